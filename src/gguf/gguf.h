#pragma once
// GGUF v3 reader. File format: ggml/docs/gguf.md (header, key/value metadata,
// tensor table, aligned data section). Knows nothing about models.
//
// Every count, length and offset is validated against the file size before it is
// used; any violation throws GgufError naming the file and the problem. Tensor
// data is never read here: callers read tensor bytes at TensorInfo::offset with
// their own File (dense weights) or through the expert stream (experts).
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "gguf/ggml_types.h"

namespace strata::gguf {

namespace detail {
class Reader;  // the bounded byte reader the parser runs on (gguf.cpp)
}

/// Thrown for any malformed, truncated or unsupported GGUF file. what() names the file.
class GgufError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// GGUF metadata value type ids (gguf.md, "gguf_metadata_value_type").
enum class ValueType : uint32_t {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12,
};

/// Name of a value type as in gguf.md ("UINT32", "STRING", ...), or "type#<id>" for unknown ids.
std::string value_type_name(ValueType t);

struct Value;
/// An array value: element type and the elements (arrays may nest).
struct Array {
  ValueType elem_type = ValueType::UINT8;
  std::vector<Value> items;

  /// Deep equality (element type and every item).
  bool operator==(const Array& o) const;
};

/// One metadata value. Integers keep their signedness in the variant alternative
/// (uint64_t for unsigned types, int64_t for signed); `type` keeps the exact on-disk type.
struct Value {
  ValueType type = ValueType::UINT8;
  std::variant<uint64_t, int64_t, double, bool, std::string, Array> v;

  bool is_integer() const;
  /// The value as an integer; throws GgufError if it is not an integer or does not fit.
  int64_t as_int() const;
  /// The value as a double (any numeric type).
  double as_float() const;
  const std::string& as_string() const;
  const Array& as_array() const;

  /// The type for messages: "UINT32", "STRING", or "ARRAY[STRING]" for arrays.
  std::string type_str() const;
  /// Deep equality: same on-disk type and same value (floats compare by value).
  bool operator==(const Value& o) const;
};

/// One entry of the tensor table, validated against the file.
struct TensorInfo {
  std::string name;
  GgmlType type = GgmlType::F32;
  std::vector<uint64_t> ne;  ///< dims, ne[0] is the contiguous (innermost) dimension, as in ggml
  uint64_t offset = 0;       ///< absolute byte offset of the data in the file (data section + relative offset)
  uint64_t n_elements = 0;   ///< product of ne
  uint64_t n_bytes = 0;      ///< size of the data in bytes
  uint64_t row_bytes = 0;    ///< bytes of one row of ne[0] elements

  /// Human-readable shape, e.g. "[256, 64, 64]".
  std::string shape_str() const;
  /// The layer of a repeating-layer tensor, named "blk.N.<name>" by llama.cpp's convention
  /// (N >= 0); -1 for the others (token_embd, output, ...).
  int layer() const;
};

/// A parsed GGUF file header: metadata and tensor table. Immutable after open; thread-safe to read.
class File {
 public:
  /// Parses `path`. Throws GgufError (bad magic, unsupported version, truncation, a length or
  /// offset past the end of the file, overflowing sizes, unknown type ids, duplicate names,
  /// misaligned tensor offsets) and std::system_error-derived GgufError when the file cannot be opened.
  static File open(const std::string& path);
  /// Parses a GGUF image held in memory, `bytes` being the whole file (header and tensor data),
  /// with the same checks as open(): the result is the File open() would return for a file with
  /// these bytes. `name` stands for the path in path() and in error messages ("<name>: ...").
  /// file_size() is bytes.size(). Nothing of `bytes` is kept: the File stays valid after they go.
  /// Throws GgufError for every malformed, truncated or unsupported image, as open() does.
  static File from_bytes(std::span<const uint8_t> bytes, std::string name);

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t file_size() const { return file_size_; }
  uint64_t alignment() const { return alignment_; }      ///< general.alignment, default 32
  uint64_t data_offset() const { return data_offset_; }  ///< start of the aligned data section

  /// Metadata in file order.
  const std::vector<std::pair<std::string, Value>>& metadata() const { return kv_; }
  /// A metadata value by key, or nullptr.
  const Value* find(const std::string& key) const;
  bool has(const std::string& key) const { return find(key) != nullptr; }

  // Typed getters: throw GgufError naming the key when it is missing or of the wrong type.
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_float(const std::string& key) const;
  double get_float(const std::string& key, double fallback) const;
  std::string get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  std::vector<std::string> get_string_array(const std::string& key) const;
  std::vector<int64_t> get_int_array(const std::string& key) const;
  /// An array of any numeric element type, as doubles.
  std::vector<double> get_float_array(const std::string& key) const;

  /// Throws GgufError unless the file is a model: its general.type, when present, is "model"
  /// (llama.cpp writes "imatrix" for importance matrices, "adapter" for LoRA adapters).
  void require_model() const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  /// A tensor by name, or nullptr.
  const TensorInfo* find_tensor(const std::string& name) const;

 private:
  /// The parser behind open() and from_bytes(): reads the header from `r`, which spans the
  /// whole file (`path` and `file_size` set by the caller). Throws GgufError.
  static File parse(detail::Reader& r, std::string path, uint64_t file_size);

  std::string path_;
  uint32_t version_ = 0;
  uint64_t file_size_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, Value>> kv_;
  std::map<std::string, size_t> kv_index_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

}  // namespace strata::gguf
