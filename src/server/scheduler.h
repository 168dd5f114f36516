#pragma once
// Request scheduling for `strata serve`. The Engine is not thread-safe: one scheduler thread
// owns it (under a mutex, which /metrics also takes for a moment) and interleaves the active
// requests token by token: round robin over the slots, one prompt chunk or one decode step
// each. --parallel N slots each hold a model::SequenceState; requests beyond N wait in a
// bounded queue, and a full queue turns new requests away (the server answers 503).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/sampler.h"

namespace strata::server {

/// What to generate.
struct GenParams {
  std::vector<int32_t> prompt;
  engine::SamplerParams sampler;
  int max_tokens = 0;               ///< at most this many tokens (the context may stop it sooner)
  std::vector<std::string> stop;    ///< stop strings: the text ends before the first match
  int top_logprobs = -1;            ///< < 0: no logprobs; else the chosen token's and this many alternatives
  std::vector<int32_t> end_tokens;  ///< tokens that end generation (EOS, end of turn); not output
};

/// Log-probability of a sampled token and the most likely alternatives (by the model's
/// distribution, before sampling filters).
struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};

/// One step of output: newly released text (complete UTF-8; stop-string prefixes are held back
/// until they are ruled out) and, when a token was generated, that token.
struct Event {
  std::string text;
  std::optional<TokenLogprob> token;
};

/// A request shared by the HTTP handler that waits on it and the scheduler that runs it.
class Request {
 public:
  explicit Request(GenParams p) : params(std::move(p)) {}
  const GenParams params;

  // ---- handler side
  /// Moves pending events into `out` (appending); waits up to `timeout` when there are none.
  /// Returns true once the request has finished and every event has been taken.
  bool wait(std::vector<Event>& out, std::chrono::milliseconds timeout);
  /// Asks the scheduler to stop this request (client gone); its slot is freed at the next step.
  void cancel() { cancelled_ = true; }
  bool cancelled() const { return cancelled_; }

  // ---- results, valid once wait() returned true
  std::string finish_reason;  ///< "stop", "length", "cancelled" or "error"
  std::string error;          ///< message when finish_reason == "error"
  int prompt_tokens = 0, completion_tokens = 0;

  // ---- scheduler side
  void push(Event e);
  void finish(std::string reason, std::string error_message = {});

 private:
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<Event> events_;
  bool done_ = false;
  std::atomic<bool> cancelled_{false};
};

/// Counters of the scheduler, for /metrics and /health.
struct SchedulerCounters {
  int64_t slots = 0, slots_busy = 0, queued = 0, queue_capacity = 0;
  int64_t admitted = 0, rejected = 0, cancelled = 0, completed = 0, failed = 0;
  int64_t prompt_tokens = 0, generated_tokens = 0;
  engine::PhaseStats prefill, decode;  ///< the engine's, since start
};

class Scheduler {
 public:
  /// Starts the scheduler thread with `n_slots` sequences (each of eng.n_ctx() tokens,
  /// allocated now and reused) and room for `queue_size` waiting requests.
  Scheduler(engine::Engine& eng, int n_slots, int queue_size);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  /// Queues `r`; false when every slot is busy and the queue is full (nothing queued).
  bool submit(const std::shared_ptr<Request>& r);
  /// Stops the thread; requests still running or queued finish as "cancelled".
  void stop();
  SchedulerCounters counters();

 private:
  struct Slot;
  void loop();
  void step(Slot& s);
  void start(Slot& s, std::shared_ptr<Request> r);
  void release(Slot& s, const std::string& reason, const std::string& error = {});
  // Emits text released so far (holding back possible stop-string prefixes); true if a stop matched.
  bool emit(Slot& s, std::string piece, std::optional<TokenLogprob> tok, bool final);

  // Copies the engine's phase stats for counters() (call with engine_mutex_ held), so that
  // /metrics never waits for a long prefill chunk.
  void snapshot_stats();

  engine::Engine& eng_;
  std::mutex engine_mutex_;  // the engine: taken by the scheduler thread for each step
  std::mutex stats_mutex_;
  engine::PhaseStats prefill_stats_, decode_stats_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::mutex q_mutex_;
  std::condition_variable q_cv_;
  std::deque<std::shared_ptr<Request>> queue_;
  size_t queue_size_;
  int64_t busy_ = 0;
  bool stop_ = false;
  std::atomic<int64_t> admitted_{0}, rejected_{0}, cancelled_{0}, completed_{0}, failed_{0}, prompt_tokens_{0},
      generated_tokens_{0};
  std::thread thread_;
};

/// The log-softmax of `logits` at `id`, and the `n` most likely tokens with theirs.
TokenLogprob token_logprob(std::span<const float> logits, int32_t id, int n);

/// Length of the longest suffix of `text` that is a proper prefix of one of `stops`.
size_t partial_stop_suffix(std::string_view text, const std::vector<std::string>& stops);

}  // namespace strata::server
