#pragma once
// A fixed pool of worker threads for data-parallel loops in the forward pass.
//
// parallel_for hands out index blocks from an atomic counter, so which thread computes
// which block varies run to run; callers must make each index's result independent of
// the thread that computes it (the kernels do: threads split rows, never a reduction).
//
// Between loops the threads spin for a while before they sleep (workers waiting for the next
// loop, the caller waiting for the workers): decode runs ~10 short loops a layer, and a
// condition-variable wake-up costs tens of microseconds on a VM (a futex system call and a
// reschedule each way), which was ~10 % of a decode token. The spin is bounded
// (STRATA_POOL_SPIN_US, default 100 microseconds, at most 100000; 0 sleeps at once) so that idle
// workers give the cores back to the IO threads; with more threads than the hardware runs at
// once nothing spins.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "backend/backend.h"

namespace strata::cpu {

class ThreadPool {
 public:
  /// Starts n_threads - 1 workers; the calling thread is the n-th. n_threads >= 1.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int n_threads() const { return n_threads_; }

  /// Calls fn(begin, end) over [0, n) in blocks of `grain` indices, on all threads, and
  /// returns when every block is done. Not reentrant (do not call from inside fn).
  /// An exception thrown by fn is rethrown here after all threads stop.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  /// Turns the loop accounting of loop_profile() on or off (off at construction: then a loop
  /// reads no clock). Not to be called while a loop runs.
  void set_profiling(bool on) { profiling_ = on; }
  /// The loops' totals since profiling was turned on (backend::LoopProfile): the caller's wall
  /// time in loops, the blocks' summed CPU time (each block timed by its thread's CPU clock, so a
  /// pool of more threads than cores still measures each block's own work), and each loop's
  /// projected time on n_threads() free cores, max(work / n_threads(), its longest block). A call
  /// with one block runs on one thread at any thread count, so its projection is its own time.
  const backend::LoopProfile& loop_profile() const { return profile_; }

 private:
  void worker_loop();
  void run_blocks();
  /// Adds one loop that began at t0 (the caller's clock) to profile_.
  void add_loop(std::chrono::steady_clock::time_point t0, int64_t work_ns, int64_t longest_ns);
  /// Spins up to spin_us_ for pred() (with a pause between tries); true if it came true.
  template <class Pred>
  bool spin_until(Pred pred) const;

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_start_, cv_done_;
  std::atomic<uint64_t> generation_{0};  // bumped (under mu_) after the loop's fields are set
  std::atomic<int> active_{0};           // workers still in the current loop
  bool stop_ = false;
  int64_t spin_us_ = 0;  // set by the constructor
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, grain_ = 1;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
  bool profiling_ = false;
  backend::LoopProfile profile_;
  std::atomic<int64_t> work_ns_{0}, longest_ns_{0};  // the current loop's blocks, when profiling
};

}  // namespace strata::cpu
