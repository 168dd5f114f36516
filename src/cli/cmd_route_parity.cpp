// strata route-parity: the experts chosen per layer and token under two engine settings, compared;
// ties (the k-th and (k+1)-th router probabilities nearly equal) apart from real differences.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "cli/commands.h"
#include "cli/common.h"

namespace strata::cli {

namespace {
struct RouteParityFlags {
  std::string model;
  PromptFlags prompt;
  std::string a, b;
  int decode = 4;
  double tie_tol = 1e-6;
  bool json = false;
};

// The routing of one setting: prefill of all but the last `n_decode` ids, then those ids decoded
// one at a time (teacher-forced: the same tokens under both settings).
struct Routes {
  std::vector<int32_t> ids;
  model::RoutingTrace prefill, decode;
};

engine::EngineOptions parse_setting(const std::string& which, const std::string& flags, const std::string& model,
                                    std::string& model_out) {
  CLI::App app{"engine settings of " + which};
  EngineFlags ef;
  ef.add(app);
  app.get_option("-m")->required(false);
  try {
    app.parse(flags, false);
  } catch (const CLI::ParseError& e) {
    throw std::invalid_argument(fmt::format("{} \"{}\": {}", which, flags, e.what()));
  }
  model_out = ef.model.empty() ? model : ef.model;
  return ef.resolve();
}

Routes run_setting(const std::string& model, const engine::EngineOptions& o, const PromptFlags& prompt,
                   size_t n_decode) {
  engine::Engine eng(model, o);
  Routes r;
  r.ids = prompt.tokens(eng.tokenizer());
  const std::vector<int32_t>& ids = r.ids;
  if (ids.size() < n_decode + 1)
    throw std::invalid_argument(
        fmt::format("the prompt has {} tokens; --decode {} needs at least {}", ids.size(), n_decode, n_decode + 1));
  model::SequenceState st = eng.new_sequence();
  std::vector<float> logits;
  const size_t n_pre = ids.size() - n_decode;
  eng.prefill(st, std::span(ids).first(n_pre), model::LogitsMode::Last, logits, &r.prefill);
  for (size_t i = n_pre; i < ids.size(); ++i) eng.decode(st, ids[i], logits, &r.decode);
  return r;
}

struct LayerCount {
  size_t tokens = 0, same = 0, ties = 0, real = 0;
  double max_dp = 0;  ///< largest |prob difference| of an expert both runs chose
};

// The relative gap (p_k - p_{k+1}) / p_k at the selection boundary of one token.
double boundary_gap(const std::vector<float>& probs, float next) {
  const float pk = probs.back();
  return pk > 0 ? (double(pk) - double(next)) / double(pk) : 0.0;
}
}  // namespace

void register_route_parity(CLI::App& root) {
  auto f = std::make_shared<RouteParityFlags>();
  CLI::App* app = root.add_subcommand(
      "route-parity",
      "run a prompt under two engine settings and compare the experts chosen per layer and phase; PASS (exit 0) "
      "when they agree except for ties, else exit 1");
  app->add_option("-m,--model", f->model, "GGUF model file (either setting may name another with -m)")
      ->required()
      ->check(CLI::ExistingFile);
  f->prompt.add(*app);
  app->add_option("--a", f->a, "engine flags of setting A, quoted, e.g. \"--arena-mb 8 --prompt-chunk 16\"")
      ->required();
  app->add_option("--b", f->b, "engine flags of setting B, quoted")->required();
  app->add_option("--decode", f->decode,
                  "the last N prompt tokens are decoded one at a time (teacher-forced) to compare decode routing too")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app->add_option("--tie-tol", f->tie_tol,
                  "a differing token is a tie when exactly one expert is swapped and, in either run, "
                  "(p_k - p_k+1) <= TOL * p_k for its k-th and (k+1)-th router probabilities")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app->add_flag("--json", f->json, "print one JSON object instead of the table");
  app->callback([f] {
    std::string model_a, model_b;
    const engine::EngineOptions oa = parse_setting("--a", f->a, f->model, model_a);
    const engine::EngineOptions ob = parse_setting("--b", f->b, f->model, model_b);
    const size_t n_decode = size_t(f->decode);
    const Routes ra = run_setting(model_a, oa, f->prompt, n_decode);
    const Routes rb = run_setting(model_b, ob, f->prompt, n_decode);
    if (ra.ids != rb.ids)
      throw std::invalid_argument(
          "the two settings' tokenizers give different tokens for the prompt: give --prompt-ids");
    const std::vector<int32_t>& ids = ra.ids;

    nlohmann::json rows = nlohmann::json::array();
    size_t total_real = 0, total_ties = 0, total_tokens = 0;
    nlohmann::json first_real;
    std::vector<std::string> lines;
    for (const char* phase : {"prefill", "decode"}) {
      const model::RoutingTrace& ta = std::string(phase) == "prefill" ? ra.prefill : ra.decode;
      const model::RoutingTrace& tb = std::string(phase) == "prefill" ? rb.prefill : rb.decode;
      if (ta.ids.size() != tb.ids.size())
        throw std::runtime_error(
            fmt::format("the two settings ran models with {} and {} layers", ta.ids.size(), tb.ids.size()));
      for (size_t l = 0; l < ta.ids.size(); ++l) {
        if (ta.ids[l].empty() && tb.ids[l].empty()) continue;  // no routed experts in this layer
        if (ta.ids[l].size() != tb.ids[l].size())
          throw std::runtime_error(
              fmt::format("layer {}: {} and {} routed tokens", l, ta.ids[l].size(), tb.ids[l].size()));
        LayerCount c;
        for (size_t t = 0; t < ta.ids[l].size(); ++t) {
          ++c.tokens;
          std::vector<int32_t> sa = ta.ids[l][t], sb = tb.ids[l][t];
          std::sort(sa.begin(), sa.end());
          std::sort(sb.begin(), sb.end());
          if (sa == sb) {
            ++c.same;
            for (size_t k = 0; k < ta.ids[l][t].size(); ++k)
              for (size_t m = 0; m < tb.ids[l][t].size(); ++m)
                if (ta.ids[l][t][k] == tb.ids[l][t][m])
                  c.max_dp = std::max(c.max_dp, std::fabs(double(ta.probs[l][t][k]) - double(tb.probs[l][t][m])));
            continue;
          }
          std::vector<int32_t> only_a;
          std::set_difference(sa.begin(), sa.end(), sb.begin(), sb.end(), std::back_inserter(only_a));
          const double gap = std::min(boundary_gap(ta.probs[l][t], ta.next_prob[l][t]),
                                      boundary_gap(tb.probs[l][t], tb.next_prob[l][t]));
          if (only_a.size() == 1 && gap <= f->tie_tol) {
            ++c.ties;
          } else {
            ++c.real;
            if (first_real.is_null())
              first_real = {{"phase", phase},
                            {"layer", l},
                            {"token", t},
                            {"a", ta.ids[l][t]},
                            {"b", tb.ids[l][t]},
                            {"a_probs", ta.probs[l][t]},
                            {"b_probs", tb.probs[l][t]},
                            {"boundary_gap", gap}};
          }
        }
        total_real += c.real;
        total_ties += c.ties;
        total_tokens += c.tokens;
        rows.push_back({{"phase", phase},
                        {"layer", l},
                        {"tokens", c.tokens},
                        {"same", c.same},
                        {"ties", c.ties},
                        {"real", c.real},
                        {"max_dp", c.max_dp}});
        lines.push_back(fmt::format("{:<8} {:>5} {:>7} {:>7} {:>5} {:>5}  {:.3g}", phase, l, c.tokens, c.same, c.ties,
                                    c.real, c.max_dp));
      }
    }
    const bool pass = total_real == 0;
    if (f->json) {
      nlohmann::json j = {{"a", f->a},
                          {"b", f->b},
                          {"prompt_tokens", ids.size()},
                          {"decoded", n_decode},
                          {"tie_tol", f->tie_tol},
                          {"layers", rows},
                          {"tokens_compared", total_tokens},
                          {"ties", total_ties},
                          {"real", total_real},
                          {"pass", pass}};
      if (!first_real.is_null()) j["first_real"] = first_real;
      fmt::print("{}\n", j.dump());
    } else {
      fmt::print("route-parity: A = \"{}\", B = \"{}\"; {} prompt tokens: {} prefilled, {} decoded teacher-forced\n",
                 f->a, f->b, ids.size(), ids.size() - n_decode, n_decode);
      fmt::print(
          "tie: exactly one expert swapped and (p_k - p_k+1) <= {:g} * p_k in either run (router "
          "probabilities; p_k the k-th chosen, p_k+1 the best not chosen)\n",
          f->tie_tol);
      fmt::print("{:<8} {:>5} {:>7} {:>7} {:>5} {:>5}  {}\n", "phase", "layer", "tokens", "same", "ties", "real",
                 "max|dp| (same experts)");
      for (const auto& s : lines) fmt::print("{}\n", s);
      if (!first_real.is_null())
        fmt::print("first real difference: {} layer {} token {}: A {} B {}\n", first_real["phase"].get<std::string>(),
                   first_real["layer"].get<size_t>(), first_real["token"].get<size_t>(), first_real["a"].dump(),
                   first_real["b"].dump());
      if (pass)
        fmt::print("PASS: the routing agrees on all {} (layer, token) pairs{}\n", total_tokens,
                   total_ties ? fmt::format(" except {} ties", total_ties) : std::string());
      else
        fmt::print("FAIL: {} real routing differences ({} ties) in {} (layer, token) pairs\n", total_real, total_ties,
                   total_tokens);
    }
    std::fflush(stdout);
    if (!pass) throw std::runtime_error(fmt::format("route-parity: {} real routing differences", total_real));
  });
}

}  // namespace strata::cli
