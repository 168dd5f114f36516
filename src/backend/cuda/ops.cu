// Elementwise and per-row kernels: RMSNorm, add, SwiGLU, softmax, NEOX RoPE. Contracts in
// kernels.h. Reductions use a fixed tree over a fixed number of threads (no atomics), so a
// row's result depends only on that row.
#include <cfloat>
#include <string>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/env_switch.h"
#include "backend/cuda/launch.cuh"

namespace strata::cuda {

namespace {

constexpr int kRowThreads = 256;

/// Sum over the block of one value per thread, in a fixed tree (thread 0's value first).
template <class T>
__device__ T block_sum(T v, T* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
#pragma unroll
  for (int s = kRowThreads / 2; s > 0; s /= 2) {
    if (int(threadIdx.x) < s) sh[threadIdx.x] = sh[threadIdx.x] + sh[threadIdx.x + s];
    __syncthreads();
  }
  const T r = sh[0];
  __syncthreads();
  return r;
}

__device__ float block_max(float v, float* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
#pragma unroll
  for (int s = kRowThreads / 2; s > 0; s /= 2) {
    if (int(threadIdx.x) < s) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + s]);
    __syncthreads();
  }
  const float r = sh[0];
  __syncthreads();
  return r;
}

// Rows of up to kRowThreads * PER values (PER = 8, 16 or 32, the smallest that holds the row) are
// normalized from registers: each thread loads its values i = threadIdx.x + kRowThreads j (and the
// weights, before the dependency wait: model weights, which no kernel writes) all at once, where a
// loop over them waited for one load after another (a decode norm's ~8 us a call was mostly those
// latencies). Longer rows take the loop (PER = 0), which is the code of before, block_sum included.
constexpr int kRowRegsMax = 32;

// Opt-in until it has run on a GPU (written in the fifteenth session, docs/cuda.md): the loop
// stays the default. STRATA_CUDA_NORM_REGS=1 takes the registers.
detail::EnvSwitch g_norm_regs{"STRATA_CUDA_NORM_REGS", detail::on_if_set};

/// The register count per thread for a row of n values: 8, 16, 32, or 0 (the loop; always unless
/// STRATA_CUDA_NORM_REGS=1 / set_norm_regs(1)).
inline int row_regs(int64_t n) {
  if (g_norm_regs.get() == 0) return 0;
  for (int per : {8, 16, kRowRegsMax})
    if (n <= int64_t(kRowThreads) * per) return per;
  return 0;
}

/// The register path's RMSNorm scale float(1 / sqrt(ss_total / n + eps)) of one row (Zhang & Sennrich 2019), from
/// each thread's partial sum of squares (double, over its values in j order), summed in
/// block_sum's tree order: the cross-warp steps (128, 64, 32) in shared memory, then warp 0's five
/// steps by shuffles, which pair the same lanes as the shared-memory steps they replace (the same
/// bits as block_sum, five barriers fewer). Every thread of the block must call it.
__device__ float row_rms_scale(double ss, double* sh, int64_t n, float eps) {
  sh[threadIdx.x] = ss;
  __syncthreads();
#pragma unroll
  for (int s = kRowThreads / 2; s >= 32; s /= 2) {
    if (int(threadIdx.x) < s) sh[threadIdx.x] = sh[threadIdx.x] + sh[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x < 32) {
    double v = sh[threadIdx.x];
#pragma unroll
    for (int s = 16; s > 0; s /= 2) v = v + __shfl_down_sync(0xffffffffu, v, s);
    if (threadIdx.x == 0) sh[0] = v;
  }
  __syncthreads();
  return float(1.0 / sqrt(sh[0] / double(n) + double(eps)));
}

/// v[j] = p[threadIdx.x + kRowThreads j] for the j inside [0, n), else 0: a thread's values of a
/// row, every load issued before any is used.
template <int N>
__device__ __forceinline__ void load_row_regs(const float* p, int64_t n, float (&v)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int64_t i = threadIdx.x + int64_t(kRowThreads) * j;
    v[j] = i < n ? p[i] : 0.0f;
  }
}

/// One block per row: y = x * scale * w, rounded as (x * scale) * w, scale = row_rms_scale.
template <int PER>
__global__ void __launch_bounds__(kRowThreads) rms_norm_kernel(const float* x, int64_t ldx, const float* __restrict__ w,
                                                               float* y, int64_t ldy, int64_t n, float eps) {
  constexpr bool regs = PER > 0;
  constexpr int kRowRegs = PER > 0 ? PER : 1;
  float wv[kRowRegs], xv[kRowRegs];
  if constexpr (regs) {
    load_row_regs(w, n, wv);
  }
  detail::grid_dependency_enter();
  __shared__ double sh[kRowThreads];
  const float* xr = x + int64_t(blockIdx.x) * ldx;
  float* yr = y + int64_t(blockIdx.x) * ldy;
  double ss = 0;
  if constexpr (regs) {
    load_row_regs(xr, n, xv);
#pragma unroll
    for (int j = 0; j < kRowRegs; ++j)
      if (threadIdx.x + int64_t(kRowThreads) * j < n) ss += double(xv[j]) * double(xv[j]);
    const float scale = row_rms_scale(ss, sh, n, eps);
#pragma unroll
    for (int j = 0; j < kRowRegs; ++j) {
      const int64_t i = threadIdx.x + int64_t(kRowThreads) * j;
      if (i < n) yr[i] = __fmul_rn(__fmul_rn(xv[j], scale), wv[j]);
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += kRowThreads) ss += double(xr[i]) * double(xr[i]);
    ss = block_sum(ss, sh);
    const float scale = float(1.0 / sqrt(ss / double(n) + double(eps)));
    for (int64_t i = threadIdx.x; i < n; i += kRowThreads) yr[i] = __fmul_rn(__fmul_rn(xr[i], scale), w[i]);
  }
}

__global__ void add_kernel(const float* a, const float* b, float* y, int64_t n) {
  detail::grid_dependency_enter();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __fadd_rn(a[i], b[i]);
}

__device__ __forceinline__ float silu(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x))); }

__global__ void swiglu_kernel(const float* g, const float* u, float* y, int64_t n) {
  detail::grid_dependency_enter();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __fmul_rn(silu(g[i]), u[i]);
}

__global__ void __launch_bounds__(kRowThreads) softmax_kernel(float* x, int64_t ld, int64_t n) {
  detail::grid_dependency_enter();
  __shared__ double shd[kRowThreads];
  __shared__ float shf[kRowThreads];
  float* xr = x + int64_t(blockIdx.x) * ld;
  float mx = -FLT_MAX;
  for (int64_t i = threadIdx.x; i < n; i += kRowThreads) mx = fmaxf(mx, xr[i]);
  mx = block_max(mx, shf);
  double sum = 0;
  for (int64_t i = threadIdx.x; i < n; i += kRowThreads) {
    const float e = expf(__fsub_rn(xr[i], mx));
    xr[i] = e;
    sum += double(e);
  }
  sum = block_sum(sum, shd);
  const float inv = float(1.0 / sum);
  for (int64_t i = threadIdx.x; i < n; i += kRowThreads) xr[i] = __fmul_rn(xr[i], inv);
}

/// One thread per (token, head, pair i < n_rot/2).
__global__ void rope_neox_kernel(float* x, int64_t ld_tok, int64_t n_tok, int n_heads, int head_dim, int half,
                                 const int32_t* __restrict__ pos, const double* __restrict__ inv_freq) {
  detail::grid_dependency_enter();
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = n_tok * n_heads * half;
  if (idx >= total) return;
  const int i = int(idx % half);
  const int h = int((idx / half) % n_heads);
  const int64_t t = idx / (int64_t(half) * n_heads);
  const double theta = double(pos[t]) * inv_freq[i];
  const float c = float(cos(theta)), s = float(sin(theta));
  float* xh = x + t * ld_tok + int64_t(h) * head_dim;
  const float a = xh[i], b = xh[i + half];
  xh[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  xh[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

/// One block per (token, head) row of q (heads 0..n_head-1) or k (the next n_head_kv): the row
/// normed as rms_norm_kernel does (same loop, tree and products), then rotated as
/// rope_neox_kernel does, through shared memory (head_dim floats).
__global__ void __launch_bounds__(kRowThreads)
    qk_norm_rope_kernel(float* q, int64_t ldq, int n_head, float* k, int64_t ldk, int n_head_kv, int head_dim,
                        const float* __restrict__ qw, const float* __restrict__ kw, float eps, int half, int64_t pos0,
                        const double* __restrict__ inv_freq) {
  detail::grid_dependency_enter();
  extern __shared__ float row[];
  __shared__ double sh[kRowThreads];
  const int heads = n_head + n_head_kv;
  const int64_t t = int64_t(blockIdx.x) / heads;
  const int h = int(int64_t(blockIdx.x) % heads);
  float* xr = h < n_head ? q + t * ldq + int64_t(h) * head_dim : k + t * ldk + int64_t(h - n_head) * head_dim;
  const float* w = h < n_head ? qw : kw;
  if (w) {
    double ss = 0;
    for (int i = threadIdx.x; i < head_dim; i += kRowThreads) ss += double(xr[i]) * double(xr[i]);
    ss = block_sum(ss, sh);
    const float scale = float(1.0 / sqrt(ss / double(head_dim) + double(eps)));
    for (int i = threadIdx.x; i < head_dim; i += kRowThreads) row[i] = __fmul_rn(__fmul_rn(xr[i], scale), w[i]);
  } else {
    for (int i = threadIdx.x; i < head_dim; i += kRowThreads) row[i] = xr[i];
  }
  __syncthreads();
  const double p = double(int32_t(pos0 + t));
  for (int i = threadIdx.x; i < half; i += kRowThreads) {
    const double theta = p * inv_freq[i];
    const float c = float(cos(theta)), s = float(sin(theta));
    const float a = row[i], b = row[i + half];
    row[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    row[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < head_dim; i += kRowThreads) xr[i] = row[i];
}

/// qk_norm_rope_kernel's operations for head_dim <= 256 with one warp per (token, head) row and
/// the rotation's cos / sin made once per token and block: block (token blockIdx.x, heads
/// blockIdx.y * heads_per_block .. + heads_per_block - 1), warp w taking heads w, w + 8, ... of those. Lane l
/// holds elements l + 32 j (j < 8) of the row, so block_sum's tree over 256 threads (thread i
/// holding element i, 0 past head_dim) is replayed exactly: the strides 128, 64 and 32 within
/// the lane, then 16 .. 1 across lanes (the same adds of the same operands), so the bits equal
/// qk_norm_rope_kernel's. smem: 2 * half floats of cos / sin, then 8 rows of head_dim floats.
__global__ void __launch_bounds__(kRowThreads)
    qk_norm_rope_warp_kernel(float* q, int64_t ldq, int n_head, float* k, int64_t ldk, int n_head_kv, int head_dim,
                             const float* __restrict__ qw, const float* __restrict__ kw, float eps, int half,
                             int64_t pos0, const double* __restrict__ inv_freq, int heads_per_block) {
  detail::grid_dependency_enter();
  extern __shared__ float qk_sh[];
  float* cs = qk_sh;         // cos, half floats
  float* sn = qk_sh + half;  // sin, half floats
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) & 31;
  float* row = qk_sh + 2 * half + warp * head_dim;
  const int64_t t = blockIdx.x;
  const double p = double(int32_t(pos0 + t));
  for (int i = threadIdx.x; i < half; i += kRowThreads) {
    const double theta = p * inv_freq[i];
    cs[i] = float(cos(theta)), sn[i] = float(sin(theta));
  }
  __syncthreads();
  const int heads = n_head + n_head_kv;
  const int h_end = min(heads, int(blockIdx.y + 1) * heads_per_block);
  for (int h = int(blockIdx.y) * heads_per_block + warp; h < h_end; h += kRowThreads / 32) {
    float* xr = h < n_head ? q + t * ldq + int64_t(h) * head_dim : k + t * ldk + int64_t(h - n_head) * head_dim;
    const float* w = h < n_head ? qw : kw;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = lane + 32 * j < head_dim ? xr[lane + 32 * j] : 0.0f;
    if (w) {
      double u[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) u[j] = lane + 32 * j < head_dim ? double(v[j]) * double(v[j]) : 0.0;
        // block_sum: sh[i] = sh[i] + sh[i + s] for s = 128, 64, 32 (slots of this lane), then 16 .. 1
#pragma unroll
      for (int j = 0; j < 4; ++j) u[j] = u[j] + u[j + 4];
#pragma unroll
      for (int j = 0; j < 2; ++j) u[j] = u[j] + u[j + 2];
      double ss = u[0] + u[1];
#pragma unroll
      for (int s = 16; s > 0; s /= 2) {
        const double o = __shfl_down_sync(0xffffffffu, ss, s);
        if (lane < s) ss = ss + o;
      }
      ss = __shfl_sync(0xffffffffu, ss, 0);
      const float scale = float(1.0 / sqrt(ss / double(head_dim) + double(eps)));
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (lane + 32 * j < head_dim) v[j] = __fmul_rn(__fmul_rn(v[j], scale), w[lane + 32 * j]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (lane + 32 * j < head_dim) row[lane + 32 * j] = v[j];
    __syncwarp();
    for (int i = lane; i < half; i += 32) {
      const float c = cs[i], s = sn[i];
      const float a = row[i], b = row[i + half];
      row[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
      row[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
    __syncwarp();
    for (int i = lane; i < head_dim; i += 32) xr[i] = row[i];
    __syncwarp();
  }
}

/// One block per row: x += y as add_kernel, then out = the RMSNorm of the sum as rms_norm_kernel.
/// Each thread reads back only the sums it wrote itself, so no barrier is needed between the two.
template <int PER>
__global__ void __launch_bounds__(kRowThreads)
    add_rms_norm_kernel(float* x, int64_t ldx, const float* __restrict__ y, int64_t ldy, const float* __restrict__ w,
                        float* __restrict__ out, int64_t ldo, int64_t n, float eps) {
  constexpr bool regs = PER > 0;
  constexpr int kRowRegs = PER > 0 ? PER : 1;
  float wv[kRowRegs], sv[kRowRegs];
  if constexpr (regs) {
    load_row_regs(w, n, wv);
  }
  detail::grid_dependency_enter();
  __shared__ double sh[kRowThreads];
  float* xr = x + int64_t(blockIdx.x) * ldx;
  const float* yr = y + int64_t(blockIdx.x) * ldy;
  float* orow = out + int64_t(blockIdx.x) * ldo;
  double ss = 0;
  if constexpr (regs) {
    float yv[kRowRegs];
    load_row_regs(xr, n, sv);
    load_row_regs(yr, n, yv);
#pragma unroll
    for (int j = 0; j < kRowRegs; ++j) {
      const int64_t i = threadIdx.x + int64_t(kRowThreads) * j;
      if (i < n) {
        sv[j] = __fadd_rn(sv[j], yv[j]);
        xr[i] = sv[j];
        ss += double(sv[j]) * double(sv[j]);
      }
    }
    const float scale = row_rms_scale(ss, sh, n, eps);
#pragma unroll
    for (int j = 0; j < kRowRegs; ++j) {
      const int64_t i = threadIdx.x + int64_t(kRowThreads) * j;
      if (i < n) orow[i] = __fmul_rn(__fmul_rn(sv[j], scale), wv[j]);
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += kRowThreads) {
      const float v = __fadd_rn(xr[i], yr[i]);
      xr[i] = v;
      ss += double(v) * double(v);
    }
    ss = block_sum(ss, sh);
    const float scale = float(1.0 / sqrt(ss / double(n) + double(eps)));
    for (int64_t i = threadIdx.x; i < n; i += kRowThreads) orow[i] = __fmul_rn(__fmul_rn(xr[i], scale), w[i]);
  }
}

/// pick(std::integral_constant<int, PER>{}) for row_regs(n)'s PER: the instance of a norm
/// kernel (rms_norm_kernel, add_rms_norm_kernel) that takes a row of n values.
template <class Pick>
auto row_kernel(int64_t n, Pick pick) {
  switch (row_regs(n)) {
    case 8: return pick(std::integral_constant<int, 8>{});
    case 16: return pick(std::integral_constant<int, 16>{});
    case kRowRegsMax: return pick(std::integral_constant<int, kRowRegsMax>{});
    default: return pick(std::integral_constant<int, 0>{});
  }
}

unsigned elementwise_blocks(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return unsigned(b < 65536 ? b : 65536);
}

}  // namespace

void rms_norm(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy, int64_t n, int64_t n_rows, float eps,
              void* stream) {
  STRATA_CUDA_REQUIRE(n > 0 && ldx >= n && ldy >= n, "cuda::rms_norm: bad n/ldx/ldy");
  STRATA_CUDA_REQUIRE(n_rows >= 0 && n_rows <= 0x7fffffff, "cuda::rms_norm: bad n_rows");
  if (n_rows == 0) return;
  auto* k = row_kernel(n, [](auto per) { return &rms_norm_kernel<decltype(per)::value>; });
  detail::launch(k, unsigned(n_rows), kRowThreads, 0, static_cast<cudaStream_t>(stream), x, ldx, w, y, ldy, n, eps);
  STRATA_CUDA_CHECK_LAUNCH();
}

void add(const float* a, const float* b, float* y, int64_t n, void* stream) {
  STRATA_CUDA_REQUIRE(n >= 0, "cuda::add: n < 0");
  if (n == 0) return;
  detail::launch(add_kernel, elementwise_blocks(n), 256, 0, static_cast<cudaStream_t>(stream), a, b, y, n);
  STRATA_CUDA_CHECK_LAUNCH();
}

void swiglu(const float* gate, const float* up, float* y, int64_t n, void* stream) {
  STRATA_CUDA_REQUIRE(n >= 0, "cuda::swiglu: n < 0");
  if (n == 0) return;
  detail::launch(swiglu_kernel, elementwise_blocks(n), 256, 0, static_cast<cudaStream_t>(stream), gate, up, y, n);
  STRATA_CUDA_CHECK_LAUNCH();
}

void softmax_rows(float* x, int64_t ld, int64_t n, int64_t n_rows, void* stream) {
  STRATA_CUDA_REQUIRE(n > 0 && ld >= n, "cuda::softmax_rows: bad n/ld");
  STRATA_CUDA_REQUIRE(n_rows >= 0 && n_rows <= 0x7fffffff, "cuda::softmax_rows: bad n_rows");
  if (n_rows == 0) return;
  detail::launch(softmax_kernel, unsigned(n_rows), kRowThreads, 0, static_cast<cudaStream_t>(stream), x, ld, n);
  STRATA_CUDA_CHECK_LAUNCH();
}

void rope_neox(float* x, int64_t ld_tok, int64_t n_tok, int n_heads, int head_dim, int n_rot, const int32_t* pos,
               const double* inv_freq, void* stream) {
  STRATA_CUDA_REQUIRE(n_rot > 0 && n_rot % 2 == 0 && n_rot <= head_dim, "cuda::rope_neox: n_rot must be even, in (0, head_dim]");
  STRATA_CUDA_REQUIRE(n_heads > 0 && ld_tok >= int64_t(n_heads) * head_dim, "cuda::rope_neox: ld_tok < n_heads*head_dim");
  STRATA_CUDA_REQUIRE(n_tok >= 0, "cuda::rope_neox: n_tok < 0");
  const int64_t total = n_tok * n_heads * (n_rot / 2);
  if (total == 0) return;
  STRATA_CUDA_REQUIRE((total + 255) / 256 <= 0x7fffffff, "cuda::rope_neox: too many elements");
  detail::launch(rope_neox_kernel, unsigned((total + 255) / 256), 256, 0, static_cast<cudaStream_t>(stream), x, ld_tok,
                 n_tok, n_heads, head_dim, n_rot / 2, pos, inv_freq);
  STRATA_CUDA_CHECK_LAUNCH();
}

void qk_norm_rope(float* q, int64_t ldq, int n_head, float* k, int64_t ldk, int n_head_kv, int head_dim,
                  int64_t n_tok, const float* q_norm, const float* k_norm, float eps, int n_rot, int64_t pos0,
                  const double* inv_freq, void* stream) {
  STRATA_CUDA_REQUIRE(head_dim >= 1 && n_head >= 0 && n_head_kv >= 0 && n_tok >= 0, "cuda::qk_norm_rope: bad shape");
  STRATA_CUDA_REQUIRE(n_rot >= 0 && n_rot % 2 == 0 && n_rot <= head_dim,
                      "cuda::qk_norm_rope: n_rot must be even, in [0, head_dim]");
  STRATA_CUDA_REQUIRE(ldq >= int64_t(n_head) * head_dim && ldk >= int64_t(n_head_kv) * head_dim,
                      "cuda::qk_norm_rope: ldq / ldk below the heads' width");
  STRATA_CUDA_REQUIRE(pos0 >= 0 && pos0 + n_tok <= 0x7fffffff, "cuda::qk_norm_rope: positions beyond int32");
  const int64_t blocks = n_tok * (int64_t(n_head) + n_head_kv);
  if (blocks == 0) return;
  STRATA_CUDA_REQUIRE(blocks <= 0x7fffffff, "cuda::qk_norm_rope: too many rows for one launch");
  if (head_dim <= 256) {
    // one warp per row, cos / sin once per (token, block): a block takes all heads of a token in
    // prefill, 8 in decode (more blocks for one token)
    const int heads = n_head + n_head_kv;
    const int hpb = n_tok >= 64 ? heads : kRowThreads / 32;
    const size_t wsmem = (size_t(n_rot) + size_t(kRowThreads / 32) * size_t(head_dim)) * sizeof(float);
    const dim3 grid(unsigned(n_tok), unsigned((heads + hpb - 1) / hpb));
    detail::launch(qk_norm_rope_warp_kernel, grid, kRowThreads, wsmem, static_cast<cudaStream_t>(stream), q, ldq,
                   n_head, k, ldk, n_head_kv, head_dim, q_norm, k_norm, eps, n_rot / 2, pos0, inv_freq, hpb);
    STRATA_CUDA_CHECK_LAUNCH();
    return;
  }
  const size_t smem = size_t(head_dim) * sizeof(float);
  STRATA_CUDA_REQUIRE(smem <= 48 * 1024, "cuda::qk_norm_rope: head_dim above 12288");
  detail::launch(qk_norm_rope_kernel, unsigned(blocks), kRowThreads, smem, static_cast<cudaStream_t>(stream), q, ldq,
                 n_head, k, ldk, n_head_kv, head_dim, q_norm, k_norm, eps, n_rot / 2, pos0, inv_freq);
  STRATA_CUDA_CHECK_LAUNCH();
}

void add_rms_norm(float* x, int64_t ldx, const float* y, int64_t ldy, const float* w, float* out, int64_t ldo,
                  int64_t n, int64_t n_rows, float eps, void* stream) {
  STRATA_CUDA_REQUIRE(n > 0 && ldx >= n && ldy >= n && ldo >= n, "cuda::add_rms_norm: bad n/ldx/ldy/ldo");
  STRATA_CUDA_REQUIRE(n_rows >= 0 && n_rows <= 0x7fffffff, "cuda::add_rms_norm: bad n_rows");
  if (n_rows == 0) return;
  auto* k = row_kernel(n, [](auto per) { return &add_rms_norm_kernel<decltype(per)::value>; });
  detail::launch(k, unsigned(n_rows), kRowThreads, 0, static_cast<cudaStream_t>(stream), x, ldx, y, ldy, w, out, ldo, n,
                 eps);
  STRATA_CUDA_CHECK_LAUNCH();
}

void set_norm_regs(int mode) { mode < 0 ? g_norm_regs.clear() : g_norm_regs.set(mode != 0); }

}  // namespace strata::cuda
