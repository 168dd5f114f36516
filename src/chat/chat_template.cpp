#include "chat/chat_template.h"

#include <fmt/format.h>

#include <algorithm>
#include <unordered_set>

#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

namespace strata::chat {

const char* const kChatMLTemplate =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

namespace {

// `source` itself, after checking that it is a template at all: not empty, text.
const std::string& checked_source(const std::string& source) {
  if (source.find_first_not_of(" \t\r\n") == std::string::npos) throw TemplateError("the chat template is empty");
  if (auto at = tokenizer::find_invalid_utf8(source))
    throw TemplateError(fmt::format("the chat template is not text: invalid UTF-8 at byte {}", *at));
  if (auto at = source.find('\0'); at != std::string::npos)
    throw TemplateError(fmt::format("the chat template is not text: a NUL byte at byte {}", at));
  return source;
}

}  // namespace

ChatTemplate::ChatTemplate(std::string source, std::string bos_token, std::string eos_token)
    : source_(std::move(source)),
      bos_(std::move(bos_token)),
      eos_(std::move(eos_token)),
      tmpl_(checked_source(source_)) {
  using J = nlohmann::ordered_json;
  const J with_system = J::array({{{"role", "system"}, {"content", "You are a helpful assistant."}},
                                  {{"role", "user"}, {"content", "Hello"}},
                                  {{"role", "assistant"}, {"content", "Hi there"}},
                                  {{"role", "user"}, {"content", "How are you?"}}});
  const J without_system = J(with_system.begin() + 1, with_system.end());
  const J tools = J::parse(R"([{"type": "function", "function": {"name": "get_time", "description": "The time",
      "parameters": {"type": "object", "properties": {}}}}])");
  // The sample conversations, as real clients send them: plain, without a system message, with
  // tools (templates that iterate `tools` unguarded: functionary v3.1), and with tools plus the
  // `functions` text and `datetime` that llama.cpp's server gives firefunction-v2's template.
  // The first that renders is kept; the template fails to load only if none does.
  struct Sample {
    J messages, extra;
  };
  const std::vector<Sample> samples = {
      {with_system, J::object()},
      {without_system, J::object()},
      {without_system, J{{"tools", tools}}},
      {without_system, J{{"tools", tools}, {"functions", tools.dump(2)}, {"datetime", "Jan 01 2026 00:00:00 GMT"}}},
  };
  // Renders the sample, and again with its last message changed: a template whose output does
  // not change ignores the messages (not a chat template: a text file, a truncated one).
  std::string out, first_error;
  const Sample* used = nullptr;
  for (const Sample& smp : samples) {
    try {
      out = apply(smp.messages, true, smp.extra);
      used = &smp;
      break;
    } catch (const RenderError& e) {
      if (first_error.empty()) first_error = e.what();
    }
  }
  if (!used) throw TemplateError(fmt::format("chat template fails on a sample conversation: {}", first_error));
  J changed_messages = used->messages;
  changed_messages.back()["content"] = "Goodbye";
  std::string changed;
  try {
    changed = apply(changed_messages, true, used->extra);
  } catch (const RenderError&) {}
  if (out == changed)
    throw TemplateError(
        "the chat template does not render the messages (its output does not change with a message's content)");
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

// ---- PromptEncoder

namespace {

using OJ = nlohmann::ordered_json;

std::string utf8_of(uint32_t cp) {
  std::string s;
  s += char(0xF0 | (cp >> 18));
  s += char(0x80 | ((cp >> 12) & 0x3F));
  s += char(0x80 | ((cp >> 6) & 0x3F));
  s += char(0x80 | (cp & 0x3F));
  return s;
}

// Every proper prefix (prefixes = true) or proper suffix of the strings of `toks`.
std::unordered_set<std::string> partials(const std::vector<std::pair<std::string, int32_t>>& toks, bool prefixes) {
  std::unordered_set<std::string> out;
  for (auto& [t, id] : toks)
    for (size_t k = 1; k < t.size(); ++k) out.insert(prefixes ? t.substr(0, k) : t.substr(t.size() - k));
  return out;
}

}  // namespace

PromptEncoder::PromptEncoder(const tokenizer::Tokenizer& tok) : tok_(&tok), by_first_(256) {
  for (int32_t id = 0; id < tok.n_vocab(); ++id)
    if (tok.is_control(id) && !tok.token_bytes(id).empty()) all_.emplace_back(tok.token_bytes(id), id);
  std::stable_sort(all_.begin(), all_.end(), [](auto& a, auto& b) { return a.first.size() > b.first.size(); });
  for (auto& e : all_) by_first_[static_cast<unsigned char>(e.first[0])].push_back(e);
  prefixes_ = partials(all_, true);
  suffixes_ = partials(all_, false);
  max_len_ = all_.empty() ? 0 : all_.front().first.size();
}

std::pair<size_t, int32_t> PromptEncoder::match(std::string_view s, size_t i) const {
  for (auto& [t, id] : by_first_[static_cast<unsigned char>(s[i])])
    if (s.compare(i, t.size(), t) == 0) return {t.size(), id};
  return {0, -1};
}

std::string PromptEncoder::neutralise_string(const std::string& s, const std::string& sentinel,
                                             std::vector<std::string>& pieces) const {
  const size_t n = s.size();
  if (n == 0 || all_.empty()) return s;
  std::vector<bool> mark(n, false);
  // Whole control-token strings anywhere.
  for (size_t i = 0; i < n;) {
    const auto [len, id] = match(s, i);
    if (len) {
      std::fill(mark.begin() + long(i), mark.begin() + long(i + len), true);
      i += len;
    } else {
      ++i;
    }
  }
  // A leading proper suffix and a trailing proper prefix of a control token: the template's
  // markup next to this string could complete them.
  for (size_t len = std::min(n, max_len_ - 1); len > 0; --len)
    if (suffixes_.count(s.substr(0, len))) {
      std::fill(mark.begin(), mark.begin() + long(len), true);
      break;
    }
  for (size_t len = std::min(n, max_len_ - 1); len > 0; --len)
    if (prefixes_.count(s.substr(n - len))) {
      std::fill(mark.end() - long(len), mark.end(), true);
      break;
    }
  if (std::find(mark.begin(), mark.end(), true) == mark.end()) return s;
  std::string out;
  for (size_t i = 0; i < n;) {
    if (!mark[i]) {
      out += s[i++];
      continue;
    }
    size_t j = i;
    while (j < n && mark[j]) ++j;
    out += sentinel + std::to_string(pieces.size()) + sentinel;
    pieces.push_back(s.substr(i, j - i));
    i = j;
  }
  return out;
}

OJ PromptEncoder::neutralise(const OJ& v, const std::string& sentinel, std::vector<std::string>& pieces) const {
  if (v.is_string()) return neutralise_string(v.get<std::string>(), sentinel, pieces);
  if (v.is_array()) {
    OJ out = OJ::array();
    for (auto& e : v) out.push_back(neutralise(e, sentinel, pieces));
    return out;
  }
  if (v.is_object()) {
    OJ out = OJ::object();
    for (auto it = v.begin(); it != v.end(); ++it)
      out[neutralise_string(it.key(), sentinel, pieces)] = neutralise(it.value(), sentinel, pieces);
    return out;
  }
  return v;
}

std::vector<int32_t> PromptEncoder::encode_rendered(std::string_view r, const std::string& sentinel,
                                                    const std::vector<std::string>& pieces) const {
  std::vector<int32_t> ids;
  std::string plain;
  auto flush = [&] {
    if (plain.empty()) return;
    auto more = tok_->encode(plain, false);
    ids.insert(ids.end(), more.begin(), more.end());
    plain.clear();
  };
  const size_t n = r.size(), sl = sentinel.size();
  for (size_t i = 0; i < n;) {
    if (sl && r.compare(i, sl, sentinel) == 0) {
      size_t j = i + sl;
      while (j < n && r[j] >= '0' && r[j] <= '9' && j - i - sl < 12) ++j;
      if (j > i + sl && r.compare(j, sl, sentinel) == 0) {
        const size_t idx = std::stoul(std::string(r.substr(i + sl, j - i - sl)));
        if (idx < pieces.size()) {
          plain += pieces[idx];
          i = j + sl;
          continue;
        }
      }
      i += sl;  // a sentinel the template cut off its marker: dropped
      continue;
    }
    if (const auto [len, id] = match(r, i); len) {
      flush();
      ids.push_back(id);
      i += len;
      continue;
    }
    plain += r[i++];
  }
  flush();
  return ids;
}

std::vector<int32_t> PromptEncoder::encode_chat(const ChatTemplate& t, const OJ& messages, bool add_generation_prompt,
                                                const OJ& extra) const {
  // A sentinel that occurs nowhere in the request nor in the template.
  const std::string all = messages.dump(-1, ' ', false, OJ::error_handler_t::replace) +
                          extra.dump(-1, ' ', false, OJ::error_handler_t::replace) + t.source();
  std::string sentinel;
  for (uint32_t cp = 0xF0000; cp <= 0x10FFFD && sentinel.empty(); ++cp)
    if (all.find(utf8_of(cp)) == std::string::npos) sentinel = utf8_of(cp);
  if (sentinel.empty()) throw RenderError("the request uses every private-use code point; cannot mark its text");
  std::vector<std::string> pieces;
  const OJ m = neutralise(messages, sentinel, pieces);
  const OJ x = neutralise(extra, sentinel, pieces);
  return encode_rendered(t.apply(m, add_generation_prompt, x), sentinel, pieces);
}

std::vector<int32_t> end_of_generation_tokens(const tokenizer::Tokenizer& tok) {
  std::vector<int32_t> out;
  if (tok.eos_id() >= 0) out.push_back(tok.eos_id());
  auto control = [&](const char* t) {
    auto id = tok.find_token(t);
    return id && tok.is_control(*id) ? *id : -1;
  };
  // Harmony (gpt-oss): <|end|> closes a message inside the turn (analysis, then final);
  // the turn ends at <|return|> or at a tool call's <|call|>.
  const bool harmony = control("<|return|>") >= 0 && control("<|call|>") >= 0 && control("<|channel|>") >= 0;
  for (const char* t : {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>",
                        "<|return|>", "<|call|>"}) {
    if (harmony && std::string_view(t) == "<|end|>") continue;
    if (!harmony && (std::string_view(t) == "<|return|>" || std::string_view(t) == "<|call|>")) continue;
    if (const int32_t id = control(t); id >= 0) out.push_back(id);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace strata::chat
