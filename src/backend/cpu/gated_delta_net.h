#pragma once
// Gated delta net (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2
// with Delta Rule", arXiv:2412.06464), the linear-attention layer of Qwen3-Next, in its
// recurrent form: work and memory per token are constant, so a prompt chunk of T tokens
// costs T steps, and prefill in any chunking equals token-by-token decode bit for bit.
//
// Per token t, with h the normed input (layout of the GGUF tensors as llama.cpp's converter
// writes them; see docs/architectures.md):
//   x      = attn_qkv h                         [q (n_k_head*dk) | k (n_k_head*dk) | v (n_v_head*dv)]
//   x'     = silu(causal depthwise conv_K(x))   (ssm_conv1d; state = the last K-1 inputs x)
//   q, k   = l2norm per key head (eps 1e-6 under the square root, as transformers' l2norm);
//            q *= 1/sqrt(dk); value head j reads key head j / (n_v_head / n_k_head)
//   b, a   = ssm_ba h, per key head [b (r), a (r)], r = n_v_head / n_k_head
//            (or b = ssm_beta h, a = ssm_alpha h, one per value head: qwen35moe)
//   value head j reads key head j / r (GdnSpec::VHeadOrder::Grouped) or j % n_k_head (Tiled)
//   beta   = sigmoid(b),  g = softplus(a + ssm_dt.bias) * ssm_a   (ssm_a = -exp(A_log) < 0)
//   S      = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q      (S: [dk][dv] per value head)
//   y      = (rmsnorm(o) * ssm_norm) * silu(z),  z = attn_gate h   (per value head)
//   out    = ssm_out y
// References: transformers modeling_qwen3_next.py (Qwen3NextGatedDeltaNet,
// torch_recurrent_gated_delta_rule, Qwen3NextRMSNormGated); llama.cpp src/models/qwen3next.cpp.
#include <cstdint>

#include "backend/backend.h"
#include "backend/cpu/ops.h"

namespace strata::cpu {

/// Heads, head sizes and convolution taps: backend::GdnSpec (backend/backend.h).
using GatedDeltaNetShape = backend::GdnSpec;

struct GatedDeltaNetWeights {
  MatrixRef wqkv;                  ///< attn_qkv: [conv_dim, n_embd] rows x cols
  MatrixRef wz;                    ///< attn_gate: [n_v_head * dv, n_embd]
  MatrixRef wba;                   ///< ssm_ba: [2 * n_v_head, n_embd], per key head [b (r), a (r)]
  MatrixRef wout;                  ///< ssm_out: [n_embd, n_v_head * dv]
  const float* conv = nullptr;     ///< ssm_conv1d: [conv_dim][K] (taps of a channel contiguous)
  const float* dt_bias = nullptr;  ///< ssm_dt.bias: [n_v_head]
  const float* a = nullptr;        ///< ssm_a: [n_v_head], -exp(A_log) (negative)
  const float* norm = nullptr;     ///< ssm_norm: [dv], weight of the gated RMSNorm
  MatrixRef wbeta{};               ///< ssm_beta: [n_v_head, n_embd] (used when wba.data is null)
  MatrixRef walpha{};              ///< ssm_alpha: [n_v_head, n_embd] (used when wba.data is null)
};

/// Runs the layer for T consecutive tokens. h: [T][n_embd] normed input; out: [T][n_embd]
/// (overwritten). conv_state: [K-1][conv_dim], ssm_state: [n_v_head][dk][dv]: read as the
/// state after the previous tokens (zeros for a fresh sequence) and advanced past these T.
/// Per-token results depend only on the token and the state (not on T or thread count).
void gated_delta_net_block(ThreadPool& pool, const kernels::KernelConfig& kc, const GatedDeltaNetWeights& w,
                           const GatedDeltaNetShape& s, const float* h, int64_t n_embd, int64_t T, float* conv_state,
                           float* ssm_state, float* out);

/// The delta-rule step of one value head for one token, in place on S: [dk][dv].
/// q, k: [dk] (normalized, q scaled); v: [dv]; o: [dv] output. decay = exp(g).
/// Exposed as the scalar reference the block uses (and tests check against a direct formula).
void delta_rule_step(float* S, const float* q, const float* k, const float* v, float decay, float beta, int dk, int dv,
                     float* o, float* scratch);

}  // namespace strata::cpu
