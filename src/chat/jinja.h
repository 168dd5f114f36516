#pragma once
// A small Jinja2 interpreter for chat templates (tokenizer.chat_template in GGUF files).
//
// Debian 12 ships no C++ Jinja library, so this implements the subset real chat templates
// use, with the semantics of Python's jinja2 as Hugging Face transformers configures it for
// apply_chat_template: trim_blocks and lstrip_blocks on, the loopcontrols extension
// (break/continue), an immutable sandbox (lists cannot be mutated), `tojson` as
// json.dumps(x, ensure_ascii=False), and the globals raise_exception and strftime_now.
//
// Supported:
//  - tags: if/elif/else, for (tuple targets, `if` filter, else, loop.index/index0/revindex/
//    revindex0/first/last/length/previtem/nextitem), set (name, ns.attr, block set), macro
//    (positional and keyword arguments with defaults), break, continue; comments;
//    whitespace control with - and +.
//  - expressions: literals (strings, ints, floats, true/false/none, lists, tuples, dicts),
//    attribute and item access, slices, calls with keyword arguments, unary - and +,
//    ** * / // % + - ~, comparisons (chained), in / not in, and / or / not, `x if c else y`,
//    filters (x | f(args)) and tests (x is [not] t(args)).
//  - filters, tests, string/dict methods and globals: see kFilters, kTests, kMethods and
//    kGlobals in jinja/builtins.h.
// Anything else (an unknown tag, filter, test, method or function) is a TemplateError when
// the template is parsed, so an unsupported template fails at load time, not per request.
//
// The implementation lives in chat/jinja/: value.h (the Python-like value model), lexer.h,
// ast.h and parser.h (the syntax tree), render.h (the tree-walking renderer) and builtins.h
// (filters, tests, methods, globals). Callers need only this header.
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>

namespace strata::chat {

/// A syntax error or an unsupported construct, found when parsing. The message names the
/// construct and the template line.
class TemplateError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// An error while rendering: a type error, an undefined value used where one is needed, or
/// the template's own raise_exception("...") (then the message is the template's text).
class RenderError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The jinja2 Environment options that change how a template's whitespace is lexed.
struct TemplateOptions {
  bool trim_blocks = true;             ///< drop the first newline after a block tag
  bool lstrip_blocks = true;           ///< strip spaces/tabs before a block tag at line start
  bool keep_trailing_newline = false;  ///< jinja2's default: drop one trailing newline
};

/// A parsed template; immutable and safe to render from several threads at once.
class Template {
 public:
  /// Parses `source`. Throws TemplateError for syntax errors and unsupported constructs.
  explicit Template(std::string_view source, const TemplateOptions& opts = {});
  /// Renders with the top-level variables of `context` (a JSON object). Throws RenderError.
  std::string render(const nlohmann::ordered_json& context) const;

  struct Impl;  ///< the parsed tree (jinja.cpp)

 private:
  std::shared_ptr<const Impl> impl_;
};

}  // namespace strata::chat
