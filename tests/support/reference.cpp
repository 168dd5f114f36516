#include "support/reference.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <stdexcept>

namespace strata::test {

nlohmann::json load_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  return nlohmann::json::parse(in);
}

static double logsumexp(const float* row, int n) {
  float mx = row[0];
  for (int i = 1; i < n; ++i) mx = std::max(mx, row[i]);
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(double(row[i]) - mx);
  return mx + std::log(s);
}

void compare_with_hf(engine::Engine& eng, const nlohmann::json& ref, ParityReport& rep) {
  const int V = eng.hparams().n_vocab;
  for (const auto& c : ref["cases"]) {
    const std::vector<int32_t> ids = c["ids"].get<std::vector<int32_t>>();
    model::SequenceState st = eng.new_sequence();
    std::vector<float> logits;
    model::RoutingTrace trace;
    eng.prefill(st, ids, model::LogitsMode::All, logits, &trace);
    for (size_t t = 0; t < ids.size(); ++t) {
      const float* row = logits.data() + t * V;
      const auto top_ids = c["top_ids"][t].get<std::vector<int32_t>>();
      const auto top_logits = c["top_logits"][t].get<std::vector<double>>();
      ++rep.positions;
      for (size_t k = 0; k < top_ids.size(); ++k)
        rep.max_logit_err = std::max(rep.max_logit_err, std::abs(double(row[top_ids[k]]) - top_logits[k]));
      rep.max_lse_err = std::max(rep.max_lse_err, std::abs(logsumexp(row, V) - c["logsumexp"][t].get<double>()));
      if (top_logits[0] - top_logits[1] > 1e-2) {
        ++rep.top1_checked;
        const int32_t ours = int32_t(std::max_element(row, row + V) - row);
        if (ours != top_ids[0]) ++rep.top1_mismatch;
      }
    }
    const auto last = c["last_logits"].get<std::vector<double>>();
    const float* lrow = logits.data() + (ids.size() - 1) * V;
    for (int i = 0; i < V; ++i) rep.max_last_err = std::max(rep.max_last_err, std::abs(double(lrow[i]) - last[i]));

    // Routing: reference routing[layer].ids[token] (descending probability); absent from the
    // references of families whose routing transformers does not return (deepseek2, glm4moe).
    if (!c.contains("routing")) continue;
    const auto& routing = c["routing"];
    for (size_t l = 0; l < routing.size(); ++l) {
      for (size_t t = 0; t < ids.size(); ++t) {
        const auto ref_ids = routing[l]["ids"][t].get<std::vector<int32_t>>();
        const auto ref_probs = routing[l]["probs"][t].get<std::vector<double>>();
        const auto& our_ids = trace.ids[l][t];
        const auto& our_probs = trace.probs[l][t];
        for (size_t k = 0; k < ref_probs.size(); ++k)
          rep.max_route_prob_err = std::max(rep.max_route_prob_err, std::abs(double(our_probs[k]) - ref_probs[k]));
        // A set is only well defined where the k-th and (k+1)-th probabilities differ.
        const double margin = double(our_probs.back()) - double(trace.next_prob[l][t]);
        if (margin <= 1e-4) continue;
        ++rep.routes_checked;
        if (std::set<int32_t>(ref_ids.begin(), ref_ids.end()) != std::set<int32_t>(our_ids.begin(), our_ids.end()))
          ++rep.routes_mismatch;
      }
    }
  }
}

std::vector<int32_t> greedy(engine::Engine& eng, const std::vector<int32_t>& prompt, int n) {
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, prompt, model::LogitsMode::Last, logits);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    const int32_t id = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(id);
    if (i + 1 < n) eng.decode(st, id, logits);
  }
  return out;
}

void print_report(const char* name, const ParityReport& r) {
  std::printf(
      "[%s] positions %d, top-1 checked %d mismatched %d, max |dlogit| top-20 %.3g, all-vocab last %.3g, "
      "logsumexp %.3g; routes checked %d mismatched %d, max |dprob| %.3g\n",
      name, r.positions, r.top1_checked, r.top1_mismatch, r.max_logit_err, r.max_last_err, r.max_lse_err,
      r.routes_checked, r.routes_mismatch, r.max_route_prob_err);
}

void expect_parity(const ParityReport& r, double logit_tol, double route_prob_tol) {
  EXPECT_GT(r.positions, 0);
  EXPECT_GT(r.top1_checked, r.positions / 2);
  EXPECT_EQ(r.top1_mismatch, 0);
  EXPECT_LE(r.max_logit_err, logit_tol);
  EXPECT_LE(r.max_last_err, logit_tol);
  EXPECT_LE(r.max_lse_err, logit_tol);
  EXPECT_GT(r.routes_checked, 0);
  EXPECT_EQ(r.routes_mismatch, 0);
  EXPECT_LE(r.max_route_prob_err, route_prob_tol);
}

}  // namespace strata::test
