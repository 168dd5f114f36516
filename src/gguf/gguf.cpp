// GGUF reader: one parser over a bounded reader (buffered pread over the file, or bytes in
// memory); every count, length and offset is checked against the bytes that remain before it
// is used or allocated.
#include "gguf/gguf.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <limits>
#include <span>
#include <string_view>
#include <utility>

namespace strata::gguf {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian uint32
constexpr uint32_t kMaxDims = 4;
constexpr int kMaxArrayDepth = 16;  // nested arrays deeper than this are rejected (stack bound)
constexpr size_t kBufSize = size_t{1} << 16;
// Counts are only bounded by the bytes that remain, which in a large file allows billions of
// entries: room is reserved for at most this many before any has been read (more grow as read).
constexpr uint64_t kMaxReserve = 4096;
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;                  // key length, value type, 1-byte value
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;  // name length, n_dims, 1 dim, type, offset

[[noreturn]] void fail(const std::string& path, const std::string& what) { throw GgufError(path + ": " + what); }

/// Smallest on-disk size of one value of type t (strings: the length; arrays: type + count).
uint64_t min_value_bytes(ValueType t) {
  switch (t) {
    case ValueType::UINT8:
    case ValueType::INT8:
    case ValueType::BOOL: return 1;
    case ValueType::UINT16:
    case ValueType::INT16: return 2;
    case ValueType::UINT32:
    case ValueType::INT32:
    case ValueType::FLOAT32: return 4;
    case ValueType::UINT64:
    case ValueType::INT64:
    case ValueType::FLOAT64: return 8;
    case ValueType::STRING: return 8;
    case ValueType::ARRAY: return 12;
  }
  return 1;
}

bool valid_value_type(uint32_t id) { return id <= static_cast<uint32_t>(ValueType::FLOAT64); }

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

namespace detail {

/// Sequential reader over [0, size) of a GGUF image: a file read with pread through a small
/// buffer, or bytes in memory. Never reads past `size`; every read first checks the bytes that
/// remain and throws GgufError naming `path` if they are short.
class Reader {
 public:
  /// Reads the file open as `fd` (not owned), `size` bytes long.
  Reader(std::string path, int fd, uint64_t size) : path_(std::move(path)), fd_(fd), size_(size), buf_(kBufSize) {}
  /// Reads `bytes` (not copied: they must outlive the reader).
  Reader(std::string path, std::span<const uint8_t> bytes)
      : path_(std::move(path)), in_memory_(true), mem_(bytes.data()), size_(bytes.size()) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }

  void read(void* dst, uint64_t n, const std::string& what) {
    if (n > remaining())
      fail(path_,
           fmt::format("truncated file: {} at offset {} needs {} bytes, only {} remain", what, pos_, n, remaining()));
    auto* out = static_cast<uint8_t*>(dst);
    if (in_memory_) {
      if (n > 0) std::memcpy(out, mem_ + pos_, n);
      pos_ += n;
      return;
    }
    while (n > 0) {
      uint64_t avail = buf_start_ + buf_len_ - pos_;
      if (avail == 0) {
        if (n >= kBufSize) {  // large read: straight into the destination
          pread_exact(out, n, pos_);
          pos_ += n;
          buf_start_ = pos_;
          buf_len_ = 0;
          return;
        }
        buf_start_ = pos_;
        buf_len_ = std::min<uint64_t>(kBufSize, remaining());
        pread_exact(buf_.data(), buf_len_, buf_start_);
        avail = buf_len_;
      }
      uint64_t take = std::min(n, avail);
      std::memcpy(out, buf_.data() + (pos_ - buf_start_), take);
      out += take;
      pos_ += take;
      n -= take;
    }
  }

  uint8_t u8(const std::string& what) {
    uint8_t v;
    read(&v, 1, what);
    return v;
  }
  uint16_t u16(const std::string& what) {
    uint16_t v;
    read(&v, 2, what);
    return v;
  }
  uint32_t u32(const std::string& what) {
    uint32_t v;
    read(&v, 4, what);
    return v;
  }
  uint64_t u64(const std::string& what) {
    uint64_t v;
    read(&v, 8, what);
    return v;
  }

  std::string str(const std::string& what) {
    uint64_t at = pos_;
    uint64_t len = u64("length of " + what);
    if (len > remaining())
      fail(path_, fmt::format("bad string length {} for {} at offset {}: only {} bytes remain in the file", len, what,
                              at, remaining()));
    std::string s(len, '\0');
    read(s.data(), len, what);
    return s;
  }

 private:
  void pread_exact(uint8_t* dst, uint64_t n, uint64_t off) {
    while (n > 0) {
      size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, uint64_t{1} << 30));
      ssize_t got = ::pread(fd_, dst, chunk, static_cast<off_t>(off));
      if (got < 0) {
        if (errno == EINTR) continue;
        fail(path_, fmt::format("read error at offset {}: {}", off, std::strerror(errno)));
      }
      if (got == 0) fail(path_, fmt::format("truncated file: unexpected end of file at offset {} (file shrank?)", off));
      dst += got;
      off += static_cast<uint64_t>(got);
      n -= static_cast<uint64_t>(got);
    }
  }

  std::string path_;
  int fd_ = -1;
  bool in_memory_ = false;
  const uint8_t* mem_ = nullptr;  // the image, when in_memory_
  uint64_t size_;
  uint64_t pos_ = 0;
  uint64_t buf_start_ = 0;
  uint64_t buf_len_ = 0;
  std::vector<uint8_t> buf_;
};

}  // namespace detail

namespace {

using detail::Reader;

Value read_value(Reader& r, const std::string& path, ValueType t, const std::string& key, int depth) {
  Value out;
  out.type = t;
  const std::string what = "value of key '" + key + "'";
  switch (t) {
    case ValueType::UINT8: out.v = uint64_t{r.u8(what)}; break;
    case ValueType::INT8: out.v = int64_t{static_cast<int8_t>(r.u8(what))}; break;
    case ValueType::UINT16: out.v = uint64_t{r.u16(what)}; break;
    case ValueType::INT16: out.v = int64_t{static_cast<int16_t>(r.u16(what))}; break;
    case ValueType::UINT32: out.v = uint64_t{r.u32(what)}; break;
    case ValueType::INT32: out.v = int64_t{static_cast<int32_t>(r.u32(what))}; break;
    case ValueType::UINT64: out.v = r.u64(what); break;
    case ValueType::INT64: out.v = static_cast<int64_t>(r.u64(what)); break;
    case ValueType::FLOAT32: {
      float f = std::bit_cast<float>(r.u32(what));
      out.v = static_cast<double>(f);
      break;
    }
    case ValueType::FLOAT64: out.v = std::bit_cast<double>(r.u64(what)); break;
    case ValueType::BOOL: {
      uint64_t at = r.pos();
      uint8_t b = r.u8(what);
      if (b > 1) fail(path, fmt::format("key '{}' has bool value {} at offset {} (must be 0 or 1)", key, b, at));
      out.v = b != 0;
      break;
    }
    case ValueType::STRING: out.v = r.str(what); break;
    case ValueType::ARRAY: {
      if (depth >= kMaxArrayDepth)
        fail(path, fmt::format("key '{}' has arrays nested deeper than {}", key, kMaxArrayDepth));
      uint64_t at = r.pos();
      uint32_t et = r.u32("array element type of key '" + key + "'");
      if (!valid_value_type(et))
        fail(path, fmt::format("key '{}' has unknown array element type id {} at offset {}", key, et, at));
      Array arr;
      arr.elem_type = static_cast<ValueType>(et);
      at = r.pos();
      uint64_t count = r.u64("array count of key '" + key + "'");
      uint64_t min_bytes = min_value_bytes(arr.elem_type);
      if (count > r.remaining() / min_bytes)
        fail(path, fmt::format("array count {} of key '{}' at offset {} cannot fit in the remaining {} bytes "
                               "({} bytes per {} element at least)",
                               count, key, at, r.remaining(), min_bytes, value_type_name(arr.elem_type)));
      arr.items.reserve(std::min(count, kMaxReserve));
      for (uint64_t i = 0; i < count; ++i) arr.items.push_back(read_value(r, path, arr.elem_type, key, depth + 1));
      out.v = std::move(arr);
      break;
    }
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------- Value

std::string value_type_name(ValueType t) {
  switch (t) {
    case ValueType::UINT8: return "UINT8";
    case ValueType::INT8: return "INT8";
    case ValueType::UINT16: return "UINT16";
    case ValueType::INT16: return "INT16";
    case ValueType::UINT32: return "UINT32";
    case ValueType::INT32: return "INT32";
    case ValueType::FLOAT32: return "FLOAT32";
    case ValueType::BOOL: return "BOOL";
    case ValueType::STRING: return "STRING";
    case ValueType::ARRAY: return "ARRAY";
    case ValueType::UINT64: return "UINT64";
    case ValueType::INT64: return "INT64";
    case ValueType::FLOAT64: return "FLOAT64";
  }
  return "type#" + std::to_string(static_cast<uint32_t>(t));
}

bool Array::operator==(const Array& o) const { return elem_type == o.elem_type && items == o.items; }

bool Value::operator==(const Value& o) const { return type == o.type && v == o.v; }

std::string Value::type_str() const {
  if (const Array* a = std::get_if<Array>(&v)) return "ARRAY[" + value_type_name(a->elem_type) + "]";
  return value_type_name(type);
}

bool Value::is_integer() const { return std::holds_alternative<uint64_t>(v) || std::holds_alternative<int64_t>(v); }

int64_t Value::as_int() const {
  if (const uint64_t* u = std::get_if<uint64_t>(&v)) {
    if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      throw GgufError(fmt::format("value {} does not fit in int64", *u));
    return static_cast<int64_t>(*u);
  }
  if (const int64_t* i = std::get_if<int64_t>(&v)) return *i;
  throw GgufError("value of type " + type_str() + " is not an integer");
}

double Value::as_float() const {
  if (const uint64_t* u = std::get_if<uint64_t>(&v)) return static_cast<double>(*u);
  if (const int64_t* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
  if (const double* d = std::get_if<double>(&v)) return *d;
  throw GgufError("value of type " + type_str() + " is not a number");
}

const std::string& Value::as_string() const {
  if (const std::string* s = std::get_if<std::string>(&v)) return *s;
  throw GgufError("value of type " + type_str() + " is not a STRING");
}

const Array& Value::as_array() const {
  if (const Array* a = std::get_if<Array>(&v)) return *a;
  throw GgufError("value of type " + type_str() + " is not an ARRAY");
}

std::string TensorInfo::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

int TensorInfo::layer() const {
  constexpr std::string_view kPrefix = "blk.";
  if (name.size() <= kPrefix.size() || name.compare(0, kPrefix.size(), kPrefix) != 0) return -1;
  const char* first = name.data() + kPrefix.size();
  const char* last = name.data() + name.size();
  if (*first < '0' || *first > '9') return -1;  // from_chars would take a sign
  int l = -1;
  const auto [end, ec] = std::from_chars(first, last, l);
  return ec == std::errc() && end != last && *end == '.' ? l : -1;
}

// ---------------------------------------------------------------- File

File File::open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO would otherwise wait for a writer before the check below can
  // refuse it (no effect on regular files; cleared again for the reads).
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) fail(path, fmt::format("cannot open: {}", std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(path, fmt::format("cannot stat: {}", std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) fail(path, "not a regular file");
  if (const int fl = ::fcntl(fd.get(), F_GETFL); fl >= 0) (void)::fcntl(fd.get(), F_SETFL, fl & ~O_NONBLOCK);
  const auto size = static_cast<uint64_t>(st.st_size);
  Reader r(path, fd.get(), size);
  return parse(r, path, size);
}

File File::from_bytes(std::span<const uint8_t> bytes, std::string name) {
  Reader r(name, bytes);
  return parse(r, std::move(name), bytes.size());
}

File File::parse(Reader& r, std::string path_arg, uint64_t file_size) {
  File f;
  f.path_ = std::move(path_arg);
  f.file_size_ = file_size;
  const std::string& path = f.path_;
  uint32_t magic = r.u32("magic");
  if (magic != kMagic)
    fail(path, fmt::format("bad magic 0x{:08x} (expected 0x{:08x}, \"GGUF\"): not a GGUF file", magic, kMagic));
  f.version_ = r.u32("version");
  if (f.version_ != 2 && f.version_ != 3) {
    std::string hint = f.version_ == 1 ? " (GGUF v1 is obsolete)" : "";
    uint32_t swapped = __builtin_bswap32(f.version_);
    if (swapped == 2 || swapped == 3) hint = " (big-endian GGUF files are not supported)";
    fail(path, fmt::format("unsupported GGUF version {}{}; supported: 2, 3", f.version_, hint));
  }
  uint64_t tensor_count = r.u64("tensor count");
  uint64_t kv_count = r.u64("kv count");
  if (kv_count > r.remaining() / kMinKvBytes)
    fail(path,
         fmt::format("kv count {} is absurd for a file of {} bytes (truncated or corrupt)", kv_count, f.file_size_));
  if (tensor_count > r.remaining() / kMinTensorInfoBytes)
    fail(path, fmt::format("tensor count {} is absurd for a file of {} bytes (truncated or corrupt)", tensor_count,
                           f.file_size_));

  // ---- metadata
  f.kv_.reserve(std::min(kv_count, kMaxReserve));
  for (uint64_t i = 0; i < kv_count; ++i) {
    std::string key = r.str(fmt::format("key of kv #{}", i));
    if (f.kv_index_.count(key)) fail(path, fmt::format("duplicate key '{}' (kv #{})", key, i));
    uint64_t at = r.pos();
    uint32_t type = r.u32("value type of key '" + key + "'");
    if (!valid_value_type(type))
      fail(path, fmt::format("key '{}' has unknown value type id {} at offset {}", key, type, at));
    Value v = read_value(r, path, static_cast<ValueType>(type), key, 0);
    f.kv_index_.emplace(key, f.kv_.size());
    f.kv_.emplace_back(std::move(key), std::move(v));
  }

  if (const Value* a = f.find("general.alignment")) {
    if (a->type != ValueType::UINT32)
      fail(path, fmt::format("general.alignment has type {}, expected UINT32", a->type_str()));
    uint64_t al = std::get<uint64_t>(a->v);
    if (al == 0 || (al & (al - 1)) != 0)
      fail(path, fmt::format("general.alignment = {} is not a power of two (must be a nonzero power of two)", al));
    f.alignment_ = al;
  }

  // ---- tensor table
  f.tensors_.reserve(std::min(tensor_count, kMaxReserve));
  std::vector<uint64_t> rel_offsets;
  rel_offsets.reserve(std::min(tensor_count, kMaxReserve));
  for (uint64_t i = 0; i < tensor_count; ++i) {
    TensorInfo t;
    t.name = r.str(fmt::format("name of tensor #{}", i));
    if (f.tensor_index_.count(t.name)) fail(path, fmt::format("duplicate tensor name '{}' (tensor #{})", t.name, i));
    const std::string tn = "'" + t.name + "'";
    uint32_t n_dims = r.u32("n_dims of tensor " + tn);
    if (n_dims == 0 || n_dims > kMaxDims)
      fail(path, fmt::format("tensor {} has n_dims {} (must be 1..{})", tn, n_dims, kMaxDims));
    t.ne.resize(n_dims);
    for (uint32_t d = 0; d < n_dims; ++d) t.ne[d] = r.u64(fmt::format("ne[{}] of tensor {}", d, tn));
    uint32_t type_id = r.u32("type of tensor " + tn);
    uint64_t rel = r.u64("offset of tensor " + tn);
    auto info = ggml_type_info(type_id);
    if (!info) fail(path, fmt::format("unknown ggml type id {} in tensor {}", type_id, tn));
    t.type = info->type;

    t.n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      if (t.ne[d] == 0) fail(path, fmt::format("tensor {} has a zero-sized dimension: ne[{}] = 0", tn, d));
      if (__builtin_mul_overflow(t.n_elements, t.ne[d], &t.n_elements))
        fail(path, fmt::format("tensor {} element count overflows uint64 (shape {})", tn, t.shape_str()));
    }
    if (t.ne[0] % info->block_elems != 0)
      fail(path, fmt::format("tensor {} of type {} has ne[0] = {}, not a multiple of the block size {}", tn, info->name,
                             t.ne[0], info->block_elems));
    if (__builtin_mul_overflow(t.ne[0] / info->block_elems, uint64_t{info->block_bytes}, &t.row_bytes) ||
        __builtin_mul_overflow(t.row_bytes, t.n_elements / t.ne[0], &t.n_bytes))
      fail(path,
           fmt::format("tensor {} byte size overflows uint64 (type {}, shape {})", tn, info->name, t.shape_str()));
    if (rel % f.alignment_ != 0)
      fail(path, fmt::format("tensor {} offset {} is not aligned to {} (general.alignment)", tn, rel, f.alignment_));
    f.tensor_index_.emplace(t.name, f.tensors_.size());
    f.tensors_.push_back(std::move(t));
    rel_offsets.push_back(rel);
  }

  // ---- data section
  uint64_t header_end = r.pos();
  f.data_offset_ = (header_end + f.alignment_ - 1) / f.alignment_ * f.alignment_;  // header_end <= file size
  for (size_t i = 0; i < f.tensors_.size(); ++i) {
    TensorInfo& t = f.tensors_[i];
    uint64_t end = 0;
    if (__builtin_add_overflow(f.data_offset_, rel_offsets[i], &t.offset) ||
        __builtin_add_overflow(t.offset, t.n_bytes, &end) || end > f.file_size_)
      fail(path, fmt::format("tensor '{}' data (relative offset {}, {} bytes, data section at {}) runs past the "
                             "end of the file ({} bytes)",
                             t.name, rel_offsets[i], t.n_bytes, f.data_offset_, f.file_size_));
  }
  // No two tensors' data may overlap (a writer never aliases them; an edited or damaged header
  // that does would make one tensor read another's bytes).
  std::vector<size_t> order(f.tensors_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return f.tensors_[a].offset < f.tensors_[b].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const TensorInfo& a = f.tensors_[order[k - 1]];
    const TensorInfo& b = f.tensors_[order[k]];
    if (a.n_bytes > 0 && b.n_bytes > 0 && a.offset + a.n_bytes > b.offset)
      fail(path, fmt::format("tensors '{}' (bytes {}..{}) and '{}' (from byte {}) overlap in the data section", a.name,
                             a.offset, a.offset + a.n_bytes, b.name, b.offset));
  }
  return f;
}

const Value* File::find(const std::string& key) const {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

const TensorInfo* File::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {

const Value& require(const File& f, const std::string& key) {
  const Value* v = f.find(key);
  if (!v) fail(f.path(), "missing key '" + key + "'");
  return *v;
}

[[noreturn]] void wrong_type(const File& f, const std::string& key, const Value& v, const char* expected) {
  fail(f.path(), fmt::format("key '{}' has type {}, expected {}", key, v.type_str(), expected));
}

int64_t int_of(const File& f, const std::string& key, const Value& v) {
  if (!v.is_integer()) wrong_type(f, key, v, "an integer");
  if (const uint64_t* u = std::get_if<uint64_t>(&v.v);
      u && *u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    fail(f.path(), fmt::format("key '{}' value {} does not fit in int64", key, *u));
  return v.as_int();
}

double float_of(const File& f, const std::string& key, const Value& v) {
  if (!v.is_integer() && !std::holds_alternative<double>(v.v)) wrong_type(f, key, v, "a number");
  return v.as_float();
}

const std::string& string_of(const File& f, const std::string& key, const Value& v) {
  if (!std::holds_alternative<std::string>(v.v)) wrong_type(f, key, v, "STRING");
  return std::get<std::string>(v.v);
}

}  // namespace

int64_t File::get_int(const std::string& key) const { return int_of(*this, key, require(*this, key)); }

int64_t File::get_int(const std::string& key, int64_t fallback) const {
  const Value* v = find(key);
  return v ? int_of(*this, key, *v) : fallback;
}

double File::get_float(const std::string& key) const { return float_of(*this, key, require(*this, key)); }

double File::get_float(const std::string& key, double fallback) const {
  const Value* v = find(key);
  return v ? float_of(*this, key, *v) : fallback;
}

std::string File::get_string(const std::string& key) const { return string_of(*this, key, require(*this, key)); }

void File::require_model() const {
  const Value* v = find("general.type");
  if (!v || !std::holds_alternative<std::string>(v->v) || v->as_string() == "model") return;
  const std::string& t = v->as_string();
  fail(path_, fmt::format("this is {} {} file (general.type = {}), not a model; give a model GGUF with -m",
                          !t.empty() && std::string("aeiou").find(t[0]) != std::string::npos ? "an" : "a", t, t));
}

std::string File::get_string(const std::string& key, const std::string& fallback) const {
  const Value* v = find(key);
  return v ? string_of(*this, key, *v) : fallback;
}

std::vector<std::string> File::get_string_array(const std::string& key) const {
  const Value& v = require(*this, key);
  const Array* a = std::get_if<Array>(&v.v);
  if (!a || a->elem_type != ValueType::STRING) wrong_type(*this, key, v, "ARRAY[STRING]");
  std::vector<std::string> out;
  out.reserve(a->items.size());
  for (const Value& item : a->items) out.push_back(std::get<std::string>(item.v));
  return out;
}

std::vector<int64_t> File::get_int_array(const std::string& key) const {
  const Value& v = require(*this, key);
  const Array* a = std::get_if<Array>(&v.v);
  if (!a || a->elem_type == ValueType::BOOL || a->elem_type == ValueType::STRING || a->elem_type == ValueType::ARRAY ||
      a->elem_type == ValueType::FLOAT32 || a->elem_type == ValueType::FLOAT64)
    wrong_type(*this, key, v, "an array of integers");
  std::vector<int64_t> out;
  out.reserve(a->items.size());
  for (size_t i = 0; i < a->items.size(); ++i) out.push_back(int_of(*this, fmt::format("{}[{}]", key, i), a->items[i]));
  return out;
}

std::vector<double> File::get_float_array(const std::string& key) const {
  const Value& v = require(*this, key);
  const Array* a = std::get_if<Array>(&v.v);
  if (!a || a->elem_type == ValueType::BOOL || a->elem_type == ValueType::STRING || a->elem_type == ValueType::ARRAY)
    wrong_type(*this, key, v, "an array of numbers");
  std::vector<double> out;
  out.reserve(a->items.size());
  for (const Value& item : a->items) out.push_back(item.as_float());
  return out;
}

}  // namespace strata::gguf
