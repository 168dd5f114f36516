// ExpertStream: bytes of every view, slot geometry, LRU eviction, pinning, exact counters,
// read-ahead (streamed ahead, wasted, dropped), IO errors, O_DIRECT fallback, stress.
#include <gtest/gtest.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <vector>

#include "io/file.h"
#include "io/file_testing.h"
#include "stream/expert_stream.h"

namespace fs = std::filesystem;
using namespace strata::stream;
using strata::io::IoError;

namespace {

constexpr uint64_t kA = 4096;
uint64_t floor_a(uint64_t x) { return x / kA * kA; }
uint64_t ceil_a(uint64_t x) { return (x + kA - 1) / kA * kA; }

bool on_tmpfs(const fs::path& p) {
  struct statfs s {};
  return statfs(p.c_str(), &s) == 0 && static_cast<long>(s.f_type) == 0x01021994;
}

// A synthetic model file: per layer, three expert tensors (gate, up, down) of n_expert
// slices each, at odd offsets, with odd gaps; the file ends exactly at the last slice.
struct Synth {
  fs::path dir, path;
  std::vector<uint8_t> bytes;
  std::vector<LayerExperts> layers;

  /// part sizes: min_part + rng() % (spread + 1) bytes
  Synth(const fs::path& parent, const std::string& name, int n_layers, int n_expert, uint32_t seed,
        uint64_t min_part = 5000, uint32_t spread = 2000) {
    dir = parent / ("strata-test-stream-" + std::to_string(::getpid()) + "-" + name);
    fs::create_directories(dir);
    path = dir / "experts.bin";
    std::mt19937 rng(seed);
    uint64_t pos = 123;
    for (int l = 0; l < n_layers; ++l) {
      LayerExperts L;
      L.n_expert = n_expert;
      for (int p = 0; p < 3; ++p) {
        if (l + p > 0) pos += 37 + 2 * (rng() % 50);  // odd gap between tensors
        L.part[p].base_offset = pos;
        L.part[p].expert_bytes = min_part + rng() % (spread + 1);
        pos += static_cast<uint64_t>(n_expert) * L.part[p].expert_bytes;
      }
      layers.push_back(L);
    }
    bytes.resize(pos);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng() >> 7);
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    f.close();
    if (!f) throw std::runtime_error("cannot write " + path.string());
  }
  ~Synth() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }

  // Aligned bytes one read of (l, e) issues (direct: whole aligned ranges).
  uint64_t aligned_bytes(int l, int e) const {
    uint64_t n = 0;
    for (const auto& P : layers[static_cast<size_t>(l)].part) {
      const uint64_t off = P.base_offset + static_cast<uint64_t>(e) * P.expert_bytes;
      n += ceil_a(off + P.expert_bytes) - floor_a(off);
    }
    return n;
  }
  uint64_t max_slot() const {
    uint64_t m = 0;
    for (size_t l = 0; l < layers.size(); ++l)
      for (int e = 0; e < layers[l].n_expert; ++e) m = std::max(m, aligned_bytes(static_cast<int>(l), e));
    return m;
  }

  ::testing::AssertionResult view_ok(int l, int e, const ExpertView& v) const {
    for (int p = 0; p < 3; ++p) {
      const auto& P = layers[static_cast<size_t>(l)].part[p];
      const uint64_t off = P.base_offset + static_cast<uint64_t>(e) * P.expert_bytes;
      if (v.part[p] == nullptr) return ::testing::AssertionFailure() << "null part " << p;
      if (std::memcmp(v.part[p], bytes.data() + off, P.expert_bytes) != 0)
        return ::testing::AssertionFailure() << "layer " << l << " expert " << e << " part " << p << " differs";
    }
    return ::testing::AssertionSuccess();
  }
};

// Real disk under the build tree (ctest runs in build/tests), not /tmp.
const fs::path& disk_dir() {
  static const fs::path d = fs::current_path();
  return d;
}

StreamOptions opts_slots(const Synth& s, size_t slots, int threads = 1, bool direct = true) {
  StreamOptions o;
  o.arena_bytes = slots * s.max_slot() + 100;  // the remainder is not a whole slot
  o.io_threads = threads;
  o.direct = direct;
  return o;
}

std::vector<int32_t> v(std::initializer_list<int32_t> x) { return x; }

}  // namespace

class StreamTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { syn = new Synth(disk_dir(), "main", 3, 10, 42); }
  static void TearDownTestSuite() {
    delete syn;
    syn = nullptr;
  }
  static Synth* syn;
};
Synth* StreamTest::syn = nullptr;

TEST_F(StreamTest, EveryViewMatchesTheFile) {
  for (bool direct : {true, false}) {
    ExpertStream s(syn->path.string(), syn->layers, opts_slots(*syn, 30, 4, direct));
    if (direct && !on_tmpfs(disk_dir())) {
      EXPECT_TRUE(s.direct());
    }
    EXPECT_EQ(s.slot_bytes(), syn->max_slot());
    EXPECT_EQ(s.n_slots(), 30u);
    for (int l = 0; l < 3; ++l) {
      std::vector<int32_t> ids(10);
      std::iota(ids.begin(), ids.end(), 0);
      s.request(l, ids);
      for (int e = 0; e < 10; ++e) EXPECT_TRUE(syn->view_ok(l, e, s.wait(l, e))) << "direct " << direct;
      s.release(l);
    }
    // The last expert of the last layer ends exactly at the (unaligned) end of the file.
    EXPECT_NE(syn->bytes.size() % kA, 0u);
    const auto st = s.stats();
    EXPECT_EQ(st.needed, 30u);
    EXPECT_EQ(st.misses, 30u);
    EXPECT_EQ(st.reads, 30u);
    if (direct) {
      uint64_t bytes = 0;
      for (int l = 0; l < 3; ++l)
        for (int e = 0; e < 10; ++e) bytes += syn->aligned_bytes(l, e);
      EXPECT_EQ(st.bytes_read, bytes);
    }
    EXPECT_GT(st.read_busy_s, 0.0);
  }
}

// Experts of ~1-2 MB are read in 256 KiB pieces by several threads at once; a read-ahead in
// progress is promoted when its layer asks for it; clear() lets started reads finish.
TEST(Stream, LargeExpertsReadInPieces) {
  Synth big(disk_dir(), "big", 2, 6, 7, 300000, 400000);
  for (bool direct : {true, false}) {
    for (int threads : {1, 3, 8}) {
      ExpertStream s(big.path.string(), big.layers, opts_slots(big, 8, threads, direct));
      s.prefetch(1, v({0, 1, 2, 3, 4, 5}));
      s.request(0, v({0, 1, 2, 3, 4, 5}));
      for (int e = 0; e < 6; ++e) ASSERT_TRUE(big.view_ok(0, e, s.wait(0, e))) << direct << " " << threads;
      s.release(0);
      s.request(1, v({5, 4, 3}));
      for (int e = 3; e < 6; ++e) ASSERT_TRUE(big.view_ok(1, e, s.wait(1, e))) << direct << " " << threads;
      s.release(1);
      s.prefetch(0, v({0, 1}));
      s.clear();  // must not hang on reads cut in pieces
      s.request(1, v({0}));
      ASSERT_TRUE(big.view_ok(1, 0, s.wait(1, 0)));
      s.release(1);
      s.wait_idle();
      const auto st = s.stats();
      EXPECT_GE(st.reads, 10u);
      if (direct) {
        EXPECT_EQ(st.bytes_read % kA, 0u);
      }
    }
  }
}

TEST_F(StreamTest, ArenaRoundsDownAndCapsAtExpertCount) {
  ExpertStream s(syn->path.string(), syn->layers, opts_slots(*syn, 7));
  EXPECT_EQ(s.n_slots(), 7u);
  StreamOptions o = opts_slots(*syn, 1000);
  ExpertStream big(syn->path.string(), syn->layers, o);
  EXPECT_EQ(big.n_slots(), 30u);  // 3 layers x 10 experts: more slots could never be used
}

TEST_F(StreamTest, ArenaTooSmallNamesTheMinimum) {
  StreamOptions o = opts_slots(*syn, 5);
  o.min_slots = 10;
  try {
    ExpertStream s(syn->path.string(), syn->layers, o);
    FAIL() << "expected ArenaTooSmall";
  } catch (const ArenaTooSmall& e) {
    EXPECT_EQ(e.min_bytes, 10 * syn->max_slot());
    const std::string w = e.what();
    EXPECT_NE(w.find("holds 5 expert slots of"), std::string::npos) << w;
    EXPECT_NE(w.find("one layer can need 10 at once"), std::string::npos) << w;
    const uint64_t mb = (10 * syn->max_slot() + (1 << 20) - 1) >> 20;
    EXPECT_NE(w.find("--arena-mb " + std::to_string(mb) + " or more"), std::string::npos) << w;
  }
  o.arena_bytes = 100;  // not even one slot
  o.min_slots = 1;
  EXPECT_THROW(ExpertStream(syn->path.string(), syn->layers, o), ArenaTooSmall);
}

TEST_F(StreamTest, LruEvictionAndExactCounters) {
  ExpertStream s(syn->path.string(), syn->layers, opts_slots(*syn, 4, 1));
  auto req = [&](int l, std::vector<int32_t> ids) {
    s.request(l, ids);
    for (int e : ids) ASSERT_TRUE(syn->view_ok(l, e, s.wait(l, e)));
    s.release(l);
  };
  uint64_t bytes = 0;
  req(0, {0, 1});  // 2 misses into empty slots
  bytes += syn->aligned_bytes(0, 0) + syn->aligned_bytes(0, 1);
  req(0, {0, 1});  // 2 hits
  req(0, {2, 3});  // 2 misses, arena now full; LRU order: (0,0) (0,1) (0,2) (0,3)
  bytes += syn->aligned_bytes(0, 2) + syn->aligned_bytes(0, 3);
  req(0, {1});  // hit; LRU order: (0,0) (0,2) (0,3) (0,1)
  req(1, {5});  // miss, evicts (0,0)
  bytes += syn->aligned_bytes(1, 5);
  EXPECT_FALSE(s.resident(0, 0));
  EXPECT_TRUE(s.resident(0, 1));
  EXPECT_TRUE(s.resident(0, 2));
  req(2, {9, 8});  // misses, evict (0,2) then (0,3)
  bytes += syn->aligned_bytes(2, 9) + syn->aligned_bytes(2, 8);
  EXPECT_FALSE(s.resident(0, 2));
  EXPECT_FALSE(s.resident(0, 3));
  EXPECT_TRUE(s.resident(0, 1));
  EXPECT_TRUE(s.resident(1, 5));
  req(0, {1});  // still resident: hit
  const auto st = s.stats();
  EXPECT_EQ(st.needed, 11u);
  EXPECT_EQ(st.hits, 4u);
  EXPECT_EQ(st.misses, 7u);  // 2 + 2 + 1 + 2
  EXPECT_EQ(st.hits + st.misses, st.needed);
  EXPECT_EQ(st.reads, 7u);
  EXPECT_EQ(st.streamed_ahead, 0u);
  EXPECT_EQ(st.wasted, 0u);
  EXPECT_EQ(st.bytes_read, s.direct() ? bytes : st.bytes_read);
  s.reset_stats();
  EXPECT_EQ(s.stats().needed, 0u);
  EXPECT_EQ(s.stats().bytes_read, 0u);
  s.clear();
  EXPECT_FALSE(s.resident(0, 1));
  req(0, {1});
  EXPECT_EQ(s.stats().misses, 1u);
}

// resident_layer: views of a whole layer only when the arena has a slot for every expert of the
// model and the layer is all resident; count_resident_use counts hits as request() would; clear()
// starts a new generation.
TEST_F(StreamTest, ResidentLayerNeedsEveryExpertAndASlotForEach) {
  std::vector<int32_t> all(10);
  std::iota(all.begin(), all.end(), 0);
  {
    ExpertStream s(syn->path.string(), syn->layers, opts_slots(*syn, 29, 2));  // one slot short of all 30
    s.request(0, all);
    for (int e : all) (void)s.wait(0, e);
    s.release(0);
    EXPECT_EQ(s.resident_layer(0), nullptr) << "29 slots for 30 experts: a resident expert may be evicted";
  }
  ExpertStream s(syn->path.string(), syn->layers, opts_slots(*syn, 30, 2));
  EXPECT_EQ(s.resident_layer(0), nullptr) << "nothing read yet";
  EXPECT_EQ(s.resident_layer(3), nullptr) << "no such layer";
  s.request(1, v({0, 1, 2}));
  for (int e : {0, 1, 2}) (void)s.wait(1, e);
  s.release(1);
  EXPECT_EQ(s.resident_layer(1), nullptr) << "3 of 10 resident";
  s.request(1, all);
  std::vector<ExpertView> waited;
  for (int e : all) waited.push_back(s.wait(1, e));
  s.release(1);
  const std::vector<ExpertView>* views = s.resident_layer(1);
  ASSERT_NE(views, nullptr);
  ASSERT_EQ(views->size(), 10u);
  for (int e : all) {
    EXPECT_TRUE(syn->view_ok(1, e, (*views)[size_t(e)]));
    for (int p = 0; p < 3; ++p) EXPECT_EQ((*views)[size_t(e)].part[p], waited[size_t(e)].part[p]);
  }
  EXPECT_EQ(s.resident_layer(1), views) << "cached";
  s.reset_stats();
  s.count_resident_use(1, v({3, 7, 9}));
  const auto st = s.stats();
  EXPECT_EQ(st.needed, 3u);
  EXPECT_EQ(st.hits, 3u);
  EXPECT_EQ(st.misses, 0u);
  EXPECT_EQ(st.reads, 0u);
  EXPECT_THROW(s.count_resident_use(0, v({0})), std::logic_error) << "layer 0 was never read";
  {
    ExpertStream f(syn->path.string(), syn->layers, opts_slots(*syn, 30, 2));
    f.request(2, v({4}));
    (void)f.wait(2, 4);
    f.release(2);
    EXPECT_EQ(f.fill_all(), 29u) << "every expert but the one already resident";
    f.wait_idle();
    for (int l = 0; l < 3; ++l) {
      const auto* lv = f.resident_layer(l);
      ASSERT_NE(lv, nullptr) << "layer " << l;
      for (int e : all) EXPECT_TRUE(syn->view_ok(l, e, (*lv)[size_t(e)]));
    }
    EXPECT_EQ(f.fill_all(), 0u);
    ExpertStream g(syn->path.string(), syn->layers, opts_slots(*syn, 29, 2));
    EXPECT_EQ(g.fill_all(), 0u) << "29 slots cannot hold all 30";
  }
  const uint64_t gen = s.generation();
  s.clear();
  EXPECT_NE(s.generation(), gen);
  EXPECT_EQ(s.resident_layer(1), nullptr) << "emptied by clear()";
}

TEST_F(StreamTest, PinnedSlotsAreNeverEvicted) {
  ExpertStream s(syn->path.string(), syn->layers, opts_slots(*syn, 4, 2));
  s.request(0, v({0, 1}));
  s.request(1, v({0, 1}));  // all 4 slots pinned by two layers at once
  for (int l = 0; l < 2; ++l)
    for (int e = 0; e < 2; ++e) EXPECT_TRUE(syn->view_ok(l, e, s.wait(l, e)));
  EXPECT_THROW(s.request(2, v({0})), std::logic_error);  // a 5th pin cannot be placed
  EXPECT_NO_THROW(s.prefetch(2, v({0})));                // a hint: ignored when every slot is pinned
  s.wait_idle();
  EXPECT_FALSE(s.resident(2, 0));
  for (int l = 0; l < 2; ++l)
    for (int e = 0; e < 2; ++e) EXPECT_TRUE(syn->view_ok(l, e, s.wait(l, e)));
  s.release(0);
  s.request(2, v({0}));  // now a slot of layer 0 can go
  EXPECT_TRUE(syn->view_ok(2, 0, s.wait(2, 0)));
  EXPECT_TRUE(syn->view_ok(1, 0, s.wait(1, 0)));
  EXPECT_TRUE(syn->view_ok(1, 1, s.wait(1, 1)));
}

TEST_F(StreamTest, PinnedSlotsSurviveOtherLayers) {
  ExpertStream s(syn->path.string(), syn->layers, opts_slots(*syn, 4, 2));
  s.request(0, v({3, 4}));
  const ExpertView a = s.wait(0, 3), b = s.wait(0, 4);
  // Prefetch cannot take pinned slots: only the 2 free ones.
  s.prefetch(1, v({0, 1, 2, 3, 4}));
  s.wait_idle();
  EXPECT_TRUE(s.resident(1, 0));
  EXPECT_TRUE(s.resident(1, 1));
  EXPECT_FALSE(s.resident(1, 2));
  // Layer 2 needs 2 experts: evicts the read-aheads, never the pinned layer 0.
  s.request(2, v({7, 8}));
  EXPECT_TRUE(syn->view_ok(2, 7, s.wait(2, 7)));
  EXPECT_TRUE(syn->view_ok(2, 8, s.wait(2, 8)));
  EXPECT_TRUE(syn->view_ok(0, 3, a));
  EXPECT_TRUE(syn->view_ok(0, 4, b));
  EXPECT_EQ(s.stats().wasted, 2u);
  s.release(2);
  s.release(0);
}

TEST_F(StreamTest, PrefetchThenRequestIsStreamedAhead) {
  ExpertStream s(syn->path.string(), syn->layers, opts_slots(*syn, 8, 1));
  s.prefetch(1, v({4, 2, 7}));
  s.wait_idle();
  EXPECT_EQ(s.stats().reads, 3u);
  s.request(1, v({2, 4, 7, 9}));
  for (int e : {2, 4, 7, 9}) EXPECT_TRUE(syn->view_ok(1, e, s.wait(1, e)));
  s.release(1);
  auto st = s.stats();
  EXPECT_EQ(st.needed, 4u);
  EXPECT_EQ(st.hits, 3u);
  EXPECT_EQ(st.streamed_ahead, 3u);
  EXPECT_EQ(st.misses, 1u);
  EXPECT_EQ(st.wasted, 0u);
  // Used once: a second lookup is a plain hit, not streamed ahead again.
  s.request(1, v({2}));
  s.wait(1, 2);
  s.release(1);
  st = s.stats();
  EXPECT_EQ(st.hits, 4u);
  EXPECT_EQ(st.streamed_ahead, 3u);
  // Prefetch of something already resident queues nothing.
  s.prefetch(1, v({2, 4}));
  s.wait_idle();
  EXPECT_EQ(s.stats().reads, 4u);
}

TEST_F(StreamTest, UnusedReadAheadEvictedIsWasted) {
  ExpertStream s(syn->path.string(), syn->layers, opts_slots(*syn, 2, 1));
  s.prefetch(0, v({5}));
  s.wait_idle();
  s.request(1, v({0}));  // empty slot
  s.wait(1, 0);
  s.release(1);
  EXPECT_EQ(s.stats().wasted, 0u);
  s.request(1, v({1}));  // LRU is (1,0) (not a pending read-ahead): evicted first
  s.wait(1, 1);
  EXPECT_TRUE(s.resident(0, 5));
  s.request(2, v({1}));  // only the pending read-ahead is left: evicted, wasted
  s.wait(2, 1);
  EXPECT_FALSE(s.resident(0, 5));
  auto st = s.stats();
  EXPECT_EQ(st.wasted, 1u);
  EXPECT_EQ(st.reads, 4u);
  EXPECT_EQ(st.misses, 3u);
  s.release(1);
  s.release(2);
  // After its layer is released, an unused read-ahead is ordinary LRU (and still wasted).
  s.prefetch(0, v({6}));
  s.wait_idle();
  s.request(0, v({7}));
  s.wait(0, 7);
  s.release(0);  // (0,6) never used, now unprotected and older than (0,7)
  s.request(1, v({3}));
  s.wait(1, 3);
  EXPECT_FALSE(s.resident(0, 6));
  EXPECT_EQ(s.stats().wasted, 2u);
  s.release(1);
}

TEST_F(StreamTest, ReleaseAndCancelDropUnstartedReadAheads) {
  ExpertStream s(syn->path.string(), syn->layers, opts_slots(*syn, 8, 1));
  s.pause_io(true);
  s.prefetch(0, v({1, 2, 3}));
  s.prefetch(1, v({4}));
  s.release(0);
  EXPECT_EQ(s.stats().dropped, 3u);
  s.pause_io(false);
  s.wait_idle();
  EXPECT_EQ(s.stats().reads, 1u);
  EXPECT_TRUE(s.resident(1, 4));
  EXPECT_FALSE(s.resident(0, 1));

  s.pause_io(true);
  s.prefetch(2, v({1, 2, 3}));
  s.cancel_prefetch();
  EXPECT_EQ(s.stats().dropped, 6u);
  s.pause_io(false);
  s.wait_idle();
  EXPECT_EQ(s.stats().reads, 1u);

  // A read-ahead not yet started that the layer needs is promoted: a miss, read urgently.
  s.reset_stats();
  s.pause_io(true);
  s.prefetch(2, v({5, 6}));
  s.request(2, v({6}));
  auto st = s.stats();
  EXPECT_EQ(st.misses, 1u);
  EXPECT_EQ(st.hits, 0u);
  EXPECT_EQ(st.streamed_ahead, 0u);
  s.pause_io(false);
  EXPECT_TRUE(syn->view_ok(2, 6, s.wait(2, 6)));
  s.wait_idle();
  s.release(2);
  st = s.stats();
  EXPECT_EQ(st.reads, 2u);  // (2,6) urgent, (2,5) read ahead
  EXPECT_EQ(st.dropped, 0u);
  EXPECT_EQ(st.wasted, 0u);
  EXPECT_GE(st.exposed_wait_s, 0.0);
}

TEST_F(StreamTest, UrgentReadsGoFirst) {
  ExpertStream s(syn->path.string(), syn->layers, opts_slots(*syn, 10, 1));
  s.pause_io(true);
  s.prefetch(1, v({0, 1, 2, 3, 4, 5, 6, 7}));
  s.request(0, v({9}));
  s.pause_io(false);
  s.wait(0, 9);
  // With one IO thread the urgent read is served first: when it is resident, the IO thread
  // cannot have finished the 8 read-aheads queued before it.
  EXPECT_LT(s.stats().reads, 9u);
  s.release(0);
  s.wait_idle();
  EXPECT_EQ(s.stats().reads, 9u);
}

TEST_F(StreamTest, IoErrorIsRethrownByWait) {
  auto layers = syn->layers;
  layers[1].part[2].base_offset = syn->bytes.size() + 10000;  // layer 1's down slices: past EOF
  ExpertStream s(syn->path.string(), layers, opts_slots(*syn, 4, 2));
  s.request(1, v({0}));
  s.request(0, v({0}));
  try {
    s.wait(1, 0);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(syn->path.string()), std::string::npos) << e.what();
  }
  EXPECT_TRUE(syn->view_ok(0, 0, s.wait(0, 0)));
  s.release(1);
  s.release(0);
  EXPECT_FALSE(s.resident(1, 0));
  // Asking again retries the read (and fails again).
  s.request(1, v({0}));
  EXPECT_THROW(s.wait(1, 0), IoError);
  s.release(1);
  EXPECT_EQ(s.stats().reads, 1u);
}

TEST_F(StreamTest, DestructorWithQueuedWork) {
  for (bool paused : {true, false}) {
    auto t0 = std::chrono::steady_clock::now();
    {
      ExpertStream s(syn->path.string(), syn->layers, opts_slots(*syn, 30, 3));
      if (paused) s.pause_io(true);
      std::vector<int32_t> ids(10);
      std::iota(ids.begin(), ids.end(), 0);
      for (int l = 0; l < 3; ++l) s.prefetch(l, ids);
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  }
}

TEST(Stream, TmpfsWorks) {
  if (!fs::is_directory("/dev/shm") || !on_tmpfs("/dev/shm")) GTEST_SKIP() << "/dev/shm is not a tmpfs here";
  Synth syn("/dev/shm", "shm", 2, 6, 7);
  testing::internal::CaptureStderr();
  ExpertStream s(syn.path.string(), syn.layers, opts_slots(syn, 12, 2));
  const std::string err = testing::internal::GetCapturedStderr();
  // tmpfs accepts O_DIRECT since Linux 6.6; before, the stream falls back and warns.
  if (s.direct()) {
    EXPECT_EQ(err, "");
  } else {
    EXPECT_NE(err.find("strata: warning: " + syn.path.string() + ": O_DIRECT refused by the filesystem"),
              std::string::npos)
        << err;
  }
  for (int l = 0; l < 2; ++l) {
    std::vector<int32_t> ids(6);
    std::iota(ids.begin(), ids.end(), 0);
    s.request(l, ids);
    for (int e = 0; e < 6; ++e) EXPECT_TRUE(syn.view_ok(l, e, s.wait(l, e)));
    s.release(l);
  }
}

TEST_F(StreamTest, DirectRefusedAtFirstReadFallsBack) {
  strata::io::testing::simulate_direct_read_einval(true);
  testing::internal::CaptureStderr();
  ExpertStream s(syn->path.string(), syn->layers, opts_slots(*syn, 30, 2));
  const std::string err = testing::internal::GetCapturedStderr();
  strata::io::testing::simulate_direct_read_einval(false);
  EXPECT_FALSE(s.direct());
  EXPECT_EQ(err,
            "strata: warning: " + syn->path.string() + ": O_DIRECT refused by the filesystem, using buffered reads\n");
  for (int l = 0; l < 3; ++l) {
    std::vector<int32_t> ids(10);
    std::iota(ids.begin(), ids.end(), 0);
    s.request(l, ids);
    for (int e = 0; e < 10; ++e) EXPECT_TRUE(syn->view_ok(l, e, s.wait(l, e)));
    s.release(l);
  }
}

TEST(Stream, NoHiddenCaps512x48) {
  // 48 layers x 512 experts of tiny slices (layers share the same bytes).
  Synth syn(disk_dir(), "caps", 1, 512, 9);
  std::vector<LayerExperts> layers(48);
  for (auto& L : layers) {
    L.n_expert = 512;
    for (int p = 0; p < 3; ++p) {
      L.part[p].base_offset = syn.layers[0].part[p].base_offset;
      L.part[p].expert_bytes = 16 + 8 * p;
    }
  }
  StreamOptions o;
  o.arena_bytes = 150 * 6 * 4096;
  o.io_threads = 4;
  o.min_slots = 100;
  ExpertStream s(syn.path.string(), layers, o);
  EXPECT_GE(s.n_slots(), 100u);
  std::mt19937 rng(1);
  for (int l = 0; l < 48; ++l) {
    std::vector<int32_t> ids(512);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(100);
    s.request(l, ids);
    for (int e : ids) {
      const ExpertView vw = s.wait(l, e);
      for (int p = 0; p < 3; ++p) {
        const auto& P = layers[static_cast<size_t>(l)].part[p];
        ASSERT_EQ(std::memcmp(vw.part[p], syn.bytes.data() + P.base_offset + e * P.expert_bytes, P.expert_bytes), 0);
      }
    }
    s.release(l);
  }
  EXPECT_EQ(s.stats().needed, 48u * 100u);
}

TEST_F(StreamTest, ConcurrencyStress) {
  ExpertStream s(syn->path.string(), syn->layers, opts_slots(*syn, 12, 8));
  std::mt19937 rng(123);
  const auto t0 = std::chrono::steady_clock::now();
  int iters = 0;
  for (; iters < 3000; ++iters) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > 4.0) break;
    const int l = static_cast<int>(rng() % 3);
    std::vector<int32_t> all(10);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int32_t> ids(all.begin(), all.begin() + 1 + rng() % 6);
    s.request(l, ids);
    std::shuffle(all.begin(), all.end(), rng);
    s.prefetch((l + 1) % 3, std::span<const int32_t>(all.data(), 1 + rng() % 8));
    for (int e : ids) ASSERT_TRUE(syn->view_ok(l, e, s.wait(l, e))) << "iteration " << iters;
    if (rng() % 7 == 0) s.cancel_prefetch();
    s.release(l);
  }
  EXPECT_GE(iters, 200);
  s.wait_idle();
  const auto st = s.stats();
  EXPECT_EQ(st.hits + st.misses, st.needed);
  EXPECT_LE(st.streamed_ahead, st.hits);
  EXPECT_GE(st.reads, st.misses);
  s.clear();
  for (int l = 0; l < 3; ++l)
    for (int e = 0; e < 10; ++e) EXPECT_FALSE(s.resident(l, e));
}
