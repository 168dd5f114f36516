// libFuzzer target for the GGUF parser: the input is a whole GGUF file. Every input must
// either parse or be refused with GgufError; anything else (another exception escaping, a
// sanitizer report, an invariant below failing) is a crash. After a successful parse the
// target touches what a loader touches on untrusted input: every key with every typed getter,
// every array, and every tensor's geometry, which must lie inside the file.
//
// Built with -DSTRATA_FUZZ=ON by clang (fuzz/CMakeLists.txt); scripts/test.sh runs it for a
// bounded time on the seeds fuzz_gguf_seeds writes.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>

#include "gguf/ggml_types.h"
#include "gguf/gguf.h"

using namespace strata;
using namespace strata::gguf;

namespace {

[[noreturn]] void violated(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_gguf: invariant violated: %s (%s)\n", what, detail.c_str());
  std::abort();
}

#define FUZZ_CHECK(cond, detail)          \
  do {                                    \
    if (!(cond)) violated(#cond, detail); \
  } while (0)

/// Calls `f`; a GgufError is an accepted outcome (wrong type, value out of range).
template <typename F>
void tolerate(F&& f) {
  try {
    f();
  } catch (const GgufError&) {}
}

/// Walks a value as a consumer would: every accessor, recursively into arrays.
void touch_value(const Value& v, int depth) {
  FUZZ_CHECK(depth <= 64, "array depth");
  (void)v.type_str();
  (void)(v == v);
  tolerate([&] { (void)v.as_int(); });
  tolerate([&] { (void)v.as_float(); });
  tolerate([&] { (void)v.as_string(); });
  tolerate([&] {
    const Array& a = v.as_array();
    for (const Value& item : a.items) {
      FUZZ_CHECK(item.type == a.elem_type, value_type_name(item.type));
      touch_value(item, depth + 1);
    }
  });
}

void touch_file(const File& f, size_t size) {
  FUZZ_CHECK(f.file_size() == size, std::to_string(f.file_size()));
  FUZZ_CHECK(f.version() == 2 || f.version() == 3, std::to_string(f.version()));
  const uint64_t al = f.alignment();
  FUZZ_CHECK(al != 0 && (al & (al - 1)) == 0, std::to_string(al));
  FUZZ_CHECK(f.data_offset() % al == 0, std::to_string(f.data_offset()));

  for (const auto& kv : f.metadata()) {
    const std::string& key = kv.first;  // not a structured binding: clang 14 lambdas cannot capture those
    const Value& value = kv.second;
    FUZZ_CHECK(f.find(key) == &value, key);
    touch_value(value, 0);
    tolerate([&] { (void)f.get_int(key); });
    tolerate([&] { (void)f.get_int(key, 0); });
    tolerate([&] { (void)f.get_float(key); });
    tolerate([&] { (void)f.get_float(key, 0.0); });
    tolerate([&] { (void)f.get_string(key); });
    tolerate([&] { (void)f.get_string(key, ""); });
    tolerate([&] { (void)f.get_string_array(key); });
    tolerate([&] { (void)f.get_int_array(key); });
    tolerate([&] { (void)f.get_float_array(key); });
  }
  // Keys a loader asks for whether or not the file has them.
  for (const char* key : {"general.architecture", "general.alignment", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                          "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}) {
    tolerate([&] { (void)f.get_string(key, ""); });
    tolerate([&] { (void)f.get_string_array(key); });
    tolerate([&] { (void)f.get_int_array(key); });
    tolerate([&] { (void)f.get_float_array(key); });
  }

  for (const TensorInfo& t : f.tensors()) {
    FUZZ_CHECK(f.find_tensor(t.name) == &t, t.name);
    const std::optional<GgmlTypeInfo> info = ggml_type_info(static_cast<uint32_t>(t.type));
    FUZZ_CHECK(info.has_value(), t.name);
    FUZZ_CHECK(!t.ne.empty() && t.ne.size() <= 4, t.shape_str());
    uint64_t n = 1;
    for (uint64_t d : t.ne) {
      FUZZ_CHECK(d != 0, t.shape_str());
      FUZZ_CHECK(!__builtin_mul_overflow(n, d, &n), t.shape_str());
    }
    FUZZ_CHECK(n == t.n_elements, t.shape_str());
    FUZZ_CHECK(t.ne[0] % info->block_elems == 0, t.shape_str());
    FUZZ_CHECK(t.row_bytes == t.ne[0] / info->block_elems * info->block_bytes, t.name);
    FUZZ_CHECK(t.n_bytes == t.row_bytes * (t.n_elements / t.ne[0]), t.name);
    FUZZ_CHECK(t.offset >= f.data_offset() && t.offset % al == 0, t.name);
    uint64_t end = 0;
    FUZZ_CHECK(!__builtin_add_overflow(t.offset, t.n_bytes, &end) && end <= f.file_size(), t.name);
    (void)t.layer();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::optional<File> f;
  try {
    f.emplace(File::from_bytes(std::span<const uint8_t>(data, size), "fuzz.gguf"));
  } catch (const GgufError& e) {
    const std::string msg = e.what();
    FUZZ_CHECK(msg.rfind("fuzz.gguf: ", 0) == 0, msg);  // every error names the file
    return 0;
  }
  touch_file(*f, size);
  return 0;
}
