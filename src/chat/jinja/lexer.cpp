// The Jinja lexer: template segments with jinja2's whitespace rules, and expression tokens.
#include "chat/jinja/lexer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include "chat/jinja/value.h"

namespace strata::chat::jinja {

namespace {

int line_of(std::string_view src, size_t pos) {
  return 1 + int(std::count(src.begin(), src.begin() + long(pos), '\n'));
}

// Position of `close` ("}}" or "%}") after `from`, skipping string literals; npos if none.
size_t find_tag_end(std::string_view src, size_t from, std::string_view close) {
  char quote = 0;
  for (size_t p = from; p < src.size(); ++p) {
    const char c = src[p];
    if (quote) {
      if (c == '\\')
        ++p;
      else if (c == quote)
        quote = 0;
    } else if (c == '\'' || c == '"') {
      quote = c;
    } else if (src.compare(p, close.size(), close) == 0) {
      return p;
    }
  }
  return std::string_view::npos;
}

}  // namespace

std::vector<Segment> lex(std::string_view raw, const TemplateOptions& opts) {
  std::string src;
  src.reserve(raw.size());
  for (size_t p = 0; p < raw.size(); ++p) {  // newline normalisation, as jinja2 does
    if (raw[p] == '\r' && p + 1 < raw.size() && raw[p + 1] == '\n') continue;
    src += raw[p];
  }
  if (!opts.keep_trailing_newline && !src.empty() && src.back() == '\n') src.pop_back();

  std::vector<Segment> out;
  size_t pos = 0;
  bool line_starting = true;
  while (pos <= src.size()) {
    size_t start = pos;
    for (;;) {
      start = src.find('{', start);
      if (start == std::string::npos || start + 1 >= src.size()) {
        start = std::string::npos;
        break;
      }
      const char n = src[start + 1];
      if (n == '{' || n == '%' || n == '#') break;
      ++start;
    }
    std::string text = src.substr(pos, start == std::string::npos ? std::string::npos : start - pos);
    if (start == std::string::npos) {
      if (!text.empty()) out.push_back({Segment::K::Text, text, line_of(src, pos)});
      break;
    }
    const char kind = src[start + 1];
    const char sign = start + 2 < src.size() ? src[start + 2] : 0;
    if (sign == '-') {
      text = strip_chars(text, Value{}, false, true);
    } else if (sign != '+' && opts.lstrip_blocks && kind != '{') {
      const size_t nl = text.rfind('\n');
      const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting) && l_pos < text.size() &&
          std::all_of(text.begin() + long(l_pos), text.end(), is_space))
        text.resize(l_pos);
    }
    if (!text.empty()) out.push_back({Segment::K::Text, text, line_of(src, pos)});
    const int line = line_of(src, start);
    size_t body_begin = start + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
    size_t end, after;
    if (kind == '#') {
      end = src.find("#}", body_begin);
      if (end == std::string::npos) throw TemplateError(fmt::format("line {}: unclosed comment", line));
      after = end + 2;
    } else {
      end = find_tag_end(src, body_begin, kind == '{' ? "}}" : "%}");
      if (end == std::string::npos) throw TemplateError(fmt::format("line {}: unclosed '{{{}' tag", line, kind));
      after = end + 2;
    }
    const char end_sign = end > body_begin ? src[end - 1] : 0;
    size_t body_end = end;
    if (kind != '#' && (end_sign == '-' || end_sign == '+') && end > body_begin) --body_end;
    if (kind != '#') {
      const Segment::K k = kind == '{' ? Segment::K::Expr : Segment::K::Stmt;
      out.push_back({k, src.substr(body_begin, body_end - body_begin), line});
    }
    pos = after;
    if (end_sign == '-') {
      while (pos < src.size() && is_space(src[pos])) ++pos;
    } else if (kind != '{' && end_sign != '+' && opts.trim_blocks && pos < src.size() && src[pos] == '\n') {
      ++pos;
    }
    line_starting = pos > 0 && src[pos - 1] == '\n';
    if (pos == src.size()) break;
  }
  return out;
}

std::vector<Tok> tokenize(const std::string& s, int line) {
  std::vector<Tok> out;
  size_t p = 0;
  static const char* ops3[] = {"**", "//", "==", "!=", "<=", ">="};
  while (p < s.size()) {
    const char c = s[p];
    if (is_space(c)) {
      ++p;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t e = p;
      while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      out.push_back({Tok::K::Name, s.substr(p, e - p)});
      p = e;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t e = p;
      bool is_float = false;
      while (e < s.size() && (std::isdigit(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      if (e + 1 < s.size() && s[e] == '.' && std::isdigit(static_cast<unsigned char>(s[e + 1]))) {
        is_float = true;
        ++e;
        while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) ++e;
      }
      if (e < s.size() && (s[e] == 'e' || s[e] == 'E')) {
        size_t q = e + 1;
        if (q < s.size() && (s[q] == '+' || s[q] == '-')) ++q;
        if (q < s.size() && std::isdigit(static_cast<unsigned char>(s[q]))) {
          is_float = true;
          e = q;
          while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) ++e;
        }
      }
      std::string num;
      for (size_t k = p; k < e; ++k)
        if (s[k] != '_') num += s[k];
      Tok t{is_float ? Tok::K::Float : Tok::K::Int, num};
      if (is_float)
        t.f = std::stod(num);
      else
        t.i = std::stoll(num);
      out.push_back(t);
      p = e;
    } else if (c == '\'' || c == '"') {
      std::string v;
      size_t e = p + 1;
      for (; e < s.size() && s[e] != c; ++e) {
        if (s[e] == '\\' && e + 1 < s.size()) {
          const char n = s[++e];
          switch (n) {
            case 'n': v += '\n'; break;
            case 't': v += '\t'; break;
            case 'r': v += '\r'; break;
            case '0': v += '\0'; break;
            case '\\': v += '\\'; break;
            case '\'': v += '\''; break;
            case '"': v += '"'; break;
            case '\n': break;
            case 'u': {
              if (e + 4 >= s.size()) throw TemplateError(fmt::format("line {}: bad \\u escape", line));
              const unsigned cp = unsigned(std::stoul(s.substr(e + 1, 4), nullptr, 16));
              e += 4;
              if (cp < 0x80) {
                v += char(cp);
              } else if (cp < 0x800) {
                v += char(0xC0 | (cp >> 6));
                v += char(0x80 | (cp & 0x3F));
              } else {
                v += char(0xE0 | (cp >> 12));
                v += char(0x80 | ((cp >> 6) & 0x3F));
                v += char(0x80 | (cp & 0x3F));
              }
              break;
            }
            default: v += '\\'; v += n;
          }
        } else {
          v += s[e];
        }
      }
      if (e >= s.size()) throw TemplateError(fmt::format("line {}: unterminated string literal", line));
      out.push_back({Tok::K::Str, v});
      p = e + 1;
    } else {
      bool two = false;
      for (const char* op : ops3)
        if (s.compare(p, 2, op) == 0) {
          out.push_back({Tok::K::Op, op});
          p += 2;
          two = true;
          break;
        }
      if (two) continue;
      if (std::string_view("+-*/%~|.,:()[]{}=<>").find(c) == std::string_view::npos)
        throw TemplateError(fmt::format("line {}: unexpected character '{}' in tag", line, c));
      out.push_back({Tok::K::Op, std::string(1, c)});
      ++p;
    }
  }
  out.push_back({Tok::K::End, ""});
  return out;
}

}  // namespace strata::chat::jinja
