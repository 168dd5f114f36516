// The Jinja parser: statements by keyword, expressions by precedence (or, and, not,
// comparisons, + -, ~, * / // %, **, unary, postfix, filters and tests, primaries).
#include "chat/jinja/parser.h"

#include <fmt/format.h>

#include <set>
#include <string>

#include "chat/jinja/builtins.h"

namespace strata::chat::jinja {

namespace {

class Parser {
 public:
  explicit Parser(std::vector<Segment> segs) : segs_(std::move(segs)) {}

  Body parse_all() {
    Body body = parse_body({});
    if (seg_ < segs_.size())
      throw TemplateError(fmt::format("line {}: unexpected '{}'", segs_[seg_].line, first_word(segs_[seg_])));
    // A call may name a macro defined further down the file (it runs after the definition).
    for (auto& [name, line] : calls_)
      if (!kGlobals.count(name) && !macros_.count(name))
        throw TemplateError(
            fmt::format("line {}: unsupported function '{}()' (supported: {}, and the "
                        "template's macros)",
                        line, name, fmt::join(kGlobals, ", ")));
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
      if (kw == "if")
        body.push_back(parse_if());
      else if (kw == "for")
        body.push_back(parse_for());
      else if (kw == "set")
        body.push_back(parse_set());
      else if (kw == "macro")
        body.push_back(parse_macro());
      else if (kw == "filter") {
        auto n = std::make_unique<FilterBlockNode>();
        n->line = line_;
        for (;;) {
          std::string name = expect_name();
          if (!kFilters.count(name))
            throw TemplateError(fmt::format("line {}: unsupported filter '{}' (supported: {})", line_, name,
                                            fmt::join(kFilters, ", ")));
          CallArgs args;
          if (peek_op("(")) args = parse_call_args();
          n->filters.emplace_back(std::move(name), std::move(args));
          if (!peek_op("|")) break;
          ++p_;
        }
        expect_end();
        n->body = parse_body({"endfilter"});
        take_stmt();
        expect_end();
        body.push_back(std::move(n));
      } else if (kw == "generation") {
        // transformers' assistant-mask tag: its body renders as it is.
        expect_end();
        auto n = std::make_unique<IfNode>();
        n->branches.emplace_back(nullptr, parse_body({"endgeneration"}));
        take_stmt();
        expect_end();
        body.push_back(std::move(n));
      } else if (kw == "break" || kw == "continue") {
        if (loop_depth_ == 0) throw TemplateError(fmt::format("line {}: '{}' outside a loop", line_, kw));
        expect_end();
        auto n = std::make_unique<ControlNode>();
        n->flow = kw == "break" ? Flow::Break : Flow::Continue;
        body.push_back(std::move(n));
      } else if (kw == "elif" || kw == "else" || kw.rfind("end", 0) == 0) {
        throw TemplateError(fmt::format("line {}: unexpected '{}'", line_, kw));
      } else {
        throw TemplateError(
            fmt::format("line {}: unsupported tag '{}' (supported: if, for, set, macro, break, "
                        "continue, filter, generation)",
                        line_, kw));
      }
    }
    if (!stop.empty()) throw TemplateError(fmt::format("unexpected end of template: missing '{}'", *stop.rbegin()));
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
    if (cur().k != Tok::K::Name)
      throw TemplateError(fmt::format("line {}: expected a name, found '{}'", line_, describe()));
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
        if (!a.kw.empty())
          throw TemplateError(fmt::format("line {}: positional argument after keyword argument", line_));
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
        if (cur().k == Tok::K::Int)
          name = toks_[p_++].s;
        else
          name = expect_name();
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
        calls_.emplace_back(nm->name, line_);  // checked once all macros are known
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
        if (cur().k == Tok::K::Name || (cur().k == Tok::K::Op && kTests.count(cur().s)))
          t->name = toks_[p_++].s;
        else
          throw TemplateError(fmt::format("line {}: expected a test name after 'is'", line_));
        if (!kTests.count(t->name))
          throw TemplateError(
              fmt::format("line {}: unsupported test '{}' (supported: {})", line_, t->name, fmt::join(kTests, ", ")));
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
        if (t.s == "true" || t.s == "True")
          l->v = Value::boolean(true);
        else if (t.s == "false" || t.s == "False")
          l->v = Value::boolean(false);
        else if (t.s == "none" || t.s == "None")
          l->v = Value::none();
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
  std::vector<std::pair<std::string, int>> calls_;  // (function name, line) of every call
};

}  // namespace

Body parse(std::vector<Segment> segments) { return Parser(std::move(segments)).parse_all(); }

}  // namespace strata::chat::jinja
