// Gated delta net (src/layers/gated_delta_net.{h,cpp}): the causal convolution step and the
// delta-rule recurrence, with the CPU's fp32 operations in the CPU's order. Contract: kernels.h.
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch.cuh"

namespace strata::cuda {

namespace {

__device__ __forceinline__ float silu(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x))); }

/// One thread per channel, walking the T tokens in order.
__global__ void gdn_conv_kernel(const float* __restrict__ x, int64_t C, int64_t T, const float* __restrict__ w, int K,
                                float* __restrict__ state, float* __restrict__ xc) {
  detail::grid_dependency_enter();
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const float* wc = w + c * K;
  for (int64_t t = 0; t < T; ++t) {
    const float xt = x[t * C + c];
    float acc = 0.0f;
    for (int j = 0; j < K - 1; ++j) acc = __fadd_rn(acc, __fmul_rn(wc[j], state[int64_t(j) * C + c]));
    acc = __fadd_rn(acc, __fmul_rn(wc[K - 1], xt));
    xc[t * C + c] = silu(acc);
    for (int j = 0; j + 1 < K - 1; ++j) state[int64_t(j) * C + c] = state[int64_t(j + 1) * C + c];
    if (K > 1) state[int64_t(K - 2) * C + c] = xt;
  }
}

/// Sum of one double per thread over the block: butterfly within each warp, then the warp sums
/// in warp order (every thread computes the same total). sh: blockDim/32 doubles.
__device__ double block_sum_d(double v, double* sh) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int nw = int(blockDim.x) / 32;
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x / 32] = v;
  __syncthreads();
  double s = 0;
  for (int i = 0; i < nw; ++i) s += sh[i];
  __syncthreads();
  return s;
}

/// Block per value head j; the head's state S [dk][dv] lives in shared memory for all T tokens.
__global__ void gdn_recurrent_kernel(const float* __restrict__ xc, int64_t C, int64_t T, const float* __restrict__ ba,
                                     const float* __restrict__ dt_bias, const float* __restrict__ A, int n_k_head,
                                     int n_v_head, int dk, int dv, float* __restrict__ state, float* __restrict__ o,
                                     bool separate_ba, bool tiled_heads) {
  detail::grid_dependency_enter();
  extern __shared__ double sm_d[];
  double* red = sm_d;                              // [32] warp sums
  float* S = reinterpret_cast<float*>(sm_d + 32);  // [dk][dv]
  float* sq = S + dk * dv;                         // [dk]
  float* sk = sq + dk;                             // [dk]
  const int j = int(blockIdx.x);
  const int tid = int(threadIdx.x);
  const int r = n_v_head / n_k_head, hk = tiled_heads ? j % n_k_head : j / r, g = j / r, gi = j % r;
  const int64_t key_dim = int64_t(n_k_head) * dk, value_dim = int64_t(n_v_head) * dv;
  float* Sg = state + int64_t(j) * dk * dv;
  for (int i = tid; i < dk * dv; i += blockDim.x) S[i] = Sg[i];
  const float q_scale = __fdiv_rn(1.0f, __fsqrt_rn(float(dk)));
  const float dtb = dt_bias[j], Aj = A[j];
  for (int64_t t = 0; t < T; ++t) {
    const float* xq = xc + t * C + int64_t(hk) * dk;
    const float* xk = xq + key_dim;
    float qv = 0.0f, kv = 0.0f;
    if (tid < dk) qv = xq[tid], kv = xk[tid];
    const double ssq = block_sum_d(double(qv) * double(qv), red);
    const double ssk = block_sum_d(double(kv) * double(kv), red);
    const float invq = float(1.0 / sqrt(ssq + 1e-6)), invk = float(1.0 / sqrt(ssk + 1e-6));
    if (tid < dk) {
      sq[tid] = __fmul_rn(__fmul_rn(qv, invq), q_scale);
      sk[tid] = __fmul_rn(kv, invk);
    }
    const float* bat = ba + t * 2 * n_v_head;
    const float b = separate_ba ? bat[j] : bat[g * 2 * r + gi];
    const float av = separate_ba ? bat[n_v_head + j] : bat[g * 2 * r + r + gi];
    const float beta = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-b)));
    const float xs = __fadd_rn(av, dtb);
    const float sp = xs > 20.0f ? xs : float(log1p(exp(double(xs))));
    const float decay = expf(__fmul_rn(sp, Aj));
    __syncthreads();
    if (tid < dv) {
      float mem = 0.0f;
      for (int i = 0; i < dk; ++i) {
        const float s = __fmul_rn(S[i * dv + tid], decay);
        S[i * dv + tid] = s;
        mem = __fadd_rn(mem, __fmul_rn(s, sk[i]));
      }
      const float v = xc[t * C + 2 * key_dim + int64_t(j) * dv + tid];
      const float delta = __fmul_rn(__fsub_rn(v, mem), beta);
      float acc = 0.0f;
      for (int i = 0; i < dk; ++i) {
        const float s = __fadd_rn(S[i * dv + tid], __fmul_rn(sk[i], delta));
        S[i * dv + tid] = s;
        acc = __fadd_rn(acc, __fmul_rn(s, sq[i]));
      }
      o[t * value_dim + int64_t(j) * dv + tid] = acc;
    }
    __syncthreads();  // sq/sk are rewritten by the next token
  }
  for (int i = tid; i < dk * dv; i += blockDim.x) Sg[i] = S[i];
}

}  // namespace

void gdn_conv(const float* x, int64_t C, int64_t T, const float* w, int K, float* state, float* xc, void* stream) {
  STRATA_CUDA_REQUIRE(C > 0 && T >= 0 && K >= 1, "cuda::gdn_conv: bad C/T/K");
  if (T == 0) return;
  detail::launch(gdn_conv_kernel, unsigned((C + 127) / 128), 128, 0, static_cast<cudaStream_t>(stream), x, C, T, w, K,
                 state, xc);
  STRATA_CUDA_CHECK_LAUNCH();
}

void gdn_recurrent(const float* xc, int64_t C, int64_t T, const float* ba, const float* dt_bias, const float* A,
                   int n_k_head, int n_v_head, int dk, int dv, float* state, float* o, void* stream, bool separate_ba,
                   bool tiled_heads) {
  STRATA_CUDA_REQUIRE(n_k_head > 0 && n_v_head > 0 && n_v_head % n_k_head == 0,
                      "cuda::gdn_recurrent: n_v_head must be a positive multiple of n_k_head");
  STRATA_CUDA_REQUIRE(dk > 0 && dv > 0 && dk <= 1024 && dv <= 1024, "cuda::gdn_recurrent: dk, dv must be in [1, 1024]");
  STRATA_CUDA_REQUIRE(C >= 2 * int64_t(n_k_head) * dk + int64_t(n_v_head) * dv, "cuda::gdn_recurrent: C < conv_dim");
  if (T == 0) return;
  int dev = 0, max_smem = 0;
  STRATA_CUDA_CHECK(cudaGetDevice(&dev));
  STRATA_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  const int threads = ((dk > dv ? dk : dv) + 31) / 32 * 32;
  const size_t smem = sizeof(double) * 32 + sizeof(float) * (size_t(dk) * dv + 2 * size_t(dk));
  STRATA_CUDA_REQUIRE(smem <= size_t(max_smem), "cuda::gdn_recurrent: a head's state (" + std::to_string(smem) +
                                                    " bytes) exceeds the shared memory of a block (" +
                                                    std::to_string(max_smem) + ")");
  detail::opt_in_smem(reinterpret_cast<const void*>(gdn_recurrent_kernel), int(smem));
  detail::launch(gdn_recurrent_kernel, unsigned(n_v_head), threads, smem, static_cast<cudaStream_t>(stream), xc, C, T,
                 ba, dt_bias, A, n_k_head, n_v_head, dk, dv, state, o, separate_ba, tiled_heads);
  STRATA_CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
