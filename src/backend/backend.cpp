#include "backend/backend.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <numbers>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

#include <fmt/format.h>

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

RopeSpec RopeSpec::yarn(int n_rot, double base, Mode mode, double factor, double orig_ctx, double beta_fast,
                        double beta_slow, bool truncate, double attn_factor) {
  if (n_rot < 2 || n_rot % 2 != 0)
    throw std::invalid_argument(fmt::format("RopeSpec::yarn: n_rot {} must be even and >= 2", n_rot));
  if (!(base > 1)) throw std::invalid_argument(fmt::format("RopeSpec::yarn: freq_base {} must be > 1", base));
  if (!(factor >= 1)) throw std::invalid_argument(fmt::format("RopeSpec::yarn: factor {} must be >= 1", factor));
  if (!(orig_ctx >= 1))
    throw std::invalid_argument(fmt::format("RopeSpec::yarn: original context {} must be >= 1", orig_ctx));
  if (!(beta_fast > 0) || !(beta_slow > 0))
    throw std::invalid_argument(
        fmt::format("RopeSpec::yarn: beta_fast {} and beta_slow {} must be > 0", beta_fast, beta_slow));
  RopeSpec r = standard(n_rot, base, mode);
  r.attn_factor = attn_factor;
  const double d = n_rot;
  const auto corr = [&](double b) {
    return d * std::log(orig_ctx / (2 * std::numbers::pi * b)) / (2 * std::log(base));
  };
  double lo = corr(beta_fast), hi = corr(beta_slow);
  if (truncate) {
    lo = std::floor(lo);
    hi = std::ceil(hi);
  }
  lo = std::max(lo, 0.0);
  hi = std::min(hi, d - 1);
  for (int i = 0; i < n_rot / 2; ++i) {
    const double ramp = 1 - std::clamp((i - lo) / std::max(hi - lo, 0.001), 0.0, 1.0);
    const double p = r.inv_freq[size_t(i)];
    r.inv_freq[size_t(i)] = p / factor * (1 - ramp) + p * ramp;
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

/// Runs fn(t_begin, t_end) over the tokens [0, T): on the calling thread, or for T >= 512 on up to
/// 8 threads (std::thread::hardware_concurrency), each a contiguous range of >= 256 tokens. The
/// selection of a token reads its own logits row and writes its own output rows only, so the
/// result is the same for every split (the host top-k of a 2048-token chunk took ~4 ms on one
/// core, the device idle between a layer's router and its experts: docs/cuda.md "Profile").
/// An exception thrown by fn is rethrown here after every thread has stopped.
void for_token_ranges(int64_t T, const std::function<void(int64_t, int64_t)>& fn) {
  constexpr int64_t kGrain = 256, kMaxThreads = 8;
  const int64_t hw = std::max<int64_t>(1, int64_t(std::thread::hardware_concurrency()));
  const int64_t n = std::min({hw, kMaxThreads, T / kGrain});
  if (n <= 1) {
    fn(0, T);
    return;
  }
  std::vector<std::exception_ptr> err(static_cast<size_t>(n));
  auto part = [&](int64_t i) {
    try {
      fn(T * i / n, T * (i + 1) / n);
    } catch (...) {
      err[size_t(i)] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(size_t(n - 1));
  for (int64_t i = 1; i < n; ++i) threads.emplace_back(part, i);
  part(0);
  for (std::thread& th : threads) th.join();
  for (const std::exception_ptr& e : err)
    if (e) std::rethrow_exception(e);
}

// The tokens [0, T) through `ranges`, or for_token_ranges when it is empty.
void spread(const TokenRanges& ranges, int64_t T, const std::function<void(int64_t, int64_t)>& fn) {
  if (ranges)
    ranges(T, fn);
  else
    for_token_ranges(T, fn);
}

// Gating::SoftmaxTopK: the top_k largest raw logits (ties: lower id first), then a softmax
// over those k values only (max-subtracted, sum in double, as softmax() above).
// `sel` (null: the logits themselves) orders the experts; the weights use the original logits.
void select_softmax_topk(const RouterSpec& spec, float* logits, const float* sel, int64_t T, Routing& r,
                         uint8_t* defect, const TokenRanges& ranges) {
  const int n_expert = spec.n_expert, top_k = spec.top_k;
  spread(ranges, T, [&](int64_t t_begin, int64_t t_end) {
    std::vector<int32_t> order(n_expert);
    std::vector<float> e(size_t(top_k) + 1);
    for (int64_t t = t_begin; t < t_end; ++t) {
      const float* l = logits + t * n_expert;
      if ((defect[t] = uint8_t(router_logits_defect(spec.gating, l, n_expert)))) continue;
      const float* o = sel ? sel + t * n_expert : l;
      std::iota(order.begin(), order.end(), 0);
      const int n_sorted = std::min(top_k + 1, n_expert);
      std::partial_sort(order.begin(), order.begin() + n_sorted, order.end(),
                        [&](int32_t a, int32_t b) { return o[a] > o[b] || (o[a] == o[b] && a < b); });
      // The largest original logit among the chosen (without a bonus: the first).
      float mx = l[order[0]];
      for (int k = 1; k < top_k; ++k) mx = std::max(mx, l[order[k]]);
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
  });
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

int router_logits_defect(RouterSpec::Gating gating, const float* l, int n_expert) {
  bool nan = false, pinf = false, finite = false;
  for (int i = 0; i < n_expert; ++i) {
    nan = nan || std::isnan(l[i]);
    pinf = pinf || (std::isinf(l[i]) && l[i] > 0);
    finite = finite || std::isfinite(l[i]);
  }
  if (nan) return 1;
  if (gating == RouterSpec::Gating::Sigmoid) return 0;
  if (pinf) return 2;
  return finite ? 0 : 3;
}

std::string router_logits_defect_message(int code, int64_t t) {
  const char* what = code == 1   ? "contain NaN"
                     : code == 2 ? "contain +inf (a softmax router needs finite logits or -inf)"
                     : code == 3 ? "are all -inf (a softmax router needs one finite logit)"
                                 : "are unusable";
  return "select_experts: token " + std::to_string(t) + ": the router logits " + what +
         " (the activations are not finite: a damaged model file or expert pack, or a wrong tensor type in it)";
}

void Backend::route(std::span<const RouteCall> calls, const Tensor& h) { route_on_host(calls, h, {}); }

void Backend::route_on_host(std::span<const RouteCall> calls, const Tensor& h, const TokenRanges& ranges) {
  std::vector<float> logits;
  for (const RouteCall& c : calls) {
    if (c.bias.empty())
      router_logits(c.w, h, logits);
    else
      router_logits_biased(c.w, c.bias, h, logits);
    select_experts(*c.spec, logits.data(), h.rows(), *c.out, ranges);
  }
}

namespace {

// The shared selection; `sel` ([T][n_expert] logits with the residency bonus, or null) replaces
// the logits for choosing the experts only.
void select_impl(const RouterSpec& spec, float* logits, const float* sel, int64_t T, Routing& r,
                 const TokenRanges& ranges) {
  const int n_expert = spec.n_expert, top_k = spec.top_k;
  if (spec.gating != RouterSpec::Gating::Softmax && spec.gating != RouterSpec::Gating::Sigmoid &&
      spec.gating != RouterSpec::Gating::SoftmaxTopK)
    throw std::invalid_argument("select_experts: unknown gating function");
  if (top_k <= 0 || top_k > n_expert) throw std::invalid_argument("select_experts: top_k must be in [1, n_expert]");
  const bool biased = !spec.selection_bias.empty();
  if (biased && int64_t(spec.selection_bias.size()) != n_expert)
    throw std::invalid_argument("select_experts: selection_bias must have n_expert values");
  const bool grouped = spec.n_group > 1 && spec.n_group_used < spec.n_group;
  const int group_size = grouped ? n_expert / spec.n_group : n_expert;
  if (grouped &&
      (n_expert % spec.n_group != 0 || spec.n_group_used < 1 || int64_t(spec.n_group_used) * group_size < top_k))
    throw std::invalid_argument(
        "select_experts: n_group must divide n_expert and n_group_used groups must hold top_k experts");
  r.top_k = top_k;
  r.ids.assign(T * top_k, 0);
  r.probs.assign(T * top_k, 0.0f);
  r.weights.assign(T * top_k, 0.0f);
  r.next_prob.assign(T, 0.0f);
  // Tokens whose logits cannot be selected from are skipped, and the first is reported after
  // the threads have stopped (the same token whatever the split).
  std::vector<uint8_t> defect(size_t(T), 0);
  auto report = [&] {
    for (int64_t t = 0; t < T; ++t)
      if (defect[size_t(t)]) throw std::invalid_argument(router_logits_defect_message(defect[size_t(t)], t));
  };
  if (spec.gating == RouterSpec::Gating::SoftmaxTopK) {
    select_softmax_topk(spec, logits, sel, T, r, defect.data(), ranges);
    report();
    return;
  }
  spread(ranges, T, [&](int64_t t_begin, int64_t t_end) {
    std::vector<int32_t> order(n_expert), gorder;
    std::vector<float> score_buf, gscore, sel_buf;
    if (grouped) {
      gorder.resize(size_t(spec.n_group));
      gscore.resize(size_t(spec.n_group));
    }
    for (int64_t t = t_begin; t < t_end; ++t) {
      float* p = logits + t * n_expert;
      if ((defect[size_t(t)] = uint8_t(router_logits_defect(spec.gating, p, n_expert)))) continue;
      if (spec.gating == RouterSpec::Gating::Softmax) {
        softmax(p, n_expert);
      } else {
        for (int i = 0; i < n_expert; ++i) p[i] = 1.0f / (1.0f + std::exp(-p[i]));
      }
      // Selection scores: the probabilities (of the bonus logits, with MoCE), plus the selection bias.
      const float* s = p;
      if (sel) {
        sel_buf.assign(sel + t * n_expert, sel + (t + 1) * n_expert);
        if (spec.gating == RouterSpec::Gating::Softmax) {
          softmax(sel_buf.data(), n_expert);
        } else {
          for (float& v : sel_buf) v = 1.0f / (1.0f + std::exp(-v));
        }
        s = sel_buf.data();
      }
      if (biased) {
        score_buf.resize(size_t(n_expert));
        for (int i = 0; i < n_expert; ++i) score_buf[size_t(i)] = s[i] + spec.selection_bias[size_t(i)];
        s = score_buf.data();
      }
      auto better = [&](int32_t a, int32_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
      int n_cand = n_expert;
      std::iota(order.begin(), order.end(), 0);
      if (grouped) {
        // A group scores the sum of its two best selection scores; the best n_group_used groups'
        // experts are the candidates.
        for (int g = 0; g < spec.n_group; ++g) {
          float b1 = -INFINITY, b2 = -INFINITY;
          for (int i = g * group_size; i < (g + 1) * group_size; ++i) {
            if (s[i] > b1) {
              b2 = b1;
              b1 = s[i];
            } else if (s[i] > b2) {
              b2 = s[i];
            }
          }
          gscore[size_t(g)] = group_size >= 2 ? b1 + b2 : b1;
        }
        std::iota(gorder.begin(), gorder.end(), 0);
        std::stable_sort(gorder.begin(), gorder.end(),
                         [&](int32_t a, int32_t b) { return gscore[size_t(a)] > gscore[size_t(b)]; });
        std::sort(gorder.begin(), gorder.begin() + spec.n_group_used);
        n_cand = 0;
        for (int gi = 0; gi < spec.n_group_used; ++gi)
          for (int i = gorder[size_t(gi)] * group_size; i < (gorder[size_t(gi)] + 1) * group_size; ++i)
            order[size_t(n_cand++)] = i;
      }
      const int n_sorted = std::min(top_k + 1, n_cand);
      std::partial_sort(order.begin(), order.begin() + n_sorted, order.begin() + n_cand, better);
      if (top_k < n_cand) r.next_prob[t] = p[order[top_k]];
      double sum = 0;
      for (int k = 0; k < top_k; ++k) sum += p[order[k]];
      for (int k = 0; k < top_k; ++k) {
        r.ids[t * top_k + k] = order[k];
        r.probs[t * top_k + k] = p[order[k]];
        float w = spec.norm_topk ? float(p[order[k]] / sum) : p[order[k]];
        if (spec.weights_scale != 1.0f) w *= spec.weights_scale;
        r.weights[t * top_k + k] = w;
      }
    }
  });
  report();
}

}  // namespace

void select_experts(const RouterSpec& spec, float* logits, int64_t T, Routing& r) {
  select_impl(spec, logits, nullptr, T, r, {});
}

void select_experts(const RouterSpec& spec, float* logits, int64_t T, Routing& r, const TokenRanges& ranges) {
  select_impl(spec, logits, nullptr, T, r, ranges);
}

void select_experts(const RouterSpec& spec, float* logits, int64_t T, Routing& r, const ResidencyBonus& bonus) {
  if (!std::isfinite(bonus.bonus) || bonus.bonus < 0)
    throw std::invalid_argument("select_experts: the residency bonus must be finite and >= 0");
  if (bonus.bonus == 0) {
    select_impl(spec, logits, nullptr, T, r, {});
    return;
  }
  if (int64_t(bonus.resident.size()) != spec.n_expert)
    throw std::invalid_argument("select_experts: the residency mask must have n_expert entries");
  const int n_expert = spec.n_expert;
  std::vector<float> sel(logits, logits + T * n_expert);
  for (int64_t t = 0; t < T; ++t) {
    float* l = sel.data() + t * n_expert;
    const auto [lo, hi] = std::minmax_element(l, l + n_expert);
    const float add = bonus.bonus * (*hi - *lo);
    if (!std::isfinite(add)) continue;  // a -inf (or defective) logit: no bonus, exact routing for the token
    for (int e = 0; e < n_expert; ++e)
      if (bonus.resident[size_t(e)]) l[e] += add;
  }
  select_impl(spec, logits, sel.data(), T, r, {});
}

void Backend::mla_attention(const MlaSpec&, const MlaWeights&, const Tensor&, int64_t, const Tensor&, const Tensor&) {
  throw std::logic_error("backend '" + info().name +
                         "' does not implement multi-head latent attention (mla_attention)");
}

}  // namespace strata::backend
