// Mixtral ("llama" with routed experts, src/model/arch/mixtral.cpp) against an independent
// reference: tests/data/moe_reference.py, a standard-library Python forward written from the
// Mixtral paper and GGUF's documented layout (double precision), on a tiny all-F32 model written
// by `strata synth --like mixtral-tiny --type F32` (2 layers, 4 heads / 2 kv of 16, 4 experts
// top-2, random weights). No fixture of this family exists; the test skips when python3 is
// absent.
//
// Tolerance: 1e-5 absolute on every logit of every position (logits are ~0.6 at most here; fp32
// against double differs by ~1e-7, measured 1.0e-7). A wrong RoPE layout (NEOX instead of NORM)
// moves them by 7.2e-3, no renormalization of the top-2 weights by 2.1e-2 and flips a top-1
// (measured by switching each in mixtral.cpp while writing this test).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include "engine/engine.h"
#include "support/gguf_edit.h"
#include "support/paths.h"
#include "support/reference.h"
#include "support/synth_model.h"

using namespace strata;
using ::testing::HasSubstr;

TEST(Mixtral, MatchesTheIndependentReference) {
  int rc = 0;
  test::run_command("python3 -c 'import json, struct' 2>&1", &rc);
  if (rc != 0) GTEST_SKIP() << "python3 absent: no reference to compare with";
  test::SynthModel m("mixtral-tiny");
  const std::vector<int32_t> ids = {5, 77, 1000, 42, 8000, 3, 3, 4096, 17};
  std::string list;
  for (int32_t t : ids) list += (list.empty() ? "" : ",") + std::to_string(t);
  const std::string out =
      test::run_command("python3 " + test::data_path("moe_reference.py") + " " + m.path + " " + list, &rc);
  ASSERT_EQ(rc, 0) << out;
  const auto ref = nlohmann::json::parse(out)["logits"];
  ASSERT_EQ(ref.size(), ids.size());

  engine::EngineOptions o;
  o.n_threads = 2;
  o.arena_mb = 8;  // every expert record (24 KiB) fits; streaming: ChunksThreadsArenaAndDecodeAreBitIdentical
  engine::Engine eng(m.path, o);
  EXPECT_EQ(eng.hparams().arch, "llama");
  EXPECT_EQ(eng.hparams().n_ff_exp, 32);  // feed_forward_length: the converter writes no expert width
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, ids, model::LogitsMode::All, logits);
  const size_t V = size_t(eng.hparams().n_vocab);
  ASSERT_EQ(logits.size(), V * ids.size());
  double max_err = 0, max_abs = 0;
  int top1_equal = 0;
  for (size_t t = 0; t < ids.size(); ++t) {
    const auto r = ref[t].get<std::vector<double>>();
    ASSERT_EQ(r.size(), V);
    size_t best_r = 0, best_o = 0;
    for (size_t i = 0; i < V; ++i) {
      max_err = std::max(max_err, std::abs(double(logits[t * V + i]) - r[i]));
      max_abs = std::max(max_abs, std::abs(r[i]));
      if (r[i] > r[best_r]) best_r = i;
      if (logits[t * V + i] > logits[t * V + best_o]) best_o = i;
    }
    top1_equal += best_r == best_o;
  }
  std::printf("[mixtral vs moe_reference.py] max |logit err| %.3g (logits up to %.3g), top-1 equal %d/%zu\n", max_err,
              max_abs, top1_equal, ids.size());
  EXPECT_LE(max_err, 1e-5);
  EXPECT_GT(max_abs, 0.1);  // not a degenerate model
  EXPECT_EQ(top1_equal, int(ids.size()));
}

TEST(Mixtral, ChunksThreadsArenaAndDecodeAreBitIdentical) {
  test::SynthModel m("mixtral-tiny");
  engine::EngineOptions o;
  o.n_threads = 2;
  o.arena_mb = 8;
  test::expect_invariance(m.path, o, {5, 77, 1000, 42, 8000, 3, 3, 4096, 17});  // 8 experts of 24 KiB
}

TEST(Mixtral, MalformedFilesAreNamed) {
  test::SynthModel m("mixtral-tiny");
  test::GgufEdit d;
  d.drop = {"blk.1.ffn_up_exps.weight"};
  EXPECT_THAT(test::edited_load_error(m.path, d, "mixtral-d"), HasSubstr("blk.1.ffn_up_exps.weight"));
  test::GgufEdit r;
  r.copies = {{"rope_freqs.weight", "output_norm.weight"}};
  EXPECT_THAT(test::edited_load_error(m.path, r, "mixtral-r"), HasSubstr("'rope_freqs.weight'"));
  test::GgufEdit dense;  // a dense llama (no ffn_gate_exps) is not this architecture
  dense.drop = {"blk.0.ffn_gate_exps.weight"};
  EXPECT_THAT(test::edited_load_error(m.path, dense, "mixtral-dense"), HasSubstr("llama"));
}
