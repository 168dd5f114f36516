#include "backend/backend.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "gguf/ggml_types.h"
#include "quant/quant.h"

namespace strata::backend {

Tensor Tensor::matrix(GgmlType t, const void* data, int64_t cols, int64_t rows, size_t row_bytes, Place place) {
  Tensor x;
  x.type = t;
  x.ne[0] = cols;
  x.ne[1] = rows;
  const auto info = ggml_type_info(uint32_t(t));
  x.nb[0] = info ? size_t(info->block_bytes) : 0;
  x.nb[1] = row_bytes;
  x.nb[2] = x.nb[3] = row_bytes * size_t(rows);
  x.data = const_cast<void*>(data);
  x.place = place;
  return x;
}

Tensor Tensor::f32(float* data, int64_t cols, int64_t rows, Place place) {
  return matrix(GgmlType::F32, data, cols, rows, size_t(cols) * sizeof(float), place);
}

Tensor Tensor::rows_view(int64_t r0, int64_t n) const {
  Tensor v = *this;
  v.ne[1] = n;
  v.ne[2] = v.ne[3] = 1;
  v.nb[2] = v.nb[3] = nb[1] * size_t(n);
  v.data = static_cast<char*>(data) + size_t(r0) * nb[1];
  return v;
}

RopeSpec RopeSpec::standard(int n_rot, double base, Mode mode, bool round_to_bf16) {
  RopeSpec r;
  r.mode = mode;
  r.n_rot = n_rot;
  r.inv_freq.resize(size_t(n_rot / 2));
  for (int i = 0; i < n_rot / 2; ++i) {
    r.inv_freq[size_t(i)] = std::pow(base, -2.0 * i / n_rot);
    if (round_to_bf16) r.inv_freq[size_t(i)] = quant::bf16_to_fp32(quant::fp32_to_bf16(float(r.inv_freq[size_t(i)])));
  }
  return r;
}

Tensor Buffer::f32(int64_t cols, int64_t rows, size_t offset_bytes) {
  return Tensor::f32(reinterpret_cast<float*>(static_cast<char*>(data()) + offset_bytes), cols, rows, place());
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

namespace {

// Gating::SoftmaxTopK: the top_k largest raw logits (ties: lower id first), then a softmax
// over those k values only (max-subtracted, sum in double, as softmax() above).
void select_softmax_topk(const RouterSpec& spec, float* logits, int64_t T, Routing& r) {
  const int n_expert = spec.n_expert, top_k = spec.top_k;
  std::vector<int32_t> order(n_expert);
  std::vector<float> e(size_t(top_k) + 1);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * n_expert;
    std::iota(order.begin(), order.end(), 0);
    const int n_sorted = std::min(top_k + 1, n_expert);
    std::partial_sort(order.begin(), order.begin() + n_sorted, order.end(),
                      [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    const float mx = l[order[0]];
    double sum = 0;
    for (int k = 0; k < n_sorted; ++k) {
      e[size_t(k)] = std::exp(l[order[k]] - mx);
      if (k < top_k) sum += e[size_t(k)];
    }
    const float inv = float(1.0 / sum);
    for (int k = 0; k < top_k; ++k) {
      r.ids[t * top_k + k] = order[k];
      r.probs[t * top_k + k] = r.weights[t * top_k + k] = e[size_t(k)] * inv;
    }
    if (top_k < n_expert) r.next_prob[t] = e[size_t(top_k)] * inv;
  }
}

}  // namespace

void Backend::router_logits_biased(const Tensor& w, const Tensor& bias, const Tensor& h, std::vector<float>& logits) {
  router_logits(w, h, logits);
  const int64_t n_expert = w.rows();
  if (bias.numel() != n_expert) throw std::invalid_argument("router_logits_biased: the bias needs n_expert values");
  std::vector<float> b(static_cast<size_t>(n_expert));
  download(b.data(), bias, b.size() * sizeof(float));
  for (size_t i = 0; i < logits.size(); ++i) logits[i] += b[i % size_t(n_expert)];
}

void select_experts(const RouterSpec& spec, float* logits, int64_t T, Routing& r) {
  const int n_expert = spec.n_expert, top_k = spec.top_k;
  if (spec.gating != RouterSpec::Gating::Softmax && spec.gating != RouterSpec::Gating::SoftmaxTopK)
    throw std::invalid_argument("select_experts: unknown gating function");
  if (top_k <= 0 || top_k > n_expert) throw std::invalid_argument("select_experts: top_k must be in [1, n_expert]");
  r.top_k = top_k;
  r.ids.assign(T * top_k, 0);
  r.probs.assign(T * top_k, 0.0f);
  r.weights.assign(T * top_k, 0.0f);
  r.next_prob.assign(T, 0.0f);
  if (spec.gating == RouterSpec::Gating::SoftmaxTopK) {
    select_softmax_topk(spec, logits, T, r);
    return;
  }
  std::vector<int32_t> order(n_expert);
  for (int64_t t = 0; t < T; ++t) {
    float* p = logits + t * n_expert;
    softmax(p, n_expert);
    std::iota(order.begin(), order.end(), 0);
    const int n_sorted = std::min(top_k + 1, n_expert);
    std::partial_sort(order.begin(), order.begin() + n_sorted, order.end(),
                      [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    if (top_k < n_expert) r.next_prob[t] = p[order[top_k]];
    double sum = 0;
    for (int k = 0; k < top_k; ++k) sum += p[order[k]];
    for (int k = 0; k < top_k; ++k) {
      r.ids[t * top_k + k] = order[k];
      r.probs[t * top_k + k] = p[order[k]];
      r.weights[t * top_k + k] = spec.norm_topk ? float(p[order[k]] / sum) : p[order[k]];
    }
  }
}

}  // namespace strata::backend
