#pragma once
// Dense SwiGLU feed-forward network (Shazeer 2020, "GLU Variants Improve Transformer"):
//   out = down(silu(gate h) * up h)
// Used for the always-resident shared expert of qwen3next (ffn_{gate,up,down}_shexp, scaled
// by sigmoid(h . ffn_gate_inp_shexp): transformers Qwen3NextSparseMoeBlock) and for dense
// FFN layers of any architecture.
#include <cstdint>

#include "backend/cpu/ops.h"

namespace strata::cpu {

struct FfnWeights {
  MatrixRef gate;  ///< ffn_gate(_shexp): [n_ff, n_embd] rows x cols
  MatrixRef up;    ///< ffn_up(_shexp):   [n_ff, n_embd]
  MatrixRef down;  ///< ffn_down(_shexp): [n_embd, n_ff]
};

/// SwiGLU FFN for T tokens. h: [T][n_embd]; out: [T][n_embd] (overwritten).
/// Per-token results do not depend on T (matmul invariance).
void swiglu_ffn(ThreadPool& pool, const kernels::KernelConfig& kc, const FfnWeights& w, const float* h, int64_t n_embd,
                int64_t T, float* out);

/// Adds a sigmoid-gated FFN to `out`: out[t] += sigmoid(gate_inp . h[t]) * swiglu_ffn(h[t]).
/// gate_inp: [1, n_embd] (one scalar gate per token), e.g. ffn_gate_inp_shexp.
void add_gated_swiglu_ffn(ThreadPool& pool, const kernels::KernelConfig& kc, const FfnWeights& w,
                          const MatrixRef& gate_inp, const float* h, int64_t n_embd, int64_t T, float* out);

}  // namespace strata::cpu
