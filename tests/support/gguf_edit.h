#pragma once
// Copies of a GGUF file with tensors dropped, reshaped, added or keys changed (through
// gguf::Writer), for tests of malformed files and of options a fixture does not carry.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gguf/gguf.h"

namespace strata::test {

struct GgufEdit {
  std::vector<std::string> drop;  ///< tensors to leave out
  std::string reshape;            ///< tensor to give shape `ne` (data cut or zero-padded)
  std::vector<uint64_t> ne;
  /// tensors to add: (new name, name of the tensor whose bytes and type it copies); shape of the source
  std::vector<std::pair<std::string, std::string>> copies;
  std::vector<std::pair<std::string, gguf::Value>> set_kv;  ///< keys to set (replaced in place, or appended)
};

/// Writes the edited copy of `src` to a temporary file named after `tag` and returns its path
/// (the caller removes it).
std::string write_edited_gguf(const std::string& src, const GgufEdit& ed, const std::string& tag);

/// Loads `path` on a one-thread CPU backend; returns the ModelError's message, or "<no exception>".
std::string model_load_error(const std::string& path);

/// write_edited_gguf + model_load_error, removing the file.
std::string edited_load_error(const std::string& src, const GgufEdit& ed, const std::string& tag);

}  // namespace strata::test
