// Quantized matmul (mat-vec and tiled paths) and embedding lookup over weights in their GGUF
// block formats. Contract, arithmetic and error bound: kernels.h. Block layouts: the reference
// dequantizer src/quant/dequant_ref.cpp; each decoder below performs the same fp32 operations in
// the same order (spelled with __fmul_rn / __fadd_rn / __fsub_rn so nvcc cannot contract them
// into FMAs), so a weight expands to exactly the bits quant::dequantize_row gives.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/env_switch.h"
#include "backend/cuda/launch.cuh"
#include "quant/quant_impl.h"
#include "quant/quant_tables.h"

namespace strata::cuda {

namespace {

// ---- lookup tables: copied from the host tables (src/quant/quant_tables.cpp) once per device ----
__device__ uint64_t g_iq2xs_grid[512];
__device__ uint32_t g_iq3s_grid[512];
__device__ uint8_t g_ksigns_iq2xs[128];
__device__ int8_t g_kvalues_iq4nl[16];
__device__ int8_t g_kvalues_fp4[16];

static_assert(sizeof(quant::tables::iq2xs_grid) == sizeof(g_iq2xs_grid));
static_assert(sizeof(quant::tables::iq3s_grid) == sizeof(g_iq3s_grid));
static_assert(sizeof(quant::tables::ksigns_iq2xs) == sizeof(g_ksigns_iq2xs));
static_assert(sizeof(quant::tables::kvalues_iq4nl) == sizeof(g_kvalues_iq4nl));
static_assert(sizeof(quant::tables::kvalues_fp4) == sizeof(g_kvalues_fp4));

void ensure_tables() {
  static std::mutex mu;
  static std::vector<bool> done;
  int dev = 0;
  STRATA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (size_t(dev) < done.size() && done[size_t(dev)]) return;
  STRATA_CUDA_CHECK(cudaMemcpyToSymbol(g_iq2xs_grid, quant::tables::iq2xs_grid, sizeof(g_iq2xs_grid)));
  STRATA_CUDA_CHECK(cudaMemcpyToSymbol(g_iq3s_grid, quant::tables::iq3s_grid, sizeof(g_iq3s_grid)));
  STRATA_CUDA_CHECK(cudaMemcpyToSymbol(g_ksigns_iq2xs, quant::tables::ksigns_iq2xs, sizeof(g_ksigns_iq2xs)));
  STRATA_CUDA_CHECK(cudaMemcpyToSymbol(g_kvalues_iq4nl, quant::tables::kvalues_iq4nl, sizeof(g_kvalues_iq4nl)));
  STRATA_CUDA_CHECK(cudaMemcpyToSymbol(g_kvalues_fp4, quant::tables::kvalues_fp4, sizeof(g_kvalues_fp4)));
  if (done.size() <= size_t(dev)) done.resize(size_t(dev) + 1, false);
  done[size_t(dev)] = true;
}

// ---- loads ----
__device__ __forceinline__ uint32_t ld16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
__device__ __forceinline__ float ldh(const uint8_t* p) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(ld16(p))));
}
/// 8 bytes little-endian from p, which is A-byte aligned (A = 8, 4, 2 or 1).
template <int A>
__device__ __forceinline__ uint64_t ld8(const uint8_t* p) {
  if constexpr (A >= 8) {
    return *reinterpret_cast<const uint64_t*>(p);
  } else if constexpr (A == 4) {
    const auto* q = reinterpret_cast<const uint32_t*>(p);
    return uint64_t(q[0]) | (uint64_t(q[1]) << 32);
  } else if constexpr (A == 2) {
    const auto* q = reinterpret_cast<const uint16_t*>(p);
    return uint64_t(q[0]) | (uint64_t(q[1]) << 16) | (uint64_t(q[2]) << 32) | (uint64_t(q[3]) << 48);
  } else {
    uint64_t v = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) v |= uint64_t(p[j]) << (8 * j);
    return v;
  }
}
__device__ __forceinline__ int byte_of(uint64_t v, int j) { return int((v >> (8 * j)) & 0xff); }
/// 4-bit codes j0..j0+7 of a 32-weight block whose 16 code bytes start at qs (Q4_0 layout:
/// element j < 16 is the low nibble of qs[j], j >= 16 the high nibble of qs[j - 16]).
template <int A>
__device__ __forceinline__ void nibbles8(const uint8_t* qs, int j0, int q[8]) {
  const uint64_t v = ld8<A>(qs + (j0 & 15));
  const int sh = j0 < 16 ? 0 : 4;
#pragma unroll
  for (int j = 0; j < 8; ++j) q[j] = (byte_of(v, j) >> sh) & 0xf;
}

__device__ __forceinline__ float e8m0_half(int e) {
  return __uint_as_float(e < 2 ? (0x00200000u << e) : (uint32_t(e - 1) << 23));
}

/// The 8 weights at columns c..c+7 (c % 8 == 0) of a row of type T, as dequantize_row gives them.
template <GgmlType T>
__device__ __forceinline__ void decode8(const uint8_t* __restrict__ row, int c, float w[8]) {
  using G = GgmlType;
  if constexpr (T == G::F32) {
    const float4 a = *reinterpret_cast<const float4*>(row + 4 * size_t(c));
    const float4 b = *reinterpret_cast<const float4*>(row + 4 * size_t(c) + 16);
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
  } else if constexpr (T == G::F16 || T == G::BF16) {
    const uint4 v = *reinterpret_cast<const uint4*>(row + 2 * size_t(c));
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (T == G::F16) {
        w[2 * j] = __half2float(__ushort_as_half(static_cast<unsigned short>(u[j] & 0xffff)));
        w[2 * j + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(u[j] >> 16)));
      } else {
        w[2 * j] = __uint_as_float(u[j] << 16);
        w[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
      }
    }
  } else if constexpr (T == G::Q8_0) {
    const uint8_t* b = row + size_t(c / 32) * 34;
    const int j0 = c % 32;
    const float d = ldh(b);
    const uint64_t v = ld8<2>(b + 2 + j0);
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = __fmul_rn(float(int8_t(byte_of(v, j))), d);
  } else if constexpr (T == G::Q4_0 || T == G::IQ4_NL) {
    const uint8_t* b = row + size_t(c / 32) * 18;
    const float d = ldh(b);
    int q[8];
    nibbles8<2>(b + 2, c % 32, q);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if constexpr (T == G::Q4_0)
        w[j] = __fmul_rn(d, float(q[j] - 8));
      else
        w[j] = __fmul_rn(d, float(g_kvalues_iq4nl[q[j]]));
    }
  } else if constexpr (T == G::Q4_1) {
    const uint8_t* b = row + size_t(c / 32) * 20;
    const float d = ldh(b), m = ldh(b + 2);
    int q[8];
    nibbles8<4>(b + 4, c % 32, q);
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = __fadd_rn(__fmul_rn(d, float(q[j])), m);
  } else if constexpr (T == G::Q5_0 || T == G::Q5_1) {
    constexpr int bytes = T == G::Q5_0 ? 22 : 24, qh_off = T == G::Q5_0 ? 2 : 4;
    const uint8_t* b = row + size_t(c / 32) * bytes;
    const int j0 = c % 32;
    const float d = ldh(b);
    const uint32_t qh = ld16(b + qh_off) | (ld16(b + qh_off + 2) << 16);
    int q[8];
    nibbles8<2>(b + qh_off + 4, j0, q);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int u = q[j] | int(((qh >> (j0 + j)) & 1u) << 4);  // the 5th bit of element e is bit e of qh
      if constexpr (T == G::Q5_0)
        w[j] = __fmul_rn(d, float(u - 16));
      else
        w[j] = __fadd_rn(__fmul_rn(d, float(u)), ldh(b + 2));
    }
  } else if constexpr (T == G::MXFP4) {
    const uint8_t* b = row + size_t(c / 32) * 17;
    const float d = e8m0_half(b[0]);
    int q[8];
    nibbles8<1>(b + 1, c % 32, q);
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = __fmul_rn(d, float(g_kvalues_fp4[q[j]]));
  } else if constexpr (T == G::Q2_K) {
    // element e = 128h + 32s + j; this lane's 8 share h, s and the 16-group g = l/2
    const uint8_t* b = row + size_t(c / 256) * 84;
    const int l = (c % 256) / 8, h = l / 16, s = (l / 4) % 4, j0 = 8 * (l % 4);
    const float d = ldh(b + 80), dmin = ldh(b + 82);
    const int sc = b[l / 2];
    const float dl = __fmul_rn(d, float(sc & 0xf)), ml = __fmul_rn(dmin, float(sc >> 4));
    const uint64_t v = ld8<4>(b + 16 + 32 * h + j0);
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = __fsub_rn(__fmul_rn(dl, float((byte_of(v, j) >> (2 * s)) & 3)), ml);
  } else if constexpr (T == G::Q3_K) {
    const uint8_t* b = row + size_t(c / 256) * 110;
    const int l = (c % 256) / 8, h = l / 16, s = (l / 4) % 4, j0 = 8 * (l % 4), g = l / 2;
    const uint8_t* sc = b + 96;
    const int scale = (((sc[g % 8] >> (4 * (g / 8))) & 0xf) | (((sc[8 + g % 4] >> (2 * (g / 4))) & 3) << 4)) - 32;
    const float dl = __fmul_rn(ldh(b + 108), float(scale));
    const uint64_t hm = ld8<2>(b + j0), qs = ld8<2>(b + 32 + 32 * h + j0);
    const int hbit_sh = l / 4;  // e / 32
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int ql = (byte_of(qs, j) >> (2 * s)) & 3;
      const int hb = (byte_of(hm, j) >> hbit_sh) & 1;
      w[j] = __fmul_rn(dl, float(ql - (hb ? 0 : 4)));
    }
  } else if constexpr (T == G::Q4_K || T == G::Q5_K) {
    constexpr int bytes = T == G::Q4_K ? 144 : 176, qs_off = T == G::Q4_K ? 16 : 48;
    const uint8_t* b = row + size_t(c / 256) * bytes;
    const int l = (c % 256) / 8, g = l / 4, j0 = 8 * (l % 4);
    const float d = ldh(b), dmin = ldh(b + 2);
    const uint8_t* s = b + 4;
    int sc, m;
    if (g < 4) {
      sc = s[g] & 63;
      m = s[g + 4] & 63;
    } else {
      sc = (s[g + 4] & 0xf) | ((s[g - 4] >> 6) << 4);
      m = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
    }
    const float dl = __fmul_rn(d, float(sc)), ml = __fmul_rn(dmin, float(m));
    const uint64_t qs = ld8<8>(b + qs_off + 32 * (g / 2) + j0);
    uint64_t qh = 0;
    if constexpr (T == G::Q5_K) qh = ld8<8>(b + 16 + j0);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      int q = (byte_of(qs, j) >> (4 * (g % 2))) & 0xf;
      if constexpr (T == G::Q5_K) q |= ((byte_of(qh, j) >> g) & 1) << 4;
      w[j] = __fsub_rn(__fmul_rn(dl, float(q)), ml);
    }
  } else if constexpr (T == G::Q6_K) {
    const uint8_t* b = row + size_t(c / 256) * 210;
    const int l = (c % 256) / 8, h = l / 16, s = (l / 4) % 4, j0 = 8 * (l % 4);
    const float d = ldh(b + 208);
    const float dl = __fmul_rn(d, float(int8_t(b[192 + l / 2])));
    const uint64_t lo = ld8<2>(b + 64 * h + 32 * (s % 2) + j0), hi = ld8<2>(b + 128 + 32 * h + j0);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int q = ((byte_of(lo, j) >> (4 * (s / 2))) & 0xf) | (((byte_of(hi, j) >> (2 * s)) & 3) << 4);
      w[j] = __fmul_rn(dl, float(q - 32));
    }
  } else if constexpr (T == G::IQ2_XS) {
    const uint8_t* b = row + size_t(c / 256) * 74;
    const int k = (c % 256) / 8;  // qs[k] covers elements 8k..8k+7
    const float d = ldh(b);
    const uint32_t q = ld16(b + 2 + 2 * k);
    const int nib = (b[66 + k / 4] >> (4 * ((k / 2) % 2))) & 0xf;
    const float db = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, float(nib))), 0.25f);
    const uint64_t g = g_iq2xs_grid[q & 511];
    const int sg = g_ksigns_iq2xs[q >> 9];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float v = __fmul_rn(db, float(byte_of(g, j)));
      w[j] = (sg >> j) & 1 ? -v : v;
    }
  } else if constexpr (T == G::IQ3_S) {
    const uint8_t* b = row + size_t(c / 256) * 110;
    const int l = (c % 256) / 8;  // grid entries k = 2l, 2l + 1; sign byte l
    const float d = ldh(b);
    const int nib = (b[106 + l / 8] >> (4 * ((l / 4) % 2))) & 0xf;
    const float db = __fmul_rn(d, float(1 + 2 * nib));
    const int qh = b[66 + l / 4];
    const int sg = b[74 + l];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int k = 2 * l + half;
      const uint32_t g = g_iq3s_grid[b[2 + k] | (((qh >> (k % 8)) & 1) << 8)];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float v = __fmul_rn(db, float((g >> (8 * j)) & 0xff));
        w[4 * half + j] = (sg >> (4 * half + j)) & 1 ? -v : v;
      }
    }
  } else if constexpr (T == G::IQ4_XS) {
    const uint8_t* b = row + size_t(c / 256) * 136;
    const int l = (c % 256) / 8, g = l / 4, j0 = 8 * (l % 4);
    const int sh = int(ld16(b + 2));
    const int scale = (((b[4 + g / 2] >> (4 * (g % 2))) & 0xf) | (((sh >> (2 * g)) & 3) << 4)) - 32;
    const float dl = __fmul_rn(ldh(b), float(scale));
    int q[8];
    nibbles8<8>(b + 8 + 16 * g, j0, q);
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = __fmul_rn(dl, float(g_kvalues_iq4nl[q[j]]));
  }
}

constexpr int kWarpsPerBlock = 8;  // warps per block
constexpr int kTileTokens = 8;     // tokens per warp on the tiled path
constexpr int kTileRows = 4;       // rows per warp on the tiled path

/// One warp per R consecutive rows from (blockIdx.x * warps per block + warp) * R and NT
/// consecutive tokens from blockIdx.y * NT. Lane l owns columns [256i + 8l, 256i + 8l + 8); per
/// (row, token) one FMA chain in column order; butterfly at the end. R and NT change only which
/// elements a warp computes, never an element's operations, so every (R, NT) gives the same bits.
/// With R > 1 each x load feeds R rows (the tiled path's loads of x, not its FMAs, were its bound).
template <GgmlType T, int NT, int R>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    mm_kernel(const uint8_t* __restrict__ W, size_t row_bytes, int64_t rows, int cols, const float* __restrict__ x,
              int64_t ldx, int64_t n_tok, int64_t tok_base, float* __restrict__ y, int64_t ldy) {
  detail::grid_dependency_enter();
  const int lane = threadIdx.x & 31;
  const int64_t r0 = (int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) * R;
  if (r0 >= rows) return;
  const int nr = rows - r0 < R ? int(rows - r0) : R;
  const int64_t t0 = tok_base + int64_t(blockIdx.y) * NT;
  const int64_t left = n_tok - t0;
  const int nt = left < NT ? int(left) : NT;
  const float* xt = x + t0 * ldx;
  float acc[R][NT];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[i][t] = 0.0f;
  for (int c = 8 * lane; c < cols; c += 256) {
    float w[R][8];
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (i < nr) decode8<T>(W + (r0 + i) * int64_t(row_bytes), c, w[i]);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < nt) {
        const float4 a = *reinterpret_cast<const float4*>(xt + t * ldx + c);
        const float4 bq = *reinterpret_cast<const float4*>(xt + t * ldx + c + 4);
#pragma unroll
        for (int i = 0; i < R; ++i) {
          float s = acc[i][t];
          s = __fmaf_rn(w[i][0], a.x, s);
          s = __fmaf_rn(w[i][1], a.y, s);
          s = __fmaf_rn(w[i][2], a.z, s);
          s = __fmaf_rn(w[i][3], a.w, s);
          s = __fmaf_rn(w[i][4], bq.x, s);
          s = __fmaf_rn(w[i][5], bq.y, s);
          s = __fmaf_rn(w[i][6], bq.z, s);
          s = __fmaf_rn(w[i][7], bq.w, s);
          acc[i][t] = s;
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float s = acc[i][t];
#pragma unroll
      for (int off = 16; off >= 1; off /= 2) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off));
      if (lane == 0 && t < nt && i < nr) y[(t0 + t) * ldy + r0 + i] = s;
    }
}

/// Embedding rows: thread i of row t decodes columns 8i..8i+7 of table row ids[t].
template <GgmlType T>
__global__ void get_rows_kernel(const uint8_t* __restrict__ table, size_t row_bytes, int cols,
                                const int32_t* __restrict__ ids, float* __restrict__ out, int64_t ldo) {
  detail::grid_dependency_enter();
  const int c = 8 * int(blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= cols) return;
  const int64_t t = blockIdx.y;
  float w[8];
  decode8<T>(table + int64_t(ids[t]) * int64_t(row_bytes), c, w);
  float* o = out + t * ldo + c;
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = w[j];
}

// ---- tensor-core path (Q8_0, Q4_K, Q6_K, BF16): contract in kernels.h (MatmulPath::Mma) ----

constexpr int kMmaRows = 64;  // weight rows per block (4 warps x 16)
constexpr int kMmaThreads = 128;
constexpr int kKs = 32;      // columns per main-loop step (one Q8_0 block / Q4_K sub-block / two Q6_K sub-blocks)
constexpr int kPad = 40;     // bf16 per shared row (32 + 8: conflict-free 32-bit fragment reads)
constexpr int kPieces = 3;   // x = hi + mid + lo, each bf16: exact for normal fp32 values
constexpr int kChunk = 512;  // columns per chunk: chunk sums start from 0 and are added in chunk order
constexpr int kSmallMaxChunks = 24;  // mma_small's shared partials: up to 24 * 2 * 512 B

/// Two floats as a bf16 pair, a in the low half (one cvt.rn.bf16x2.f32).
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
/// The signed byte j of v as a float, exactly: 2^23 + 128 + q has q + 128 in its low mantissa bits.
__device__ __forceinline__ float s8_float(uint64_t v, int j) {
  return __fsub_rn(__uint_as_float(0x4B000000u | uint32_t((byte_of(v, j) ^ 0x80))), 8388736.0f);
}

/// Columns [k0 + 16 hf, k0 + 16 hf + 16) of a weight row as 16 exact bf16 integer codes (or, for
/// BF16, the weights), packed in pairs, and the step's scales: Q8_0 s0 = d; Q4_K s0 = dl, s1 = ml
/// (w = dl q - ml); Q6_K s0 = dl of these 16 columns (w = dl (q - 32)).
template <GgmlType T>
__device__ __forceinline__ void stage_row(const uint8_t* __restrict__ row, int k0, int hf, uint32_t q[8], float& s0,
                                          float& s1) {
  using G = GgmlType;
  if constexpr (T == G::BF16) {
    const uint4* p = reinterpret_cast<const uint4*>(row + 2 * size_t(k0 + 16 * hf));
    const uint4 a = p[0], b = p[1];
    q[0] = a.x, q[1] = a.y, q[2] = a.z, q[3] = a.w, q[4] = b.x, q[5] = b.y, q[6] = b.z, q[7] = b.w;
  } else if constexpr (T == G::Q8_0) {
    const uint8_t* b = row + size_t(k0 / 32) * 34;
    s0 = ldh(b);
    const uint64_t v0 = ld8<2>(b + 2 + 16 * hf), v1 = ld8<2>(b + 10 + 16 * hf);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      q[j] = pack2(s8_float(v0, 2 * j), s8_float(v0, 2 * j + 1));
      q[4 + j] = pack2(s8_float(v1, 2 * j), s8_float(v1, 2 * j + 1));
    }
  } else if constexpr (T == G::Q4_K) {
    const uint8_t* b = row + size_t(k0 / 256) * 144;
    const int g = (k0 % 256) / 32;
    const float d = ldh(b), dmin = ldh(b + 2);
    const uint8_t* s = b + 4;
    int sc, m;
    if (g < 4) {
      sc = s[g] & 63;
      m = s[g + 4] & 63;
    } else {
      sc = (s[g + 4] & 0xf) | ((s[g - 4] >> 6) << 4);
      m = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
    }
    s0 = __fmul_rn(d, float(sc)), s1 = __fmul_rn(dmin, float(m));
    const uint8_t* qs = b + 16 + 32 * (g / 2) + 16 * hf;
    const uint64_t v0 = ld8<8>(qs), v1 = ld8<8>(qs + 8);
    const int sh = 4 * (g % 2);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      q[j] = pack2(float((byte_of(v0, 2 * j) >> sh) & 0xf), float((byte_of(v0, 2 * j + 1) >> sh) & 0xf));
      q[4 + j] = pack2(float((byte_of(v1, 2 * j) >> sh) & 0xf), float((byte_of(v1, 2 * j + 1) >> sh) & 0xf));
    }
  } else if constexpr (T == G::Q6_K) {
    const uint8_t* b = row + size_t(k0 / 256) * 210;
    const int i = (k0 % 256) / 32, h = i / 4, s = i % 4, j0 = 16 * hf;
    s0 = __fmul_rn(ldh(b + 208), float(int8_t(b[192 + 2 * i + hf])));
    const uint8_t* lo = b + 64 * h + 32 * (s % 2) + j0;
    const uint8_t* hi = b + 128 + 32 * h + j0;
    const uint64_t l0 = ld8<2>(lo), l1 = ld8<2>(lo + 8), h0 = ld8<2>(hi), h1 = ld8<2>(hi + 8);
    const int ls = 4 * (s / 2), hs = 2 * s;
    auto code = [&](uint64_t l, uint64_t hh, int j) {
      return float((((byte_of(l, j) >> ls) & 0xf) | (((byte_of(hh, j) >> hs) & 3) << 4)) - 32);
    };
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      q[j] = pack2(code(l0, h0, 2 * j), code(l0, h0, 2 * j + 1));
      q[4 + j] = pack2(code(l1, h1, 2 * j), code(l1, h1, 2 * j + 1));
    }
  }
}

__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

using detail::ldsm_x4;  // device_common.cuh

/// One block's tile: weight rows [r0, r0 + 64) x tokens [0, nt) of x (nt <= BN). DUAL: W and W2
/// (the SwiGLU gate and up) share the activations and the tile writes silu(W x) * (W2 x).
/// Per output element: for each 32-column step in order, per 16-column half the three bf16
/// pieces of x are multiplied on the tensor cores (fp32 accumulation, starting from 0 for each
/// scale group), then folded into the fp32 accumulator with that group's scale (fixed
/// sequence below). Nothing depends on nt, on BN, on the other tokens or on the position of the
/// element in the tile.
/// V2 (the default, docs/cuda.md): the fragments come from shared memory by ldmatrix (A: one .x4
/// per 16 columns; B: one .x4 per 8 tokens and piece, both 16-column halves) instead of 32-bit
/// loads (4x fewer shared-load instructions), and the staging is double-buffered (one barrier
/// per step instead of two). The same words reach the same MMAs in the same order: same bits.
template <GgmlType T, int BN, bool DUAL, bool V2>
__device__ __forceinline__ void mma_tile(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2,
                                         size_t row_bytes, int64_t rows, int cols, int64_t r0,
                                         const float* __restrict__ x, int64_t ldx, int nt, float* __restrict__ y,
                                         int64_t ldy) {
  constexpr int NW = DUAL ? 2 : 1;
  constexpr int NT8 = BN / 8;
  constexpr int BT = (BN * 4 + kMmaThreads - 1) / kMmaThreads;  // activation tasks (token, 8 columns) per thread
  constexpr int NB = V2 ? 2 : 1;                                // staging buffers
  __shared__ __align__(16) uint16_t sA[NB][NW][kMmaRows][kPad];
  __shared__ __align__(16) uint16_t sB[NB][kPieces][BN][kPad];
  __shared__ float sS[NB][NW][kMmaRows][2];
  __shared__ float sX[NB][BN][4];  // Q4_K: partial sums of x over each 8 columns of the step
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rr = tid / 2, hf = tid % 2;
  const int64_t r = r0 + rr;
  const bool row_ok = r < rows;

  uint32_t qa[NW][8];
  float sa[NW][2];
  float xv[BT][8];
  auto load = [&](int k0) {
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      sa[w][0] = sa[w][1] = 0.0f;
      if (row_ok) {
        stage_row<T>((w == 0 ? W : W2) + r * int64_t(row_bytes), k0, hf, qa[w], sa[w][0], sa[w][1]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) qa[w][j] = 0;
      }
    }
#pragma unroll
    for (int b = 0; b < BT; ++b) {
      const int task = tid + b * kMmaThreads, tk = task / 4, c8 = (task % 4) * 8;
      if (task < BN * 4 && tk < nt) {
        const float4 u = *reinterpret_cast<const float4*>(x + tk * ldx + k0 + c8);
        const float4 v = *reinterpret_cast<const float4*>(x + tk * ldx + k0 + c8 + 4);
        xv[b][0] = u.x, xv[b][1] = u.y, xv[b][2] = u.z, xv[b][3] = u.w;
        xv[b][4] = v.x, xv[b][5] = v.y, xv[b][6] = v.z, xv[b][7] = v.w;
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) xv[b][j] = 0.0f;
      }
    }
  };
  auto store = [&](int bf) {
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      uint4* d = reinterpret_cast<uint4*>(&sA[bf][w][rr][16 * hf]);
      d[0] = make_uint4(qa[w][0], qa[w][1], qa[w][2], qa[w][3]);
      d[1] = make_uint4(qa[w][4], qa[w][5], qa[w][6], qa[w][7]);
      if constexpr (T == GgmlType::Q6_K) {
        sS[bf][w][rr][hf] = sa[w][0];
      } else if (hf == 0) {
        sS[bf][w][rr][0] = sa[w][0], sS[bf][w][rr][1] = sa[w][1];
      }
    }
#pragma unroll
    for (int b = 0; b < BT; ++b) {
      const int task = tid + b * kMmaThreads, tk = task / 4, c8 = (task % 4) * 8;
      if (task >= BN * 4) continue;
      uint32_t p[kPieces][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float v0 = xv[b][2 * j], v1 = xv[b][2 * j + 1];
#pragma unroll
        for (int pc = 0; pc < kPieces; ++pc) {
          const __nv_bfloat16 h0 = __float2bfloat16_rn(v0), h1 = __float2bfloat16_rn(v1);
          p[pc][j] = uint32_t(__bfloat16_as_ushort(h0)) | (uint32_t(__bfloat16_as_ushort(h1)) << 16);
          v0 = __fsub_rn(v0, __bfloat162float(h0));
          v1 = __fsub_rn(v1, __bfloat162float(h1));
        }
      }
#pragma unroll
      for (int pc = 0; pc < kPieces; ++pc)
        *reinterpret_cast<uint4*>(&sB[bf][pc][tk][c8]) = make_uint4(p[pc][0], p[pc][1], p[pc][2], p[pc][3]);
      if constexpr (T == GgmlType::Q4_K) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) s = __fadd_rn(s, xv[b][j]);
        sX[bf][tk][c8 / 8] = s;
      }
    }
  };

  float acc[NW][NT8][4];
#pragma unroll
  for (int w = 0; w < NW; ++w)
#pragma unroll
    for (int n = 0; n < NT8; ++n) acc[w][n][0] = acc[w][n][1] = acc[w][n][2] = acc[w][n][3] = 0.0f;

  float tot[NW][NT8][4];  // the sum of the finished kChunk-column chunks, in chunk order
  auto fold = [&](bool first) {
#pragma unroll
    for (int w = 0; w < NW; ++w)
#pragma unroll
      for (int n = 0; n < NT8; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          tot[w][n][j] = first ? acc[w][n][j] : __fadd_rn(tot[w][n][j], acc[w][n][j]);
          acc[w][n][j] = 0.0f;
        }
  };

  const int g = lane / 4, c = (lane % 4) * 2;
  const int ra = 16 * warp + g;  // this thread's rows ra and ra + 8 of the tile
  load(0);
  int it = 0;
  for (int k0 = 0; k0 < cols; k0 += kKs, ++it) {
    const int bf = V2 ? (it & 1) : 0;
    if (k0 > 0 && k0 % kChunk == 0) fold(k0 == kChunk);
    // V2: buffer bf was last read in step it - 2, which every warp finished before passing the
    // barrier of step it - 1; so one barrier per step suffices.
    store(bf);
    __syncthreads();
    if (k0 + kKs < cols) load(k0 + kKs);  // the next step's global loads fly during the MMAs
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      uint32_t a[2][4];
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        if constexpr (V2) {
          ldsm_x4(a[ks], &sA[bf][w][16 * warp + (lane % 8) + 8 * ((lane / 8) % 2)][16 * ks + 8 * (lane / 16)]);
        } else {
          a[ks][0] = *reinterpret_cast<const uint32_t*>(&sA[bf][w][ra][16 * ks + c]);
          a[ks][1] = *reinterpret_cast<const uint32_t*>(&sA[bf][w][ra + 8][16 * ks + c]);
          a[ks][2] = *reinterpret_cast<const uint32_t*>(&sA[bf][w][ra][16 * ks + c + 8]);
          a[ks][3] = *reinterpret_cast<const uint32_t*>(&sA[bf][w][ra + 8][16 * ks + c + 8]);
        }
      }
      const float s0a = sS[bf][w][ra][0], s1a = sS[bf][w][ra][1], s0b = sS[bf][w][ra + 8][0],
                  s1b = sS[bf][w][ra + 8][1];
#pragma unroll
      for (int n = 0; n < NT8; ++n) {
        // bq[pc] = {b0, b1} of columns 0-15, then {b0, b1} of columns 16-31 of the step
        uint32_t bq[kPieces][4];
#pragma unroll
        for (int pc = 0; pc < kPieces; ++pc) {
          if constexpr (V2) {
            ldsm_x4(bq[pc], &sB[bf][pc][8 * n + (lane % 8)][8 * (lane / 8)]);
          } else {
#pragma unroll
            for (int ks = 0; ks < 2; ++ks) {
              bq[pc][2 * ks] = *reinterpret_cast<const uint32_t*>(&sB[bf][pc][8 * n + g][16 * ks + c]);
              bq[pc][2 * ks + 1] = *reinterpret_cast<const uint32_t*>(&sB[bf][pc][8 * n + g][16 * ks + c + 8]);
            }
          }
        }
        float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
#pragma unroll
          for (int pc = 0; pc < kPieces; ++pc) mma_bf16(t, a[ks], bq[pc][2 * ks], bq[pc][2 * ks + 1]);
          if constexpr (T == GgmlType::Q6_K) {
            // one scale per 16 columns: rows ra (t[0], t[1]) and ra + 8 (t[2], t[3])
            const float da = ks == 0 ? s0a : s1a, db = ks == 0 ? s0b : s1b;
            acc[w][n][0] = __fmaf_rn(da, t[0], acc[w][n][0]);
            acc[w][n][1] = __fmaf_rn(da, t[1], acc[w][n][1]);
            acc[w][n][2] = __fmaf_rn(db, t[2], acc[w][n][2]);
            acc[w][n][3] = __fmaf_rn(db, t[3], acc[w][n][3]);
            t[0] = t[1] = t[2] = t[3] = 0.0f;
          }
        }
        if constexpr (T == GgmlType::BF16) {
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[w][n][j] = __fadd_rn(acc[w][n][j], t[j]);
        } else if constexpr (T == GgmlType::Q8_0) {
          acc[w][n][0] = __fmaf_rn(s0a, t[0], acc[w][n][0]);
          acc[w][n][1] = __fmaf_rn(s0a, t[1], acc[w][n][1]);
          acc[w][n][2] = __fmaf_rn(s0b, t[2], acc[w][n][2]);
          acc[w][n][3] = __fmaf_rn(s0b, t[3], acc[w][n][3]);
        } else if constexpr (T == GgmlType::Q4_K) {
          // sum (dl q - ml) x = dl (sum q x) - ml (sum x); sum x of a token: its four 8-column partials in order
          float sx[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float* p = sX[bf][8 * n + c + j];
            sx[j] = __fadd_rn(__fadd_rn(__fadd_rn(p[0], p[1]), p[2]), p[3]);
          }
          acc[w][n][0] = __fmaf_rn(s0a, t[0], __fmaf_rn(-s1a, sx[0], acc[w][n][0]));
          acc[w][n][1] = __fmaf_rn(s0a, t[1], __fmaf_rn(-s1a, sx[1], acc[w][n][1]));
          acc[w][n][2] = __fmaf_rn(s0b, t[2], __fmaf_rn(-s1b, sx[0], acc[w][n][2]));
          acc[w][n][3] = __fmaf_rn(s0b, t[3], __fmaf_rn(-s1b, sx[1], acc[w][n][3]));
        }
      }
    }
    if constexpr (!V2) __syncthreads();
  }
  fold(cols <= kChunk);
#pragma unroll
  for (int n = 0; n < NT8; ++n) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int tk = 8 * n + c + (j & 1);
      const int64_t row = r0 + ra + (j >= 2 ? 8 : 0);
      if (tk >= nt || row >= rows) continue;
      float v = tot[0][n][j];
      if constexpr (DUAL) v = __fmul_rn(__fdiv_rn(v, __fadd_rn(1.0f, expf(-v))), tot[NW - 1][n][j]);
      y[tk * ldy + row] = v;
    }
  }
}

/// The small-batch form of mma_tile (<= 8 tokens), same arithmetic: a block of 4 warps holds 16
/// weight rows; warp w computes the partial sums of chunks w, w + 4, ... (each from 0, its
/// groups in order, exactly as mma_tile's acc between two folds) into shared memory; then
/// thread i adds element i's chunk partials in chunk order, as mma_tile's fold does. So the
/// 128-row x 8-token work of one mat-vec spreads over cols/kChunk warps instead of one.
/// Dynamic shared memory: n_chunks * NW * 128 floats.
template <GgmlType T, bool DUAL>
__device__ __forceinline__ void mma_small(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2,
                                          size_t row_bytes, int64_t rows, int cols, int64_t r0,
                                          const float* __restrict__ x, int64_t ldx, int nt, float* __restrict__ y,
                                          int64_t ldy) {
  constexpr int NW = DUAL ? 2 : 1;
  constexpr int kWarps = kMmaThreads / 32;
  __shared__ __align__(16) uint16_t sA[kWarps][NW][16][kPad];
  __shared__ __align__(16) uint16_t sB[kWarps][kPieces][8][kPad];
  __shared__ float sS[kWarps][NW][16][2];
  __shared__ float sX[kWarps][8][4];
  extern __shared__ float part[];  // [chunk][NW][16 rows][8 tokens]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rr = lane / 2, hf = lane % 2;        // staging: row rr, columns 16 hf..
  const int tk = lane / 4, c8 = (lane % 4) * 8;  // staging: token tk, columns c8..
  const int64_t r = r0 + rr;
  const bool row_ok = r < rows, tok_ok = tk < nt;
  const int g = lane / 4, c = (lane % 4) * 2;
  const int n_chunks = (cols + kChunk - 1) / kChunk;

  uint32_t qa[NW][8];
  float sa[NW][2];
  float xv[8];
  auto load = [&](int k0) {
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      sa[w][0] = sa[w][1] = 0.0f;
      if (row_ok) {
        stage_row<T>((w == 0 ? W : W2) + r * int64_t(row_bytes), k0, hf, qa[w], sa[w][0], sa[w][1]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) qa[w][j] = 0;
      }
    }
    if (tok_ok) {
      const float4 u = *reinterpret_cast<const float4*>(x + tk * ldx + k0 + c8);
      const float4 v = *reinterpret_cast<const float4*>(x + tk * ldx + k0 + c8 + 4);
      xv[0] = u.x, xv[1] = u.y, xv[2] = u.z, xv[3] = u.w, xv[4] = v.x, xv[5] = v.y, xv[6] = v.z, xv[7] = v.w;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) xv[j] = 0.0f;
    }
  };
  auto store = [&]() {
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      uint4* d = reinterpret_cast<uint4*>(&sA[warp][w][rr][16 * hf]);
      d[0] = make_uint4(qa[w][0], qa[w][1], qa[w][2], qa[w][3]);
      d[1] = make_uint4(qa[w][4], qa[w][5], qa[w][6], qa[w][7]);
      if constexpr (T == GgmlType::Q6_K) {
        sS[warp][w][rr][hf] = sa[w][0];
      } else if (hf == 0) {
        sS[warp][w][rr][0] = sa[w][0], sS[warp][w][rr][1] = sa[w][1];
      }
    }
    uint32_t p[kPieces][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float v0 = xv[2 * j], v1 = xv[2 * j + 1];
#pragma unroll
      for (int pc = 0; pc < kPieces; ++pc) {
        const __nv_bfloat16 h0 = __float2bfloat16_rn(v0), h1 = __float2bfloat16_rn(v1);
        p[pc][j] = uint32_t(__bfloat16_as_ushort(h0)) | (uint32_t(__bfloat16_as_ushort(h1)) << 16);
        v0 = __fsub_rn(v0, __bfloat162float(h0));
        v1 = __fsub_rn(v1, __bfloat162float(h1));
      }
    }
#pragma unroll
    for (int pc = 0; pc < kPieces; ++pc)
      *reinterpret_cast<uint4*>(&sB[warp][pc][tk][c8]) = make_uint4(p[pc][0], p[pc][1], p[pc][2], p[pc][3]);
    if constexpr (T == GgmlType::Q4_K) {
      float sm = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) sm = __fadd_rn(sm, xv[j]);
      sX[warp][tk][c8 / 8] = sm;
    }
  };

  for (int ch = warp; ch < n_chunks; ch += kWarps) {
    const int kb = ch * kChunk, ke = min(cols, kb + kChunk);
    float acc[NW][4];
#pragma unroll
    for (int w = 0; w < NW; ++w) acc[w][0] = acc[w][1] = acc[w][2] = acc[w][3] = 0.0f;
    load(kb);
    for (int k0 = kb; k0 < ke; k0 += kKs) {
      store();
      __syncwarp();
      if (k0 + kKs < ke) load(k0 + kKs);
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        uint32_t a[2][4];
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
          a[ks][0] = *reinterpret_cast<const uint32_t*>(&sA[warp][w][g][16 * ks + c]);
          a[ks][1] = *reinterpret_cast<const uint32_t*>(&sA[warp][w][g + 8][16 * ks + c]);
          a[ks][2] = *reinterpret_cast<const uint32_t*>(&sA[warp][w][g][16 * ks + c + 8]);
          a[ks][3] = *reinterpret_cast<const uint32_t*>(&sA[warp][w][g + 8][16 * ks + c + 8]);
        }
        const float s0a = sS[warp][w][g][0], s1a = sS[warp][w][g][1], s0b = sS[warp][w][g + 8][0],
                    s1b = sS[warp][w][g + 8][1];
        float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
#pragma unroll
          for (int pc = 0; pc < kPieces; ++pc) {
            const uint32_t b0 = *reinterpret_cast<const uint32_t*>(&sB[warp][pc][g][16 * ks + c]);
            const uint32_t b1 = *reinterpret_cast<const uint32_t*>(&sB[warp][pc][g][16 * ks + c + 8]);
            mma_bf16(t, a[ks], b0, b1);
          }
          if constexpr (T == GgmlType::Q6_K) {
            const float da = ks == 0 ? s0a : s1a, db = ks == 0 ? s0b : s1b;
            acc[w][0] = __fmaf_rn(da, t[0], acc[w][0]);
            acc[w][1] = __fmaf_rn(da, t[1], acc[w][1]);
            acc[w][2] = __fmaf_rn(db, t[2], acc[w][2]);
            acc[w][3] = __fmaf_rn(db, t[3], acc[w][3]);
            t[0] = t[1] = t[2] = t[3] = 0.0f;
          }
        }
        if constexpr (T == GgmlType::BF16) {
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[w][j] = __fadd_rn(acc[w][j], t[j]);
        } else if constexpr (T == GgmlType::Q8_0) {
          acc[w][0] = __fmaf_rn(s0a, t[0], acc[w][0]);
          acc[w][1] = __fmaf_rn(s0a, t[1], acc[w][1]);
          acc[w][2] = __fmaf_rn(s0b, t[2], acc[w][2]);
          acc[w][3] = __fmaf_rn(s0b, t[3], acc[w][3]);
        } else if constexpr (T == GgmlType::Q4_K) {
          float sx[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float* q = sX[warp][c + j];
            sx[j] = __fadd_rn(__fadd_rn(__fadd_rn(q[0], q[1]), q[2]), q[3]);
          }
          acc[w][0] = __fmaf_rn(s0a, t[0], __fmaf_rn(-s1a, sx[0], acc[w][0]));
          acc[w][1] = __fmaf_rn(s0a, t[1], __fmaf_rn(-s1a, sx[1], acc[w][1]));
          acc[w][2] = __fmaf_rn(s0b, t[2], __fmaf_rn(-s1b, sx[0], acc[w][2]));
          acc[w][3] = __fmaf_rn(s0b, t[3], __fmaf_rn(-s1b, sx[1], acc[w][3]));
        }
      }
      __syncwarp();
    }
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      float* pp = part + (size_t(ch) * NW + w) * 128;  // [16 rows][8 tokens]
      pp[g * 8 + c] = acc[w][0];
      pp[g * 8 + c + 1] = acc[w][1];
      pp[(g + 8) * 8 + c] = acc[w][2];
      pp[(g + 8) * 8 + c + 1] = acc[w][3];
    }
  }
  __syncthreads();
  const int er = tid / 8, et = tid % 8;
  float v[NW];
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    v[w] = part[size_t(w) * 128 + tid];
    for (int ch = 1; ch < n_chunks; ++ch) v[w] = __fadd_rn(v[w], part[(size_t(ch) * NW + w) * 128 + tid]);
  }
  const int64_t row = r0 + er;
  if (et < nt && row < rows) {
    float o = v[0];
    if constexpr (DUAL) o = __fmul_rn(__fdiv_rn(o, __fadd_rn(1.0f, expf(-o))), v[NW - 1]);
    y[et * ldy + row] = o;
  }
}

/// The <= 8-token form for mma_kernel_version() 2, same arithmetic as mma_small (so the same bits):
/// a block of 4 warps holds 16 weight rows x 8 tokens and walks the chunks in order; in each round
/// of RG 32-column groups of a chunk (RG = 16, Q6_K pairs 8), warp w loads the weights and
/// activations of groups w, w + 4, ... together (4x the loads in flight of mma_small, where one
/// warp walks a whole chunk one group at a time), multiplies each group on the tensor cores from 0
/// and leaves the group sums in shared memory; then thread e folds element e's group sums with
/// their scales in column order, exactly as mma_small's accumulator, and adds the chunk sums in
/// chunk order. Static shared memory only (no limit on the number of chunks).
template <GgmlType T, bool DUAL>
__device__ __forceinline__ void mma_small2(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2,
                                           size_t row_bytes, int64_t rows, int cols, int64_t r0,
                                           const float* __restrict__ x, int64_t ldx, int nt, float* __restrict__ y,
                                           int64_t ldy) {
  constexpr int NW = DUAL ? 2 : 1;
  constexpr int kWarps = kMmaThreads / 32;
  constexpr int TQ = T == GgmlType::Q6_K ? 2 : 1;           // group sums per group (Q6_K: per 16 columns)
  constexpr int RG = T == GgmlType::Q6_K && DUAL ? 8 : 16;  // groups per round (shared memory bound)
  constexpr int GPW = RG / kWarps;                          // groups per warp and round
  static_assert(RG * kKs <= kChunk && kChunk % (RG * kKs) == 0, "rounds must tile a chunk");
  __shared__ __align__(16) uint16_t sA[kWarps][NW][16][kPad];
  __shared__ __align__(16) uint16_t sB[kWarps][kPieces][8][kPad];
  __shared__ float sT[RG][TQ][NW][128];  // group sums: [group][half][weight][row * 8 + token]
  __shared__ float sSc[RG][NW][16][2];   // the groups' scales per row
  __shared__ float sXg[RG][8][4];        // Q4_K: per token the 8-column partial sums of x
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rr = lane / 2, hf = lane % 2;        // staging: row rr, columns 16 hf..
  const int tk = lane / 4, c8 = (lane % 4) * 8;  // staging: token tk, columns c8..
  const int64_t r = r0 + rr;
  const bool row_ok = r < rows, tok_ok = tk < nt;
  const int g = lane / 4, c = (lane % 4) * 2;
  const int n_chunks = (cols + kChunk - 1) / kChunk;
  const int er = tid / 8, et = tid % 8;  // the element this thread folds

  uint32_t qa[GPW][NW][8];
  float sa[GPW][NW][2];
  float xv[GPW][8];
  float tot[NW], acc[NW];
#pragma unroll
  for (int w = 0; w < NW; ++w) tot[w] = acc[w] = 0.0f;
  for (int ch = 0; ch < n_chunks; ++ch) {
    for (int g0 = 0; g0 < kChunk / kKs; g0 += RG) {
      // 1. this warp's groups of the round: every global load first
#pragma unroll
      for (int i = 0; i < GPW; ++i) {
        const int k0 = ch * kChunk + kKs * (g0 + warp + kWarps * i);
        if (k0 >= cols) continue;  // uniform per warp
#pragma unroll
        for (int w = 0; w < NW; ++w) {
          sa[i][w][0] = sa[i][w][1] = 0.0f;
          if (row_ok) {
            stage_row<T>((w == 0 ? W : W2) + r * int64_t(row_bytes), k0, hf, qa[i][w], sa[i][w][0], sa[i][w][1]);
          } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) qa[i][w][j] = 0;
          }
        }
        if (tok_ok) {
          const float4 u = *reinterpret_cast<const float4*>(x + tk * ldx + k0 + c8);
          const float4 v = *reinterpret_cast<const float4*>(x + tk * ldx + k0 + c8 + 4);
          xv[i][0] = u.x, xv[i][1] = u.y, xv[i][2] = u.z, xv[i][3] = u.w;
          xv[i][4] = v.x, xv[i][5] = v.y, xv[i][6] = v.z, xv[i][7] = v.w;
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) xv[i][j] = 0.0f;
        }
      }
      // 2. per group: stage, multiply (sums from 0, as mma_small's t), leave the sums and scales
#pragma unroll
      for (int i = 0; i < GPW; ++i) {
        const int jg = warp + kWarps * i;  // group of the round
        const int k0 = ch * kChunk + kKs * (g0 + jg);
        if (k0 >= cols) continue;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
          uint4* d = reinterpret_cast<uint4*>(&sA[warp][w][rr][16 * hf]);
          d[0] = make_uint4(qa[i][w][0], qa[i][w][1], qa[i][w][2], qa[i][w][3]);
          d[1] = make_uint4(qa[i][w][4], qa[i][w][5], qa[i][w][6], qa[i][w][7]);
          if constexpr (T == GgmlType::Q6_K) {
            sSc[jg][w][rr][hf] = sa[i][w][0];
          } else if (hf == 0) {
            sSc[jg][w][rr][0] = sa[i][w][0], sSc[jg][w][rr][1] = sa[i][w][1];
          }
        }
        uint32_t p[kPieces][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float v0 = xv[i][2 * j], v1 = xv[i][2 * j + 1];
#pragma unroll
          for (int pc = 0; pc < kPieces; ++pc) {
            const __nv_bfloat16 h0 = __float2bfloat16_rn(v0), h1 = __float2bfloat16_rn(v1);
            p[pc][j] = uint32_t(__bfloat16_as_ushort(h0)) | (uint32_t(__bfloat16_as_ushort(h1)) << 16);
            v0 = __fsub_rn(v0, __bfloat162float(h0));
            v1 = __fsub_rn(v1, __bfloat162float(h1));
          }
        }
#pragma unroll
        for (int pc = 0; pc < kPieces; ++pc)
          *reinterpret_cast<uint4*>(&sB[warp][pc][tk][c8]) = make_uint4(p[pc][0], p[pc][1], p[pc][2], p[pc][3]);
        if constexpr (T == GgmlType::Q4_K) {
          float sm = 0.0f;
#pragma unroll
          for (int j = 0; j < 8; ++j) sm = __fadd_rn(sm, xv[i][j]);
          sXg[jg][tk][c8 / 8] = sm;
        }
        __syncwarp();
#pragma unroll
        for (int w = 0; w < NW; ++w) {
          uint32_t a[2][4];
#pragma unroll
          for (int ks = 0; ks < 2; ++ks) {
            a[ks][0] = *reinterpret_cast<const uint32_t*>(&sA[warp][w][g][16 * ks + c]);
            a[ks][1] = *reinterpret_cast<const uint32_t*>(&sA[warp][w][g + 8][16 * ks + c]);
            a[ks][2] = *reinterpret_cast<const uint32_t*>(&sA[warp][w][g][16 * ks + c + 8]);
            a[ks][3] = *reinterpret_cast<const uint32_t*>(&sA[warp][w][g + 8][16 * ks + c + 8]);
          }
          float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int ks = 0; ks < 2; ++ks) {
#pragma unroll
            for (int pc = 0; pc < kPieces; ++pc) {
              const uint32_t b0 = *reinterpret_cast<const uint32_t*>(&sB[warp][pc][g][16 * ks + c]);
              const uint32_t b1 = *reinterpret_cast<const uint32_t*>(&sB[warp][pc][g][16 * ks + c + 8]);
              mma_bf16(t, a[ks], b0, b1);
            }
            if (T == GgmlType::Q6_K || ks == 1) {
              const int h = T == GgmlType::Q6_K ? ks : 0;
              float* o = sT[jg][h][w];
              o[g * 8 + c] = t[0];
              o[g * 8 + c + 1] = t[1];
              o[(g + 8) * 8 + c] = t[2];
              o[(g + 8) * 8 + c + 1] = t[3];
              if constexpr (T == GgmlType::Q6_K) t[0] = t[1] = t[2] = t[3] = 0.0f;
            }
          }
        }
        __syncwarp();  // the staging is rewritten by this warp's next group
      }
      __syncthreads();
      // 3. thread (er, et) folds its element's group sums in column order (mma_small's sequence)
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        for (int jg = 0; jg < RG; ++jg) {
          if (ch * kChunk + kKs * (g0 + jg) >= cols) break;
          const float s0 = sSc[jg][w][er][0], s1 = sSc[jg][w][er][1];
          const float t0 = sT[jg][0][w][tid];
          if constexpr (T == GgmlType::BF16) {
            acc[w] = __fadd_rn(acc[w], t0);
          } else if constexpr (T == GgmlType::Q8_0) {
            acc[w] = __fmaf_rn(s0, t0, acc[w]);
          } else if constexpr (T == GgmlType::Q4_K) {
            const float* q = sXg[jg][et];
            const float sx = __fadd_rn(__fadd_rn(__fadd_rn(q[0], q[1]), q[2]), q[3]);
            acc[w] = __fmaf_rn(s0, t0, __fmaf_rn(-s1, sx, acc[w]));
          } else if constexpr (T == GgmlType::Q6_K) {
            acc[w] = __fmaf_rn(s0, t0, acc[w]);
            acc[w] = __fmaf_rn(s1, sT[jg][TQ - 1][w][tid], acc[w]);
          }
        }
      }
      __syncthreads();  // the round's sums and scales are rewritten by the next round
    }
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      tot[w] = ch == 0 ? acc[w] : __fadd_rn(tot[w], acc[w]);
      acc[w] = 0.0f;
    }
  }
  const int64_t row = r0 + er;
  if (et < nt && row < rows) {
    float o = tot[0];
    if constexpr (DUAL) o = __fmul_rn(__fdiv_rn(o, __fadd_rn(1.0f, expf(-o))), tot[NW - 1]);
    y[et * ldy + row] = o;
  }
}

template <GgmlType T, int BN, bool V2>
__global__ void __launch_bounds__(kMmaThreads)
    mma_kernel(const uint8_t* __restrict__ W, size_t row_bytes, int64_t rows, int cols, const float* __restrict__ x,
               int64_t ldx, int64_t n_tok, int64_t tok_base, float* __restrict__ y, int64_t ldy) {
  detail::grid_dependency_enter();
  const int64_t t0 = tok_base + int64_t(blockIdx.y) * BN;
  const int nt = int(min(int64_t(BN), n_tok - t0));
  mma_tile<T, BN, false, V2>(W, nullptr, row_bytes, rows, cols, int64_t(blockIdx.x) * kMmaRows, x + t0 * ldx, ldx, nt,
                             y + t0 * ldy, ldy);
}

template <GgmlType T, bool V2>
__global__ void __launch_bounds__(kMmaThreads)
    mma_small_kernel(const uint8_t* __restrict__ W, size_t row_bytes, int64_t rows, int cols,
                     const float* __restrict__ x, int64_t ldx, int64_t n_tok, int64_t tok_base, float* __restrict__ y,
                     int64_t ldy) {
  detail::grid_dependency_enter();
  const int64_t t0 = tok_base + int64_t(blockIdx.y) * 8;
  const int nt = int(min(int64_t(8), n_tok - t0));
  if constexpr (V2)
    mma_small2<T, false>(W, nullptr, row_bytes, rows, cols, int64_t(blockIdx.x) * 16, x + t0 * ldx, ldx, nt,
                         y + t0 * ldy, ldy);
  else
    mma_small<T, false>(W, nullptr, row_bytes, rows, cols, int64_t(blockIdx.x) * 16, x + t0 * ldx, ldx, nt,
                        y + t0 * ldy, ldy);
}

/// Grouped: block b belongs to the job j with jobs[j].block0 <= b < jobs[j + 1].block0.
template <GgmlType T, int BN, bool DUAL, bool SMALL, bool V2>
__global__ void __launch_bounds__(kMmaThreads)
    grouped_kernel(const GroupedMatmulJob* __restrict__ jobs, int n_jobs, size_t row_bytes, int64_t rows, int cols,
                   const float* __restrict__ x, int64_t ldx, float* __restrict__ y, int64_t ldy) {
  detail::grid_dependency_enter();
  const int64_t b = blockIdx.x;
  const GroupedMatmulJob& jb = detail::find_job(jobs, n_jobs, b);
  constexpr int RB = SMALL ? 16 : kMmaRows;
  const detail::JobTile tile = detail::job_tile<RB, BN>(jb, b, rows);
  const int64_t t0 = tile.t0, r0 = tile.r0;
  const int nt = tile.nt;
  if constexpr (SMALL && V2)
    mma_small2<T, DUAL>(static_cast<const uint8_t*>(jb.w), static_cast<const uint8_t*>(jb.w2), row_bytes, rows, cols,
                        r0, x + t0 * ldx, ldx, nt, y + t0 * ldy, ldy);
  else if constexpr (SMALL)
    mma_small<T, DUAL>(static_cast<const uint8_t*>(jb.w), static_cast<const uint8_t*>(jb.w2), row_bytes, rows, cols, r0,
                       x + t0 * ldx, ldx, nt, y + t0 * ldy, ldy);
  else
    mma_tile<T, BN, DUAL, V2>(static_cast<const uint8_t*>(jb.w), static_cast<const uint8_t*>(jb.w2), row_bytes, rows,
                              cols, r0, x + t0 * ldx, ldx, nt, y + t0 * ldy, ldy);
}

int mma_tile_tokens(int64_t n) { return n <= 8 ? 8 : n <= 32 ? 32 : 64; }
/// mma_small for <= 8 tokens when its chunk partials fit in shared memory, else mma_tile.
bool use_small(int tile_tokens, int64_t cols) {
  return tile_tokens == 8 && (cols + kChunk - 1) / kChunk <= kSmallMaxChunks;
}
size_t small_smem(int64_t cols, bool dual) {
  return size_t((cols + kChunk - 1) / kChunk) * (dual ? 2 : 1) * 128 * sizeof(float);
}
int64_t row_block(int tile_tokens, int64_t cols) { return use_small(tile_tokens, cols) ? 16 : kMmaRows; }

template <GgmlType T, bool V2>
void launch_mma(const uint8_t* W, size_t row_bytes, int64_t rows, int cols, const float* x, int64_t ldx, int64_t n_tok,
                float* y, int64_t ldy, cudaStream_t st) {
  const int bn = mma_tile_tokens(n_tok);
  const bool small = use_small(bn, cols);
  const int64_t rb = small ? 16 : kMmaRows;
  const int64_t gx = (rows + rb - 1) / rb;
  constexpr int64_t kMaxGridY = 65535;
  for (int64_t base = 0; base < n_tok; base += kMaxGridY * bn) {
    const int64_t n_here = std::min<int64_t>(n_tok - base, kMaxGridY * bn);
    const dim3 grid(unsigned(gx), unsigned((n_here + bn - 1) / bn));
    if (small)
      detail::launch(mma_small_kernel<T, V2>, grid, kMmaThreads, V2 ? 0 : small_smem(cols, false), st, W, row_bytes,
                     rows, cols, x, ldx, base + n_here, base, y, ldy);
    else if (bn == 8)
      detail::launch(mma_kernel<T, 8, V2>, grid, kMmaThreads, 0, st, W, row_bytes, rows, cols, x, ldx, base + n_here,
                     base, y, ldy);
    else if (bn == 32)
      detail::launch(mma_kernel<T, 32, V2>, grid, kMmaThreads, 0, st, W, row_bytes, rows, cols, x, ldx, base + n_here,
                     base, y, ldy);
    else
      detail::launch(mma_kernel<T, 64, V2>, grid, kMmaThreads, 0, st, W, row_bytes, rows, cols, x, ldx, base + n_here,
                     base, y, ldy);
    STRATA_CUDA_CHECK_LAUNCH();
  }
}

template <GgmlType T, bool DUAL, bool V2>
void launch_grouped(const GroupedMatmulPlan& plan, const GroupedMatmulJob* jobs, int n_jobs, size_t row_bytes,
                    int64_t rows, int cols, const float* x, int64_t ldx, float* y, int64_t ldy, cudaStream_t st) {
  const unsigned grid = unsigned(plan.blocks);
  if (use_small(plan.tile_tokens, cols))
    detail::launch(grouped_kernel<T, 8, DUAL, true, V2>, grid, kMmaThreads, V2 ? 0 : small_smem(cols, DUAL), st, jobs,
                   n_jobs, row_bytes, rows, cols, x, ldx, y, ldy);
  else if (plan.tile_tokens == 8)
    detail::launch(grouped_kernel<T, 8, DUAL, false, V2>, grid, kMmaThreads, 0, st, jobs, n_jobs, row_bytes, rows, cols,
                   x, ldx, y, ldy);
  else if (DUAL || plan.tile_tokens == 32)
    detail::launch(grouped_kernel<T, 32, DUAL, false, V2>, grid, kMmaThreads, 0, st, jobs, n_jobs, row_bytes, rows,
                   cols, x, ldx, y, ldy);
  else
    detail::launch(grouped_kernel<T, 64, false, false, V2>, grid, kMmaThreads, 0, st, jobs, n_jobs, row_bytes, rows,
                   cols, x, ldx, y, ldy);
  STRATA_CUDA_CHECK_LAUNCH();
}

/// Alignment (bytes) that the decoder of `t` assumes for W and row_bytes.
int required_alignment(GgmlType t) {
  switch (t) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16: return 16;
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::IQ4_XS: return 8;
    case GgmlType::Q2_K:
    case GgmlType::Q4_1: return 4;
    case GgmlType::MXFP4: return 1;
    default: return 2;
  }
}

std::string tname(GgmlType t) { return ggml_type_name(t); }

void check_weights(const char* fn, GgmlType type, const void* W, size_t row_bytes, int64_t cols) {
  STRATA_CUDA_REQUIRE(is_supported(type), std::string(fn) + ": unsupported weight type " + tname(type));
  const auto g = quant::detail::geometry(type);
  const int64_t be = g.elems == 1 ? 8 : g.elems;
  STRATA_CUDA_REQUIRE(cols > 0 && cols % be == 0 && cols <= (int64_t(1) << 30),
                      std::string(fn) + ": cols=" + std::to_string(cols) + " is not a positive multiple of " +
                          std::to_string(be) + " for " + tname(type));
  STRATA_CUDA_REQUIRE(row_bytes >= size_t(cols / g.elems) * size_t(g.bytes),
                      std::string(fn) + ": row_bytes=" + std::to_string(row_bytes) + " < the " + tname(type) +
                          " row size of " + std::to_string(size_t(cols / g.elems) * size_t(g.bytes)));
  const int al = required_alignment(type);
  STRATA_CUDA_REQUIRE((reinterpret_cast<uintptr_t>(W) % al) == 0 && row_bytes % al == 0,
                      std::string(fn) + ": " + tname(type) + " weights and row_bytes must be " + std::to_string(al) +
                          "-byte aligned");
}

#define STRATA_CUDA_FOR_EACH_TYPE(X)                                                                                   \
  X(F32)                                                                                                               \
  X(F16)                                                                                                               \
  X(BF16) X(Q8_0) X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q2_K) X(Q3_K) X(Q4_K) X(Q5_K) X(Q6_K) X(IQ2_XS) X(IQ3_S) X(IQ4_XS) \
      X(IQ4_NL) X(MXFP4)

template <GgmlType T>
void launch_mm(const uint8_t* W, size_t row_bytes, int64_t rows, int cols, const float* x, int64_t ldx, int64_t n_tok,
               float* y, int64_t ldy, cudaStream_t st, bool tiled) {
  // The mat-vec of a small matrix (a router: 128 rows) in blocks of 2 warps, so that it spreads
  // over more SMs; a block's warps compute independent rows, so this changes no result.
  const int warps = !tiled && rows < 2048 ? 2 : kWarpsPerBlock;
  const dim3 block(unsigned(warps * 32));
  const int64_t rows_per_block = int64_t(warps) * (tiled ? kTileRows : 1);
  const int64_t gx = (rows + rows_per_block - 1) / rows_per_block;
  const int nt = tiled ? kTileTokens : 1;
  constexpr int64_t kMaxGridY = 65535;
  for (int64_t base = 0; base < n_tok; base += kMaxGridY * nt) {
    const int64_t n_here = std::min<int64_t>(n_tok - base, kMaxGridY * nt);
    const dim3 grid(unsigned(gx), unsigned((n_here + nt - 1) / nt));
    if (tiled) {
      detail::launch(mm_kernel<T, kTileTokens, kTileRows>, grid, block, 0, st, W, row_bytes, rows, cols, x, ldx,
                     base + n_here, base, y, ldy);
    } else {
      detail::launch(mm_kernel<T, 1, 1>, grid, block, 0, st, W, row_bytes, rows, cols, x, ldx, base + n_here, base, y,
                     ldy);
    }
    STRATA_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

bool is_supported(GgmlType t) {
  switch (t) {
#define X(name) case GgmlType::name:
    STRATA_CUDA_FOR_EACH_TYPE(X)
#undef X
    return true;
    default: return false;
  }
}

void matmul(GgmlType type, const void* W, size_t row_bytes, int64_t rows, int64_t cols, const float* x, int64_t ldx,
            int64_t n_tok, float* y, int64_t ldy, void* stream, MatmulPath path) {
  check_weights("cuda::matmul", type, W, row_bytes, cols);
  STRATA_CUDA_REQUIRE(rows > 0 && rows <= int64_t(65535) * kWarpsPerBlock * 1024,
                      "cuda::matmul: bad rows=" + std::to_string(rows));
  STRATA_CUDA_REQUIRE(n_tok >= 0, "cuda::matmul: n_tok < 0");
  STRATA_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(x) % 16 == 0 && ldx % 4 == 0 && ldx >= cols,
                      "cuda::matmul: x must be 16-byte aligned with ldx a multiple of 4 and >= cols (ldx=" +
                          std::to_string(ldx) + ")");
  STRATA_CUDA_REQUIRE(ldy >= rows, "cuda::matmul: ldy=" + std::to_string(ldy) + " < rows=" + std::to_string(rows));
  if (n_tok == 0) return;
  ensure_tables();
  const auto* w = static_cast<const uint8_t*>(W);
  auto st = static_cast<cudaStream_t>(stream);
  const bool mma = path == MatmulPath::Mma || (path == MatmulPath::Auto && has_mma(type, cols));
  if (mma) {
    STRATA_CUDA_REQUIRE(has_mma(type, cols), "cuda::matmul: the tensor-core path does not take " + tname(type) +
                                                 " with cols=" + std::to_string(cols));
    const bool v2 = mma_kernel_version() == 2;
    switch (type) {
      case GgmlType::Q8_0:
        if (v2)
          launch_mma<GgmlType::Q8_0, true>(w, row_bytes, rows, int(cols), x, ldx, n_tok, y, ldy, st);
        else
          launch_mma<GgmlType::Q8_0, false>(w, row_bytes, rows, int(cols), x, ldx, n_tok, y, ldy, st);
        return;
      case GgmlType::Q4_K:
        if (v2)
          launch_mma<GgmlType::Q4_K, true>(w, row_bytes, rows, int(cols), x, ldx, n_tok, y, ldy, st);
        else
          launch_mma<GgmlType::Q4_K, false>(w, row_bytes, rows, int(cols), x, ldx, n_tok, y, ldy, st);
        return;
      case GgmlType::Q6_K:
        if (v2)
          launch_mma<GgmlType::Q6_K, true>(w, row_bytes, rows, int(cols), x, ldx, n_tok, y, ldy, st);
        else
          launch_mma<GgmlType::Q6_K, false>(w, row_bytes, rows, int(cols), x, ldx, n_tok, y, ldy, st);
        return;
      case GgmlType::BF16:
        if (v2)
          launch_mma<GgmlType::BF16, true>(w, row_bytes, rows, int(cols), x, ldx, n_tok, y, ldy, st);
        else
          launch_mma<GgmlType::BF16, false>(w, row_bytes, rows, int(cols), x, ldx, n_tok, y, ldy, st);
        return;
      default: break;
    }
  }
  const bool tiled = path == MatmulPath::Tiled || (path == MatmulPath::Auto && n_tok >= 4);
  switch (type) {
#define X(name)                                                                                 \
  case GgmlType::name:                                                                          \
    launch_mm<GgmlType::name>(w, row_bytes, rows, int(cols), x, ldx, n_tok, y, ldy, st, tiled); \
    return;
    STRATA_CUDA_FOR_EACH_TYPE(X)
#undef X
    default: break;
  }
  STRATA_CUDA_REQUIRE(false, "cuda::matmul: unsupported weight type " + tname(type));
}

namespace {
int parse_mma_version(const char* v) { return v && v[0] == '2' && !v[1] ? 2 : 1; }
detail::EnvSwitch g_mma_version{"STRATA_CUDA_MMA", parse_mma_version};
}  // namespace

int mma_kernel_version() { return g_mma_version.get(); }

void set_mma_kernel_version(int version) {
  if (version != 1 && version != 2)
    throw std::invalid_argument("cuda::set_mma_kernel_version: version " + std::to_string(version) + " is not 1 or 2");
  g_mma_version.set(version);
}

bool has_mma(GgmlType t, int64_t cols) {
  switch (t) {
    case GgmlType::Q8_0:
    case GgmlType::Q4_K:
    case GgmlType::Q6_K: return true;
    case GgmlType::BF16: return cols % 32 == 0;
    default: return false;
  }
}

GroupedMatmulPlan plan_grouped(GroupedMatmulJob* jobs, int n_jobs, int64_t rows, int64_t cols, bool swiglu_pair) {
  STRATA_CUDA_REQUIRE(n_jobs >= 1, "cuda::plan_grouped: no jobs");
  STRATA_CUDA_REQUIRE(rows > 0, "cuda::plan_grouped: rows <= 0");
  int64_t max_n = 0;
  for (int i = 0; i < n_jobs; ++i) {
    STRATA_CUDA_REQUIRE(jobs[i].n_tok >= 1, "cuda::plan_grouped: job " + std::to_string(i) + " has no tokens");
    max_n = std::max(max_n, jobs[i].n_tok);
  }
  GroupedMatmulPlan p;
  p.tile_tokens = std::min(mma_tile_tokens(max_n), swiglu_pair ? 32 : 64);
  const int64_t rbk = row_block(p.tile_tokens, cols);
  p.blocks = detail::assign_job_blocks(jobs, n_jobs, (rows + rbk - 1) / rbk, p.tile_tokens);
  STRATA_CUDA_REQUIRE(p.blocks <= int64_t(INT32_MAX), "cuda::plan_grouped: too many blocks");
  return p;
}

void grouped_matmul(const GroupedMatmulPlan& plan, GgmlType type, const GroupedMatmulJob* jobs, int n_jobs,
                    size_t row_bytes, int64_t rows, int64_t cols, const float* x, int64_t ldx, float* y, int64_t ldy,
                    bool swiglu_pair, void* stream) {
  STRATA_CUDA_REQUIRE(has_mma(type, cols), "cuda::grouped_matmul: the tensor-core path does not take " + tname(type) +
                                               " with cols=" + std::to_string(cols));
  STRATA_CUDA_REQUIRE(n_jobs >= 1 && plan.blocks >= 1 &&
                          (plan.tile_tokens == 8 || plan.tile_tokens == 32 || plan.tile_tokens == 64),
                      "cuda::grouped_matmul: bad plan (use plan_grouped)");
  STRATA_CUDA_REQUIRE(!swiglu_pair || plan.tile_tokens <= 32,
                      "cuda::grouped_matmul: the plan was not made for a swiglu pair");
  STRATA_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(x) % 16 == 0 && ldx % 4 == 0 && ldx >= cols,
                      "cuda::grouped_matmul: x must be 16-byte aligned with ldx a multiple of 4 and >= cols");
  STRATA_CUDA_REQUIRE(ldy >= rows, "cuda::grouped_matmul: ldy < rows");
  const int al = required_alignment(type);
  STRATA_CUDA_REQUIRE(row_bytes % al == 0,
                      "cuda::grouped_matmul: row_bytes not " + std::to_string(al) + "-byte aligned");
  auto st = static_cast<cudaStream_t>(stream);
  const int c = int(cols);
  const bool v2 = mma_kernel_version() == 2;
#define STRATA_GROUPED(T)                                                                                 \
  if (swiglu_pair && v2)                                                                                  \
    launch_grouped<GgmlType::T, true, true>(plan, jobs, n_jobs, row_bytes, rows, c, x, ldx, y, ldy, st);  \
  else if (swiglu_pair)                                                                                   \
    launch_grouped<GgmlType::T, true, false>(plan, jobs, n_jobs, row_bytes, rows, c, x, ldx, y, ldy, st); \
  else if (v2)                                                                                            \
    launch_grouped<GgmlType::T, false, true>(plan, jobs, n_jobs, row_bytes, rows, c, x, ldx, y, ldy, st); \
  else                                                                                                    \
    launch_grouped<GgmlType::T, false, false>(plan, jobs, n_jobs, row_bytes, rows, c, x, ldx, y, ldy, st);
  switch (type) {
    case GgmlType::Q8_0: STRATA_GROUPED(Q8_0) return;
    case GgmlType::Q4_K: STRATA_GROUPED(Q4_K) return;
    case GgmlType::Q6_K: STRATA_GROUPED(Q6_K) return;
    case GgmlType::BF16: STRATA_GROUPED(BF16) return;
    default: break;
  }
#undef STRATA_GROUPED
}

void get_rows(GgmlType type, const void* table, size_t row_bytes, int64_t cols, const int32_t* ids, int64_t n,
              float* out, int64_t ldo, void* stream) {
  check_weights("cuda::get_rows", type, table, row_bytes, cols);
  STRATA_CUDA_REQUIRE(n >= 0 && n <= 65535, "cuda::get_rows: n=" + std::to_string(n) + " outside [0, 65535]");
  STRATA_CUDA_REQUIRE(ldo >= cols, "cuda::get_rows: ldo < cols");
  if (n == 0) return;
  ensure_tables();
  const auto* tb = static_cast<const uint8_t*>(table);
  auto st = static_cast<cudaStream_t>(stream);
  const int threads = 128;
  const dim3 grid(unsigned((cols / 8 + threads - 1) / threads), unsigned(n));
  switch (type) {
#define X(name)                                                                                                     \
  case GgmlType::name:                                                                                              \
    detail::launch(get_rows_kernel<GgmlType::name>, grid, threads, 0, st, tb, row_bytes, int(cols), ids, out, ldo); \
    STRATA_CUDA_CHECK_LAUNCH();                                                                                     \
    return;
    STRATA_CUDA_FOR_EACH_TYPE(X)
#undef X
    default: break;
  }
  STRATA_CUDA_REQUIRE(false, "cuda::get_rows: unsupported type " + tname(type));
}

}  // namespace strata::cuda
