// Every quantized fixture end to end against llama.cpp: feed llama.cpp's greedy trajectory
// teacher-forced (one prefill over prompt + continuation) and check that our top-1 equals
// llama.cpp's next token at every step where llama.cpp's top-2 probabilities differ by more
// than 0.02 (closer than that, a different summation order may legitimately flip the pick).
// The agreement rate over all steps is printed too.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "support/paths.h"
#include "support/reference.h"

using namespace strata;

namespace {

struct Agreement {
  int steps = 0, agree = 0, checked = 0, checked_agree = 0;
};

Agreement teacher_forced(const std::string& model_path, const nlohmann::json& runs) {
  engine::EngineOptions o;
  o.n_threads = 2;
  o.arena_mb = 64;
  o.use_pack = false;
  engine::Engine eng(model_path, o);
  const int V = eng.hparams().n_vocab;
  Agreement a;
  for (const auto& run : runs) {
    auto seq = run["ids"].get<std::vector<int32_t>>();
    const auto greedy = run["greedy"].get<std::vector<int32_t>>();
    const size_t n_prompt = seq.size();
    seq.insert(seq.end(), greedy.begin(), greedy.end() - 1);
    model::SequenceState st = eng.new_sequence();
    std::vector<float> logits;
    eng.prefill(st, seq, model::LogitsMode::All, logits);
    for (size_t i = 0; i < greedy.size(); ++i) {
      const float* row = logits.data() + (n_prompt - 1 + i) * V;
      const int32_t ours = int32_t(std::max_element(row, row + V) - row);
      const auto& top = run["top5"][i];
      const double p1 = std::exp(top[0][1].get<double>()), p2 = std::exp(top[1][1].get<double>());
      ++a.steps;
      a.agree += ours == greedy[i];
      if (p1 - p2 > 0.02) {
        ++a.checked;
        a.checked_agree += ours == greedy[i];
        EXPECT_EQ(ours, greedy[i]) << model_path << ": step " << i << " of \"" << run["text"].get<std::string>()
                                   << "\", llama.cpp p1 " << p1 << " p2 " << p2;
      }
    }
  }
  return a;
}

class QuantizedFixture : public ::testing::TestWithParam<const char*> {};

}  // namespace

TEST_P(QuantizedFixture, TopOneMatchesLlamaCppTeacherForced) {
  STRATA_REQUIRE_FIXTURES(fx);
  const std::string name = GetParam();
  const auto ref = test::load_json(fx + "/ref/llamacpp-greedy.json");
  ASSERT_TRUE(ref["models"].contains(name));
  const Agreement a = teacher_forced(fx + "/models/" + name, ref["models"][name]);
  std::printf("[%s] agreement with llama.cpp: %d/%d steps (%.1f %%); where its top-2 gap > 0.02: %d/%d\n",
              name.c_str(), a.agree, a.steps, 100.0 * a.agree / std::max(1, a.steps), a.checked_agree, a.checked);
  EXPECT_GT(a.checked, a.steps / 2);
}

INSTANTIATE_TEST_SUITE_P(AllFiles, QuantizedFixture,
                         ::testing::Values("qwen3moe-code-bf16.gguf", "qwen3moe-code-Q8_0.gguf",
                                           "qwen3moe-code-Q4_K_M.gguf", "qwen3moe-code-IQ2_XS.gguf",
                                           "qwen3moe-code-IQ3_S.gguf"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return s;
                         });

TEST(QuantizedFixture, Iq4XsAgreesWithLlamaCppOnMostSteps) {
  // Known fixture defect, not an engine bug: in llamacpp-greedy.json the entry for
  // "qwen3moe-code-IQ4_XS.gguf" is an exact copy of the "qwen3moe-code-Q8_0.gguf" entry
  // (deep-equal JSON: same greedy ids and top-5 log-probs), so it is llama.cpp's Q8_0 output.
  // Evidence: our Q8_0 file scored against that entry gives mean |dp| 0.0015 (max 0.056), the
  // same as against the Q8_0 entry, while our IQ4_XS file gives 0.0078 (max 0.207); at
  // "    for i in range(len(" step 39 the entry has 1673/410 = 0.395/0.220, our Q8_0 0.409/0.217,
  // our IQ4_XS 0.313/0.326. Our IQ4_XS side checked independently: a numpy dequant of all 56
  // IQ4_XS/IQ4_NL tensors (blk.0.attn_k sum/sumsq equal gguf-py's in dequant.json) written as F32
  // gives bit-identical logits through the engine, and a numpy forward pass reproduces our 0.0078;
  // emulating llama.cpp's Q8_K/Q8_0 activation quantization (and an F16 KV cache) leaves it at
  // 0.0077-0.0080 (step 39: 0.340/0.297). Until the fixture is regenerated with the real IQ4_XS
  // output this file gets the weaker check below instead of the strict one above.
  STRATA_REQUIRE_FIXTURES(fx);
  const auto ref = test::load_json(fx + "/ref/llamacpp-greedy.json");
  ::testing::ScopedTrace note(__FILE__, __LINE__, "weaker check: see the comment above");
  engine::EngineOptions o;
  o.n_threads = 2;
  o.arena_mb = 64;
  o.use_pack = false;
  const std::string name = "qwen3moe-code-IQ4_XS.gguf";
  engine::Engine eng(fx + "/models/" + name, o);
  const int V = eng.hparams().n_vocab;
  int steps = 0, agree = 0, checked = 0, checked_agree = 0;
  for (const auto& run : ref["models"][name]) {
    auto seq = run["ids"].get<std::vector<int32_t>>();
    const auto greedy = run["greedy"].get<std::vector<int32_t>>();
    const size_t n_prompt = seq.size();
    seq.insert(seq.end(), greedy.begin(), greedy.end() - 1);
    model::SequenceState st = eng.new_sequence();
    std::vector<float> logits;
    eng.prefill(st, seq, model::LogitsMode::All, logits);
    for (size_t i = 0; i < greedy.size(); ++i) {
      const float* row = logits.data() + (n_prompt - 1 + i) * V;
      const bool same = int32_t(std::max_element(row, row + V) - row) == greedy[i];
      const auto& top = run["top5"][i];
      ++steps;
      agree += same;
      if (std::exp(top[0][1].get<double>()) - std::exp(top[1][1].get<double>()) > 0.02) {
        ++checked;
        checked_agree += same;
      }
    }
  }
  std::printf("[%s] agreement with llama.cpp: %d/%d steps; where its top-2 gap > 0.02: %d/%d\n", name.c_str(), agree,
              steps, checked_agree, checked);
  EXPECT_GE(checked_agree, checked - 1);  // today: 143/144
}

TEST(QuantizedFixture, Bf16UnchangedByTheNewTypes) {
  // The BF16 fixture still gives the transformers results it gave before the quantized
  // types landed (same check as test_forward, kept here next to the other files).
  STRATA_REQUIRE_FIXTURES(fx);
  engine::EngineOptions o;
  o.n_threads = 2;
  o.arena_mb = 64;
  o.load.rope_freqs_bf16 = true;
  engine::Engine eng(fx + "/models/qwen3moe-code-bf16.gguf", o);
  test::ParityReport rep;
  test::compare_with_hf(eng, test::load_json(fx + "/ref/qwen3moe-code.hf.json"), rep);
  EXPECT_EQ(rep.top1_mismatch, 0);
  EXPECT_LE(rep.max_logit_err, 1e-3);
}
