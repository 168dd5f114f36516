#pragma once
// Grouped-query self-attention with per-head q/k RMSNorm and rotary embedding, shared by
// the architectures that use it (qwen3moe; qwen3next's gated full-attention layers).
//
// Gated variant (qwen3next, AttentionShape::q_gate): attn_q produces, per head, the query
// and an output gate side by side, [q(head_dim), gate(head_dim)], and the attention output
// is multiplied by sigmoid(gate) before attn_output (transformers Qwen3NextAttention:
// `q_proj(h).view(..., -1, head_dim * 2).chunk(2, -1)`, `out * sigmoid(gate)`; llama.cpp
// qwen3next build_layer_attn views the same layout). Partial rotary embedding comes from
// the Rope itself (Rope::n_rot < head_dim rotates only the first n_rot dims).
#include <cstdint>

#include "backend/cpu/ops.h"

namespace strata::layers {

struct AttentionWeights {
  cpu::MatrixRef wq;               ///< attn_q: [n_head * head_dim (x2 if gated), n_embd] rows x cols
  cpu::MatrixRef wk;               ///< attn_k: [n_head_kv * head_dim, n_embd]
  cpu::MatrixRef wv;               ///< attn_v: [n_head_kv * head_dim, n_embd]
  cpu::MatrixRef wo;               ///< attn_output: [n_embd, n_head * head_dim]
  const float* q_norm = nullptr;   ///< attn_q_norm [head_dim], or null
  const float* k_norm = nullptr;   ///< attn_k_norm [head_dim], or null
};

struct AttentionShape {
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;
  float rms_eps = 1e-6f;
  const cpu::Rope* rope = nullptr;
  /// attn_q rows are [n_head][q(head_dim), gate(head_dim)] and the output is gated by
  /// sigmoid(gate) per element (qwen3next). False: attn_q is [n_head][head_dim] (qwen3moe).
  bool q_gate = false;
};

/// Runs attention for T consecutive tokens at positions [pos0, pos0 + T).
/// h: [T][n_embd] normed input; out: [T][n_embd] (overwritten).
/// k_cache, v_cache: [n_ctx][n_head_kv * head_dim]; rows pos0..pos0+T-1 are written.
/// Causal: token t attends to positions 0..pos0+t.
void attention_block(cpu::ThreadPool& pool, const cpu::kernels::KernelConfig& kc, const AttentionWeights& w, const AttentionShape& s, const float* h,
                     int64_t n_embd, int64_t T, int64_t pos0, float* k_cache, float* v_cache, float* out);

}  // namespace strata::layers
