// Kernel benchmarks for src/backend/cpu/kernels (over the formats of src/quant), reported next
// to a memory-bandwidth probe run in the same process, so the matrix-vector numbers read as a fraction of what the
// memory can deliver.
//
//   MemRead/threads:N      sequential read of a 1 GiB buffer (AVX2 loads), GB/s
//   Memcpy/threads:N       memcpy of 512 MiB (bytes read + written), GB/s
//   MatVec/<type>/N        y = W x for one token, W ~1 GiB (far larger than the 300 MiB LLC):
//                          GB/s of weight bytes streamed, N threads splitting rows
//   MatMul/<type>/T/N      T tokens (prefill) on a 1024 x 4096 matrix (cache resident):
//                          GFLOP/s = 2 * rows * cols * T / time (activations quantized in each call)
//   MatMulQ8/<type>/T/N    the same, q8 activations quantized once outside the loop (kernel only)
//   Peak/N                 the int8 probes (peak_probe.h): vpdpbusd / AVX2 sequence, and with AMX the
//                          TDPBSSD tile peak (amx_GOPS, K = 64; amx_k32_GOPS, K = 32 as the Q8_0 GEMM)
//   Iq2xsGatherFloor       the grid gathers of one IQ2_XS super-block alone (1 thread, L2):
//                          the floor under any gather-based IQ2_XS decoder
//
// Each benchmark uses the active kernel family (auto; --cpu-kernels=scalar|avx2|avx512 forces one;
// STRATA_CPU_AMX=0 keeps the AVX-512 family off its AMX tiles).
#include <benchmark/benchmark.h>

#include "backend/cpu/kernels/simd_intrin.h"  // <immintrin.h> minus GCC 12's false -Wuninitialized

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/kernels/kernels.h"
#include "backend/cpu/kernels/peak_probe.h"
#include "quant/quant.h"
#include "quant/quant_tables.h"

using strata::GgmlType;
namespace q = strata::quant;
namespace k = strata::cpu::kernels;

namespace {

constexpr size_t kBigBytes = size_t{1} << 30;  // >> LLC (300 MiB on the dev machine)
constexpr int64_t kCols = 4096;

struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t, AlignedFree>;

Buffer alloc(size_t n) {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
  if (!p) throw std::bad_alloc();
  return Buffer(p);
}

/// Fills `n` bytes with pseudo-random data (xorshift, fast enough for GiBs).
void fill_random(uint8_t* p, size_t n, uint64_t seed) {
  uint64_t s = seed | 1;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    std::memcpy(p + i, &s, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<uint8_t>(i);
}

/// Byte offsets of the fp16 scales in a block (so random blocks decode to finite, normal values).
std::vector<int> fp16_fields(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_1:
    case GgmlType::Q5_1:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: return {0, 2};
    case GgmlType::Q2_K: return {80, 82};
    case GgmlType::Q3_K: return {108};
    case GgmlType::Q6_K: return {208};
    case GgmlType::MXFP4: return {};
    default: return {0};
  }
}

/// Makes `bytes` (rows of type t) decode to finite values of order 1.
void sanitize(GgmlType t, uint8_t* w, size_t bytes) {
  const int be = q::block_elems(t);
  const size_t bb = q::row_size(t, be);
  const size_t nb = bytes / bb;
  const uint16_t h = q::fp32_to_fp16(0.01f);
  if (t == GgmlType::F32) {
    const float v = 0.01f;
    for (size_t i = 0; i + 4 <= bytes; i += 4) std::memcpy(w + i, &v, 4);
  } else if (t == GgmlType::F16 || t == GgmlType::BF16) {
    const uint16_t v = t == GgmlType::F16 ? h : q::fp32_to_bf16(0.01f);
    for (size_t i = 0; i + 2 <= bytes; i += 2) std::memcpy(w + i, &v, 2);
  } else if (t == GgmlType::MXFP4) {
    for (size_t b = 0; b < nb; ++b) w[b * bb] = 120;
  } else {
    const std::vector<int> fields = fp16_fields(t);
    for (size_t b = 0; b < nb; ++b)
      for (int off : fields) std::memcpy(w + b * bb + static_cast<size_t>(off), &h, 2);
  }
}

/// Runs fn(row_begin, row_end) on `threads` threads splitting [0, rows) evenly.
template <class Fn>
void split_rows(int threads, int64_t rows, Fn fn) {
  if (threads == 1) {
    fn(int64_t{0}, rows);
    return;
  }
  std::vector<std::thread> ts;
  for (int i = 0; i < threads; ++i) {
    const int64_t r0 = rows * i / threads, r1 = rows * (i + 1) / threads;
    ts.emplace_back([=] { fn(r0, r1); });
  }
  for (auto& t : ts) t.join();
}

// ---- memory probe ----

__attribute__((target("avx2"))) uint64_t read_sum(const uint8_t* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 128 <= n; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  alignas(32) uint64_t v[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(v), s);
  return v[0] + v[1] + v[2] + v[3];
}

__attribute__((target("avx512f"))) uint64_t read_sum512(const uint8_t* p, size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 256 <= n; i += 256) {
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(p + i + 64));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512(p + i + 128));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512(p + i + 192));
  }
  return static_cast<uint64_t>(
      _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3))));
}

uint64_t read_probe(const uint8_t* p, size_t n) {
  return __builtin_cpu_supports("avx512f") ? read_sum512(p, n) : read_sum(p, n);
}

uint8_t* big_buffer() {
  static Buffer b = [] {
    Buffer x = alloc(kBigBytes);
    fill_random(x.get(), kBigBytes, 42);
    return x;
  }();
  return b.get();
}

void BM_MemRead(benchmark::State& st) {
  const int threads = static_cast<int>(st.range(0));
  const uint8_t* p = big_buffer();
  for (auto _ : st) {
    std::vector<uint64_t> sums(static_cast<size_t>(threads));
    split_rows(threads, static_cast<int64_t>(kBigBytes / 4096), [&](int64_t a, int64_t b) {
      sums[static_cast<size_t>(a * threads / static_cast<int64_t>(kBigBytes / 4096))] =
          read_probe(p + a * 4096, static_cast<size_t>(b - a) * 4096);
    });
    benchmark::DoNotOptimize(sums.data());
  }
  st.counters["GB/s"] = benchmark::Counter(static_cast<double>(kBigBytes) * static_cast<double>(st.iterations()) / 1e9,
                                           benchmark::Counter::kIsRate);
}

void BM_Memcpy(benchmark::State& st) {
  const int threads = static_cast<int>(st.range(0));
  const size_t half = kBigBytes / 2;
  uint8_t* p = big_buffer();
  for (auto _ : st) {
    split_rows(threads, static_cast<int64_t>(half / 4096), [&](int64_t a, int64_t b) {
      std::memcpy(p + half + a * 4096, p + a * 4096, static_cast<size_t>(b - a) * 4096);
    });
    benchmark::ClobberMemory();
  }
  st.counters["GB/s"] = benchmark::Counter(2.0 * static_cast<double>(half) * static_cast<double>(st.iterations()) / 1e9,
                                           benchmark::Counter::kIsRate);
}

// ---- kernels ----

/// The kernels every benchmark runs: --cpu-kernels / --act-quant, resolved in main().
k::KernelConfig g_kernels;

const GgmlType kTypes[] = {GgmlType::F32,    GgmlType::F16,    GgmlType::BF16, GgmlType::Q8_0,   GgmlType::Q4_0,
                           GgmlType::Q4_1,   GgmlType::Q5_0,   GgmlType::Q5_1, GgmlType::Q2_K,   GgmlType::Q3_K,
                           GgmlType::Q4_K,   GgmlType::Q5_K,   GgmlType::Q6_K, GgmlType::IQ2_XS, GgmlType::IQ3_S,
                           GgmlType::IQ4_XS, GgmlType::IQ4_NL, GgmlType::MXFP4};

std::vector<float> activations(int64_t n) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = u(rng);
  return x;
}

void BM_MatVec(benchmark::State& st, GgmlType t) {
  const int threads = static_cast<int>(st.range(0));
  const size_t rb = q::row_size(t, kCols);
  const int64_t rows = static_cast<int64_t>(kBigBytes / rb);
  uint8_t* w = big_buffer();  // the same 1 GiB, re-sanitized for this type
  sanitize(t, w, static_cast<size_t>(rows) * rb);
  const auto x = activations(kCols);
  std::vector<float> y(static_cast<size_t>(rows));
  for (auto _ : st) {
    split_rows(threads, rows, [&](int64_t r0, int64_t r1) {
      k::matmul(g_kernels, t, w, rb, r0, r1, kCols, x.data(), kCols, 1, y.data(), rows);
    });
    benchmark::DoNotOptimize(y.data());
  }
  const double bytes = static_cast<double>(rows) * static_cast<double>(rb);
  st.counters["GB/s"] =
      benchmark::Counter(bytes * static_cast<double>(st.iterations()) / 1e9, benchmark::Counter::kIsRate);
  st.counters["Gweights/s"] =
      benchmark::Counter(static_cast<double>(rows * kCols) * static_cast<double>(st.iterations()) / 1e9,
                         benchmark::Counter::kIsRate);
}

// `rows` random rows of type t and kCols columns (rows row_size(t, kCols) bytes apart), made
// valid for the type's decoder (sanitize), from `seed`.
Buffer random_weights(GgmlType t, int64_t rows, uint64_t seed) {
  const size_t bytes = q::row_size(t, kCols) * static_cast<size_t>(rows);
  Buffer w = alloc(bytes);
  fill_random(w.get(), bytes, seed);
  sanitize(t, w.get(), bytes);
  return w;
}

// A matrix-matrix benchmark's rate: 2 rows x kCols x n_tok flops per iteration, in GFLOP/s.
benchmark::Counter gflops(const benchmark::State& st, int64_t rows, int64_t n_tok) {
  return benchmark::Counter(2.0 * static_cast<double>(rows * kCols * n_tok) * static_cast<double>(st.iterations()) /
                                1e9,
                            benchmark::Counter::kIsRate);
}

// The same matrix-vector product on ~1 MiB of weights (L2 resident): the decode+FMA compute
// ceiling, to compare with the DRAM-bound MatVec.
void BM_MatVecHot(benchmark::State& st, GgmlType t) {
  const size_t rb = q::row_size(t, kCols);
  const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>((size_t{1} << 20) / rb));
  Buffer w = random_weights(t, rows, 5);
  const auto x = activations(kCols);
  std::vector<float> y(static_cast<size_t>(rows));
  for (auto _ : st) {
    k::matmul(g_kernels, t, w.get(), rb, 0, rows, kCols, x.data(), kCols, 1, y.data(), rows);
    benchmark::DoNotOptimize(y.data());
  }
  st.counters["GB/s"] = benchmark::Counter(static_cast<double>(rows) * static_cast<double>(rb) *
                                               static_cast<double>(st.iterations()) / 1e9,
                                           benchmark::Counter::kIsRate);
  st.counters["Gweights/s"] =
      benchmark::Counter(static_cast<double>(rows * kCols) * static_cast<double>(st.iterations()) / 1e9,
                         benchmark::Counter::kIsRate);
}

// The roofline probes (backend/cpu/kernels/peak_probe.h) in this process, on 1 or 2 threads at
// once: the int8 dot-product peak of the kernel family (GOPS, 2 per multiply-add; MatMul's
// GFLOP/s is counted the same way), the bare vpmaddubsw rate and the sequential read GB/s.
void BM_Peak(benchmark::State& st) {
  k::PeakProbe p;
  for (auto _ : st) p = k::probe_peak(g_kernels.family, static_cast<int>(st.range(0)));
  st.counters["int8_GOPS"] = p.int8_gops;
  st.counters["maddubs_GOPS"] = p.maddubs_gops;
  st.counters["amx_GOPS"] = p.amx_int8_gops;
  st.counters["amx_k32_GOPS"] = p.amx_k32_gops;
  st.counters["read_GB/s"] = p.read_gbps;
}

void BM_MatMul(benchmark::State& st, GgmlType t) {
  const int64_t n_tok = st.range(0);
  const int threads = static_cast<int>(st.range(1));
  const int64_t rows = 1024;
  const size_t rb = q::row_size(t, kCols);
  Buffer w = random_weights(t, rows, 3);
  const auto x = activations(n_tok * kCols);
  std::vector<float> y(static_cast<size_t>(rows * n_tok));
  for (auto _ : st) {
    split_rows(threads, rows, [&](int64_t r0, int64_t r1) {
      k::matmul(g_kernels, t, w.get(), rb, r0, r1, kCols, x.data(), kCols, n_tok, y.data(), rows);
    });
    benchmark::DoNotOptimize(y.data());
  }
  st.counters["GFLOP/s"] = gflops(st, rows, n_tok);
}

// The same product with the activations quantized once, outside the timed loop (as the engine
// does: one quantization per layer input, shared by every matmul and thread that reads it), so
// only the kernel is timed: MatMulQ8/<type>/T/N.
void BM_MatMulQ8(benchmark::State& st, GgmlType t) {
  const int64_t n_tok = st.range(0);
  const int threads = static_cast<int>(st.range(1));
  const int64_t rows = 1024;
  const size_t rb = q::row_size(t, kCols);
  Buffer w = random_weights(t, rows, 3);
  const auto x = activations(n_tok * kCols);
  k::ActQ8 act;
  act.resize(n_tok, kCols, t);
  k::quantize_activations(g_kernels, x.data(), kCols, 0, n_tok, act);
  std::vector<float> y(static_cast<size_t>(rows * n_tok));
  for (auto _ : st) {
    split_rows(threads, rows, [&](int64_t r0, int64_t r1) {
      k::matmul_q8(g_kernels, t, w.get(), rb, r0, r1, kCols, act, y.data(), rows);
    });
    benchmark::DoNotOptimize(y.data());
  }
  st.counters["GFLOP/s"] = gflops(st, rows, n_tok);
}

// The floor of any IQ2_XS decoder that looks its grid up with vpgatherqq, as the q8 kernel
// does: per super-block (74 bytes, 32 9-bit grid indices) the kernel's index extraction and its
// four 8-entry gathers from the 4 KiB grid (L1), summed so nothing is optimized away; codes
// stream from 0.5 MiB (L2). ns/superblock and the GB/s of weight bytes that alone would allow.
__attribute__((target("avx512f,avx512bw"))) __attribute__((noinline)) long long iq2xs_gathers(const uint8_t* w,
                                                                                              int64_t nsb) {
  const long long* grid = reinterpret_cast<const long long*>(strata::quant::tables::iq2xs_grid);
  const __m512i m511 = _mm512_set1_epi64(511);
  __m512i acc0 = _mm512_setzero_si512(), acc1 = acc0;
  for (int64_t i = 0; i < nsb; ++i, w += 74) {
    const __m512i codes = _mm512_loadu_si512(w + 2);
    acc0 = _mm512_add_epi64(acc0, _mm512_i64gather_epi64(_mm512_and_si512(codes, m511), grid, 8));
    acc1 =
        _mm512_add_epi64(acc1, _mm512_i64gather_epi64(_mm512_and_si512(_mm512_srli_epi64(codes, 16), m511), grid, 8));
    acc0 =
        _mm512_add_epi64(acc0, _mm512_i64gather_epi64(_mm512_and_si512(_mm512_srli_epi64(codes, 32), m511), grid, 8));
    acc1 =
        _mm512_add_epi64(acc1, _mm512_i64gather_epi64(_mm512_and_si512(_mm512_srli_epi64(codes, 48), m511), grid, 8));
  }
  return _mm512_reduce_add_epi64(_mm512_add_epi64(acc0, acc1));
}

void BM_Iq2xsGatherFloor(benchmark::State& st) {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) {
    st.SkipWithError("needs AVX-512");
    return;
  }
  const int64_t nsb = (int64_t{1} << 19) / 74;
  Buffer w = alloc(static_cast<size_t>(nsb) * 74 + 64);
  fill_random(w.get(), static_cast<size_t>(nsb) * 74 + 64, 9);
  for (auto _ : st) {
    const uint8_t* p = w.get();
    benchmark::DoNotOptimize(p);
    const long long r = iq2xs_gathers(p, nsb);
    benchmark::DoNotOptimize(r);
  }
  const double n = static_cast<double>(nsb) * static_cast<double>(st.iterations());
  st.counters["ns/superblock"] =
      benchmark::Counter(n * 1e-9, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  st.counters["GB/s"] = benchmark::Counter(n * 74 / 1e9, benchmark::Counter::kIsRate);
}

void register_all() {
  benchmark::RegisterBenchmark("Iq2xsGatherFloor", BM_Iq2xsGatherFloor)->UseRealTime()->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("MemRead", BM_MemRead)
      ->Arg(1)
      ->Arg(2)
      ->UseRealTime()
      ->MeasureProcessCPUTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("Memcpy", BM_Memcpy)
      ->Arg(1)
      ->Arg(2)
      ->UseRealTime()
      ->MeasureProcessCPUTime()
      ->Unit(benchmark::kMillisecond);
  for (GgmlType t : kTypes) {
    const std::string name = std::string("MatVec/") + strata::ggml_type_name(t);
    benchmark::RegisterBenchmark(name.c_str(), BM_MatVec, t)
        ->Arg(1)
        ->Arg(2)
        ->UseRealTime()
        ->MeasureProcessCPUTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (GgmlType t : kTypes) {
    const std::string name = std::string("MatVecHot/") + strata::ggml_type_name(t);
    benchmark::RegisterBenchmark(name.c_str(), BM_MatVecHot, t)
        ->UseRealTime()
        ->MeasureProcessCPUTime()
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::RegisterBenchmark("Peak", BM_Peak)
      ->Arg(1)
      ->Arg(2)
      ->Iterations(1)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  for (GgmlType t : kTypes) {
    const std::string name = std::string("MatMul/") + strata::ggml_type_name(t);
    auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_MatMul, t);
    for (int64_t n : {64, 256, 512})
      for (int64_t th : {1, 2}) b->Args({n, th});
    b->UseRealTime()->MeasureProcessCPUTime()->Unit(benchmark::kMillisecond);
  }
  if (k::has_q8_activations(g_kernels, GgmlType::Q8_0))
    for (GgmlType t : {GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::IQ4_XS}) {
      const std::string name = std::string("MatMulQ8/") + strata::ggml_type_name(t);
      auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_MatMulQ8, t);
      for (int64_t n : {16, 64, 512})
        for (int64_t th : {1, 2}) b->Args({n, th});
      b->UseRealTime()->MeasureProcessCPUTime()->Unit(benchmark::kMillisecond);
    }
}

}  // namespace

int main(int argc, char** argv) {
  // --cpu-kernels=scalar|avx2|avx512|auto and --act-quant=auto|q8|f32 (ours; removed before Google Benchmark parses the
  // rest)
  std::vector<char*> args;
  k::CpuKernels family = k::CpuKernels::Auto;
  k::ActQuant act = k::ActQuant::Auto;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--cpu-kernels=", 0) == 0) {
      family = k::parse_cpu_kernels(a.substr(14));
      continue;
    }
    if (a.rfind("--act-quant=", 0) == 0) {  // auto (default: q8 with AVX-512) | q8 | f32
      act = k::parse_act_quant(a.substr(12));
      continue;
    }
    args.push_back(argv[i]);
  }
  int n = static_cast<int>(args.size());
  g_kernels = k::resolve_kernels(family, act);
  benchmark::AddCustomContext("cpu_kernels", k::cpu_kernels_name(g_kernels.family));
  benchmark::AddCustomContext("act_quant", k::act_quant_name(g_kernels.act));
  register_all();
  benchmark::Initialize(&n, args.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
