#include "backend/cpu/gated_delta_net.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace strata::cpu {

namespace {

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// torch.nn.functional.softplus (beta 1, threshold 20): log(1 + exp(x)), linear above 20.
float softplus(float x) { return x > 20.0f ? x : float(std::log1p(std::exp(double(x)))); }

// x /= sqrt(sum(x^2) + eps), as transformers' l2norm (eps inside the square root; llama.cpp's
// ggml_l2_norm uses max(norm, eps) instead, which differs by ~eps / |x|^2 relative).
void l2norm(float* x, int n, double eps) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  const float inv = float(1.0 / std::sqrt(ss + eps));
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

constexpr double kL2Eps = 1e-6;  // transformers Qwen3Next l2norm default (FLA's too)

}  // namespace

void delta_rule_step(float* S, const float* q, const float* k, const float* v, float decay, float beta, int dk, int dv,
                     float* o, float* scratch) {
  // Decay the state and read what it remembers for k: mem = (exp(g) S)^T k.
  float* mem = scratch;
  std::fill(mem, mem + dv, 0.0f);
  for (int i = 0; i < dk; ++i) {
    float* row = S + int64_t(i) * dv;
    const float ki = k[i];
    for (int j = 0; j < dv; ++j) {
      row[j] *= decay;
      mem[j] += row[j] * ki;
    }
  }
  // Delta rule: move the value stored under k towards v by beta.
  for (int j = 0; j < dv; ++j) mem[j] = (v[j] - mem[j]) * beta;
  // Rank-1 update S += k delta^T, then read out o = S^T q.
  std::fill(o, o + dv, 0.0f);
  for (int i = 0; i < dk; ++i) {
    float* row = S + int64_t(i) * dv;
    const float ki = k[i], qi = q[i];
    for (int j = 0; j < dv; ++j) {
      row[j] += ki * mem[j];
      o[j] += row[j] * qi;
    }
  }
}

void gated_delta_net_block(ThreadPool& pool, const kernels::KernelConfig& kc, const GatedDeltaNetWeights& w,
                           const GatedDeltaNetShape& s, const float* h, int64_t n_embd, int64_t T, float* conv_state,
                           float* ssm_state, float* out) {
  const int64_t C = s.conv_dim(), key_dim = s.key_dim(), value_dim = s.value_dim();
  const int K = s.conv_kernel, dk = s.head_k_dim, dv = s.head_v_dim, nv = s.n_v_head;
  const int r = s.n_v_head / s.n_k_head;  // value heads per key head
  thread_local GrowBuffer<float> tl_x, tl_xc, tl_z, tl_ba, tl_beta, tl_decay, tl_o;
  float* const x = scratch_floats(tl_x, T * C);
  float* const xc = scratch_floats(tl_xc, T * C);
  float* const z = scratch_floats(tl_z, T * value_dim);
  float* const ba = scratch_floats(tl_ba, T * 2 * nv);

  // Input projections.
  matmul(pool, kc, w.wqkv, h, n_embd, T, x, C);
  matmul(pool, kc, w.wz, h, n_embd, T, z, value_dim);
  const bool separate_ba = w.wba.data == nullptr;  // ssm_beta and ssm_alpha: [b (nv) | a (nv)] per token in `ba`
  if (!separate_ba) {
    matmul(pool, kc, w.wba, h, n_embd, T, ba, 2 * nv);
  } else {
    matmul(pool, kc, w.wbeta, h, n_embd, T, ba, 2 * nv);
    matmul(pool, kc, w.walpha, h, n_embd, T, ba + nv, 2 * nv);
  }

  // Causal depthwise convolution over time with the rolling state, then SiLU. Channels are
  // independent: split them over the pool, each walking the tokens in order.
  const int64_t grain = std::max<int64_t>(64, C / (int64_t(pool.n_threads()) * 4));
  pool.parallel_for(C, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t t = 0; t < T; ++t) {
      const float* xt = x + t * C;
      for (int64_t c = c0; c < c1; ++c) {
        const float* wc = w.conv + c * K;
        float acc = 0.0f;
        for (int j = 0; j < K - 1; ++j) acc += wc[j] * conv_state[int64_t(j) * C + c];
        acc += wc[K - 1] * xt[c];
        xc[t * C + c] = silu(acc);
        // Shift the window: the state keeps the last K-1 raw inputs, oldest first.
        for (int j = 0; j + 1 < K - 1; ++j) conv_state[int64_t(j) * C + c] = conv_state[int64_t(j + 1) * C + c];
        if (K > 1) conv_state[int64_t(K - 2) * C + c] = xt[c];
      }
    }
  });

  // Per token: L2-normalize q and k per key head, scale q; gates beta and g per value head.
  float* const beta = scratch_floats(tl_beta, T * nv);
  float* const decay = scratch_floats(tl_decay, T * nv);
  const float q_scale = 1.0f / std::sqrt(float(dk));
  pool.parallel_for(T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* q = xc + t * C;
      float* k = q + key_dim;
      for (int hk = 0; hk < s.n_k_head; ++hk) {
        l2norm(q + int64_t(hk) * dk, dk, kL2Eps);
        l2norm(k + int64_t(hk) * dk, dk, kL2Eps);
      }
      for (int64_t i = 0; i < key_dim; ++i) q[i] *= q_scale;
      const float* bat = ba + t * 2 * nv;
      for (int j = 0; j < nv; ++j) {
        const int g = j / r, i = j % r;
        const float b = separate_ba ? bat[j] : bat[g * 2 * r + i];
        const float a = separate_ba ? bat[nv + j] : bat[g * 2 * r + r + i];
        beta[t * nv + j] = sigmoid(b);
        decay[t * nv + j] = std::exp(softplus(a + w.dt_bias[j]) * w.a[j]);
      }
    }
  });

  // The delta-rule recurrence: value heads are independent; each walks the tokens in order.
  float* const o = scratch_floats(tl_o, T * value_dim);
  pool.parallel_for(nv, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> scratch(dv);
    for (int64_t j = j0; j < j1; ++j) {
      float* S = ssm_state + j * int64_t(dk) * dv;
      const int64_t hk = s.v_head_order == GatedDeltaNetShape::VHeadOrder::Tiled ? j % s.n_k_head : j / r;
      for (int64_t t = 0; t < T; ++t) {
        const float* q = xc + t * C + hk * dk;
        const float* k = q + key_dim;
        const float* v = xc + t * C + 2 * key_dim + j * dv;
        delta_rule_step(S, q, k, v, decay[t * nv + j], beta[t * nv + j], dk, dv, o + t * value_dim + j * dv,
                        scratch.data());
      }
    }
  });

  // Gated RMSNorm per value head: (rmsnorm(o) * ssm_norm) * silu(z).
  pool.parallel_for(T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int j = 0; j < nv; ++j) {
        float* oh = o + t * value_dim + int64_t(j) * dv;
        const float* zh = z + t * value_dim + int64_t(j) * dv;
        rms_norm(oh, w.norm, oh, dv, s.rms_eps);
        for (int d = 0; d < dv; ++d) oh[d] *= silu(zh[d]);
      }
  });

  // Output projection.
  matmul(pool, kc, w.wout, o, value_dim, T, out, n_embd);
}

}  // namespace strata::cpu
