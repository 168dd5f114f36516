#pragma once
// Per-block factors of the 32-weight block types (b32_format in act_q8.h) for 8 blocks at once,
// shared by the AVX2 and AVX-512 q8 kernels (matmul_q8_avx2.cpp, matmul_q8_avx512.cpp), which
// both compile it with AVX2, FMA and F16C. Internal linkage: each translation unit keeps its own
// instruction-set copy.
#include <cstdint>

#include "backend/cpu/kernels/act_q8.h"
#include "backend/cpu/kernels/simd_intrin.h"

namespace strata::cpu::kernels::detail::b32 {
namespace {

/// Mask of the first n (0..8) int32 lanes, for vmaskmov.
inline __m256i first_lanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/// The fp16 values at p, p + stride, ... of the first nv blocks (zero after them), as floats.
template <bool FULL>
inline __m256 halves8(const uint8_t* p, int stride, int nv) {
  if constexpr (FULL)
    return _mm256_cvtph_ps(
        _mm_setr_epi16(static_cast<short>(load_u16(p)), static_cast<short>(load_u16(p + stride)),
                       static_cast<short>(load_u16(p + 2 * stride)), static_cast<short>(load_u16(p + 3 * stride)),
                       static_cast<short>(load_u16(p + 4 * stride)), static_cast<short>(load_u16(p + 5 * stride)),
                       static_cast<short>(load_u16(p + 6 * stride)), static_cast<short>(load_u16(p + 7 * stride))));
  alignas(16) uint16_t h[8] = {};
  for (int j = 0; j < nv; ++j) h[j] = load_u16(p + stride * j);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}

/// fd and fc (b32_format) of the first nv (1..8) blocks at wg; zero for blocks nv..7.
template <GgmlType T, bool FULL>
inline void b32_factors(const uint8_t* wg, int nv, __m256& fd, __m256& fc) {
  constexpr B32Format F = b32_format(T);
  if constexpr (F.e8m0) {
    // e8m0_half of the scale bytes: 2^(e-128), i.e. (e - 1) << 23, or 0x00200000 << e for e < 2
    const __m256i m8 = first_lanes(FULL ? 8 : nv);
    const __m256i off = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(F.bytes));
    const __m256i e = _mm256_and_si256(_mm256_mask_i32gather_epi32(_mm256_setzero_si256(),
                                                                   reinterpret_cast<const int*>(wg), off, m8, 1),
                                       _mm256_set1_epi32(0xff));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    fd = _mm256_castsi256_ps(_mm256_and_si256(m8, _mm256_blendv_epi8(normal, sub, small)));
  } else {
    fd = halves8<FULL>(wg, F.bytes, nv);
  }
  if constexpr (F.min >= 0) {
    fc = halves8<FULL>(wg + F.min, F.bytes, nv);
  } else {
    fc = _mm256_mul_ps(fd, _mm256_set1_ps(-static_cast<float>(F.offset)));
  }
}

}  // namespace
}  // namespace strata::cpu::kernels::detail::b32
