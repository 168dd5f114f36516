#include "backend/cpu/ffn.h"

#include <cmath>
#include <vector>

namespace strata::cpu {

void swiglu_ffn(ThreadPool& pool, const kernels::KernelConfig& kc, const FfnWeights& w, const float* h, int64_t n_embd,
                int64_t T, float* out) {
  const int64_t n_ff = w.gate.rows;
  std::vector<float> g(T * n_ff), u(T * n_ff);
  matmul(pool, kc, w.gate, h, n_embd, T, g.data(), n_ff);
  matmul(pool, kc, w.up, h, n_embd, T, u.data(), n_ff);
  for (int64_t i = 0; i < T * n_ff; ++i) g[i] = silu(g[i]) * u[i];
  matmul(pool, kc, w.down, g.data(), n_ff, T, out, n_embd);
}

void add_gated_swiglu_ffn(ThreadPool& pool, const kernels::KernelConfig& kc, const FfnWeights& w,
                          const MatrixRef& gate_inp, const float* h, int64_t n_embd, int64_t T, float* out) {
  std::vector<float> y(T * n_embd), gate(T);
  swiglu_ffn(pool, kc, w, h, n_embd, T, y.data());
  matmul(pool, kc, gate_inp, h, n_embd, T, gate.data(), 1);
  for (int64_t t = 0; t < T; ++t) {
    const float s = 1.0f / (1.0f + std::exp(-gate[t]));
    for (int64_t i = 0; i < n_embd; ++i) out[t * n_embd + i] += s * y[t * n_embd + i];
  }
}

}  // namespace strata::cpu
