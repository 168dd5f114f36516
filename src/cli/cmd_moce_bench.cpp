// strata moce-bench: MoCE speed and quality side by side. For each bonus of a list (and the one
// --moce-kld-budget calibrates), the same tokens are teacher-forced through decode from an empty
// arena; per bonus it reports decode tok/s, misses, substitutions, misses avoided, and the exact
// KL(bonus 0 || bonus B) and same top-1 against the bonus-0 run of the same sweep (docs/tools.md).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "cli/commands.h"
#include "cli/common.h"
#include "engine/quality.h"

namespace strata::cli {

namespace {
struct MoceBenchFlags {
  EngineFlags engine;
  PromptFlags prompt;
  int n_tokens = 64;
  std::string bonuses = "0,0.25,0.5,0.85";
  bool json = false;
};

/// One row of the sweep: the decode counters of a teacher-forced pass at `bonus` and its
/// distributions compared with the bonus-0 pass (rows [n][n_vocab] of log-probabilities).
struct SweepRow {
  float bonus = 0;
  bool calibrated = false;
  int64_t tokens = 0;
  double seconds = 0;
  uint64_t needed = 0, hits = 0, misses = 0, bytes_read = 0;
  uint64_t substituted = 0, misses_avoided = 0;
  quality::MeanError kld, same_top;
  double kld_p99 = 0, kld_max = 0;
  std::vector<double> kld_tokens;  ///< KL(bonus 0 || bonus B) of each teacher-forced token, in order
};

std::vector<float> parse_bonuses(const std::string& s) {
  std::vector<float> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const std::optional<double> v = parse_finite(item);
    if (!v || *v < 0)
      throw std::invalid_argument(
          fmt::format("--bonuses '{}': '{}' is not a bonus (a finite number >= 0, comma-separated)", s, item));
    out.push_back(float(*v));
  }
  if (out.empty()) throw std::invalid_argument("--bonuses is empty: give e.g. 0,0.25,0.5,0.85");
  return out;
}

// Per-row exact KL(p || q) (nats) and whether the argmaxes (lower id on ties) agree.
void compare_rows(const std::vector<float>& p, const std::vector<float>& q, int V, SweepRow& row) {
  std::vector<double> kld = quality::kld_per_row(p, q, V);
  const size_t n = kld.size();
  row.kld_tokens = kld;
  double sum = 0, sum2 = 0, same = 0;
  for (size_t r = 0; r < n; ++r) {
    const std::span<const float> pr(p.data() + r * size_t(V), size_t(V)), qr(q.data() + r * size_t(V), size_t(V));
    sum += kld[r];
    sum2 += kld[r] * kld[r];
    same +=
        (std::max_element(pr.begin(), pr.end()) - pr.begin()) == (std::max_element(qr.begin(), qr.end()) - qr.begin());
  }
  row.kld = quality::mean_and_error(sum, sum2, n);
  const double f = n ? same / double(n) : 0.0;
  row.same_top = {f, n > 1 ? std::sqrt(f * (1 - f) / double(n - 1)) : 0.0};
  std::sort(kld.begin(), kld.end());
  row.kld_p99 = n ? quality::percentile(kld, 0.99) : 0.0;
  row.kld_max = n ? kld.back() : 0.0;
}
}  // namespace

void register_moce_bench(CLI::App& root) {
  auto f = std::make_shared<MoceBenchFlags>();
  CLI::App* app = root.add_subcommand(
      "moce-bench",
      "MoCE speed and quality side by side: for each --bonuses value (and the bonus --moce-kld-budget calibrates) "
      "the same tokens are teacher-forced through decode from an empty arena; prints decode tok/s, misses, "
      "substituted, misses avoided, and the KLD and same top-1 against bonus 0, in one run");
  f->engine.add(*app);
  f->prompt.add(*app);
  app->get_option("-p")->description(
      "text to teacher-force (default: the model's own greedy text after \"def fibonacci(n):\" at bonus 0)");
  app->get_option("-f")->description(
      "file whose first -n tokens are teacher-forced (use a text other than --moce-calibrate's to test the "
      "budget on held-back text)");
  app->add_option("-n,--n-predict", f->n_tokens, "tokens teacher-forced through decode per bonus")
      ->capture_default_str()
      ->check(at_least(2));
  app->add_option("--bonuses", f->bonuses,
                  "comma-separated --moce-bonus values to measure; bonus 0 is always run first as the reference")
      ->capture_default_str();
  app->add_flag("--json", f->json, "print one JSON object instead of the table");
  app->callback([f] {
    std::vector<float> bonuses = parse_bonuses(f->bonuses);
    engine::EngineOptions opts = f->engine.resolve();
    if (opts.moce_bonus != 0)
      throw std::invalid_argument("moce-bench sets the bonus itself: give the values with --bonuses, not --moce-bonus");
    if (opts.moce_prefill)
      throw std::invalid_argument("moce-bench teacher-forces through decode only: --moce-prefill has no effect here");
    engine::Engine eng(f->engine.model, opts);
    const int V = eng.hparams().n_vocab;
    const size_t cap = size_t(std::max<int64_t>(2, eng.n_ctx()));
    const size_t want = std::min(size_t(f->n_tokens), cap);
    const bool given =
        (f->prompt.text_opt && f->prompt.text_opt->count() > 0) || !f->prompt.file.empty() || !f->prompt.ids.empty();
    std::vector<int32_t> tokens;
    std::string source;
    if (given) {
      tokens = f->prompt.tokens(eng.tokenizer());
      source = !f->prompt.file.empty() ? f->prompt.file : !f->prompt.ids.empty() ? "--prompt-ids" : "-p text";
      if (tokens.size() < 2)
        throw std::invalid_argument(fmt::format("the text has {} tokens: moce-bench needs at least 2", tokens.size()));
      if (tokens.size() > want) tokens.resize(want);
    } else {
      tokens = quality::moce_builtin_sample(eng, int(want));
      if (tokens.size() > want) tokens.resize(want);  // the prompt alone may be longer than -n
      source = fmt::format("the model's greedy text after \"{}\"", quality::kMoceCalibrationPrompt);
    }

    const quality::MoceCalibration cal = f->engine.calibrate_moce(eng);
    const bool calibrated = f->engine.moce_kld_budget > 0;

    // Bonus 0 first (the reference), then the list in order, then the calibrated bonus.
    std::vector<std::pair<float, bool>> plan = {{0.0f, false}};
    for (float b : bonuses)
      if (b != 0) plan.emplace_back(b, false);
    if (calibrated) plan.emplace_back(cal.bonus, true);
    std::vector<SweepRow> rows;
    std::vector<float> ref;
    for (const auto& [b, is_cal] : plan) {
      eng.set_moce_bonus(b);
      const std::vector<float> q = quality::teacher_forced_logprobs(eng, tokens);
      const engine::PhaseStats& d = eng.decode_stats();
      SweepRow r;
      r.bonus = b;
      r.calibrated = is_cal;
      r.tokens = d.tokens;
      r.seconds = d.seconds;
      r.needed = d.stream.needed;
      r.hits = d.stream.hits;
      r.misses = d.stream.misses;
      r.bytes_read = d.stream.bytes_read;
      r.substituted = d.moce.substituted;
      r.misses_avoided = d.moce.misses_avoided;
      if (ref.empty()) ref = q;
      compare_rows(ref, q, V, r);
      rows.push_back(r);
    }
    eng.set_moce_bonus(0);

    const auto& hp = eng.hparams();
    const uint64_t experts = uint64_t(hp.n_expert) * uint64_t(std::max(0, hp.n_layer - hp.n_layer_dense_lead));
    const size_t slots = eng.stream().n_slots();
    const double arena_pct = experts ? 100.0 * double(std::min<uint64_t>(slots, experts)) / double(experts) : 0.0;
    if (f->json) {
      nlohmann::json jr = nlohmann::json::array();
      for (const SweepRow& r : rows)
        jr.push_back({{"bonus", r.bonus},
                      {"calibrated", r.calibrated},
                      {"tokens", r.tokens},
                      {"decode_s", r.seconds},
                      {"tokens_per_s", r.seconds > 0 ? double(r.tokens) / r.seconds : 0.0},
                      {"needed", r.needed},
                      {"hits", r.hits},
                      {"misses", r.misses},
                      {"hit_rate", r.needed ? double(r.hits) / double(r.needed) : 0.0},
                      {"bytes_read", r.bytes_read},
                      {"moce_substituted", r.substituted},
                      {"moce_misses_avoided", r.misses_avoided},
                      {"kld_mean", r.kld.mean},
                      {"kld_error", r.kld.error},
                      {"kld_p99", r.kld_p99},
                      {"kld_max", r.kld_max},
                      {"kld_tokens", r.kld_tokens},
                      {"same_top1", r.same_top.mean},
                      {"same_top1_error", r.same_top.error}});
      nlohmann::json j = {{"model", f->engine.model},
                          {"arena_bytes", eng.arena_bytes()},
                          {"arena_slots", slots},
                          {"experts", experts},
                          {"arena_percent", arena_pct},
                          {"predict", opts.predict},
                          {"tokens", tokens.size()},
                          {"text", source},
                          {"rows", jr}};
      if (calibrated) {
        nlohmann::json grid = nlohmann::json::array();
        for (const auto& g : cal.grid)
          grid.push_back({{"bonus", g.bonus}, {"kld", g.kld}, {"kld_error", g.kld_error}, {"kld_bound", g.kld_bound}});
        j["calibration"] = {{"budget", f->engine.moce_kld_budget},
                            {"text", f->engine.moce_calibrate.empty() ? "builtin" : f->engine.moce_calibrate},
                            {"sequences", cal.sequences},
                            {"tokens", cal.tokens},
                            {"bonus", cal.bonus},
                            {"kld", cal.kld},
                            {"kld_bound", cal.kld_bound},
                            {"grid", grid}};
      }
      fmt::print("{}\n", j.dump());
      return;
    }
    fmt::print(
        "moce-bench: {}; arena {} = {} slots of {} experts ({:.1f} %), read-ahead {}; {} tokens ({}) teacher-forced "
        "through decode from an empty arena per bonus\n",
        f->engine.model, human_bytes(double(eng.arena_bytes())), slots, experts, arena_pct, opts.predict ? "on" : "off",
        tokens.size(), source);
    fmt::print(
        "KLD: exact KL(bonus 0 || bonus B) over the {} token vocabulary, nats, mean +/- its standard error; same "
        "top-1: "
        "argmax agrees with bonus 0's\n",
        V);
    fmt::print("{:<24} {:>9} {:>8} {:>6} {:>11} {:>9}  {:<21} {:>9}  {}\n", "bonus", "tok/s", "misses", "hit %",
               "substituted", "avoided", "mean KLD", "99% KLD", "same top-1");
    for (const SweepRow& r : rows) {
      const std::string label = r.calibrated ? fmt::format("{:g} (calibrated)", r.bonus) : fmt::format("{:g}", r.bonus);
      fmt::print("{:<24} {:>9.2f} {:>8} {:>6.1f} {:>11} {:>9}  {:<21} {:>9.5f}  {:.2f} %\n", label,
                 r.seconds > 0 ? double(r.tokens) / r.seconds : 0.0, r.misses,
                 r.needed ? 100.0 * double(r.hits) / double(r.needed) : 0.0, r.substituted, r.misses_avoided,
                 fmt::format("{:.5f} +/- {:.5f}", r.kld.mean, r.kld.error), r.kld_p99, 100 * r.same_top.mean);
    }
    if (calibrated)
      fmt::print(
          "calibrated: budget {} nats on {} ({} tokens): chose {:g} (its calibration KLD {:.5f}, bound {:.5f}; its "
          "row is this text's)\n",
          f->engine.moce_kld_budget,
          f->engine.moce_calibrate.empty() ? std::string("the built-in sampled text") : f->engine.moce_calibrate,
          cal.tokens, cal.bonus, cal.kld, cal.kld_bound);
    std::fflush(stdout);
  });
}

}  // namespace strata::cli
