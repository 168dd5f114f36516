// Quantized matmul (mat-vec and tiled paths) and embedding lookup over weights in their GGUF
// block formats. Contract, arithmetic and error bound: kernels.h. Block layouts: the reference
// dequantizer src/quant/dequant_ref.cpp; each decoder below performs the same fp32 operations in
// the same order (spelled with __fmul_rn / __fadd_rn / __fsub_rn so nvcc cannot contract them
// into FMAs), so a weight expands to exactly the bits quant::dequantize_row gives.
#include <cuda_fp16.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
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
      if constexpr (T == G::Q4_0) w[j] = __fmul_rn(d, float(q[j] - 8));
      else w[j] = __fmul_rn(d, float(g_kvalues_iq4nl[q[j]]));
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
      if constexpr (T == G::Q5_0) w[j] = __fmul_rn(d, float(u - 16));
      else w[j] = __fadd_rn(__fmul_rn(d, float(u)), ldh(b + 2));
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

constexpr int kWarpsPerBlock = 8;  // rows per block (one warp each)
constexpr int kTileTokens = 8;     // tokens per warp on the tiled path

/// One warp per row r and NT consecutive tokens from blockIdx.y * NT. Lane l owns columns
/// [256i + 8l, 256i + 8l + 8); per token one FMA chain in column order; butterfly at the end.
template <GgmlType T, int NT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    mm_kernel(const uint8_t* __restrict__ W, size_t row_bytes, int64_t rows, int cols, const float* __restrict__ x,
              int64_t ldx, int64_t n_tok, int64_t tok_base, float* __restrict__ y, int64_t ldy) {
  const int lane = threadIdx.x & 31;
  const int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (r >= rows) return;
  const int64_t t0 = tok_base + int64_t(blockIdx.y) * NT;
  const int64_t left = n_tok - t0;
  const int nt = left < NT ? int(left) : NT;
  const uint8_t* row = W + r * int64_t(row_bytes);
  const float* xt = x + t0 * ldx;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  for (int c = 8 * lane; c < cols; c += 256) {
    float w[8];
    decode8<T>(row, c, w);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < nt) {
        const float4 a = *reinterpret_cast<const float4*>(xt + t * ldx + c);
        const float4 bq = *reinterpret_cast<const float4*>(xt + t * ldx + c + 4);
        float s = acc[t];
        s = __fmaf_rn(w[0], a.x, s);
        s = __fmaf_rn(w[1], a.y, s);
        s = __fmaf_rn(w[2], a.z, s);
        s = __fmaf_rn(w[3], a.w, s);
        s = __fmaf_rn(w[4], bq.x, s);
        s = __fmaf_rn(w[5], bq.y, s);
        s = __fmaf_rn(w[6], bq.z, s);
        s = __fmaf_rn(w[7], bq.w, s);
        acc[t] = s;
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    float s = acc[t];
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off));
    if (lane == 0 && t < nt) y[(t0 + t) * ldy + r] = s;
  }
}

/// Embedding rows: thread i of row t decodes columns 8i..8i+7 of table row ids[t].
template <GgmlType T>
__global__ void get_rows_kernel(const uint8_t* __restrict__ table, size_t row_bytes, int cols,
                                const int32_t* __restrict__ ids, float* __restrict__ out, int64_t ldo) {
  const int c = 8 * int(blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= cols) return;
  const int64_t t = blockIdx.y;
  float w[8];
  decode8<T>(table + int64_t(ids[t]) * int64_t(row_bytes), c, w);
  float* o = out + t * ldo + c;
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = w[j];
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

#define STRATA_CUDA_FOR_EACH_TYPE(X)                                                                             \
  X(F32) X(F16) X(BF16) X(Q8_0) X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q2_K) X(Q3_K) X(Q4_K) X(Q5_K) X(Q6_K) X(IQ2_XS) \
      X(IQ3_S) X(IQ4_XS) X(IQ4_NL) X(MXFP4)

template <GgmlType T>
void launch_mm(const uint8_t* W, size_t row_bytes, int64_t rows, int cols, const float* x, int64_t ldx,
               int64_t n_tok, float* y, int64_t ldy, cudaStream_t st, bool tiled) {
  const dim3 block(kWarpsPerBlock * 32);
  const int64_t gx = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int nt = tiled ? kTileTokens : 1;
  constexpr int64_t kMaxGridY = 65535;
  for (int64_t base = 0; base < n_tok; base += kMaxGridY * nt) {
    const int64_t n_here = std::min<int64_t>(n_tok - base, kMaxGridY * nt);
    const dim3 grid(unsigned(gx), unsigned((n_here + nt - 1) / nt));
    if (tiled) {
      mm_kernel<T, kTileTokens><<<grid, block, 0, st>>>(W, row_bytes, rows, cols, x, ldx, base + n_here, base, y, ldy);
    } else {
      mm_kernel<T, 1><<<grid, block, 0, st>>>(W, row_bytes, rows, cols, x, ldx, base + n_here, base, y, ldy);
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
  STRATA_CUDA_REQUIRE(rows > 0 && rows <= int64_t(65535) * kWarpsPerBlock * 1024, "cuda::matmul: bad rows=" + std::to_string(rows));
  STRATA_CUDA_REQUIRE(n_tok >= 0, "cuda::matmul: n_tok < 0");
  STRATA_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(x) % 16 == 0 && ldx % 4 == 0 && ldx >= cols,
                      "cuda::matmul: x must be 16-byte aligned with ldx a multiple of 4 and >= cols (ldx=" +
                          std::to_string(ldx) + ")");
  STRATA_CUDA_REQUIRE(ldy >= rows, "cuda::matmul: ldy=" + std::to_string(ldy) + " < rows=" + std::to_string(rows));
  if (n_tok == 0) return;
  ensure_tables();
  const bool tiled = path == MatmulPath::Tiled || (path == MatmulPath::Auto && n_tok >= 4);
  const auto* w = static_cast<const uint8_t*>(W);
  auto st = static_cast<cudaStream_t>(stream);
  switch (type) {
#define X(name)                                                                                                  \
  case GgmlType::name:                                                                                           \
    launch_mm<GgmlType::name>(w, row_bytes, rows, int(cols), x, ldx, n_tok, y, ldy, st, tiled); \
    return;
    STRATA_CUDA_FOR_EACH_TYPE(X)
#undef X
    default: break;
  }
  STRATA_CUDA_REQUIRE(false, "cuda::matmul: unsupported weight type " + tname(type));
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
#define X(name)                                                                                   \
  case GgmlType::name:                                                                            \
    get_rows_kernel<GgmlType::name><<<grid, threads, 0, st>>>(tb, row_bytes, int(cols), ids, out, ldo); \
    STRATA_CUDA_CHECK_LAUNCH();                                                                   \
    return;
    STRATA_CUDA_FOR_EACH_TYPE(X)
#undef X
    default: break;
  }
  STRATA_CUDA_REQUIRE(false, "cuda::get_rows: unsupported type " + tname(type));
}

}  // namespace strata::cuda
