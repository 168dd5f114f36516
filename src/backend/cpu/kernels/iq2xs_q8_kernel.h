#pragma once
// The IQ2_XS row kernel of the q8 path, shared by matmul_q8_avx512.cpp (AVX-512 F/BW/VL/DQ,
// with or without VNNI) and matmul_q8_iq2xs_avx512icl.cpp (+ GFNI and BITALG). Included only
// by those; internal linkage, so each translation unit keeps its own instruction-set copy.
//
// Per super-block (256 weights: fp16 d, 32 codes of 16 bits = 9-bit grid index + 7-bit sign
// index, 8 scale bytes of two 4-bit scales) and chunk k (0..3) of 64 weights:
//  - the 8 grid entries of chunk k are entries 4s + k, s = 0..7 (iq2xs_lane_element), i.e.
//    word k of each 64-bit word of the codes: one shift and mask give the 64-bit indices of a
//    vpgatherqq, whose 8 results are the chunk's 64 magnitudes already in lane order;
//  - the sign bit of every weight is found in the high byte of its code: with GFNI one
//    gf2p8affineqb turns every high byte into ggml's sign byte (7 bits + parity) and one vpermb
//    puts each chunk's 8 sign bytes into a 64-bit mask; without, the parity is computed with
//    shifts and the bytes are collected with vpmovqb;
//  - the mask negates the activation codes, vpmaddubsw forms pair sums (no saturation:
//    2 * 43 * 127 < 2^15) and vpdpwssd (or vpmaddwd + add) weights them by the odd scale
//    2*ls+1 of the lane's group, so each lane ends the super-block with one exact int32 and
//    one fp32 fma (matmul_q8_ref.cpp defines the arithmetic).
#include <cstdint>
#include <cstring>

#include "backend/cpu/kernels/act_q8.h"
#include "backend/cpu/kernels/kernels_impl.h"
#include "backend/cpu/kernels/simd_intrin.h"
#include "quant/quant_tables.h"

namespace strata::cpu::kernels::detail::iq2q8 {
namespace {  // internal linkage: compiled once per instruction set

constexpr int kPrefetch = kQ8Prefetch;

/// vpshufb: scale byte s = L/2 into the low byte of lane L's two words (word w: byte w/4),
/// high bytes zero (0x80).
inline __m512i scale_byte_index() {
  alignas(64) uint8_t b[64];
  for (int p = 0; p < 64; ++p) b[p] = p % 2 ? 0x80 : static_cast<uint8_t>((p / 8) % 8);
  return _mm512_load_si512(b);
}

/// vpermb: the high byte of code 4s + k (byte 8s + 2k + 1 of the codes) to byte 8k + s, so that
/// 64-bit word k holds chunk k's 8 sign bytes in slot order.
inline __m512i sign_transpose() {
  alignas(64) uint8_t b[64] = {};
  for (int k = 0; k < 4; ++k)
    for (int s = 0; s < 8; ++s) b[8 * k + s] = static_cast<uint8_t>(8 * s + 2 * k + 1);
  return _mm512_load_si512(b);
}

/// Odd scales 2*ls+1 of a super-block as int16 (lane L's two words: scale byte L/2, low nibble
/// for chunks 0-1, high nibble for chunks 2-3). (x & 0x1e) | 1 is vpternlog 0xea.
inline void odd_scales(const uint8_t* scales, __m512i index, __m512i (&odd)[2]) {
  uint64_t s;
  std::memcpy(&s, scales, 8);
  const __m512i sb = _mm512_shuffle_epi8(_mm512_set1_epi64(static_cast<long long>(s)), index);
  const __m512i m1e = _mm512_set1_epi16(0x1e), one = _mm512_set1_epi16(1);
  odd[0] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(sb, 1), m1e, one, 0xea);
  odd[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(sb, 3), m1e, one, 0xea);
}

/// The four chunk masks of a super-block's 32 codes (bit 8s + j of mask k: sign of element j of
/// entry 4s + k). With GFNI and VBMI: ksigns_iq2xs[c >> 9] is bits 1-7 of the code's high byte
/// shifted down with their parity as bit 7, a linear map over GF(2) (gf2p8affineqb: output bit
/// b = parity of row byte 7-b & x); vpermb gathers each chunk's 8 sign bytes into one 64-bit
/// word, which is loaded as the mask. Without: parity by shifts, bytes collected with vpmovqb.
template <bool ICL>
inline void sign_masks(__m512i codes, __m512i transpose, __mmask64 (&neg)[4]) {
  if constexpr (ICL) {
    const __m512i sg = _mm512_gf2p8affine_epi64_epi8(codes, _mm512_set1_epi64(0x02040810204080FELL), 0);
    alignas(32) uint64_t m[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(m), _mm512_castsi512_si256(_mm512_permutexvar_epi8(transpose, sg)));
    for (int k = 0; k < 4; ++k) neg[k] = _load_mask64(reinterpret_cast<__mmask64*>(m + k));
  } else {
    (void)transpose;
    const __m512i k7 = _mm512_srli_epi16(codes, 9);
    __m512i par = _mm512_xor_si512(k7, _mm512_srli_epi16(k7, 4));
    par = _mm512_xor_si512(par, _mm512_srli_epi16(par, 2));
    par = _mm512_xor_si512(par, _mm512_srli_epi16(par, 1));
    // sign byte of code c in the low byte of word c
    const __m512i sb = _mm512_or_si512(k7, _mm512_slli_epi16(_mm512_and_si512(par, _mm512_set1_epi16(1)), 7));
    for (int k = 0; k < 4; ++k) {
      const __m128i m = _mm512_cvtepi64_epi8(_mm512_srli_epi64(sb, 16 * k));  // low byte of each 64-bit word
      neg[k] = _cvtu64_mask64(static_cast<uint64_t>(_mm_cvtsi128_si64(m)));
    }
  }
}

/// acc + per int32 lane: odd * (pair sums of u * s), u unsigned, s signed bytes.
template <bool VNNI>
inline __m512i dot_odd(__m512i acc, __m512i u, __m512i s, __m512i odd) {
  const __m512i pairs = _mm512_maddubs_epi16(u, s);
  if constexpr (VNNI) return _mm512_dpwssd_epi32(acc, pairs, odd);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, odd));
}

/// One row of IQ2_XS (tk.cols / 256 super-blocks at w) against TB tokens of tk; y[t * ldy].
template <int TB, bool VNNI, bool ICL>
void row(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i sindex = scale_byte_index(), transpose = sign_transpose(), m511 = _mm512_set1_epi64(511);
  const long long* grid = reinterpret_cast<const long long*>(tables::iq2xs_grid);
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 74) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + 64, _MM_HINT_T0);
    const __m512i codes = _mm512_loadu_si512(w + 2);
    __m512i odd[2];
    odd_scales(w + 66, sindex, odd);
    __mmask64 neg[4];
    sign_masks<ICL>(codes, transpose, neg);
    __m512i sum[TB];
    for (int t = 0; t < TB; ++t) sum[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m512i wq = _mm512_i64gather_epi64(_mm512_and_si512(_mm512_srli_epi64(codes, 16 * k), m511), grid, 8);
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t) {
        const __m512i qx = _mm512_loadu_si512(tk.q + t * tk.cols + 256 * i + 64 * k);
        sum[t] = dot_odd<VNNI>(sum[t], wq, _mm512_mask_sub_epi8(qx, neg[k], _mm512_setzero_si512(), qx), odd[k / 2]);
      }
    }
    const __m512 dq = _mm512_set1_ps(_cvtsh_ss(load_u16(w)) * 0.125f);
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
      const __m512 dx = _mm512_loadu_ps(tk.dxl + t * (tk.cols / 16) + 16 * i);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_mul_ps(dq, dx), acc[t]);
    }
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum16(acc[t]);
}

/// Rows [r0, r1) (row_bytes apart from W) against tokens 0..n_tok-1 of tk, in tiles of up to 4
/// tokens that share one decode of a row (each tile size runs the same per-token arithmetic).
template <bool VNNI, bool ICL>
void rows(const uint8_t* W, size_t row_bytes, int64_t r0, int64_t r1, int64_t n_tok, const LaneTokens& tk, float* y,
          int64_t ldy) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* w = W + static_cast<size_t>(r) * row_bytes;
    for (int64_t t = 0; t < n_tok; t += 4) {
      const LaneTokens sub = tk.from(t);
      float* yt = y + t * ldy + r;
      switch (n_tok - t < 4 ? n_tok - t : 4) {
        case 4: row<4, VNNI, ICL>(w, sub, yt, ldy); break;
        case 3: row<3, VNNI, ICL>(w, sub, yt, ldy); break;
        case 2: row<2, VNNI, ICL>(w, sub, yt, ldy); break;
        default: row<1, VNNI, ICL>(w, sub, yt, ldy); break;
      }
    }
  }
}

}  // namespace
}  // namespace strata::cpu::kernels::detail::iq2q8
