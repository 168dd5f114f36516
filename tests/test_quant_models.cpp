// Every quantized fixture end to end against llama.cpp: feed llama.cpp's greedy trajectory
// teacher-forced (one prefill over prompt + continuation) and check that our top-1 equals
// llama.cpp's next token at every step where llama.cpp's top-2 probabilities differ by more
// than 0.02 (closer than that, a different summation order may legitimately flip the pick).
// The agreement rate over all steps is printed too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "backend/cpu/kernels/kernels.h"
#include "support/paths.h"
#include "support/reference.h"

using namespace strata;

namespace {

struct Agreement {
  int steps = 0, agree = 0, checked = 0, checked_agree = 0;
  double max_logprob_err = 0;  ///< over llama.cpp's top-5 log-probabilities at every step
};

Agreement teacher_forced(const std::string& model_path, const nlohmann::json& runs, cpu::kernels::ActQuant act) {
  engine::EngineOptions o;
  o.act_quant = act;
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
      double mx = row[0], sum = 0;
      for (int v = 0; v < V; ++v) mx = std::max(mx, double(row[v]));
      for (int v = 0; v < V; ++v) sum += std::exp(double(row[v]) - mx);
      for (const auto& e : top) {
        const double ours_lp = double(row[e[0].get<int>()]) - mx - std::log(sum);
        a.max_logprob_err = std::max(a.max_logprob_err, std::fabs(ours_lp - e[1].get<double>()));
      }
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
  // Reference defect found here: the IQ4_XS entry of llamacpp-greedy.json is a byte-for-byte
  // copy of the Q8_0 entry (same trajectories and top-5 log-probs), so it is not llama.cpp's
  // IQ4_XS output. Checked independently: a numpy forward pass of the IQ4_XS file reproduces
  // our probabilities, and the IQ4_XS tensors rewritten as F32 give identical logits. Skip
  // (saying so) while the entry is a copy; once it is regenerated the strict check runs.
  if (name != "qwen3moe-code-Q8_0.gguf" && ref["models"][name] == ref["models"]["qwen3moe-code-Q8_0.gguf"])
    GTEST_SKIP() << name << ": its llamacpp-greedy.json entry is a copy of the Q8_0 entry (reference defect)";
  for (cpu::kernels::ActQuant act : {cpu::kernels::ActQuant::Q8, cpu::kernels::ActQuant::F32}) {
    const Agreement a = teacher_forced(fx + "/models/" + name, ref["models"][name], act);
    std::printf(
        "[%s, %s activations] agreement with llama.cpp: %d/%d steps (%.1f %%); where its top-2 gap > 0.02: "
        "%d/%d; max |log-prob - llama.cpp's| over its top 5: %.3f\n",
        name.c_str(), cpu::kernels::act_quant_name(act), a.agree, a.steps, 100.0 * a.agree / std::max(1, a.steps),
        a.checked_agree, a.checked, a.max_logprob_err);
    EXPECT_GT(a.checked, a.steps / 2);
  }
}

INSTANTIATE_TEST_SUITE_P(AllFiles, QuantizedFixture,
                         ::testing::Values("qwen3moe-code-bf16.gguf", "qwen3moe-code-Q8_0.gguf",
                                           "qwen3moe-code-Q4_K_M.gguf", "qwen3moe-code-IQ2_XS.gguf",
                                           "qwen3moe-code-IQ3_S.gguf", "qwen3moe-code-IQ4_XS.gguf"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return s;
                         });

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
