// Tool-call markup of model output to OpenAI tool calls (see tool_calls.h).
#include "server/tool_calls.h"

#include <nlohmann/json.hpp>
#include <optional>

namespace strata::server::tools {

namespace {

using OJ = nlohmann::ordered_json;

// DeepSeek's markers (fullwidth bars, U+2581 for the spaces).
constexpr std::string_view kDsCallsBegin =
    "<\xEF\xBD\x9Ctool\xE2\x96\x81\x63\x61lls\xE2\x96\x81\x62\x65gin\xEF\xBD\x9C>";
constexpr std::string_view kDsCallsEnd = "<\xEF\xBD\x9Ctool\xE2\x96\x81\x63\x61lls\xE2\x96\x81\x65nd\xEF\xBD\x9C>";
constexpr std::string_view kDsCallBegin = "<\xEF\xBD\x9Ctool\xE2\x96\x81\x63\x61ll\xE2\x96\x81\x62\x65gin\xEF\xBD\x9C>";
constexpr std::string_view kDsCallEnd = "<\xEF\xBD\x9Ctool\xE2\x96\x81\x63\x61ll\xE2\x96\x81\x65nd\xEF\xBD\x9C>";
constexpr std::string_view kDsSep = "<\xEF\xBD\x9Ctool\xE2\x96\x81sep\xEF\xBD\x9C>";

constexpr std::string_view kToolCall = "<tool_call>";
constexpr std::string_view kToolCallEnd = "</tool_call>";

std::string_view trim(std::string_view s) {
  const auto ws = " \t\r\n";
  const size_t a = s.find_first_not_of(ws);
  if (a == std::string_view::npos) return {};
  const size_t b = s.find_last_not_of(ws);
  return s.substr(a, b - a + 1);
}

bool is_space_only(std::string_view s) { return trim(s).empty(); }

// `text` when it is a JSON object (kept as the model wrote it, trimmed), else nullopt.
std::optional<std::string> json_object_text(std::string_view text) {
  text = trim(text);
  const OJ j = OJ::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  return std::string(text);
}

// A parameter value of the XML-like forms: JSON when it parses as JSON, else the string.
OJ loose_value(std::string_view v) {
  const OJ j = OJ::parse(v, nullptr, false);
  if (!j.is_discarded()) return j;
  return std::string(v);
}

bool valid_name(std::string_view n) {
  if (n.empty()) return false;
  for (char c : n)
    if (c == ' ' || c == '\n' || c == '\t' || c == '\r' || c == '<' || c == '>' || c == '"') return false;
  return true;
}

// `{"name": N, "arguments": {...}}` (or "parameters"; arguments may be a JSON string of an object).
std::optional<ToolCall> parse_json_call(std::string_view body) {
  const OJ j = OJ::parse(trim(body), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  auto n = j.find("name");
  if (n == j.end() || !n->is_string() || !valid_name(n->get<std::string>())) return std::nullopt;
  auto a = j.find("arguments");
  if (a == j.end()) a = j.find("parameters");
  if (a == j.end()) return ToolCall{n->get<std::string>(), "{}"};
  if (a->is_object()) return ToolCall{n->get<std::string>(), a->dump()};
  if (a->is_string()) {
    if (auto t = json_object_text(a->get<std::string>())) return ToolCall{n->get<std::string>(), *t};
  }
  return std::nullopt;
}

// Strips one leading and one trailing newline (the XML forms put values on their own lines).
std::string_view strip_newlines(std::string_view v) {
  if (!v.empty() && v.front() == '\n') v.remove_prefix(1);
  if (!v.empty() && v.back() == '\n') v.remove_suffix(1);
  return v;
}

// `<function=N>\n<parameter=K>\nV\n</parameter>...</function>` (Qwen3.5, Qwen3-Coder).
std::optional<ToolCall> parse_xml_call(std::string_view body) {
  body = trim(body);
  constexpr std::string_view fo = "<function=", fc = "</function>", po = "<parameter=", pc = "</parameter>";
  if (body.substr(0, fo.size()) != fo) return std::nullopt;
  const size_t gt = body.find('>');
  if (gt == std::string_view::npos) return std::nullopt;
  ToolCall c{std::string(body.substr(fo.size(), gt - fo.size())), {}};
  if (!valid_name(c.name)) return std::nullopt;
  std::string_view rest = body.substr(gt + 1);
  OJ args = OJ::object();
  for (;;) {
    rest = trim(rest);
    if (rest == fc) break;
    if (rest.substr(0, po.size()) != po) return std::nullopt;
    const size_t kg = rest.find('>');
    const size_t end = rest.find(pc);
    if (kg == std::string_view::npos || end == std::string_view::npos || end < kg) return std::nullopt;
    const std::string key(rest.substr(po.size(), kg - po.size()));
    if (key.empty()) return std::nullopt;
    args[key] = loose_value(strip_newlines(rest.substr(kg + 1, end - kg - 1)));
    rest = rest.substr(end + pc.size());
  }
  c.arguments = args.dump();
  return c;
}

// `N\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>...` (GLM-4.5/4.6).
std::optional<ToolCall> parse_glm_call(std::string_view body) {
  body = trim(body);
  constexpr std::string_view ko = "<arg_key>", kc = "</arg_key>", vo = "<arg_value>", vc = "</arg_value>";
  const size_t first = body.find(ko);
  ToolCall c{std::string(trim(body.substr(0, first))), {}};
  if (!valid_name(c.name)) return std::nullopt;
  OJ args = OJ::object();
  std::string_view rest = first == std::string_view::npos ? std::string_view{} : body.substr(first);
  while (!(rest = trim(rest)).empty()) {
    if (rest.substr(0, ko.size()) != ko) return std::nullopt;
    const size_t ke = rest.find(kc);
    if (ke == std::string_view::npos) return std::nullopt;
    const std::string key(rest.substr(ko.size(), ke - ko.size()));
    rest = trim(rest.substr(ke + kc.size()));
    if (rest.substr(0, vo.size()) != vo) return std::nullopt;
    const size_t ve = rest.find(vc);
    if (ve == std::string_view::npos || key.empty()) return std::nullopt;
    args[key] = loose_value(rest.substr(vo.size(), ve - vo.size()));
    rest = rest.substr(ve + vc.size());
  }
  c.arguments = args.dump();
  return c;
}

// What a block of text that starts with an opener is. Markup: a harmony message header or
// <|end|>, dropped; `channel` says where the text after it goes.
struct Block {
  enum Kind { Incomplete, Calls, Text, Markup } kind = Incomplete;
  size_t len = 0;  // bytes of the buffer it covers (Calls, Text, Markup)
  std::vector<ToolCall> calls;
  bool reasoning = false;  // Markup: the text after it is reasoning (harmony's analysis channel)
};

Block calls_or_text(std::optional<ToolCall> c, size_t len) {
  Block b;
  b.len = len;
  if (c) {
    b.kind = Block::Calls;
    b.calls.push_back(std::move(*c));
  } else {
    b.kind = Block::Text;
  }
  return b;
}

// <tool_call>...</tool_call> with a JSON, XML-function or GLM body.
Block tag_block(std::string_view s, bool at_end, bool glm) {
  const size_t close = s.find(kToolCallEnd, kToolCall.size());
  if (close == std::string_view::npos && !at_end) return {};
  const size_t body_end = close == std::string_view::npos ? s.size() : close;
  const size_t len = close == std::string_view::npos ? s.size() : close + kToolCallEnd.size();
  const std::string_view body = s.substr(kToolCall.size(), body_end - kToolCall.size());
  std::optional<ToolCall> c;
  const std::string_view t = trim(body);
  if (!t.empty() && t.front() == '{')
    c = parse_json_call(t);
  else if (t.substr(0, 10) == "<function=")
    c = parse_xml_call(t);
  else if (glm)
    c = parse_glm_call(t);
  return calls_or_text(std::move(c), len);
}

// One DeepSeek call body (between <｜tool▁call▁begin｜> and <｜tool▁call▁end｜>).
std::optional<ToolCall> parse_deepseek_call(std::string_view body) {
  const size_t sep = body.find(kDsSep);
  if (sep == std::string_view::npos) return std::nullopt;
  const std::string_view a = trim(body.substr(0, sep));
  std::string_view b = body.substr(sep + kDsSep.size());
  const size_t fence = b.find("```json");
  if (a == "function" && fence != std::string_view::npos) {  // V3 / R1
    const std::string_view name = trim(b.substr(0, fence));
    std::string_view args = b.substr(fence + 7);
    const size_t close = args.rfind("```");
    if (close == std::string_view::npos || !valid_name(name)) return std::nullopt;
    auto t = json_object_text(args.substr(0, close));
    if (!t) return std::nullopt;
    return ToolCall{std::string(name), *t};
  }
  if (!valid_name(a)) return std::nullopt;  // V3.1 / V3.2
  auto t = json_object_text(b);
  if (!t) return std::nullopt;
  return ToolCall{std::string(a), *t};
}

Block deepseek_block(std::string_view s, bool at_end) {
  Block out;
  if (s.substr(0, kDsCallBegin.size()) == kDsCallBegin) {  // a call without the outer markers
    const size_t end = s.find(kDsCallEnd);
    if (end == std::string_view::npos && !at_end) return {};
    const size_t body_end = end == std::string_view::npos ? s.size() : end;
    return calls_or_text(parse_deepseek_call(s.substr(kDsCallBegin.size(), body_end - kDsCallBegin.size())),
                         end == std::string_view::npos ? s.size() : end + kDsCallEnd.size());
  }
  const size_t end = s.find(kDsCallsEnd);
  if (end == std::string_view::npos && !at_end) return {};
  out.len = end == std::string_view::npos ? s.size() : end + kDsCallsEnd.size();
  std::string_view rest =
      s.substr(kDsCallsBegin.size(), (end == std::string_view::npos ? s.size() : end) - kDsCallsBegin.size());
  out.kind = Block::Calls;
  while (!(rest = trim(rest)).empty()) {
    const size_t ce = rest.find(kDsCallEnd);
    std::optional<ToolCall> c;
    if (rest.substr(0, kDsCallBegin.size()) == kDsCallBegin)
      c = parse_deepseek_call(
          rest.substr(kDsCallBegin.size(), (ce == std::string_view::npos ? rest.size() : ce) - kDsCallBegin.size()));
    if (!c) {
      out.kind = Block::Text;
      out.calls.clear();
      return out;
    }
    out.calls.push_back(std::move(*c));
    rest = ce == std::string_view::npos ? std::string_view{} : rest.substr(ce + kDsCallEnd.size());
  }
  if (out.calls.empty()) out.kind = Block::Text;
  return out;
}

// A harmony message from <|channel|> or <|start|> (or its <|end|>). A header naming
// to=functions.NAME starts a call (when `calls`); `<|channel|>C<|message|>` and
// `<|start|>assistant<|channel|>C<|message|>` with C analysis, commentary or final are markup
// (analysis: the text after it is reasoning); any other header is text, byte for byte.
Block harmony_block(std::string_view s, bool at_end, bool calls) {
  constexpr std::string_view msg = "<|message|>", call = "<|call|>", to = "to=functions.", end = "<|end|>",
                             start = "<|start|>", chan = "<|channel|>";
  if (s.substr(0, end.size()) == end) {
    Block b;
    b.kind = Block::Markup;
    b.len = end.size();
    return b;
  }
  const size_t m = s.find(msg);
  if (m == std::string_view::npos) {
    if (!at_end) return {};
    return calls_or_text(std::nullopt, s.size());
  }
  const std::string_view header = s.substr(0, m);
  const size_t r = header.find(to);
  if (r == std::string_view::npos) {
    // A non-call message: its channel decides where its text goes.
    std::string_view h = header;
    if (h.substr(0, start.size()) == start) {
      h.remove_prefix(start.size());
      if (h.substr(0, 9) != "assistant") return calls_or_text(std::nullopt, m + msg.size());
      h.remove_prefix(9);
    }
    if (h.substr(0, chan.size()) != chan) return calls_or_text(std::nullopt, m + msg.size());
    const std::string_view c = h.substr(chan.size());
    if (c != "analysis" && c != "commentary" && c != "final") return calls_or_text(std::nullopt, m + msg.size());
    Block b;
    b.kind = Block::Markup;
    b.len = m + msg.size();
    b.reasoning = c == "analysis";
    return b;
  }
  if (!calls) return calls_or_text(std::nullopt, m + msg.size());
  size_t ne = r + to.size();
  while (ne < header.size() && header[ne] != ' ' && header[ne] != '<' && header[ne] != '\n') ++ne;
  const std::string_view name = header.substr(r + to.size(), ne - r - to.size());
  const size_t c = s.find(call, m + msg.size());
  if (c == std::string_view::npos && !at_end) return {};
  const size_t args_end = c == std::string_view::npos ? s.size() : c;
  std::optional<ToolCall> tc;
  if (valid_name(name))
    if (auto t = json_object_text(s.substr(m + msg.size(), args_end - m - msg.size())))
      tc = ToolCall{std::string(name), *t};
  return calls_or_text(std::move(tc), c == std::string_view::npos ? s.size() : c + call.size());
}

// How far `s` is a valid prefix of one JSON object: the length of the longest prefix that
// is (0 when `s` does not start with '{'), and whether the object is closed there. Checks
// the structure, strings, escapes and literals; numbers loosely (the final parse decides).
struct JsonPrefix {
  size_t valid = 0;
  bool complete = false;
};
JsonPrefix json_object_prefix(std::string_view s) {
  enum Expect { Value, KeyOrEnd, Key, Colon, CommaOrEnd, ValueOrEnd };
  std::string stack;  // '{' or '['
  Expect ex = Value;
  JsonPrefix r;
  if (s.empty() || s[0] != '{') return r;
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      ++i;
      continue;
    }
    auto close_value = [&] { ex = CommaOrEnd; };
    if (ex == Value || ex == ValueOrEnd) {
      if (ex == ValueOrEnd && c == ']') {
        stack.pop_back();
        ++i;
        close_value();
      } else if (c == '{' || c == '[') {
        if (stack.empty() && i != 0) return r;
        stack.push_back(c);
        ex = c == '{' ? KeyOrEnd : ValueOrEnd;
        ++i;
      } else if (c == '"' || c == '-' || (c >= '0' && c <= '9') || c == 't' || c == 'f' || c == 'n') {
        size_t j = i;
        if (c == '"') {
          for (++j; j < s.size() && s[j] != '"'; ++j) {
            if (static_cast<unsigned char>(s[j]) < 0x20) return r;
            if (s[j] == '\\') {
              if (++j >= s.size()) break;
              if (std::string_view("\"\\/bfnrtu").find(s[j]) == std::string_view::npos) return r;
            }
          }
          if (j >= s.size()) return {i + (s.size() - i), false};  // an open string
          ++j;
        } else if (c == 't' || c == 'f' || c == 'n') {
          const std::string_view word = c == 't' ? "true" : c == 'f' ? "false" : "null";
          while (j < s.size() && j - i < word.size() && s[j] == word[j - i]) ++j;
          if (j < s.size() && j - i < word.size()) return r;  // a wrong letter
          if (j - i < word.size()) return {s.size(), false};
        } else {
          while (j < s.size() && std::string_view("0123456789+-.eE").find(s[j]) != std::string_view::npos) ++j;
          if (j >= s.size()) return {s.size(), false};
        }
        i = j;
        close_value();
      } else {
        return r;
      }
    } else if (ex == KeyOrEnd || ex == Key) {
      if (ex == KeyOrEnd && c == '}') {
        stack.pop_back();
        ++i;
        close_value();
      } else if (c == '"') {
        ex = Value;  // the key is a string value; then a colon
        size_t j = i + 1;
        for (; j < s.size() && s[j] != '"'; ++j) {
          if (static_cast<unsigned char>(s[j]) < 0x20) return r;
          if (s[j] == '\\') {
            if (++j >= s.size()) break;
            if (std::string_view("\"\\/bfnrtu").find(s[j]) == std::string_view::npos) return r;
          }
        }
        if (j >= s.size()) return {s.size(), false};
        i = j + 1;
        ex = Colon;
      } else {
        return r;
      }
    } else if (ex == Colon) {
      if (c != ':') return r;
      ++i;
      ex = Value;
    } else {                        // CommaOrEnd
      if (stack.empty()) return r;  // text after the object
      const char top = stack.back();
      if (c == ',') {
        ex = top == '{' ? Key : Value;
        ++i;
      } else if ((c == '}' && top == '{') || (c == ']' && top == '[')) {
        stack.pop_back();
        ++i;
      } else {
        return r;
      }
    }
    r.valid = i;
    r.complete = stack.empty() && ex == CommaOrEnd;
    if (r.complete) return r;
  }
  r.valid = s.size();
  return r;
}

// The arguments of an open harmony call decided so far (see StreamParser), or nullopt when
// `s` is not (yet) such a call: `name` set from the header.
std::optional<std::string_view> harmony_open_args(std::string_view s, std::string& name) {
  constexpr std::string_view msg = "<|message|>", call = "<|call|>", to = "to=functions.";
  const size_t m = s.find(msg);
  if (m == std::string_view::npos) return std::nullopt;
  const std::string_view header = s.substr(0, m);
  const size_t r = header.find(to);
  if (r == std::string_view::npos) return std::nullopt;
  size_t ne = r + to.size();
  while (ne < header.size() && header[ne] != ' ' && header[ne] != '<' && header[ne] != '\n') ++ne;
  name = std::string(header.substr(r + to.size(), ne - r - to.size()));
  if (!valid_name(name)) return std::nullopt;
  std::string_view a = s.substr(m + msg.size());
  // Hold back a tail that may begin <|call|>.
  for (size_t k = std::min(call.size() - 1, a.size()); k > 0; --k)
    if (a.substr(a.size() - k) == call.substr(0, k)) {
      a.remove_suffix(k);
      break;
    }
  const size_t b = a.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return std::nullopt;
  a.remove_prefix(b);
  const JsonPrefix j = json_object_prefix(a);
  a = a.substr(0, j.valid);
  while (!a.empty() && std::string_view(" \t\r\n").find(a.back()) != std::string_view::npos) a.remove_suffix(1);
  if (a.empty()) return std::nullopt;
  return a;
}

std::vector<std::string_view> openers(Format f) {
  switch (f) {
    case Format::Hermes:
    case Format::Glm: return {kToolCall};
    case Format::DeepSeek: return {kDsCallsBegin, kDsCallBegin};
    case Format::Harmony: return {"<|channel|>", "<|start|>", "<|end|>"};
    case Format::None: break;
  }
  return {};
}

Block parse_block(Format f, std::string_view s, bool at_end, bool calls) {
  switch (f) {
    case Format::Hermes: return tag_block(s, at_end, false);
    case Format::Glm: return tag_block(s, at_end, true);
    case Format::DeepSeek: return deepseek_block(s, at_end);
    case Format::Harmony: return harmony_block(s, at_end, calls);
    case Format::None: break;
  }
  return calls_or_text(std::nullopt, s.size());
}

}  // namespace

Format detect_format(std::string_view src) {
  if (src.find(kDsCallsBegin) != std::string_view::npos || src.find(kDsCallBegin) != std::string_view::npos)
    return Format::DeepSeek;
  if (src.find("<arg_key>") != std::string_view::npos) return Format::Glm;
  if (src.find("<|channel|>") != std::string_view::npos && src.find("to=functions") != std::string_view::npos)
    return Format::Harmony;
  if (src.find(kToolCall) != std::string_view::npos) return Format::Hermes;
  return Format::None;
}

const char* format_name(Format f) {
  switch (f) {
    case Format::Hermes: return "hermes";
    case Format::Harmony: return "harmony";
    case Format::DeepSeek: return "deepseek";
    case Format::Glm: return "glm";
    case Format::None: break;
  }
  return "none";
}

void StreamParser::emit_text(std::string_view s, Delta& out) {
  if (s.empty()) return;
  if (reasoning_) {
    out.reasoning += s;
    return;
  }
  // Trailing whitespace waits: it is dropped when a call follows, whatever the split.
  if (is_space_only(s)) {
    pending_ws_ += s;
    return;
  }
  const size_t last = s.find_last_not_of(" \t\r\n");
  out.content += pending_ws_;
  out.content += s.substr(0, last + 1);
  pending_ws_ = std::string(s.substr(last + 1));
}

void StreamParser::run(bool at_end, Delta& out) {
  const auto ops = openers(format_);
  for (;;) {
    if (!in_block_) {
      size_t pos = std::string::npos;
      for (auto op : ops) pos = std::min(pos, buf_.find(op));
      if (pos != std::string::npos) {
        emit_text(std::string_view(buf_).substr(0, pos), out);
        buf_.erase(0, pos);
        in_block_ = true;
        continue;
      }
      // Hold back a tail that may be the start of an opener.
      size_t keep = 0;
      if (!at_end)
        for (auto op : ops)
          for (size_t k = std::min(op.size() - 1, buf_.size()); k > keep; --k)
            if (std::string_view(buf_).substr(buf_.size() - k) == op.substr(0, k)) {
              keep = k;
              break;
            }
      emit_text(std::string_view(buf_).substr(0, buf_.size() - keep), out);
      buf_.erase(0, buf_.size() - keep);
      if (at_end && !buf_.empty()) continue;
      return;
    }
    Block b = parse_block(format_, buf_, at_end, calls_);
    if (b.kind == Block::Incomplete) {
      if (incremental_ && calls_ && format_ == Format::Harmony) stream_open_call(out);
      return;
    }
    if (b.len == 0) b.len = buf_.size();  // never stall
    // An open call must end as the arguments it sent began (always so: they are a prefix).
    if (b.kind == Block::Calls && open_ &&
        (b.calls.size() != 1 || b.calls[0].arguments.compare(0, sent_.size(), sent_) != 0))
      b.kind = Block::Text;
    if (b.kind == Block::Calls) {
      pending_ws_.clear();
      reasoning_ = false;
      n_calls_ += b.calls.size();
      for (auto& c : b.calls) emit_call(std::move(c), out);
    } else if (b.kind == Block::Markup) {
      reasoning_ = b.reasoning;
    } else {
      if (open_) ++next_index_;  // an opened call that did not parse keeps its index
      emit_text(std::string_view(buf_).substr(0, b.len), out);
    }
    open_ = false;
    sent_.clear();
    buf_.erase(0, b.len);
    in_block_ = false;
    if (buf_.empty()) return;
  }
}

void StreamParser::emit_call(ToolCall c, Delta& out) {
  if (!incremental_) {
    out.calls.push_back(std::move(c));
    return;
  }
  CallPiece p;
  p.index = next_index_++;
  if (open_) {
    p.arguments = c.arguments.substr(sent_.size());  // the rest of an open call
  } else {
    p.first = true;
    p.name = std::move(c.name);
    p.arguments = std::move(c.arguments);
  }
  open_ = false;
  out.pieces.push_back(std::move(p));
}

void StreamParser::stream_open_call(Delta& out) {
  std::string name;
  const auto args = harmony_open_args(buf_, name);
  if (!args || args->size() <= sent_.size() || args->compare(0, sent_.size(), sent_) != 0) return;
  CallPiece p;
  p.index = next_index_;
  if (!open_) {
    p.first = true;
    p.name = std::move(name);
    open_ = true;
  }
  p.arguments = std::string(args->substr(sent_.size()));
  sent_ = std::string(*args);
  out.pieces.push_back(std::move(p));
}

Delta StreamParser::push(std::string_view text) {
  Delta out;
  buf_ += text;
  if (format_ == Format::None) {
    out.content = std::move(buf_);
    buf_.clear();
    return out;
  }
  run(false, out);
  return out;
}

Delta StreamParser::finish() {
  Delta out;
  if (format_ != Format::None) run(true, out);
  if (n_calls_ == 0) out.content += pending_ws_;
  pending_ws_.clear();
  return out;
}

Delta parse(Format f, std::string_view text, bool calls) {
  StreamParser p(f, calls);
  Delta d = p.push(text);
  Delta e = p.finish();
  d.content += e.content;
  d.reasoning += e.reasoning;
  for (auto& c : e.calls) d.calls.push_back(std::move(c));
  return d;
}

}  // namespace strata::server::tools
