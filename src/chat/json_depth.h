#pragma once
// How deeply a JSON value nests, found without recursion: the check that keeps a hostile
// document (a request body, --messages, a template's fromjson) out of the recursive code that
// converts and renders values, whose stack it would otherwise exhaust.
#include <cstddef>
#include <utility>
#include <vector>

namespace strata::chat {

/// The deepest JSON nesting that strata converts (request bodies, chat messages, templates):
/// real requests nest a few levels; 256 is far above them and far below what a thread's stack holds.
inline constexpr size_t kMaxJsonDepth = 256;

/// Nesting depth of `root` (any nlohmann basic_json): 0 for a scalar, 1 for [] or {} of scalars,
/// 1 + the deepest child otherwise. Iterative (an explicit stack), so any depth is safe to measure.
template <class Json>
size_t json_depth(const Json& root) {
  std::vector<std::pair<const Json*, size_t>> todo{{&root, 0}};
  size_t deepest = 0;
  while (!todo.empty()) {
    const auto [node, depth] = todo.back();
    todo.pop_back();
    if (!node->is_structured()) continue;
    if (depth + 1 > deepest) deepest = depth + 1;
    for (const auto& child : *node) todo.emplace_back(&child, depth + 1);
  }
  return deepest;
}

}  // namespace strata::chat
