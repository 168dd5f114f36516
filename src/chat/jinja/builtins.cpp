// The Jinja built-ins: filters, tests, string/dict methods and global functions, with the
// semantics of Python's str methods and jinja2's filters and tests.
#include "chat/jinja/builtins.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <ctime>
#include <unordered_map>

namespace strata::chat::jinja {

const std::set<std::string> kGlobals = {"raise_exception", "namespace", "range", "strftime_now", "dict"};

namespace {

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

// ---- string / dict methods

const std::set<std::string> kMethods = {"strip", "lstrip", "rstrip",     "split",   "startswith", "endswith", "upper",
                                        "lower", "title",  "capitalize", "replace", "find",       "count",    "join",
                                        "items", "keys",   "values",     "get",     "append",     "pop",      "format"};

namespace {

// Python's str.format(*args, **kwargs) for replacement fields {}, {0}, {name}, each optionally
// with !s or !r; {{ and }} are literal braces. Format specs (":...") and attribute or index
// access inside a field are refused with a RenderError naming them.
std::string str_format(const std::string& s, Args& a, int line) {
  std::string out;
  size_t next_auto = 0;
  bool manual = false, automatic = false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '}') {
      if (i + 1 < s.size() && s[i + 1] == '}') {
        out += '}';
        ++i;
        continue;
      }
      fail(line, "str.format: single '}' encountered in format string");
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < s.size() && s[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    const size_t end = s.find('}', i + 1);
    if (end == std::string::npos) fail(line, "str.format: single '{' encountered in format string");
    std::string field = s.substr(i + 1, end - i - 1);
    i = end;
    char conv = 's';
    if (auto bang = field.find('!'); bang != std::string::npos) {
      if (bang + 2 != field.size() || (field[bang + 1] != 's' && field[bang + 1] != 'r'))
        fail(line, fmt::format("str.format: unsupported conversion in '{{{}}}'", field));
      conv = field[bang + 1];
      field.resize(bang);
    }
    if (field.find_first_of(":.[") != std::string::npos)
      fail(line, fmt::format("str.format: format specs and attribute access ('{{{}}}') are not supported", field));
    Value v;
    if (field.empty()) {
      if (manual) fail(line, "str.format: cannot switch from manual field numbering to automatic");
      automatic = true;
      if (next_auto >= a.pos.size()) fail(line, "str.format: not enough positional arguments");
      v = a.pos[next_auto++];
    } else if (std::all_of(field.begin(), field.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
      if (automatic) fail(line, "str.format: cannot switch from automatic field numbering to manual");
      manual = true;
      const size_t k = std::stoul(field);
      if (k >= a.pos.size()) fail(line, fmt::format("str.format: no positional argument {}", k));
      v = a.pos[k];
    } else {
      auto it = std::find_if(a.kw.begin(), a.kw.end(), [&](const auto& kv) { return kv.first == field; });
      if (it == a.kw.end()) fail(line, fmt::format("str.format: no keyword argument '{}'", field));
      v = it->second;
    }
    out += conv == 'r' ? repr(v) : to_str(v);
  }
  return out;
}

}  // namespace

Value call_method(const Value& o, const std::string& name, Args& a, int line) {
  if (o.t == Value::T::Str) {
    const std::string& s = o.s;
    if (name == "strip") return Value::str(strip_chars(s, a.take(0, "chars"), true, true));
    if (name == "lstrip") return Value::str(strip_chars(s, a.take(0, "chars"), true, false));
    if (name == "rstrip") return Value::str(strip_chars(s, a.take(0, "chars"), false, true));
    if (name == "format") return Value::str(str_format(s, a, line));
    if (name == "split") {
      Value ms = a.take(1, "maxsplit", Value::integer(-1));
      return split(s, a.take(0, "sep", Value::none()), ms.as_int(), line);
    }
    if (name == "startswith" || name == "endswith") {
      Value arg = a.take(0, "prefix");
      std::vector<std::string> cands;
      if (arg.t == Value::T::Str)
        cands.push_back(arg.s);
      else if (arg.t == Value::T::Arr)
        for (auto& e : *arg.a) {
          if (e.t != Value::T::Str) fail(line, name + "() tuple must hold strings");
          cands.push_back(e.s);
        }
      else
        fail(line, fmt::format("{}() argument must be str or a tuple of str, not {}", name, type_name(arg)));
      for (auto& x : cands) {
        const bool hit = name == "startswith"
                             ? s.compare(0, x.size(), x) == 0
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
  } else if (o.t == Value::T::Arr && name == "append") {
    // Lists are shared by reference, so the append shows through every name bound to it
    // (Python's list.append; jinja2's immutable sandbox refuses it, llama.cpp's engine allows it).
    if (o.is_tuple) fail(line, "'tuple' object has no attribute 'append'");
    o.a->push_back(a.take(0, "object"));
    return Value::none();
  } else if (o.t == Value::T::Arr && name == "pop") {  // Python's list.pop([index])
    if (o.is_tuple) fail(line, "'tuple' object has no attribute 'pop'");
    if (o.a->empty()) fail(line, "pop from empty list");
    const Value idx = a.take(0, "index", Value::integer(-1));
    if (idx.t != Value::T::Int) fail(line, "pop() index must be an integer");
    const int64_t n = int64_t(o.a->size()), k = idx.i < 0 ? idx.i + n : idx.i;
    if (k < 0 || k >= n) fail(line, "pop index out of range");
    Value v = (*o.a)[size_t(k)];
    o.a->erase(o.a->begin() + k);
    return v;
  } else if (o.t == Value::T::Obj && !o.is_namespace) {
    if (name == "items") {
      Array out;
      for (auto& [k, v] : *o.o) {
        Value t = Value::array({key_value(k), v});
        t.is_tuple = true;
        out.push_back(t);
      }
      return Value::array(std::move(out));
    }
    if (name == "keys" || name == "values") {
      Array out;
      for (auto& [k, v] : *o.o) out.push_back(name == "keys" ? key_value(k) : v);
      return Value::array(std::move(out));
    }
    if (name == "get") {
      Value key = a.take(0, "key");
      const Value* v = key.t == Value::T::Str                     ? o.get(key.s)
                       : key.numeric() || key.t == Value::T::None ? o.get(dict_key(key, line))
                                                                  : nullptr;
      return v ? *v : a.take(1, "default", Value::none());
    }
  }
  if (o.t == Value::T::Obj) {
    if (const Value* v = o.get(name); v && v->t == Value::T::Fn) return (*v->fn)(a);
  }
  fail(line, fmt::format("'{}' object has no method '{}'", type_name(o), name));
}

// ---- tests (`x is name`)

const std::set<std::string> kTests = {"defined",  "undefined", "none",    "boolean", "true",        "false",
                                      "string",   "number",    "integer", "float",   "mapping",     "iterable",
                                      "sequence", "callable",  "even",    "odd",     "divisibleby", "eq",
                                      "equalto",  "==",        "ne",      "!=",      "lt",          "<",
                                      "le",       "<=",        "gt",      ">",       "ge",          ">=",
                                      "in",       "lower",     "upper",   "sameas"};

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
  static const std::unordered_map<std::string, std::string> ops = {{"eq", "=="}, {"equalto", "=="}, {"==", "=="},
                                                                   {"ne", "!="}, {"!=", "!="},      {"lt", "<"},
                                                                   {"<", "<"},   {"le", "<="},      {"<=", "<="},
                                                                   {"gt", ">"},  {">", ">"},        {"ge", ">="},
                                                                   {">=", ">="}, {"in", "in"}};
  auto it = ops.find(name);
  if (it != ops.end()) return truthy(compare_op(it->second, v, a.take(0, "other"), line));
  fail(line, "unknown test '" + name + "'");
}

// ---- filters

const std::set<std::string> kFilters = {"trim",       "length",     "count",   "tojson",   "upper",     "lower",
                                        "title",      "capitalize", "default", "d",        "join",      "first",
                                        "last",       "list",       "string",  "int",      "float",     "abs",
                                        "round",      "replace",    "items",   "dictsort", "reverse",   "selectattr",
                                        "rejectattr", "select",     "reject",  "map",      "indent",    "safe",
                                        "unique",     "sum",        "min",     "max",      "from_json", "sort"};

Value apply_filter(const std::string& name, const Value& v, Args& a, int line) {
  using T = Value::T;
  if (name == "safe") {
    if (v.t != T::Str) return v;
    Value out = v;
    out.is_safe = true;
    return out;
  }
  if (name == "from_json") {
    // Not a jinja2 builtin (templates use it on tool-call arguments given as JSON text): the
    // value of a JSON text, as json.loads gives it.
    if (v.t != T::Str) fail(line, fmt::format("from_json needs a string, not {}", type_name(v)));
    try {
      return from_json(nlohmann::ordered_json::parse(v.s));
    } catch (const nlohmann::json::parse_error& e) {
      fail(line, fmt::format("from_json: invalid JSON: {}", e.what()));
    }
  }
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
      } catch (const std::exception&) {}
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
      } catch (const std::exception&) {}
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
  if (name == "sort") {
    // jinja2's sort(value, reverse=False, case_sensitive=False, attribute=None): Python's sorted()
    // (stable, also with reverse) by the item, or by its attribute(s) ("a.b", or "x,y" for a
    // tuple of them), strings lower-cased unless case_sensitive.
    Value seq = iterate_list(v, line);
    const bool rev = truthy(a.take(0, "reverse", Value::boolean(false)));
    const bool cs = truthy(a.take(1, "case_sensitive", Value::boolean(false)));
    const Value attr = a.take(2, "attribute", Value::none());
    std::vector<std::string> attrs;
    if (attr.t != T::None && !attr.undefined()) {
      const std::string spec = to_str(attr);
      for (size_t b = 0;;) {
        const size_t e = spec.find(',', b);
        attrs.push_back(spec.substr(b, e == std::string::npos ? std::string::npos : e - b));
        if (e == std::string::npos) break;
        b = e + 1;
      }
    }
    auto fold = [&](Value x) {
      return x.t == T::Str && !cs ? Value::str(ascii_map(x.s, [](int ch) { return std::tolower(ch); })) : x;
    };
    auto key = [&](const Value& e) {
      std::vector<Value> k;
      if (attrs.empty()) k.push_back(fold(e));
      for (auto& at : attrs) k.push_back(fold(attr_path(e, at, line)));
      return k;
    };
    std::vector<std::pair<std::vector<Value>, Value>> keyed;
    for (auto& e : *seq.a) keyed.emplace_back(key(e), e);
    auto less = [&](const std::vector<Value>& x, const std::vector<Value>& y) {
      for (size_t i = 0; i < x.size(); ++i) {
        if (equal(x[i], y[i])) continue;
        return truthy(compare_op("<", x[i], y[i], line));
      }
      return false;
    };
    std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
      return rev ? less(y.first, x.first) : less(x.first, y.first);
    });
    Array out;
    for (auto& [k, e] : keyed) out.push_back(e);
    return Value::array(std::move(out));
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
    if (!truthy(v)) return Value::array();  // jinja2: `if value:` first, so None selects nothing
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
    if (!truthy(v)) return Value::array();  // jinja2: `if value:` first, so None maps to nothing
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

// ---- globals

Object global_functions() {
  Object g;
  g.emplace_back("raise_exception",
                 Value::function([](Args& a) -> Value { throw RenderError(to_str(a.take(0, "message"))); }));
  g.emplace_back("namespace", Value::function([](Args& a) {
                   Value ns = Value::object();
                   ns.is_namespace = true;
                   for (auto& [k, v] : a.kw) ns.set(k, v);
                   return ns;
                 }));
  g.emplace_back("dict", Value::function([](Args& a) {
                   Value d = Value::object();
                   for (auto& [k, v] : a.kw) d.set(k, v);
                   return d;
                 }));
  g.emplace_back("range", Value::function(range_fn));
  g.emplace_back("strftime_now", Value::function([](Args& a) {
                   const std::string f = to_str(a.take(0, "format"));
                   std::time_t now = std::time(nullptr);
                   std::tm tm{};
                   localtime_r(&now, &tm);
                   char buf[256];
                   const size_t n = std::strftime(buf, sizeof buf, f.c_str(), &tm);
                   return Value::str(std::string(buf, n));
                 }));
  return g;
}

}  // namespace strata::chat::jinja
