#pragma once
// The AVX2 family's Q4_K / Q5_K prefill tile (tokens x one row, lane order q4k_lane_element) and
// its helpers, shared by matmul_q8_avx2.cpp (vpmaddubsw + vpaddw) and matmul_q8_0_avxvnni.cpp
// (vpdpbusd, VNNI = true). In an anonymous namespace on purpose: the two files are compiled for
// different instruction sets, so each gets its own copy (see q8_0_lanes_gemm.h).
#include "backend/cpu/kernels/simd_intrin.h"

#include <cstdint>
#include <cstring>

#include "backend/cpu/kernels/act_q8.h"
#include "quant/quant_impl.h"

namespace strata::cpu::kernels::detail {
namespace {

inline __m256i q4k_load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

/// 16 int8 / uint8 values as fp32 lanes 0-7 and 8-15.
inline void i8x16_ps(__m128i v, bool is_signed, __m256 (&out)[2]) {
  const __m128i hi = _mm_unpackhi_epi64(v, v);
  out[0] = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
  out[1] = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi));
}

/// Two 64-bit words as [a, a, b, b].
inline __m256i words_aabb(const uint8_t* a, const uint8_t* b) {
  long long x, z;
  std::memcpy(&x, a, 8);
  std::memcpy(&z, b, 8);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi64x(x)), _mm_set1_epi64x(z), 1);
}

/// A Q4_K / Q5_K super-block's factors (w: its first byte): dsc[h] = d * the sub-block scales of
/// half h (lane L: sub-block L / 2, the lane order of q4k_lane_element) and dm = dmin * the 8 mins.
inline void q4k_factors(const uint8_t* w, __m256 (&dsc)[2], __m256& dm) {
  const __m128i pairs = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);  // sub-block L/2
  uint64_t sc, m;
  k4_scales_packed(w + 4, sc, m);
  __m256 scf[2];
  i8x16_ps(_mm_shuffle_epi8(_mm_cvtsi64_si128(static_cast<long long>(sc)), pairs), false, scf);
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(w)));
  dsc[0] = _mm256_mul_ps(d, scf[0]);
  dsc[1] = _mm256_mul_ps(d, scf[1]);
  dm = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(load_u16(w + 2))),
                     _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(m)))));
}

/// TB tokens of one Q4_K/Q5_K row (row_q4_k's arithmetic): per super-block and half, each token's
/// 4 chunk products are summed as int16 pairs (vpaddw: Q4_K's pairs are at most 2*15*127, Q5_K's
/// 2*31*127, so 4 of them fit in int16 exactly) and widened once (vpmaddwd), which halves the
/// widening multiplies; the codes of a chunk are unpacked once for the TB tokens. VNNI (only in a
/// file compiled with -mavxvnni): one vpdpbusd per chunk and token instead, whose int32 lanes
/// are the same exact sums (each lane's 4 bytes over the 4 chunks), so the same bits.
template <int TB, bool FIFTH, bool VNNI>
void tile_q4_k(const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  constexpr int kBytes = FIFTH ? 176 : 144, kQs = FIFTH ? 48 : 16;
  __m256 acc[TB][2], accm[TB];
  for (int t = 0; t < TB; ++t) acc[t][0] = acc[t][1] = accm[t] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi8(0x0f), shift = _mm256_setr_epi64x(0, 4, 0, 4), bit4 = _mm256_set1_epi8(0x10);
  const __m256i up = _mm256_setr_epi64x(4, 3, 2, 1), down = _mm256_setr_epi64x(0, 1, 2, 3);
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += kBytes) {
    __m256 dsc[2], dm;
    q4k_factors(w, dsc, dm);
    const uint8_t* qs = w + kQs;
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m256i s16[TB];  // int16 pair sums (VNNI: the int32 lane sums themselves)
      for (int t = 0; t < TB; ++t) s16[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const __m256i v = words_aabb(qs + 64 * half + 8 * k, qs + 64 * half + 32 + 8 * k);
        __m256i wq = _mm256_and_si256(_mm256_srlv_epi64(v, shift), nib);
        if constexpr (FIFTH) {
          long long h;
          std::memcpy(&h, w + 16 + 8 * k, 8);
          const __m256i hb = _mm256_set1_epi64x(h);
          const __m256i b4 = half == 0 ? _mm256_sllv_epi64(hb, up) : _mm256_srlv_epi64(hb, down);
          wq = _mm256_or_si256(wq, _mm256_and_si256(b4, bit4));
        }
#pragma GCC unroll 4
        for (int t = 0; t < TB; ++t) {
          const __m256i qx = q4k_load256(tk.q + t * tk.cols + 256 * i + 64 * k + 32 * half);
          if constexpr (VNNI)
            s16[t] = _mm256_dpbusd_avx_epi32(s16[t], wq, qx);  // each int32 lane: its 4 bytes' products
          else
            s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(wq, qx));
        }
      }
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t) {
        const __m256i sum = VNNI ? s16[t] : _mm256_madd_epi16(s16[t], _mm256_set1_epi16(1));
        const float* dxl = tk.dxl + t * (tk.cols / 16) + 16 * i;
        acc[t][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),
                                       _mm256_mul_ps(dsc[half], _mm256_loadu_ps(dxl + 8 * half)), acc[t][half]);
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t)
      accm[t] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(tk.xs + t * (tk.cols / 32) + 8 * i), accm[t]);
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum8(_mm256_add_ps(acc[t][0], acc[t][1])) - simd_hsum8(accm[t]);
}

}  // namespace
}  // namespace strata::cpu::kernels::detail
