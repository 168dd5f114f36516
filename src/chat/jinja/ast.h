#pragma once
// The Jinja syntax tree: expressions (Expr) and statements (Node), as the parser builds them
// and the renderer walks them. Each node evaluates or renders itself (render.cpp defines
// those members); every node is immutable after parsing, so one tree serves several threads.
//
// Internal to chat/jinja (the public entry point is chat/jinja.h).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chat/jinja/value.h"

namespace strata::chat::jinja {

struct Ctx;    // the render state (render.h)
struct Scope;  // variables (render.h)

/// What a loop body asks of its loop: go on, {% break %} or {% continue %}.
enum class Flow { Normal, Break, Continue };

// ---- expressions

/// An expression; eval() throws RenderError.
struct Expr {
  int line = 0;  ///< the template line, for error messages
  virtual ~Expr() = default;
  virtual Value eval(Ctx& c) const = 0;
};
using ExprP = std::unique_ptr<Expr>;

struct Literal : Expr {
  Value v;
  Value eval(Ctx&) const override;
};

/// A variable; undefined when no scope holds it.
struct Name : Expr {
  std::string name;
  Value eval(Ctx& c) const override;
};

/// [a, b] or (a, b).
struct ListLit : Expr {
  std::vector<ExprP> items;
  bool tuple = false;
  Value eval(Ctx& c) const override;
};

/// {k: v, ...}; keys must evaluate to strings.
struct DictLit : Expr {
  std::vector<std::pair<ExprP, ExprP>> items;
  Value eval(Ctx& c) const override;
};

/// obj.name
struct Attr : Expr {
  ExprP obj;
  std::string name;
  Value eval(Ctx& c) const override;
};

/// obj[idx]
struct Index : Expr {
  ExprP obj, idx;
  Value eval(Ctx& c) const override;
};

/// obj[start:stop:step] on a list or a string; absent parts are null.
struct Slice : Expr {
  ExprP obj, start, stop, step;
  Value eval(Ctx& c) const override;
};

/// The argument expressions of a call, method, filter or test.
struct CallArgs {
  std::vector<ExprP> pos;
  std::vector<std::pair<std::string, ExprP>> kw;
  Args eval(Ctx& c) const;
};

/// fn(args): a global function or a macro.
struct Call : Expr {
  ExprP fn;
  CallArgs args;
  Value eval(Ctx& c) const override;
};

/// A built-in named `name` applied to `obj` with `args`: the base of methods, tests, filters.
struct NamedOp : Expr {
  ExprP obj;
  std::string name;
  CallArgs args;
};

/// obj.name(args): a string or dict method (builtins.h).
struct MethodCall : NamedOp {
  Value eval(Ctx& c) const override;
};

/// obj is [not] name(args)
struct Test : NamedOp {
  bool negated = false;
  Value eval(Ctx& c) const override;
};

/// obj | name(args)
struct Filter : NamedOp {
  Value eval(Ctx& c) const override;
};

/// -e or +e
struct Unary : Expr {
  char op;
  ExprP e;
  Value eval(Ctx& c) const override;
};

/// l op r: and / or (short-circuit, returning an operand, as Python) or an arithmetic operator.
struct Binary : Expr {
  std::string op;
  ExprP l, r;
  Value eval(Ctx& c) const override;
};

struct Not : Expr {
  ExprP e;
  Value eval(Ctx& c) const override;
};

/// first op1 x1 op2 x2 ...: a chained comparison, true when every link holds.
struct Compare : Expr {
  ExprP first;
  std::vector<std::pair<std::string, ExprP>> rest;
  Value eval(Ctx& c) const override;
};

/// then if cond [else otherwise]; without else, undefined when cond is false.
struct CondExpr : Expr {
  ExprP then, cond, otherwise;
  Value eval(Ctx& c) const override;
};

// ---- statements

/// A statement or text; render() appends output to `out` and throws RenderError.
struct Node {
  virtual ~Node() = default;
  virtual void render(Ctx& c, std::string& out) const = 0;
};
using NodeP = std::unique_ptr<Node>;
using Body = std::vector<NodeP>;

struct TextNode : Node {
  std::string text;
  void render(Ctx&, std::string& out) const override;
};

/// {{ e }}
struct OutputNode : Node {
  ExprP e;
  void render(Ctx& c, std::string& out) const override;
};

/// if / elif / else: the first branch whose condition holds renders.
struct IfNode : Node {
  std::vector<std::pair<ExprP, Body>> branches;  // condition null = else
  void render(Ctx& c, std::string& out) const override;
};

/// The left side of for / set: one name, or several for tuple unpacking.
struct Target {
  std::vector<std::string> names;
  int line = 0;
  /// Binds the names in `s` to `v` (unpacked when there are several). Throws RenderError
  /// when `v` is not a list of that length.
  void assign(Scope& s, const Value& v) const;
};

/// for target in iter [if filter] ... [else ...] endfor, with the `loop` variable.
struct ForNode : Node {
  Target target;
  ExprP iter, filter;
  Body body, else_body;
  int line = 0;
  void render(Ctx& c, std::string& out) const override;
};

/// set target = value, set ns.attr = value, or a block set (value null, body rendered).
struct SetNode : Node {
  Target target;
  std::string attr;  // set ns.attr = ...
  ExprP value;       // null for a block set
  Body body;
  int line = 0;
  void render(Ctx& c, std::string& out) const override;
};

/// break / continue
struct ControlNode : Node {
  Flow flow;
  void render(Ctx& c, std::string&) const override;
};

/// macro name(params) ... endmacro: rendering it defines the function `name` in the scope.
struct MacroNode : Node {
  std::string name;
  std::vector<std::pair<std::string, ExprP>> params;  // default may be null
  Body body;
  int line = 0;
  void render(Ctx& c, std::string&) const override;
};

/// filter name(args) | name2 ... endfilter: the body's text through the filters, in order.
struct FilterBlockNode : Node {
  std::vector<std::pair<std::string, CallArgs>> filters;
  Body body;
  int line = 0;
  void render(Ctx& c, std::string& out) const override;
};

}  // namespace strata::chat::jinja
