#include "backend/cpu/thread_pool.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace strata::cpu {

namespace {
constexpr int64_t kDefaultSpinUs = 100, kMaxSpinUs = 100000;

// STRATA_POOL_SPIN_US: microseconds a thread spins before it sleeps (read once; default 100,
// at most 100000). A value that is not such a number is reported once on stderr and the default
// used.
int64_t spin_us_from_env() {
  static const int64_t us = [] {
    const char* e = std::getenv("STRATA_POOL_SPIN_US");
    if (!e || !*e) return kDefaultSpinUs;
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(e, &end, 10);
    if (end == e || *end != 0 || errno == ERANGE || v < 0 || v > kMaxSpinUs) {
      std::fprintf(stderr,
                   "strata: warning: STRATA_POOL_SPIN_US='%s' is not a number of microseconds in [0, %lld]; "
                   "using %lld\n",
                   e, static_cast<long long>(kMaxSpinUs), static_cast<long long>(kDefaultSpinUs));
      return kDefaultSpinUs;
    }
    return int64_t(v);
  }();
  return us;
}

// CPU time of the calling thread (ns): a block's work, without the time it waited for a core
// (a pool of more threads than cores) or slept inside the block.
int64_t thread_cpu_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// fn(b, e), and the CPU time it took this thread (ns).
int64_t timed_block(const std::function<void(int64_t, int64_t)>& fn, int64_t b, int64_t e) {
  const int64_t t0 = thread_cpu_ns();
  fn(b, e);
  return thread_cpu_ns() - t0;
}

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}
}  // namespace

template <class Pred>
bool ThreadPool::spin_until(Pred pred) const {
  if (spin_us_ <= 0) return pred();
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (pred()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= end) return pred();
  }
}

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)), spin_us_(spin_us_from_env()) {
  // More threads than the machine runs at once: a spinning thread would hold a core that a
  // working one needs (-t above the core count), so they sleep at once.
  const unsigned hw = std::thread::hardware_concurrency();
  if (hw > 0 && unsigned(n_threads_) > hw) spin_us_ = 0;
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_blocks() {
  for (;;) {
    int64_t b = next_.fetch_add(grain_, std::memory_order_relaxed);
    if (b >= n_) break;
    int64_t e = std::min(n_, b + grain_);
    try {
      if (profiling_) {
        const int64_t ns = timed_block(*fn_, b, e);
        work_ns_.fetch_add(ns, std::memory_order_relaxed);
        int64_t m = longest_ns_.load(std::memory_order_relaxed);
        while (ns > m && !longest_ns_.compare_exchange_weak(m, ns, std::memory_order_relaxed)) {}
      } else {
        (*fn_)(b, e);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!error_) error_ = std::current_exception();
      next_.store(n_, std::memory_order_relaxed);  // stop handing out work
    }
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    // The next loop, first by spinning (its fields are written before the release of
    // generation_, so the acquire load sees them), then asleep.
    if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_start_.wait(lk, [&] { return stop_ || generation_.load(std::memory_order_relaxed) != seen; });
      if (stop_) return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);  // stop_ and the loop's fields, consistent
      if (stop_) return;
      seen = generation_.load(std::memory_order_relaxed);
    }
    run_blocks();
    if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(mu_);  // the caller may be asleep in cv_done_
      cv_done_.notify_one();
    }
  }
}

void ThreadPool::add_loop(std::chrono::steady_clock::time_point t0, int64_t work_ns, int64_t longest_ns) {
  const double work = double(work_ns) * 1e-9;
  profile_.loop_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  profile_.work_s += work;
  profile_.projected_s += std::max(work / n_threads_, double(longest_ns) * 1e-9);
  ++profile_.loops;
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (workers_.empty() || n <= grain) {
    if (!profiling_) {
      fn(0, n);
      return;
    }
    // On a one-thread pool the blocks it would hand out are timed one by one (without
    // profiling they run as one call), so the projection sees the loop's grain.
    const auto t0 = std::chrono::steady_clock::now();
    int64_t work = 0, longest = 0;
    for (int64_t b = 0; b < n; b += grain) {
      const int64_t ns = timed_block(fn, b, std::min(n, b + grain));
      work += ns;
      longest = std::max(longest, ns);
    }
    add_loop(t0, work, longest);
    return;
  }
  const auto t_loop = profiling_ ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  if (profiling_) {
    work_ns_.store(0, std::memory_order_relaxed);
    longest_ns_.store(0, std::memory_order_relaxed);
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = &fn;
    n_ = n;
    grain_ = grain;
    next_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    active_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_start_.notify_all();
  run_blocks();
  spin_until([&] { return active_.load(std::memory_order_acquire) == 0; });
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, [&] { return active_.load(std::memory_order_acquire) == 0; });
    fn_ = nullptr;
    err = error_;
  }
  if (profiling_)
    add_loop(t_loop, work_ns_.load(std::memory_order_relaxed), longest_ns_.load(std::memory_order_relaxed));
  if (err) std::rethrow_exception(err);
}

}  // namespace strata::cpu
