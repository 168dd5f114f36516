#pragma once
// The Jinja renderer: walks a parsed Body (ast.h) over scopes of variables.
//
// Internal to chat/jinja (the public entry point is chat/jinja.h).
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>

#include "chat/jinja/ast.h"

namespace strata::chat::jinja {

/// Variables of one level (the globals, the render context, a loop body, a macro call),
/// chained to the enclosing level.
struct Scope {
  std::unordered_map<std::string, Value> vars;
  Scope* parent = nullptr;
  /// The variable `n` of this scope or the nearest enclosing one that has it; null if none.
  Value* find(const std::string& n) {
    for (Scope* s = this; s; s = s->parent) {
      auto it = s->vars.find(n);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};

/// The state of one render: the innermost scope, the scope macros see, and a pending break or
/// continue. (Nested macro calls are capped at 64 per thread, against runaway recursion.)
struct Ctx {
  Scope* scope;
  Scope* globals;
  Flow flow = Flow::Normal;
};

/// Renders the nodes of `body` in order into `out`, stopping early at a break or continue.
void render_body(const Body& body, Ctx& c, std::string& out);

/// Renders `body` with the global functions (builtins.h) and the top-level variables of
/// `context` (a JSON object, or null for none). Throws RenderError, also when `context` is
/// neither.
std::string render(const Body& body, const nlohmann::ordered_json& context);

}  // namespace strata::chat::jinja
