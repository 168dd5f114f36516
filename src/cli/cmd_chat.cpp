// strata chat: an interactive chat in the terminal with the model's chat template. Reads one
// user message per line from stdin (a terminal or a pipe), streams the reply to stdout.
// Commands: /exit ends, /reset starts a new conversation.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
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
struct ChatFlags {
  EngineFlags engine;
  engine::SamplerParams sp;
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
  app->add_option("-n,--n-predict", f->n_predict, "most tokens per reply (-1 = until end of turn or context)")
      ->capture_default_str();
  app->add_option("--temp", f->sp.temp, "temperature (0 = greedy)")->capture_default_str();
  app->add_option("--top-k", f->sp.top_k, "top-k sampling (0 = off)")->capture_default_str();
  app->add_option("--top-p", f->sp.top_p, "top-p sampling (1 = off)")->capture_default_str();
  app->add_option("--min-p", f->sp.min_p, "min-p sampling (0 = off)")->capture_default_str();
  app->add_option("--repeat-penalty", f->sp.repeat_penalty, "repetition penalty (1 = off)")->capture_default_str();
  app->add_option("-s,--seed", f->sp.seed, "sampling seed (default: random)");
  app->add_option("--chat-template-file", f->chat_template_file, "Jinja chat template to use instead of the model's")
      ->check(CLI::ExistingFile);
  app->callback([f] {
    using J = nlohmann::ordered_json;
    engine::Engine eng(f->engine.model, f->engine.resolve());
    const chat::ChatTemplate tmpl = load_chat_template(eng, f->chat_template_file);
    const auto& tok = eng.tokenizer();
    const std::vector<int32_t> eog = chat::end_of_generation_tokens(tok);
    const bool tty = isatty(STDIN_FILENO);
    fmt::print(stderr, "strata chat: {} ({}), context {} tokens; /exit ends, /reset starts over\n", f->engine.model,
               eng.hparams().arch, eng.n_ctx());

    engine::Sampler sampler(f->sp);
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
      if (!std::getline(std::cin, line)) break;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line == "/exit" || line == "/quit") break;
      if (line == "/reset") {
        reset();
        continue;
      }
      if (line.empty()) continue;
      messages.push_back({{"role", "user"}, {"content", line}});
      std::vector<int32_t> ids;
      try {
        ids = tok.encode(tmpl.apply(messages, true));
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
      for (int n = 0; f->n_predict < 0 || n < f->n_predict; ++n) {
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
      messages.push_back({{"role", "assistant"}, {"content", reply}});
    }
  });
}

}  // namespace strata::cli
