// The q8-activation path, AVX-512: int8 dot products (vpdpbusd with VNNI, else vpmaddubsw +
// vpmaddwd, which give the same integers: no pair sum can saturate for these formats), with
// the fp32 factors applied lane by lane exactly as matmul_q8_ref.cpp defines them. Q8_0 goes to
// its own GEMM with the tokens in the lanes (matmul_q8_0_avx512.cpp, serial definition), and so
// does Q4_K.
//
// Loop order: blocks of 64 tokens (their int8 codes stay in L2), then rows, then tiles of up
// to 4 tokens that share one decode of the row's weights. Every (row, token) pair runs the
// same instruction sequence whatever the tile, so results are batch invariant.
#include "backend/cpu/kernels/simd_intrin.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <type_traits>
#include <vector>

#include "backend/cpu/kernels/act_q8.h"
#include "backend/cpu/kernels/b32_factors.h"
#include "backend/cpu/kernels/iq2xs_q8_kernel.h"
#include "quant/quant_tables.h"

namespace strata::cpu::kernels::detail {

namespace {

constexpr int kPrefetch = kQ8Prefetch;
using b32::b32_factors;

/// acc + per int32 lane the sum of its 4 products u * s (u unsigned, s signed bytes):
/// vpdpbusd, or vpmaddubsw + vpmaddwd (the same integers while no pair sum saturates).
template <bool VNNI>
inline __m512i dot_acc(__m512i acc, __m512i u, __m512i s) {
  if constexpr (VNNI) return _mm512_dpbusd_epi32(acc, u, s);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}

/// vpermps indices that spread lanes 2c and 2c+1 of an 8-float vector over the two halves of
/// a zmm (lanes 0-7 and 8-15), for c = 0..3: one per-block factor per 8 int32 lanes.
inline void pair_lanes(__m512i (&idx)[4]) {
  for (int c = 0; c < 4; ++c) idx[c] = _mm512_inserti64x4(_mm512_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1), 1);
}

/// The codes u_j (b32_format) of two consecutive blocks of a 32-weight block type as unsigned
/// bytes: the block at b in bytes 0-31, the next one in bytes 32-63 (when !two, a copy of the
/// first, whose activation codes the caller zeroes). `table`: values[q] + offset in every
/// 128-bit lane (types with a value table).
template <GgmlType T>
inline __m512i b32_pair(const uint8_t* b, bool two, __m512i table) {
  constexpr B32Format F = b32_format(T);
  const uint8_t* b1 = two ? b + F.bytes : b;
  if constexpr (F.qs + 32 == F.bytes) {  // Q8_0: int8 codes, + 128
    const __m512i v =
        _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + F.qs))),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + F.qs)), 1);
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    // [qs, qs, qs', qs'] -> low nibbles in 128-bit lanes 0 and 2 (elements 0-15), high in 1 and 3
    const __m512i v2 =
        _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + F.qs))),
                                    0xff00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + F.qs)));
    __m512i v = _mm512_and_si512(_mm512_mask_srli_epi16(v2, 0xff00ff00u, v2, 4), _mm512_set1_epi8(0x0f));
    if constexpr (F.qh >= 0) {
      const uint64_t h = load_u32(b + F.qh) | (static_cast<uint64_t>(load_u32(b1 + F.qh)) << 32);
      v = _mm512_mask_add_epi8(v, _cvtu64_mask64(h), v, _mm512_set1_epi8(16));
    }
    if constexpr (F.table) v = _mm512_shuffle_epi8(table, v);
    return v;
  }
}

/// Sum of u * x over each int32 lane. Without VNNI, vpmaddubsw on u up to 255 (offset 128)
/// could saturate, so those integers are formed as sum((u - 128) * x) + 128 * sum(x); smaller
/// codes (<= 31) cannot saturate a pair sum.
template <bool VNNI, bool BIG>
inline __m512i dot_b32(__m512i u, __m512i qx) {
  if constexpr (VNNI || !BIG) {
    return dot_acc<VNNI>(_mm512_setzero_si512(), u, qx);
  } else {
    const __m512i w = _mm512_xor_si512(u, _mm512_set1_epi8(static_cast<char>(0x80)));
    const __m512i sx = _mm512_mask_sub_epi8(qx, _mm512_movepi8_mask(w), _mm512_setzero_si512(), qx);
    const __m512i ones = _mm512_set1_epi16(1);
    const __m512i wx = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), sx), ones);
    const __m512i sum = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_set1_epi8(1), qx), ones);
    return _mm512_add_epi32(wx, _mm512_slli_epi32(sum, 7));
  }
}

/// One group of (up to) 8 blocks of a 32-weight block type against TB tokens; FULL: all 8 valid.
template <GgmlType T, int TB, bool VNNI, bool FULL>
inline void b32_group(const uint8_t* wg, int nv, const Tokens& tk, int64_t g, __m512i table, __m512* acc0, __m512* acc1,
                      __m256* corr) {
  constexpr B32Format F = b32_format(T);
  __m512i idx[4];
  pair_lanes(idx);
  __m256 fd, fc;
  b32_factors<T, FULL>(wg, nv, fd, fc);
  const __mmask8 m8 = FULL ? __mmask8{0xff} : static_cast<__mmask8>((1u << nv) - 1u);
  const __mmask16 m16 = FULL ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (2 * nv)) - 1u);
  __m512 f[TB];
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t) {
    const __m256 dx = _mm256_maskz_loadu_ps(m8, tk.d + t * (tk.cols / 32) + g);
    const __m256i s16 = _mm256_maskz_loadu_epi16(m16, tk.s + t * (tk.cols / 16) + 2 * g);
    corr[t] = _mm256_fmadd_ps(_mm256_mul_ps(fc, dx), _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1))),
                              corr[t]);
    f[t] = _mm512_zextps256_ps512(_mm256_mul_ps(fd, dx));
  }
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    if (!FULL && 2 * p >= nv) break;
    const bool two = FULL || 2 * p + 1 < nv;
    const __m512i wu = b32_pair<T>(wg + 2 * F.bytes * p, two, table);
    const __mmask64 mx = two ? ~__mmask64{0} : __mmask64{0xffffffffu};
    // pair index g/2 + p, g/2 a multiple of 4: the accumulator is p's parity
    __m512* acc = (p & 1) ? acc1 : acc0;
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
      const int8_t* xp = tk.q + t * tk.cols + 32 * (g + 2 * p);
      const __m512i qx = FULL ? _mm512_loadu_si512(xp) : _mm512_maskz_loadu_epi8(mx, xp);
      const __m512 pf = _mm512_cvtepi32_ps(dot_b32<VNNI, F.offset == 128>(wu, qx));
      acc[t] = _mm512_fmadd_ps(pf, _mm512_permutexvar_ps(idx[p], f[t]), acc[t]);
    }
  }
}

/// One row of a 32-weight block type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4) against TB
/// tokens, with the arithmetic of dot_b32 in matmul_q8_ref.cpp.
template <GgmlType T, int TB, bool VNNI>
void row_b32(const uint8_t* w, const Tokens& tk, float* y, int64_t ldy) {
  constexpr B32Format F = b32_format(T);
  __m512 acc0[TB], acc1[TB];
  __m256 corr[TB];
  for (int t = 0; t < TB; ++t) {
    acc0[t] = acc1[t] = _mm512_setzero_ps();
    corr[t] = _mm256_setzero_ps();
  }
  __m512i table = _mm512_setzero_si512();
  if constexpr (F.table)
    table = _mm512_broadcast_i32x4(_mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(F.values)),
                                                _mm_set1_epi8(static_cast<char>(F.offset))));
  const int64_t nb = tk.cols / 32;
  int64_t g = 0;
  for (; g + 8 <= nb; g += 8) {
    const uint8_t* wg = w + F.bytes * g;
    for (int o = 0; o < F.bytes * 8; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wg) + kPrefetch + o, _MM_HINT_T0);
    b32_group<T, TB, VNNI, true>(wg, 8, tk, g, table, acc0, acc1, corr);
  }
  if (g < nb) b32_group<T, TB, VNNI, false>(w + F.bytes * g, static_cast<int>(nb - g), tk, g, table, acc0, acc1, corr);
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum16(_mm512_add_ps(acc0[t], acc1[t])) + simd_hsum8(corr[t]);
}

/// Q4_K (and Q5_K: FIFTH) in its lane order (q4k_lane_element): chunk k = 64-bit word k of
/// each 32-byte run of quants (one vpermt2q), low nibbles in even words (sub-blocks 0, 2, 4, 6),
/// high in odd; Q5_K's 5th bits of chunk k are qh's 64-bit word k, bit s of every byte for the
/// lanes of sub-block s (a per-word rotate brings it to bit 4). Each lane sums its 16 products
/// in integers and is scaled once per super-block.
template <int TB, bool VNNI, bool FIFTH>
void row_q4_k(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  constexpr int kBytes = FIFTH ? 176 : 144, kQs = FIFTH ? 48 : 16;
  __m512 acc[TB];
  __m256 accm[TB];
  for (int t = 0; t < TB; ++t) {
    acc[t] = _mm512_setzero_ps();
    accm[t] = _mm256_setzero_ps();
  }
  const __m512i nib = _mm512_set1_epi8(0x0f), shift = _mm512_setr_epi64(0, 4, 0, 4, 0, 4, 0, 4);
  const __m512i bit4 = _mm512_set1_epi8(0x10), rot = _mm512_setr_epi64(4, 3, 2, 1, 0, 63, 62, 61);  // bit s -> 4
  // word p of chunk k: word 4(p/2) + k of the 128 quant bytes (words 8-15 from the second source)
  const __m512i words = _mm512_setr_epi64(0, 0, 4, 4, 8, 8, 12, 12);
  const __m128i pairs = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);  // sub-block L/2
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += kBytes) {
    for (int o = 0; o < kBytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + o, _MM_HINT_T0);
    uint64_t sc, m;
    k4_scales_packed(w + 4, sc, m);
    const __m512 dsc = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(load_u16(w))),
                                     _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                         _mm_shuffle_epi8(_mm_cvtsi64_si128(static_cast<long long>(sc)), pairs))));
    const __m256 dm =
        _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(load_u16(w + 2))),
                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(m)))));
    const __m512i qa = _mm512_loadu_si512(w + kQs), qb = _mm512_loadu_si512(w + kQs + 64);
    __m512i sum[TB];
    for (int t = 0; t < TB; ++t) sum[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m512i v = _mm512_permutex2var_epi64(qa, _mm512_add_epi64(words, _mm512_set1_epi64(k)), qb);
      __m512i wq;
      if constexpr (FIFTH) {
        uint64_t h;
        std::memcpy(&h, w + 16 + 8 * k, 8);
        const __m512i hb = _mm512_and_si512(_mm512_rolv_epi64(_mm512_set1_epi64(static_cast<long long>(h)), rot), bit4);
        wq = _mm512_ternarylogic_epi32(_mm512_srlv_epi64(v, shift), nib, hb, 0xea);  // (v & 0x0f) | hb
      } else {
        wq = _mm512_and_si512(_mm512_srlv_epi64(v, shift), nib);
      }
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t)
        sum[t] = dot_acc<VNNI>(sum[t], wq, _mm512_loadu_si512(tk.q + t * tk.cols + 256 * i + 64 * k));
    }
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
      const __m512 f = _mm512_mul_ps(dsc, _mm512_loadu_ps(tk.dxl + t * (tk.cols / 16) + 16 * i));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), f, acc[t]);
      accm[t] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(tk.xs + t * (tk.cols / 32) + 8 * i), accm[t]);
    }
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum16(acc[t]) - simd_hsum8(accm[t]);
}

/// Lanes that are 16-weight groups (Q6_K, IQ4_XS), super-block i: the group's integer sum of
/// (code + 2^OFF) * x minus 2^OFF times the group's code sum, times its integer scale `sc` (as
/// float), scaled by d * dx: acc + float(sc * (sum - (s16 << OFF))) * (d * dxl). The product is
/// formed in fp32 from two exact operands (|sum| < 2^24), i.e. one rounding of the exact integer
/// product: the same bits as converting the int32 product (matmul_q8_ref.cpp), one uop cheaper.
template <int OFF>
inline __m512 group_lanes_fma(__m512 acc, __m512i sum, __m512 sc, __m512 d, const LaneTokens& tk, int64_t i) {
  const __m512i s16 = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tk.s16 + 16 * i)));
  const __m512 S = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_slli_epi32(s16, OFF))));
  return _mm512_fmadd_ps(S, _mm512_mul_ps(d, _mm512_loadu_ps(tk.dxl + 16 * i)), acc);
}

/// Per-lane 4-bit fields of a super-block's scales, lane L taking field L/2: (bits >> 4(L/2)) &
/// 0xf as int32 lanes (bits: 8 nibbles, field g at bits 4g..4g+3).
inline __m512i lane_nibbles(uint32_t bits) {
  const __m512i shift = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  return _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(bits)), shift), _mm512_set1_epi32(0xf));
}

/// Q6_K in its lane order (q6k_lane_element: lane L = 16-weight group L): per 64 weights one
/// vpermt2d of the low-bit bytes and one vpermd of the high-bit bytes bring every lane its 4
/// bytes; a per-lane shift picks the nibble, a per-lane rotate moves the two high bits to bits
/// 4-5, vpternlog joins them. The -32 offset and the int8 scale are applied to the lane's
/// integer sum once per super-block.
template <int TB, bool VNNI>
void row_q6_k(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  alignas(64) static const auto idx = [] {
    struct {
      uint32_t ql[4][16], qh[4][16], nib[16], rot[16];
    } c{};
    for (int L = 0; L < 16; ++L) {
      const int n = L / 8, r = (L % 8) / 2, h = L % 2;
      for (int k = 0; k < 4; ++k) {
        c.ql[k][L] = static_cast<uint32_t>(16 * n + 8 * (r % 2) + 4 * h + k);
        c.qh[k][L] = static_cast<uint32_t>(8 * n + 4 * h + k);
      }
      c.nib[L] = static_cast<uint32_t>(4 * (r / 2));
      c.rot[L] = static_cast<uint32_t>((4 - 2 * r) & 31);  // bits 2r, 2r+1 of each byte to bits 4, 5
    }
    return c;
  }();
  const __m512i nib = _mm512_loadu_si512(idx.nib), rot = _mm512_loadu_si512(idx.rot);
  const __m512i lo4 = _mm512_set1_epi8(0x0f), hi2 = _mm512_set1_epi8(0x30);
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 210) {
    for (int o = 0; o < 210; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + o, _MM_HINT_T0);
    const __m512i qla = _mm512_loadu_si512(w), qlb = _mm512_loadu_si512(w + 64), qh = _mm512_loadu_si512(w + 128);
    const __m512 sc =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192))));
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(w + 208)));
    __m512i sum[TB];
    for (int t = 0; t < TB; ++t) sum[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m512i l = _mm512_srlv_epi32(_mm512_permutex2var_epi32(qla, _mm512_loadu_si512(idx.ql[k]), qlb), nib);
      const __m512i hbits =
          _mm512_and_si512(_mm512_rolv_epi32(_mm512_permutexvar_epi32(_mm512_loadu_si512(idx.qh[k]), qh), rot), hi2);
      const __m512i q6 = _mm512_ternarylogic_epi32(l, lo4, hbits, 0xea);  // (l & 0x0f) | hbits
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t)
        sum[t] = dot_acc<VNNI>(sum[t], q6, _mm512_loadu_si512(tk.q + t * tk.cols + 256 * i + 64 * k));
    }
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) acc[t] = group_lanes_fma<5>(acc[t], sum[t], sc, d, tk.from(t), i);
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum16(acc[t]);
}

/// Q2_K in Q6_K's lane order (lane L = 16-weight group L): per 64 weights one vpermd brings
/// every lane its 4 bytes of qs, a per-lane shift picks its 2-bit plane; the group's 4-bit scale
/// multiplies the lane's integer sum and its 4-bit min the group's code sum (both products exact
/// in fp32).
template <int TB, bool VNNI>
void row_q2_k(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  __m512 acc[TB], accm[TB];
  for (int t = 0; t < TB; ++t) acc[t] = accm[t] = _mm512_setzero_ps();
  alignas(64) static const auto idx = [] {
    struct {
      uint32_t qs[4][16], shift[16];
    } c{};
    for (int L = 0; L < 16; ++L) {
      for (int k = 0; k < 4; ++k) c.qs[k][L] = static_cast<uint32_t>(8 * (L / 8) + 4 * (L % 2) + k);
      c.shift[L] = static_cast<uint32_t>(2 * ((L / 2) % 4));
    }
    return c;
  }();
  const __m512i shift = _mm512_loadu_si512(idx.shift), three = _mm512_set1_epi8(3), nib = _mm512_set1_epi32(0xf);
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 84) {
    for (int o = 0; o < 84; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + o, _MM_HINT_T0);
    const __m512i s8 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_and_si512(s8, nib)), mn = _mm512_cvtepi32_ps(_mm512_srli_epi32(s8, 4));
    const __m512i qs = _mm512_loadu_si512(w + 16);
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(w + 80))), dmin = _mm512_set1_ps(_cvtsh_ss(load_u16(w + 82)));
    __m512i sum[TB];
    for (int t = 0; t < TB; ++t) sum[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m512i q =
          _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(_mm512_loadu_si512(idx.qs[k]), qs), shift),
                           three);
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t)
        sum[t] = dot_acc<VNNI>(sum[t], q, _mm512_loadu_si512(tk.q + t * tk.cols + 256 * i + 64 * k));
    }
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
      const __m512 x = _mm512_loadu_ps(tk.dxl + t * (tk.cols / 16) + 16 * i);
      const __m512i s16 = _mm512_cvtepi16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tk.s16 + t * (tk.cols / 16) + 16 * i)));
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(sc, _mm512_cvtepi32_ps(sum[t])), _mm512_mul_ps(d, x), acc[t]);
      accm[t] = _mm512_fmadd_ps(_mm512_mul_ps(mn, _mm512_cvtepi32_ps(s16)), _mm512_mul_ps(dmin, x), accm[t]);
    }
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum16(acc[t]) - simd_hsum16(accm[t]);
}

/// Q3_K in Q6_K's lane order (lane L = 16-weight group L): per 64 weights one vpermd of qs and
/// a per-lane shift give the low 2 bits, one vpermd of hmask and a per-lane rotate the third
/// (bit L/2 of the byte to bit 2); the -4 offset and the six-bit scale act on the lane's sum.
template <int TB, bool VNNI>
void row_q3_k(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  alignas(64) static const auto idx = [] {
    struct {
      uint32_t qs[4][16], hm[4][16], shift[16], rot[16], lo_shift[16], hi_shift[16];
      uint8_t lo_byte[64], hi_byte[64];
    } c{};
    std::memset(c.lo_byte, 0x80, sizeof c.lo_byte);
    std::memset(c.hi_byte, 0x80, sizeof c.hi_byte);
    for (int L = 0; L < 16; ++L) {
      for (int k = 0; k < 4; ++k) {
        c.qs[k][L] = static_cast<uint32_t>(8 * (L / 8) + 4 * (L % 2) + k);
        c.hm[k][L] = static_cast<uint32_t>(4 * (L % 2) + k);
      }
      c.shift[L] = static_cast<uint32_t>(2 * ((L / 2) % 4));
      c.rot[L] = static_cast<uint32_t>((2 - L / 2) & 31);
      // scale of group L: low 4 bits of byte L%8 >> 4(L/8), high 2 of byte 8 + L%4 >> 2(L/4)
      c.lo_byte[4 * L] = static_cast<uint8_t>(L % 8);
      c.hi_byte[4 * L] = static_cast<uint8_t>(8 + L % 4);
      c.lo_shift[L] = static_cast<uint32_t>(4 * (L / 8));
      c.hi_shift[L] = static_cast<uint32_t>(2 * (L / 4));
    }
    return c;
  }();
  const __m512i shift = _mm512_loadu_si512(idx.shift), rot = _mm512_loadu_si512(idx.rot);
  const __m512i three = _mm512_set1_epi8(3), bit2 = _mm512_set1_epi8(4);
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 110) {
    for (int o = 0; o < 110; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + o, _MM_HINT_T0);
    // the 12 scale bytes (read as 8 + 4: a 16-byte load would pass the block's end)
    const __m512i s16b =
        _mm512_broadcast_i32x4(_mm_insert_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 96)),
                                                static_cast<int>(load_u32(w + 104)), 2));
    const __m512i lo = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi8(s16b, _mm512_loadu_si512(idx.lo_byte)),
                                                          _mm512_loadu_si512(idx.lo_shift)),
                                        _mm512_set1_epi32(0xf));
    const __m512i hi = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi8(s16b, _mm512_loadu_si512(idx.hi_byte)),
                                                          _mm512_loadu_si512(idx.hi_shift)),
                                        _mm512_set1_epi32(3));
    const __m512 sc =
        _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32)));
    const __m512i hm = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    const __m512i qs = _mm512_loadu_si512(w + 32);
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(w + 108)));
    __m512i sum[TB];
    for (int t = 0; t < TB; ++t) sum[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m512i q =
          _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(_mm512_loadu_si512(idx.qs[k]), qs), shift),
                           three);
      const __m512i h =
          _mm512_and_si512(_mm512_rolv_epi32(_mm512_permutexvar_epi32(_mm512_loadu_si512(idx.hm[k]), hm), rot), bit2);
      const __m512i u = _mm512_or_si512(q, h);
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t)
        sum[t] = dot_acc<VNNI>(sum[t], u, _mm512_loadu_si512(tk.q + t * tk.cols + 256 * i + 64 * k));
    }
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) acc[t] = group_lanes_fma<2>(acc[t], sum[t], sc, d, tk.from(t), i);
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum16(acc[t]);
}

/// IQ4_XS in Q6_K's lane order (lane L = 16-weight group L = low (L even) or high nibbles of
/// qs[16(L/2) ..]): per 64 weights one vpermt2d, a per-lane nibble shift and vpshufb from
/// kvalues_iq4nl + 128 (unsigned for vpdpbusd; the 128 * code sum is removed per lane, and
/// without VNNI the products are formed as for Q8_0, which has the same +128 offset).
template <int TB, bool VNNI>
void row_iq4_xs(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  alignas(64) static const auto idx = [] {
    struct {
      uint32_t qs[4][16], nib[16];
      uint8_t kv[16];
    } c{};
    for (int L = 0; L < 16; ++L) {
      for (int k = 0; k < 4; ++k) c.qs[k][L] = static_cast<uint32_t>(4 * (L / 2) + k);
      c.nib[L] = static_cast<uint32_t>(4 * (L % 2));
    }
    for (int q = 0; q < 16; ++q) c.kv[q] = static_cast<uint8_t>(tables::kvalues_iq4nl[q] + 128);
    return c;
  }();
  const __m512i nib = _mm512_loadu_si512(idx.nib), lo4 = _mm512_set1_epi8(0x0f);
  const __m512i kv = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(idx.kv)));
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 136) {
    for (int o = 0; o < 136; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + o, _MM_HINT_T0);
    // six-bit scale of block L/2 minus 32: nibble of scales_l | 2 bits of scales_h << 4
    const __m512i sh2 = _mm512_srlv_epi32(_mm512_set1_epi32(load_u16(w + 2)),
                                          _mm512_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14));
    const __m512i ls =
        _mm512_ternarylogic_epi32(lane_nibbles(load_u32(w + 4)), _mm512_set1_epi32(0x0f),
                                  _mm512_and_si512(_mm512_slli_epi32(sh2, 4), _mm512_set1_epi32(0x30)), 0xea);
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32)));
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(w)));
    const __m512i qa = _mm512_loadu_si512(w + 8), qb = _mm512_loadu_si512(w + 72);
    __m512i sum[TB];
    for (int t = 0; t < TB; ++t) sum[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m512i q =
          _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutex2var_epi32(qa, _mm512_loadu_si512(idx.qs[k]), qb), nib),
                           lo4);
      const __m512i wq = _mm512_shuffle_epi8(kv, q);
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t) {
        const __m512i qx = _mm512_loadu_si512(tk.q + t * tk.cols + 256 * i + 64 * k);
        // kv + 128 reaches 241: without VNNI, vpmaddubsw pairs could saturate (dot_b32)
        sum[t] = VNNI ? _mm512_dpbusd_epi32(sum[t], wq, qx) : _mm512_add_epi32(sum[t], dot_b32<false, true>(wq, qx));
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) acc[t] = group_lanes_fma<7>(acc[t], sum[t], sc, d, tk.from(t), i);
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum16(acc[t]);
}

/// IQ3_S in Q6_K's lane order: chunk k's 16 grid entries are 4L + k, byte k of each 32-bit word
/// of qs (a shift) with its 9th index bit, bit 4L + k of qh (a per-lane rotate), gathered by one
/// vpgatherdd into lane order; the explicit sign bits of chunk k are nibble k of each 16-bit word
/// of the signs (four pext); the 4-bit block scale multiplies the lane's integer sum.
template <int TB, bool VNNI>
void row_iq3_s(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  alignas(64) static const auto rot = [] {
    std::array<std::array<uint32_t, 16>, 4> r{};
    // bit 4(L%8) + k of lane L's 32-bit half of qh (low half for L < 8) rotated to bit 8
    for (int k = 0; k < 4; ++k)
      for (int L = 0; L < 16; ++L) r[k][L] = static_cast<uint32_t>((4 * (L % 8) + k - 8) & 31);
    return r;
  }();
  const __m512i lo8 = _mm512_set1_epi32(0xff), bit8 = _mm512_set1_epi32(0x100);
  const int* grid = reinterpret_cast<const int*>(tables::iq3s_grid);
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 110) {
    for (int o = 0; o < 110; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + o, _MM_HINT_T0);
    const __m512i qs = _mm512_loadu_si512(w + 2);
    uint32_t qh[2];
    std::memcpy(qh, w + 66, 8);
    const __m512i hv =
        _mm512_inserti64x4(_mm512_set1_epi32(static_cast<int>(qh[0])), _mm256_set1_epi32(static_cast<int>(qh[1])), 1);
    uint64_t sg[4];
    std::memcpy(sg, w + 74, 32);
    const __m512i nib = lane_nibbles(load_u32(w + 106));
    const __m512 odd = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_add_epi32(nib, nib), _mm512_set1_epi32(1)));
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(w)));
    __m512i sum[TB];
    for (int t = 0; t < TB; ++t) sum[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m512i hb =
          _mm512_and_si512(_mm512_rorv_epi32(hv, _mm512_loadu_si512(rot[static_cast<size_t>(k)].data())), bit8);
      const __m512i ix =
          _mm512_ternarylogic_epi32(_mm512_srli_epi32(qs, 8 * k), lo8, hb, 0xea);  // (qs >> 8k & 0xff) | hb
      const __m512i g = _mm512_i32gather_epi32(ix, grid, 4);
      // lane L = 16-bit word L of the signs: its nibble k to mask bits 4L..4L+3
      const uint64_t nib = 0x000F000F000F000FULL << (4 * k);
      const uint64_t m = _pext_u64(sg[0], nib) | (_pext_u64(sg[1], nib) << 16) | (_pext_u64(sg[2], nib) << 32) |
                         (_pext_u64(sg[3], nib) << 48);
      const __mmask64 neg = _cvtu64_mask64(m);
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t) {
        const __m512i qx = _mm512_loadu_si512(tk.q + t * tk.cols + 256 * i + 64 * k);
        sum[t] = dot_acc<VNNI>(sum[t], g, _mm512_mask_sub_epi8(qx, neg, _mm512_setzero_si512(), qx));
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
      const __m512 f = _mm512_mul_ps(d, _mm512_loadu_ps(tk.dxl + t * (tk.cols / 16) + 16 * i));
      // odd * sum in fp32 from exact operands: the bits of converting the integer product
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(odd, _mm512_cvtepi32_ps(sum[t])), f, acc[t]);
    }
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum16(acc[t]);
}

/// The AVX-512 kernels at one level (VNNI or not) for run_q8_blocks (act_q8.h), tiles of up to 4
/// tokens. IQ2_XS takes whole blocks of rows and tokens (iq2xs_q8_kernel.h), at the Icl level
/// from its own translation unit.
template <bool VNNI>
struct Avx512Q8 {
  Q8Isa isa;

  template <GgmlType T, int TB>
  void lane_row(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) const {
    using G = GgmlType;
    if constexpr (T == G::Q4_K)
      row_q4_k<TB, VNNI, false>(w, tk, y, ldy);
    else if constexpr (T == G::Q5_K)
      row_q4_k<TB, VNNI, true>(w, tk, y, ldy);
    else if constexpr (T == G::Q2_K)
      row_q2_k<TB, VNNI>(w, tk, y, ldy);
    else if constexpr (T == G::Q3_K)
      row_q3_k<TB, VNNI>(w, tk, y, ldy);
    else if constexpr (T == G::IQ3_S)
      row_iq3_s<TB, VNNI>(w, tk, y, ldy);
    else if constexpr (T == G::IQ4_XS)
      row_iq4_xs<TB, VNNI>(w, tk, y, ldy);
    else if constexpr (T == G::Q6_K)
      row_q6_k<TB, VNNI>(w, tk, y, ldy);
    // IQ2_XS never comes here: lane_block takes it
  }
  bool lane_block(const MatmulArgs& m, int64_t t0, int64_t t1, const LaneTokens& tk) const {
    if (m.type != GgmlType::IQ2_XS) return false;
    if (isa >= Q8Isa::Avx512Icl) {
      iq2xs_rows_icl(m.W, m.row_bytes, m.row_begin, m.row_end, t1 - t0, tk, m.y + t0 * m.ldy, m.ldy);
    } else {
      iq2q8::rows<VNNI, false>(m.W, m.row_bytes, m.row_begin, m.row_end, t1 - t0, tk, m.y + t0 * m.ldy, m.ldy);
    }
    return true;
  }
  void b32_block(const MatmulArgs&, const ActQ8&, int64_t, int64_t) const {}
  template <GgmlType T, int TB>
  void b32_row(const uint8_t* w, const Tokens& tk, int64_t, float* y, int64_t ldy) const {
    row_b32<T, TB, VNNI>(w, tk, y, ldy);
  }
};

}  // namespace

float quantize_block_q8_avx512(const float* x, int8_t* q, int16_t* s16) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const __m512 abs_a = _mm512_abs_ps(a), abs_b = _mm512_abs_ps(b);
  // finite: |x| <= FLT_MAX (false for NaN and infinities), as quantize_block_q8 tests it
  const __m512 big = _mm512_set1_ps(3.4028234e38f);
  const __mmask16 ok = _mm512_cmp_ps_mask(abs_a, big, _CMP_LE_OQ) & _mm512_cmp_ps_mask(abs_b, big, _CMP_LE_OQ);
  if (ok != 0xffff) {
    std::memset(q, 0, 32);
    s16[0] = s16[1] = 0;
    return std::nanf("");
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(abs_a, abs_b));  // max is exact, any order
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  // round to nearest even (MXCSR default), as the scalar's 1.5 * 2^23 trick
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  s16[0] = static_cast<int16_t>(_mm512_reduce_add_epi32(qa));
  s16[1] = static_cast<int16_t>(_mm512_reduce_add_epi32(qb));
  return amax / 127.0f;
}

Q8Isa best_q8_isa() {
  if (!__builtin_cpu_supports("avx512vnni")) return Q8Isa::Avx512;
  if (__builtin_cpu_supports("gfni") && __builtin_cpu_supports("avx512vbmi")) {
    const char* env = std::getenv("STRATA_CPU_AMX");
    // (the environment first: with STRATA_CPU_AMX=0 the tile permission is not even requested)
    if (!(env && std::string_view(env) == "0") && amx_int8_usable()) return Q8Isa::Avx512Amx;
    return Q8Isa::Avx512Icl;
  }
  return Q8Isa::Avx512Vnni;
}

bool matmul_q8_avx512(const MatmulArgs& m, const ActQ8& a, Q8Isa isa) {
  // (amx_int8_usable: also requests the tile data permission if no one has yet; without it the
  // first tile instruction would fault)
  if (isa == Q8Isa::Avx512Amx && has_tok16(m.type) && m.n_tok > kQ8_0MatVecMax && amx_int8_usable()) {
    matmul_tok16_amx(m, a);
    return true;
  }
  if (has_tok16(m.type)) {  // tokens in the lanes, the serial definitions (matmul_q8_0_avx512.cpp)
    matmul_tok16_avx512(m, a, isa != Q8Isa::Avx512);
    return true;
  }
  if (isa == Q8Isa::Avx512) {
    Avx512Q8<false> k{isa};
    return run_q8_blocks<4>(m, a, k);
  }
  Avx512Q8<true> k{isa};
  return run_q8_blocks<4>(m, a, k);
}

}  // namespace strata::cpu::kernels::detail
