#include "server/scheduler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tokenizer/tokenizer.h"

namespace strata::server {

bool Request::wait(std::vector<Event>& out, std::chrono::milliseconds timeout) {
  std::unique_lock lk(m_);
  if (events_.empty() && !done_) cv_.wait_for(lk, timeout, [&] { return !events_.empty() || done_; });
  while (!events_.empty()) {
    out.push_back(std::move(events_.front()));
    events_.pop_front();
  }
  return done_;
}

void Request::push(Event e) {
  {
    std::lock_guard lk(m_);
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

void Request::finish(std::string reason, std::string error_message) {
  {
    std::lock_guard lk(m_);
    finish_reason = std::move(reason);
    error = std::move(error_message);
    done_ = true;
  }
  cv_.notify_all();
}

TokenLogprob token_logprob(std::span<const float> logits, int32_t id, int n) {
  TokenLogprob t;
  t.id = id;
  float mx = -INFINITY;
  for (float x : logits)
    if (std::isfinite(x)) mx = std::max(mx, x);
  double sum = 0;
  for (float x : logits)
    if (std::isfinite(x)) sum += std::exp(double(x - mx));
  const double lse = double(mx) + std::log(sum);
  auto lp = [&](int32_t k) {
    const float x = logits[size_t(k)];
    return std::isfinite(x) ? float(double(x) - lse) : -INFINITY;
  };
  t.logprob = lp(id);
  n = std::min<int>(n, int(logits.size()));
  if (n > 0) {
    std::vector<int32_t> idx(logits.size());
    std::iota(idx.begin(), idx.end(), 0);
    auto key = [&](int32_t k) { return std::isfinite(logits[size_t(k)]) ? logits[size_t(k)] : -INFINITY; };
    std::partial_sort(idx.begin(), idx.begin() + n, idx.end(),
                      [&](int32_t a, int32_t b) { return key(a) > key(b) || (key(a) == key(b) && a < b); });
    for (int k = 0; k < n; ++k) t.top.emplace_back(idx[size_t(k)], lp(idx[size_t(k)]));
  }
  return t;
}

size_t partial_stop_suffix(std::string_view text, const std::vector<std::string>& stops) {
  size_t best = 0;
  for (const std::string& s : stops)
    for (size_t k = s.empty() ? 0 : std::min(text.size(), s.size() - 1); k > best; --k)
      if (text.compare(text.size() - k, k, s, 0, k) == 0) {
        best = k;
        break;
      }
  return best;
}

void Histogram::observe(double v) {
  size_t b = 0;
  while (b < bounds_.size() && v > bounds_[b]) ++b;
  ++counts_[b];
  sum_ += v;
  ++count_;
}

void Histogram::write(std::string& out, const std::string& name, const std::string& help, const std::string& labels,
                      bool header) const {
  if (header) out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  const std::string sep = labels.empty() ? "" : ",";
  int64_t cum = 0;
  for (size_t b = 0; b <= bounds_.size(); ++b) {
    cum += counts_[b];
    const std::string le = b < bounds_.size() ? fmt::format("{}", bounds_[b]) : "+Inf";
    out += fmt::format("{}_bucket{{{}{}le=\"{}\"}} {}\n", name, labels, sep, le, cum);
  }
  const std::string braces = labels.empty() ? "" : "{" + labels + "}";
  out += fmt::format("{}_sum{} {}\n{}_count{} {}\n", name, braces, sum_, name, braces, count_);
}

namespace {
using Clock = std::chrono::steady_clock;
double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
const std::vector<double> kSecondsBuckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
const std::vector<double> kRateBuckets = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000};
std::vector<double> powers_of_two(int64_t top) {
  std::vector<double> b;
  for (int64_t x = 1; x < top; x *= 2) b.push_back(double(x));
  b.push_back(double(top));
  return b;
}
}  // namespace

struct Scheduler::Slot {
  int index = 0;
  std::shared_ptr<Request> req;
  model::SequenceState st;
  std::optional<engine::Sampler> sampler;
  std::optional<tokenizer::StreamDecoder> dec;
  std::vector<float> logits;
  std::vector<int32_t> history;
  size_t prefilled = 0;
  int generated = 0;
  std::string pending;      // decoded text not yet released (a possible stop-string prefix)
  bool has_logits = false;  // logits of the last token run are ready to sample
  int32_t feed[1] = {-1};   // the sampled token to run next (-1: none)
  size_t checkpoint = 0;    // prompt position to store in the prefix cache (0: none)
  uint64_t order = 0;       // admission order
  Clock::time_point started, first_token;
  int64_t served = 0, tokens = 0;  // per-slot counters (under metrics_mutex_)
};

Scheduler::Scheduler(engine::Engine& eng, int n_slots, int queue_size)
    : Scheduler(eng, [&] {
        SchedulerOptions o;
        o.n_slots = n_slots;
        o.queue_size = queue_size;
        return o;
      }()) {}

Scheduler::Scheduler(engine::Engine& eng, const SchedulerOptions& opts)
    : opts_(opts),
      eng_(eng),
      queue_s_(kSecondsBuckets),
      ttft_s_(kSecondsBuckets),
      decode_tps_(kRateBuckets),
      step_seqs_(powers_of_two(std::max(1, opts.n_slots))),
      step_tokens_(powers_of_two(std::max(1, eng.options().prompt_chunk))),
      queue_size_(size_t(std::max(0, opts.queue_size))) {
  if (opts_.n_slots < 1) throw std::invalid_argument("--parallel must be at least 1");
  const int chunk = std::max(1, eng_.options().prompt_chunk);
  if (opts_.batch_tokens < 0 || opts_.batch_tokens > chunk)
    throw std::invalid_argument(fmt::format(
        "--batch-tokens {} is outside [1, {}] (the arena is sized for one --prompt-chunk of {} tokens; raise "
        "--prompt-chunk for larger batches)",
        opts_.batch_tokens, chunk, chunk));
  if (opts_.batch_tokens == 0) opts_.batch_tokens = chunk;
  step_tokens_ = Histogram(powers_of_two(opts_.batch_tokens));
  for (int k = 0; k < opts_.n_slots; ++k) {
    auto s = std::make_unique<Slot>();
    s->index = k;
    s->st = eng_.new_sequence();
    slots_.push_back(std::move(s));
  }
  bool recurrent = false;
  for (auto& b : slots_[0]->st.conv) recurrent = recurrent || !b.empty();
  for (auto& b : slots_[0]->st.ssm) recurrent = recurrent || !b.empty();
  cache_ = std::make_unique<PrefixCache>(eng_.backend(), opts_.cache_bytes, recurrent,
                                         size_t(std::max(1, opts_.cache_min_tokens)));
  snapshot_stats();
  eng_.set_interrupt(&interrupt_);
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() { stop(); }

void Scheduler::stop() {
  {
    std::lock_guard lk(q_mutex_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  interrupt_ = true;
  q_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  eng_.set_interrupt(nullptr);
  std::lock_guard lk(q_mutex_);
  for (auto& r : queue_) {
    ++cancelled_;
    r->finish("cancelled");
  }
  queue_.clear();
}

int64_t Scheduler::drain(std::chrono::milliseconds grace) {
  const int64_t before = cancelled_;
  {
    std::lock_guard lk(q_mutex_);
    draining_ = true;
  }
  const auto deadline = Clock::now() + grace;
  for (;;) {
    {
      std::lock_guard lk(q_mutex_);
      if (busy_ == 0 && queue_.empty()) break;
    }
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  stop();
  return cancelled_ - before;
}

bool Scheduler::stopping() {
  std::lock_guard lk(q_mutex_);
  return stop_ || draining_;
}

bool Scheduler::submit(const std::shared_ptr<Request>& r) {
  {
    std::lock_guard lk(q_mutex_);
    const size_t free_slots = slots_.size() - size_t(busy_);
    if (stop_ || draining_ || queue_.size() >= queue_size_ + free_slots) {
      ++rejected_;
      return false;
    }
    r->submitted = Clock::now();
    queue_.push_back(r);
  }
  q_cv_.notify_all();
  return true;
}

SchedulerCounters Scheduler::counters() {
  SchedulerCounters c;
  {
    std::lock_guard lk(q_mutex_);
    c.slots = int64_t(slots_.size());
    c.slots_busy = busy_;
    c.queued = int64_t(queue_.size());
    c.queue_capacity = int64_t(queue_size_);
  }
  c.admitted = admitted_;
  c.rejected = rejected_;
  c.cancelled = cancelled_;
  c.completed = completed_;
  c.failed = failed_;
  c.timed_out = timed_out_;
  c.prompt_tokens = prompt_tokens_;
  c.generated_tokens = generated_tokens_;
  c.steps = steps_;
  c.cache = cache_->stats();
  std::lock_guard lk(stats_mutex_);
  c.prefill = prefill_stats_;
  c.decode = decode_stats_;
  return c;
}

void Scheduler::write_metrics(std::string& out) {
  const SchedulerCounters c = counters();
  auto one = [&](const char* name, const char* type, const char* help, double v) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{} {}\n", name, help, name, type, name, v);
  };
  one("strata_requests_timed_out_total", "counter", "Generations ended by --request-timeout.", double(c.timed_out));
  one("strata_batch_steps_total", "counter", "Forward calls of the scheduler (one per step).", double(c.steps));
  one("strata_prefix_cache_lookups_total", "counter", "Requests that looked up the prefix cache.",
      double(c.cache.lookups));
  one("strata_prefix_cache_hits_total", "counter", "Requests that reused a cached prefix.", double(c.cache.hits));
  one("strata_prefix_cache_tokens_reused_total", "counter", "Prompt tokens restored from the prefix cache.",
      double(c.cache.tokens_reused));
  one("strata_prefix_cache_inserts_total", "counter", "Snapshots stored in the prefix cache.", double(c.cache.inserts));
  one("strata_prefix_cache_evictions_total", "counter", "Snapshots evicted (least recently used, or subsumed).",
      double(c.cache.evictions));
  one("strata_prefix_cache_entries", "gauge", "Snapshots held by the prefix cache.", double(c.cache.entries));
  one("strata_prefix_cache_bytes", "gauge", "Bytes held by the prefix cache.", double(c.cache.bytes));
  one("strata_prefix_cache_capacity_bytes", "gauge", "Bound of the prefix cache (--cache-ram).",
      double(c.cache.capacity_bytes));
  std::lock_guard lk(metrics_mutex_);
  queue_s_.write(out, "strata_queue_seconds", "Seconds from submission to a slot, per request.");
  ttft_s_.write(out, "strata_time_to_first_token_seconds", "Seconds from submission to the first token, per request.");
  decode_tps_.write(out, "strata_request_decode_tokens_per_second",
                    "Generated tokens per second after the first token, per request of two or more tokens.");
  step_seqs_.write(out, "strata_batch_sequences", "Sequences per forward step.");
  step_tokens_.write(out, "strata_batch_tokens", "Tokens per forward step.");
  out += "# HELP strata_slot_requests_total Requests each slot served.\n# TYPE strata_slot_requests_total counter\n";
  for (auto& s : slots_) out += fmt::format("strata_slot_requests_total{{slot=\"{}\"}} {}\n", s->index, s->served);
  out +=
      "# HELP strata_slot_generated_tokens_total Tokens each slot generated.\n"
      "# TYPE strata_slot_generated_tokens_total counter\n";
  for (auto& s : slots_)
    out += fmt::format("strata_slot_generated_tokens_total{{slot=\"{}\"}} {}\n", s->index, s->tokens);
}

void Scheduler::snapshot_stats() {
  std::lock_guard lk(stats_mutex_);
  prefill_stats_ = eng_.prefill_stats();
  decode_stats_ = eng_.decode_stats();
}

void Scheduler::start(Slot& s, std::shared_ptr<Request> r) {
  s.req = std::move(r);
  s.st.n_past = 0;  // reuse the slot's buffers: KV rows past n_past are never read
  for (auto& v : s.st.conv) v.zero();
  for (auto& v : s.st.ssm) v.zero();
  s.sampler.emplace(s.req->params.sampler);
  s.dec.emplace(eng_.tokenizer());
  s.history = s.req->params.prompt;
  s.generated = 0;
  s.pending.clear();
  s.has_logits = false;
  s.feed[0] = -1;
  s.order = order_++;
  s.started = Clock::now();
  s.req->prompt_tokens = int(s.req->params.prompt.size());
  {
    std::lock_guard lk(engine_mutex_);
    const PrefixCache::Match m = cache_->restore(s.req->params.prompt, s.st);
    s.prefilled = m.reused;
    s.checkpoint = m.checkpoint;
  }
  {
    std::lock_guard lk(metrics_mutex_);
    queue_s_.observe(seconds_between(s.req->submitted, s.started));
  }
  ++admitted_;
}

void Scheduler::release(Slot& s, const std::string& reason, const std::string& error) {
  s.req->completion_tokens = s.generated;
  if (reason == "cancelled")
    ++cancelled_;
  else if (reason == "error")
    ++failed_;
  else
    ++completed_;
  if (reason != "error" && !interrupt_) {
    // The state holds history[0, n_past): worth keeping for a request that continues it (not
    // after an interrupted forward, which may have updated recurrent state part way).
    std::lock_guard lk(engine_mutex_);
    cache_->insert(std::span<const int32_t>(s.history).first(size_t(s.st.n_past)), s.st);
  }
  {
    std::lock_guard lk(metrics_mutex_);
    ++s.served;
    s.tokens += s.generated;
    if (s.generated >= 2) {
      const double dt = seconds_between(s.first_token, Clock::now());
      if (dt > 0) decode_tps_.observe(double(s.generated - 1) / dt);
    }
  }
  {
    std::lock_guard lk(q_mutex_);  // before finish(): whoever waits on the request sees the slot free
    --busy_;
  }
  s.req->finish(reason, error);
  s.req.reset();
  s.sampler.reset();
  s.dec.reset();
  s.has_logits = false;
  s.feed[0] = -1;
  std::vector<int32_t>().swap(s.history);
}

bool Scheduler::emit(Slot& s, std::string piece, std::optional<TokenLogprob> tok, bool final) {
  s.pending += piece;
  const auto& stops = s.req->params.stop;
  size_t cut = std::string::npos;
  for (const std::string& st : stops) cut = std::min(cut, s.pending.find(st));
  if (cut != std::string::npos) {
    s.req->push({s.pending.substr(0, cut), std::move(tok)});
    s.pending.clear();
    return true;
  }
  const size_t hold = final ? 0 : partial_stop_suffix(s.pending, stops);
  Event e{s.pending.substr(0, s.pending.size() - hold), std::move(tok)};
  s.pending.erase(0, s.pending.size() - hold);
  if (!e.text.empty() || e.token) s.req->push(std::move(e));
  return false;
}

bool Scheduler::sample(Slot& s) {
  const GenParams& p = s.req->params;
  s.has_logits = false;
  const int32_t id = s.sampler->sample(s.logits, s.history);
  s.history.push_back(id);
  if (s.generated == 0) {
    s.first_token = Clock::now();
    std::lock_guard lk(metrics_mutex_);
    ttft_s_.observe(seconds_between(s.req->submitted, s.first_token));
  }
  if (std::find(p.end_tokens.begin(), p.end_tokens.end(), id) != p.end_tokens.end()) {
    emit(s, s.dec->flush(), std::nullopt, true);
    release(s, "stop");
    return false;
  }
  ++s.generated;
  ++generated_tokens_;
  std::optional<TokenLogprob> lp;
  if (p.top_logprobs >= 0) lp = token_logprob(s.logits, id, p.top_logprobs);
  if (emit(s, s.dec->push(id), std::move(lp), false)) {
    release(s, "stop");
    return false;
  }
  if (s.generated >= p.max_tokens || s.st.n_past >= s.st.n_ctx) {
    release(s, emit(s, s.dec->flush(), std::nullopt, true) ? "stop" : "length");
    return false;
  }
  s.feed[0] = id;
  return true;
}

void Scheduler::step(const std::vector<Slot*>& cand, int budget) {
  const auto now = Clock::now();
  std::vector<Slot*> live;
  for (Slot* s : cand) {
    if (!s->req) continue;
    if (s->req->cancelled()) {
      release(*s, "cancelled");
      continue;
    }
    if (opts_.request_timeout_s > 0 && seconds_between(s->req->submitted, now) > opts_.request_timeout_s) {
      ++timed_out_;
      emit(*s, s->dec->flush(), std::nullopt, true);
      release(*s, "length");
      continue;
    }
    try {
      if (s->has_logits && !sample(*s)) continue;
    } catch (const std::exception& e) {
      release(*s, "error", e.what());
      continue;
    }
    live.push_back(s);
  }
  // The batch: one token for each generating slot, then prompt chunks first come first served.
  struct Part {
    Slot* s;
    size_t n;  // prompt tokens (0: a decode token)
  };
  std::vector<Part> parts;
  for (Slot* s : live)
    if (s->feed[0] >= 0 && budget > 0) {
      parts.push_back({s, 0});
      --budget;
    }
  std::vector<Slot*> filling;
  for (Slot* s : live)
    if (s->prefilled < s->req->params.prompt.size()) filling.push_back(s);
  std::sort(filling.begin(), filling.end(), [](Slot* a, Slot* b) { return a->order < b->order; });
  for (Slot* s : filling) {
    if (budget <= 0) break;
    const size_t end = s->checkpoint > s->prefilled ? s->checkpoint : s->req->params.prompt.size();
    const size_t n = std::min(end - s->prefilled, size_t(budget));
    parts.push_back({s, n});
    budget -= int(n);
  }
  if (parts.empty()) return;
  std::vector<model::SeqInput> batch;
  std::vector<Part> ok;
  for (const Part& pt : parts) {
    Slot& s = *pt.s;
    const bool last = pt.n > 0 && s.prefilled + pt.n == s.req->params.prompt.size();
    model::SeqInput in{&s.st,
                       pt.n ? std::span<const int32_t>(s.req->params.prompt).subspan(s.prefilled, pt.n)
                            : std::span<const int32_t>(s.feed, 1),
                       pt.n == 0 || last ? model::LogitsMode::Last : model::LogitsMode::None, &s.logits};
    try {
      eng_.check_ids(s.st, in.ids);
    } catch (const std::exception& e) {
      release(s, "error", e.what());
      continue;
    }
    batch.push_back(in);
    ok.push_back(pt);
  }
  if (batch.empty()) return;
  try {
    std::lock_guard lk(engine_mutex_);
    eng_.forward_batch(batch);
    snapshot_stats();
  } catch (const model::Interrupted&) {
    for (const Part& pt : ok) release(*pt.s, "cancelled");
    return;
  } catch (const std::exception& e) {
    for (const Part& pt : ok) release(*pt.s, "error", e.what());
    return;
  }
  ++steps_;
  int tokens = 0;
  for (const Part& pt : ok) {
    Slot& s = *pt.s;
    tokens += pt.n ? int(pt.n) : 1;
    if (pt.n == 0) {
      s.feed[0] = -1;
      s.has_logits = true;
      continue;
    }
    s.prefilled += pt.n;
    prompt_tokens_ += int64_t(pt.n);
    if (s.prefilled == s.req->params.prompt.size()) s.has_logits = true;
    if (s.prefilled == s.checkpoint) {
      std::lock_guard lk(engine_mutex_);
      cache_->insert(std::span<const int32_t>(s.req->params.prompt).first(s.prefilled), s.st);
    }
  }
  std::lock_guard lk(metrics_mutex_);
  step_seqs_.observe(double(ok.size()));
  step_tokens_.observe(double(tokens));
}

void Scheduler::loop() {
  for (;;) {
    {
      std::unique_lock lk(q_mutex_);
      q_cv_.wait(lk, [&] { return stop_ || busy_ > 0 || !queue_.empty(); });
      if (stop_) break;
      for (auto& s : slots_) {
        if (s->req || queue_.empty()) continue;
        std::shared_ptr<Request> r = std::move(queue_.front());
        queue_.pop_front();
        if (r->cancelled()) {
          ++cancelled_;
          r->finish("cancelled");
          continue;
        }
        ++busy_;
        lk.unlock();
        start(*s, std::move(r));
        lk.lock();
      }
    }
    const size_t n = slots_.size();
    if (opts_.batching) {
      // Every busy slot in one forward; the rotation decides who waits when the budget is short.
      std::vector<Slot*> all;
      for (size_t k = 0; k < n; ++k) all.push_back(slots_[(rr_ + k) % n].get());
      step(all, opts_.batch_tokens);
    } else {
      // One forward per busy slot, starting after the one that went first last time.
      for (size_t k = 0; k < n; ++k) step({slots_[(rr_ + k) % n].get()}, opts_.batch_tokens);
    }
    rr_ = (rr_ + 1) % n;
  }
  for (auto& s : slots_)
    if (s->req) release(*s, "cancelled");
}

}  // namespace strata::server
