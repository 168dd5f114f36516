#pragma once
// The Jinja built-ins: filters (x | f), tests (x is t), string and dict methods (s.strip()),
// and the global functions (raise_exception, namespace, dict, range, strftime_now). The
// parser checks names against the k* sets, so an unsupported one fails at parse time.
//
// Internal to chat/jinja (the public entry point is chat/jinja.h).
#include <set>
#include <string>

#include "chat/jinja/value.h"

namespace strata::chat::jinja {

extern const std::set<std::string> kFilters;  ///< filter names apply_filter knows
extern const std::set<std::string> kTests;    ///< test names run_test knows (also ==, <, ...)
extern const std::set<std::string> kMethods;  ///< method names call_method knows
extern const std::set<std::string> kGlobals;  ///< the functions of global_functions()

/// `v | name(a)`. Throws RenderError for wrong argument types and an unknown name.
Value apply_filter(const std::string& name, const Value& v, Args& a, int line);
/// `v is name(a)`. Throws RenderError for wrong argument types and an unknown name.
bool run_test(const std::string& name, const Value& v, Args& a, int line);
/// `o.name(a)`: str methods on strings, items/keys/values/get on dicts, and a function
/// stored in a dict (or namespace) under `name`. Throws RenderError when `o` has no such method.
Value call_method(const Value& o, const std::string& name, Args& a, int line);

/// The global functions, by name, fresh for one render. raise_exception throws RenderError
/// with the template's message; strftime_now formats the local time.
Object global_functions();

}  // namespace strata::chat::jinja
