// The glm4moe forward pass (q/k/v biases, per-head q/k norm, partial NEOX rotary, a leading
// dense layer, sigmoid routing with a selection bias and scaled weights, one ungated shared
// expert) against transformers 5.17 in fp32 on the BF16 weights (../shared/fixtures/ref/
// glm4moe-tiny.hf.json, exact RoPE frequencies) and llama.cpp's greedy continuations, which
// agree with transformers on this file.
//
// Tolerance on logits: 1e-3 absolute (logits of magnitude ~10-15). Measured: 9.7e-6 max over the
// top-20 of 97 positions (f32 activations; BF16 weights take the f32 path with every kernel
// family): fp32 summation order over 4 layers of width 128, plus the reference's 5-decimal
// rounding. 1e-3 is two orders of magnitude above that and below what a semantic slip costs
// (softmax instead of sigmoid gating, a missing bias or scale: > 1e-1). No routing reference
// exists for this family (transformers does not return its router scores).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "gguf/gguf_writer.h"
#include "support/gguf_edit.h"
#include "support/paths.h"
#include "support/reference.h"

using namespace strata;
using ::testing::HasSubstr;

namespace {

constexpr double kLogitTol = 1e-3;

std::string glm_model(const std::string& fx) { return fx + "/models/glm4moe-tiny-bf16.gguf"; }

engine::EngineOptions options() {
  engine::EngineOptions o;
  o.n_threads = 2;
  o.arena_mb = 16;  // all experts (9 MiB) fit
  return o;
}

std::vector<float> all_logits(const std::string& model, const engine::EngineOptions& o,
                              const std::vector<int32_t>& ids) {
  engine::Engine eng(model, o);
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, ids, model::LogitsMode::All, logits);
  return logits;
}

bool bit_equal(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

}  // namespace

TEST(Glm4Moe, HyperParameters) {
  STRATA_REQUIRE_FIXTURES(fx);
  engine::Engine eng(glm_model(fx), options());
  const auto& hp = eng.hparams();
  EXPECT_EQ(hp.arch, "glm4moe");
  EXPECT_EQ(hp.n_layer, 4);
  EXPECT_EQ(hp.n_rot, 16);  // partial rotary: 16 of 32 head dims
  EXPECT_EQ(hp.head_dim_k, 32);
  EXPECT_EQ(hp.n_layer_dense_lead, 1);
  EXPECT_EQ(hp.n_expert_shared, 1);
  EXPECT_EQ(hp.expert_gating_func, 2);
  EXPECT_FLOAT_EQ(hp.expert_weights_scale, 2.5f);
  // the dense layer has no experts in the stream layout
  ASSERT_EQ(eng.model().expert_layout().size(), 4u);
  EXPECT_EQ(eng.model().expert_layout()[0].n_expert, 0);
  EXPECT_EQ(eng.model().expert_layout()[1].n_expert, 64);
}

TEST(Glm4Moe, MatchesTransformers) {
  STRATA_REQUIRE_FIXTURES(fx);
  engine::Engine eng(glm_model(fx), options());
  test::ParityReport rep;
  test::compare_with_hf(eng, test::load_json(fx + "/ref/glm4moe-tiny.hf.json"), rep);
  test::print_report("glm4moe BF16 vs transformers", rep);
  test::expect_logit_parity(rep, kLogitTol);
}

TEST(Glm4Moe, GreedyMatchesTransformersAndLlamaCpp) {
  STRATA_REQUIRE_FIXTURES(fx);
  engine::Engine eng(glm_model(fx), options());
  test::expect_greedy(eng, test::load_json(fx + "/ref/glm4moe-tiny.hf.json")["greedy"], "transformers");
  test::expect_greedy(eng, test::load_json(fx + "/ref/llamacpp-greedy-archs.json")["models"]["glm4moe-tiny-bf16.gguf"],
                      "llama.cpp");
}

TEST(Glm4Moe, ChunksThreadsArenaAndDecodeAreBitIdentical) {
  STRATA_REQUIRE_FIXTURES(fx);
  const auto ref_json = test::load_json(fx + "/ref/glm4moe-tiny.hf.json");
  const auto ids = ref_json["cases"][2]["ids"].get<std::vector<int32_t>>();  // 64 tokens
  const size_t V = 8192;
  engine::EngineOptions whole = options();
  whole.prompt_chunk = int(ids.size());
  const auto ref = all_logits(glm_model(fx), whole, ids);
  ASSERT_EQ(ref.size(), ids.size() * V);
  for (int chunk : {1, 5}) {
    for (int threads : {1, 2}) {
      engine::EngineOptions o = options();
      o.prompt_chunk = chunk;
      o.n_threads = threads;
      EXPECT_TRUE(bit_equal(all_logits(glm_model(fx), o, ids).data(), ref.data(), ref.size()))
          << "chunk " << chunk << " threads " << threads;
    }
  }
  {  // the minimum arena for single-token chunks (8 slots of 192 experts): streamed all the time
    engine::EngineOptions o = options();
    o.prompt_chunk = 1;
    o.arena_mb = 0;
    o.arena_bytes = engine::Engine(glm_model(fx), o).min_arena_bytes();
    EXPECT_TRUE(bit_equal(all_logits(glm_model(fx), o, ids).data(), ref.data(), ref.size())) << "minimum arena";
  }
  engine::Engine eng(glm_model(fx), options());
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, std::span(ids).first(1), model::LogitsMode::Last, logits);
  EXPECT_TRUE(bit_equal(logits.data(), ref.data(), V)) << "position 0";
  for (size_t i = 1; i < ids.size(); ++i) {
    eng.decode(st, ids[i], logits);
    ASSERT_TRUE(bit_equal(logits.data(), ref.data() + i * V, V)) << "decode position " << i;
  }
}

TEST(Glm4Moe, NextNBlocksAreSkipped) {
  // Real GLM files carry a multi-token-prediction block after the last layer (block_count
  // counts it, nextn_predict_layers = 1): one appended to the fixture must not change a bit.
  STRATA_REQUIRE_FIXTURES(fx);
  test::expect_nextn_block_skipped(glm_model(fx), options(), {100, 200, 300, 400, 500, 600, 700});
}

TEST(Glm4MoeErrors, MalformedFilesAreNamed) {
  STRATA_REQUIRE_FIXTURES(fx);
  const std::string m = glm_model(fx);
  test::GgufEdit d1;
  d1.drop = {"blk.1.ffn_gate_inp.weight"};
  EXPECT_THAT(test::edited_load_error(m, d1, "glm-d1"),
              HasSubstr("missing tensor 'blk.1.ffn_gate_inp.weight' (expected shape [128, 64])"));
  test::GgufEdit d2;
  d2.drop = {"blk.0.ffn_up.weight"};  // the dense layer's FFN
  EXPECT_THAT(test::edited_load_error(m, d2, "glm-d2"),
              HasSubstr("missing tensor 'blk.0.ffn_up.weight' (expected shape [128, 256])"));
  test::GgufEdit r1;
  r1.reshape = "blk.2.attn_q.bias";  // an optional tensor, when present, is still checked
  r1.ne = {64};
  EXPECT_THAT(test::edited_load_error(m, r1, "glm-r1"),
              HasSubstr("tensor 'blk.2.attn_q.bias': expected shape [128], got [64]"));
  test::GgufEdit k1;
  k1.set_kv = {{"glm4moe.expert_gating_func", gguf::make_u32(3)}};
  EXPECT_THAT(test::edited_load_error(m, k1, "glm-k1"),
              HasSubstr("key 'glm4moe.expert_gating_func' = 3 is not supported"));
  test::GgufEdit k2;
  k2.set_kv = {{"glm4moe.expert_group_count", gguf::make_u32(3)}};
  EXPECT_THAT(test::edited_load_error(m, k2, "glm-k2"),
              HasSubstr("key 'glm4moe.expert_group_count' = 3 does not divide expert_count 64"));
  test::GgufEdit k3;
  k3.set_kv = {{"glm4moe.leading_dense_block_count", gguf::make_u32(5)}};
  EXPECT_THAT(test::edited_load_error(m, k3, "glm-k3"), HasSubstr("leading_dense_block_count' = 5"));
}
