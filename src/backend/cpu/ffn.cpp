#include "backend/cpu/ffn.h"

#include <cmath>
#include <vector>

namespace strata::cpu {

void swiglu_ffn(ThreadPool& pool, const kernels::KernelConfig& kc, const FfnWeights& w, const float* h, int64_t n_embd,
                int64_t T, float* out) {
  const int64_t n_ff = w.gate.rows;
  thread_local GrowBuffer<float> tl_g, tl_u;
  float* const g = scratch_floats(tl_g, T * n_ff);
  float* const u = scratch_floats(tl_u, T * n_ff);
  matmul(pool, kc, w.gate, h, n_embd, T, g, n_ff);
  matmul(pool, kc, w.up, h, n_embd, T, u, n_ff);
  pool.parallel_for(T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0 * n_ff; i < t1 * n_ff; ++i) g[i] = silu(g[i]) * u[i];
  });
  matmul(pool, kc, w.down, g, n_ff, T, out, n_embd);
}

void add_gated_swiglu_ffn(ThreadPool& pool, const kernels::KernelConfig& kc, const FfnWeights& w,
                          const MatrixRef& gate_inp, const float* h, int64_t n_embd, int64_t T, float* out) {
  thread_local GrowBuffer<float> tl_y, tl_gate;
  float* const y = scratch_floats(tl_y, T * n_embd);
  float* const gate = scratch_floats(tl_gate, T);
  swiglu_ffn(pool, kc, w, h, n_embd, T, y);
  matmul(pool, kc, gate_inp, h, n_embd, T, gate, 1);
  pool.parallel_for(T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float s = 1.0f / (1.0f + std::exp(-gate[t]));
      for (int64_t i = 0; i < n_embd; ++i) out[t * n_embd + i] += s * y[t * n_embd + i];
    }
  });
}

}  // namespace strata::cpu
