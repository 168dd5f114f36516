#pragma once
// <immintrin.h> for the SIMD translation units. GCC 12's AVX-512 headers trip
// -Wuninitialized/-Wmaybe-uninitialized on their own `__Y = __Y` "undefined vector" idiom
// (GCC PR105593); the warning is located inside the header, so silencing it here, around the
// include, keeps the check on for our code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

// Horizontal sums with one fixed tree (results are part of the kernels' arithmetic contract):
// hsum8(v) = ((v0+v4) + (v2+v6)) + ((v1+v5) + (v3+v7)); hsum16(v) = hsum8(v[0..7] + v[8..15]).
#ifdef __AVX2__
static inline float simd_hsum8(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
#endif
#ifdef __AVX512F__
static inline float simd_hsum16(__m512 v) {
  return simd_hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
#endif
