#pragma once
// Request scheduling for `strata serve`. The Engine is not thread-safe: one scheduler thread
// owns it. --parallel N slots each hold a model::SequenceState; requests beyond N wait in a
// bounded queue, and a full queue turns new requests away (the server answers 503).
//
// Continuous batching (the default): every step is one Engine::forward_batch over all busy
// slots, the next token of each generating request plus prompt chunks of new ones, at most
// --batch-tokens tokens in all (decode tokens first, then prompt chunks first come first
// served). The batch shares each layer's expert reads, and each sequence's results are
// bit-identical to running it alone (batch invariance; tests/test_server.cpp).
// --no-cont-batching keeps the former interleaving (round robin, one forward per slot per turn:
// one prompt chunk or one decode step), for comparison.
//
// The prefix cache (prefix_cache.h) restores a request's longest cached prompt prefix into its
// slot before prefill, and stores each finished request's state.
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
#include "server/prefix_cache.h"

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
  /// When Scheduler::submit accepted it (queue time, time to first token and the request
  /// timeout count from here).
  std::chrono::steady_clock::time_point submitted;

  // ---- handler side
  /// Moves pending events into `out` (appending); waits up to `timeout` when there are none.
  /// Returns true once the request has finished and every event has been taken.
  bool wait(std::vector<Event>& out, std::chrono::milliseconds timeout);
  /// Asks the scheduler to stop this request (client gone); its slot is freed at the next step.
  void cancel() { cancelled_ = true; }
  bool cancelled() const { return cancelled_; }

  // ---- results, valid once wait() returned true
  std::string finish_reason;  ///< "stop", "length" (also after the request timeout), "cancelled" or "error"
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
  int64_t admitted = 0, rejected = 0, cancelled = 0, completed = 0, failed = 0, timed_out = 0;
  int64_t prompt_tokens = 0, generated_tokens = 0;
  int64_t steps = 0;                   ///< forward calls the scheduler made
  engine::PhaseStats prefill, decode;  ///< the engine's, since start
  PrefixCacheStats cache;
};

/// A Prometheus histogram: cumulative buckets with upper bounds `bounds` (ascending) and +Inf,
/// the sum and the count of observations. Not thread-safe (the scheduler guards its own).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1) {}
  void observe(double v);
  /// Appends the `# HELP`/`# TYPE` lines and `name_bucket{le=...}`, `name_sum`, `name_count`
  /// (with `labels`, e.g. `slot="0"`, inside the braces when not empty).
  void write(std::string& out, const std::string& name, const std::string& help, const std::string& labels = {},
             bool header = true) const;
  int64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  // per bucket, not cumulative; the last is +Inf
  double sum_ = 0;
  int64_t count_ = 0;
};

/// How the scheduler runs (`strata serve` flags).
struct SchedulerOptions {
  int n_slots = 4;       ///< --parallel: slots (sequences of the engine's n_ctx tokens each)
  int queue_size = 64;   ///< --queue-size: requests waiting for a slot
  int batch_tokens = 0;  ///< --batch-tokens: most tokens per forward step; 0 = the engine's prompt chunk
  bool batching = true;  ///< false (--no-cont-batching): the former round-robin interleaving
  uint64_t cache_bytes = uint64_t(1024) << 20;  ///< --cache-ram (MiB): prefix cache bound; 0 = no cache
  int cache_min_tokens = 32;                    ///< shortest prefix the cache stores (tokens)
  double request_timeout_s =
      600;  ///< --request-timeout: a request ends ("length") this long after submission; 0 = never
};

class Scheduler {
 public:
  /// Starts the scheduler thread with opts.n_slots sequences (each of eng.n_ctx() tokens,
  /// allocated now and reused) and room for opts.queue_size waiting requests. Throws
  /// std::invalid_argument for n_slots < 1 or batch_tokens outside [0, prompt chunk] (the arena
  /// is sized for one prompt chunk: a larger batch could need more experts than it holds).
  Scheduler(engine::Engine& eng, const SchedulerOptions& opts);
  /// The defaults with `n_slots` and `queue_size`.
  Scheduler(engine::Engine& eng, int n_slots, int queue_size);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  /// Queues `r`; false when every slot is busy and the queue is full (nothing queued).
  bool submit(const std::shared_ptr<Request>& r);
  /// Stops the thread; requests still running or queued finish as "cancelled".
  void stop();
  /// Graceful shutdown: refuses new requests, lets running and queued ones finish for up to
  /// `grace` and then stops (the rest finish as "cancelled"). Returns the requests cancelled.
  int64_t drain(std::chrono::milliseconds grace);
  /// True once drain() or stop() began: new requests are refused, and those cancelled from now
  /// on were cancelled by the shutdown (the server answers them 503 "shutting down").
  bool stopping();
  SchedulerCounters counters();
  /// Appends the scheduler's histograms (queue time, time to first token, decode tokens/s per
  /// request, sequences and tokens per step), per-slot counters and prefix-cache counters in
  /// Prometheus text format.
  void write_metrics(std::string& out);
  const SchedulerOptions& options() const { return opts_; }

 private:
  struct Slot;
  void loop();
  // One forward over `cand` (busy slots): samples the slots whose logits are ready, then runs
  // their next tokens and prompt chunks within the token budget.
  void step(const std::vector<Slot*>& cand, int budget);
  // Samples s's next token from its logits; false when the request ended (slot released).
  bool sample(Slot& s);
  void start(Slot& s, std::shared_ptr<Request> r);
  void release(Slot& s, const std::string& reason, const std::string& error = {});
  // Emits text released so far (holding back possible stop-string prefixes); true if a stop matched.
  bool emit(Slot& s, std::string piece, std::optional<TokenLogprob> tok, bool final);

  // Copies the engine's phase stats for counters() (call with engine_mutex_ held), so that
  // /metrics never waits for a long prefill chunk.
  void snapshot_stats();

  SchedulerOptions opts_;
  engine::Engine& eng_;
  std::unique_ptr<PrefixCache> cache_;
  std::mutex metrics_mutex_;  // the histograms and per-slot counters
  Histogram queue_s_, ttft_s_, decode_tps_, step_seqs_, step_tokens_;
  uint64_t order_ = 0;       // admission counter (prefill is first come first served)
  size_t rr_ = 0;            // round-robin start (interleaving; decode tokens beyond the budget)
  bool draining_ = false;    // under q_mutex_: submit refuses
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
  // Set by stop(): the forward in progress stops before its next layer (Engine::set_interrupt),
  // so a long prompt chunk does not hold up the shutdown.
  std::atomic<bool> interrupt_{false};
  std::atomic<int64_t> admitted_{0}, rejected_{0}, cancelled_{0}, completed_{0}, failed_{0}, timed_out_{0},
      prompt_tokens_{0}, generated_tokens_{0}, steps_{0};
  std::thread thread_;
};

/// The log-softmax of `logits` at `id`, and the `n` most likely tokens with theirs.
TokenLogprob token_logprob(std::span<const float> logits, int32_t id, int n);

/// Length of the longest suffix of `text` that is a proper prefix of one of `stops`.
size_t partial_stop_suffix(std::string_view text, const std::vector<std::string>& stops);

}  // namespace strata::server
