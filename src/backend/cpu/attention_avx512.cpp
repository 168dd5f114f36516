// AVX-512 attention for one query token (see attention_one in ops.h). Chosen when the kernel
// family (KernelConfig) is avx512. The query heads that share a KV head are processed together, so
// each K/V row is read once per group instead of once per head (attention over a long
// context is bound by reading the KV cache). Every position's score is one fixed sequence of FMAs over head_dim
// (16 lanes, then one reduction tree), and the weighted V sum adds positions in order, so a
// query's result does not depend on how many other queries, positions or threads there are.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cpu/kernels/simd_intrin.h"
#include "backend/cpu/ops.h"

namespace strata::cpu::detail {

namespace {

/// q . k over n dims: lane l accumulates dims l, l+16, ... in order (masked tail), then hsum16.
inline float dot(const float* q, const float* k, int n) {
  __m512 acc = _mm512_setzero_ps();
  int d = 0;
  for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
  if (d < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - d)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d), _mm512_maskz_loadu_ps(m, k + d), acc);
  }
  return simd_hsum16(acc);
}

/// G query heads sharing one KV head: each K and V row is read from memory once for all G.
/// Per head the arithmetic is exactly that of one head alone (same FMA sequence per score,
/// same position order per output lane), so grouping never changes a result.
template <int G>
void group_heads(const float* q, const float* k, const float* v, int64_t kv_stride, int64_t n_pos, int head_dim,
                 float scale, float* out, float* scratch, const float* sinks) {
  float mx[G], inv[G];
  for (int j = 0; j < G; ++j) mx[j] = -INFINITY;
  for (int64_t p = 0; p < n_pos; ++p) {
    const float* kp = k + p * kv_stride;
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
      const float s = dot(q + int64_t(j) * head_dim, kp, head_dim) * scale;
      scratch[int64_t(j) * n_pos + p] = s;
      mx[j] = std::max(mx[j], s);
    }
  }
  for (int j = 0; j < G; ++j) {
    float* sc = scratch + int64_t(j) * n_pos;
    if (sinks) mx[j] = std::max(mx[j], sinks[j]);
    double sum = 0;
    for (int64_t p = 0; p < n_pos; ++p) {
      sc[p] = std::exp(sc[p] - mx[j]);
      sum += sc[p];
    }
    if (sinks) sum += std::exp(sinks[j] - mx[j]);  // the sink's share of the denominator
    inv[j] = float(1.0 / sum);
  }
  // out[j][d] = sum_p (w_jp * inv_j) * v_p[d], positions in order, 32 dims per pass
  for (int d = 0; d < head_dim; d += 32) {
    const int left = head_dim - d;
    const __mmask16 m0 = static_cast<__mmask16>((1u << std::min(16, left)) - 1u);
    const __mmask16 m1 = static_cast<__mmask16>((1u << std::min(16, std::max(0, left - 16))) - 1u);
    __m512 a0[G], a1[G];
    for (int j = 0; j < G; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < n_pos; ++p) {
      const float* vp = v + p * kv_stride + d;
      const __m512 v0 = _mm512_maskz_loadu_ps(m0, vp), v1 = _mm512_maskz_loadu_ps(m1, vp + 16);
#pragma GCC unroll 8
      for (int j = 0; j < G; ++j) {
        const __m512 w = _mm512_set1_ps(scratch[int64_t(j) * n_pos + p] * inv[j]);
        a0[j] = _mm512_fmadd_ps(w, v0, a0[j]);
        a1[j] = _mm512_fmadd_ps(w, v1, a1[j]);
      }
    }
    for (int j = 0; j < G; ++j) {
      _mm512_mask_storeu_ps(out + int64_t(j) * head_dim + d, m0, a0[j]);
      _mm512_mask_storeu_ps(out + int64_t(j) * head_dim + d + 16, m1, a1[j]);
    }
  }
}

}  // namespace

void attention_one_avx512(const float* q, const float* k_cache, const float* v_cache, int64_t kv_stride, int64_t n_pos,
                          int n_head, int n_head_kv, int head_dim, float scale, float* out, float* scratch,
                          const float* sinks) {
  const int group = n_head / n_head_kv;
  for (int g = 0; g < n_head_kv; ++g) {
    const float* k = k_cache + int64_t(g) * head_dim;
    const float* v = v_cache + int64_t(g) * head_dim;
    for (int h0 = 0; h0 < group; h0 += 8) {
      const int n = std::min(8, group - h0);
      const int64_t h = int64_t(g) * group + h0;
      const float* qh = q + h * head_dim;
      float* oh = out + h * head_dim;
      const float* sh = sinks ? sinks + h : nullptr;
      switch (n) {
        case 8: group_heads<8>(qh, k, v, kv_stride, n_pos, head_dim, scale, oh, scratch, sh); break;
        case 7: group_heads<7>(qh, k, v, kv_stride, n_pos, head_dim, scale, oh, scratch, sh); break;
        case 6: group_heads<6>(qh, k, v, kv_stride, n_pos, head_dim, scale, oh, scratch, sh); break;
        case 5: group_heads<5>(qh, k, v, kv_stride, n_pos, head_dim, scale, oh, scratch, sh); break;
        case 4: group_heads<4>(qh, k, v, kv_stride, n_pos, head_dim, scale, oh, scratch, sh); break;
        case 3: group_heads<3>(qh, k, v, kv_stride, n_pos, head_dim, scale, oh, scratch, sh); break;
        case 2: group_heads<2>(qh, k, v, kv_stride, n_pos, head_dim, scale, oh, scratch, sh); break;
        default: group_heads<1>(qh, k, v, kv_stride, n_pos, head_dim, scale, oh, scratch, sh); break;
      }
    }
  }
}

}  // namespace strata::cpu::detail
