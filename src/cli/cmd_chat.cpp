// strata chat: an interactive chat in the terminal with the model's chat template. Reads one
// user message per line from stdin (a terminal or a pipe), streams the reply to stdout.
// Commands: /help lists them, /exit (or /quit) ends, /reset starts a new conversation; other
// "/word" lines are refused as unknown commands, "//text" sends "/text". Ctrl-C stops the reply being
// generated (the conversation goes on with the part written); at the prompt it only
// reminds how to quit (/exit or Ctrl-D).
#include <fmt/format.h>

#include <pthread.h>
#include <unistd.h>
#include <cctype>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "engine/sampler.h"

namespace strata::cli {

chat::ChatTemplate load_chat_template(engine::Engine& eng, const std::string& file);  // cmd_serve.cpp

namespace {

std::atomic<bool> g_interrupted{false};
extern "C" void on_sigint(int) { g_interrupted.store(true); }

struct ChatFlags {
  EngineFlags engine;
  SamplingFlags sampling;
  std::string system;
  int n_predict = -1;
  std::string chat_template_file;
};
}  // namespace

void register_chat(CLI::App& root) {
  auto f = std::make_shared<ChatFlags>();
  CLI::App* app =
      root.add_subcommand("chat", "interactive chat with the model's chat template (stdin lines; /exit ends)");
  f->engine.add(*app);
  app->add_option("--system", f->system, "system message");
  add_n_predict_option(*app, f->n_predict, "most tokens per reply (-1 = until end of turn or context)");
  f->sampling.add(*app);
  app->add_option("--chat-template-file", f->chat_template_file, "Jinja chat template to use instead of the model's")
      ->check(CLI::ExistingFile);
  app->callback([f] {
    using J = nlohmann::ordered_json;
    const engine::SamplerParams sp = f->sampling.resolve();  // bad flags fail before the model loads
    // SIGINT goes to this thread only (the engine's threads inherit it blocked), where it
    // interrupts the read of a line or sets the flag that stops a reply.
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
    engine::Engine eng(f->engine.model, f->engine.resolve());
    const chat::ChatTemplate tmpl = load_chat_template(eng, f->chat_template_file);
    struct sigaction sa {};
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;  // no SA_RESTART: a blocked read returns EINTR
    sigaction(SIGINT, &sa, nullptr);
    pthread_sigmask(SIG_UNBLOCK, &sigs, nullptr);
    const auto& tok = eng.tokenizer();
    const chat::PromptEncoder encoder(tok);
    const std::vector<int32_t> eog = chat::end_of_generation_tokens(tok);
    const bool tty = isatty(STDIN_FILENO);
    fmt::print(stderr,
               "strata chat: {} ({}), context {} tokens; /help lists commands, /exit or Ctrl-D ends, /reset starts "
               "over, Ctrl-C stops a "
               "reply\n",
               f->engine.model, eng.hparams().arch, eng.n_ctx());

    engine::Sampler sampler(sp);
    if (f->sampling.seed == -1 && sp.temp > 0) fmt::print(stderr, "strata chat: seed {} (random)\n", sampler.seed());
    model::SequenceState st = eng.new_sequence();
    std::vector<int32_t> cached;  // tokens whose KV rows are in st
    J messages = J::array();
    auto reset = [&] {
      messages = J::array();
      if (!f->system.empty()) messages.push_back({{"role", "system"}, {"content", f->system}});
      st = eng.new_sequence();
      cached.clear();
    };
    reset();
    std::vector<float> logits;
    std::string line;
    for (;;) {
      if (tty) {
        fmt::print("> ");
        std::fflush(stdout);
      }
      g_interrupted.store(false);
      if (!std::getline(std::cin, line)) {
        if (g_interrupted.load() && !std::feof(stdin)) {  // Ctrl-C at the prompt
          std::cin.clear();
          clearerr(stdin);
          fmt::print(stderr, "\nstrata chat: (Ctrl-C stops a reply; /exit or Ctrl-D ends the chat)\n");
          continue;
        }
        break;
      }
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line == "/exit" || line == "/quit") break;
      if (line == "/reset") {
        const size_t turns = messages.size() - (f->system.empty() ? 0 : 1);
        const size_t dropped = cached.size();
        reset();
        fmt::print(stderr, "strata chat: conversation cleared ({} messages and {} cached tokens dropped{})\n", turns,
                   dropped, f->system.empty() ? "" : "; the system message is kept");
        continue;
      }
      if (line == "/help") {
        fmt::print(stderr,
                   "strata chat commands:\n"
                   "  /help          this list\n"
                   "  /reset         start a new conversation (the --system message is kept)\n"
                   "  /exit, /quit   end the chat (as Ctrl-D)\n"
                   "  //TEXT         send TEXT with one leading '/' (\"//etc\" sends \"/etc\")\n"
                   "Ctrl-C stops the reply being generated.\n");
        continue;
      }
      if (line.size() >= 2 && line[0] == '/' && line[1] == '/') {
        line.erase(0, 1);  // "//x" is the message "/x"
      } else if (line.size() >= 2 && line[0] == '/' && std::isalpha(static_cast<unsigned char>(line[1]))) {
        const std::string word = line.substr(0, line.find_first_of(" \t"));
        fmt::print(stderr, "strata chat: unknown command '{}', see /help (start with // to send a leading '/')\n",
                   word);
        continue;
      }
      if (line.empty()) continue;
      messages.push_back({{"role", "user"}, {"content", line}});
      std::vector<int32_t> ids;
      try {
        ids = encoder.encode_chat(tmpl, messages, true);
      } catch (const std::exception& e) {
        fmt::print(stderr, "strata chat: {}\n", e.what());
        messages.erase(messages.end() - 1);
        continue;
      }
      if (int64_t(ids.size()) >= eng.n_ctx()) {
        fmt::print(stderr, "strata chat: the conversation ({} tokens) fills the context ({}); /reset to start over\n",
                   ids.size(), eng.n_ctx());
        messages.erase(messages.end() - 1);
        continue;
      }
      // Reuse the KV rows of the previous turns when the new prompt extends them.
      const bool extends = cached.size() < ids.size() && std::equal(cached.begin(), cached.end(), ids.begin());
      if (!extends) {
        st = eng.new_sequence();
        cached.clear();
      }
      std::vector<int32_t> fresh(ids.begin() + long(cached.size()), ids.end());
      eng.prefill(st, fresh, model::LogitsMode::Last, logits);
      cached = ids;
      std::vector<int32_t> history = ids;
      tokenizer::StreamDecoder dec(tok);
      std::string reply;
      bool stopped = false;
      for (int n = 0; f->n_predict < 0 || n < f->n_predict; ++n) {
        if (g_interrupted.exchange(false)) {
          stopped = true;
          break;
        }
        const int32_t id = sampler.sample(logits, history);
        if (std::find(eog.begin(), eog.end(), id) != eog.end()) break;
        history.push_back(id);
        const std::string piece = dec.push(id);
        reply += piece;
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
        if (st.n_past >= st.n_ctx) break;
        eng.decode(st, id, logits);
        cached.push_back(id);
      }
      const std::string rest = dec.flush();
      reply += rest;
      std::fwrite(rest.data(), 1, rest.size(), stdout);
      std::fputc('\n', stdout);
      std::fflush(stdout);
      if (stopped) fmt::print(stderr, "strata chat: reply stopped (Ctrl-C); the conversation goes on\n");
      messages.push_back({{"role", "assistant"}, {"content", reply}});
    }
  });
}

}  // namespace strata::cli
