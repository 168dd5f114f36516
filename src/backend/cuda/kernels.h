#pragma once
// CUDA kernels of the forward pass, with a host-side C++ API that does not include any CUDA
// header: streams are passed as `void*` (a cudaStream_t; nullptr = the legacy default stream),
// and every pointer documented as "device" must point to device memory (cudaMalloc or the
// helpers below). Every launch is asynchronous on its stream; argument errors are thrown on
// the host before anything is launched, and a CUDA failure is thrown as CudaError naming the
// call, the file and the line (src/backend/cuda/cuda_check.h). Nothing aborts.
//
// Shapes are written in ggml `ne` order: ne[0] is the contiguous dimension, so a matrix
// "[cols, rows]" has rows of `cols` contiguous elements. Units: elements unless a name ends
// in _bytes; all activations are fp32.
//
// Determinism and batch invariance (docs/architecture.md, "Exactness rules"): every kernel
// computes one output element with an instruction sequence fixed by the shapes of that
// element's own inputs, never by how many other tokens or rows share the launch, and uses no
// atomics. So the same inputs give the same bits for any n_tok, any split of a batch, and on
// both matmul paths (MatmulPath).
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "gguf/ggml_types.h"

namespace strata::cuda {

/// A failed CUDA runtime call (message: the CUDA error name and string, the call, file:line),
/// or a kernel argument the device cannot take.
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// ---------------------------------------------------------------------------------------------
// Devices and memory (thin checked wrappers, so that callers and tests need no CUDA headers)

/// Number of CUDA devices; 0 when there is no device or no driver (never throws).
int device_count() noexcept;
/// Makes `dev` the current device of the calling thread.
void set_device(int dev);
/// "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)" for device `dev`.
std::string device_description(int dev);

/// cudaMalloc of `bytes` (256-byte aligned); throws CudaError naming the size on failure.
void* device_alloc(size_t bytes);
/// cudaFree; nullptr is a no-op. Never throws (errors are ignored, as in a destructor).
void device_free(void* p) noexcept;
/// Synchronous copies (host memory may be pageable).
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
/// Waits for all work on `stream` and throws the first asynchronous error, if any.
void synchronize(void* stream = nullptr);

/// Owning device buffer (move-only).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : p_(bytes ? device_alloc(bytes) : nullptr), bytes_(bytes) {}
  ~DeviceBuffer() { device_free(p_); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr, o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      device_free(p_);
      p_ = o.p_, bytes_ = o.bytes_;
      o.p_ = nullptr, o.bytes_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return p_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Quantized matmul

/// True if matmul and get_rows take weights of type `t`: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
/// Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ2_XS, IQ3_S, IQ4_XS, IQ4_NL, MXFP4.
bool is_supported(GgmlType t);

/// Which kernel computes a matmul. MatVec and Tiled (the fp32 path) give the same bits for every
/// output element (below). Mma is the tensor-core path, a different arithmetic (below), for
/// has_mma types only. Auto takes Mma for every n_tok when has_mma(type, cols), else MatVec for
/// n_tok < 4 and Tiled otherwise; so for a given weight tensor Auto always computes an element
/// with the same arithmetic, whatever n_tok.
enum class MatmulPath { Auto, MatVec, Tiled, Mma };

/// The staging of the tensor-core kernels (MatmulPath::Mma, grouped_matmul; not the <= 8-token
/// mma_small): 2 loads the MMA fragments from shared memory with ldmatrix and
/// double-buffers the staging (one barrier per 32-column step); 1 (default) is the former kernel (32-bit
/// fragment loads, one buffer, two barriers). Both feed the same words to the same MMAs in the
/// same order, so their results are bit-identical (tested); 1 is the default because 2 measured no
/// faster (H200, 2026-12-02: prefill 2,418 vs 2,426 tok/s, decode 50.8 vs 48.3). Process-wide;
/// the first use reads STRATA_CUDA_MMA ("2": version 2).
int mma_kernel_version();
/// Sets mma_kernel_version() for later launches. Throws std::invalid_argument unless 1 or 2.
void set_mma_kernel_version(int version);

/// True if the tensor-core path (MatmulPath::Mma, grouped_matmul) takes weights of type `t` with
/// `cols` columns: Q8_0, Q4_K, Q6_K, and BF16 with cols a multiple of 32.
bool has_mma(GgmlType t, int64_t cols);

/// y[t][r] = sum_k W[r][k] x[t][k], for t < n_tok, r < rows.
///   W: device, [cols, rows] in the GGUF block format of `type` (row r at W + r * row_bytes,
///      row_bytes >= the row's size in bytes); x: device, [cols, n_tok] fp32, rows `ldx` floats
///      apart; y: device, [rows, n_tok] fp32, rows `ldy` floats apart (x and y must not overlap).
/// Arithmetic (identical on both paths, so bit-identical for any n_tok and path): each weight is
/// expanded to fp32 exactly as quant::dequantize_row does (same fp32 operations, no
/// contraction); the row is cut into 256-column chunks and lane l (0..31) of a warp owns
/// columns [256i + 8l, 256i + 8l + 8) of every chunk i, accumulating w·x with fp32 FMA in
/// column order; the 32 lane sums are combined by a fixed butterfly (xor 16, 8, 4, 2, 1).
/// MatVec: one warp per (row, token). Tiled: one warp per 4 rows and tile of 8 tokens, each
/// weight expanded once for the tile and each x load fed to the 4 rows (32 accumulators, each
/// the MatVec sequence).
/// Error against the exact sum (fp32 accumulation of cols/32 terms, then 5 additions):
/// |y - sum| <= (cols/32 + 6) * 2^-24 * sum_k |w_k x_k| (to first order).
/// Mma (tensor cores, mma.sync m16n8k16 bf16 with fp32 accumulation): the weights enter as
/// exact bf16 integer codes (Q8_0: q; Q4_K: q; Q6_K: q - 32) or as themselves (BF16), the
/// activations as three bf16 pieces x = hi + mid + lo (exact for normal fp32 x: 3 x 8
/// significand bits). Per output element and per scale group (32 columns; Q6_K: 16) the
/// products of the group are summed on the tensor cores from 0, then folded into an fp32
/// accumulator in column order: Q8_0 acc = fma(d, s, acc); Q6_K acc = fma(dl, s, acc); Q4_K
/// acc = fma(dl, s, fma(-ml, sum_x, acc)) with sum_x the group's x summed in fp32 (8-column
/// partials in order, then the four partials in order); BF16 acc = acc + s. The tensor cores'
/// internal sum order is fixed by the hardware per element, so the result depends only on that
/// element's row and token: bit-identical for any n_tok, tile and batch position. The columns
/// are cut into fixed chunks of 512: each chunk's fold starts from 0 and the chunk sums are
/// added in chunk order (a K split fixed by cols alone). Blocks of 4 warps: 64 rows x 32 or 64
/// tokens, one warp per 16 rows walking all chunks; for <= 8 tokens, 16 rows x 8 tokens with
/// the chunks spread over the warps (the same sums, so the same bits). Error: per group ~(16 + 2) * 2^-24 of its
/// sum |w x| (the tensor cores' fp32 sums), plus the fp32 fold; bound used by the tests:
/// |y - sum| <= (cols/16 + 8) * 2^-23 * sum_k |w_k x_k|.
/// Requirements (CudaError otherwise): is_supported(type); cols a multiple of the block size
/// (and of 8 for F32/F16/BF16); x 16-byte aligned and ldx a multiple of 4; W 16-byte aligned
/// with row_bytes a multiple of 16 for F32/F16/BF16, 2-byte aligned with even row_bytes for
/// the block types except MXFP4 (any alignment).
void matmul(GgmlType type, const void* W, size_t row_bytes, int64_t rows, int64_t cols, const float* x, int64_t ldx,
            int64_t n_tok, float* y, int64_t ldy, void* stream = nullptr, MatmulPath path = MatmulPath::Auto);

/// One expert of a grouped matmul: weights w (and w2, the up projection, for the SwiGLU pair)
/// applied to the n_tok rows of x starting at row0, writing the same rows of y.
struct GroupedMatmulJob {
  const void* w = nullptr;   ///< device, [cols, rows] of the group's type, row_bytes apart
  const void* w2 = nullptr;  ///< device, same type and shape (grouped_swiglu only), else unused
  int64_t row0 = 0;          ///< first row of this job in x and y
  int64_t n_tok = 0;         ///< its rows (>= 1)
  int64_t block0 = 0;        ///< first block of this job (filled by plan_grouped)
};
/// The token tile of the q8 GEMM (grouped_matmul_q8's plan.tile_tokens when the GEMM runs; 8 is the mat-vec).
inline constexpr int kGemmTileTokens = 64;
/// The launch shape of a grouped matmul: token tile (8, 32 or 64) and blocks in all.
struct GroupedMatmulPlan {
  int tile_tokens = 0;
  int64_t blocks = 0;
  bool words = false;  ///< plan_grouped_q8: every weight row is 4-byte aligned (the mat-vec loads 32-bit words)
  bool vec16 = false;  ///< every weight row is 16-byte aligned (the mat-vec stages rows with 16-byte copies)
  bool one_token = false;  ///< plan_grouped_q8: every job has one token (grouped_matmul_q8_x1 takes the plan)
};
/// Fills jobs[i].block0 (host memory) for `rows` x `cols` weights and returns the plan; the tile is
/// chosen from the largest n_tok, at most 32 for a swiglu_pair (register budget); it does not
/// change any result. Throws CudaError on n_jobs < 1, a job with n_tok < 1, or more than
/// 2^31 - 1 blocks.
GroupedMatmulPlan plan_grouped(GroupedMatmulJob* jobs, int n_jobs, int64_t rows, int64_t cols, bool swiglu_pair);

/// Every job's matmul in one launch, with MatmulPath::Mma's arithmetic (bit-identical with
/// matmul(..., Mma) on each job's rows alone): y[row0 + t][r] = sum_k w[r][k] x[row0 + t][k] for
/// t < n_tok. swiglu_pair: y[row0 + t][r] = silu(g) * u with g from w and u from w2 (silu(g) =
/// g / (1 + expf(-g)), the same expression as swiglu()). jobs: device copy of the planned
/// table; x: device [cols, total rows] fp32 rows ldx apart (16-byte aligned, ldx % 4 == 0); y:
/// device rows ldy apart. Requirements as matmul, and has_mma(type, cols).
void grouped_matmul(const GroupedMatmulPlan& plan, GgmlType type, const GroupedMatmulJob* jobs, int n_jobs,
                    size_t row_bytes, int64_t rows, int64_t cols, const float* x, int64_t ldx, float* y, int64_t ldy,
                    bool swiglu_pair, void* stream = nullptr);

// ---------------------------------------------------------------------------------------------
// q8 activations (--act-quant q8 on the CUDA backend; docs/cuda.md "q8 activations")

/// True if the q8-activation path (matmul_q8, grouped_matmul_q8) takes weights of type `t` with
/// `cols` columns: Q8_0 with cols a positive multiple of 32.
bool has_q8(GgmlType t, int64_t cols);

/// Quantizes n_tok rows of fp32 activations to int8 in blocks of 32, exactly as the CPU's
/// cpu::kernels::detail::quantize_block_q8 (ggml's Q8_0 scheme): per block amax = max |x|,
/// id = 127 / amax (0 when amax == 0), q = round-to-nearest-even(x * id) (the product rounded on
/// its own), d = amax / 127; a block holding a NaN or an infinity gets q = 0 and d = NaN, and a
/// block with amax < 127 / FLT_MAX (id overflows) gets q = 0, as the CPU's conversion gives. Same
/// fp32 operations, so the codes and scales equal the CPU's bit for bit (tested).
///   x: device, [cols, n_tok] fp32, rows ldx floats apart; q: device, [cols, n_tok] int8, rows
///   `cols` bytes apart (16-byte aligned for matmul_q8); d: device, [cols/32, n_tok] fp32, rows
///   cols/32 floats apart. rep > 1: output row t is input row t / rep (each input row repeated
///   rep times in a row: the (token, k) pairs of a MoE layer, without copying x first).
/// Throws CudaError unless cols is a positive multiple of 32, ldx >= cols and rep >= 1.
void quantize_q8(const float* x, int64_t ldx, int64_t cols, int64_t n_tok, int8_t* q, float* d, void* stream = nullptr,
                 int rep = 1);
/// quantize_q8 of gathered rows: output row t (t < n_tok) is input row map[t] / rep (map: device,
/// n_tok int64 entries, e.g. a MoE layer's (token, k) pairs t * top_k + k in expert order with rep =
/// top_k), so the rows need not be copied together first; map == nullptr is quantize_q8. Same
/// codes and scales as quantize_q8 of the gathered rows. Throws as quantize_q8.
void quantize_q8_rows(const float* x, int64_t ldx, int64_t cols, int64_t n_tok, const int64_t* map, int rep, int8_t* q,
                      float* d, void* stream = nullptr);

/// y[t][r] = sum over the Q8_0 blocks b of row r, for t < n_tok, with the activations given as
/// quantize_q8's codes xq and scales xd (rows of cols bytes / cols/32 floats, token t at
/// xq + t * cols and xd + t * cols / 32).
/// Arithmetic (the definition, the same on every kernel): for each output element, acc = 0, then
/// for each 32-column block b = 0, 1, ... in column order
///     S_b = sum_{k in b} qw_k * qx_k            (exact int32: |S_b| <= 32 * 127 * 128 < 2^24)
///     acc = fmaf(float(S_b), dw_b * dx_b, acc)  (dw_b * dx_b rounded to fp32 on its own)
/// with dw_b the block's fp16 scale as fp32 and dx_b the activation scale; y = acc. The GEMM takes
/// S_b from one int8 tensor-core MMA (mma.sync m16n8k32 s8.s8.s32, from 0), the mat-vec from 8
/// __dp4a (from 0): both exact, so both kernels and every tile give the same bits for an element
/// whatever n_tok, the other tokens or the batch (tested bit for bit against a scalar host
/// definition). Error against the exact w·x: the activation rounding (|x - dx qx| <= dx/2 per
/// element, the CPU --act-quant q8 error) plus the fp32 fold, <= (cols/32 + 1) 2^-24 sum |w dx qx|.
/// Kernels: MatVec, up to 8 tokens per block of 8 rows when W and row_bytes are 16-byte aligned
/// (mv2: rows of <= 1024 columns in one-warp blocks, 768 columns at a time, else 4 warps of 2
/// rows, 2048 columns at a time, copied to shared memory with 16-byte cp.async; STRATA_CUDA_MV16_V2=0:
/// the earlier mv16 kernel, 4 warps of 2 rows), else of 16 rows (of 4 rows below 4224 rows, for more blocks); Mma, the
/// GEMM, blocks of 128 rows x 64 tokens (8 warps of 32 x 32), 4 blocks of columns per stage, a 3-stage cp.async
/// pipeline; it needs W and row_bytes 8-byte aligned. Auto: the GEMM for n_tok > 8 when aligned, else MatVec.
/// Requirements (CudaError otherwise): has_q8(type, cols); W 2-byte aligned, row_bytes even and
/// >= cols/32 * 34; xq 16-byte aligned, xd 4-byte aligned; ldy >= rows; path Auto, MatVec or Mma.
void matmul_q8(GgmlType type, const void* W, size_t row_bytes, int64_t rows, int64_t cols, const int8_t* xq,
               const float* xd, int64_t n_tok, float* y, int64_t ldy, void* stream = nullptr,
               MatmulPath path = MatmulPath::Auto);

namespace detail {
/// Which kernel runs the 16-byte aligned q8 mat-vec (matmul_q8 / grouped_matmul_q8 with <= 8
/// tokens): 1 mv2_q8_kernel, 0 mv16_q8_kernel (the same bits), -1 back to the default
/// (mv2 unless STRATA_CUDA_MV16_V2=0, read once). For tests and same-process comparisons; a
/// launch reads it when it is issued.
void set_mv16_v2(int mode);
/// Whether the one-token fp32-activation entry points (q8_x1_takes) are on: 1 yes, 0 no (callers
/// quantize first, as before), -1 back to the default (on unless STRATA_CUDA_Q8_X1=0, read
/// once). For tests and same-process comparisons.
void set_q8_x1(int mode);
/// The L2 prefetch of the *_x1 launches (L2Prefetch): 0 off, 1 plain prefetches, 2 with the
/// evict_last priority, -1 back to the default (STRATA_CUDA_L2_PREFETCH, read once; off unless
/// set). For tests and same-process comparisons.
void set_l2_prefetch(int mode);
}  // namespace detail

/// Bytes a decode mat-vec launch asks the L2 cache to fetch for the kernel after it, while its
/// own weights stream: decode's kernels depend on each other in a chain, so each one's weight
/// reads otherwise start only after the one before it ends. Direct regions (p[i], bytes[i]: device
/// pointers known at the launch, e.g. attention's output projection during q/k/v) or, with jobs,
/// n_jobs regions of job_bytes bytes at jobs[j].w of a device job table that an earlier kernel
/// wrote (a MoE step's down weights during gate/up). The launch's blocks split the regions
/// evenly, one 128-byte line per prefetch (PTX ISA, `prefetch.global.L2`). A hint only: no
/// result depends on it (STRATA_CUDA_L2_PREFETCH: 0 off, 1 on, 2 with evict_last).
struct L2Prefetch {
  static constexpr int kMax = 4;
  const void* p[kMax] = {};
  size_t bytes[kMax] = {};
  int n = 0;
  const GroupedMatmulJob* jobs = nullptr;
  int n_jobs = 0;
  size_t job_bytes = 0;
  int mode = 0;  ///< set by the launch from STRATA_CUDA_L2_PREFETCH / detail::set_l2_prefetch
};

// ---- one token, fp32 activations, quantized inside the mat-vec (decode) ----
//
// The decode projections' activations are quantized by the mat-vec's blocks themselves (each
// block the token's row, into shared memory, with the quantizer's operations), so that no
// quantize_q8 launch precedes them. Results: the bits of quantize_q8 + the matching q8 call
// (the same codes, scales and fold), tested bit for bit.

/// True if the *_x1 entry points take this case: on (detail::set_q8_x1), Q8_0 with cols a
/// multiple of 32 and at most 8192, row_bytes a multiple of 16 (and the weights 16-byte
/// aligned: the caller's check), x 16-byte aligned, ldx % 4 == 0 and >= cols, and the 16-byte
/// mat-vec not forced off (STRATA_CUDA_MV_ROWS / STRATA_CUDA_MV16 / STRATA_CUDA_MV16_V2).
bool q8_x1_takes(GgmlType type, size_t row_bytes, int64_t cols, const float* x, int64_t ldx);

/// y[r] = sum_k W[r][k] q8(x)[k] for one token: quantize_q8(x) then matmul_q8(..., n_tok 1) in
/// one launch, the same bits. x: device [cols] fp32; W: device [cols, rows], 16-byte aligned;
/// y: device, y[r] at r (ldy >= rows is checked; one token, so only row 0 of y is written).
/// Throws CudaError unless q8_x1_takes and W 16-byte aligned.
void matmul_q8_x1(GgmlType type, const void* W, size_t row_bytes, int64_t rows, int64_t cols, const float* x, float* y,
                  int64_t ldy, void* stream = nullptr);


/// Fills jobs[i].block0 (host memory) for grouped_matmul_q8 with `rows` x `cols` weights of
/// `row_bytes` per row and returns the plan: tile 64 (the GEMM) when some job has more than 8
/// tokens and every job's weights (w, and w2 when set) are 8-byte aligned, else 8 (the mat-vec);
/// it does not change any result. Throws CudaError on n_jobs < 1, a job without tokens, or more
/// than 2^31 - 1 blocks.
GroupedMatmulPlan plan_grouped_q8(GroupedMatmulJob* jobs, int n_jobs, int64_t rows, int64_t cols, size_t row_bytes);

/// One matrix of matmul_q8_multi: W [cols, rows] (device, Q8_0 rows row_bytes apart) and its
/// output y [rows, n_tok] (device, rows ldy floats apart).
struct MatmulQ8Part {
  const void* w = nullptr;
  int64_t rows = 0;
  float* y = nullptr;
  int64_t ldy = 0;
};
/// matmul_q8 of n matrices with the same column count on the same activations (xq, xd: n_tok
/// tokens): y_i = W_i x for each part. With n <= 4, n_tok <= 8 and every W 16-byte aligned (with
/// row_bytes) the mat-vec runs once for all of them (a block's matrix found from its index;
/// attention's q, k and v in decode), else one matmul_q8 per part. Either way each output is
/// computed by the kernel and the operations matmul_q8 uses for that matrix alone: the same bits.
/// Throws CudaError as matmul_q8 for any part, or on n < 1.
void matmul_q8_multi(GgmlType type, const MatmulQ8Part* parts, int n, size_t row_bytes, int64_t cols, const int8_t* xq,
                     const float* xd, int64_t n_tok, void* stream = nullptr);
/// matmul_q8_multi for one token of fp32 activations x (device [cols]) quantized inside the
/// launch (matmul_q8_x1's scheme): 1 to 4 parts, one launch, the bits of quantize_q8 +
/// matmul_q8 per part. Throws CudaError unless q8_x1_takes and every W 16-byte aligned.
/// pf: what the launch prefetches into L2 for the next kernel (nullptr: nothing).
void matmul_q8_multi_x1(GgmlType type, const MatmulQ8Part* parts, int n, size_t row_bytes, int64_t cols, const float* x,
                        void* stream = nullptr, const L2Prefetch* pf = nullptr);

/// The plan of a grouped_matmul_q8 launch whose job table is written on the device (group_pairs):
/// `n_jobs` jobs with `n_tok` tokens in all, of `rows`-row weights. gemm: every job's weights and
/// row_bytes are 8-byte aligned (the caller checks), so the GEMM runs, else the mat-vec; words:
/// 4-byte aligned (the mat-vec's word loads); vec16: 16-byte aligned (the mat-vec's 16-byte
/// staging). tile_tokens: that kernel's token tile; blocks: an
/// upper bound, row_blocks x (ceil(n_tok / tile) + n_jobs), the blocks past a job's tiles
/// returning at once; row_blocks: one job's row blocks, which the device numbering multiplies by
/// each job's token tiles. Either kernel gives the same bits. Throws CudaError for a bound above
/// 2^31 - 1 blocks.
GroupedMatmulPlan plan_grouped_q8_bound(int n_jobs, int64_t n_tok, int64_t rows, bool gemm, bool words, bool vec16,
                                        int64_t& row_blocks);

/// Every job's matmul_q8 in one launch (bit-identical with matmul_q8 on each job's rows alone):
/// job j's tokens are rows [row0, row0 + n_tok) of the codes xq / scales xd and of y. swiglu_pair:
/// y = silu(g) * u with g from w and u from w2 (the expression of swiglu()). jobs: device copy of
/// the table plan_grouped_q8 filled. Requirements as matmul_q8.
/// y_rows (device, one int64 per x row, or nullptr): x row j's outputs go to row y_rows[j] of y
/// instead of row j (the scatter of a MoE layer's pairs back to (token, k) order, done by the
/// store); only with a GEMM plan (tile_tokens 64), else CudaError. Same values either way.
void grouped_matmul_q8(const GroupedMatmulPlan& plan, GgmlType type, const GroupedMatmulJob* jobs, int n_jobs,
                       size_t row_bytes, int64_t rows, int64_t cols, const int8_t* xq, const float* xd, float* y,
                       int64_t ldy, bool swiglu_pair, void* stream = nullptr, const int64_t* y_rows = nullptr);
/// grouped_matmul_q8 with one token per job and fp32 activations: job j's token row row0 reads x
/// row row0 / rep (x: device, rows ldx floats apart; rep = top_k for a MoE step's pairs of one
/// token), quantized inside the launch (matmul_q8_x1's scheme); the bits of quantize_q8(x, ...,
/// rep) + grouped_matmul_q8. plan: plan_grouped_q8's with one_token and vec16 (a mat-vec plan).
/// Throws CudaError unless q8_x1_takes, such a plan and rep >= 1. pf: as matmul_q8_multi_x1's.
void grouped_matmul_q8_x1(const GroupedMatmulPlan& plan, GgmlType type, const GroupedMatmulJob* jobs, int n_jobs,
                          size_t row_bytes, int64_t rows, int64_t cols, const float* x, int64_t ldx, int rep, float* y,
                          int64_t ldy, bool swiglu_pair, void* stream = nullptr, const L2Prefetch* pf = nullptr);

/// Embedding lookup: out[t][:] = dequantize_row(table row ids[t]) for t < n, bit-identical
/// with quant::dequantize_row. table: device, [cols, n_rows_table] of `type`, rows row_bytes
/// apart; ids: device, n int32 row indices (each in [0, n_rows_table): not checked on the
/// device, the caller validates token ids); out: device, [cols, n] fp32, rows `ldo` floats
/// apart. Same type and alignment requirements as matmul.
void get_rows(GgmlType type, const void* table, size_t row_bytes, int64_t cols, const int32_t* ids, int64_t n,
              float* out, int64_t ldo, void* stream = nullptr);

// ---------------------------------------------------------------------------------------------
// Elementwise and per-row ops (all device pointers, fp32)

/// RMSNorm of n_rows rows of n: y = (x * s) * w with s = float(1 / sqrt(mean(x^2) + eps)), the
/// mean of squares accumulated in double (per-thread partial sums over a fixed stride, then a
/// fixed tree). x: [n, n_rows] rows ldx apart; w: [n]; y: rows ldy apart (may alias x when
/// ldy == ldx). Matches cpu::rms_norm up to the double rounding of the mean (<= 1 ulp of s).
void rms_norm(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy, int64_t n, int64_t n_rows, float eps,
              void* stream = nullptr);

/// y[i] = a[i] + b[i] for i < n (exact; y may alias a or b).
void add(const float* a, const float* b, float* y, int64_t n, void* stream = nullptr);

/// y[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + expf(-x)) (CUDA's expf: <= 2 ulp), for i < n
/// (y may alias either input).
void swiglu(const float* gate, const float* up, float* y, int64_t n, void* stream = nullptr);

/// In-place softmax of n_rows rows of n (x: [n, n_rows], rows ld apart): max-subtracted,
/// expf, the sum in double (fixed tree), multiplied by float(1 / sum), as cpu::softmax.
void softmax_rows(float* x, int64_t ld, int64_t n, int64_t n_rows, void* stream = nullptr);

/// NEOX rotary embedding in place, as cpu::Rope::apply: x: [head_dim, n_heads, n_tok] (token t
/// at x + t * ld_tok, head h at + h * head_dim); pairs (i, i + n_rot/2) for i < n_rot/2 rotate
/// by theta = pos[t] * inv_freq[i] (double; cos/sin in double, rounded to float); pos: device,
/// n_tok int32 positions; inv_freq: device, n_rot/2 doubles (cpu::Rope::inv_freq).
void rope_neox(float* x, int64_t ld_tok, int64_t n_tok, int n_heads, int head_dim, int n_rot, const int32_t* pos,
               const double* inv_freq, void* stream = nullptr);

/// The per-head RMSNorm of q and k, then the NEOX rotation of both, in one launch: bit-identical
/// with rms_norm(q, head_dim, q_norm, q, head_dim, head_dim, n_tok * n_head, eps) and the same on
/// k (each skipped when its norm weight is null), followed by rope_neox on q and k with
/// pos[t] = pos0 + t (skipped when n_rot == 0). One block of 256 threads per (token, head) row,
/// the norm's sum tree and the rotation's operations those of the two kernels.
///   q: device, [head_dim, n_head, n_tok] fp32, token t at q + t * ldq; k: device, [head_dim,
///   n_head_kv, n_tok], token t at k + t * ldk (in place, e.g. the KV cache rows); q_norm /
///   k_norm: device [head_dim] or null; inv_freq: device, n_rot/2 doubles.
/// Throws CudaError for head_dim < 1, n_rot odd or > head_dim, ldq < n_head * head_dim or
/// ldk < n_head_kv * head_dim, or pos0 + n_tok beyond int32.
void qk_norm_rope(float* q, int64_t ldq, int n_head, float* k, int64_t ldk, int n_head_kv, int head_dim,
                  int64_t n_tok, const float* q_norm, const float* k_norm, float eps, int n_rot, int64_t pos0,
                  const double* inv_freq, void* stream = nullptr);

/// The residual add and the next RMSNorm in one launch: x = x + y, then out = rms_norm(x, w, eps),
/// per row; bit-identical with add (x, y, x) followed by rms_norm(x, ldx, w, out, ldo, ...).
/// x: device [n, n_rows], rows ldx apart (updated in place); y: rows ldy apart; out: rows ldo
/// apart (must not alias x or y). Throws CudaError for n < 1 or a leading dimension below n.
void add_rms_norm(float* x, int64_t ldx, const float* y, int64_t ldy, const float* w, float* out, int64_t ldo,
                  int64_t n, int64_t n_rows, float eps, void* stream = nullptr);

/// rms_norm and add_rms_norm from registers (rows of up to 8192 values: each thread's values
/// loaded at once, the weights before the dependency wait) or by a loop over each thread's values
/// (as every row longer than that): 1 registers, 0 the loop (the same bits), -1 back to the
/// default (the loop unless STRATA_CUDA_NORM_REGS=1, read once: opt-in until the registers have
/// run on a GPU). For tests and same-process comparisons; a launch reads it when it is issued.
void set_norm_regs(int mode);

// ---------------------------------------------------------------------------------------------
// Attention

/// Which attention kernel runs (cuda::attention). Auto: Mma where attention_has_mma() holds,
/// else Simt; the environment variable STRATA_CUDA_ATTN=simt makes Auto pick Simt everywhere
/// (read on first use; for side-by-side benchmarks). The two kernels give close but not
/// identical bits; each one alone keeps the decode = prefill = any-chunking promise.
enum class AttentionPath { Auto, Simt, Mma };

/// Causal GQA attention of n_tok consecutive query tokens against an fp32 KV cache.
struct AttentionArgs {
  const float* q = nullptr;  ///< device, [head_dim, n_head, n_tok], token rows q_stride floats apart
  int64_t q_stride = 0;
  const float* k = nullptr;  ///< device, cache [head_dim, n_head_kv, n_ctx], position rows kv_stride apart
  const float* v = nullptr;  ///< device, same layout as k
  int64_t kv_stride = 0;
  float* out = nullptr;  ///< device, [head_dim, n_head, n_tok], token rows out_stride apart
  int64_t out_stride = 0;
  int64_t n_tok = 0;              ///< query t is at position pos0 + t and sees cache positions [0, pos0 + t]
  int64_t pos0 = 0;               ///< (the cache must already hold positions up to pos0 + n_tok - 1)
  int n_head = 0, n_head_kv = 0;  ///< query head h reads KV head h / (n_head / n_head_kv)
  int head_dim = 0;               ///< a multiple of 32, at most 256; or 576 (MLA: 512 latent + 64 rotary)
  float scale = 0;                ///< usually 1/sqrt(head_dim)
  /// > 0: query t sees only the last `window` positions, [max(0, pos0 + t + 1 - window), pos0 + t]
  /// (sliding-window layers, gpt-oss); 0 = all of [0, pos0 + t].
  int64_t window = 0;
  /// device, [n_head] or null: one extra logit per query head (same units as the scaled scores)
  /// joining the softmax's max and denominator without a value row (gpt-oss attention sinks):
  /// out = sum_p e^(s_p - M) v_p / (sum_p e^(s_p - M) + e^(sink_h - M)).
  const float* sinks = nullptr;
  AttentionPath path = AttentionPath::Auto;  ///< Mma where attention_has_mma() is false: CudaError
  /// device scratch for the split-KV partial states (decode, small chunks), at least
  /// attention_scratch_bytes(*this) bytes, not in use by other queued work; null: each call
  /// allocates and frees its own in stream order (a host cost per call that decode notices).
  void* part = nullptr;
  size_t part_bytes = 0;  ///< the bytes at `part`; fewer than needed: allocated per call as with null
};

/// Bytes of partial states cuda::attention needs for `a` (0 when it runs in one pass): per KV
/// head, query row (token, head of the group) and 32- (Mma) or 256-position (Simt) segment of the cache,
/// (m, l, o[head_dim]) in fp32. An upper bound over both paths.
size_t attention_scratch_bytes(const AttentionArgs& a);

/// True if AttentionPath::Mma takes `a`: head_dim 64 or 128, q, k, v 16-byte aligned, q_stride
/// and kv_stride multiples of 4 floats (the other shapes, e.g. head_dim 96, 256 and MLA's 576,
/// run on the Simt kernel).
bool attention_has_mma(const AttentionArgs& a);

/// AttentionPath::Simt, fp32 on the CUDA cores.
/// Flash-attention style: blocks of one KV head and up to 8 query rows (token, head of the
/// group), KV in tiles of 32 positions through shared memory, online softmax. Per query row
/// the arithmetic is fixed by its position alone: score = (sequential fp32 FMA over head_dim)
/// * scale; per tile m' = max(m, tile max), c = expf(m - m'), l = l*c + (butterfly sum of
/// expf(s - m')), o = o*c then FMA of the tile's p·v in position order. The cache is cut into
/// fixed segments of 256 positions: each segment's (m, l, o) starts fresh (m = -inf, l = o = 0)
/// and the segments are folded in position order (M' = max(M, m), L = L e^(M-M') + l e^(m-M'),
/// O likewise); out = O / L. With few blocks (decode) the segments run in parallel and a second
/// kernel folds them; otherwise one pass folds as it goes: the same operations either way. So
/// decode (n_tok = 1) and prefill give the same bits for the same position, whatever the chunk.
/// A window (AttentionArgs::window) masks the positions before a row's first one: tiles wholly
/// before it are skipped and the folds start at the segment that holds it, so a row's arithmetic
/// is still fixed by its position alone. A sink joins after the last fold: M' = max(M, sink),
/// L' = L e^(M-M') + e^(sink-M'), O' = O e^(M-M').
///
/// AttentionPath::Mma, on the tensor cores (mma.sync m16n8k16, bf16 inputs, fp32 accumulation).
/// Blocks of one KV head and 64 query rows (4 warps x 16 rows: token, head of the group, so the
/// K/V tiles are staged once for the GQA group); KV in tiles of 32 positions. Every fp32 input x
/// (q, k, v, and the softmax weights p) is split into three bf16 pieces, hi = bf16(x),
/// mid = bf16(x - hi), lo = bf16(x - hi - mid) (round to nearest; x = hi + mid + lo to 2^-24
/// relative), and a product a·b is the six piece products a_i b_j with i + j <= 2 (dropped terms
/// < 2^-24 |a b|), multiplied per 16-long step of the sum on the tensor cores from 0, smallest
/// first ((2,0) (1,1) (0,2) (1,0) (0,1) (0,0)), then added to the fp32 sum in step order:
/// score = (sum over 16-dim steps) * scale; per tile m' = max(m, tile max) over the row's 32
/// positions (masked positions -inf), c = expf(m - m') (1 while m' = -inf), e = expf(s - m')
/// (0 masked), l = l*c + (the row's 8 values per lane summed in order, then the quad's butterfly),
/// o = o*c, then per 16-position step the pieces of e times those of v added to o. Segments of
/// 32 positions (detail::kAttnMmaSegment, one tile: decode splits a cache of P positions over P / 32 blocks per KV
/// head) start fresh and are folded in position order with the Simt formula, the sink after the last fold, out = O / L.
/// With few blocks (decode, small chunks) the segments run in parallel and a second kernel folds them; else one pass
/// folds as it goes (the folded O in registers): the same operations. A row's arithmetic depends on its position alone
/// (tile and segment edges are multiples of 32 and 128 from position 0; a tile a row does not see is a no-op for it: m'
/// = m, c = 1, e = 0), so decode, prefill and any chunking give the same bits, as on Simt. Error: the rounding of the
/// fp32 sums, as Simt (tests/test_cuda_kernels.cpp: the same 4e-6 bound against a double
/// reference). `out` must not overlap k or v. The one-pass prefill splits the call's K / V
/// cache rows into their pieces once (a stream-ordered scratch allocation of 12 x n_head_kv x
/// head_dim bytes per position) and runs blocks of 128 rows on them, copying the pieces with
/// cp.async, double-buffered: the same bits as the 64-row kernel that splits per block, which
/// STRATA_CUDA_FA_PREFILL=0 keeps (read on first use; detail::fa_prefill_enabled). Positions past
/// 2^31 - 1 are an error on that path.
/// Errors: bad shapes (head_dim, divisibility, n_tok <= 0, window < 0) throw CudaError.
void attention(const AttentionArgs& a, void* stream = nullptr);

// ---------------------------------------------------------------------------------------------
// Gated delta net (src/layers/gated_delta_net.h: same formulas, same layouts)

/// Causal depthwise convolution with the rolling state, then SiLU, for T tokens:
/// xc[t][c] = silu(sum_{j<K-1} w[c][j] state[j][c] + w[c][K-1] x[t][c]), then the state shifts
/// (it keeps the last K-1 raw inputs, oldest first). x, xc: device [C, T] (rows C apart);
/// w: device [K, C] (taps of a channel contiguous); state: device [C, K-1], advanced in place.
/// Products and sums in the CPU's order without contraction (bit-identical to the CPU before
/// the SiLU; the SiLU's expf <= 2 ulp).
void gdn_conv(const float* x, int64_t C, int64_t T, const float* w, int K, float* state, float* xc,
              void* stream = nullptr);

/// The recurrent part for T tokens, per value head j (value heads in parallel, tokens in
/// order): q, k of key head j / (n_v/n_k) from xc (q at t*C + hk*dk, k at + key_dim), each
/// L2-normalized (x / sqrt(sum x^2 + 1e-6), the sum in double), q then scaled by 1/sqrt(dk);
/// beta = sigmoid(b), decay = exp(softplus(a + dt_bias[j]) * A[j]) from ba [2*n_v, T] (per key
/// head [b (r values), a (r values)]); then cpu's delta_rule_step on S = state[j] ([dv, dk],
/// row i = dk index) with the same fp32 operations in the same order (no contraction),
/// o[t][j*dv + :] = S^T q. xc: device [C, T]; ba: device [2*n_v, T]; dt_bias, A: device [n_v];
/// state: device [dv, dk, n_v], advanced in place; o: device [n_v*dv, T].
/// separate_ba (qwen35moe's ssm_beta / ssm_alpha): ba per token is [b (n_v), a (n_v)], value
/// head j reading b at j and a at n_v + j. tiled_heads (backend::GdnSpec::VHeadOrder::Tiled,
/// llama.cpp's Qwen3.5 value-head order): value head j reads key head j % n_k instead of j / r.
/// Limits: dk, dv <= 1024; state of one head (dk*dv floats) must fit in shared memory.
void gdn_recurrent(const float* xc, int64_t C, int64_t T, const float* ba, const float* dt_bias, const float* A,
                   int n_k_head, int n_v_head, int dk, int dv, float* state, float* o, void* stream = nullptr,
                   bool separate_ba = false, bool tiled_heads = false);

}  // namespace strata::cuda
