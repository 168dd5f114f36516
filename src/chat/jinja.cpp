// The Jinja subset interpreter: lexer (with jinja2's whitespace rules), recursive-descent
// parser into an AST, and a tree-walking renderer over a small Python-like value model.
#include "chat/jinja.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <functional>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace strata::chat {

namespace {

// ============================================================ values (Python-like)

struct Value;
using Array = std::vector<Value>;
using Object = std::vector<std::pair<std::string, Value>>;  // insertion-ordered, like a Python dict
struct Args;
using Function = std::function<Value(Args&)>;

struct Value {
  enum class T { Undef, None, Bool, Int, Float, Str, Arr, Obj, Fn };
  T t = T::Undef;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<Array> a;
  std::shared_ptr<Object> o;
  std::shared_ptr<Function> fn;
  bool is_tuple = false;      // prints as (a, b)
  bool is_namespace = false;  // namespace(): attributes can be assigned

  static Value none() { Value v; v.t = T::None; return v; }
  static Value boolean(bool x) { Value v; v.t = T::Bool; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.t = T::Int; v.i = x; return v; }
  static Value number(double x) { Value v; v.t = T::Float; v.f = x; return v; }
  static Value str(std::string x) { Value v; v.t = T::Str; v.s = std::move(x); return v; }
  static Value array(Array x = {}) { Value v; v.t = T::Arr; v.a = std::make_shared<Array>(std::move(x)); return v; }
  static Value object(Object x = {}) { Value v; v.t = T::Obj; v.o = std::make_shared<Object>(std::move(x)); return v; }
  static Value function(Function fn) { Value v; v.t = T::Fn; v.fn = std::make_shared<Function>(std::move(fn)); return v; }

  bool undefined() const { return t == T::Undef; }
  bool numeric() const { return t == T::Int || t == T::Float || t == T::Bool; }
  double as_double() const { return t == T::Float ? f : t == T::Int ? double(i) : b ? 1.0 : 0.0; }
  int64_t as_int() const { return t == T::Int ? i : t == T::Bool ? int64_t(b) : int64_t(f); }
  const Value* get(std::string_view key) const {
    if (t != T::Obj) return nullptr;
    for (auto& [k, v] : *o)
      if (k == key) return &v;
    return nullptr;
  }
  void set(const std::string& key, Value v) {
    for (auto& [k, old] : *o)
      if (k == key) {
        old = std::move(v);
        return;
      }
    o->emplace_back(key, std::move(v));
  }
};

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  /// Argument `name` at position `idx` (or by keyword); `fallback` when absent.
  Value take(size_t idx, std::string_view name, Value fallback = {}) {
    for (auto& [k, v] : kw)
      if (k == name) return v;
    if (idx < pos.size()) return pos[idx];
    return fallback;
  }
};

const char* type_name(const Value& v) {
  switch (v.t) {
    case Value::T::Undef: return "undefined";
    case Value::T::None: return "NoneType";
    case Value::T::Bool: return "bool";
    case Value::T::Int: return "int";
    case Value::T::Float: return "float";
    case Value::T::Str: return "str";
    case Value::T::Arr: return v.is_tuple ? "tuple" : "list";
    case Value::T::Obj: return v.is_namespace ? "Namespace" : "dict";
    case Value::T::Fn: return "function";
  }
  return "?";
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: return Value::integer(int64_t(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::str(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      Array a;
      for (auto& e : j) a.push_back(from_json(e));
      return Value::array(std::move(a));
    }
    case nlohmann::ordered_json::value_t::object: {
      Object o;
      for (auto it = j.begin(); it != j.end(); ++it) o.emplace_back(it.key(), from_json(it.value()));
      return Value::object(std::move(o));
    }
    default: return Value::none();
  }
}

// ---- UTF-8 helpers: Python strings count code points

std::vector<std::string> code_points(const std::string& s) {
  std::vector<std::string> out;
  for (size_t p = 0; p < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[p]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    n = std::min(n, s.size() - p);
    out.push_back(s.substr(p, n));
    p += n;
  }
  return out;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string strip_chars(const std::string& s, const Value& chars, bool left, bool right) {
  auto in_set = [&](char c) {
    if (chars.t == Value::T::Str) return chars.s.find(c) != std::string::npos;
    return is_space(c);
  };
  size_t b = 0, e = s.size();
  if (left)
    while (b < e && in_set(s[b])) ++b;
  if (right)
    while (e > b && in_set(s[e - 1])) --e;
  return s.substr(b, e - b);
}

// ---- Python str() / repr()

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // [-]d.ddde[+-]XX
  const size_t epos = sci.find('e');
  int exp = std::stoi(sci.substr(epos + 1));
  std::string mant = sci.substr(0, epos);
  const bool neg = mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  std::string out;
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      if (int(digits.size()) <= exp + 1) {
        out = digits + std::string(size_t(exp + 1 - int(digits.size())), '0') + ".0";
      } else {
        out = digits.substr(0, size_t(exp + 1)) + "." + digits.substr(size_t(exp + 1));
      }
    } else {
      out = "0." + std::string(size_t(-exp - 1), '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
  }
  return neg ? "-" + out : out;
}

std::string str_repr(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == q || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
    } else {
      out += c;
    }
  }
  return out + q;
}

std::string repr(const Value& v);

std::string to_str(const Value& v) {
  switch (v.t) {
    case Value::T::Undef: return "";
    case Value::T::None: return "None";
    case Value::T::Bool: return v.b ? "True" : "False";
    case Value::T::Int: return std::to_string(v.i);
    case Value::T::Float: return float_repr(v.f);
    case Value::T::Str: return v.s;
    default: return repr(v);
  }
}

std::string repr(const Value& v) {
  switch (v.t) {
    case Value::T::Str: return str_repr(v.s);
    case Value::T::Arr: {
      std::string out = v.is_tuple ? "(" : "[";
      for (size_t k = 0; k < v.a->size(); ++k) out += (k ? ", " : "") + repr((*v.a)[k]);
      if (v.is_tuple && v.a->size() == 1) out += ",";
      return out + (v.is_tuple ? ")" : "]");
    }
    case Value::T::Obj: {
      std::string out = v.is_namespace ? "<Namespace {" : "{";
      bool first = true;
      for (auto& [k, e] : *v.o) {
        out += (first ? "" : ", ") + str_repr(k) + ": " + repr(e);
        first = false;
      }
      return out + (v.is_namespace ? "}>" : "}");
    }
    case Value::T::Fn: return "<function>";
    default: return to_str(v);
  }
}

bool truthy(const Value& v) {
  switch (v.t) {
    case Value::T::Undef:
    case Value::T::None: return false;
    case Value::T::Bool: return v.b;
    case Value::T::Int: return v.i != 0;
    case Value::T::Float: return v.f != 0;
    case Value::T::Str: return !v.s.empty();
    case Value::T::Arr: return !v.a->empty();
    case Value::T::Obj: return v.is_namespace || !v.o->empty();
    case Value::T::Fn: return true;
  }
  return false;
}

bool equal(const Value& x, const Value& y) {
  if (x.numeric() && y.numeric()) {
    if (x.t != Value::T::Float && y.t != Value::T::Float) return x.as_int() == y.as_int();
    return x.as_double() == y.as_double();
  }
  if (x.t != y.t) return false;
  switch (x.t) {
    case Value::T::Undef:
    case Value::T::None: return true;
    case Value::T::Str: return x.s == y.s;
    case Value::T::Arr:
      if (x.a->size() != y.a->size()) return false;
      for (size_t k = 0; k < x.a->size(); ++k)
        if (!equal((*x.a)[k], (*y.a)[k])) return false;
      return true;
    case Value::T::Obj:
      if (x.o->size() != y.o->size()) return false;
      for (auto& [k, e] : *x.o) {
        const Value* o = y.get(k);
        if (!o || !equal(e, *o)) return false;
      }
      return true;
    case Value::T::Fn: return x.fn == y.fn;
    default: return false;
  }
}

// ---- json.dumps(x, ensure_ascii=False[, indent=N][, sort_keys]) as transformers' tojson does

void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20)
          out += fmt::format("\\u{:04x}", static_cast<unsigned char>(c));
        else
          out += c;
    }
  }
  out += '"';
}

void to_json(std::string& out, const Value& v, int indent, bool sort_keys, int depth) {
  auto newline = [&](int d) {
    out += '\n';
    out.append(size_t(indent * d), ' ');
  };
  switch (v.t) {
    case Value::T::None: out += "null"; return;
    case Value::T::Bool: out += v.b ? "true" : "false"; return;
    case Value::T::Int: out += std::to_string(v.i); return;
    case Value::T::Float:
      out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity") : float_repr(v.f);
      return;
    case Value::T::Str: json_string(out, v.s); return;
    case Value::T::Arr: {
      if (v.a->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.a->size(); ++k) {
        if (k) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(depth + 1);
        to_json(out, (*v.a)[k], indent, sort_keys, depth + 1);
      }
      if (indent >= 0) newline(depth);
      out += ']';
      return;
    }
    case Value::T::Obj: {
      if (v.o->empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (auto& kv : *v.o) items.push_back(&kv);
      if (sort_keys) std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(depth + 1);
        json_string(out, items[k]->first);
        out += ": ";
        to_json(out, items[k]->second, indent, sort_keys, depth + 1);
      }
      if (indent >= 0) newline(depth);
      out += '}';
      return;
    }
    default: throw RenderError(fmt::format("Object of type {} is not JSON serializable", type_name(v)));
  }
}

// ============================================================ template lexer

struct Segment {
  enum class K { Text, Expr, Stmt } k;
  std::string body;
  int line;
};

int line_of(std::string_view src, size_t pos) { return 1 + int(std::count(src.begin(), src.begin() + long(pos), '\n')); }

// Position of `close` ("}}" or "%}") after `from`, skipping string literals; npos if none.
size_t find_tag_end(std::string_view src, size_t from, std::string_view close) {
  char quote = 0;
  for (size_t p = from; p < src.size(); ++p) {
    const char c = src[p];
    if (quote) {
      if (c == '\\') ++p;
      else if (c == quote) quote = 0;
    } else if (c == '\'' || c == '"') {
      quote = c;
    } else if (src.compare(p, close.size(), close) == 0) {
      return p;
    }
  }
  return std::string_view::npos;
}

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
      if (end == std::string::npos)
        throw TemplateError(fmt::format("line {}: unclosed '{{{}' tag", line, kind));
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

// ============================================================ expression tokens

struct Tok {
  enum class K { Name, Int, Float, Str, Op, End } k;
  std::string s;
  int64_t i = 0;
  double f = 0;
};

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
      if (is_float) t.f = std::stod(num);
      else t.i = std::stoll(num);
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

// ============================================================ AST

struct Scope {
  std::unordered_map<std::string, Value> vars;
  Scope* parent = nullptr;
  Value* find(const std::string& n) {
    for (Scope* s = this; s; s = s->parent) {
      auto it = s->vars.find(n);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};

struct Ctx {
  Scope* scope;
  Scope* globals;
  enum class Flow { Normal, Break, Continue } flow = Flow::Normal;
  int depth = 0;
};

struct Expr {
  int line = 0;
  virtual ~Expr() = default;
  virtual Value eval(Ctx& c) const = 0;
};
using ExprP = std::unique_ptr<Expr>;

[[noreturn]] void fail(int line, const std::string& msg) { throw RenderError(fmt::format("line {}: {}", line, msg)); }

struct Literal : Expr {
  Value v;
  Value eval(Ctx&) const override { return v; }
};

struct Name : Expr {
  std::string name;
  Value eval(Ctx& c) const override {
    if (Value* v = c.scope->find(name)) return *v;
    return {};
  }
};

struct ListLit : Expr {
  std::vector<ExprP> items;
  bool tuple = false;
  Value eval(Ctx& c) const override {
    Array a;
    for (auto& e : items) a.push_back(e->eval(c));
    Value v = Value::array(std::move(a));
    v.is_tuple = tuple;
    return v;
  }
};

struct DictLit : Expr {
  std::vector<std::pair<ExprP, ExprP>> items;
  Value eval(Ctx& c) const override {
    Value v = Value::object();
    for (auto& [k, e] : items) {
      Value key = k->eval(c);
      if (key.t != Value::T::Str) fail(line, "dict keys must be strings here");
      v.set(key.s, e->eval(c));
    }
    return v;
  }
};

int64_t norm_index(int64_t idx, size_t n) { return idx < 0 ? idx + int64_t(n) : idx; }

Value subscript(const Value& obj, const Value& key, int line) {
  if (obj.t == Value::T::Obj) {
    if (key.t != Value::T::Str) return {};
    const Value* v = obj.get(key.s);
    return v ? *v : Value{};
  }
  if (obj.t == Value::T::Arr || obj.t == Value::T::Str) {
    if (key.t != Value::T::Int && key.t != Value::T::Bool) {
      if (key.t == Value::T::Str) return {};  // e.g. message.content on a string: undefined
      fail(line, fmt::format("indices must be integers, not {}", type_name(key)));
    }
    if (obj.t == Value::T::Arr) {
      const int64_t k = norm_index(key.as_int(), obj.a->size());
      if (k < 0 || k >= int64_t(obj.a->size())) return {};
      return (*obj.a)[size_t(k)];
    }
    auto cps = code_points(obj.s);
    const int64_t k = norm_index(key.as_int(), cps.size());
    if (k < 0 || k >= int64_t(cps.size())) return {};
    return Value::str(cps[size_t(k)]);
  }
  if (obj.undefined()) fail(line, "cannot read an attribute or item of an undefined value");
  if (obj.t == Value::T::None) fail(line, "'None' has no attributes or items");
  return {};
}

struct Attr : Expr {
  ExprP obj;
  std::string name;
  Value eval(Ctx& c) const override { return subscript(obj->eval(c), Value::str(name), line); }
};

struct Index : Expr {
  ExprP obj, idx;
  Value eval(Ctx& c) const override { return subscript(obj->eval(c), idx->eval(c), line); }
};

struct Slice : Expr {
  ExprP obj, start, stop, step;
  Value eval(Ctx& c) const override {
    Value o = obj->eval(c);
    auto opt = [&](const ExprP& e) -> std::optional<int64_t> {
      if (!e) return std::nullopt;
      Value v = e->eval(c);
      if (v.t == Value::T::None) return std::nullopt;
      if (v.t != Value::T::Int) fail(line, "slice indices must be integers");
      return v.i;
    };
    std::optional<int64_t> a = opt(start), b = opt(stop), st = opt(step);
    const int64_t s = st.value_or(1);
    if (s == 0) fail(line, "slice step cannot be zero");
    std::vector<Value> items;
    std::vector<std::string> cps;
    int64_t n;
    if (o.t == Value::T::Arr) n = int64_t(o.a->size());
    else if (o.t == Value::T::Str) cps = code_points(o.s), n = int64_t(cps.size());
    else fail(line, fmt::format("'{}' object is not subscriptable", type_name(o)));
    auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
      if (!v) return dflt;
      int64_t x = *v < 0 ? *v + n : *v;
      if (s > 0) return std::clamp<int64_t>(x, 0, n);
      return std::clamp<int64_t>(x, -1, n - 1);
    };
    const int64_t lo = clamp(a, s > 0 ? 0 : n - 1), hi = clamp(b, s > 0 ? n : -1);
    Array out;
    std::string str;
    for (int64_t k = lo; s > 0 ? k < hi : k > hi; k += s) {
      if (o.t == Value::T::Arr) out.push_back((*o.a)[size_t(k)]);
      else str += cps[size_t(k)];
    }
    if (o.t == Value::T::Str) return Value::str(str);
    return Value::array(std::move(out));
  }
};

struct CallArgs {
  std::vector<ExprP> pos;
  std::vector<std::pair<std::string, ExprP>> kw;
  Args eval(Ctx& c) const {
    Args a;
    for (auto& e : pos) a.pos.push_back(e->eval(c));
    for (auto& [k, e] : kw) a.kw.emplace_back(k, e->eval(c));
    return a;
  }
};

struct Call : Expr {
  ExprP fn;
  CallArgs args;
  Value eval(Ctx& c) const override {
    Value f = fn->eval(c);
    if (f.t != Value::T::Fn) fail(line, fmt::format("'{}' is not callable", type_name(f)));
    Args a = args.eval(c);
    return (*f.fn)(a);
  }
};

// ---- string / dict methods

Value split(const std::string& s, const Value& sep, int64_t maxsplit, int line) {
  Array out;
  if (sep.t == Value::T::None || sep.undefined()) {
    size_t p = 0;
    int64_t n = 0;
    while (true) {
      while (p < s.size() && is_space(s[p])) ++p;
      if (p >= s.size()) break;
      if (maxsplit >= 0 && n == maxsplit) {
        size_t e = s.size();
        while (e > p && is_space(s[e - 1])) --e;
        out.push_back(Value::str(s.substr(p, e - p)));
        break;
      }
      size_t e = p;
      while (e < s.size() && !is_space(s[e])) ++e;
      out.push_back(Value::str(s.substr(p, e - p)));
      ++n;
      p = e;
    }
    return Value::array(std::move(out));
  }
  if (sep.t != Value::T::Str) fail(line, "split() separator must be a string");
  if (sep.s.empty()) fail(line, "empty separator");
  size_t p = 0;
  int64_t n = 0;
  while (true) {
    const size_t q = (maxsplit >= 0 && n >= maxsplit) ? std::string::npos : s.find(sep.s, p);
    if (q == std::string::npos) {
      out.push_back(Value::str(s.substr(p)));
      break;
    }
    out.push_back(Value::str(s.substr(p, q - p)));
    p = q + sep.s.size();
    ++n;
  }
  return Value::array(std::move(out));
}

std::string replace_all(std::string s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) return s;
  size_t p = 0;
  int64_t n = 0;
  while ((count < 0 || n < count) && (p = s.find(from, p)) != std::string::npos) {
    s.replace(p, from.size(), to);
    p += to.size();
    ++n;
  }
  return s;
}

std::string ascii_map(std::string s, int (*f)(int)) {
  for (char& ch : s)
    if (static_cast<unsigned char>(ch) < 0x80) ch = char(f(ch));
  return s;
}

std::string title_case(const std::string& s) {
  std::string out = s;
  bool prev_alpha = false;
  for (char& ch : out) {
    const bool alpha = std::isalpha(static_cast<unsigned char>(ch));
    if (alpha) ch = char(prev_alpha ? std::tolower(ch) : std::toupper(ch));
    prev_alpha = alpha;
  }
  return out;
}

std::string capitalize(const std::string& s) {
  std::string out = ascii_map(s, [](int ch) { return std::tolower(ch); });
  if (!out.empty()) out[0] = char(std::toupper(out[0]));
  return out;
}

const std::set<std::string> kMethods = {"strip",  "lstrip", "rstrip",     "split", "startswith", "endswith",
                                        "upper",  "lower",  "title",      "capitalize", "replace", "find",
                                        "count",  "join",   "items",      "keys",  "values",     "get"};

Value call_method(const Value& o, const std::string& name, Args& a, int line) {
  if (o.t == Value::T::Str) {
    const std::string& s = o.s;
    if (name == "strip") return Value::str(strip_chars(s, a.take(0, "chars"), true, true));
    if (name == "lstrip") return Value::str(strip_chars(s, a.take(0, "chars"), true, false));
    if (name == "rstrip") return Value::str(strip_chars(s, a.take(0, "chars"), false, true));
    if (name == "split") {
      Value ms = a.take(1, "maxsplit", Value::integer(-1));
      return split(s, a.take(0, "sep", Value::none()), ms.as_int(), line);
    }
    if (name == "startswith" || name == "endswith") {
      Value arg = a.take(0, "prefix");
      std::vector<std::string> cands;
      if (arg.t == Value::T::Str) cands.push_back(arg.s);
      else if (arg.t == Value::T::Arr)
        for (auto& e : *arg.a) {
          if (e.t != Value::T::Str) fail(line, name + "() tuple must hold strings");
          cands.push_back(e.s);
        }
      else fail(line, fmt::format("{}() argument must be str or a tuple of str, not {}", name, type_name(arg)));
      for (auto& x : cands) {
        const bool hit = name == "startswith" ? s.compare(0, x.size(), x) == 0
                                              : s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
        if (hit) return Value::boolean(true);
      }
      return Value::boolean(false);
    }
    if (name == "upper") return Value::str(ascii_map(s, [](int ch) { return std::toupper(ch); }));
    if (name == "lower") return Value::str(ascii_map(s, [](int ch) { return std::tolower(ch); }));
    if (name == "title") return Value::str(title_case(s));
    if (name == "capitalize") return Value::str(capitalize(s));
    if (name == "replace") {
      Value from = a.take(0, "old"), to = a.take(1, "new"), n = a.take(2, "count", Value::integer(-1));
      if (from.t != Value::T::Str || to.t != Value::T::Str) fail(line, "replace() arguments must be strings");
      return Value::str(replace_all(s, from.s, to.s, n.as_int()));
    }
    if (name == "find") {
      Value sub = a.take(0, "sub");
      if (sub.t != Value::T::Str) fail(line, "find() argument must be a string");
      const size_t p = s.find(sub.s);
      return Value::integer(p == std::string::npos ? -1 : int64_t(code_points(s.substr(0, p)).size()));
    }
    if (name == "count") {
      Value sub = a.take(0, "sub");
      if (sub.t != Value::T::Str) fail(line, "count() argument must be a string");
      if (sub.s.empty()) return Value::integer(int64_t(code_points(s).size()) + 1);
      int64_t n = 0;
      for (size_t p = s.find(sub.s); p != std::string::npos; p = s.find(sub.s, p + sub.s.size())) ++n;
      return Value::integer(n);
    }
    if (name == "join") {
      Value seq = a.take(0, "iterable");
      if (seq.t != Value::T::Arr) fail(line, "join() needs a list");
      std::string out;
      for (size_t k = 0; k < seq.a->size(); ++k) {
        if ((*seq.a)[k].t != Value::T::Str) fail(line, "join() items must be strings");
        out += (k ? s : "") + (*seq.a)[k].s;
      }
      return Value::str(out);
    }
  } else if (o.t == Value::T::Obj && !o.is_namespace) {
    if (name == "items") {
      Array out;
      for (auto& [k, v] : *o.o) {
        Value t = Value::array({Value::str(k), v});
        t.is_tuple = true;
        out.push_back(t);
      }
      return Value::array(std::move(out));
    }
    if (name == "keys" || name == "values") {
      Array out;
      for (auto& [k, v] : *o.o) out.push_back(name == "keys" ? Value::str(k) : v);
      return Value::array(std::move(out));
    }
    if (name == "get") {
      Value key = a.take(0, "key");
      const Value* v = key.t == Value::T::Str ? o.get(key.s) : nullptr;
      return v ? *v : a.take(1, "default", Value::none());
    }
  }
  if (o.t == Value::T::Obj) {
    if (const Value* v = o.get(name); v && v->t == Value::T::Fn) return (*v->fn)(a);
  }
  fail(line, fmt::format("'{}' object has no method '{}'", type_name(o), name));
}

struct MethodCall : Expr {
  ExprP obj;
  std::string name;
  CallArgs args;
  Value eval(Ctx& c) const override {
    Value o = obj->eval(c);
    if (o.undefined()) fail(line, fmt::format("cannot call '{}' on an undefined value", name));
    Args a = args.eval(c);
    return call_method(o, name, a, line);
  }
};

// ---- tests (`x is name`)

bool run_test(const std::string& name, const Value& v, Args& a, int line);

const std::set<std::string> kTests = {"defined", "undefined", "none",     "boolean",  "true",   "false",  "string",
                                      "number",  "integer",   "float",    "mapping",  "iterable", "sequence",
                                      "callable", "even",     "odd",      "divisibleby", "eq",  "equalto", "==",
                                      "ne",      "!=",        "lt",       "<",        "le",     "<=",     "gt",
                                      ">",       "ge",        ">=",       "in",       "lower",  "upper",  "sameas"};

Value compare_op(const std::string& op, const Value& l, const Value& r, int line);

bool run_test(const std::string& name, const Value& v, Args& a, int line) {
  using T = Value::T;
  if (name == "defined") return !v.undefined();
  if (name == "undefined") return v.undefined();
  if (name == "none") return v.t == T::None;
  if (name == "boolean") return v.t == T::Bool;
  if (name == "true") return v.t == T::Bool && v.b;
  if (name == "false") return v.t == T::Bool && !v.b;
  if (name == "string") return v.t == T::Str;
  if (name == "number") return v.t == T::Int || v.t == T::Float || v.t == T::Bool;
  if (name == "integer") return v.t == T::Int;
  if (name == "float") return v.t == T::Float;
  if (name == "mapping") return v.t == T::Obj;
  if (name == "iterable") return v.t == T::Arr || v.t == T::Obj || v.t == T::Str || v.t == T::Undef;
  if (name == "sequence") return v.t == T::Arr || v.t == T::Obj || v.t == T::Str;
  if (name == "callable") return v.t == T::Fn;
  if (name == "even" || name == "odd") {
    if (v.t != T::Int && v.t != T::Bool) fail(line, "even/odd test needs an integer");
    const bool even = v.as_int() % 2 == 0;
    return name == "even" ? even : !even;
  }
  if (name == "divisibleby") {
    Value n = a.take(0, "num");
    if (!n.numeric() || n.as_int() == 0) fail(line, "divisibleby needs a nonzero integer");
    return v.as_int() % n.as_int() == 0;
  }
  if (name == "lower" || name == "upper") {
    if (v.t != T::Str) return false;
    return name == "lower" ? ascii_map(v.s, [](int ch) { return std::tolower(ch); }) == v.s
                           : ascii_map(v.s, [](int ch) { return std::toupper(ch); }) == v.s;
  }
  if (name == "sameas") {
    Value o = a.take(0, "other");
    if (v.t != o.t) return false;
    if (v.t == T::Arr) return v.a == o.a;
    if (v.t == T::Obj) return v.o == o.o;
    return equal(v, o);
  }
  static const std::unordered_map<std::string, std::string> ops = {
      {"eq", "=="}, {"equalto", "=="}, {"==", "=="}, {"ne", "!="}, {"!=", "!="}, {"lt", "<"}, {"<", "<"},
      {"le", "<="}, {"<=", "<="},      {"gt", ">"},  {">", ">"},  {"ge", ">="}, {">=", ">="}, {"in", "in"}};
  auto it = ops.find(name);
  if (it != ops.end()) return truthy(compare_op(it->second, v, a.take(0, "other"), line));
  fail(line, "unknown test '" + name + "'");
}

struct Test : Expr {
  ExprP obj;
  std::string name;
  CallArgs args;
  bool negated = false;
  Value eval(Ctx& c) const override {
    Value v = obj->eval(c);
    Args a = args.eval(c);
    return Value::boolean(run_test(name, v, a, line) != negated);
  }
};

// ---- filters

const std::set<std::string> kFilters = {"trim",  "length", "count",      "tojson", "upper", "lower",   "title",
                                        "capitalize", "default", "d",    "join",   "first", "last",    "list",
                                        "string", "int",   "float",      "abs",    "round", "replace", "items",
                                        "dictsort", "reverse", "selectattr", "rejectattr", "select", "reject",
                                        "map",   "indent", "safe",       "unique", "sum",   "min",     "max"};

Value apply_filter(const std::string& name, const Value& v, Args& a, int line);

Value iterate_list(const Value& v, int line) {
  if (v.t == Value::T::Arr) return v;
  Array out;
  if (v.t == Value::T::Obj)
    for (auto& [k, e] : *v.o) out.push_back(Value::str(k));
  else if (v.t == Value::T::Str)
    for (auto& cp : code_points(v.s)) out.push_back(Value::str(cp));
  else if (!v.undefined())
    fail(line, fmt::format("'{}' object is not iterable", type_name(v)));
  return Value::array(std::move(out));
}

Value attr_path(const Value& v, const std::string& path, int line) {
  Value cur = v;
  size_t p = 0;
  while (p <= path.size()) {
    const size_t q = path.find('.', p);
    const std::string part = path.substr(p, q == std::string::npos ? std::string::npos : q - p);
    if (!part.empty() && std::all_of(part.begin(), part.end(), [](char ch) { return std::isdigit(ch); }))
      cur = subscript(cur, Value::integer(std::stoll(part)), line);
    else
      cur = cur.t == Value::T::Obj ? subscript(cur, Value::str(part), line) : Value{};
    if (q == std::string::npos) break;
    p = q + 1;
  }
  return cur;
}

Value compare_op(const std::string& op, const Value& l, const Value& r, int line) {
  if (op == "==") return Value::boolean(equal(l, r));
  if (op == "!=") return Value::boolean(!equal(l, r));
  if (op == "in" || op == "not in") {
    bool hit = false;
    if (r.t == Value::T::Str) {
      if (l.t != Value::T::Str) fail(line, fmt::format("'in <string>' requires string as left operand, not {}", type_name(l)));
      hit = r.s.find(l.s) != std::string::npos;
    } else if (r.t == Value::T::Arr) {
      hit = std::any_of(r.a->begin(), r.a->end(), [&](const Value& e) { return equal(e, l); });
    } else if (r.t == Value::T::Obj) {
      hit = l.t == Value::T::Str && r.get(l.s) != nullptr;
    } else if (r.undefined()) {
      hit = false;
    } else {
      fail(line, fmt::format("argument of type '{}' is not iterable", type_name(r)));
    }
    return Value::boolean(op == "in" ? hit : !hit);
  }
  int cmp;
  if (l.numeric() && r.numeric()) {
    const double x = l.as_double(), y = r.as_double();
    cmp = x < y ? -1 : x > y ? 1 : 0;
  } else if (l.t == Value::T::Str && r.t == Value::T::Str) {
    cmp = l.s.compare(r.s);
    cmp = cmp < 0 ? -1 : cmp > 0 ? 1 : 0;
  } else {
    fail(line, fmt::format("'{}' not supported between instances of '{}' and '{}'", op, type_name(l), type_name(r)));
  }
  if (op == "<") return Value::boolean(cmp < 0);
  if (op == "<=") return Value::boolean(cmp <= 0);
  if (op == ">") return Value::boolean(cmp > 0);
  return Value::boolean(cmp >= 0);
}

Value apply_filter(const std::string& name, const Value& v, Args& a, int line) {
  using T = Value::T;
  if (name == "safe") return v;
  if (name == "trim") {
    if (v.undefined()) return Value::str("");
    return Value::str(strip_chars(to_str(v), a.take(0, "chars"), true, true));
  }
  if (name == "length" || name == "count") {
    if (v.t == T::Str) return Value::integer(int64_t(code_points(v.s).size()));
    if (v.t == T::Arr) return Value::integer(int64_t(v.a->size()));
    if (v.t == T::Obj) return Value::integer(int64_t(v.o->size()));
    if (v.undefined()) return Value::integer(0);
    fail(line, fmt::format("object of type '{}' has no len()", type_name(v)));
  }
  if (name == "tojson") {
    Value ind = a.take(0, "indent", Value::none());
    Value sk = a.take(2, "sort_keys", Value::boolean(false));
    std::string out;
    to_json(out, v, ind.t == T::None ? -1 : int(ind.as_int()), truthy(sk), 0);
    return Value::str(out);
  }
  if (name == "upper") return Value::str(ascii_map(to_str(v), [](int ch) { return std::toupper(ch); }));
  if (name == "lower") return Value::str(ascii_map(to_str(v), [](int ch) { return std::tolower(ch); }));
  if (name == "title") return Value::str(title_case(to_str(v)));
  if (name == "capitalize") return Value::str(capitalize(to_str(v)));
  if (name == "default" || name == "d") {
    Value dflt = a.take(0, "default_value", Value::str("")), boolean = a.take(1, "boolean", Value::boolean(false));
    if (v.undefined() || (truthy(boolean) && !truthy(v))) return dflt;
    return v;
  }
  if (name == "join") {
    Value sep = a.take(0, "d", Value::str("")), attr = a.take(1, "attribute", Value::none());
    Value seq = iterate_list(v, line);
    std::string out;
    for (size_t k = 0; k < seq.a->size(); ++k) {
      Value e = attr.t == T::None ? (*seq.a)[k] : attr_path((*seq.a)[k], to_str(attr), line);
      out += (k ? to_str(sep) : "") + to_str(e);
    }
    return Value::str(out);
  }
  if (name == "first" || name == "last") {
    Value seq = iterate_list(v, line);
    if (seq.a->empty()) return {};
    return name == "first" ? seq.a->front() : seq.a->back();
  }
  if (name == "list") {
    Value seq = iterate_list(v, line);
    return Value::array(*seq.a);
  }
  if (name == "string") return Value::str(to_str(v));
  if (name == "int") {
    Value dflt = a.take(0, "default", Value::integer(0));
    if (v.t == T::Int || v.t == T::Bool) return Value::integer(v.as_int());
    if (v.t == T::Float) return Value::integer(int64_t(v.f));
    if (v.t == T::Str) {
      std::string s = strip_chars(v.s, Value{}, true, true);
      int64_t x = 0;
      auto r = std::from_chars(s.data(), s.data() + s.size(), x);
      if (r.ec == std::errc() && r.ptr == s.data() + s.size() && !s.empty()) return Value::integer(x);
      try {
        size_t used = 0;
        double d = std::stod(s, &used);
        if (used == s.size()) return Value::integer(int64_t(d));
      } catch (const std::exception&) {
      }
    }
    return dflt;
  }
  if (name == "float") {
    Value dflt = a.take(0, "default", Value::number(0));
    if (v.numeric()) return Value::number(v.as_double());
    if (v.t == T::Str) {
      try {
        size_t used = 0;
        std::string s = strip_chars(v.s, Value{}, true, true);
        double d = std::stod(s, &used);
        if (used == s.size()) return Value::number(d);
      } catch (const std::exception&) {
      }
    }
    return dflt;
  }
  if (name == "abs") {
    if (v.t == T::Int || v.t == T::Bool) return Value::integer(std::abs(v.as_int()));
    if (v.t == T::Float) return Value::number(std::fabs(v.f));
    fail(line, fmt::format("bad operand type for abs(): '{}'", type_name(v)));
  }
  if (name == "round") {
    if (!v.numeric()) fail(line, "round needs a number");
    const int64_t prec = a.take(0, "precision", Value::integer(0)).as_int();
    const std::string method = to_str(a.take(1, "method", Value::str("common")));
    const double m = std::pow(10.0, double(prec)), x = v.as_double() * m;
    double r = method == "floor" ? std::floor(x) : method == "ceil" ? std::ceil(x) : std::round(x);
    return Value::number(r / m);
  }
  if (name == "replace") {
    Value from = a.take(0, "old"), to = a.take(1, "new"), n = a.take(2, "count", Value::integer(-1));
    return Value::str(replace_all(to_str(v), to_str(from), to_str(to), n.t == T::None ? -1 : n.as_int()));
  }
  if (name == "items") {
    Args none;
    if (v.undefined()) return Value::array();
    if (v.t != T::Obj) fail(line, "items filter needs a mapping");
    return call_method(v, "items", none, line);
  }
  if (name == "dictsort") {
    if (v.t != T::Obj) fail(line, "dictsort needs a mapping");
    const bool cs = truthy(a.take(0, "case_sensitive", Value::boolean(false)));
    const bool by_value = to_str(a.take(1, "by", Value::str("key"))) == "value";
    const bool rev = truthy(a.take(2, "reverse", Value::boolean(false)));
    Args none;
    Value items = call_method(v, "items", none, line);
    auto key = [&](const Value& t) {
      const Value& k = (*t.a)[by_value ? 1 : 0];
      return k.t == T::Str && !cs ? Value::str(ascii_map(k.s, [](int ch) { return std::tolower(ch); })) : k;
    };
    std::stable_sort(items.a->begin(), items.a->end(), [&](const Value& x, const Value& y) {
      return truthy(compare_op(rev ? ">" : "<", key(x), key(y), line));
    });
    return items;
  }
  if (name == "reverse") {
    if (v.t == T::Str) {
      auto cps = code_points(v.s);
      std::string out;
      for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
      return Value::str(out);
    }
    Value seq = iterate_list(v, line);
    return Value::array(Array(seq.a->rbegin(), seq.a->rend()));
  }
  if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
    const bool attr = name == "selectattr" || name == "rejectattr";
    const bool keep = name == "selectattr" || name == "select";
    Value seq = iterate_list(v, line);
    std::string attr_name;
    size_t first = 0;
    if (attr) {
      if (a.pos.empty()) fail(line, name + " needs an attribute name");
      attr_name = to_str(a.pos[0]);
      first = 1;
    }
    std::string test = a.pos.size() > first ? to_str(a.pos[first]) : "";
    if (!test.empty() && !kTests.count(test)) fail(line, "unknown test '" + test + "'");
    Args targs;
    for (size_t k = first + 1; k < a.pos.size(); ++k) targs.pos.push_back(a.pos[k]);
    Array out;
    for (auto& e : *seq.a) {
      Value x = attr ? attr_path(e, attr_name, line) : e;
      const bool ok = test.empty() ? truthy(x) : run_test(test, x, targs, line);
      if (ok == keep) out.push_back(e);
    }
    return Value::array(std::move(out));
  }
  if (name == "map") {
    Value seq = iterate_list(v, line);
    Array out;
    Value attr = a.take(99, "attribute");
    if (!attr.undefined()) {
      Value dflt = a.take(99, "default");
      for (auto& e : *seq.a) {
        Value x = attr_path(e, to_str(attr), line);
        out.push_back(x.undefined() && !dflt.undefined() ? dflt : x);
      }
    } else {
      if (a.pos.empty()) fail(line, "map needs a filter name or attribute=");
      const std::string f = to_str(a.pos[0]);
      if (!kFilters.count(f)) fail(line, "unknown filter '" + f + "'");
      Args fa;
      fa.pos.assign(a.pos.begin() + 1, a.pos.end());
      fa.kw = a.kw;
      for (auto& e : *seq.a) out.push_back(apply_filter(f, e, fa, line));
    }
    return Value::array(std::move(out));
  }
  if (name == "indent") {
    const Value w = a.take(0, "width", Value::integer(4));
    const bool first = truthy(a.take(1, "first", Value::boolean(false)));
    const bool blank = truthy(a.take(2, "blank", Value::boolean(false)));
    const std::string pad = w.t == T::Str ? w.s : std::string(size_t(std::max<int64_t>(0, w.as_int())), ' ');
    std::string s = to_str(v), out;
    std::vector<std::string> lines;
    size_t p = 0;
    while (true) {
      size_t q = s.find('\n', p);
      lines.push_back(s.substr(p, q == std::string::npos ? std::string::npos : q - p));
      if (q == std::string::npos) break;
      p = q + 1;
    }
    for (size_t k = 0; k < lines.size(); ++k) {
      if (k) out += '\n';
      const bool pad_it = k == 0 ? first : (blank || !lines[k].empty());
      out += (pad_it ? pad : "") + lines[k];
    }
    return Value::str(out);
  }
  if (name == "unique") {
    Value seq = iterate_list(v, line);
    Array out;
    for (auto& e : *seq.a)
      if (std::none_of(out.begin(), out.end(), [&](const Value& x) { return equal(x, e); })) out.push_back(e);
    return Value::array(std::move(out));
  }
  if (name == "sum") {
    Value seq = iterate_list(v, line);
    Value attr = a.take(0, "attribute", Value::none());
    Value acc = a.take(1, "start", Value::integer(0));
    for (auto& e : *seq.a) {
      Value x = attr.t == T::None ? e : attr_path(e, to_str(attr), line);
      if (!x.numeric() || !acc.numeric()) fail(line, "sum needs numbers");
      acc = (acc.t == T::Float || x.t == T::Float) ? Value::number(acc.as_double() + x.as_double())
                                                   : Value::integer(acc.as_int() + x.as_int());
    }
    return acc;
  }
  if (name == "min" || name == "max") {
    Value seq = iterate_list(v, line);
    if (seq.a->empty()) return {};
    Value best = seq.a->front();
    for (auto& e : *seq.a)
      if (truthy(compare_op(name == "min" ? "<" : ">", e, best, line))) best = e;
    return best;
  }
  fail(line, "unknown filter '" + name + "'");
}

struct Filter : Expr {
  ExprP obj;
  std::string name;
  CallArgs args;
  Value eval(Ctx& c) const override {
    Value v = obj->eval(c);
    Args a = args.eval(c);
    return apply_filter(name, v, a, line);
  }
};

// ---- operators

struct Unary : Expr {
  char op;
  ExprP e;
  Value eval(Ctx& c) const override {
    Value v = e->eval(c);
    if (!v.numeric()) fail(line, fmt::format("bad operand type for unary {}: '{}'", op, type_name(v)));
    if (op == '+') return v.t == Value::T::Float ? v : Value::integer(v.as_int());
    return v.t == Value::T::Float ? Value::number(-v.f) : Value::integer(-v.as_int());
  }
};

Value arith(const std::string& op, const Value& l, const Value& r, int line) {
  using T = Value::T;
  if (op == "~") return Value::str(to_str(l) + to_str(r));
  if (op == "+") {
    if (l.t == T::Str && r.t == T::Str) return Value::str(l.s + r.s);
    if (l.t == T::Arr && r.t == T::Arr) {
      Array out = *l.a;
      out.insert(out.end(), r.a->begin(), r.a->end());
      return Value::array(std::move(out));
    }
  }
  if (op == "*") {
    if ((l.t == T::Str || l.t == T::Arr) && (r.t == T::Int || r.t == T::Bool)) {
      Value out = l.t == T::Str ? Value::str("") : Value::array();
      for (int64_t k = 0; k < r.as_int(); ++k) {
        if (l.t == T::Str) out.s += l.s;
        else out.a->insert(out.a->end(), l.a->begin(), l.a->end());
      }
      return out;
    }
  }
  if (!l.numeric() || !r.numeric())
    fail(line, fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, type_name(l), type_name(r)));
  const bool ints = l.t != T::Float && r.t != T::Float;
  const int64_t x = l.as_int(), y = r.as_int();
  const double dx = l.as_double(), dy = r.as_double();
  if (op == "+") return ints ? Value::integer(x + y) : Value::number(dx + dy);
  if (op == "-") return ints ? Value::integer(x - y) : Value::number(dx - dy);
  if (op == "*") return ints ? Value::integer(x * y) : Value::number(dx * dy);
  if (op == "/") {
    if (dy == 0) fail(line, "division by zero");
    return Value::number(dx / dy);
  }
  if (op == "//" || op == "%") {
    if (dy == 0) fail(line, "integer division or modulo by zero");
    if (ints) {
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {
        --q;
        m += y;
      }
      return Value::integer(op == "//" ? q : m);
    }
    const double q = std::floor(dx / dy);
    return Value::number(op == "//" ? q : dx - q * dy);
  }
  if (op == "**") {
    if (ints && y >= 0) {
      int64_t p = 1;
      for (int64_t k = 0; k < y; ++k) p *= x;
      return Value::integer(p);
    }
    return Value::number(std::pow(dx, dy));
  }
  fail(line, "unknown operator " + op);
}

struct Binary : Expr {
  std::string op;
  ExprP l, r;
  Value eval(Ctx& c) const override {
    if (op == "and") {
      Value x = l->eval(c);
      return truthy(x) ? r->eval(c) : x;
    }
    if (op == "or") {
      Value x = l->eval(c);
      return truthy(x) ? x : r->eval(c);
    }
    return arith(op, l->eval(c), r->eval(c), line);
  }
};

struct Not : Expr {
  ExprP e;
  Value eval(Ctx& c) const override { return Value::boolean(!truthy(e->eval(c))); }
};

struct Compare : Expr {
  ExprP first;
  std::vector<std::pair<std::string, ExprP>> rest;
  Value eval(Ctx& c) const override {
    Value l = first->eval(c);
    for (auto& [op, e] : rest) {
      Value r = e->eval(c);
      if (!truthy(compare_op(op, l, r, line))) return Value::boolean(false);
      l = std::move(r);
    }
    return Value::boolean(true);
  }
};

struct CondExpr : Expr {
  ExprP then, cond, otherwise;
  Value eval(Ctx& c) const override {
    if (truthy(cond->eval(c))) return then->eval(c);
    return otherwise ? otherwise->eval(c) : Value{};
  }
};

// ============================================================ statements

struct Node {
  virtual ~Node() = default;
  virtual void render(Ctx& c, std::string& out) const = 0;
};
using NodeP = std::unique_ptr<Node>;
using Body = std::vector<NodeP>;

void render_body(const Body& body, Ctx& c, std::string& out) {
  for (auto& n : body) {
    n->render(c, out);
    if (c.flow != Ctx::Flow::Normal) return;
  }
}

struct TextNode : Node {
  std::string text;
  void render(Ctx&, std::string& out) const override { out += text; }
};

struct OutputNode : Node {
  ExprP e;
  void render(Ctx& c, std::string& out) const override { out += to_str(e->eval(c)); }
};

struct IfNode : Node {
  std::vector<std::pair<ExprP, Body>> branches;  // condition null = else
  void render(Ctx& c, std::string& out) const override {
    for (auto& [cond, body] : branches)
      if (!cond || truthy(cond->eval(c))) {
        render_body(body, c, out);
        return;
      }
  }
};

struct Target {
  std::vector<std::string> names;  // one name, or several for tuple unpacking
  int line = 0;
  void assign(Scope& s, const Value& v) const {
    if (names.size() == 1) {
      s.vars[names[0]] = v;
      return;
    }
    if (v.t != Value::T::Arr || v.a->size() != names.size())
      fail(line, fmt::format("cannot unpack {} into {} names", type_name(v), names.size()));
    for (size_t k = 0; k < names.size(); ++k) s.vars[names[k]] = (*v.a)[k];
  }
};

struct ForNode : Node {
  Target target;
  ExprP iter, filter;
  Body body, else_body;
  int line = 0;
  void render(Ctx& c, std::string& out) const override {
    Value seq = iterate_list(iter->eval(c), line);
    Array items;
    if (filter) {
      Scope probe{{}, c.scope};
      Scope* saved = c.scope;
      c.scope = &probe;
      for (auto& e : *seq.a) {
        target.assign(probe, e);
        if (truthy(filter->eval(c))) items.push_back(e);
      }
      c.scope = saved;
    } else {
      items = *seq.a;
    }
    if (items.empty()) {
      render_body(else_body, c, out);
      return;
    }
    Scope scope{{}, c.scope};
    Scope* saved = c.scope;
    c.scope = &scope;
    const int64_t n = int64_t(items.size());
    for (int64_t k = 0; k < n; ++k) {
      scope.vars.clear();
      target.assign(scope, items[size_t(k)]);
      Value loop = Value::object({{"index", Value::integer(k + 1)},
                                  {"index0", Value::integer(k)},
                                  {"revindex", Value::integer(n - k)},
                                  {"revindex0", Value::integer(n - k - 1)},
                                  {"first", Value::boolean(k == 0)},
                                  {"last", Value::boolean(k == n - 1)},
                                  {"length", Value::integer(n)},
                                  {"previtem", k > 0 ? items[size_t(k - 1)] : Value{}},
                                  {"nextitem", k + 1 < n ? items[size_t(k + 1)] : Value{}}});
      scope.vars["loop"] = loop;
      render_body(body, c, out);
      if (c.flow == Ctx::Flow::Break) {
        c.flow = Ctx::Flow::Normal;
        break;
      }
      c.flow = Ctx::Flow::Normal;
    }
    c.scope = saved;
  }
};

struct SetNode : Node {
  Target target;
  std::string attr;  // set ns.attr = ...
  ExprP value;       // null for a block set
  Body body;
  int line = 0;
  void render(Ctx& c, std::string& out) const override {
    Value v;
    if (value) {
      v = value->eval(c);
    } else {
      std::string s;
      render_body(body, c, s);
      v = Value::str(s);
    }
    if (!attr.empty()) {
      Value* ns = c.scope->find(target.names[0]);
      if (!ns || !ns->is_namespace) fail(line, fmt::format("'{}' is not a namespace; cannot set '{}'", target.names[0], attr));
      ns->set(attr, v);
      return;
    }
    target.assign(*c.scope, v);
  }
};

struct ControlNode : Node {
  Ctx::Flow flow;
  void render(Ctx& c, std::string&) const override { c.flow = flow; }
};

struct MacroNode : Node {
  std::string name;
  std::vector<std::pair<std::string, ExprP>> params;  // default may be null
  Body body;
  int line = 0;
  void render(Ctx& c, std::string&) const override {
    const MacroNode* self = this;
    Ctx* outer = &c;
    Scope* globals = c.globals;
    c.scope->vars[name] = Value::function([self, outer, globals](Args& a) {
      Scope scope{{}, globals};
      Ctx mc{&scope, globals};
      mc.depth = outer->depth + 1;
      if (mc.depth > 64) fail(self->line, "macro recursion too deep");
      if (a.pos.size() > self->params.size()) fail(self->line, "too many arguments to macro " + self->name);
      for (size_t k = 0; k < self->params.size(); ++k) {
        const auto& [pname, dflt] = self->params[k];
        Value v = a.take(k, pname);
        if (v.undefined() && dflt) v = dflt->eval(mc);
        scope.vars[pname] = v;
      }
      std::string s;
      render_body(self->body, mc, s);
      return Value::str(s);
    });
  }
};

// ============================================================ parser

const std::set<std::string> kGlobals = {"raise_exception", "namespace", "range", "strftime_now", "dict"};

class Parser {
 public:
  explicit Parser(std::vector<Segment> segs) : segs_(std::move(segs)) {}

  Body parse_all() {
    Body body = parse_body({});
    if (seg_ < segs_.size())
      throw TemplateError(fmt::format("line {}: unexpected '{}'", segs_[seg_].line, first_word(segs_[seg_])));
    return body;
  }

 private:
  static std::string first_word(const Segment& s) {
    auto toks = tokenize(s.body, s.line);
    return toks[0].s;
  }

  // Parses nodes until a statement whose keyword is in `stop` (left unconsumed).
  Body parse_body(const std::set<std::string>& stop) {
    Body body;
    while (seg_ < segs_.size()) {
      const Segment& s = segs_[seg_];
      line_ = s.line;
      if (s.k == Segment::K::Text) {
        auto n = std::make_unique<TextNode>();
        n->text = s.body;
        body.push_back(std::move(n));
        ++seg_;
        continue;
      }
      toks_ = tokenize(s.body, s.line);
      p_ = 0;
      if (s.k == Segment::K::Expr) {
        auto n = std::make_unique<OutputNode>();
        n->e = parse_expr();
        expect_end();
        body.push_back(std::move(n));
        ++seg_;
        continue;
      }
      if (toks_[0].k != Tok::K::Name) throw TemplateError(fmt::format("line {}: expected a tag name", line_));
      const std::string kw = toks_[0].s;
      if (stop.count(kw)) return body;
      ++seg_;
      p_ = 1;
      if (kw == "if") body.push_back(parse_if());
      else if (kw == "for") body.push_back(parse_for());
      else if (kw == "set") body.push_back(parse_set());
      else if (kw == "macro") body.push_back(parse_macro());
      else if (kw == "break" || kw == "continue") {
        if (loop_depth_ == 0) throw TemplateError(fmt::format("line {}: '{}' outside a loop", line_, kw));
        expect_end();
        auto n = std::make_unique<ControlNode>();
        n->flow = kw == "break" ? Ctx::Flow::Break : Ctx::Flow::Continue;
        body.push_back(std::move(n));
      } else if (kw == "elif" || kw == "else" || kw.rfind("end", 0) == 0) {
        throw TemplateError(fmt::format("line {}: unexpected '{}'", line_, kw));
      } else {
        throw TemplateError(fmt::format("line {}: unsupported tag '{}' (supported: if, for, set, macro, break, "
                                        "continue)",
                                        line_, kw));
      }
    }
    if (!stop.empty())
      throw TemplateError(fmt::format("unexpected end of template: missing '{}'", *stop.rbegin()));
    return body;
  }

  // Current statement's keyword (after parse_body stopped on it), consuming the segment.
  std::string take_stmt() {
    const Segment& s = segs_[seg_];
    line_ = s.line;
    toks_ = tokenize(s.body, s.line);
    p_ = 1;
    ++seg_;
    return toks_[0].s;
  }

  NodeP parse_if() {
    auto n = std::make_unique<IfNode>();
    ExprP cond = parse_expr();
    expect_end();
    for (;;) {
      Body b = parse_body({"elif", "else", "endif"});
      n->branches.emplace_back(std::move(cond), std::move(b));
      const std::string kw = take_stmt();
      if (kw == "endif") {
        expect_end();
        break;
      }
      if (kw == "elif") {
        cond = parse_expr();
        expect_end();
      } else {
        expect_end();
        Body e = parse_body({"endif"});
        n->branches.emplace_back(nullptr, std::move(e));
        take_stmt();
        expect_end();
        break;
      }
    }
    return n;
  }

  Target parse_target() {
    Target t;
    t.line = line_;
    t.names.push_back(expect_name());
    while (peek_op(",")) {
      ++p_;
      t.names.push_back(expect_name());
    }
    return t;
  }

  NodeP parse_for() {
    auto n = std::make_unique<ForNode>();
    n->line = line_;
    n->target = parse_target();
    if (!(cur().k == Tok::K::Name && cur().s == "in"))
      throw TemplateError(fmt::format("line {}: expected 'in' in for tag", line_));
    ++p_;
    n->iter = parse_cond_free();
    if (cur().k == Tok::K::Name && cur().s == "if") {
      ++p_;
      n->filter = parse_cond_free();
    }
    if (cur().k == Tok::K::Name && cur().s == "recursive")
      throw TemplateError(fmt::format("line {}: unsupported: recursive for loops", line_));
    expect_end();
    ++loop_depth_;
    n->body = parse_body({"else", "endfor"});
    --loop_depth_;
    if (take_stmt() == "else") {
      expect_end();
      n->else_body = parse_body({"endfor"});
      take_stmt();
    }
    expect_end();
    return n;
  }

  NodeP parse_set() {
    auto n = std::make_unique<SetNode>();
    n->line = line_;
    n->target.line = line_;
    n->target.names.push_back(expect_name());
    if (peek_op(".")) {
      ++p_;
      n->attr = expect_name();
    } else {
      while (peek_op(",")) {
        ++p_;
        n->target.names.push_back(expect_name());
      }
    }
    if (peek_op("=")) {
      ++p_;
      n->value = parse_tuple_or_expr();
      expect_end();
      return n;
    }
    expect_end();
    n->body = parse_body({"endset"});
    take_stmt();
    expect_end();
    return n;
  }

  NodeP parse_macro() {
    auto n = std::make_unique<MacroNode>();
    n->line = line_;
    n->name = expect_name();
    macros_.insert(n->name);
    expect_op("(");
    while (!peek_op(")")) {
      std::string pname = expect_name();
      ExprP dflt;
      if (peek_op("=")) {
        ++p_;
        dflt = parse_expr();
      }
      n->params.emplace_back(pname, std::move(dflt));
      if (!peek_op(",")) break;
      ++p_;
    }
    expect_op(")");
    expect_end();
    const int saved = loop_depth_;
    loop_depth_ = 0;
    n->body = parse_body({"endmacro"});
    loop_depth_ = saved;
    take_stmt();
    expect_end();
    return n;
  }

  // ---- expressions

  const Tok& cur() const { return toks_[p_]; }
  bool peek_op(const char* op) const { return cur().k == Tok::K::Op && cur().s == op; }
  bool peek_name(const char* n) const { return cur().k == Tok::K::Name && cur().s == n; }
  void expect_op(const char* op) {
    if (!peek_op(op)) throw TemplateError(fmt::format("line {}: expected '{}', found '{}'", line_, op, describe()));
    ++p_;
  }
  std::string expect_name() {
    if (cur().k != Tok::K::Name) throw TemplateError(fmt::format("line {}: expected a name, found '{}'", line_, describe()));
    return toks_[p_++].s;
  }
  void expect_end() {
    if (cur().k != Tok::K::End) throw TemplateError(fmt::format("line {}: unexpected '{}'", line_, describe()));
  }
  std::string describe() const { return cur().k == Tok::K::End ? "end of tag" : cur().s; }

  template <class N>
  std::unique_ptr<N> make() {
    auto n = std::make_unique<N>();
    n->line = line_;
    return n;
  }

  ExprP parse_tuple_or_expr() {
    ExprP e = parse_expr();
    if (!peek_op(",")) return e;
    auto t = make<ListLit>();
    t->tuple = true;
    t->items.push_back(std::move(e));
    while (peek_op(",")) {
      ++p_;
      if (cur().k == Tok::K::End) break;
      t->items.push_back(parse_expr());
    }
    return t;
  }

  ExprP parse_expr() {
    ExprP e = parse_or();
    if (peek_name("if")) {
      ++p_;
      auto c = make<CondExpr>();
      c->then = std::move(e);
      c->cond = parse_or();
      if (peek_name("else")) {
        ++p_;
        c->otherwise = parse_expr();
      }
      return c;
    }
    return e;
  }
  // An expression without the trailing `x if c else y` (for-loop iterables and filters).
  ExprP parse_cond_free() { return parse_or(); }

  ExprP parse_or() {
    ExprP l = parse_and();
    while (peek_name("or")) {
      ++p_;
      auto b = make<Binary>();
      b->op = "or";
      b->l = std::move(l);
      b->r = parse_and();
      l = std::move(b);
    }
    return l;
  }
  ExprP parse_and() {
    ExprP l = parse_not();
    while (peek_name("and")) {
      ++p_;
      auto b = make<Binary>();
      b->op = "and";
      b->l = std::move(l);
      b->r = parse_not();
      l = std::move(b);
    }
    return l;
  }
  ExprP parse_not() {
    if (peek_name("not")) {
      ++p_;
      auto n = make<Not>();
      n->e = parse_not();
      return n;
    }
    return parse_compare();
  }
  ExprP parse_compare() {
    ExprP l = parse_math1();
    std::vector<std::pair<std::string, ExprP>> rest;
    for (;;) {
      std::string op;
      if (cur().k == Tok::K::Op && (cur().s == "==" || cur().s == "!=" || cur().s == "<" || cur().s == ">" ||
                                    cur().s == "<=" || cur().s == ">=")) {
        op = cur().s;
        ++p_;
      } else if (peek_name("in")) {
        op = "in";
        ++p_;
      } else if (peek_name("not") && toks_[p_ + 1].k == Tok::K::Name && toks_[p_ + 1].s == "in") {
        op = "not in";
        p_ += 2;
      } else {
        break;
      }
      rest.emplace_back(op, parse_math1());
    }
    if (rest.empty()) return l;
    auto c = make<Compare>();
    c->first = std::move(l);
    c->rest = std::move(rest);
    return c;
  }
  ExprP binary(std::string op, ExprP l, ExprP r) {
    auto b = make<Binary>();
    b->op = std::move(op);
    b->l = std::move(l);
    b->r = std::move(r);
    return b;
  }
  ExprP parse_math1() {
    ExprP l = parse_concat();
    while (peek_op("+") || peek_op("-")) {
      std::string op = toks_[p_++].s;
      l = binary(op, std::move(l), parse_concat());
    }
    return l;
  }
  ExprP parse_concat() {
    ExprP l = parse_math2();
    while (peek_op("~")) {
      ++p_;
      l = binary("~", std::move(l), parse_math2());
    }
    return l;
  }
  ExprP parse_math2() {
    ExprP l = parse_pow();
    while (peek_op("*") || peek_op("/") || peek_op("//") || peek_op("%")) {
      std::string op = toks_[p_++].s;
      l = binary(op, std::move(l), parse_pow());
    }
    return l;
  }
  ExprP parse_pow() {
    ExprP l = parse_unary(true);
    while (peek_op("**")) {
      ++p_;
      l = binary("**", std::move(l), parse_unary(true));
    }
    return l;
  }
  ExprP parse_unary(bool with_filter) {
    ExprP e;
    if (peek_op("-") || peek_op("+")) {
      auto u = make<Unary>();
      u->op = toks_[p_++].s[0];
      u->e = parse_unary(false);
      e = std::move(u);
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filters(std::move(e));
    return e;
  }

  CallArgs parse_call_args() {
    CallArgs a;
    expect_op("(");
    while (!peek_op(")")) {
      if (cur().k == Tok::K::Name && toks_[p_ + 1].k == Tok::K::Op && toks_[p_ + 1].s == "=") {
        std::string k = toks_[p_].s;
        p_ += 2;
        a.kw.emplace_back(k, parse_expr());
      } else {
        if (!a.kw.empty()) throw TemplateError(fmt::format("line {}: positional argument after keyword argument", line_));
        a.pos.push_back(parse_expr());
      }
      if (!peek_op(",")) break;
      ++p_;
    }
    expect_op(")");
    return a;
  }

  ExprP parse_postfix(ExprP e) {
    for (;;) {
      if (peek_op(".")) {
        ++p_;
        std::string name;
        if (cur().k == Tok::K::Int) name = toks_[p_++].s;
        else name = expect_name();
        if (peek_op("(")) {
          if (!kMethods.count(name))
            throw TemplateError(fmt::format("line {}: unsupported method '{}()' (supported: {})", line_, name,
                                            fmt::join(kMethods, ", ")));
          auto m = make<MethodCall>();
          m->obj = std::move(e);
          m->name = name;
          m->args = parse_call_args();
          e = std::move(m);
        } else {
          auto a = make<Attr>();
          a->obj = std::move(e);
          a->name = name;
          e = std::move(a);
        }
      } else if (peek_op("[")) {
        ++p_;
        ExprP parts[3];
        int n_colons = 0;
        for (;;) {
          if (peek_op(":")) {
            ++p_;
            if (++n_colons > 2) throw TemplateError(fmt::format("line {}: bad slice", line_));
            continue;
          }
          if (peek_op("]")) break;
          if (parts[n_colons]) throw TemplateError(fmt::format("line {}: bad subscript", line_));
          parts[n_colons] = parse_expr();
        }
        expect_op("]");
        if (n_colons == 0) {
          if (!parts[0]) throw TemplateError(fmt::format("line {}: empty subscript", line_));
          auto ix = make<Index>();
          ix->obj = std::move(e);
          ix->idx = std::move(parts[0]);
          e = std::move(ix);
        } else {
          auto sl = make<Slice>();
          sl->obj = std::move(e);
          sl->start = std::move(parts[0]);
          sl->stop = std::move(parts[1]);
          sl->step = std::move(parts[2]);
          e = std::move(sl);
        }
      } else if (peek_op("(")) {
        auto* nm = dynamic_cast<Name*>(e.get());
        if (!nm) throw TemplateError(fmt::format("line {}: only named functions can be called here", line_));
        if (!kGlobals.count(nm->name) && !macros_.count(nm->name))
          throw TemplateError(fmt::format("line {}: unsupported function '{}()' (supported: {})", line_, nm->name,
                                          fmt::join(kGlobals, ", ")));
        auto c = make<Call>();
        c->fn = std::move(e);
        c->args = parse_call_args();
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  ExprP parse_filters(ExprP e) {
    for (;;) {
      if (peek_op("|")) {
        ++p_;
        auto f = make<Filter>();
        f->name = expect_name();
        if (!kFilters.count(f->name))
          throw TemplateError(fmt::format("line {}: unsupported filter '{}' (supported: {})", line_, f->name,
                                          fmt::join(kFilters, ", ")));
        f->obj = std::move(e);
        if (peek_op("(")) f->args = parse_call_args();
        e = std::move(f);
      } else if (peek_name("is")) {
        ++p_;
        auto t = make<Test>();
        if (peek_name("not")) {
          ++p_;
          t->negated = true;
        }
        if (cur().k == Tok::K::Name || (cur().k == Tok::K::Op && kTests.count(cur().s))) t->name = toks_[p_++].s;
        else throw TemplateError(fmt::format("line {}: expected a test name after 'is'", line_));
        if (!kTests.count(t->name))
          throw TemplateError(fmt::format("line {}: unsupported test '{}' (supported: {})", line_, t->name,
                                          fmt::join(kTests, ", ")));
        t->obj = std::move(e);
        if (peek_op("(")) {
          t->args = parse_call_args();
        } else if (cur().k == Tok::K::Str || cur().k == Tok::K::Int || cur().k == Tok::K::Float ||
                   (cur().k == Tok::K::Name && cur().s != "and" && cur().s != "or" && cur().s != "if" &&
                    cur().s != "else" && cur().s != "is" && cur().s != "in" && cur().s != "not")) {
          t->args.pos.push_back(parse_primary());  // `x is divisibleby 3`, `x is sameas none`
        }
        e = std::move(t);
      } else {
        return e;
      }
    }
  }

  ExprP parse_primary() {
    const Tok t = cur();
    switch (t.k) {
      case Tok::K::Str: {
        ++p_;
        std::string s = t.s;
        while (cur().k == Tok::K::Str) s += toks_[p_++].s;  // adjacent literals concatenate
        auto l = make<Literal>();
        l->v = Value::str(s);
        return l;
      }
      case Tok::K::Int: {
        ++p_;
        auto l = make<Literal>();
        l->v = Value::integer(t.i);
        return l;
      }
      case Tok::K::Float: {
        ++p_;
        auto l = make<Literal>();
        l->v = Value::number(t.f);
        return l;
      }
      case Tok::K::Name: {
        ++p_;
        auto l = make<Literal>();
        if (t.s == "true" || t.s == "True") l->v = Value::boolean(true);
        else if (t.s == "false" || t.s == "False") l->v = Value::boolean(false);
        else if (t.s == "none" || t.s == "None") l->v = Value::none();
        else {
          auto n = make<Name>();
          n->name = t.s;
          return n;
        }
        return l;
      }
      case Tok::K::Op: {
        if (t.s == "(") {
          ++p_;
          if (peek_op(")")) {
            ++p_;
            auto tl = make<ListLit>();
            tl->tuple = true;
            return tl;
          }
          ExprP e = parse_expr();
          if (peek_op(",")) {
            auto tl = make<ListLit>();
            tl->tuple = true;
            tl->items.push_back(std::move(e));
            while (peek_op(",")) {
              ++p_;
              if (peek_op(")")) break;
              tl->items.push_back(parse_expr());
            }
            e = std::move(tl);
          }
          expect_op(")");
          return e;
        }
        if (t.s == "[") {
          ++p_;
          auto l = make<ListLit>();
          while (!peek_op("]")) {
            l->items.push_back(parse_expr());
            if (!peek_op(",")) break;
            ++p_;
          }
          expect_op("]");
          return l;
        }
        if (t.s == "{") {
          ++p_;
          auto d = make<DictLit>();
          while (!peek_op("}")) {
            ExprP k = parse_expr();
            expect_op(":");
            d->items.emplace_back(std::move(k), parse_expr());
            if (!peek_op(",")) break;
            ++p_;
          }
          expect_op("}");
          return d;
        }
        break;
      }
      case Tok::K::End: break;
    }
    throw TemplateError(fmt::format("line {}: unexpected '{}' in expression", line_, describe()));
  }

  std::vector<Segment> segs_;
  size_t seg_ = 0;
  std::vector<Tok> toks_;
  size_t p_ = 0;
  int line_ = 1;
  int loop_depth_ = 0;
  std::set<std::string> macros_;
};

// ---- globals

Value range_fn(Args& a) {
  int64_t start = 0, stop, step = 1;
  if (a.pos.size() == 1) {
    stop = a.pos[0].as_int();
  } else if (a.pos.size() >= 2) {
    start = a.pos[0].as_int();
    stop = a.pos[1].as_int();
    if (a.pos.size() >= 3) step = a.pos[2].as_int();
  } else {
    throw RenderError("range() needs 1 to 3 arguments");
  }
  if (step == 0) throw RenderError("range() step must not be zero");
  Array out;
  for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
    if (out.size() > 100000) throw RenderError("range() too long");
    out.push_back(Value::integer(k));
  }
  return Value::array(std::move(out));
}

}  // namespace

struct Template::Impl {
  Body body;
};

Template::Template(std::string_view source, const TemplateOptions& opts) {
  auto impl = std::make_shared<Impl>();
  Parser p(lex(source, opts));
  impl->body = p.parse_all();
  impl_ = std::move(impl);
}

std::string Template::render(const nlohmann::ordered_json& context) const {
  Scope globals;
  globals.vars["raise_exception"] = Value::function([](Args& a) -> Value { throw RenderError(to_str(a.take(0, "message"))); });
  globals.vars["namespace"] = Value::function([](Args& a) {
    Value ns = Value::object();
    ns.is_namespace = true;
    for (auto& [k, v] : a.kw) ns.set(k, v);
    return ns;
  });
  globals.vars["dict"] = Value::function([](Args& a) {
    Value d = Value::object();
    for (auto& [k, v] : a.kw) d.set(k, v);
    return d;
  });
  globals.vars["range"] = Value::function(range_fn);
  globals.vars["strftime_now"] = Value::function([](Args& a) {
    const std::string f = to_str(a.take(0, "format"));
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    char buf[256];
    const size_t n = std::strftime(buf, sizeof buf, f.c_str(), &tm);
    return Value::str(std::string(buf, n));
  });
  if (!context.is_object() && !context.is_null()) throw RenderError("the template context must be a JSON object");
  Scope top{{}, &globals};
  if (context.is_object())
    for (auto it = context.begin(); it != context.end(); ++it) top.vars[it.key()] = from_json(it.value());
  Ctx c{&top, &top};  // macros see the render context
  std::string out;
  render_body(impl_->body, c, out);
  return out;
}

}  // namespace strata::chat
