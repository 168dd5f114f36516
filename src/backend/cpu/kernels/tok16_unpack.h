#pragma once
// The weight unpack of the AVX-512 Q4_K and IQ4_XS GEMMs (tokens in the lanes,
// matmul_q8_0_avx512.cpp, and the AMX tiles, matmul_tok16_amx.cpp): one row's 4-bit codes as
// bytes, 32 per 32-block, with the per-block fp32 factors of the serial definitions
// (matmul_q8_scalar_avx512). Internal linkage (static): each including translation unit, compiled
// for its own instruction set, keeps its own copy. Include after simd_intrin.h (AVX2 at least).
#include <cstdint>

#include "backend/cpu/kernels/kernels_impl.h"

namespace strata::cpu::kernels::detail {

/// One Q4_K row (nsb super-blocks at w) unpacked: for every 32-block b = 8i + s (sub-block s of
/// super-block i) its 32 codes (0..15) as bytes at codes + cs * b, dw[fs * b] = d * sc_s,
/// gm[fs * b] = -(dmin * m_s) (each product rounded, as in matmul_q8_scalar_avx512) and, unless nc
/// is null, nc[fs * b] = -128 * (sum of the codes).
static inline void unpack_q4_k_row(const uint8_t* w, int64_t nsb, uint8_t* codes, int64_t cs, float* dw, float* gm,
                                   int64_t fs, int32_t* nc) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int64_t i = 0; i < nsb; ++i, w += 144) {
    const float d = _cvtsh_ss(load_u16(w)), dmin = _cvtsh_ss(load_u16(w + 2));
    for (int s = 0; s < 8; ++s) {
      int sc = 0, m = 0;
      k4_scale_min(w + 4, s, sc, m);
      dw[fs * (8 * i + s)] = d * static_cast<float>(sc);
      gm[fs * (8 * i + s)] = -(dmin * static_cast<float>(m));
    }
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 + 32 * j));
      const __m256i c[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
      for (int h = 0; h < 2; ++h) {
        const int64_t b = 8 * i + 2 * j + h;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + cs * b), c[h]);
        if (!nc) continue;
        const __m256i sad = _mm256_sad_epu8(c[h], _mm256_setzero_si256());
        const __m128i q = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
        nc[fs * b] = static_cast<int32_t>(-128 * _mm_cvtsi128_si64(_mm_add_epi64(q, _mm_unpackhi_epi64(q, q))));
      }
    }
  }
}

/// One IQ4_XS row (nsb super-blocks at w) unpacked: for every 32-block b = 8i + g its 32 values
/// kvalues_iq4nl[code] (signed bytes) at codes + cs * b, dw[fs * b] = d * (ls_g - 32) (rounded, as
/// in matmul_q8_scalar_avx512) and, unless nc is null, nc[fs * b] = -128 * (sum of the values).
static inline void unpack_iq4_xs_row(const uint8_t* w, int64_t nsb, uint8_t* codes, int64_t cs, float* dw, int64_t fs,
                                     int32_t* nc) {
  const __m128i low = _mm_set1_epi8(0x0f);
  const __m256i kv =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tables::kvalues_iq4nl)));
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t i = 0; i < nsb; ++i, w += 136) {
    const float d = _cvtsh_ss(load_u16(w));
    for (int g = 0; g < 8; ++g) {
      const int64_t b = 8 * i + g;
      dw[fs * b] = d * static_cast<float>(iq4xs_scale(w, g));
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8 + 16 * g));
      const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
      const __m256i c = _mm256_shuffle_epi8(kv, idx);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + cs * b), c);
      if (!nc) continue;
      // sum of the signed values: vpsadbw of (value + 128), minus 32 * 128
      const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(c, bias), _mm256_setzero_si256());
      const __m128i q = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
      nc[fs * b] =
          static_cast<int32_t>(-128 * (_mm_cvtsi128_si64(_mm_add_epi64(q, _mm_unpackhi_epi64(q, q))) - 32 * 128));
    }
  }
}

}  // namespace strata::cpu::kernels::detail
