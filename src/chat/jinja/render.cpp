// The Jinja renderer: evaluation of every expression node and rendering of every statement
// node of ast.h, and the top-level render with the globals and the context.
#include "chat/jinja/render.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "chat/jinja/builtins.h"

namespace strata::chat::jinja {

// ============================================================ expressions

Value Literal::eval(Ctx&) const { return v; }

Value Name::eval(Ctx& c) const {
  if (Value* v = c.scope->find(name)) return *v;
  return {};
}

Value ListLit::eval(Ctx& c) const {
  Array a;
  for (auto& e : items) a.push_back(e->eval(c));
  Value v = Value::array(std::move(a));
  v.is_tuple = tuple;
  return v;
}

Value DictLit::eval(Ctx& c) const {
  Value v = Value::object();
  for (auto& [k, e] : items) {
    Value key = k->eval(c);
    v.set(dict_key(key, line), e->eval(c));
  }
  return v;
}

Value Attr::eval(Ctx& c) const { return subscript(obj->eval(c), Value::str(name), line); }

Value Index::eval(Ctx& c) const { return subscript(obj->eval(c), idx->eval(c), line); }

Value Slice::eval(Ctx& c) const {
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
  if (o.t == Value::T::Arr)
    n = int64_t(o.a->size());
  else if (o.t == Value::T::Str)
    cps = code_points(o.s), n = int64_t(cps.size());
  else
    fail(line, fmt::format("'{}' object is not subscriptable", type_name(o)));
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
    if (o.t == Value::T::Arr)
      out.push_back((*o.a)[size_t(k)]);
    else
      str += cps[size_t(k)];
  }
  if (o.t == Value::T::Str) return Value::str(str);
  return Value::array(std::move(out));
}

Args CallArgs::eval(Ctx& c) const {
  Args a;
  for (auto& e : pos) a.pos.push_back(e->eval(c));
  for (auto& [k, e] : kw) a.kw.emplace_back(k, e->eval(c));
  return a;
}

Value Call::eval(Ctx& c) const {
  Value f = fn->eval(c);
  if (f.t != Value::T::Fn) fail(line, fmt::format("'{}' is not callable", type_name(f)));
  Args a = args.eval(c);
  return (*f.fn)(a);
}

Value MethodCall::eval(Ctx& c) const {
  Value o = obj->eval(c);
  if (o.undefined()) fail(line, fmt::format("cannot call '{}' on an undefined value", name));
  Args a = args.eval(c);
  return call_method(o, name, a, line);
}

Value Test::eval(Ctx& c) const {
  Value v = obj->eval(c);
  Args a = args.eval(c);
  return Value::boolean(run_test(name, v, a, line) != negated);
}

Value Filter::eval(Ctx& c) const {
  Value v = obj->eval(c);
  Args a = args.eval(c);
  return apply_filter(name, v, a, line);
}

Value Unary::eval(Ctx& c) const {
  Value v = e->eval(c);
  if (!v.numeric()) fail(line, fmt::format("bad operand type for unary {}: '{}'", op, type_name(v)));
  if (op == '+') return v.t == Value::T::Float ? v : Value::integer(v.as_int());
  return v.t == Value::T::Float ? Value::number(-v.f) : Value::integer(-v.as_int());
}

Value Binary::eval(Ctx& c) const {
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

Value Not::eval(Ctx& c) const { return Value::boolean(!truthy(e->eval(c))); }

Value Compare::eval(Ctx& c) const {
  Value l = first->eval(c);
  for (auto& [op, e] : rest) {
    Value r = e->eval(c);
    if (!truthy(compare_op(op, l, r, line))) return Value::boolean(false);
    l = std::move(r);
  }
  return Value::boolean(true);
}

Value CondExpr::eval(Ctx& c) const {
  if (truthy(cond->eval(c))) return then->eval(c);
  return otherwise ? otherwise->eval(c) : Value{};
}

// ============================================================ statements

void render_body(const Body& body, Ctx& c, std::string& out) {
  for (auto& n : body) {
    n->render(c, out);
    if (c.flow != Flow::Normal) return;
  }
}

void TextNode::render(Ctx&, std::string& out) const { out += text; }

void OutputNode::render(Ctx& c, std::string& out) const { out += to_str(e->eval(c)); }

void FilterBlockNode::render(Ctx& c, std::string& out) const {
  std::string text;
  render_body(body, c, text);
  Value v = Value::str(text);
  for (auto& [name, args] : filters) {
    Args a = args.eval(c);
    v = apply_filter(name, v, a, line);
  }
  out += to_str(v);
}

void IfNode::render(Ctx& c, std::string& out) const {
  for (auto& [cond, body] : branches)
    if (!cond || truthy(cond->eval(c))) {
      render_body(body, c, out);
      return;
    }
}

void Target::assign(Scope& s, const Value& v) const {
  if (names.size() == 1) {
    s.vars[names[0]] = v;
    return;
  }
  if (v.t != Value::T::Arr || v.a->size() != names.size())
    fail(line, fmt::format("cannot unpack {} into {} names", type_name(v), names.size()));
  for (size_t k = 0; k < names.size(); ++k) s.vars[names[k]] = (*v.a)[k];
}

void ForNode::render(Ctx& c, std::string& out) const {
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
    if (c.flow == Flow::Break) {
      c.flow = Flow::Normal;
      break;
    }
    c.flow = Flow::Normal;
  }
  c.scope = saved;
}

void SetNode::render(Ctx& c, std::string& out) const {
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
    if (!ns || !ns->is_namespace)
      fail(line, fmt::format("'{}' is not a namespace; cannot set '{}'", target.names[0], attr));
    ns->set(attr, v);
    return;
  }
  target.assign(*c.scope, v);
}

void ControlNode::render(Ctx& c, std::string&) const { c.flow = flow; }

namespace {

// Macro calls in progress on this thread (a render runs on one thread): a macro's closure sees
// the context it was defined in, not its caller's, so the nesting is counted here.
thread_local int g_macro_calls = 0;
constexpr int kMaxMacroCalls = 64;

struct MacroCall {
  explicit MacroCall(int line) {
    if (g_macro_calls >= kMaxMacroCalls)
      fail(line, fmt::format("macro recursion too deep (more than {} nested macro calls)", kMaxMacroCalls));
    ++g_macro_calls;
  }
  ~MacroCall() { --g_macro_calls; }
  MacroCall(const MacroCall&) = delete;
  MacroCall& operator=(const MacroCall&) = delete;
};

}  // namespace

void MacroNode::render(Ctx& c, std::string&) const {
  const MacroNode* self = this;
  Scope* globals = c.globals;
  c.scope->vars[name] = Value::function([self, globals](Args& a) {
    const MacroCall call(self->line);
    Scope scope{{}, globals};
    Ctx mc{&scope, globals};
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

// ============================================================ a whole template

std::string render(const Body& body, const nlohmann::ordered_json& context) {
  Scope globals;
  for (auto& [name, fn] : global_functions()) globals.vars[name] = fn;
  if (!context.is_object() && !context.is_null()) throw RenderError("the template context must be a JSON object");
  Scope top{{}, &globals};
  if (context.is_object())
    for (auto it = context.begin(); it != context.end(); ++it) top.vars[it.key()] = from_json(it.value());
  Ctx c{&top, &top};  // macros see the render context
  std::string out;
  render_body(body, c, out);
  return out;
}

}  // namespace strata::chat::jinja
