// Tests of src/quant and of the CPU kernels over it (src/backend/cpu/kernels): reference
// dequantization against gguf-py (tests/data/dequant.json), fp16/bf16 conversions, every fast kernel family against the
// scalar reference on fresh random data (seed printed; STRATA_QUANT_SEED replays a run), and the matmul invariance
// contract.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <sys/mman.h>
#include <unistd.h>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/kernels/act_q8.h"
#include "backend/cpu/kernels/kernels.h"
#include "quant/quant.h"
#include "quant/quant_impl.h"
#include "quant/quant_tables.h"
#include "support/paths.h"

using strata::GgmlType;
namespace q = strata::quant;
namespace k = strata::cpu::kernels;
namespace kd = strata::cpu::kernels::detail;

namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// run(0, mid) on this thread and run(mid, end) on a second one at the same time: a kernel's rows
// split between two threads (mid inside a tile), as the engine's pool splits them.
template <class F>
void run_split(int64_t mid, int64_t end, F& run) {
  std::thread other([&] { run(mid, end); });
  run(0, mid);
  other.join();
}

uint64_t test_seed() {
  static const uint64_t seed = [] {
    uint64_t s = std::random_device{}();
    if (const char* e = std::getenv("STRATA_QUANT_SEED"); e && *e) s = std::strtoull(e, nullptr, 10);
    std::printf("[quant] random seed %llu (set STRATA_QUANT_SEED to replay)\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

std::vector<uint8_t> from_hex(const std::string& h) {
  std::vector<uint8_t> out(h.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(std::stoul(h.substr(2 * i, 2), nullptr, 16));
  return out;
}

GgmlType type_from_name(const std::string& n) {
  static const std::pair<const char*, GgmlType> names[] = {
      {"F32", GgmlType::F32},       {"F16", GgmlType::F16},       {"BF16", GgmlType::BF16},
      {"Q8_0", GgmlType::Q8_0},     {"Q4_0", GgmlType::Q4_0},     {"Q4_1", GgmlType::Q4_1},
      {"Q5_0", GgmlType::Q5_0},     {"Q5_1", GgmlType::Q5_1},     {"Q2_K", GgmlType::Q2_K},
      {"Q3_K", GgmlType::Q3_K},     {"Q4_K", GgmlType::Q4_K},     {"Q5_K", GgmlType::Q5_K},
      {"Q6_K", GgmlType::Q6_K},     {"IQ2_XS", GgmlType::IQ2_XS}, {"IQ3_S", GgmlType::IQ3_S},
      {"IQ4_XS", GgmlType::IQ4_XS}, {"IQ4_NL", GgmlType::IQ4_NL}, {"MXFP4", GgmlType::MXFP4},
  };
  for (const auto& [s, t] : names)
    if (n == s) return t;
  return static_cast<GgmlType>(9999);
}

/// Every type this module is meant to implement (phase 1 and 2 of the quant work).
const std::vector<GgmlType>& all_types() {
  static const std::vector<GgmlType> v = {
      GgmlType::F32,  GgmlType::F16,    GgmlType::BF16,  GgmlType::Q8_0,   GgmlType::Q4_0,   GgmlType::Q4_1,
      GgmlType::Q5_0, GgmlType::Q5_1,   GgmlType::Q2_K,  GgmlType::Q3_K,   GgmlType::Q4_K,   GgmlType::Q5_K,
      GgmlType::Q6_K, GgmlType::IQ2_XS, GgmlType::IQ3_S, GgmlType::IQ4_XS, GgmlType::IQ4_NL, GgmlType::MXFP4,
  };
  return v;
}

std::vector<GgmlType> supported_types() {
  std::vector<GgmlType> v;
  for (GgmlType t : all_types())
    if (q::is_supported(t)) v.push_back(t);
  return v;
}

/// Kernel families this CPU can run.
std::vector<k::CpuKernels> families() {
  std::vector<k::CpuKernels> v = {k::CpuKernels::Scalar};
  for (k::CpuKernels f : {k::CpuKernels::Avx2, k::CpuKernels::Avx512}) {
    try {
      k::resolve_kernels(f);
      v.push_back(f);
    } catch (const std::runtime_error&) {}
  }
  return v;
}

/// The kernels of family `fam` with activation mode `act` (resolved as the engine does).
k::KernelConfig config(k::CpuKernels fam, k::ActQuant act = k::ActQuant::Auto) { return k::resolve_kernels(fam, act); }

/// Byte offsets of the fp16 scale fields inside one block, so random blocks get sane scales.
std::vector<int> fp16_fields(GgmlType t) {
  switch (t) {
    case GgmlType::Q8_0:
    case GgmlType::Q4_0:
    case GgmlType::Q5_0:
    case GgmlType::IQ4_NL:
    case GgmlType::IQ4_XS:
    case GgmlType::IQ2_XS:
    case GgmlType::IQ3_S: return {0};
    case GgmlType::Q4_1:
    case GgmlType::Q5_1:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: return {0, 2};
    case GgmlType::Q2_K: return {80, 82};
    case GgmlType::Q3_K: return {108};
    case GgmlType::Q6_K: return {208};
    default: return {};
  }
}

/// `rows` random rows of type t with `cols` elements: random payload bytes, scales drawn so the
/// values are of order 1 (no Inf/NaN).
std::vector<uint8_t> random_rows(GgmlType t, int64_t rows, int64_t cols, std::mt19937_64& rng) {
  const size_t rb = q::row_size(t, cols);
  std::vector<uint8_t> w(rb * static_cast<size_t>(rows));
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& b : w) b = static_cast<uint8_t>(byte(rng));
  auto put16 = [&](size_t off, uint16_t v) { std::memcpy(w.data() + off, &v, 2); };
  const int be = q::block_elems(t);
  const size_t bb = q::row_size(t, be);
  const size_t nblocks = w.size() / bb;
  if (t == GgmlType::F32) {
    for (size_t i = 0; i < w.size() / 4; ++i) {
      const float f = u(rng);
      std::memcpy(w.data() + 4 * i, &f, 4);
    }
  } else if (t == GgmlType::F16) {
    for (size_t i = 0; i < w.size() / 2; ++i) put16(2 * i, q::fp32_to_fp16(u(rng)));
  } else if (t == GgmlType::BF16) {
    for (size_t i = 0; i < w.size() / 2; ++i) put16(2 * i, q::fp32_to_bf16(u(rng)));
  } else if (t == GgmlType::MXFP4) {
    for (size_t b = 0; b < nblocks; ++b) w[b * bb] = static_cast<uint8_t>(120 + byte(rng) % 10);
  } else {
    // scales of order 1/32 so dequantized values stay near [-4, 4]
    for (size_t b = 0; b < nblocks; ++b)
      for (int off : fp16_fields(t)) put16(b * bb + static_cast<size_t>(off), q::fp32_to_fp16(u(rng) / 32.f));
  }
  return w;
}

std::vector<float> random_x(int64_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = u(rng);
  return x;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Conversions

TEST(QuantConvert, Fp16ToFp32ExactForAllHalves) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = q::fp16_to_fp32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_EQ((h >> 10) & 0x1f, 0x1fu);
      EXPECT_NE(h & 0x3ff, 0u);
      continue;
    }
    // round trip through the encoder is the identity on every non-NaN half
    ASSERT_EQ(q::fp32_to_fp16(f), h) << "h=" << h;
  }
  EXPECT_EQ(q::fp16_to_fp32(0x3c00), 1.0f);
  EXPECT_EQ(q::fp16_to_fp32(0xc000), -2.0f);
  EXPECT_EQ(q::fp16_to_fp32(0x0001), 0x1p-24f);
  EXPECT_EQ(q::fp16_to_fp32(0x7bff), 65504.0f);
  EXPECT_EQ(bits(q::fp16_to_fp32(0x8000)), 0x80000000u);
  EXPECT_TRUE(std::isinf(q::fp16_to_fp32(0x7c00)));
}

#if defined(__GNUC__)
__attribute__((target("f16c"))) static uint16_t hw_f32_to_f16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) static float hw_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#endif

TEST(QuantConvert, Fp16MatchesF16cHardware) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "no F16C on this CPU";
  for (uint32_t h = 0; h < 65536; ++h) {
    const float a = q::fp16_to_fp32(static_cast<uint16_t>(h)), b = hw_f16_to_f32(static_cast<uint16_t>(h));
    // NaNs: F16C quiets signaling NaNs, while we keep the payload bits as numpy does
    if (std::isnan(b)) {
      ASSERT_TRUE(std::isnan(a)) << "h=" << h;
      continue;
    }
    ASSERT_EQ(bits(a), bits(b)) << "h=" << h;
  }
  std::mt19937_64 rng(test_seed());
  std::vector<float> probes = {0.f,     -0.f,      65504.f,     65519.99f, 65520.f, 1e-8f,    2.98e-8f, 2.99e-8f,
                               6.1e-5f, 6.097e-5f, 0.33333334f, 1e30f,     -1e30f,  INFINITY, -INFINITY};
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = static_cast<uint32_t>(rng());
    // concentrate on the half range: exponents 100..145
    u = (u & 0x807fffffu) | ((100u + (u >> 23) % 46u) << 23);
    float f;
    std::memcpy(&f, &u, 4);
    probes.push_back(f);
  }
  for (float f : probes) ASSERT_EQ(q::fp32_to_fp16(f), hw_f32_to_f16(f)) << "f=" << f << " bits=" << bits(f);
}

TEST(QuantConvert, Bf16) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = q::bf16_to_fp32(static_cast<uint16_t>(h));
    ASSERT_EQ(bits(f), h << 16);
    if (!std::isnan(f)) {
      ASSERT_EQ(q::fp32_to_bf16(f), h);
    }
  }
  // round to nearest even at the halfway point, and above it
  EXPECT_EQ(q::fp32_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80u);  // tie, even stays
  EXPECT_EQ(q::fp32_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82u);  // tie, odd rounds up
  EXPECT_EQ(q::fp32_to_bf16(std::bit_cast<float>(0x3f808001u)), 0x3f81u);
  EXPECT_TRUE(std::isnan(q::bf16_to_fp32(q::fp32_to_bf16(std::bit_cast<float>(0x7f800001u)))));
}

// ---------------------------------------------------------------------------------------------
// Kernel selection and argument checks

TEST(QuantKernels, ParseAndSelect) {
  EXPECT_EQ(k::parse_cpu_kernels("scalar"), k::CpuKernels::Scalar);
  EXPECT_EQ(k::parse_cpu_kernels("avx2"), k::CpuKernels::Avx2);
  EXPECT_EQ(k::parse_cpu_kernels("avx512"), k::CpuKernels::Avx512);
  EXPECT_EQ(k::parse_cpu_kernels("auto"), k::CpuKernels::Auto);
  EXPECT_THROW(k::parse_cpu_kernels("sse"), std::invalid_argument);
  EXPECT_STREQ(k::cpu_kernels_name(k::CpuKernels::Avx512), "avx512");
  EXPECT_NE(config(k::CpuKernels::Auto).family, k::CpuKernels::Auto);
  EXPECT_EQ(config(k::CpuKernels::Scalar).family, k::CpuKernels::Scalar);
  if (!__builtin_cpu_supports("avx512f")) {
    EXPECT_THROW(config(k::CpuKernels::Avx512), std::runtime_error);
  }
  std::printf("[quant] families on this CPU:");
  for (auto f : families()) std::printf(" %s", k::cpu_kernels_name(f));
  std::printf("\n");
}

TEST(QuantKernels, RejectsBadArguments) {
  float x[64] = {}, y[4] = {};
  uint8_t w[68] = {};
  EXPECT_FALSE(q::is_supported(GgmlType::I32));
  const k::KernelConfig kc = config(k::CpuKernels::Auto);
  EXPECT_THROW(k::matmul(kc, GgmlType::I32, w, 64, 0, 1, 16, x, 16, 1, y, 1), std::runtime_error);
  EXPECT_THROW(k::matmul(kc, GgmlType::Q8_0, w, 34, 0, 1, 48, x, 48, 1, y, 1), std::runtime_error);  // ragged
  EXPECT_THROW(q::dequantize_row(GgmlType::Q8_0, w, y, 3), std::runtime_error);
  EXPECT_THROW(q::dequantize_row(GgmlType::I32, w, y, 1), std::runtime_error);
  EXPECT_EQ(q::row_size(GgmlType::Q8_0, 64), 68u);
  EXPECT_EQ(q::block_elems(GgmlType::Q8_0), 32);
  EXPECT_EQ(q::block_elems(GgmlType::F16), 1);
}

// ---------------------------------------------------------------------------------------------
// Reference dequantization vs gguf-py

TEST(QuantDequant, MatchesGgufPyBitExact) {
  std::ifstream f(strata::test::data_path("dequant.json"));
  ASSERT_TRUE(f) << "missing " << strata::test::data_path("dequant.json");
  const auto j = nlohmann::json::parse(f);
  int checked = 0;
  std::vector<std::string> skipped;
  for (const auto& tj : j.at("tensors")) {
    const std::string tname = tj.at("type");
    const GgmlType t = type_from_name(tname);
    ASSERT_EQ(static_cast<uint32_t>(t), tj.at("type_id").get<uint32_t>()) << tname;
    if (!q::is_supported(t)) {
      skipped.push_back(tname);
      continue;
    }
    const int64_t cols = tj.at("ne")[0].get<int64_t>();
    ASSERT_EQ(q::row_size(t, cols), tj.at("row_bytes").get<size_t>()) << tname;
    for (const auto& rj : tj.at("rows")) {
      const auto raw = from_hex(rj.at("raw"));
      const auto& vals = rj.at("values");
      ASSERT_EQ(raw.size(), q::row_size(t, cols));
      ASSERT_EQ(vals.size(), static_cast<size_t>(cols));
      std::vector<float> out(static_cast<size_t>(cols), -1.f);
      q::dequantize_row(t, raw.data(), out.data(), cols);
      for (int64_t k = 0; k < cols; ++k) {
        const double ref = vals[static_cast<size_t>(k)].get<double>();
        ASSERT_EQ(static_cast<double>(static_cast<float>(ref)), ref) << "reference value not a float32";
        ASSERT_EQ(bits(out[static_cast<size_t>(k)]), bits(static_cast<float>(ref)))
            << tname << " " << tj.at("tensor").get<std::string>() << " row " << rj.at("index") << " col " << k
            << ": got " << out[static_cast<size_t>(k)] << " want " << ref;
      }
      // the fast families' decoders must expand to the same bits
      std::vector<float> fast(static_cast<size_t>(cols));
      if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
          kd::decode_row_avx2(t, raw.data(), fast.data(), cols)) {
        for (int64_t k = 0; k < cols; ++k) ASSERT_EQ(bits(fast[k]), bits(out[k])) << tname << " avx2 col " << k;
      }
      if (__builtin_cpu_supports("avx512bw") && kd::decode_row_avx512(t, raw.data(), fast.data(), cols)) {
        for (int64_t k = 0; k < cols; ++k) ASSERT_EQ(bits(fast[k]), bits(out[k])) << tname << " avx512 col " << k;
      }
    }
    ++checked;
  }
  std::printf("[quant] dequant.json: %d tensors bit-exact\n", checked);
  EXPECT_TRUE(skipped.empty()) << "types in dequant.json without a dequantizer: " << skipped.size();
  EXPECT_EQ(checked, static_cast<int>(j.at("tensors").size()));
}

namespace {

/// Minimal GGUF v3 reader for the tests (independent of src/gguf): finds one tensor's type,
/// dims and absolute data offset. Format: ggml/docs/gguf.md.
struct GgufTensor {
  uint32_t type = 0;
  std::vector<uint64_t> ne;
  uint64_t offset = 0;
};

class MiniGguf {
 public:
  explicit MiniGguf(const std::string& path) : f_(path, std::ios::binary) {
    if (!f_) throw std::runtime_error("cannot open " + path);
    if (u32() != 0x46554747u) throw std::runtime_error("bad magic");
    if (u32() != 3) throw std::runtime_error("not GGUF v3");
    const uint64_t n_tensors = u64(), n_kv = u64();
    uint64_t alignment = 32;
    for (uint64_t i = 0; i < n_kv; ++i) {
      const std::string key = str();
      const uint32_t vt = u32();
      if (key == "general.alignment" && vt == 4) {
        alignment = u32();
        continue;
      }
      skip_value(vt);
    }
    std::vector<std::pair<std::string, GgufTensor>> infos;
    for (uint64_t i = 0; i < n_tensors; ++i) {
      GgufTensor t;
      const std::string name = str();
      const uint32_t nd = u32();
      for (uint32_t d = 0; d < nd; ++d) t.ne.push_back(u64());
      t.type = u32();
      t.offset = u64();
      infos.emplace_back(name, t);
    }
    const uint64_t pos = static_cast<uint64_t>(f_.tellg());
    const uint64_t data = (pos + alignment - 1) / alignment * alignment;
    for (auto& [n, t] : infos) {
      t.offset += data;
      tensors_[n] = t;
    }
  }
  const GgufTensor& at(const std::string& name) const { return tensors_.at(name); }
  std::vector<uint8_t> read(uint64_t offset, size_t n) {
    std::vector<uint8_t> b(n);
    f_.clear();
    f_.seekg(static_cast<std::streamoff>(offset));
    f_.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(n));
    if (!f_) throw std::runtime_error("short read");
    return b;
  }

 private:
  template <class T>
  T get() {
    T v{};
    f_.read(reinterpret_cast<char*>(&v), sizeof v);
    if (!f_) throw std::runtime_error("truncated gguf");
    return v;
  }
  uint32_t u32() { return get<uint32_t>(); }
  uint64_t u64() { return get<uint64_t>(); }
  std::string str() {
    const uint64_t n = u64();
    std::string s(n, '\0');
    f_.read(s.data(), static_cast<std::streamsize>(n));
    return s;
  }
  void skip_value(uint32_t vt) {
    static const int sizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    if (vt == 8) {
      str();
    } else if (vt == 9) {
      const uint32_t et = u32();
      const uint64_t n = u64();
      for (uint64_t i = 0; i < n; ++i) skip_value(et);
    } else if (vt < 13) {
      f_.seekg(sizes[vt], std::ios::cur);
    } else {
      throw std::runtime_error("bad gguf value type");
    }
  }
  std::ifstream f_;
  std::map<std::string, GgufTensor> tensors_;
};

}  // namespace

// Whole tensors: dequantize every row of the tensors named in dequant.json from the GGUF files
// (the shipped Q8_0 model and ../shared/fixtures/models) and compare sum and sum of squares.
TEST(QuantDequant, WholeTensorSumsMatchGgufPy) {
  std::ifstream f(strata::test::data_path("dequant.json"));
  const auto j = nlohmann::json::parse(f);
  const std::string fixtures = strata::test::shared_fixtures();
  int checked = 0;
  for (const auto& tj : j.at("tensors")) {
    const std::string file = tj.at("file");
    std::string path;
    for (const std::string& cand : {fixtures.empty() ? std::string() : fixtures + "/models/" + file,
                                    std::string(STRATA_REPO_DIR) + "/models/" + file})
      if (!cand.empty() && std::filesystem::exists(cand)) {
        path = cand;
        break;
      }
    if (path.empty()) {
      std::printf("[quant] %s: %s not available, whole-tensor sum not checked\n",
                  tj.at("type").get<std::string>().c_str(), file.c_str());
      continue;
    }
    MiniGguf g(path);
    const GgufTensor& t = g.at(tj.at("tensor"));
    const GgmlType type = type_from_name(tj.at("type"));
    ASSERT_EQ(t.type, static_cast<uint32_t>(type));
    const int64_t cols = static_cast<int64_t>(t.ne[0]);
    int64_t rows = 1;
    for (size_t d = 1; d < t.ne.size(); ++d) rows *= static_cast<int64_t>(t.ne[d]);
    ASSERT_EQ(rows, tj.at("n_rows").get<int64_t>());
    const size_t rb = q::row_size(type, cols);
    const auto bytes = g.read(t.offset, rb * static_cast<size_t>(rows));
    std::vector<float> row(static_cast<size_t>(cols));
    double sum = 0, sumsq = 0;
    for (int64_t r = 0; r < rows; ++r) {
      q::dequantize_row(type, bytes.data() + static_cast<size_t>(r) * rb, row.data(), cols);
      for (float v : row) {
        sum += v;
        sumsq += static_cast<double>(v) * v;
      }
    }
    const double ref_sum = tj.at("sum"), ref_sq = tj.at("sumsq");
    // gguf-py's sums were accumulated by numpy (float32 pairwise for some tensors), so allow
    // its rounding: 1e-6 of the sum of squares scale, far below one changed weight.
    const double scale = std::sqrt(ref_sq * static_cast<double>(rows * cols));
    EXPECT_NEAR(sum, ref_sum, 1e-6 * scale + 1e-9) << tj.at("type").get<std::string>() << " " << file;
    EXPECT_NEAR(sumsq, ref_sq, 1e-6 * ref_sq) << tj.at("type").get<std::string>() << " " << file;
    std::printf("[quant] %-6s %s %s: sum %.9g (ref %.9g), sumsq %.9g (ref %.9g)\n",
                tj.at("type").get<std::string>().c_str(), file.c_str(), tj.at("tensor").get<std::string>().c_str(), sum,
                ref_sum, sumsq, ref_sq);
    ++checked;
  }
  if (checked == 0) GTEST_SKIP() << "no GGUF file of dequant.json available";
}

// Formats without a reference row in dequant.json: hand-built blocks with known values.
TEST(QuantDequant, Mxfp4AndQ5_1KnownValues) {
  // MXFP4: e = 127 -> scale 2^-1, so values are the E2M1 code points themselves
  uint8_t mx[17];
  mx[0] = 127;
  for (int j = 0; j < 16; ++j) mx[1 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  float y[32];
  q::dequantize_row(GgmlType::MXFP4, mx, y, 32);
  const float e2m1[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, 0, -.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], e2m1[j]) << j;
    EXPECT_EQ(y[16 + j], e2m1[15 - j]) << j;
  }
  mx[0] = 0;  // 2^-128: subnormal scale
  q::dequantize_row(GgmlType::MXFP4, mx, y, 32);
  EXPECT_EQ(y[1], 0x1p-128f);
  EXPECT_EQ(y[7], 12 * 0x1p-128f);
  mx[0] = 254;
  q::dequantize_row(GgmlType::MXFP4, mx, y, 32);
  EXPECT_EQ(y[2], 2 * 0x1p126f);
  // Q5_1: d = 0.5, m = -4, q = 0..31 -> 0.5 q - 4
  uint8_t q51[24];
  const uint16_t d = q::fp32_to_fp16(0.5f), m = q::fp32_to_fp16(-4.f);
  std::memcpy(q51, &d, 2);
  std::memcpy(q51 + 2, &m, 2);
  // element e holds q = e: low nibble e & 15 (byte e % 16; low half for e < 16), 5th bit in qh
  uint32_t qh = 0;
  for (int e = 0; e < 32; ++e)
    if ((e >> 4) & 1) qh |= 1u << e;
  std::memcpy(q51 + 4, &qh, 4);
  for (int j = 0; j < 16; ++j) q51[8 + j] = static_cast<uint8_t>((j & 15) | (((16 + j) & 15) << 4));
  q::dequantize_row(GgmlType::Q5_1, q51, y, 32);
  for (int e = 0; e < 32; ++e) EXPECT_EQ(y[e], 0.5f * static_cast<float>(e) - 4.f) << e;
}

// The fast families expand weights to exactly the reference's floats, on random blocks too
// (every bit pattern of the payload; scales of order 1).
TEST(QuantDequant, FastDecodersBitExactOnRandomBlocks) {
  std::mt19937_64 rng(test_seed() ^ 0x9abc);
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  for (GgmlType t : supported_types()) {
    const int64_t cols = q::block_elems(t) == 1 ? 1000 : 4096;
    const auto w = random_rows(t, 8, cols, rng);
    const size_t rb = q::row_size(t, cols);
    std::vector<float> ref(static_cast<size_t>(cols)), fast(static_cast<size_t>(cols));
    for (int r = 0; r < 8; ++r) {
      const uint8_t* row = w.data() + rb * static_cast<size_t>(r);
      q::dequantize_row(t, row, ref.data(), cols);
      if (avx2) {
        ASSERT_TRUE(kd::decode_row_avx2(t, row, fast.data(), cols));
        for (int64_t k = 0; k < cols; ++k)
          ASSERT_EQ(bits(fast[k]), bits(ref[k])) << strata::quant::detail::type_name(t) << " avx2 col " << k;
      }
      if (avx512) {
        ASSERT_TRUE(kd::decode_row_avx512(t, row, fast.data(), cols));
        for (int64_t k = 0; k < cols; ++k)
          ASSERT_EQ(bits(fast[k]), bits(ref[k])) << strata::quant::detail::type_name(t) << " avx512 col " << k;
      }
    }
  }
}

TEST(QuantTables, EmbeddedTablesEqualJson) {
  std::ifstream f(strata::test::data_path("ggml-quant-tables.json"));
  ASSERT_TRUE(f);
  const auto j = nlohmann::json::parse(f).at("tables");
  ASSERT_EQ(j.size(), strata::quant::tables::kNumTables);
  for (const auto& t : strata::quant::tables::kAllTables) {
    ASSERT_TRUE(j.contains(t.name)) << t.name;
    const auto& jt = j.at(t.name);
    ASSERT_EQ(jt.at("type").get<std::string>(), t.type) << t.name;
    ASSERT_EQ(jt.at("count").get<size_t>(), t.count) << t.name;
    const auto& vals = jt.at("values");
    ASSERT_EQ(vals.size(), t.count) << t.name;
    const std::string ty = t.type;
    for (size_t i = 0; i < t.count; ++i) {
      if (ty == "uint64_t") {
        ASSERT_EQ(static_cast<const uint64_t*>(t.data)[i], vals[i].get<uint64_t>()) << t.name << "[" << i << "]";
      } else if (ty == "uint32_t") {
        ASSERT_EQ(static_cast<const uint32_t*>(t.data)[i], vals[i].get<uint32_t>()) << t.name << "[" << i << "]";
      } else if (ty == "uint8_t") {
        ASSERT_EQ(static_cast<const uint8_t*>(t.data)[i], vals[i].get<uint32_t>()) << t.name << "[" << i << "]";
      } else if (ty == "int8_t") {
        ASSERT_EQ(static_cast<const int8_t*>(t.data)[i], vals[i].get<int32_t>()) << t.name << "[" << i << "]";
      } else {
        FAIL() << "unexpected table type " << ty;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Fast kernels vs the scalar reference

namespace {

/// Accumulation error bound of the fast families relative to sum_k |w_k x_k|: the expanded
/// weights are bit-identical to the reference, so the only error is fp32 accumulation: each
/// of 16 (AVX2) or 32 (AVX-512) lanes sums cols/lanes FMA terms, then <= 5 adds in the final
/// reduction; gamma_n ~ n * 2^-24. The reference accumulates in double (error negligible).
double tolerance(int64_t cols) { return (static_cast<double>(cols) / 16.0 + 8.0) * 0x1p-24; }

struct Case {
  int64_t rows, cols, n_tok;
};

}  // namespace

TEST(QuantMatmul, FastFamiliesMatchScalarReference) {
  const k::ActQuant f32 = k::ActQuant::F32;  // the q8 path has its own tests (QuantQ8)
  std::mt19937_64 rng(test_seed() ^ 0x1234);
  const auto fams = families();
  for (GgmlType t : supported_types()) {
    const int be = q::block_elems(t);
    std::vector<int64_t> col_set = {32, 64, 256, 4096};
    if (be == 1) col_set.insert(col_set.end(), {1, 7, 33, 100});
    double worst[3] = {0, 0, 0};
    for (int64_t cols : col_set) {
      if (cols % be) continue;
      for (int64_t rows : {1, 3, 17, 255}) {
        const auto w = random_rows(t, rows, cols, rng);
        const size_t rb = q::row_size(t, cols);
        for (int64_t n_tok : {1, 2, 3, 7, 64}) {
          if (rows * cols * n_tok > 255 * 4096 * 16) continue;  // keep the double reference fast
          const auto x = random_x(n_tok * cols, rng);
          // reference and the magnitude sum |w*x| per output
          std::vector<float> ref(static_cast<size_t>(n_tok * rows));
          k::matmul(config(k::CpuKernels::Scalar, f32), t, w.data(), rb, 0, rows, cols, x.data(), cols, n_tok,
                    ref.data(), rows);
          std::vector<double> mag(ref.size(), 0.0);
          std::vector<float> wrow(static_cast<size_t>(cols));
          for (int64_t r = 0; r < rows; ++r) {
            q::dequantize_row(t, w.data() + static_cast<size_t>(r) * rb, wrow.data(), cols);
            for (int64_t tk = 0; tk < n_tok; ++tk)
              for (int64_t k = 0; k < cols; ++k)
                mag[tk * rows + r] += std::fabs(static_cast<double>(wrow[k]) * x[tk * cols + k]);
          }
          for (size_t fi = 1; fi < fams.size(); ++fi) {
            std::vector<float> y(ref.size(), NAN);
            k::matmul(config(fams[fi], f32), t, w.data(), rb, 0, rows, cols, x.data(), cols, n_tok, y.data(), rows);
            for (size_t i = 0; i < y.size(); ++i) {
              const double err = std::fabs(static_cast<double>(y[i]) - ref[i]);
              const double rel = err / std::max(mag[i], 1e-30);
              worst[fi] = std::max(worst[fi], rel);
              ASSERT_LE(err, tolerance(cols) * mag[i] + 1e-30)
                  << std::string(strata::quant::detail::type_name(t)) << " " << k::cpu_kernels_name(fams[fi])
                  << " rows=" << rows << " cols=" << cols << " n_tok=" << n_tok << " i=" << i << " y=" << y[i]
                  << " ref=" << ref[i];
            }
          }
        }
      }
    }
    std::printf("[quant] %-6s max |y-ref|/sum|w*x|:", strata::quant::detail::type_name(t));
    for (size_t fi = 1; fi < fams.size(); ++fi) std::printf(" %s %.2e", k::cpu_kernels_name(fams[fi]), worst[fi]);
    std::printf("  (bound at cols=4096: %.2e)\n", tolerance(4096));
  }
}

// ---------------------------------------------------------------------------------------------
// Invariance contract: y[t][r] does not depend on n_tok, the row range or the other tokens.

TEST(QuantMatmul, InvariantToTokenCountRowSplitAndStrides) {
  std::mt19937_64 rng(test_seed() ^ 0x5678);
  for (k::ActQuant act : {k::ActQuant::F32, k::ActQuant::Q8})
    for (k::CpuKernels fam : families()) {
      const k::KernelConfig kc = config(fam, act);
      for (GgmlType t : supported_types()) {
        const int be = q::block_elems(t);
        for (int64_t cols : {int64_t{256}, int64_t{1024}, be == 1 ? int64_t{77} : int64_t{512}}) {
          const int64_t rows = 41, n_tok = 137;  // > 2 blocks of 64 tokens in the panel path
          const auto w = random_rows(t, rows, cols, rng);
          const size_t rb = q::row_size(t, cols);
          const auto x = random_x(n_tok * cols, rng);
          std::vector<float> full(static_cast<size_t>(n_tok * rows));
          k::matmul(kc, t, w.data(), rb, 0, rows, cols, x.data(), cols, n_tok, full.data(), rows);
          const std::string what = std::string(k::act_quant_name(act)) + " " + k::cpu_kernels_name(fam) + " " +
                                   strata::quant::detail::type_name(t) + " cols=" + std::to_string(cols);
          // one token at a time, from a copy placed elsewhere with a different stride
          for (int64_t tk = 0; tk < n_tok; ++tk) {
            std::vector<float> xt(static_cast<size_t>(cols) + 5);
            std::copy(x.begin() + tk * cols, x.begin() + (tk + 1) * cols, xt.begin() + 3);
            std::vector<float> yt(static_cast<size_t>(rows));
            k::matmul(kc, t, w.data(), rb, 0, rows, cols, xt.data() + 3, cols, 1, yt.data(), rows);
            for (int64_t r = 0; r < rows; ++r)
              ASSERT_EQ(bits(yt[r]), bits(full[tk * rows + r])) << what << " token " << tk << " row " << r;
          }
          // rows split into uneven ranges, tokens in uneven chunks, wider ldx/ldy
          const int64_t ldx = cols + 16, ldy = rows + 3;
          std::vector<float> xs(static_cast<size_t>(n_tok * ldx), 1e30f);
          for (int64_t tk = 0; tk < n_tok; ++tk)
            std::copy(x.begin() + tk * cols, x.begin() + (tk + 1) * cols, xs.begin() + tk * ldx);
          std::vector<float> ys(static_cast<size_t>(n_tok * ldy), NAN);
          const int64_t row_cuts[] = {0, 1, 4, 5, 22, 41};
          const int64_t tok_cuts[] = {0, 7, 8, 21, 29, 100, 104, 137};
          for (int ri = 0; ri + 1 < 6; ++ri)
            for (int ti = 0; ti + 1 < 8; ++ti)
              k::matmul(kc, t, w.data(), rb, row_cuts[ri], row_cuts[ri + 1], cols, xs.data() + tok_cuts[ti] * ldx, ldx,
                        tok_cuts[ti + 1] - tok_cuts[ti], ys.data() + tok_cuts[ti] * ldy, ldy);
          for (int64_t tk = 0; tk < n_tok; ++tk)
            for (int64_t r = 0; r < rows; ++r)
              ASSERT_EQ(bits(ys[tk * ldy + r]), bits(full[tk * rows + r]))
                  << what << " split, token " << tk << " row " << r;
        }
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Bounds: no kernel reads a byte past its rows. The weights end exactly where an inaccessible
// page begins, so any over-read faults (the test process dies with SIGSEGV).

TEST(QuantMatmul, NoKernelReadsPastTheLastRow) {
  std::mt19937_64 rng(test_seed() ^ 0x6a6a);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  int64_t runs = 0;
  for (GgmlType t : supported_types()) {
    for (int64_t cols : {256, 512}) {
      const int64_t rows = 3;
      const auto w = random_rows(t, rows, cols, rng);
      const size_t bytes = w.size(), span = (bytes + page - 1) / page * page;
      void* m = mmap(nullptr, span + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      ASSERT_NE(m, MAP_FAILED);
      auto* base = static_cast<uint8_t*>(m);
      ASSERT_EQ(mprotect(base + span, page, PROT_NONE), 0);
      uint8_t* wp = base + span - bytes;  // the last row ends at the guard page
      std::memcpy(wp, w.data(), bytes);
      const auto x = random_x(5 * cols, rng);
      std::vector<float> y(static_cast<size_t>(rows * 5));
      for (k::ActQuant act : {k::ActQuant::F32, k::ActQuant::Q8})
        for (k::CpuKernels fam : families()) {
          const k::KernelConfig kc = config(fam, act);
          for (int64_t n_tok : {1, 2, 5}) {
            k::matmul(kc, t, wp, q::row_size(t, cols), 0, rows, cols, x.data(), cols, n_tok, y.data(), rows);
            ++runs;
          }
        }
      munmap(m, span + page);
    }
  }
  std::printf("[quant] %lld matmul calls with the weights ending at an inaccessible page\n",
              static_cast<long long>(runs));
}

// ---------------------------------------------------------------------------------------------
// q8 activations (act_q8.h): every family computes the same bits; the result is the exact dot
// product of the dequantized weights with the dequantized int8 activations up to fp32 rounding;
// the activation quantization error is bounded by sum_k |w_k| * d_b / 2.

namespace {

const GgmlType kQ8Types[] = {GgmlType::Q8_0,   GgmlType::Q4_0,  GgmlType::Q4_1,   GgmlType::Q5_0,  GgmlType::Q5_1,
                             GgmlType::IQ4_NL, GgmlType::MXFP4, GgmlType::Q2_K,   GgmlType::Q3_K,  GgmlType::Q4_K,
                             GgmlType::Q5_K,   GgmlType::Q6_K,  GgmlType::IQ2_XS, GgmlType::IQ3_S, GgmlType::IQ4_XS};

/// Per element the offset magnitude a format subtracts inside a block (Q4_K: dmin * m, found by
/// dequantizing the block with its codes zeroed); 0 for the others.
std::vector<float> offsets(GgmlType t, const uint8_t* row, int64_t cols) {
  std::vector<float> o(static_cast<size_t>(cols), 0.0f);
  if (t != GgmlType::Q4_K) return o;
  std::vector<uint8_t> z(row, row + q::row_size(t, cols));
  for (int64_t b = 0; b < cols / 256; ++b) std::memset(z.data() + 144 * b + 16, 0, 128);
  q::dequantize_row(t, z.data(), o.data(), cols);
  for (float& v : o) v = std::fabs(v);
  return o;
}

}  // namespace

TEST(QuantQ8, AllFamiliesBitIdentical) {
  std::mt19937_64 rng(test_seed() ^ 0x9abc);
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
                    __builtin_cpu_supports("bmi2");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (!avx2) GTEST_SKIP() << "no AVX2 on this CPU: only the scalar q8 family exists";
  // the AVX2 family and every AVX-512 level up to the CPU's best (each a superset of the one before)
  using kd::Q8Isa;
  std::vector<Q8Isa> levels;
  if (avx512) {
    const Q8Isa best = kd::best_q8_isa();
    levels.push_back(Q8Isa::Avx512);
    if (best != Q8Isa::Avx512) levels.push_back(Q8Isa::Avx512Vnni);
    if (best >= Q8Isa::Avx512Icl) levels.push_back(Q8Isa::Avx512Icl);
    // (AMX where the CPU and the kernel allow it, whatever STRATA_CPU_AMX says)
    if (best >= Q8Isa::Avx512Icl && kd::amx_int8_usable()) levels.push_back(Q8Isa::Avx512Amx);
  }
  static const char* const kLevelName[] = {"avx512", "avx512-vnni", "avx512-icl", "avx512-amx"};
  // the AVX2 family's Q8_0 GEMM on AVX-VNNI where the CPU has it (whatever STRATA_CPU_AVXVNNI says)
  const bool vnni_before = kd::avx_vnni_enabled();
  kd::set_avx_vnni_enabled(true);
  const bool avx_vnni = kd::avx_vnni_usable();
  kd::set_avx_vnni_enabled(vnni_before);
  int64_t checked = 0;
  for (GgmlType t : kQ8Types) {
    const int be = q::block_elems(t);
    for (int64_t cols : {32, 64, 256, 512, 768, 4096}) {
      if (cols % be) continue;
      for (int64_t rows : {1, 3, 17, 130}) {
        const auto w = random_rows(t, rows, cols, rng);
        const size_t rb = q::row_size(t, cols);
        for (int64_t n_tok : {1, 2, 3, 5, 7, 64, 70}) {
          if (rows * cols * n_tok > 130 * 4096 * 8) continue;
          const auto x = random_x(n_tok * cols, rng);
          k::ActQ8 act, act_lanes;  // without and with the type's lane order kept
          act.resize(n_tok, cols);
          k::quantize_activations(config(k::CpuKernels::Auto), x.data(), cols, 0, n_tok, act);
          act_lanes.resize(n_tok, cols, t);
          k::quantize_activations(config(k::CpuKernels::Auto), x.data(), cols, 0, n_tok, act_lanes);
          const kd::MatmulArgs base{t, w.data(), rb, 0, rows, cols, x.data(), cols, n_tok, nullptr, rows};
          // the definitions: the scalar family's (AVX2 too) and the AVX-512 family's (Q8_0: serial)
          std::vector<float> ref(static_cast<size_t>(rows * n_tok), NAN), ref512(ref.size(), NAN), y(ref.size(), NAN);
          auto a = base;
          a.y = ref.data();
          kd::matmul_q8_scalar(a, act);
          a.y = ref512.data();
          kd::matmul_q8_scalar_avx512(a, act);
          // -2: the AVX2 family without AVX-VNNI; -1: with it (where the CPU has it)
          for (int isa = -2; isa < static_cast<int>(levels.size()); ++isa)
            for (const k::ActQ8* ap : {&act, &act_lanes}) {
              if (isa == -1 && !avx_vnni) continue;
              std::fill(y.begin(), y.end(), NAN);
              a.y = y.data();
              if (isa < 0) {
                kd::set_avx_vnni_enabled(isa == -1);
                const bool ok = kd::matmul_q8_avx2(a, *ap);
                kd::set_avx_vnni_enabled(vnni_before);
                ASSERT_TRUE(ok);
              } else {
                ASSERT_TRUE(kd::matmul_q8_avx512(a, *ap, levels[static_cast<size_t>(isa)]));
              }
              // (the AVX2 family's Q8_0 is the serial definition too: matmul_q8_scalar_avx2)
              const std::vector<float>& want = isa < 0 && t != GgmlType::Q8_0 ? ref : ref512;
              for (size_t i = 0; i < y.size(); ++i)
                ASSERT_EQ(bits(y[i]), bits(want[i]))
                    << strata::quant::detail::type_name(t) << " "
                    << (isa == -2   ? "avx2"
                        : isa == -1 ? "avx2 + AVX-VNNI"
                                    : kLevelName[static_cast<int>(levels[static_cast<size_t>(isa)])])
                    << (ap == &act ? "" : " lanes kept") << " rows=" << rows << " cols=" << cols << " n_tok=" << n_tok
                    << " i=" << i;
              checked += static_cast<int64_t>(y.size());
            }
        }
      }
    }
  }
  // and through the public entry point, per family: the scalar family's bits, except Q8_0, Q4_K
  // and IQ4_XS in the AVX-512 family and Q8_0 in the AVX2 family (their serial definitions)
  for (GgmlType t : kQ8Types) {
    const int64_t rows = 9, cols = 512, n_tok = 6;
    const auto w = random_rows(t, rows, cols, rng);
    const auto x = random_x(n_tok * cols, rng);
    k::ActQ8 act;
    act.resize(n_tok, cols);
    k::quantize_activations(config(k::CpuKernels::Scalar), x.data(), cols, 0, n_tok, act);
    std::vector<float> ref(static_cast<size_t>(rows * n_tok)), ref512(ref.size());
    kd::MatmulArgs a{t, w.data(), q::row_size(t, cols), 0, rows, cols, x.data(), cols, n_tok, ref.data(), rows};
    kd::matmul_q8_scalar(a, act);
    a.y = ref512.data();
    kd::matmul_q8_scalar_avx512(a, act);
    for (k::CpuKernels fam : families()) {
      const k::KernelConfig kc = config(fam, k::ActQuant::Q8);
      ASSERT_TRUE(k::has_q8_activations(kc, t));
      std::vector<float> y(static_cast<size_t>(rows * n_tok));
      k::matmul(kc, t, w.data(), q::row_size(t, cols), 0, rows, cols, x.data(), cols, n_tok, y.data(), rows);
      const bool serial = fam == k::CpuKernels::Avx512 || (fam == k::CpuKernels::Avx2 && t == GgmlType::Q8_0);
      const std::vector<float>& want = serial ? ref512 : ref;
      for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(bits(y[i]), bits(want[i])) << k::cpu_kernels_name(fam);
    }
  }
  std::string names = avx_vnni ? " / avx2 / avx2 + AVX-VNNI" : " / avx2 (no AVX-VNNI on this CPU)";
  for (Q8Isa isa : levels) names += std::string(" / ") + kLevelName[static_cast<int>(isa)];
  std::printf("[quant] q8 path: %lld outputs bit-identical across scalar%s\n", static_cast<long long>(checked),
              names.c_str());
}

TEST(QuantQ8, QuantizerIdenticalInEveryFamily) {
  std::mt19937_64 rng(test_seed() ^ 0x7777);
  const int64_t cols = 4096, n_tok = 5;
  auto x = random_x(n_tok * cols, rng);
  for (int64_t k = 0; k < n_tok * cols; k += 13) x[static_cast<size_t>(k)] *= 1000.0f;
  std::fill(x.begin() + 64, x.begin() + 96, 0.0f);                                 // all-zero block
  for (int k = 0; k < 32; ++k) x[static_cast<size_t>(128 + k)] = 0.5f * (k - 16);  // ties at 127/8 steps
  x[300] = NAN;
  x[400] = -INFINITY;
  std::vector<k::ActQ8> out;
  for (k::CpuKernels fam : families()) {
    k::ActQ8 a;
    a.resize(n_tok, cols);
    k::quantize_activations(config(fam), x.data(), cols, 0, n_tok, a);
    out.push_back(a);
  }
  for (size_t f = 1; f < out.size(); ++f) {
    ASSERT_EQ(out[f].q, out[0].q);
    ASSERT_EQ(out[f].s16, out[0].s16);
    for (size_t i = 0; i < out[0].d.size(); ++i) ASSERT_EQ(bits(out[f].d[i]), bits(out[0].d[i])) << "block " << i;
  }
  EXPECT_TRUE(std::isnan(out[0].d[300 / 32]));
  EXPECT_TRUE(std::isnan(out[0].d[400 / 32]));
  EXPECT_EQ(out[0].d[2], 0.0f);
  // nearest value: |x - d*q| <= d/2 everywhere finite
  for (int64_t k = 0; k < n_tok * cols; ++k) {
    const float d = out[0].d[static_cast<size_t>(k / 32)];
    if (std::isnan(d)) continue;
    ASSERT_LE(std::fabs(double(x[static_cast<size_t>(k)]) - double(d) * out[0].q[static_cast<size_t>(k)]),
              0.5 * d * (1 + 1e-6) + 1e-30);
  }
}

TEST(QuantQ8, EqualsExactProductOfDequantizedOperands) {
  const k::KernelConfig kc = config(k::CpuKernels::Auto, k::ActQuant::Q8);
  std::mt19937_64 rng(test_seed() ^ 0xdef0);
  for (GgmlType t : kQ8Types) {
    double worst_fmt = 0, worst_quant = 0;
    for (int64_t cols : {256, 1024, 4096}) {
      const int64_t rows = 33, n_tok = 3;
      const auto w = random_rows(t, rows, cols, rng);
      const size_t rb = q::row_size(t, cols);
      auto x = random_x(n_tok * cols, rng);
      // activations with outliers and a zero block, as hidden states have
      for (int64_t k = 0; k < n_tok * cols; k += 97) x[static_cast<size_t>(k)] *= 20.0f;
      std::fill(x.begin(), x.begin() + 32, 0.0f);
      k::ActQ8 act;
      act.resize(n_tok, cols);
      k::quantize_activations(kc, x.data(), cols, 0, n_tok, act);
      std::vector<float> y(static_cast<size_t>(rows * n_tok));
      k::matmul(kc, t, w.data(), rb, 0, rows, cols, x.data(), cols, n_tok, y.data(), rows);
      std::vector<float> wr(static_cast<size_t>(cols));
      for (int64_t r = 0; r < rows; ++r) {
        q::dequantize_row(t, w.data() + static_cast<size_t>(r) * rb, wr.data(), cols);
        const auto off = offsets(t, w.data() + static_cast<size_t>(r) * rb, cols);
        for (int64_t tk = 0; tk < n_tok; ++tk) {
          double dq = 0, mag = 0, exact = 0, qbound = 0, absx = 0;
          for (int64_t k = 0; k < cols; ++k) {
            const double xd = static_cast<double>(act.dt(tk)[k / 32]) * act.qt(tk)[k];
            const double xe = x[static_cast<size_t>(tk * cols + k)];
            dq += static_cast<double>(wr[k]) * xd;
            mag += (std::fabs(static_cast<double>(wr[k])) + off[k]) * std::fabs(xd);
            exact += static_cast<double>(wr[k]) * xe;
            qbound += std::fabs(static_cast<double>(wr[k])) * act.dt(tk)[k / 32] * 0.5 * (1 + 1e-6);
            absx += std::fabs(static_cast<double>(wr[k]) * xe);
          }
          const double yv = y[static_cast<size_t>(tk * rows + r)];
          // fp32 rounding of the block factors (<= 4 ulp) and of the lane sums (cols/64 FMAs
          // per lane, then 5 adds), relative to the magnitudes that enter them
          // (the AVX-512 family's Q8_0 and IQ4_XS are serial: one product and one FMA per 32-block
          // (IQ4_XS: two products), in order; its Q4_K two products and two FMAs per 32-block, the
          // scale's and the min's)
          const bool avx512 = kc.family == k::CpuKernels::Avx512;
          const double blocks = static_cast<double>(cols) / 32.0;
          const double fmt_tol = (avx512 && t == GgmlType::Q8_0     ? blocks + 2.0
                                  : avx512 && t == GgmlType::IQ4_XS ? blocks + 3.0
                                  : avx512 && t == GgmlType::Q4_K   ? 2.0 * blocks + 4.0
                                                                    : static_cast<double>(cols) / 64.0 + 16.0) *
                                 0x1p-24 * mag;
          ASSERT_LE(std::fabs(yv - dq), fmt_tol) << strata::quant::detail::type_name(t) << " cols=" << cols;
          ASSERT_LE(std::fabs(dq - exact), qbound) << "activation rounding beyond d/2 per element";
          worst_fmt = std::max(worst_fmt, std::fabs(yv - dq) / std::max(mag, 1e-30));
          worst_quant = std::max(worst_quant, std::fabs(yv - exact) / std::max(absx, 1e-30));
        }
      }
    }
    std::printf("[quant] q8 %-6s |y - w.xq|/sum|w.xq| max %.2e; |y - w.x|/sum|w.x| (activation rounding) max %.2e\n",
                strata::quant::detail::type_name(t), worst_fmt, worst_quant);
  }
}

TEST(QuantQ8, NonFiniteActivationsReachTheOutput) {
  std::mt19937_64 rng(test_seed() ^ 0x4242);
  for (k::CpuKernels fam : families()) {
    const k::KernelConfig kc = config(fam, k::ActQuant::Q8);
    for (GgmlType t : kQ8Types) {
      const int64_t rows = 4, cols = 256;
      const auto w = random_rows(t, rows, cols, rng);
      for (float bad : {NAN, INFINITY}) {
        auto x = random_x(cols, rng);
        x[77] = bad;
        std::vector<float> y(static_cast<size_t>(rows));
        k::matmul(kc, t, w.data(), q::row_size(t, cols), 0, rows, cols, x.data(), cols, 1, y.data(), rows);
        for (float v : y)
          EXPECT_TRUE(std::isnan(v)) << strata::quant::detail::type_name(t) << " " << k::cpu_kernels_name(fam);
      }
    }
  }
}

TEST(QuantQ8, ModeSelection) {
  EXPECT_EQ(k::parse_act_quant("f32"), k::ActQuant::F32);
  EXPECT_EQ(k::parse_act_quant("q8"), k::ActQuant::Q8);
  EXPECT_THROW(k::parse_act_quant("int4"), std::invalid_argument);
  // auto: q8 with the AVX2 and AVX-512 kernels (every quantized type), f32 with the scalar family
  const k::KernelConfig scalar = config(k::CpuKernels::Scalar, k::ActQuant::Auto);
  EXPECT_EQ(scalar.act, k::ActQuant::F32);
  EXPECT_FALSE(k::has_q8_activations(scalar, GgmlType::Q4_K));
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("bmi2")) {
    const k::KernelConfig avx2 = config(k::CpuKernels::Avx2, k::ActQuant::Auto);
    EXPECT_EQ(avx2.act, k::ActQuant::Q8);
    for (GgmlType t : kQ8Types) EXPECT_TRUE(k::has_q8_activations(avx2, t)) << strata::quant::detail::type_name(t);
    EXPECT_FALSE(k::has_q8_activations(avx2, GgmlType::BF16));
  }
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq"))
    GTEST_SKIP() << "no AVX-512 on this CPU: the avx512 family cannot be resolved here (scalar and avx2 checked above)";
  EXPECT_EQ(config(k::CpuKernels::Avx512, k::ActQuant::Auto).act, k::ActQuant::Q8);
  const k::KernelConfig q8 = config(k::CpuKernels::Avx512, k::ActQuant::Q8);
  EXPECT_TRUE(k::has_q8_activations(q8, GgmlType::Q4_K));
  EXPECT_TRUE(k::has_q8_activations(q8, GgmlType::Q6_K));
  EXPECT_TRUE(k::has_q8_activations(q8, GgmlType::Q5_K));
  for (GgmlType t : kQ8Types) EXPECT_TRUE(k::has_q8_activations(q8, t)) << strata::quant::detail::type_name(t);
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16})  // no int8 kernel: fp32 activations
    EXPECT_FALSE(k::has_q8_activations(q8, t)) << strata::quant::detail::type_name(t);
  EXPECT_FALSE(k::has_q8_activations(config(k::CpuKernels::Avx512, k::ActQuant::F32), GgmlType::Q4_K));
}

// The AVX2 prefill tiles (gemm_q8_avx2 in matmul_q8_avx2.cpp: 2 rows x 4 tokens for the 32-weight
// block types, 4 tokens per row for Q4_K/Q5_K/IQ4_XS; n_tok >= 4; Q8_0: matmul_q8_0_avx2.cpp)
// against the AVX2 family's definition (matmul_q8_scalar_avx2)
// and against the row kernels (n_tok < 4), bit for bit: row ranges that start and end inside a
// row tile, every tile remainder (n_tok 4..9, and 67 crossing the 64-token block), wider ldy, and
// the codes at the ends of the int16 range (all-maximal Q4_K/Q5_K/Q8_0/IQ4_XS codes against
// activation codes of +-127, where Q5_K's int16 sum of 4 chunks reaches 31496).
TEST(QuantQ8, Avx2TilesEqualDefinitionAndRowKernels) {
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
        __builtin_cpu_supports("bmi2")))
    GTEST_SKIP() << "no AVX2 on this CPU";
  std::mt19937_64 rng(test_seed() ^ 0x7117);
  int64_t checked = 0;
  for (bool extreme : {false, true}) {
    for (GgmlType t : kQ8Types) {
      const int64_t cols = q::block_elems(t) == 256 ? 768 : 800;  // 800: 25 blocks (a partial group of 8)
      const int64_t rows = 7, r0 = 1, r1 = 6;
      auto w = random_rows(t, rows, cols, rng);
      const size_t rb = q::row_size(t, cols);
      if (extreme) {
        const bool k4 = t == GgmlType::Q4_K || t == GgmlType::Q5_K, iq4 = t == GgmlType::IQ4_XS;
        if (!k4 && iq4 == false && t != GgmlType::Q8_0) continue;
        const size_t bb = q::row_size(t, q::block_elems(t));
        for (size_t b = 0; b < w.size() / bb; ++b) {
          uint8_t* blk = w.data() + b * bb;
          if (t == GgmlType::Q8_0) std::memset(blk + 2, b % 2 ? 0x80 : 0x7f, 32);  // -128 / +127
          if (t == GgmlType::Q4_K) std::memset(blk + 16, 0xff, 128);               // nibbles 15
          if (t == GgmlType::Q5_K) std::memset(blk + 16, 0xff, 160);               // qh + nibbles: 31
          if (iq4) std::memset(blk + 8, 0x00, 128);                                // kvalues[0] = -127
        }
      }
      for (int64_t n_tok : {1, 2, 3, 4, 5, 6, 7, 8, 9, 67}) {
        std::vector<float> x = random_x(n_tok * cols, rng);
        if (extreme)  // +-amax everywhere: codes +-127, one sign per token
          for (int64_t i = 0; i < n_tok * cols; ++i) x[static_cast<size_t>(i)] = (i / cols) % 2 ? -0.5f : 0.5f;
        k::ActQ8 act;
        act.resize(n_tok, cols, t);
        k::quantize_activations(config(k::CpuKernels::Auto), x.data(), cols, 0, n_tok, act);
        const int64_t ldy = rows + 3;
        std::vector<float> ref(static_cast<size_t>(ldy * n_tok), NAN), y(ref.size(), NAN), one(ref.size(), NAN);
        kd::MatmulArgs a{t, w.data(), rb, r0, r1, cols, x.data(), cols, n_tok, ref.data(), ldy};
        kd::matmul_q8_scalar_avx2(a, act);
        a.y = y.data();
        ASSERT_TRUE(kd::matmul_q8_avx2(a, act));
        // each token alone (the row kernels), from its own quantization
        for (int64_t tk = 0; tk < n_tok; ++tk) {
          k::ActQ8 a1;
          a1.resize(1, cols, t);
          k::quantize_activations(config(k::CpuKernels::Auto), x.data() + tk * cols, cols, 0, 1, a1);
          kd::MatmulArgs s{t, w.data(), rb, r0, r1, cols, nullptr, cols, 1, one.data() + tk * ldy, ldy};
          ASSERT_TRUE(kd::matmul_q8_avx2(s, a1));
        }
        for (int64_t tk = 0; tk < n_tok; ++tk)
          for (int64_t r = 0; r < ldy; ++r) {
            const size_t i = static_cast<size_t>(tk * ldy + r);
            if (r < r0 || r >= r1) {  // outside the row range: untouched
              ASSERT_TRUE(std::isnan(y[i]));
              continue;
            }
            ASSERT_FALSE(std::isnan(ref[i]));
            ASSERT_EQ(bits(y[i]), bits(ref[i])) << strata::quant::detail::type_name(t) << (extreme ? " extreme" : "")
                                                << " n_tok=" << n_tok << " token " << tk << " row " << r;
            ASSERT_EQ(bits(one[i]), bits(y[i])) << strata::quant::detail::type_name(t) << " token " << tk << " alone";
            ++checked;
          }
      }
    }
  }
  std::printf("[quant] avx2 tiles: %lld outputs equal to the definition and to single-token calls\n",
              static_cast<long long>(checked));
}

namespace {

bool cpu_has_avx512_q8() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

/// The AVX-512 levels this CPU has (each a superset of the one before).
std::vector<kd::Q8Isa> avx512_levels() {
  std::vector<kd::Q8Isa> v = {kd::Q8Isa::Avx512};
  if (kd::best_q8_isa() != kd::Q8Isa::Avx512) v.push_back(kd::Q8Isa::Avx512Vnni);
  if (kd::best_q8_isa() >= kd::Q8Isa::Avx512Icl && kd::amx_int8_usable()) v.push_back(kd::Q8Isa::Avx512Amx);
  return v;
}

}  // namespace

// The AVX-512 Q8_0 and Q4_K GEMMs with the tokens in the lanes (matmul_q8_0_avx512.cpp), and their
// mat-vecs, against their scalar definitions (matmul_q8_scalar_avx512: serial; for Q8_0 the CUDA
// q8 arithmetic), bit for bit: rows that are not a multiple of the 4-row tile (nor of the
// mat-vec's 16), 1 to 128 blocks per row (Q4_K: 1 to 16 super-blocks), every token count around
// the 16-token group and the 3-group tile, the row range split over 1 and 2 threads, the layout
// kept in ActQ8 (tok16) and made by the kernel, and the extreme codes (Q8_0: weights -128 / +127
// against activation codes +-127, |S_b| = 32 * 128 * 127; Q4_K: codes 15 and 6-bit scales and
// mins 63 against +-127).
static void token_lanes_equal_definition(GgmlType t) {
  std::mt19937_64 rng(test_seed() ^ 0x51a0 ^ static_cast<uint64_t>(t));
  const bool q4k = t == GgmlType::Q4_K, sb = t != GgmlType::Q8_0;  // sb: a 256-weight super-block type
  int64_t checked = 0;
  for (kd::Q8Isa isa : avx512_levels()) {
    for (bool extreme : {false, true}) {
      // (16384 columns: the unpacked weight tile, 64 KiB, no longer fits in L1; one 3-group block)
      for (int64_t cols :
           sb ? std::vector<int64_t>{256, 512, 2304, 4096, 16384} : std::vector<int64_t>{32, 96, 800, 4096}) {
        const int64_t rows = cols == 16384 ? 5 : cols == 4096 ? 13 : 30;
        auto w = random_rows(t, rows, cols, rng);
        if (extreme && !sb)
          for (int64_t b = 0; b < rows * cols / 32; ++b) std::memset(w.data() + 34 * b + 2, b % 3 ? 0x80 : 0x7f, 32);
        if (extreme && q4k)  // scales and mins 63 (k4_scale_min of all-ones bytes), codes 15 or 0
          for (int64_t b = 0; b < rows * cols / 256; ++b) {
            std::memset(w.data() + 144 * b + 4, 0xff, 12);
            std::memset(w.data() + 144 * b + 16, b % 3 ? 0xff : 0x0f, 128);
          }
        if (extreme && t == GgmlType::IQ4_XS)  // scales 63 - 32 or 0 - 32, codes 0 (value -127) or 15 (113)
          for (int64_t b = 0; b < rows * cols / 256; ++b) {
            std::memset(w.data() + 136 * b + 2, b % 2 ? 0xff : 0x00, 6);
            std::memset(w.data() + 136 * b + 8, b % 3 ? 0x00 : 0xff, 128);
          }
        const size_t rb = q::row_size(t, cols);
        for (int64_t n_tok : {1, 2, 3, 4, 5, 7, 15, 16, 17, 33, 64, 511, 512}) {
          if (cols == 4096 && n_tok > 64 && n_tok != 512) continue;
          if (cols == 16384 && n_tok != 1 && n_tok != 17 && n_tok != 64) continue;
          std::vector<float> x = random_x(n_tok * cols, rng);
          if (extreme)
            for (int64_t i = 0; i < n_tok * cols; ++i) x[static_cast<size_t>(i)] = (i / 32) % 2 ? -0.5f : 0.5f;
          k::ActQ8 kept, bare;  // with the token-lane layout kept, and without (the kernel makes it)
          kept.resize(n_tok, cols, t);
          bare.resize(n_tok, cols);
          ASSERT_EQ(kept.tok16, n_tok > kd::kQ8_0MatVecMax);
          ASSERT_EQ(kept.tok16_xs, q4k && n_tok > kd::kQ8_0MatVecMax);
          ASSERT_FALSE(bare.tok16);
          // quantized in two token ranges (as the thread pool does): the layout must not care
          k::quantize_activations(config(k::CpuKernels::Auto), x.data(), cols, 0, n_tok / 2, kept);
          k::quantize_activations(config(k::CpuKernels::Auto), x.data(), cols, n_tok / 2, n_tok, kept);
          k::quantize_activations(config(k::CpuKernels::Auto), x.data(), cols, 0, n_tok, bare);
          const int64_t ldy = rows + 1;
          std::vector<float> ref(static_cast<size_t>(ldy * n_tok), NAN);
          kd::MatmulArgs a{t, w.data(), rb, 0, rows, cols, nullptr, cols, n_tok, ref.data(), ldy};
          kd::matmul_q8_scalar_avx512(a, bare);
          for (int threads : {1, 2})
            for (const k::ActQ8* ap : {&kept, &bare}) {
              std::vector<float> y(ref.size(), NAN);
              // rows split at an odd row (inside a 4-row tile) for 2 threads
              const int64_t split = threads == 1 ? rows : rows / 2 + 1;
              auto run = [&](int64_t r0, int64_t r1) {
                kd::MatmulArgs s = a;
                s.row_begin = r0;
                s.row_end = r1;
                s.y = y.data();
                ASSERT_TRUE(kd::matmul_q8_avx512(s, *ap, isa));
              };
              if (threads == 1)
                run(0, rows);
              else
                run_split(split, rows, run);
              for (int64_t tk = 0; tk < n_tok; ++tk)
                for (int64_t r = 0; r < ldy; ++r) {
                  const size_t i = static_cast<size_t>(tk * ldy + r);
                  if (r >= rows) {
                    ASSERT_TRUE(std::isnan(y[i])) << "column past the rows written";
                    continue;
                  }
                  ASSERT_FALSE(std::isnan(ref[i]));
                  ASSERT_EQ(bits(y[i]), bits(ref[i]))
                      << strata::quant::detail::type_name(t) << " "
                      << (isa == kd::Q8Isa::Avx512      ? "avx512"
                          : isa == kd::Q8Isa::Avx512Amx ? "avx512-amx"
                                                        : "avx512-vnni")
                      << (extreme ? " extreme" : "") << " cols=" << cols << " n_tok=" << n_tok << " threads=" << threads
                      << (ap == &kept ? " kept" : " made") << " token " << tk << " row " << r;
                  ++checked;
                }
            }
        }
      }
    }
  }
  std::printf("[quant] avx512 %s token lanes: %lld outputs equal to the serial definition\n",
              strata::quant::detail::type_name(t), static_cast<long long>(checked));
}

TEST(QuantQ8, Avx512Q8_0TokenLanesEqualDefinition) {
  if (!cpu_has_avx512_q8()) GTEST_SKIP() << "no AVX-512 on this CPU";
  token_lanes_equal_definition(GgmlType::Q8_0);
}

TEST(QuantQ8, Avx512Q4_KTokenLanesEqualDefinition) {
  if (!cpu_has_avx512_q8()) GTEST_SKIP() << "no AVX-512 on this CPU";
  token_lanes_equal_definition(GgmlType::Q4_K);
}

TEST(QuantQ8, Avx512IQ4_XSTokenLanesEqualDefinition) {
  if (!cpu_has_avx512_q8()) GTEST_SKIP() << "no AVX-512 on this CPU";
  token_lanes_equal_definition(GgmlType::IQ4_XS);
}

// The AMX GEMMs (matmul_tok16_amx.cpp, level Avx512Amx) against the serial definition
// (matmul_q8_scalar_avx512) and against the AVX-512 tokens-in-the-lanes GEMM (level Avx512Vnni),
// bit for bit: 16-row tiles and their tails (37 rows; a row range starting and ending inside a
// tile; 2 threads splitting at an odd row), token counts around the 16-token group (5 .. 512),
// 8 to 512 blocks per row (16384 columns: the group's codes no longer fit the 512 KiB token block
// more than once), the token-lane layout kept in ActQ8 and made by the kernel, and extreme codes
// (Q8_0: weights -128 / +127 against activation codes +-127, |S_b| up to 32 * 128 * 127; Q4_K:
// codes 15 with scales and mins 63; IQ4_XS: values -127 / 113 with scales 31 / -32).
static void amx_equals_definition(GgmlType t) {
  std::mt19937_64 rng(test_seed() ^ 0xa3f ^ static_cast<uint64_t>(t));
  int64_t checked = 0;
  for (bool extreme : {false, true})
    for (int64_t cols : {256, 1024, 4096, 16384}) {
      const int64_t rows = 37;
      auto w = random_rows(t, rows, cols, rng);
      if (extreme && t == GgmlType::Q8_0)
        for (int64_t b = 0; b < rows * cols / 32; ++b) std::memset(w.data() + 34 * b + 2, b % 3 ? 0x80 : 0x7f, 32);
      if (extreme && t == GgmlType::Q4_K)  // scales and mins 63 (k4_scale_min of all-ones bytes), codes 15 or 0
        for (int64_t b = 0; b < rows * cols / 256; ++b) {
          std::memset(w.data() + 144 * b + 4, 0xff, 12);
          std::memset(w.data() + 144 * b + 16, b % 3 ? 0xff : 0x0f, 128);
        }
      if (extreme && t == GgmlType::IQ4_XS)  // scales 63 - 32 or 0 - 32, codes 0 (value -127) or 15 (113)
        for (int64_t b = 0; b < rows * cols / 256; ++b) {
          std::memset(w.data() + 136 * b + 2, b % 2 ? 0xff : 0x00, 6);
          std::memset(w.data() + 136 * b + 8, b % 3 ? 0x00 : 0xff, 128);
        }
      const size_t rb = q::row_size(t, cols);
      for (int64_t n_tok : {5, 15, 16, 17, 33, 64, 511, 512}) {
        if (cols == 16384 && n_tok > 64 && n_tok != 512) continue;
        if (cols >= 4096 && (n_tok == 15 || n_tok == 33)) continue;
        std::vector<float> x = random_x(n_tok * cols, rng);
        if (extreme)
          for (int64_t i = 0; i < n_tok * cols; ++i) x[static_cast<size_t>(i)] = (i / 32) % 2 ? -0.5f : 0.5f;
        k::ActQ8 kept, bare;
        kept.resize(n_tok, cols, t);
        bare.resize(n_tok, cols);
        ASSERT_TRUE(kept.tok16);
        k::quantize_activations(config(k::CpuKernels::Auto), x.data(), cols, 0, n_tok, kept);
        k::quantize_activations(config(k::CpuKernels::Auto), x.data(), cols, 0, n_tok, bare);
        const int64_t ldy = rows + 3;
        std::vector<float> ref(static_cast<size_t>(ldy * n_tok), NAN), lanes(ref.size(), NAN);
        kd::MatmulArgs a{t, w.data(), rb, 0, rows, cols, nullptr, cols, n_tok, ref.data(), ldy};
        kd::matmul_q8_scalar_avx512(a, bare);
        a.y = lanes.data();
        ASSERT_TRUE(kd::matmul_q8_avx512(a, kept, kd::Q8Isa::Avx512Vnni));
        // row ranges: all, [3, 35) (inside the first and the third tile), and two threads
        for (int variant = 0; variant < 3; ++variant)
          for (const k::ActQ8* ap : {&kept, &bare}) {
            std::vector<float> y(ref.size(), NAN);
            const int64_t r0 = variant == 1 ? 3 : 0, r1 = variant == 1 ? 35 : rows;
            auto run = [&](int64_t b0, int64_t b1) {
              kd::MatmulArgs s = a;
              s.row_begin = b0;
              s.row_end = b1;
              s.y = y.data();
              ASSERT_TRUE(kd::matmul_q8_avx512(s, *ap, kd::Q8Isa::Avx512Amx));
            };
            if (variant == 2)
              run_split(19, rows, run);
            else
              run(r0, r1);
            for (int64_t tk = 0; tk < n_tok; ++tk)
              for (int64_t r = 0; r < ldy; ++r) {
                const size_t i = static_cast<size_t>(tk * ldy + r);
                if (r < r0 || r >= r1) {
                  ASSERT_TRUE(std::isnan(y[i])) << "row outside the range written: " << r;
                  continue;
                }
                ASSERT_EQ(bits(y[i]), bits(ref[i]))
                    << strata::quant::detail::type_name(t) << " amx vs definition" << (extreme ? " extreme" : "")
                    << " cols=" << cols << " n_tok=" << n_tok << " variant=" << variant
                    << (ap == &kept ? " kept" : " made") << " token " << tk << " row " << r;
                ASSERT_EQ(bits(y[i]), bits(lanes[i])) << "amx vs avx512 lanes cols=" << cols << " n_tok=" << n_tok;
                ++checked;
              }
          }
      }
    }
  std::printf("[quant] amx %s: %lld outputs equal to the serial definition and to the avx512 GEMM\n",
              strata::quant::detail::type_name(t), static_cast<long long>(checked));
}

static bool amx_test_skip(std::string& why) {
  if (!cpu_has_avx512_q8() || kd::best_q8_isa() < kd::Q8Isa::Avx512Icl) {
    why = "no AVX-512 VNNI/VBMI/GFNI on this CPU (so no AMX level)";
    return true;
  }
  if (!kd::amx_int8_usable()) {
    why = "no AMX-INT8 on this CPU, or the kernel refused the tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM)";
    return true;
  }
  return false;
}

TEST(QuantQ8, AmxQ8_0EqualsDefinitionAndAvx512) {
  std::string why;
  if (amx_test_skip(why)) GTEST_SKIP() << why;
  amx_equals_definition(GgmlType::Q8_0);
}

TEST(QuantQ8, AmxQ4_KEqualsDefinitionAndAvx512) {
  std::string why;
  if (amx_test_skip(why)) GTEST_SKIP() << why;
  amx_equals_definition(GgmlType::Q4_K);
}

TEST(QuantQ8, AmxIQ4_XSEqualsDefinitionAndAvx512) {
  std::string why;
  if (amx_test_skip(why)) GTEST_SKIP() << why;
  amx_equals_definition(GgmlType::IQ4_XS);
}

// STRATA_CPU_AMX=0 takes the AMX level out of best_q8_isa (and so out of the run-time choice).
TEST(QuantQ8, AmxOffByEnvironment) {
  if (!cpu_has_avx512_q8()) GTEST_SKIP() << "no AVX-512 on this CPU";
  const char* old = std::getenv("STRATA_CPU_AMX");
  const std::string saved = old ? old : "";
  ::setenv("STRATA_CPU_AMX", "0", 1);
  EXPECT_NE(kd::best_q8_isa(), kd::Q8Isa::Avx512Amx);
  const bool icl = kd::best_q8_isa() == kd::Q8Isa::Avx512Icl;
  ::setenv("STRATA_CPU_AMX", "1", 1);
  EXPECT_EQ(kd::best_q8_isa() == kd::Q8Isa::Avx512Amx, icl && kd::amx_int8_usable());
  if (old) {
    ::setenv("STRATA_CPU_AMX", saved.c_str(), 1);
  } else {
    ::unsetenv("STRATA_CPU_AMX");
  }
}

// Batch invariance of the token-lane GEMM: a token's outputs are the same bits alone, at every
// position of a group of 16, and at several positions of a batch of 512 (the other tokens random).
static void token_lanes_batch_invariant(GgmlType t, k::CpuKernels fam = k::CpuKernels::Avx512) {
  std::mt19937_64 rng(test_seed() ^ 0x16 ^ static_cast<uint64_t>(t));
  const int64_t rows = 11, cols = 1024;
  const size_t rb = q::row_size(t, cols);
  const auto w = random_rows(t, rows, cols, rng);
  const std::vector<float> probe = random_x(cols, rng);
  const k::KernelConfig kc = config(fam, k::ActQuant::Q8);
  auto outputs = [&](int64_t n_tok, int64_t pos) {  // the probe's outputs at `pos` of n_tok tokens
    std::vector<float> x = random_x(n_tok * cols, rng);
    std::copy(probe.begin(), probe.end(), x.begin() + pos * cols);
    std::vector<float> y(static_cast<size_t>(n_tok * rows));
    k::matmul(kc, t, w.data(), rb, 0, rows, cols, x.data(), cols, n_tok, y.data(), rows);
    return std::vector<float>(y.begin() + pos * rows, y.begin() + (pos + 1) * rows);
  };
  const std::vector<float> alone = outputs(1, 0);
  auto same = [&](const std::vector<float>& v, const char* what, int64_t pos) {
    for (int64_t r = 0; r < rows; ++r)
      ASSERT_EQ(bits(v[static_cast<size_t>(r)]), bits(alone[static_cast<size_t>(r)]))
          << strata::quant::detail::type_name(t) << " " << what << " position " << pos << " row " << r;
  };
  for (int64_t pos = 0; pos < 16; ++pos) same(outputs(16, pos), "group of 16", pos);
  for (int64_t pos : {0, 1, 15, 16, 47, 48, 255, 497, 511}) same(outputs(512, pos), "batch of 512", pos);
  for (int64_t pos : {0, 6}) same(outputs(7, pos), "batch of 7", pos);
}

TEST(QuantQ8, Avx512Q8_0TokenLanesBatchInvariant) {
  if (!cpu_has_avx512_q8()) GTEST_SKIP() << "no AVX-512 on this CPU";
  token_lanes_batch_invariant(GgmlType::Q8_0);
}

TEST(QuantQ8, Avx512Q4_KTokenLanesBatchInvariant) {
  if (!cpu_has_avx512_q8()) GTEST_SKIP() << "no AVX-512 on this CPU";
  token_lanes_batch_invariant(GgmlType::Q4_K);
}

TEST(QuantQ8, Avx512IQ4_XSTokenLanesBatchInvariant) {
  if (!cpu_has_avx512_q8()) GTEST_SKIP() << "no AVX-512 on this CPU";
  token_lanes_batch_invariant(GgmlType::IQ4_XS);
}

// The AVX2 Q8_0 kernels (matmul_q8_0_avx2.cpp: the GEMM with 8 tokens per ymm, 2-row x 16-token
// register tiles, and the 8-row mat-vec) against the AVX2 family's definition
// (matmul_q8_scalar_avx2, for Q8_0 the serial one of matmul_q8_scalar_avx512) and, where the CPU
// has AVX-512, against the AVX-512 family's GEMM and mat-vec, bit for bit: 37 rows (tails of the
// 2-row tile and of the mat-vec's 8), the row range [3, 34) (starting and ending inside a tile)
// and two threads split at row 19; cols 256..16384; n_tok 1..9, 15, 16, 17, 33, 64, 67, 511, 512
// (the larger ones skipped at the wider rows); the layout kept in ActQ8 and made by the kernel;
// the extreme codes (weights -128 / +127 against activation codes +-127: |S_b| = 32 * 128 * 127,
// vpmaddubsw pair sums at 2 * 128 * 127 = 32512).
TEST(QuantQ8, Avx2Q8_0TokenLanesEqualDefinition) {
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
        __builtin_cpu_supports("bmi2")))
    GTEST_SKIP() << "no AVX2 on this CPU";
  const GgmlType t = GgmlType::Q8_0;
  const bool avx512 = cpu_has_avx512_q8();
  std::mt19937_64 rng(test_seed() ^ 0xa2a2);
  int64_t checked = 0, vs512 = 0;
  for (bool extreme : {false, true}) {
    for (int64_t cols : {256, 800, 1024, 4096, 16384}) {
      const int64_t rows = cols >= 4096 ? 21 : 37;
      auto w = random_rows(t, rows, cols, rng);
      if (extreme)
        for (int64_t b = 0; b < rows * cols / 32; ++b) std::memset(w.data() + 34 * b + 2, b % 3 ? 0x80 : 0x7f, 32);
      const size_t rb = q::row_size(t, cols);
      for (int64_t n_tok : {1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 33, 64, 67, 511, 512}) {
        if (cols == 4096 && n_tok > 67 && n_tok != 512) continue;
        if (cols == 16384 && n_tok > 17 && n_tok != 64) continue;
        std::vector<float> x = random_x(n_tok * cols, rng);
        if (extreme)
          for (int64_t i = 0; i < n_tok * cols; ++i) x[static_cast<size_t>(i)] = (i / 32) % 2 ? -0.5f : 0.5f;
        k::ActQ8 kept, bare;
        kept.resize(n_tok, cols, t);
        bare.resize(n_tok, cols);
        k::quantize_activations(config(k::CpuKernels::Avx2), x.data(), cols, 0, n_tok / 2, kept);
        k::quantize_activations(config(k::CpuKernels::Avx2), x.data(), cols, n_tok / 2, n_tok, kept);
        k::quantize_activations(config(k::CpuKernels::Avx2), x.data(), cols, 0, n_tok, bare);
        const int64_t ldy = rows + 1;
        std::vector<float> ref(static_cast<size_t>(ldy * n_tok), NAN), y512(ref.size(), NAN);
        kd::MatmulArgs a{t, w.data(), rb, 0, rows, cols, nullptr, cols, n_tok, ref.data(), ldy};
        kd::matmul_q8_scalar_avx2(a, bare);
        if (avx512) {
          a.y = y512.data();
          ASSERT_TRUE(kd::matmul_q8_avx512(a, bare, kd::Q8Isa::Avx512));
          for (size_t i = 0; i < ref.size(); ++i) ASSERT_EQ(bits(y512[i]), bits(ref[i])) << "avx512 i=" << i;
          vs512 += static_cast<int64_t>(ref.size());
        }
        for (int split : {0, 1, 2})  // 0: all rows; 1: rows [3, 34); 2: two threads split at row 19
          for (const k::ActQ8* ap : {&kept, &bare}) {
            std::vector<float> y(ref.size(), NAN);
            auto run = [&](int64_t r0, int64_t r1) {
              kd::MatmulArgs s = a;
              s.row_begin = r0;
              s.row_end = r1;
              s.y = y.data();
              ASSERT_TRUE(kd::matmul_q8_avx2(s, *ap));
            };
            const int64_t lo = split == 1 ? 3 : 0, hi = split == 1 ? rows - 3 : rows;
            if (split == 2)
              run_split(19, rows, run);
            else
              run(lo, hi);
            for (int64_t tk = 0; tk < n_tok; ++tk)
              for (int64_t r = 0; r < ldy; ++r) {
                const size_t i = static_cast<size_t>(tk * ldy + r);
                if (r < lo || r >= hi) {
                  ASSERT_TRUE(std::isnan(y[i])) << "row outside the range written";
                  continue;
                }
                ASSERT_EQ(bits(y[i]), bits(ref[i]))
                    << "avx2 Q8_0" << (extreme ? " extreme" : "") << " cols=" << cols << " n_tok=" << n_tok
                    << " split=" << split << (ap == &kept ? " kept" : " made") << " token " << tk << " row " << r;
                ++checked;
              }
          }
      }
    }
  }
  std::printf("[quant] avx2 Q8_0 token lanes: %lld outputs equal to the serial definition (%lld also to avx512)\n",
              static_cast<long long>(checked), static_cast<long long>(vs512));
}

// A token's outputs under the AVX2 family's Q8_0 kernels do not depend on the batch: alone (the
// mat-vec), at each position of a group of 16, in a batch of 512 and of 7 (the GEMM).
TEST(QuantQ8, Avx2Q8_0TokenLanesBatchInvariant) {
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
        __builtin_cpu_supports("bmi2")))
    GTEST_SKIP() << "no AVX2 on this CPU";
  token_lanes_batch_invariant(GgmlType::Q8_0, k::CpuKernels::Avx2);
}
