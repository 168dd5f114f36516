#pragma once
// Internal to src/backend/cpu/kernels: the arguments of one matmul call and the entry points of
// the kernel families. The block formats' helpers (geometry, fp16 conversion, scale unpacking,
// tables) come from src/quant and are visible here unqualified.
#include <cstddef>
#include <cstdint>

#include "backend/cpu/kernels/kernels.h"
#include "quant/quant.h"
#include "quant/quant_impl.h"
#include "quant/quant_tables.h"

namespace strata::cpu::kernels::detail {

// The formats' internal helpers (src/quant/quant_impl.h: geometry, half_to_float, load_u16,
// k4_scale_min, ...) and tables, under the names the kernels used when they lived in src/quant.
using namespace ::strata::quant::detail;
namespace tables = ::strata::quant::tables;

/// The arguments of one matmul call, already validated (see kernels.h for the contract).
struct MatmulArgs {
  GgmlType type;
  const uint8_t* W;
  size_t row_bytes;
  int64_t row_begin, row_end, cols;
  const float* x;
  int64_t ldx, n_tok;
  float* y;
  int64_t ldy;
};

/// Scalar reference family: every supported type.
void matmul_scalar(const MatmulArgs& a);
/// AVX2+FMA+F16C family. Returns false (and does nothing) for types it has no fast path for.
bool matmul_avx2(const MatmulArgs& a);
/// AVX-512 (F/BW/VL/DQ) family. Returns false for types it has no fast path for.
bool matmul_avx512(const MatmulArgs& a);
/// Row decoders of the fast families, exposed for tests: decode `n` elements (a multiple of the
/// block size) of type `t` to floats. False if the family has no decoder for `t`.
bool decode_row_avx2(GgmlType t, const void* src, float* dst, int64_t n);
bool decode_row_avx512(GgmlType t, const void* src, float* dst, int64_t n);

}  // namespace strata::cpu::kernels::detail
