#include "backend/cpu/expert_batch.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <numeric>

#include "backend/cpu/ops.h"

namespace strata::cpu {

namespace {

constexpr int kStages = 4;                        // gather, gate/up, quantize, down (expert_batch.h)
constexpr int64_t kTokenBlock = 32;               // tokens per gather / quantize item
constexpr int64_t kPiecesPerThread = 8;           // work items per thread the sizing aims at
constexpr size_t kPieceWeightBytes = 128 * 1024;  // at most this much of one matrix per piece

struct Item {
  uint32_t call;
  uint8_t stage;
  int64_t a, b;  // tokens (stages 0, 2) or rows (stages 1, 3)
};

// Where a call's rows live in the scratch, and which projections take q8 activations.
struct Plan {
  int64_t n = 0, n_embd = 0, n_ff = 0;
  size_t x_off = 0, g_off = 0;  // floats into scratch.x / scratch.g and scratch.u
  bool q8_gate = false, q8_up = false, q8_down = false;
};

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Rows per piece of a matrix of `rows` rows (`row_bytes` each) applied to n tokens, costing
// `macs_per_row_token` multiply-adds per (row, token): enough rows for `target` MACs, a multiple
// of 8, at least 8 and at most kPieceWeightBytes of weights (never more than the matrix).
int64_t piece_rows(int64_t rows, size_t row_bytes, int64_t n, int64_t macs_per_row_token, double target) {
  const double per_row = double(n) * double(macs_per_row_token);
  int64_t r = round_up(std::max<int64_t>(1, int64_t(std::ceil(target / per_row))), 8);
  const int64_t cap = std::max<int64_t>(8, int64_t(kPieceWeightBytes / std::max<size_t>(row_bytes, 1)) / 8 * 8);
  r = std::clamp<int64_t>(r, 8, cap);
  return std::min(r, rows);
}

const float* values_or_null(const backend::Tensor& t) {
  return t.empty() ? nullptr : static_cast<const float*>(t.data);
}

}  // namespace

namespace {

// The scratch layout, the items and their count per (call, stage) for `calls` on `n_threads`.
struct Batch {
  std::vector<Plan> plan;
  std::vector<Item> items;
  std::vector<int64_t> count;  // [call * kStages + stage]
  size_t x_floats = 0, g_floats = 0;
};

Batch plan_batch(const kernels::KernelConfig& kc, std::span<const ExpertCall> calls, int n_threads) {
  const size_t C = calls.size();
  Batch bt;
  bt.plan.resize(C);
  bt.count.assign(C * kStages, 0);
  double gu_macs = 0, down_macs = 0;
  for (size_t c = 0; c < C; ++c) {
    const ExpertCall& e = calls[c];
    Plan& p = bt.plan[c];
    p.n = int64_t(e.pairs.size());
    p.n_embd = e.w.gate.cols();
    p.n_ff = e.w.gate.rows();
    p.x_off = bt.x_floats;
    p.g_off = bt.g_floats;
    // x holds the inputs, later down's outputs (down's rows)
    bt.x_floats += size_t(p.n * std::max(p.n_embd, e.w.down.rows()));
    bt.g_floats += size_t(p.n * p.n_ff);
    p.q8_gate = kernels::has_q8_activations(kc, e.w.gate.type);
    p.q8_up = kernels::has_q8_activations(kc, e.w.up.type);
    p.q8_down = kernels::has_q8_activations(kc, e.w.down.type);
    gu_macs += 2.0 * double(p.n) * double(p.n_ff) * double(p.n_embd);
    down_macs += double(p.n) * double(e.w.down.rows()) * double(p.n_ff);
  }
  // The items, stage by stage, the experts with the most tokens first within a stage.
  std::vector<uint32_t> order(C);
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return bt.plan[a].n > bt.plan[b].n; });
  // each stage aims at kPiecesPerThread pieces per thread of equal work
  const double pieces = double(int64_t(std::max(1, n_threads)) * kPiecesPerThread);
  auto add = [&](uint32_t c, uint8_t stage, int64_t n, int64_t step) {
    for (int64_t a = 0; a < n; a += step) bt.items.push_back(Item{c, stage, a, std::min(n, a + step)});
    bt.count[c * kStages + stage] = (n + step - 1) / step;
  };
  for (uint32_t c : order) add(c, 0, bt.plan[c].n, kTokenBlock);
  for (uint32_t c : order) {
    const ExpertCall& e = calls[c];
    const Plan& p = bt.plan[c];
    const size_t rb = std::max(e.w.gate.row_bytes(), e.w.up.row_bytes());
    add(c, 1, p.n_ff, piece_rows(p.n_ff, rb, p.n, 2 * p.n_embd, gu_macs / pieces));
  }
  for (uint32_t c : order)
    if (bt.plan[c].q8_down) add(c, 2, bt.plan[c].n, kTokenBlock);
  for (uint32_t c : order) {
    const ExpertCall& e = calls[c];
    const int64_t rows = e.w.down.rows();
    add(c, 3, rows, piece_rows(rows, e.w.down.row_bytes(), bt.plan[c].n, bt.plan[c].n_ff, down_macs / pieces));
  }
  return bt;
}

}  // namespace

std::array<int64_t, 4> expert_batch_items(const kernels::KernelConfig& kc, std::span<const ExpertCall> calls,
                                          int n_threads) {
  const Batch bt = plan_batch(kc, calls, n_threads);
  std::array<int64_t, 4> n{};
  for (const Item& it : bt.items) ++n[it.stage];
  return n;
}

void run_expert_batch(ThreadPool& pool, const kernels::KernelConfig& kc, std::span<const ExpertCall> calls,
                      ExpertBatchScratch& sc) {
  const size_t C = calls.size();
  if (C == 0) return;
  const Batch bt = plan_batch(kc, calls, pool.n_threads());
  const std::vector<Plan>& plan = bt.plan;
  const std::vector<Item>& items = bt.items;
  sc.x.grow(bt.x_floats);
  sc.g.grow(bt.g_floats);
  sc.u.grow(bt.g_floats);
  while (sc.act_x.size() < C) sc.act_x.push_back(std::make_unique<kernels::ActQ8>());
  while (sc.act_h.size() < C) sc.act_h.push_back(std::make_unique<kernels::ActQ8>());
  for (size_t c = 0; c < C; ++c) {
    const ExpertCall& e = calls[c];
    const Plan& p = plan[c];
    // one quantization of x for gate and up, in gate's lane order (up's kernel rearranges the
    // codes itself when its type differs: the same bits, kernels.h matmul_q8)
    if (p.q8_gate || p.q8_up) sc.act_x[c]->resize(p.n, p.n_embd, p.q8_gate ? e.w.gate.type : e.w.up.type);
    if (p.q8_down) sc.act_h[c]->resize(p.n, p.n_ff, e.w.down.type);
  }
  std::unique_ptr<std::atomic<int64_t>[]> pending(new std::atomic<int64_t>[C * kStages]());
  for (size_t i = 0; i < C * kStages; ++i) pending[i].store(bt.count[i], std::memory_order_relaxed);

  // Per expert and stage, the items not yet done; an item starts when its expert's earlier
  // stages have none left.
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> failed{false};
  auto ready = [&](uint32_t c, int stage) {
    for (int s = 0; s < stage; ++s)
      if (pending[c * kStages + s].load(std::memory_order_acquire) != 0) return false;
    return true;
  };
  // false: the loop failed elsewhere; skip the item (the pool rethrows the first error)
  auto wait_ready = [&](uint32_t c, int stage) {
    if (ready(c, stage)) return true;
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return failed.load(std::memory_order_acquire) || ready(c, stage); });
    return !failed.load(std::memory_order_acquire);
  };
  auto done = [&](uint32_t c, int stage) {
    if (pending[c * kStages + stage].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(mu);
      cv.notify_all();
    }
  };

  auto run_item = [&](const Item& it) {
    const ExpertCall& e = calls[it.call];
    const Plan& p = plan[it.call];
    float* x = sc.x.data() + p.x_off;
    float* g = sc.g.data() + p.g_off;
    float* u = sc.u.data() + p.g_off;
    const backend::FfnWeights& w = e.w;
    switch (it.stage) {
      case 0: {  // gather (and quantize) tokens [a, b)
        for (int64_t j = it.a; j < it.b; ++j)
          std::copy_n(e.h.row(e.pairs[size_t(j)] / e.top_k), p.n_embd, x + j * p.n_embd);
        if (p.q8_gate || p.q8_up) kernels::quantize_activations(kc, x, p.n_embd, it.a, it.b, *sc.act_x[it.call]);
        break;
      }
      case 1: {  // rows [a, b) of gate and up, biases, activation
        auto project = [&](const backend::Tensor& W, bool q8, float* y) {
          if (q8)
            kernels::matmul_q8(kc, W.type, W.data, W.row_bytes(), it.a, it.b, p.n_embd, *sc.act_x[it.call], y, p.n_ff);
          else
            kernels::matmul(kc, W.type, W.data, W.row_bytes(), it.a, it.b, p.n_embd, x, p.n_embd, p.n, y, p.n_ff);
        };
        project(w.gate, p.q8_gate, g);
        project(w.up, p.q8_up, u);
        const float* gb = values_or_null(w.gate_b);
        const float* ub = values_or_null(w.up_b);
        const bool oai = e.spec.act == backend::FfnSpec::Act::SwiGluOai;
        for (int64_t t = 0; t < p.n; ++t) {
          float* gt = g + t * p.n_ff;
          float* ut = u + t * p.n_ff;
          if (gb)
            for (int64_t r = it.a; r < it.b; ++r) gt[r] += gb[r];
          if (ub)
            for (int64_t r = it.a; r < it.b; ++r) ut[r] += ub[r];
          if (oai) {
            for (int64_t r = it.a; r < it.b; ++r) gt[r] = swiglu_oai(gt[r], ut[r], e.spec.alpha, e.spec.limit);
          } else {
            for (int64_t r = it.a; r < it.b; ++r) gt[r] = silu(gt[r]) * ut[r];
          }
        }
        break;
      }
      case 2:  // quantize tokens [a, b) of the activation for down
        kernels::quantize_activations(kc, g, p.n_ff, it.a, it.b, *sc.act_h[it.call]);
        break;
      default: {  // rows [a, b) of down, bias, into the (token, k) rows
        const backend::Tensor& W = w.down;
        const int64_t ldy = W.rows();
        if (p.q8_down)
          kernels::matmul_q8(kc, W.type, W.data, W.row_bytes(), it.a, it.b, p.n_ff, *sc.act_h[it.call], x, ldy);
        else
          kernels::matmul(kc, W.type, W.data, W.row_bytes(), it.a, it.b, p.n_ff, g, p.n_ff, p.n, x, ldy);
        const float* db = values_or_null(w.down_b);
        for (int64_t t = 0; t < p.n; ++t) {
          float* yt = x + t * ldy;
          if (db)
            for (int64_t r = it.a; r < it.b; ++r) yt[r] += db[r];
          std::copy(yt + it.a, yt + it.b, e.out.row(e.pairs[size_t(t)]) + it.a);
        }
        break;
      }
    }
  };

  pool.parallel_for(int64_t(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[size_t(i)];
      if (!wait_ready(it.call, it.stage)) return;
      try {
        run_item(it);
      } catch (...) {
        failed.store(true, std::memory_order_release);
        {
          std::lock_guard<std::mutex> lk(mu);
          cv.notify_all();
        }
        throw;
      }
      done(it.call, it.stage);
    }
  });
}

}  // namespace strata::cpu
