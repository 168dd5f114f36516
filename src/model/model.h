#pragma once
// The model interface the engine drives, and the registry of architectures.
// Each architecture lives in its own file (qwen3moe.cpp, ...) and registers itself in
// the table in model.cpp: hyper-parameters from GGUF keys, tensors bound by name with
// their shapes, and one forward function that runs a prompt chunk through all layers.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/cpu/thread_pool.h"
#include "gguf/gguf.h"
#include "layers/moe.h"
#include "model/hparams.h"
#include "stream/expert_stream.h"

namespace strata::model {

/// Per-sequence state: the KV cache of attention layers (and, for hybrid models, the
/// recurrent state of linear-attention layers). Positions are token indices.
struct SequenceState {
  int64_t n_past = 0;  ///< tokens already in the state
  int64_t n_ctx = 0;   ///< capacity in tokens
  /// Per layer: K and V rows [n_ctx][n_head_kv * head_dim] (head_dim contiguous); empty for
  /// layers without attention.
  std::vector<std::vector<float>> k, v;
  /// Per layer: recurrent state (conv and SSM) of linear-attention layers; empty otherwise.
  std::vector<std::vector<float>> conv, ssm;
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
  bool predict = true;   ///< --predict: next layer's router on this layer's MoE input
  int predict_min = 1;   ///< --predict-min: queue experts predicted by at least this many tokens
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

/// What the engine lends a model for one forward call.
struct ForwardContext {
  cpu::ThreadPool& pool;
  stream::ExpertStream& stream;
  RoutingTrace* trace = nullptr;  ///< when set, the MoE layers append their routing
  ForwardTimes* times = nullptr;
  ReadAheadOptions ahead;
  PredictionStats* prediction = nullptr;  ///< when set, recall is accumulated here
  cpu::kernels::KernelConfig kernels;     ///< the CPU kernels every matmul and attention runs (engine's)
};

/// Which positions of a forward call produce logits.
enum class LogitsMode { None, Last, All };

class Model {
 public:
  virtual ~Model() = default;
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

  /// Runs `ids` at positions [st.n_past, st.n_past + ids.size()) through every layer and
  /// advances st.n_past. logits: [n_rows][n_vocab] for the rows `mode` asks for (1 for
  /// Last, ids.size() for All). Preconditions: ids in [0, n_vocab), room in st.
  /// Per-token results do not depend on how a prompt is split into calls.
  virtual void forward(ForwardContext& ctx, SequenceState& st, std::span<const int32_t> ids, LogitsMode mode,
                       std::vector<float>& logits) = 0;

 protected:
  /// Appends one MoE layer's routing of a forward call to `trace` (no-op when null).
  void record_routing(RoutingTrace* trace, int layer, const layers::Routing& r, int top_k) const;

  /// The read-ahead to issue for `layer` (n_layer or more: none) from T tokens: predicted with
  /// `router` when prediction is on, else (and always for layer 0) the static rank fills in up
  /// to min(top-k x T, experts). `predicted` receives per-token predictions for recall.
  layers::ReadAhead plan_read_ahead(const ForwardContext& ctx, int layer, const cpu::MatrixRef* router, int64_t T,
                                    std::vector<int32_t>* predicted) const;
  /// Adds layer `layer`'s recall (its routing vs. the earlier prediction) to ctx.prediction.
  void score_prediction(ForwardContext& ctx, int layer, const layers::Routing& r,
                        const std::vector<int32_t>& predicted) const;

  /// Read-ahead for layer 0, issued before any compute: `router0` on the token embeddings
  /// x: [T][n_embd] normed with `norm0` (layer 0's pre-MoE norm weights). `scratch` holds
  /// T x n_embd floats. `pred` receives the per-token prediction for layer 0.
  void read_ahead_first(ForwardContext& ctx, const cpu::MatrixRef& router0, const float* norm0, const float* x,
                        int64_t T, float* scratch, std::vector<int32_t>& pred) const;

  /// The routed-MoE step every MoE architecture shares: read-ahead for layer+1 (predicted
  /// with `next_router`, null for the last layer), the MoE of `layer` with experts from the
  /// stream, recall scoring and the routing trace. h: [T][n_embd] normed input; out:
  /// [T][n_embd] (overwritten). `pred` carries the prediction for `layer` in and for layer+1 out.
  void moe_step(ForwardContext& ctx, int layer, const layers::MoeWeights& w, const cpu::MatrixRef* next_router,
                const float* h, int64_t T, float* out, std::vector<int32_t>& pred) const;

  /// h[t] = RMSNorm(x[t]) * w for T rows of n_embd (rows split over the pool).
  void rms_norm_rows(cpu::ThreadPool& pool, const float* x, const float* w, int64_t T, float* h) const;
  /// The residual add x[t] += o[t] for T rows of n_embd.
  void add_rows(float* x, const float* o, int64_t T) const;

  /// Token embeddings: x[t] = dequant(tok_embd row ids[t]); x: [T][n_embd].
  void embed(const cpu::MatrixRef& tok_embd, std::span<const int32_t> ids, float* x) const;

  /// Final RMSNorm and the output head for the rows `mode` asks for: logits [rows][n_vocab].
  /// x: [T][n_embd] residual stream; scratch: T x n_embd floats.
  void output_head(ForwardContext& ctx, const float* x, int64_t T, LogitsMode mode, const float* norm,
                   const cpu::MatrixRef& head, float* scratch, std::vector<float>& logits) const;

  ModelHParams hp_;
  std::vector<stream::LayerExperts> experts_;
  uint64_t dense_bytes_ = 0;
};

/// Load-time settings that change numerics (default: exact fp32 semantics).
struct LoadOptions {
  /// Round RoPE inverse frequencies to bf16, as transformers does for a checkpoint loaded in
  /// bf16. Only for parity tests against such references; never on by default.
  bool rope_freqs_bf16 = false;
};

/// Loads the architecture named by general.architecture. Throws ModelError for an
/// unsupported architecture (naming the supported ones) or missing/mis-shaped tensors.
std::unique_ptr<Model> load_model(const gguf::File& gguf, const LoadOptions& opts = {});

/// Architectures this build supports, e.g. {"qwen3moe"}.
std::vector<std::string> supported_architectures();

}  // namespace strata::model
