// The AVX-VNNI register loop of peak_probe.h (vpdpbusd on ymm, VEX encoding).
#include "backend/cpu/kernels/simd_intrin.h"

#include "backend/cpu/kernels/peak_probe.h"

namespace strata::cpu::kernels::detail {

// 12 independent vpdpbusd ymm chains (latency ~5 cycles, so 12 chains keep two ports busy); 32
// multiply-adds per instruction.
double int8_loop_avxvnni(long iters) {
  __m256i a[12];
  const __m256i u = _mm256_set1_epi8(3);
  __m256i s = _mm256_set1_epi8(-5);
  for (int j = 0; j < 12; ++j) a[j] = _mm256_set1_epi32(j);
  for (long i = 0; i < iters; ++i) {
    // the empty asm keeps s opaque, so the loop body is not hoisted
    __asm__("" : "+x"(s));
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm256_dpbusd_avx_epi32(a[j], u, s);
  }
  __m256i r = a[0];
  for (int j = 1; j < 12; ++j) r = _mm256_xor_si256(r, a[j]);
  volatile int sink = _mm256_extract_epi32(r, 0);
  (void)sink;
  return double(iters) * 12 * 32 * 2;
}

}  // namespace strata::cpu::kernels::detail
