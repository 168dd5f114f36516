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

/// At least n floats of v (GrowBuffer: grown, never shrunk, not zero-filled), for a block's
/// activations that are written before they are read: keep v thread_local in the caller, so
/// that a chunk neither allocates nor zero-fills fresh memory on the calling thread alone, a
/// serial part of prefill that grew with the thread count (docs/kernels.md, "Serial parts of
/// prefill").
inline float* scratch_floats(GrowBuffer<float>& v, int64_t n) { return v.grow(size_t(n)); }

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

/// A tile of attention queries that share one KV head: `n_head` query heads (of one GQA group)
/// for `n_tok` consecutive tokens. Query row (i, j) is at q + i * q_stride + j * head_dim
/// (floats) and attends to positions first[i]..last[i] (inclusive; both non-decreasing in i) of
/// k and v (rows kv_stride floats apart, already offset to the KV head); its result goes to
/// out + i * out_stride + j * head_dim. sinks: null or [n_head] (attention_one's).
struct AttentionTile {
  const float* q = nullptr;
  int64_t q_stride = 0;
  int n_tok = 0, n_head = 0, head_dim = 0;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t kv_stride = 0;
  const int64_t* first = nullptr;  ///< [n_tok]
  const int64_t* last = nullptr;   ///< [n_tok]
  float scale = 1.0f;
  float* out = nullptr;
  int64_t out_stride = 0;
  const float* sinks = nullptr;
};

/// Floats of scratch attention_tile needs for `t`.
int64_t attention_tile_scratch(const AttentionTile& t);

/// Attention of every query row of `t`. Each row's result has exactly the bits attention_one
/// gives it alone (with kc's family), whatever the tile: with the avx2 family and head_dim % 8
/// == 0 the tile runs in flash-attention order (attention_avx2.cpp: the tile's queries pass
/// over blocks of 32 K rows, then of V rows, so each row is read once per tile); otherwise
/// attention_one per token.
void attention_tile(const kernels::KernelConfig& kc, const AttentionTile& t, float* scratch);

namespace detail {
/// AVX2 attention_tile (attention_avx2.cpp); precondition head_dim % 8 == 0.
void attention_tile_avx2(const AttentionTile& t, float* scratch);
/// AVX-512 attention_one (attention_avx512.cpp); same contract.
void attention_one_avx512(const float* q, const float* k_cache, const float* v_cache, int64_t kv_stride, int64_t n_pos,
                          int n_head, int n_head_kv, int head_dim, float scale, float* out, float* scratch,
                          const float* sinks = nullptr);
}  // namespace detail

}  // namespace strata::cpu
