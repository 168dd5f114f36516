#pragma once
// A small GGUF v3 writer: metadata, tensor table and aligned tensor data, written to
// `path + ".tmp"` and renamed into place. Used by tests (valid and corrupted files) and by
// `strata synth`. Tensors added with add_tensor() are held in memory until write(); tensors
// added with add_tensor_streamed() are produced piece by piece during write() by a callback,
// so a file far larger than memory is written with constant memory.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gguf/gguf.h"

namespace strata::gguf {

// ---- Value builders (the variant alternative matching each on-disk type) ----
Value make_u8(uint8_t x);
Value make_i8(int8_t x);
Value make_u16(uint16_t x);
Value make_i16(int16_t x);
Value make_u32(uint32_t x);
Value make_i32(int32_t x);
Value make_u64(uint64_t x);
Value make_i64(int64_t x);
Value make_f32(float x);
Value make_f64(double x);
Value make_bool(bool x);
Value make_string(std::string x);
/// An array of `elem_type`; every item must have that type (nested arrays: elem_type ARRAY).
Value make_array(ValueType elem_type, std::vector<Value> items);
Value make_string_array(const std::vector<std::string>& xs);
Value make_i32_array(const std::vector<int32_t>& xs);
Value make_f32_array(const std::vector<float>& xs);

/// Produces a streamed tensor's bytes during Writer::write: fills dst with bytes
/// [offset, offset + n) of the tensor's data. Called in increasing offset order, from the thread
/// that calls write(), with n <= WriteOptions::chunk_bytes. May throw (write() then fails).
using TensorFill = std::function<void(uint64_t offset, uint8_t* dst, size_t n)>;

/// Options of Writer::write.
struct WriteOptions {
  size_t chunk_bytes = size_t(8) << 20;  ///< largest piece asked of a TensorFill at once (bytes)
  /// Keep the file out of the page cache: O_DIRECT writes from IO threads (io::WriteFile; where
  /// refused, buffered writes that flush and drop written ranges as they go), and
  /// posix_fadvise(DONTNEED) on the whole file at the end.
  bool drop_cache = false;
  /// Called after the header and after each piece of tensor data: (file bytes written, file size).
  std::function<void(uint64_t done, uint64_t total)> progress;
};

class Writer {
 public:
  /// `alignment`: alignment of the data section and of every tensor's data, in bytes; must be
  /// a nonzero power of two (throws std::invalid_argument). When it differs from the default 32
  /// and no "general.alignment" key was added, write() emits general.alignment (UINT32) first.
  explicit Writer(uint64_t alignment = 32);

  uint64_t alignment() const { return alignment_; }

  /// Adds a metadata pair (kept in insertion order). Throws std::invalid_argument for a
  /// duplicate key or a Value whose variant alternative does not match its type (e.g. a
  /// UINT8 holding 300, an array item of another type). The writer does not validate
  /// general.alignment: tests use that to make invalid files.
  void add_kv(const std::string& key, Value v);
  void add_u32(const std::string& key, uint32_t x) { add_kv(key, make_u32(x)); }
  void add_i32(const std::string& key, int32_t x) { add_kv(key, make_i32(x)); }
  void add_u64(const std::string& key, uint64_t x) { add_kv(key, make_u64(x)); }
  void add_f32(const std::string& key, float x) { add_kv(key, make_f32(x)); }
  void add_bool(const std::string& key, bool x) { add_kv(key, make_bool(x)); }
  void add_string(const std::string& key, std::string x) { add_kv(key, make_string(std::move(x))); }
  void add_string_array(const std::string& key, const std::vector<std::string>& xs) {
    add_kv(key, make_string_array(xs));
  }

  /// Adds a tensor. `ne`: 1..4 dims, ne[0] innermost and a multiple of the type's block size;
  /// `data`: exactly the tensor's byte size ((ne[0]/block_elems)*block_bytes*ne[1]*...).
  /// Throws std::invalid_argument on a duplicate name, bad shape or wrong data size.
  void add_tensor(const std::string& name, GgmlType type, std::vector<uint64_t> ne, std::vector<uint8_t> data);
  void add_tensor(const std::string& name, GgmlType type, std::vector<uint64_t> ne, const void* data, size_t n_bytes);

  /// Adds a tensor whose bytes `fill` produces during write() (see TensorFill). Same checks
  /// as add_tensor; throws std::invalid_argument for an empty `fill`.
  void add_tensor_streamed(const std::string& name, GgmlType type, std::vector<uint64_t> ne, TensorFill fill);

  /// Byte size a tensor of `type` and shape `ne` occupies; throws std::invalid_argument if the
  /// shape is invalid for the type (0 or >4 dims, zero dim, ne[0] not a block multiple, overflow).
  static uint64_t tensor_bytes(GgmlType type, const std::vector<uint64_t>& ne);

  /// Writes the file (GGUF v3) to `path + ".tmp"`, then renames it to `path`.
  /// Throws GgufError ("<path>: ...") on an I/O error; the .tmp file is removed then.
  void write(const std::string& path) const;
  /// The same, streaming: tensor data goes out in pieces of at most opts.chunk_bytes; only one
  /// piece is in memory at a time (plus in-memory tensors). Errors as above.
  void write(const std::string& path, const WriteOptions& opts) const;
  /// Size in bytes of the file write() produces (header, padding and tensor data).
  uint64_t file_bytes() const;

 private:
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<uint64_t> ne;
    std::vector<uint8_t> data;  // in-memory tensors
    TensorFill fill;            // streamed tensors (data empty)
    uint64_t n_bytes = 0;
  };
  std::vector<uint8_t> header_bytes() const;
  void check_new_tensor(const std::string& name) const;
  uint64_t alignment_;
  std::vector<std::pair<std::string, Value>> kv_;
  std::vector<Tensor> tensors_;
};

}  // namespace strata::gguf
