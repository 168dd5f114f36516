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

/// What the engine lends a model for one forward call.
struct ForwardContext {
  cpu::ThreadPool& pool;
  stream::ExpertStream& stream;
  RoutingTrace* trace = nullptr;  ///< when set, the MoE layers append their routing
  ForwardTimes* times = nullptr;
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
