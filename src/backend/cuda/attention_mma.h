#pragma once
// The tensor-core attention kernel (attention_mma.cu), behind cuda::attention (kernels.h,
// AttentionPath). Internal to src/backend/cuda.
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace strata::cuda::detail {

/// Cache positions per segment of the tensor-core kernel (its softmax state starts fresh at
/// every multiple of this; kernels.h, AttentionPath::Mma).
inline constexpr int kAttnMmaSegment = 32;
/// Query rows (token, head of the GQA group) per block of the tensor-core kernel.
inline constexpr int kAttnMmaRows = 64;

/// How one attention call runs on either kernel: `n_seg` cache segments of `segment` positions;
/// split (the segments in parallel blocks, then a fold kernel) when there are at least 2 and
/// fewer than 128 blocks otherwise (n_head_kv x ceil(n_rows / rows_per_block)); `bytes` of fp32
/// partial states (m, l, o[head_dim]) per KV head, query row and segment when split, else 0.
struct SplitPlan {
  int64_t n_seg = 0;
  bool split = false;
  size_t bytes = 0;
};

inline SplitPlan split_plan(const AttentionArgs& a, int rows_per_block, int segment) {
  const int64_t n_rows = a.n_tok * (a.n_head / a.n_head_kv);
  const int64_t gy = (n_rows + rows_per_block - 1) / rows_per_block;
  SplitPlan p;
  p.n_seg = (a.pos0 + a.n_tok - 1) / segment + 1;
  p.split = p.n_seg >= 2 && int64_t(a.n_head_kv) * gy < 128;
  if (p.split) p.bytes = sizeof(float) * size_t(a.n_head_kv) * size_t(n_rows) * size_t(p.n_seg) * size_t(a.head_dim + 2);
  return p;
}

/// The partial-state buffer of a split call: a.part when it holds `bytes`, else a stream-ordered
/// allocation that release_part frees after the fold.
inline float* acquire_part(const AttentionArgs& a, size_t bytes, cudaStream_t st) {
  if (a.part && a.part_bytes >= bytes) return static_cast<float*>(a.part);
  float* p = nullptr;
  STRATA_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&p), bytes, st));
  return p;
}

inline void release_part(const AttentionArgs& a, float* p, cudaStream_t st) {
  if (p != a.part) STRATA_CUDA_CHECK(cudaFreeAsync(p, st));
}

/// Which kernel runs the tensor-core one-pass prefill (the calls that are not split, see
/// SplitPlan): true (default): fa_split_kv_kernel splits the K / V cache rows of the call into
/// bf16 pieces once, in a stream-ordered scratch allocation (cudaMallocAsync / cudaFreeAsync,
/// 12 x n_head_kv x head_dim bytes per position from the tile of fa_first_pos(pos0, window) to
/// pos0 + n_tok - 1), and fa_prefill_kernel (8 warps, 128 query rows per block) copies them with
/// cp.async, double-buffered; false: the former fa_kernel (4 warps, 64 rows, each block splitting
/// its own tiles). Both give the same bits (tested). Process-wide; the first use reads
/// STRATA_CUDA_FA_PREFILL ("0": false), for before / after measurements. Thread-safe.
bool fa_prefill_enabled();
/// Sets fa_prefill_enabled() for later calls (tests compare the two kernels).
void set_fa_prefill_enabled(bool on);
/// Test hook, process-wide: false runs every later tensor-core call in one pass (as if
/// SplitPlan::split were false; the same bits, more slowly for decode), so that the one-pass
/// kernels can be compared at any shape; true (default): as split_plan decides.
void set_fa_split_allowed(bool on);

/// Whether split-KV decode (<= 16 query rows, fa_decode_kernel) folds its segment states in the
/// same kernel: true (default): the blocks with the last arrivals at a per-(stream, KV head)
/// counter fold them (fd_arrive_and_fold) with fa_combine's code; false: fa_combine runs as a
/// second launch. Both give the same bits (tested). Process-wide; the first use reads
/// STRATA_CUDA_FA_FUSED ("0": false), for before / after measurements. Thread-safe.
bool fa_fused_enabled();
/// Sets fa_fused_enabled() for later calls (tests compare the two paths).
void set_fa_fused_enabled(bool on);

/// True if the tensor-core kernel takes these arguments: head_dim 64 or 128, q, k, v 16-byte
/// aligned, q_stride and kv_stride multiples of 4 floats. The other checks are cuda::attention's.
bool attention_mma_takes(const AttentionArgs& a);

/// Launches the tensor-core kernel on `stream` (a cudaStream_t); the arguments must already
/// have passed cuda::attention's checks and attention_mma_takes.
void attention_mma(const AttentionArgs& a, void* stream);

}  // namespace strata::cuda::detail
