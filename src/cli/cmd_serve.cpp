// strata serve: an OpenAI-compatible HTTP server (src/server) over one engine. Runs until
// SIGINT or SIGTERM.
#include <fmt/format.h>
#include <pthread.h>

#include <csignal>
#include <fstream>
#include <sstream>
#include <thread>

#include "chat/chat_template.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "server/server.h"

namespace strata::cli {

namespace {
struct ServeFlags {
  EngineFlags engine;
  server::ServerOptions server;
  SamplingFlags sampling;  ///< the defaults of requests that leave a sampling field unset
  std::string chat_template_file;
  int64_t max_body_kb = 1024;
  int64_t cache_ram_mb = 1024;
  double shutdown_grace_s = 5;
  bool no_cont_batching = false;
};
}  // namespace

/// The model's chat template (or the one in `file`), failing with a clear message at startup.
chat::ChatTemplate load_chat_template(engine::Engine& eng, const std::string& file) {
  try {
    if (file.empty()) {
      chat::ChatTemplate t = chat::ChatTemplate::from_gguf(eng.gguf(), eng.tokenizer());
      if (t.is_fallback())
        fmt::print(stderr, "strata: warning: the model has no tokenizer.chat_template; using ChatML\n");
      return t;
    }
    std::ifstream in(file, std::ios::binary);
    if (!in) throw std::runtime_error(fmt::format("cannot read chat template file '{}'", file));
    std::stringstream ss;
    ss << in.rdbuf();
    auto text_of = [&](int32_t id) { return id >= 0 ? eng.tokenizer().token_bytes(id) : std::string(); };
    return chat::ChatTemplate(ss.str(), text_of(eng.tokenizer().bos_id()), text_of(eng.tokenizer().eos_id()));
  } catch (const chat::TemplateError& e) {
    throw std::runtime_error(fmt::format("unsupported chat template ({}): {}",
                                         file.empty() ? "tokenizer.chat_template of the model" : file, e.what()));
  }
}

/// Refuses, before anything is allocated, a --parallel whose KV caches (slots x context x bytes
/// per token) or a --cache-ram that does not fit in MemAvailable (CPU backend: both live in host
/// RAM; with a device backend only the prefix cache does). Throws std::invalid_argument.
static void check_serve_memory(const engine::Engine& eng, int parallel, uint64_t cache_bytes) {
  const uint64_t avail = engine::mem_available_bytes();
  if (avail == 0) return;  // unknown (no /proc/meminfo)
  const auto mib = [](double b) { return b / 1048576.0; };
  const int64_t ctx = eng.n_ctx();
  const uint64_t per_slot = eng.model().state_bytes(ctx);
  const bool host_kv = eng.backend_info().name == "cpu";
  const double slots_total = double(per_slot) * double(parallel);
  if (host_kv && slots_total > double(avail))
    throw std::invalid_argument(fmt::format(
        "--parallel {}: {} slots x {} tokens of context x {} bytes per token = {:.1f} MiB of KV cache, but only "
        "{:.1f} MiB are available (MemAvailable); lower --parallel or -c/--ctx-size",
        parallel, parallel, ctx, per_slot / uint64_t(std::max<int64_t>(ctx, 1)), mib(slots_total), mib(double(avail))));
  const double left = double(avail) - (host_kv ? slots_total : 0.0);
  if (double(cache_bytes) > left)
    throw std::invalid_argument(fmt::format(
        "--cache-ram {}: a prefix cache of {:.1f} MiB does not fit in the {:.1f} MiB available (MemAvailable{}); "
        "use --cache-ram {} or less",
        cache_bytes >> 20, mib(double(cache_bytes)), mib(left), host_kv ? " less the slots' KV caches" : "",
        uint64_t(left) >> 20));
}

void register_serve(CLI::App& root) {
  auto f = std::make_shared<ServeFlags>();
  CLI::App* app =
      root.add_subcommand("serve", "OpenAI-compatible HTTP server: chat and text completions, SSE streaming");
  f->engine.add(*app);
  auto& s = f->server;
  app->add_option("--host", s.host, "address to listen on")->capture_default_str();
  app->add_option("--port", s.port, "port to listen on (0 = any free port, printed at start)")->capture_default_str();
  app->add_option("--api-key", s.api_key, "require 'Authorization: Bearer KEY' (all endpoints but /health)");
  app->add_option("--parallel", s.parallel, "requests generating at once (slots of --ctx-size tokens each)")
      ->capture_default_str()
      ->check(at_least(1));
  app->add_option("--queue-size", s.queue_size, "requests waiting for a slot before new ones get 503")
      ->capture_default_str()
      ->check(at_least(0));
  app->add_option("--max-body-kb", f->max_body_kb, "largest request body in KiB (larger: 413)")
      ->capture_default_str()
      ->check(at_least(1));
  app->add_option("--max-connections,--http-threads", s.http_threads,
                  "connections served at once, a thread each (more wait for a free one; 0 = max(256, parallel + "
                  "queue-size + 64))")
      ->capture_default_str()
      ->check(at_least(0));
  app->add_option("--timeout", s.read_timeout_s,
                  "seconds a connection may send nothing (an unfinished request, an idle keep-alive) before it "
                  "is closed")
      ->capture_default_str()
      ->check(at_least(1));
  auto& sc = s.scheduling;
  app->add_option("--batch-tokens", sc.batch_tokens,
                  "most tokens per forward step: the next token of every generating request plus prompt chunks "
                  "of new ones (0 = --prompt-chunk, the most the arena is sized for)")
      ->capture_default_str()
      ->check(at_least(0));
  app->add_flag("--no-cont-batching", f->no_cont_batching,
                "no continuous batching: interleave the slots, one forward per slot per turn (for comparison)");
  app->add_option("--cache-ram", f->cache_ram_mb,
                  "prefix cache size in MiB (host RAM for KV/recurrent-state snapshots of earlier prompts; 0 = off)")
      ->capture_default_str()
      ->check(at_least(0));
  app->add_option("--request-timeout", sc.request_timeout_s,
                  "seconds after which a request ends with finish_reason \"length\" (0 = never)")
      ->capture_default_str()
      ->check(non_negative_real());
  add_n_predict_option(*app, s.n_predict,
                       "max_tokens of requests that leave it unset (-1 = up to the end of the context)");
  app->add_option("--shutdown-grace", f->shutdown_grace_s,
                  "on SIGINT/SIGTERM, seconds running requests get to finish before they are cancelled")
      ->capture_default_str()
      ->check(non_negative_real());
  f->sampling.add(*app, true);  // --temp, --top-k, ... as run and chat: a request's own fields win
  app->add_option("--alias", s.model_name, "model id reported by /v1/models (default: the file name)");
  app->add_option("--chat-template-file", f->chat_template_file, "Jinja chat template to use instead of the model's")
      ->check(CLI::ExistingFile);
  app->callback([f] {
    // Signals go to one waiting thread (blocked everywhere else), which stops the server.
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

    server::ServerOptions opts = f->server;
    opts.sampling = f->sampling.resolve();  // checked before the model loads
    engine::Engine eng(f->engine.model, f->engine.resolve());
    chat::ChatTemplate tmpl = load_chat_template(eng, f->chat_template_file);
    opts.max_body_bytes = size_t(f->max_body_kb) * 1024;
    opts.scheduling.cache_bytes = uint64_t(f->cache_ram_mb) << 20;
    opts.scheduling.batching = !f->no_cont_batching;
    check_serve_memory(eng, opts.parallel, opts.scheduling.cache_bytes);
    server::Server srv(eng, std::move(tmpl), opts);
    const int port = srv.bind();
    const engine::SamplerParams& d = opts.sampling;
    fmt::print(stderr,
               "strata serve: defaults of unset request fields: temperature {}, top_k {}, top_p {}, min_p {}, "
               "repeat_penalty {}, repeat_last_n {}, seed {}, max_tokens {}\n",
               d.temp, d.top_k, d.top_p, d.min_p, d.repeat_penalty, d.repeat_last_n,
               f->sampling.seed < 0 ? std::string("random") : std::to_string(f->sampling.seed),
               opts.n_predict <= 0 ? std::string("up to the end of the context") : std::to_string(opts.n_predict));
    fmt::print(stderr,
               "strata serve: listening on http://{}:{} ({}, {} of {} tokens, queue {}, arena {} in {}, "
               "{}, prefix cache {})\n",
               opts.host, port, f->engine.model, count_of(opts.parallel, "slot"), eng.n_ctx(), opts.queue_size,
               human_bytes(double(eng.arena_bytes())), count_of(eng.stream().n_slots(), "slot"),
               opts.scheduling.batching ? fmt::format("continuous batching of up to {} tokens",
                                                      opts.scheduling.batch_tokens > 0 ? opts.scheduling.batch_tokens
                                                                                       : eng.options().prompt_chunk)
                                        : std::string("interleaved slots"),
               f->cache_ram_mb > 0 ? human_bytes(double(uint64_t(f->cache_ram_mb) << 20)) : std::string("off"));
    std::thread waiter([&] {
      int sig = 0;
      sigwait(&sigs, &sig);
      if (sig != SIGINT && sig != SIGTERM) return;  // listen ended by itself
      fmt::print(stderr, "strata serve: stopping (running requests get {} s to finish)\n", f->shutdown_grace_s);
      const int64_t cancelled = srv.shutdown(std::chrono::milliseconds(int64_t(f->shutdown_grace_s * 1000)));
      if (cancelled > 0) fmt::print(stderr, "strata serve: cancelled {} unfinished requests\n", cancelled);
    });
    srv.listen();
    pthread_kill(waiter.native_handle(), SIGUSR1);  // wake the waiter if listen ended by itself
    waiter.join();
    fmt::print(stderr, "strata serve: stopped\n");
  });
}

}  // namespace strata::cli
