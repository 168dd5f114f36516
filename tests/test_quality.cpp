// Quality tools (issue 15): the perplexity and KL-divergence formulas on hand-computed cases,
// `strata perplexity` (llama.cpp's chunking, reproducible, equal to the PPL computed here from
// the engine's logits), `--kl-divergence` (0 against itself under other engine settings, small
// but > 0 for f32 vs q8 activations, larger for Q4_K_M than for Q8_0 against BF16, clear errors),
// `strata route-parity`, and determinism of prefill and decode (logits and routing) across IO
// timing on the CPU backend.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "engine/engine.h"
#include "engine/quality.h"
#include "model/model.h"
#include "support/paths.h"
#include "support/synth_model.h"

namespace fs = std::filesystem;
using namespace strata;
using ::testing::HasSubstr;

namespace {

class Scratch {
 public:
  Scratch() {
    dir_ = fs::current_path() / ("strata-test-quality-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

 private:
  fs::path dir_;
};
Scratch& scratch() {
  static Scratch s;
  return s;
}

struct CmdResult {
  int rc = -1;
  std::string out;
};
// Runs the strata binary; `with_stderr` merges stderr into out (else it is dropped).
CmdResult run_strata(const std::string& args, bool with_stderr = true) {
  CmdResult r;
  int st = 0;
  r.out = test::run_command(test::strata_binary() + " " + args + (with_stderr ? " 2>&1" : " 2>/dev/null"), &st);
  r.rc = st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}
nlohmann::json run_json(const std::string& args) {
  const CmdResult r = run_strata(args, false);
  EXPECT_EQ(r.rc, 0) << args << "\n" << run_strata(args).out;
  return r.rc == 0 ? nlohmann::json::parse(r.out) : nlohmann::json();
}

const std::string kText = std::string(STRATA_TEST_DATA) + "/quality.py";
std::string model_flag() { return "-m " + test::shipped_model() + " -t 2"; }

// The base file of the shipped model on kText with chunks of 64 (written once).
const std::string& shipped_base() {
  static const std::string path = [] {
    const std::string p = scratch().path("shipped.kld");
    const CmdResult r = run_strata("perplexity " + model_flag() + " -f " + kText + " -c 64 --kl-divergence-base " + p);
    EXPECT_EQ(r.rc, 0) << r.out;
    return p;
  }();
  return path;
}

constexpr double kLn2 = 0.69314718055994530942;

std::vector<float> logits_of(std::initializer_list<double> probs) {
  std::vector<float> v;
  for (double p : probs) v.push_back(float(std::log(p)));
  return v;
}

}  // namespace

// ---- formulas on hand-computed cases ----

TEST(QualityFormulas, ChunkPlanIsLlamaCpps) {
  const quality::ChunkPlan p = quality::plan_chunks(200, 64);
  EXPECT_EQ(p.n_chunk, 3);  // 200 / 64; the last 8 tokens are dropped
  EXPECT_EQ(p.first, 32);
  EXPECT_EQ(p.n_scored, 31);  // positions 32..62 predict tokens 33..63
  EXPECT_EQ(quality::plan_chunks(128, 64).n_chunk, 2);
  try {
    quality::plan_chunks(127, 64);
    FAIL() << "no error for a text of fewer than 2 chunks";
  } catch (const quality::QualityError& e) {
    EXPECT_THAT(e.what(), HasSubstr("127 tokens"));
    EXPECT_THAT(e.what(), HasSubstr("at least 2 chunks = 128 tokens"));
  }
}

TEST(QualityFormulas, MeanErrorPercentileLogSumExp) {
  // 1, 2, 3, 4: mean 2.5, population variance 1.25, error sqrt(1.25 / 3)
  const quality::MeanError m = quality::mean_and_error(10, 30, 4);
  EXPECT_DOUBLE_EQ(m.mean, 2.5);
  EXPECT_NEAR(m.error, std::sqrt(1.25 / 3), 1e-15);
  EXPECT_EQ(quality::mean_and_error(5, 25, 1).error, 0.0);
  const std::vector<double> v = {1, 2, 3, 4, 5};
  EXPECT_DOUBLE_EQ(quality::percentile(v, 0.5), 3.0);
  EXPECT_NEAR(quality::percentile(v, 0.99), 4.96, 1e-12);  // rank 3.96: 0.04 * 4 + 0.96 * 5
  EXPECT_NEAR(quality::percentile(v, 0.999), 4.996, 1e-12);
  EXPECT_DOUBLE_EQ(quality::percentile(v, 1.0), 5.0);
  const std::vector<float> row = {0.0f, float(std::log(3.0))};
  EXPECT_NEAR(quality::log_sum_exp(row.data(), 2), std::log(4.0), 1e-7);
  // PPL of NLLs ln 2 and ln 8: exp(mean) = exp(2 ln 2) = 4; error = 4 * sqrt(((ln2^2 + (3 ln2)^2)/2 - (2 ln2)^2) / 1)
  quality::PplAccumulator acc;
  acc.add(kLn2);
  acc.add(3 * kLn2);
  EXPECT_NEAR(acc.ppl(), 4.0, 1e-12);
  EXPECT_NEAR(acc.ppl_error(), 4.0 * kLn2, 1e-12);
}

// P = (0.5, 0.25, 0.125, 0.125), Q = (0.25, 0.25, 0.4, 0.1), K = 2 (S = {0, 1}), next token 2.
//  exact KL(P||Q) = 0.5 ln 2 + 0 + 0.125 ln(0.125/0.4) + 0.125 ln(0.125/0.1)
//  lower bound    = 0.5 ln 2 + 0 + P_T ln(P_T/Q_T) with P_T = 0.25, Q_T = 0.5: 0.25 ln 2
//  upper bound    = 0.5 ln 2 + the tail mass 0.25 (at most P(K-th) = 0.25) on Q's smallest, 0.1:
//                   0.5 ln 2 + 0.25 ln(0.25/0.1)
TEST(QualityFormulas, KldBoundsOnHandComputedCase) {
  const auto p = logits_of({0.5, 0.25, 0.125, 0.125});
  const auto q = logits_of({0.25, 0.25, 0.4, 0.1});
  const double exact = 0.5 * kLn2 + 0.125 * std::log(0.125 / 0.4) + 0.125 * std::log(0.125 / 0.1);
  const quality::RefPosition r2 = quality::make_ref(p.data(), 4, 2, 2);
  EXPECT_EQ(r2.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(r2.tail, 0.25, 1e-7);
  EXPECT_NEAR(r2.lse, 0.0, 1e-7);
  EXPECT_NEAR(r2.next_lp, std::log(0.125), 1e-6);
  const quality::PositionCompare c = quality::compare_position(r2, q.data(), 4, 2);
  EXPECT_NEAR(c.kld, 0.25 * kLn2, 1e-6);
  EXPECT_NEAR(c.kld_upper, 0.5 * kLn2 + 0.25 * std::log(0.25 / 0.1), 1e-6);
  EXPECT_LE(c.kld, exact);
  EXPECT_GE(c.kld_upper, exact);
  EXPECT_NEAR(c.nll, -std::log(0.4), 1e-6);
  EXPECT_NEAR(c.nll_base, -std::log(0.125), 1e-6);
  EXPECT_NEAR(c.dp_text, 0.4 - 0.125, 1e-6);
  EXPECT_NEAR(c.dp_top, 0.25 - 0.5, 1e-6);
  EXPECT_FALSE(c.same_top);  // Q's argmax is 2, P's is 0
  // K = n_vocab: no tail, both bounds are the exact KL
  const quality::PositionCompare e = quality::compare_position(quality::make_ref(p.data(), 4, 4, 2), q.data(), 4, 2);
  EXPECT_NEAR(e.kld, exact, 1e-6);
  EXPECT_NEAR(e.kld_upper, exact, 1e-6);
  // against itself: exactly 0, whatever K
  for (int k : {1, 2, 4}) {
    const quality::PositionCompare s = quality::compare_position(quality::make_ref(p.data(), 4, k, 1), p.data(), 4, 1);
    EXPECT_EQ(s.kld, 0.0) << k;
    EXPECT_EQ(s.nll, s.nll_base);
    EXPECT_EQ(s.dp_text, 0.0);
    EXPECT_TRUE(s.same_top);
  }
}

TEST(QualityFormulas, BoundsHoldOnRandomDistributions) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (int trial = 0; trial < 200; ++trial) {
    const int V = 50;
    std::vector<float> p(V), q(V);
    for (int i = 0; i < V; ++i) {
      p[size_t(i)] = nd(rng);
      q[size_t(i)] = p[size_t(i)] + 0.5f * nd(rng);
    }
    const double exact = quality::compare_position(quality::make_ref(p.data(), V, V, 0), q.data(), V, 0).kld;
    for (int k : {1, 5, 20}) {
      const auto c = quality::compare_position(quality::make_ref(p.data(), V, k, 0), q.data(), V, 0);
      EXPECT_LE(c.kld, exact + 1e-6) << trial << " K " << k;
      EXPECT_GE(c.kld_upper, exact - 1e-6) << trial << " K " << k;
    }
  }
}

TEST(QualityFormulas, SummaryOnHandComputedPositions) {
  std::vector<quality::PositionCompare> v(2);
  v[0].nll = 1.0, v[0].nll_base = 0.5, v[0].kld = 0.1, v[0].same_top = true, v[0].dp_text = 0.3, v[0].dp_top = 0.1;
  v[1].nll = 2.0, v[1].nll_base = 1.5, v[1].kld = 0.3, v[1].same_top = false, v[1].dp_text = -0.4, v[1].dp_top = 0.1;
  const quality::KldSummary s = quality::summarize(v);
  EXPECT_NEAR(s.ppl.mean, std::exp(1.5), 1e-12);
  EXPECT_NEAR(s.ppl_base.mean, std::exp(1.0), 1e-12);
  EXPECT_NEAR(s.ppl_ratio.mean, std::exp(0.5), 1e-12);  // the differences are both 0.5
  EXPECT_NEAR(s.ppl_ratio.error, 0.0, 1e-12);
  EXPECT_NEAR(s.kld.mean, 0.2, 1e-12);
  EXPECT_NEAR(s.kld.error, 0.1, 1e-12);  // population sd 0.1 / sqrt(1)
  EXPECT_NEAR(s.kld_p99, 0.1 + 0.99 * 0.2, 1e-12);
  EXPECT_NEAR(s.same_top.mean, 0.5, 1e-12);
  EXPECT_NEAR(s.same_top.error, 0.5, 1e-12);  // sqrt(0.25 / 1)
  EXPECT_NEAR(s.rms_dp_text.mean, std::sqrt((0.09 + 0.16) / 2), 1e-12);
  EXPECT_NEAR(s.rms_dp_top.mean, 0.1, 1e-12);
}

TEST(QualityFormulas, BaseFileRoundTripAndErrors) {
  quality::KldBase b;
  b.n_vocab = 4;
  b.top_k = 2;
  b.plan = quality::plan_chunks(8, 4);
  b.tokenizer_hash = 42;
  b.model = "m.gguf";
  b.settings = "act-quant f32";
  b.tokens = {0, 1, 2, 3, 3, 2, 1, 0};
  const auto p = logits_of({0.5, 0.25, 0.125, 0.125});
  for (int i = 0; i < b.plan.n_chunk * b.plan.n_scored; ++i)
    b.positions.push_back(quality::make_ref(p.data(), 4, 2, i % 4));
  const std::string path = scratch().path("tiny.kld");
  quality::write_kld_base(path, b);
  const quality::KldBase r = quality::read_kld_base(path);
  EXPECT_EQ(r.tokens, b.tokens);
  EXPECT_EQ(r.model, "m.gguf");
  EXPECT_EQ(r.tokenizer_hash, 42u);
  ASSERT_EQ(r.positions.size(), b.positions.size());
  EXPECT_EQ(r.positions[1].lp, b.positions[1].lp);
  EXPECT_EQ(r.positions[1].tail, b.positions[1].tail);
  auto error_of = [](const std::string& f) {
    try {
      quality::read_kld_base(f);
    } catch (const quality::QualityError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const auto bytes = [&] {
    std::ifstream in(path, std::ios::binary);
    return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }();
  auto write = [](const std::string& f, const std::vector<char>& v) {
    std::ofstream(f, std::ios::binary).write(v.data(), std::streamsize(v.size()));
  };
  write(scratch().path("trunc.kld"), std::vector<char>(bytes.begin(), bytes.end() - 5));
  EXPECT_THAT(error_of(scratch().path("trunc.kld")), HasSubstr("truncated"));
  write(scratch().path("short.kld"), std::vector<char>(bytes.begin(), bytes.begin() + 20));
  EXPECT_THAT(error_of(scratch().path("short.kld")), HasSubstr("truncated"));
  auto flipped = bytes;
  flipped[bytes.size() - 20] ^= 1;
  write(scratch().path("flip.kld"), flipped);
  EXPECT_THAT(error_of(scratch().path("flip.kld")), HasSubstr("corrupt"));
  auto magic = bytes;
  magic[0] = 'X';
  write(scratch().path("magic.kld"), magic);
  EXPECT_THAT(error_of(scratch().path("magic.kld")), HasSubstr("not a strata KLD base file"));
  auto version = bytes;
  version[8] = 9;
  write(scratch().path("version.kld"), version);
  EXPECT_THAT(error_of(scratch().path("version.kld")), HasSubstr("version 9"));
}

// ---- strata perplexity on the shipped model ----

TEST(QualityPerplexity, FiniteReproducibleAndEqualToLogits) {
  const std::string args = "perplexity " + model_flag() + " -f " + kText + " -c 64 --json";
  const nlohmann::json a = run_json(args), b = run_json(args);
  ASSERT_TRUE(a.is_object());
  EXPECT_GE(a["chunks"].get<int>(), 2);
  EXPECT_EQ(a["scored"].get<int>(), a["chunks"].get<int>() * 31);
  const double ppl = a["ppl"].get<double>();
  EXPECT_TRUE(std::isfinite(ppl));
  EXPECT_GT(ppl, 1.0);
  EXPECT_LT(ppl, 100.0);  // a Python model on Python text
  EXPECT_GT(a["ppl_error"].get<double>(), 0.0);
  EXPECT_EQ(a.dump(), b.dump());  // bit-identical run to run

  // The same number from the engine's logits, with the scoring written out here.
  engine::EngineOptions o;
  o.n_threads = 2;
  o.n_ctx = 64;
  engine::Engine eng(test::shipped_model(), o);
  std::ifstream in(kText);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::vector<int32_t> ids = eng.tokenizer().encode(text);
  const int V = eng.hparams().n_vocab, n_chunk = int(ids.size() / 64);
  double nll = 0;
  int n = 0;
  for (int c = 0; c < n_chunk; ++c) {
    std::vector<int32_t> chunk(ids.begin() + c * 64, ids.begin() + (c + 1) * 64);
    model::SequenceState st = eng.new_sequence();
    std::vector<float> logits;
    eng.prefill(st, chunk, model::LogitsMode::All, logits);
    for (int j = 32; j < 63; ++j) {
      const float* row = logits.data() + size_t(j) * size_t(V);
      double sum = 0;
      for (int i = 0; i < V; ++i) sum += std::exp(double(row[i]));
      nll += std::log(sum) - double(row[chunk[size_t(j) + 1]]);
      ++n;
    }
  }
  EXPECT_EQ(n, a["scored"].get<int>());
  EXPECT_NEAR(ppl, std::exp(nll / n), 1e-5 * ppl);
}

TEST(QualityPerplexity, TextShorterThanTwoChunksIsAClearError) {
  const CmdResult r = run_strata("perplexity " + model_flag() + " -p 'def f(x):\n    return x\n' -c 64");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.out, HasSubstr("needs at least 2 chunks = 128 tokens"));
}

// ---- --kl-divergence ----

TEST(QualityKld, AgainstItselfUnderOtherEngineSettingsIsExactlyZero) {
  const std::string& base = shipped_base();
  // The base ran with prompt chunks of 64 (the chunk is capped at -c) and an automatic arena
  // holding every expert; --decode feeds the tokens one at a time.
  for (const std::string settings :
       {"", "--arena-mb 5 --prompt-chunk 16", "--predict off --io-threads 1",
        "--prompt-chunk 7 --arena-mb 40 --no-direct-io", "--decode --arena-mb 5 --moce-bonus 0 --moce-prefill"}) {
    const nlohmann::json j = run_json("perplexity " + model_flag() + " -f " + kText + " --kl-divergence-base " + base +
                                      " --kl-divergence --json " + settings);
    ASSERT_TRUE(j.contains("kld")) << settings;
    const auto& k = j["kld"];
    EXPECT_EQ(k["mean"]["value"].get<double>(), 0.0) << settings;
    EXPECT_EQ(k["max"].get<double>(), 0.0) << settings;
    EXPECT_EQ(k["p999"].get<double>(), 0.0) << settings;
    EXPECT_EQ(k["same_top1"]["value"].get<double>(), 1.0) << settings;
    EXPECT_EQ(k["ppl_ratio"]["value"].get<double>(), 1.0) << settings;
    EXPECT_EQ(k["rms_dp_text"]["value"].get<double>(), 0.0) << settings;
  }
}

TEST(QualityKld, F32VersusQ8ActivationsIsSmallButNotZero) {
  const std::string base = scratch().path("f32.kld");
  const nlohmann::json f32 = run_json("perplexity " + model_flag() + " -f " + kText +
                                      " -c 64 --act-quant f32 --json --kl-divergence-base " + base);
  const nlohmann::json q8 = run_json("perplexity " + model_flag() + " -f " + kText + " -c 64 --act-quant q8 --json");
  const nlohmann::json j = run_json("perplexity " + model_flag() + " -f " + kText + " --kl-divergence-base " + base +
                                    " --kl-divergence --json --act-quant q8");
  ASSERT_TRUE(j.contains("kld"));
  const auto& k = j["kld"];
  // The two perplexities of the separate runs are the ones the comparison reports, and they differ
  // by its PPL ratio (exp(mean(NLL_q8 - NLL_f32)) = PPL_q8 / PPL_f32 up to rounding).
  const double p_f32 = f32["ppl"].get<double>(), p_q8 = q8["ppl"].get<double>();
  EXPECT_NE(p_f32, p_q8);
  EXPECT_NEAR(k["ppl_base"]["value"].get<double>(), p_f32, 1e-9 * p_f32);
  EXPECT_NEAR(j["ppl"].get<double>(), p_q8, 1e-12 * p_q8);
  EXPECT_NEAR(k["ppl_ratio"]["value"].get<double>(), p_q8 / p_f32, 1e-9);
  const double kld = k["mean"]["value"].get<double>();
  std::fprintf(stderr, "KLD(f32 || q8) = %.3g +/- %.2g, p99 %.3g, same top-1 %.4f, PPL ratio %.5f\n", kld,
               k["mean"]["error"].get<double>(), k["p99"].get<double>(), k["same_top1"]["value"].get<double>(),
               k["ppl_ratio"]["value"].get<double>());
  EXPECT_GT(kld, 0.0);
  EXPECT_LT(kld, 0.01);
  EXPECT_GT(k["same_top1"]["value"].get<double>(), 0.95);
  EXPECT_LE(kld, k["mean_upper_bound"].get<double>());
  EXPECT_GE(k["p999"].get<double>(), k["p99"].get<double>());
  EXPECT_NEAR(k["ppl_ratio"]["value"].get<double>(), 1.0, 0.02);
  // The scalar kernels (f32 activations) against the AVX2 f32 base: the last bits only.
  const nlohmann::json s = run_json("perplexity " + model_flag() + " -f " + kText + " --kl-divergence-base " + base +
                                    " --kl-divergence --json --cpu-kernels scalar --act-quant f32");
  ASSERT_TRUE(s.contains("kld"));
  EXPECT_LT(s["kld"]["mean"]["value"].get<double>(), 1e-5);
}

TEST(QualityKld, Q4KMIsFurtherFromBf16ThanQ8) {
  STRATA_REQUIRE_FIXTURES(fx);
  const std::string bf16 = fx + "/models/qwen3moe-code-bf16.gguf";
  if (!fs::exists(bf16)) GTEST_SKIP() << "fixture " << bf16 << " absent";
  const std::string base = scratch().path("bf16.kld");
  ASSERT_EQ(run_strata("perplexity -m " + bf16 + " -t 2 -f " + kText + " -c 64 --kl-divergence-base " + base).rc, 0);
  std::map<std::string, double> kld;
  for (const std::string q : {"Q8_0", "Q4_K_M"}) {
    const std::string m = fx + "/models/qwen3moe-code-" + q + ".gguf";
    if (!fs::exists(m)) GTEST_SKIP() << "fixture " << m << " absent";
    const nlohmann::json j = run_json("perplexity -m " + m + " -t 2 -f " + kText + " --kl-divergence-base " + base +
                                      " --kl-divergence --json");
    ASSERT_TRUE(j.contains("kld")) << q;
    kld[q] = j["kld"]["mean"]["value"].get<double>();
    std::fprintf(stderr, "KLD(BF16 || %s) = %.4g, PPL %.4f (BF16 %.4f)\n", q.c_str(), kld[q], j["ppl"].get<double>(),
                 j["kld"]["ppl_base"]["value"].get<double>());
  }
  EXPECT_GT(kld["Q8_0"], 0.0);
  EXPECT_GT(kld["Q4_K_M"], kld["Q8_0"]);
}

TEST(QualityKld, WrongTextVocabularyTokenizerOrChunkAreClearErrors) {
  const std::string& base = shipped_base();
  const std::string cmp = "perplexity " + model_flag() + " --kl-divergence --kl-divergence-base ";
  // another text (long enough for 2 chunks of 64)
  const std::string other = std::string(STRATA_REPO_DIR) + "/tools/gen_quant_tables.py";
  CmdResult r = run_strata(cmp + base + " -f " + other);
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.out, HasSubstr("made from another text"));
  // another chunk size
  r = run_strata(cmp + base + " -f " + kText + " -c 128");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.out, HasSubstr("differs from the base file's chunk of 64"));
  // a base of another vocabulary / tokenizer (the header rewritten, checksum valid)
  quality::KldBase b = quality::read_kld_base(base);
  b.n_vocab = 151936;
  quality::write_kld_base(scratch().path("vocab.kld"), b);
  r = run_strata(cmp + scratch().path("vocab.kld") + " -f " + kText);
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.out, HasSubstr("vocabulary of 151936 tokens, this model 8192"));
  b = quality::read_kld_base(base);
  b.tokenizer_hash ^= 1;
  quality::write_kld_base(scratch().path("tok.kld"), b);
  r = run_strata(cmp + scratch().path("tok.kld") + " -f " + kText);
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.out, HasSubstr("another tokenizer"));
  // truncated and corrupt files, through the command
  std::vector<char> bytes;
  {
    std::ifstream in(base, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::ofstream(scratch().path("cut.kld"), std::ios::binary).write(bytes.data(), std::streamsize(bytes.size() / 2));
  r = run_strata(cmp + scratch().path("cut.kld") + " -f " + kText);
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.out, HasSubstr("truncated"));
  bytes[bytes.size() / 2] ^= 0x40;
  std::ofstream(scratch().path("bad.kld"), std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
  r = run_strata(cmp + scratch().path("bad.kld") + " -f " + kText);
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.out, HasSubstr("corrupt"));
  r = run_strata(cmp + test::shipped_model() + " -f " + kText);
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.out, HasSubstr("not a strata KLD base file"));
}

// ---- strata route-parity ----

TEST(QualityRouteParity, SettingsThatMustAgreePass) {
  for (const auto& [a, b] :
       std::vector<std::pair<std::string, std::string>>{{"--arena-mb 40", "--arena-mb 5 --prompt-chunk 16"},
                                                        {"--prompt-chunk 512",
                                                         "--prompt-chunk 7 --predict off --io-threads 1"},
                                                        // the whole text in one call vs calls of 64
                                                        {"--prompt-chunk 64", "--prompt-chunk 2048 --predict off"},
                                                        // every expert vs the minimum arena (automatic chunk)
                                                        {"--arena-mb 40", "--arena-mb 1"}}) {
    const CmdResult r = run_strata("route-parity -m " + test::shipped_model() + " -f " + kText + " --a \"-t 2 " + a +
                                   "\" --b \"-t 2 " + b + "\"");
    EXPECT_EQ(r.rc, 0) << r.out;
    EXPECT_THAT(r.out, HasSubstr("PASS: the routing agrees on all"));
    EXPECT_THAT(r.out, HasSubstr("decode"));
  }
}

TEST(QualityRouteParity, F32VersusQ8ReportsDifferencesWithTiesApart) {
  const CmdResult r = run_strata("route-parity -m " + test::shipped_model() + " -f " + kText +
                                     " --a \"-t 2 --act-quant q8\" --b \"-t 2 --act-quant f32\" --json",
                                 false);
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const size_t real = j["real"].get<size_t>(), ties = j["ties"].get<size_t>();
  std::fprintf(stderr, "route-parity q8 vs f32: %zu real differences, %zu ties in %zu pairs\n", real, ties,
               j["tokens_compared"].get<size_t>());
  EXPECT_EQ(r.rc, real ? 1 : 0);
  EXPECT_EQ(j["pass"].get<bool>(), real == 0);
  size_t sum_real = 0, sum_ties = 0;
  for (const auto& row : j["layers"]) {
    EXPECT_EQ(row["tokens"].get<size_t>(),
              row["same"].get<size_t>() + row["ties"].get<size_t>() + row["real"].get<size_t>());
    sum_real += row["real"].get<size_t>();
    sum_ties += row["ties"].get<size_t>();
  }
  EXPECT_EQ(sum_real, real);
  EXPECT_EQ(sum_ties, ties);
  if (real) {
    EXPECT_TRUE(j.contains("first_real"));
  }
  // A huge tolerance turns every single-expert swap into a tie: ties are separated, not dropped.
  const CmdResult t = run_strata("route-parity -m " + test::shipped_model() + " -f " + kText +
                                     " --a \"-t 2 --act-quant q8\" --b \"-t 2 --act-quant f32\" --json --tie-tol 1",
                                 false);
  const nlohmann::json jt = nlohmann::json::parse(t.out);
  EXPECT_EQ(jt["ties"].get<size_t>() + jt["real"].get<size_t>(), ties + real);
  if (real) {
    EXPECT_GT(jt["ties"].get<size_t>(), ties);
  }
}

namespace {
// kText's first 40 token ids, comma-separated (for --prompt-ids).
const std::string& prompt_ids40() {
  static const std::string ids = [] {
    engine::EngineOptions o;
    o.n_threads = 2;
    engine::Engine eng(test::shipped_model(), o);
    std::ifstream in(kText);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::vector<int32_t> t = eng.tokenizer().encode(ss.str());
    std::string out;
    for (size_t i = 0; i < 40 && i < t.size(); ++i) out += (i ? "," : "") + std::to_string(t[i]);
    return out;
  }();
  return ids;
}

// `strata run` of kText's first 40 tokens plus 4 greedy decode steps, dumping only the routing.
std::string dump_routes(const std::string& name, const std::string& settings) {
  const std::string dir = scratch().path(name);
  const CmdResult r = run_strata("run " + model_flag() + " --prompt-ids " + prompt_ids40() + " -n 4 --temp 0 " +
                                 settings + " --dump " + dir + " --dump-filter 'ffn_moe_route-.*'");
  EXPECT_EQ(r.rc, 0) << r.out;
  return dir;
}
}  // namespace

TEST(QualityRouteParity, FromTwoDumpDirectories) {
  // Two settings that must agree, recorded with --dump (different prompt chunks, so the calls
  // differ): PASS, decode rows present; a dump against itself: PASS.
  const std::string a = dump_routes("dump-a", "--arena-mb 40");
  const std::string b = dump_routes("dump-b", "--arena-mb 5 --prompt-chunk 16");
  const CmdResult self = run_strata("route-parity --dump-a " + a + " --dump-b " + a);
  EXPECT_EQ(self.rc, 0) << self.out;
  EXPECT_THAT(self.out, HasSubstr("PASS: the routing agrees on all"));
  const CmdResult ab = run_strata("route-parity --dump-a " + a + " --dump-b " + b + " --json", false);
  EXPECT_EQ(ab.rc, 0) << ab.out;
  const nlohmann::json j = nlohmann::json::parse(ab.out);
  EXPECT_TRUE(j["pass"].get<bool>());
  size_t prefill = 0, decode = 0;
  for (const auto& row : j["layers"]) (row["phase"] == "decode" ? decode : prefill) += row["tokens"].get<size_t>();
  EXPECT_EQ(prefill, 8u * 40u);  // 8 MoE layers x 40 prompt tokens
  EXPECT_EQ(decode, 8u * 3u);    // 4 generated tokens: the first from the prefill, 3 decode steps

  // One changed routing: layer 5 of the first call, token 7, its last chosen expert replaced by
  // one not chosen (the probabilities stay, so the boundary gap is the recorded one: real unless
  // it is a 1e-6 tie, which the test excludes by choosing the token).
  const std::string c = scratch().path("dump-c");
  fs::copy(a, c, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  const std::string file = c + "/00000-ffn_moe_route-5.f32";
  std::vector<float> rec(fs::file_size(file) / sizeof(float));
  {
    std::ifstream in(file, std::ios::binary);
    in.read(reinterpret_cast<char*>(rec.data()), std::streamsize(rec.size() * sizeof(float)));
  }
  const size_t K = 8, W = 2 * K + 1, t = 7;
  ASSERT_EQ(rec.size(), W * 40);
  const float pk = rec[t * W + 2 * K - 1], next = rec[t * W + 2 * K];
  ASSERT_GT((pk - next) / pk, 1e-6) << "token 7 is a tie; choose another";
  for (int e = 0; e < 64; ++e) {
    bool chosen = false;
    for (size_t k = 0; k < K; ++k) chosen = chosen || rec[t * W + k] == float(e);
    if (!chosen) {
      rec[t * W + K - 1] = float(e);
      break;
    }
  }
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(rec.data()), std::streamsize(rec.size() * sizeof(float)));
  }
  const CmdResult bad = run_strata("route-parity --dump-a " + a + " --dump-b " + c);
  EXPECT_EQ(bad.rc, 1) << bad.out;
  EXPECT_THAT(bad.out, HasSubstr("first real difference: prefill layer 5 token 7"));
  EXPECT_THAT(bad.out, HasSubstr("FAIL: 1 real routing differences (0 ties)"));
  EXPECT_THAT(bad.out, HasSubstr("in (phase layer): prefill 5"));

  // Bad input: a directory that is not a dump, a dump without routing, one side missing.
  const CmdResult nodump = run_strata("route-parity --dump-a " + scratch().path("") + " --dump-b " + a);
  EXPECT_EQ(nodump.rc, 1);
  EXPECT_THAT(nodump.out, HasSubstr("is not a --dump directory"));
  const std::string lo = scratch().path("dump-lout");
  ASSERT_EQ(run_strata("run " + model_flag() + " --prompt-ids 1,2,3 -n 1 --dump " + lo + " --dump-filter 'l_out-1'").rc,
            0);
  const CmdResult noroute = run_strata("route-parity --dump-a " + lo + " --dump-b " + a);
  EXPECT_EQ(noroute.rc, 1);
  EXPECT_THAT(noroute.out, HasSubstr("has no ffn_moe_route-L tensors"));
  const std::string ids39 = prompt_ids40().substr(0, prompt_ids40().rfind(','));
  const std::string other = scratch().path("dump-other");
  ASSERT_EQ(run_strata("run " + model_flag() + " --prompt-ids " + ids39 + " -n 4 --temp 0 --dump " + other +
                       " --dump-filter 'ffn_moe_route-.*'")
                .rc,
            0);
  const CmdResult diff = run_strata("route-parity --dump-a " + a + " --dump-b " + other);
  EXPECT_EQ(diff.rc, 1);
  EXPECT_THAT(diff.out, HasSubstr("the two dumps ran different tokens"));
  const CmdResult one = run_strata("route-parity --dump-a " + a);
  EXPECT_EQ(one.rc, 1);
  EXPECT_THAT(one.out, HasSubstr("give both --dump-a DIR and --dump-b DIR"));
}

TEST(QualityRouteParity, BadFlagsAreNamed) {
  const CmdResult r =
      run_strata("route-parity -m " + test::shipped_model() + " -f " + kText + " --a \"--arena-mb x\" --b \"\"");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.out, HasSubstr("--a \"--arena-mb x\""));
}

// ---- determinism (issue 15 item 4): CPU backend, logits and routing, across IO timing ----

namespace {
struct RunResult {
  std::vector<float> prefill_logits, decode_logits;
  model::RoutingTrace prefill_trace, decode_trace;
};

// Prefill of the first 80 tokens of kText (all logits), then 8 teacher-forced decode steps.
RunResult run_once(const engine::EngineOptions& o, bool slow_stream) {
  engine::Engine eng(test::shipped_model(), o);
  std::ifstream in(kText);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<int32_t> ids = eng.tokenizer().encode(text);
  ids.resize(88);
  std::atomic<bool> done{false};
  std::thread staller;
  if (slow_stream)  // pauses the IO threads 2 ms of every 3: reads land late and in other orders
    staller = std::thread([&] {
      while (!done) {
        eng.stream().pause_io(true);
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        eng.stream().pause_io(false);
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    });
  RunResult r;
  model::SequenceState st = eng.new_sequence();
  eng.prefill(st, std::span(ids).first(80), model::LogitsMode::All, r.prefill_logits, &r.prefill_trace);
  std::vector<float> step;
  for (size_t i = 80; i < ids.size(); ++i) {
    eng.decode(st, ids[i], step, &r.decode_trace);
    r.decode_logits.insert(r.decode_logits.end(), step.begin(), step.end());
  }
  done = true;
  if (staller.joinable()) staller.join();
  eng.stream().pause_io(false);
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}
bool same_trace(const model::RoutingTrace& a, const model::RoutingTrace& b) {
  if (a.ids != b.ids || a.probs.size() != b.probs.size() || a.next_prob.size() != b.next_prob.size()) return false;
  for (size_t l = 0; l < a.probs.size(); ++l) {
    if (a.probs[l].size() != b.probs[l].size() || !same_bits(a.next_prob[l], b.next_prob[l])) return false;
    for (size_t t = 0; t < a.probs[l].size(); ++t)
      if (!same_bits(a.probs[l][t], b.probs[l][t])) return false;
  }
  return true;
}
}  // namespace

TEST(QualityDeterminism, PrefillAndDecodeBitIdenticalAcrossIoTiming) {
  engine::EngineOptions ref;
  ref.n_threads = 2;
  ref.n_ctx = 128;
  ref.arena_mb = 40;  // every expert fits
  const RunResult a = run_once(ref, false);
  ASSERT_FALSE(a.prefill_trace.ids.empty());
  ASSERT_EQ(a.decode_logits.size(), 8u * 8192u);
  struct Variant {
    std::string name;
    engine::EngineOptions o;
    bool slow;
  };
  std::vector<Variant> variants;
  variants.push_back({"same settings again", ref, false});
  auto with = [&](const std::string& name, auto&& edit, bool slow = false) {
    engine::EngineOptions o = ref;
    edit(o);
    variants.push_back({name, o, slow});
  };
  with("io-threads 1", [](auto& o) { o.io_threads = 1; });
  with("io-threads 16", [](auto& o) { o.io_threads = 16; });
  with("arena 5 MiB, prompt chunk 16", [](auto& o) { o.arena_mb = 5, o.prompt_chunk = 16; });
  with("minimum arena (auto chunk)", [](auto& o) { o.arena_mb = 1; });
  with("prediction off", [](auto& o) { o.predict = false; });
  with("read ahead 2 layers", [](auto& o) { o.read_ahead_layers = 2; });
  with("read ahead 2 layers, arena 5 MiB, chunk 16",
       [](auto& o) { o.read_ahead_layers = 2, o.arena_mb = 5, o.prompt_chunk = 16; });
  with("prediction off, arena 5 MiB, chunk 16",
       [](auto& o) { o.predict = false, o.arena_mb = 5, o.prompt_chunk = 16; });
  with("buffered reads", [](auto& o) { o.direct_io = false; });
  with("prompt chunk 64, minimum arena", [](auto& o) { o.prompt_chunk = 64, o.arena_mb = 5; });
  with("moce bonus 0 in prefill too, arena 5 MiB", [](auto& o) { o.moce_prefill = true, o.arena_mb = 5; });
  with("threads 1", [](auto& o) { o.n_threads = 1; });
  with(
      "paused/slow stream, arena 5 MiB, chunk 16", [](auto& o) { o.arena_mb = 5, o.prompt_chunk = 16; }, true);
  with(
      "paused/slow stream, io-threads 1", [](auto& o) { o.io_threads = 1; }, true);
  for (const Variant& v : variants) {
    RunResult b;
    try {
      b = run_once(v.o, v.slow);
    } catch (const std::exception& e) {
      ADD_FAILURE() << v.name << ": " << e.what();
      continue;
    }
    EXPECT_TRUE(same_bits(a.prefill_logits, b.prefill_logits)) << v.name << ": prefill logits";
    EXPECT_TRUE(same_bits(a.decode_logits, b.decode_logits)) << v.name << ": decode logits";
    EXPECT_TRUE(same_trace(a.prefill_trace, b.prefill_trace)) << v.name << ": prefill routing";
    EXPECT_TRUE(same_trace(a.decode_trace, b.decode_trace)) << v.name << ": decode routing";
  }
}

// ---- defective router logits: a clear error naming the first bad token, on every path ----

TEST(Routing, DefectiveLogitsAreAClearErrorForTheFirstBadToken) {
  using G = backend::RouterSpec::Gating;
  // T = 1200 runs the threaded selection (>= 512 tokens): the first bad token is reported
  // whichever thread met it first.
  const int64_t T = 1200, n = 32;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> uni(-2.0f, 2.0f);
  struct Case {
    G gating;
    float value;
    bool all;
    const char* what;
  };
  const Case cases[] = {{G::Softmax, NAN, false, "contain NaN"},
                        {G::Sigmoid, NAN, false, "contain NaN"},
                        {G::SoftmaxTopK, INFINITY, false, "contain +inf"},
                        {G::Softmax, -INFINITY, true, "are all -inf"}};
  for (const Case& c : cases) {
    backend::RouterSpec spec;
    spec.gating = c.gating;
    spec.n_expert = int(n);
    spec.top_k = 4;
    std::vector<float> l(size_t(T * n));
    for (float& x : l) x = uni(rng);
    for (int64_t t : {int64_t(1100), int64_t(700)})
      for (int64_t e = 0; e < n; ++e)
        if (c.all || e == 9) l[size_t(t * n + e)] = c.value;
    backend::Routing r;
    try {
      backend::select_experts(spec, l.data(), T, r);
      ADD_FAILURE() << "accepted: " << c.what;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("token 700: the router logits " + std::string(c.what)), std::string::npos)
          << e.what();
    }
  }
  // Defined inputs: -inf is probability 0 (softmax), sigmoid takes +inf (probability 1).
  backend::RouterSpec spec;
  spec.n_expert = 4;
  spec.top_k = 2;
  std::vector<float> l = {-INFINITY, 1.0f, -INFINITY, 0.0f};
  backend::Routing r;
  backend::select_experts(spec, l.data(), 1, r);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(r.next_prob[0], 0.0f);
  spec.gating = G::Sigmoid;
  spec.norm_topk = false;
  l = {0.0f, INFINITY, -INFINITY, INFINITY};
  backend::select_experts(spec, l.data(), 1, r);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3}));  // a tie at p = 1: the lower id first
  EXPECT_EQ(r.weights, (std::vector<float>{1.0f, 1.0f}));
  EXPECT_EQ(r.next_prob[0], 0.5f);
}

// The TokenRanges form (the CPU backend spreads the selection over its pool) against the plain
// form: every byte of the result equal, for every gating, with a selection bias and a group
// limit, whatever the split, and the same first bad token.
TEST(Routing, TokenRangesFormEqualsThePlainForm) {
  using G = backend::RouterSpec::Gating;
  const int64_t T = 700, n = 64;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uni(-3.0f, 3.0f);
  // Uneven ranges of 1..13 tokens, run last first, so no split the plain form uses.
  int calls = 0;
  const backend::TokenRanges odd = [&](int64_t TT, const std::function<void(int64_t, int64_t)>& fn) {
    std::vector<std::pair<int64_t, int64_t>> parts;
    for (int64_t t = 0, w = 1; t < TT; t += w, w = w % 13 + 1) parts.push_back({t, std::min(TT, t + w)});
    for (auto it = parts.rbegin(); it != parts.rend(); ++it) fn(it->first, it->second);
    ++calls;
  };
  auto same = [](const backend::Routing& a, const backend::Routing& b) {
    auto bytes = [](const auto& v) {
      return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(v[0]));
    };
    return a.top_k == b.top_k && a.ids == b.ids && bytes(a.probs) == bytes(b.probs) &&
           bytes(a.weights) == bytes(b.weights) && bytes(a.next_prob) == bytes(b.next_prob);
  };
  for (G gating : {G::Softmax, G::Sigmoid, G::SoftmaxTopK}) {
    for (bool grouped : {false, true}) {
      backend::RouterSpec spec;
      spec.gating = gating;
      spec.n_expert = int(n);
      spec.top_k = 6;
      if (grouped && gating == G::Sigmoid) {  // DeepSeek-V3's shape: bias, 8 groups, 4 used
        spec.n_group = 8;
        spec.n_group_used = 4;
        for (int e = 0; e < n; ++e) spec.selection_bias.push_back(0.01f * float(e % 7));
      } else if (grouped) {
        continue;
      }
      std::vector<float> l(size_t(T * n));
      for (float& x : l) x = uni(rng);
      l[size_t(5 * n + 3)] = l[size_t(5 * n + 4)];  // a tie
      std::vector<float> l2 = l;
      backend::Routing a, b;
      backend::select_experts(spec, l.data(), T, a);
      calls = 0;
      backend::select_experts(spec, l2.data(), T, b, odd);
      EXPECT_EQ(calls, 1);
      EXPECT_TRUE(same(a, b)) << "gating " << int(gating) << (grouped ? " grouped" : "");
      EXPECT_EQ(std::memcmp(l.data(), l2.data(), l.size() * sizeof(float)), 0) << "the probabilities left in place";
      // A bad token: the same (first) one reported.
      l2[size_t(600 * n + 1)] = NAN;
      l2[size_t(40 * n + 2)] = NAN;
      try {
        backend::select_experts(spec, l2.data(), T, b, odd);
        ADD_FAILURE() << "NaN accepted";
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("token 40:"), std::string::npos) << e.what();
      }
    }
  }
}

// ---- MoCE (--moce-bonus, arXiv:2412.00099) ----

TEST(QualityMoce, SelectionWithBonusOnAHandComputedCase) {
  // 4 experts, top-2, logits 3 2 1 0 (range 3), experts 2 and 3 resident. Bonus 0.5 adds 1.5 to
  // them: 3 2 2.5 1.5, so experts 0 and 2 are chosen; the weights are the original softmax of the
  // chosen, renormalized: e^3 / (e^3 + e^1) and e^1 / (e^3 + e^1).
  backend::RouterSpec spec;
  spec.n_expert = 4;
  spec.top_k = 2;
  const std::vector<uint8_t> resident = {0, 0, 1, 1};
  const double z = std::exp(3.0) + std::exp(2.0) + std::exp(1.0) + 1.0;
  for (auto gating : {backend::RouterSpec::Gating::Softmax, backend::RouterSpec::Gating::SoftmaxTopK}) {
    spec.gating = gating;
    std::vector<float> l = {3, 2, 1, 0};
    backend::Routing r;
    backend::select_experts(spec, l.data(), 1, r, backend::ResidencyBonus{0.5f, resident});
    ASSERT_EQ(r.ids, (std::vector<int32_t>{0, 2}));
    EXPECT_NEAR(r.weights[0], std::exp(3.0) / (std::exp(3.0) + std::exp(1.0)), 1e-6);
    EXPECT_NEAR(r.weights[1], std::exp(1.0) / (std::exp(3.0) + std::exp(1.0)), 1e-6);
    if (gating == backend::RouterSpec::Gating::Softmax) {
      EXPECT_NEAR(r.probs[0], std::exp(3.0) / z, 1e-6);
    }
    // A bonus of 0.3 (0.9) does not lift expert 2 over expert 1: the exact routing.
    std::vector<float> l2 = {3, 2, 1, 0}, l3 = {3, 2, 1, 0};
    backend::Routing a, b;
    backend::select_experts(spec, l2.data(), 1, a, backend::ResidencyBonus{0.3f, resident});
    backend::select_experts(spec, l3.data(), 1, b);
    EXPECT_EQ(a.ids, b.ids);
    EXPECT_EQ(a.weights, b.weights);
  }
  // Sigmoid with a selection bias: the bonus goes on the logits, the bias on the scores, the
  // weights are the sigmoid of the original logits.
  spec.gating = backend::RouterSpec::Gating::Sigmoid;
  spec.selection_bias = {0, 0, 0, 0};
  std::vector<float> l = {3, 2, 1, 0};
  backend::Routing r;
  backend::select_experts(spec, l.data(), 1, r, backend::ResidencyBonus{0.5f, resident});
  ASSERT_EQ(r.ids, (std::vector<int32_t>{0, 2}));
  const double s0 = 1 / (1 + std::exp(-3.0)), s2 = 1 / (1 + std::exp(-1.0));
  EXPECT_NEAR(r.weights[0], s0 / (s0 + s2), 1e-6);
  // Bad inputs are named.
  std::vector<float> l4 = {3, 2, 1, 0};
  EXPECT_THROW(backend::select_experts(spec, l4.data(), 1, r, backend::ResidencyBonus{-1.0f, resident}),
               std::invalid_argument);
  EXPECT_THROW(backend::select_experts(spec, l4.data(), 1, r, backend::ResidencyBonus{0.5f, {}}),
               std::invalid_argument);
}

TEST(QualityMoce, BonusZeroOrEverythingResidentIsExactRouting) {
  // Random softmax and softmax-top-k routers: bonus 0 with any mask, and any bonus with every
  // expert resident (the same addition on every logit), give the exact routing bit for bit.
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0, 2);
  backend::RouterSpec spec;
  spec.n_expert = 64;
  spec.top_k = 8;
  std::vector<uint8_t> some(64), all(64, 1);
  for (auto& v : some) v = uint8_t(rng() % 2);
  for (auto gating : {backend::RouterSpec::Gating::Softmax, backend::RouterSpec::Gating::SoftmaxTopK}) {
    spec.gating = gating;
    std::vector<float> l(64 * 16);
    for (float& v : l) v = nd(rng);
    std::vector<float> a = l, b = l, c = l;
    backend::Routing ra, rb, rc;
    backend::select_experts(spec, a.data(), 16, ra);
    backend::select_experts(spec, b.data(), 16, rb, backend::ResidencyBonus{0.0f, some});
    backend::select_experts(spec, c.data(), 16, rc, backend::ResidencyBonus{0.85f, all});
    EXPECT_EQ(ra.ids, rb.ids);
    EXPECT_EQ(ra.ids, rc.ids);
    EXPECT_EQ(0, std::memcmp(ra.weights.data(), rb.weights.data(), ra.weights.size() * sizeof(float)));
    EXPECT_EQ(ra.weights, rc.weights);
  }
}

TEST(QualityMoce, LargeChunkSelectionEqualsPerTokenSelection) {
  // A chunk of 2048 tokens is selected on several threads (token ranges); every token's routing,
  // and the logits softmaxed in place, must be the bits of selecting that token alone. Coarse
  // logits make ties (broken by the lower id) frequent.
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0, 2);
  constexpr int64_t T = 2048;
  constexpr int kExperts = 64;
  std::vector<uint8_t> some(kExperts);
  for (auto& v : some) v = uint8_t(rng() % 2);
  using G = backend::RouterSpec::Gating;
  for (int variant = 0; variant < 4; ++variant) {
    backend::RouterSpec spec;
    spec.n_expert = kExperts;
    spec.top_k = 8;
    spec.gating = variant == 0 ? G::Softmax : variant == 1 ? G::SoftmaxTopK : G::Sigmoid;
    if (variant >= 2) {
      spec.n_group = 8;
      spec.n_group_used = 4;
      spec.weights_scale = 2.5f;
      for (int e = 0; e < kExperts; ++e) spec.selection_bias.push_back(0.01f * float(e % 7));
    }
    const float bonus = variant == 3 ? 0.3f : 0.0f;
    std::vector<float> l(size_t(T * kExperts));
    for (float& v : l) v = std::round(nd(rng) * 4.0f) / 4.0f;
    std::vector<float> whole = l;
    backend::Routing rw;
    backend::select_experts(spec, whole.data(), T, rw, backend::ResidencyBonus{bonus, some});
    ASSERT_EQ(rw.ids.size(), size_t(T * spec.top_k));
    size_t diff = 0;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<float> one(l.begin() + t * kExperts, l.begin() + (t + 1) * kExperts);
      backend::Routing r1;
      backend::select_experts(spec, one.data(), 1, r1, backend::ResidencyBonus{bonus, some});
      const size_t k0 = size_t(t * spec.top_k), K = size_t(spec.top_k);
      diff += std::memcmp(r1.ids.data(), rw.ids.data() + k0, K * sizeof(int32_t)) != 0;
      diff += std::memcmp(r1.probs.data(), rw.probs.data() + k0, K * sizeof(float)) != 0;
      diff += std::memcmp(r1.weights.data(), rw.weights.data() + k0, K * sizeof(float)) != 0;
      diff += std::memcmp(&r1.next_prob[0], &rw.next_prob[size_t(t)], sizeof(float)) != 0;
      diff += std::memcmp(one.data(), whole.data() + t * kExperts, kExperts * sizeof(float)) != 0;
    }
    EXPECT_EQ(diff, 0u) << "variant " << variant;
  }
}

TEST(QualityMoce, BonusZeroEqualsThePlainRunBitForBit) {
  const std::string common = "run " + model_flag() + " -p 'def fibonacci(n):' -n 24 --temp 0 --json --arena-mb 5";
  const nlohmann::json plain = run_json(common);
  const nlohmann::json zero = run_json(common + " --moce-bonus 0 --moce-prefill");
  ASSERT_TRUE(plain.contains("ids"));
  EXPECT_EQ(plain["ids"], zero["ids"]);
  // (The miss counts are not compared: with the read-ahead on they depend on IO timing.)
  EXPECT_EQ(zero["stats"]["decode"]["moce_substituted"].get<uint64_t>(), 0u);
}

namespace {
// Teacher-forced decode of `tokens` at `bonus` with a small arena; returns the log-probs and
// the decode misses and MoCE counters.
struct MoceRun {
  std::vector<float> logp;
  uint64_t misses = 0;
  model::MoceStats moce;
};
MoceRun moce_run(engine::Engine& eng, std::span<const int32_t> tokens, float bonus) {
  eng.set_moce_bonus(bonus);
  MoceRun r;
  r.logp = quality::teacher_forced_logprobs(eng, tokens);
  r.misses = eng.decode_stats().stream.misses;
  r.moce = eng.decode_stats().moce;
  return r;
}
std::vector<int32_t> text_tokens(const engine::Engine& eng, size_t skip, size_t n) {
  std::ifstream in(kText);
  std::stringstream ss;
  ss << in.rdbuf();
  std::vector<int32_t> t = eng.tokenizer().encode(ss.str());
  EXPECT_GE(t.size(), skip + n);
  return std::vector<int32_t>(t.begin() + ptrdiff_t(skip), t.begin() + ptrdiff_t(std::min(t.size(), skip + n)));
}
// `n` token ids of kText after the first `skip`, comma-separated (for --prompt-ids).
std::string text_ids(size_t skip, size_t n) {
  engine::EngineOptions o;
  o.n_threads = 2;
  engine::Engine eng(test::shipped_model(), o);
  std::string out;
  for (int32_t id : text_tokens(eng, skip, n)) out += (out.empty() ? "" : ",") + std::to_string(id);
  return out;
}
}  // namespace

TEST(QualityMoce, BonusWithASmallArenaLowersMissesAndHasAKld) {
  engine::EngineOptions o;
  o.n_threads = 2;
  o.n_ctx = 128;
  o.arena_mb = 5;  // 75 slots of the 512 experts (15 %)
  // Without the read-ahead the misses depend on the routing only (with it, on IO timing too:
  // docs/tools.md reports both).
  o.predict = false;
  engine::Engine eng(test::shipped_model(), o);
  const std::vector<int32_t> toks = text_tokens(eng, 0, 64);
  const MoceRun base = moce_run(eng, toks, 0);
  const MoceRun again = moce_run(eng, toks, 0);
  EXPECT_EQ(quality::mean_kld_rows(base.logp, again.logp, eng.hparams().n_vocab), 0.0);
  EXPECT_EQ(base.moce.substituted, 0u);
  for (float b : {0.5f, 0.85f}) {
    const MoceRun m = moce_run(eng, toks, b);
    const double kld = quality::mean_kld_rows(base.logp, m.logp, eng.hparams().n_vocab);
    std::printf(
        "moce bonus %.2f, arena 5 MiB, 64 teacher-forced tokens: misses %llu (bonus 0: %llu), substituted %llu, "
        "misses avoided %llu, mean KLD %.5f\n",
        b, (unsigned long long)m.misses, (unsigned long long)base.misses, (unsigned long long)m.moce.substituted,
        (unsigned long long)m.moce.misses_avoided, kld);
    EXPECT_LT(m.misses, base.misses) << b;
    EXPECT_GT(m.moce.substituted, 0u) << b;
    EXPECT_GT(m.moce.misses_avoided, 0u) << b;
    EXPECT_GT(kld, 0.0) << b;
    EXPECT_TRUE(std::isfinite(kld)) << b;
  }
  EXPECT_THROW(eng.set_moce_bonus(-0.5f), engine::EngineError);
  EXPECT_THROW(eng.set_moce_bonus(NAN), engine::EngineError);
}

TEST(QualityMoce, BlockMeanErrorIsTheBatchMeansEstimate) {
  // Two sequences, blocks of 2: block means 1, 3 | 5 (the trailing 7 counts in the mean only).
  const std::vector<std::vector<double>> v = {{0, 2, 2, 4}, {4, 6, 7}};
  const quality::MeanError m = quality::block_mean_error(v, 2);
  EXPECT_DOUBLE_EQ(m.mean, 25.0 / 7.0);
  // sd of {1, 3, 5} = 2, over sqrt(3) blocks.
  EXPECT_NEAR(m.error, 2.0 / std::sqrt(3.0), 1e-12);
  EXPECT_EQ(quality::block_mean_error(std::vector<std::vector<double>>{{1, 2, 3}}, 4).error, 0.0);
  EXPECT_THROW(quality::block_mean_error(v, 0), std::invalid_argument);
}

TEST(QualityMoce, CalibratedBonusRespectsItsBudget) {
  engine::EngineOptions o;
  o.n_threads = 2;
  o.n_ctx = 128;
  o.arena_mb = 5;     // 75 slots of the 512 experts (15 %)
  o.predict = false;  // residency from the routing alone: deterministic, the bonus matters most
  engine::Engine eng(test::shipped_model(), o);
  // The built-in calibration sample: the model's own text at temperature 1, fixed seeds.
  const auto cal = quality::moce_sampled_texts(eng, quality::kMoceSampleSequences, quality::kMoceSampleTokens);
  ASSERT_EQ(cal.size(), size_t(quality::kMoceSampleSequences));
  for (const auto& t : cal) ASSERT_EQ(t.size(), size_t(quality::kMoceSampleTokens));
  EXPECT_NE(cal[0], cal[1]);  // other seeds, other text
  const auto again = quality::moce_sampled_texts(eng, 1, 24);
  EXPECT_TRUE(std::equal(again[0].begin(), again[0].end(), cal[0].begin())) << "the sample is not reproducible";
  const double budget = 0.01;
  const quality::MoceCalibration c = quality::calibrate_moce(eng, cal, budget);
  ASSERT_FALSE(c.grid.empty());
  EXPECT_EQ(eng.options().moce_bonus, c.bonus);
  EXPECT_EQ(c.tokens, size_t(quality::kMoceSampleSequences * quality::kMoceSampleTokens));
  // The criterion: every point up to the chosen one has its bound within the budget; the search
  // stops at the first point above it (or at the end of the grid).
  for (size_t i = 0; i < c.grid.size(); ++i) {
    const auto& g = c.grid[i];
    EXPECT_DOUBLE_EQ(g.kld_bound, g.kld + quality::kMoceZ * g.kld_error);
    EXPECT_GT(g.kld_error, 0.0) << g.bonus;
    if (g.bonus <= c.bonus) {
      EXPECT_LE(g.kld_bound, budget) << g.bonus;
    }
    if (i + 1 == c.grid.size() && c.grid.size() < std::size(quality::kMoceGrid)) {
      EXPECT_GT(g.kld_bound, budget);
    }
  }
  // A bonus was chosen, so the held-back check below is not trivially 0.
  ASSERT_GT(c.bonus, 0.0f) << "bound of the smallest grid bonus: " << c.grid[0].kld_bound;
  EXPECT_LE(c.kld_bound, budget);
  // Held back: two parts of kText (real code, not the model's own text), each from an empty arena.
  for (const size_t skip : {size_t(0), size_t(200)}) {
    const std::vector<int32_t> held = text_tokens(eng, skip, 64);
    const MoceRun b0 = moce_run(eng, held, 0);
    const MoceRun bc = moce_run(eng, held, c.bonus);
    const double kld = quality::mean_kld_rows(b0.logp, bc.logp, eng.hparams().n_vocab);
    std::printf(
        "moce calibration, budget %.3f: chose %g (calibration KLD %.5f, bound %.5f); held-back tokens %zu..%zu: "
        "KLD %.5f, misses %llu vs %llu at bonus 0\n",
        budget, c.bonus, c.kld, c.kld_bound, skip, skip + 64, kld, (unsigned long long)bc.misses,
        (unsigned long long)b0.misses);
    EXPECT_LE(kld, budget) << "held-back tokens from " << skip;
    EXPECT_LT(bc.misses, b0.misses) << "the chosen bonus should save reads";
  }
  EXPECT_THROW(quality::calibrate_moce(eng, cal, 0.0), std::invalid_argument);
  EXPECT_THROW(quality::calibrate_moce(eng, {}, budget), std::invalid_argument);
  const std::vector<std::vector<int32_t>> short_text = {std::vector<int32_t>(cal[0].begin(), cal[0].begin() + 31)};
  EXPECT_THROW(quality::calibrate_moce(eng, short_text, budget), std::invalid_argument);  // 1 block of 16
}

TEST(QualityMoce, MoceBenchReportsSpeedAndKldSideBySide) {
  // Calibrate on a short file (the first 200 characters of kText, at least two blocks of 16 tokens) and measure on a held-back part.
  const std::string cal = scratch().path("moce-cal.txt");
  {
    std::ifstream in(kText);
    std::stringstream ss;
    ss << in.rdbuf();
    std::ofstream(cal) << ss.str().substr(0, 200);
  }
  const std::string held = text_ids(400, 24);
  const std::string args = "moce-bench " + model_flag() + " --arena-mb 5 --predict off -c 64 --prompt-ids " + held +
                           " --bonuses 0,0.5 --moce-kld-budget 0.05 --moce-calibrate " + cal;
  const nlohmann::json j = run_json(args + " --json");
  ASSERT_TRUE(j.contains("rows"));
  ASSERT_EQ(j["rows"].size(), 3u);  // 0, 0.5, calibrated
  EXPECT_EQ(j["tokens"].get<size_t>(), 24u);
  const auto& r0 = j["rows"][0];
  const auto& r5 = j["rows"][1];
  const auto& rc = j["rows"][2];
  EXPECT_EQ(r0["bonus"].get<double>(), 0.0);
  EXPECT_EQ(r0["kld_mean"].get<double>(), 0.0);
  EXPECT_EQ(r0["same_top1"].get<double>(), 1.0);
  EXPECT_EQ(r0["moce_substituted"].get<uint64_t>(), 0u);
  EXPECT_EQ(r0["tokens"].get<int64_t>(), 24);
  EXPECT_GT(r0["tokens_per_s"].get<double>(), 0.0);
  EXPECT_EQ(r5["bonus"].get<double>(), 0.5);
  EXPECT_LT(r5["misses"].get<uint64_t>(), r0["misses"].get<uint64_t>());
  EXPECT_GT(r5["moce_substituted"].get<uint64_t>(), 0u);
  EXPECT_GT(r5["kld_mean"].get<double>(), 0.0);
  EXPECT_LE(r5["kld_mean"].get<double>(), r5["kld_max"].get<double>());
  EXPECT_TRUE(rc["calibrated"].get<bool>());
  EXPECT_EQ(rc["bonus"].get<double>(), j["calibration"]["bonus"].get<double>());
  EXPECT_LE(j["calibration"]["kld"].get<double>(), 0.05);
  std::printf(
      "moce-bench, arena 5 MiB, read-ahead off, 24 held-back tokens: bonus 0 misses %llu; 0.5: misses %llu, "
      "KLD %.5f; calibrated %g (budget 0.05, calibration KLD %.5f): held-back KLD %.5f, misses %llu\n",
      (unsigned long long)r0["misses"].get<uint64_t>(), (unsigned long long)r5["misses"].get<uint64_t>(),
      r5["kld_mean"].get<double>(), rc["bonus"].get<double>(), j["calibration"]["kld"].get<double>(),
      rc["kld_mean"].get<double>(), (unsigned long long)rc["misses"].get<uint64_t>());
  // The same KLD is a pure function of the routing with the read-ahead off: the text output agrees.
  const CmdResult text = run_strata(args, false);
  EXPECT_EQ(text.rc, 0);
  EXPECT_THAT(text.out, HasSubstr("(calibrated)"));
  EXPECT_THAT(text.out, HasSubstr("read-ahead off"));
  // Bad input is named.
  for (const auto& [bad, msg] :
       std::vector<std::pair<std::string, std::string>>{{" --bonuses 0,x", "'x' is not a bonus"},
                                                        {" --bonuses 0,-1", "'-1' is not a bonus"},
                                                        {" --moce-bonus 0.5", "give the values with --bonuses"}}) {
    const CmdResult r = run_strata("moce-bench " + model_flag() + " --prompt-ids " + held + bad);
    EXPECT_EQ(r.rc, 1) << bad;
    EXPECT_THAT(r.out, HasSubstr(msg)) << bad;
  }
}
