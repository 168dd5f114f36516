#pragma once
// --dump DIR --dump-filter REGEX: the named intermediates of a run written to files, so two
// backends or two settings can be compared tensor by tensor (tools/dump_diff.py, or cmp).
//
// Each forward call is numbered from 0; a tensor named N (e.g. "attn_norm-3", "ffn_moe_out-7",
// "result_output"; the names are listed in docs/architecture.md) offered during call C and
// matching the filter is written to DIR/C-N.f32 (C zero-padded to 5 digits) as raw
// little-endian fp32, ne[0] contiguous, and one line "C-N.f32<TAB>N<TAB>C<TAB>ne0<TAB>ne1" is
// appended to DIR/index.tsv. Two runs of the same prompt with the same chunking give files
// that can be compared byte for byte.
#include <cstdint>
#include <cstdio>
#include <regex>
#include <string>
#include <vector>

namespace strata::model {

class Dumper {
 public:
  /// Creates DIR (and parents) and truncates DIR/index.tsv. `filter` is an ECMAScript regex
  /// matched against the whole name ("" = every tensor). Throws std::runtime_error when DIR
  /// cannot be created or written, std::regex_error for a bad filter.
  Dumper(std::string dir, const std::string& filter);
  ~Dumper();
  Dumper(const Dumper&) = delete;
  Dumper& operator=(const Dumper&) = delete;

  /// Starts the next forward call (the first is 0).
  void begin_call() { ++call_; }
  /// Whether a tensor of this name would be written.
  bool wants(const std::string& name) const;
  /// Writes `values` (ne0 x ne1 floats, ne0 contiguous) as `name` of the current call.
  /// Throws std::runtime_error on a write error.
  void write(const std::string& name, const std::vector<float>& values, int64_t ne0, int64_t ne1);
  /// Tensors written so far.
  int64_t written() const { return written_; }

 private:
  std::string dir_;
  bool all_ = true;
  std::regex filter_;
  std::FILE* index_ = nullptr;
  int64_t call_ = -1;
  int64_t written_ = 0;
};

}  // namespace strata::model
