#pragma once
// Grouped-query self-attention with per-head q/k RMSNorm and rotary embedding, shared by
// the architectures that use it (qwen3moe; qwen3next's gated full-attention layers).
//
// Gated variant (qwen3next, AttentionShape::q_gate): attn_q produces, per head, the query
// and an output gate side by side, [q(head_dim), gate(head_dim)], and the attention output
// is multiplied by sigmoid(gate) before attn_output (transformers Qwen3NextAttention:
// `q_proj(h).view(..., -1, head_dim * 2).chunk(2, -1)`, `out * sigmoid(gate)`; llama.cpp
// qwen3next build_layer_attn views the same layout). Partial rotary embedding comes from
// the RopeSpec itself (n_rot < head_dim rotates only the first n_rot dims).
//
// gpt-oss adds biases to the four projections and one "sink" logit per query head that joins
// each softmax's denominator (backend::AttentionWeights::sinks; transformers GptOssAttention),
// and attends over a window of the last `window` positions on its sliding layers.
#include <cstdint>

#include "backend/backend.h"
#include "backend/cpu/ops.h"

namespace strata::cpu {

struct AttentionWeights {
  MatrixRef wq;                   ///< attn_q: [n_head * head_dim (x2 if gated), n_embd] rows x cols
  MatrixRef wk;                   ///< attn_k: [n_head_kv * head_dim, n_embd]
  MatrixRef wv;                   ///< attn_v: [n_head_kv * head_dim, n_embd]
  MatrixRef wo;                   ///< attn_output: [n_embd, n_head * head_dim]
  const float* q_norm = nullptr;  ///< attn_q_norm [head_dim] ([n_head * head_dim] if qk_norm_full), or null
  const float* k_norm = nullptr;  ///< attn_k_norm [head_dim] ([n_head_kv * head_dim] if qk_norm_full), or null
  const float* bq = nullptr;      ///< attn_q.bias [wq.rows], or null (added before the q norm and RoPE)
  const float* bk = nullptr;      ///< attn_k.bias [n_head_kv * head_dim], or null
  const float* bv = nullptr;      ///< attn_v.bias [n_head_kv * head_dim], or null
  const float* bo = nullptr;      ///< attn_output.bias [n_embd], or null
  const float* sinks = nullptr;   ///< attn_sinks [n_head] (extra softmax logit per head), or null
};

/// The layer's shape, RoPE, gating and window: backend::AttentionSpec (backend/backend.h).
using AttentionShape = backend::AttentionSpec;

/// Runs attention for T consecutive tokens at positions [pos0, pos0 + T).
/// h: [T][n_embd] normed input; out: [T][n_embd] (overwritten).
/// k_cache, v_cache: [n_ctx][n_head_kv * head_dim]; rows pos0..pos0+T-1 are written.
/// Causal: token t attends to positions 0..pos0+t, or the last s.window of them when s.window > 0.
void attention_block(ThreadPool& pool, const kernels::KernelConfig& kc, const AttentionWeights& w,
                     const AttentionShape& s, const float* h, int64_t n_embd, int64_t T, int64_t pos0, float* k_cache,
                     float* v_cache, float* out);

/// Multi-head latent attention (backend::MlaSpec has the formulas) for T consecutive tokens at
/// positions [pos0, pos0 + T). h: [T][n_embd]; cache: [n_ctx][kv_lora_rank + n_rot], rows
/// pos0..pos0+T-1 written ([normed latent c | rotated kpe]); out: [T][n_embd] (overwritten).
/// Scores and the latent context use attention_one with one shared "KV head" of
/// kv_lora_rank + n_rot dims (keys = the cache rows, values = their first kv_lora_rank dims).
struct MlaWeights {
  MatrixRef wq_a, wq_b, wq, wkv_a, wk_b, wv_b, wo;  ///< as backend::MlaWeights (wk_b, wv_b: all heads' rows)
  const float* q_a_norm = nullptr;
  const float* kv_a_norm = nullptr;
};
void mla_attention_block(ThreadPool& pool, const kernels::KernelConfig& kc, const MlaWeights& w,
                         const backend::MlaSpec& s, const float* h, int64_t n_embd, int64_t T, int64_t pos0,
                         float* cache, float* out);

}  // namespace strata::cpu
