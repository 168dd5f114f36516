// MiniMax-M2 (src/model/arch/minimax-m2.cpp) against an independent reference:
// tests/data/moe_reference.py, a standard-library Python forward written from MiniMax-M2's model
// card and config (full-width q/k RMSNorm, partial NEOX rotary, sigmoid routing with a selection
// bias) and GGUF's layout (double precision), on a tiny all-F32 model written by
// `strata synth --like minimax-m2-tiny --type F32` (2 layers, 4 heads / 2 kv of 16 with 8 rotary
// dims, 8 experts top-2, random weights, selection biases ~1 +- 0.1 that move the choice). No
// fixture of this family exists; the test skips when python3 is absent.
//
// Tolerance: 1e-5 absolute on every logit of every position (fp32 against double; the logits
// reach ~0.5 here). The same reference with q/k normed per head instead of over the whole row
// (--per-head-qk-norm) must be more than 10x that away from strata, or the test could not tell
// the two apart (asserted below).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include "engine/engine.h"
#include "gguf/gguf_writer.h"
#include "support/gguf_edit.h"
#include "support/paths.h"
#include "support/reference.h"
#include "support/synth_model.h"

using namespace strata;
using ::testing::HasSubstr;

namespace {

const std::vector<int32_t> kIds = {5, 77, 1000, 42, 8000, 3, 3, 4096, 17};

// The reference's logits [position][vocab] for kIds (`flags` passed to moe_reference.py).
std::vector<std::vector<double>> reference(const std::string& model, const std::string& flags) {
  std::string list;
  for (int32_t t : kIds) list += (list.empty() ? "" : ",") + std::to_string(t);
  int rc = 0;
  const std::string out =
      test::run_command("python3 " + test::data_path("moe_reference.py") + " " + model + " " + list + " " + flags, &rc);
  EXPECT_EQ(rc, 0) << out;
  std::vector<std::vector<double>> r;
  if (rc != 0) return r;
  const nlohmann::json j = nlohmann::json::parse(out);
  for (const auto& row : j["logits"]) r.push_back(row.get<std::vector<double>>());
  return r;
}

// max |a - b| over every logit; top1_equal counts positions whose argmax agrees.
double max_err(const std::vector<float>& logits, const std::vector<std::vector<double>>& ref, size_t V,
               int* top1_equal = nullptr, double* max_abs = nullptr) {
  double e = 0;
  for (size_t t = 0; t < ref.size(); ++t) {
    size_t best_r = 0, best_o = 0;
    for (size_t i = 0; i < V; ++i) {
      e = std::max(e, std::abs(double(logits[t * V + i]) - ref[t][i]));
      if (max_abs) *max_abs = std::max(*max_abs, std::abs(ref[t][i]));
      if (ref[t][i] > ref[t][best_r]) best_r = i;
      if (logits[t * V + i] > logits[t * V + best_o]) best_o = i;
    }
    if (top1_equal) *top1_equal += best_r == best_o;
  }
  return e;
}

}  // namespace

TEST(MiniMaxM2, MatchesTheIndependentReference) {
  int rc = 0;
  test::run_command("python3 -c 'import json, struct' 2>&1", &rc);
  if (rc != 0) GTEST_SKIP() << "python3 absent: no reference to compare with";
  test::SynthModel m("minimax-m2-tiny");
  const auto ref = reference(m.path, "");
  ASSERT_EQ(ref.size(), kIds.size());

  engine::EngineOptions o;
  o.n_threads = 2;
  o.arena_mb = 8;  // every expert record (24 KiB) fits; streaming is tested below
  engine::Engine eng(m.path, o);
  EXPECT_EQ(eng.hparams().arch, "minimax-m2");
  EXPECT_EQ(eng.hparams().n_rot, 8);  // partial rotary from rope.dimension_count
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, kIds, model::LogitsMode::All, logits);
  const size_t V = size_t(eng.hparams().n_vocab);
  ASSERT_EQ(logits.size(), V * kIds.size());
  ASSERT_EQ(ref[0].size(), V);
  int top1_equal = 0;
  double max_abs = 0;
  const double err = max_err(logits, ref, V, &top1_equal, &max_abs);
  const auto wrong = reference(m.path, "--per-head-qk-norm");
  ASSERT_EQ(wrong.size(), kIds.size());
  const double err_wrong = max_err(logits, wrong, V);
  std::printf(
      "[minimax-m2 vs moe_reference.py] max |logit err| %.3g (logits up to %.3g), top-1 equal %d/%zu; "
      "vs the per-head-norm reference %.3g\n",
      err, max_abs, top1_equal, kIds.size(), err_wrong);
  EXPECT_LE(err, 1e-5);
  EXPECT_GT(max_abs, 0.1);  // not a degenerate model
  EXPECT_EQ(top1_equal, int(kIds.size()));
  EXPECT_GT(err_wrong, 1e-4);  // the tolerance separates full-width from per-head q/k norm
}

TEST(MiniMaxM2, ChunksThreadsArenaAndDecodeAreBitIdentical) {
  test::SynthModel m("minimax-m2-tiny");
  engine::EngineOptions o;
  o.n_threads = 2;
  o.arena_mb = 8;
  test::expect_invariance(m.path, o, kIds);  // 16 experts of 24 KiB; the smallest arena: 2 slots
}

TEST(MiniMaxM2, MalformedFilesAreNamed) {
  test::SynthModel m("minimax-m2-tiny");
  test::GgufEdit d;
  d.drop = {"blk.1.attn_k_norm.weight"};
  EXPECT_THAT(test::edited_load_error(m.path, d, "minimax-d"), HasSubstr("blk.1.attn_k_norm.weight"));
  test::GgufEdit b;
  b.drop = {"blk.0.exp_probs_b.bias"};
  EXPECT_THAT(test::edited_load_error(m.path, b, "minimax-b"), HasSubstr("blk.0.exp_probs_b.bias"));
  test::GgufEdit r;  // a per-head q norm is not this architecture's
  r.reshape = "blk.0.attn_q_norm.weight";
  r.ne = {16};
  EXPECT_THAT(test::edited_load_error(m.path, r, "minimax-r"), HasSubstr("blk.0.attn_q_norm.weight"));
  test::GgufEdit g;
  g.set_kv = {{"minimax-m2.expert_gating_func", gguf::make_u32(3)}};
  EXPECT_THAT(test::edited_load_error(m.path, g, "minimax-g"), HasSubstr("expert_gating_func"));
}
