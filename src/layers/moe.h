#pragma once
// Routed mixture-of-experts FFN with experts streamed through the arena:
//   router logits -> softmax -> top-k -> (renormalize) -> group tokens by expert
//   -> [cut: stream.request + wait] -> SwiGLU expert per group -> weighted sum per token.
// Shazeer et al. 2017 (sparsely-gated MoE); Qwen3 MoE block as in transformers'
// Qwen3MoeSparseMoeBlock (softmax over all experts, top-k, norm_topk_prob).
#include <cstdint>
#include <span>
#include <vector>

#include "backend/cpu/ops.h"
#include "stream/expert_stream.h"

namespace strata::layers {

/// Shape and type of one part (gate, up or down) of every expert of a layer:
/// each expert's slice is a `rows` x `cols` matrix (cols contiguous).
struct ExpertPartShape {
  GgmlType type = GgmlType::F32;
  int64_t rows = 0;
  int64_t cols = 0;
  size_t row_bytes = 0;
};

struct MoeWeights {
  cpu::MatrixRef router;  ///< ffn_gate_inp: [n_expert, n_embd] rows x cols
  ExpertPartShape gate;   ///< ffn_gate_exps slice: [n_ff_exp, n_embd]
  ExpertPartShape up;     ///< ffn_up_exps slice:   [n_ff_exp, n_embd]
  ExpertPartShape down;   ///< ffn_down_exps slice: [n_embd, n_ff_exp]
  int n_expert = 0;
  int top_k = 0;
  bool norm_topk = true;
};

/// Routing decisions of one call: [T][top_k], experts by descending probability
/// (ties: lower id first).
struct Routing {
  std::vector<int32_t> ids;     ///< [T * top_k]
  std::vector<float> probs;     ///< softmax probabilities of the selected experts
  std::vector<float> weights;   ///< mixing weights (probs, renormalized if norm_topk)
  std::vector<float> next_prob; ///< [T]: the (k+1)-th probability (0 when k = n_expert)
};

/// Read-ahead for a later layer, issued from this layer (DESIGN.md "next-layer prediction",
/// "static rank"): the later layer's router applied to this layer's MoE input predicts its
/// experts; they are queued most-predicting-tokens first, with no cap; then the layer's
/// static rank (most popular first) fills in. Never changes results, only what is read when.
struct ReadAhead {
  int layer = -1;                          ///< layer to read ahead for; -1 = none
  const cpu::MatrixRef* router = nullptr;  ///< that layer's router [n_expert, n_embd]; null = no prediction
  int n_expert = 0;
  int top_k = 0;
  int min_tokens = 1;                      ///< queue only experts predicted by >= this many tokens
  std::span<const int32_t> static_rank;    ///< that layer's experts, most popular first (may be empty)
  int64_t static_count = 0;                ///< how many of static_rank to queue after the predicted ones
  std::vector<int32_t>* predicted = nullptr;  ///< out: predicted ids per token [T][top_k], for recall
};

/// Predicts and queues read-aheads as `ra` says, from MoE input h: [T][n_embd].
void read_ahead(cpu::ThreadPool& pool, const cpu::kernels::KernelConfig& kc, stream::ExpertStream& stream, const ReadAhead& ra, const float* h,
                int64_t n_embd, int64_t T);

/// Selects experts for T tokens from router logits [T][n_expert] (softmaxed in place).
void route_topk(float* logits, int64_t T, int n_expert, int top_k, bool norm_topk, Routing& r);

/// Runs the MoE FFN of `layer` for T tokens. h: [T][n_embd] normed input; out: [T][n_embd]
/// (overwritten). Experts come from `stream`; each token's expert outputs are summed in
/// its top-k order, so the result does not depend on which tokens share the chunk.
/// `routing` (optional) receives the decisions. `expert_seconds` (optional) accumulates time
/// in expert matmuls.
/// `ahead` (optional) is issued right after this layer's own requests, so the IO threads read
/// the next layer's experts while this layer computes. Experts already resident are computed
/// first, while the misses arrive.
void moe_block(cpu::ThreadPool& pool, const cpu::kernels::KernelConfig& kc, stream::ExpertStream& stream, int layer, const MoeWeights& w, const float* h,
               int64_t n_embd, int64_t T, float* out, Routing* routing = nullptr, double* expert_seconds = nullptr,
               const ReadAhead* ahead = nullptr);

}  // namespace strata::layers
