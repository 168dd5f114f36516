// YaRN RoPE scaling (model/rope_scaling.h, backend::RopeSpec::yarn) against an independent
// reference: tests/data/yarn_ref.json, written by tests/data/yarn_reference.py from the YaRN
// paper's quantities (arXiv:2309.00071: turns per original context r(d), the beta_fast/beta_slow
// regimes, the 0.1 ln s + 1 temperature) and transformers' documented yarn parameters
// (truncate, mscale / mscale_all_dim), with llama.cpp's key conventions (deepseek2's
// yarn_log_multiplier = 0.1 * mscale_all_dim). Keys are set on copies of the tiny gpt-oss and
// deepseek2 fixtures, read back through the loader's own path (read_hparams + scaled_rope).
//
// Tolerances: the frequency table and the factors are closed forms in double on both sides
// (only the order of operations differs): 1e-12 relative. Logits: bit-identical where the
// formula says YaRN is the identity, and differing by > 1e-3 where it is not.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "backend/cpu/ops.h"
#include "engine/engine.h"
#include "gguf/gguf_writer.h"
#include "model/arch.h"
#include "model/rope_scaling.h"
#include "support/gguf_edit.h"
#include "support/paths.h"
#include "support/reference.h"

using namespace strata;
using ::testing::HasSubstr;

namespace {

constexpr double kRel = 1e-12;

std::string fixture_for(const std::string& fx, const std::string& arch) {
  return fx + "/models/" + arch + "-tiny-bf16.gguf";
}

gguf::Value value_of(const nlohmann::json& v) {
  if (v.is_string()) return gguf::make_string(v.get<std::string>());
  if (v.is_number_integer()) return gguf::make_u32(v.get<uint32_t>());
  return gguf::make_f32(v.get<float>());
}

// A copy of the arch's tiny fixture with `keys` (suffixes of "<arch>.") set.
std::string with_keys(const std::string& fx, const std::string& arch, const nlohmann::json& keys,
                      const std::string& tag) {
  test::GgufEdit ed;
  for (auto it = keys.begin(); it != keys.end(); ++it) ed.set_kv.push_back({arch + "." + it.key(), value_of(*it)});
  return test::write_edited_gguf(fixture_for(fx, arch), ed, tag);
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-300); }

std::vector<float> all_logits(const std::string& path, const std::vector<int32_t>& ids) {
  engine::EngineOptions o;
  o.n_threads = 2;
  o.arena_mb = 64;
  engine::Engine eng(path, o);
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, ids, model::LogitsMode::All, logits);
  return logits;
}

std::vector<int32_t> prompt(int n) {
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) ids.push_back(int32_t((i * 977 + 13) % 8000));
  return ids;
}

}  // namespace

TEST(Yarn, TableAndFactorsMatchTheIndependentReference) {
  STRATA_REQUIRE_FIXTURES(fx);
  const nlohmann::json ref = test::load_json(test::data_path("yarn_ref.json"));
  ASSERT_GE(ref["cases"].size(), 6u);
  for (const auto& c : ref["cases"]) {
    const std::string name = c["name"], arch = c["arch"];
    SCOPED_TRACE(name);
    const std::string path = with_keys(fx, arch, c["keys"], "yarn-" + name);
    const gguf::File f = gguf::File::open(path);
    const model::ModelHParams hp = model::read_hparams(f, model::architecture_for(f));
    const bool ds = arch == "deepseek2";
    const model::ScaledRope sr =
        model::scaled_rope(f, hp, c["n_rot"], ds ? backend::RopeSpec::Mode::Norm : backend::RopeSpec::Mode::Neox,
                           ds ? model::YarnFlavour::Deepseek2 : model::YarnFlavour::Standard, c["truncate"], false);
    std::filesystem::remove(path);
    EXPECT_TRUE(sr.yarn);
    const auto want = c["inv_freq"].get<std::vector<double>>();
    const auto plain = c["plain"].get<std::vector<double>>();
    const auto turns = c["turns"].get<std::vector<double>>();
    const double s = c["factor"], bf = c["beta_fast"], bs = c["beta_slow"];
    ASSERT_EQ(sr.rope.inv_freq.size(), want.size());
    int extrap = 0, interp = 0, blended = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_LE(rel(sr.rope.inv_freq[i], want[i]), kRel) << "pair " << i;
      // The paper's regimes, directly: a pair turning more than beta_fast times in the original
      // context keeps its frequency, one turning fewer than beta_slow times is divided by s.
      if (turns[i] > bf) {
        ++extrap;
        EXPECT_LE(rel(sr.rope.inv_freq[i], plain[i]), kRel) << "pair " << i;
      } else if (turns[i] < bs) {
        ++interp;
        EXPECT_LE(rel(sr.rope.inv_freq[i], plain[i] / s), kRel) << "pair " << i;
      } else {
        ++blended;
        EXPECT_LE(sr.rope.inv_freq[i], plain[i] * (1 + kRel));
        EXPECT_GE(sr.rope.inv_freq[i], plain[i] / s * (1 - kRel));
      }
    }
    EXPECT_GT(extrap, 0);
    EXPECT_GT(interp, 0);
    EXPECT_GT(blended, 0);
    EXPECT_LE(rel(sr.rope.attn_factor, c["attn_factor"].get<double>()), kRel);
    EXPECT_LE(rel(sr.kq_factor, c["kq_factor"].get<double>()), kRel);
  }
}

// Known values, by hand: gpt-oss's cos/sin factor 0.1 ln 32 + 1; DeepSeek V3's rope factor 1
// and q.k factor (0.1 ln 40 + 1)^2.
TEST(Yarn, ReleasedModelsFactors) {
  const nlohmann::json ref = test::load_json(test::data_path("yarn_ref.json"));
  for (const auto& c : ref["cases"]) {
    if (c["name"] == "gpt-oss-120b") {
      EXPECT_NEAR(c["attn_factor"].get<double>(), 1.3465735902799727, 1e-15);
      EXPECT_EQ(c["kq_factor"].get<double>(), 1.0);
    }
    if (c["name"] == "deepseek-v3") {
      EXPECT_EQ(c["attn_factor"].get<double>(), 1.0);
      EXPECT_NEAR(c["kq_factor"].get<double>(), std::pow(0.1 * std::log(40.0) + 1, 2), 1e-15);
    }
  }
}

// The CPU rotation applies attn_factor to cos and sin: the rotated pair is the plain rotation
// scaled by the factor (its norm times the factor, same angle).
TEST(Yarn, RopeApplyScalesTheRotatedPairs) {
  backend::RopeSpec plain = backend::RopeSpec::standard(16, 10000.0);
  backend::RopeSpec scaled = plain;
  scaled.attn_factor = 1.3465735902799727;
  std::vector<float> x(2 * 24), y;
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * float(i)) + 0.1f;
  y = x;
  cpu::rope_apply(plain, x.data(), 2, 24, 1234);
  cpu::rope_apply(scaled, y.data(), 2, 24, 1234);
  for (int h = 0; h < 2; ++h)
    for (int d = 0; d < 24; ++d) {
      const size_t i = size_t(h * 24 + d);
      if (d < 16)
        EXPECT_NEAR(y[i], x[i] * scaled.attn_factor, 1e-5) << i;
      else
        EXPECT_EQ(y[i], x[i]) << i;  // beyond n_rot: untouched
    }
}

// Where the formula makes YaRN the identity, the model's logits are bit-identical to the plain
// file's: factor 1 (no interpolation, mscale 1); and for gpt-oss a factor of 32 with betas so
// small that every pair extrapolates and a log multiplier of 1 (mscale(s)/mscale(s, 1) = 1).
// With the released gpt-oss keys, positions > 0 move by more than 1e-3.
TEST(Yarn, GptOssLogitsFollowTheFormula) {
  STRATA_REQUIRE_FIXTURES(fx);
  const auto ids = prompt(24);
  const std::vector<float> plain = all_logits(fixture_for(fx, "gpt-oss"), ids);
  auto run = [&](const nlohmann::json& keys, const char* tag) {
    const std::string p = with_keys(fx, "gpt-oss", keys, tag);
    std::vector<float> l = all_logits(p, ids);
    std::filesystem::remove(p);
    return l;
  };
  const nlohmann::json one = {{"rope.scaling.type", "yarn"}, {"rope.scaling.factor", 1.0}};
  const std::vector<float> l1 = run(one, "yarn-one");
  ASSERT_EQ(l1.size(), plain.size());
  EXPECT_EQ(std::memcmp(l1.data(), plain.data(), plain.size() * sizeof(float)), 0);
  const nlohmann::json extrap = {{"rope.scaling.type", "yarn"},
                                 {"rope.scaling.factor", 32.0},
                                 {"rope.scaling.yarn_beta_fast", 1e-6},
                                 {"rope.scaling.yarn_beta_slow", 1e-6},
                                 {"rope.scaling.yarn_log_multiplier", 1.0}};
  const std::vector<float> l2 = run(extrap, "yarn-extrap");
  EXPECT_EQ(std::memcmp(l2.data(), plain.data(), plain.size() * sizeof(float)), 0);
  const nlohmann::json real = {{"rope.scaling.type", "yarn"},
                               {"rope.scaling.factor", 32.0},
                               {"rope.scaling.original_context_length", 4096}};
  const std::vector<float> l3 = run(real, "yarn-real");
  const size_t V = plain.size() / ids.size();
  double max_diff = 0;
  for (size_t i = V; i < plain.size(); ++i) max_diff = std::max(max_diff, double(std::abs(l3[i] - plain[i])));
  std::printf("[yarn gpt-oss] released keys: max |logit - plain| over positions 1.. = %.3g\n", max_diff);
  EXPECT_GT(max_diff, 1e-3);
  for (float v : l3) ASSERT_TRUE(std::isfinite(v));
}

// deepseek2: factor 1 is the identity. With V3's multiplier (mscale_all_dim 1: rope factor 1)
// and betas so small that every pair extrapolates (the plain table), only the q.k factor
// (0.1 ln 40 + 1)^2 acts: position 0 (one score, softmax 1 whatever its scale) is unchanged,
// later positions move.
TEST(Yarn, Deepseek2LogitsFollowTheFormula) {
  STRATA_REQUIRE_FIXTURES(fx);
  const auto ids = prompt(12);
  const std::vector<float> plain = all_logits(fixture_for(fx, "deepseek2"), ids);
  auto run = [&](const nlohmann::json& keys, const char* tag) {
    const std::string p = with_keys(fx, "deepseek2", keys, tag);
    std::vector<float> l = all_logits(p, ids);
    std::filesystem::remove(p);
    return l;
  };
  const std::vector<float> l1 = run({{"rope.scaling.type", "yarn"}, {"rope.scaling.factor", 1.0}}, "ds-yarn-one");
  EXPECT_EQ(std::memcmp(l1.data(), plain.data(), plain.size() * sizeof(float)), 0);
  const std::vector<float> l2 = run({{"rope.scaling.type", "yarn"},
                                     {"rope.scaling.factor", 40.0},
                                     {"rope.scaling.yarn_beta_fast", 1e-6},
                                     {"rope.scaling.yarn_beta_slow", 1e-6},
                                     {"rope.scaling.yarn_log_multiplier", 0.1}},
                                    "ds-yarn-v3");
  const size_t V = plain.size() / ids.size();
  double d0 = 0;
  for (size_t i = 0; i < V; ++i) d0 = std::max(d0, double(std::abs(l2[i] - plain[i])));
  // Position 0 attends only to itself: softmax over one score is 1 whatever the scale, so the
  // scale shows from position 1 on.
  double d1 = 0;
  for (size_t i = V; i < plain.size(); ++i) d1 = std::max(d1, double(std::abs(l2[i] - plain[i])));
  std::printf("[yarn deepseek2] V3-style keys: max |logit - plain| position 0 %.3g, positions 1.. %.3g\n", d0, d1);
  EXPECT_EQ(d0, 0.0);
  EXPECT_GT(d1, 1e-3);
}

TEST(Yarn, UnsupportedKeysAreNamed) {
  STRATA_REQUIRE_FIXTURES(fx);
  auto err = [&](const nlohmann::json& keys, const char* tag) {
    const std::string p = with_keys(fx, "gpt-oss", keys, tag);
    std::string e = test::model_load_error(p);
    std::filesystem::remove(p);
    return e;
  };
  EXPECT_THAT(err({{"rope.scaling.type", "longrope"}}, "yarn-e1"),
              HasSubstr("key 'gpt-oss.rope.scaling.type' = 'longrope' is not supported"));
  EXPECT_THAT(err({{"rope.scaling.type", "yarn"}}, "yarn-e2"), HasSubstr("needs key 'gpt-oss.rope.scaling.factor'"));
  EXPECT_THAT(err({{"rope.scaling.type", "yarn"}, {"rope.scaling.factor", 0.5}}, "yarn-e3"),
              HasSubstr("key 'gpt-oss.rope.scaling.factor' = 0.5 is out of range"));
  EXPECT_THAT(err({{"rope.scaling.type", "yarn"}, {"rope.scaling.factor", 4.0}, {"rope.scaling.yarn_ext_factor", 0.5}},
                  "yarn-e4"),
              HasSubstr("yarn_ext_factor' = 0.5 is not supported"));
  EXPECT_THAT(err({{"rope.scaling.type", "yarn"}, {"rope.scaling.factor", 4.0}, {"rope.scaling.yarn_attn_factor", 1.2}},
                  "yarn-e5"),
              HasSubstr("yarn_attn_factor' is not supported"));
  EXPECT_THAT(err({{"rope.scaling.type", "yarn"},
                   {"rope.scaling.factor", 4.0},
                   {"rope.scaling.yarn_beta_fast", 1.0},
                   {"rope.scaling.yarn_beta_slow", 8.0}},
                  "yarn-e6"),
              HasSubstr("must be > 0 with beta_fast >= beta_slow"));
}
