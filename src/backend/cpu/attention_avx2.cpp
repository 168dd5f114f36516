// AVX2 attention for a tile of query rows that share one KV head (see attention_tile in
// ops.h): the query heads of a GQA group for a few consecutive tokens. Flash-attention order
// for the memory traffic (Dao et al. 2022): the tile's queries pass over each block of K rows,
// then over each block of V rows, while the block is in L1, so a K/V row is read from L2 or
// memory once per tile instead of once per query.
//
// The arithmetic of every query row is exactly that of attention_one's SSE path (ops.cpp), so
// the bits do not change and do not depend on the tile: a score is the product of 8 lanes
// (lane j: dims j, j+8, ... in order; each product rounded, then added), reduced by the tree
// ((l0+l4)+(l1+l5))+((l2+l6)+(l3+l7)), times scale; the softmax keeps two passes (max, then
// std::exp and a double sum in position order: no online rescaling, which would change the
// rounding); the output lanes add (w_p * inv) * v_p in position order starting from +0. Only
// the loop order over (query, position) pairs differs, and no two pairs share an accumulator.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cpu/ops.h"

namespace strata::cpu::detail {

namespace {

constexpr int64_t kBlock = 32;  // positions per K/V block: 32 rows of 128 floats = 16 KiB

// Keeps the compiler from contracting a multiply into the following add (GCC's default
// -ffp-contract=fast would make an FMA of it): the SSE path rounds the product first.
inline __m256 opaque(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}

// ((l0+l4)+(l1+l5))+((l2+l6)+(l3+l7)): dot_f32's tree in ops.cpp.
inline float tree8(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // l_j + l_{j+4}
  const __m128 t = _mm_hadd_ps(s, s);                                                   // s0+s1, s2+s3
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Scores of query row `qr` against positions p0..p0+n-1 (n <= 4 at a time), times scale.
inline void scores(const float* qr, const float* k, int64_t kv_stride, int64_t p0, int64_t n, int head_dim, float scale,
                   float* out) {
  int64_t p = p0;
  for (; p + 4 <= p0 + n; p += 4) {
    const float* k0 = k + p * kv_stride;
    const float* k1 = k0 + kv_stride;
    const float* k2 = k1 + kv_stride;
    const float* k3 = k2 + kv_stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int d = 0; d < head_dim; d += 8) {
      const __m256 qv = _mm256_loadu_ps(qr + d);
      a0 = _mm256_add_ps(a0, opaque(_mm256_mul_ps(qv, _mm256_loadu_ps(k0 + d))));
      a1 = _mm256_add_ps(a1, opaque(_mm256_mul_ps(qv, _mm256_loadu_ps(k1 + d))));
      a2 = _mm256_add_ps(a2, opaque(_mm256_mul_ps(qv, _mm256_loadu_ps(k2 + d))));
      a3 = _mm256_add_ps(a3, opaque(_mm256_mul_ps(qv, _mm256_loadu_ps(k3 + d))));
    }
    out[p - p0] = tree8(a0) * scale;
    out[p - p0 + 1] = tree8(a1) * scale;
    out[p - p0 + 2] = tree8(a2) * scale;
    out[p - p0 + 3] = tree8(a3) * scale;
  }
  for (; p < p0 + n; ++p) {
    const float* kp = k + p * kv_stride;
    __m256 a = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; d += 8)
      a = _mm256_add_ps(a, opaque(_mm256_mul_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(kp + d))));
    out[p - p0] = tree8(a) * scale;
  }
}

// o[d] += w_p * v_p[d] for positions p0..p0+n-1 in order (w: the positions' weights), head_dim
// dims, 64 at a time in registers, then the 8-dim rest.
inline void accumulate(const float* w, const float* v, int64_t kv_stride, int64_t p0, int64_t n, int head_dim,
                       float* o) {
  int d = 0;
  for (; d + 64 <= head_dim; d += 64) {
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_loadu_ps(o + d + 8 * c);
    for (int64_t i = 0; i < n; ++i) {
      const __m256 wv = _mm256_set1_ps(w[i]);
      const float* vp = v + (p0 + i) * kv_stride + d;
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) a[c] = _mm256_add_ps(a[c], opaque(_mm256_mul_ps(wv, _mm256_loadu_ps(vp + 8 * c))));
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o + d + 8 * c, a[c]);
  }
  for (; d < head_dim; d += 8) {
    __m256 a = _mm256_loadu_ps(o + d);
    for (int64_t i = 0; i < n; ++i)
      a = _mm256_add_ps(a, opaque(_mm256_mul_ps(_mm256_set1_ps(w[i]), _mm256_loadu_ps(v + (p0 + i) * kv_stride + d))));
    _mm256_storeu_ps(o + d, a);
  }
}

}  // namespace

void attention_tile_avx2(const AttentionTile& t, float* scratch) {
  const int rows = t.n_tok * t.n_head;
  const int64_t lo = t.first[0], hi = t.last[t.n_tok - 1] + 1;  // the tile's positions [lo, hi)
  const int64_t len = hi - lo;
  auto qrow = [&](int i, int j) { return t.q + int64_t(i) * t.q_stride + int64_t(j) * t.head_dim; };
  auto orow = [&](int i, int j) { return t.out + int64_t(i) * t.out_stride + int64_t(j) * t.head_dim; };
  // scratch row r = i * n_head + j holds the scores (then the weights) of positions [lo, hi)

  // fn(i, j, p0, p1) for every query row (token i, head j) and block of kBlock K/V rows: the
  // row's positions [p0, p1) in that block, blocks in position order.
  auto by_blocks = [&](auto&& fn) {
    for (int64_t b0 = lo; b0 < hi; b0 += kBlock) {
      const int64_t b1 = std::min(hi, b0 + kBlock);
      for (int i = 0; i < t.n_tok; ++i) {
        const int64_t p0 = std::max(b0, t.first[i]), p1 = std::min(b1, t.last[i] + 1);
        if (p0 >= p1) continue;
        for (int j = 0; j < t.n_head; ++j) fn(i, j, p0, p1);
      }
    }
  };
  // Scores, block by block of K rows.
  by_blocks([&](int i, int j, int64_t p0, int64_t p1) {
    scores(qrow(i, j), t.k, t.kv_stride, p0, p1 - p0, t.head_dim, t.scale,
           scratch + int64_t(i * t.n_head + j) * len + (p0 - lo));
  });
  // Softmax per query row: max, exp and a double sum in position order (attention_one's).
  for (int r = 0; r < rows; ++r) {
    const int i = r / t.n_head, j = r % t.n_head;
    float* sc = scratch + int64_t(r) * len + (t.first[i] - lo);
    const int64_t n = t.last[i] + 1 - t.first[i];
    float mx = -INFINITY;
    for (int64_t p = 0; p < n; ++p) mx = std::max(mx, sc[p]);
    if (t.sinks) mx = std::max(mx, t.sinks[j]);
    double sum = 0;
    for (int64_t p = 0; p < n; ++p) {
      sc[p] = std::exp(sc[p] - mx);
      sum += sc[p];
    }
    if (t.sinks) sum += std::exp(t.sinks[j] - mx);
    const float inv = float(1.0 / sum);
    for (int64_t p = 0; p < n; ++p) sc[p] = sc[p] * inv;  // the weight attention_one broadcasts
    std::fill(orow(i, j), orow(i, j) + t.head_dim, 0.0f);
  }
  // Weighted V sum, block by block of V rows.
  by_blocks([&](int i, int j, int64_t p0, int64_t p1) {
    accumulate(scratch + int64_t(i * t.n_head + j) * len + (p0 - lo), t.v, t.kv_stride, p0, p1 - p0, t.head_dim,
               orow(i, j));
  });
}

}  // namespace strata::cpu::detail
