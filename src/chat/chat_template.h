#pragma once
// Chat templates: the model's tokenizer.chat_template (Jinja, rendered by chat/jinja.h) turned
// into a prompt from OpenAI-style messages, plus the tokens that end an assistant turn.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "chat/jinja.h"

namespace strata::gguf {
class File;
}
namespace strata::tokenizer {
class Tokenizer;
}

namespace strata::chat {

/// The ChatML template, used when a model has no tokenizer.chat_template.
extern const char* const kChatMLTemplate;

class ChatTemplate {
 public:
  /// Parses `source` and renders a sample conversation (system, user, assistant, user; then
  /// without the system message if the template rejects it), so that an unsupported
  /// template fails here, at load time. Throws TemplateError naming the construct or the
  /// sample's render error.
  ChatTemplate(std::string source, std::string bos_token, std::string eos_token);

  /// The template of a GGUF file (tokenizer.chat_template), with its BOS/EOS token text.
  /// Falls back to ChatML when the key is absent (is_fallback() then says so).
  static ChatTemplate from_gguf(const gguf::File& f, const tokenizer::Tokenizer& tok);

  /// Renders `messages` (an array of {"role", "content", ...} objects). `extra` adds
  /// top-level variables (e.g. {"enable_thinking": false}, "tools"). Throws RenderError,
  /// including the template's own raise_exception messages.
  std::string apply(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                    const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;

  const std::string& source() const { return source_; }
  bool is_fallback() const { return fallback_; }

 private:
  std::string source_, bos_, eos_;
  Template tmpl_;
  bool fallback_ = false;
};

/// Tokens that end generation: EOS plus the end-of-turn control tokens a chat format uses
/// (<|im_end|>, <|endoftext|>, <|eot_id|>, <|end|>, <end_of_turn>, <|eom_id|>) that exist in
/// the vocabulary as control tokens. Sorted, unique.
std::vector<int32_t> end_of_generation_tokens(const tokenizer::Tokenizer& tok);

}  // namespace strata::chat
