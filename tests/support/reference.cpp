#include "support/reference.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <span>
#include <stdexcept>

#include "engine/static_rank.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "support/gguf_edit.h"
#include "support/paths.h"

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

    // Router scores: reference router_top[layer].ids/scores[token] (descending raw score).
    if (c.contains("router_top")) {
      const auto& rt = c["router_top"];
      ASSERT_EQ(rt.size(), trace.ids.size()) << "MoE layers";
      for (size_t l = 0; l < rt.size(); ++l)
        for (size_t t = 0; t < ids.size(); ++t) {
          const auto ref_ids = rt[l]["ids"][t].get<std::vector<int32_t>>();
          const auto ref_scores = rt[l]["scores"][t].get<std::vector<double>>();
          const auto& our_ids = trace.ids[l][t];
          const auto& our_probs = trace.probs[l][t];
          ASSERT_EQ(ref_ids.size(), our_ids.size()) << "top-k";
          // The set is only defined where the k-th and (k+1)-th probabilities differ.
          if (double(our_probs.back()) - double(trace.next_prob[l][t]) > 1e-4) {
            ++rep.routes_checked;
            if (std::set<int32_t>(ref_ids.begin(), ref_ids.end()) != std::set<int32_t>(our_ids.begin(), our_ids.end()))
              ++rep.routes_mismatch;
          }
          // Scores of the same experts relative to the reference's top one: s_e - s_top = log(p_e / p_top).
          auto our_p = [&](int32_t e) {
            const auto it = std::find(our_ids.begin(), our_ids.end(), e);
            return it == our_ids.end() ? -1.0 : double(our_probs[size_t(it - our_ids.begin())]);
          };
          const double p_top = our_p(ref_ids[0]);
          if (p_top <= 0) continue;  // a tie swapped it out (counted above if not a tie)
          for (size_t k = 1; k < ref_ids.size(); ++k) {
            const double pe = our_p(ref_ids[k]);
            if (pe <= 0) continue;
            rep.max_score_err =
                std::max(rep.max_score_err, std::abs(std::log(pe / p_top) - (ref_scores[k] - ref_scores[0])));
          }
        }
    }
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
      "logsumexp %.3g; routes checked %d mismatched %d, max |dprob| %.3g, max |d score diff| %.3g\n",
      name, r.positions, r.top1_checked, r.top1_mismatch, r.max_logit_err, r.max_last_err, r.max_lse_err,
      r.routes_checked, r.routes_mismatch, r.max_route_prob_err, r.max_score_err);
}

void expect_logit_parity(const ParityReport& r, double logit_tol) {
  EXPECT_GT(r.positions, 0);
  EXPECT_GT(r.top1_checked, r.positions / 2);
  EXPECT_EQ(r.top1_mismatch, 0);
  EXPECT_LE(r.max_logit_err, logit_tol);
  EXPECT_LE(r.max_last_err, logit_tol);
  EXPECT_LE(r.max_lse_err, logit_tol);
}

void expect_greedy(engine::Engine& eng, const nlohmann::json& cases, const char* who) {
  ASSERT_TRUE(cases.is_array() && !cases.empty()) << "no greedy cases from " << who;
  for (const auto& g : cases) {
    const auto want = g["greedy"].get<std::vector<int32_t>>();
    EXPECT_EQ(greedy(eng, g["ids"].get<std::vector<int32_t>>(), int(want.size())), want)
        << "differs from " << who << " for: " << g["text"].get<std::string>();
  }
}

void expect_parity(const ParityReport& r, double logit_tol, double route_prob_tol) {
  expect_logit_parity(r, logit_tol);
  EXPECT_GT(r.routes_checked, 0);
  EXPECT_EQ(r.routes_mismatch, 0);
  EXPECT_LE(r.max_route_prob_err, route_prob_tol);
}

void expect_invariance(const std::string& model, const engine::EngineOptions& base, const std::vector<int32_t>& ids) {
  auto all = [&](const engine::EngineOptions& o) {
    engine::Engine eng(model, o);
    model::SequenceState st = eng.new_sequence();
    std::vector<float> logits;
    eng.prefill(st, ids, model::LogitsMode::All, logits);
    return logits;
  };
  auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  engine::EngineOptions whole = base;
  whole.prompt_chunk = int(ids.size());
  const auto ref = all(whole);
  for (int threads : {1, 2}) {
    engine::EngineOptions o = whole;
    o.n_threads = threads;
    EXPECT_TRUE(same(all(o), ref)) << threads << " threads";
  }
  engine::EngineOptions o = base;
  o.prompt_chunk = 2;
  EXPECT_TRUE(same(all(o), ref)) << "chunks of 2";
  o.prompt_chunk = 1;
  {
    engine::Engine probe(model, o);
    o.arena_mb = 0;
    o.arena_bytes = probe.min_arena_bytes();
    EXPECT_LT(o.arena_bytes, probe.expert_bytes()) << "the smallest arena holds every expert: nothing streams";
  }
  EXPECT_TRUE(same(all(o), ref)) << "smallest arena (" << o.arena_bytes << " bytes)";
  engine::Engine eng(model, base);
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  eng.prefill(st, std::span(ids).first(1), model::LogitsMode::Last, logits);
  const size_t V = size_t(eng.hparams().n_vocab);
  ASSERT_EQ(ref.size(), V * ids.size());
  EXPECT_EQ(std::memcmp(logits.data(), ref.data(), V * sizeof(float)), 0) << "position 0";
  for (size_t i = 1; i < ids.size(); ++i) {
    eng.decode(st, ids[i], logits);
    ASSERT_EQ(std::memcmp(logits.data(), ref.data() + i * V, V * sizeof(float)), 0) << "decode position " << i;
  }
}

void expect_nextn_block_skipped(const std::string& model, const engine::EngineOptions& o,
                                const std::vector<int32_t>& ids) {
  auto all_logits = [&](const std::string& path, int* n_layer, int* extra_experts) {
    engine::Engine eng(path, o);
    *n_layer = eng.hparams().n_layer;
    *extra_experts = eng.model().expert_layout().back().n_expert;
    model::SequenceState st = eng.new_sequence();
    std::vector<float> logits;
    eng.prefill(st, ids, model::LogitsMode::All, logits);
    return logits;
  };
  std::string arch;
  int64_t n = 0;
  GgufEdit ed;
  {
    const gguf::File f = gguf::File::open(model);
    arch = f.get_string("general.architecture");
    n = f.get_int(arch + ".block_count");
    const std::string last = "blk." + std::to_string(n - 1) + ".";
    for (const auto& t : f.tensors())
      if (t.name.rfind(last, 0) == 0)
        ed.copies.emplace_back("blk." + std::to_string(n) + "." + t.name.substr(last.size()), t.name);
  }
  ASSERT_FALSE(ed.copies.empty());
  ed.set_kv = {{arch + ".block_count", gguf::make_u32(uint32_t(n + 1))},
               {arch + ".nextn_predict_layers", gguf::make_u32(1)}};
  const std::string path = write_edited_gguf(model, ed, arch + "-nextn");
  int n_base = 0, n_nextn = 0, experts_base = 0, experts_nextn = 0;
  const auto want = all_logits(model, &n_base, &experts_base);
  std::vector<float> got;
  try {
    got = all_logits(path, &n_nextn, &experts_nextn);
  } catch (...) {
    std::filesystem::remove(path);
    throw;
  }
  std::filesystem::remove(path);
  EXPECT_EQ(n_nextn, n_base + 1);
  EXPECT_EQ(experts_nextn, 0) << "the NextN block's experts are in the stream layout";
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0)
      << "logits change with a NextN block appended";
}

void write_prompt_rank(const engine::EngineOptions& o, const std::vector<int32_t>& ids, const std::string& path) {
  engine::EngineOptions all = o;
  all.arena_mb = 64;
  engine::Engine eng(test::shipped_model(), all);
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  model::RoutingTrace trace;
  eng.prefill(st, ids, model::LogitsMode::None, logits, &trace);
  engine::ExpertPopularity pop;
  pop.counts.assign(size_t(eng.hparams().n_layer), std::vector<uint64_t>(size_t(eng.hparams().n_expert), 0));
  pop.count(trace);
  pop.tokens = ids.size();
  engine::write_popularity(path, test::shipped_model(), pop);
}

}  // namespace strata::test
