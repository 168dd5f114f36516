#pragma once
// CPU building blocks of the forward pass. All activations are fp32, row-major with the
// feature dimension contiguous. Each op computes one token's result from that token's
// inputs only, in a fixed order, so results never depend on the prompt chunk or on the
// thread count (batch invariance).
#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernels/kernels.h"
#include "backend/cpu/thread_pool.h"
#include "gguf/ggml_types.h"

namespace strata::cpu {

/// A weight matrix in its file type: `rows` rows of `cols` elements (cols contiguous),
/// `row_bytes` apart. Non-owning.
struct MatrixRef {
  GgmlType type = GgmlType::F32;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  size_t row_bytes = 0;
};

/// y[t][r] = sum_k W[r][k] x[t][k] for t < n_tok, r < W.rows, split by rows over the pool, with
/// the kernels of `kc` (kernels::matmul). x: [n_tok][ldx], y: [n_tok][ldy] (floats).
/// Bit-identical for any thread count.
void matmul(ThreadPool& pool, const kernels::KernelConfig& kc, const MatrixRef& W, const float* x, int64_t ldx,
            int64_t n_tok, float* y, int64_t ldy);

/// RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x^2) + eps) * w, over n elements.
/// x and y may alias. The mean is accumulated in double.
void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps);

/// SiLU(x) = x * sigmoid(x).
inline float silu(float x) { return x / (1.0f + __builtin_expf(-x)); }

/// gpt-oss's clamped SwiGLU of one gate value g and up value u (backend::FfnSpec::Act::SwiGluOai):
/// g' = min(g, limit), u' = clamp(u, -limit, limit), g' * sigmoid(alpha g') * (u' + 1).
inline float swiglu_oai(float g, float u, float alpha, float limit) {
  g = g < limit ? g : limit;
  u = u < -limit ? -limit : (u > limit ? limit : u);
  return g / (1.0f + __builtin_expf(-alpha * g)) * (u + 1.0f);
}

/// Rotary position embedding (Su et al. 2021, "RoFormer") of x: [n_heads][head_dim] (head_dim
/// contiguous) in place for position `pos` (tokens), the first rope.n_rot dims of each head:
/// Neox mode rotates pairs (i, i + n_rot/2) (GPT-NeoX, transformers' rotate_half), Norm mode
/// adjacent pairs (2i, 2i+1). Angle pos * inv_freq[i] in double, cos/sin times rope.attn_factor
/// (YaRN; 1 otherwise) in double, rounded to float.
void rope_apply(const backend::RopeSpec& rope, float* x, int n_heads, int head_dim, int64_t pos);

/// Causal GQA attention for one query token against a KV cache.
/// q: [n_head][head_dim]; k_cache/v_cache: [n_pos][n_head_kv * head_dim] rows for positions
/// 0..n_pos-1 (row stride `kv_stride` floats); out: [n_head][head_dim]. Query head h reads
/// KV head h / (n_head / n_head_kv). scale is usually 1/sqrt(head_dim).
/// scratch must hold min(8, n_head / n_head_kv) * n_pos floats.
/// sinks: null, or [n_head] extra logits (same units as the scaled scores), one per query head,
/// that join the softmax's max and denominator without a value row (gpt-oss attention sinks:
/// backend::AttentionWeights::sinks).
/// Uses the AVX-512 version when kc.family is avx512: FMA instead of SSE multiply-add, so
/// results differ in rounding between families, never within one.
void attention_one(const kernels::KernelConfig& kc, const float* q, const float* k_cache, const float* v_cache,
                   int64_t kv_stride, int64_t n_pos, int n_head, int n_head_kv, int head_dim, float scale, float* out,
                   float* scratch, const float* sinks = nullptr);

namespace detail {
/// AVX-512 attention_one (attention_avx512.cpp); same contract.
void attention_one_avx512(const float* q, const float* k_cache, const float* v_cache, int64_t kv_stride, int64_t n_pos,
                          int n_head, int n_head_kv, int head_dim, float scale, float* out, float* scratch,
                          const float* sinks = nullptr);
}  // namespace detail

}  // namespace strata::cpu
