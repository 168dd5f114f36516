// The value model's Python semantics: str()/repr(), truthiness, equality, json.dumps,
// subscripts, comparisons and arithmetic.
#include "chat/jinja/value.h"

#include "chat/json_depth.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

namespace strata::chat::jinja {

[[noreturn]] void fail(int line, const std::string& msg) { throw RenderError(fmt::format("line {}: {}", line, msg)); }

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

namespace {

Value from_json_at(const nlohmann::ordered_json& j, size_t depth);

}  // namespace

Value from_json(const nlohmann::ordered_json& j) { return from_json_at(j, 0); }

namespace {

// `j` converted, `depth` the arrays and objects around it. The conversion counts the depth as
// it recurses (the same count as json_depth) and stops past kMaxJsonDepth, so the recursion is
// bounded without a separate walk of the document first (the server has already walked the
// request body once in parse_body).
Value from_json_at(const nlohmann::ordered_json& j, size_t depth) {
  if (j.is_structured() && depth + 1 > kMaxJsonDepth)
    throw RenderError(fmt::format("a JSON value nested more than {} levels deep", kMaxJsonDepth));
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: return Value::integer(int64_t(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::str(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      Array a;
      for (auto& e : j) a.push_back(from_json_at(e, depth + 1));
      return Value::array(std::move(a));
    }
    case nlohmann::ordered_json::value_t::object: {
      Object o;
      for (auto it = j.begin(); it != j.end(); ++it) o.emplace_back(it.key(), from_json_at(it.value(), depth + 1));
      return Value::object(std::move(o));
    }
    default: return Value::none();
  }
}

}  // namespace

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

namespace {

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

}  // namespace

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
        out += (first ? "" : ", ") + repr(key_value(k)) + ": " + repr(e);
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

namespace {

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

}  // namespace

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
        // json.dumps writes the key 1 as "1" and None as "null"
        const Value key = key_value(items[k]->first);
        json_string(out, key.t == Value::T::None ? "null" : to_str(key));
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

namespace {

int64_t norm_index(int64_t idx, size_t n) { return idx < 0 ? idx + int64_t(n) : idx; }

}  // namespace

std::string dict_key(const Value& k, int line) {
  switch (k.t) {
    case Value::T::Str: return k.s;
    case Value::T::Int:
    case Value::T::Bool: return "\xff" + std::to_string(k.as_int());
    case Value::T::Float:
      if (std::isfinite(k.f) && k.f == std::floor(k.f) && std::abs(k.f) < 9e18)
        return "\xff" + std::to_string(int64_t(k.f));
      break;
    case Value::T::None: return "\xffN";
    default: break;
  }
  fail(line, fmt::format("dict keys of type '{}' are not supported", type_name(k)));
}

Value key_value(const std::string& k) {
  if (k.empty() || k[0] != '\xff') return Value::str(k);
  if (k == "\xffN") return Value::none();
  return Value::integer(std::stoll(k.substr(1)));
}

Value subscript(const Value& obj, const Value& key, int line) {
  if (obj.t == Value::T::Obj) {
    if (key.t == Value::T::Str) {
      const Value* v = obj.get(key.s);
      return v ? *v : Value{};
    }
    if (key.t != Value::T::Int && key.t != Value::T::Bool && key.t != Value::T::Float && key.t != Value::T::None)
      return {};
    const Value* v = obj.get(dict_key(key, line));
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

Value iterate_list(const Value& v, int line) {
  if (v.t == Value::T::Arr) return v;
  Array out;
  if (v.t == Value::T::Obj)
    for (auto& [k, e] : *v.o) out.push_back(key_value(k));
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
      if (l.t != Value::T::Str)
        fail(line, fmt::format("'in <string>' requires string as left operand, not {}", type_name(l)));
      hit = r.s.find(l.s) != std::string::npos;
    } else if (r.t == Value::T::Arr) {
      hit = std::any_of(r.a->begin(), r.a->end(), [&](const Value& e) { return equal(e, l); });
    } else if (r.t == Value::T::Obj) {
      hit = l.t == Value::T::Str ? r.get(l.s) != nullptr
                                 : (l.numeric() || l.t == Value::T::None) && r.get(dict_key(l, line)) != nullptr;
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

Value arith(const std::string& op, const Value& l, const Value& r, int line) {
  using T = Value::T;
  if (op == "~") return Value::str(to_str(l) + to_str(r));
  if (op == "+") {
    if (l.t == T::Str && r.t == T::Str) {
      if (!l.is_safe && !r.is_safe) return Value::str(l.s + r.s);
      // markupsafe: Markup + str escapes the str (and str + Markup likewise); the sum is Markup.
      auto esc = [](const Value& v) {
        if (v.is_safe) return v.s;
        std::string o;
        for (char c : v.s) switch (c) {
            case '&': o += "&amp;"; break;
            case '<': o += "&lt;"; break;
            case '>': o += "&gt;"; break;
            case '"': o += "&#34;"; break;
            case '\'': o += "&#39;"; break;
            default: o += c;
          }
        return o;
      };
      Value out = Value::str(esc(l) + esc(r));
      out.is_safe = true;
      return out;
    }
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
        if (l.t == T::Str)
          out.s += l.s;
        else
          out.a->insert(out.a->end(), l.a->begin(), l.a->end());
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

}  // namespace strata::chat::jinja
