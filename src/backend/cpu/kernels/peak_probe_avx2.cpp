// The AVX2 register loops and read loop of peak_probe.h.
#include "backend/cpu/kernels/simd_intrin.h"

#include "backend/cpu/kernels/peak_probe.h"

namespace strata::cpu::kernels::detail {

// 12 independent chains of vpmaddubsw -> vpmaddwd -> vpaddd (latency ~4+4+1 cycles, so 12
// chains keep a 1-2 per cycle multiply port busy); 32 multiply-adds per chain and iteration.
double int8_loop_avx2(long iters) {
  __m256i a[12];
  const __m256i u = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
  __m256i s = _mm256_set1_epi8(-5);
  for (int j = 0; j < 12; ++j) a[j] = _mm256_set1_epi32(j);
  for (long i = 0; i < iters; ++i) {
    // the empty asm keeps s opaque, so the loop body is not hoisted
    __asm__("" : "+x"(s));
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm256_add_epi32(a[j], _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
  }
  __m256i r = a[0];
  for (int j = 1; j < 12; ++j) r = _mm256_xor_si256(r, a[j]);
  volatile int sink = _mm256_extract_epi32(r, 0);
  (void)sink;
  return double(iters) * 12 * 32 * 2;
}

// Bare vpmaddubsw (int16 pair sums): 32 multiply-adds per instruction.
double maddubs_loop_avx2(long iters) {
  __m256i a[12];
  const __m256i u = _mm256_set1_epi8(1);
  for (int j = 0; j < 12; ++j) a[j] = _mm256_set1_epi8(static_cast<char>(j));
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm256_maddubs_epi16(u, a[j]);
  }
  __m256i r = a[0];
  for (int j = 1; j < 12; ++j) r = _mm256_xor_si256(r, a[j]);
  volatile int sink = _mm256_extract_epi32(r, 0);
  (void)sink;
  return double(iters) * 12 * 32 * 2;
}

long long read_avx2(const void* p, size_t n) {
  const auto* v = static_cast<const __m256i*>(p);
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i < n / 32; i += 4) {
    s0 = _mm256_add_epi64(s0, _mm256_load_si256(v + i));
    s1 = _mm256_add_epi64(s1, _mm256_load_si256(v + i + 1));
    s2 = _mm256_add_epi64(s2, _mm256_load_si256(v + i + 2));
    s3 = _mm256_add_epi64(s3, _mm256_load_si256(v + i + 3));
  }
  const __m256i s = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
  return _mm256_extract_epi64(s, 0) + _mm256_extract_epi64(s, 1) + _mm256_extract_epi64(s, 2) +
         _mm256_extract_epi64(s, 3);
}

}  // namespace strata::cpu::kernels::detail
