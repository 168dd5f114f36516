#pragma once
// Catching the error a call is expected to throw, to match its message.
#include <string>

namespace strata::test {

/// Calls `f` and returns the what() of the E it throws, or "<no exception>" when it returns.
/// Exceptions of other types propagate (the test then fails with their message).
template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no exception>";
}

}  // namespace strata::test
