#include "layers/moe.h"

#include <algorithm>
#include <chrono>
#include <numeric>

namespace strata::layers {

void route_topk(float* logits, int64_t T, int n_expert, int top_k, bool norm_topk, Routing& r) {
  r.ids.assign(T * top_k, 0);
  r.probs.assign(T * top_k, 0.0f);
  r.weights.assign(T * top_k, 0.0f);
  r.next_prob.assign(T, 0.0f);
  std::vector<int32_t> order(n_expert);
  for (int64_t t = 0; t < T; ++t) {
    float* p = logits + t * n_expert;
    cpu::softmax(p, n_expert);
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
      r.weights[t * top_k + k] = norm_topk ? float(p[order[k]] / sum) : p[order[k]];
    }
  }
}

void read_ahead(cpu::ThreadPool& pool, const cpu::kernels::KernelConfig& kc, stream::ExpertStream& stream, const ReadAhead& ra, const float* h,
                int64_t n_embd, int64_t T) {
  if (ra.layer < 0) return;
  std::vector<int32_t> order;
  std::vector<char> queued(ra.n_expert, 0);
  if (ra.router) {
    // Router of the later layer on this layer's input, for every token.
    std::vector<float> logits(T * ra.n_expert);
    cpu::matmul(pool, kc, *ra.router, h, n_embd, T, logits.data(), ra.n_expert);
    Routing pr;
    route_topk(logits.data(), T, ra.n_expert, ra.top_k, true, pr);
    if (ra.predicted) *ra.predicted = pr.ids;
    // Count predicting tokens per expert; most-predicted first (ties: lower id).
    std::vector<int64_t> count(ra.n_expert, 0);
    for (int32_t e : pr.ids) ++count[e];
    for (int e = 0; e < ra.n_expert; ++e)
      if (count[e] >= ra.min_tokens) order.push_back(e);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return count[a] > count[b]; });
    for (int32_t e : order) queued[e] = 1;
  }
  for (int64_t i = 0, n = 0; i < int64_t(ra.static_rank.size()) && n < ra.static_count; ++i) {
    const int32_t e = ra.static_rank[i];
    if (e < 0 || e >= ra.n_expert || queued[e]) continue;
    order.push_back(e);
    queued[e] = 1;
    ++n;
  }
  if (!order.empty()) stream.prefetch(ra.layer, order);
}

static cpu::MatrixRef part_matrix(const ExpertPartShape& s, const uint8_t* data) {
  return cpu::MatrixRef{s.type, data, s.rows, s.cols, s.row_bytes};
}

void moe_block(cpu::ThreadPool& pool, const cpu::kernels::KernelConfig& kc, stream::ExpertStream& stream, int layer, const MoeWeights& w, const float* h,
               int64_t n_embd, int64_t T, float* out, Routing* routing, double* expert_seconds,
               const ReadAhead* ahead) {
  const int K = w.top_k;
  const int64_t n_ff = w.gate.rows;

  // Router and top-k selection.
  std::vector<float> logits(T * w.n_expert);
  cpu::matmul(pool, kc, w.router, h, n_embd, T, logits.data(), w.n_expert);
  Routing local;
  Routing& r = routing ? *routing : local;
  route_topk(logits.data(), T, w.n_expert, K, w.norm_topk, r);

  // Group the chunk's (token, k) pairs by expert: each resident expert is applied to
  // all its tokens at once.
  std::vector<std::vector<int64_t>> pairs(w.n_expert);  // entries t * K + k
  for (int64_t i = 0; i < T * K; ++i) pairs[r.ids[i]].push_back(i);
  std::vector<int32_t> needed;
  for (int e = 0; e < w.n_expert; ++e)
    if (!pairs[e].empty()) needed.push_back(e);

  // The cut: ask for every expert this layer needs; misses become urgent reads.
  stream.request(layer, needed);
  // While this layer computes, the IO threads read ahead for the next one.
  if (ahead) read_ahead(pool, kc, stream, *ahead, h, n_embd, T);

  // Expert outputs per (token, k), summed afterwards in k order for batch invariance.
  std::vector<float> expert_out(T * K * n_embd);
  std::vector<float> x, g, u;
  const auto t_start = std::chrono::steady_clock::now();
  double waited = 0;
  // One expert on all its tokens: SwiGLU, down(silu(gate x) * up x), into the (token, k) rows.
  auto run_expert = [&](int32_t e) {
    const auto t_wait = std::chrono::steady_clock::now();
    const stream::ExpertView view = stream.wait(layer, e);
    waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - t_wait).count();
    const auto& pe = pairs[e];
    const int64_t n = int64_t(pe.size());
    x.resize(n * n_embd);
    g.resize(n * n_ff);
    u.resize(n * n_ff);
    for (int64_t j = 0; j < n; ++j) std::copy_n(h + (pe[j] / K) * n_embd, n_embd, x.data() + j * n_embd);
    cpu::matmul(pool, kc, part_matrix(w.gate, view.part[0]), x.data(), n_embd, n, g.data(), n_ff);
    cpu::matmul(pool, kc, part_matrix(w.up, view.part[1]), x.data(), n_embd, n, u.data(), n_ff);
    for (int64_t i = 0; i < n * n_ff; ++i) g[i] = cpu::silu(g[i]) * u[i];
    cpu::matmul(pool, kc, part_matrix(w.down, view.part[2]), g.data(), n_ff, n, x.data(), n_embd);
    for (int64_t j = 0; j < n; ++j) std::copy_n(x.data() + j * n_embd, n_embd, expert_out.data() + pe[j] * n_embd);
  };

  // Resident experts first, then each miss as it arrives. The order of experts does not
  // change results: outputs land in per-(token, k) rows.
  std::vector<int32_t> todo = needed, later, ready;
  while (!todo.empty()) {
    // One pass: take what is resident now; if nothing is, block on the first remaining.
    later.clear();
    ready.clear();
    for (int32_t e : todo) (stream.resident(layer, e) ? ready : later).push_back(e);
    if (ready.empty()) {
      ready.push_back(later.front());
      later.erase(later.begin());
    }
    todo.swap(later);
    for (int32_t e : ready) run_expert(e);
  }
  stream.release(layer);
  if (expert_seconds)
    *expert_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count() - waited;

  // Weighted sum per token in top-k order.
  for (int64_t t = 0; t < T; ++t) {
    float* o = out + t * n_embd;
    std::fill(o, o + n_embd, 0.0f);
    for (int k = 0; k < K; ++k) {
      const float wk = r.weights[t * K + k];
      const float* eo = expert_out.data() + (t * K + k) * n_embd;
      for (int64_t i = 0; i < n_embd; ++i) o[i] += wk * eo[i];
    }
  }
}

}  // namespace strata::layers
