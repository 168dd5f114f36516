#include "model/step.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "model/arch.h"
#include "model/dump.h"
#include "parallel/expert_parallel.h"

namespace strata::model {

using backend::Tensor;

namespace {
/// Expert e's weights as the backend takes them: its three parts in the arena slot `v` (shapes
/// from the layer's table) and its rows of the layer's resident biases, if any.
backend::FfnWeights expert_weights(const MoeLayer& w, const stream::ExpertView& v, int64_t e) {
  auto part = [](const ExpertPartShape& s, const uint8_t* data) {
    return Tensor::matrix(s.type, data, s.cols, s.rows, s.row_bytes);
  };
  backend::FfnWeights f{part(w.gate, v.part[0]), part(w.up, v.part[1]), part(w.down, v.part[2])};
  if (!w.gate_bias.empty()) f.gate_b = w.gate_bias.rows_view(e, 1);
  if (!w.up_bias.empty()) f.up_b = w.up_bias.rows_view(e, 1);
  if (!w.down_bias.empty()) f.down_b = w.down_bias.rows_view(e, 1);
  return f;
}

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
// Adds the scope's wall time to one stage of the profile (if any). When profiling, the backend
// is synchronized at both ends, so on an asynchronous backend (CUDA) a stage's time is its device
// time rather than its launch time (profiling then costs two syncs per stage).
class StageTimer {
 public:
  StageTimer(StageProfile* p, backend::Backend& be, StageProfile::Stage s) : p_(p), be_(be), s_(s) {
    if (!p_) return;
    be_.synchronize();
    t0_ = std::chrono::steady_clock::now();
    loops0_ = be_.loop_profile();
  }
  ~StageTimer() {
    if (!p_) return;
    be_.synchronize();
    p_->add(s_, seconds_between(t0_, std::chrono::steady_clock::now()), be_.loop_profile().minus(loops0_));
  }

 private:
  StageProfile* p_;
  backend::Backend& be_;
  StageProfile::Stage s_;
  std::chrono::steady_clock::time_point t0_;
  backend::LoopProfile loops0_;
};
}  // namespace

/// Read-ahead for a later layer, issued from this layer: that layer's router applied to this
/// layer's MoE input predicts its experts, queued most-predicting-tokens first with no cap;
/// then the layer's static rank (most popular first) fills in. Never changes results, only
/// what is read when.
struct Step::ReadAhead {
  int layer = -1;                       ///< layer to read ahead for; -1 = none
  const MoeLayer* router_of = nullptr;  ///< that layer (its router predicts); null = no prediction
  int n_expert = 0;
  int top_k = 0;
  int min_tokens = 1;                         ///< queue only experts predicted by >= this many tokens
  std::span<const int32_t> static_rank;       ///< that layer's experts, most popular first (may be empty)
  int64_t static_count = 0;                   ///< how many of static_rank to queue after the predicted ones
  std::vector<int32_t>* predicted = nullptr;  ///< out: predicted ids per token [T][top_k], for recall
};

Step::Step(ForwardContext& ctx, const Model& model, std::span<SeqInput> batch)
    : ctx_(ctx), be_(ctx.be), model_(model), batch_(batch) {
  for (const SeqInput& s : batch) T_ += int64_t(s.ids.size());
  if (T_ == 0) throw std::invalid_argument("Step: a forward call needs at least one token");
  E_ = model.hparams().n_embd;
  const size_t rows_bytes = size_t(T_ * E_) * sizeof(float);
  act_ = be_.alloc(backend::BufferRole::Activations, 3 * rows_bytes);
  x_ = act_->f32(E_, T_, 0);
  h_ = act_->f32(E_, T_, rows_bytes);
  o_ = act_->f32(E_, T_, 2 * rows_bytes);
  if (ctx_.dump) {
    std::vector<int32_t> ids;
    for (const SeqInput& s : batch) ids.insert(ids.end(), s.ids.begin(), s.ids.end());
    ctx_.dump->begin_call(ids);
  }
}

Step::~Step() = default;

void Step::name(const Tensor& t, std::string_view base, int layer) {
  if (!ctx_.dump) return;
  const std::string full = layer >= 0 ? fmt::format("{}-{}", base, layer) : std::string(base);
  if (!ctx_.dump->wants(full)) return;
  std::vector<float> host(size_t(t.numel()));
  be_.download(host.data(), t, host.size() * sizeof(float));
  ctx_.dump->write(full, host, t.cols(), t.rows());
}

void Step::embed(const Tensor& table) {
  StageTimer timer_(ctx_.profile, be_, StageProfile::Embed);
  std::vector<int32_t> ids;
  ids.reserve(size_t(T_));
  for (const SeqInput& s : batch_) ids.insert(ids.end(), s.ids.begin(), s.ids.end());
  be_.embed(table, ids, x_);
  name(x_, "inp_embd");
}

void Step::norm(const Tensor& w, const char* nm, int layer) {
  StageTimer timer_(ctx_.profile, be_, StageProfile::Norm);
  be_.rms_norm(x_, w, model_.hparams().rms_eps, h_);
  name(h_, nm, layer);
}

void Step::residual(const char* nm, int layer) {
  StageTimer timer_(ctx_.profile, be_, StageProfile::Residual);
  be_.add(x_, o_);
  name(x_, nm, layer);
}

void Step::residual_norm(const char* nm, int layer, const Tensor& w, const char* norm_name, int norm_layer) {
  StageTimer timer_(ctx_.profile, be_, StageProfile::Residual);
  be_.add_rms_norm(x_, o_, w, model_.hparams().rms_eps, h_);
  name(x_, nm, layer);
  name(h_, norm_name, norm_layer);
}

void Step::attention(int layer, const backend::AttentionSpec& spec, const backend::AttentionWeights& w) {
  StageTimer timer_(ctx_.profile, be_, StageProfile::Attention);
  const int64_t kv_dim = int64_t(spec.n_head_kv) * spec.head_dim;
  int64_t t0 = 0;
  for (SeqInput& s : batch_) {
    const int64_t n = int64_t(s.ids.size());
    const backend::KvCache kv{s.state->k[size_t(layer)].tensor(kv_dim), s.state->v[size_t(layer)].tensor(kv_dim)};
    be_.attention(spec, w, kv, s.state->n_past, h_.rows_view(t0, n), o_.rows_view(t0, n));
    t0 += n;
  }
  name(o_, "attn_out", layer);
}

void Step::mla_attention(int layer, const backend::MlaSpec& spec, const backend::MlaWeights& w) {
  StageTimer timer_(ctx_.profile, be_, StageProfile::MlaAttention);
  int64_t t0 = 0;
  for (SeqInput& s : batch_) {
    const int64_t n = int64_t(s.ids.size());
    be_.mla_attention(spec, w, s.state->k[size_t(layer)].tensor(spec.cache_dim()), s.state->n_past, h_.rows_view(t0, n),
                      o_.rows_view(t0, n));
    t0 += n;
  }
  name(o_, "attn_out", layer);
}

void Step::gated_delta_net(int layer, const backend::GdnSpec& spec, const backend::GdnWeights& w) {
  StageTimer timer_(ctx_.profile, be_, StageProfile::GatedDeltaNet);
  int64_t t0 = 0;
  for (SeqInput& s : batch_) {
    const int64_t n = int64_t(s.ids.size());
    const backend::RecurrentState st{s.state->conv[size_t(layer)].tensor(spec.conv_dim()),
                                     s.state->ssm[size_t(layer)].tensor(spec.head_v_dim)};
    be_.gated_delta_net(spec, w, st, h_.rows_view(t0, n), o_.rows_view(t0, n));
    t0 += n;
  }
  name(o_, "linear_attn_out", layer);
}

void Step::ffn(const backend::FfnCall& call, const backend::FfnWeights& w, const char* nm, int layer) {
  StageTimer timer_(ctx_.profile, be_, StageProfile::DenseFfn);
  be_.ffn(call, w, h_, o_);
  name(o_, nm, layer);
}

Step::ReadAhead Step::plan_read_ahead(int layer, const MoeLayer* router_of, std::vector<int32_t>* predicted) const {
  ReadAhead ra;
  const auto& hp = model_.hparams();
  const auto& experts = model_.expert_layout();
  if (layer < 0 || layer >= hp.n_layer || experts[size_t(layer)].n_expert == 0) return ra;
  ra.layer = layer;
  ra.n_expert = experts[size_t(layer)].n_expert;
  ra.top_k = hp.n_expert_used;
  ra.min_tokens = ctx_.ahead.predict_min;
  if (ctx_.ahead.predict && router_of) {
    ra.router_of = router_of;
    ra.predicted = predicted;
  }
  const auto* rank = ctx_.ahead.static_rank;
  if (rank && size_t(layer) < rank->size() && (!ra.router_of || layer == 0)) {
    ra.static_rank = (*rank)[size_t(layer)];
    ra.static_count = std::min<int64_t>(int64_t(ra.top_k) * T_, ra.n_expert);
  }
  return ra;
}

void Step::read_ahead(const ReadAhead& ra, const Tensor& h, const backend::Routing* predicted) {
  if (ra.layer < 0) return;
  std::vector<int32_t> order;
  std::vector<char> queued(size_t(ra.n_expert), 0);
  if (ra.router_of) {
    // The later layer's router on this layer's input, for every token; only the ids come to the
    // host (on the CUDA backend the selection runs on the device). `predicted`: already routed
    // (with this layer's routing, in one backend call).
    const MoeLayer& m = *ra.router_of;
    backend::Routing pr;
    if (predicted) {
      pr.ids = predicted->ids;
    } else if (m.spec.top_k == ra.top_k) {
      be_.route(m.spec, m.router, m.router_bias, h, pr, /*ids_only=*/true);
    } else {
      backend::RouterSpec spec = m.spec;
      spec.top_k = ra.top_k;
      be_.route(spec, m.router, m.router_bias, h, pr, /*ids_only=*/true);
    }
    if (ra.predicted) *ra.predicted = pr.ids;
    // Count predicting tokens per expert; most-predicted first (ties: lower id).
    std::vector<int64_t> count(size_t(ra.n_expert), 0);
    for (int32_t e : pr.ids) ++count[size_t(e)];
    for (int e = 0; e < ra.n_expert; ++e)
      if (count[size_t(e)] >= ra.min_tokens) order.push_back(e);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return count[size_t(a)] > count[size_t(b)]; });
    for (int32_t e : order) queued[size_t(e)] = 1;
  }
  for (int64_t i = 0, n = 0; i < int64_t(ra.static_rank.size()) && n < ra.static_count; ++i) {
    const int32_t e = ra.static_rank[size_t(i)];
    if (e < 0 || e >= ra.n_expert || queued[size_t(e)]) continue;
    order.push_back(e);
    queued[size_t(e)] = 1;
    ++n;
  }
  if (order.empty()) return;
  if (ctx_.ep)
    ctx_.ep->prefetch(ra.layer, order);  // each rank reads ahead the experts it owns
  else
    ctx_.stream.prefetch(ra.layer, order);
}

void Step::router_logits(const MoeLayer& m, const Tensor& h, std::vector<float>& logits) {
  if (m.router_bias.empty())
    be_.router_logits(m.router, h, logits);
  else
    be_.router_logits_biased(m.router, m.router_bias, h, logits);
}

void Step::read_ahead_first(const MoeLayer& first, const Tensor& norm0, int layer) {
  StageTimer timer_(ctx_.profile, be_, StageProfile::ReadAhead);
  be_.rms_norm(x_, norm0, model_.hparams().rms_eps, h_);
  pred_.clear();
  read_ahead(plan_read_ahead(layer, &first, &pred_), h_);
}

void Step::score_prediction(int layer, const backend::Routing& r, const std::vector<int32_t>& predicted) {
  if (!ctx_.prediction || predicted.size() != r.ids.size() || predicted.empty()) return;
  auto& p = *ctx_.prediction;
  const int n_layer = model_.hparams().n_layer;
  p.picks.resize(size_t(n_layer), 0);
  p.predicted.resize(size_t(n_layer), 0);
  const size_t K = size_t(r.top_k), T = r.ids.size() / K;
  for (size_t t = 0; t < T; ++t)
    for (size_t k = 0; k < K; ++k) {
      const int32_t e = r.ids[t * K + k];
      ++p.picks[size_t(layer)];
      for (size_t j = 0; j < K; ++j)
        if (predicted[t * K + j] == e) {
          ++p.predicted[size_t(layer)];
          break;
        }
    }
}

void Step::count_moce(const backend::Routing& r, const backend::Routing& exact, std::span<const uint8_t> resident,
                      MoceStats& out) {
  const size_t K = size_t(r.top_k), T = r.ids.size() / std::max<size_t>(1, K);
  std::vector<uint8_t> need_r(resident.size(), 0), need_x(resident.size(), 0);
  for (size_t t = 0; t < T; ++t)
    for (size_t k = 0; k < K; ++k) {
      const int32_t e = r.ids[t * K + k];
      need_r[size_t(e)] = 1;
      need_x[size_t(exact.ids[t * K + k])] = 1;
      bool in_exact = false;
      for (size_t j = 0; j < K; ++j) in_exact = in_exact || exact.ids[t * K + j] == e;
      if (!in_exact) ++out.substituted;
    }
  for (size_t e = 0; e < resident.size(); ++e)
    if (need_x[e] && !need_r[e] && !resident[e]) ++out.misses_avoided;
}

void Step::record_routing(int layer, const backend::Routing& r) {
  if (ctx_.dump) {
    const std::string full = fmt::format("ffn_moe_route-{}", layer);
    if (ctx_.dump->wants(full)) {
      const size_t T = r.next_prob.size(), K = size_t(r.top_k), W = 2 * K + 1;
      std::vector<float> rec(T * W);
      for (size_t t = 0; t < T; ++t) {
        for (size_t k = 0; k < K; ++k) {
          rec[t * W + k] = float(r.ids[t * K + k]);
          rec[t * W + K + k] = r.probs[t * K + k];
        }
        rec[t * W + 2 * K] = r.next_prob[t];
      }
      ctx_.dump->write(full, rec, int64_t(W), int64_t(T));
    }
  }
  RoutingTrace* trace = ctx_.trace;
  if (!trace) return;
  const size_t n_layer = size_t(model_.hparams().n_layer);
  trace->ids.resize(n_layer);
  trace->probs.resize(n_layer);
  trace->next_prob.resize(n_layer);
  const size_t T = r.next_prob.size(), K = size_t(r.top_k);
  for (size_t t = 0; t < T; ++t) {
    trace->ids[size_t(layer)].emplace_back(r.ids.begin() + t * K, r.ids.begin() + (t + 1) * K);
    trace->probs[size_t(layer)].emplace_back(r.probs.begin() + t * K, r.probs.begin() + (t + 1) * K);
    trace->next_prob[size_t(layer)].push_back(r.next_prob[t]);
  }
}

Interrupted::Interrupted(int l) : std::runtime_error(fmt::format("interrupted before layer {}", l)), layer(l) {}

void Step::moe(int layer, const MoeLayer& w, const MoeLayer* next, const MoeLayer* after_next) {
  stream::ExpertStream& stream = ctx_.stream;
  // Stop between layers when asked: nothing of this layer is pinned yet; queued read-aheads
  // are dropped and the backend's queued work is finished before the buffers go.
  if (ctx_.interrupt && ctx_.interrupt->load(std::memory_order_relaxed)) {
    stream.cancel_prefetch();
    be_.synchronize();
    throw Interrupted(layer);
  }
  const int K = w.spec.top_k;
  // Expert outputs per (token, k), summed afterwards in k order for batch invariance.
  const size_t out_bytes = size_t(T_ * K * E_) * sizeof(float);
  if (!expert_out_ || expert_out_->bytes() < out_bytes)
    expert_out_ = be_.alloc(backend::BufferRole::Activations, out_bytes);
  const Tensor expert_out = expert_out_->f32(E_, T_ * K);
  if (moe_on_device(layer, w, next, expert_out)) return;
  std::vector<int32_t> pred_next;
  const ReadAhead ra = plan_read_ahead(layer + 1, next, &pred_next);
  // --read-ahead-layers 2: the layer after next too, with its router on this layer's input (a
  // longer window for its reads; queued after the next layer's, which it never displaces).
  const ReadAhead ra2 = ctx_.ahead.layers >= 2 && ctx_.ahead.predict && after_next
                            ? plan_read_ahead(layer + 2, after_next, nullptr)
                            : ReadAhead{};

  // Router and top-k selection; the ids come to the host.
  // --profile: a stage runs from the last restart() to its profile_from().
  auto t_stage = std::chrono::steady_clock::now();
  backend::LoopProfile loops_stage = ctx_.profile ? be_.loop_profile() : backend::LoopProfile{};
  auto restart = [&] {
    t_stage = std::chrono::steady_clock::now();
    if (ctx_.profile) loops_stage = be_.loop_profile();
  };
  auto profile_from = [&](StageProfile::Stage st) {
    if (!ctx_.profile) return;
    be_.synchronize();
    ctx_.profile->add(st, seconds_between(t_stage, std::chrono::steady_clock::now()),
                      be_.loop_profile().minus(loops_stage));
  };
  backend::Routing r;
  // With MoCE, `exact` is the routing without the bonus: the prediction is scored against it,
  // so residency the bonus created is never taken as evidence that the prediction was right.
  // MoCE selects on the host (all logits downloaded); otherwise the backend selects (on the
  // CUDA backend: on the device, only [T][top_k] results come back).
  backend::Routing exact;
  backend::Routing pred;  // the next layer's predicted ids, when routed together with this layer
  backend::Routing pred2;  // and the layer after it's (--read-ahead-layers 2)
  bool pred_ready = false, pred2_ready = false;
  const bool moce = ctx_.moce_bonus > 0;
  if (moce) {
    std::vector<float> logits;
    router_logits(w, h_, logits);
    std::vector<uint8_t> resident(size_t(w.spec.n_expert));
    for (int e = 0; e < w.spec.n_expert; ++e)
      resident[size_t(e)] = (ctx_.ep ? ctx_.ep->resident(layer, e) : stream.resident(layer, e)) ? 1 : 0;
    std::vector<float> copy = logits;
    backend::select_experts(w.spec, copy.data(), T_, exact);
    backend::select_experts(w.spec, logits.data(), T_, r, backend::ResidencyBonus{ctx_.moce_bonus, resident});
    if (ctx_.moce) count_moce(r, exact, resident, *ctx_.moce);
  } else if (ra.router_of && ra.router_of->spec.top_k == ra.top_k) {
    // The next layer's prediction reads the same h_: both routers in one backend call (on the
    // CUDA backend one synchronization instead of two).
    const MoeLayer& nx = *ra.router_of;
    backend::RouteCall calls[3] = {{&w.spec, w.router, w.router_bias, &r, false},
                                   {&nx.spec, nx.router, nx.router_bias, &pred, true},
                                   {}};
    size_t n_calls = 2;
    if (ra2.router_of && ra2.router_of->spec.top_k == ra2.top_k) {
      const MoeLayer& n2 = *ra2.router_of;
      calls[n_calls++] = {&n2.spec, n2.router, n2.router_bias, &pred2, true};
      pred2_ready = true;
    }
    be_.route(std::span<const backend::RouteCall>(calls, n_calls), h_);
    pred_ready = true;
  } else {
    be_.route(w.spec, w.router, w.router_bias, h_, r);
  }

  // Group the chunk's (token, k) pairs by expert: each resident expert is applied to all its
  // tokens at once.
  std::vector<std::vector<int64_t>> pairs(size_t(w.spec.n_expert));  // entries t * K + k
  for (int64_t i = 0; i < T_ * K; ++i) pairs[size_t(r.ids[size_t(i)])].push_back(i);
  std::vector<int32_t> needed;
  for (int e = 0; e < w.spec.n_expert; ++e)
    if (!pairs[size_t(e)].empty()) needed.push_back(e);

  profile_from(StageProfile::Router);
  // The cut: ask for every expert this layer needs; misses become urgent reads. With expert
  // parallelism each rank asks its own stream for the experts it owns.
  restart();
  std::vector<std::vector<int32_t>> rank_needed;
  if (ctx_.ep) {
    rank_needed = ctx_.ep->split(layer, needed);
    for (int rk = 0; rk < ctx_.ep->n_ranks(); ++rk) ctx_.ep->stream(rk).request(layer, rank_needed[size_t(rk)]);
  } else {
    stream.request(layer, needed);
  }
  profile_from(StageProfile::StreamRequest);
  // While this layer computes, the IO threads read ahead for the next one.
  restart();
  read_ahead(ra, h_, pred_ready ? &pred : nullptr);
  read_ahead(ra2, h_, pred2_ready ? &pred2 : nullptr);
  profile_from(StageProfile::ReadAhead);

  restart();  // the expert stage's loops are counted from here
  const auto t_start = t_stage;
  double waited = 0;
  auto run_expert = [&](stream::ExpertStream& from, int32_t e, const Tensor& rows) {
    const auto t_wait = std::chrono::steady_clock::now();
    const stream::ExpertView view = from.wait(layer, e);
    waited += seconds_between(t_wait, std::chrono::steady_clock::now());
    backend::ExpertJob job;
    job.expert = e;
    job.w = expert_weights(w, view, e);
    job.pairs = pairs[size_t(e)];
    be_.expert_ffn(w.ffn, job, K, h_, rows);
  };

  // Resident experts first, then each miss as it arrives. The order of experts does not change
  // results: outputs land in per-(token, k) rows.
  auto run_experts = [&](stream::ExpertStream& from, const std::vector<int32_t>& ids, const Tensor& rows) {
    std::vector<int32_t> todo = ids, later, ready;
    while (!todo.empty()) {
      // One pass: take what is resident now; if nothing is, block on the first remaining.
      later.clear();
      ready.clear();
      for (int32_t e : todo) (from.resident(layer, e) ? ready : later).push_back(e);
      if (ready.empty()) {
        be_.flush();  // the queued experts compute while this one arrives
        ready.push_back(later.front());
        later.erase(later.begin());
      }
      todo.swap(later);
      for (int32_t e : ready) run_expert(from, e, rows);
    }
  };
  if (ctx_.ep) {
    // Each rank applies its experts to their tokens, into its own (token, k) rows.
    for (int rk = 0; rk < ctx_.ep->n_ranks(); ++rk)
      run_experts(ctx_.ep->stream(rk), rank_needed[size_t(rk)], ctx_.ep->rank_rows(rk, expert_out));
  } else {
    run_experts(stream, needed, expert_out);
  }
  // The slots may be reused once the expert kernels queued so far have read them.
  if (ctx_.profile) {
    be_.synchronize();
    ctx_.profile->add(StageProfile::ExpertMatmuls, seconds_between(t_start, std::chrono::steady_clock::now()) - waited,
                      be_.loop_profile().minus(loops_stage));
    ctx_.profile->add(StageProfile::ExpertWait, waited);
  }
  restart();
  if (ctx_.ep) {
    const backend::EventPtr last_use = be_.record();
    for (int rk = 0; rk < ctx_.ep->n_ranks(); ++rk) ctx_.ep->stream(rk).release(layer, last_use);
  } else {
    stream.release(layer, be_.record());
  }
  if (ctx_.times) ctx_.times->expert_s += seconds_between(t_start, std::chrono::steady_clock::now()) - waited;

  // Weighted sum per token in top-k order (with expert parallelism: after gathering every
  // (token, k) row from the rank that owns its expert).
  if (ctx_.ep)
    ctx_.ep->combine(layer, r, expert_out, o_);
  else
    be_.moe_combine(r, expert_out, o_);
  profile_from(StageProfile::MoeCombine);
  name(o_, "ffn_moe_out", layer);
  score_prediction(layer, moce ? exact : r, pred_);
  record_routing(layer, r);
  pred_.swap(pred_next);
}

bool Step::moe_on_device(int layer, const MoeLayer& w, const MoeLayer* next, const Tensor& expert_out) {
  // Needs the host between router and experts: MoCE (residency-aware selection), expert
  // parallelism, a dump (intermediates named as the host path names them).
  if (ctx_.moce_bonus > 0 || ctx_.ep || ctx_.dump) return false;
  stream::ExpertStream& stream = ctx_.stream;
  const std::vector<stream::ExpertView>* views = stream.resident_layer(layer);
  // The next layer resident too: otherwise its read-ahead (from this layer's input) is wanted.
  if (!views || views->empty() || (next && !stream.resident_layer(layer + 1))) return false;
  StageTimer timer_(ctx_.profile, be_, StageProfile::ExpertMatmuls);
  backend::DeviceMoeCall c;
  c.spec = &w.spec;
  c.router = w.router;
  c.router_bias = w.router_bias;
  c.ffn = &w.ffn;
  c.owner = &stream;
  c.layer = layer;
  c.generation = stream.generation();
  c.experts = [&](std::vector<backend::FfnWeights>& out) {
    out.resize(views->size());
    for (size_t e = 0; e < views->size(); ++e) out[e] = expert_weights(w, (*views)[e], int64_t(e));
  };
  c.h = h_;
  c.expert_out = expert_out;
  c.out = o_;
  const int32_t* host = be_.moe_on_device(c);
  if (!host) return false;
  device_moe_.push_back({layer, w.spec.top_k, host});
  pred_.clear();  // no read-ahead was needed for this layer, so none for the next
  return true;
}

void Step::settle_device_moe() {
  if (device_moe_.empty()) return;
  be_.synchronize();
  std::vector<DeviceMoeResult> done;
  done.swap(device_moe_);
  std::vector<int32_t> used;
  for (const DeviceMoeResult& d : done) {
    const int32_t* status = d.host;
    for (int64_t t = 0; t < T_; ++t)
      if (status[t]) throw std::invalid_argument(backend::router_logits_defect_message(status[t], t));
    const size_t TK = size_t(T_) * size_t(d.top_k);
    const int32_t* ids = d.host + T_;
    used.assign(ids, ids + TK);
    std::sort(used.begin(), used.end());
    used.erase(std::unique(used.begin(), used.end()), used.end());
    ctx_.stream.count_resident_use(d.layer, used);
    if (ctx_.trace) {
      backend::Routing r;
      r.top_k = d.top_k;
      r.ids.assign(ids, ids + TK);
      const auto* f = reinterpret_cast<const float*>(ids + TK);
      r.probs.assign(f, f + TK);
      r.weights.assign(f + TK, f + 2 * TK);
      r.next_prob.assign(f + 2 * TK, f + 2 * TK + T_);
      record_routing(d.layer, r);
    }
  }
}

void Step::output(const Tensor& norm, const Tensor& head) {
  StageTimer timer_(ctx_.profile, be_, StageProfile::OutputHead);
  for (SeqInput& s : batch_) s.state->n_past += int64_t(s.ids.size());
  // The rows that produce logits, normed into h back to back.
  const float eps = model_.hparams().rms_eps;
  int64_t t0 = 0, rows = 0;
  for (const SeqInput& s : batch_) {
    const int64_t n = int64_t(s.ids.size());
    const int64_t first = s.mode == LogitsMode::All ? 0 : s.mode == LogitsMode::Last ? n - 1 : n;
    if (first < n) be_.rms_norm(x_.rows_view(t0 + first, n - first), norm, eps, h_.rows_view(rows, n - first));
    rows += n - first;
    t0 += n;
  }
  if (rows == 0) {
    settle_or_roll_back();
    return;
  }
  name(h_.rows_view(0, rows), "result_norm");
  const int64_t V = model_.hparams().n_vocab;
  auto buf = be_.alloc(backend::BufferRole::Activations, size_t(rows * V) * sizeof(float));
  const Tensor logits = buf->f32(V, rows);
  be_.matmul(head, h_.rows_view(0, rows), logits);
  name(logits, "result_output");
  int64_t r = 0;
  for (SeqInput& s : batch_) {
    const int64_t n = int64_t(s.ids.size());
    const int64_t k = s.mode == LogitsMode::All ? n : s.mode == LogitsMode::Last ? 1 : 0;
    if (k == 0) continue;
    s.logits->resize(size_t(k * V));
    be_.download(s.logits->data(), logits.rows_view(r, k), size_t(k * V) * sizeof(float));
    r += k;
  }
  settle_or_roll_back();
}

void Step::settle_or_roll_back() {
  try {
    settle_device_moe();
  } catch (...) {
    for (SeqInput& s : batch_) s.state->n_past -= int64_t(s.ids.size());  // the call's tokens are not done
    throw;
  }
}

SequenceState AttnMoeModel::new_state(int64_t n_ctx) const {
  SequenceState st;
  st.n_ctx = n_ctx;
  const int64_t kv_dim = int64_t(hp_.n_head_kv) * hp_.head_dim_k;
  for (int l = 0; l < hp_.n_layer; ++l) {
    st.k.emplace_back(*be_, n_ctx * kv_dim);
    st.v.emplace_back(*be_, n_ctx * kv_dim);
  }
  return st;
}

uint64_t AttnMoeModel::state_bytes(int64_t n_ctx) const {
  return uint64_t(2) * hp_.n_layer * n_ctx * hp_.n_head_kv * hp_.head_dim_k * sizeof(float);
}

void AttnMoeModel::bind_layers(const BoundWeights& w, const std::function<const backend::AttentionSpec*(int)>& spec,
                               const std::function<backend::RouterSpec(int)>& router, const char* ffn_norm) {
  layers_.resize(size_t(hp_.n_layer));
  experts_.resize(size_t(hp_.n_layer));
  for (int l = 0; l < hp_.n_layer; ++l) {
    AttnMoeLayer& L = layers_[size_t(l)];
    L.attn_norm = w.get(blk(l, "attn_norm.weight"));
    L.attn = bind_attention(w, l);
    L.spec = spec(l);
    L.ffn_norm = w.get(blk(l, ffn_norm));
    L.moe = bind_moe(w, l, router(l));
  }
}

void AttnMoeModel::forward(ForwardContext& ctx, std::span<SeqInput> batch) {
  Step s(ctx, *this, batch);
  s.embed(tok_embd_);
  s.read_ahead_first(layers_[0].moe, layers_[0].ffn_norm);  // layer 0's experts load during attention
  const int n = int(layers_.size());
  if (n > 0) s.norm(layers_[0].attn_norm, "attn_norm", 0);
  for (int l = 0; l < n; ++l) {
    const AttnMoeLayer& L = layers_[size_t(l)];
    s.attention(l, *L.spec, L.attn);
    s.residual_norm("ffn_inp", l, L.ffn_norm, ffn_norm_name_, l);
    s.moe(l, L.moe, moe_ahead(layers_, l, n, 1), moe_ahead(layers_, l, n, 2));
    if (l + 1 < n)
      s.residual_norm("l_out", l, layers_[size_t(l + 1)].attn_norm, "attn_norm", l + 1);  // the next layer's norm
    else
      s.residual("l_out", l);
  }
  s.output(output_norm_, output_);
}

}  // namespace strata::model
