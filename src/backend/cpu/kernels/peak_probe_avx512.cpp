// The AVX-512 VNNI register loop of peak_probe.h. NOT MEASURED on the development machine
// (AVX2 only); only called where CPUID reports AVX-512 VNNI.
#include "backend/cpu/kernels/simd_intrin.h"

#include "backend/cpu/kernels/peak_probe.h"

namespace strata::cpu::kernels::detail {

// 12 independent vpdpbusd zmm chains (latency ~5 cycles, up to 2 per cycle): 64 multiply-adds each.
double int8_loop_avx512vnni(long iters) {
  __m512i a[12];
  const __m512i u = _mm512_set1_epi8(3);
  __m512i s = _mm512_set1_epi8(-5);
  for (int j = 0; j < 12; ++j) a[j] = _mm512_set1_epi32(j);
  for (long i = 0; i < iters; ++i) {
    __asm__("" : "+v"(s));
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm512_dpbusd_epi32(a[j], u, s);
  }
  __m512i r = a[0];
  for (int j = 1; j < 12; ++j) r = _mm512_xor_si512(r, a[j]);
  volatile int sink = _mm512_cvtsi512_si32(r);
  (void)sink;
  return double(iters) * 12 * 64 * 2;
}

}  // namespace strata::cpu::kernels::detail
