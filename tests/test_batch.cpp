// A forward over a batch of sequences (Engine::forward_batch, model::SeqInput): each sequence's
// logits and state are bit-identical to running it alone, whatever it is batched with, and the
// batch shares the layer's expert reads. Also --dump: the named intermediates of a run, byte-equal
// across runs and arena sizes, with result_output equal to the logits.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/engine.h"
#include "support/options.h"
#include "support/paths.h"

using namespace strata;
using ::testing::HasSubstr;

namespace {

engine::EngineOptions opts(int64_t arena_mb) {
  engine::EngineOptions o = test::engine_options(/*n_threads=*/2, /*n_ctx=*/128, arena_mb);
  return o;
}

const std::vector<int32_t> kA = {16, 53, 90, 127, 164, 201, 238, 275, 312};
const std::vector<int32_t> kB = {700, 41, 1999, 5};
const std::vector<int32_t> kC = {1234};

// The logits of each prompt run alone (All positions), then of one more token after it.
struct Alone {
  std::vector<float> prompt, next;
};
Alone run_alone(engine::Engine& eng, const std::vector<int32_t>& ids, int32_t next) {
  Alone a;
  model::SequenceState st = eng.new_sequence();
  eng.prefill(st, ids, model::LogitsMode::All, a.prompt);
  eng.decode(st, next, a.next);
  return a;
}

}  // namespace

TEST(Batch, EachSequenceEqualsItselfAlone) {
  for (const std::string& path : {test::shipped_model(), test::shipped_qwen3next()}) {
    SCOPED_TRACE(path);
    engine::Engine eng(path, opts(40));
    const Alone a = run_alone(eng, kA, 7), b = run_alone(eng, kB, 8), c = run_alone(eng, kC, 9);
    // The three prompts in one forward call, then their next tokens in another (a decode batch).
    model::SequenceState sa = eng.new_sequence(), sb = eng.new_sequence(), sc = eng.new_sequence();
    std::vector<float> la, lb, lc;
    std::vector<model::SeqInput> batch = {{&sa, kA, model::LogitsMode::All, &la},
                                          {&sb, kB, model::LogitsMode::All, &lb},
                                          {&sc, kC, model::LogitsMode::All, &lc}};
    eng.forward_batch(batch);
    EXPECT_EQ(la, a.prompt);
    EXPECT_EQ(lb, b.prompt);
    EXPECT_EQ(lc, c.prompt);
    const int32_t na[1] = {7}, nb[1] = {8}, nc[1] = {9};
    std::vector<model::SeqInput> step = {{&sa, na, model::LogitsMode::Last, &la},
                                         {&sb, nb, model::LogitsMode::Last, &lb},
                                         {&sc, nc, model::LogitsMode::Last, &lc}};
    eng.forward_batch(step);
    EXPECT_EQ(la, a.next);
    EXPECT_EQ(lb, b.next);
    EXPECT_EQ(lc, c.next);
    EXPECT_EQ(sa.n_past, int64_t(kA.size()) + 1);
  }
}

TEST(Batch, SharesTheLayersExpertReads) {
  // Decoding three sequences in one step needs each layer's union of experts once; three
  // separate steps ask for each sequence's experts again.
  engine::Engine eng(test::shipped_model(), opts(40));
  model::SequenceState s[3] = {eng.new_sequence(), eng.new_sequence(), eng.new_sequence()};
  std::vector<float> l[3];
  const std::vector<int32_t>* prompts[3] = {&kA, &kB, &kC};
  for (int i = 0; i < 3; ++i) eng.prefill(s[i], *prompts[i], model::LogitsMode::Last, l[i]);
  eng.reset_stats();
  const int32_t next[3] = {7, 8, 9};
  std::vector<model::SeqInput> step;
  for (int i = 0; i < 3; ++i)
    step.push_back({&s[i], std::span<const int32_t>(&next[i], 1), model::LogitsMode::Last, &l[i]});
  eng.forward_batch(step);
  const uint64_t batched = eng.decode_stats().stream.needed;
  EXPECT_EQ(eng.decode_stats().tokens, 3);
  // each of the 8 layers needs at least top-8 and at most 3 x top-8 distinct experts
  EXPECT_GE(batched, 8u * 8u);
  EXPECT_LT(batched, 3u * 8u * 8u);
}

TEST(Batch, BadEntriesAreNamed) {
  engine::Engine eng(test::shipped_model(), opts(40));
  model::SequenceState sa = eng.new_sequence();
  std::vector<float> la;
  const std::vector<int32_t> bad = {1, 9999999};
  std::vector<model::SeqInput> twice = {{&sa, kA, model::LogitsMode::Last, &la},
                                        {&sa, kB, model::LogitsMode::Last, &la}};
  try {
    eng.forward_batch(twice);
    FAIL() << "expected EngineError";
  } catch (const engine::EngineError& e) {
    EXPECT_THAT(e.what(), HasSubstr("share a state"));
  }
  std::vector<model::SeqInput> oov = {{&sa, bad, model::LogitsMode::Last, &la}};
  try {
    eng.forward_batch(oov);
    FAIL() << "expected EngineError";
  } catch (const engine::EngineError& e) {
    EXPECT_THAT(e.what(), HasSubstr("batch entry 0"));
    EXPECT_THAT(e.what(), HasSubstr("out of the vocabulary"));
  }
  EXPECT_EQ(sa.n_past, 0);
}

namespace {
std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
}  // namespace

TEST(Dump, NamedIntermediatesAreByteEqualAcrossRunsAndArenas) {
  const auto dir = std::filesystem::temp_directory_path() / ("strata-dump-" + std::to_string(::getpid()));
  std::vector<float> logits[2];
  for (int run = 0; run < 2; ++run) {
    engine::EngineOptions o = opts(run == 0 ? 40 : 5);  // every expert resident vs. one layer's worth
    o.prompt_chunk = 16;                                // one forward call for the 9 tokens in both
    o.dump_dir = (dir / std::to_string(run)).string();
    o.dump_filter = "attn_norm-.*|ffn_moe_out-.*|l_out-7|result_output";
    engine::Engine eng(test::shipped_model(), o);
    model::SequenceState st = eng.new_sequence();
    eng.prefill(st, kA, model::LogitsMode::All, logits[run]);
  }
  const std::string index0 = read_file(dir / "0" / "index.tsv"), index1 = read_file(dir / "1" / "index.tsv");
  EXPECT_EQ(index0, index1);
  // 8 attn_norm + 8 ffn_moe_out + l_out-7 + result_output; the names carry the layer
  int lines = 0;
  std::istringstream in(index0);
  for (std::string line; std::getline(in, line);) {
    ++lines;
    const std::string file = line.substr(0, line.find('\t'));
    EXPECT_EQ(read_file(dir / "0" / file), read_file(dir / "1" / file)) << file;
  }
  EXPECT_EQ(lines, 18);
  EXPECT_THAT(index0, HasSubstr("ffn_moe_out-7\t0\t256\t9"));
  // result_output is the logits, all 9 positions
  const std::string out = read_file(dir / "0" / "00000-result_output.f32");
  ASSERT_EQ(out.size(), logits[0].size() * sizeof(float));
  EXPECT_EQ(0, std::memcmp(out.data(), logits[0].data(), out.size()));
  EXPECT_EQ(logits[0], logits[1]);
  std::filesystem::remove_all(dir);
}

TEST(Dump, BadFilterAndDirectoryAreClearErrors) {
  engine::EngineOptions o = opts(40);
  o.dump_dir = "/proc/strata-cannot-write-here";
  EXPECT_THROW(engine::Engine(test::shipped_model(), o), engine::EngineError);
  o.dump_dir = (std::filesystem::temp_directory_path() / "strata-dump-bad").string();
  o.dump_filter = "([";
  try {
    engine::Engine eng(test::shipped_model(), o);
    FAIL() << "expected EngineError";
  } catch (const engine::EngineError& e) {
    EXPECT_THAT(e.what(), HasSubstr("--dump-filter"));
  }
  std::filesystem::remove_all(o.dump_dir);
}
