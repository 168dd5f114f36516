#pragma once
// Loading the independent references (transformers fp32, llama.cpp) and comparing our
// forward pass with them. Tolerances are stated where they are used.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace strata::test {

/// Parses a JSON file; fails the test (throws) if it cannot be read.
nlohmann::json load_json(const std::string& path);

/// Largest deviations seen while comparing one model against its reference.
struct ParityReport {
  int positions = 0;     ///< positions compared
  int top1_checked = 0;  ///< positions whose reference top-2 gap exceeded the threshold
  int top1_mismatch = 0;
  double max_logit_err = 0;  ///< max |ours - ref| over the reference's top-20 logits
  double max_last_err = 0;   ///< max |ours - ref| over all logits of each case's last position
  double max_lse_err = 0;    ///< max |logsumexp ours - ref|
  int routes_checked = 0;    ///< (token, layer) pairs whose k-th/(k+1)-th margin exceeded 1e-4
  int routes_mismatch = 0;
  double max_route_prob_err = 0;
};

/// Runs every case of a transformers reference (`cases[]`) teacher-forced through `eng`
/// and compares logits and routing (where the case has `routing`). Fills `rep`; does not assert.
void compare_with_hf(engine::Engine& eng, const nlohmann::json& ref, ParityReport& rep);

/// Prints one line with every field of `r`, prefixed by "[name]" (test output, not asserted).
void print_report(const char* name, const ParityReport& r);

/// Asserts (gtest EXPECT) that `r` shows parity with the reference: positions compared, more
/// than half of them with a checked top-1 and none mismatched, logits (top-20, last position,
/// logsumexp) within `logit_tol`, routes checked with none mismatched and routing
/// probabilities within `route_prob_tol`. Tolerances are absolute.
void expect_parity(const ParityReport& r, double logit_tol, double route_prob_tol);

/// Greedy continuation of `prompt` for n tokens (KV cache, one token at a time).
std::vector<int32_t> greedy(engine::Engine& eng, const std::vector<int32_t>& prompt, int n);

}  // namespace strata::test
