#pragma once
// Whole-vocabulary scans of one token's logits (n_vocab floats, e.g. 151,936 for Qwen3), done on
// the host once per generated token: the finiteness check after a forward pass, the greedy
// argmax and the top-k candidates of the sampler. Written with SSE2 (x86-64's baseline) so that
// they run at memory speed: the plain loops were not vectorized at -O2 and took 60-500 us a token
// on the development machine, a tenth of a GPU decode step (docs/architecture.md, "Host work per token").
#include <cstdint>
#include <span>
#include <vector>

namespace strata::engine {

/// True if no element of `v` is NaN or +-inf.
bool all_finite(std::span<const float> v);

/// The index of the largest element of `v`, NaN counted as -inf; ties (and an all -inf / NaN
/// input): the lowest index. Returns 0 for an empty span.
int32_t argmax(std::span<const float> v);

/// One candidate token: its (possibly adjusted) logit and id.
struct LogitCand {
  float logit;
  int32_t id;
};

/// The sampler's strict order: higher logit first; ties: lower id first.
inline bool better(const LogitCand& a, const LogitCand& b) {
  return a.logit != b.logit ? a.logit > b.logit : a.id < b.id;
}

/// The k best of `v` into `out` (resized to min(k, v.size())), best first in the strict order
/// (higher logit first; ties: lower id first), NaN counted as -inf (and stored as -inf). The same
/// set and order as a partial sort of every (logit, id) pair by that order. k <= 0: `out` empty.
void top_k(std::span<const float> v, int k, std::vector<LogitCand>& out);

}  // namespace strata::engine
