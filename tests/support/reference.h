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
  /// Cases with router_top (raw router scores of the top-k, descending; gpt-oss, qwen35moe)
  /// instead of routing probabilities: max |(s_e - s_top)ours - (s_e - s_top)ref| over the
  /// reference's experts that we also selected, ours as log(p_e / p_top) (exact for a softmax
  /// over all experts or over the k). Route sets count in routes_checked / routes_mismatch.
  double max_score_err = 0;
};

/// Runs every case of a transformers reference (`cases[]`) teacher-forced through `eng`
/// and compares logits and routing (where the case has `routing` or `router_top`). Fills `rep`;
/// asserts only the shapes (reference layers and top-k against our trace).
void compare_with_hf(engine::Engine& eng, const nlohmann::json& ref, ParityReport& rep);

/// Prints one line with every field of `r`, prefixed by "[name]" (test output, not asserted).
void print_report(const char* name, const ParityReport& r);

/// Asserts (gtest EXPECT) the logit part of parity with the reference: positions compared,
/// more than half of them with a checked top-1 and none mismatched, logits (top-20, last
/// position, logsumexp) within `logit_tol` (absolute). For families whose reference has no
/// routing probabilities.
void expect_logit_parity(const ParityReport& r, double logit_tol);

/// expect_logit_parity, and routes checked with none mismatched and routing probabilities
/// within `route_prob_tol`. Tolerances are absolute.
void expect_parity(const ParityReport& r, double logit_tol, double route_prob_tol);

/// Greedy continuation of `prompt` for n tokens (KV cache, one token at a time).
std::vector<int32_t> greedy(engine::Engine& eng, const std::vector<int32_t>& prompt, int n);

/// For each case {"ids": prompt, "greedy": tokens, "text": prompt text} of `cases` (a JSON
/// array, as the transformers and llama.cpp references hold them), asserts that our greedy
/// continuation of the prompt equals the reference's tokens exactly; `who` names the reference
/// in the failure message. Fails if `cases` is not a non-empty array.
void expect_greedy(engine::Engine& eng, const nlohmann::json& cases, const char* who);

/// Invariance of `model`'s logits, bit for bit, at every position of `ids`: prefilled in one
/// chunk with `base` (its thread count) equal 1 and 2 threads, prompt chunks of 2, one prefilled
/// token then one decode per token, and the smallest arena for 1-token chunks, which is asserted
/// to be below the experts' total bytes (streaming: experts are evicted and re-read).
void expect_invariance(const std::string& model, const engine::EngineOptions& base, const std::vector<int32_t>& ids);

/// Writes a static rank (MODEL.strata-rank format, engine::write_popularity) to `path` made
/// from the routing of one prefill of `ids` on the shipped model, with `o` but an arena that
/// holds every expert (64 MiB).
void write_prompt_rank(const engine::EngineOptions& o, const std::vector<int32_t>& ids, const std::string& path);

/// The NextN / multi-token-prediction skip on a file made for it: copies `model` with one more
/// block appended (a copy of the last block's tensors as blk.<block_count>.*, block_count + 1,
/// nextn_predict_layers = 1, as GLM-4.5 and Qwen3.5 GGUFs carry it) and asserts that the copy
/// loads with the extra block outside the stream layout (no experts) and gives bit-identical
/// logits at every position of `ids` (options `o`). The copy is removed afterwards.
void expect_nextn_block_skipped(const std::string& model, const engine::EngineOptions& o,
                                const std::vector<int32_t>& ids);

}  // namespace strata::test
