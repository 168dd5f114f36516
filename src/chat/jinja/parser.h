#pragma once
// The Jinja parser: recursive descent from lexer segments to the syntax tree of ast.h.
//
// Internal to chat/jinja (the public entry point is chat/jinja.h).
#include <vector>

#include "chat/jinja/ast.h"
#include "chat/jinja/lexer.h"

namespace strata::chat::jinja {

/// The statements of a whole template, from its segments (lex()). Throws TemplateError, naming
/// the line, for a syntax error, a tag without its end tag, and an unsupported tag, filter,
/// test, method or function (so an unsupported template fails when it is loaded).
Body parse(std::vector<Segment> segments);

}  // namespace strata::chat::jinja
