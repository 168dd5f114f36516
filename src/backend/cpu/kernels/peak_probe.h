#pragma once
// Roofline probes of this machine, measured in the same run as the work they are set against
// (`strata bench`, bench_kernels): the int8 multiply-add peak of the kernel family's dot-product
// instructions in a register loop (no memory traffic), and the sequential memory read bandwidth.
// docs/kernels.md ("Roofline") explains what each number means.
#include <cstddef>

#include "backend/cpu/kernels/kernels.h"

namespace strata::cpu::kernels {

/// One probe result. Ops count a multiply and an add as 2 (GFLOP/s of the matmuls:
/// 2·rows·cols·tokens / time).
struct PeakProbe {
  double int8_gops = 0;  ///< int8 dot-product peak, all threads, 1e9 ops/s
  /// the instruction sequence timed: "vpmaddubsw+vpmaddwd+vpaddd" (AVX2: the integers of one
  /// vpdpbusd, as the AVX2 kernels form them), "vpdpbusd zmm" (AVX-512 VNNI), "none" (scalar)
  const char* int8_how = "none";
  double maddubs_gops = 0;  ///< bare vpmaddubsw ymm rate (int16 pair sums only), 0 without AVX2
  /// AMX tile peak (TDPBSSD, 16 x 16 x 64 tiles held in the tile registers), all threads, 1e9 ops/s;
  /// 0 where the family is not Avx512 or !amx_int8_usable()
  double amx_int8_gops = 0;
  /// the same with K = 32 bytes per TDPBSSD, the shape of the Q8_0 AMX GEMM (one block per dot)
  double amx_k32_gops = 0;
  double read_gbps = 0;     ///< sequential read of `read_bytes` per thread, all threads, 1e9 B/s
  int threads = 0;
};

/// Runs the probes on `n_threads` threads at once (each ~`seconds` per probe) with the dot-product
/// instructions of `family` (Avx512 uses vpdpbusd zmm where the CPU has AVX-512 VNNI, Avx2
/// vpdpbusd ymm where avx_vnni_usable(), else the AVX2 sequence; Scalar reports no int8 peak). `read_bytes`: the buffer
/// each thread reads (choose it well above the last-level cache). Throws std::invalid_argument for n_threads < 1.
PeakProbe probe_peak(CpuKernels family, int n_threads, double seconds = 0.25, size_t read_bytes = size_t(256) << 20);

namespace detail {
/// Register loops of the probe: `iters` iterations, returns the int8 ops done (2 per multiply-add).
double int8_loop_avx2(long iters);
double maddubs_loop_avx2(long iters);
/// vpdpbusd zmm loop (AVX-512 VNNI). Compiles on every x86 build; NOT MEASURED on the
/// development machine (no AVX-512 there).
double int8_loop_avx512vnni(long iters);
/// vpdpbusd ymm loop (AVX-VNNI, VEX; peak_probe_avxvnni.cpp): the AVX2 family's int8 peak where
/// avx_vnni_usable() (its Q8_0 GEMM runs on that instruction there).
double int8_loop_avxvnni(long iters);
/// TDPBSSD loop (AMX-INT8; peak_probe_amx.cpp): 4 independent 16 x 16 int32 tiles, each
/// `iters` times += A (16 x k_bytes) * B (k_bytes/4 x 64 bytes); k_bytes 4..64, a multiple of 4.
/// Only where amx_int8_usable().
double int8_loop_amx(long iters, int k_bytes);
/// Sums n bytes at p (n % 128 == 0) with 256-bit loads; returns a value that depends on them.
long long read_avx2(const void* p, size_t n);
}  // namespace detail

}  // namespace strata::cpu::kernels
