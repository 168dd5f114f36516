// The host RAM tier between the disk and the arena (StreamOptions::host_cache_bytes,
// --host-cache-mb), on the CPU backend: every view's bytes equal the file's, the tier counters
// add up (reads = host hits + disk reads; with no read-ahead, misses = host hits + disk reads),
// LRU eviction where an arena hit counts as a use, and logits bit-identical with the tier off,
// small and holding every expert.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <vector>

#include "engine/engine.h"
#include "stream/expert_stream.h"
#include "support/paths.h"
#include "support/reference.h"

namespace fs = std::filesystem;
using namespace strata;
using stream::ExpertStream;
using stream::LayerExperts;
using stream::StreamOptions;

namespace {

// One file of random bytes: `n_layers` layers of `n_expert` experts, gate/up/down slices of
// odd sizes back to back (as in a GGUF), so each expert is 1..3 aligned reads.
struct TierFile {
  fs::path dir, path;
  std::vector<uint8_t> bytes;
  std::vector<LayerExperts> layers;
  TierFile(const std::string& name, int n_layers, int n_expert, uint64_t part_bytes = 6000) {
    dir = fs::temp_directory_path() / ("strata-test-tier-" + std::to_string(::getpid()) + "-" + name);
    fs::create_directories(dir);
    path = dir / "experts.bin";
    std::mt19937 rng(7);
    uint64_t pos = 321;
    for (int l = 0; l < n_layers; ++l) {
      LayerExperts L;
      L.n_expert = n_expert;
      for (auto& p : L.part) {
        pos += 53;
        p.base_offset = pos;
        p.expert_bytes = part_bytes + rng() % 3000;
        pos += uint64_t(n_expert) * p.expert_bytes;
      }
      layers.push_back(L);
    }
    bytes.resize(pos + 777);
    for (auto& b : bytes) b = uint8_t(rng() >> 5);
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  }
  ~TierFile() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  // The view's three slices equal the file's bytes.
  bool view_ok(int l, int e, const stream::ExpertView& v) const {
    for (int p = 0; p < 3; ++p) {
      const auto& P = layers[size_t(l)].part[p];
      if (std::memcmp(v.part[p], bytes.data() + P.offset(e), P.expert_bytes) != 0) return false;
    }
    return true;
  }
};

// Requests, waits for (checking its bytes) and releases one expert: one layer's whole use.
void use(ExpertStream& s, const TierFile& f, int l, int32_t e) {
  const int32_t one[1] = {e};
  s.request(l, one);
  const stream::ExpertView v = s.wait(l, e);
  EXPECT_TRUE(f.view_ok(l, e, v)) << "layer " << l << " expert " << e;
  s.release(l);
}

StreamOptions tier_opts(const TierFile& f, size_t arena_slots, size_t host_slots, int io_threads = 1) {
  StreamOptions o;
  const size_t slot = ExpertStream::slot_bytes_for(f.layers);
  o.arena_bytes = arena_slots * slot;
  o.host_cache_bytes = host_slots * slot;
  o.io_threads = io_threads;
  o.direct = false;  // tmpfs may refuse O_DIRECT; the tier logic is the same
  return o;
}

void expect_sums(const stream::StreamStats& st) {
  EXPECT_EQ(st.reads, st.host_hits + st.disk_reads);
  EXPECT_EQ(st.misses, st.host_hits + st.disk_reads);  // no read-ahead in these tests
}

}  // namespace

TEST(HostTier, SecondPassComesFromHostRam) {
  TierFile f("pass", 1, 8);
  ExpertStream s(f.path.string(), f.layers, tier_opts(f, 2, 8));
  ASSERT_EQ(s.host_slots(), 8u);
  for (int e = 0; e < 8; ++e) use(s, f, 0, e);
  auto st = s.stats();
  EXPECT_EQ(st.disk_reads, 8u);
  EXPECT_EQ(st.host_hits, 0u);
  EXPECT_EQ(st.host_fills, 8u);
  const uint64_t disk_bytes = st.bytes_read;
  // The arena holds 6 and 7; every other expert, and then 6 and 7 again, come from host RAM.
  for (int e = 0; e < 8; ++e) use(s, f, 0, e);
  st = s.stats();
  EXPECT_EQ(st.misses, 16u);
  EXPECT_EQ(st.host_hits, 8u);
  EXPECT_EQ(st.disk_reads, 8u);
  EXPECT_EQ(st.bytes_read, disk_bytes);  // no disk byte in the second pass
  EXPECT_GT(st.host_hit_bytes, 0u);
  EXPECT_EQ(st.h2d_bytes, st.host_hit_bytes + disk_bytes);  // fills and hits are copied into the slot
  expect_sums(st);
}

TEST(HostTier, OffMeansEveryMissIsADiskRead) {
  TierFile f("off", 2, 6);
  ExpertStream s(f.path.string(), f.layers, tier_opts(f, 2, 0));
  EXPECT_EQ(s.host_slots(), 0u);
  for (int pass = 0; pass < 2; ++pass)
    for (int l = 0; l < 2; ++l)
      for (int e = 0; e < 6; ++e) use(s, f, l, e);
  const auto st = s.stats();
  EXPECT_EQ(st.host_hits, 0u);
  EXPECT_EQ(st.disk_reads, 24u);
  EXPECT_EQ(st.h2d_bytes, 0u);  // host arena, direct reads land in the slot
  expect_sums(st);
}

TEST(HostTier, LruWhereAnArenaHitCountsAsAUse) {
  TierFile f("lru", 1, 4);
  ExpertStream s(f.path.string(), f.layers, tier_opts(f, 2, 2));
  use(s, f, 0, 0);                              // disk, host {0}
  use(s, f, 0, 1);                              // disk, host {0, 1}
  for (int i = 0; i < 3; ++i) use(s, f, 0, 0);  // arena hits: 0 is now the newest in the host tier too
  use(s, f, 0, 2);                              // disk; the host tier evicts 1, the least recently used
  EXPECT_TRUE(s.in_host_tier(0, 0));
  EXPECT_FALSE(s.in_host_tier(0, 1));
  EXPECT_TRUE(s.in_host_tier(0, 2));
  EXPECT_EQ(s.stats().host_evictions, 1u);
  use(s, f, 0, 1);  // arena {0, 2} -> miss; host lost it -> disk; host evicts 0 (older than 2)
  EXPECT_FALSE(s.in_host_tier(0, 0));
  use(s, f, 0, 2);  // arena {2, 1}: hit
  use(s, f, 0, 0);  // arena miss, host miss: disk
  const auto st = s.stats();
  EXPECT_EQ(st.host_hits, 0u);
  EXPECT_EQ(st.disk_reads, 5u);
  EXPECT_EQ(st.hits, 4u);
  expect_sums(st);
  // Looping over more experts than the host tier holds: LRU keeps none of them.
  s.reset_stats();
  for (int pass = 0; pass < 2; ++pass)
    for (int e = 0; e < 4; ++e) use(s, f, 0, e);
  EXPECT_EQ(s.stats().host_hits, 0u);
  expect_sums(s.stats());
}

TEST(HostTier, ManyIoThreadsCountersAddUp) {
  TierFile f("threads", 3, 16);
  ExpertStream s(f.path.string(), f.layers, tier_opts(f, 8, 20, 4));
  std::mt19937 rng(3);
  for (int it = 0; it < 200; ++it) {
    const int l = int(rng() % 3);
    std::vector<int32_t> ids;
    for (int32_t e = 0; e < 16; ++e)
      if (rng() % 4 == 0 && ids.size() < 8) ids.push_back(e);
    if (ids.empty()) continue;
    s.request(l, ids);
    for (int32_t e : ids) EXPECT_TRUE(f.view_ok(l, e, s.wait(l, e)));
    s.release(l);
  }
  const auto st = s.stats();
  EXPECT_GT(st.host_hits, 0u);
  EXPECT_GT(st.disk_reads, 0u);
  expect_sums(st);
  s.clear();  // cold start empties the host tier too
  EXPECT_FALSE(s.in_host_tier(0, 0) || s.in_host_tier(1, 1) || s.in_host_tier(2, 2));
}

namespace {

std::vector<int32_t> prompt_ids() {
  const auto ref = test::load_json(test::data_path("qwen3moe-code-Q8_0.hf.json"));
  std::vector<int32_t> best;
  for (const auto& c : ref["cases"]) {
    auto ids = c["ids"].get<std::vector<int32_t>>();
    if (ids.size() > best.size()) best = ids;
  }
  best.resize(std::min<size_t>(best.size(), 64));
  return best;
}

struct TierRun {
  std::vector<float> logits;
  stream::StreamStats pass1, pass2;
  uint64_t host_bytes = 0;
};

// Two prefills of the same ids (the second reuses what the first left in the tiers).
TierRun run_engine(int64_t host_mb, bool predict, const std::string& backend = "cpu") {
  engine::EngineOptions o;
  o.backend = backend;
  o.n_threads = 2;
  o.arena_mb = 3;  // about 10 % of the 25.5 MiB of experts (the chunk shrinks to fit)
  o.host_cache_mb = host_mb;
  o.predict = predict;
  o.static_rank = "none";
  o.io_threads = 2;
  engine::Engine eng(test::shipped_model(), o);
  TierRun r;
  r.host_bytes = eng.host_cache_bytes();
  std::vector<float> l2;
  for (int pass = 0; pass < 2; ++pass) {
    model::SequenceState st = eng.new_sequence();
    eng.prefill(st, prompt_ids(), model::LogitsMode::All, pass == 0 ? r.logits : l2);
    eng.stream().wait_idle();
    (pass == 0 ? r.pass1 : r.pass2) = eng.prefill_stats().stream;
    eng.reset_stats();
  }
  EXPECT_EQ(0, std::memcmp(r.logits.data(), l2.data(), l2.size() * sizeof(float)));
  return r;
}

}  // namespace

TEST(HostTier, EngineLogitsBitIdenticalAndCountersAddUp) {
  const TierRun off = run_engine(0, false);
  const TierRun small = run_engine(16, false);
  const TierRun all = run_engine(64, false);
  EXPECT_EQ(off.host_bytes, 0u);
  EXPECT_GT(small.host_bytes, 0u);
  EXPECT_LT(small.host_bytes, all.host_bytes);
  for (const TierRun* r : {&off, &small, &all}) {
    EXPECT_EQ(r->logits.size(), off.logits.size());
    EXPECT_EQ(0, std::memcmp(r->logits.data(), off.logits.data(), off.logits.size() * sizeof(float)));
    for (const auto* st : {&r->pass1, &r->pass2}) {
      EXPECT_EQ(st->misses, st->host_hits + st->disk_reads);
      EXPECT_EQ(st->reads, st->host_hits + st->disk_reads);
    }
  }
  EXPECT_EQ(off.pass2.host_hits, 0u);
  EXPECT_GT(small.pass2.host_hits, 0u);
  // Every expert fits in the host tier: the second pass reads nothing from disk.
  EXPECT_EQ(all.pass2.disk_reads, 0u);
  EXPECT_EQ(all.pass2.bytes_read, 0u);
  EXPECT_EQ(all.pass2.host_hits, all.pass2.misses);
  EXPECT_GT(all.pass2.misses, 0u);
  // With read-ahead on, every arena fill still comes from exactly one tier.
  const TierRun ahead = run_engine(16, true);
  EXPECT_EQ(0, std::memcmp(ahead.logits.data(), off.logits.data(), off.logits.size() * sizeof(float)));
  EXPECT_EQ(ahead.pass2.reads, ahead.pass2.host_hits + ahead.pass2.disk_reads);
}

// The same on the GPU: the arena in VRAM, the host tier pinned, hits landed host-to-device.
TEST(HostTier, CudaLogitsBitIdenticalAndCountersAddUp) {
  if (!engine::cuda_device_present()) GTEST_SKIP() << "no CUDA device (or a build without the CUDA backend)";
  const TierRun off = run_engine(0, false, "cuda");
  const TierRun small = run_engine(16, false, "cuda");
  const TierRun all = run_engine(64, false, "cuda");
  // With read-ahead, predicted experts that were never needed (nor read) in the first pass may be
  // read from the disk in the second, so only the identities hold there, not "no disk reads".
  const TierRun ahead = run_engine(64, true, "cuda");
  for (const TierRun* r : {&small, &all, &ahead}) {
    ASSERT_EQ(r->logits.size(), off.logits.size());
    EXPECT_EQ(0, std::memcmp(r->logits.data(), off.logits.data(), off.logits.size() * sizeof(float)));
    for (const auto* st : {&r->pass1, &r->pass2}) {
      EXPECT_EQ(st->reads, st->host_hits + st->disk_reads);
      EXPECT_GT(st->h2d_bytes, 0u);  // a device arena: every landed byte is a host-to-device copy
    }
  }
  EXPECT_EQ(small.pass2.misses, small.pass2.host_hits + small.pass2.disk_reads);
  EXPECT_GT(small.pass2.host_hits, 0u);
  EXPECT_EQ(all.pass2.disk_reads, 0u);
}

namespace {

/// A host-memory arena that lands host-tier hits whole (as the CUDA backend's device arena
/// does), counting how each landing arrives.
class WholeArena : public backend::ArenaMemory {
 public:
  WholeArena(size_t n_slots, size_t slot_bytes, int io_threads)
      : n_(n_slots), bytes_(slot_bytes), slots_(n_slots * slot_bytes, 0xEE), staging_(size_t(io_threads)) {
    for (auto& st : staging_) st.resize(slot_bytes);
  }
  size_t n_slots() const override { return n_; }
  size_t slot_bytes() const override { return bytes_; }
  uint8_t* read_target(size_t, int io_thread) override { return staging_.at(size_t(io_thread)).data(); }
  void land(size_t slot, int io_thread, size_t bytes, size_t offset) override {
    std::memcpy(slots_.data() + slot * bytes_ + offset, staging_.at(size_t(io_thread)).data() + offset, bytes);
  }
  void land_from(size_t slot, int, const uint8_t* src, size_t bytes, size_t offset) override {
    EXPECT_LE(offset + bytes, bytes_);
    std::memcpy(slots_.data() + slot * bytes_ + offset, src, bytes);
    ++from_calls;
  }
  bool lands_whole() const override { return true; }
  void land_ranges(size_t slot, int, std::span<const HostRange> ranges) override {
    EXPECT_GE(ranges.size(), 1u);
    EXPECT_LE(ranges.size(), 3u);
    for (const HostRange& r : ranges) {
      EXPECT_EQ(r.offset % 4096, 0u);
      EXPECT_LE(r.offset + r.bytes, bytes_);
      std::memcpy(slots_.data() + slot * bytes_ + r.offset, r.src, r.bytes);
    }
    ++range_calls;
  }
  const uint8_t* slot_data(size_t slot) const override { return slots_.data() + slot * bytes_; }
  backend::Place place() const override { return backend::Place::Host; }

  std::atomic<int> from_calls{0}, range_calls{0};

 private:
  size_t n_, bytes_;
  std::vector<uint8_t> slots_;
  std::vector<std::vector<uint8_t>> staging_;
};

}  // namespace

// An arena that lands whole gets each host-tier hit in one land_ranges() call (the expert's
// three ranges, each several 256 KiB pieces long), with the file's bytes and the same counters;
// disk fills still land piece by piece.
TEST(HostTier, WholeLandingArenaGetsOneCallPerHitAndTheSameBytes) {
  TierFile f("whole", 2, 5, 600000);
  WholeArena* arena = nullptr;
  ExpertStream s(f.path.string(), f.layers, tier_opts(f, 2, 10, 4), [&](size_t n, size_t bytes, int threads) {
    auto a = std::make_unique<WholeArena>(n, bytes, threads);
    arena = a.get();
    return a;
  });
  ASSERT_NE(arena, nullptr);
  for (int l = 0; l < 2; ++l)
    for (int e = 0; e < 5; ++e) use(s, f, l, e);
  auto st = s.stats();
  EXPECT_EQ(st.host_fills, 10u);
  EXPECT_EQ(arena->range_calls.load(), 0);
  EXPECT_GE(arena->from_calls.load(), 10 * 3 * 3);  // every fill: 3 ranges of >= 3 pieces each
  const int fill_calls = arena->from_calls.load();
  const uint64_t disk_bytes = st.bytes_read;
  // Second pass: the arena holds layer 1's experts 3 and 4; everything else is a host hit.
  for (int l = 0; l < 2; ++l)
    for (int e = 0; e < 5; ++e) use(s, f, l, e);
  st = s.stats();
  EXPECT_EQ(st.host_hits, 10u);
  EXPECT_EQ(arena->range_calls.load(), 10);
  EXPECT_EQ(arena->from_calls.load(), fill_calls);  // no hit landed piece by piece
  EXPECT_EQ(st.bytes_read, disk_bytes);
  EXPECT_EQ(st.h2d_bytes, st.host_hit_bytes + disk_bytes);
  expect_sums(st);
}

TEST(HostTier, CpuDefaultIsOffAndBadSizesAreErrors) {
  engine::EngineOptions o;
  o.n_threads = 1;
  o.arena_mb = 3;
  {
    engine::Engine eng(test::shipped_model(), o);  // automatic (-1) on the CPU backend: off
    EXPECT_EQ(eng.host_cache_bytes(), 0u);
  }
  EXPECT_EQ(engine::default_host_cache_bytes(false, 1, 100, 1000), 0u);
  EXPECT_EQ(engine::default_host_cache_bytes(true, 100, 100, 1000), 0u);  // the arena holds everything
  EXPECT_EQ(engine::default_host_cache_bytes(true, 10, 100, 1000), 100u);
  EXPECT_EQ(engine::default_host_cache_bytes(true, 10, 1000, 1000), 500u);
  o.host_cache_mb = -2;
  EXPECT_THROW(engine::Engine(test::shipped_model(), o), engine::EngineError);
  // An explicit size: capped at every expert, and more than is available is an error naming both.
  EXPECT_EQ(engine::resolve_host_cache_bytes(1, false, 0, 100 << 20, 1000 << 20), 1u << 20);
  EXPECT_EQ(engine::resolve_host_cache_bytes(500, false, 0, 100 << 20, 1000 << 20), 100u << 20);
  EXPECT_EQ(engine::resolve_host_cache_bytes(0, true, 0, 100 << 20, 1000 << 20), 0u);
  try {
    engine::resolve_host_cache_bytes(300, true, 0, 1000 << 20, 200 << 20);
    ADD_FAILURE() << "no error for more pinned memory than is available";
  } catch (const engine::EngineError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("300.0 MiB of pinned host memory"), std::string::npos) << m;
    EXPECT_NE(m.find("200.0 MiB are available"), std::string::npos) << m;
  }
  o.host_cache_mb = 1 << 20;  // a TiB: more than this machine has, refused although the experts need less
  try {
    engine::Engine big(test::shipped_model(), o);
    ADD_FAILURE() << "no error for a 1 TiB host tier";
  } catch (const engine::EngineError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("--host-cache-mb 1048576: 1048576.0 MiB of host memory asked for"));
  }
  // 256 MiB fits in RAM but is more than every expert of the model: capped at the experts.
  if (engine::mem_available_bytes() < (uint64_t(512) << 20)) GTEST_SKIP() << "less than 512 MiB available";
  o.host_cache_mb = 256;
  engine::Engine eng(test::shipped_model(), o);
  uint64_t n_experts = 0;
  for (const auto& L : eng.model().expert_layout()) n_experts += uint64_t(L.n_expert);
  EXPECT_EQ(eng.stream().host_slots(), n_experts);
  EXPECT_EQ(eng.host_cache_bytes(), n_experts * eng.stream().slot_bytes());
}
