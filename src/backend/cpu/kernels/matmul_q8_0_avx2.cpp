// The AVX2 Q8_0 GEMM with the tokens in the lanes, and its mat-vec for decode, in the serial
// definition the AVX-512 family uses for Q8_0 (matmul_q8_scalar_avx512, dot_q8_0_serial in
// matmul_q8_ref.cpp; also the CUDA q8 arithmetic): per (row, token) acc = 0, then for each
// 32-block b in column order S_b = sum_k qw_k * qx_k (exact int32) and
// acc = fma(float(S_b), dw_b * dx_b, acc), the product rounded on its own. So the AVX2 family's
// Q8_0 results equal the AVX-512 family's bit for bit (docs/kernels.md "Q8_0 on AVX2: tokens in
// the lanes").
//
// GEMM (more than kQ8_0MatVecMax tokens). Activations: ActQ8::xg / dxg (groups of 16 tokens;
// per group g and block b 8 runs j of 64 bytes, lane l = token 16g + l holding its codes
// 4j..4j+3 plus 128), read as two ymm halves of 8 tokens; per block of groups the runs are copied
// once with the 128 removed (signed codes, into a thread-local buffer).
// Weights stay in GGUF row order; per tile of R rows the codes' absolute values are copied once
// (32 bytes per row and block) with the fp16 scales as fp32. For row r, block b, run j the
// 4 codes 4j..4j+3 of the row are one broadcast w (signed) and one broadcast |w|: per token lane
// vpmaddubsw(|w|, vpsignb(x, w)) gives two int16 pair sums (each |.| <= 2 * 128 * 127 = 32512, so
// never saturated: x codes are in [-127, 127]) and vpmaddwd by 1 their int32 sum; 8 runs add up
// to S_b of 8 tokens exactly. Then one convert, one product dw_b * dx (8 tokens) and one FMA per
// (row, block, 8 tokens). Register tile: 2 rows x 2 halves (16 tokens; 4 int32 sums + 4 fp32
// accumulators); blocks of groups whose signed codes fit ~256 KiB (L2), then 2-row weight tiles.
//
// Mat-vec (1..kQ8_0MatVecMax tokens, natural code order ActQ8::q/d): 8 rows at a time; per block
// and token each row's 32 codes give 8 int32 lane sums (the same sign trick), a transpose-add
// tree (vphaddd, 3 levels) puts the 8 rows' S_b in one register, then the float part with the
// rows in the lanes. Tail rows (< 8) run one row at a time with a horizontal integer sum.
//
// Nothing depends on the batch or the tile: every (row, token) is one serial chain, padding lanes
// (code 0, scale 0) are never stored, and integer sums are exact in any order.
#include "backend/cpu/kernels/simd_intrin.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backend/cpu/kernels/act_q8.h"
#include "backend/cpu/kernels/q8_0_lanes_gemm.h"

namespace strata::cpu::kernels::detail {

namespace {

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

/// Per int32 lane the exact sum of its 4 products w * x (w: |w| given as aw, both broadcast or
/// full vectors of signed bytes; |x| <= 127 so no vpmaddubsw pair sum saturates).
inline __m256i dot4(__m256i aw, __m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

/// R rows x H halves (8 tokens each) of one group over all nb blocks. w[r]: row r's first code
/// (blocks 34 bytes apart, GGUF order); aw: |codes| of the tile, row r at r * nb * 32, block b at
/// + 32 b; dw: fp32 scales, row r at r * nb; x: the group's signed runs (block b at b * 512, run j
/// at + 64 j, half h at + 32 h); dx: the group's scales (block b at 16 b, half h at + 8 h).
/// Writes y[(8 h + l) * ldy + r] for tokens 8h + l < valid.
template <int R, int H>
void tile(const uint8_t* const* w, const uint8_t* aw, const float* dw, int64_t nb, const int8_t* x, const float* dx,
          int64_t valid, float* y, int64_t ldy) {
  __m256 acc[R][H];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s[R][H];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) s[r][h] = _mm256_setzero_si256();
    const int8_t* xb = x + b * 512;
    // (4 runs at a time: the full unroll of 8 let the compiler hoist every run's products and
    // spill; 2 rows x 2 halves, unrolled by 4, measured fastest of 2x2 / 4x1 and 1, 2, 4, 8)
#pragma GCC unroll 4
    for (int j = 0; j < 8; ++j) {
      __m256i xr[H];
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) xr[h] = load256(xb + 64 * j + 32 * h);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i wv = _mm256_set1_epi32(static_cast<int>(load_u32(w[r] + 34 * b + 4 * j)));
        const __m256i av = _mm256_set1_epi32(static_cast<int>(load_u32(aw + (r * nb + b) * 32 + 4 * j)));
#pragma GCC unroll 2
        for (int h = 0; h < H; ++h) {
          const __m256i p = dot4(av, wv, xr[h]);
          s[r][h] = _mm256_add_epi32(s[r][h], p);
        }
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) {
      const __m256 d = _mm256_loadu_ps(dx + 16 * b + 8 * h);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 f = _mm256_mul_ps(_mm256_broadcast_ss(dw + r * nb + b), d);  // dw_b * dx_b, rounded
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), f, acc[r][h]);
      }
    }
  }
  store_lane_tile<R, H>(acc, valid, y, ldy);
}

// The sign-trick kernel's parts of q8_0_lanes_gemm: the signed copy of a block of groups, |w|
// and the fp32 scales per row tile.
struct SignTrickTiles {
  std::vector<int8_t>& xs;
  std::vector<uint8_t>& aw;
  std::vector<float>& dw;
  const void* groups(const uint8_t* src, int64_t bytes) {
    if (xs.size() < static_cast<size_t>(bytes)) xs.resize(static_cast<size_t>(bytes));
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int64_t i = 0; i < bytes; i += 32)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xs.data() + i), _mm256_xor_si256(load256(src + i), bias));
    return xs.data();
  }
  void rows(const uint8_t* row, int r, int64_t nb) {
    for (int64_t b = 0; b < nb; ++b) {
      dw[static_cast<size_t>(r * nb + b)] = _cvtsh_ss(load_u16(row + 34 * b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(aw.data() + (r * nb + b) * 32),
                          _mm256_abs_epi8(load256(row + 34 * b + 2)));
    }
  }
  template <int R, int H>
  void tile(const uint8_t* const* w, int64_t nb, const void* x, const float* dx, int64_t valid, float* y, int64_t ldy) {
    detail::tile<R, H>(w, aw.data(), dw.data(), nb, static_cast<const int8_t*>(x), dx, valid, y, ldy);
  }
};

void gemm(const MatmulArgs& m, const ActQ8& a) {
  thread_local std::vector<int8_t> xs;  // signed runs of the current block of groups
  thread_local std::vector<uint8_t> aw;
  thread_local std::vector<float> dw;
  const int64_t nb = m.cols / 32;
  aw.resize(static_cast<size_t>(kQ8_0LaneRows * nb * 32));
  dw.resize(static_cast<size_t>(kQ8_0LaneRows * nb));
  SignTrickTiles k{xs, aw, dw};
  q8_0_lanes_gemm(m, a, k);
}

/// Sum of the 8 int32 lanes of v (exact).
inline int32_t hsum_epi32(__m256i v) {
  __m128i q = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  q = _mm_add_epi32(q, _mm_unpackhi_epi64(q, q));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 1));
  return _mm_cvtsi128_si32(q);
}

/// Lane r of the result: the sum of the 8 lanes of v[r] (exact integer sums).
inline __m256i transpose_add8(const __m256i* v) {
  const __m256i h0 = _mm256_hadd_epi32(v[0], v[1]), h1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i h2 = _mm256_hadd_epi32(v[4], v[5]), h3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i g0 = _mm256_hadd_epi32(h0, h1), g1 = _mm256_hadd_epi32(h2, h3);  // [r0..r3 | r0..r3] halves
  return _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20), _mm256_permute2x128_si256(g0, g1, 0x31));
}

/// Rows [r0, r0 + 8) against NT tokens. The 8 rows are one contiguous run of 8 * rb bytes, and
/// so is the next tile: it is prefetched into L2 as one sequential stream, ~8 * 34 bytes per
/// block, while this tile runs.
template <int NT>
void matvec_rows8(const uint8_t* W, size_t rb, int64_t r0, int64_t r_end, int64_t nb, const ActQ8& a, float* y,
                  int64_t ldy) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const uint8_t* row0 = W + static_cast<size_t>(r0) * rb;
  const uint8_t* next = row0 + 8 * rb;
  const int64_t next_bytes = std::min<int64_t>(8, r_end - (r0 + 8)) * static_cast<int64_t>(rb);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wv[8];
    const uint8_t* wb = row0 + 34 * b;
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) wv[r] = load256(wb + r * rb + 2);
    // the 8 rows' fp16 scales, row r in lane r, built in registers (no store-forwarding stall);
    // _mm_set_epi16 rather than _mm_insert_epi16 in the loop, whose lane must be a constant
    const __m128i h =
        _mm_set_epi16(short(load_u16(wb + 7 * rb)), short(load_u16(wb + 6 * rb)), short(load_u16(wb + 5 * rb)),
                      short(load_u16(wb + 4 * rb)), short(load_u16(wb + 3 * rb)), short(load_u16(wb + 2 * rb)),
                      short(load_u16(wb + rb)), short(load_u16(wb)));
    const __m256 dw = _mm256_cvtph_ps(h);
    for (int t = 0; t < NT; ++t) {
      const __m256i x = load256(a.qt(t) + 32 * b);
      __m256i v[8];
      for (int r = 0; r < 8; ++r) v[r] = dot4(_mm256_abs_epi8(wv[r]), wv[r], x);
      const __m256i S = transpose_add8(v);
      const __m256 f = _mm256_mul_ps(dw, _mm256_set1_ps(a.dt(t)[b]));  // dw_b * dx_b, rounded
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), f, acc[t]);
    }
    for (int64_t o = b * 272; o < (b + 1) * 272 && o < next_bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T1);
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(y + t * ldy + r0, acc[t]);
}

/// One row against NT tokens (the row tails of the mat-vec).
template <int NT>
void matvec_row1(const uint8_t* row, int64_t r, int64_t nb, const ActQ8& a, float* y, int64_t ldy) {
  __m128 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = row + 34 * b;
    const __m256i wv = load256(wb + 2), av = _mm256_abs_epi8(wv);
    const __m128 dw = _mm_set_ss(_cvtsh_ss(load_u16(wb)));
    for (int t = 0; t < NT; ++t) {
      const int32_t S = hsum_epi32(dot4(av, wv, load256(a.qt(t) + 32 * b)));
      const __m128 f = _mm_mul_ss(dw, _mm_set_ss(a.dt(t)[b]));  // dw_b * dx_b, rounded
      acc[t] = _mm_fmadd_ss(_mm_cvtsi32_ss(_mm_setzero_ps(), S), f, acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) y[t * ldy + r] = _mm_cvtss_f32(acc[t]);
}

template <int NT>
void matvec(const MatmulArgs& m, const ActQ8& a) {
  const int64_t nb = m.cols / 32;
  int64_t r = m.row_begin;
  for (; r + 8 <= m.row_end; r += 8) matvec_rows8<NT>(m.W, m.row_bytes, r, m.row_end, nb, a, m.y, m.ldy);
  for (; r < m.row_end; ++r) matvec_row1<NT>(m.W + static_cast<size_t>(r) * m.row_bytes, r, nb, a, m.y, m.ldy);
}

}  // namespace

void matmul_q8_0_avx2(const MatmulArgs& m, const ActQ8& a) {
  if (m.n_tok > kQ8_0MatVecMax) {
    if (avx_vnni_usable()) {
      gemm_q8_0_avxvnni(m, a);  // the same bits, one vpdpbusd per 8 tokens and run
    } else {
      gemm(m, a);
    }
    return;
  }
  switch (m.n_tok) {
    case 1: matvec<1>(m, a); break;
    case 2: matvec<2>(m, a); break;
    case 3: matvec<3>(m, a); break;
    default: matvec<4>(m, a); break;
  }
}

}  // namespace strata::cpu::kernels::detail
