// The gpt-oss forward pass (GptOssForCausalLM: biased GQA attention with sinks, sliding window
// on even layers, biased router with softmax over the top-k, clamped SwiGLU experts with
// biases) against the shared fixtures: ../shared/fixtures/models/gpt-oss-tiny-bf16.gguf,
// ref/gpt-oss-tiny.hf.json (transformers 5.17, fp32 math on the bf16 weights, exact RoPE
// frequencies) and ref/llamacpp-greedy-archs.json (llama.cpp's greedy continuations). Every
// test skips, saying so, when the fixtures folder is absent.
//
// Tolerance on logits: 1e-3 absolute, the fixtures' expectation for fp32 math on bf16 weights
// (both sides compute in fp32 and differ only in summation order; logits are of magnitude
// ~5-10). Measured: 8.7e-6 max over the top-20 of 97 positions, 7.8e-6 over all 8192 logits of
// each case's last position, 6.8e-6 on logsumexp (the reference stores 5 decimals, so about
// half of that is its rounding). A one-line slip moves logits by far more (measured by switching
// each off while writing this test): no attention sinks 4.2, no sliding window 2.7, no router
// bias 2.3 (each also flips top-1 and routing). Two options have no effect on this file and are
// tested on synthetic inputs below instead: the SwiGLU clamp (no gate or up value of the tiny
// model reaches 7), and SoftmaxTopK vs Softmax + renormalization (equal in exact arithmetic).
// Router scores: the reference gives the raw logits (bias included) of the top-k per layer
// and token; ours are compared through their softmax: log(p_k / p_0) = s_k - s_0, within 1e-4
// (measured 1.7e-6; the reference stores 6 decimals).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "backend/cpu/cpu_backend.h"
#include "gguf/gguf_writer.h"
#include "support/paths.h"
#include "support/reference.h"

using namespace strata;
using ::testing::HasSubstr;

namespace {

constexpr double kLogitTol = 1e-3;
constexpr double kScoreTol = 1e-4;

std::string model_path(const std::string& fx) { return fx + "/models/gpt-oss-tiny-bf16.gguf"; }

engine::EngineOptions options() {
  engine::EngineOptions o;
  o.n_threads = 2;
  o.arena_mb = 64;  // all experts (12 MiB) fit
  return o;
}

bool bit_equal(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

std::vector<float> all_logits(const std::string& path, const engine::EngineOptions& o,
                              const std::vector<int32_t>& ids) {
  engine::Engine eng(path, o);
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, ids, model::LogitsMode::All, logits);
  return logits;
}

}  // namespace

TEST(GptOss, HyperParameters) {
  STRATA_REQUIRE_FIXTURES(fx);
  engine::Engine eng(model_path(fx), options());
  const auto& hp = eng.hparams();
  EXPECT_EQ(hp.arch, "gpt-oss");
  EXPECT_EQ(hp.n_layer, 4);
  EXPECT_EQ(hp.n_embd, 128);
  EXPECT_EQ(hp.n_head, 4);
  EXPECT_EQ(hp.n_head_kv, 2);
  EXPECT_EQ(hp.head_dim_k, 32);
  EXPECT_EQ(hp.n_expert, 32);
  EXPECT_EQ(hp.n_expert_used, 4);
  EXPECT_EQ(hp.n_ff_exp, 128);
  EXPECT_EQ(hp.n_swa, 32);
  EXPECT_FALSE(hp.tied_output);
}

TEST(GptOss, MatchesTransformers) {
  STRATA_REQUIRE_FIXTURES(fx);
  engine::Engine eng(model_path(fx), options());
  // The reference has router_top (raw scores) instead of routing (probabilities).
  test::ParityReport rep;
  test::compare_with_hf(eng, test::load_json(fx + "/ref/gpt-oss-tiny.hf.json"), rep);
  test::print_report("gpt-oss vs transformers", rep);
  test::expect_logit_parity(rep, kLogitTol);
  EXPECT_GT(rep.routes_checked, 0);
  EXPECT_EQ(rep.routes_mismatch, 0);
  EXPECT_LE(rep.max_score_err, kScoreTol);
}

TEST(GptOss, GreedyMatchesTransformersAndLlamaCpp) {
  STRATA_REQUIRE_FIXTURES(fx);
  engine::Engine eng(model_path(fx), options());
  const auto ref = test::load_json(fx + "/ref/gpt-oss-tiny.hf.json");
  test::expect_greedy(eng, ref["greedy"], "transformers");
  test::expect_greedy(eng, test::load_json(fx + "/ref/llamacpp-greedy-archs.json")["models"]["gpt-oss-tiny-bf16.gguf"],
                      "llama.cpp");
}

TEST(GptOss, ChunksArenaAndDecodeAreBitIdentical) {
  STRATA_REQUIRE_FIXTURES(fx);
  const std::string path = model_path(fx);
  // A prompt longer than the sliding window (32), so the window really cuts.
  std::vector<int32_t> ids;
  const auto ref_json = test::load_json(fx + "/ref/gpt-oss-tiny.hf.json");
  for (const auto& c : ref_json["greedy"])
    for (int32_t id : c["ids"].get<std::vector<int32_t>>()) ids.push_back(id);
  while (ids.size() < 80) {
    const int32_t next = ids[ids.size() % 17];
    ids.push_back(next);
  }
  const size_t V = 8192;
  engine::EngineOptions whole = options();
  whole.prompt_chunk = int(ids.size());
  const auto ref = all_logits(path, whole, ids);
  ASSERT_EQ(ref.size(), ids.size() * V);
  for (int chunk : {1, 7, 33}) {
    engine::EngineOptions o = options();
    o.prompt_chunk = chunk;
    o.n_threads = chunk == 7 ? 1 : 2;
    const auto got = all_logits(path, o, ids);
    EXPECT_TRUE(got.size() == ref.size() && bit_equal(got.data(), ref.data(), ref.size())) << "chunk " << chunk;
  }
  // The smallest arena (far below the 12 MiB of experts): experts are evicted and re-read.
  {
    engine::EngineOptions o = options();
    o.prompt_chunk = 1;
    o.arena_bytes = engine::Engine(path, o).min_arena_bytes();
    const auto got = all_logits(path, o, ids);
    EXPECT_TRUE(got.size() == ref.size() && bit_equal(got.data(), ref.data(), ref.size())) << "minimum arena";
  }
  engine::Engine eng(path, options());
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, std::span(ids).first(1), model::LogitsMode::Last, logits);
  EXPECT_TRUE(bit_equal(logits.data(), ref.data(), V)) << "position 0";
  for (size_t i = 1; i < ids.size(); ++i) {
    eng.decode(st, ids[i], logits);
    ASSERT_TRUE(bit_equal(logits.data(), ref.data() + i * V, V)) << "decode position " << i;
  }
}

namespace {
// Rewrites the fixture with one tensor dropped or reshaped (data cut or padded to the new size)
// or one key set, through gguf::Writer, and returns the error loading it gives.
struct Edit {
  std::string drop{}, reshape{};
  std::vector<uint64_t> ne{};
  std::string key{}, value{};  // string key to set (added when absent)
  std::string drop_key{};
};

std::string load_error(const std::string& fx, const Edit& ed, const std::string& tag) {
  const std::string model = model_path(fx);
  const gguf::File src = gguf::File::open(model);
  gguf::Writer w(src.alignment());
  bool key_set = false;
  for (const auto& [key, value] : src.metadata()) {
    if (key == "general.alignment" || key == ed.drop_key) continue;
    if (key == ed.key) {
      w.add_string(key, ed.value);
      key_set = true;
    } else {
      w.add_kv(key, value);
    }
  }
  if (!ed.key.empty() && !key_set) w.add_string(ed.key, ed.value);
  std::ifstream in(model, std::ios::binary);
  for (const auto& t : src.tensors()) {
    if (t.name == ed.drop) continue;
    std::vector<uint8_t> data(t.n_bytes);
    in.seekg(std::streamoff(t.offset));
    in.read(reinterpret_cast<char*>(data.data()), std::streamsize(data.size()));
    std::vector<uint64_t> ne = t.ne;
    if (t.name == ed.reshape) {
      ne = ed.ne;
      data.resize(gguf::Writer::tensor_bytes(t.type, ne));
    }
    w.add_tensor(t.name, t.type, ne, std::move(data));
  }
  const auto path =
      std::filesystem::temp_directory_path() / ("strata-gpt-oss-" + tag + "-" + std::to_string(::getpid()) + ".gguf");
  w.write(path.string());
  std::string msg = "<no exception>";
  try {
    cpu::CpuBackend be(cpu::CpuOptions{1, cpu::kernels::resolve_kernels()});
    model::load_model(gguf::File::open(path.string()), be);
  } catch (const std::exception& e) {
    msg = e.what();
  }
  std::filesystem::remove(path);
  return msg;
}
}  // namespace

TEST(GptOssErrors, MissingTensorIsNamedWithItsShape) {
  STRATA_REQUIRE_FIXTURES(fx);
  EXPECT_THAT(load_error(fx, {.drop = "blk.1.attn_sinks.weight"}, "sinks"),
              HasSubstr("missing tensor 'blk.1.attn_sinks.weight' (expected shape [4])"));
  EXPECT_THAT(load_error(fx, {.drop = "blk.2.ffn_gate_inp.bias"}, "router-bias"),
              HasSubstr("missing tensor 'blk.2.ffn_gate_inp.bias' (expected shape [32])"));
  EXPECT_THAT(load_error(fx, {.drop = "blk.0.ffn_down_exps.bias"}, "down-bias"),
              HasSubstr("missing tensor 'blk.0.ffn_down_exps.bias' (expected shape [128, 32])"));
  EXPECT_THAT(load_error(fx, {.drop = "blk.3.attn_q.bias"}, "q-bias"),
              HasSubstr("missing tensor 'blk.3.attn_q.bias' (expected shape [128])"));
}

TEST(GptOssErrors, ReshapedTensorIsNamedWithBothShapes) {
  STRATA_REQUIRE_FIXTURES(fx);
  EXPECT_THAT(load_error(fx, {.reshape = "blk.0.ffn_up_exps.bias", .ne = {32, 128}}, "up-bias"),
              HasSubstr("tensor 'blk.0.ffn_up_exps.bias': expected shape [128, 32], got [32, 128]"));
  EXPECT_THAT(load_error(fx, {.reshape = "blk.2.attn_sinks.weight", .ne = {8}}, "sinks8"),
              HasSubstr("tensor 'blk.2.attn_sinks.weight': expected shape [4], got [8]"));
}

// YaRN itself is tested in test_yarn.cpp; a yarn file without its factor is an error.
TEST(GptOssErrors, MissingSlidingWindowAndYarnFactorAreRefused) {
  STRATA_REQUIRE_FIXTURES(fx);
  EXPECT_THAT(load_error(fx, {.drop_key = "gpt-oss.attention.sliding_window"}, "no-swa"),
              HasSubstr("gpt-oss.attention.sliding_window"));
  const std::string yarn = load_error(fx, {.key = "gpt-oss.rope.scaling.type", .value = "yarn"}, "yarn");
  EXPECT_THAT(yarn, HasSubstr("rope.scaling.type = yarn needs key 'gpt-oss.rope.scaling.factor'"));
}

TEST(GptOssBlocks, ClampedSwiGluExpertWithBiases) {
  // One F32 expert (n_embd 2, n_ff 3) whose gate and up values cross the clamp bounds, through
  // CpuBackend::expert_ffn, against the formula in double:
  //   g = W_g x + b_g, u = W_u x + b_u, g' = min(g, 7), u' = clamp(u, -7, 7),
  //   y = W_d (g' sigmoid(1.702 g') (u' + 1)) + b_d.
  cpu::CpuBackend be(cpu::CpuOptions{1, cpu::kernels::resolve_kernels(cpu::kernels::CpuKernels::Scalar)});
  std::vector<float> wg = {4, 1, -2, 0.5f, 0.25f, 0.1f}, wu = {-5, 0, 3, 3, 0.5f, -0.5f},
                     wd = {1, -1, 0.5f, 0.3f, 2, -0.7f};
  std::vector<float> bg = {0.5f, -0.25f, 0.125f}, bu = {-0.5f, 1, 0.2f}, bd = {0.1f, -0.2f};
  std::vector<float> h = {2, 1};  // one token
  backend::ExpertJob job;
  job.expert = 0;
  job.w.gate = backend::Tensor::f32(wg.data(), 2, 3);
  job.w.up = backend::Tensor::f32(wu.data(), 2, 3);
  job.w.down = backend::Tensor::f32(wd.data(), 3, 2);
  job.w.gate_b = backend::Tensor::f32(bg.data(), 3);
  job.w.up_b = backend::Tensor::f32(bu.data(), 3);
  job.w.down_b = backend::Tensor::f32(bd.data(), 2);
  const int64_t pairs[] = {0};
  job.pairs = pairs;
  backend::FfnSpec spec;
  spec.act = backend::FfnSpec::Act::SwiGluOai;
  std::vector<float> out(2, -1.0f);
  be.expert_ffn(spec, job, 1, backend::Tensor::f32(h.data(), 2, 1), backend::Tensor::f32(out.data(), 2, 1));
  be.synchronize();  // expert_ffn calls are queued until a flush (cpu_backend.h)
  double act[3];
  int clamped = 0;
  for (int r = 0; r < 3; ++r) {
    const double g = double(wg[2 * r]) * h[0] + double(wg[2 * r + 1]) * h[1] + bg[r];
    const double u = double(wu[2 * r]) * h[0] + double(wu[2 * r + 1]) * h[1] + bu[r];
    clamped += (g > 7) + (std::abs(u) > 7);
    const double gc = std::min(g, 7.0), uc = std::clamp(u, -7.0, 7.0);
    act[r] = gc / (1 + std::exp(-1.702 * gc)) * (uc + 1);
  }
  ASSERT_GE(clamped, 2);  // the inputs do exercise the clamp (g = 9.5, u = -10.5)
  for (int i = 0; i < 2; ++i) {
    const double want =
        double(wd[3 * i]) * act[0] + double(wd[3 * i + 1]) * act[1] + double(wd[3 * i + 2]) * act[2] + bd[i];
    EXPECT_NEAR(out[size_t(i)], want, 1e-5 * std::max(1.0, std::abs(want))) << "output " << i;
  }
}

TEST(GptOssBlocks, SoftmaxTopKGating) {
  // Top-k of the raw logits (ties: lower id), softmax over those k only; next_prob is the
  // (k+1)-th on the same scale. Equal to Softmax + renormalization in exact arithmetic.
  std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f, 0.75f};
  backend::RouterSpec spec;
  spec.gating = backend::RouterSpec::Gating::SoftmaxTopK;
  spec.n_expert = 6;
  spec.top_k = 3;
  backend::Routing r;
  std::vector<float> l = logits;
  backend::select_experts(spec, l.data(), 1, r);
  EXPECT_EQ(l, logits);  // left as they are
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3, 4}));
  const double z = std::exp(2.0) * 2 + std::exp(1.0);
  EXPECT_NEAR(r.weights[0], std::exp(2.0) / z, 1e-7);
  EXPECT_NEAR(r.weights[1], std::exp(2.0) / z, 1e-7);
  EXPECT_NEAR(r.weights[2], std::exp(1.0) / z, 1e-7);
  EXPECT_EQ(r.probs, r.weights);
  EXPECT_NEAR(r.next_prob[0], std::exp(0.75) / z, 1e-7);
  backend::RouterSpec all = spec;
  all.gating = backend::RouterSpec::Gating::Softmax;
  all.norm_topk = true;
  backend::Routing ra;
  l = logits;
  backend::select_experts(all, l.data(), 1, ra);
  EXPECT_EQ(ra.ids, r.ids);
  for (int k = 0; k < 3; ++k) EXPECT_NEAR(ra.weights[size_t(k)], r.weights[size_t(k)], 1e-7);
}

TEST(GptOssBlocks, AttentionSinksMatchFormula) {
  // cpu::attention_one with sinks against the formula in double, for the scalar/SSE kernel and
  // the machine's best family (AVX-512 where the CPU has it): per query head h,
  //   p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink_h)),  out_h = sum_j p_j v_j,  s_j = scale q_h.k_j.
  const int n_head = 4, n_head_kv = 2, hd = 32, n_pos = 5;
  const int64_t kv_stride = int64_t(n_head_kv) * hd;
  std::vector<float> q(size_t(n_head) * hd), k(size_t(n_pos * kv_stride)), v(size_t(n_pos * kv_stride));
  for (size_t i = 0; i < q.size(); ++i) q[i] = float(std::sin(0.37 * double(i)));
  for (size_t i = 0; i < k.size(); ++i) k[i] = float(std::cos(0.11 * double(i) + 0.5));
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(std::sin(0.23 * double(i) - 1.0));
  const float sinks[n_head] = {-1.0f, 0.5f, 3.0f, 0.0f};
  const float scale = 1.0f / std::sqrt(float(hd));
  for (auto family : {cpu::kernels::CpuKernels::Scalar, cpu::kernels::CpuKernels::Auto}) {
    const auto kc = cpu::kernels::resolve_kernels(family, cpu::kernels::ActQuant::F32);
    std::vector<float> out(q.size()), scratch(size_t(n_head) * n_pos);
    cpu::attention_one(kc, q.data(), k.data(), v.data(), kv_stride, n_pos, n_head, n_head_kv, hd, scale, out.data(),
                       scratch.data(), sinks);
    for (int h = 0; h < n_head; ++h) {
      const int g = h / (n_head / n_head_kv);
      std::vector<double> s(n_pos);
      double z = std::exp(double(sinks[h]));
      for (int p = 0; p < n_pos; ++p) {
        double d = 0;
        for (int i = 0; i < hd; ++i) d += double(q[size_t(h * hd + i)]) * k[size_t(p * kv_stride + g * hd + i)];
        s[size_t(p)] = std::exp(d * scale);
        z += s[size_t(p)];
      }
      for (int i = 0; i < hd; ++i) {
        double want = 0;
        for (int p = 0; p < n_pos; ++p) want += s[size_t(p)] / z * v[size_t(p * kv_stride + g * hd + i)];
        EXPECT_NEAR(out[size_t(h * hd + i)], want, 1e-6) << cpu::kernels::cpu_kernels_name(kc.family) << " head " << h;
      }
    }
  }
}
