// Roofline probes (peak_probe.h): each probe runs on all threads at once, so the result is the
// machine's rate with every core busy (shared caches, memory channels and frequency included).
#include "backend/cpu/kernels/peak_probe.h"

#include "backend/cpu/kernels/act_q8.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include <memory>

namespace strata::cpu::kernels {

namespace {

using Clock = std::chrono::steady_clock;

// Runs body(iters) on n threads started together; per thread, doubles iters until one call
// lasts `seconds / 4`, then times calls for `seconds`. Returns the summed work per second.
template <class Body>
double on_threads(int n, double seconds, Body body) {
  std::vector<double> rate(size_t(n), 0.0);
  std::atomic<int> ready{0};
  std::vector<std::thread> th;
  for (int i = 0; i < n; ++i) {
    th.emplace_back([&, i] {
      ready.fetch_add(1);
      while (ready.load() < n) {}
      long iters = 1024;
      for (;;) {
        const auto t0 = Clock::now();
        body(i, iters);
        if (std::chrono::duration<double>(Clock::now() - t0).count() > seconds / 4) break;
        iters *= 2;
      }
      double work = 0;
      const auto t0 = Clock::now();
      double el = 0;
      while (el < seconds) {
        work += body(i, iters);
        el = std::chrono::duration<double>(Clock::now() - t0).count();
      }
      rate[size_t(i)] = work / el;
    });
  }
  for (auto& t : th) t.join();
  double s = 0;
  for (double r : rate) s += r;
  return s;
}

bool has_vnni512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

}  // namespace

PeakProbe probe_peak(CpuKernels family, int n_threads, double seconds, size_t read_bytes) {
  if (n_threads < 1) throw std::invalid_argument("probe_peak: n_threads must be >= 1");
  PeakProbe p;
  p.threads = n_threads;
  const bool avx2 = family == CpuKernels::Avx2 || family == CpuKernels::Avx512;
  if (family == CpuKernels::Avx512 && has_vnni512()) {
    p.int8_how = "vpdpbusd zmm";
    p.int8_gops = on_threads(n_threads, seconds, [](int, long it) { return detail::int8_loop_avx512vnni(it); }) / 1e9;
  } else if (family == CpuKernels::Avx2 && detail::avx_vnni_usable()) {
    p.int8_how = "vpdpbusd ymm (AVX-VNNI)";
    p.int8_gops = on_threads(n_threads, seconds, [](int, long it) { return detail::int8_loop_avxvnni(it); }) / 1e9;
  } else if (avx2) {
    p.int8_how = "vpmaddubsw+vpmaddwd+vpaddd";
    p.int8_gops = on_threads(n_threads, seconds, [](int, long it) { return detail::int8_loop_avx2(it); }) / 1e9;
  }
  if (family == CpuKernels::Avx512 && detail::amx_int8_usable()) {
    p.amx_int8_gops = on_threads(n_threads, seconds, [](int, long it) { return detail::int8_loop_amx(it, 64); }) / 1e9;
    p.amx_k32_gops = on_threads(n_threads, seconds, [](int, long it) { return detail::int8_loop_amx(it, 32); }) / 1e9;
  }
  if (avx2)
    p.maddubs_gops = on_threads(n_threads, seconds, [](int, long it) { return detail::maddubs_loop_avx2(it); }) / 1e9;
  // read probe: one buffer per thread, touched first by that thread (first-touch placement)
  read_bytes = (read_bytes + 127) / 128 * 128;
  std::vector<std::unique_ptr<unsigned char[]>> store;
  std::vector<unsigned char*> bufs;
  for (int i = 0; i < n_threads; ++i) {
    store.emplace_back(new unsigned char[read_bytes + 64]);
    const auto a = reinterpret_cast<uintptr_t>(store.back().get());
    bufs.push_back(store.back().get() + ((64 - a % 64) % 64));
  }
  {
    std::vector<std::thread> th;
    for (int i = 0; i < n_threads; ++i) th.emplace_back([&, i] { std::memset(bufs[size_t(i)], i + 1, read_bytes); });
    for (auto& t : th) t.join();
  }
  std::atomic<long long> sink{0};
  auto read = [&](int i, long it) {
    for (long k = 0; k < it; k += 1024) {
      if (avx2) {
        sink.fetch_add(detail::read_avx2(bufs[size_t(i)], read_bytes), std::memory_order_relaxed);
      } else {
        const auto* q = reinterpret_cast<const long long*>(bufs[size_t(i)]);
        long long s = 0;
        for (size_t j = 0; j < read_bytes / 8; ++j) s += q[j];
        sink.fetch_add(s, std::memory_order_relaxed);
      }
    }
    return double(read_bytes) * double((it + 1023) / 1024);
  };
  p.read_gbps = on_threads(n_threads, seconds, read) / 1e9;
  return p;
}

}  // namespace strata::cpu::kernels
