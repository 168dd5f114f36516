// The qwen3next forward pass (gated delta net + gated full attention + MoE with shared
// expert) against transformers 5.17 in fp32 on the BF16 weights (tests/data/
// qwen3next-tiny.hf.json, a copy of ../shared/fixtures/ref/qwen3next-tiny.hf.json), and its
// invariances: prompt chunk, thread count, decode vs prefill, state copies.
//
// Tolerance on logits: 1e-4 absolute (logits here are of magnitude ~2: random weights, flat
// distributions). Measured: 7.1e-6 max over the top-20 of 412 positions, 7.4e-6 over all 8192
// logits of each case's last position, 5.6e-6 on logsumexp. The reference stores logits with
// 5 decimals, so ~5e-6 of that is its own rounding; the rest is fp32 summation order (4
// layers of width 128). 1e-4 is a 14x margin and still catches a one-line semantic slip:
// llama.cpp's l2norm convention (x / max(|x|, eps) instead of transformers' x / sqrt(|x|^2 +
// eps)) moves logits by 7.9e-4 here; exact instead of bf16 RoPE frequencies (below) by 2.5e-4
// at position 5. Routing probabilities: 1e-5 (measured 5.6e-7; the reference has 6 decimals).
//
// Reference quirk, as for qwen3moe: transformers loaded the BF16 checkpoint in bf16, so its RoPE
// inverse frequencies (a non-persistent buffer cast with the model) are bf16-rounded. With
// exact fp32 frequencies our logits drift from the reference with position: 5e-5 at position
// 1, 2.5e-4 at 5, 1e-3 to 4e-3 from position 40 on, 2.5e-2 at worst (position 70 of the
// longest case); only 16 of 64 head dims rotate and only one layer in four attends, so the
// drift is smaller than qwen3moe's. With bf16-rounded frequencies they match to 7e-6 at every
// position. So the teacher-forced comparison runs with
// LoadOptions::rope_freqs_bf16. Greedy continuations equal the reference's 24 tokens on all
// three prompts with either setting (smallest top-2 gap on the way: 8.7e-4 with exact, 1.4e-3
// with bf16 frequencies).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/gated_delta_net.h"
#include "gguf/gguf_writer.h"
#include "model/weights.h"
#include "support/paths.h"
#include "support/reference.h"

using namespace strata;
using ::testing::HasSubstr;

namespace {

constexpr double kLogitTol = 1e-4;
constexpr double kRouteProbTol = 1e-5;

std::string next_model() { return std::string(STRATA_REPO_DIR) + "/models/qwen3next-tiny-bf16.gguf"; }
nlohmann::json next_ref() { return test::load_json(test::data_path("qwen3next-tiny.hf.json")); }

engine::EngineOptions options(bool rope_bf16 = false) {
  engine::EngineOptions o;
  o.n_threads = 2;
  o.arena_mb = 64;  // all experts (6 MiB) fit
  o.load.rope_freqs_bf16 = rope_bf16;
  return o;
}

test::ParityReport parity(bool rope_bf16) {
  engine::Engine eng(next_model(), options(rope_bf16));
  test::ParityReport rep;
  test::compare_with_hf(eng, next_ref(), rep);
  return rep;
}

}  // namespace

TEST(Qwen3Next, HyperParameters) {
  engine::Engine eng(next_model(), options());
  const auto& hp = eng.hparams();
  EXPECT_EQ(hp.arch, "qwen3next");
  EXPECT_EQ(hp.n_layer, 4);
  EXPECT_EQ(hp.n_embd, 128);
  EXPECT_EQ(hp.n_rot, 16);  // partial rotary: 0.25 of head_dim 64
  EXPECT_EQ(hp.n_expert, 64);
  EXPECT_EQ(hp.n_expert_used, 10);
  EXPECT_EQ(hp.n_ff_shexp, 64);
  // Linear-attention layers hold a recurrent state and no KV cache; the full-attention one
  // (layer 3 with full_attention_interval 4) the opposite.
  const auto st = eng.new_sequence();
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(st.conv[l].size(), 3u * 256) << l;  // (conv_kernel - 1) x (2*2*32 + 4*32)
    EXPECT_EQ(st.ssm[l].size(), 4u * 32 * 32) << l;
    EXPECT_TRUE(st.k[l].empty()) << l;
  }
  EXPECT_TRUE(st.conv[3].empty());
  EXPECT_EQ(st.k[3].size(), size_t(eng.n_ctx()) * 2 * 64);
  const auto archs = model::supported_architectures();
  EXPECT_NE(std::find(archs.begin(), archs.end(), "qwen3next"), archs.end());
}

TEST(Qwen3Next, MatchesTransformers) {
  const test::ParityReport exact = parity(false), bf16 = parity(true);
  test::print_report("exact RoPE freqs vs transformers", exact);
  test::print_report("bf16 RoPE freqs vs transformers", bf16);
  // The finding above: exact frequencies are not what the reference computed.
  EXPECT_GT(exact.max_logit_err, kLogitTol);
  test::expect_parity(bf16, kLogitTol, kRouteProbTol);
}

namespace {
// Greedy continuation (prefill, then one decode per token) with our top-2 gap at each step.
std::vector<int32_t> greedy_with_gaps(engine::Engine& eng, const std::vector<int32_t>& prompt, int n,
                                      std::vector<float>& gaps) {
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, prompt, model::LogitsMode::Last, logits);
  std::vector<int32_t> out;
  gaps.clear();
  for (int i = 0; i < n; ++i) {
    std::vector<float> sorted(logits);
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    gaps.push_back(sorted[0] - sorted[1]);
    const int32_t id = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(id);
    if (i + 1 < n) eng.decode(st, id, logits);
  }
  return out;
}
}  // namespace

TEST(Qwen3Next, GreedyMatchesTransformers) {
  const nlohmann::json ref = next_ref();
  for (bool rope_bf16 : {false, true}) {
    engine::Engine eng(next_model(), options(rope_bf16));
    for (const auto& g : ref["greedy"]) {
      const auto want = g["greedy"].get<std::vector<int32_t>>();
      std::vector<float> gaps;
      const auto got = greedy_with_gaps(eng, g["ids"].get<std::vector<int32_t>>(), int(want.size()), gaps);
      size_t same = 0;
      while (same < want.size() && got[same] == want[same]) ++same;
      std::printf("[greedy, %s RoPE freqs] %zu of %zu tokens equal; smallest top-2 gap %.3g\n",
                  rope_bf16 ? "bf16" : "exact", same, want.size(), *std::min_element(gaps.begin(), gaps.end()));
      EXPECT_GE(same, 10u) << "prompt: " << g["text"].get<std::string>();
      // Past the first 10 tokens a divergence is only acceptable at a near tie.
      if (same < want.size()) {
        EXPECT_LT(gaps[same], 1e-4) << "diverged at step " << same << " without a near tie";
      }
    }
  }
}

namespace {
bool bit_equal(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

// The longest reference prompt (128 tokens).
std::vector<int32_t> long_prompt() {
  const nlohmann::json ref = next_ref();
  std::vector<int32_t> best;
  for (const auto& c : ref["cases"]) {
    auto ids = c["ids"].get<std::vector<int32_t>>();
    if (ids.size() > best.size()) best = ids;
  }
  return best;
}

std::vector<float> all_logits(const engine::EngineOptions& o, const std::vector<int32_t>& ids) {
  engine::Engine eng(next_model(), o);
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, ids, model::LogitsMode::All, logits);
  return logits;
}
}  // namespace

TEST(Qwen3Next, ChunksThreadsAndDecodeAreBitIdentical) {
  const auto ids = long_prompt();
  ASSERT_GE(ids.size(), 100u);
  const size_t V = 8192;
  engine::EngineOptions whole = options();
  whole.prompt_chunk = int(ids.size());
  const auto ref = all_logits(whole, ids);
  ASSERT_EQ(ref.size(), ids.size() * V);
  for (int chunk : {1, 3, 64}) {
    for (int threads : {1, 2}) {
      engine::EngineOptions o = options();
      o.prompt_chunk = chunk;
      o.n_threads = threads;
      const auto got = all_logits(o, ids);
      EXPECT_TRUE(got.size() == ref.size() && bit_equal(got.data(), ref.data(), ref.size()))
          << "chunk " << chunk << " threads " << threads;
    }
  }
  // Minimum arena for single-token chunks: experts are evicted and re-read all the time.
  {
    engine::EngineOptions o = options();
    o.prompt_chunk = 1;
    o.arena_bytes = engine::Engine(next_model(), o).min_arena_bytes();
    const auto got = all_logits(o, ids);
    EXPECT_TRUE(got.size() == ref.size() && bit_equal(got.data(), ref.data(), ref.size())) << "minimum arena";
  }
  // Decode token by token after a one-token prefill: every position's logits equal the
  // whole-prompt row.
  engine::Engine eng(next_model(), options());
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, std::span(ids).first(1), model::LogitsMode::Last, logits);
  EXPECT_TRUE(bit_equal(logits.data(), ref.data(), V)) << "position 0";
  for (size_t i = 1; i < ids.size(); ++i) {
    eng.decode(st, ids[i], logits);
    ASSERT_TRUE(bit_equal(logits.data(), ref.data() + i * V, V)) << "decode position " << i;
  }
}

TEST(Qwen3Next, StateCopyResumesExactly) {
  // The recurrent state (conv, ssm) travels with the KV cache in SequenceState: a copy taken
  // mid-prompt resumes to the same logits as the original, and a fresh sequence is not
  // affected by an earlier one.
  const auto ids = long_prompt();
  const size_t V = 8192, cut = 50;
  engine::Engine eng(next_model(), options());
  model::SequenceState a = eng.new_sequence();
  std::vector<float> la, lb, lc;
  eng.prefill(a, std::span(ids).first(cut), model::LogitsMode::None, la);
  model::SequenceState b = a;  // saved
  eng.prefill(a, std::span(ids).subspan(cut), model::LogitsMode::All, la);
  eng.prefill(b, std::span(ids).subspan(cut), model::LogitsMode::All, lb);
  ASSERT_EQ(la.size(), (ids.size() - cut) * V);
  EXPECT_TRUE(la == lb);
  model::SequenceState c = eng.new_sequence();
  eng.prefill(c, ids, model::LogitsMode::All, lc);
  EXPECT_TRUE(bit_equal(lc.data() + cut * V, la.data(), la.size()));
}

TEST(Qwen3Next, DeltaRuleStepMatchesFormula) {
  // cpu::delta_rule_step against the formula in double:
  //   S' = exp(g) S + k (beta (v - exp(g) S^T k))^T,  o = S'^T q.
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int dk = 16, dv = 24;
  std::vector<float> S(dk * dv), q(dk), k(dk), v(dv), o(dv), scratch(dv);
  for (auto* vec : {&S, &q, &k, &v})
    for (auto& e : *vec) e = nd(rng);
  const float decay = 0.7f, beta = 0.3f;
  std::vector<double> Sd(S.begin(), S.end()), mem(dv, 0.0), od(dv, 0.0);
  for (int i = 0; i < dk; ++i)
    for (int j = 0; j < dv; ++j) mem[j] += decay * Sd[i * dv + j] * k[i];
  for (int i = 0; i < dk; ++i)
    for (int j = 0; j < dv; ++j) Sd[i * dv + j] = decay * Sd[i * dv + j] + k[i] * beta * (v[j] - mem[j]);
  for (int i = 0; i < dk; ++i)
    for (int j = 0; j < dv; ++j) od[j] += Sd[i * dv + j] * q[i];
  cpu::delta_rule_step(S.data(), q.data(), k.data(), v.data(), decay, beta, dk, dv, o.data(), scratch.data());
  for (int i = 0; i < dk * dv; ++i) EXPECT_NEAR(S[i], Sd[i], 1e-5) << "S " << i;
  for (int j = 0; j < dv; ++j) EXPECT_NEAR(o[j], od[j], 1e-4) << "o " << j;
}

namespace {
// Rewrites the shipped model with one tensor dropped or reshaped (data cut or padded to the
// new size), through gguf::Writer, and returns the error loading it gives.
struct TensorEdit {
  std::string drop;     // tensor to remove
  std::string reshape;  // tensor to give the shape `ne`
  std::vector<uint64_t> ne;
  std::string add;  // tensor to add (a copy of `add_from`'s bytes, shape `ne`)
  std::string add_from;
};
TensorEdit drop(std::string name) {
  TensorEdit e;
  e.drop = std::move(name);
  return e;
}
TensorEdit reshape(std::string name, std::vector<uint64_t> ne) {
  TensorEdit e;
  e.reshape = std::move(name);
  e.ne = std::move(ne);
  return e;
}
TensorEdit add_copy(std::string name, std::string from, std::vector<uint64_t> ne) {
  TensorEdit e;
  e.add = std::move(name);
  e.add_from = std::move(from);
  e.ne = std::move(ne);
  return e;
}

std::string load_error(const TensorEdit& ed, const std::string& tag) {
  const gguf::File src = gguf::File::open(next_model());
  gguf::Writer w(src.alignment());
  for (const auto& [key, value] : src.metadata())
    if (key != "general.alignment") w.add_kv(key, value);
  std::ifstream in(next_model(), std::ios::binary);
  auto bytes_of = [&](const gguf::TensorInfo& t) {
    std::vector<uint8_t> data(t.n_bytes);
    in.seekg(std::streamoff(t.offset));
    in.read(reinterpret_cast<char*>(data.data()), std::streamsize(data.size()));
    return data;
  };
  for (const auto& t : src.tensors()) {
    if (t.name == ed.drop) continue;
    std::vector<uint8_t> data = bytes_of(t);
    std::vector<uint64_t> ne = t.ne;
    if (t.name == ed.reshape) {
      ne = ed.ne;
      data.resize(gguf::Writer::tensor_bytes(t.type, ne));
    }
    w.add_tensor(t.name, t.type, ne, std::move(data));
    if (t.name == ed.add_from) {
      std::vector<uint8_t> extra = bytes_of(t);
      extra.resize(gguf::Writer::tensor_bytes(t.type, ed.ne));
      w.add_tensor(ed.add, t.type, ed.ne, std::move(extra));
    }
  }
  const auto path =
      std::filesystem::temp_directory_path() / ("strata-qwen3next-" + tag + "-" + std::to_string(::getpid()) + ".gguf");
  w.write(path.string());
  std::string msg = "<no exception>";
  try {
    cpu::CpuBackend be(cpu::CpuOptions{1, cpu::kernels::resolve_kernels()});
    model::load_model(gguf::File::open(path.string()), be);
  } catch (const model::ModelError& e) {
    msg = e.what();
  }
  std::filesystem::remove(path);
  return msg;
}
}  // namespace

TEST(Qwen3NextErrors, MissingTensorIsNamedWithItsShape) {
  EXPECT_THAT(load_error(drop("blk.1.ssm_a"), "drop-a"),
              HasSubstr("missing tensor 'blk.1.ssm_a' (expected shape [4])"));
  EXPECT_THAT(load_error(drop("blk.3.attn_q.weight"), "drop-q"),
              HasSubstr("missing tensor 'blk.3.attn_q.weight' (expected shape [128, 512])"));
  EXPECT_THAT(load_error(drop("blk.2.ffn_up_shexp.weight"), "drop-shexp"),
              HasSubstr("missing tensor 'blk.2.ffn_up_shexp.weight' (expected shape [128, 64])"));
}

TEST(Qwen3NextErrors, ReshapedTensorIsNamedWithBothShapes) {
  // Transposed conv kernel: same bytes, wrong layout.
  EXPECT_THAT(load_error(reshape("blk.0.ssm_conv1d.weight", {256, 4}), "conv"),
              HasSubstr("tensor 'blk.0.ssm_conv1d.weight': expected shape [4, 256], got [256, 4]"));
  // attn_q without its gate half (a qwen3moe-style query projection).
  EXPECT_THAT(load_error(reshape("blk.3.attn_q.weight", {128, 256}), "q"),
              HasSubstr("tensor 'blk.3.attn_q.weight': expected shape [128, 512], got [128, 256]"));
  EXPECT_THAT(load_error(reshape("blk.0.ffn_down_exps.weight", {32, 128, 32}), "down"),
              HasSubstr("tensor 'blk.0.ffn_down_exps.weight': expected shape [32, 128, 64], got [32, 128, 32]"));
}

TEST(Qwen3NextErrors, FusedGateUpExpertsAreRefusedClearly) {
  const std::string msg =
      load_error(add_copy("blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_up_exps.weight", {128, 64, 64}), "fused");
  EXPECT_THAT(msg, HasSubstr("'blk.0.ffn_gate_up_exps.weight'"));
  EXPECT_THAT(msg, HasSubstr("not supported yet"));
}

TEST(Qwen3NextErrors, LayerTensorBeyondBlockCountIsRefused) {
  // a fifth layer's tensor in a file whose metadata says 4 layers: it would be silently unused
  const std::string msg =
      load_error(add_copy("blk.4.attn_norm.weight", "blk.3.attn_norm.weight", {128}), "extra-layer");
  EXPECT_THAT(msg,
              HasSubstr("tensor 'blk.4.attn_norm.weight' belongs to layer 4, but qwen3next.block_count says 4 layers"));
}
