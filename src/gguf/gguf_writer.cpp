// GGUF v3 writer (layout per ggml/docs/gguf.md).
#include "gguf/gguf_writer.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "io/file.h"
#include "io/write_file.h"

namespace strata::gguf {
namespace {

Value make(ValueType t, decltype(Value::v) v) {
  Value out;
  out.type = t;
  out.v = std::move(v);
  return out;
}

/// Checks that v's alternative matches v.type (recursively); throws std::invalid_argument.
void check_value(const std::string& key, const Value& v) {
  auto bad = [&] {
    throw std::invalid_argument(
        fmt::format("gguf writer: key '{}': value of type {} holds the wrong alternative "
                    "or an out-of-range number",
                    key, value_type_name(v.type)));
  };
  auto urange = [&](uint64_t max) {
    const uint64_t* u = std::get_if<uint64_t>(&v.v);
    if (!u || *u > max) bad();
  };
  auto irange = [&](int64_t lo, int64_t hi) {
    const int64_t* i = std::get_if<int64_t>(&v.v);
    if (!i || *i < lo || *i > hi) bad();
  };
  switch (v.type) {
    case ValueType::UINT8: urange(0xff); break;
    case ValueType::UINT16: urange(0xffff); break;
    case ValueType::UINT32: urange(0xffffffffu); break;
    case ValueType::UINT64: urange(~uint64_t{0}); break;
    case ValueType::INT8: irange(INT8_MIN, INT8_MAX); break;
    case ValueType::INT16: irange(INT16_MIN, INT16_MAX); break;
    case ValueType::INT32: irange(INT32_MIN, INT32_MAX); break;
    case ValueType::INT64: irange(INT64_MIN, INT64_MAX); break;
    case ValueType::FLOAT32:
    case ValueType::FLOAT64:
      if (!std::holds_alternative<double>(v.v)) bad();
      break;
    case ValueType::BOOL:
      if (!std::holds_alternative<bool>(v.v)) bad();
      break;
    case ValueType::STRING:
      if (!std::holds_alternative<std::string>(v.v)) bad();
      break;
    case ValueType::ARRAY: {
      const Array* a = std::get_if<Array>(&v.v);
      if (!a) bad();
      for (const Value& item : a->items) {
        if (item.type != a->elem_type)
          throw std::invalid_argument(fmt::format("gguf writer: key '{}': array of {} holds a {}", key,
                                                  value_type_name(a->elem_type), value_type_name(item.type)));
        check_value(key, item);
      }
      break;
    }
    default: bad();
  }
}

class Buf {
 public:
  void bytes(const void* p, size_t n) {
    auto* b = static_cast<const uint8_t*>(p);
    data.insert(data.end(), b, b + n);
  }
  void u8(uint8_t x) { bytes(&x, 1); }
  void u16(uint16_t x) { bytes(&x, 2); }
  void u32(uint32_t x) { bytes(&x, 4); }
  void u64(uint64_t x) { bytes(&x, 8); }
  void str(const std::string& s) {
    u64(s.size());
    bytes(s.data(), s.size());
  }
  void value(const Value& v) {
    switch (v.type) {
      case ValueType::UINT8: u8(static_cast<uint8_t>(std::get<uint64_t>(v.v))); break;
      case ValueType::UINT16: u16(static_cast<uint16_t>(std::get<uint64_t>(v.v))); break;
      case ValueType::UINT32: u32(static_cast<uint32_t>(std::get<uint64_t>(v.v))); break;
      case ValueType::UINT64: u64(std::get<uint64_t>(v.v)); break;
      case ValueType::INT8: u8(static_cast<uint8_t>(std::get<int64_t>(v.v))); break;
      case ValueType::INT16: u16(static_cast<uint16_t>(std::get<int64_t>(v.v))); break;
      case ValueType::INT32: u32(static_cast<uint32_t>(std::get<int64_t>(v.v))); break;
      case ValueType::INT64: u64(static_cast<uint64_t>(std::get<int64_t>(v.v))); break;
      case ValueType::FLOAT32: u32(std::bit_cast<uint32_t>(static_cast<float>(std::get<double>(v.v)))); break;
      case ValueType::FLOAT64: u64(std::bit_cast<uint64_t>(std::get<double>(v.v))); break;
      case ValueType::BOOL: u8(std::get<bool>(v.v) ? 1 : 0); break;
      case ValueType::STRING: str(std::get<std::string>(v.v)); break;
      case ValueType::ARRAY: {
        const Array& a = std::get<Array>(v.v);
        u32(static_cast<uint32_t>(a.elem_type));
        u64(a.items.size());
        for (const Value& item : a.items) value(item);
        break;
      }
    }
  }
  void pad_to(uint64_t alignment) { data.resize((data.size() + alignment - 1) / alignment * alignment, 0); }
  std::vector<uint8_t> data;
};

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

Value make_u8(uint8_t x) { return make(ValueType::UINT8, uint64_t{x}); }
Value make_i8(int8_t x) { return make(ValueType::INT8, int64_t{x}); }
Value make_u16(uint16_t x) { return make(ValueType::UINT16, uint64_t{x}); }
Value make_i16(int16_t x) { return make(ValueType::INT16, int64_t{x}); }
Value make_u32(uint32_t x) { return make(ValueType::UINT32, uint64_t{x}); }
Value make_i32(int32_t x) { return make(ValueType::INT32, int64_t{x}); }
Value make_u64(uint64_t x) { return make(ValueType::UINT64, x); }
Value make_i64(int64_t x) { return make(ValueType::INT64, x); }
Value make_f32(float x) { return make(ValueType::FLOAT32, static_cast<double>(x)); }
Value make_f64(double x) { return make(ValueType::FLOAT64, x); }
Value make_bool(bool x) { return make(ValueType::BOOL, x); }
Value make_string(std::string x) { return make(ValueType::STRING, std::move(x)); }

Value make_array(ValueType elem_type, std::vector<Value> items) {
  Array a;
  a.elem_type = elem_type;
  a.items = std::move(items);
  return make(ValueType::ARRAY, std::move(a));
}

Value make_string_array(const std::vector<std::string>& xs) {
  std::vector<Value> items;
  items.reserve(xs.size());
  for (const std::string& s : xs) items.push_back(make_string(s));
  return make_array(ValueType::STRING, std::move(items));
}

Value make_i32_array(const std::vector<int32_t>& xs) {
  std::vector<Value> items;
  items.reserve(xs.size());
  for (int32_t x : xs) items.push_back(make_i32(x));
  return make_array(ValueType::INT32, std::move(items));
}

Value make_f32_array(const std::vector<float>& xs) {
  std::vector<Value> items;
  items.reserve(xs.size());
  for (float x : xs) items.push_back(make_f32(x));
  return make_array(ValueType::FLOAT32, std::move(items));
}

Writer::Writer(uint64_t alignment) : alignment_(alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > 0xffffffffu)
    throw std::invalid_argument(fmt::format("gguf writer: alignment {} is not a power of two", alignment));
}

void Writer::add_kv(const std::string& key, Value v) {
  for (const auto& kv : kv_)
    if (kv.first == key) throw std::invalid_argument("gguf writer: duplicate key '" + key + "'");
  check_value(key, v);
  kv_.emplace_back(key, std::move(v));
}

uint64_t Writer::tensor_bytes(GgmlType type, const std::vector<uint64_t>& ne) {
  auto info = ggml_type_info(static_cast<uint32_t>(type));
  if (!info) throw std::invalid_argument("gguf writer: unknown type " + ggml_type_name(type));
  if (ne.empty() || ne.size() > 4) throw std::invalid_argument("gguf writer: tensors have 1..4 dims");
  uint64_t n = 1;
  for (uint64_t d : ne)
    if (d == 0 || __builtin_mul_overflow(n, d, &n))
      throw std::invalid_argument("gguf writer: zero or overflowing dimension");
  if (ne[0] % info->block_elems != 0)
    throw std::invalid_argument(fmt::format("gguf writer: ne[0] = {} is not a multiple of the {} block size {}", ne[0],
                                            info->name, info->block_elems));
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(n / info->block_elems, uint64_t{info->block_bytes}, &bytes))
    throw std::invalid_argument("gguf writer: tensor byte size overflows");
  return bytes;
}

void Writer::check_new_tensor(const std::string& name) const {
  for (const Tensor& t : tensors_)
    if (t.name == name) throw std::invalid_argument("gguf writer: duplicate tensor name '" + name + "'");
}

void Writer::add_tensor(const std::string& name, GgmlType type, std::vector<uint64_t> ne, std::vector<uint8_t> data) {
  check_new_tensor(name);
  uint64_t want = tensor_bytes(type, ne);
  if (data.size() != want)
    throw std::invalid_argument(
        fmt::format("gguf writer: tensor '{}' needs {} bytes, got {}", name, want, data.size()));
  tensors_.push_back(Tensor{name, type, std::move(ne), std::move(data), nullptr, want});
}

void Writer::add_tensor_streamed(const std::string& name, GgmlType type, std::vector<uint64_t> ne, TensorFill fill) {
  check_new_tensor(name);
  if (!fill) throw std::invalid_argument("gguf writer: tensor '" + name + "' has no fill function");
  const uint64_t n = tensor_bytes(type, ne);
  tensors_.push_back(Tensor{name, type, std::move(ne), {}, std::move(fill), n});
}

void Writer::add_tensor(const std::string& name, GgmlType type, std::vector<uint64_t> ne, const void* data,
                        size_t n_bytes) {
  auto* b = static_cast<const uint8_t*>(data);
  add_tensor(name, type, std::move(ne), std::vector<uint8_t>(b, b + n_bytes));
}

std::vector<uint8_t> Writer::header_bytes() const {
  bool add_alignment = alignment_ != 32;
  for (const auto& kv : kv_)
    if (kv.first == "general.alignment") add_alignment = false;

  Buf h;
  h.u32(0x46554747);  // "GGUF"
  h.u32(3);
  h.u64(tensors_.size());
  h.u64(kv_.size() + (add_alignment ? 1 : 0));
  if (add_alignment) {
    h.str("general.alignment");
    h.u32(static_cast<uint32_t>(ValueType::UINT32));
    h.u32(static_cast<uint32_t>(alignment_));
  }
  for (const auto& [key, v] : kv_) {
    h.str(key);
    h.u32(static_cast<uint32_t>(v.type));
    h.value(v);
  }
  uint64_t rel = 0;
  for (const Tensor& t : tensors_) {
    h.str(t.name);
    h.u32(static_cast<uint32_t>(t.ne.size()));
    for (uint64_t d : t.ne) h.u64(d);
    h.u32(static_cast<uint32_t>(t.type));
    h.u64(rel);
    rel = align_up(rel + t.n_bytes, alignment_);
  }
  h.pad_to(alignment_);
  return std::move(h.data);
}

uint64_t Writer::file_bytes() const {
  uint64_t n = header_bytes().size();
  for (const Tensor& t : tensors_) n += align_up(t.n_bytes, alignment_);
  return n;
}

void Writer::write(const std::string& path) const { write(path, WriteOptions{}); }

void Writer::write(const std::string& path, const WriteOptions& opts) const {
  const std::vector<uint8_t> header = header_bytes();
  uint64_t total = header.size();
  for (const Tensor& t : tensors_) total += align_up(t.n_bytes, alignment_);
  std::unique_ptr<io::WriteFile> out;
  try {
    io::WriteFileOptions wo;
    wo.direct = opts.drop_cache;  // uncached writes from IO threads (buffered + drop-behind if refused)
    wo.drop_behind = opts.drop_cache;
    out = io::WriteFile::create(path, wo);
  } catch (const io::IoError& e) {
    throw GgufError(fmt::format("{}: cannot create: {}", path + ".tmp", e.what()));
  }
  try {
    out->write(header.data(), header.size());
    if (opts.progress) opts.progress(out->size(), total);
    std::vector<uint8_t> piece;
    const size_t chunk = std::max<size_t>(opts.chunk_bytes, 4096);
    for (const Tensor& t : tensors_) {
      if (!t.fill) {
        out->write(t.data.data(), t.data.size());
      } else {
        for (uint64_t off = 0; off < t.n_bytes;) {
          const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk, t.n_bytes - off));
          piece.resize(n);
          t.fill(off, piece.data(), n);
          out->write(piece.data(), n);
          off += n;
          if (opts.progress) opts.progress(out->size(), total);
        }
      }
      out->write_zeros(align_up(t.n_bytes, alignment_) - t.n_bytes);
      if (opts.progress) opts.progress(out->size(), total);
    }
    out->commit();
  } catch (const io::IoError& e) {
    throw GgufError(fmt::format("{}: write failed: {}", path, e.what()));
  }
}

}  // namespace strata::gguf
