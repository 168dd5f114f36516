#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <unordered_set>

namespace strata::engine {

namespace {

uint64_t pick_seed(uint64_t requested) {
  if (requested != kRandomSeed) return requested;
  std::random_device rd;
  // 63 bits: the seed is printed for reuse, and --seed (and the server's "seed") take a signed
  // 64-bit integer.
  uint64_t s = ((static_cast<uint64_t>(rd()) << 32) ^ rd()) & 0x7fff'ffff'ffff'ffffull;
  return s;  // never kRandomSeed (above 2^63 - 1)
}

}  // namespace

Sampler::Sampler(const SamplerParams& params) : params_(params), seed_(pick_seed(params.seed)), rng_(seed_) {}

int32_t Sampler::sample(std::span<const float> logits, std::span<const int32_t> history) {
  if (logits.empty()) throw std::invalid_argument("Sampler::sample: empty logits");
  const auto n = static_cast<int32_t>(logits.size());
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // The logits as the filters see them: NaN as -inf (the scans count it so), plus the logit bias
  // and the repetition penalty. Without those two the input is read as it is (no copy): each
  // whole-vocabulary pass below is one SSE2 scan (logits_scan.h).
  const bool penalty = params_.repeat_penalty != 1.0f && params_.repeat_last_n != 0 && !history.empty();
  std::span<const float> l = logits;
  if (penalty || !params_.logit_bias.empty()) {
    logits_.assign(logits.begin(), logits.end());
    for (const auto& [id, bias] : params_.logit_bias)
      if (id >= 0 && id < n) {
        float& x = logits_[static_cast<size_t>(id)];
        x = std::isnan(x) ? kNegInf : x + bias;
      }

    // 1. repetition penalty over the last repeat_last_n ids, each distinct token once.
    if (penalty) {
      size_t last = params_.repeat_last_n < 0 ? history.size()
                                              : std::min(history.size(), static_cast<size_t>(params_.repeat_last_n));
      std::unordered_set<int32_t> seen;
      for (int32_t id : history.subspan(history.size() - last)) {
        if (id < 0 || id >= n || !seen.insert(id).second) continue;
        float& x = logits_[static_cast<size_t>(id)];
        if (std::isnan(x)) x = kNegInf;
        x = x > 0 ? x / params_.repeat_penalty : x * params_.repeat_penalty;
      }
    }
    l = logits_;
  }

  // Greedy: argmax, lowest id on ties.
  if (params_.temp <= 0.0f) return argmax(l);

  bool sorted = false;

  // 2. top-k: the k best in order by one scan (the set and order of a partial sort)
  if (params_.top_k > 0 && params_.top_k < n) {
    top_k(l, params_.top_k, cands_);
    sorted = true;
  } else {
    cands_.clear();
    cands_.reserve(l.size());
    for (int32_t i = 0; i < n; ++i) {
      const float x = l[static_cast<size_t>(i)];
      cands_.push_back({std::isnan(x) ? kNegInf : x, i});
    }
  }

  // softmax over the current candidates (in candidate order) into probs_
  auto softmax = [&](float inv_temp) {
    float mx = kNegInf;
    for (const auto& c : cands_) mx = std::max(mx, c.logit);
    probs_.resize(cands_.size());
    double sum = 0;
    for (size_t i = 0; i < cands_.size(); ++i) {
      const float l = cands_[i].logit;
      double p = l == kNegInf || mx == kNegInf ? 0.0
                 : std::isinf(mx)              ? (l == mx ? 1.0 : 0.0)  // +inf logits share everything
                                               : std::exp(static_cast<double>(l - mx) * inv_temp);
      probs_[i] = p;
      sum += p;
    }
    return sum;
  };

  // 3. top-p: smallest prefix (by probability) whose sum reaches top_p; at least one token.
  if (params_.top_p < 1.0f) {
    if (!sorted) {
      std::sort(cands_.begin(), cands_.end(), better);  // logits_scan.h's order
      sorted = true;
    }
    double sum = softmax(1.0f);
    if (sum > 0) {
      double cum = 0;
      size_t keep = cands_.size();
      for (size_t i = 0; i < cands_.size(); ++i) {
        cum += probs_[i] / sum;
        if (cum >= static_cast<double>(params_.top_p)) {
          keep = i + 1;
          break;
        }
      }
      cands_.resize(keep);
    }
  }

  // 4. min-p: keep p >= min_p * p_max, i.e. logit >= max_logit + log(min_p).
  if (params_.min_p > 0.0f) {
    float mx = kNegInf;
    for (const auto& c : cands_) mx = std::max(mx, c.logit);
    if (mx != kNegInf) {
      const double thr = std::min(static_cast<double>(mx),  // min_p > 1 still keeps the best token
                                  static_cast<double>(mx) + std::log(static_cast<double>(params_.min_p)));
      std::erase_if(cands_, [&](const LogitCand& c) { return static_cast<double>(c.logit) < thr; });
    }
  }

  // 5. temperature, 6. draw
  double sum = softmax(1.0f / params_.temp);
  if (!(sum > 0) || !std::isfinite(sum)) {
    // every candidate is -inf (or overflow): fall back to the best candidate
    return std::min_element(cands_.begin(), cands_.end(), better)->id;
  }
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * sum;  // uniform in [0, sum)
  double cum = 0;
  for (size_t i = 0; i < cands_.size(); ++i) {
    cum += probs_[i];
    if (u < cum) return cands_[i].id;
  }
  // rounding: the last candidate with nonzero probability
  for (size_t i = cands_.size(); i-- > 0;)
    if (probs_[i] > 0) return cands_[i].id;
  return cands_.front().id;
}

}  // namespace strata::engine
