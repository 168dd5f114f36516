#pragma once
// Token sampling with llama.cpp semantics and order:
//   logit bias -> repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw.
#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "engine/logits_scan.h"

namespace strata::engine {

/// SamplerParams::seed's "pick a random seed": outside the seeds a user can give (-s and the
/// server's "seed" take 0 .. 2^63 - 1), so every one of those is used as given.
inline constexpr uint64_t kRandomSeed = ~uint64_t{0};

/// Sampling parameters. Defaults follow llama.cpp's.
struct SamplerParams {
  /// Temperature; <= 0 selects greedy argmax (after the repetition penalty; lowest id on ties).
  float temp = 0.8f;
  /// Keep the k most likely tokens; <= 0 turns it off.
  int top_k = 40;
  /// Keep the smallest set of most likely tokens whose probability sum reaches top_p (the token
  /// that crosses the threshold is kept); >= 1 turns it off.
  float top_p = 0.95f;
  /// Drop tokens whose probability is below min_p times the most likely token's; <= 0 turns it off.
  float min_p = 0.05f;
  /// Divides positive logits and multiplies negative logits of recently seen tokens
  /// (each distinct token once); 1 turns it off.
  float repeat_penalty = 1.0f;
  /// How many of the last history ids the penalty looks at; 0 turns it off, < 0 means all.
  int repeat_last_n = 64;
  /// Seed of the std::mt19937_64 draw; kRandomSeed picks a random seed (see Sampler::seed()).
  uint64_t seed = kRandomSeed;
  /// (token id, bias) pairs added to the raw logits before everything else (OpenAI's
  /// logit_bias: -100 all but bans a token, +100 all but forces it); ids outside the logits
  /// are ignored here (front ends validate them).
  std::vector<std::pair<int32_t, float>> logit_bias = {};
};

/// Draws the next token from logits. Keeps its random state across calls, so a fixed seed
/// gives a reproducible sequence. Not thread-safe (one sampler per sequence).
class Sampler {
 public:
  explicit Sampler(const SamplerParams& params);

  /// Samples a token id from `logits` (one per vocabulary entry). `history`: the ids so far
  /// (prompt and generated), used by the repetition penalty; out-of-range ids are ignored.
  /// NaN logits are treated as -inf. Throws std::invalid_argument when `logits` is empty.
  int32_t sample(std::span<const float> logits, std::span<const int32_t> history);

  const SamplerParams& params() const { return params_; }
  /// The seed actually used (the random one when params.seed was kRandomSeed).
  uint64_t seed() const { return seed_; }

 private:
  SamplerParams params_;
  uint64_t seed_;
  std::mt19937_64 rng_;
  // scratch, reused between calls
  std::vector<float> logits_;
  std::vector<LogitCand> cands_;
  std::vector<double> probs_;
};

}  // namespace strata::engine
