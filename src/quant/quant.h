#pragma once
// Block formats: their layouts (quant/blocks.h), the scalar reference dequantization (bit-exact
// with gguf-py), fp16/bf16 conversions and block geometry. The matmul kernels that read these
// formats are the CPU backend's (backend/cpu/kernels/kernels.h).
//
// Layout convention (ggml's): a weight matrix W of shape [rows, cols] is stored as
// `rows` consecutive rows of `cols` elements each (cols contiguous), each row
// `row_bytes = cols / block_elems * block_bytes` bytes of blocks.
//
// Formats (block layouts of ggml/src/ggml-common.h, values as gguf-py/gguf/quants.py computes
// them): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ2_XS,
// IQ3_S, IQ4_XS, IQ4_NL, MXFP4. Design, tolerances and measurements: docs/kernels.md.
// All functions are thread-safe.
#include <cstddef>
#include <cstdint>

#include "gguf/ggml_types.h"

namespace strata::quant {

/// True if this build can dequantize type `t` (and the CPU kernels can multiply it).
bool is_supported(GgmlType t);

/// Scalar reference: dequantizes `n` elements (a multiple of the block size) from `src`
/// (n / block_elems(t) blocks, row_size(t, n) bytes) into `dst` (n floats). Bit-exact with
/// gguf-py's dequantize. Throws std::runtime_error for unsupported types or a ragged `n`.
void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n);

/// IEEE half <-> float (exact conversions, round-to-nearest-even on the way down).
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
/// bfloat16 -> float (exact) and float -> bfloat16 (round-to-nearest-even, NaN kept).
float bf16_to_fp32(uint16_t h);
uint16_t fp32_to_bf16(float f);

}  // namespace strata::quant

namespace strata::quant {

/// Elements per block of `t` (1 for F32/F16/BF16, 32 or 256 for block formats); 0 if unsupported.
/// Hard-coded in src/quant (the formats of ggml/src/ggml-common.h).
int block_elems(GgmlType t);
/// Bytes of one row of `cols` elements of type `t` (cols must be a multiple of block_elems(t));
/// throws std::runtime_error for unsupported types or a ragged `cols`.
size_t row_size(GgmlType t, int64_t cols);

}  // namespace strata::quant
