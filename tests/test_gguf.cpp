// GGUF reader and writer: the shipped model, a writer round trip, typed getters,
// hand-corrupted files (each must fail with GgufError naming the file and the problem)
// and a mutation fuzz loop (open() either succeeds or throws GgufError).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <span>

#include "gguf/ggml_types.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "support/error_of.h"
#include "support/paths.h"

namespace fs = std::filesystem;
using strata::GgmlType;
using namespace strata::gguf;
using ::testing::HasSubstr;

namespace {

using Bytes = std::vector<uint8_t>;

Bytes read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  Bytes b(fs::file_size(path));
  in.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(b.size()));
  return b;
}

/// The shipped model's bytes, read once.
const Bytes& shipped_bytes() {
  static const Bytes b = read_all(strata::test::shipped_model());
  return b;
}

void write_all(const std::string& path, const Bytes& b, size_t n = SIZE_MAX) {
  // Unlink first: truncating a file in place makes ext4 flush it (auto_da_alloc), which is slow.
  fs::remove(path);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(std::min(n, b.size())));
}

/// Offset of the first occurrence of `needle` in b (fails the test if absent).
size_t find(const Bytes& b, const std::string& needle) {
  auto it = std::search(b.begin(), b.end(), needle.begin(), needle.end());
  EXPECT_NE(it, b.end()) << "'" << needle << "' not found";
  return static_cast<size_t>(it - b.begin());
}

void put_u32(Bytes& b, size_t at, uint32_t v) { std::memcpy(b.data() + at, &v, 4); }
void put_u64(Bytes& b, size_t at, uint64_t v) { std::memcpy(b.data() + at, &v, 8); }
uint64_t get_u64(const Bytes& b, size_t at) {
  uint64_t v;
  std::memcpy(&v, b.data() + at, 8);
  return v;
}

Bytes random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Bytes b(n);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

class Gguf : public ::testing::Test {
 protected:
  void SetUp() override {
    // Many small files are written: prefer tmpfs (/dev/shm) over a disk-backed temp dir.
    const fs::path base = ::access("/dev/shm", W_OK) == 0 ? fs::path("/dev/shm") : fs::temp_directory_path();
    dir_ = base / ("strata_test_gguf_" + std::to_string(::getpid()) + "_" +
                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string tmp(const std::string& name) const { return (dir_ / name).string(); }

  /// A small valid file: 4 kv pairs (one an int array, one nested) and two tensors,
  /// t.alpha (F32, [8, 2]) and t.bravo (Q8_0, [32, 2]).
  Bytes base_file(const std::function<void(Writer&)>& extra_kv = {}) {
    Writer w;
    if (extra_kv) extra_kv(w);
    w.add_string("general.architecture", "test");
    w.add_kv("arr.ints", make_i32_array({1, 2, 3}));
    w.add_kv("arr.nested", make_array(ValueType::ARRAY, {make_string_array({"x", "yz"}), make_string_array({})}));
    w.add_kv("key.aaa", make_u8(1));
    w.add_kv("key.bbb", make_u8(2));
    w.add_tensor("t.alpha", GgmlType::F32, {8, 2}, random_bytes(64, 1));
    w.add_tensor("t.bravo", GgmlType::Q8_0, {32, 2}, random_bytes(68, 2));
    std::string p = tmp("base.gguf");
    w.write(p);
    return read_all(p);
  }

  /// Writes `b` (first n bytes) to a temp file and expects open() to throw GgufError whose
  /// message contains the path and `phrase`.
  void expect_error(const Bytes& b, const std::string& phrase, size_t n = SIZE_MAX) {
    std::string p = tmp("bad.gguf");
    write_all(p, b, n);
    expect_open_error(p, phrase);
  }

  /// Expects open(p) to throw GgufError whose message contains the path and `phrase`.
  void expect_open_error(const std::string& p, const std::string& phrase) {
    try {
      File::open(p);
      ADD_FAILURE() << "open() accepted a corrupt file; expected: " << phrase;
    } catch (const GgufError& e) {
      EXPECT_THAT(e.what(), HasSubstr(p + ": "));
      EXPECT_THAT(e.what(), HasSubstr(phrase));
    }
  }

  fs::path dir_;
};

// ------------------------------------------------------------------ shipped model

TEST_F(Gguf, ShippedModelParses) {
  const std::string path = strata::test::shipped_model();
  // Parse speed is not asserted here (timed tests flake on loaded machines); open time is
  // recorded as a property for whoever reads the XML report.
  auto t0 = std::chrono::steady_clock::now();
  File f = File::open(path);
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  RecordProperty("open_ms", std::to_string(ms));
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.tensors().size(), 98u);
  EXPECT_EQ(f.metadata().size(), 32u);
  EXPECT_EQ(f.file_size(), fs::file_size(path));
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.data_offset() % f.alignment(), 0u);
  EXPECT_EQ(f.get_string("general.architecture"), "qwen3moe");
  EXPECT_EQ(f.get_int("qwen3moe.expert_count"), 64);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens").size(), 8192u);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.merges").size(), 7933u);

  const TensorInfo* gate = f.find_tensor("blk.0.ffn_gate_exps.weight");
  ASSERT_NE(gate, nullptr);
  EXPECT_EQ(gate->type, GgmlType::Q8_0);
  EXPECT_EQ(gate->ne, (std::vector<uint64_t>{256, 64, 64}));
  EXPECT_EQ(gate->shape_str(), "[256, 64, 64]");
  EXPECT_EQ(gate->n_elements, 256u * 64 * 64);
  EXPECT_EQ(gate->row_bytes, 256u / 32 * 34);
  EXPECT_EQ(gate->n_bytes, 256u / 32 * 34 * 64 * 64);
  const TensorInfo* emb = f.find_tensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->ne, (std::vector<uint64_t>{256, 8192}));
  EXPECT_EQ(f.find_tensor("no.such.tensor"), nullptr);
  for (const TensorInfo& t : f.tensors()) {
    EXPECT_LE(t.offset + t.n_bytes, f.file_size()) << t.name;
    EXPECT_GE(t.offset, f.data_offset()) << t.name;
    EXPECT_EQ(t.offset % f.alignment(), 0u) << t.name;
  }
}

// from_bytes runs the parser open() runs: the same File from the same bytes, errors naming
// the image's name instead of a path.
TEST_F(Gguf, FromBytesMatchesOpen) {
  const std::string path = strata::test::shipped_model();
  const File a = File::open(path);
  const File b = File::from_bytes(shipped_bytes(), "in-memory");
  EXPECT_EQ(b.path(), "in-memory");
  EXPECT_EQ(b.version(), a.version());
  EXPECT_EQ(b.file_size(), a.file_size());
  EXPECT_EQ(b.alignment(), a.alignment());
  EXPECT_EQ(b.data_offset(), a.data_offset());
  EXPECT_EQ(b.metadata(), a.metadata());
  ASSERT_EQ(b.tensors().size(), a.tensors().size());
  for (size_t i = 0; i < a.tensors().size(); ++i) {
    const TensorInfo &x = a.tensors()[i], &y = b.tensors()[i];
    EXPECT_EQ(y.name, x.name);
    EXPECT_EQ(y.type, x.type);
    EXPECT_EQ(y.ne, x.ne);
    EXPECT_EQ(y.offset, x.offset);
    EXPECT_EQ(y.n_bytes, x.n_bytes);
    EXPECT_EQ(y.row_bytes, x.row_bytes);
  }
  EXPECT_EQ(b.get_string_array("tokenizer.ggml.tokens"), a.get_string_array("tokenizer.ggml.tokens"));

  // The File owns what it parsed: it outlives the bytes.
  std::optional<File> f;
  {
    Bytes copy = base_file();
    f.emplace(File::from_bytes(copy, "copy"));
  }
  EXPECT_EQ(f->get_string("general.architecture"), "test");
  EXPECT_EQ(f->get_int_array("arr.ints"), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(f->find_tensor("t.bravo")->n_bytes, 68u);
}

TEST_F(Gguf, FromBytesErrors) {
  auto error_of = [](const Bytes& b, size_t n) {
    return strata::test::error_of<GgufError>(
        [&] { File::from_bytes(std::span<const uint8_t>(b.data(), std::min(n, b.size())), "img.gguf"); });
  };
  EXPECT_EQ(error_of({}, 0), "img.gguf: truncated file: magic at offset 0 needs 4 bytes, only 0 remain");
  const Bytes& shipped = shipped_bytes();
  EXPECT_THAT(error_of(shipped, 20), HasSubstr("img.gguf: truncated file: kv count"));
  EXPECT_THAT(error_of(shipped, shipped.size() - 1), HasSubstr("runs past the end of the file"));
  Bytes b = base_file();
  b[0] = 'X';
  EXPECT_THAT(error_of(b, SIZE_MAX), HasSubstr("img.gguf: bad magic"));
}

// A header whose tensors share data bytes (an edited or damaged file) is refused by name: one
// tensor would otherwise read another's bytes and the run produce garbage without an error.
TEST_F(Gguf, OverlappingTensorDataIsAnError) {
  Bytes b = base_file();
  const File f = File::from_bytes(b, "x");
  std::vector<const TensorInfo*> ts;
  for (const TensorInfo& t : f.tensors())
    if (t.n_bytes > 0) ts.push_back(&t);
  ASSERT_GE(ts.size(), 2u);
  std::sort(ts.begin(), ts.end(), [](const TensorInfo* x, const TensorInfo* y) { return x->offset < y->offset; });
  const TensorInfo& second = *ts[1];
  // The second tensor's header entry: name, n_dims (u32), ne (u64 each), type (u32), offset (u64).
  const auto at = std::search(b.begin(), b.begin() + ptrdiff_t(f.data_offset()), second.name.begin(), second.name.end());
  ASSERT_NE(at, b.begin() + ptrdiff_t(f.data_offset()));
  size_t pos = size_t(at - b.begin()) + second.name.size();
  uint32_t n_dims = 0;
  std::memcpy(&n_dims, &b[pos], 4);
  pos += 4 + 8 * size_t(n_dims) + 4;
  uint64_t rel = 0;
  std::memcpy(&rel, &b[pos], 8);
  ASSERT_EQ(rel, second.offset - f.data_offset());
  const uint64_t first_rel = ts[0]->offset - f.data_offset();
  std::memcpy(&b[pos], &first_rel, 8);
  const std::string err = strata::test::error_of<GgufError>([&] { File::from_bytes(b, "img.gguf"); });
  EXPECT_THAT(err, HasSubstr("overlap in the data section")) << err;
  EXPECT_THAT(err, HasSubstr(second.name));
}

// "blk.N." with N decimal digits that fit in an int; anything else is not a layer tensor. (The
// sscanf("blk.%d.") this replaced was undefined for an N past INT_MAX, and in glibc wrapped:
// blk.4294967296. read as layer 0; it also took "blk.+3.", "blk. 3." and "blk.3x" as layer 3.)
TEST(TensorInfoLayer, StrictDecimal) {
  auto layer = [](const std::string& name) {
    TensorInfo t;
    t.name = name;
    return t.layer();
  };
  EXPECT_EQ(layer("blk.0.attn_q.weight"), 0);
  EXPECT_EQ(layer("blk.47.ffn_gate_exps.weight"), 47);
  EXPECT_EQ(layer("blk.007.x"), 7);
  EXPECT_EQ(layer("blk.2147483647.x"), 2147483647);
  EXPECT_EQ(layer("blk.2147483648.x"), -1);
  EXPECT_EQ(layer("blk.4294967296.x"), -1);
  EXPECT_EQ(layer("blk.99999999999999999999.x"), -1);
  EXPECT_EQ(layer("blk.-1.x"), -1);
  EXPECT_EQ(layer("blk.+3.x"), -1);
  EXPECT_EQ(layer("blk. 3.x"), -1);
  EXPECT_EQ(layer("blk.3x"), -1);
  EXPECT_EQ(layer("blk.3"), -1);
  EXPECT_EQ(layer("blk..x"), -1);
  EXPECT_EQ(layer("token_embd.weight"), -1);
  EXPECT_EQ(layer(""), -1);
}

TEST(GgmlTypes, BlockGeometry) {
  struct G {
    GgmlType t;
    const char* name;
    uint32_t be, bb;
  };
  const G want[] = {
      {GgmlType::F32, "F32", 1, 4},           {GgmlType::F16, "F16", 1, 2},
      {GgmlType::BF16, "BF16", 1, 2},         {GgmlType::Q4_0, "Q4_0", 32, 18},
      {GgmlType::Q4_1, "Q4_1", 32, 20},       {GgmlType::Q5_0, "Q5_0", 32, 22},
      {GgmlType::Q5_1, "Q5_1", 32, 24},       {GgmlType::Q8_0, "Q8_0", 32, 34},
      {GgmlType::Q8_1, "Q8_1", 32, 36},       {GgmlType::Q2_K, "Q2_K", 256, 84},
      {GgmlType::Q3_K, "Q3_K", 256, 110},     {GgmlType::Q4_K, "Q4_K", 256, 144},
      {GgmlType::Q5_K, "Q5_K", 256, 176},     {GgmlType::Q6_K, "Q6_K", 256, 210},
      {GgmlType::Q8_K, "Q8_K", 256, 292},     {GgmlType::IQ2_XXS, "IQ2_XXS", 256, 66},
      {GgmlType::IQ2_XS, "IQ2_XS", 256, 74},  {GgmlType::IQ3_XXS, "IQ3_XXS", 256, 98},
      {GgmlType::IQ1_S, "IQ1_S", 256, 50},    {GgmlType::IQ4_NL, "IQ4_NL", 32, 18},
      {GgmlType::IQ3_S, "IQ3_S", 256, 110},   {GgmlType::IQ2_S, "IQ2_S", 256, 82},
      {GgmlType::IQ4_XS, "IQ4_XS", 256, 136}, {GgmlType::I8, "I8", 1, 1},
      {GgmlType::I16, "I16", 1, 2},           {GgmlType::I32, "I32", 1, 4},
      {GgmlType::I64, "I64", 1, 8},           {GgmlType::F64, "F64", 1, 8},
      {GgmlType::IQ1_M, "IQ1_M", 256, 56},    {GgmlType::TQ1_0, "TQ1_0", 256, 54},
      {GgmlType::TQ2_0, "TQ2_0", 256, 66},    {GgmlType::MXFP4, "MXFP4", 32, 17},
  };
  EXPECT_EQ(std::size(want), 32u);
  for (const G& g : want) {
    auto info = strata::ggml_type_info(static_cast<uint32_t>(g.t));
    ASSERT_TRUE(info) << g.name;
    EXPECT_EQ(info->type, g.t);
    EXPECT_STREQ(info->name, g.name);
    EXPECT_EQ(info->block_elems, g.be) << g.name;
    EXPECT_EQ(info->block_bytes, g.bb) << g.name;
    EXPECT_EQ(strata::ggml_type_name(g.t), g.name);
  }
  for (uint32_t id : {4u, 5u, 31u, 36u, 38u, 40u, 1234u}) EXPECT_FALSE(strata::ggml_type_info(id)) << id;
  EXPECT_EQ(strata::ggml_type_name(1234), "type#1234");
}

// ------------------------------------------------------------------ writer round trip

TEST_F(Gguf, WriterRoundTrip) {
  Writer w(64);
  std::vector<std::pair<std::string, Value>> kv = {
      {"v.u8", make_u8(200)},
      {"v.i8", make_i8(-100)},
      {"v.u16", make_u16(60000)},
      {"v.i16", make_i16(-30000)},
      {"v.u32", make_u32(4000000000u)},
      {"v.i32", make_i32(-2000000000)},
      {"v.u64", make_u64((uint64_t{1} << 63) + 5)},
      {"v.i64", make_i64(-(int64_t{1} << 62))},
      {"v.f32", make_f32(1.5f)},
      {"v.f32b", make_f32(0.1f)},
      {"v.f64", make_f64(-2.25e300)},
      {"v.true", make_bool(true)},
      {"v.false", make_bool(false)},
      {"v.str", make_string(std::string("h\xc3\xa9llo\0x", 8))},
      {"v.empty", make_string("")},
      {"a.u8", make_array(ValueType::UINT8, {make_u8(0), make_u8(255)})},
      {"a.str", make_string_array({"a", "", "ccc"})},
      {"a.f32", make_f32_array({1.0f, -0.5f})},
      {"a.i32", make_i32_array({-1, 7})},
      {"a.bool", make_array(ValueType::BOOL, {make_bool(true), make_bool(false)})},
      {"a.empty", make_array(ValueType::INT64, {})},
      {"a.nested", make_array(ValueType::ARRAY, {make_i32_array({1, 2}), make_i32_array({3})})},
      {"a.nested3", make_array(ValueType::ARRAY, {make_array(ValueType::ARRAY, {make_string_array({"deep"})})})},
  };
  for (const auto& [k, v] : kv) w.add_kv(k, v);
  struct T {
    std::string name;
    GgmlType type;
    std::vector<uint64_t> ne;
  };
  const std::vector<T> ts = {
      {"f32", GgmlType::F32, {4, 3}},       {"f16", GgmlType::F16, {8}},        {"q8", GgmlType::Q8_0, {64, 2}},
      {"q4k", GgmlType::Q4_K, {256, 1, 2}}, {"i8", GgmlType::I8, {5, 1, 1, 2}}, {"mxfp4", GgmlType::MXFP4, {32, 3}},
  };
  std::vector<Bytes> datas;
  for (size_t i = 0; i < ts.size(); ++i) {
    datas.push_back(random_bytes(Writer::tensor_bytes(ts[i].type, ts[i].ne), 100 + static_cast<uint32_t>(i)));
    w.add_tensor(ts[i].name, ts[i].type, ts[i].ne, datas.back());
  }
  EXPECT_THROW(w.add_kv("v.u8", make_u8(1)), std::invalid_argument);
  EXPECT_THROW(w.add_tensor("bad", GgmlType::Q8_0, {33}, Bytes(34)), std::invalid_argument);
  EXPECT_THROW(w.add_tensor("f32", GgmlType::F32, {1}, Bytes(4)), std::invalid_argument);
  EXPECT_THROW(w.add_tensor("short", GgmlType::F32, {2}, Bytes(4)), std::invalid_argument);
  EXPECT_THROW(w.add_kv("mixed", make_array(ValueType::INT32, {make_u8(1)})), std::invalid_argument);
  EXPECT_THROW(Writer(24), std::invalid_argument);

  const std::string p = tmp("rt.gguf");
  w.write(p);
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  File f = File::open(p);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.data_offset() % 64, 0u);
  ASSERT_EQ(f.metadata().size(), kv.size() + 1);  // + general.alignment, written first
  EXPECT_EQ(f.metadata()[0].first, "general.alignment");
  EXPECT_EQ(f.metadata()[0].second, make_u32(64));
  for (size_t i = 0; i < kv.size(); ++i) {
    EXPECT_EQ(f.metadata()[i + 1].first, kv[i].first);
    EXPECT_TRUE(f.metadata()[i + 1].second == kv[i].second) << kv[i].first;
  }
  EXPECT_EQ(f.get_string("v.str"), std::string("h\xc3\xa9llo\0x", 8));
  EXPECT_EQ(f.get_string_array("a.str"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(f.find("a.nested")->as_array().items[1].as_array().items[0].as_int(), 3);
  EXPECT_EQ(f.find("a.nested")->type_str(), "ARRAY[ARRAY]");

  const Bytes file = read_all(p);
  ASSERT_EQ(f.tensors().size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    const TensorInfo& t = f.tensors()[i];
    EXPECT_EQ(t.name, ts[i].name);
    EXPECT_EQ(t.type, ts[i].type);
    EXPECT_EQ(t.ne, ts[i].ne);
    EXPECT_EQ(t.n_bytes, datas[i].size());
    EXPECT_EQ(t.offset % 64, 0u);
    ASSERT_LE(t.offset + t.n_bytes, file.size());
    EXPECT_TRUE(std::equal(datas[i].begin(), datas[i].end(), file.begin() + static_cast<ptrdiff_t>(t.offset)))
        << t.name;
  }
  EXPECT_EQ(f.find_tensor("q4k")->row_bytes, 144u);
  EXPECT_EQ(f.find_tensor("q4k")->n_elements, 512u);
}

TEST_F(Gguf, TypedGetters) {
  Writer w;
  w.add_kv("u8", make_u8(7));
  w.add_kv("i16", make_i16(-3));
  w.add_kv("u64big", make_u64(~uint64_t{0}));
  w.add_kv("f32", make_f32(2.5f));
  w.add_kv("b", make_bool(true));
  w.add_kv("s", make_string("hi"));
  w.add_kv("ints", make_array(ValueType::UINT16, {make_u16(1), make_u16(65535)}));
  w.add_kv("floats", make_f32_array({0.5f}));
  w.add_kv("strs", make_string_array({"p", "q"}));
  const std::string p = tmp("get.gguf");
  w.write(p);
  File f = File::open(p);

  EXPECT_EQ(f.get_int("u8"), 7);
  EXPECT_EQ(f.get_int("i16"), -3);
  EXPECT_EQ(f.get_int("missing", 42), 42);
  EXPECT_DOUBLE_EQ(f.get_float("f32"), 2.5);
  EXPECT_DOUBLE_EQ(f.get_float("i16"), -3.0);
  EXPECT_DOUBLE_EQ(f.get_float("missing", 1.25), 1.25);
  EXPECT_EQ(f.get_string("s"), "hi");
  EXPECT_EQ(f.get_string("missing", "fb"), "fb");
  EXPECT_EQ(f.get_int_array("ints"), (std::vector<int64_t>{1, 65535}));
  EXPECT_EQ(f.get_float_array("floats"), (std::vector<double>{0.5}));
  EXPECT_EQ(f.get_float_array("ints"), (std::vector<double>{1, 65535}));
  EXPECT_EQ(f.get_string_array("strs"), (std::vector<std::string>{"p", "q"}));
  EXPECT_TRUE(f.has("b"));
  EXPECT_FALSE(f.has("nope"));

  auto expect_msg = [&](auto fn, const std::string& phrase) {
    try {
      fn();
      ADD_FAILURE() << "no exception; expected: " << phrase;
    } catch (const GgufError& e) {
      EXPECT_THAT(e.what(), HasSubstr(p + ": "));
      EXPECT_THAT(e.what(), HasSubstr(phrase));
    }
  };
  expect_msg([&] { f.get_int("nope"); }, "missing key 'nope'");
  expect_msg([&] { f.get_string("nope"); }, "missing key 'nope'");
  expect_msg([&] { f.get_int("b"); }, "key 'b' has type BOOL, expected an integer");
  expect_msg([&] { f.get_int("f32"); }, "key 'f32' has type FLOAT32, expected an integer");
  expect_msg([&] { f.get_int("s", 0); }, "key 's' has type STRING, expected an integer");
  expect_msg([&] { f.get_int("u64big"); }, "key 'u64big' value 18446744073709551615 does not fit in int64");
  expect_msg([&] { f.get_float("s"); }, "key 's' has type STRING, expected a number");
  expect_msg([&] { f.get_float("b"); }, "key 'b' has type BOOL, expected a number");
  expect_msg([&] { f.get_string("u8"); }, "key 'u8' has type UINT8, expected STRING");
  expect_msg([&] { f.get_string_array("ints"); }, "key 'ints' has type ARRAY[UINT16], expected ARRAY[STRING]");
  expect_msg([&] { f.get_string_array("s"); }, "key 's' has type STRING, expected ARRAY[STRING]");
  expect_msg([&] { f.get_int_array("strs"); }, "key 'strs' has type ARRAY[STRING], expected an array of integers");
  expect_msg([&] { f.get_int_array("floats"); }, "expected an array of integers");
}

// ------------------------------------------------------------------ corrupted files

TEST_F(Gguf, CannotOpen) {
  try {
    File::open(tmp("does-not-exist.gguf"));
    ADD_FAILURE();
  } catch (const GgufError& e) {
    EXPECT_THAT(e.what(), HasSubstr(tmp("does-not-exist.gguf") + ": cannot open"));
  }
  expect_error(Bytes{}, "truncated file: magic");
}

TEST_F(Gguf, ShippedTruncatedInHeader) {
  const Bytes& b = shipped_bytes();
  expect_error(b, "truncated file: magic", 3);
  expect_error(b, "truncated file: version", 6);
  expect_error(b, "truncated file: kv count", 20);
}

TEST_F(Gguf, ShippedTruncatedInKvString) {
  const Bytes& b = shipped_bytes();
  // (tokenizer.ggml.merges comes after the token list, so the tensor count still looks plausible)
  expect_error(b, "bad string length 21 for key of kv #", find(b, "tokenizer.ggml.merges") + 5);
}

TEST_F(Gguf, ShippedTruncatedInTensorTable) {
  const Bytes& b = shipped_bytes();
  size_t at = find(b, "blk.0.ffn_gate_exps.weight") + 26 + 4 + 3;  // inside ne[0]
  expect_error(b, "truncated file: ne[0] of tensor 'blk.0.ffn_gate_exps.weight'", at);
}

TEST_F(Gguf, TruncatedInData) {
  Bytes b = base_file();
  // t.bravo (68 bytes) is the last tensor, padded to 96: cut into its data.
  expect_error(b, "tensor 't.bravo' data", b.size() - 40);
  expect_error(b, "runs past the end of the file", b.size() - 40);
  const uint64_t alpha = File::open(tmp("base.gguf")).find_tensor("t.alpha")->offset;
  expect_error(b, "tensor 't.alpha' data", alpha + 10);  // into the first tensor's data
}

TEST_F(Gguf, BadMagic) {
  Bytes b = base_file();
  b[0] = 'X';
  expect_error(b, "bad magic");
}

TEST_F(Gguf, Version1And99) {
  Bytes b = base_file();
  put_u32(b, 4, 1);
  expect_error(b, "unsupported GGUF version 1");
  put_u32(b, 4, 99);
  expect_error(b, "unsupported GGUF version 99");
  put_u32(b, 4, 0x03000000);
  expect_error(b, "big-endian");
  put_u32(b, 4, 2);  // v2 has the same layout
  write_all(tmp("v2.gguf"), b);
  EXPECT_EQ(File::open(tmp("v2.gguf")).version(), 2u);
}

TEST_F(Gguf, HugeCounts) {
  Bytes b = base_file();
  put_u64(b, 8, uint64_t{1} << 40);
  expect_error(b, "tensor count 1099511627776 is absurd");
  b = base_file();
  put_u64(b, 16, uint64_t{1} << 40);
  expect_error(b, "kv count 1099511627776 is absurd");
}

// Counts are bounded by the bytes that remain, which in a large file (here a 1 TiB sparse one:
// the model files are tens of GiB) allows billions of entries. The parser must not reserve room
// for a count it has not read yet (it did: std::bad_alloc, or an ASan allocation-size abort).
TEST_F(Gguf, HugeCountsInLargeFile) {
  const uint64_t kFile = uint64_t{1} << 40;
  auto expect_large_file_error = [&](Bytes head, const std::string& phrase) {
    const std::string p = tmp("large.gguf");
    write_all(p, head);
    fs::resize_file(p, kFile);  // zeros, no blocks
    expect_open_error(p, phrase);
    fs::remove(p);
  };
  Bytes head(24);
  put_u32(head, 0, 0x46554747);
  put_u32(head, 4, 3);
  put_u64(head, 16, kFile / 16);  // kv count; kv #0 and #1 are key "" = UINT8 0 (zeros)
  expect_large_file_error(head, "duplicate key '' (kv #1)");
  put_u64(head, 16, 0);
  put_u64(head, 8, kFile / 64);  // tensor count; tensor #0 reads n_dims 0
  expect_large_file_error(head, "tensor '' has n_dims 0");
  // kv #0: key "a", ARRAY of BOOL with 2^39 items, the third of which is 2.
  Bytes arr(24 + 8 + 1 + 4 + 4 + 8 + 3);
  std::memcpy(arr.data(), head.data(), 24);
  put_u64(arr, 8, 0);
  put_u64(arr, 16, 1);
  put_u64(arr, 24, 1);  // key length
  arr[32] = 'a';
  put_u32(arr, 33, static_cast<uint32_t>(ValueType::ARRAY));
  put_u32(arr, 37, static_cast<uint32_t>(ValueType::BOOL));
  put_u64(arr, 41, uint64_t{1} << 39);  // count
  arr[49] = 1, arr[50] = 0, arr[51] = 2;
  head = arr;
  expect_large_file_error(head, "key 'a' has bool value 2");
}

TEST_F(Gguf, HugeStringLength) {
  Bytes b = base_file();
  ASSERT_EQ(get_u64(b, 24), std::string("general.architecture").size());
  put_u64(b, 24, uint64_t{1} << 62);
  expect_error(b, "bad string length 4611686018427387904");
}

TEST_F(Gguf, HugeArrayCount) {
  Bytes b = base_file();
  size_t at = find(b, "arr.ints") + 8;  // value type, element type, count
  ASSERT_EQ(get_u64(b, at + 8), 3u);
  put_u64(b, at + 8, uint64_t{1} << 60);
  expect_error(b, "array count 1152921504606846976 of key 'arr.ints'");
}

TEST_F(Gguf, UnknownValueType) {
  Bytes b = base_file();
  put_u32(b, find(b, "key.aaa") + 7, 13);
  expect_error(b, "key 'key.aaa' has unknown value type id 13");
  b = base_file();
  put_u32(b, find(b, "arr.ints") + 12, 77);
  expect_error(b, "key 'arr.ints' has unknown array element type id 77");
}

TEST_F(Gguf, DuplicateKeyAndTensor) {
  Bytes b = base_file();
  std::memcpy(b.data() + find(b, "key.bbb"), "key.aaa", 7);
  expect_error(b, "duplicate key 'key.aaa'");
  b = base_file();
  std::memcpy(b.data() + find(b, "t.bravo"), "t.alpha", 7);
  expect_error(b, "duplicate tensor name 't.alpha'");
}

// Tensor table fields of t.alpha / t.bravo (2 dims each): n_dims, ne[0], ne[1], type, offset.
struct TensorFields {
  size_t n_dims, ne0, ne1, type, offset;
};
TensorFields fields(const Bytes& b, const std::string& name) {
  size_t p = find(b, name) + name.size();
  return {p, p + 4, p + 12, p + 20, p + 24};
}

TEST_F(Gguf, TensorOffsetPastEnd) {
  Bytes b = base_file();
  put_u64(b, fields(b, "t.bravo").offset, uint64_t{1} << 20);
  expect_error(b, "tensor 't.bravo' data (relative offset 1048576");
  put_u64(b, fields(b, "t.bravo").offset, ~uint64_t{0} - 31);  // data_offset + offset overflows
  expect_error(b, "runs past the end of the file");
}

TEST_F(Gguf, UnknownTensorType) {
  Bytes b = base_file();
  put_u32(b, fields(b, "t.alpha").type, 1234);
  expect_error(b, "unknown ggml type id 1234 in tensor 't.alpha'");
}

TEST_F(Gguf, TooManyDims) {
  Bytes b = base_file();
  put_u32(b, fields(b, "t.alpha").n_dims, 7);
  expect_error(b, "tensor 't.alpha' has n_dims 7");
  put_u32(b, fields(b, "t.alpha").n_dims, 0);
  expect_error(b, "tensor 't.alpha' has n_dims 0");
}

TEST_F(Gguf, BadDims) {
  Bytes b = base_file();
  TensorFields a = fields(b, "t.alpha");
  put_u64(b, a.ne0, uint64_t{1} << 32);
  put_u64(b, a.ne1, uint64_t{1} << 33);
  expect_error(b, "tensor 't.alpha' element count overflows uint64");
  put_u64(b, a.ne0, uint64_t{1} << 62);
  put_u64(b, a.ne1, 1);
  expect_error(b, "tensor 't.alpha' byte size overflows uint64");
  put_u64(b, a.ne0, 8);
  put_u64(b, a.ne1, 0);
  expect_error(b, "tensor 't.alpha' has a zero-sized dimension: ne[1] = 0");
  b = base_file();
  put_u64(b, fields(b, "t.bravo").ne0, 48);
  expect_error(b, "tensor 't.bravo' of type Q8_0 has ne[0] = 48, not a multiple of the block size 32");
}

TEST_F(Gguf, MisalignedOffset) {
  Bytes b = base_file();
  size_t at = fields(b, "t.bravo").offset;
  put_u64(b, at, get_u64(b, at) + 4);
  expect_error(b, "tensor 't.bravo' offset 68 is not aligned to 32");
}

TEST_F(Gguf, BadAlignment) {
  expect_error(base_file([](Writer& w) { w.add_u32("general.alignment", 3); }),
               "general.alignment = 3 is not a power of two");
  expect_error(base_file([](Writer& w) { w.add_u32("general.alignment", 0); }),
               "general.alignment = 0 is not a power of two");
  expect_error(base_file([](Writer& w) { w.add_string("general.alignment", "32"); }),
               "general.alignment has type STRING, expected UINT32");
  expect_error(base_file([](Writer& w) { w.add_u64("general.alignment", 32); }),
               "general.alignment has type UINT64, expected UINT32");
}

TEST_F(Gguf, BadBool) {
  Bytes b = base_file([](Writer& w) { w.add_bool("flag.x", true); });
  b[find(b, "flag.x") + 6 + 4] = 7;
  expect_error(b, "key 'flag.x' has bool value 7");
}

TEST_F(Gguf, DeeplyNestedArray) {
  Value v = make_i32_array({1});
  for (int i = 0; i < 20; ++i) v = make_array(ValueType::ARRAY, {v});
  expect_error(base_file([&](Writer& w) { w.add_kv("deep", v); }), "key 'deep' has arrays nested deeper than 16");
}

// ------------------------------------------------------------------ fuzz

TEST_F(Gguf, MutationFuzz) {
  const Bytes base = base_file();
  File::open(tmp("base.gguf"));  // the unmutated file is valid
  std::mt19937_64 rng(12345);
  const std::string p = tmp("fuzz.gguf");
  const uint64_t specials[] = {0,
                               1,
                               2,
                               3,
                               4,
                               7,
                               31,
                               32,
                               33,
                               0xff,
                               0xffff,
                               0xffffffffu,
                               uint64_t{1} << 31,
                               uint64_t{1} << 32,
                               uint64_t{1} << 60,
                               uint64_t{1} << 62,
                               ~uint64_t{0},
                               ~uint64_t{0} - 1,
                               uint64_t{1} << 63};
  int ok = 0, rejected = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    Bytes b = base;
    size_t n = b.size();
    const int kind = static_cast<int>(rng() % 5);
    const int rounds = 1 + static_cast<int>(rng() % 3);
    for (int r = 0; r < rounds; ++r) {
      size_t at = rng() % b.size();
      switch (kind) {
        case 0: b[at] = static_cast<uint8_t>(rng()); break;               // one byte
        case 1: b[at] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;  // one bit
        case 2: {                                                         // a run of random bytes
          size_t len = 1 + rng() % 8;
          for (size_t i = at; i < std::min(b.size(), at + len); ++i) b[i] = static_cast<uint8_t>(rng());
          break;
        }
        case 3: {  // a boundary value as u32 or u64, at any offset
          uint64_t v = specials[rng() % std::size(specials)];
          size_t len = (rng() & 1) ? 8 : 4;
          for (size_t i = 0; i < len && at + i < b.size(); ++i) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
          break;
        }
        default: n = rng() % b.size(); break;  // truncation
      }
    }
    write_all(p, b, n);
    std::string outcome = "accepted";
    try {
      File f = File::open(p);
      for (const TensorInfo& t : f.tensors()) ASSERT_LE(t.offset + t.n_bytes, f.file_size());
      ++ok;
    } catch (const GgufError& e) {
      ASSERT_THAT(e.what(), HasSubstr(p + ": "));
      outcome = e.what();
      ++rejected;
    } catch (const std::exception& e) {
      FAIL() << "iteration " << iter << ": unexpected exception type: " << e.what();
    }
    // The same bytes from memory: the same verdict, word for word.
    b.resize(n);
    std::string outcome_bytes = "accepted";
    try {
      File::from_bytes(b, p);
    } catch (const GgufError& e) {
      outcome_bytes = e.what();
    }
    ASSERT_EQ(outcome_bytes, outcome) << "iteration " << iter;
  }
  EXPECT_GT(rejected, 500);
  RecordProperty("accepted", ok);
}

}  // namespace
