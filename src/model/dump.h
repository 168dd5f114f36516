#pragma once
// --dump DIR --dump-filter REGEX: the named intermediates of a run written to files, so two
// backends or two settings can be compared tensor by tensor (tools/dump_diff.py, or cmp).
//
// Each forward call is numbered from 0; a tensor named N (e.g. "attn_norm-3", "ffn_moe_out-7",
// "result_output"; the names are listed in docs/architecture.md) offered during call C and
// matching the filter is written to DIR/C-N.f32 (C zero-padded to 5 digits) as raw
// little-endian fp32, ne[0] contiguous, and one line "C-N.f32<TAB>N<TAB>C<TAB>ne0<TAB>ne1" is
// appended to DIR/index.tsv. Two runs of the same prompt with the same chunking give files
// that can be compared byte for byte. DIR/calls.tsv has one line "C<TAB>PHASE<TAB>IDS" per forward
// call (PHASE prefill or decode, as the engine counts them, so a reader can tell decode steps from
// one-token prompt chunks; IDS the call's token ids, comma-separated, sequences in batch order).
//
// Besides the tensors, each MoE layer L offers "ffn_moe_route-L": ne0 = 2 K + 1, ne1 = T tokens;
// per token the K chosen expert ids (as exact floats, in selection order), their router
// probabilities (the original ones, also with MoCE), and the largest probability not chosen
// (model::RoutingTrace's fields), so `strata route-parity --dump-a/--dump-b` can compare routing
// from two dump directories.
#include <cstdint>
#include <cstdio>
#include <regex>
#include <span>
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

  /// Starts the next forward call (the first is 0) and records its phase and token ids in
  /// DIR/calls.tsv. Throws std::runtime_error on a write error.
  void begin_call(std::span<const int32_t> ids);
  /// The phase the following forward calls belong to ("prefill" or "decode"; set by the engine).
  void set_phase(std::string phase) { phase_ = std::move(phase); }
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
  std::string phase_ = "prefill";
  std::FILE* index_ = nullptr;
  std::FILE* calls_ = nullptr;
  int64_t call_ = -1;
  int64_t written_ = 0;
};

}  // namespace strata::model
