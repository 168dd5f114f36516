#pragma once
// Block formats: dequantization (scalar reference, bit-exact with gguf-py) and the
// matrix kernels the forward pass uses, with fast paths chosen at run time.
//
// Layout convention (ggml's): a weight matrix W of shape [rows, cols] is stored as
// `rows` consecutive rows of `cols` elements each (cols contiguous), each row
// `row_bytes = cols / block_elems * block_bytes` bytes of blocks.
//
// Formats (block layouts of ggml/src/ggml-common.h, values as gguf-py/gguf/quants.py computes
// them): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ2_XS,
// IQ3_S, IQ4_XS, IQ4_NL, MXFP4. Design, tolerances and measurements: docs/kernels.md.
// All functions are thread-safe; matmul keeps a per-thread scratch buffer that only grows.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"

namespace strata::quant {

/// Which kernel family runs. Auto picks the best the CPU supports (CPUID).
enum class CpuKernels { Auto, Scalar, Avx2, Avx512 };

/// Selects the kernel family for all later calls (process-wide).
/// Throws std::runtime_error if the CPU lacks the requested instructions.
void set_cpu_kernels(CpuKernels k);
/// The family actually in use after resolving Auto.
CpuKernels active_cpu_kernels();
const char* cpu_kernels_name(CpuKernels k);
/// Parses "scalar|avx2|avx512|auto"; throws std::invalid_argument otherwise.
CpuKernels parse_cpu_kernels(const std::string& s);

/// How matmul treats activations for the quantized weight types (every one has an int8
/// definition; has_q8_activations()): F32 multiplies the exact fp32 activations with weights
/// expanded to fp32; Q8 quantizes each token's activations to int8 in blocks of 32 (ggml's
/// Q8_0 scheme, as llama.cpp does on CPU) and multiplies in integers, with the same bits in
/// every kernel family (where a family has no SIMD kernel for a type, the scalar definition
/// runs: exact but slow). F16/BF16/F32 weights always use F32. Auto (the default) is Q8 with
/// the AVX2 and AVX-512 families (both have a kernel for every quantized type) and F32 with the
/// scalar one. Accuracy cost and speed: docs/kernels.md.
enum class ActQuant { Auto, F32, Q8 };
/// Selects the activation mode for all later calls (process-wide).
void set_act_quant(ActQuant a);
/// The mode in use after resolving Auto against the active kernel family.
ActQuant active_act_quant();
const char* act_quant_name(ActQuant a);
/// Parses "f32|q8|auto"; throws std::invalid_argument otherwise.
ActQuant parse_act_quant(const std::string& s);
/// True if matmul on weights of type `t` quantizes the activations in the current mode.
bool has_q8_activations(GgmlType t);

/// int8 activations of n_tok tokens of `cols` columns (q8 mode; cols % 32 == 0), so that several
/// matmuls (and every thread of one) share one quantization. Layout, token-major:
/// q: n_tok x cols int8 codes (cols contiguous); d: n_tok x cols/32 fp32 block scales
/// (d = amax/127 of the block's 32 floats; ggml's Q8_0 scheme); s16: n_tok x cols/16 sums of
/// 16 consecutive codes. For the weight type named in resize() (the K- and I-quants with an int8 kernel, cols %
/// 256 == 0) the codes are also kept in that type's lane order (ql, n_tok x cols; dxl, n_tok x
/// cols/16 per-lane block scales; xs, n_tok x cols/32, Q4_K/Q5_K only: d times the block's code sum),
/// which the AVX-512 kernels read directly (src/quant/act_q8.h; otherwise every matmul call
/// rearranges the codes itself).
struct ActQ8 {
  int64_t cols = 0, n_tok = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> s16;
  GgmlType lanes = GgmlType::F32;  ///< the type ql/dxl/xs are arranged for; F32: none
  std::vector<int8_t> ql;
  std::vector<float> dxl, xs;
  /// Sizes the buffers for n_tok x cols (only grows) and chooses the lane order to keep
  /// (`for_type`; any type without one keeps none). Throws std::runtime_error if cols % 32.
  void resize(int64_t n_tok, int64_t cols, GgmlType for_type = GgmlType::F32);
  const int8_t* qt(int64_t t) const { return q.data() + t * cols; }
  const float* dt(int64_t t) const { return d.data() + t * (cols / 32); }
  const int16_t* st(int64_t t) const { return s16.data() + t * (cols / 16); }
};

/// Quantizes tokens [t0, t1) of x (rows `ldx` floats apart, a.cols columns) into `a`, which
/// must have been resized to at least t1 tokens (and the lane order chosen there). A token's
/// codes depend only on its own row; a block with a NaN or infinity gets d = NaN (so the NaN
/// reaches the outputs). Every kernel family produces identical codes. Thread-safe for disjoint
/// token ranges.
void quantize_activations(const float* x, int64_t ldx, int64_t t0, int64_t t1, ActQ8& a);

/// matmul with activations already quantized into `a` (all a.n_tok tokens; y as in matmul).
/// Gives exactly the bits matmul(t, ..., x, ...) gives in q8 mode for the x that `a` holds.
/// Throws std::runtime_error unless has_q8_activations(t) and a.cols == cols.
void matmul_q8(GgmlType t, const void* W, size_t row_bytes, int64_t row_begin, int64_t row_end, int64_t cols,
               const ActQ8& a, float* y, int64_t ldy);

/// True if this build can dequantize and multiply type `t`.
bool is_supported(GgmlType t);

/// Scalar reference: dequantizes `n` elements (a multiple of the block size) from `src`
/// (n / block_elems(t) blocks, row_size(t, n) bytes) into `dst` (n floats). Bit-exact with
/// gguf-py's dequantize. Throws std::runtime_error for unsupported types or a ragged `n`.
void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n);

/// Y = X * W^T for one row range:
///   for t in [0, n_tok), r in [row_begin, row_end):
///     y[t * ldy + r] = sum_k dequant(W)[r][k] * x[t * ldx + k]
/// W: `rows` rows of type `t`, `row_bytes` apart, `cols` elements each (cols % block == 0).
/// x: n_tok rows of `cols` floats, `ldx` floats apart. y: n_tok rows, `ldy` floats apart.
///
/// Invariance contract: y[t][r] is bit-identical whatever n_tok, the row range it was
/// computed in, and the other rows of x (so results do not depend on prompt chunking or
/// thread split). Only the kernel family (set_cpu_kernels) may change the rounding.
///
/// Units: all fp32; x and y must not overlap. In F32 mode (and for types without an int8
/// kernel) weights are expanded to fp32 exactly as dequantize_row does; the fast families
/// differ from the scalar reference (double accumulation) only by fp32 accumulation, at most
/// (cols/16 + 8) * 2^-24 * sum_k |w_k x_k|. In Q8 mode (has_q8_activations(t)) every family
/// computes the same bits (the arithmetic is defined in matmul_q8_ref.cpp). Throws std::runtime_error for an unsupported type,
/// a ragged `cols`, a bad row range or row_bytes < row_size(t, cols).
void matmul(GgmlType t, const void* W, size_t row_bytes, int64_t row_begin, int64_t row_end, int64_t cols,
            const float* x, int64_t ldx, int64_t n_tok, float* y, int64_t ldy);

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
