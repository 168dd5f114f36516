// Kernels for the gpt-oss / glm4moe options of the CudaBackend (contracts in family_kernels.h).
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/family_kernels.h"
#include "backend/cuda/launch.cuh"

namespace strata::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxRowsPerLaunch = 65535;

__global__ void add_bias_kernel(float* x, int64_t ldx, const float* __restrict__ b, int64_t cols, int64_t t0) {
  detail::grid_dependency_enter();
  const int64_t t = t0 + blockIdx.y;
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= cols) return;
  x[t * ldx + i] = __fadd_rn(x[t * ldx + i], b[i]);
}

__global__ void rope_kernel(float* x, int64_t ld_tok, int64_t n_tok, int n_heads, int head_dim, int half,
                            const int32_t* __restrict__ pos, const double* __restrict__ inv_freq, bool neox,
                            double attn_factor) {
  detail::grid_dependency_enter();
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = n_tok * n_heads * half;
  if (idx >= total) return;
  const int i = int(idx % half);
  const int h = int((idx / half) % n_heads);
  const int64_t t = idx / (int64_t(half) * n_heads);
  const double theta = double(pos[t]) * inv_freq[i];
  const float c = float(__dmul_rn(cos(theta), attn_factor)), s = float(__dmul_rn(sin(theta), attn_factor));
  const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
  float* xh = x + t * ld_tok + int64_t(h) * head_dim;
  const float a = xh[i0], b = xh[i1];
  xh[i0] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  xh[i1] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

__global__ void swiglu_oai_kernel(const float* g, const float* u, float* y, int64_t n, float alpha, float limit) {
  detail::grid_dependency_enter();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float gv = g[i], uv = u[i];
    gv = gv < limit ? gv : limit;
    uv = uv < -limit ? -limit : (uv > limit ? limit : uv);
    const float sg = __fdiv_rn(gv, __fadd_rn(1.0f, expf(-__fmul_rn(alpha, gv))));
    y[i] = __fmul_rn(sg, __fadd_rn(uv, 1.0f));
  }
}

unsigned elementwise_blocks(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return unsigned(b < 65536 ? b : 65536);
}

}  // namespace

void add_bias(float* x, int64_t ldx, const float* b, int64_t cols, int64_t n_rows, void* stream) {
  STRATA_CUDA_REQUIRE(cols > 0 && ldx >= cols && n_rows >= 0, "cuda::add_bias: bad cols/ldx/n_rows");
  STRATA_CUDA_REQUIRE(x && b, "cuda::add_bias: null pointer");
  for (int64_t t0 = 0; t0 < n_rows; t0 += kMaxRowsPerLaunch) {
    const int64_t n = n_rows - t0 < kMaxRowsPerLaunch ? n_rows - t0 : kMaxRowsPerLaunch;
    const dim3 grid(unsigned((cols + kThreads - 1) / kThreads), unsigned(n));
    detail::launch(add_bias_kernel, grid, kThreads, 0, static_cast<cudaStream_t>(stream), x, ldx, b, cols, t0);
    STRATA_CUDA_CHECK_LAUNCH();
  }
}

void rope(float* x, int64_t ld_tok, int64_t n_tok, int n_heads, int head_dim, int n_rot, const int32_t* pos,
          const double* inv_freq, bool neox, double attn_factor, void* stream) {
  STRATA_CUDA_REQUIRE(n_rot > 0 && n_rot % 2 == 0 && n_rot <= head_dim,
                      "cuda::rope: n_rot must be even, in (0, head_dim]");
  STRATA_CUDA_REQUIRE(n_heads > 0 && ld_tok >= int64_t(n_heads) * head_dim, "cuda::rope: ld_tok < n_heads*head_dim");
  STRATA_CUDA_REQUIRE(n_tok >= 0, "cuda::rope: n_tok < 0");
  const int64_t total = n_tok * n_heads * (n_rot / 2);
  if (total == 0) return;
  STRATA_CUDA_REQUIRE((total + 255) / 256 <= 0x7fffffff, "cuda::rope: too many elements");
  detail::launch(rope_kernel, unsigned((total + 255) / 256), 256, 0, static_cast<cudaStream_t>(stream), x, ld_tok,
                 n_tok, n_heads, head_dim, n_rot / 2, pos, inv_freq, neox, attn_factor);
  STRATA_CUDA_CHECK_LAUNCH();
}

void swiglu_oai(const float* gate, const float* up, float* y, int64_t n, float alpha, float limit, void* stream) {
  STRATA_CUDA_REQUIRE(n >= 0, "cuda::swiglu_oai: n < 0");
  if (n == 0) return;
  detail::launch(swiglu_oai_kernel, elementwise_blocks(n), kThreads, 0, static_cast<cudaStream_t>(stream), gate, up, y,
                 n, alpha, limit);
  STRATA_CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
