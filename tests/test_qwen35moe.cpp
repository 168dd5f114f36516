// The qwen35moe forward pass (Qwen3.5 MoE text model: gated delta net with tiled value heads and
// separate alpha/beta projections, gated full attention with IMRoPE, routed MoE + gated shared
// expert) against the shared fixtures' independent references: transformers 5.17 fp32 math on the
// bf16 weights (ref/qwen35moe-tiny.hf.json, RoPE frequencies exact) and llama.cpp's greedy
// continuations (ref/llamacpp-greedy-archs.json). Skips, saying so, without the fixtures.
//
// Tolerance on logits: 1e-4 absolute (logits here reach ~15). Measured: 7.9e-6 max over the
// top-20 of the 97 positions, the same order over all 8192 logits of each last position and on
// logsumexp; the reference stores 6 decimals, the rest is fp32 summation order over 4 layers of
// width 128. 1e-4 is a ~12x margin that still catches the semantic slips of this family:
// reading the value heads in qwen3next's grouped order instead of the converter's tiled order
// (GdnSpec::VHeadOrder::Grouped) moves logits by up to 5.4 and flips 27 of the 97 top-1s
// (measured by switching the spec). llama.cpp's reading of IMRoPE for text (the fourth section at
// position 0, so pair 7 of 8 is not rotated here) would move them by far less than 1e-4: that
// pair turns by 7.5e-7 rad per token. Router scores: 1e-4 on differences of raw scores (the reference's router_top are
// raw router logits; ours are softmax probabilities, and log p_k - log p_0 = s_k - s_0).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/ops.h"
#include "gguf/gguf_writer.h"
#include "model/arch.h"
#include "support/paths.h"
#include "support/reference.h"

using namespace strata;
using ::testing::HasSubstr;

namespace {

constexpr double kLogitTol = 1e-4;
constexpr double kRouterScoreTol = 1e-4;

std::string model_path(const std::string& fx) { return fx + "/models/qwen35moe-tiny-bf16.gguf"; }
nlohmann::json hf_ref(const std::string& fx) { return test::load_json(fx + "/ref/qwen35moe-tiny.hf.json"); }

engine::EngineOptions options() {
  engine::EngineOptions o;
  o.n_threads = 2;
  o.arena_mb = 64;  // all experts (15 MiB of slots) fit
  return o;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> all_logits(const std::string& path, const engine::EngineOptions& o,
                              const std::vector<int32_t>& ids) {
  engine::Engine eng(path, o);
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, ids, model::LogitsMode::All, logits);
  return logits;
}

std::vector<int32_t> longest_case(const nlohmann::json& ref) {
  std::vector<int32_t> best;
  for (const auto& c : ref["cases"]) {
    auto ids = c["ids"].get<std::vector<int32_t>>();
    if (ids.size() > best.size()) best = ids;
  }
  return best;
}

}  // namespace

TEST(Qwen35Moe, HyperParametersAndState) {
  STRATA_REQUIRE_FIXTURES(fx);
  engine::Engine eng(model_path(fx), options());
  const auto& hp = eng.hparams();
  EXPECT_EQ(hp.arch, "qwen35moe");
  EXPECT_EQ(hp.n_layer, 4);
  EXPECT_EQ(hp.n_nextn, 0);  // converted with --no-mtp
  EXPECT_EQ(hp.n_rot, 16);   // partial rotary 0.25 of head_dim 64
  EXPECT_EQ(hp.n_expert, 64);
  EXPECT_EQ(hp.n_expert_used, 8);
  EXPECT_EQ(hp.n_ff_shexp, 128);
  EXPECT_EQ(hp.full_attention_interval, 4);
  const auto st = eng.new_sequence();
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(st.conv[l].size(), 3u * 256) << l;  // (conv_kernel - 1) x (2*2*32 + 4*32)
    EXPECT_EQ(st.ssm[l].size(), 4u * 32 * 32) << l;
    EXPECT_TRUE(st.k[l].empty()) << l;
  }
  EXPECT_TRUE(st.conv[3].empty());
  EXPECT_EQ(st.k[3].size(), size_t(eng.n_ctx()) * 2 * 64);
  const auto archs = model::supported_architectures();
  EXPECT_NE(std::find(archs.begin(), archs.end(), "qwen35moe"), archs.end());
}

TEST(Qwen35Moe, MatchesTransformers) {
  STRATA_REQUIRE_FIXTURES(fx);
  engine::Engine eng(model_path(fx), options());
  test::ParityReport p;
  test::compare_with_hf(eng, hf_ref(fx), p);
  test::print_report("qwen35moe vs transformers", p);
  EXPECT_EQ(p.positions, 9 + 24 + 64);
  test::expect_logit_parity(p, kLogitTol);
  EXPECT_GT(p.routes_checked, p.positions * 3);  // 4 MoE layers per position, nearly all untied
  EXPECT_EQ(p.routes_mismatch, 0);
  EXPECT_LE(p.max_score_err, kRouterScoreTol);
}

TEST(Qwen35Moe, GreedyMatchesTransformersAndLlamaCpp) {
  STRATA_REQUIRE_FIXTURES(fx);
  const nlohmann::json hf = hf_ref(fx);
  const nlohmann::json lc =
      test::load_json(fx + "/ref/llamacpp-greedy-archs.json")["models"]["qwen35moe-tiny-bf16.gguf"];
  ASSERT_EQ(lc.size(), hf["greedy"].size());
  engine::Engine eng(model_path(fx), options());
  for (size_t i = 0; i < hf["greedy"].size(); ++i) {
    const auto& g = hf["greedy"][i];
    const auto prompt = g["ids"].get<std::vector<int32_t>>();
    ASSERT_EQ(lc[i]["ids"].get<std::vector<int32_t>>(), prompt);
    const auto want_hf = g["greedy"].get<std::vector<int32_t>>();
    const auto want_lc = lc[i]["greedy"].get<std::vector<int32_t>>();
    const size_t n = std::max(want_hf.size(), want_lc.size());
    const auto got = test::greedy(eng, prompt, int(n));
    std::printf("[greedy %zu] %zu tokens vs transformers' %zu and llama.cpp's %zu\n", i, n, want_hf.size(),
                want_lc.size());
    EXPECT_EQ(std::vector<int32_t>(got.begin(), got.begin() + long(want_hf.size())), want_hf)
        << "prompt: " << g["text"].get<std::string>();
    EXPECT_EQ(std::vector<int32_t>(got.begin(), got.begin() + long(want_lc.size())), want_lc)
        << "prompt: " << g["text"].get<std::string>();
  }
}

TEST(Qwen35Moe, ChunksThreadsArenaAndDecodeAreBitIdentical) {
  STRATA_REQUIRE_FIXTURES(fx);
  const std::string path = model_path(fx);
  const auto ids = longest_case(hf_ref(fx));
  ASSERT_GE(ids.size(), 60u);
  const size_t V = 8192;
  engine::EngineOptions whole = options();
  whole.prompt_chunk = int(ids.size());
  const auto ref = all_logits(path, whole, ids);
  ASSERT_EQ(ref.size(), ids.size() * V);
  for (int chunk : {1, 7}) {
    for (int threads : {1, 2}) {
      engine::EngineOptions o = options();
      o.prompt_chunk = chunk;
      o.n_threads = threads;
      EXPECT_TRUE(bit_equal(all_logits(path, o, ids), ref)) << "chunk " << chunk << " threads " << threads;
    }
  }
  // `--arena-mb 1` with an automatic chunk: 17 slots of 60 KiB for 256 experts; the chunk shrinks
  // to 2 tokens (16 slots) and nearly every expert is read on demand.
  {
    engine::EngineOptions o = options();
    o.arena_mb = 1;
    engine::Engine eng(path, o);
    EXPECT_LT(eng.arena_bytes(), eng.expert_bytes() / 4);
    model::SequenceState st = eng.new_sequence();
    std::vector<float> logits;
    eng.prefill(st, ids, model::LogitsMode::All, logits);
    EXPECT_TRUE(bit_equal(logits, ref)) << "1 MiB arena";
    EXPECT_GT(eng.prefill_stats().stream.misses, uint64_t(ids.size()));
  }
  // Decode token by token after a one-token prefill: every position equals the whole-prompt row.
  engine::Engine eng(path, options());
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, std::span(ids).first(1), model::LogitsMode::Last, logits);
  EXPECT_EQ(std::memcmp(logits.data(), ref.data(), V * sizeof(float)), 0) << "position 0";
  for (size_t i = 1; i < ids.size(); ++i) {
    eng.decode(st, ids[i], logits);
    ASSERT_EQ(std::memcmp(logits.data(), ref.data() + i * V, V * sizeof(float)), 0) << "decode position " << i;
  }
}

namespace {
// Interleaved multi-section RoPE as transformers' Qwen3.5 applies it (apply_interleaved_mrope on
// NEOX rotate_half), written from the formula: rotary pair i < n_rot/2 takes the position of
// section h when i % 3 == 1 and i < 3 sec[1], of w when i % 3 == 2 and i < 3 sec[2], else t;
// angle = pos * base^(-2i/n_rot); pair (i, i + n_rot/2) of each head; dims >= n_rot pass.
void imrope_reference(float* x, int n_heads, int head_dim, int n_rot, double base, const int sec[3],
                      const int64_t pos_thw[3]) {
  const int half = n_rot / 2;
  for (int i = 0; i < half; ++i) {
    int s = 0;
    if (i % 3 == 1 && i < 3 * sec[1]) s = 1;
    if (i % 3 == 2 && i < 3 * sec[2]) s = 2;
    const double angle = double(pos_thw[s]) * std::pow(base, -2.0 * i / n_rot);
    for (int h = 0; h < n_heads; ++h) {
      float* xh = x + int64_t(h) * head_dim;
      const double a = xh[i], b = xh[i + half];
      xh[i] = float(a * std::cos(angle) - b * std::sin(angle));
      xh[i + half] = float(b * std::cos(angle) + a * std::sin(angle));
    }
  }
}
}  // namespace

TEST(Qwen35Moe, ImropeOnTextIsNeoxPartialRotary) {
  // The identity the forward pass relies on: with the same position in every section (text),
  // IMRoPE is NEOX partial rotary, cpu::rope_apply with RopeSpec::standard. The fixture's
  // numbers: n_rot 16 of head_dim 64, sections [4, 2, 2], theta 1e7.
  const int n_heads = 4, head_dim = 64, n_rot = 16, sec[3] = {4, 2, 2};
  const double base = 1e7;
  const backend::RopeSpec rope = backend::RopeSpec::standard(n_rot, base);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x0(size_t(n_heads * head_dim));
  for (auto& v : x0) v = nd(rng);
  for (int64_t pos : {0, 1, 5, 63, 1000, 4095}) {
    std::vector<float> ours = x0, want = x0;
    cpu::rope_apply(rope, ours.data(), n_heads, head_dim, pos);
    const int64_t p3[3] = {pos, pos, pos};
    imrope_reference(want.data(), n_heads, head_dim, n_rot, base, sec, p3);
    for (size_t i = 0; i < ours.size(); ++i)
      ASSERT_NEAR(ours[i], want[i], 2e-6 * (1 + std::abs(want[i]))) << pos << " " << i;
  }
  // The sections do matter once positions differ (image tokens): the reference is not vacuous.
  std::vector<float> a = x0, b = x0;
  const int64_t same[3] = {40, 40, 40}, mixed[3] = {40, 3, 9};
  imrope_reference(a.data(), n_heads, head_dim, n_rot, base, sec, same);
  imrope_reference(b.data(), n_heads, head_dim, n_rot, base, sec, mixed);
  EXPECT_GT(std::abs(a[1] - b[1]), 1e-3);  // pair 1: section h
  EXPECT_EQ(a[0], b[0]);                   // pair 0: section t
}

namespace {
// Rewrites the fixture through gguf::Writer with edits and returns the new file's path (removed
// by the caller): keys set (u32 or i32 array), tensors dropped, reshaped (bytes cut or padded) or
// added (bytes of another tensor, cut or padded to the new shape, each byte XOR `scramble`).
struct FileEdit {
  std::vector<std::pair<std::string, gguf::Value>> set;
  std::vector<std::string> drop;
  std::string reshape;
  std::vector<uint64_t> reshape_ne;
  struct Add {
    std::string name, from;
    std::vector<uint64_t> ne;  ///< empty: the shape of `from`
  };
  std::vector<Add> add;
  uint8_t scramble = 0;
};

std::string write_edited(const std::string& src_path, const FileEdit& ed, const std::string& tag) {
  const gguf::File src = gguf::File::open(src_path);
  gguf::Writer w(src.alignment());
  for (const auto& [key, value] : src.metadata()) {
    if (key == "general.alignment") continue;
    auto it = std::find_if(ed.set.begin(), ed.set.end(), [&](const auto& kv) { return kv.first == key; });
    w.add_kv(key, it == ed.set.end() ? value : it->second);
  }
  for (const auto& [key, value] : ed.set)
    if (!src.has(key)) w.add_kv(key, value);
  std::ifstream in(src_path, std::ios::binary);
  auto bytes_of = [&](const gguf::TensorInfo& t) {
    std::vector<uint8_t> data(t.n_bytes);
    in.seekg(std::streamoff(t.offset));
    in.read(reinterpret_cast<char*>(data.data()), std::streamsize(data.size()));
    return data;
  };
  for (const auto& t : src.tensors()) {
    if (std::find(ed.drop.begin(), ed.drop.end(), t.name) != ed.drop.end()) continue;
    std::vector<uint8_t> data = bytes_of(t);
    std::vector<uint64_t> ne = t.ne;
    if (t.name == ed.reshape) {
      ne = ed.reshape_ne;
      data.resize(gguf::Writer::tensor_bytes(t.type, ne));
    }
    w.add_tensor(t.name, t.type, ne, std::move(data));
  }
  for (const auto& a : ed.add) {
    const gguf::TensorInfo* from = src.find_tensor(a.from);
    if (!from) throw std::runtime_error("no tensor " + a.from);
    std::vector<uint8_t> data = bytes_of(*from);
    const std::vector<uint64_t> ne = a.ne.empty() ? from->ne : a.ne;
    data.resize(gguf::Writer::tensor_bytes(from->type, ne));
    for (auto& byte : data) byte ^= ed.scramble;
    w.add_tensor(a.name, from->type, ne, std::move(data));
  }
  const auto path =
      std::filesystem::temp_directory_path() / ("strata-qwen35moe-" + tag + "-" + std::to_string(::getpid()) + ".gguf");
  w.write(path.string());
  return path.string();
}

std::string load_error(const std::string& src_path, const FileEdit& ed, const std::string& tag) {
  const std::string path = write_edited(src_path, ed, tag);
  std::string msg = "<no exception>";
  try {
    cpu::CpuBackend be(cpu::CpuOptions{1, cpu::kernels::resolve_kernels()});
    model::load_model(gguf::File::open(path), be);
  } catch (const model::ModelError& e) {
    msg = e.what();
  }
  std::filesystem::remove(path);
  return msg;
}

FileEdit drop(std::string name) {
  FileEdit e;
  e.drop.push_back(std::move(name));
  return e;
}
FileEdit reshape(std::string name, std::vector<uint64_t> ne) {
  FileEdit e;
  e.reshape = std::move(name);
  e.reshape_ne = std::move(ne);
  return e;
}
FileEdit set_u32(std::string key, uint32_t v) {
  FileEdit e;
  e.set.emplace_back(std::move(key), gguf::make_u32(v));
  return e;
}

// A NextN block as llama.cpp's converter appends it (Qwen3.5's mtp.*, as blk.<n>.*: a
// full-attention decoder block with the MoE, plus nextn.eh_proj / enorm / hnorm /
// shared_head_norm), its tensors made from layer 3's bytes XOR `scramble`; block_count 5 and
// nextn_predict_layers 1.
FileEdit append_nextn_block(uint8_t scramble) {
  FileEdit e;
  e.scramble = scramble;
  e.set.emplace_back("qwen35moe.block_count", gguf::make_u32(5));
  e.set.emplace_back("qwen35moe.nextn_predict_layers", gguf::make_u32(1));
  for (const char* n :
       {"attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
        "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_gate_inp.weight", "ffn_down_exps.weight",
        "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight",
        "ffn_up_shexp.weight", "ffn_down_shexp.weight"})
    e.add.push_back({model::blk(4, n), model::blk(3, n), {}});
  e.add.push_back({"blk.4.nextn.eh_proj.weight", "blk.3.attn_output.weight", {256, 128}});  // [2 n_embd, n_embd]
  for (const char* n : {"nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight"})
    e.add.push_back({model::blk(4, n), "blk.3.attn_norm.weight", {128}});
  return e;
}
}  // namespace

TEST(Qwen35MoeErrors, MissingOrMisShapedTensorIsNamed) {
  STRATA_REQUIRE_FIXTURES(fx);
  const std::string m = model_path(fx);
  EXPECT_THAT(load_error(m, drop("blk.1.ssm_beta.weight"), "drop-beta"),
              HasSubstr("missing tensor 'blk.1.ssm_beta.weight' (expected shape [128, 4])"));
  EXPECT_THAT(load_error(m, drop("blk.3.attn_q.weight"), "drop-q"),
              HasSubstr("missing tensor 'blk.3.attn_q.weight' (expected shape [128, 512])"));
  EXPECT_THAT(load_error(m, drop("blk.0.ffn_gate_inp_shexp.weight"), "drop-shgate"),
              HasSubstr("missing tensor 'blk.0.ffn_gate_inp_shexp.weight'"));
  // alpha with qwen3next's interleaved [b | a] width: not this layout
  EXPECT_THAT(load_error(m, reshape("blk.2.ssm_alpha.weight", {128, 8}), "alpha"),
              HasSubstr("tensor 'blk.2.ssm_alpha.weight': expected shape [128, 4], got [128, 8]"));
  EXPECT_THAT(load_error(m, reshape("blk.0.ffn_up_exps.weight", {128, 64, 32}), "up"),
              HasSubstr("tensor 'blk.0.ffn_up_exps.weight': expected shape [128, 64, 64], got [128, 64, 32]"));
}

TEST(Qwen35MoeErrors, BadKeysAreNamed) {
  STRATA_REQUIRE_FIXTURES(fx);
  const std::string m = model_path(fx);
  EXPECT_THAT(load_error(m, set_u32("qwen35moe.nextn_predict_layers", 4), "nextn"),
              HasSubstr("qwen35moe.nextn_predict_layers 4 leaves no decoder block of block_count 4"));
  FileEdit sec;
  sec.set.emplace_back("qwen35moe.rope.dimension_sections", gguf::make_i32_array({8, 2, 2, 0}));
  EXPECT_THAT(load_error(m, sec, "sections"), HasSubstr("key 'qwen35moe.rope.dimension_sections' = [8, 2, 2, 0]"));
  EXPECT_THAT(load_error(m, set_u32("qwen35moe.ssm.time_step_rank", 3), "dtrank"),
              HasSubstr("ssm.time_step_rank 3 (value heads) is not a multiple of ssm.group_count 2"));
}

TEST(Qwen35Moe, NextNBlocksAreSkipped) {
  // The fixture was converted with --no-mtp; a file with a NextN block appended (scrambled
  // weights: running it would change everything) loads, lists the block's tensors as Skip in
  // its table, holds no state or experts for it, and gives bit-identical logits.
  STRATA_REQUIRE_FIXTURES(fx);
  const std::string m = model_path(fx);
  const std::string path = write_edited(m, append_nextn_block(0x5a), "nextn");
  const auto ids = longest_case(hf_ref(fx));
  {
    engine::Engine eng(path, options());
    const auto& hp = eng.hparams();
    EXPECT_EQ(hp.n_layer, 5);
    EXPECT_EQ(hp.n_nextn, 1);
    const auto table = model::find_architecture("qwen35moe")->tensors(hp);
    std::set<std::string> skipped;
    for (const auto& t : table)
      if (t.role == model::TensorRole::Skip) skipped.insert(t.name);
    int in_file = 0;
    for (const auto& t : eng.gguf().tensors())
      if (t.layer() == 4) {
        ++in_file;
        EXPECT_TRUE(skipped.count(t.name)) << t.name << " is not in the table as Skip";
      }
    EXPECT_EQ(in_file, 20);
    EXPECT_EQ(skipped.size(), 20u);
    EXPECT_EQ(eng.model().expert_layout()[4].n_expert, 0);
    const auto st = eng.new_sequence();
    EXPECT_TRUE(st.k[4].empty() && st.v[4].empty() && st.conv[4].empty() && st.ssm[4].empty());
    EXPECT_EQ(eng.model().state_bytes(eng.n_ctx()), engine::Engine(m, options()).model().state_bytes(eng.n_ctx()));
  }
  EXPECT_TRUE(bit_equal(all_logits(path, options(), ids), all_logits(m, options(), ids)));
  std::filesystem::remove(path);
}
