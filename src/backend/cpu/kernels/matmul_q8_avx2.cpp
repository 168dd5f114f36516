// The q8-activation path, AVX2 (+ FMA, F16C, BMI2): the arithmetic of matmul_q8_ref.cpp, lane
// by lane, with the 16 int32/fp32 lanes of the AVX-512 kernels (matmul_q8_avx512.cpp) held as
// two ymm (lanes 0-7 and 8-15). Products are summed with vpmaddubsw + vpmaddwd (the integers of
// vpdpbusd: no pair sum can saturate for the codes used here), so every result has the bits of
// the scalar definition and of the AVX-512 kernels. Q8_0 is the exception: it runs the serial
// definition (matmul_q8_scalar_avx2) with the tokens in the lanes, matmul_q8_0_avx2.cpp.
//
// Kernels: every type of has_q8_kernel (the 32-weight block types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
// IQ4_NL, MXFP4; Q2_K..Q6_K, IQ2_XS, IQ3_S, IQ4_XS in their lane orders).
// Loop order as in the AVX-512 family (run_q8_blocks in act_q8.h): blocks of 64 tokens, rows,
// tiles of 2 tokens.
#include "backend/cpu/kernels/simd_intrin.h"

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "backend/cpu/kernels/act_q8.h"
#include "backend/cpu/kernels/b32_factors.h"
#include "backend/cpu/kernels/q4_k_lanes_tile.h"
#include "quant/quant_tables.h"

namespace strata::cpu::kernels::detail {

namespace {

constexpr int kPrefetch = kQ8Prefetch;
using b32::b32_factors;
using b32::first_lanes;

/// acc + per int32 lane the sum of its 4 products u * s (u unsigned, s signed bytes; the pair
/// sums must not saturate int16).
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/// Per int32 lane the sum of its 4 products w * x of two signed byte vectors (|w| <= 128, so no
/// pair sum saturates): vpmaddubsw of |w| with x negated where w < 0.
inline __m256i dot_signed(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// ---- 32-weight block types (b32_format; dot_b32 in matmul_q8_ref.cpp) ----

/// The codes u_j of the block at b as 32 unsigned bytes (element j in byte j); for the types
/// with offset 128 (Q8_0, IQ4_NL) the signed values u_j - 128 instead. `table`: values[q] +
/// offset (mod 256) in both 128-bit lanes (types with a value table).
template <GgmlType T>
inline __m256i b32_codes(const uint8_t* b, __m256i table) {
  constexpr B32Format F = b32_format(T);
  if constexpr (F.qs + 32 == F.bytes) {  // Q8_0: the int8 codes
    return load256(b + F.qs);
  } else {
    // [qs, qs] -> low nibbles in the low 128 bits (elements 0-15), high nibbles in the high 128
    const __m256i v2 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + F.qs)));
    __m256i v = _mm256_and_si256(_mm256_srlv_epi64(v2, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
    if constexpr (F.qh >= 0) {
      // bit j of qh -> 16 in byte j: byte j of a broadcast takes byte j/8 of qh, tests bit j%8
      const __m256i hb =
          _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(load_u32(b + F.qh))),
                              _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
      const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
      v = _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit), _mm256_set1_epi8(16)));
    }
    if constexpr (F.table) v = _mm256_shuffle_epi8(table, v);
    return v;
  }
}

/// fd and fc (b32_format) of the first nv (1..8) blocks at wg; zero for blocks nv..7.
/// One group of blocks of a row against TB tokens (FULL: 8 blocks, else nv < 8): block 2p of
/// the group goes to accumulator p % 2, lanes 0-7 (acc[.][.][0]), block 2p+1 to its lanes 8-15
/// (acc[.][.][1]).
template <GgmlType T, int TB, bool FULL>
inline void b32_group(const uint8_t* wg, int nv, const Tokens& tk, const int32_t* x128, int64_t g, __m256i table,
                      __m256 (*acc)[2][2], __m256* corr) {
  constexpr B32Format F = b32_format(T);
  __m256 fd, fc;
  b32_factors<T, FULL>(wg, nv, fd, fc);
  const __m256i m8 = first_lanes(FULL ? 8 : nv);
  alignas(32) float f[TB][8];
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t) {
    const float* dxp = tk.d + t * (tk.cols / 32) + g;
    // the two 16-sums of block b are int32 lane b (pairs of int16)
    const int* sp = reinterpret_cast<const int*>(tk.s + t * (tk.cols / 16) + 2 * g);
    const __m256 dx = FULL ? _mm256_loadu_ps(dxp) : _mm256_maskload_ps(dxp, m8);
    const __m256i s16 = FULL ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)) : _mm256_maskload_epi32(sp, m8);
    corr[t] = _mm256_fmadd_ps(_mm256_mul_ps(fc, dx), _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1))),
                              corr[t]);
    _mm256_store_ps(f[t], _mm256_mul_ps(fd, dx));
  }
#pragma GCC unroll 8
  for (int b = 0; b < (FULL ? 8 : nv); ++b) {
    const __m256i u = b32_codes<T>(wg + F.bytes * b, table);
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
      const __m256i qx = load256(tk.q + t * tk.cols + 32 * (g + b));
      // offset 128: sum(u x) = sum(w x) + 128 * (the lane's code sum, x128 of the token)
      const __m256i s = F.offset == 128
                            ? _mm256_add_epi32(dot_signed(u, qx), load256(x128 + t * (tk.cols / 4) + 8 * (g + b)))
                            : dot_acc(_mm256_setzero_si256(), u, qx);
      __m256& a = acc[t][(b / 2) & 1][b & 1];
      a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(&f[t][b]), a);
    }
  }
}

/// x128 (offset-128 types): per token, 128 * the sum of each int32 lane's 4 codes, cols/4 apart.
template <GgmlType T, int TB>
void row_b32(const uint8_t* w, const Tokens& tk, const int32_t* x128, float* y, int64_t ldy) {
  constexpr B32Format F = b32_format(T);
  __m256 acc[TB][2][2], corr[TB];
  for (int t = 0; t < TB; ++t) {
    acc[t][0][0] = acc[t][0][1] = acc[t][1][0] = acc[t][1][1] = _mm256_setzero_ps();
    corr[t] = _mm256_setzero_ps();
  }
  __m256i table = _mm256_setzero_si256();
  if constexpr (F.table)
    table = _mm256_broadcastsi128_si256(_mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(F.values)),
                                                     _mm_set1_epi8(static_cast<char>(F.offset == 128 ? 0 : F.offset))));
  const int64_t nb = tk.cols / 32;
  int64_t g = 0;
  for (; g + 8 <= nb; g += 8) {
    const uint8_t* wg = w + F.bytes * g;
    for (int o = 0; o < F.bytes * 8; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wg) + kPrefetch + o, _MM_HINT_T0);
    b32_group<T, TB, true>(wg, 8, tk, x128, g, table, acc, corr);
  }
  if (g < nb) b32_group<T, TB, false>(w + F.bytes * g, static_cast<int>(nb - g), tk, x128, g, table, acc, corr);
  for (int t = 0; t < TB; ++t) {
    // s = acc0 + acc1 per lane; hsum16(s) = hsum8(s[0..7] + s[8..15])
    const __m256 lo = _mm256_add_ps(acc[t][0][0], acc[t][1][0]), hi = _mm256_add_ps(acc[t][0][1], acc[t][1][1]);
    y[t * ldy] = simd_hsum8(_mm256_add_ps(lo, hi)) + simd_hsum8(corr[t]);
  }
}

// ---- super-block types in their lane orders (act_q8.h) ----

/// Q4_K (and Q5_K: FIFTH), lane order q4k_lane_element: lanes 0-7 are sub-blocks 0-3 (quant runs
/// 0 and 1), lanes 8-15 sub-blocks 4-7 (runs 2 and 3); chunk k is word k of each run, low
/// nibbles for even sub-blocks, high for odd; Q5_K's 5th bit of sub-block s is bit s of qh's
/// word k, brought to bit 4 by a per-word shift. Definition: dot_q4_k in matmul_q8_ref.cpp.
template <int TB, bool FIFTH>
void row_q4_k(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  constexpr int kBytes = FIFTH ? 176 : 144, kQs = FIFTH ? 48 : 16;
  __m256 acc[TB][2], accm[TB];
  for (int t = 0; t < TB; ++t) acc[t][0] = acc[t][1] = accm[t] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi8(0x0f), shift = _mm256_setr_epi64x(0, 4, 0, 4), bit4 = _mm256_set1_epi8(0x10);
  const __m256i up = _mm256_setr_epi64x(4, 3, 2, 1), down = _mm256_setr_epi64x(0, 1, 2, 3);  // bit s -> bit 4
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += kBytes) {
    for (int o = 0; o < kBytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + o, _MM_HINT_T0);
    __m256 dsc[2], dm;
    q4k_factors(w, dsc, dm);
    const uint8_t* qs = w + kQs;
    __m256i sum[TB][2];
    for (int t = 0; t < TB; ++t) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      __m256i hb = _mm256_setzero_si256();
      if constexpr (FIFTH) {
        long long h;
        std::memcpy(&h, w + 16 + 8 * k, 8);
        hb = _mm256_set1_epi64x(h);
      }
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const __m256i v = words_aabb(qs + 64 * half + 8 * k, qs + 64 * half + 32 + 8 * k);
        __m256i wq = _mm256_and_si256(_mm256_srlv_epi64(v, shift), nib);
        if constexpr (FIFTH) {
          // sub-blocks 4*half .. 4*half+3: bit s to bit 4 by a left shift (s < 4) or right (s > 4)
          const __m256i b4 = half == 0 ? _mm256_sllv_epi64(hb, up) : _mm256_srlv_epi64(hb, down);
          wq = _mm256_or_si256(wq, _mm256_and_si256(b4, bit4));
        }
#pragma GCC unroll 4
        for (int t = 0; t < TB; ++t)
          sum[t][half] = dot_acc(sum[t][half], wq, load256(tk.q + t * tk.cols + 256 * i + 64 * k + 32 * half));
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
      const float* dxl = tk.dxl + t * (tk.cols / 16) + 16 * i;
      for (int half = 0; half < 2; ++half)
        acc[t][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t][half]),
                                       _mm256_mul_ps(dsc[half], _mm256_loadu_ps(dxl + 8 * half)), acc[t][half]);
      accm[t] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(tk.xs + t * (tk.cols / 32) + 8 * i), accm[t]);
    }
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum8(_mm256_add_ps(acc[t][0], acc[t][1])) - simd_hsum8(accm[t]);
}

/// Lanes that are 16-weight groups (Q6_K, IQ4_XS), lanes 8*half..8*half+7 of super-block i:
/// acc + float(sc * (sum - (s16 << OFF))) * (d * dxl) (group_lanes_fma of the AVX-512 family).
template <int OFF>
inline __m256 group_lanes_fma(__m256 acc, __m256i sum, __m256 sc, __m256 d, const LaneTokens& tk, int64_t i, int half) {
  const __m256i s16 =
      _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tk.s16 + 16 * i + 8 * half)));
  const __m256 S = _mm256_mul_ps(sc, _mm256_cvtepi32_ps(_mm256_sub_epi32(sum, _mm256_slli_epi32(s16, OFF))));
  return _mm256_fmadd_ps(S, _mm256_mul_ps(d, _mm256_loadu_ps(tk.dxl + 16 * i + 8 * half)), acc);
}

/// Q6_K, lane order q6k_lane_element (lane L = 16-weight group L): lanes 8n..8n+7 read the low
/// bits from ql bytes 64n..64n+63 and the high bits from qh bytes 32n..32n+31; in chunk k lane
/// L takes dword 4(L%2) + k of the 32-byte run (L%8)/2 % 2 (low bits) / of its qh run (high
/// bits); a per-lane shift picks the nibble, per-lane shifts move the two high bits to 4-5.
/// Definition: dot_q6_k in matmul_q8_ref.cpp.
template <int TB>
void row_q6_k(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  __m256 acc[TB][2];
  for (int t = 0; t < TB; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i nib = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);  // r = (L%8)/2 >= 2: high nibble
  const __m256i up = _mm256_setr_epi32(4, 4, 2, 2, 0, 0, 32, 32), dn = _mm256_setr_epi32(32, 32, 32, 32, 32, 32, 2, 2);
  const __m256i lo4 = _mm256_set1_epi8(0x0f), hi2 = _mm256_set1_epi8(0x30);
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 210) {
    for (int o = 0; o < 210; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + o, _MM_HINT_T0);
    __m256 sc[2];
    i8x16_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)), true, sc);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(w + 208)));
    __m256i sum[TB][2];
    for (int t = 0; t < TB; ++t) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m256i ix = _mm256_setr_epi32(k, 4 + k, k, 4 + k, k, 4 + k, k, 4 + k);
#pragma GCC unroll 2
      for (int n = 0; n < 2; ++n) {
        const __m256i l = _mm256_blend_epi32(_mm256_permutevar8x32_epi32(load256(w + 64 * n), ix),
                                             _mm256_permutevar8x32_epi32(load256(w + 64 * n + 32), ix), 0xcc);
        const __m256i h = _mm256_permutevar8x32_epi32(load256(w + 128 + 32 * n), ix);
        const __m256i hb = _mm256_and_si256(_mm256_or_si256(_mm256_sllv_epi32(h, up), _mm256_srlv_epi32(h, dn)), hi2);
        const __m256i q6 = _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi32(l, nib), lo4), hb);
#pragma GCC unroll 4
        for (int t = 0; t < TB; ++t)
          sum[t][n] = dot_acc(sum[t][n], q6, load256(tk.q + t * tk.cols + 256 * i + 64 * k + 32 * n));
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t)
      for (int n = 0; n < 2; ++n) acc[t][n] = group_lanes_fma<5>(acc[t][n], sum[t][n], sc[n], d, tk.from(t), i, n);
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum8(_mm256_add_ps(acc[t][0], acc[t][1]));
}

/// IQ4_XS in Q6_K's lane order (lane L = low (L even) or high nibbles of qs[16(L/2) ..]): in
/// chunk k, lane L takes dword 4(L/2) + k of qs (lanes 8-15: of qs + 64); vpshufb maps the
/// nibble to kvalues_iq4nl, multiplied signed by signed (vpsignb).
/// Definition: dot_iq4_xs in matmul_q8_ref.cpp.
template <int TB>
void row_iq4_xs(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  __m256 acc[TB][2];
  for (int t = 0; t < TB; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i nib = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4), lo4 = _mm256_set1_epi8(0x0f);
  const __m256i kv =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tables::kvalues_iq4nl)));
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 136) {
    for (int o = 0; o < 136; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + o, _MM_HINT_T0);
    // six-bit scale of group g = L/2, minus 32 (iq4xs_scale): nibble g of scales_l | bits 2g..2g+1
    // of scales_h << 4, with per-lane shifts
    __m256 sc[2];
    const __m256i lo = _mm256_set1_epi32(static_cast<int>(load_u32(w + 4))), hi = _mm256_set1_epi32(load_u16(w + 2));
    for (int n = 0; n < 2; ++n) {
      const __m256i g = _mm256_add_epi32(_mm256_set1_epi32(4 * n), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
      const __m256i l4 = _mm256_and_si256(_mm256_srlv_epi32(lo, _mm256_slli_epi32(g, 2)), _mm256_set1_epi32(0xf));
      const __m256i h2 = _mm256_and_si256(_mm256_srlv_epi32(hi, _mm256_add_epi32(g, g)), _mm256_set1_epi32(3));
      sc[n] =
          _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(l4, _mm256_slli_epi32(h2, 4)), _mm256_set1_epi32(32)));
    }
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(w)));
    __m256i sum[TB][2];
    for (int t = 0; t < TB; ++t) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m256i ix = _mm256_setr_epi32(k, k, 4 + k, 4 + k, 0, 0, 4 + k, 4 + k);
#pragma GCC unroll 2
      for (int n = 0; n < 2; ++n) {
        // lanes 0-3 from the first 32 bytes of the half (groups 0-1), lanes 4-7 from the second
        const __m256i a = _mm256_permutevar8x32_epi32(load256(w + 8 + 64 * n), ix);
        const __m256i b = _mm256_permutevar8x32_epi32(load256(w + 8 + 64 * n + 32),
                                                      _mm256_setr_epi32(0, 0, 0, 0, k, k, 4 + k, 4 + k));
        const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_blend_epi32(a, b, 0xf0), nib), lo4);
        const __m256i u = _mm256_shuffle_epi8(kv, q);
#pragma GCC unroll 4
        for (int t = 0; t < TB; ++t)
          sum[t][n] =
              _mm256_add_epi32(sum[t][n], dot_signed(u, load256(tk.q + t * tk.cols + 256 * i + 64 * k + 32 * n)));
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t)
      for (int n = 0; n < 2; ++n) {
        // sum(kv x) is the definition's sum((kv + 128) x) - 128 * the group's code sum
        const __m256 S = _mm256_mul_ps(sc[n], _mm256_cvtepi32_ps(sum[t][n]));
        acc[t][n] = _mm256_fmadd_ps(S, _mm256_mul_ps(d, _mm256_loadu_ps(tk.dxl + t * (tk.cols / 16) + 16 * i + 8 * n)),
                                    acc[t][n]);
      }
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum8(_mm256_add_ps(acc[t][0], acc[t][1]));
}

/// Lanes 0-7 (n = 0) or 8-15 (n = 1) of Q6_K's lane order over a 64-byte run of 2-bit planes
/// (Q2_K, Q3_K qs): in chunk k lane L takes dword 4(L%2) + k of bytes 32n..32n+31 and the plane
/// 2((L/2)%4) of it.
inline __m256i q2_planes(const uint8_t* qs, int n, __m256i ix) {
  const __m256i shift = _mm256_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6);
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(load256(qs + 32 * n), ix), shift),
                          _mm256_set1_epi8(3));
}

/// Q2_K in Q6_K's lane order (lane L = 16-weight group L): the group's 4-bit scale multiplies the
/// lane's integer sum, its 4-bit min the group's code sum. Definition: dot_q2_k.
template <int TB>
void row_q2_k(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  __m256 acc[TB][2], accm[TB][2];
  for (int t = 0; t < TB; ++t) acc[t][0] = acc[t][1] = accm[t][0] = accm[t][1] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi32(0xf);
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 84) {
    for (int o = 0; o < 84; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + o, _MM_HINT_T0);
    __m256 sc[2], mn[2];
    for (int n = 0; n < 2; ++n) {
      const __m256i s8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * n)));
      sc[n] = _mm256_cvtepi32_ps(_mm256_and_si256(s8, nib));
      mn[n] = _mm256_cvtepi32_ps(_mm256_srli_epi32(s8, 4));
    }
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(w + 80))), dmin = _mm256_set1_ps(_cvtsh_ss(load_u16(w + 82)));
    __m256i sum[TB][2];
    for (int t = 0; t < TB; ++t) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m256i ix = _mm256_setr_epi32(k, 4 + k, k, 4 + k, k, 4 + k, k, 4 + k);
#pragma GCC unroll 2
      for (int n = 0; n < 2; ++n) {
        const __m256i q = q2_planes(w + 16, n, ix);
#pragma GCC unroll 2
        for (int t = 0; t < TB; ++t)
          sum[t][n] = dot_acc(sum[t][n], q, load256(tk.q + t * tk.cols + 256 * i + 64 * k + 32 * n));
      }
    }
#pragma GCC unroll 2
    for (int t = 0; t < TB; ++t)
      for (int n = 0; n < 2; ++n) {
        const __m256 x = _mm256_loadu_ps(tk.dxl + t * (tk.cols / 16) + 16 * i + 8 * n);
        const __m256i s16 = _mm256_cvtepi16_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(tk.s16 + t * (tk.cols / 16) + 16 * i + 8 * n)));
        acc[t][n] =
            _mm256_fmadd_ps(_mm256_mul_ps(sc[n], _mm256_cvtepi32_ps(sum[t][n])), _mm256_mul_ps(d, x), acc[t][n]);
        accm[t][n] = _mm256_fmadd_ps(_mm256_mul_ps(mn[n], _mm256_cvtepi32_ps(s16)), _mm256_mul_ps(dmin, x), accm[t][n]);
      }
  }
  for (int t = 0; t < TB; ++t)
    y[t * ldy] = simd_hsum8(_mm256_add_ps(acc[t][0], acc[t][1])) - simd_hsum8(_mm256_add_ps(accm[t][0], accm[t][1]));
}

/// Q3_K in Q6_K's lane order: low 2 bits as Q2_K's planes, the third from hmask (lane L takes
/// dword 4(L%2) + k of it; bit L/2 of each byte is shifted to bit 2); the -4 offset and the six-bit
/// scale act on the lane's sum (q3k_scale, vectorized). Definition: dot_q3_k.
template <int TB>
void row_q3_k(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  __m256 acc[TB][2];
  for (int t = 0; t < TB; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  // bit L/2 of each byte to bit 2: left by 2 - L/2 (L/2 <= 2) or right by L/2 - 2
  const __m256i up[2] = {_mm256_setr_epi32(2, 2, 1, 1, 0, 0, 32, 32), _mm256_set1_epi32(32)};
  const __m256i dn[2] = {_mm256_setr_epi32(32, 32, 32, 32, 32, 32, 1, 1), _mm256_setr_epi32(2, 2, 3, 3, 4, 4, 5, 5)};
  // six-bit scale of group L: low 4 bits of byte L%8 >> 4(L/8), high 2 of byte 8 + L%4 >> 2(L/4)
  const __m256i lo_byte =
      _mm256_setr_epi32(0x80808000, 0x80808001, 0x80808002, 0x80808003, 0x80808004, 0x80808005, 0x80808006, 0x80808007);
  const __m256i hi_byte =
      _mm256_setr_epi32(0x80808008, 0x80808009, 0x8080800a, 0x8080800b, 0x80808008, 0x80808009, 0x8080800a, 0x8080800b);
  const __m256i hi_shift[2] = {_mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2), _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6)};
  const __m256i bit2 = _mm256_set1_epi8(4);
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 110) {
    for (int o = 0; o < 110; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + o, _MM_HINT_T0);
    const __m256i sb =
        _mm256_broadcastsi128_si256(_mm_insert_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 96)),
                                                     static_cast<int>(load_u32(w + 104)), 2));
    const __m256i lo = _mm256_shuffle_epi8(sb, lo_byte), hi = _mm256_shuffle_epi8(sb, hi_byte);
    __m256 sc[2];
    for (int n = 0; n < 2; ++n) {
      const __m256i l4 = _mm256_and_si256(_mm256_srli_epi32(lo, 4 * n), _mm256_set1_epi32(0xf));
      const __m256i h2 = _mm256_and_si256(_mm256_srlv_epi32(hi, hi_shift[n]), _mm256_set1_epi32(3));
      sc[n] =
          _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(l4, _mm256_slli_epi32(h2, 4)), _mm256_set1_epi32(32)));
    }
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(w + 108)));
    const __m256i hm = load256(w);
    __m256i sum[TB][2];
    for (int t = 0; t < TB; ++t) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m256i ix = _mm256_setr_epi32(k, 4 + k, k, 4 + k, k, 4 + k, k, 4 + k);
      const __m256i h = _mm256_permutevar8x32_epi32(hm, ix);
#pragma GCC unroll 2
      for (int n = 0; n < 2; ++n) {
        const __m256i hb =
            _mm256_and_si256(_mm256_or_si256(_mm256_sllv_epi32(h, up[n]), _mm256_srlv_epi32(h, dn[n])), bit2);
        const __m256i u = _mm256_or_si256(q2_planes(w + 32, n, ix), hb);
#pragma GCC unroll 2
        for (int t = 0; t < TB; ++t)
          sum[t][n] = dot_acc(sum[t][n], u, load256(tk.q + t * tk.cols + 256 * i + 64 * k + 32 * n));
      }
    }
#pragma GCC unroll 2
    for (int t = 0; t < TB; ++t)
      for (int n = 0; n < 2; ++n) acc[t][n] = group_lanes_fma<2>(acc[t][n], sum[t][n], sc[n], d, tk.from(t), i, n);
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum8(_mm256_add_ps(acc[t][0], acc[t][1]));
}

/// Byte masks (0xff where the bit is set): byte 4L + j of the result is bit j of the low byte of
/// 32-bit lane L of v (j = 0..3, so the low nibble).
inline __m256i nibble_masks(__m256i v) {
  const __m256i rep = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8,
                                       8, 8, 12, 12, 12, 12);
  const __m256i bits = _mm256_set1_epi32(0x08040201);
  return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(v, rep), bits), bits);
}

/// x with the bytes under mask m (0xff) negated.
inline __m256i negate_where(__m256i x, __m256i m) {
  return _mm256_sign_epi8(x, _mm256_or_si256(m, _mm256_set1_epi8(1)));
}

/// IQ3_S in Q6_K's lane order: in chunk k lane L's grid entry is 4L + k, byte k of qs dword L
/// with its 9th bit, bit 4(L%8) + k of qh word L/8, gathered by one vpgatherdd per 8 lanes; the
/// signs of lane L are nibble k of 16-bit word L of the signs; the odd 4-bit block scale
/// multiplies the lane's integer sum. Definition: dot_iq3_s.
template <int TB>
void row_iq3_s(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  __m256 acc[TB][2];
  for (int t = 0; t < TB; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i lo8 = _mm256_set1_epi32(0xff), one = _mm256_set1_epi32(1);
  const __m256i hshift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const int* grid = reinterpret_cast<const int*>(tables::iq3s_grid);
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 110) {
    for (int o = 0; o < 110; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + o, _MM_HINT_T0);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(w)));
    // odd scale 1 + 2 * ls of 32-block L/2: nibble L/2 of the 4 scale bytes
    const __m256i sv = _mm256_set1_epi32(static_cast<int>(load_u32(w + 106)));
    __m256 odd[2];
    for (int n = 0; n < 2; ++n) {
      const __m256i sh = _mm256_add_epi32(_mm256_set1_epi32(16 * n), _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12));
      const __m256i ls = _mm256_and_si256(_mm256_srlv_epi32(sv, sh), _mm256_set1_epi32(0xf));
      odd[n] = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(ls, ls), one));
    }
    __m256i qs[2], qh[2], sg[2];
    for (int n = 0; n < 2; ++n) {
      qs[n] = load256(w + 2 + 32 * n);
      qh[n] = _mm256_set1_epi32(static_cast<int>(load_u32(w + 66 + 4 * n)));
      sg[n] = _mm256_cvtepu16_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 74 + 16 * n)));  // word L in lane L
    }
    __m256i sum[TB][2];
    for (int t = 0; t < TB; ++t) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
#pragma GCC unroll 2
      for (int n = 0; n < 2; ++n) {
        const __m256i hb = _mm256_slli_epi32(
            _mm256_and_si256(_mm256_srlv_epi32(qh[n], _mm256_add_epi32(hshift, _mm256_set1_epi32(k))), one), 8);
        const __m256i ix = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(qs[n], 8 * k), lo8), hb);
        const __m256i g = _mm256_i32gather_epi32(grid, ix, 4);
        const __m256i neg = nibble_masks(_mm256_srli_epi32(sg[n], 4 * k));
#pragma GCC unroll 2
        for (int t = 0; t < TB; ++t) {
          const __m256i qx = load256(tk.q + t * tk.cols + 256 * i + 64 * k + 32 * n);
          sum[t][n] = dot_acc(sum[t][n], g, negate_where(qx, neg));
        }
      }
    }
#pragma GCC unroll 2
    for (int t = 0; t < TB; ++t)
      for (int n = 0; n < 2; ++n) {
        const __m256 f = _mm256_mul_ps(d, _mm256_loadu_ps(tk.dxl + t * (tk.cols / 16) + 16 * i + 8 * n));
        acc[t][n] = _mm256_fmadd_ps(_mm256_mul_ps(odd[n], _mm256_cvtepi32_ps(sum[t][n])), f, acc[t][n]);
      }
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum8(_mm256_add_ps(acc[t][0], acc[t][1]));
}

/// IQ2_XS in its gather-native lane order (iq2xs_lane_element): lanes 0-7 (n = 0) are 32-blocks
/// 0-3, lanes 8-15 blocks 4-7; in chunk k the lane pair (2s, 2s+1) of a half is grid entry
/// 4(4n + s) + k, word k of 64-bit word s of the half's codes, so one 4-entry vpgatherqq gives
/// the chunk's magnitudes in lane order; each code's sign byte (7 bits + parity, computed with
/// shifts) is spread over its entry's 8 bytes and negates the activation codes; the odd scales
/// 2*ls+1 weight the pair sums in integers (vpmaddwd). Definition: dot_iq2_xs.
template <int TB>
void row_iq2_xs(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  __m256 acc[TB][2];
  for (int t = 0; t < TB; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i m511 = _mm256_set1_epi64x(511), one = _mm256_set1_epi16(1);
  const __m256i rep =
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
  const __m256i bits = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const long long* grid = reinterpret_cast<const long long*>(tables::iq2xs_grid);
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 74) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + 64, _MM_HINT_T0);
    const __m256 dq = _mm256_set1_ps(_cvtsh_ss(load_u16(w)) * 0.125f);
    __m256i codes[2], sb[2], odd[2][2];
    for (int n = 0; n < 2; ++n) {
      codes[n] = load256(w + 2 + 32 * n);
      // sign byte of every code in the low byte of its word: bits 9-15 and their parity as bit 7
      const __m256i k7 = _mm256_srli_epi16(codes[n], 9);
      __m256i par = _mm256_xor_si256(k7, _mm256_srli_epi16(k7, 4));
      par = _mm256_xor_si256(par, _mm256_srli_epi16(par, 2));
      par = _mm256_xor_si256(par, _mm256_srli_epi16(par, 1));
      sb[n] = _mm256_or_si256(k7, _mm256_slli_epi16(_mm256_and_si256(par, one), 7));
      // odd scales of scale byte 4n + L/2: low nibble for chunks 0-1, high for 2-3, in both words
      const __m256i sv = _mm256_set1_epi32(static_cast<int>(load_u32(w + 66 + 4 * n)));
      for (int c = 0; c < 2; ++c) {
        const __m256i sh = _mm256_add_epi32(_mm256_set1_epi32(4 * c), _mm256_setr_epi32(0, 0, 8, 8, 16, 16, 24, 24));
        const __m256i ls = _mm256_and_si256(_mm256_srlv_epi32(sv, sh), _mm256_set1_epi32(0xf));
        const __m256i o = _mm256_add_epi32(_mm256_add_epi32(ls, ls), _mm256_set1_epi32(1));
        odd[n][c] = _mm256_or_si256(o, _mm256_slli_epi32(o, 16));
      }
    }
    __m256i sum[TB][2];
    for (int t = 0; t < TB; ++t) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
#pragma GCC unroll 2
      for (int n = 0; n < 2; ++n) {
        const __m256i wq = _mm256_i64gather_epi64(grid, _mm256_and_si256(_mm256_srli_epi64(codes[n], 16 * k), m511), 8);
        const __m256i neg =
            _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_srli_epi64(sb[n], 16 * k), rep), bits), bits);
#pragma GCC unroll 2
        for (int t = 0; t < TB; ++t) {
          const __m256i qx = load256(tk.q + t * tk.cols + 256 * i + 64 * k + 32 * n);
          // pair sums cannot saturate: 2 * 43 * 127 < 2^15
          const __m256i pairs = _mm256_maddubs_epi16(wq, negate_where(qx, neg));
          sum[t][n] = _mm256_add_epi32(sum[t][n], _mm256_madd_epi16(pairs, odd[n][k / 2]));
        }
      }
    }
#pragma GCC unroll 2
    for (int t = 0; t < TB; ++t)
      for (int n = 0; n < 2; ++n) {
        const __m256 dx = _mm256_loadu_ps(tk.dxl + t * (tk.cols / 16) + 16 * i + 8 * n);
        acc[t][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t][n]), _mm256_mul_ps(dq, dx), acc[t][n]);
      }
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum8(_mm256_add_ps(acc[t][0], acc[t][1]));
}

// ---- prefill tiles (gemm_q8_avx2): several rows and tokens per pass over the weights ----
//
// The same arithmetic per (row, token) as the row kernels above (so the same bits, for any
// tile): only the order in which independent accumulators are visited changes, and integer
// sums are regrouped (exact).

/// fd and fc (b32_factors) of rows [0, nr) of a row tile, made once per row tile and reused by
/// every token tile: group g (blocks 8g..8g+7) of row r at fdc + (r ng + g) 16, fd in floats 0-7
/// and fc in 8-15 (ng = round_up(nb, 8) / 8; a partial last group as b32_factors makes it).
template <GgmlType T>
inline void tile_b32_row_factors(const uint8_t* w, size_t row_bytes, int nr, int64_t nb, float* fdc) {
  constexpr B32Format F = b32_format(T);
  const int64_t ng = (nb + 7) / 8;
  for (int r = 0; r < nr; ++r) {
    const uint8_t* wr = w + row_bytes * static_cast<size_t>(r);
    for (int64_t g = 0; g < ng; ++g) {
      const int nv = nb - 8 * g < 8 ? static_cast<int>(nb - 8 * g) : 8;
      __m256 fd, fc;
      if (nv == 8)
        b32_factors<T, true>(wr + F.bytes * 8 * g, 8, fd, fc);
      else
        b32_factors<T, false>(wr + F.bytes * 8 * g, nv, fd, fc);
      _mm256_storeu_ps(fdc + (r * ng + g) * 16, fd);
      _mm256_storeu_ps(fdc + (r * ng + g) * 16 + 8, fc);
    }
  }
}

/// The per-block factors of an RB x TB tile of a 32-weight block type, with row_b32's
/// operations: f[((b/8 * RB + r) * TB + t) * 8 + b % 8] = fd(r, b) * dx(t, b) (f: scratch of
/// RB * TB * round_up(nb, 8) floats), and corr[r][t] the fc corrections summed per lane of 8
/// blocks in increasing groups (b32_group). fdc: tile_b32_row_factors of the tile's rows. The
/// token's code sums of a group are converted once for the RB rows (the same values).
template <int RB, int TB>
inline void tile_b32_factors(const float* fdc, const Tokens& tk, float* f, __m256 (&corr)[RB][TB]) {
  const int64_t nb = tk.cols / 32, ng = (nb + 7) / 8, ld = nb, ls = tk.cols / 16;
  const float* const d = tk.d;
  const int16_t* const s16p = tk.s;
  __m256 c[RB][TB];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) c[r][t] = _mm256_setzero_ps();
  const auto group = [&](int64_t g, auto full) __attribute__((always_inline)) {
    constexpr bool FULL = decltype(full)::value;
    const __m256i m8 = first_lanes(FULL ? 8 : static_cast<int>(nb - 8 * g));
    __m256 fd[RB], fc[RB];
    for (int r = 0; r < RB; ++r) {
      fd[r] = _mm256_loadu_ps(fdc + (r * ng + g) * 16);
      fc[r] = _mm256_loadu_ps(fdc + (r * ng + g) * 16 + 8);
    }
    float* fg = f + g * (RB * TB * 8);
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
      const float* dxp = d + t * ld + 8 * g;
      const int* sp = reinterpret_cast<const int*>(s16p + t * ls + 16 * g);
      const __m256 dx = FULL ? _mm256_loadu_ps(dxp) : _mm256_maskload_ps(dxp, m8);
      const __m256i sv =
          FULL ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)) : _mm256_maskload_epi32(sp, m8);
      const __m256 sx = _mm256_cvtepi32_ps(_mm256_madd_epi16(sv, _mm256_set1_epi16(1)));
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) {
        c[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(fc[r], dx), sx, c[r][t]);
        _mm256_storeu_ps(fg + (r * TB + t) * 8, _mm256_mul_ps(fd[r], dx));
      }
    }
  };
  int64_t g = 0;
  for (; 8 * g + 8 <= nb; ++g) group(g, std::true_type{});
  if (g < ng) group(g, std::false_type{});
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) corr[r][t] = c[r][t];
}

/// RB rows x TB tokens of a 32-weight block type. Per (row, token), row_b32's four accumulators
/// take blocks b = 4j + a (a = b % 4: acc[(b/2)&1][b&1]) in increasing b; here accumulator a is
/// finished before a + 1 starts (a pass over blocks a, a+4, ...), so one ymm per (row, token)
/// is live and each block's codes are unpacked once per tile and reused by its TB tokens.
/// The per-block factors fd*dx and the fc corrections are formed first, with row_b32's
/// operations (tile_b32_factors from fdc; f: scratch of RB*TB*round_up(nb, 8) floats,
/// block-major). The tokens' codes and
/// x128 come block-major (BlockMajor, made once per token block): block b of the tile's token t
/// at xq + b*bs + 32t, its x128 lanes at x1 + b*bs/4 + 8t.
template <GgmlType T, int RB, int TB>
void tile_b32(const uint8_t* w, size_t row_bytes, const float* fdc, const Tokens& tk, const int8_t* xq,
              const int32_t* x1, int64_t bs, float* f, float* y, int64_t ldy) {
  constexpr B32Format F = b32_format(T);
  const int64_t nb = tk.cols / 32;
  __m256 corr[RB][TB];
  tile_b32_factors<RB, TB>(fdc, tk, f, corr);
  __m256i table = _mm256_setzero_si256();
  if constexpr (F.table)
    table = _mm256_broadcastsi128_si256(_mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(F.values)),
                                                     _mm_set1_epi8(static_cast<char>(F.offset == 128 ? 0 : F.offset))));
  __m256 acc4[4][RB][TB];
  const uint8_t* w1 = w + (RB > 1 ? row_bytes : 0);
  for (int a = 0; a < 4; ++a) {
    __m256 acc[RB][TB];
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < TB; ++t) acc[r][t] = _mm256_setzero_ps();
    const uint8_t* wa = w + F.bytes * a;
    const uint8_t* wb = w1 + F.bytes * a;
    const int8_t* qa = xq + bs * a;
    const int32_t* xa = x1 + bs / 4 * a;
    // block b's factor for (r, t): f[((b/8 * RB + r) * TB + t) * 8 + b % 8]
    const float* fa = f + a;
    const auto step = [&](const float* fb) __attribute__((always_inline)) {
      __m256i u[RB], au[RB];
      u[0] = b32_codes<T>(wa, table);
      if constexpr (RB > 1) u[1] = b32_codes<T>(wb, table);
      for (int r = 0; r < RB; ++r)
        if constexpr (F.offset == 128) au[r] = _mm256_abs_epi8(u[r]);
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t) {
        const __m256i qx = load256(qa + 32 * t);
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) {
          // offset 128: sum(u x) = sum(w x) + 128 * (the lane's code sum), as in b32_group
          __m256i s;
          if constexpr (F.offset == 128)
            s = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(au[r], _mm256_sign_epi8(qx, u[r])),
                                                   _mm256_set1_epi16(1)),
                                 load256(xa + 8 * t));
          else
            s = _mm256_madd_epi16(_mm256_maddubs_epi16(u[r], qx), _mm256_set1_epi16(1));
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(fb + (r * TB + t) * 8), acc[r][t]);
        }
      }
      wa += 4 * F.bytes;
      wb += 4 * F.bytes;
      qa += 4 * bs;
      xa += bs;
    };
    int64_t b = a;
    for (; b + 4 < nb; b += 8, fa += 8 * RB * TB) {
      step(fa);
      step(fa + 4);
    }
    if (b < nb) step(fa);
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < TB; ++t) acc4[a][r][t] = acc[r][t];
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) {
      // row_b32: lo = acc[0][0] + acc[1][0] (blocks 4j, 4j+2), hi = acc[0][1] + acc[1][1]
      const __m256 lo = _mm256_add_ps(acc4[0][r][t], acc4[2][r][t]), hi = _mm256_add_ps(acc4[1][r][t], acc4[3][r][t]);
      y[t * ldy + r] = simd_hsum8(_mm256_add_ps(lo, hi)) + simd_hsum8(corr[r][t]);
    }
}

/// TB tokens of one IQ4_XS row (row_iq4_xs's arithmetic, halves outermost so that TB int32 sums
/// are live): the 64 codes of a chunk are unpacked once (two vpermd, a blend, vpshufb) for the
/// TB tokens.
template <int TB>
void tile_iq4_xs(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  __m256 acc[TB][2];
  for (int t = 0; t < TB; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i nib = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4), lo4 = _mm256_set1_epi8(0x0f);
  const __m256i kv =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tables::kvalues_iq4nl)));
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 136) {
    __m256 sc[2];
    const __m256i lo = _mm256_set1_epi32(static_cast<int>(load_u32(w + 4))), hi = _mm256_set1_epi32(load_u16(w + 2));
    for (int n = 0; n < 2; ++n) {
      const __m256i g = _mm256_add_epi32(_mm256_set1_epi32(4 * n), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
      const __m256i l4 = _mm256_and_si256(_mm256_srlv_epi32(lo, _mm256_slli_epi32(g, 2)), _mm256_set1_epi32(0xf));
      const __m256i h2 = _mm256_and_si256(_mm256_srlv_epi32(hi, _mm256_add_epi32(g, g)), _mm256_set1_epi32(3));
      sc[n] =
          _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(l4, _mm256_slli_epi32(h2, 4)), _mm256_set1_epi32(32)));
    }
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(w)));
#pragma GCC unroll 2
    for (int n = 0; n < 2; ++n) {
      __m256i sum[TB];
      for (int t = 0; t < TB; ++t) sum[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const __m256i ix = _mm256_setr_epi32(k, k, 4 + k, 4 + k, 0, 0, 4 + k, 4 + k);
        const __m256i a = _mm256_permutevar8x32_epi32(load256(w + 8 + 64 * n), ix);
        const __m256i b = _mm256_permutevar8x32_epi32(load256(w + 8 + 64 * n + 32),
                                                      _mm256_setr_epi32(0, 0, 0, 0, k, k, 4 + k, 4 + k));
        const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_blend_epi32(a, b, 0xf0), nib), lo4);
        const __m256i u = _mm256_shuffle_epi8(kv, q), au = _mm256_abs_epi8(u);
#pragma GCC unroll 4
        for (int t = 0; t < TB; ++t) {
          const __m256i qx = load256(tk.q + t * tk.cols + 256 * i + 64 * k + 32 * n);
          sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(au, _mm256_sign_epi8(qx, u)),
                                                              _mm256_set1_epi16(1)));
        }
      }
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t) {
        const __m256 S = _mm256_mul_ps(sc[n], _mm256_cvtepi32_ps(sum[t]));
        acc[t][n] = _mm256_fmadd_ps(S, _mm256_mul_ps(d, _mm256_loadu_ps(tk.dxl + t * (tk.cols / 16) + 16 * i + 8 * n)),
                                    acc[t][n]);
      }
    }
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum8(_mm256_add_ps(acc[t][0], acc[t][1]));
}

}  // namespace

float quantize_block_q8_avx2(const float* x, int8_t* q, int16_t* s16) {
  __m256 v[4], amax = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // finite: |x| <= FLT_MAX (false for NaN and infinities), as quantize_block_q8 tests it
  const __m256 big = _mm256_set1_ps(3.4028234e38f);
  int ok = 0xff;
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm256_loadu_ps(x + 8 * c);
    const __m256 a = _mm256_and_ps(v[c], abs_mask);
    ok &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ));
    amax = _mm256_max_ps(amax, a);
  }
  if (ok != 0xff) {
    std::memset(q, 0, 32);
    s16[0] = s16[1] = 0;
    return std::nanf("");
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));  // max is exact, any order
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float am = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float id = am > 0.0f ? 127.0f / am : 0.0f;
  __m256i qi[4];
  // round to nearest even (MXCSR default), as the scalar's 1.5 * 2^23 trick
  for (int c = 0; c < 4; ++c) qi[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], _mm256_set1_ps(id)));
  // packs interleave 128-bit lanes: [0-3 8-11 4-7 12-15] per 16-bit pack, fixed by one dword permute
  const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
  const __m256i p8 =
      _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p8);
  for (int h = 0; h < 2; ++h) {
    const __m256i s = _mm256_add_epi32(qi[2 * h], qi[2 * h + 1]);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    s16[h] = static_cast<int16_t>(_mm_cvtsi128_si32(s4));
  }
  return am / 127.0f;
}

namespace {

/// The AVX2 kernels for run_q8_blocks (act_q8.h). Tiles of 2 tokens: sums and accumulators of
/// 16 lanes are 2 ymm each per token (the 32-weight types: 4 accumulators per token, 16 ymm
/// registers in all).
struct Avx2Q8 {
  std::vector<int32_t>& x128;  ///< offset-128 types: per token of the block, 128 * each lane's code sum

  template <GgmlType T, int TB>
  void lane_row(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) const {
    using G = GgmlType;
    if constexpr (T == G::Q4_K)
      row_q4_k<TB, false>(w, tk, y, ldy);
    else if constexpr (T == G::Q5_K)
      row_q4_k<TB, true>(w, tk, y, ldy);
    else if constexpr (T == G::Q6_K)
      row_q6_k<TB>(w, tk, y, ldy);
    else if constexpr (T == G::IQ4_XS)
      row_iq4_xs<TB>(w, tk, y, ldy);
    else if constexpr (T == G::Q2_K)
      row_q2_k<TB>(w, tk, y, ldy);
    else if constexpr (T == G::Q3_K)
      row_q3_k<TB>(w, tk, y, ldy);
    else if constexpr (T == G::IQ3_S)
      row_iq3_s<TB>(w, tk, y, ldy);
    else
      row_iq2_xs<TB>(w, tk, y, ldy);  // IQ2_XS: with_lane_type lists exactly these
  }
  bool lane_block(const MatmulArgs&, int64_t, int64_t, const LaneTokens&) const { return false; }

  /// x128 for the tokens [t0, t1) when the type has offset 128 (Q8_0, IQ4_NL).
  void b32_block(const MatmulArgs& m, const ActQ8& a, int64_t t0, int64_t t1) const {
    if (b32_format(m.type).offset != 128) return;
    const int64_t nl = a.cols / 4;
    x128.resize(static_cast<size_t>((t1 - t0) * nl));
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t l = 0; l < nl; l += 8) {  // 8 lanes (one block of 32 codes) at a time
        const __m256i q = load256(a.qt(t) + 4 * l);
        const __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(x128.data() + (t - t0) * nl + l), _mm256_slli_epi32(sum, 7));
      }
  }
  template <GgmlType T, int TB>
  void b32_row(const uint8_t* w, const Tokens& tk, int64_t i, float* y, int64_t ldy) const {
    row_b32<T, TB>(w, tk, x128.data() + i * (tk.cols / 4), y, ldy);
  }
};

}  // namespace

/// Calls fn(integral_constant<int, N>) for n = 1..NMAX (a tile size known at compile time).
template <int NMAX, class Fn>
inline void with_count(int64_t n, Fn&& fn) {
  if constexpr (NMAX > 1) {
    if (n >= NMAX) {
      fn(std::integral_constant<int, NMAX>{});
      return;
    }
    with_count<NMAX - 1>(n, fn);
  } else {
    fn(std::integral_constant<int, 1>{});
  }
}

/// Tiles of the prefill driver: rows x tokens of the 32-weight block types (2 x 4: 8
/// accumulators, 2 + 2 code registers), tokens per row of Q4_K/Q5_K/IQ4_XS.
constexpr int kTileTok = 4, kTileRows = 2, kB32Tok = 4;

/// The prefill driver (n_tok >= kTileTok): tokens in blocks of kQ8TokBlock (their codes stay in
/// L2), rows in tiles of kTileRows whose weights stay in L1 while the block's token tiles pass.
/// False for the types without a tile kernel (they take run_q8_blocks).
bool gemm_q8_avx2(const MatmulArgs& m, const ActQ8& a) {
  using G = GgmlType;
  const G T = m.type;
  const bool lane = T == G::Q4_K || T == G::Q5_K || T == G::IQ4_XS;
  if (!lane && b32_format(T).bytes == 0) return false;
  thread_local std::vector<float> f;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<int32_t> x1;
  f.resize(static_cast<size_t>(kTileRows * kB32Tok * (m.cols / 32 + 8)));
  thread_local std::vector<float> fdc;  // tile_b32_row_factors of the current row tile
  fdc.resize(static_cast<size_t>(kTileRows * 16 * ((m.cols / 32 + 7) / 8)));
  for (int64_t t0 = 0; t0 < m.n_tok; t0 += kQ8TokBlock) {
    const int64_t t1 = m.n_tok < t0 + kQ8TokBlock ? m.n_tok : t0 + kQ8TokBlock;
    if (lane) {
      const LaneTokens tk = lane_tokens(T, a, t0, t1);
      const bool vnni = avx_vnni_usable();
      for (int64_t r = m.row_begin; r < m.row_end; ++r) {
        const uint8_t* w = m.W + static_cast<size_t>(r) * m.row_bytes;
        for (int64_t t = t0; t < t1; t += kTileTok) {
          float* y = m.y + t * m.ldy + r;
          with_count<kTileTok>(t1 - t, [&](auto nt) {
            constexpr int NT = decltype(nt)::value;
            if ((T == G::Q4_K || T == G::Q5_K) && vnni)  // the same bits, vpdpbusd for vpmaddubsw + vpaddw
              tile_q4_k_avxvnni(NT, T == G::Q5_K, w, tk.from(t - t0), y, m.ldy);
            else if (T == G::Q4_K)
              tile_q4_k<NT, false, false>(w, tk.from(t - t0), y, m.ldy);
            else if (T == G::Q5_K)
              tile_q4_k<NT, true, false>(w, tk.from(t - t0), y, m.ldy);
            else
              tile_iq4_xs<NT>(w, tk.from(t - t0), y, m.ldy);
          });
        }
      }
      continue;
    }
    // the codes (and x128) of each tile of kB32Tok tokens block-major and contiguous: tile j
    // (tokens t0 + kB32Tok j ..., n of them) from byte kB32Tok j cols, block b of its token t at
    // + (b n + t) 32 (no power-of-two stride between a tile's blocks)
    const int64_t nb = a.cols / 32;
    xq.resize(static_cast<size_t>(nb * 32 * (t1 - t0)));
    x1.resize(static_cast<size_t>(nb * 8 * (t1 - t0)));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j = (t - t0) / kB32Tok, tt = (t - t0) % kB32Tok;
      const int64_t n = t1 - t0 - kB32Tok * j < kB32Tok ? t1 - t0 - kB32Tok * j : kB32Tok;
      int8_t* qd = xq.data() + kB32Tok * j * a.cols + 32 * tt;
      int32_t* xd = x1.data() + kB32Tok * j * (a.cols / 4) + 8 * tt;
      for (int64_t b = 0; b < nb; ++b) {
        const __m256i q = load256(a.qt(t) + 32 * b);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qd + 32 * n * b), q);
        if (b32_format(T).offset == 128) {
          const __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(xd + 8 * n * b), _mm256_slli_epi32(sum, 7));
        }
      }
    }
    with_b32_type(T, [&](auto type) {
      constexpr G TT = decltype(type)::value;
      for (int64_t r = m.row_begin; r < m.row_end; r += kTileRows) {
        const uint8_t* w = m.W + static_cast<size_t>(r) * m.row_bytes;
        tile_b32_row_factors<TT>(w, m.row_bytes,
                                 m.row_end - r < kTileRows ? static_cast<int>(m.row_end - r) : kTileRows, nb,
                                 fdc.data());
        for (int64_t t = t0; t < t1; t += kB32Tok) {
          const Tokens tk{a.qt(t), a.dt(t), a.st(t), a.cols};
          float* y = m.y + t * m.ldy + r;
          const int8_t* q = xq.data() + (t - t0) * a.cols;
          const int32_t* x = x1.data() + (t - t0) * (a.cols / 4);
          const int64_t bs = 32 * (t1 - t < kB32Tok ? t1 - t : kB32Tok);
          with_count<kTileRows>(m.row_end - r, [&](auto nr) {
            with_count<kB32Tok>(t1 - t, [&](auto n) {
              tile_b32<TT, decltype(nr)::value, decltype(n)::value>(w, m.row_bytes, fdc.data(), tk, q, x, bs, f.data(),
                                                                    y, m.ldy);
            });
          });
        }
      }
    });
  }
  return true;
}

bool matmul_q8_avx2(const MatmulArgs& m, const ActQ8& a) {
  thread_local std::vector<int32_t> x128;
  if (m.type == GgmlType::Q8_0) {  // the serial definition, tokens in the lanes (matmul_q8_0_avx2.cpp)
    matmul_q8_0_avx2(m, a);
    return true;
  }
  if (m.n_tok >= kTileTok && gemm_q8_avx2(m, a)) return true;
  Avx2Q8 k{x128};
  return run_q8_blocks<2>(m, a, k);
}

}  // namespace strata::cpu::kernels::detail
