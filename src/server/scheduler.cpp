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

struct Scheduler::Slot {
  std::shared_ptr<Request> req;
  model::SequenceState st;
  std::optional<engine::Sampler> sampler;
  std::optional<tokenizer::StreamDecoder> dec;
  std::vector<float> logits;
  std::vector<int32_t> history;
  size_t prefilled = 0;
  int generated = 0;
  std::string pending;  // decoded text not yet released (a possible stop-string prefix)
};

Scheduler::Scheduler(engine::Engine& eng, int n_slots, int queue_size)
    : eng_(eng), queue_size_(size_t(std::max(0, queue_size))) {
  if (n_slots < 1) throw std::invalid_argument("--parallel must be at least 1");
  for (int k = 0; k < n_slots; ++k) {
    auto s = std::make_unique<Slot>();
    s->st = eng_.new_sequence();
    slots_.push_back(std::move(s));
  }
  snapshot_stats();
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() { stop(); }

void Scheduler::stop() {
  {
    std::lock_guard lk(q_mutex_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  q_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard lk(q_mutex_);
  for (auto& r : queue_) r->finish("cancelled");
  queue_.clear();
}

bool Scheduler::submit(const std::shared_ptr<Request>& r) {
  {
    std::lock_guard lk(q_mutex_);
    const size_t free_slots = slots_.size() - size_t(busy_);
    if (stop_ || queue_.size() >= queue_size_ + free_slots) {
      ++rejected_;
      return false;
    }
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
  c.prompt_tokens = prompt_tokens_;
  c.generated_tokens = generated_tokens_;
  std::lock_guard lk(stats_mutex_);
  c.prefill = prefill_stats_;
  c.decode = decode_stats_;
  return c;
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
  s.prefilled = 0;
  s.generated = 0;
  s.pending.clear();
  s.req->prompt_tokens = int(s.req->params.prompt.size());
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
  {
    std::lock_guard lk(q_mutex_);  // before finish(): whoever waits on the request sees the slot free
    --busy_;
  }
  s.req->finish(reason, error);
  s.req.reset();
  s.sampler.reset();
  s.dec.reset();
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

void Scheduler::step(Slot& s) {
  Request& r = *s.req;
  if (r.cancelled()) return release(s, "cancelled");
  const GenParams& p = r.params;
  try {
    if (s.prefilled < p.prompt.size()) {
      const size_t n = std::min(p.prompt.size() - s.prefilled, size_t(std::max(1, eng_.options().prompt_chunk)));
      const bool last = s.prefilled + n == p.prompt.size();
      std::lock_guard lk(engine_mutex_);
      eng_.prefill(s.st, std::span<const int32_t>(p.prompt).subspan(s.prefilled, n),
                   last ? model::LogitsMode::Last : model::LogitsMode::None, s.logits);
      snapshot_stats();
      s.prefilled += n;
      prompt_tokens_ += int64_t(n);
      return;
    }
    const int32_t id = s.sampler->sample(s.logits, s.history);
    s.history.push_back(id);
    if (std::find(p.end_tokens.begin(), p.end_tokens.end(), id) != p.end_tokens.end()) {
      emit(s, s.dec->flush(), std::nullopt, true);
      return release(s, "stop");
    }
    ++s.generated;
    ++generated_tokens_;
    std::optional<TokenLogprob> lp;
    if (p.top_logprobs >= 0) lp = token_logprob(s.logits, id, p.top_logprobs);
    if (emit(s, s.dec->push(id), std::move(lp), false)) return release(s, "stop");
    if (s.generated >= p.max_tokens || s.st.n_past >= s.st.n_ctx) {
      if (emit(s, s.dec->flush(), std::nullopt, true)) return release(s, "stop");
      return release(s, "length");
    }
    std::lock_guard lk(engine_mutex_);
    eng_.decode(s.st, id, s.logits);
    snapshot_stats();
  } catch (const std::exception& e) {
    release(s, "error", e.what());
  }
}

void Scheduler::loop() {
  size_t next = 0;
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
    // One step for each busy slot, starting after the one that went first last time.
    for (size_t k = 0; k < slots_.size(); ++k) {
      Slot& s = *slots_[(next + k) % slots_.size()];
      if (s.req) step(s);
    }
    next = (next + 1) % slots_.size();
  }
  for (auto& s : slots_)
    if (s->req) release(*s, "cancelled");
}

}  // namespace strata::server
