#include "chat/chat_template.h"

#include <fmt/format.h>

#include <algorithm>

#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

namespace strata::chat {

const char* const kChatMLTemplate =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

ChatTemplate::ChatTemplate(std::string source, std::string bos_token, std::string eos_token)
    : source_(std::move(source)), bos_(std::move(bos_token)), eos_(std::move(eos_token)), tmpl_(source_) {
  using J = nlohmann::ordered_json;
  const J with_system = J::array({{{"role", "system"}, {"content", "You are a helpful assistant."}},
                                  {{"role", "user"}, {"content", "Hello"}},
                                  {{"role", "assistant"}, {"content", "Hi there"}},
                                  {{"role", "user"}, {"content", "How are you?"}}});
  const J without_system = J(with_system.begin() + 1, with_system.end());
  try {
    apply(with_system, true);
  } catch (const RenderError&) {
    try {
      apply(without_system, true);
    } catch (const RenderError& e) {
      throw TemplateError(fmt::format("chat template fails on a sample conversation: {}", e.what()));
    }
  }
}

ChatTemplate ChatTemplate::from_gguf(const gguf::File& f, const tokenizer::Tokenizer& tok) {
  auto text_of = [&](int32_t id) { return id >= 0 ? tok.token_bytes(id) : std::string(); };
  const bool has = f.has("tokenizer.chat_template");
  ChatTemplate t(has ? f.get_string("tokenizer.chat_template") : std::string(kChatMLTemplate), text_of(tok.bos_id()),
                 text_of(tok.eos_id()));
  t.fallback_ = !has;
  return t;
}

std::string ChatTemplate::apply(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                const nlohmann::ordered_json& extra) const {
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  if (extra.is_object())
    for (auto it = extra.begin(); it != extra.end(); ++it) ctx[it.key()] = it.value();
  ctx["messages"] = messages;
  ctx["add_generation_prompt"] = add_generation_prompt;
  ctx["bos_token"] = bos_;
  ctx["eos_token"] = eos_;
  return tmpl_.render(ctx);
}

std::vector<int32_t> end_of_generation_tokens(const tokenizer::Tokenizer& tok) {
  std::vector<int32_t> out;
  if (tok.eos_id() >= 0) out.push_back(tok.eos_id());
  for (const char* t : {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>"})
    if (auto id = tok.find_token(t); id && tok.is_control(*id)) out.push_back(*id);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace strata::chat
