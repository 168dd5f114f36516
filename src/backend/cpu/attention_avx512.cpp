// AVX-512 attention for one query token (see attention_one in ops.h). Chosen when the quant
// kernel family is avx512. Every position's score is one fixed sequence of FMAs over head_dim
// (16 lanes, then one reduction tree), and the weighted V sum adds positions in order, so a
// query's result does not depend on how many other queries, positions or threads there are.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cpu/ops.h"
#include "quant/simd_intrin.h"

namespace strata::cpu::detail {

namespace {

inline float hsum16(__m512 v) {
  __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

/// q . k over n dims: lane l accumulates dims l, l+16, ... in order (masked tail), then hsum16.
inline float dot(const float* q, const float* k, int n) {
  __m512 acc = _mm512_setzero_ps();
  int d = 0;
  for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
  if (d < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - d)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d), _mm512_maskz_loadu_ps(m, k + d), acc);
  }
  return hsum16(acc);
}

}  // namespace

void attention_one_avx512(const float* q, const float* k_cache, const float* v_cache, int64_t kv_stride, int64_t n_pos,
                          int n_head, int n_head_kv, int head_dim, float scale, float* out, float* scratch) {
  const int group = n_head / n_head_kv;
  for (int h = 0; h < n_head; ++h) {
    const float* qh = q + int64_t(h) * head_dim;
    const int64_t kv_off = int64_t(h / group) * head_dim;
    float mx = -INFINITY;
    int64_t p = 0;
    // four positions at a time: independent FMA chains, each position's sequence unchanged
    for (; p + 4 <= n_pos; p += 4) {
      const float* k0 = k_cache + p * kv_stride + kv_off;
      const float s0 = dot(qh, k0, head_dim) * scale;
      const float s1 = dot(qh, k0 + kv_stride, head_dim) * scale;
      const float s2 = dot(qh, k0 + 2 * kv_stride, head_dim) * scale;
      const float s3 = dot(qh, k0 + 3 * kv_stride, head_dim) * scale;
      scratch[p] = s0;
      scratch[p + 1] = s1;
      scratch[p + 2] = s2;
      scratch[p + 3] = s3;
      mx = std::max(mx, std::max(std::max(s0, s1), std::max(s2, s3)));
    }
    for (; p < n_pos; ++p) {
      const float s = dot(qh, k_cache + p * kv_stride + kv_off, head_dim) * scale;
      scratch[p] = s;
      mx = std::max(mx, s);
    }
    double sum = 0;
    for (p = 0; p < n_pos; ++p) {
      scratch[p] = std::exp(scratch[p] - mx);
      sum += scratch[p];
    }
    const float inv = float(1.0 / sum);
    float* oh = out + int64_t(h) * head_dim;
    int d = 0;
    // out[d] = sum_p (w_p * inv) * v_p[d], positions in order, 64 dims per pass
    for (; d < head_dim; d += 64) {
      const int left = head_dim - d;
      __mmask16 m[4];
      for (int j = 0; j < 4; ++j) {
        const int n = std::min(16, std::max(0, left - 16 * j));
        m[j] = static_cast<__mmask16>((1u << n) - 1u);
      }
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
      for (p = 0; p < n_pos; ++p) {
        const __m512 w = _mm512_set1_ps(scratch[p] * inv);
        const float* vp = v_cache + p * kv_stride + kv_off + d;
        a0 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m[0], vp), a0);
        a1 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m[1], vp + 16), a1);
        a2 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m[2], vp + 32), a2);
        a3 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m[3], vp + 48), a3);
      }
      _mm512_mask_storeu_ps(oh + d, m[0], a0);
      _mm512_mask_storeu_ps(oh + d + 16, m[1], a1);
      _mm512_mask_storeu_ps(oh + d + 32, m[2], a2);
      _mm512_mask_storeu_ps(oh + d + 48, m[3], a3);
    }
  }
}

}  // namespace strata::cpu::detail
