// strata route-parity: the experts chosen per layer and token under two engine settings, compared;
// ties (the k-th and (k+1)-th router probabilities nearly equal) apart from real differences.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "cli/commands.h"
#include "cli/common.h"

namespace strata::cli {

namespace {
struct RouteParityFlags {
  std::string model;
  PromptFlags prompt;
  std::string a, b;
  std::string dump_a, dump_b;
  const CLI::Option* a_opt = nullptr;  ///< --a, to tell --a "" (plain settings) from no --a
  const CLI::Option* b_opt = nullptr;
  int decode = 4;
  double tie_tol = 1e-6;
  bool json = false;
};

// The routing of one setting: prefill of all but the last `n_decode` ids, then those ids decoded
// one at a time (teacher-forced: the same tokens under both settings).
struct Routes {
  std::vector<int32_t> ids;  ///< the tokens run: prefill's, then decode's
  size_t n_decode = 0;       ///< of those, decoded one at a time (read from a dump)
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

std::vector<std::string> split_tabs(const std::string& line) {
  std::vector<std::string> out;
  std::stringstream ss(line);
  for (std::string f; std::getline(ss, f, '\t');) out.push_back(f);
  return out;
}

// The routing a --dump directory recorded: its ffn_moe_route-L tensors (model/dump.h), in call
// order, each call's tokens appended to the phase calls.tsv names.
Routes read_dump_routes(const std::string& dir) {
  namespace fs = std::filesystem;
  const auto open = [&](const std::string& name) {
    std::ifstream in(fs::path(dir) / name);
    if (!in) throw std::invalid_argument(fmt::format("'{}' is not a --dump directory: cannot read {}", dir, name));
    return in;
  };
  std::map<long long, std::string> phase;
  Routes r;
  {
    // r.ids: the prefill calls' tokens in order, then the decode calls'.
    std::vector<int32_t> decode_ids;
    std::ifstream in = open("calls.tsv");
    for (std::string line; std::getline(in, line);) {
      auto f = split_tabs(line);
      if (f.size() == 2) f.emplace_back();
      if (f.size() != 3 || (f[1] != "prefill" && f[1] != "decode"))
        throw std::invalid_argument(fmt::format("{}/calls.tsv: bad line '{}'", dir, line));
      try {
        phase[std::stoll(f[0])] = f[1];
        const std::vector<int32_t> ids = f[2].empty() ? std::vector<int32_t>() : parse_id_list(f[2]);
        std::vector<int32_t>& to = f[1] == "decode" ? decode_ids : r.ids;
        to.insert(to.end(), ids.begin(), ids.end());
      } catch (const std::exception& e) {
        throw std::invalid_argument(fmt::format("{}/calls.tsv: bad line '{}': {}", dir, line, e.what()));
      }
    }
    r.n_decode = decode_ids.size();
    r.ids.insert(r.ids.end(), decode_ids.begin(), decode_ids.end());
  }
  size_t found = 0;
  std::ifstream in = open("index.tsv");
  for (std::string line; std::getline(in, line);) {
    const auto f = split_tabs(line);
    if (f.size() != 5) throw std::invalid_argument(fmt::format("{}/index.tsv: bad line '{}'", dir, line));
    const std::string prefix = "ffn_moe_route-";
    if (f[1].rfind(prefix, 0) != 0) continue;
    size_t layer = 0, w = 0, t_count = 0;
    long long call = 0;
    try {
      layer = std::stoul(f[1].substr(prefix.size()));
      call = std::stoll(f[2]);
      w = std::stoul(f[3]);
      t_count = std::stoul(f[4]);
    } catch (const std::exception&) {
      throw std::invalid_argument(fmt::format("{}/index.tsv: bad line '{}'", dir, line));
    }
    if (w < 3 || w % 2 == 0)
      throw std::invalid_argument(fmt::format("{}/{}: {} values per token is not 2 K + 1", dir, f[0], w));
    const auto ph = phase.find(call);
    if (ph == phase.end())
      throw std::invalid_argument(fmt::format("{}: call {} of {} is not in calls.tsv", dir, call, f[0]));
    const size_t K = (w - 1) / 2;
    std::vector<float> rec(w * t_count);
    std::ifstream data(fs::path(dir) / f[0], std::ios::binary);
    data.read(reinterpret_cast<char*>(rec.data()), std::streamsize(rec.size() * sizeof(float)));
    if (!data || data.peek() != std::char_traits<char>::eof())
      throw std::invalid_argument(
          fmt::format("{}/{}: not {} x {} floats (missing, truncated or longer)", dir, f[0], w, t_count));
    model::RoutingTrace& tr = ph->second == "decode" ? r.decode : r.prefill;
    if (tr.ids.size() <= layer) {
      tr.ids.resize(layer + 1);
      tr.probs.resize(layer + 1);
      tr.next_prob.resize(layer + 1);
    }
    for (size_t t = 0; t < t_count; ++t) {
      const float* p = rec.data() + t * w;
      std::vector<int32_t> ids(K);
      for (size_t k = 0; k < K; ++k) {
        if (!(p[k] >= 0 && p[k] < 16777216.0f && p[k] == std::floor(p[k])))
          throw std::invalid_argument(fmt::format("{}/{}: token {} has expert id {}", dir, f[0], t, p[k]));
        ids[k] = int32_t(p[k]);
      }
      tr.ids[layer].push_back(ids);
      tr.probs[layer].emplace_back(p + K, p + 2 * K);
      tr.next_prob[layer].push_back(p[2 * K]);
    }
    ++found;
  }
  if (found == 0)
    throw std::invalid_argument(
        fmt::format("the dump in '{}' has no ffn_moe_route-L tensors: dump with no --dump-filter or one matching "
                    "'ffn_moe_route-.*'",
                    dir));
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
      ->check(CLI::ExistingFile);
  f->prompt.add(*app);
  f->a_opt = app->add_option("--a", f->a, "engine flags of setting A, quoted, e.g. \"--arena-mb 8 --prompt-chunk 16\"");
  f->b_opt = app->add_option("--b", f->b, "engine flags of setting B, quoted");
  app->add_option("--dump-a", f->dump_a,
                  "instead of running: a --dump directory of setting A (its ffn_moe_route-L tensors and calls.tsv)")
      ->check(CLI::ExistingDirectory);
  app->add_option("--dump-b", f->dump_b, "the --dump directory of setting B (the same prompt as --dump-a's)")
      ->check(CLI::ExistingDirectory);
  app->add_option("--decode", f->decode,
                  "the last N prompt tokens are decoded one at a time (teacher-forced) to compare decode routing too")
      ->capture_default_str()
      ->check(at_least(0));
  app->add_option("--tie-tol", f->tie_tol,
                  "a differing token is a tie when exactly one expert is swapped and, in either run, "
                  "(p_k - p_k+1) <= TOL * p_k for its k-th and (k+1)-th router probabilities")
      ->capture_default_str()
      ->check(non_negative_real());
  app->add_flag("--json", f->json, "print one JSON object instead of the table");
  app->callback([f] {
    const bool from_dumps = !f->dump_a.empty() || !f->dump_b.empty();
    Routes ra, rb;
    size_t n_decode = size_t(f->decode);
    if (from_dumps) {
      if (f->dump_a.empty() || f->dump_b.empty())
        throw std::invalid_argument("give both --dump-a DIR and --dump-b DIR");
      if (f->a_opt->count() || f->b_opt->count() || !f->model.empty())
        throw std::invalid_argument("--dump-a/--dump-b compare recorded runs: give them without -m, --a and --b");
      ra = read_dump_routes(f->dump_a);
      rb = read_dump_routes(f->dump_b);
      n_decode = ra.n_decode;
      if (ra.ids != rb.ids || ra.n_decode != rb.n_decode) {
        size_t i = 0;
        while (i < ra.ids.size() && i < rb.ids.size() && ra.ids[i] == rb.ids[i]) ++i;
        throw std::invalid_argument(fmt::format(
            "the two dumps ran different tokens ({} and {} tokens, {} and {} decoded; first difference at token {}): "
            "routing is only comparable on the same tokens (e.g. teacher-forced: perplexity --decode, or run "
            "--prompt-ids with -n 0 or 1)",
            ra.ids.size(), rb.ids.size(), ra.n_decode, rb.n_decode, i));
      }
      // Layers that only one side recorded are compared as empty (and then differ in token count).
      const size_t n =
          std::max({ra.prefill.ids.size(), rb.prefill.ids.size(), ra.decode.ids.size(), rb.decode.ids.size()});
      for (model::RoutingTrace* t : {&ra.prefill, &rb.prefill, &ra.decode, &rb.decode}) {
        t->ids.resize(n);
        t->probs.resize(n);
        t->next_prob.resize(n);
      }
    } else {
      if (f->model.empty() || !f->a_opt->count() || !f->b_opt->count())
        throw std::invalid_argument("give -m MODEL, --a \"FLAGS\" and --b \"FLAGS\" (or --dump-a DIR --dump-b DIR)");
      std::string model_a, model_b;
      const engine::EngineOptions oa = parse_setting("--a", f->a, f->model, model_a);
      const engine::EngineOptions ob = parse_setting("--b", f->b, f->model, model_b);
      ra = run_setting(model_a, oa, f->prompt, n_decode);
      rb = run_setting(model_b, ob, f->prompt, n_decode);
      if (ra.ids != rb.ids)
        throw std::invalid_argument(
            "the two settings' tokenizers give different tokens for the prompt: give --prompt-ids");
    }
    const std::vector<int32_t>& ids = ra.ids;
    const std::string name_a = from_dumps ? "--dump-a " + f->dump_a : f->a;
    const std::string name_b = from_dumps ? "--dump-b " + f->dump_b : f->b;

    nlohmann::json rows = nlohmann::json::array();
    size_t total_real = 0, total_ties = 0, total_tokens = 0;
    nlohmann::json first_real;
    std::vector<std::string> real_layers;  // "prefill 3" for every (phase, layer) with a real difference
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
          throw std::runtime_error(fmt::format("{} layer {}: {} and {} routed tokens (not the same prompt?)", phase, l,
                                               ta.ids[l].size(), tb.ids[l].size()));
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
        if (c.real) real_layers.push_back(fmt::format("{} {}", phase, l));
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
      nlohmann::json j = {{"a", name_a},
                          {"b", name_b},
                          {"prompt_tokens", ids.size()},
                          {"decoded", n_decode},
                          {"tie_tol", f->tie_tol},
                          {"layers", rows},
                          {"tokens_compared", total_tokens},
                          {"ties", total_ties},
                          {"real", total_real},
                          {"real_layers", real_layers},
                          {"pass", pass}};
      if (!first_real.is_null()) j["first_real"] = first_real;
      fmt::print("{}\n", j.dump());
    } else {
      fmt::print("route-parity: A = \"{}\", B = \"{}\"; {} prompt tokens: {} prefilled, {} decoded{}\n", name_a, name_b,
                 ids.size(), ids.size() - n_decode, n_decode, from_dumps ? "" : " teacher-forced");
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
        fmt::print("FAIL: {} real routing differences ({} ties) in {} (layer, token) pairs; in (phase layer): {}\n",
                   total_real, total_ties, total_tokens, fmt::join(real_layers, ", "));
    }
    std::fflush(stdout);
    if (!pass) throw std::runtime_error(fmt::format("route-parity: {} real routing differences", total_real));
  });
}

}  // namespace strata::cli
