// strata perplexity: PPL of a text in chunks scored as llama.cpp's llama-perplexity does, and the
// KL divergence of a run against a reference run saved compactly (engine/quality.h, docs/tools.md).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <variant>

#include "cli/commands.h"
#include "cli/common.h"
#include "engine/quality.h"
#include "io/write_file.h"

namespace strata::cli {

namespace {
struct PerplexityFlags {
  EngineFlags engine;
  PromptFlags prompt;
  std::string kld_base;
  bool kld = false;
  int top_k = 256;
  bool json = false;
  bool decode = false;
};

constexpr int kDefaultChunk = 512;

// Whether the GGUF asks for a BOS at the start of a sequence (tokenizer.ggml.add_bos_token).
bool wants_bos(const engine::Engine& eng) {
  const gguf::Value* v = eng.gguf().find("tokenizer.ggml.add_bos_token");
  if (!v) return false;
  const bool* b = std::get_if<bool>(&v->v);
  return b && *b && eng.tokenizer().bos_id() >= 0;
}

std::string settings_of(const engine::Engine& eng) {
  const auto& o = eng.options();
  return fmt::format("act-quant {}, cpu-kernels {}, arena {}, prompt-chunk {}, io-threads {}, predict {}",
                     eng.act_quant(), eng.cpu_kernels(), human_bytes(double(eng.arena_bytes())), o.prompt_chunk,
                     o.io_threads, o.predict ? "on" : "off") +
         (o.moce_bonus > 0 ? fmt::format(", moce-bonus {}{}", o.moce_bonus, o.moce_prefill ? " (prefill too)" : "")
                           : std::string());
}

nlohmann::json me_json(const quality::MeanError& m) { return {{"value", m.mean}, {"error", m.error}}; }
}  // namespace

void register_perplexity(CLI::App& root) {
  auto f = std::make_shared<PerplexityFlags>();
  CLI::App* app = root.add_subcommand(
      "perplexity",
      "perplexity of a text in chunks of -c tokens, scoring the second half of each chunk as llama.cpp's "
      "llama-perplexity does; with --kl-divergence-base FILE saves the run's distributions, with --kl-divergence also "
      "compares against them (mean, 99th and 99.9th percentile KLD, same top-1, RMS dp, PPL ratio)");
  f->engine.add(*app);
  f->prompt.add(*app);
  f->prompt.purpose = "score";
  app->get_option("-c")->description(
      "tokens per chunk and context (default 512, or the base file's with --kl-divergence; at most the model's "
      "context)");
  app->add_option("--kl-divergence-base", f->kld_base,
                  "without --kl-divergence: write the reference distributions here (top-K ids and log-probs, the "
                  "tail mass, log-sum-exp and the text token's log-prob per scored position); with it: read them");
  app->add_flag("--kl-divergence", f->kld, "compare this run with the reference in --kl-divergence-base");
  app->add_option("--kld-top-k", f->top_k, "ids stored per position in the base file (n_vocab = exact KLD)")
      ->capture_default_str()
      ->check(at_least(1));
  app->add_flag("--json", f->json, "print one JSON object instead of text");
  app->add_flag("--decode", f->decode,
                "feed each chunk one token at a time through decode (teacher forcing on the decode path, where "
                "--moce-bonus applies without --moce-prefill); without a bonus the results equal the prefill's");
  app->callback([f] {
    if (f->kld && f->kld_base.empty()) throw std::invalid_argument("--kl-divergence needs --kl-divergence-base FILE");
    if (!f->kld && !f->kld_base.empty()) io::check_writable(f->kld_base, "--kl-divergence-base");
    engine::EngineOptions opts = f->engine.resolve();
    quality::KldBase base;
    if (f->kld) {
      base = quality::read_kld_base(f->kld_base);
      if (opts.n_ctx != 0 && opts.n_ctx != base.plan.n_ctx)
        throw std::invalid_argument(
            fmt::format("-c {} differs from the base file's chunk of {} tokens: omit -c or give -c {}", opts.n_ctx,
                        base.plan.n_ctx, base.plan.n_ctx));
      opts.n_ctx = base.plan.n_ctx;
    } else if (opts.n_ctx == 0) {
      opts.n_ctx = kDefaultChunk;
    }
    const int n_ctx = int(opts.n_ctx);
    engine::Engine eng(f->engine.model, opts);
    f->engine.calibrate_moce(eng);
    const int V = eng.hparams().n_vocab;
    std::vector<int32_t> tokens = f->prompt.tokens(eng.tokenizer());
    const quality::ChunkPlan plan = quality::plan_chunks(tokens.size(), n_ctx);
    tokens.resize(size_t(plan.n_chunk) * size_t(n_ctx));
    const bool bos = wants_bos(eng);
    const uint64_t tok_hash = quality::tokenizer_hash(eng.tokenizer());
    if (f->kld) {
      if (uint32_t(V) != base.n_vocab)
        throw quality::QualityError(fmt::format(
            "the base file '{}' has a vocabulary of {} tokens, this model {}: compare models with the same vocabulary",
            f->kld_base, base.n_vocab, V));
      if (tok_hash != base.tokenizer_hash)
        throw quality::QualityError(fmt::format(
            "the base file '{}' was made with another tokenizer (of {}): compare models that share the tokenizer",
            f->kld_base, base.model));
      if (tokens != base.tokens)
        throw quality::QualityError(fmt::format(
            "the base file '{}' was made from another text ({} chunks of {} tokens; this text gives {} chunks or other "
            "tokens): give the same -f TEXT as the reference run",
            f->kld_base, base.plan.n_chunk, base.plan.n_ctx, plan.n_chunk));
    }
    if (!f->kld_base.empty() && !f->kld) {
      base.n_vocab = uint32_t(V);
      base.top_k = uint32_t(std::min(f->top_k, V));
      base.plan = plan;
      base.tokenizer_hash = tok_hash;
      base.model = f->engine.model;
      base.settings = settings_of(eng);
      base.tokens = tokens;
      base.positions.reserve(size_t(plan.n_chunk) * size_t(plan.n_scored));
    }

    if (!f->json)
      fmt::print(stderr,
                 "perplexity: {} tokens, {} chunks of {}; in each, the logits of positions {}..{} predict the next "
                 "token ({} scored per chunk, {} in all; llama.cpp's convention){}\n",
                 tokens.size(), plan.n_chunk, n_ctx, plan.first, n_ctx - 2, plan.n_scored,
                 size_t(plan.n_chunk) * size_t(plan.n_scored), bos ? "; BOS replaces each chunk's first token" : "");
    quality::PplAccumulator acc;
    std::vector<quality::PositionCompare> cmp;
    std::vector<double> chunk_ppl;
    std::vector<float> logits;
    for (int c = 0; c < plan.n_chunk; ++c) {
      std::vector<int32_t> ids(tokens.begin() + ptrdiff_t(c) * n_ctx, tokens.begin() + ptrdiff_t(c + 1) * n_ctx);
      if (bos) ids[0] = eng.tokenizer().bos_id();
      model::SequenceState st = eng.new_sequence();
      if (f->decode) {
        logits.resize(ids.size() * size_t(V));
        std::vector<float> one;
        for (size_t i = 0; i < ids.size(); ++i) {
          eng.decode(st, ids[i], one);
          std::copy(one.begin(), one.end(), logits.begin() + ptrdiff_t(i * size_t(V)));
        }
      } else {
        eng.prefill(st, ids, model::LogitsMode::All, logits);
      }
      for (int j = plan.first; j < n_ctx - 1; ++j) {
        const float* row = logits.data() + size_t(j) * size_t(V);
        const int32_t next = tokens[size_t(c) * size_t(n_ctx) + size_t(j) + 1];
        const double lse = quality::log_sum_exp(row, V);
        acc.add(-double(quality::log_prob(row[next], lse)));
        if (f->kld) {
          const size_t idx = size_t(c) * size_t(plan.n_scored) + size_t(j - plan.first);
          cmp.push_back(quality::compare_position(base.positions[idx], row, V, next));
        } else if (!f->kld_base.empty()) {
          base.positions.push_back(quality::make_ref(row, V, int(base.top_k), next));
        }
      }
      chunk_ppl.push_back(acc.ppl());
      if (!f->json) fmt::print(stderr, "[{}]{:.4f},", c + 1, acc.ppl());
    }
    if (!f->json) fmt::print(stderr, "\n");
    if (!f->kld_base.empty() && !f->kld) quality::write_kld_base(f->kld_base, base);

    const std::string estimator = "PPL = exp(mean NLL); +/- = PPL x the standard error of the mean NLL";
    if (f->json) {
      nlohmann::json j = {{"tokens", tokens.size()},    {"n_ctx", n_ctx},
                          {"chunks", plan.n_chunk},     {"scored", acc.n},
                          {"ppl", acc.ppl()},           {"ppl_error", acc.ppl_error()},
                          {"mean_nll", acc.nll().mean}, {"chunk_ppl", chunk_ppl},
                          {"estimator", estimator}};
      if (f->kld) {
        const quality::KldSummary s = quality::summarize(cmp);
        j["kld"] = {{"base_model", base.model},
                    {"base_settings", base.settings},
                    {"top_k", base.top_k},
                    {"ppl_base", me_json(s.ppl_base)},
                    {"ppl_ratio", me_json(s.ppl_ratio)},
                    {"mean", me_json(s.kld)},
                    {"mean_upper_bound", s.kld_upper_mean},
                    {"mean_tail_mass", s.tail_mean},
                    {"p99", s.kld_p99},
                    {"p999", s.kld_p999},
                    {"median", s.kld_median},
                    {"max", s.kld_max},
                    {"same_top1", me_json(s.same_top)},
                    {"rms_dp_text", me_json(s.rms_dp_text)},
                    {"rms_dp_top1", me_json(s.rms_dp_top)}};
      } else if (!f->kld_base.empty()) {
        j["kld_base_written"] = f->kld_base;
      }
      fmt::print("{}\n", j.dump());
      return;
    }
    fmt::print("Final estimate: PPL = {:.4f} +/- {:.5f}   ({} over {} tokens; {})\n", acc.ppl(), acc.ppl_error(),
               f->engine.model, acc.n, estimator);
    if (!f->kld_base.empty() && !f->kld)
      fmt::print("wrote the reference distributions to {} (top {} per position)\n", f->kld_base, base.top_k);
    if (!f->kld) return;
    const quality::KldSummary s = quality::summarize(cmp);
    fmt::print("\nbase: {} ({}), top {} stored per position; this run: {}\n", base.model, base.settings, base.top_k,
               settings_of(eng));
    fmt::print("====== Perplexity statistics ======\n");
    fmt::print("Mean PPL(Q)                 : {:12.6f} +/- {:.6f}\n", s.ppl.mean, s.ppl.error);
    fmt::print("Mean PPL(base)              : {:12.6f} +/- {:.6f}\n", s.ppl_base.mean, s.ppl_base.error);
    fmt::print("Mean PPL(Q)/PPL(base)       : {:12.6f} +/- {:.6f}\n", s.ppl_ratio.mean, s.ppl_ratio.error);
    fmt::print("====== KL divergence KL(base || Q), nats (top-{} + tail bins: a lower bound) ======\n", base.top_k);
    fmt::print("Mean    KLD: {:.6f} +/- {:.6f}\n", s.kld.mean, s.kld.error);
    fmt::print("Maximum KLD: {:.6f}\n", s.kld_max);
    fmt::print("99.9%   KLD: {:.6f}\n", s.kld_p999);
    fmt::print("99.0%   KLD: {:.6f}\n", s.kld_p99);
    fmt::print("Median  KLD: {:.6f}\n", s.kld_median);
    fmt::print(
        "Mean KLD upper bound: {:.6f} (the base's mass outside its top {} is {:.3g} on average; the bound puts it "
        "where this run is least probable)\n",
        s.kld_upper_mean, base.top_k, s.tail_mean);
    fmt::print("====== Token probability statistics ======\n");
    fmt::print("RMS dp (text token)         : {:.3f} +/- {:.3f} %\n", 100 * s.rms_dp_text.mean,
               100 * s.rms_dp_text.error);
    fmt::print("RMS dp (base's top-1 token) : {:.3f} +/- {:.3f} %\n", 100 * s.rms_dp_top.mean,
               100 * s.rms_dp_top.error);
    fmt::print("Same top-1                  : {:.3f} +/- {:.3f} %\n", 100 * s.same_top.mean, 100 * s.same_top.error);
  });
}

}  // namespace strata::cli
