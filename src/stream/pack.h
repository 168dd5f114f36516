#pragma once
// Pack: a sidecar file (default MODEL.gguf.strata-pack) in which each routed expert's gate, up
// and down slices are one contiguous, 4 KiB-aligned record, so the expert stream fetches a
// whole expert with one read instead of three (the GGUF keeps each part in its own tensor).
//
// Layout (little-endian):
//   [header, padded to a 4 KiB multiple]
//     0  char[8] magic "STRAPACK"      8  u32 version (2)       12 u32 header_bytes
//    16  u64 source file size         24  i64 source mtime (ns) 32  u64 source header hash
//    40  u64 source header bytes (the GGUF's [0, data_offset) that was hashed, FNV-1a 64)
//    48  u32 n_layers                 52  u32 reserved (0)      56  u64 total file bytes
//    64  u64 sampled data hash: FNV-1a 64 of the first 4 KiB (or less) of each part of the
//        first and last expert of every layer, in layer, expert, part order
//    72  n_layers x 72-byte entries:
//          u32 n_expert, u32 reserved, u64 first record offset, u64 record bytes,
//          u64 part offset within the record [gate, up, down], u64 part bytes [gate, up, down]
//    ..  u64 FNV-1a 64 of all header bytes before it
//   [layer 0: n_expert records][layer 1: ...] ...
//     record = [gate slice][up slice][down slice][zero padding to a 4 KiB multiple]
// A pack is valid for a GGUF when the GGUF's size, mtime and header hash (its metadata and
// tensor table: names, types, shapes, offsets) match the ones recorded, the per-layer expert
// geometry matches what the model reports, and the sampled data hash matches both the GGUF's
// and the pack's own bytes at those places (a few 4 KiB reads per layer, never the whole file);
// anything else (a changed model, a truncated or corrupt pack, a pack of an older version)
// makes open_pack fall back to the GGUF with one warning that says to re-run `strata pack`.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "stream/expert_stream.h"

namespace strata::gguf {
class File;
}

namespace strata::stream {

/// MODEL + ".strata-pack".
std::string default_pack_path(const std::string& gguf_path);

/// The routed experts of a GGUF by llama.cpp's tensor names (blk.N.ffn_{gate,up,down}_exps.weight,
/// ne[2] experts): one entry per block (n_expert 0 for blocks without routed experts), the same
/// layout the model loaders report. Throws std::runtime_error if a block has only some of the
/// three tensors or their expert counts differ.
std::vector<LayerExperts> expert_layers_from_gguf(const gguf::File& f);

/// A pack's experts as the stream reads them.
struct PackedLayout {
  std::string path;                  ///< the pack file
  std::vector<LayerExperts> layers;  ///< part offsets into the pack (parts back to back in each record)
};

struct PackOptions {
  /// (bytes written, pack size), called as writing proceeds.
  std::function<void(uint64_t done, uint64_t total)> progress;
  /// Records re-read from the finished file and compared with the GGUF before it is renamed
  /// into place: the first and last expert of every layer plus this many more at random.
  int verify_samples = 64;
  /// The routed experts to pack as the model's architecture table lays them out
  /// (model::expert_layout); empty = found by llama.cpp's tensor names (expert_layers_from_gguf).
  std::vector<LayerExperts> layers;
};

struct PackResult {
  std::string path;
  uint64_t bytes = 0;         ///< pack file size
  uint64_t records = 0;       ///< experts packed
  uint64_t record_bytes = 0;  ///< largest record
  uint64_t verified = 0;      ///< records re-read and compared
  double seconds = 0;
};

/// Writes the pack of `gguf_path`'s routed experts to `out_path` (default_pack_path when empty):
/// to out_path + ".tmp", flushed, verified (header re-parsed, sample records compared with the
/// GGUF), then renamed. Never leaves a partial file under out_path. Throws std::runtime_error
/// (io::IoError for I/O) naming the file; the .tmp file is removed on failure.
PackResult write_pack(const std::string& gguf_path, const std::string& out_path = "", const PackOptions& opts = {});

/// Why a pack is or is not usable.
/// Stale: the GGUF changed since the pack was written; Corrupt: the pack's sampled records
/// differ from the GGUF's slices.
enum class PackStatus { Ok, Missing, Unreadable, BadHeader, Truncated, Stale, Mismatch, Corrupt };

struct PackCheck {
  PackStatus status = PackStatus::Missing;
  std::string message;  ///< for anything but Ok/Missing: what is wrong, naming the file
  PackedLayout layout;  ///< valid when status == Ok
};

/// Checks the pack at `pack_path` (default_pack_path(gguf_path) when empty) against the GGUF
/// and the experts `layers` the model reports for it. Never throws for a bad pack.
PackCheck check_pack(const std::string& gguf_path, const std::vector<LayerExperts>& layers,
                     const std::string& pack_path = "");

/// The pack's layout when check_pack says Ok; otherwise std::nullopt, after printing one
/// warning to stderr unless the pack is simply absent ("strata: warning: X: ...; reading
/// experts from the GGUF").
std::optional<PackedLayout> open_pack(const std::string& gguf_path, const std::vector<LayerExperts>& layers,
                                      const std::string& pack_path = "");

}  // namespace strata::stream
