#include "backend/cpu/ops.h"

#include <algorithm>
#include <cmath>

#include "quant/quant.h"

namespace strata::cpu {

void matmul(ThreadPool& pool, const MatrixRef& W, const float* x, int64_t ldx, int64_t n_tok, float* y, int64_t ldy) {
  // Rows are split in blocks; each output element is computed by one call with the same
  // accumulation order whatever the block (quant::matmul's invariance contract).
  const int64_t grain = std::max<int64_t>(8, W.rows / (pool.n_threads() * 8));
  pool.parallel_for(W.rows, grain, [&](int64_t r0, int64_t r1) {
    quant::matmul(W.type, W.data, W.row_bytes, r0, r1, W.cols, x, ldx, n_tok, y, ldy);
  });
}

void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  const float scale = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
}

void softmax(float* x, int64_t n) {
  float mx = x[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, x[i]);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = float(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

Rope::Rope(int n_rot_, double freq_base, bool round_freqs_to_bf16) : n_rot(n_rot_), inv_freq(n_rot_ / 2) {
  for (int i = 0; i < n_rot / 2; ++i) {
    inv_freq[i] = std::pow(freq_base, -2.0 * i / n_rot);
    if (round_freqs_to_bf16) inv_freq[i] = quant::bf16_to_fp32(quant::fp32_to_bf16(float(inv_freq[i])));
  }
}

void Rope::apply(float* x, int n_heads, int head_dim, int64_t pos) const {
  const int half = n_rot / 2;
  for (int i = 0; i < half; ++i) {
    const double theta = double(pos) * inv_freq[i];
    const float c = float(std::cos(theta)), s = float(std::sin(theta));
    for (int h = 0; h < n_heads; ++h) {
      float* xh = x + int64_t(h) * head_dim;
      const float a = xh[i], b = xh[i + half];
      xh[i] = a * c - b * s;
      xh[i + half] = b * c + a * s;
    }
  }
}

void attention_one(const float* q, const float* k_cache, const float* v_cache, int64_t kv_stride, int64_t n_pos,
                   int n_head, int n_head_kv, int head_dim, float scale, float* out, float* scratch) {
  const int group = n_head / n_head_kv;
  for (int h = 0; h < n_head; ++h) {
    const float* qh = q + int64_t(h) * head_dim;
    const int64_t kv_off = int64_t(h / group) * head_dim;
    float mx = -INFINITY;
    for (int64_t p = 0; p < n_pos; ++p) {
      const float* kp = k_cache + p * kv_stride + kv_off;
      float s = 0;
      for (int d = 0; d < head_dim; ++d) s += qh[d] * kp[d];
      s *= scale;
      scratch[p] = s;
      mx = std::max(mx, s);
    }
    double sum = 0;
    for (int64_t p = 0; p < n_pos; ++p) {
      scratch[p] = std::exp(scratch[p] - mx);
      sum += scratch[p];
    }
    const float inv = float(1.0 / sum);
    float* oh = out + int64_t(h) * head_dim;
    std::fill(oh, oh + head_dim, 0.0f);
    for (int64_t p = 0; p < n_pos; ++p) {
      const float w = scratch[p] * inv;
      const float* vp = v_cache + p * kv_stride + kv_off;
      for (int d = 0; d < head_dim; ++d) oh[d] += w * vp[d];
    }
  }
}

}  // namespace strata::cpu
