// strata profile: record per-layer expert popularity over a text into the static-rank
// sidecar the stream uses for layer 0 and wherever no prediction is made.
#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/common.h"
#include "engine/static_rank.h"

namespace strata::cli {

void register_profile(CLI::App& root) {
  struct Flags {
    EngineFlags engine;
    PromptFlags prompt;
    std::string out;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* app =
      root.add_subcommand("profile", "record per-layer expert popularity over a text (static rank sidecar)");
  f->engine.add(*app);
  f->prompt.add(*app);
  f->prompt.purpose = "profile";
  app->add_option("-o,--output", f->out, "where to write it (default: MODEL.strata-rank)");
  app->callback([f] {
    engine::EngineOptions o = f->engine.resolve();
    o.static_rank = "none";  // profile the model, not a previous profile's read-ahead
    engine::Engine eng(f->engine.model, o);
    const std::vector<int32_t> ids = f->prompt.tokens(eng.tokenizer());
    // No tokens, no counts: a rank file of zeros would order the read-ahead by expert id alone.
    if (ids.empty()) throw std::invalid_argument("the prompt has no tokens: nothing to profile");
    const auto& hp = eng.hparams();
    engine::ExpertPopularity pop;
    pop.counts.assign(hp.n_layer, std::vector<uint64_t>(hp.n_expert, 0));
    // Run the text in context-sized windows so any length can be profiled.
    const int64_t window = eng.n_ctx();
    std::vector<float> logits;
    for (size_t b = 0; b < ids.size(); b += size_t(window)) {
      const size_t n = std::min(ids.size() - b, size_t(window));
      model::SequenceState st = eng.new_sequence();
      model::RoutingTrace trace;
      eng.prefill(st, std::span(ids).subspan(b, n), model::LogitsMode::None, logits, &trace);
      pop.count(trace);
      pop.tokens += n;
      fmt::print(stderr, "\rprofiled {}/{} tokens", b + n, ids.size());
    }
    fmt::print(stderr, "\n");
    const std::string out = f->out.empty() ? engine::default_rank_path(f->engine.model) : f->out;
    engine::write_popularity(out, f->engine.model, pop);
    // Coverage: share of picks taken by each layer's 16 most popular experts.
    const auto rank = pop.rank();
    for (int l = 0; l < hp.n_layer; ++l) {
      uint64_t total = 0, top = 0, used = 0;
      for (int e = 0; e < hp.n_expert; ++e) {
        total += pop.counts[l][e];
        used += pop.counts[l][e] > 0;
      }
      for (int i = 0; i < std::min(16, hp.n_expert); ++i) top += pop.counts[l][rank[l][i]];
      fmt::print(stderr, "layer {:3d}: {} of {} experts used, top 16 take {:.1f} % of picks\n", l, used, hp.n_expert,
                 total ? 100.0 * double(top) / double(total) : 0.0);
    }
    fmt::print("wrote {} ({} tokens, {} layers x {} experts)\n", out, pop.tokens, hp.n_layer, hp.n_expert);
  });
}

}  // namespace strata::cli
