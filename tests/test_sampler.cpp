// Sampler tests: greedy, determinism, each filter's effect, repetition penalty, and the
// empirical distribution against softmax.
#include "engine/sampler.h"

#include "engine/logits_scan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <stdexcept>
#include <vector>

using strata::engine::Sampler;
using strata::engine::SamplerParams;

namespace {

SamplerParams no_filters(float temp = 1.0f, uint64_t seed = 1234) {
  SamplerParams p;
  p.temp = temp;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  p.repeat_penalty = 1.0f;
  p.seed = seed;
  return p;
}

// Logits whose softmax is exactly `probs`.
std::vector<float> logits_of(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

std::set<int32_t> drawable(const SamplerParams& p, const std::vector<float>& logits, int draws = 5000) {
  Sampler s(p);
  std::set<int32_t> ids;
  for (int i = 0; i < draws; ++i) ids.insert(s.sample(logits, {}));
  return ids;
}

const std::vector<double> kProbs = {0.5, 0.3, 0.15, 0.05};

}  // namespace

TEST(Sampler, GreedyIsArgmax) {
  std::mt19937 gen(7);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (float temp : {0.0f, -1.0f}) {
    Sampler s(no_filters(temp));
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<float> l(1000);
      for (float& x : l) x = nd(gen);
      int32_t expect = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
      EXPECT_EQ(s.sample(l, {}), expect);
    }
  }
  // ties: the lowest id wins
  Sampler s(no_filters(0.0f));
  EXPECT_EQ(s.sample(std::vector<float>{1.0f, 3.0f, 2.0f, 3.0f}, {}), 1);
  // default params with temp 0 are greedy too
  SamplerParams d;
  d.temp = 0.0f;
  EXPECT_EQ(Sampler(d).sample(std::vector<float>{0.1f, -2.0f, 0.7f}, {}), 2);
}

TEST(Sampler, SameSeedSameSequence) {
  std::vector<float> l = {0.1f, 0.2f, 0.3f, 0.0f, -0.1f, 0.25f, 0.05f, 0.15f};
  for (SamplerParams p : {no_filters(1.0f, 42), SamplerParams{.temp = 0.8f, .seed = 42}}) {
    Sampler a(p), b(p);
    std::vector<int32_t> sa, sb;
    for (int i = 0; i < 500; ++i) {
      sa.push_back(a.sample(l, sa));
      sb.push_back(b.sample(l, sb));
    }
    EXPECT_EQ(sa, sb);
    EXPECT_EQ(a.seed(), 42u);
    // a different seed gives a different sequence (overwhelmingly likely over 500 draws)
    p.seed = 43;
    Sampler c(p);
    std::vector<int32_t> sc;
    for (int i = 0; i < 500; ++i) sc.push_back(c.sample(l, sc));
    EXPECT_NE(sa, sc);
  }
  // the random seed is not the sentinel and is reported
  Sampler r(no_filters(1.0f, strata::engine::kRandomSeed));
  EXPECT_NE(r.seed(), strata::engine::kRandomSeed);
}

TEST(Sampler, TopK1IsGreedy) {
  std::mt19937 gen(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  SamplerParams p = no_filters(1.5f);
  p.top_k = 1;
  Sampler s(p);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> l(64);
    for (float& x : l) x = nd(gen);
    int32_t expect = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    EXPECT_EQ(s.sample(l, {}), expect);
  }
}

TEST(Sampler, TopKKeepsTheKBest) {
  SamplerParams p = no_filters();
  p.top_k = 2;
  EXPECT_EQ(drawable(p, logits_of(kProbs)), (std::set<int32_t>{0, 1}));
  p.top_k = 3;
  EXPECT_EQ(drawable(p, logits_of(kProbs)), (std::set<int32_t>{0, 1, 2}));
  p.top_k = 100;  // larger than the vocabulary: everything
  EXPECT_EQ(drawable(p, logits_of(kProbs)), (std::set<int32_t>{0, 1, 2, 3}));
}

TEST(Sampler, TopPRemovesTheTail) {
  SamplerParams p = no_filters();
  auto l = logits_of(kProbs);  // 0.5, 0.3, 0.15, 0.05
  p.top_p = 0.4f;              // 0.5 already reaches it
  EXPECT_EQ(drawable(p, l), (std::set<int32_t>{0}));
  p.top_p = 0.75f;  // 0.5 + 0.3 crosses it: the crossing token is kept
  EXPECT_EQ(drawable(p, l), (std::set<int32_t>{0, 1}));
  p.top_p = 0.9f;
  EXPECT_EQ(drawable(p, l), (std::set<int32_t>{0, 1, 2}));
  p.top_p = 0.99f;
  EXPECT_EQ(drawable(p, l), (std::set<int32_t>{0, 1, 2, 3}));
  // order of the vocabulary does not matter
  std::vector<float> shuffled = {l[3], l[1], l[0], l[2]};
  p.top_p = 0.75f;
  EXPECT_EQ(drawable(p, shuffled), (std::set<int32_t>{2, 1}));
}

TEST(Sampler, MinPRemovesUnlikely) {
  SamplerParams p = no_filters();
  auto l = logits_of(kProbs);  // max 0.5
  p.min_p = 0.2f;              // threshold 0.1: drops 0.05
  EXPECT_EQ(drawable(p, l), (std::set<int32_t>{0, 1, 2}));
  p.min_p = 0.5f;  // threshold 0.25: drops 0.15 and 0.05
  EXPECT_EQ(drawable(p, l), (std::set<int32_t>{0, 1}));
  p.min_p = 0.9f;  // threshold 0.45
  EXPECT_EQ(drawable(p, l), (std::set<int32_t>{0}));
  p.min_p = 0.05f;  // threshold 0.025: keeps all
  EXPECT_EQ(drawable(p, l), (std::set<int32_t>{0, 1, 2, 3}));
}

TEST(Sampler, FiltersApplyBeforeTemperature) {
  // A high temperature flattens the distribution, but the filters use the untempered one.
  SamplerParams p = no_filters(50.0f);
  p.min_p = 0.5f;
  EXPECT_EQ(drawable(p, logits_of(kProbs)), (std::set<int32_t>{0, 1}));
  p = no_filters(50.0f);
  p.top_p = 0.75f;
  EXPECT_EQ(drawable(p, logits_of(kProbs)), (std::set<int32_t>{0, 1}));
}

TEST(Sampler, RepetitionPenaltyChangesArgmax) {
  SamplerParams p = no_filters(0.0f);
  p.repeat_penalty = 1.5f;
  p.repeat_last_n = 64;
  std::vector<float> pos = {2.0f, 1.9f, -1.0f, 0.5f};
  EXPECT_EQ(Sampler(no_filters(0.0f)).sample(pos, std::vector<int32_t>{0}), 0);  // penalty off
  EXPECT_EQ(Sampler(p).sample(pos, std::vector<int32_t>{0}), 1);                 // 2.0 / 1.5 < 1.9
  EXPECT_EQ(Sampler(p).sample(pos, std::vector<int32_t>{0, 0, 0}), 1);           // once per distinct id
  // negative logits are multiplied
  std::vector<float> neg = {-1.0f, -1.2f};
  EXPECT_EQ(Sampler(p).sample(neg, std::vector<int32_t>{0}), 1);  // -1.5 < -1.2
  // only the last repeat_last_n ids count
  p.repeat_last_n = 2;
  EXPECT_EQ(Sampler(p).sample(pos, std::vector<int32_t>{0, 3, 3}), 0);
  EXPECT_EQ(Sampler(p).sample(pos, std::vector<int32_t>{3, 0, 3}), 1);
  p.repeat_last_n = 0;  // off
  EXPECT_EQ(Sampler(p).sample(pos, std::vector<int32_t>{0}), 0);
  p.repeat_last_n = -1;  // whole history
  EXPECT_EQ(Sampler(p).sample(pos, std::vector<int32_t>{0, 3, 3, 3, 3}), 1);
  // out-of-range history ids are ignored
  p.repeat_last_n = 64;
  EXPECT_EQ(Sampler(p).sample(pos, std::vector<int32_t>{-5, 99}), 0);
  // with sampling, the penalized token becomes less frequent
  SamplerParams ps = no_filters(1.0f);
  ps.repeat_penalty = 3.0f;
  Sampler s(ps);
  int zeros = 0;
  for (int i = 0; i < 2000; ++i) zeros += s.sample(std::vector<float>{3.0f, 0.0f}, std::vector<int32_t>{0}) == 0;
  // p(0) = softmax(1, 0)[0] = 0.731
  EXPECT_NEAR(zeros / 2000.0, 0.731, 0.05);
}

TEST(Sampler, EmpiricalFrequenciesMatchSoftmax) {
  for (float temp : {1.0f, 0.5f}) {
    std::vector<float> l = {1.0f, 0.5f, 0.0f, -0.5f, -1.0f, 2.0f, -3.0f, 0.25f};
    std::vector<double> p(l.size());
    double sum = 0;
    for (size_t i = 0; i < l.size(); ++i) sum += p[i] = std::exp(static_cast<double>(l[i]) / temp);
    for (double& x : p) x /= sum;

    Sampler s(no_filters(temp, 2024));
    const int n = 20000;
    std::vector<int> counts(l.size());
    for (int i = 0; i < n; ++i) ++counts.at(static_cast<size_t>(s.sample(l, {})));
    for (size_t i = 0; i < l.size(); ++i) {
      double expect = n * p[i];
      double sigma = std::sqrt(n * p[i] * (1 - p[i]));
      EXPECT_LE(std::abs(counts[i] - expect), 3 * sigma)
          << "temp " << temp << " token " << i << ": " << counts[i] << " draws, expected " << expect;
    }
  }
}

TEST(Sampler, EdgeCases) {
  Sampler s(no_filters());
  EXPECT_THROW(s.sample(std::vector<float>{}, {}), std::invalid_argument);
  // a single token
  EXPECT_EQ(s.sample(std::vector<float>{0.3f}, {}), 0);
  // -inf and NaN are never drawn
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> l = {-inf, 0.0f, std::nanf(""), 0.0f};
  for (int i = 0; i < 1000; ++i) {
    int32_t id = s.sample(l, {});
    EXPECT_TRUE(id == 1 || id == 3) << id;
  }
  // all -inf: falls back to the lowest id
  EXPECT_EQ(s.sample(std::vector<float>{-inf, -inf}, {}), 0);
  // min_p > 1 still keeps the best token
  SamplerParams p = no_filters();
  p.min_p = 2.0f;
  EXPECT_EQ(drawable(p, logits_of(kProbs), 200), (std::set<int32_t>{0}));
}

TEST(Sampler, LogitBiasForcesAndBans) {
  // OpenAI's logit_bias: +100 forces a token at temperature 0 (and all but always when drawn),
  // -100 bans the argmax; ids outside the logits are ignored.
  const std::vector<float> logits = {0.5f, 3.0f, 1.0f, -2.0f, 2.5f};
  SamplerParams p = no_filters(0.0f);
  EXPECT_EQ(Sampler(p).sample(logits, {}), 1);
  p.logit_bias = {{3, 100.0f}, {99, -100.0f}, {-1, 100.0f}};
  EXPECT_EQ(Sampler(p).sample(logits, {}), 3);
  p.logit_bias = {{1, -100.0f}};
  EXPECT_EQ(Sampler(p).sample(logits, {}), 4);
  SamplerParams hot = no_filters(1.0f, 7);
  hot.logit_bias = {{3, 100.0f}};
  Sampler s(hot);
  for (int i = 0; i < 200; ++i) ASSERT_EQ(s.sample(logits, {}), 3);
  hot.logit_bias = {{1, -100.0f}};
  Sampler b(hot);
  for (int i = 0; i < 2000; ++i) ASSERT_NE(b.sample(logits, {}), 1);
}

// The whole-vocabulary scans (engine/logits_scan.h) against plain loops: random logits on a
// coarse grid (many ties), NaN and +-inf sprinkled in, every length from 0 to 80 (the SSE2 body
// and its scalar tail) and a Qwen3-sized vocabulary; argmax counts NaN as -inf with the lowest
// index on ties, top_k gives the set and order of a partial sort by (higher logit, lower id).
TEST(LogitsScan, EqualPlainLoops) {
  namespace e = strata::engine;
  std::mt19937 rng(77);
  std::uniform_int_distribution<int> grid(-8, 8), pick(0, 99);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 80; ++n) lengths.push_back(n);
  lengths.push_back(151936);
  int checked = 0;
  for (size_t n : lengths)
    for (int variant = 0; variant < 6; ++variant) {
      std::vector<float> v(n);
      for (float& x : v) {
        const int r = pick(rng);
        x = variant == 5            ? nan  // all NaN
            : variant >= 1 && r < 3 ? nan
            : variant >= 2 && r < 5 ? -inf
            : variant >= 3 && r < 6 ? inf
                                    : 0.5f * float(grid(rng));
      }
      // all_finite
      bool fin = true;
      for (float x : v) fin = fin && std::isfinite(x);
      EXPECT_EQ(e::all_finite(v), fin) << "n " << n << " variant " << variant;
      // argmax
      int32_t best = 0;
      auto key = [&](size_t i) { return std::isnan(v[i]) ? -inf : v[i]; };
      for (size_t i = 1; i < n; ++i)
        if (key(i) > key(size_t(best))) best = int32_t(i);
      EXPECT_EQ(e::argmax(v), best) << "n " << n << " variant " << variant;
      // top_k
      std::vector<e::LogitCand> all;
      for (size_t i = 0; i < n; ++i) all.push_back({key(i), int32_t(i)});
      auto better = [](const e::LogitCand& a, const e::LogitCand& b) {
        return a.logit != b.logit ? a.logit > b.logit : a.id < b.id;
      };
      for (int k : {1, 2, 5, 40, int(n) - 1, int(n), int(n) + 3}) {
        if (k <= 0) continue;
        std::vector<e::LogitCand> want = all;
        const size_t m = std::min(size_t(k), n);
        std::partial_sort(want.begin(), want.begin() + std::ptrdiff_t(m), want.end(), better);
        want.resize(m);
        std::vector<e::LogitCand> got;
        e::top_k(v, k, got);
        ASSERT_EQ(got.size(), want.size()) << "n " << n << " k " << k;
        for (size_t i = 0; i < m; ++i) {
          EXPECT_EQ(got[i].id, want[i].id) << "n " << n << " k " << k << " rank " << i;
          EXPECT_EQ(got[i].logit, want[i].logit) << "n " << n << " k " << k << " rank " << i;
        }
        ++checked;
      }
    }
  // a single non-finite value is found at every position of a 16-float step and in the tail
  for (size_t at = 0; at < 40; ++at)
    for (float bad : {nan, inf, -inf}) {
      std::vector<float> v(40, 1.0f);
      v[at] = bad;
      EXPECT_FALSE(e::all_finite(v)) << at;
    }
  std::vector<e::LogitCand> none;
  e::top_k(std::vector<float>(5, 1.0f), 0, none);
  EXPECT_TRUE(none.empty());
  EXPECT_GT(checked, 400);
}
