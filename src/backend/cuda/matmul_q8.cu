// The q8-activation matmul path (docs/cuda.md "q8 activations"): activations quantized per token
// to int8 in blocks of 32 (quantize_q8, the CPU's quantize_block_q8 bit for bit), Q8_0 weights
// multiplied with them in integers (int8 tensor cores, m16n8k32, for the GEMM; __dp4a for the
// mat-vec), and the exact int32 block sums folded into an fp32 accumulator in column order.
// Contract, arithmetic and error bound: kernels.h (matmul_q8).
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/env_switch.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace strata::cuda {

namespace {

// ---- quantizer ----

/// The quantizer's operations on 4 consecutive activations v of one 32-block, whose 8 threads
/// (4 values each, in column order) are the lanes of gmask and all call this: amax by a max over
/// the thread's 4 values and 3 shuffles within the 8 (exact, order-free), then the CPU's
/// operations per element: id = 127 / amax, q = nearest-even(x * id), d = amax / 127 (NaN when
/// the block holds a NaN or an infinity, its codes 0). Returns the 4 codes packed (value e in
/// byte e) and the block's d in dv. The one spelling of the scheme on the device: the quantizer
/// kernel and the mat-vec's in-block quantization (mv2_q8_kernel, X1) both call it.
__device__ __forceinline__ uint32_t quantize4_q8(const float v[4], unsigned gmask, float& dv) {
  float amax = 0.0f;
  bool fin = true;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float a = fabsf(v[e]);
    fin = fin && a <= 3.4028234e38f;  // false for NaN and infinities
    amax = fmaxf(amax, a);
  }
#pragma unroll
  for (int off = 4; off >= 1; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(gmask, amax, off));
  int all_fin = fin ? 1 : 0;
#pragma unroll
  for (int off = 4; off >= 1; off /= 2) all_fin &= __shfl_xor_sync(gmask, all_fin, off);
  int8_t o[4] = {0, 0, 0, 0};
  dv = __int_as_float(0x7fc00000);
  if (all_fin) {
    const float id = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    // amax < 127 / FLT_MAX: id is infinite and v = x * id infinite or NaN, which the CPU's
    // conversion turns into code 0 (x86's integer indefinite, truncated to 8 bits): the same here
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float p = __fmul_rn(v[e], id);
      o[e] = fabsf(p) <= 127.5f ? static_cast<int8_t>(__float2int_rn(p)) : int8_t(0);
    }
    dv = __fdiv_rn(amax, 127.0f);
  }
  return uint32_t(uint8_t(o[0])) | (uint32_t(uint8_t(o[1])) << 8) | (uint32_t(uint8_t(o[2])) << 16) |
         (uint32_t(uint8_t(o[3])) << 24);
}

/// One thread per 4 consecutive activations, 8 threads per 32-block (grid: x over 1024-column
/// pieces of a row, y over rows, strided by gridDim.y), quantize4_q8's operations. Output row t
/// reads input row (map ? map[t] : t) / rep. V4: x and ldx allow 16-byte loads, q 4-byte stores.
template <bool V4>
__global__ void quantize_q8_kernel(const float* __restrict__ x, int64_t ldx, int cols, int64_t n,
                                   const int64_t* __restrict__ map, int8_t* __restrict__ q, float* __restrict__ d,
                                   int rep) {
  detail::grid_dependency_enter();
  const int c0 = (int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x)) * 4;  // cols % 32 == 0
  if (c0 >= cols) return;                                                     // whole 8-thread groups leave together
  const int lane = int(threadIdx.x) & 31;
  const unsigned gmask = 0xffu << (lane & ~7);
  for (int64_t t = blockIdx.y; t < n; t += gridDim.y) {
    const int64_t src = (map ? map[t] : t) / rep;
    const float* xr = x + src * ldx + c0;
    float v[4];
    if constexpr (V4) {
      const float4 f = *reinterpret_cast<const float4*>(xr);
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = xr[e];
    }
    float dv;
    const uint32_t packed = quantize4_q8(v, gmask, dv);
    int8_t* qr = q + t * cols + c0;
    if constexpr (V4) {
      *reinterpret_cast<uint32_t*>(qr) = packed;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) qr[e] = int8_t(packed >> (8 * e));
    }
    if ((lane & 7) == 0) d[t * (cols / 32) + c0 / 32] = dv;
  }
}

// ---- shared helpers ----

__device__ __forceinline__ float half_at(const uint8_t* p) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
}
/// float(s) for |s| < 2^22, exactly, without the (quarter-rate) conversion instruction: the int
/// added to the bits of 1.5 * 2^23 lands in the mantissa, then 1.5 * 2^23 is subtracted (exact).
__device__ __forceinline__ float small_int_float(int s) {
  return __fsub_rn(__int_as_float(0x4B400000 + s), 12582912.0f);
}
/// The fold step of the contract: acc + float(isum) * (dw * dx), the product rounded on its own
/// (|isum| <= 32 * 127 * 128 < 2^22, so small_int_float is exact).
__device__ __forceinline__ float fold(float acc, int isum, float dw, float dx) {
  return __fmaf_rn(small_int_float(isum), __fmul_rn(dw, dx), acc);
}
/// silu(g) * u with the expression of cuda::swiglu.
__device__ __forceinline__ float silu_mul(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

using detail::find_job;  // device_common.cuh
using detail::job_tile;
using detail::cp_async;
using detail::cp_commit;
using detail::cp_wait;

// ---- int8 tensor-core GEMM (Q8_0) ----

constexpr int kGThreads = 256;  // 8 warps: 4 along the rows x 2 along the tokens
constexpr int kGRows = 128;     // weight rows per block (a warp: 32 rows = 2 m16 tiles)
constexpr int kGTok = kGemmTileTokens;  // tokens per block (a warp: 32 tokens = 4 n8 tiles)
constexpr int kGKb = 4;         // Q8_0 blocks (32 columns) per pipeline stage
constexpr int kGStages = 3;     // cp.async pipeline depth
constexpr int kGWRow = 144;     // smem bytes per weight row and stage (4 x 34 = 136 used; 36 words: no conflicts)
constexpr int kGXRow = 144;     // smem bytes per token's codes and stage (128 used)
constexpr int kGWBytes = kGRows * kGWRow;
constexpr int kGXBytes = kGTok * kGXRow;
constexpr int kGDBytes = kGTok * kGKb * 4;
template <bool DUAL>
constexpr int gemm_stage_bytes() {
  return (DUAL ? 2 : 1) * kGWBytes + kGXBytes + kGDBytes;
}

/// The 4 bytes at p of shared memory, p 4-byte aligned (ALIGNED) or 2 bytes past an aligned word.
template <bool ALIGNED>
__device__ __forceinline__ uint32_t lds32(const uint8_t* p) {
  if constexpr (ALIGNED) {
    return *reinterpret_cast<const uint32_t*>(p);
  } else {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p - 2);
    return __funnelshift_r(w[0], w[1], 16);
  }
}

/// c = bits(1.5 * 2^23) + the exact int32 products of one m16n8k32 step (from that constant, not
/// from 0): with |S| < 2^22 the result, read as a float, is exactly 1.5 * 2^23 + S, so the fold
/// needs no integer add (fold_biased; the same value as small_int_float(S)).
__device__ __forceinline__ void mma_s8_biased(int c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  constexpr int kBias = 0x4B400000;
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n"
      : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(kBias), "r"(kBias), "r"(kBias), "r"(kBias));
}
/// fold(acc, S, dw, dx) from the biased sum bits(1.5 * 2^23) + S of mma_s8_biased.
__device__ __forceinline__ float fold_biased(float acc, int biased, float dw, float dx) {
  return __fmaf_rn(__fsub_rn(__int_as_float(biased), 12582912.0f), __fmul_rn(dw, dx), acc);
}

/// Stage s of a tile into smem buffer `buf`: kGKb Q8_0 blocks of rows [r0, r0 + kGRows) of W (and
/// W2), the tokens' codes and scales of those blocks. Parts outside the matrix are skipped (their
/// smem is never folded into a stored output) or zero-filled (a block straddling a row's end).
template <bool DUAL, int NTH = DUAL ? 2 * kGThreads : kGThreads>
__device__ __forceinline__ void gemm_load(uint8_t* buf, const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2,
                                          size_t row_bytes, int64_t rows, int64_t r0, int nb, int s,
                                          const int8_t* __restrict__ xq, const float* __restrict__ xd, int cols,
                                          int nt) {
  const int tid = threadIdx.x;
  const int vb = min(kGKb, nb - s * kGKb);  // valid blocks of this stage
  const int wbytes = vb * 34;
  constexpr int kChunks = kGKb * 34 / 8;  // 17 chunks of 8 bytes per row
#pragma unroll
  for (int m = 0; m < (DUAL ? 2 : 1); ++m) {
    const uint8_t* Wm = m == 0 ? W : W2;
    uint8_t* sw = buf + m * kGWBytes;
    for (int i = tid; i < kGRows * kChunks; i += NTH) {
      const int r = i / kChunks, c = i % kChunks;
      const int left = wbytes - 8 * c;
      if (r0 + r < rows && left > 0)
        cp_async<8>(sw + r * kGWRow + 8 * c, Wm + (r0 + r) * int64_t(row_bytes) + int64_t(s) * (kGKb * 34) + 8 * c,
                    left < 8 ? left : 8);
    }
  }
  uint8_t* sx = buf + (DUAL ? 2 : 1) * kGWBytes;
  for (int i = tid; i < kGTok * 8; i += NTH) {  // 8 chunks of 16 codes per token
    const int t = i / 8, c = i % 8;
    if (t < nt && c / 2 < vb)
      cp_async<16>(sx + t * kGXRow + 16 * c, xq + int64_t(t) * cols + s * (kGKb * 32) + 16 * c, 16);
  }
  float* sd = reinterpret_cast<float*>(sx + kGXBytes);
  for (int i = tid; i < kGTok * kGKb; i += NTH) {
    const int t = i / kGKb, j = i % kGKb;
    if (t < nt && j < vb) cp_async<4>(sd + t * kGKb + j, xd + int64_t(t) * (cols / 32) + s * kGKb + j, 4);
  }
}

/// The MMAs and folds of one pipeline stage (vb valid Q8_0 blocks) of one weight matrix (its
/// stage in sw, the tokens' codes in sx, their scales after them) for the warp's 32 rows (wm) and
/// its first NN 8-token n-tiles (wn): per block j in order, isum from one biased m16n8k32 MMA,
/// acc = fold(acc, isum, dw_j, dx_j).
template <int NN>
__device__ __forceinline__ void gemm_stage_mma(const uint8_t* sw, const uint8_t* sx, int vb, int wm, int wn, int g,
                                               int tq, float (&acc)[2][4][4]) {
  const float* sd = reinterpret_cast<const float*>(sx + kGXBytes);
#pragma unroll
  for (int j = 0; j < kGKb; ++j) {
    if (j < vb) {
      uint32_t bf[NN][2];
      float dx[NN][2];
#pragma unroll
      for (int n = 0; n < NN; ++n) {
        const int tok = wn * 32 + n * 8;
        const uint8_t* p = sx + (tok + g) * kGXRow + 32 * j + 4 * tq;
        bf[n][0] = *reinterpret_cast<const uint32_t*>(p);
        bf[n][1] = *reinterpret_cast<const uint32_t*>(p + 16);
        dx[n][0] = sd[(tok + 2 * tq) * kGKb + j];
        dx[n][1] = sd[(tok + 2 * tq + 1) * kGKb + j];
      }
      uint32_t af[2][4];
      float dw[2][2];
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        const uint8_t* row = sw + (wm * 32 + a * 16 + g) * kGWRow + 34 * j;
        if ((34 * j + 2) % 4 == 0) {
          af[a][0] = lds32<true>(row + 2 + 4 * tq);
          af[a][1] = lds32<true>(row + 8 * kGWRow + 2 + 4 * tq);
          af[a][2] = lds32<true>(row + 18 + 4 * tq);
          af[a][3] = lds32<true>(row + 8 * kGWRow + 18 + 4 * tq);
        } else {
          af[a][0] = lds32<false>(row + 2 + 4 * tq);
          af[a][1] = lds32<false>(row + 8 * kGWRow + 2 + 4 * tq);
          af[a][2] = lds32<false>(row + 18 + 4 * tq);
          af[a][3] = lds32<false>(row + 8 * kGWRow + 18 + 4 * tq);
        }
        dw[a][0] = half_at(row);
        dw[a][1] = half_at(row + 8 * kGWRow);
      }
      int is[2][NN][4];
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int n = 0; n < NN; ++n) mma_s8_biased(is[a][n], af[a], bf[n][0], bf[n][1]);
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int n = 0; n < NN; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[a][n][e] = fold_biased(acc[a][n][e], is[a][n][e], dw[a][e / 2], dx[n][e % 2]);
    }
  }
}

/// One block's tile: rows [r0, r0 + 128) x tokens [0, nt) (nt <= 64) of codes xq (rows cols bytes
/// apart) and scales xd. Per output element, for each Q8_0 block b in order: isum = the block's
/// exact int32 dot product (one m16n8k32 MMA from 0), acc = fold(acc, isum, dw_b, dx_b).
/// Output token tok goes to row (yrows ? yrows[tok] : tok) of y. The warp's 8-token n-tiles past
/// nt are skipped (no MMA, no fold: their outputs are never stored). DUAL (the SwiGLU pair,
/// 512 threads): warps 0-7 compute W's outputs and warps 8-15 the same outputs of W2, each with
/// one matrix's accumulators (so two blocks' worth of warps per SM at the register budget of
/// one matrix); the W2 warps leave theirs in shared memory for the W warps, which store
/// silu(w) * w2. Each output's operations are those of one matrix alone, in block order.
template <bool DUAL>
__device__ __forceinline__ void gemm_tile(uint8_t* smem, const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2,
                                          size_t row_bytes, int64_t rows, int cols, int64_t r0,
                                          const int8_t* __restrict__ xq, const float* __restrict__ xd, int nt,
                                          float* __restrict__ y, int64_t ldy, const int64_t* __restrict__ yrows) {
  constexpr int NW = DUAL ? 2 : 1;
  constexpr int SB = gemm_stage_bytes<DUAL>();
  const int nb = cols / 32;
  const int ns = (nb + kGKb - 1) / kGKb;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  const int mat = warp / 8, wl = warp % 8;  // mat 1: the W2 warps (DUAL only)
  const int wm = wl % 4, wn = wl / 4;
  const int nlive = min(4, max(0, (nt - wn * 32 + 7) / 8));  // the warp's n-tiles with a token below nt
  float acc[2][4][4];
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[a][b][e] = 0.0f;

#pragma unroll
  for (int s = 0; s < kGStages - 1; ++s) {
    if (s < ns) gemm_load<DUAL>(smem + s * SB, W, W2, row_bytes, rows, r0, nb, s, xq, xd, cols, nt);
    cp_commit();
  }
  for (int s = 0; s < ns; ++s) {
    cp_wait<kGStages - 2>();
    __syncthreads();
    {
      const int sn = s + kGStages - 1;
      if (sn < ns) gemm_load<DUAL>(smem + (sn % kGStages) * SB, W, W2, row_bytes, rows, r0, nb, sn, xq, xd, cols, nt);
      cp_commit();
    }
    const uint8_t* buf = smem + (s % kGStages) * SB;
    const uint8_t* sw = buf + mat * kGWBytes;
    const uint8_t* sx = buf + NW * kGWBytes;
    const int vb = min(kGKb, nb - s * kGKb);
    // A warp whose tokens all lie past nt does no MMA; one with at most 16 live tokens does
    // its first two n-tiles only (the outputs of the others are never stored).
    if (nlive > 2)
      gemm_stage_mma<4>(sw, sx, vb, wm, wn, g, tq, acc);
    else if (nlive > 0)
      gemm_stage_mma<2>(sw, sx, vb, wm, wn, g, tq, acc);
  }
  cp_wait<0>();
  constexpr int kExLd = kGRows + 4;  // floats per token row of the W2 outputs (conflict-free)
  float* ex = reinterpret_cast<float*>(smem);
  if constexpr (DUAL) {
    __syncthreads();  // every stage consumed: the pipeline's smem is free
    if (mat == 1) {
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            ex[(wn * 32 + n * 8 + 2 * tq + e % 2) * kExLd + wm * 32 + a * 16 + g + 8 * (e / 2)] = acc[a][n][e];
    }
    __syncthreads();
    if (mat == 1) return;
  }
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rl = wm * 32 + a * 16 + g + 8 * (e / 2);
        const int64_t row = r0 + rl;
        const int tok = wn * 32 + n * 8 + 2 * tq + e % 2;
        if (row < rows && tok < nt) {
          float o = acc[a][n][e];
          if constexpr (DUAL) o = silu_mul(o, ex[tok * kExLd + rl]);
          y[(yrows ? yrows[tok] : int64_t(tok)) * ldy + row] = o;
        }
      }
}

/// GEMM launch over jobs (jobs == nullptr: the single job `one`, x rows from row0). Block b:
/// job j, row block (b - block0) % row_blocks, token tile (b - block0) / row_blocks.
template <bool DUAL>
__global__ void __launch_bounds__(DUAL ? 2 * kGThreads : kGThreads)
    gemm_q8_kernel(const GroupedMatmulJob* __restrict__ jobs, int n_jobs, GroupedMatmulJob one, size_t row_bytes,
                   int64_t rows, int cols, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                   float* __restrict__ y, int64_t ldy, const int64_t* __restrict__ yrows) {
  detail::grid_dependency_enter();
  extern __shared__ __align__(16) uint8_t smem[];
  const int64_t b = blockIdx.x;
  const GroupedMatmulJob& jb = jobs ? find_job(jobs, n_jobs, b) : one;
  const detail::JobTile t = job_tile<kGRows, kGTok>(jb, b, rows);
  if (t.nt <= 0) return;  // past the job's tiles: a bound-sized launch (plan_grouped_q8_bound)
  gemm_tile<DUAL>(smem, static_cast<const uint8_t*>(jb.w), static_cast<const uint8_t*>(jb.w2), row_bytes, rows, cols,
                  t.r0, xq + t.t0 * cols, xd + t.t0 * (cols / 32), t.nt, yrows ? y : y + t.t0 * ldy, ldy,
                  yrows ? yrows + t.t0 : nullptr);
}

// ---- mat-vec (__dp4a), up to 8 tokens ----

constexpr int kVThreads = 256;
constexpr int kVRows = 16;   // rows per block (large matrices)
constexpr int kVRowsSmall = 4;     // rows per block for matrices of fewer than kVSmallBelow 16-row blocks
constexpr int kVThreadsSmall = 128;
constexpr int64_t kVSmallBelow = 264;  // two blocks per SM of a 132-SM H200 at 16 rows a block
constexpr int kVTok = 8;     // tokens per block at most
constexpr int kVPairs = 32;  // block pairs (64 columns) per stage: 2048 columns
template <bool DUAL, int RB = kVRows>
constexpr int mv_smem_bytes() {
  return (DUAL ? 2 : 1) * (RB * kVTok * 2 * kVPairs + RB * 2 * kVPairs) * 4;
}

/// The two Q8_0 blocks 2P, 2P + 1 of a row (the second only if `two`): codes as 16 words (block
/// 0: words 0-7, block 1: 8-15) and scales. A4: the row is 4-byte aligned (the pair at 68P is).
template <bool A4>
__device__ __forceinline__ void load_pair(const uint8_t* __restrict__ p, bool two, uint32_t q[16], float& d0,
                                          float& d1) {
  if constexpr (A4) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p);
    uint32_t v[17];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = w[k];
    v[8] = two ? w[8] : uint32_t(*reinterpret_cast<const uint16_t*>(p + 32));
    if (two) {
#pragma unroll
      for (int k = 9; k < 17; ++k) v[k] = w[k];
    } else {
#pragma unroll
      for (int k = 9; k < 17; ++k) v[k] = 0;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = __funnelshift_r(v[k], v[k + 1], 16);
#pragma unroll
    for (int k = 0; k < 8; ++k) q[8 + k] = v[9 + k];
    d0 = __half2float(__ushort_as_half(static_cast<unsigned short>(v[0] & 0xffff)));
    d1 = __half2float(__ushort_as_half(static_cast<unsigned short>(v[8] >> 16)));
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    d0 = __half2float(__ushort_as_half(h[0]));
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = uint32_t(h[1 + 2 * k]) | (uint32_t(h[2 + 2 * k]) << 16);
    if (two) {
      d1 = __half2float(__ushort_as_half(h[17]));
#pragma unroll
      for (int k = 0; k < 8; ++k) q[8 + k] = uint32_t(h[18 + 2 * k]) | (uint32_t(h[19 + 2 * k]) << 16);
    } else {
      d1 = 0.0f;
#pragma unroll
      for (int k = 0; k < 8; ++k) q[8 + k] = 0;
    }
  }
}

/// Rows per block of the mat-vec for a matrix of `rows` rows (host side; the plan and the launch
/// both ask it): kWRowsBlock (mv16_q8_kernel) when every weight row is 16-byte aligned (vec16),
/// else 4 (more blocks, so that a small matrix still spreads over the SMs) below kVSmallBelow
/// blocks of 16, else 16 (mv_tile). STRATA_CUDA_MV_ROWS=16 or =4 forces mv_tile with that many,
/// STRATA_CUDA_MV16=0 the choice without the 16-byte staging (comparisons). The rows a block holds and the kernel change no element's operations.
constexpr int kWRowsBlockFwd = 8;  // = kWRowsBlock (mv16_q8_kernel, below)
int mv_rows_per_block(int64_t rows, bool vec16) {
  static detail::EnvSwitch rows_env{"STRATA_CUDA_MV_ROWS", [](const char* v) {
                                      return v && std::string(v) == "16"  ? kVRows
                                             : v && std::string(v) == "4" ? kVRowsSmall
                                                                          : 0;
                                    }};
  static detail::EnvSwitch v16_env{"STRATA_CUDA_MV16", detail::off_if_zero};
  const int forced = rows_env.get();
  const bool no16 = v16_env.get() == 0;
  if (forced) return forced;
  if (vec16 && !no16) return kWRowsBlockFwd;
  return (rows + kVRows - 1) / kVRows < kVSmallBelow ? kVRowsSmall : kVRows;
}

/// Rows [r0, r0 + RB) x tokens [0, nt) (nt <= 8), NTH threads. Per stage of 64 blocks: every (row, block pair)
/// task computes the exact int32 block sums (8 __dp4a each, from 0) for each token into shared
/// memory; then thread (row, token) folds the stage's blocks in column order, the GEMM's fold.
template <bool DUAL, bool A4, int RB, int NTH>
__device__ __forceinline__ void mv_tile(float* smem, const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2,
                                        size_t row_bytes, int64_t rows, int cols, int64_t r0,
                                        const int8_t* __restrict__ xq, const float* __restrict__ xd, int nt,
                                        float* __restrict__ y, int64_t ldy) {
  constexpr int NW = DUAL ? 2 : 1;
  constexpr int SB = kVTok * 2 * kVPairs;  // ints per row of sums
  int* sS = reinterpret_cast<int*>(smem);  // [NW][RB][kVTok][64]
  float* sD = smem + NW * RB * SB;     // [NW][RB][64]
  const int nb = cols / 32, np = (nb + 1) / 2;
  const int tid = threadIdx.x;
  const int fr = tid % RB, ft = tid / RB;  // fold thread: row, token
  float acc[NW];
#pragma unroll
  for (int m = 0; m < NW; ++m) acc[m] = 0.0f;
  for (int p0 = 0; p0 < np; p0 += kVPairs) {
    for (int i = tid; i < NW * RB * kVPairs; i += NTH) {
      const int m = i / (RB * kVPairs), r = (i / kVPairs) % RB, pp = i % kVPairs;
      const int P = p0 + pp;
      if (P >= np || r0 + r >= rows) continue;
      const bool two = 2 * P + 1 < nb;
      uint32_t q[16];
      float d0, d1;
      load_pair<A4>((m == 0 ? W : W2) + (r0 + r) * int64_t(row_bytes) + int64_t(P) * 68, two, q, d0, d1);
      sD[(m * RB + r) * 64 + 2 * pp] = d0;
      sD[(m * RB + r) * 64 + 2 * pp + 1] = d1;
      for (int t = 0; t < nt; ++t) {
        const uint4* xp = reinterpret_cast<const uint4*>(xq + int64_t(t) * cols + int64_t(P) * 64);
        const uint4 x0 = xp[0], x1 = xp[1];
        const uint32_t xa[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        int s0 = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) s0 = __dp4a(int(q[k]), int(xa[k]), s0);
        int s1 = 0;
        if (two) {
          const uint4 x2 = xp[2], x3 = xp[3];
          const uint32_t xb[8] = {x2.x, x2.y, x2.z, x2.w, x3.x, x3.y, x3.z, x3.w};
#pragma unroll
          for (int k = 0; k < 8; ++k) s1 = __dp4a(int(q[8 + k]), int(xb[k]), s1);
        }
        int* so = sS + ((m * RB + r) * kVTok + t) * 64 + 2 * pp;
        so[0] = s0;
        so[1] = s1;
      }
    }
    __syncthreads();
    if (ft < nt && r0 + fr < rows) {
      const int nblk = min(64, nb - 2 * p0);
      const float* xdt = xd + int64_t(ft) * (cols / 32) + 2 * p0;
#pragma unroll
      for (int m = 0; m < NW; ++m) {
        const int* si = sS + ((m * RB + fr) * kVTok + ft) * 64;
        const float* di = sD + (m * RB + fr) * 64;
        float a = acc[m];
        for (int k = 0; k < nblk; ++k) a = fold(a, si[k], di[k], xdt[k]);
        acc[m] = a;
      }
    }
    __syncthreads();
  }
  if (ft < nt && r0 + fr < rows) {
    float o = acc[0];
    if constexpr (DUAL) o = silu_mul(o, acc[NW - 1]);
    y[int64_t(ft) * ldy + r0 + fr] = o;
  }
}

template <bool DUAL, bool A4, int RB = kVRows, int NTH = kVThreads>
__global__ void __launch_bounds__(NTH)
    mv_q8_kernel(const GroupedMatmulJob* __restrict__ jobs, int n_jobs, GroupedMatmulJob one, size_t row_bytes,
                 int64_t rows, int cols, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                 float* __restrict__ y, int64_t ldy) {
  detail::grid_dependency_enter();
  extern __shared__ __align__(16) float smem_f[];
  const int64_t b = blockIdx.x;
  const GroupedMatmulJob& jb = jobs ? find_job(jobs, n_jobs, b) : one;
  const detail::JobTile t = job_tile<RB, kVTok>(jb, b, rows);
  if (t.nt <= 0) return;
  mv_tile<DUAL, A4, RB, NTH>(smem_f, static_cast<const uint8_t*>(jb.w), static_cast<const uint8_t*>(jb.w2), row_bytes, rows,
                    cols, t.r0, xq + t.t0 * cols, xd + t.t0 * (cols / 32), t.nt, y + t.t0 * ldy, ldy);
}

// ---- mat-vec with 16-byte staging (rows 16-byte aligned), up to 8 tokens ----
//
// The same arithmetic as mv_tile, another data path. A warp owns kWRows rows (of both matrices
// with DUAL) and no block barrier: per stage of 64 Q8_0 blocks it copies each row's 2176 bytes
// into its shared memory with coalesced 16-byte cp.async (a warp instruction covers 512
// contiguous bytes; mv_tile's per-thread 68-byte pairs cost a cache wavefront per 4 bytes and
// lane), then lane l takes block pair l of every row from shared memory (68-byte stride: 17
// words, an odd count, so the 32 lanes hit 32 banks), forms the exact block sums for each token
// with __dp4a, leaves them in the same shared memory, and lanes (row, token) fold them in column
// order. Needs W (and W2) and row_bytes 16-byte aligned.

constexpr int kWRows = 2;                         // rows per warp
constexpr int kWWarps = 4;                        // warps per block
constexpr int kWRowsBlock = kWRows * kWWarps;     // rows per block
static_assert(kWRowsBlock == kWRowsBlockFwd, "mv_rows_per_block names this block size");
// Per (matrix, row) stream of a warp: a stage's 2176 bytes of weights, then (over them) the block
// sums of token t at t * kWTokBytes (66 words: the fold lanes (row, token) read 8 tokens of a row in
// 8 banks) and the 64 block scales at kWScales; the stream stride (592 words, 16 mod 32) puts the
// other row's tokens in the other 16 banks.
constexpr int kWTokBytes = 264;
constexpr int kWScales = kVTok * kWTokBytes;
constexpr int kWStreamBytes = kWScales + 64 * 4;
static_assert(kWStreamBytes >= 64 * 34 && kWStreamBytes % 16 == 0 && (kWStreamBytes / 4) % 32 == 16,
              "a stage's weights fit the stream's bytes, 16-byte aligned, rows in separate banks");
constexpr int kWXdBytes = kVTok * 64 * 4;  // per warp: the stage's activation scales of each token
template <bool DUAL>
constexpr int mv16_smem_bytes() {
  return kWWarps * ((DUAL ? 2 : 1) * kWRows * kWStreamBytes + kWXdBytes);
}

/// find_job by one warp: lanes read 32 jobs' block0 at a time (one memory round trip instead of a
/// chain of log2(n_jobs)), the last job starting at or before b wins. Every lane gets the index.
__device__ __forceinline__ int find_job_warp(const GroupedMatmulJob* __restrict__ jobs, int n_jobs, int64_t b,
                                             int lane) {
  int found = 0;
  for (int j0 = 0; j0 < n_jobs; j0 += 32) {
    const int j = j0 + lane;
    const bool le = j < n_jobs && jobs[j].block0 <= b;
    const unsigned m = __ballot_sync(0xffffffffu, le);
    if (m) found = j0 + 31 - __clz(int(m));
    if (m != 0xffffffffu) break;  // block0 increases with j: no later job starts at or before b
  }
  return found;
}

template <bool DUAL>
__global__ void __launch_bounds__(kWWarps * 32)
    mv16_q8_kernel(const GroupedMatmulJob* __restrict__ jobs, int n_jobs, GroupedMatmulJob one, size_t row_bytes,
                   int64_t rows, int cols, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                   float* __restrict__ y, int64_t ldy) {
  // One matrix (jobs == nullptr: a model weight, which no kernel writes) may copy its first
  // stage of weights before waiting for the kernel before it (launch.cuh); the job table of a
  // grouped launch is that kernel's output, so a grouped launch waits first. Every other global
  // access of either comes after the wait.
  const bool early = jobs == nullptr;
  if (!early) detail::grid_dependency_enter();
  constexpr int NW = DUAL ? 2 : 1, NS = NW * kWRows;  // streams: stream s = matrix s / kWRows, row s % kWRows
  extern __shared__ __align__(16) uint8_t smem_w[];
  const int64_t b = blockIdx.x;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const GroupedMatmulJob& jb = jobs ? jobs[find_job_warp(jobs, n_jobs, b, lane)] : one;
  const detail::JobTile t = job_tile<kWRowsBlock, kVTok>(jb, b, rows);
  const int64_t r0 = t.r0 + int64_t(warp) * kWRows;
  if (t.nt <= 0 || r0 >= rows) {  // the whole warp (warps never wait for each other)
    if (early) detail::grid_dependency_enter();
    return;
  }
  uint8_t* ws = smem_w + warp * (NS * kWStreamBytes + kWXdBytes);
  float* xds = reinterpret_cast<float*>(ws + NS * kWStreamBytes);  // [kVTok][64]
  const uint8_t* W[2] = {static_cast<const uint8_t*>(jb.w), static_cast<const uint8_t*>(jb.w2)};
  const int nt = t.nt, nb = cols / 32;
  const int8_t* xqt = xq + t.t0 * cols;
  const float* xdt = xd + t.t0 * (cols / 32);
  const int fr = lane % kWRows, ft = lane / kWRows;  // fold lane: row, token
  const bool folder = ft < nt && r0 + fr < rows;
  float acc[NW];
#pragma unroll
  for (int m = 0; m < NW; ++m) acc[m] = 0.0f;
  if (early && nb == 0) detail::grid_dependency_enter();
  for (int b0 = 0; b0 < nb; b0 += 64) {
    const int nblk = min(64, nb - b0);
    const int chunks = (nblk * 34 + 15) / 16;  // within the row: row_bytes and b0 * 34 are multiples of 16
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      if (r0 + s % kWRows >= rows) continue;
      const uint8_t* src = W[s / kWRows] + (r0 + s % kWRows) * int64_t(row_bytes) + int64_t(b0) * 34;
      for (int c = lane; c < chunks; c += 32) cp_async<16>(ws + s * kWStreamBytes + c * 16, src + c * 16, 16);
    }
    if (early && b0 == 0) detail::grid_dependency_enter();  // the weights are in flight; x and y after this
    for (int i = lane; i < nt * nblk; i += 32)  // the fold's activation scales, with the weights
      cp_async<4>(xds + (i / nblk) * 64 + i % nblk, xdt + int64_t(i / nblk) * nb + b0 + i % nblk, 4);
    cp_commit();
    const int P = lane;  // this lane's block pair: blocks b0 + 2P, b0 + 2P + 1
    const bool act = 2 * P < nblk, two = 2 * P + 1 < nblk;
    // token 0's codes while the copies are in flight
    uint4 xf[4] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
    if (act) {
      const uint4* xp = reinterpret_cast<const uint4*>(xqt + int64_t(b0 + 2 * P) * 32);
      xf[0] = xp[0], xf[1] = xp[1];
      if (two) xf[2] = xp[2], xf[3] = xp[3];
    }
    cp_wait<0>();
    __syncwarp();
    uint32_t q[NS][16];
    float d0[NS], d1[NS];
    if (act) {
#pragma unroll
      for (int s = 0; s < NS; ++s) load_pair<true>(ws + s * kWStreamBytes + 68 * P, two, q[s], d0[s], d1[s]);
    }
    __syncwarp();  // every lane has its codes: the sums may overwrite them
    if (act) {
      for (int tk = 0; tk < nt; ++tk) {
        uint4 x0 = xf[0], x1 = xf[1], x2 = xf[2], x3 = xf[3];
        if (tk > 0) {
          const uint4* xp = reinterpret_cast<const uint4*>(xqt + int64_t(tk) * cols + int64_t(b0 + 2 * P) * 32);
          x0 = xp[0], x1 = xp[1];
          if (two) x2 = xp[2], x3 = xp[3];
        }
        const uint32_t xa[16] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w,
                                 x2.x, x2.y, x2.z, x2.w, x3.x, x3.y, x3.z, x3.w};
#pragma unroll
        for (int s = 0; s < NS; ++s) {
          int s0 = 0, s1 = 0;
#pragma unroll
          for (int k = 0; k < 8; ++k) s0 = __dp4a(int(q[s][k]), int(xa[k]), s0);
#pragma unroll
          for (int k = 0; k < 8; ++k) s1 = __dp4a(int(q[s][8 + k]), int(xa[8 + k]), s1);
          *reinterpret_cast<int2*>(ws + s * kWStreamBytes + tk * kWTokBytes + 8 * P) = make_int2(s0, s1);
        }
      }
#pragma unroll
      for (int s = 0; s < NS; ++s)
        *reinterpret_cast<float2*>(ws + s * kWStreamBytes + kWScales + 8 * P) = make_float2(d0[s], d1[s]);
    }
    __syncwarp();
    if (folder) {
      const float* xdk = xds + ft * 64;
      const int* si[NW];
      const float* di[NW];
#pragma unroll
      for (int m = 0; m < NW; ++m) {
        si[m] = reinterpret_cast<const int*>(ws + (m * kWRows + fr) * kWStreamBytes + ft * kWTokBytes);
        di[m] = reinterpret_cast<const float*>(ws + (m * kWRows + fr) * kWStreamBytes + kWScales);
      }
#pragma unroll 8
      for (int k = 0; k < nblk; ++k) {
        const float dx = xdk[k];
#pragma unroll
        for (int m = 0; m < NW; ++m) acc[m] = fold(acc[m], si[m][k], di[m][k], dx);
      }
    }
    __syncwarp();  // the fold has read the sums before the next stage's copies land
  }
  if (folder) {
    float o = acc[0];
    if constexpr (DUAL) o = silu_mul(o, acc[NW - 1]);
    y[(t.t0 + ft) * ldy + r0 + fr] = o;
  }
}

// ---- mat-vec v2 (rows 16-byte aligned), up to 8 tokens ----
//
// mv16_q8_kernel's data path with the work spread over all lanes and a 2-instruction fold step.
// A warp owns R rows (of both matrices with DUAL: NS = NW * R streams, stream s = matrix s / R,
// row s % R) and a block WARPS warps (R * WARPS = kWRowsBlock rows, so the plans and the block
// numbering are mv16's). Per stage of KB Q8_0 blocks the warp copies each stream's bytes into
// its shared memory with coalesced 16-byte cp.async, streams back to back (stream s at
// s * KB * 34 bytes, so block pair P of stream s lies at 68 (s * KB/2 + P): task i = (s, P),
// flattened, sits at 68 i, and 32 consecutive tasks, 17 words apart, hit 32 banks). Lane l
// takes tasks l, l + 32, ...: for each token it forms the two exact block sums with __dp4a and
// stores, per block, the fold's operands (float(S_b) exactly, dw_b * dx_b rounded on its own) in
// a separate result area; then lane s folds stream s's blocks in column order, one fma per
// block (two blocks per 16-byte load). The weights stay in shared memory for the next token.
// Same operations per output as fold(): the same bits as mv16_q8_kernel and the definition.
// Two instances: R = 2, KB = 64, 4 warps (long rows: mv16's geometry, 32 pairs a stream, lane l
// takes pair l of every stream) and R = 8, KB = 24, one warp (rows of up to 32 blocks: 768
// columns give 8 x 12 = 96 pair tasks, 3 per lane, where mv16 kept 12 of 32 lanes busy).
// STRATA_CUDA_MV16_V2=0 runs mv16_q8_kernel instead (mv16_v2_enabled); STRATA_CUDA_MV2_SMALL=0 the
// 4-warp instance for short rows too (g_mv2_small).
//
// X1 (one token per block, its activations in fp32: decode): the block first quantizes the
// token's row into shared memory with quantize4_q8 (the quantizer kernel's operations, so the
// same codes and scales), all its threads, one barrier; and since no second token reads a
// stage's weights, lane l writes task i's four fold operands over task i's own 68 weight bytes
// (after loading them into registers), at word 4 (s % 4) of it so that the fold lanes' reads
// fall in different banks. That drops the separate result area: 8.7 instead of 11 KiB a warp
// for the DUAL 2 x 64 instance, so that 6 instead of 5 of its 4-warp blocks fit an SM (a MoE
// decode step's 768 gate/up blocks in one wave on 132 SMs), and the quantizer launch before
// each decode mat-vec goes away. The fold's operands and order are unchanged: the same bits.

constexpr int kV2SmallMaxBlocks = 32;  // rows of at most 32 Q8_0 blocks (1024 columns): the R = 8 instance

/// Shared bytes of one warp of mv2_q8_kernel<DUAL, R, KB, *>: the stage's weights of its NS
/// streams, the (float(S), dw dx) results [NS][2 KB + 4] (the + 4 words move stream s + 1's row
/// to another 16-byte bank group), the accumulators [NS][kVTok] carried between stages. X1: the
/// weights and one accumulator per stream (padded to 16 bytes), the results written over the
/// weights.
template <bool DUAL, int R, int KB, bool X1 = false>
constexpr int mv2_warp_bytes() {
  constexpr int NS = (DUAL ? 2 : 1) * R;
  return X1 ? NS * KB * 34 + (NS * 4 + 15) / 16 * 16 : NS * (KB * 34 + (2 * KB + 4) * 4 + kVTok * 4);
}
/// X1's block area in front of the warps': the token's cols codes, then its cols / 32 scales,
/// rounded up to 16 bytes.
__host__ __device__ constexpr int64_t mv2_x1_bytes(int64_t cols) { return (cols + cols / 8 + 15) / 16 * 16; }
/// Columns X1 takes at most (its codes and scales in shared memory next to the weights).
constexpr int64_t kX1MaxCols = 8192;

/// X1's activations: one fp32 row per block, row (job token row) / rep of x, rows ldx floats apart
/// (x 16-byte aligned, ldx % 4 == 0).
struct Q8X1Src {
  const float* x = nullptr;
  int64_t ldx = 0;
  int rep = 1;
};

/// X1: the block's NTH threads quantize the fp32 row xr (cols floats, 16-byte aligned) into
/// codes xs[0, cols) and scales at xs + cols, 4 columns a thread (a 32-block's 8 threads adjacent
/// lanes: NTH is a multiple of 32, cols of 32), quantize4_q8's operations. A thread's loads of a
/// batch of kX1Batch float4s are issued together before any shuffle (one L2 round trip per batch
/// instead of one per float4).
constexpr int kX1Batch = 4;
template <int NTH>
__device__ __forceinline__ void mv2_quantize_row(const float* __restrict__ xr, int cols, uint8_t* xs) {
  const int lane = int(threadIdx.x) & 31;
  const unsigned gmask = 0xffu << (lane & ~7);
  float* xds = reinterpret_cast<float*>(xs + cols);
  for (int base = 4 * int(threadIdx.x); base < cols; base += 4 * NTH * kX1Batch) {
    float4 f[kX1Batch];
#pragma unroll
    for (int u = 0; u < kX1Batch; ++u) {
      const int c0 = base + 4 * NTH * u;
      f[u] = c0 < cols ? *reinterpret_cast<const float4*>(xr + c0) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < kX1Batch; ++u) {
      const int c0 = base + 4 * NTH * u;
      if (c0 >= cols) break;  // uniform over a 32-block's 8 threads
      const float v[4] = {f[u].x, f[u].y, f[u].z, f[u].w};
      float dv;
      *reinterpret_cast<uint32_t*>(xs + c0) = quantize4_q8(v, gmask, dv);
      if ((lane & 7) == 0) xds[c0 / 32] = dv;
    }
  }
}

/// mv2_q8_kernel's "several matrices" mode (matmul_q8_multi): n > 0 matrices of one column count
/// applied to the same activations, matrix i taking the blocks [block0[i], block0[i + 1]) with its
/// own rows, output pointer and row stride. Passed by value, so the blocks may copy their first
/// weight stage before the dependency wait, as a single matrix's launch does.
struct Q8MultiOut {
  static constexpr int kMax = 4;
  const void* w[kMax] = {};
  float* y[kMax] = {};
  int64_t rows[kMax] = {};
  int64_t ldy[kMax] = {};
  int64_t block0[kMax + 1] = {};
  int n = 0;
};

/// This block's share of pf (L2Prefetch): region r = blockIdx / parts of the n regions, its piece
/// blockIdx % parts (parts = gridDim / n, at least 1), one prefetch per 128-byte line by the
/// block's NTH threads; blocks past the last region's pieces issue none. Jobs' pointers are read
/// after the launch's dependency wait (the caller's order). No memory is written.
template <int NTH>
__device__ __forceinline__ void issue_l2_prefetch(const L2Prefetch& pf) {
  const int n = pf.jobs ? pf.n_jobs : pf.n;
  if (pf.mode == 0 || n <= 0) return;
  const unsigned parts = max(1u, gridDim.x / unsigned(n)), r = blockIdx.x / parts, k = blockIdx.x % parts;
  if (r >= unsigned(n)) return;
  const char* base;
  size_t bytes;
  if (pf.jobs) {
    base = static_cast<const char*>(pf.jobs[r].w);
    bytes = pf.job_bytes;
  } else {  // (selects, not an index: an indexed parameter array would be copied to local memory)
    base = nullptr, bytes = 0;
#pragma unroll
    for (int i = 0; i < L2Prefetch::kMax; ++i)
      if (unsigned(i) == r) base = static_cast<const char*>(pf.p[i]), bytes = pf.bytes[i];
  }
  if (!base) return;
  const size_t piece = ((bytes + parts - 1) / parts + 127) / 128 * 128, lo = size_t(k) * piece;
  const size_t hi = min(bytes, lo + piece);
  for (size_t off = lo + 128 * size_t(threadIdx.x); off < hi; off += 128 * size_t(NTH)) {
    const char* a = base + off;
    if (pf.mode == 2)
      asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(a));
    else
      asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
  }
}

// Blocks per SM the register budget must allow: a MoE decode step's 2048 one-warp down blocks
// (16 a SM on 132 SMs) and its 768 4-warp gate/up blocks (6 a SM) in one wave.
template <bool DUAL, int R, int KB, int WARPS, bool MULTI = false, bool X1 = false>
__global__ void __launch_bounds__(WARPS * 32, WARPS == 1 ? 16 : 6)
    mv2_q8_kernel(const GroupedMatmulJob* __restrict__ jobs, int n_jobs, GroupedMatmulJob one, size_t row_bytes,
                  int64_t rows_all, int cols, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                  float* __restrict__ y_all, int64_t ldy_all, Q8MultiOut multi, Q8X1Src x1, L2Prefetch pf) {
  constexpr int NW = DUAL ? 2 : 1, NS = NW * R;
  constexpr int NP = KB / 2;                               // block pairs per stream and stage
  constexpr int NTASK = NS * NP, TPL = (NTASK + 31) / 32;  // (stream, pair) tasks: per warp, per lane
  constexpr bool SAMEP = NP == 32;                         // task j of lane l: stream j, pair l
  constexpr bool PREF = SAMEP || TPL <= 3;                 // token 0's codes prefetched into registers
  constexpr int XS = SAMEP ? 1 : TPL;                      // distinct pairs of a lane
  constexpr int RS = 2 * KB + 4;                           // result words per stream
  static_assert(KB % 8 == 0 && KB <= 64, "a stage of KB blocks is a multiple of 16 bytes");
  static_assert(R * WARPS == kWRowsBlock, "the plans number blocks of kWRowsBlock rows");
  static_assert(NS <= 32, "one fold lane per stream");
  // As mv16_q8_kernel: one model weight matrix (jobs == nullptr) may copy its first stage before
  // waiting for the kernel before it; a grouped launch waits first (its job table is that
  // kernel's output). Every other global access comes after the wait.
  const bool early = jobs == nullptr;
  if (!early) detail::grid_dependency_enter();
  extern __shared__ __align__(16) uint8_t smem_v2[];
  const int64_t b = blockIdx.x;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  int64_t rows = rows_all, ldy = ldy_all;
  float* __restrict__ y = y_all;
  GroupedMatmulJob mj = one;
  if constexpr (MULTI) {  // the matrix of block b (block-uniform)
    int i = 0;
#pragma unroll
    for (int k = 1; k < Q8MultiOut::kMax; ++k) i += k < multi.n && b >= multi.block0[k];
    mj.w = multi.w[i], mj.block0 = multi.block0[i];
    rows = multi.rows[i], y = multi.y[i], ldy = multi.ldy[i];
  }
  const GroupedMatmulJob& jb = jobs ? jobs[find_job_warp(jobs, n_jobs, b, lane)] : mj;
  const detail::JobTile t = job_tile<kWRowsBlock, kVTok>(jb, b, rows);
  const int64_t r0 = t.r0 + int64_t(warp) * R;
  // X1: the block's row quantized by every thread of the block (one barrier), so a warp without
  // rows leaves only after it has done its share; the tile's token count is block-uniform.
  const int64_t x1_bytes = X1 ? mv2_x1_bytes(cols) : 0;
  auto x1_quantize = [&] {
    mv2_quantize_row<WARPS * 32>(x1.x + t.t0 / x1.rep * x1.ldx, cols, smem_v2);
    __syncthreads();
  };
  if (t.nt <= 0 || r0 >= rows) {  // the whole warp (warps never wait for each other, but for X1's barrier)
    if (early) detail::grid_dependency_enter();
    issue_l2_prefetch<WARPS * 32>(pf);
    if (X1 && t.nt > 0) x1_quantize();
    return;
  }
  uint8_t* ws = smem_v2 + x1_bytes + warp * mv2_warp_bytes<DUAL, R, KB, X1>();
  float* res = reinterpret_cast<float*>(ws + NS * KB * 34);  // [NS][RS] (X1: none, the results over the weights)
  float* sacc = X1 ? res : res + NS * RS;                    // [NS][SA]
  constexpr int SA = X1 ? 1 : kVTok;                         // accumulators per stream
  const uint8_t* W0 = static_cast<const uint8_t*>(jb.w);
  const uint8_t* W1 = static_cast<const uint8_t*>(DUAL ? jb.w2 : jb.w);
  const int nt = X1 ? 1 : t.nt, nb = cols / 32;  // X1: the host guarantees one token per job
  const int8_t* xqt = X1 ? reinterpret_cast<const int8_t*>(smem_v2) : xq + t.t0 * cols;
  const float* xdt = X1 ? reinterpret_cast<const float*>(smem_v2 + cols) : xd + t.t0 * nb;
  const int frow = lane % R;  // fold lane = stream `lane`
  const bool folder = lane < NS && r0 + frow < rows;
  float acc = 0.0f;
  if (early && nb == 0) detail::grid_dependency_enter();  // (has_q8: nb >= 1)
  for (int b0 = 0; b0 < nb; b0 += KB) {
    const int nblk = min(KB, nb - b0);
    const bool last = b0 + KB >= nb;
    const int chunks = (nblk * 34 + 15) / 16;  // within the row: row_bytes and b0 * 34 are multiples of 16
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      if (r0 + s % R >= rows) continue;
      const uint8_t* src = (s < R ? W0 : W1) + (r0 + s % R) * int64_t(row_bytes) + int64_t(b0) * 34;
      for (int c = lane; c < chunks; c += 32) cp_async<16>(ws + s * (KB * 34) + c * 16, src + c * 16, 16);
    }
    cp_commit();
    if (early && b0 == 0) detail::grid_dependency_enter();  // the weights are in flight; x and y after this
    if (b0 == 0) issue_l2_prefetch<WARPS * 32>(pf);         // the next kernel's weights, behind this one's
    if (X1 && b0 == 0) x1_quantize();
    // this lane's tasks: j -> flattened task lane + 32 j = (stream, pair); all compile-time divisions
    int tP[TPL];
    bool tact[TPL], ttwo[TPL];
#pragma unroll
    for (int j = 0; j < TPL; ++j) {
      const int i = lane + 32 * j;
      tP[j] = i % NP;
      tact[j] = i < NTASK && 2 * tP[j] < nblk;
      ttwo[j] = i < NTASK && 2 * tP[j] + 1 < nblk;
    }
    // token 0's codes and scales while the copies are in flight
    uint4 xf[XS][4];
    float xdf[XS][2];
#pragma unroll
    for (int u = 0; u < XS; ++u) {
#pragma unroll
      for (int k = 0; k < 4; ++k) xf[u][k] = make_uint4(0, 0, 0, 0);
      xdf[u][0] = xdf[u][1] = 0.0f;
      if (PREF && tact[u]) {
        const uint4* xp = reinterpret_cast<const uint4*>(xqt + int64_t(b0 + 2 * tP[u]) * 32);
        xf[u][0] = xp[0], xf[u][1] = xp[1];
        xdf[u][0] = xdt[b0 + 2 * tP[u]];
        if (ttwo[u]) xf[u][2] = xp[2], xf[u][3] = xp[3], xdf[u][1] = xdt[b0 + 2 * tP[u] + 1];
      }
    }
    cp_wait<0>();
    __syncwarp();
    for (int tk = 0; tk < nt; ++tk) {
      if (PREF && tk > 0) {  // token tk's codes and scales of this lane's pairs
#pragma unroll
        for (int u = 0; u < XS; ++u)
          if (tact[u]) {
            const int c0 = b0 + 2 * tP[u];
            const uint4* xp = reinterpret_cast<const uint4*>(xqt + int64_t(tk) * cols + int64_t(c0) * 32);
            xf[u][0] = xp[0], xf[u][1] = xp[1];
            xdf[u][0] = xdt[int64_t(tk) * nb + c0];
            if (ttwo[u]) xf[u][2] = xp[2], xf[u][3] = xp[3], xdf[u][1] = xdt[int64_t(tk) * nb + c0 + 1];
          }
      }
#pragma unroll
      for (int j = 0; j < TPL; ++j) {
        if (!tact[j]) continue;
        const int i = lane + 32 * j, s = i / NP, P = tP[j];
        const int u = SAMEP ? 0 : j;
        if (!PREF) {  // u == j: this task's codes and scales of token tk
          const int c0 = b0 + 2 * P;
          const uint4* xp = reinterpret_cast<const uint4*>(xqt + int64_t(tk) * cols + int64_t(c0) * 32);
          xf[u][0] = xp[0], xf[u][1] = xp[1];
          xdf[u][0] = xdt[int64_t(tk) * nb + c0];
          if (ttwo[j]) xf[u][2] = xp[2], xf[u][3] = xp[3], xdf[u][1] = xdt[int64_t(tk) * nb + c0 + 1];
        }
        uint32_t q[16];
        float d0, d1;
        load_pair<true>(ws + 68 * i, ttwo[j], q, d0, d1);  // s * KB * 34 + 68 P
        const uint32_t xa[16] = {xf[u][0].x, xf[u][0].y, xf[u][0].z, xf[u][0].w, xf[u][1].x, xf[u][1].y,
                                 xf[u][1].z, xf[u][1].w, xf[u][2].x, xf[u][2].y, xf[u][2].z, xf[u][2].w,
                                 xf[u][3].x, xf[u][3].y, xf[u][3].z, xf[u][3].w};
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) s0 = __dp4a(int(q[k]), int(xa[k]), s0);
#pragma unroll
        for (int k = 0; k < 8; ++k) s1 = __dp4a(int(q[8 + k]), int(xa[8 + k]), s1);
        // fold()'s operands: float(S) exactly, dw * dx rounded on its own (a missing second
        // block: S = 0, dw = dx = 0, never folded)
        const float4 r4 =
            make_float4(small_int_float(s0), __fmul_rn(d0, xdf[u][0]), small_int_float(s1), __fmul_rn(d1, xdf[u][1]));
        if constexpr (X1) {  // over this task's own weight bytes (loaded above), word 4 (s % 4) of them
          float* rp = reinterpret_cast<float*>(ws + 68 * i) + 4 * (s % 4);
          rp[0] = r4.x, rp[1] = r4.y, rp[2] = r4.z, rp[3] = r4.w;
        } else {
          *reinterpret_cast<float4*>(res + s * RS + 4 * P) = r4;
        }
      }
      __syncwarp();
      if (folder) {
        float a = b0 == 0 ? 0.0f : sacc[lane * SA + tk];
        const int np2 = nblk / 2;
        if constexpr (X1) {  // pair k of stream `lane`: task lane * NP + k
          const float* rp = reinterpret_cast<const float*>(ws + 68 * (lane * NP)) + 4 * (lane % 4);
#pragma unroll 4
          for (int k = 0; k < np2; ++k) {
            const float* v = rp + 17 * k;
            a = __fmaf_rn(v[0], v[1], a);
            a = __fmaf_rn(v[2], v[3], a);
          }
          if (nblk & 1) a = __fmaf_rn(rp[17 * np2], rp[17 * np2 + 1], a);
        } else {
          const float4* rp = reinterpret_cast<const float4*>(res + lane * RS);
#pragma unroll 4
          for (int k = 0; k < np2; ++k) {
            const float4 v = rp[k];
            a = __fmaf_rn(v.x, v.y, a);
            a = __fmaf_rn(v.z, v.w, a);
          }
          if (nblk & 1) {
            const float2 v = *reinterpret_cast<const float2*>(res + lane * RS + 4 * np2);
            a = __fmaf_rn(v.x, v.y, a);
          }
        }
        if (!last) sacc[lane * SA + tk] = a;
        acc = a;
      }
      if (last) {  // warp-uniform
        float o = acc;
        if constexpr (DUAL) {
          const float u = __shfl_down_sync(0xffffffffu, acc, R);  // lane s < R: stream s + R (the up row)
          o = silu_mul(o, u);
        }
        if (folder && lane < R) y[(t.t0 + tk) * ldy + r0 + frow] = o;
      }
      __syncwarp();  // the fold has read the results before the next token's (and stage's) writes
    }
  }
}

// ---- host side ----

/// The dynamic shared memory the kernels need is above 48 KiB: opt in once per device.
void ensure_smem_attrs() {
  static std::mutex mu;
  static std::vector<bool> done;
  int dev = 0;
  STRATA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (size_t(dev) < done.size() && done[size_t(dev)]) return;
  STRATA_CUDA_CHECK(cudaFuncSetAttribute(gemm_q8_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kGStages * gemm_stage_bytes<false>()));
  STRATA_CUDA_CHECK(cudaFuncSetAttribute(gemm_q8_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kGStages * gemm_stage_bytes<true>()));
  STRATA_CUDA_CHECK(cudaFuncSetAttribute(mv_q8_kernel<false, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         mv_smem_bytes<false>()));
  STRATA_CUDA_CHECK(cudaFuncSetAttribute(mv_q8_kernel<false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         mv_smem_bytes<false>()));
  STRATA_CUDA_CHECK(cudaFuncSetAttribute(mv_q8_kernel<true, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         mv_smem_bytes<true>()));
  STRATA_CUDA_CHECK(cudaFuncSetAttribute(mv_q8_kernel<true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         mv_smem_bytes<true>()));
  // the small-matrix variants stay under the 48 KiB default (4 rows: 9 / 18 KiB), and so do the
  // v2 ones (mv2_q8_kernel: 8.3 / 16.5 KiB a one-warp block, 21.4 / 42.75 KiB a 4-warp one).
  // The X1 instances prefer the largest shared-memory carveout, so that six 37 KiB DUAL blocks
  // fit an SM.
  for (const void* k : {reinterpret_cast<const void*>(mv2_q8_kernel<true, 8, 24, 1, false, true>),
                        reinterpret_cast<const void*>(mv2_q8_kernel<true, 2, 64, 4, false, true>),
                        reinterpret_cast<const void*>(mv2_q8_kernel<false, 8, 24, 1, false, true>),
                        reinterpret_cast<const void*>(mv2_q8_kernel<false, 2, 64, 4, false, true>),
                        reinterpret_cast<const void*>(mv2_q8_kernel<false, 8, 24, 1, true, true>),
                        reinterpret_cast<const void*>(mv2_q8_kernel<false, 2, 64, 4, true, true>)})
    STRATA_CUDA_CHECK(
        cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, int(cudaSharedmemCarveoutMaxShared)));
  if (done.size() <= size_t(dev)) done.resize(size_t(dev) + 1, false);
  done[size_t(dev)] = true;
}

/// The GEMM's cp.async reads 8-byte pieces of the weight rows.
bool gemm_aligned(const void* w, size_t row_bytes) {
  return reinterpret_cast<uintptr_t>(w) % 8 == 0 && row_bytes % 8 == 0;
}
bool a4(const void* w, size_t row_bytes) { return reinterpret_cast<uintptr_t>(w) % 4 == 0 && row_bytes % 4 == 0; }
bool a16(const void* w, size_t row_bytes) { return reinterpret_cast<uintptr_t>(w) % 16 == 0 && row_bytes % 16 == 0; }

void check_q8_common(const char* fn, GgmlType type, size_t row_bytes, int64_t rows, int64_t cols, const int8_t* xq,
                     const float* xd, int64_t ldy) {
  STRATA_CUDA_REQUIRE(has_q8(type, cols), std::string(fn) + ": the q8 path does not take " + ggml_type_name(type) +
                                              " with cols=" + std::to_string(cols));
  STRATA_CUDA_REQUIRE(cols <= (int64_t(1) << 30) && rows > 0 && rows <= (int64_t(1) << 31),
                      std::string(fn) + ": bad shape rows=" + std::to_string(rows) + " cols=" + std::to_string(cols));
  STRATA_CUDA_REQUIRE(row_bytes >= size_t(cols / 32) * 34 && row_bytes % 2 == 0,
                      std::string(fn) + ": row_bytes=" + std::to_string(row_bytes) +
                          " is odd or below the Q8_0 row size " + std::to_string(size_t(cols / 32) * 34));
  STRATA_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(xq) % 16 == 0 && reinterpret_cast<uintptr_t>(xd) % 4 == 0,
                      std::string(fn) + ": the codes must be 16-byte aligned and the scales 4-byte aligned");
  STRATA_CUDA_REQUIRE(ldy >= rows,
                      std::string(fn) + ": ldy=" + std::to_string(ldy) + " < rows=" + std::to_string(rows));
}

int parse_l2_prefetch(const char* v) { return v && v[0] && !v[1] && (v[0] == '1' || v[0] == '2') ? v[0] - '0' : 0; }
/// Whether the 16-byte mat-vec runs as mv2_q8_kernel (default) or as mv16_q8_kernel:
/// STRATA_CUDA_MV16_V2=0 picks mv16, detail::set_mv16_v2 overrides (tests).
detail::EnvSwitch g_mv16_v2{"STRATA_CUDA_MV16_V2", detail::off_if_zero};
/// Whether the one-token launches quantize their fp32 activations in the mat-vec (X1):
/// STRATA_CUDA_Q8_X1=0 keeps the quantizer launch, detail::set_q8_x1 overrides.
detail::EnvSwitch g_q8_x1{"STRATA_CUDA_Q8_X1", detail::off_if_zero};
/// The L2 prefetch mode of the X1 launches: STRATA_CUDA_L2_PREFETCH (0 unless 1 or 2),
/// detail::set_l2_prefetch overrides.
detail::EnvSwitch g_l2_prefetch{"STRATA_CUDA_L2_PREFETCH", parse_l2_prefetch};
bool mv16_v2_enabled() { return g_mv16_v2.get() != 0; }
bool q8_x1_enabled() { return g_q8_x1.get() != 0 && mv16_v2_enabled(); }
/// STRATA_CUDA_MV2_SMALL=0: rows of at most kV2SmallMaxBlocks blocks take the 4-warp instance too
/// (both instances give the same bits; for before / after measurements of the one-warp one).
detail::EnvSwitch g_mv2_small{"STRATA_CUDA_MV2_SMALL", detail::off_if_zero};
int l2_prefetch_mode() { return g_l2_prefetch.get(); }

/// Launches mv2_q8_kernel<DUAL, ..., MULTI, X1>: the one-warp instance (R = 8, KB = 24) for
/// rows of at most kV2SmallMaxBlocks Q8_0 blocks, else the 4-warp one (R = 2, KB = 64); X1's
/// blocks hold the quantized row in front of their warps' shared memory.
template <bool DUAL, bool MULTI, bool X1>
void launch_v2(unsigned grid, const GroupedMatmulJob* jobs, int n_jobs, const GroupedMatmulJob& one, size_t row_bytes,
               int64_t rows, int cols, const int8_t* xq, const float* xd, float* y, int64_t ldy,
               const Q8MultiOut& multi, const Q8X1Src& x1, cudaStream_t st, const L2Prefetch* pf = nullptr) {
  ensure_smem_attrs();
  const size_t xb = X1 ? size_t(mv2_x1_bytes(cols)) : 0;
  L2Prefetch p = pf ? *pf : L2Prefetch{};
  p.mode = pf ? l2_prefetch_mode() : 0;
  if (cols / 32 <= kV2SmallMaxBlocks && g_mv2_small.get())
    detail::launch(mv2_q8_kernel<DUAL, 8, 24, 1, MULTI, X1>, grid, 32, xb + mv2_warp_bytes<DUAL, 8, 24, X1>(), st, jobs,
                   n_jobs, one, row_bytes, rows, cols, xq, xd, y, ldy, multi, x1, p);
  else
    detail::launch(mv2_q8_kernel<DUAL, 2, 64, 4, MULTI, X1>, grid, 4 * 32, xb + 4 * mv2_warp_bytes<DUAL, 2, 64, X1>(),
                   st, jobs, n_jobs, one, row_bytes, rows, cols, xq, xd, y, ldy, multi, x1, p);
  STRATA_CUDA_CHECK_LAUNCH();
}

/// Fills m with the n (1 ..= kMax) parts of a matmul_q8_multi launch, each part's blocks one token
/// tile of kWRowsBlock rows after the previous part's; returns the launch's blocks (CudaError
/// above 2^31 - 1, naming fn).
int64_t fill_multi(const MatmulQ8Part* parts, int n, Q8MultiOut& m, const char* fn) {
  m.n = n;
  int64_t blocks = 0;
  for (int i = 0; i < n; ++i) {
    m.w[i] = parts[i].w, m.y[i] = parts[i].y, m.rows[i] = parts[i].rows, m.ldy[i] = parts[i].ldy;
    m.block0[i] = blocks;
    blocks += (parts[i].rows + kWRowsBlock - 1) / kWRowsBlock;
  }
  m.block0[n] = blocks;
  STRATA_CUDA_REQUIRE(blocks <= INT32_MAX, std::string(fn) + ": too many blocks");
  return blocks;
}

/// The common checks of the X1 entry points.
void check_x1(const char* fn, GgmlType type, size_t row_bytes, int64_t rows, int64_t cols, const float* x, int64_t ldx,
              int64_t ldy) {
  STRATA_CUDA_REQUIRE(has_q8(type, cols) && cols <= kX1MaxCols,
                      std::string(fn) + ": takes Q8_0 with cols a multiple of 32 up to " + std::to_string(kX1MaxCols) +
                          ", not " + ggml_type_name(type) + " with cols=" + std::to_string(cols));
  STRATA_CUDA_REQUIRE(rows > 0 && rows <= (int64_t(1) << 31) && row_bytes >= size_t(cols / 32) * 34 &&
                          row_bytes % 16 == 0,
                      std::string(fn) + ": bad shape rows=" + std::to_string(rows) +
                          " or row_bytes=" + std::to_string(row_bytes) + " (a multiple of 16 of at least the Q8_0 row)");
  STRATA_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(x) % 16 == 0 && ldx % 4 == 0 && ldx >= cols,
                      std::string(fn) + ": x must be 16-byte aligned with ldx a multiple of 4 and >= cols");
  STRATA_CUDA_REQUIRE(ldy >= rows,
                      std::string(fn) + ": ldy=" + std::to_string(ldy) + " < rows=" + std::to_string(rows));
  STRATA_CUDA_REQUIRE(q8_x1_enabled() && mv_rows_per_block(1, true) == kWRowsBlock,
                      std::string(fn) + ": the X1 mat-vec is turned off (see q8_x1_takes)");
}

/// Launches the kernel for `rb` rows per block (mv_rows_per_block) or the GEMM.
template <bool DUAL>
void launch_q8(bool gemm, bool al4, int rb, unsigned grid, const GroupedMatmulJob* jobs, int n_jobs,
               const GroupedMatmulJob& one, size_t row_bytes, int64_t rows, int cols, const int8_t* xq, const float* xd,
               float* y, int64_t ldy, cudaStream_t st, const int64_t* yrows = nullptr) {
  ensure_smem_attrs();
  if (gemm)
    detail::launch(gemm_q8_kernel<DUAL>, grid, DUAL ? 2 * kGThreads : kGThreads, kGStages * gemm_stage_bytes<DUAL>(),
                   st, jobs, n_jobs, one, row_bytes, rows, cols, xq, xd, y, ldy, yrows);
  else if (rb == kWRowsBlock && mv16_v2_enabled())
    launch_v2<DUAL, false, false>(grid, jobs, n_jobs, one, row_bytes, rows, cols, xq, xd, y, ldy, Q8MultiOut{},
                                  Q8X1Src{}, st);
  else if (rb == kWRowsBlock)
    detail::launch(mv16_q8_kernel<DUAL>, grid, kWWarps * 32, mv16_smem_bytes<DUAL>(), st, jobs, n_jobs, one, row_bytes,
                   rows, cols, xq, xd, y, ldy);
  else if (rb == kVRowsSmall && al4)
    detail::launch(mv_q8_kernel<DUAL, true, kVRowsSmall, kVThreadsSmall>, grid, kVThreadsSmall,
                   mv_smem_bytes<DUAL, kVRowsSmall>(), st, jobs, n_jobs, one, row_bytes, rows, cols, xq, xd, y, ldy);
  else if (rb == kVRowsSmall)
    detail::launch(mv_q8_kernel<DUAL, false, kVRowsSmall, kVThreadsSmall>, grid, kVThreadsSmall,
                   mv_smem_bytes<DUAL, kVRowsSmall>(), st, jobs, n_jobs, one, row_bytes, rows, cols, xq, xd, y, ldy);
  else if (al4)
    detail::launch(mv_q8_kernel<DUAL, true>, grid, kVThreads, mv_smem_bytes<DUAL>(), st, jobs, n_jobs, one, row_bytes,
                   rows, cols, xq, xd, y, ldy);
  else
    detail::launch(mv_q8_kernel<DUAL, false>, grid, kVThreads, mv_smem_bytes<DUAL>(), st, jobs, n_jobs, one, row_bytes,
                   rows, cols, xq, xd, y, ldy);
  STRATA_CUDA_CHECK_LAUNCH();
}

}  // namespace

namespace detail {
void set_mv16_v2(int mode) { mode < 0 ? g_mv16_v2.clear() : g_mv16_v2.set(mode != 0); }
void set_q8_x1(int mode) { mode < 0 ? g_q8_x1.clear() : g_q8_x1.set(mode != 0); }
void set_l2_prefetch(int mode) { mode < 0 ? g_l2_prefetch.clear() : g_l2_prefetch.set(mode > 2 ? 1 : mode); }
}  // namespace detail

bool has_q8(GgmlType t, int64_t cols) { return t == GgmlType::Q8_0 && cols > 0 && cols % 32 == 0; }

void quantize_q8_rows(const float* x, int64_t ldx, int64_t cols, int64_t n_tok, const int64_t* map, int rep, int8_t* q,
                      float* d, void* stream) {
  STRATA_CUDA_REQUIRE(cols > 0 && cols % 32 == 0 && cols <= (int64_t(1) << 30),
                      "cuda::quantize_q8: cols=" + std::to_string(cols) + " is not a positive multiple of 32");
  STRATA_CUDA_REQUIRE(n_tok >= 0 && ldx >= cols && rep >= 1, "cuda::quantize_q8: n_tok < 0, ldx < cols or rep < 1");
  if (n_tok == 0) return;
  constexpr int kThreads = 256;  // 1024 columns per block
  const int64_t gx = (cols / 4 + kThreads - 1) / kThreads;
  const unsigned gy = unsigned(std::min<int64_t>(n_tok, 65535));
  const bool v4 = reinterpret_cast<uintptr_t>(x) % 16 == 0 && ldx % 4 == 0 && reinterpret_cast<uintptr_t>(q) % 4 == 0;
  const dim3 grid(unsigned(gx), gy);
  auto st = static_cast<cudaStream_t>(stream);
  if (v4)
    detail::launch(quantize_q8_kernel<true>, grid, kThreads, 0, st, x, ldx, int(cols), n_tok, map, q, d, rep);
  else
    detail::launch(quantize_q8_kernel<false>, grid, kThreads, 0, st, x, ldx, int(cols), n_tok, map, q, d, rep);
  STRATA_CUDA_CHECK_LAUNCH();
}

void quantize_q8(const float* x, int64_t ldx, int64_t cols, int64_t n_tok, int8_t* q, float* d, void* stream, int rep) {
  quantize_q8_rows(x, ldx, cols, n_tok, nullptr, rep, q, d, stream);
}

void matmul_q8(GgmlType type, const void* W, size_t row_bytes, int64_t rows, int64_t cols, const int8_t* xq,
               const float* xd, int64_t n_tok, float* y, int64_t ldy, void* stream, MatmulPath path) {
  check_q8_common("cuda::matmul_q8", type, row_bytes, rows, cols, xq, xd, ldy);
  STRATA_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(W) % 2 == 0, "cuda::matmul_q8: W must be 2-byte aligned");
  STRATA_CUDA_REQUIRE(n_tok >= 0, "cuda::matmul_q8: n_tok < 0");
  STRATA_CUDA_REQUIRE(path == MatmulPath::Auto || path == MatmulPath::MatVec || path == MatmulPath::Mma,
                      "cuda::matmul_q8: path must be Auto, MatVec or Mma");
  const bool can_gemm = gemm_aligned(W, row_bytes);
  STRATA_CUDA_REQUIRE(path != MatmulPath::Mma || can_gemm,
                      "cuda::matmul_q8: the GEMM needs W and row_bytes 8-byte aligned");
  if (n_tok == 0) return;
  const bool gemm = path == MatmulPath::Mma || (path == MatmulPath::Auto && can_gemm && n_tok > kVTok);
  const int rb = gemm ? kGRows : mv_rows_per_block(rows, a16(W, row_bytes)), tt = gemm ? kGTok : kVTok;
  GroupedMatmulJob one;
  one.w = W;
  one.row0 = 0;
  one.n_tok = n_tok;
  one.block0 = 0;
  const int64_t blocks = ((rows + rb - 1) / rb) * ((n_tok + tt - 1) / tt);
  STRATA_CUDA_REQUIRE(blocks <= INT32_MAX, "cuda::matmul_q8: too many blocks");
  launch_q8<false>(gemm, a4(W, row_bytes), rb, unsigned(blocks), nullptr, 1, one, row_bytes, rows, int(cols), xq, xd,
                   y, ldy, static_cast<cudaStream_t>(stream));
}

void matmul_q8_multi(GgmlType type, const MatmulQ8Part* parts, int n, size_t row_bytes, int64_t cols, const int8_t* xq,
                     const float* xd, int64_t n_tok, void* stream) {
  STRATA_CUDA_REQUIRE(n >= 1 && parts, "cuda::matmul_q8_multi: no matrices");
  STRATA_CUDA_REQUIRE(n_tok >= 0, "cuda::matmul_q8_multi: n_tok < 0");
  bool one_launch = n <= Q8MultiOut::kMax && n_tok >= 1 && n_tok <= kVTok && mv16_v2_enabled() &&
                    mv_rows_per_block(1, true) == kWRowsBlock;
  for (int i = 0; i < n; ++i) {
    check_q8_common("cuda::matmul_q8_multi", type, row_bytes, parts[i].rows, cols, xq, xd, parts[i].ldy);
    STRATA_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(parts[i].w) % 2 == 0,
                        "cuda::matmul_q8_multi: W must be 2-byte aligned");
    one_launch = one_launch && a16(parts[i].w, row_bytes);
  }
  if (n_tok == 0) return;
  if (!one_launch) {  // the separate launches (the same kernels per matrix: the same bits)
    for (int i = 0; i < n; ++i)
      matmul_q8(type, parts[i].w, row_bytes, parts[i].rows, cols, xq, xd, n_tok, parts[i].y, parts[i].ldy, stream);
    return;
  }
  Q8MultiOut m;
  const int64_t blocks = fill_multi(parts, n, m, "cuda::matmul_q8_multi");  // one token tile (n_tok <= kVTok)
  GroupedMatmulJob one;
  one.row0 = 0, one.n_tok = n_tok, one.block0 = 0;
  launch_v2<false, true, false>(unsigned(blocks), nullptr, 1, one, row_bytes, 0, int(cols), xq, xd, nullptr, 0, m,
                                Q8X1Src{}, static_cast<cudaStream_t>(stream));
}

GroupedMatmulPlan plan_grouped_q8_bound(int n_jobs, int64_t n_tok, int64_t rows, bool gemm, bool words, bool vec16,
                                        int64_t& row_blocks) {
  STRATA_CUDA_REQUIRE(n_jobs >= 1 && n_tok >= 0 && rows > 0, "cuda::plan_grouped_q8_bound: bad shape");
  GroupedMatmulPlan p;
  p.tile_tokens = gemm ? kGTok : kVTok;
  p.words = gemm || words || vec16;  // 8- and 16-byte aligned rows are 4-byte aligned
  p.vec16 = vec16;
  const int64_t rb = gemm ? kGRows : mv_rows_per_block(rows, vec16);
  row_blocks = (rows + rb - 1) / rb;
  p.blocks = row_blocks * ((n_tok + p.tile_tokens - 1) / p.tile_tokens + n_jobs);
  STRATA_CUDA_REQUIRE(p.blocks >= 1 && p.blocks <= int64_t(INT32_MAX), "cuda::plan_grouped_q8_bound: too many blocks");
  return p;
}

GroupedMatmulPlan plan_grouped_q8(GroupedMatmulJob* jobs, int n_jobs, int64_t rows, int64_t cols, size_t row_bytes) {
  STRATA_CUDA_REQUIRE(n_jobs >= 1, "cuda::plan_grouped_q8: no jobs");
  STRATA_CUDA_REQUIRE(rows > 0 && cols > 0, "cuda::plan_grouped_q8: rows or cols <= 0");
  int64_t max_n = 0;
  bool aligned = row_bytes % 8 == 0;
  for (int i = 0; i < n_jobs; ++i) {
    STRATA_CUDA_REQUIRE(jobs[i].n_tok >= 1, "cuda::plan_grouped_q8: job " + std::to_string(i) + " has no tokens");
    max_n = std::max(max_n, jobs[i].n_tok);
    aligned = aligned && gemm_aligned(jobs[i].w, row_bytes) && (!jobs[i].w2 || gemm_aligned(jobs[i].w2, row_bytes));
  }
  GroupedMatmulPlan p;
  p.tile_tokens = aligned && max_n > kVTok ? kGTok : kVTok;
  p.one_token = max_n == 1;
  p.words = row_bytes % 4 == 0;
  p.vec16 = row_bytes % 16 == 0;
  for (int i = 0; i < n_jobs; ++i) {
    p.words = p.words && a4(jobs[i].w, row_bytes) && (!jobs[i].w2 || a4(jobs[i].w2, row_bytes));
    p.vec16 = p.vec16 && a16(jobs[i].w, row_bytes) && (!jobs[i].w2 || a16(jobs[i].w2, row_bytes));
  }
  const int64_t rb = p.tile_tokens == kGTok ? kGRows : mv_rows_per_block(rows, p.vec16);
  p.blocks = detail::assign_job_blocks(jobs, n_jobs, (rows + rb - 1) / rb, p.tile_tokens);
  STRATA_CUDA_REQUIRE(p.blocks <= int64_t(INT32_MAX), "cuda::plan_grouped_q8: too many blocks");
  return p;
}

void grouped_matmul_q8(const GroupedMatmulPlan& plan, GgmlType type, const GroupedMatmulJob* jobs, int n_jobs,
                       size_t row_bytes, int64_t rows, int64_t cols, const int8_t* xq, const float* xd, float* y,
                       int64_t ldy, bool swiglu_pair, void* stream, const int64_t* y_rows) {
  check_q8_common("cuda::grouped_matmul_q8", type, row_bytes, rows, cols, xq, xd, ldy);
  STRATA_CUDA_REQUIRE(n_jobs >= 1 && plan.blocks >= 1 && plan.blocks <= INT32_MAX &&
                          (plan.tile_tokens == kVTok || plan.tile_tokens == kGTok),
                      "cuda::grouped_matmul_q8: bad plan (use plan_grouped_q8)");
  const bool gemm = plan.tile_tokens == kGTok;
  STRATA_CUDA_REQUIRE(!y_rows || gemm, "cuda::grouped_matmul_q8: y_rows needs the GEMM plan (tile 64)");
  const bool al4 = plan.words;  // the plan saw the (host) table's pointers
  GroupedMatmulJob one;
  auto st = static_cast<cudaStream_t>(stream);
  const int rb = gemm ? kGRows : mv_rows_per_block(rows, plan.vec16);
  if (swiglu_pair)
    launch_q8<true>(gemm, al4, rb, unsigned(plan.blocks), jobs, n_jobs, one, row_bytes, rows, int(cols), xq, xd, y, ldy,
                    st, y_rows);
  else
    launch_q8<false>(gemm, al4, rb, unsigned(plan.blocks), jobs, n_jobs, one, row_bytes, rows, int(cols), xq, xd, y,
                     ldy, st, y_rows);
}

bool q8_x1_takes(GgmlType type, size_t row_bytes, int64_t cols, const float* x, int64_t ldx) {
  return q8_x1_enabled() && has_q8(type, cols) && cols <= kX1MaxCols && row_bytes % 16 == 0 &&
         row_bytes >= size_t(cols / 32) * 34 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && ldx % 4 == 0 &&
         ldx >= cols && mv_rows_per_block(1, true) == kWRowsBlock;
}

void matmul_q8_x1(GgmlType type, const void* W, size_t row_bytes, int64_t rows, int64_t cols, const float* x, float* y,
                  int64_t ldy, void* stream) {
  check_x1("cuda::matmul_q8_x1", type, row_bytes, rows, cols, x, cols, ldy);
  STRATA_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(W) % 16 == 0, "cuda::matmul_q8_x1: W must be 16-byte aligned");
  GroupedMatmulJob one;
  one.w = W, one.row0 = 0, one.n_tok = 1, one.block0 = 0;
  const int64_t blocks = (rows + kWRowsBlock - 1) / kWRowsBlock;
  STRATA_CUDA_REQUIRE(blocks <= INT32_MAX, "cuda::matmul_q8_x1: too many blocks");
  launch_v2<false, false, true>(unsigned(blocks), nullptr, 1, one, row_bytes, rows, int(cols), nullptr, nullptr, y, ldy,
                                Q8MultiOut{}, Q8X1Src{x, cols, 1}, static_cast<cudaStream_t>(stream));
}

void matmul_q8_multi_x1(GgmlType type, const MatmulQ8Part* parts, int n, size_t row_bytes, int64_t cols, const float* x,
                        void* stream, const L2Prefetch* pf) {
  STRATA_CUDA_REQUIRE(n >= 1 && n <= Q8MultiOut::kMax && parts,
                      "cuda::matmul_q8_multi_x1: 1 to " + std::to_string(Q8MultiOut::kMax) + " matrices");
  for (int i = 0; i < n; ++i) {
    check_x1("cuda::matmul_q8_multi_x1", type, row_bytes, parts[i].rows, cols, x, cols, parts[i].ldy);
    STRATA_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(parts[i].w) % 16 == 0,
                        "cuda::matmul_q8_multi_x1: W must be 16-byte aligned");
  }
  Q8MultiOut m;
  const int64_t blocks = fill_multi(parts, n, m, "cuda::matmul_q8_multi_x1");
  GroupedMatmulJob one;
  one.row0 = 0, one.n_tok = 1, one.block0 = 0;
  launch_v2<false, true, true>(unsigned(blocks), nullptr, 1, one, row_bytes, 0, int(cols), nullptr, nullptr, nullptr, 0,
                               m, Q8X1Src{x, cols, 1}, static_cast<cudaStream_t>(stream), pf);
}

void grouped_matmul_q8_x1(const GroupedMatmulPlan& plan, GgmlType type, const GroupedMatmulJob* jobs, int n_jobs,
                          size_t row_bytes, int64_t rows, int64_t cols, const float* x, int64_t ldx, int rep, float* y,
                          int64_t ldy, bool swiglu_pair, void* stream, const L2Prefetch* pf) {
  check_x1("cuda::grouped_matmul_q8_x1", type, row_bytes, rows, cols, x, ldx, ldy);
  STRATA_CUDA_REQUIRE(n_jobs >= 1 && plan.blocks >= 1 && plan.blocks <= INT32_MAX && plan.tile_tokens == kVTok &&
                          plan.vec16 && plan.one_token && rep >= 1,
                      "cuda::grouped_matmul_q8_x1: needs a mat-vec plan of 16-byte rows and one token per job "
                      "(plan_grouped_q8 with n_tok 1 each) and rep >= 1");
  GroupedMatmulJob one;
  auto st = static_cast<cudaStream_t>(stream);
  if (swiglu_pair)
    launch_v2<true, false, true>(unsigned(plan.blocks), jobs, n_jobs, one, row_bytes, rows, int(cols), nullptr, nullptr,
                                 y, ldy, Q8MultiOut{}, Q8X1Src{x, ldx, rep}, st, pf);
  else
    launch_v2<false, false, true>(unsigned(plan.blocks), jobs, n_jobs, one, row_bytes, rows, int(cols), nullptr,
                                  nullptr, y, ldy, Q8MultiOut{}, Q8X1Src{x, ldx, rep}, st, pf);
}

}  // namespace strata::cuda
