#pragma once
// The Jinja lexer, in two stages: lex() cuts a template's source into text, {{ expression }}
// and {% statement %} segments, applying jinja2's whitespace rules (trim_blocks,
// lstrip_blocks, the - and + markers, the trailing newline); tokenize() cuts one tag's body
// into expression tokens.
//
// Internal to chat/jinja (the public entry point is chat/jinja.h).
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "chat/jinja.h"

namespace strata::chat::jinja {

/// A piece of the template: literal text, or the body of a {{ }} or {% %} tag (without the
/// delimiters and the -/+ markers). Comments produce no segment.
struct Segment {
  enum class K { Text, Expr, Stmt } k;
  std::string body;
  int line;  ///< 1-based line of the segment's start in the source
};

/// The segments of `raw` (line endings normalised to \n) under `opts`. Throws TemplateError
/// for an unclosed tag or comment.
std::vector<Segment> lex(std::string_view raw, const TemplateOptions& opts);

/// One expression token. Names include keywords (and, or, not, in, is, if, else, ...).
struct Tok {
  enum class K { Name, Int, Float, Str, Op, End } k;
  std::string s;  ///< the name, the operator, the literal's text (a string's decoded value)
  int64_t i = 0;  ///< the value of an Int
  double f = 0;   ///< the value of a Float
};

/// The tokens of a tag body `s`, ending with one End token. `line` is for error messages.
/// Throws TemplateError for an unexpected character, an unterminated string or a bad escape.
std::vector<Tok> tokenize(const std::string& s, int line);

}  // namespace strata::chat::jinja
