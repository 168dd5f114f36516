#pragma once
// A small GGUF v3 writer: metadata, tensor table and aligned tensor data, written to
// `path + ".tmp"` and renamed into place. Used by tests (valid and corrupted files) and by
// `strata synth` / `strata pack`. Holds all tensor data in memory until write().
#include <cstdint>
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

  /// Byte size a tensor of `type` and shape `ne` occupies; throws std::invalid_argument if the
  /// shape is invalid for the type (0 or >4 dims, zero dim, ne[0] not a block multiple, overflow).
  static uint64_t tensor_bytes(GgmlType type, const std::vector<uint64_t>& ne);

  /// Writes the file (GGUF v3) to `path + ".tmp"`, then renames it to `path`.
  /// Throws GgufError ("<path>: ...") on an I/O error; the .tmp file is removed then.
  void write(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<uint64_t> ne;
    std::vector<uint8_t> data;
  };
  uint64_t alignment_;
  std::vector<std::pair<std::string, Value>> kv_;
  std::vector<Tensor> tensors_;
};

}  // namespace strata::gguf
