// The AMX int8 register loop of peak_probe.h: TDPBSSD on tiles that stay in the tile registers
// (Intel SDM vol. 2, "TDPBSSD"; intrinsics _tile_loadconfig, _tile_loadd, _tile_dpbssd). Only
// called where amx_int8_usable() (CPUID AMX-TILE/AMX-INT8 and the tile data permission).
#include "backend/cpu/kernels/simd_intrin.h"

#include <cstdint>
#include <cstring>

#include "backend/cpu/kernels/peak_probe.h"

namespace strata::cpu::kernels::detail {

namespace {

struct alignas(64) ProbeConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

// tmm0..3: C, 16 x 16 int32; tmm4, tmm5: A, 16 rows x K bytes; tmm6, tmm7: B, K/4 rows x 64
// bytes. Per iteration 4 independent TDPBSSD (C_ij += A_i B_j), each 16 * 16 * K multiply-adds.
double int8_loop_amx(long iters, int k_bytes) {
  ProbeConfig cfg;
  for (int i = 0; i < 4; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  for (int i = 4; i < 6; ++i) {
    cfg.colsb[i] = static_cast<uint16_t>(k_bytes);
    cfg.rows[i] = 16;
  }
  for (int i = 6; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = static_cast<uint8_t>(k_bytes / 4);
  }
  alignas(64) int8_t src[16 * 64];
  for (int i = 0; i < 16 * 64; ++i) src[i] = static_cast<int8_t>(i * 7 % 251 - 125);
  alignas(64) int32_t out[256];
  _tile_loadconfig(&cfg);
  __asm__ volatile("" ::: "memory");
  _tile_loadd(4, src, 64);
  _tile_loadd(5, src, 64);
  _tile_loadd(6, src, 64);
  _tile_loadd(7, src, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (long i = 0; i < iters; ++i) {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  volatile int32_t sink = out[0];
  (void)sink;
  return static_cast<double>(iters) * 4 * 16 * 16 * k_bytes * 2;
}

}  // namespace strata::cpu::kernels::detail
