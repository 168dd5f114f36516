#pragma once
// The model interface the engine drives, and the registry of architectures.
// Each architecture lives in its own file (qwen3moe.cpp, ...) and registers itself in
// the table in model.cpp: hyper-parameters from GGUF keys, tensors bound by name with
// their shapes, and one forward function that runs a prompt chunk through all layers.
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "gguf/gguf.h"
#include "model/hparams.h"
#include "stream/expert_stream.h"

namespace strata::parallel {
class ExpertParallel;
}

namespace strata::model {

/// One per-layer state tensor of a sequence in its backend's memory (fp32). Copying a
/// StateBuf copies the bytes (a snapshot of the sequence), through the backend.
class StateBuf {
 public:
  StateBuf() = default;
  /// `floats` zeroed floats from `be` (BufferRole::State).
  StateBuf(backend::Backend& be, int64_t floats);
  StateBuf(const StateBuf& o);
  StateBuf& operator=(const StateBuf& o);
  StateBuf(StateBuf&&) noexcept = default;
  StateBuf& operator=(StateBuf&&) noexcept = default;
  /// Floats held (0 for a layer without this kind of state).
  size_t size() const { return buf_ ? buf_->bytes() / sizeof(float) : 0; }
  bool empty() const { return size() == 0; }
  /// Sets every float to 0 (a fresh recurrent state).
  void zero();
  /// The floats as rows of `cols` (size() / cols rows).
  backend::Tensor tensor(int64_t cols) const;

 private:
  backend::Backend* be_ = nullptr;
  std::unique_ptr<backend::Buffer> buf_;
};

/// Per-sequence state: the KV cache of attention layers (and, for hybrid models, the
/// recurrent state of linear-attention layers), in the backend's memory. Positions are token
/// indices. Copyable (a snapshot).
struct SequenceState {
  int64_t n_past = 0;  ///< tokens already in the state
  int64_t n_ctx = 0;   ///< capacity in tokens
  /// Per layer: K and V rows [n_ctx][n_head_kv * head_dim] (head_dim contiguous); empty for
  /// layers without attention.
  std::vector<StateBuf> k, v;
  /// Per layer: recurrent state (conv and SSM) of linear-attention layers; empty otherwise.
  std::vector<StateBuf> conv, ssm;
};

/// Routing record of one forward call, for parity checks against a reference:
/// ids[layer][token] = selected experts by descending router probability; probs the same
/// order (softmax probabilities before renormalization).
struct RoutingTrace {
  std::vector<std::vector<std::vector<int32_t>>> ids;
  std::vector<std::vector<std::vector<float>>> probs;
  /// next_prob[layer][token]: the largest probability NOT selected (the (k+1)-th), so a
  /// parity check can tell ties from real differences.
  std::vector<std::vector<float>> next_prob;
};

/// Time split of forward calls, in seconds (accumulated).
struct ForwardTimes {
  double host_s = 0;     ///< embedding, gathers, routing bookkeeping
  double compute_s = 0;  ///< matmuls, attention, norms
  double expert_s = 0;   ///< expert matmuls (part of compute)
};

/// Read-ahead settings of a run (DESIGN.md: next-layer prediction, static rank).
struct ReadAheadOptions {
  bool predict = true;  ///< --predict: next layer's router on this layer's MoE input
  int predict_min = 1;  ///< --predict-min: queue experts predicted by at least this many tokens
  int layers = 1;       ///< --read-ahead-layers: 1 = the next layer, 2 = also the one after it
  /// Per layer, expert ids by descending popularity (`strata profile`); null or empty rows =
  /// unknown. Used for layer 0 and wherever no prediction is made.
  const std::vector<std::vector<int32_t>>* static_rank = nullptr;
};

/// Prediction recall per layer: of the (token, expert) picks of layer l, how many the
/// prediction made one layer earlier (for layer 0: from the token embeddings) also picked.
/// A property of the model and the input; independent of arena size and IO timing.
struct PredictionStats {
  std::vector<uint64_t> picks;      ///< [n_layer] picks that had a prediction
  std::vector<uint64_t> predicted;  ///< [n_layer] of those, predicted
};

/// Cache-conditional routing (--moce-bonus) counters, in (layer, expert) lookups as StreamStats.
struct MoceStats {
  /// (token, k) picks where the bonus chose a resident expert the exact routing did not pick.
  uint64_t substituted = 0;
  /// Experts a layer's exact routing needed that were not resident when it routed and that the
  /// bonus routing did not need: urgent reads saved (an upper bound: one of them might have been
  /// in flight as a read-ahead and counted a hit).
  uint64_t misses_avoided = 0;
};

/// --profile: host wall time per named stage of the forward pass (model::Step), summed over
/// calls (seconds). On the CPU backend every call is synchronous, so this is the stage's compute;
/// on an asynchronous backend (CUDA) it is the time to issue the calls, plus any synchronization
/// inside them (downloads of router logits and outputs wait for the queue).
struct StageProfile {
  enum Stage {
    Embed,
    Norm,
    Attention,      ///< GQA attention layers (q/k/v/o matmuls, RoPE, softmax over the cache)
    MlaAttention,   ///< multi-head latent attention layers (deepseek2)
    GatedDeltaNet,  ///< linear-attention layers (qwen3next, qwen35moe)
    DenseFfn,       ///< dense FFN and shared experts
    Router,         ///< router logits to the host and top-k selection (with MoCE: both routings)
    StreamRequest,  ///< ExpertStream::request: pins, queues the misses (blocks only if every slot is busy)
    ReadAhead,      ///< the next layer's prediction (its router) and the prefetch queueing
    ExpertMatmuls,  ///< the routed experts' FFNs, without the waits
    ExpertWait,     ///< blocked in ExpertStream::wait for a read to land (exposed wait)
    MoeCombine,     ///< release and the weighted sum in top-k order
    Residual,
    OutputHead,  ///< final norm, output matmul, logits download
    kCount
  };
  static const char* name(int s) {
    static const char* const names[kCount] = {"embed",           "norm",           "attention",   "mla attention",
                                              "gated delta net", "dense ffn",      "router",      "stream request",
                                              "read-ahead",      "expert matmuls", "expert wait", "moe combine",
                                              "residual",        "output head"};
    return s >= 0 && s < kCount ? names[s] : "?";
  }
  double seconds[kCount] = {};
  uint64_t calls[kCount] = {};
  /// Per stage, what ran in the backend's host-thread loops (backend::LoopProfile; zero on a
  /// backend without them): the stage's time outside them runs on one thread.
  backend::LoopProfile loops[kCount];

  /// One call of stage s that took `secs` seconds, of which `in_loops` ran in loops.
  void add(Stage s, double secs, const backend::LoopProfile& in_loops = {}) {
    seconds[s] += secs;
    ++calls[s];
    loops[s].add(in_loops);
  }
};

class Dumper;
class BoundWeights;
struct MoeLayer;

/// What the engine lends a model for one forward call.
struct ForwardContext {
  backend::Backend& be;
  stream::ExpertStream& stream;
  RoutingTrace* trace = nullptr;  ///< when set, the MoE layers append their routing
  ForwardTimes* times = nullptr;
  ReadAheadOptions ahead;
  PredictionStats* prediction = nullptr;  ///< when set, recall is accumulated here
  Dumper* dump = nullptr;                 ///< when set, named intermediates are written (--dump)
  /// MoCE: the residency bonus of this call's selection (backend::ResidencyBonus; 0 = exact
  /// routing) and where its counters go (may be null).
  float moce_bonus = 0;
  MoceStats* moce = nullptr;
  StageProfile* profile = nullptr;  ///< when set (--profile), each stage's host time is added here
  /// When set (--ep-ranks): the routed experts are partitioned over its ranks, each with its own
  /// stream (`stream` is then unused by the MoE step); docs/expert-parallel.md.
  parallel::ExpertParallel* ep = nullptr;
  /// When set and true, the forward stops before the next MoE layer with model::Interrupted
  /// (SIGINT in `run`, a server shutdown); the states' n_past is not advanced.
  const std::atomic<bool>* interrupt = nullptr;
};

/// Thrown by a forward whose ForwardContext::interrupt was set: it stopped between layers, the
/// call's tokens are not done (n_past unchanged; their KV rows of the earlier layers are
/// overwritten by the next call at the same positions). Recurrent state may be partly updated,
/// so an interrupted sequence is not to be continued.
struct Interrupted : std::runtime_error {
  explicit Interrupted(int layer);
  int layer;  ///< the layer the forward stopped before
};

/// Which positions of a forward call produce logits.
enum class LogitsMode { None, Last, All };

/// One sequence's part of a forward call: `ids` run at positions [state->n_past, +ids.size())
/// and `logits` receives [rows][n_vocab] for the rows `mode` asks for (1 for Last, ids.size()
/// for All; untouched for None).
struct SeqInput {
  SequenceState* state = nullptr;
  std::span<const int32_t> ids;
  LogitsMode mode = LogitsMode::Last;
  std::vector<float>* logits = nullptr;
};

class Model {
 public:
  virtual ~Model();
  const ModelHParams& hparams() const { return hp_; }
  /// Where each layer's experts live in the file (for the stream). Layers without routed
  /// experts have n_expert = 0.
  const std::vector<stream::LayerExperts>& expert_layout() const { return experts_; }
  /// Bytes of resident (dense) weights.
  uint64_t dense_bytes() const { return dense_bytes_; }

  /// A fresh sequence with room for n_ctx tokens.
  virtual SequenceState new_state(int64_t n_ctx) const = 0;
  /// Bytes new_state(n_ctx) allocates.
  virtual uint64_t state_bytes(int64_t n_ctx) const = 0;

  /// Runs a batch of sequences through every layer (one forward: the tokens of all sequences
  /// share each matmul and each layer's expert reads; attention and recurrent state stay per
  /// sequence) and advances each state's n_past. Preconditions: ids in [0, n_vocab), room in
  /// each state, no state twice. Per-token results do not depend on how tokens are split into
  /// calls or batched with other sequences.
  virtual void forward(ForwardContext& ctx, std::span<SeqInput> batch) = 0;
  /// The one-sequence form: runs `ids` after st's past tokens; logits as SeqInput says.
  void forward(ForwardContext& ctx, SequenceState& st, std::span<const int32_t> ids, LogitsMode mode,
               std::vector<float>& logits);

 protected:
  /// Binds token_embd, output_norm and the output head (token_embd when output.weight is absent:
  /// tied embeddings) into tok_embd_, output_norm_, output_.
  void bind_io(const BoundWeights& w);
  /// Layer `layer`'s attention weights: blk.N.attn_{q,k,v,output}.weight, and whichever of
  /// attn_{q,k}_norm.weight, attn_{q,k,v,output}.bias and attn_sinks.weight the architecture's
  /// table lists.
  backend::AttentionWeights bind_attention(const BoundWeights& w, int layer) const;
  /// GQA attention from the common hyper-parameters (heads, head dim, norm epsilon) with `rope`.
  backend::AttentionSpec attention_spec(const backend::RopeSpec* rope) const;
  /// Softmax over all experts, top-k, renormalized as norm_topk says (qwen3moe, qwen3next).
  backend::RouterSpec softmax_router() const;

  /// Binds layer `layer`'s router (blk.N.ffn_gate_inp) and routed experts (ffn_{gate,up,down}_exps,
  /// left on disk) and records where the experts live for the stream (experts_[layer]). The
  /// router's and experts' biases (ffn_gate_inp.bias, ffn_*_exps.bias) are bound when the
  /// architecture's table lists them (resident), else left empty.
  MoeLayer bind_moe(const BoundWeights& w, int layer, const backend::RouterSpec& spec);

  ModelHParams hp_;
  std::vector<stream::LayerExperts> experts_;
  uint64_t dense_bytes_ = 0;
  backend::Backend* be_ = nullptr;                   ///< where the weights and the sequences' state live
  backend::Tensor tok_embd_, output_norm_, output_;  ///< set by bind_io

 private:
  friend std::unique_ptr<Model> load_model(const gguf::File&, backend::Backend&, const struct LoadOptions&);
  std::unique_ptr<const BoundWeights> weights_;  ///< the resident tensors the backend views point into
};

/// Load-time settings that change numerics (default: exact fp32 semantics).
struct LoadOptions {
  /// Round RoPE inverse frequencies to bf16, as transformers does for a checkpoint loaded in
  /// bf16. Only for parity tests against such references; never on by default.
  bool rope_freqs_bf16 = false;
};

/// Loads the architecture that handles `gguf` (model/arch.h) onto backend `be`, which must
/// outlive the model. Throws ModelError for an unsupported architecture (naming the supported
/// ones), missing or mis-shaped tensors, unsupported types or key values.
std::unique_ptr<Model> load_model(const gguf::File& gguf, backend::Backend& be, const LoadOptions& opts = {});

/// Architectures this build supports, e.g. {"qwen3moe", "qwen3next"}.
std::vector<std::string> supported_architectures();

}  // namespace strata::model
