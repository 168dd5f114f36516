// The IQ2_XS q8 kernel (iq2xs_q8_kernel.h) compiled for the Ice Lake level: VNNI for the
// integer dot products, GFNI and VBMI for the signs (one gf2p8affineqb and one vpermb per
// super-block instead of a parity computed with shifts and a vpmovqb per 64 weights).
// Reached only when CPUID reports these extensions (best_q8_isa, matmul_q8_avx512.cpp).
#include "backend/cpu/kernels/iq2xs_q8_kernel.h"

namespace strata::cpu::kernels::detail {

void iq2xs_rows_icl(const uint8_t* W, size_t row_bytes, int64_t r0, int64_t r1, int64_t n_tok, const LaneTokens& tk,
                    float* y, int64_t ldy) {
  iq2q8::rows<true, true>(W, row_bytes, r0, r1, n_tok, tk, y, ldy);
}

}  // namespace strata::cpu::kernels::detail
