// strata template: render a chat template over a conversation, printing exactly the prompt.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "chat/chat_template.h"
#include "chat/json_depth.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

namespace strata::cli {

namespace {

// The text of `arg`: itself, or the contents of the file it names when it starts with '@'.
std::string inline_or_file(const std::string& arg, const char* flag) {
  if (arg.empty() || arg[0] != '@') return arg;
  const std::string path = arg.substr(1);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument(fmt::format("{}: cannot read the file '{}'", flag, path));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// `arg` (inline JSON or @file) parsed; it must be an array. Throws naming the flag.
nlohmann::ordered_json json_array_arg(const std::string& arg, const char* flag) {
  const std::string text = inline_or_file(arg, flag);
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::invalid_argument(fmt::format("{}: invalid JSON: {}", flag, e.what()));
  }
  if (!j.is_array()) throw std::invalid_argument(fmt::format("{}: must be a JSON array", flag));
  if (const size_t d = chat::json_depth(j); d > chat::kMaxJsonDepth)
    throw std::invalid_argument(fmt::format("{}: nests {} levels deep (at most {})", flag, d, chat::kMaxJsonDepth));
  return j;
}

}  // namespace

void register_template(CLI::App& root) {
  struct Flags {
    std::string model, template_file, messages, tools, bos, eos;
    bool add_generation_prompt = false;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* app =
      root.add_subcommand("template",
                          "render a chat template over a conversation and print exactly the prompt (no newline added)");
  auto* m = app->add_option("-m,--model", f->model, "GGUF model file whose tokenizer.chat_template is rendered")
                ->check(CLI::ExistingFile);
  auto* t = app->add_option("--chat-template-file", f->template_file, "Jinja chat template file to render")
                ->check(CLI::ExistingFile);
  m->excludes(t);
  app->add_option("--messages", f->messages,
                  "the conversation: a JSON array of {\"role\", \"content\", ...} objects, inline or @file")
      ->required();
  app->add_option("--tools", f->tools, "tool definitions: a JSON array (OpenAI 'tools'), inline or @file");
  app->add_flag("--add-generation-prompt", f->add_generation_prompt,
                "end with the template's opening of an assistant turn");
  auto* bos = app->add_option("--bos", f->bos,
                              "text of the template's bos_token (default: the model's BOS token text; empty with "
                              "--chat-template-file)");
  auto* eos = app->add_option("--eos", f->eos,
                              "text of the template's eos_token (default: the model's EOS token text; empty with "
                              "--chat-template-file)");
  app->callback([f, bos, eos] {
    if (f->model.empty() == f->template_file.empty())
      throw std::invalid_argument("give exactly one of -m MODEL and --chat-template-file FILE");
    const nlohmann::ordered_json messages = json_array_arg(f->messages, "--messages");
    nlohmann::ordered_json extra = nlohmann::ordered_json::object();
    if (!f->tools.empty()) extra["tools"] = json_array_arg(f->tools, "--tools");
    std::string source, name, bos_text, eos_text;
    if (!f->model.empty()) {
      const gguf::File g = gguf::File::open(f->model);
      const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_gguf(g);
      auto text_of = [&](int32_t id) { return id >= 0 ? tok.token_bytes(id) : std::string(); };
      bos_text = text_of(tok.bos_id());
      eos_text = text_of(tok.eos_id());
      if (g.has("tokenizer.chat_template")) {
        source = g.get_string("tokenizer.chat_template");
        name = fmt::format("the chat template of {}", f->model);
      } else {
        source = chat::kChatMLTemplate;
        name = fmt::format("the ChatML fallback ({} has no tokenizer.chat_template)", f->model);
      }
    } else {
      source = inline_or_file("@" + f->template_file, "--chat-template-file");
      name = fmt::format("the chat template {}", f->template_file);
    }
    if (bos->count() > 0) bos_text = f->bos;
    if (eos->count() > 0) eos_text = f->eos;
    std::string out;
    try {
      const chat::ChatTemplate tmpl(std::move(source), bos_text, eos_text);
      out = tmpl.apply(messages, f->add_generation_prompt, extra);
    } catch (const chat::TemplateError& e) {
      throw std::runtime_error(fmt::format("{} cannot be loaded: {}", name, e.what()));
    } catch (const chat::RenderError& e) {
      throw std::runtime_error(fmt::format("{} failed to render the messages: {}", name, e.what()));
    }
    std::fwrite(out.data(), 1, out.size(), stdout);
  });
}

}  // namespace strata::cli
