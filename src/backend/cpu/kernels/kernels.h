#pragma once
// The CPU matmul kernels over the block formats of src/quant: Y = X·Wᵀ over a row range, in
// one of three kernel families (scalar, AVX2, AVX-512, compiled per instruction set and chosen
// at run time), with fp32 or int8 ("q8") activations.
//
// Which family and activation mode run is a value, KernelConfig, that the caller holds (the CPU
// backend instance, a test, a benchmark) and passes to every call; there is no process-wide
// switch. resolve_kernels() turns the user's choice (auto included) into one, once.
//
// Layout convention (ggml's): a weight matrix W of shape [rows, cols] is stored as `rows`
// consecutive rows of `cols` elements each (cols contiguous), each row `row_bytes` apart
// (row_bytes >= quant::row_size(t, cols)). Design, tolerances and measurements:
// docs/kernels.md. All functions are thread-safe; matmul keeps a per-thread scratch buffer that
// only grows.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/cpu/grow_buffer.h"
#include "gguf/ggml_types.h"

namespace strata::cpu::kernels {

/// Which kernel family runs. Auto picks the best the CPU supports (CPUID) in resolve_kernels().
/// Avx512 uses the CPU's best sub-level (VNNI, VBMI/GFNI, and AMX tiles for the Q8_0, Q4_K and
/// IQ4_XS GEMMs of more than 4 tokens where CPUID reports AMX-INT8 and the OS grants the tile data
/// permission, unless the environment variable STRATA_CPU_AMX is "0"); every sub-level gives the
/// same bits (docs/kernels.md "AMX tiles").
enum class CpuKernels { Auto, Scalar, Avx2, Avx512 };

/// How matmul treats activations for the quantized weight types (every one has an int8
/// definition): F32 multiplies the exact fp32 activations with weights expanded to fp32; Q8
/// quantizes each token's activations to int8 in blocks of 32 (ggml's Q8_0 scheme, as llama.cpp
/// does on CPU) and multiplies in integers, with the same bits in every kernel family (where a
/// family has no SIMD kernel for a type, the scalar definition runs: exact but slow).
/// F16/BF16/F32 weights always use F32. Auto is Q8 with the AVX2 and AVX-512 families (both have
/// a kernel for every quantized type) and F32 with the scalar one. Accuracy cost and speed:
/// docs/kernels.md.
enum class ActQuant { Auto, F32, Q8 };

/// The kernels one caller runs: a family and an activation mode, both resolved (never Auto when
/// made by resolve_kernels). The default value is the portable scalar family with exact f32
/// activations. Cheap to copy; pass it by value or reference.
struct KernelConfig {
  CpuKernels family = CpuKernels::Scalar;
  ActQuant act = ActQuant::F32;
  bool operator==(const KernelConfig&) const = default;
};

/// Resolves a requested family and activation mode: Auto family -> the best this CPU has
/// (CPUID: AVX-512 F/BW/VL/DQ, else AVX2+FMA+F16C+BMI2, else scalar); Auto activations -> Q8 with
/// the AVX2 and AVX-512 families, F32 with the scalar one. Throws std::runtime_error if the CPU
/// lacks the instructions of the requested family.
/// Auto reads STRATA_CPU_KERNELS (scalar|avx2|avx512) first, if set: one family for a whole run.
KernelConfig resolve_kernels(CpuKernels family = CpuKernels::Auto, ActQuant act = ActQuant::Auto);

/// "auto", "scalar", "avx2", "avx512".
const char* cpu_kernels_name(CpuKernels k);
/// The family's name with the int8 instructions its q8 kernels use on this CPU, for the
/// human-readable lines (`run`, `bench`, the backend description): "avx2 + AVX-VNNI",
/// "avx512 + AMX", "avx512 + VNNI", or the bare name (f32 activations, scalar, no extension).
std::string cpu_kernels_label(const KernelConfig& k);
/// Parses "scalar|avx2|avx512|auto"; throws std::invalid_argument otherwise.
CpuKernels parse_cpu_kernels(const std::string& s);
/// "auto", "f32", "q8".
const char* act_quant_name(ActQuant a);
/// Parses "f32|q8|auto"; throws std::invalid_argument otherwise.
ActQuant parse_act_quant(const std::string& s);

/// True if matmul under `k` on weights of type `t` quantizes the activations (k.act is Q8 and t
/// has an int8 definition: every quantized type, not F32/F16/BF16).
bool has_q8_activations(const KernelConfig& k, GgmlType t);

/// int8 activations of n_tok tokens of `cols` columns (q8 mode; cols % 32 == 0), so that several
/// matmuls (and every thread of one) share one quantization. Layout, token-major:
/// q: n_tok x cols int8 codes (cols contiguous); d: n_tok x cols/32 fp32 block scales
/// (d = amax/127 of the block's 32 floats; ggml's Q8_0 scheme); s16: n_tok x cols/16 sums of
/// 16 consecutive codes. For the weight type named in resize() (the K- and I-quants with an int8
/// kernel, cols % 256 == 0) the codes are also kept in that type's lane order (ql, n_tok x cols;
/// dxl, n_tok x cols/16 per-lane block scales; xs, n_tok x cols/32, Q4_K/Q5_K only: d times the
/// block's code sum), which the SIMD kernels read directly (act_q8.h; otherwise every matmul call
/// rearranges the codes itself). For Q8_0 weights and more than 4 tokens (the GEMM's sizes) the
/// codes are also kept with the tokens in the lanes (tok16; the AVX-512 and AVX2 Q8_0 GEMMs, act_q8.h
/// "Tokens in the lanes"): groups of 16 tokens, per group g and 32-block b 8 runs j of 64 bytes,
/// run j holding for each of the 16 tokens (lane l = token 16g + l) its codes 4j..4j+3 of block b
/// plus 128 as unsigned bytes:
///   xg[((g * cols/32 + b) * 8 + j) * 64 + 4 l + i] = q(16g + l)[32 b + 4 j + i] + 128
///   dxg[(g * cols/32 + b) * 16 + l] = d(16g + l)[b]
/// and the lanes of tokens >= n_tok in the last group hold code 0 (byte 128) and scale 0. For Q4_K
/// and IQ4_XS weights and more than 4 tokens the same layout is kept (their AVX-512 GEMMs), for
/// Q4_K together with the per-block code sums scaled, for the weights' mins (tok16_xs):
///   xsg[(g * cols/32 + b) * 16 + l] = d(16g + l)[b] * float(s16[2b] + s16[2b+1])   (0 in padding)
struct ActQ8 {
  int64_t cols = 0, n_tok = 0;
  GrowBuffer<int8_t> q;
  GrowBuffer<float> d;
  GrowBuffer<int16_t> s16;
  GgmlType lanes = GgmlType::F32;  ///< the type ql/dxl/xs are arranged for; F32: none
  GrowBuffer<int8_t> ql;
  GrowBuffer<float> dxl, xs;
  bool tok16 = false;     ///< xg/dxg are kept (resize() for Q8_0, Q4_K, IQ4_XS and > 4 tokens)
  bool tok16_xs = false;  ///< xsg is kept too (Q4_K)
  GrowBuffer<uint8_t> xg;
  GrowBuffer<float> dxg, xsg;
  /// Sizes the buffers for n_tok x cols (only grows; the contents are undefined until
  /// quantize_activations writes them: no zero-fill) and chooses the lane order to keep
  /// (`for_type`; any type without one keeps none). Throws std::runtime_error if cols % 32.
  void resize(int64_t n_tok, int64_t cols, GgmlType for_type = GgmlType::F32);
  /// Codes, block scales and 16-sums of token t.
  const int8_t* qt(int64_t t) const { return q.data() + t * cols; }
  const float* dt(int64_t t) const { return d.data() + t * (cols / 32); }
  const int16_t* st(int64_t t) const { return s16.data() + t * (cols / 16); }
};

/// Quantizes tokens [t0, t1) of x (rows `ldx` floats apart, a.cols columns) into `a`, which
/// must have been resized to at least t1 tokens (and the lane order chosen there), with the
/// quantizer of k.family. A token's codes depend only on its own row; a block with a NaN or
/// infinity gets d = NaN (so the NaN reaches the outputs). Every kernel family produces identical
/// codes. Thread-safe for disjoint token ranges.
void quantize_activations(const KernelConfig& k, const float* x, int64_t ldx, int64_t t0, int64_t t1, ActQ8& a);

/// matmul with activations already quantized into `a` (all a.n_tok tokens; y as in matmul).
/// Gives exactly the bits matmul(k, t, ..., x, ...) gives in q8 mode for the x that `a` holds.
/// Throws std::runtime_error unless has_q8_activations(k, t) and a.cols == cols.
void matmul_q8(const KernelConfig& k, GgmlType t, const void* W, size_t row_bytes, int64_t row_begin, int64_t row_end,
               int64_t cols, const ActQ8& a, float* y, int64_t ldy);

/// Y = X * W^T for one row range, with the kernels of `k`:
///   for t in [0, n_tok), r in [row_begin, row_end):
///     y[t * ldy + r] = sum_k dequant(W)[r][k] * x[t * ldx + k]
/// W: `rows` rows of type `t`, `row_bytes` apart, `cols` elements each (cols % block == 0).
/// x: n_tok rows of `cols` floats, `ldx` floats apart. y: n_tok rows, `ldy` floats apart.
///
/// Invariance contract: y[t][r] is bit-identical whatever n_tok, the row range it was
/// computed in, and the other rows of x (so results do not depend on prompt chunking or
/// thread split). Only the kernel family (k.family) may change the rounding.
///
/// Units: all fp32; x and y must not overlap. In F32 mode (and for F32/F16/BF16 weights)
/// weights are expanded to fp32 exactly as quant::dequantize_row does; the fast families differ
/// from the scalar reference (double accumulation) only by fp32 accumulation, at most
/// (cols/16 + 8) * 2^-24 * sum_k |w_k x_k|. In Q8 mode (has_q8_activations(k, t)) every family
/// computes the same bits (the arithmetic is defined in matmul_q8_ref.cpp), except Q8_0, Q4_K and
/// IQ4_XS in the AVX-512 family and Q8_0 in the AVX2 family, which have their own serial
/// definitions (act_q8.h, matmul_q8_scalar_avx512 / matmul_q8_scalar_avx2; for Q8_0 the CUDA q8
/// one, the same in both families). Throws
/// std::runtime_error for an unsupported type, a ragged `cols`, a bad row range or
/// row_bytes < quant::row_size(t, cols).
void matmul(const KernelConfig& k, GgmlType t, const void* W, size_t row_bytes, int64_t row_begin, int64_t row_end,
            int64_t cols, const float* x, int64_t ldx, int64_t n_tok, float* y, int64_t ldy);

}  // namespace strata::cpu::kernels
