// chat/jinja.h's Template over the pieces in chat/jinja/: lexer.h cuts the source into
// segments, parser.h builds the tree of ast.h, render.h walks it over the values of value.h
// with the filters, tests and methods of builtins.h.
#include "chat/jinja.h"

#include "chat/jinja/lexer.h"
#include "chat/jinja/parser.h"
#include "chat/jinja/render.h"

namespace strata::chat {

struct Template::Impl {
  jinja::Body body;
};

Template::Template(std::string_view source, const TemplateOptions& opts) {
  auto impl = std::make_shared<Impl>();
  impl->body = jinja::parse(jinja::lex(source, opts));
  impl_ = std::move(impl);
}

std::string Template::render(const nlohmann::ordered_json& context) const {
  return jinja::render(impl_->body, context);
}

}  // namespace strata::chat
