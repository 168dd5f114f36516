#pragma once
// Internal to src/quant: the int8 activation path ("q8 activations").
//
// Activations x (fp32) are quantized per token in blocks of 32 (the Q8_0 scheme of ggml,
// ggml-quants.c quantize_row_q8_0: d = amax / 127, q = round(x / d)), keeping the int16 sums
// of every 16 codes for the formats whose weights carry an offset. The weight blocks are then
// multiplied with the int8 codes in integer arithmetic (exact), and only the per-block scale
// factors are applied in fp32. This is what llama.cpp does on CPU (it uses Q8_K, blocks of 256,
// for the k- and i-quants; we keep blocks of 32 everywhere, which is more accurate and costs
// one fp32 factor per 32 weights).
//
// The float part of every dot product is fixed here, lane by lane: the scalar family computes
// it with the same lane structure as the AVX-512 family (see matmul_q8_ref.cpp), so in q8 mode
// every family gives bit-identical results and the fast kernels are tested bit for bit.
#include <cmath>
#include <cstdint>
#include <vector>

#include "quant/quant.h"
#include "quant/quant_impl.h"

namespace strata::quant::detail {

using quant::ActQ8;

/// Quantizes one block of 32 activations: d = amax / 127, q = nearest-even(x * (127 / amax));
/// all zero when amax == 0. A non-finite amax gives d = NaN and q = 0, so that the NaN reaches
/// the output instead of disappearing into integer codes.
static inline float quantize_block_q8(const float* x, int8_t* q) {
  float amax = 0.0f;
  bool finite = true;
  for (int k = 0; k < 32; ++k) {
    const float a = std::fabs(x[k]);
    finite = finite && a <= 3.4028234e38f;  // false for NaN and infinities
    amax = a > amax ? a : amax;
  }
  if (!finite) {
    for (int k = 0; k < 32; ++k) q[k] = 0;
    return std::nanf("");
  }
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  // round to nearest, ties to even: adding 1.5 * 2^23 leaves no fraction bits (|x * id| <= 127.5)
  // (the empty asm keeps the product rounded on its own: no contraction into an FMA)
  for (int k = 0; k < 32; ++k) {
    float v = x[k] * id;
    __asm__("" : "+x"(v));
    q[k] = static_cast<int8_t>(static_cast<int>((v + 0x1.8p23f) - 0x1.8p23f));
  }
  return amax / 127.0f;
}

/// AVX-512 twin of quantize_block_q8 (identical codes and scale); also returns the two 16-sums.
float quantize_block_q8_avx512(const float* x, int8_t* q, int16_t* s16);

/// Weight types with an int8 dot product (the others keep fp32 activations in q8 mode).
static constexpr bool has_q8_kernel(GgmlType t) {
  return t == GgmlType::Q8_0 || t == GgmlType::Q4_K || t == GgmlType::IQ2_XS;
}

/// Scalar q8 family (the definition of the arithmetic): y[t][r] for rows [row_begin, row_end).
void matmul_q8_scalar(const MatmulArgs& m, const ActQ8& a);
/// AVX-512 q8 family (VNNI when the CPU has it, else vpmaddubsw + vpmaddwd, same integers).
/// Returns false for types without a kernel.
bool matmul_q8_avx512(const MatmulArgs& m, const ActQ8& a, bool vnni);

}  // namespace strata::quant::detail
