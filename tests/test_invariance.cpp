// Batch invariance: the same token ids give the same logits bit for bit whatever the
// prompt chunk, arena size (all experts or the minimum) and thread count.
#include <gtest/gtest.h>

#include <cstring>

#include "engine/static_rank.h"
#include "support/paths.h"
#include "support/reference.h"

using namespace strata;

namespace {

std::vector<int32_t> test_prompt() {
  const auto ref = test::load_json(test::data_path("qwen3moe-code-Q8_0.hf.json"));
  // The longest reference case; cut to 120 tokens to keep chunk-1 runs quick.
  std::vector<int32_t> best;
  for (const auto& c : ref["cases"]) {
    auto ids = c["ids"].get<std::vector<int32_t>>();
    if (ids.size() > best.size()) best = ids;
  }
  best.resize(std::min<size_t>(best.size(), 120));
  return best;
}

std::vector<float> all_logits(const engine::EngineOptions& o, const std::vector<int32_t>& ids,
                              uint64_t* min_arena = nullptr) {
  engine::Engine eng(test::shipped_model(), o);
  if (min_arena) *min_arena = eng.min_arena_bytes();
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, ids, model::LogitsMode::All, logits);
  return logits;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST(Invariance, ChunkArenaThreadsGiveIdenticalLogits) {
  const auto ids = test_prompt();
  ASSERT_GE(ids.size(), 100u);
  engine::EngineOptions base;
  base.n_threads = 2;
  base.prompt_chunk = 512;
  base.arena_mb = 64;  // all experts (26 MiB) fit
  uint64_t min_arena = 0;
  const auto ref = all_logits(base, ids, &min_arena);
  ASSERT_EQ(ref.size(), ids.size() * 8192);

  for (int chunk : {1, 7, 64, 512}) {
    for (int threads : {1, 2}) {
      engine::EngineOptions o = base;
      o.prompt_chunk = chunk;
      o.n_threads = threads;
      EXPECT_TRUE(bit_equal(all_logits(o, ids), ref)) << "chunk " << chunk << " threads " << threads;
    }
  }
  // Arena at the minimum for a 64-token chunk: every layer evicts and re-reads experts.
  engine::EngineOptions o = base;
  o.prompt_chunk = 64;
  o.arena_mb = 0;
  uint64_t min64 = 0;
  {
    engine::EngineOptions probe = o;
    probe.arena_mb = 64;
    engine::Engine eng(test::shipped_model(), probe);
    min64 = eng.min_arena_bytes();
  }
  o.arena_bytes = min64;
  EXPECT_TRUE(bit_equal(all_logits(o, ids), ref)) << "minimum arena";
  // Minimum arena for single-token chunks (top-k slots) and buffered reads.
  o.prompt_chunk = 1;
  o.arena_bytes = 0;
  {
    engine::EngineOptions probe = o;
    probe.arena_mb = 64;
    engine::Engine eng(test::shipped_model(), probe);
    o.arena_bytes = eng.min_arena_bytes();
  }
  o.direct_io = false;
  EXPECT_TRUE(bit_equal(all_logits(o, ids), ref)) << "minimum arena, chunk 1, buffered";
}

TEST(Invariance, DecodeEqualsPrefill) {
  // Token-by-token decode gives the same last-position logits as one prefill.
  const auto ids = test_prompt();
  engine::EngineOptions o;
  o.n_threads = 2;
  o.arena_mb = 64;
  engine::Engine eng(test::shipped_model(), o);
  model::SequenceState a = eng.new_sequence(), b = eng.new_sequence();
  std::vector<float> la, lb;
  eng.prefill(a, ids, model::LogitsMode::Last, la);
  eng.prefill(b, std::span(ids).first(1), model::LogitsMode::Last, lb);
  for (size_t i = 1; i < ids.size(); ++i) eng.decode(b, ids[i], lb);
  EXPECT_TRUE(bit_equal(la, lb));
}

TEST(Invariance, ReadAheadAndIoSettingsNeverChangeResults) {
  // Prediction on or off, --predict-min, a static rank, 1 or 8 IO threads, packed or not:
  // each only changes what is read when, never the logits.
  const auto ids = test_prompt();
  engine::EngineOptions base;
  base.n_threads = 2;
  base.prompt_chunk = 16;
  base.arena_mb = 5;  // about 70 of the 512 experts: constant eviction and read-ahead
  base.predict = false;
  base.use_pack = false;
  const auto ref = all_logits(base, ids);

  // A static rank made from the prompt's own routing.
  const std::string rank_path = testing::TempDir() + "strata-invariance.strata-rank";
  test::write_prompt_rank(base, ids, rank_path);

  struct Case {
    const char* name;
    bool predict;
    int predict_min;
    int io_threads;
    bool rank;
  };
  for (const Case& c : {Case{"predict on", true, 1, 8, false}, Case{"predict-min 3", true, 3, 8, false},
                        Case{"predict on, 1 io thread", true, 1, 1, false}, Case{"static rank only", false, 1, 8, true},
                        Case{"predict + static rank", true, 1, 4, true}}) {
    engine::EngineOptions o = base;
    o.predict = c.predict;
    o.predict_min = c.predict_min;
    o.io_threads = c.io_threads;
    o.static_rank = c.rank ? rank_path : "none";
    engine::Engine eng(test::shipped_model(), o);
    model::SequenceState st = eng.new_sequence();
    std::vector<float> logits;
    eng.prefill(st, ids, model::LogitsMode::All, logits);
    EXPECT_TRUE(bit_equal(logits, ref)) << c.name;
    if (c.predict) {
      // Read-ahead happened and the recall is a property of the model: same in every run.
      EXPECT_GT(eng.prefill_stats().stream.streamed_ahead, 0u) << c.name;
    }
  }
}

TEST(Invariance, PredictionRecallDoesNotDependOnArenaOrTiming) {
  const auto ids = test_prompt();
  std::vector<double> recalls;
  for (int arena_mb : {5, 64}) {
    for (int io : {1, 8}) {
      engine::EngineOptions o;
      o.n_threads = 2;
      o.prompt_chunk = 32;
      o.arena_mb = arena_mb;
      o.io_threads = io;
      o.use_pack = false;
      engine::Engine eng(test::shipped_model(), o);
      model::SequenceState st = eng.new_sequence();
      std::vector<float> logits;
      eng.prefill(st, ids, model::LogitsMode::Last, logits);
      const auto& p = eng.prefill_stats().prediction;
      ASSERT_EQ(p.picks.size(), 8u);
      uint64_t picks = 0, hit = 0;
      for (size_t l = 0; l < p.picks.size(); ++l) {
        picks += p.picks[l];
        hit += p.predicted[l];
      }
      EXPECT_EQ(picks, ids.size() * 8 * 8);  // every layer has a prediction (layer 0: from embeddings)
      recalls.push_back(double(hit) / double(picks));
    }
  }
  for (double r : recalls) EXPECT_EQ(r, recalls[0]);
  std::printf("prediction recall over all layers: %.3f\n", recalls[0]);
  EXPECT_GT(recalls[0], 0.3);  // far better than chance (8 of 64 = 0.125)
}
