// The qwen3moe forward pass against two independent references:
//  - transformers in fp32 on the dequantized Q8_0 weights (exact for the shipped model),
//  - transformers in fp32 on the BF16 model (shared fixtures),
// and greedy continuations against transformers (and, on BF16, llama.cpp, which agrees).
//
// Tolerance on logits: 1e-3 absolute. Why: both sides compute in fp32 but sum in different
// orders (our kernels keep vector partial sums, torch uses its own blocking); over 8 layers
// of width 256 with logits of magnitude ~10-20 the reordering error measured here is
// 2e-5 to 4e-5 (printed by each test); 1e-3 leaves a 25x margin and still catches a wrong
// epsilon, a missing norm or a wrong rounding, each of which moves logits by > 1e-2.
// Routing probabilities: 1e-4 absolute (measured: ~2e-6).
//
// The BF16 reference was computed by transformers with the checkpoint loaded in bf16: its
// RoPE inverse frequencies (a non-persistent buffer cast with the model) are bf16-rounded.
// With exact fp32 frequencies our logits drift from that reference with position (0.003 at
// position 5, 0.78 at position 363), with bf16-rounded ones they match to 2e-5. So the
// teacher-forced BF16 comparison runs with LoadOptions::rope_freqs_bf16; greedy runs use
// exact frequencies and must still equal both transformers and llama.cpp.
#include <gtest/gtest.h>

#include <cstdio>

#include "backend/cpu/kernels/kernels.h"
#include "support/paths.h"
#include "support/reference.h"

using namespace strata;

namespace {

constexpr double kLogitTol = 1e-3;
constexpr double kRouteProbTol = 1e-4;

engine::EngineOptions default_options() {
  engine::EngineOptions o;
  o.n_threads = 2;
  o.arena_mb = 0;
  return o;
}

}  // namespace

TEST(Forward, ShippedQ8_0MatchesTransformers) {
  engine::EngineOptions o = default_options();
  o.act_quant = cpu::kernels::ActQuant::F32;  // exact mode: weights expanded, activations fp32
  engine::Engine eng(test::shipped_model(), o);
  const auto ref = test::load_json(test::data_path("qwen3moe-code-Q8_0.hf.json"));
  test::ParityReport rep;
  test::compare_with_hf(eng, ref, rep);
  test::print_report("Q8_0 f32 activations vs transformers", rep);
  test::expect_parity(rep, kLogitTol, kRouteProbTol);
}

// The default q8 activations (int8 codes per block of 32, as llama.cpp computes on CPU) cost
// accuracy against the fp32 transformers reference. Measured: top-1 mismatches 9-10 of 1129
// checked positions (where the top two logits were close), max |dlogit| over the top 20
// 0.96-0.98, logsumexp 0.38-0.44, routing-set mismatches 264-265 of ~8670 (3.0 %), max |dprob|
// 0.039. The bounds below are those numbers with ~50 % margin: a regression test of the
// documented cost (docs/kernels.md), not a parity claim. Greedy continuations are not compared:
// one of them meets a near-tie at its 20th token, where a change of fp32 rounding order in the
// q8 kernels already flipped the choice.
TEST(Forward, ShippedQ8_0WithQ8ActivationsNearTransformers) {
  engine::EngineOptions o = default_options();
  o.act_quant = cpu::kernels::ActQuant::Q8;
  engine::Engine eng(test::shipped_model(), o);
  const auto ref = test::load_json(test::data_path("qwen3moe-code-Q8_0.hf.json"));
  test::ParityReport r;
  test::compare_with_hf(eng, ref, r);
  test::print_report("Q8_0 q8 activations vs transformers", r);
  EXPECT_GT(r.top1_checked, r.positions / 2);
  EXPECT_LE(r.top1_mismatch, r.top1_checked * 15 / 1000);
  EXPECT_LE(r.max_logit_err, 1.5);
  EXPECT_LE(r.max_lse_err, 0.6);
  EXPECT_LE(r.routes_mismatch, r.routes_checked * 45 / 1000);
  EXPECT_LE(r.max_route_prob_err, 0.06);
}

TEST(Forward, ShippedQ8_0GreedyMatchesTransformers) {
  engine::EngineOptions o = default_options();
  o.act_quant = cpu::kernels::ActQuant::F32;
  engine::Engine eng(test::shipped_model(), o);
  test::expect_greedy(eng, test::load_json(test::data_path("qwen3moe-code-Q8_0.hf.json"))["greedy"], "transformers");
}

TEST(Forward, Bf16MatchesTransformers) {
  STRATA_REQUIRE_FIXTURES(fx);
  engine::EngineOptions o = default_options();
  o.load.rope_freqs_bf16 = true;  // as the reference computed RoPE (see the top of this file)
  engine::Engine eng(fx + "/models/qwen3moe-code-bf16.gguf", o);
  const auto ref = test::load_json(fx + "/ref/qwen3moe-code.hf.json");
  test::ParityReport rep;
  test::compare_with_hf(eng, ref, rep);
  test::print_report("BF16 vs transformers", rep);
  test::expect_parity(rep, kLogitTol, kRouteProbTol);
}

TEST(Forward, Bf16GreedyMatchesTransformersAndLlamaCpp) {
  STRATA_REQUIRE_FIXTURES(fx);
  engine::Engine eng(fx + "/models/qwen3moe-code-bf16.gguf", default_options());
  const auto ref = test::load_json(fx + "/ref/qwen3moe-code.hf.json");
  test::expect_greedy(eng, ref["greedy"], "transformers");
  // llama.cpp's greedy trajectories for the same prompts (they agree with transformers on BF16).
  test::expect_greedy(eng, test::load_json(fx + "/ref/llamacpp-greedy.json")["models"]["qwen3moe-code-bf16.gguf"],
                      "llama.cpp");
}
