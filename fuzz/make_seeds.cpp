// fuzz_gguf_seeds OUT_DIR [MODEL.gguf ...]: writes the seed corpus of fuzz_gguf into OUT_DIR.
//  - small valid files written by gguf::Writer: every value type, empty and nested arrays,
//    a non-default alignment, tensors of plain, block and K-quant types, 1 to 4 dims,
//    repeating-layer names, and a GGUF v2 header;
//  - for each MODEL given, a small valid file with the model's keys, value types and tensor
//    table: arrays cut to 32 items, each tensor of the smallest shape of its type and rank.
// Every seed is a few KiB (fast runs); every seed is valid (checked); nothing is committed.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "gguf/ggml_types.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"

namespace fs = std::filesystem;
using namespace strata;
using namespace strata::gguf;

namespace {

using Bytes = std::vector<uint8_t>;

Bytes read_prefix(const std::string& path, uint64_t n) {
  std::ifstream in(path, std::ios::binary);
  Bytes b(n);
  in.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(n));
  if (!in) throw std::runtime_error(path + ": cannot read " + std::to_string(n) + " bytes");
  return b;
}

void write_bytes(const fs::path& path, const Bytes& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  if (!out) throw std::runtime_error(path.string() + ": cannot write");
}

Bytes random_bytes(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Bytes b(n);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

void add_tensor(Writer& w, const std::string& name, GgmlType type, std::vector<uint64_t> ne, uint32_t seed) {
  const uint64_t n = Writer::tensor_bytes(type, ne);
  w.add_tensor(name, type, std::move(ne), random_bytes(n, seed));
}

void writer_seeds(const fs::path& dir) {
  {
    Writer w;  // empty: header only
    w.write((dir / "empty.gguf").string());
  }
  {
    Writer w;  // every scalar type, strings, arrays of every element type, nesting
    w.add_string("general.architecture", "test");
    w.add_kv("s.u8", make_u8(200));
    w.add_kv("s.i8", make_i8(-5));
    w.add_kv("s.u16", make_u16(60000));
    w.add_kv("s.i16", make_i16(-300));
    w.add_kv("s.u32", make_u32(4000000000u));
    w.add_kv("s.i32", make_i32(-70000));
    w.add_kv("s.u64", make_u64(~uint64_t{0}));
    w.add_kv("s.i64", make_i64(-(int64_t{1} << 40)));
    w.add_kv("s.f32", make_f32(1.5f));
    w.add_kv("s.f64", make_f64(-2.25));
    w.add_kv("s.bool", make_bool(true));
    w.add_kv("s.str", make_string("hello"));
    w.add_kv("s.empty", make_string(""));
    w.add_kv("a.u8", make_array(ValueType::UINT8, {make_u8(1), make_u8(2)}));
    w.add_kv("a.u64", make_array(ValueType::UINT64, {make_u64(1), make_u64(uint64_t{1} << 63)}));
    w.add_kv("a.i64", make_array(ValueType::INT64, {make_i64(-1)}));
    w.add_kv("a.f64", make_array(ValueType::FLOAT64, {make_f64(0.5)}));
    w.add_kv("a.bool", make_array(ValueType::BOOL, {make_bool(false), make_bool(true)}));
    w.add_kv("a.i32", make_i32_array({1, -2, 3}));
    w.add_kv("a.f32", make_f32_array({0.25f, -1.0f}));
    w.add_kv("a.str", make_string_array({"a", "", "xyz"}));
    w.add_kv("a.empty", make_string_array({}));
    w.add_kv("a.nested", make_array(ValueType::ARRAY, {make_i32_array({7}), make_i32_array({})}));
    add_tensor(w, "token_embd.weight", GgmlType::F32, {8, 2}, 1);
    add_tensor(w, "blk.0.attn_q.weight", GgmlType::Q8_0, {32, 2}, 2);
    w.write((dir / "types.gguf").string());
  }
  {
    Writer w(64);  // non-default alignment (general.alignment emitted), more tensor types and ranks
    w.add_string("general.architecture", "qwen3moe");
    w.add_u32("qwen3moe.block_count", 2);
    w.add_u32("qwen3moe.expert_count", 4);
    add_tensor(w, "blk.0.ffn_gate_exps.weight", GgmlType::Q4_K, {256, 2, 4}, 3);
    add_tensor(w, "blk.1.ffn_down_exps.weight", GgmlType::Q6_K, {256, 1, 4}, 4);
    add_tensor(w, "blk.1.attn_norm.weight", GgmlType::F16, {4, 3, 2}, 5);
    add_tensor(w, "output.weight", GgmlType::BF16, {2, 2, 2, 2}, 6);
    add_tensor(w, "blk.0.ffn_up_exps.weight", GgmlType::IQ4_NL, {32, 2}, 7);
    w.write((dir / "align64.gguf").string());
  }
  {
    Writer w;  // a v2 header: same layout as v3 for little-endian files
    w.add_u32("general.quantization_version", 2);
    add_tensor(w, "t", GgmlType::F32, {1}, 8);
    const fs::path p = dir / "v2.gguf";
    w.write(p.string());
    Bytes b = read_prefix(p.string(), fs::file_size(p));
    const uint32_t v2 = 2;
    std::memcpy(b.data() + 4, &v2, 4);
    write_bytes(p, b);
  }
}

/// `v` with every array, at any depth, cut to its first `n` items.
Value trimmed(const Value& v, size_t n) {
  const Array* a = std::get_if<Array>(&v.v);
  if (!a) return v;
  std::vector<Value> items;
  for (size_t i = 0; i < a->items.size() && i < n; ++i) items.push_back(trimmed(a->items[i], n));
  return make_array(a->elem_type, std::move(items));
}

void model_seeds(const fs::path& dir, const std::string& model) {
  // The model's keys and value types (arrays cut to 32 items: the vocabulary would make every
  // run slow) and its tensor table (names, types, ranks) with the smallest shape of each type.
  const File f = File::open(model);
  Writer w(f.alignment());
  for (const auto& [key, value] : f.metadata()) w.add_kv(key, trimmed(value, 32));
  uint32_t seed = 100;
  for (const TensorInfo& t : f.tensors()) {
    std::vector<uint64_t> ne(t.ne.size(), 1);
    ne[0] = ggml_type_info(static_cast<uint32_t>(t.type))->block_elems;
    add_tensor(w, t.name, t.type, std::move(ne), seed++);
  }
  w.write((dir / (fs::path(model).stem().string() + ".small.gguf")).string());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR [MODEL.gguf ...]\n", argv[0]);
    return 2;
  }
  try {
    const fs::path dir = argv[1];
    fs::create_directories(dir);
    writer_seeds(dir);
    for (int i = 2; i < argc; ++i) model_seeds(dir, argv[i]);
    for (const auto& e : fs::directory_iterator(dir)) File::open(e.path().string());  // every seed is valid
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_gguf_seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
