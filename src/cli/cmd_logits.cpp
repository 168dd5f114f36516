// strata logits: teacher-forced logits of a prompt, top-K per position (for parity and KLD checks).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "cli/commands.h"
#include "cli/common.h"

namespace strata::cli {

namespace {
struct LogitsFlags {
  EngineFlags engine;
  PromptFlags prompt;
  int top = 20;
  bool json = false;
  bool routing = false;
};
}  // namespace

void register_logits(CLI::App& root) {
  auto f = std::make_shared<LogitsFlags>();
  CLI::App* app = root.add_subcommand("logits", "teacher-forced logits of a prompt: top-K ids and logits per position");
  f->engine.add(*app);
  f->prompt.add(*app);
  app->add_option("--top", f->top, "ids per position, by descending logit")->capture_default_str()->check(at_least(1));
  app->add_flag("--json", f->json, "print JSON (the only output format; accepted for clarity)");
  app->add_flag("--routing", f->routing, "also print the selected experts and probabilities per layer and token");
  app->callback([f] {
    engine::Engine eng(f->engine.model, f->engine.resolve());
    const std::vector<int32_t> ids = f->prompt.tokens(eng.tokenizer());
    model::SequenceState st = eng.new_sequence();
    std::vector<float> logits;
    model::RoutingTrace trace;
    eng.prefill(st, ids, model::LogitsMode::All, logits, f->routing ? &trace : nullptr);
    const int V = eng.hparams().n_vocab;
    const int K = std::min(f->top, V);
    nlohmann::json positions = nlohmann::json::array();
    std::vector<int32_t> order(V);
    for (size_t t = 0; t < ids.size(); ++t) {
      const float* row = logits.data() + t * V;
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + K, order.end(),
                        [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
      const float mx = row[order[0]];
      double sum = 0;
      for (int i = 0; i < V; ++i) sum += std::exp(double(row[i]) - mx);
      nlohmann::json top_ids = nlohmann::json::array(), top_logits = nlohmann::json::array();
      for (int k = 0; k < K; ++k) {
        top_ids.push_back(order[k]);
        top_logits.push_back(row[order[k]]);
      }
      positions.push_back(
          {{"top_ids", top_ids}, {"top_logits", top_logits}, {"logsumexp", double(mx) + std::log(sum)}});
    }
    nlohmann::json j = {{"prompt_ids", ids}, {"positions", positions}};
    if (f->routing) j["routing"] = {{"ids", trace.ids}, {"probs", trace.probs}};
    j["stats"] = {{"prefill", phase_json(eng.prefill_stats())}, {"arena", arena_json(eng)}};
    fmt::print("{}\n", j.dump());
  });
}

}  // namespace strata::cli
