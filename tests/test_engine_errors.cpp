// Bad input gets a clear error: prompt longer than the context, empty prompt, ids out of
// the vocabulary, an arena below the minimum, an unsupported architecture.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/engine.h"
#include "support/error_of.h"
#include "support/options.h"
#include "support/paths.h"

using namespace strata;
using ::testing::HasSubstr;

namespace {
using test::error_of;
engine::EngineOptions small() { return test::engine_options(/*n_threads=*/1, /*n_ctx=*/16, /*arena_mb=*/8); }
}  // namespace

TEST(EngineErrors, PromptLongerThanContext) {
  engine::Engine eng(test::shipped_model(), small());
  auto st = eng.new_sequence();
  std::vector<int32_t> ids(17, 100);
  std::vector<float> logits;
  EXPECT_THAT(error_of<engine::EngineError>([&] { eng.prefill(st, ids, model::LogitsMode::Last, logits); }),
              HasSubstr("exceed the context of 16 tokens"));
  EXPECT_EQ(st.n_past, 0);  // nothing was consumed
}

TEST(EngineErrors, EmptyPrompt) {
  engine::Engine eng(test::shipped_model(), small());
  auto st = eng.new_sequence();
  std::vector<float> logits;
  EXPECT_THAT(error_of<engine::EngineError>(
                  [&] { eng.prefill(st, std::span<const int32_t>(), model::LogitsMode::Last, logits); }),
              HasSubstr("empty prompt"));
}

TEST(EngineErrors, IdsOutOfVocabulary) {
  engine::Engine eng(test::shipped_model(), small());
  auto st = eng.new_sequence();
  std::vector<float> logits;
  for (int32_t bad : {8192, -1, 1 << 30}) {
    std::vector<int32_t> ids = {1, 2, bad};
    EXPECT_THAT(error_of<engine::EngineError>([&] { eng.prefill(st, ids, model::LogitsMode::Last, logits); }),
                HasSubstr("out of the vocabulary (0..8191)"));
  }
}

TEST(EngineErrors, ArenaBelowMinimum) {
  // Both pinned: a 1 MiB arena (15 slots of 68 KiB) cannot hold one layer of a 16-token chunk
  // (top-8 x 16 tokens, capped at the 64 experts); the error names both remedies.
  engine::EngineOptions o = small();
  o.arena_mb = 1;
  o.prompt_chunk = 16;
  const std::string msg = error_of<stream::ArenaTooSmall>([&] { engine::Engine eng(test::shipped_model(), o); });
  EXPECT_THAT(msg, HasSubstr("--arena-mb 5 or more"));
  EXPECT_THAT(msg, HasSubstr("64"));
  EXPECT_THAT(msg, HasSubstr("--prompt-chunk 1 or less"));
}

TEST(EngineErrors, ArenaBelowOneTokensTopKNamesThatMinimum) {
  // 300 KiB holds 4 slots of ~68 KiB, fewer than one token's top-8: with the automatic chunk the
  // error names the chunk-1 minimum (8 slots), not a whole layer of a 2048-token chunk; with a
  // pinned chunk of 16 it names that chunk's minimum and the chunk-1 one.
  engine::EngineOptions o = small();
  o.arena_bytes = 300 << 10;
  std::string msg = error_of<stream::ArenaTooSmall>([&] { engine::Engine eng(test::shipped_model(), o); });
  EXPECT_THAT(msg, HasSubstr("holds 4 expert slots"));
  EXPECT_THAT(msg, HasSubstr("one layer can need 8 at once: use --arena-mb 1 or more"));
  o.prompt_chunk = 16;
  msg = error_of<stream::ArenaTooSmall>([&] { engine::Engine eng(test::shipped_model(), o); });
  EXPECT_THAT(msg, HasSubstr("one layer can need 64 at once: use --arena-mb 5 or more"));
  EXPECT_THAT(msg, HasSubstr("(with --prompt-chunk 1: --arena-mb 1 or more)"));
}

TEST(EngineErrors, PinnedSmallArenaShrinksTheAutomaticChunk) {
  // Only the arena pinned: the automatic chunk shrinks until one layer's top-k fits (15 slots /
  // top-8 = 1 token), so any prompt runs, and gives the logits of a roomy arena.
  engine::EngineOptions o = small();
  o.arena_mb = 1;
  engine::Engine eng(test::shipped_model(), o);
  EXPECT_EQ(eng.options().prompt_chunk, 1);
  const std::vector<int32_t> ids = {16, 53, 90, 127, 164, 201};
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, ids, model::LogitsMode::Last, logits);
  engine::EngineOptions big = small();
  big.arena_mb = 40;
  engine::Engine ref(test::shipped_model(), big);
  model::SequenceState st2 = ref.new_sequence();
  std::vector<float> ref_logits;
  ref.prefill(st2, ids, model::LogitsMode::Last, ref_logits);
  EXPECT_EQ(logits, ref_logits);
}

TEST(EngineErrors, NegativeSettingsAreRefused) {
  {
    engine::EngineOptions o = small();
    o.n_ctx = -5;
    EXPECT_THAT(error_of<engine::EngineError>([&] { engine::Engine eng(test::shipped_model(), o); }),
                HasSubstr("--ctx-size must be positive"));
  }
  {
    engine::EngineOptions o = small();
    o.n_threads = -3;
    EXPECT_THAT(error_of<engine::EngineError>([&] { engine::Engine eng(test::shipped_model(), o); }),
                HasSubstr("--threads must be between 0"));
  }
  for (int layers : {0, 3}) {
    engine::EngineOptions o = small();
    o.read_ahead_layers = layers;
    EXPECT_THAT(error_of<engine::EngineError>([&] { engine::Engine eng(test::shipped_model(), o); }),
                HasSubstr("--read-ahead-layers must be 1 or 2, got " + std::to_string(layers)));
  }
}

TEST(EngineErrors, InterruptStopsBeforeTheNextLayerAndTheSequenceStaysUsable) {
  // A set flag stops the forward before its first MoE layer: nothing is consumed or counted;
  // cleared, the same call gives the logits of an engine that was never interrupted.
  engine::Engine eng(test::shipped_model(), small());
  std::atomic<bool> stop{true};
  eng.set_interrupt(&stop);
  auto st = eng.new_sequence();
  const std::vector<int32_t> ids = {5, 6, 7, 8, 9};
  std::vector<float> logits, ref;
  EXPECT_THAT(error_of<model::Interrupted>([&] { eng.prefill(st, ids, model::LogitsMode::Last, logits); }),
              HasSubstr("interrupted before layer 0"));
  EXPECT_EQ(st.n_past, 0);
  EXPECT_EQ(eng.prefill_stats().tokens, 0);
  stop = false;
  eng.prefill(st, ids, model::LogitsMode::Last, logits);
  EXPECT_EQ(st.n_past, 5);
  EXPECT_EQ(eng.prefill_stats().tokens, 5);
  engine::Engine fresh(test::shipped_model(), small());
  auto st2 = fresh.new_sequence();
  fresh.prefill(st2, ids, model::LogitsMode::Last, ref);
  EXPECT_EQ(logits, ref);
}
