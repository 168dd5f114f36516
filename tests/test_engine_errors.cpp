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
  engine::EngineOptions o = small();
  o.arena_mb = 1;  // one layer of a 512-token chunk needs all 64 experts (~3.4 MiB)
  o.prompt_chunk = 512;
  const std::string msg = error_of<stream::ArenaTooSmall>([&] { engine::Engine eng(test::shipped_model(), o); });
  EXPECT_THAT(msg, HasSubstr("--arena-mb"));
  EXPECT_THAT(msg, HasSubstr("64"));
  // An automatic chunk shrinks to what the pinned arena holds (15 slots: one token of top-8)...
  o.prompt_chunk = 0;
  {
    engine::Engine eng(test::shipped_model(), o);
    EXPECT_EQ(eng.options().prompt_chunk, 1);
  }
  // ...but not below one token: fewer slots than top-k is still an error naming the minimum.
  o.arena_mb = 0;
  o.arena_bytes = 4 * 68 * 1024;
  EXPECT_THAT(error_of<stream::ArenaTooSmall>([&] { engine::Engine eng(test::shipped_model(), o); }),
              HasSubstr("one layer can need 8 at once"));
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
}
