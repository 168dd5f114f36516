#pragma once
// CUDA kernels for the model families beyond qwen3moe / qwen3next (gpt-oss, glm4moe): projection
// biases, both rotary layouts with YaRN's attention factor, and gpt-oss's clamped SwiGLU. Same
// conventions as kernels.h and backend_kernels.h: no CUDA header, streams as void*, every pointer a
// device pointer, fp32 rows `ld*` floats apart, asynchronous launches, CudaError on a bad argument
// or a failed launch. Every output element is computed from its own inputs with a fixed sequence
// of IEEE operations (no contraction), so results do not depend on how many rows share a launch.
#include <cstdint>

namespace strata::cuda {

/// x[t][i] += b[i] for t < n_rows, i < cols (one exact fp32 add, as the CPU backend's
/// add_bias). x: [cols, n_rows] rows ldx floats apart; b: [cols].
void add_bias(float* x, int64_t ldx, const float* b, int64_t cols, int64_t n_rows, void* stream = nullptr);

/// Rotary embedding in place, as cpu::rope_apply: x: [head_dim, n_heads, n_tok] (token t at
/// x + t * ld_tok, head h at + h * head_dim); for i < n_rot/2 the pair (i, i + n_rot/2) (neox) or
/// (2i, 2i+1) (NORM, neox = false) rotates by theta = pos[t] * inv_freq[i]: c = float(cos(theta) *
/// attn_factor), s = float(sin(theta) * attn_factor) (double, then rounded), a' = a c - b s,
/// b' = b c + a s. pos: device, n_tok int32; inv_freq: device, n_rot/2 doubles. attn_factor 1 with
/// neox is rope_neox's arithmetic exactly. Throws CudaError for n_rot odd, <= 0 or > head_dim.
void rope(float* x, int64_t ld_tok, int64_t n_tok, int n_heads, int head_dim, int n_rot, const int32_t* pos,
          const double* inv_freq, bool neox, double attn_factor, void* stream = nullptr);

/// y[i] = act(gate[i], up[i]) for i < n with gpt-oss's clamped SwiGLU (backend::FfnSpec::Act::
/// SwiGluOai, cpu::swiglu_oai): g' = min(g, limit), u' = clamp(u, -limit, limit),
/// y = g' / (1 + expf(-(alpha g'))) * (u' + 1) (CUDA's expf: <= 2 ulp). y may alias either input.
void swiglu_oai(const float* gate, const float* up, float* y, int64_t n, float alpha, float limit,
                void* stream = nullptr);

}  // namespace strata::cuda
