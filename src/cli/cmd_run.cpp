// strata run: generate text, streaming experts through the arena, then print the counters.
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <span>

#include "cli/commands.h"
#include "cli/common.h"
#include "engine/sampler.h"

namespace strata::cli {

namespace {
struct RunFlags {
  EngineFlags engine;
  PromptFlags prompt;
  int n_predict = 64;
  SamplingFlags sampling;
  bool json = false;
  bool ignore_eos = false;
};

// Set by SIGINT: the forward stops before its next layer and the stats are printed (a lock-free
// atomic, safe to store from a signal handler).
std::atomic<bool> g_interrupted{false};
static_assert(std::atomic<bool>::is_always_lock_free);
void on_sigint(int) { g_interrupted.store(true); }
}  // namespace

void register_run(CLI::App& root) {
  auto f = std::make_shared<RunFlags>();
  CLI::App* app = root.add_subcommand("run", "generate text from a prompt");
  f->engine.add(*app);
  f->prompt.add(*app);
  add_n_predict_option(*app, f->n_predict,
                       "tokens to generate (-1 = until the end-of-text token or a full context, as in chat)");
  f->sampling.add(*app);
  app->add_flag("--ignore-eos", f->ignore_eos, "keep generating after the end-of-text token");
  app->add_flag("--json", f->json, "print one JSON object (prompt_ids, ids, text, stats) instead of streaming text");
  app->callback([f] {
    const engine::SamplerParams sp = f->sampling.resolve();
    engine::Engine eng(f->engine.model, f->engine.resolve());
    f->engine.calibrate_moce(eng);
    const std::vector<int32_t> prompt = f->prompt.tokens(eng.tokenizer());
    if (!f->json) {
      // The CPU backend's description already names its threads, kernels and activations.
      const backend::BackendInfo bi = eng.backend_info();
      const std::string host = bi.name == "cpu" ? std::string()
                                                : fmt::format("{}, {} kernels, {} activations, ",
                                                              count_of(eng.options().n_threads, "thread"),
                                                              eng.cpu_kernels_label(), eng.act_quant());
      fmt::print(stderr, "strata: {} ({}), {}, arena {} ({}), prompt chunk {}{}, {}backend {} ({})\n", f->engine.model,
                 eng.hparams().arch, count_of(prompt.size(), "prompt token"), human_bytes(double(eng.arena_bytes())),
                 count_of(eng.stream().n_slots(), "slot"), eng.options().prompt_chunk,
                 f->engine.opts.prompt_chunk == 0 ? " (automatic)" : "", host, bi.name, bi.device);
    }

    engine::Sampler sampler(sp);
    if (f->sampling.seed == -1 && sp.temp > 0 && !f->json)
      fmt::print(stderr, "strata: seed {} (random)\n", sampler.seed());
    model::SequenceState st = eng.new_sequence();
    std::vector<float> logits;
    std::vector<int32_t> history = prompt, generated;
    tokenizer::StreamDecoder dec(eng.tokenizer());
    std::string text;
    eng.check_ids(st, prompt);  // a prompt that cannot run is refused before it is echoed
    if (!f->json) {
      for (int32_t id : prompt) {
        std::string piece = dec.push(id);
        std::fwrite(piece.data(), 1, piece.size(), stdout);
      }
      std::string rest = dec.flush();
      std::fwrite(rest.data(), 1, rest.size(), stdout);
      std::fflush(stdout);
    }
    tokenizer::StreamDecoder out(eng.tokenizer());
    // SIGINT stops the forward before its next layer and still prints the stats.
    g_interrupted = false;
    eng.set_interrupt(&g_interrupted);
    const auto old_handler = std::signal(SIGINT, on_sigint);
    struct Restore {
      void (*h)(int);
      ~Restore() { std::signal(SIGINT, h); }
    } restore{old_handler};
    // The prompt in the engine's own chunks (the same forward calls prefill makes), with progress
    // on a terminal.
    const bool progress = !f->json && ::isatty(STDERR_FILENO) == 1;
    const size_t chunk = size_t(std::max(1, eng.options().prompt_chunk));
    const auto t_prefill = std::chrono::steady_clock::now();
    for (size_t c0 = 0; c0 < prompt.size() && !g_interrupted; c0 += chunk) {
      const size_t c1 = std::min(prompt.size(), c0 + chunk);
      try {
        eng.prefill(st, std::span<const int32_t>(prompt).subspan(c0, c1 - c0),
                    c1 == prompt.size() ? model::LogitsMode::Last : model::LogitsMode::None, logits);
      } catch (const model::Interrupted&) {
        break;  // the prompt tokens done so far are in the prefill stats
      }
      if (progress && prompt.size() > chunk) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_prefill).count();
        fmt::print(stderr, "\r\33[Kprefill {} / {} tokens, {:.1f} tok/s", c1, prompt.size(),
                   s > 0 ? double(c1) / s : 0.0);
        if (c1 == prompt.size()) fmt::print(stderr, "\n");
        std::fflush(stderr);
      }
    }
    bool out_of_context = false;
    for (int i = 0; (f->n_predict < 0 || i < f->n_predict) && !g_interrupted; ++i) {
      const int32_t id = sampler.sample(logits, history);
      generated.push_back(id);
      history.push_back(id);
      if (id == eng.tokenizer().eos_id() && !f->ignore_eos) break;
      std::string piece = out.push(id);
      text += piece;
      if (!f->json) {
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      }
      if (i + 1 == f->n_predict) break;
      if (st.n_past >= st.n_ctx) {
        out_of_context = true;
        break;
      }
      try {
        eng.decode(st, id, logits);
      } catch (const model::Interrupted&) {
        break;
      }
    }
    const std::string rest = out.flush();
    text += rest;
    if (f->json) {
      nlohmann::json j = {{"prompt_ids", prompt},
                          {"ids", generated},
                          {"text", text},
                          {"seed", sampler.seed()},  // the seed used (the random one too): -s reproduces the run
                          {"stats",
                           {{"prefill", phase_json(eng.prefill_stats())},
                            {"decode", phase_json(eng.decode_stats())},
                            {"arena", arena_json(eng)}}}};
      fmt::print("{}\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    } else {
      std::fwrite(rest.data(), 1, rest.size(), stdout);
      std::fputc('\n', stdout);
      std::fflush(stdout);
      if (g_interrupted)
        fmt::print(stderr, "strata: interrupted after {} prompt and {} generated tokens\n", eng.prefill_stats().tokens,
                   generated.size());
      if (out_of_context) {
        const int64_t train = eng.hparams().n_ctx_train;
        fmt::print(stderr, "strata: stopped after {} token{}: the context of {} tokens is full ({})\n",
                   generated.size(), generated.size() == 1 ? "" : "s", st.n_ctx,
                   train > 0 && st.n_ctx >= train
                       ? fmt::format("the model's training context, the most -c/--ctx-size allows")
                       : fmt::format("raise -c/--ctx-size, up to {}", train > 0 ? train : st.n_ctx));
      }
      print_stats(eng);
      print_profile(eng);
    }
    if (g_interrupted) throw CLI::RuntimeError(130);  // the shell's exit status for SIGINT
  });
}

}  // namespace strata::cli
