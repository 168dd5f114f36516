#pragma once
// The Jinja interpreter's value model: Python-like values (None, bool, int, float, str,
// list/tuple, insertion-ordered dict, namespace, function) and the Python semantics the
// templates rely on: str() and repr(), truthiness, ==, comparisons and `in`, arithmetic,
// item/attribute access, iteration, and json.dumps as transformers' `tojson` calls it.
//
// Internal to chat/jinja (the public entry point is chat/jinja.h).
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "chat/jinja.h"

namespace strata::chat::jinja {

struct Value;
using Array = std::vector<Value>;
using Object = std::vector<std::pair<std::string, Value>>;  // insertion-ordered, like a Python dict
struct Args;
/// A callable value (a global such as range(), or a macro). Throws RenderError.
using Function = std::function<Value(Args&)>;

/// One value. `t` says which member holds it; lists, dicts and functions are shared by
/// reference (copying a Value copies the pointer, as Python copies a reference).
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
  /// A string marked `| safe` (jinja2's Markup): `+` with a plain string HTML-escapes the plain
  /// one (& < > " ' as markupsafe escapes them) and gives a safe string again.
  bool is_safe = false;

  static Value none() {
    Value v;
    v.t = T::None;
    return v;
  }
  static Value boolean(bool x) {
    Value v;
    v.t = T::Bool;
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v;
    v.t = T::Int;
    v.i = x;
    return v;
  }
  static Value number(double x) {
    Value v;
    v.t = T::Float;
    v.f = x;
    return v;
  }
  static Value str(std::string x) {
    Value v;
    v.t = T::Str;
    v.s = std::move(x);
    return v;
  }
  static Value array(Array x = {}) {
    Value v;
    v.t = T::Arr;
    v.a = std::make_shared<Array>(std::move(x));
    return v;
  }
  static Value object(Object x = {}) {
    Value v;
    v.t = T::Obj;
    v.o = std::make_shared<Object>(std::move(x));
    return v;
  }
  static Value function(Function fn) {
    Value v;
    v.t = T::Fn;
    v.fn = std::make_shared<Function>(std::move(fn));
    return v;
  }

  bool undefined() const { return t == T::Undef; }
  bool numeric() const { return t == T::Int || t == T::Float || t == T::Bool; }
  double as_double() const { return t == T::Float ? f : t == T::Int ? double(i) : b ? 1.0 : 0.0; }
  int64_t as_int() const { return t == T::Int ? i : t == T::Bool ? int64_t(b) : int64_t(f); }
  /// The entry `key` of a dict; null when absent or when this is not a dict.
  const Value* get(std::string_view key) const {
    if (t != T::Obj) return nullptr;
    for (auto& [k, v] : *o)
      if (k == key) return &v;
    return nullptr;
  }
  /// Sets (or appends, keeping insertion order) the entry `key` of a dict.
  void set(const std::string& key, Value v) {
    for (auto& [k, old] : *o)
      if (k == key) {
        old = std::move(v);
        return;
      }
    o->emplace_back(key, std::move(v));
  }
};

/// The arguments of a call: positional, then keyword (in call order).
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

/// Throws RenderError("line L: msg").
[[noreturn]] void fail(int line, const std::string& msg);

/// Python's type name of `v` ("int", "list", "tuple", "dict", "Namespace", ...).
const char* type_name(const Value& v);
/// The Value of a JSON document (objects keep their key order). Throws RenderError when it
/// nests deeper than chat::kMaxJsonDepth (chat/json_depth.h).
Value from_json(const nlohmann::ordered_json& j);

// ---- strings: Python counts code points, these helpers work on UTF-8 bytes

/// The UTF-8 code points of `s`, one string each (a malformed lead byte counts as one).
std::vector<std::string> code_points(const std::string& s);
/// Python's str.isspace() for one ASCII character.
bool is_space(char c);
/// str.strip/lstrip/rstrip: removes characters of `chars` (a string) or, when `chars` is not a
/// string, whitespace, from the left and/or right end.
std::string strip_chars(const std::string& s, const Value& chars, bool left, bool right);

// ---- Python semantics

/// Python's repr() of a float (shortest round-trip digits, "1e-05", "inf", "nan").
std::string float_repr(double d);
/// Python's str(): what {{ v }} prints (undefined prints nothing).
std::string to_str(const Value& v);
/// Python's repr(): strings quoted, lists/tuples/dicts with their items' repr.
std::string repr(const Value& v);
/// Python's bool(v); undefined is false, a namespace is always true.
bool truthy(const Value& v);
/// Python's ==: numbers across int/float/bool, lists and dicts element-wise, functions by identity.
bool equal(const Value& x, const Value& y);
/// json.dumps(v, ensure_ascii=False, indent=indent (< 0: none), sort_keys=sort_keys) appended
/// to `out`, nested `depth` levels deep. Throws RenderError for values JSON cannot hold.
void to_json(std::string& out, const Value& v, int indent, bool sort_keys, int depth);

/// A dict key as Object stores it: a string is itself; an int, a bool or an integral float
/// (Python hashes 1, True and 1.0 alike) is "\xff" + its decimal digits; None is "\xffN". A
/// string key never starts with the byte 0xff (templates and JSON are valid UTF-8), so the two
/// never collide. Throws RenderError for other types (Python: unhashable, or not supported here).
std::string dict_key(const Value& k, int line);
/// The key of an Object entry as a Value (inverse of dict_key: int, None or str).
Value key_value(const std::string& k);

/// obj[key] (also obj.key): dict entry, list item or string code point (negative indices count
/// from the end); undefined when absent. Throws RenderError on undefined / None objects and
/// non-integer list indices.
Value subscript(const Value& obj, const Value& key, int line);
/// `v` as a list for iteration: a list itself, a dict's keys, a string's code points, an
/// undefined value as []. Throws RenderError for other types.
Value iterate_list(const Value& v, int line);
/// The value at a dotted path ("a.b.0") below `v`, as map(attribute=...) reads it.
Value attr_path(const Value& v, const std::string& path, int line);
/// l op r for op in ==, !=, <, <=, >, >=, in, not in (a bool Value). Throws RenderError for
/// types Python cannot compare.
Value compare_op(const std::string& op, const Value& l, const Value& r, int line);
/// l op r for op in ~ + - * / // % ** (Python's int/float rules: // and % floor). Throws
/// RenderError for unsupported operand types and division by zero.
Value arith(const std::string& op, const Value& l, const Value& r, int line);

}  // namespace strata::chat::jinja
