// ExpertStream over arena memory from a factory: a staged arena (per-IO-thread staging,
// memcpy in land(), as a GPU backend's pinned staging and copy would) gives the same bytes and
// counters as the host arena, and a slot whose last-use event is pending is not overwritten
// until the event completes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "backend/cpu/host_arena.h"
#include "stream/expert_stream.h"

namespace fs = std::filesystem;
using namespace strata;
using stream::ExpertStream;
using stream::LayerExperts;

namespace {

/// Reads land in per-thread host staging; land() copies them into separate "slot" memory.
class StagedArena : public backend::ArenaMemory {
 public:
  StagedArena(size_t n_slots, size_t slot_bytes, int io_threads, backend::Place place)
      : n_(n_slots), bytes_(slot_bytes), place_(place), slots_(n_slots * slot_bytes, 0xEE) {
    for (int i = 0; i < io_threads; ++i)
      staging_.emplace_back(static_cast<uint8_t*>(std::aligned_alloc(4096, slot_bytes)), &std::free);
  }
  size_t n_slots() const override { return n_; }
  size_t slot_bytes() const override { return bytes_; }
  uint8_t* read_target(size_t slot, int io_thread) override {
    EXPECT_LT(slot, n_);
    return staging_.at(static_cast<size_t>(io_thread)).get();
  }
  void land(size_t slot, int io_thread, size_t bytes, size_t offset) override {
    EXPECT_EQ(offset % 4096, 0u);
    EXPECT_LE(offset + bytes, bytes_);
    std::memcpy(slots_.data() + slot * bytes_ + offset, staging_.at(static_cast<size_t>(io_thread)).get() + offset,
                bytes);
    ++lands;
  }
  const uint8_t* slot_data(size_t slot) const override { return slots_.data() + slot * bytes_; }
  backend::Place place() const override { return place_; }

  std::atomic<int> lands{0};

 private:
  size_t n_, bytes_;
  backend::Place place_;
  std::vector<uint8_t> slots_;
  std::vector<std::unique_ptr<uint8_t, decltype(&std::free)>> staging_;
};

/// An event another thread completes.
class GateEvent : public backend::Event {
 public:
  void wait() override {
    std::unique_lock lk(mu_);
    ++waiters;
    cv_.wait(lk, [&] { return done_; });
  }
  bool done() override {
    std::lock_guard lk(mu_);
    return done_;
  }
  void complete() {
    {
      std::lock_guard lk(mu_);
      done_ = true;
    }
    cv_.notify_all();
  }
  std::atomic<int> waiters{0};

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
};

/// A file of random bytes whose layers hold n_expert experts of three parts each, the parts
/// large enough to be read in several 256 KiB pieces.
struct ExpertFile {
  fs::path path;
  std::vector<uint8_t> bytes;
  std::vector<LayerExperts> layers;

  ExpertFile(const std::string& name, int n_layers, int n_expert, uint64_t part_bytes) {
    path = fs::temp_directory_path() / ("strata-test-arena-" + std::to_string(::getpid()) + "-" + name + ".bin");
    std::mt19937 rng(7);
    uint64_t pos = 777;
    for (int l = 0; l < n_layers; ++l) {
      LayerExperts L;
      L.n_expert = n_expert;
      for (auto& part : L.part) {
        part.base_offset = pos;
        part.expert_bytes = part_bytes + rng() % 5000;
        pos += uint64_t(n_expert) * part.expert_bytes + 91;
      }
      layers.push_back(L);
    }
    bytes.resize(pos);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  }
  ~ExpertFile() { fs::remove(path); }

  bool view_matches(const stream::ExpertView& v, int l, int e) const {
    for (int p = 0; p < 3; ++p) {
      const auto& part = layers[size_t(l)].part[p];
      if (std::memcmp(v.part[p], bytes.data() + part.offset(e), part.expert_bytes) != 0) return false;
    }
    return true;
  }
};

stream::StreamOptions options(const ExpertFile& f, size_t slots, int threads) {
  stream::StreamOptions o;
  o.arena_bytes = slots * ExpertStream::slot_bytes_for(f.layers);
  o.io_threads = threads;
  return o;
}

// One fixed sequence of layers: predict the next layer, request, check every view, release.
stream::StreamStats run_sequence(ExpertStream& s, const ExpertFile& f) {
  std::mt19937 rng(3);
  const int n_layers = static_cast<int>(f.layers.size());
  const int n_expert = f.layers[0].n_expert;
  for (int step = 0; step < 3 * n_layers; ++step) {
    const int l = step % n_layers;
    std::vector<int32_t> ids(static_cast<size_t>(n_expert));
    for (int e = 0; e < n_expert; ++e) ids[size_t(e)] = e;
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(3);
    s.request(l, ids);
    std::vector<int32_t> next = {int32_t(rng() % n_expert), int32_t(rng() % n_expert)};
    if (next[0] == next[1]) next.pop_back();
    s.prefetch((l + 1) % n_layers, next);
    for (const int32_t e : ids) EXPECT_TRUE(f.view_matches(s.wait(l, e), l, e)) << "layer " << l << " expert " << e;
    s.wait_idle();  // deterministic counters with one IO thread
    s.release(l);
  }
  return s.stats();
}

}  // namespace

TEST(StreamArena, StagedArenaGivesTheHostArenasBytesAndCounters) {
  ExpertFile f("same", 3, 6, 300000);
  for (const auto place : {backend::Place::Host, backend::Place::Device}) {
    StagedArena* staged = nullptr;
    ExpertStream a(f.path.string(), f.layers, options(f, 5, 1));
    ExpertStream b(f.path.string(), f.layers, options(f, 5, 1), [&](size_t n, size_t bytes, int threads) {
      auto arena = std::make_unique<StagedArena>(n, bytes, threads, place);
      staged = arena.get();
      return arena;
    });
    ASSERT_NE(staged, nullptr);
    const auto sa = run_sequence(a, f), sb = run_sequence(b, f);
    EXPECT_EQ(sa.needed, sb.needed);
    EXPECT_EQ(sa.hits, sb.hits);
    EXPECT_EQ(sa.misses, sb.misses);
    EXPECT_EQ(sa.streamed_ahead, sb.streamed_ahead);
    EXPECT_EQ(sa.wasted, sb.wasted);
    EXPECT_EQ(sa.dropped, sb.dropped);
    EXPECT_EQ(sa.reads, sb.reads);
    EXPECT_EQ(sa.bytes_read, sb.bytes_read);
    EXPECT_GT(sb.misses, 0u);
    EXPECT_GT(staged->lands.load(), static_cast<int>(sb.reads));  // several pieces per expert
  }
}

TEST(StreamArena, StagedArenaUnderManyThreads) {
  ExpertFile f("threads", 4, 8, 200000);
  ExpertStream s(f.path.string(), f.layers, options(f, 6, 4), [](size_t n, size_t bytes, int threads) {
    EXPECT_EQ(threads, 4);
    return std::make_unique<StagedArena>(n, bytes, threads, backend::Place::Device);
  });
  std::mt19937 rng(11);
  for (int step = 0; step < 40; ++step) {
    const int l = step % 4;
    std::vector<int32_t> ids = {int32_t(rng() % 8)};
    while (ids.size() < 3) {
      const int32_t e = int32_t(rng() % 8);
      if (std::find(ids.begin(), ids.end(), e) == ids.end()) ids.push_back(e);
    }
    s.request(l, ids);
    s.prefetch((l + 1) % 4, std::vector<int32_t>{int32_t(rng() % 8), int32_t(rng() % 8)});
    for (const int32_t e : ids) ASSERT_TRUE(f.view_matches(s.wait(l, e), l, e)) << "step " << step;
    s.release(l);
  }
  const auto st = s.stats();
  EXPECT_EQ(st.needed, 120u);
  EXPECT_EQ(st.hits + st.misses, st.needed);
}

TEST(StreamArena, SlotIsNotOverwrittenBeforeItsLastUseEventIsDone) {
  ExpertFile f("event", 2, 4, 100000);
  for (const auto place : {backend::Place::Host, backend::Place::Device}) {
    ExpertStream s(f.path.string(), f.layers, options(f, 2, 2), [&](size_t n, size_t bytes, int threads) {
      return std::make_unique<StagedArena>(n, bytes, threads, place);
    });
    ASSERT_EQ(s.n_slots(), 2u);
    const std::vector<int32_t> ids = {0, 1};
    s.request(0, ids);
    const stream::ExpertView v0 = s.wait(0, 0), v1 = s.wait(0, 1);
    auto ev = std::make_shared<GateEvent>();
    s.release(0, ev);  // "kernels" may still read both slots until ev completes

    s.request(1, std::vector<int32_t>{2});  // every slot's event is pending: one is taken anyway
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_FALSE(s.resident(1, 2));
    // neither slot was overwritten while the event is pending
    EXPECT_TRUE(f.view_matches(v0, 0, 0));
    EXPECT_TRUE(f.view_matches(v1, 0, 1));
    ev->complete();
    EXPECT_TRUE(f.view_matches(s.wait(1, 2), 1, 2));
    EXPECT_GT(ev->waiters, 0);
    s.release(1);
    // done events are reusable at once
    s.request(1, std::vector<int32_t>{3});
    EXPECT_TRUE(f.view_matches(s.wait(1, 3), 1, 3));
    s.release(1);
  }
}

TEST(StreamArena, ReleaseWithoutEventReusesAtOnce) {
  ExpertFile f("noevent", 2, 4, 50000);
  ExpertStream s(f.path.string(), f.layers, options(f, 2, 1));
  for (int l = 0; l < 2; ++l)
    for (int32_t e = 0; e < 4; ++e) {
      s.request(l, std::vector<int32_t>{e});
      EXPECT_TRUE(f.view_matches(s.wait(l, e), l, e));
      s.release(l, nullptr);
    }
  EXPECT_EQ(s.stats().misses, 8u);
}

TEST(StreamArena, FactoryErrorsAreReported) {
  ExpertFile f("errors", 1, 4, 50000);
  auto opts = options(f, 3, 1);
  EXPECT_THROW(ExpertStream(f.path.string(), f.layers, opts,
                            [](size_t, size_t, int) { return std::unique_ptr<backend::ArenaMemory>(); }),
               std::invalid_argument);
  EXPECT_THROW(ExpertStream(f.path.string(), f.layers, opts,
                            [](size_t n, size_t bytes, int) { return std::make_unique<cpu::HostArena>(n - 1, bytes); }),
               std::invalid_argument);
  EXPECT_THROW(ExpertStream(f.path.string(), f.layers, opts,
                            [](size_t, size_t, int) -> std::unique_ptr<backend::ArenaMemory> {
                              throw std::runtime_error("no memory");
                            }),
               std::runtime_error);
  EXPECT_THROW(cpu::HostArena(2, 1000), std::invalid_argument);
  cpu::HostArena h(3, 8192);
  EXPECT_EQ(h.read_target(2, 0), h.slot_data(2));
  EXPECT_EQ(h.slot_data(1) - h.slot_data(0), 8192);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(h.slot_data(0)) % 4096, 0u);
}
