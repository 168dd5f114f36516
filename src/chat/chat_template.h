#pragma once
// Chat templates: the model's tokenizer.chat_template (Jinja, rendered by chat/jinja.h) turned
// into a prompt from OpenAI-style messages, plus the tokens that end an assistant turn.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
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
  /// Parses `source` and renders a sample conversation (system, user, assistant, user; then, if
  /// the template rejects it, without the system message, with a tool list, and with the tool
  /// list plus the `functions` and `datetime` variables firefunction-v2 reads), so that an
  /// unsupported template fails here, at load time; the first sample that renders must change
  /// with a message's content. Throws TemplateError naming the construct, the first sample's
  /// render error when none renders, or a template that ignores the messages.
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

/// Chat prompts to token ids such that only the template's own markup becomes control tokens.
///
/// Every string the client sends (message contents, names, tool-call arguments and their keys,
/// tool results, tool definitions, template kwargs) is *neutralised* before rendering: each
/// occurrence of a control token's text (TokenType::CONTROL) in it, and a trailing proper
/// prefix / leading proper suffix of one (so that client text cannot complete a control token
/// together with the template's markup around it), is replaced by a marker
/// S <decimal index> S, S being a Unicode private-use code point (U+F0000 and up) that occurs
/// neither in the template source nor anywhere in the request. The template renders the
/// neutralised values, so its string tests and filters see the text unchanged everywhere else.
/// The rendered text is then split at the control-token strings it contains, which all come
/// from the template (leftmost, longest first, as Tokenizer::encode matches them): those
/// become their ids, and the text between them, with each marker replaced by its original
/// bytes, is encoded with parse_special = false (plain text; user-defined tokens, type 4, match
/// as the tokenizer always matches them). For requests without control-token text this gives
/// exactly encode(render(messages), true) (tested). A marker that the template cut apart (a
/// slice through it) loses its unmatched sentinel; its text is kept as plain text.
class PromptEncoder {
 public:
  /// Collects the control tokens of `tok` (which must outlive the encoder).
  explicit PromptEncoder(const tokenizer::Tokenizer& tok);

  /// Renders `messages` with `t` (see ChatTemplate::apply; `extra` as there) and encodes the
  /// result as described above. Throws RenderError (the template's) and
  /// tokenizer::TokenizerError (invalid UTF-8).
  std::vector<int32_t> encode_chat(const ChatTemplate& t, const nlohmann::ordered_json& messages,
                                   bool add_generation_prompt,
                                   const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;

  /// The ids of `rendered`, a prompt text whose client strings were neutralised with sentinel
  /// `sentinel` (UTF-8 of one code point) and `pieces` (marker index -> original bytes).
  std::vector<int32_t> encode_rendered(std::string_view rendered, const std::string& sentinel,
                                       const std::vector<std::string>& pieces) const;

  /// The control-token strings of the vocabulary with their ids (longest first per first byte).
  const std::vector<std::pair<std::string, int32_t>>& control_tokens() const { return all_; }

 private:
  // The longest control token starting at s[i]: (length, id), or length 0.
  std::pair<size_t, int32_t> match(std::string_view s, size_t i) const;
  // `v` with every string (and object key) neutralised; markers appended to `pieces`.
  nlohmann::ordered_json neutralise(const nlohmann::ordered_json& v, const std::string& sentinel,
                                    std::vector<std::string>& pieces) const;
  std::string neutralise_string(const std::string& s, const std::string& sentinel,
                                std::vector<std::string>& pieces) const;

  const tokenizer::Tokenizer* tok_;
  std::vector<std::pair<std::string, int32_t>> all_;
  std::unordered_set<std::string> prefixes_, suffixes_;  // proper prefixes / suffixes of all_
  size_t max_len_ = 0;
  std::vector<std::vector<std::pair<std::string, int32_t>>> by_first_;  // 256 lists, longest first
};

/// Tokens that end generation: EOS plus the end-of-turn control tokens a chat format uses
/// (<|im_end|>, <|endoftext|>, <|eot_id|>, <|end|>, <end_of_turn>, <|eom_id|>) that exist in
/// the vocabulary as control tokens; for a harmony vocabulary (gpt-oss: <|channel|>,
/// <|return|> and <|call|> are control tokens) <|return|> and <|call|> instead of <|end|>,
/// which there ends a message inside the turn. Sorted, unique.
std::vector<int32_t> end_of_generation_tokens(const tokenizer::Tokenizer& tok);

}  // namespace strata::chat
