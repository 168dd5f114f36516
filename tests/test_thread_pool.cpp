// cpu::ThreadPool: every index runs exactly once per loop, on any number of threads, through
// loops back to back (the spin hand-over), loops after the workers fell asleep (the sleep
// hand-over), exceptions, and destruction with spinning or sleeping workers.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <thread>
#include <vector>

#include "backend/cpu/thread_pool.h"

namespace {

using strata::cpu::ThreadPool;

// Runs `loops` parallel_for calls of n indices; each index is counted once per loop.
void expect_each_index_once(ThreadPool& pool, int loops, int64_t n, int64_t grain, int sleep_every = 0) {
  std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
  for (int l = 0; l < loops; ++l) {
    pool.parallel_for(n, grain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)].fetch_add(1, std::memory_order_relaxed);
    });
    // past the spin (100 us): the workers are asleep for the next loop
    if (sleep_every && l % sleep_every == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), loops) << "index " << i;
}

TEST(ThreadPool, EveryIndexOncePerLoop) {
  for (int threads : {1, 2, 3, 8}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    ThreadPool pool(threads);
    expect_each_index_once(pool, 2000, 37, 1);       // short loops back to back: the spin hand-over
    expect_each_index_once(pool, 40, 1000, 7, 1);    // every loop after a sleep
    expect_each_index_once(pool, 200, 5000, 64, 9);  // both
    expect_each_index_once(pool, 10, 3, 16);         // n <= grain: the caller alone
  }
}

TEST(ThreadPool, ExceptionReachesTheCallerAndThePoolGoesOn) {
  ThreadPool pool(4);
  for (int l = 0; l < 50; ++l) {
    EXPECT_THROW(pool.parallel_for(1000, 1,
                                   [&](int64_t b, int64_t) {
                                     if (b == 500) throw std::runtime_error("block 500");
                                   }),
                 std::runtime_error);
    expect_each_index_once(pool, 3, 100, 3);
  }
}

TEST(ThreadPool, DestroyedWhileWorkersSpinOrSleep) {
  for (int i = 0; i < 50; ++i) {
    ThreadPool pool(3);
    expect_each_index_once(pool, 2, 64, 1);
    if (i % 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // asleep, else spinning
  }
}

}  // namespace
