#pragma once
// Grouped-query self-attention with per-head q/k RMSNorm and rotary embedding, shared by
// the architectures that use it (qwen3moe; qwen3next's gated full-attention layers).
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
};

/// Runs attention for T consecutive tokens at positions [pos0, pos0 + T).
/// h: [T][n_embd] normed input; out: [T][n_embd] (overwritten).
/// k_cache, v_cache: [n_ctx][n_head_kv * head_dim]; rows pos0..pos0+T-1 are written.
/// Causal: token t attends to positions 0..pos0+t.
void attention_block(cpu::ThreadPool& pool, const AttentionWeights& w, const AttentionShape& s, const float* h,
                     int64_t n_embd, int64_t T, int64_t pos0, float* k_cache, float* v_cache, float* out);

}  // namespace strata::layers
