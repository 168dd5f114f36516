// Small kernels of the CudaBackend (contracts in backend_kernels.h).
#include "backend/cuda/backend_kernels.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch.cuh"

#include <algorithm>

namespace strata::cuda {

namespace {

constexpr int kThreads = 256;

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// A 2-D launch: blockIdx.y = row (up to 65535 per launch, looped on the host), x over columns.
dim3 grid_for(int64_t cols, int64_t rows) {
  return dim3(unsigned((cols + kThreads - 1) / kThreads), unsigned(rows));
}
constexpr int64_t kMaxRowsPerLaunch = 65535;

__global__ void gather_rows_kernel(const float* __restrict__ src, int64_t lds, const int64_t* __restrict__ pairs,
                                   int top_k, float* __restrict__ dst, int64_t ldd, int64_t cols, int64_t j0) {
  detail::grid_dependency_enter();
  const int64_t j = j0 + blockIdx.y;
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= cols) return;
  dst[j * ldd + i] = src[(pairs[j] / top_k) * lds + i];
}

__global__ void repeat_rows_kernel(const float* __restrict__ src, int64_t lds, int top_k, float* __restrict__ dst,
                                   int64_t ldd, int64_t cols, int64_t j0) {
  detail::grid_dependency_enter();
  const int64_t j = j0 + blockIdx.y;
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= cols) return;
  dst[j * ldd + i] = src[(j / top_k) * lds + i];
}

constexpr int kGroupThreads = 1024;

__global__ void __launch_bounds__(kGroupThreads)
    group_pairs_kernel(const int32_t* __restrict__ ids, int64_t n_pairs, const void* const* __restrict__ table,
                       int n_expert, int tile_gu, int64_t rb_gu, int tile_dn, int64_t rb_dn,
                       int64_t* __restrict__ pairs,
                       GroupedMatmulJob* __restrict__ gu, GroupedMatmulJob* __restrict__ dn) {
  detail::grid_dependency_enter();
  extern __shared__ int gp_smem[];
  int* count = gp_smem;                 // [n_expert]
  int* cursor = gp_smem + n_expert;     // [n_expert]: next free slot of each expert
  auto expert_of = [&](int64_t j) {
    const int e = ids[j];
    return e < 0 || e >= n_expert ? 0 : e;
  };
  for (int e = threadIdx.x; e < n_expert; e += kGroupThreads) count[e] = 0;
  __syncthreads();
  for (int64_t j = threadIdx.x; j < n_pairs; j += kGroupThreads) atomicAdd(&count[expert_of(j)], 1);
  __syncthreads();
  if (threadIdx.x == 0) {  // exclusive scans of the rows and of the token tiles, in expert order
    int64_t off = 0, tiles_gu = 0, tiles_dn = 0;
    for (int e = 0; e < n_expert; ++e) {
      const int c = count[e];
      GroupedMatmulJob g;
      g.w = table[3 * e];
      g.w2 = table[3 * e + 1];
      g.row0 = off;
      g.n_tok = c;
      g.block0 = rb_gu * tiles_gu;
      gu[e] = g;
      GroupedMatmulJob d;
      d.w = table[3 * e + 2];
      d.w2 = nullptr;
      d.row0 = off;
      d.n_tok = c;
      d.block0 = rb_dn * tiles_dn;
      dn[e] = d;
      cursor[e] = int(off);
      off += c;
      tiles_gu += (c + tile_gu - 1) / tile_gu;
      tiles_dn += (c + tile_dn - 1) / tile_dn;
    }
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < n_pairs; j += kGroupThreads) pairs[atomicAdd(&cursor[expert_of(j)], 1)] = j;
}

__global__ void scatter_rows_kernel(const float* __restrict__ src, int64_t lds, const int64_t* __restrict__ pairs,
                                    float* __restrict__ dst, int64_t ldd, int64_t cols, int64_t j0) {
  detail::grid_dependency_enter();
  const int64_t j = j0 + blockIdx.y;
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= cols) return;
  dst[pairs[j] * ldd + i] = src[j * lds + i];
}

__global__ void add_rows_kernel(float* x, int64_t ldx, const float* y, int64_t ldy, int64_t cols, int64_t t0) {
  detail::grid_dependency_enter();
  const int64_t t = t0 + blockIdx.y;
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= cols) return;
  x[t * ldx + i] = __fadd_rn(x[t * ldx + i], y[t * ldy + i]);
}

__global__ void split_q_gate_kernel(const float* __restrict__ qg, int64_t n, int head_dim, float* __restrict__ q,
                                    float* __restrict__ gate) {
  detail::grid_dependency_enter();
  // i indexes q / gate as [T][n_head][head_dim]; the source is [T][n_head][2][head_dim].
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  const int64_t th = i / head_dim, d = i % head_dim;
  q[i] = qg[th * 2 * head_dim + d];
  gate[i] = qg[th * 2 * head_dim + head_dim + d];
}

__device__ __forceinline__ float sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

__global__ void sigmoid_mul_kernel(float* x, const float* __restrict__ gate, int64_t n) {
  detail::grid_dependency_enter();
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  x[i] = __fmul_rn(x[i], sigmoid(gate[i]));
}

__global__ void gated_accumulate_kernel(float* out, int64_t ldo, const float* __restrict__ y, int64_t ldy,
                                        const float* __restrict__ s, int64_t cols, int64_t t0) {
  detail::grid_dependency_enter();
  const int64_t t = t0 + blockIdx.y;
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= cols) return;
  const float g = sigmoid(s[t]);
  out[t * ldo + i] = __fadd_rn(out[t * ldo + i], __fmul_rn(g, y[t * ldy + i]));
}

__global__ void moe_combine_kernel(const float* __restrict__ eo, int64_t lde, const float* __restrict__ w, int K,
                                   float* __restrict__ out, int64_t ldo, int64_t cols, int64_t t0,
                                   const int32_t* __restrict__ pub_src, int32_t* __restrict__ pub_dst,
                                   int64_t pub_words) {
  detail::grid_dependency_enter();
  // The layer's routing words to host memory (block 0 of the first launch), in place of a copy
  // node between this layer's kernels and the next layer's.
  if (pub_words > 0 && blockIdx.x == 0 && blockIdx.y == 0)
    for (int64_t j = threadIdx.x; j < pub_words; j += blockDim.x) pub_dst[j] = pub_src[j];
  const int64_t t = t0 + blockIdx.y;
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= cols) return;
  float o = 0.0f;
  for (int k = 0; k < K; ++k) o = __fadd_rn(o, __fmul_rn(w[t * K + k], eo[(t * K + k) * lde + i]));
  out[t * ldo + i] = o;
}

// Runs launch(first_row, rows) over [0, n_rows) in pieces of at most 65535 rows (grid.y's limit).
template <class F>
void by_rows(int64_t n_rows, F launch) {
  for (int64_t r0 = 0; r0 < n_rows; r0 += kMaxRowsPerLaunch) {
    launch(r0, std::min<int64_t>(kMaxRowsPerLaunch, n_rows - r0));
    STRATA_CUDA_CHECK_LAUNCH();
  }
}

unsigned blocks_1d(int64_t n) { return unsigned((n + kThreads - 1) / kThreads); }

}  // namespace

void gather_rows(const float* src, int64_t lds, const int64_t* pairs, int top_k, int64_t n, float* dst, int64_t ldd,
                 int64_t cols, void* stream) {
  STRATA_CUDA_REQUIRE(top_k > 0 && n >= 0 && cols >= 0, "cuda::gather_rows: bad shape");
  if (n == 0 || cols == 0) return;
  by_rows(n, [&](int64_t j0, int64_t m) {
    detail::launch(gather_rows_kernel, grid_for(cols, m), kThreads, 0, as_stream(stream), src, lds, pairs, top_k, dst,
                   ldd, cols, j0);
  });
}

void repeat_rows(const float* src, int64_t lds, int top_k, int64_t n, float* dst, int64_t ldd, int64_t cols,
                 void* stream) {
  STRATA_CUDA_REQUIRE(top_k > 0 && n >= 0 && cols >= 0, "cuda::repeat_rows: bad shape");
  if (n == 0 || cols == 0) return;
  by_rows(n, [&](int64_t j0, int64_t m) {
    detail::launch(repeat_rows_kernel, grid_for(cols, m), kThreads, 0, as_stream(stream), src, lds, top_k, dst, ldd,
                   cols, j0);
  });
}

void group_pairs(const int32_t* ids, int64_t n_pairs, const void* const* table, int n_expert, int tile_gu,
                 int64_t rb_gu, int tile_dn, int64_t rb_dn, int64_t* pairs, GroupedMatmulJob* gate_up,
                 GroupedMatmulJob* down, void* stream) {
  STRATA_CUDA_REQUIRE(n_pairs >= 0 && n_pairs <= INT32_MAX && n_expert >= 1 && n_expert <= 4096 && tile_gu >= 1 &&
                          tile_dn >= 1 && rb_gu >= 1 && rb_dn >= 1,
                      "cuda::group_pairs: bad shape");
  detail::launch(group_pairs_kernel, 1, kGroupThreads, 2 * size_t(n_expert) * sizeof(int), as_stream(stream), ids,
                 n_pairs, table, n_expert, tile_gu, rb_gu, tile_dn, rb_dn, pairs, gate_up, down);
  STRATA_CUDA_CHECK_LAUNCH();
}

void scatter_rows(const float* src, int64_t lds, const int64_t* pairs, int64_t n, float* dst, int64_t ldd,
                  int64_t cols, void* stream) {
  STRATA_CUDA_REQUIRE(n >= 0 && cols >= 0, "cuda::scatter_rows: bad shape");
  if (n == 0 || cols == 0) return;
  by_rows(n, [&](int64_t j0, int64_t m) {
    detail::launch(scatter_rows_kernel, grid_for(cols, m), kThreads, 0, as_stream(stream), src, lds, pairs, dst, ldd,
                   cols, j0);
  });
}

void add_rows(float* x, int64_t ldx, const float* y, int64_t ldy, int64_t cols, int64_t n_rows, void* stream) {
  STRATA_CUDA_REQUIRE(n_rows >= 0 && cols >= 0, "cuda::add_rows: bad shape");
  if (n_rows == 0 || cols == 0) return;
  by_rows(n_rows, [&](int64_t t0, int64_t m) {
    detail::launch(add_rows_kernel, grid_for(cols, m), kThreads, 0, as_stream(stream), x, ldx, y, ldy, cols, t0);
  });
}

void split_q_gate(const float* qg, int64_t T, int n_head, int head_dim, float* q, float* gate, void* stream) {
  STRATA_CUDA_REQUIRE(T >= 0 && n_head > 0 && head_dim > 0, "cuda::split_q_gate: bad shape");
  const int64_t n = T * n_head * head_dim;
  if (n == 0) return;
  detail::launch(split_q_gate_kernel, blocks_1d(n), kThreads, 0, as_stream(stream), qg, n, head_dim, q, gate);
  STRATA_CUDA_CHECK_LAUNCH();
}

void sigmoid_mul(float* x, const float* gate, int64_t n, void* stream) {
  STRATA_CUDA_REQUIRE(n >= 0, "cuda::sigmoid_mul: n < 0");
  if (n == 0) return;
  detail::launch(sigmoid_mul_kernel, blocks_1d(n), kThreads, 0, as_stream(stream), x, gate, n);
  STRATA_CUDA_CHECK_LAUNCH();
}

void gated_accumulate(float* out, int64_t ldo, const float* y, int64_t ldy, const float* s, int64_t cols, int64_t T,
                      void* stream) {
  STRATA_CUDA_REQUIRE(T >= 0 && cols >= 0, "cuda::gated_accumulate: bad shape");
  if (T == 0 || cols == 0) return;
  by_rows(T, [&](int64_t t0, int64_t m) {
    detail::launch(gated_accumulate_kernel, grid_for(cols, m), kThreads, 0, as_stream(stream), out, ldo, y, ldy, s,
                   cols, t0);
  });
}

void moe_combine(const float* eo, int64_t lde, const float* w, int K, int64_t T, float* out, int64_t ldo, int64_t cols,
                 void* stream, const int32_t* pub_src, int32_t* pub_dst, int64_t pub_words) {
  STRATA_CUDA_REQUIRE(K > 0 && T >= 0 && cols >= 0 && pub_words >= 0, "cuda::moe_combine: bad shape");
  STRATA_CUDA_REQUIRE(pub_words == 0 || (pub_src && pub_dst), "cuda::moe_combine: null publish pointers");
  STRATA_CUDA_REQUIRE(pub_words == 0 || (T > 0 && cols > 0), "cuda::moe_combine: nothing to launch for the publish");
  if (T == 0 || cols == 0) return;
  by_rows(T, [&](int64_t t0, int64_t m) {
    detail::launch(moe_combine_kernel, grid_for(cols, m), kThreads, 0, as_stream(stream), eo, lde, w, K, out, ldo, cols,
                   t0, pub_src, pub_dst, t0 == 0 ? pub_words : int64_t{0});
  });
}

}  // namespace strata::cuda
