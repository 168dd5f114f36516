// Causal GQA attention on the tensor cores (mma.sync m16n8k16, bf16 pieces, fp32 accumulation),
// flash order, split-KV decode, and a prefill on K / V pieces split once per call
// (fa_split_kv_kernel + fa_prefill_kernel). Contract and numerics: kernels.h (AttentionPath::Mma).
#include <cuda_bf16.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/attention_mma.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/env_switch.h"
#include "backend/cuda/launch.cuh"

namespace strata::cuda::detail {

namespace {

constexpr int kFaWarps = 4;              // warps per block, 16 query rows each
constexpr int kFaRows = kAttnMmaRows;    // query rows per block
constexpr int kFaTile = 32;              // cache positions per tile
constexpr int kFaSeg = kAttnMmaSegment;  // cache positions per segment (fresh softmax state)
constexpr int kFaPieces = 3;             // x = hi + mid + lo, each bf16
static_assert(kFaSeg % kFaTile == 0, "a tile never crosses a segment boundary");

/// Two floats as a bf16 pair, a in the low half (round to nearest even).
__device__ __forceinline__ uint32_t fa_pack(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float fa_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

/// The three bf16 pieces of x (hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid); both
/// differences are exact in fp32), as floats.
__device__ __forceinline__ void fa_split(float x, float& h, float& m, float& l) {
  h = fa_bf16(x);
  const float r = __fsub_rn(x, h);
  m = fa_bf16(r);
  l = __fsub_rn(r, m);
}

/// Pieces of the pairs (a0, a1): p[0] = hi pair, p[1] = mid pair, p[2] = lo pair.
__device__ __forceinline__ void fa_split_pair(float a0, float a1, uint32_t p[3]) {
  float h0, m0, l0, h1, m1, l1;
  fa_split(a0, h0, m0, l0);
  fa_split(a1, h1, m1, l1);
  p[0] = fa_pack(h0, h1), p[1] = fa_pack(m0, m1), p[2] = fa_pack(l0, l1);
}

// Not volatile: the compiler may interleave independent mma chains.
__device__ __forceinline__ void fa_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// Four 16 x 8 outputs of one 16-long step, each the six piece products from 0, smallest first:
/// t[n] = sum over (i, j) in (2,0) (1,1) (0,2) (1,0) (0,1) (0,0) of a_i b_j, where a = A pieces
/// (a[i]: one A fragment) and b[u][j] = the B fragments (two 8-column tiles 2u, 2u+1: regs 0-1,
/// 2-3) of piece j; n = 2u + v. The dropped (1,2) (2,1) (2,2) are below 2^-24 of |a b|. The four
/// chains are independent (interleaved for the tensor pipe); each one's order is fixed.
__device__ __forceinline__ void fa_mma6x4(float t[4][4], const uint32_t a[3][4], const uint32_t b[2][3][4]) {
  constexpr int kI[6] = {2, 1, 0, 1, 0, 0}, kJ[6] = {0, 1, 2, 0, 1, 0};
#pragma unroll
  for (int n = 0; n < 4; ++n) t[n][0] = t[n][1] = t[n][2] = t[n][3] = 0.0f;
#pragma unroll
  for (int p = 0; p < 6; ++p)
#pragma unroll
    for (int n = 0; n < 4; ++n) fa_mma(t[n], a[kI[p]], b[n / 2][kJ[p]][2 * (n % 2)], b[n / 2][kJ[p]][2 * (n % 2) + 1]);
}

/// 4 floats of a row as the three pieces' 4-bf16 words, stored at dst[piece * piece_stride].
__device__ __forceinline__ void fa_stage4(const float4 v, __nv_bfloat16* dst, int piece_stride) {
  uint32_t p0[3], p1[3];
  fa_split_pair(v.x, v.y, p0);
  fa_split_pair(v.z, v.w, p1);
#pragma unroll
  for (int pc = 0; pc < kFaPieces; ++pc)
    *reinterpret_cast<uint2*>(dst + pc * piece_stride) = make_uint2(p0[pc], p1[pc]);
}

__host__ __device__ __forceinline__ int64_t fa_first_pos(int64_t P, int64_t window) {
  return window > 0 ? (P + 1 - window > 0 ? P + 1 - window : 0) : 0;
}

/// The segment fold (kernels.h): first: (M, L) = (m, l), O = o; else M' = max(M, m),
/// ca = e^(M - M'), cb = e^(m - M'), L = L ca + l cb, O = O ca + o cb. The one-pass kernel and
/// fa_combine call these same functions, so both give the same bits.
__device__ __forceinline__ void fa_fold_ml(bool first, float& M, float& L, float m, float l, float& ca, float& cb) {
  if (first) {
    M = m, L = l, ca = 0.0f, cb = 1.0f;
    return;
  }
  const float Mn = fmaxf(M, m);
  ca = expf(__fsub_rn(M, Mn)), cb = expf(__fsub_rn(m, Mn));
  L = __fadd_rn(__fmul_rn(L, ca), __fmul_rn(l, cb));
  M = Mn;
}
__device__ __forceinline__ float fa_fold_o(bool first, float O, float o, float ca, float cb) {
  return first ? o : __fadd_rn(__fmul_rn(O, ca), __fmul_rn(o, cb));
}
/// The sink (if any) after the last fold: M' = max(M, sink), cs = e^(M - M'),
/// L = L cs + e^(sink - M'); O is then multiplied by cs. Returns cs (1 without a sink).
__device__ __forceinline__ float fa_fold_sink(const float* sinks, int h, float M, float& L) {
  if (!sinks) return 1.0f;
  const float sk = sinks[h];
  const float Mn = fmaxf(M, sk);
  const float cs = expf(__fsub_rn(M, Mn));
  L = __fadd_rn(__fmul_rn(L, cs), expf(__fsub_rn(sk, Mn)));
  return cs;
}
__device__ __forceinline__ float fa_final(const float* sinks, float O, float cs, float L) {
  return __fdiv_rn(sinks ? __fmul_rn(O, cs) : O, L);
}

template <int HD>
struct FaShape {
  static constexpr int kLd = HD + 8;              // bf16 per shared row (conflict-free ldmatrix)
  static constexpr int kKvPiece = kFaTile * kLd;  // one piece of a K or V tile
  static constexpr int kQPiece = 16 * kLd;        // one piece of a warp's 16 query rows
  static constexpr int kQWarp = kFaPieces * kQPiece;
  static constexpr size_t kSmem = sizeof(__nv_bfloat16) * size_t(2 * kFaPieces * kKvPiece + kFaWarps * kQWarp);
};

/// The warp's 16 query rows Rw .. Rw + 15 (R = t * group + head-in-group of KV head kvh) of a.q
/// as three bf16 pieces each into Qw ([piece][row][kLd], FaShape's layout); rows past n_rows: 0.
template <int HD>
__device__ __forceinline__ void fa_stage_q(const AttentionArgs& a, int group, int kvh, int64_t Rw, int64_t n_rows,
                                           __nv_bfloat16* Qw) {
  using S = FaShape<HD>;
  const int lane = int(threadIdx.x) & 31;
  for (int idx = lane; idx < 16 * (HD / 4); idx += 32) {
    const int r = idx / (HD / 4), d4 = idx % (HD / 4);
    const int64_t R = Rw + r;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (R < n_rows) {
      const int64_t t = R / group;
      const int h = kvh * group + int(R % group);
      v = *reinterpret_cast<const float4*>(a.q + t * a.q_stride + int64_t(h) * HD + 4 * d4);
    }
    fa_stage4(v, Qw + r * S::kLd + 4 * d4, S::kQPiece);
  }
}

/// A segment's end for the lane's row i (query row R): its state (m, l, o) folded into the
/// running (M, L, Of) (first: the row's first segment), and on its last segment the sink and the
/// final division written to a.out. The one-pass kernels' shared tail.
template <int HD>
__device__ __forceinline__ void fa_fold_row(const AttentionArgs& a, int group, int kvh, int64_t R, int i, bool first,
                                            bool last, const float (&m)[2], const float (&l)[2],
                                            const float (&o)[HD / 8][4], float (&M)[2], float (&L)[2],
                                            float (&Of)[HD / 8][4]) {
  constexpr int NT = HD / 8;
  const int tq = int(threadIdx.x) & 3;
  float ca, cb;
  fa_fold_ml(first, M[i], L[i], m[i], l[i], ca, cb);
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) Of[j][2 * i + c] = fa_fold_o(first, Of[j][2 * i + c], o[j][2 * i + c], ca, cb);
  if (!last) return;
  const int64_t t = R / group;
  const int h = kvh * group + int(R % group);
  float* orow = a.out + t * a.out_stride + int64_t(h) * HD + 2 * tq;
  float Lf = L[i];
  const float cs = fa_fold_sink(a.sinks, h, M[i], Lf);
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) orow[8 * j + c] = fa_final(a.sinks, Of[j][2 * i + c], cs, Lf);
}

/// One warp's step over one 32-position K/V tile, the part fa_kernel and fa_prefill_kernel share:
/// S = Q K^T for the warp's 16 query rows (Qw: their three pieces, FaShape's layout), the online
/// softmax of the lane's rows g and g + 8 (vr: the row exists; Pr / Fr: its last and first visible
/// position, in the same units as kb, the tile's first position) into m, l, and o += P V (Ks / Vs:
/// the tile's K and V pieces, kKvPiece apart). PT: the position type (int64_t, or int relative to a
/// base); the arithmetic does not depend on it.
template <int HD, typename PT>
__device__ __forceinline__ void fa_tile_step(const __nv_bfloat16* Qw, const __nv_bfloat16* Ks, const __nv_bfloat16* Vs,
                                             PT kb, const bool (&vr)[2], const PT (&Pr)[2], const PT (&Fr)[2],
                                             float scale, float (&m)[2], float (&l)[2], float (&o)[HD / 8][4]) {
  using S = FaShape<HD>;
  constexpr int LD = S::kLd, NT = HD / 8, KS = HD / 16;
  const int lane = int(threadIdx.x) & 31, tq = lane & 3;
  // S = Q K^T: 16 rows x 32 positions (n-tiles j = positions 8j..8j+7), per 16-dim step the
  // six piece products from 0, then added to S in fp32 in step order.
  float Sc[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) Sc[j][0] = Sc[j][1] = Sc[j][2] = Sc[j][3] = 0.0f;
#pragma unroll 2
  for (int ks = 0; ks < KS; ++ks) {
    uint32_t qa[3][4], kf[2][3][4];
#pragma unroll
    for (int pc = 0; pc < 3; ++pc)
      ldsm_x4(qa[pc], Qw + pc * S::kQPiece + ((lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 16 * ks + 8 * (lane >> 4));
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int pc = 0; pc < 3; ++pc)
        ldsm_x4(kf[u][pc],
                Ks + pc * S::kKvPiece + (16 * u + (lane & 7) + 8 * (lane >> 4)) * LD + 16 * ks + 8 * ((lane >> 3) & 1));
    float t4[4][4];
    fa_mma6x4(t4, qa, kf);
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) Sc[n][e] = __fadd_rn(Sc[n][e], t4[n][e]);
  }
  // Online softmax per row (i = 0: row g, elements 0, 1; i = 1: row g + 8, elements 2, 3).
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const PT pos = kb + 8 * j + 2 * tq + c;
        const bool live = vr[i] && pos <= Pr[i] && pos >= Fr[i];
        const float s = live ? __fmul_rn(Sc[j][2 * i + c], scale) : -INFINITY;
        Sc[j][2 * i + c] = s;
        mx = fmaxf(mx, s);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m[i], mx);
    const float corr = mn == -INFINITY ? 1.0f : expf(__fsub_rn(m[i], mn));
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float s = Sc[j][2 * i + c];
        const float e = s == -INFINITY ? 0.0f : expf(__fsub_rn(s, mn));
        Sc[j][2 * i + c] = e;
        sum = __fadd_rn(sum, e);
      }
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
    l[i] = __fadd_rn(__fmul_rn(l[i], corr), sum);
    m[i] = mn;
#pragma unroll
    for (int j = 0; j < NT; ++j)
      o[j][2 * i] = __fmul_rn(o[j][2 * i], corr), o[j][2 * i + 1] = __fmul_rn(o[j][2 * i + 1], corr);
  }
  // o += P V: per 16-position step and 8-dim tile the six piece products from 0, then added in fp32.
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    uint32_t pa[3][4], w[3];
    fa_split_pair(Sc[2 * kk][0], Sc[2 * kk][1], w);
    pa[0][0] = w[0], pa[1][0] = w[1], pa[2][0] = w[2];
    fa_split_pair(Sc[2 * kk][2], Sc[2 * kk][3], w);
    pa[0][1] = w[0], pa[1][1] = w[1], pa[2][1] = w[2];
    fa_split_pair(Sc[2 * kk + 1][0], Sc[2 * kk + 1][1], w);
    pa[0][2] = w[0], pa[1][2] = w[1], pa[2][2] = w[2];
    fa_split_pair(Sc[2 * kk + 1][2], Sc[2 * kk + 1][3], w);
    pa[0][3] = w[0], pa[1][3] = w[1], pa[2][3] = w[2];
#pragma unroll
    for (int jq = 0; jq < HD / 32; ++jq) {  // dims 32 jq .. + 31: 8-dim tiles 4 jq .. 4 jq + 3
      uint32_t vf[2][3][4];
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int pc = 0; pc < 3; ++pc)
          ldsm_x4<true>(vf[u][pc], Vs + pc * S::kKvPiece + (16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD +
                                       32 * jq + 16 * u + 8 * (lane >> 4));
      float t4[4][4];
      fa_mma6x4(t4, pa, vf);
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[4 * jq + n][e] = __fadd_rn(o[4 * jq + n][e], t4[n][e]);
    }
  }
}

/// Block (kv head blockIdx.x, query rows [R0, R0 + 64), R = t * group + head-in-group); warp w
/// holds rows R0 + 16 w .. + 15; lane (g = lane / 4, tq = lane % 4) holds rows g and g + 8 of
/// its warp's 16 (mma accumulator layout). part == nullptr: one pass over the segments of the
/// block's rows, row blocks in reverse order (the longest rows start first); else segment
/// blockIdx.z only, its state [m, l, o[HD]] of row R written to part + ((kvh * n_rows + R) *
/// n_seg + seg) * (HD + 2) for fa_combine.
template <int HD>
__global__ void __launch_bounds__(kFaWarps * 32, 2)
    fa_kernel(AttentionArgs a, int group, float* __restrict__ part, int n_seg) {
  detail::grid_dependency_enter();
  using S = FaShape<HD>;
  constexpr int LD = S::kLd, NT = HD / 8;
  extern __shared__ __align__(16) unsigned char fa_smem[];
  __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(fa_smem);  // [piece][pos][LD]
  __nv_bfloat16* Vs = Ks + kFaPieces * S::kKvPiece;               // [piece][pos][LD]
  __nv_bfloat16* Qs = Vs + kFaPieces * S::kKvPiece;               // [warp][piece][row][LD]
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) & 31, g = lane >> 2, tq = lane & 3;
  const int kvh = int(blockIdx.x);
  const bool split = part != nullptr;
  const int64_t n_rows = a.n_tok * group;
  const int64_t blk = split ? int64_t(blockIdx.y) : int64_t(gridDim.y) - 1 - int64_t(blockIdx.y);
  const int64_t R0 = blk * kFaRows, Rw = R0 + 16 * warp;
  const int64_t Rb_last = (R0 + kFaRows < n_rows ? R0 + kFaRows : n_rows) - 1;
  const int64_t p_max = a.pos0 + Rb_last / group;                  // last position any row sees
  const int64_t bF = fa_first_pos(a.pos0 + R0 / group, a.window);  // first position any row sees
  const bool warp_live = Rw < n_rows;
  const int64_t Rw_last = (Rw + 16 < n_rows ? Rw + 16 : n_rows) - 1;
  const int64_t wP = a.pos0 + Rw_last / group, wF = fa_first_pos(a.pos0 + Rw / group, a.window);
  // The lane's rows.
  int64_t Pr[2], Fr[2];
  bool vr[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t R = Rw + g + 8 * i;
    vr[i] = R < n_rows;
    Pr[i] = a.pos0 + (vr[i] ? R / group : 0);
    Fr[i] = fa_first_pos(Pr[i], a.window);
  }
  fa_stage_q<HD>(a, group, kvh, Rw, n_rows, Qs + warp * S::kQWarp);  // zeros past the last row
  float o[NT][4];
  // One pass: the folded state O of the lane's two rows stays in registers across segments.
  float Of[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) Of[j][0] = Of[j][1] = Of[j][2] = Of[j][3] = 0.0f;
  float m[2], l[2], M[2] = {0.0f, 0.0f}, L[2] = {0.0f, 0.0f};
  const int64_t kv_off = int64_t(kvh) * HD;
  const int64_t sg_first = split ? int64_t(blockIdx.z) : bF / kFaSeg;
  const int64_t sg_last = split ? int64_t(blockIdx.z) : p_max / kFaSeg;
  for (int64_t sg = sg_first; sg <= sg_last; ++sg) {
    m[0] = m[1] = -INFINITY, l[0] = l[1] = 0.0f;
#pragma unroll
    for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    const int64_t s_end = sg * kFaSeg + kFaSeg - 1 < p_max ? sg * kFaSeg + kFaSeg - 1 : p_max;
    for (int64_t kb = sg * kFaSeg; kb <= s_end; kb += kFaTile) {
      if (kb + kFaTile - 1 < bF) continue;  // wholly before every row's window (block-uniform)
      __syncthreads();                      // the previous tile has been consumed
#pragma unroll 4
      for (int idx = int(threadIdx.x); idx < kFaTile * (HD / 4); idx += kFaWarps * 32) {
        const int p = idx / (HD / 4), d4 = idx % (HD / 4);
        const int64_t pos = kb + p;
        float4 kv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vv = kv;
        if (pos <= s_end) {
          kv = *reinterpret_cast<const float4*>(a.k + pos * a.kv_stride + kv_off + 4 * d4);
          vv = *reinterpret_cast<const float4*>(a.v + pos * a.kv_stride + kv_off + 4 * d4);
        }
        fa_stage4(kv, Ks + p * LD + 4 * d4, S::kKvPiece);
        fa_stage4(vv, Vs + p * LD + 4 * d4, S::kKvPiece);
      }
      __syncthreads();
      if (!warp_live || kb > wP || kb + kFaTile - 1 < wF) continue;  // no row of the warp sees the tile
      fa_tile_step<HD>(Qs + warp * S::kQWarp, Ks, Vs, kb, vr, Pr, Fr, a.scale, m, l, o);
    }
    // The segment's end: fold (one pass) or write the state (split), for each row that sees it.
    if (!warp_live) continue;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!vr[i] || sg < Fr[i] / kFaSeg || sg > Pr[i] / kFaSeg) continue;
      const int64_t R = Rw + g + 8 * i;
      if (split) {
        float* pr = part + ((int64_t(kvh) * n_rows + R) * n_seg + sg) * (HD + 2);
        if (tq == 0) pr[0] = m[i], pr[1] = l[i];
#pragma unroll
        for (int j = 0; j < NT; ++j) pr[2 + 8 * j + 2 * tq] = o[j][2 * i], pr[3 + 8 * j + 2 * tq] = o[j][2 * i + 1];
        continue;
      }
      fa_fold_row<HD>(a, group, kvh, R, i, sg == Fr[i] / kFaSeg, sg == Pr[i] / kFaSeg, m, l, o, M, L, Of);
    }
  }
}

// ---- decode: few query rows, the product transposed ----
//
// With n_tok * group <= 16 query rows (decode), fa_kernel's 16-row mma tiles are at most half
// used and each block's one live warp does a whole segment alone. fa_decode_kernel computes the
// same per-element operations with the roles of the mma operands swapped: S^T = K Q^T (m = 16
// cache positions, n = 8 query rows, k = 16 dims) and O^T = V^T P^T (m = 16 dims, n = 8 rows,
// k = 16 positions). An mma output element is the sum of the same 16 exact bf16 x bf16 products
// in the same k order either way (products commute), the six piece products of a step keep their
// (i, j) order and every fp32 add and the softmax are the same expressions in the same order, so
// the results are the bits of fa_kernel's split path (tested: AttentionMmaOddLengthsGroupsAndChunking
// compares decode with the one-pass prefill bit for bit). One block of 4 warps per (KV head,
// segment): K and V come to shared memory as fp32 with cp.async (no bf16 staging pass), warps 0
// and 1 form S^T for positions 0-15 and 16-31, warp 0 the softmax, and the 4 warps O^T for a
// quarter of the dims each; the pieces are split from the fp32 values as each fragment is loaded.

constexpr int kFdWarps = 4;  // warps per block (one segment)

template <int HD, int NR>
struct FdShape {
  static constexpr int kKLd = HD + 8;       // floats per K row: A-fragment float2 reads conflict-free
  static constexpr int kVLd = HD + 4;       // floats per V row: V^T fragment reads conflict-free
  static constexpr int kPLd = kFaTile + 8;  // floats per row of the scores / probabilities
  static constexpr int kRows = 8 * NR;      // query rows per block
  static constexpr size_t kSmem = sizeof(float) * size_t(kFaTile * kKLd + kFaTile * kVLd + kRows * kPLd + kRows);
};

/// The four register pairs v[r] of an A fragment as the three pieces' registers a[piece][r].
__device__ __forceinline__ void fd_split_frag(const float2 v[4], uint32_t a[3][4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    uint32_t w[3];
    fa_split_pair(v[r].x, v[r].y, w);
    a[0][r] = w[0], a[1][r] = w[1], a[2][r] = w[2];
  }
}
/// acc += the six piece products from 0 of one 16-long step (fa_mma6x4's (i, j) order, with the
/// B operand holding piece i and the A operand piece j), added elementwise in fp32.
__device__ __forceinline__ void fd_mma6_add(float acc[4], const uint32_t a[3][4], const uint32_t b[3][2]) {
  constexpr int kI[6] = {2, 1, 0, 1, 0, 0}, kJ[6] = {0, 1, 2, 0, 1, 0};
  float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int p = 0; p < 6; ++p) fa_mma(t, a[kJ[p]], b[kI[p]][0], b[kI[p]][1]);
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] = __fadd_rn(acc[e], t[e]);
}

/// Split-KV decode attention, the operations of fa_kernel's split path for blocks of <= 8 NR
/// query rows: block (kv head blockIdx.x, rows [8 NR blockIdx.y, + 8 NR), segment blockIdx.z).
/// Writes the same partial states [m, l, o[HD]] for fa_combine (the body of fa_decode_kernel;
/// returns, block-uniformly, without writing when no row of the block sees the segment).
/// Lane (g = lane / 4, tq = lane % 4): S^T / O^T accumulators hold positions (dims) g, g + 8 of an
/// m-tile and rows 2 tq, 2 tq + 1 of an n-tile; the softmax lanes hold row g (+ 8 i) and the
/// positions 8 j + 2 tq + c, j < 4, c < 2, as in fa_kernel.
template <int HD, int NR>
__device__ __forceinline__ void fd_segment(const AttentionArgs& a, int group, float* __restrict__ part, int n_seg) {
  using S = FdShape<HD, NR>;
  constexpr int KS = HD / 16, KLD = S::kKLd, VLD = S::kVLd, PLD = S::kPLd, NROW = S::kRows, CH = HD / 4;
  extern __shared__ __align__(16) float fd_smem[];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) & 31, g = lane >> 2, tq = lane & 3;
  const int64_t sg = int64_t(blockIdx.z);
  float* Ks = fd_smem;             // [pos][KLD]
  float* Vs = Ks + kFaTile * KLD;  // [pos][VLD]
  float* Ps = Vs + kFaTile * VLD;  // [row][PLD]: scores, then probabilities
  float* Cs = Ps + NROW * PLD;     // [row]: the softmax's correction factor
  const int kvh = int(blockIdx.x);
  const int64_t n_rows = a.n_tok * group;
  const int64_t R0 = int64_t(blockIdx.y) * NROW;
  const int64_t Rb_last = (R0 + NROW < n_rows ? R0 + NROW : n_rows) - 1;
  const int64_t p_max = a.pos0 + Rb_last / group;
  const int64_t bF = fa_first_pos(a.pos0 + R0 / group, a.window);
  const int64_t kb = sg * kFaSeg;                   // one tile per segment
  if (kb > p_max || kb + kFaTile - 1 < bF) return;  // no row of the block sees the segment (block-uniform)
  const int64_t s_end = kb + kFaTile - 1 < p_max ? kb + kFaTile - 1 : p_max;
  // K, then V, of positions kb..kb+31 (zeros past s_end, as fa_kernel stages them).
  {
    const float* kbase = a.k + int64_t(kvh) * HD;
    const float* vbase = a.v + int64_t(kvh) * HD;
    for (int i = int(threadIdx.x); i < kFaTile * CH; i += kFdWarps * 32) {
      const int p = i / CH, c = i % CH;
      const bool in = kb + p <= s_end;
      cp_async<16>(Ks + p * KLD + 4 * c, kbase + (in ? kb + p : kb) * a.kv_stride + 4 * c, in ? 16 : 0);
    }
    cp_commit();
    for (int i = int(threadIdx.x); i < kFaTile * CH; i += kFdWarps * 32) {
      const int p = i / CH, c = i % CH;
      const bool in = kb + p <= s_end;
      cp_async<16>(Vs + p * VLD + 4 * c, vbase + (in ? kb + p : kb) * a.kv_stride + 4 * c, in ? 16 : 0);
    }
    cp_commit();
  }
  // Q^T as B fragments (k = dims, n = row g of n-tile nr), split into pieces, while K and V land
  // (warps 0 and 1).
  uint32_t qb[NR][KS][3][2];
#pragma unroll
  for (int nr = 0; nr < NR && warp < 2; ++nr) {
    const int64_t R = R0 + 8 * nr + g;
    const float* qr = nullptr;
    if (R < n_rows) {
      const int64_t t = R / group;
      qr = a.q + t * a.q_stride + (int64_t(kvh) * group + R % group) * HD;
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      float2 lo = make_float2(0.0f, 0.0f), hi = lo;
      if (qr)
        lo = *reinterpret_cast<const float2*>(qr + 16 * ks + 2 * tq),
        hi = *reinterpret_cast<const float2*>(qr + 16 * ks + 2 * tq + 8);
      uint32_t w[3];
      fa_split_pair(lo.x, lo.y, w);
      qb[nr][ks][0][0] = w[0], qb[nr][ks][1][0] = w[1], qb[nr][ks][2][0] = w[2];
      fa_split_pair(hi.x, hi.y, w);
      qb[nr][ks][0][1] = w[0], qb[nr][ks][1][1] = w[1], qb[nr][ks][2][1] = w[2];
    }
  }
  cp_wait<1>();
  __syncthreads();  // every thread's K copies have landed
  if (warp < 2) {
    // S^T = K Q^T: per 16-dim step the six piece products from 0 (Q piece i, K piece j), added to
    // the scores in fp32 in step order.
    const int mt = warp;  // positions 16 mt .. 16 mt + 15
    float Sc[NR][4];
#pragma unroll
    for (int nr = 0; nr < NR; ++nr) Sc[nr][0] = Sc[nr][1] = Sc[nr][2] = Sc[nr][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {  // unrolled: qb is indexed by ks (registers)
      {
        const float* kr = Ks + (16 * mt + g) * KLD + 16 * ks + 2 * tq;
        const float2 kv[4] = {*reinterpret_cast<const float2*>(kr), *reinterpret_cast<const float2*>(kr + 8 * KLD),
                              *reinterpret_cast<const float2*>(kr + 8),
                              *reinterpret_cast<const float2*>(kr + 8 * KLD + 8)};
        uint32_t ka[3][4];
        fd_split_frag(kv, ka);
#pragma unroll
        for (int nr = 0; nr < NR; ++nr) fd_mma6_add(Sc[nr], ka, qb[nr][ks]);
      }
    }
    // The scores to [row][pos]: element (pos 16 mt + g (+ 8), row 8 nr + 2 tq + c).
#pragma unroll
    for (int nr = 0; nr < NR; ++nr)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float* pr = Ps + (8 * nr + 2 * tq + c) * PLD + 16 * mt + g;
        pr[0] = Sc[nr][c], pr[8] = Sc[nr][2 + c];
      }
  }
  __syncthreads();
  // Online softmax from a fresh state (m = -inf, l = 0), fa_kernel's expressions and order; warp
  // i < NR takes the rows 8 i .. 8 i + 7 (each row's operations are the same whichever warp runs them).
  float mrow = 0.0f, lrow = 0.0f;  // warp i < NR: row 8 i + g
  if (warp < NR) {
    const int row = 8 * warp + g;
    const int64_t R = R0 + row;
    const bool vr = R < n_rows;
    const int64_t Pr = a.pos0 + (vr ? R / group : 0), Fr = fa_first_pos(Pr, a.window);
    float* prow = Ps + row * PLD;
    float sv[4][2];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int64_t pos = kb + 8 * j + 2 * tq + c;
        const bool live = vr && pos <= Pr && pos >= Fr;
        const float s = live ? __fmul_rn(prow[8 * j + 2 * tq + c], a.scale) : -INFINITY;
        sv[j][c] = s;
        mx = fmaxf(mx, s);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m0 = -INFINITY, l0 = 0.0f;
    const float mn = fmaxf(m0, mx);
    const float corr = mn == -INFINITY ? 1.0f : expf(__fsub_rn(m0, mn));
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float s = sv[j][c];
        const float e = s == -INFINITY ? 0.0f : expf(__fsub_rn(s, mn));
        prow[8 * j + 2 * tq + c] = e;
        sum = __fadd_rn(sum, e);
      }
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
    lrow = __fadd_rn(__fmul_rn(l0, corr), sum);
    mrow = mn;
    if (tq == 0) Cs[row] = corr;
  }
  cp_wait<0>();
  __syncthreads();  // the probabilities, the factors and every V copy
  // P^T as B fragments (k = positions 16 kk + 2 tq (+ 8), n = row g of n-tile nr), split.
  uint32_t pb[NR][2][3][2];
#pragma unroll
  for (int nr = 0; nr < NR; ++nr)
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const float* pr = Ps + (8 * nr + g) * PLD + 16 * kk + 2 * tq;
      uint32_t w[3];
      fa_split_pair(pr[0], pr[1], w);
      pb[nr][kk][0][0] = w[0], pb[nr][kk][1][0] = w[1], pb[nr][kk][2][0] = w[2];
      fa_split_pair(pr[8], pr[9], w);
      pb[nr][kk][0][1] = w[0], pb[nr][kk][1][1] = w[1], pb[nr][kk][2][1] = w[2];
    }
  float corr[NR][2];
#pragma unroll
  for (int nr = 0; nr < NR; ++nr) corr[nr][0] = Cs[8 * nr + 2 * tq], corr[nr][1] = Cs[8 * nr + 2 * tq + 1];
  // The lane's rows that see the segment (and get a partial state): their partial-state rows, or null.
  auto state = [&](int row) -> float* {
    const int64_t R = R0 + row;
    if (R >= n_rows) return nullptr;
    const int64_t Pr = a.pos0 + R / group;
    if (sg < fa_first_pos(Pr, a.window) / kFaSeg || sg > Pr / kFaSeg) return nullptr;
    return part + ((int64_t(kvh) * n_rows + R) * n_seg + sg) * (HD + 2);
  };
  float* ost[NR][2];
#pragma unroll
  for (int nr = 0; nr < NR; ++nr) ost[nr][0] = state(8 * nr + 2 * tq), ost[nr][1] = state(8 * nr + 2 * tq + 1);
  // O^T = V^T P^T per 16-dim m-tile: o = o corr (o = 0 at a segment's start), then per 16-position
  // step the six piece products from 0 (P piece i, V piece j), added in fp32 in step order.
  constexpr int kMt = HD / 16 / kFdWarps;  // 16-dim m-tiles per warp
  static_assert(kMt >= 1 && HD / 16 % kFdWarps == 0, "the warps split the dims evenly");
#pragma unroll
  for (int mt = warp * kMt; mt < warp * kMt + kMt; ++mt) {
    float o[NR][4];
#pragma unroll
    for (int nr = 0; nr < NR; ++nr)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[nr][e] = __fmul_rn(0.0f, corr[nr][e & 1]);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const float* vr0 = Vs + (16 * kk + 2 * tq) * VLD + 16 * mt + g;
      // (dim g, positions 2 tq, + 1), dim g + 8, positions + 8, both
      const float2 vv[4] = {make_float2(vr0[0], vr0[VLD]), make_float2(vr0[8], vr0[VLD + 8]),
                            make_float2(vr0[8 * VLD], vr0[9 * VLD]), make_float2(vr0[8 * VLD + 8], vr0[9 * VLD + 8])};
      uint32_t va[3][4];
      fd_split_frag(vv, va);
#pragma unroll
      for (int nr = 0; nr < NR; ++nr) fd_mma6_add(o[nr], va, pb[nr][kk]);
    }
    // element (dim 16 mt + g (+ 8 for e >= 2), row 8 nr + 2 tq + (e & 1))
#pragma unroll
    for (int nr = 0; nr < NR; ++nr)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        if (float* pr = ost[nr][c]) pr[2 + 16 * mt + g] = o[nr][c], pr[2 + 16 * mt + g + 8] = o[nr][2 + c];
  }
  if (warp < NR && tq == 0)
    if (float* pr = state(8 * warp + g)) pr[0] = mrow, pr[1] = lrow;
}

/// The fold of query row R's segment states (KV head kvh) into its output: the block's threads
/// 0 .. HD - 1 each fold one output dimension d (threads past HD, if any, only join the barriers;
/// needs blockDim.x >= HD, block-uniform arguments). Folds the row's states
/// fa_first_pos(P) / kFaSeg .. P / kFaSeg in order (the one-pass kernel's fold_ml / fold_o
/// sequence), then the sink, out = O / L. Only the chains L and O are serial: per batch of 32
/// segments, warp 0 forms the running maxima M_s with a prefix scan (max is exact in any order, so
/// M_s is the serial fold's value) and each segment's factors ca = e^(M_{s-1} - M_s),
/// cb = e^(m_s - M_s) in parallel; then every thread folds its O (thread 0 also L) over the batch
/// with those factors, the same fmul / fadd in the same order. fa_combine (a block per row) and
/// the fused decode kernel's finishing blocks (fd_arrive_and_fold) both run this function, so the
/// two decode paths give the same bits. The states are read with ld.global.cg (L2): in the fused
/// kernel other blocks of the same grid wrote them.
template <int HD>
__device__ __forceinline__ void fa_fold_states(const AttentionArgs& a, int group, const float* __restrict__ part,
                                               int n_seg, int kvh, int64_t R) {
  constexpr int kBatch = 32;
  __shared__ float s_ca[kBatch], s_cb[kBatch], s_l[kBatch], s_ML[2];
  const int64_t n_rows = a.n_tok * group;
  const int d = int(threadIdx.x), lane = d & 31;
  const bool act = d < HD;
  const int64_t t = R / group;
  const int h = kvh * group + int(R % group);
  const int64_t P = a.pos0 + t, fs = fa_first_pos(P, a.window) / kFaSeg;
  const float* row = part + (int64_t(kvh) * n_rows + R) * n_seg * (HD + 2);
  const int64_t last = P / kFaSeg;
  float M = 0.0f, L = 0.0f, O = 0.0f;  // M: warp 0's carry; L: thread 0's
  for (int64_t s0 = fs; s0 <= last; s0 += kBatch) {
    const int cnt = int(last - s0 + 1 < kBatch ? last - s0 + 1 : kBatch);
    const bool first = s0 == fs;
    float o[kBatch];  // every load of the batch in flight before the folds
#pragma unroll
    for (int i = 0; i < kBatch; ++i)
      if (act && i < cnt) o[i] = __ldcg(row + (s0 + i) * (HD + 2) + 2 + d);
    if (d < 32) {
      const bool in = lane < cnt;
      const float m = in ? __ldcg(row + (s0 + lane) * (HD + 2)) : -INFINITY;
      const float l = in ? __ldcg(row + (s0 + lane) * (HD + 2) + 1) : 0.0f;
      float sc = m;  // inclusive prefix max over the batch
#pragma unroll
      for (int off = 1; off < 32; off *= 2) {
        const float v = __shfl_up_sync(0xffffffffu, sc, off);
        if (lane >= off) sc = fmaxf(sc, v);
      }
      const float Ms = first ? sc : fmaxf(M, sc);  // M after segment s0 + lane
      float Mp = __shfl_up_sync(0xffffffffu, Ms, 1);
      if (lane == 0) Mp = M;
      float ca, cb;
      if (first && lane == 0)
        ca = 0.0f, cb = 1.0f;
      else
        ca = expf(__fsub_rn(Mp, Ms)), cb = expf(__fsub_rn(m, Ms));
      s_ca[lane] = ca, s_cb[lane] = cb, s_l[lane] = l;
      M = __shfl_sync(0xffffffffu, Ms, cnt - 1);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {  // unrolled: o stays in registers
      if (i >= cnt) break;
      const bool f = first && i == 0;
      const float ca = s_ca[i], cb = s_cb[i];
      O = fa_fold_o(f, O, o[i], ca, cb);
      if (d == 0) L = f ? s_l[i] : __fadd_rn(__fmul_rn(L, ca), __fmul_rn(s_l[i], cb));
    }
    __syncthreads();  // the batch's factors are read before the next batch writes them
  }
  if (d == 0) s_ML[0] = M, s_ML[1] = L;
  __syncthreads();
  M = s_ML[0], L = s_ML[1];
  const float cs = fa_fold_sink(a.sinks, h, M, L);
  if (act) a.out[t * a.out_stride + int64_t(h) * HD + d] = fa_final(a.sinks, O, cs, L);
  __syncthreads();  // s_ML is read before a next call of this block writes it
}

/// Block (row R = blockIdx.x, kv head blockIdx.y) of HD threads: fa_fold_states of the row.
template <int HD>
__global__ void fa_combine(AttentionArgs a, int group, const float* __restrict__ part, int n_seg) {
  detail::grid_dependency_enter();
  fa_fold_states<HD>(a, group, part, n_seg, int(blockIdx.y), int64_t(blockIdx.x));
}

// ---- decode with the fold in the same kernel ----
//
// fa_combine is a second launch after fa_decode_kernel (its launch and ramp, ~2-3 us, plus one
// pass over the states). The fused path (fd_fused_enabled) lets the decode kernel's last blocks
// do the fold: each block, after writing its partial states, arrives at a per-(stream slot, KV
// head) counter (every thread's __threadfence, a barrier, one atomicAdd); the blocks with the
// last fin arrival tickets become the finishers: they wait until all n_seg blocks of their KV
// head have arrived (the last one need not wait), and finisher j then runs fa_fold_states, the
// function fa_combine runs, for rows j, j + fin, .. of the head. So every output is folded by
// the same code from the same states as on the two-kernel path: the same bits. The finishers
// also reset the counters (the last of them to acknowledge), so they are zero between calls.
//
// Why the wait cannot deadlock: a finisher waits only for blocks of its KV head that have not
// arrived yet; those are running (they never wait) or not yet resident, and a block becomes
// resident once some slot frees. At most fin x n_head_kv blocks wait at any time, which the host
// keeps at <= kFdMaxWaiting (64) and <= half the blocks the device holds at once (fd_finishers:
// occupancy x SMs, 3 x 132 on an H100 / H200), so slots always remain for the others. With PDL the next kernel's blocks
// appear only after every block of this grid has started (launch_dependents is each block's
// first instruction), so they never take a slot that one of its blocks still needs.

constexpr int kFdSlots = 16;       // streams with their own counters (more: the two-kernel path)
constexpr int kFdMaxKv = 128;      // KV heads per call (the split path has < 128 blocks per call)
constexpr int kFdMaxWaiting = 64;  // at most this many finishers (fin x n_head_kv) may wait at once
/// Per (stream slot, KV head): [0] arrivals of the current call, [1] finishers done waiting.
/// Zero at module load; every call leaves them zero.
__device__ unsigned int g_fd_sync[kFdSlots * kFdMaxKv * 2];

/// The fused tail of fa_decode_kernel (see above): arrival, then for the finishers the fold of
/// their rows. Called by every thread of every block after fd_segment (block-uniform).
template <int HD>
__device__ __forceinline__ void fd_arrive_and_fold(const AttentionArgs& a, int group, const float* part, int n_seg,
                                                   int slot, int fin) {
  __shared__ int s_ticket;
  const int kvh = int(blockIdx.x);
  unsigned int* cnt = g_fd_sync + (slot * kFdMaxKv + kvh) * 2;
  __threadfence();  // this thread's partial-state writes are visible device-wide before the arrival
  __syncthreads();
  if (threadIdx.x == 0) s_ticket = int(atomicAdd(cnt, 1u));
  __syncthreads();
  const int nf = fin < n_seg ? fin : n_seg;  // finishers
  const int j = s_ticket - (n_seg - nf);     // this block's finisher index, < 0: none
  if (j < 0) return;
  if (threadIdx.x == 0) {
    if (s_ticket != n_seg - 1)
      while (*reinterpret_cast<volatile unsigned int*>(cnt) < unsigned(n_seg)) __nanosleep(32);
    __threadfence();  // the other blocks' states are read after their arrivals were seen
    if (atomicAdd(cnt + 1, 1u) == unsigned(nf - 1)) {  // every finisher has seen the count: reset
      atomicExch(cnt, 0u);
      atomicExch(cnt + 1, 0u);
    }
  }
  __syncthreads();
  const int64_t n_rows = a.n_tok * group;
#pragma unroll 1
  for (int64_t R = j; R < n_rows; R += nf) fa_fold_states<HD>(a, group, part, n_seg, kvh, R);
}

/// Split-KV decode (n_tok * group <= 8 NR query rows): fd_segment of block (KV head blockIdx.x,
/// rows [8 NR blockIdx.y, + 8 NR), segment blockIdx.z), 4 warps. slot < 0: only the partial
/// states (fa_combine folds them in a second launch); slot >= 0 (g_fd_sync's slot of the stream;
/// gridDim.y must be 1): the fold too, by the blocks with the last fin arrivals
/// (fd_arrive_and_fold), so out is written by this kernel with fa_combine's bits. Launch bounds
/// (128, 3): at most 170 registers, which ptxas then uses without spilling in all four variants
/// (with the default bound it spilled 24 bytes in <64, 1> once the fold was inlined).
template <int HD, int NR>
__global__ void __launch_bounds__(kFdWarps * 32, 3)
    fa_decode_kernel(AttentionArgs a, int group, float* __restrict__ part, int n_seg, int slot, int fin) {
  detail::grid_dependency_enter();
  fd_segment<HD, NR>(a, group, part, n_seg);
  if (slot >= 0) fd_arrive_and_fold<HD>(a, group, part, n_seg, slot, fin);
}

// ---- prefill: the K / V pieces split once per call, copied to shared memory with cp.async ----
//
// fa_kernel stages every K / V tile itself: each block loads the fp32 rows and splits them into
// pieces between two barriers (about a third of its instructions), and every row block of a KV
// head repeats that for the same positions. For the one-pass prefill, fa_split_kv_kernel splits
// the positions the call needs once into bf16 piece planes in global scratch, and
// fa_prefill_kernel (8 warps, 128 query rows per block, so each staged tile serves twice the rows)
// copies each tile's pieces with 16-byte cp.async into one of two shared buffers while it computes
// on the other. The per-row arithmetic is fa_kernel's, line for line (the same pieces: the same
// fa_split / fa_pack; the same mma order, fp32 adds, softmax, segment folds, masking and sink), so
// every output has fa_kernel's bits: a tile or a segment a row does not see is a no-op for it,
// whichever block holds the row (the decode = prefill = any chunking property, kernels.h), and the
// positions past the block's last one are staged as zeros, as fa_kernel stages them.

constexpr int kFpWarps = 8;                    // warps per block, 16 query rows each
constexpr int kFpRows = 16 * kFpWarps;         // query rows per block
constexpr int kFpPlane = kFaPieces * kFaTile;  // piece rows of one tile of K (or V) in the planes

/// The piece planes of one call, bf16 [HD, 32, 3, 2, n_tiles, n_head_kv] in ggml ne order: for
/// KV head h, tile i (positions kb0 + 32 i .. + 31), u = 0 (K) or 1 (V) and piece pc, the tile's
/// 32 positions x HD dims (dims contiguous) at kv + (((h * n_tiles + i) * 2 + u) * 3 + pc) * 32 * HD.
template <int HD>
struct FpPlanes {
  static constexpr int64_t kTileElems = int64_t(kFpPlane) * HD;  // one tile of K (or V), 3 pieces
  /// Tiles of the call: from the tile of its first visible position fa_first_pos(pos0, window)
  /// (kb0, a multiple of 32) to the tile of pos0 + n_tok - 1.
  static int64_t kb0(const AttentionArgs& a) { return fa_first_pos(a.pos0, a.window) / kFaTile * kFaTile; }
  static int64_t n_tiles(const AttentionArgs& a) { return (a.pos0 + a.n_tok - 1) / kFaTile - kb0(a) / kFaTile + 1; }
  static size_t bytes(const AttentionArgs& a) {
    return sizeof(__nv_bfloat16) * size_t(a.n_head_kv) * size_t(n_tiles(a)) * size_t(2 * kTileElems);
  }
};

/// Block (tile blockIdx.x, KV head blockIdx.y) of 256 threads: writes the piece planes (FpPlanes)
/// of positions kb0 + 32 blockIdx.x .. + 31 of K and V (a.k, a.v: rows a.kv_stride floats apart,
/// the head's HD floats at offset h * HD) with fa_stage4, fa_kernel's split; positions past
/// pos0 + n_tok - 1 (not in the cache) as the pieces of 0 (all zero bits).
template <int HD>
__global__ void __launch_bounds__(256)
    fa_split_kv_kernel(AttentionArgs a, int64_t kb0, int64_t n_tiles, __nv_bfloat16* __restrict__ kv) {
  detail::grid_dependency_enter();
  constexpr int64_t TE = FpPlanes<HD>::kTileElems;
  const int64_t ti = int64_t(blockIdx.x), pos_end = a.pos0 + a.n_tok - 1;
  const int kvh = int(blockIdx.y);
  __nv_bfloat16* kd = kv + (int64_t(kvh) * n_tiles + ti) * (2 * TE);
  __nv_bfloat16* vd = kd + TE;
  const int64_t off = int64_t(kvh) * HD;
#pragma unroll 4
  for (int idx = int(threadIdx.x); idx < kFaTile * (HD / 4); idx += 256) {
    const int p = idx / (HD / 4), d4 = idx % (HD / 4);
    const int64_t pos = kb0 + ti * kFaTile + p;
    float4 kk = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vv = kk;
    if (pos <= pos_end) {
      kk = *reinterpret_cast<const float4*>(a.k + pos * a.kv_stride + off + 4 * d4);
      vv = *reinterpret_cast<const float4*>(a.v + pos * a.kv_stride + off + 4 * d4);
    }
    fa_stage4(kk, kd + p * HD + 4 * d4, kFaTile * HD);
    fa_stage4(vv, vd + p * HD + 4 * d4, kFaTile * HD);
  }
}

template <int HD>
struct FpShape {
  static constexpr int kLd = HD + 8;                       // bf16 per shared row (conflict-free ldmatrix)
  static constexpr int kKvPiece = kFaTile * kLd;           // one piece of a K or V tile
  static constexpr int kKvBuf = 2 * kFaPieces * kKvPiece;  // one buffer: K's pieces, then V's
  static constexpr int kQPiece = 16 * kLd;                 // one piece of a warp's 16 query rows
  static constexpr int kQWarp = kFaPieces * kQPiece;
  static constexpr size_t kSmem = sizeof(__nv_bfloat16) * size_t(2 * kKvBuf + kFpWarps * kQWarp);
  static_assert(kFaTile % (kFpWarps * 32 / (HD / 8)) == 0, "the threads copy whole rows of 16-byte chunks");
};

/// fa_kernel's one pass (part == nullptr) for blocks of 128 query rows: block (kv head
/// blockIdx.x, rows [R0, R0 + 128), R = t * group + head-in-group, row blocks in reverse order),
/// warp w holds rows R0 + 16 w .. + 15, lane (g, tq) rows g and g + 8 of them, as in fa_kernel.
/// kv: the piece planes of fa_split_kv_kernel (FpPlanes<HD>: kb0, n_tiles). The block visits the
/// tiles from the one of its first visible position to the one of its last, tile i + 1's pieces
/// copied into the other shared buffer while tile i is computed (one barrier per tile); positions
/// past the block's last one are zero-filled, as fa_kernel stages them.
template <int HD>
__global__ void __launch_bounds__(kFpWarps * 32, 1)
    fa_prefill_kernel(AttentionArgs a, int group, const __nv_bfloat16* __restrict__ kv, int64_t kb0, int64_t n_tiles) {
  detail::grid_dependency_enter();
  using S = FpShape<HD>;
  constexpr int LD = S::kLd, NT = HD / 8, CH = HD / 8;
  constexpr int64_t TE = FpPlanes<HD>::kTileElems;
  extern __shared__ __align__(16) unsigned char fp_smem[];
  __nv_bfloat16* KVs = reinterpret_cast<__nv_bfloat16*>(fp_smem);  // [buffer][K, V][piece][pos][LD]
  __nv_bfloat16* Qs = KVs + 2 * S::kKvBuf;                         // [warp][piece][row][LD]
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) & 31, g = lane >> 2;
  const int kvh = int(blockIdx.x);
  const int64_t n_rows = a.n_tok * group;
  const int64_t blk = int64_t(gridDim.y) - 1 - int64_t(blockIdx.y);
  const int64_t R0 = blk * kFpRows, Rw = R0 + 16 * warp;
  const int64_t Rb_last = (R0 + kFpRows < n_rows ? R0 + kFpRows : n_rows) - 1;
  const int64_t p_max = a.pos0 + Rb_last / group;                  // last position any row sees
  const int64_t bF = fa_first_pos(a.pos0 + R0 / group, a.window);  // first position any row sees
  // Positions from here on are ints relative to base, the start of the segment of bF (every
  // position a row of the block sees is >= base; the launch checks pos0 + n_tok <= INT32_MAX).
  const int64_t base = bF / kFaSeg * kFaSeg;
  const bool warp_live = Rw < n_rows;
  const int64_t Rw_last = (Rw + 16 < n_rows ? Rw + 16 : n_rows) - 1;
  const int wP = int(a.pos0 + Rw_last / group - base), wF = int(fa_first_pos(a.pos0 + Rw / group, a.window) - base);
  const int pm = int(p_max - base);
  // The tiles of the block: fa_kernel's (the segments bF / kFaSeg .. p_max / kFaSeg, less the
  // tiles wholly before bF): kr = kr0, kr0 + 32, .. (the tile at base + kr), n_it of them.
  const int kr0 = int(bF - base) / kFaTile * kFaTile;
  const int n_it = (pm / kFaTile * kFaTile - kr0) / kFaTile + 1;
  // Tile kr's K and V pieces into buffer buf (one commit group): thread x copies dims
  // 8 (x % CH) .. + 7 of positions x / CH + kRowStep r of every piece; zeros past p_max.
  constexpr int kRowStep = kFpWarps * 32 / CH, kRowPasses = kFaTile / kRowStep;
  const int cp_row = int(threadIdx.x) / CH, cp_d8 = int(threadIdx.x) % CH;
  // The thread's first chunk in the planes of the block's first tile (base + kr0 - kb0 >= 0).
  const __nv_bfloat16* kp =
      kv + (int64_t(kvh) * n_tiles + (base + kr0 - kb0) / kFaTile) * (2 * TE) + cp_row * HD + 8 * cp_d8;
  auto stage = [&](int it, __nv_bfloat16* buf) {
    const __nv_bfloat16* src = kp + int64_t(it) * (2 * TE);
    __nv_bfloat16* dst = buf + cp_row * LD + 8 * cp_d8;
    const int lim = pm - (kr0 + kFaTile * it);  // position p of the tile is staged when p <= lim
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int pc = 0; pc < kFaPieces; ++pc)
#pragma unroll
        for (int r = 0; r < kRowPasses; ++r) {
          const bool in = cp_row + kRowStep * r <= lim;
          const int e = ((u * kFaPieces + pc) * kFaTile + kRowStep * r) * HD;  // plane offset
          cp_async<16>(dst + (u * kFaPieces + pc) * S::kKvPiece + kRowStep * r * LD, src + (in ? e : 0), in ? 16 : 0);
        }
    cp_commit();
  };
  stage(0, KVs);  // the first tile lands while the query rows are staged
  // The lane's rows: last and first positions (relative to base; rows past n_rows: unused).
  int Pr[2], Fr[2];
  bool vr[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t R = Rw + g + 8 * i;
    vr[i] = R < n_rows;
    const int64_t P = a.pos0 + (vr[i] ? R / group : 0);
    Pr[i] = vr[i] ? int(P - base) : -1, Fr[i] = vr[i] ? int(fa_first_pos(P, a.window) - base) : 0;
  }
  fa_stage_q<HD>(a, group, kvh, Rw, n_rows, Qs + warp * S::kQWarp);  // zeros past the last row
  float o[NT][4];
  // One pass: the folded state O of the lane's two rows stays in registers across segments.
  float Of[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) Of[j][0] = Of[j][1] = Of[j][2] = Of[j][3] = 0.0f;
  float m[2], l[2], M[2] = {0.0f, 0.0f}, L[2] = {0.0f, 0.0f};
  for (int it = 0; it < n_it; ++it) {
    const int kb = kr0 + kFaTile * it, sg = kb / kFaSeg;  // relative to base, base / kFaSeg
    cp_wait<0>();
    __syncthreads();  // tile it has landed (every thread's copies); tile it - 1's buffer is consumed
    if (it + 1 < n_it) stage(it + 1, KVs + ((it + 1) & 1) * S::kKvBuf);
    const __nv_bfloat16* Ks = KVs + (it & 1) * S::kKvBuf;    // [piece][pos][LD]
    const __nv_bfloat16* Vs = Ks + kFaPieces * S::kKvPiece;  // [piece][pos][LD]
    if (it == 0 || kb % kFaSeg == 0) {                       // a segment's first tile: fresh state
      m[0] = m[1] = -INFINITY, l[0] = l[1] = 0.0f;
#pragma unroll
      for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    }
    if (warp_live && kb <= wP && kb + kFaTile - 1 >= wF) {  // some row of the warp sees the tile
      fa_tile_step<HD>(Qs + warp * S::kQWarp, Ks, Vs, kb, vr, Pr, Fr, a.scale, m, l, o);
    }
    // A segment's last tile: fold, for each row that sees the segment.
    if (!warp_live || !(it + 1 == n_it || (kb + kFaTile) % kFaSeg == 0)) continue;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!vr[i] || sg < Fr[i] / kFaSeg || sg > Pr[i] / kFaSeg) continue;
      const int64_t R = Rw + g + 8 * i;
      fa_fold_row<HD>(a, group, kvh, R, i, sg == Fr[i] / kFaSeg, sg == Pr[i] / kFaSeg, m, l, o, M, L, Of);
    }
  }
}

/// STRATA_CUDA_FA_DECODE=0 keeps decode on fa_kernel (for before / after measurements).
detail::EnvSwitch g_fd{"STRATA_CUDA_FA_DECODE", detail::off_if_zero};
bool fd_enabled() { return g_fd.get() != 0; }

}  // namespace

namespace {
detail::EnvSwitch g_fa_prefill{"STRATA_CUDA_FA_PREFILL", detail::off_if_zero};
}  // namespace

bool fa_prefill_enabled() { return g_fa_prefill.get() != 0; }

void set_fa_prefill_enabled(bool on) { g_fa_prefill.set(on ? 1 : 0); }

namespace {
std::atomic<bool> g_fa_split{true};
detail::EnvSwitch g_fd_fused{"STRATA_CUDA_FA_FUSED", detail::off_if_zero};

/// g_fd_sync's slot of (current device, stream): the slots are handed out on first use and kept
/// (at most kFdSlots (device, stream) pairs); -1 when all are taken (those calls run the
/// two-kernel path). Two calls in flight at once on different streams never share a slot; a
/// destroyed stream's slot passes to a new stream of the same address only through its handle
/// value, and by then its counters are zero (every call leaves them so).
int fd_slot(cudaStream_t st) {
  static std::mutex mu;
  static std::vector<std::pair<int, cudaStream_t>> taken;
  int dev = 0;
  STRATA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  for (size_t i = 0; i < taken.size(); ++i)
    if (taken[i].first == dev && taken[i].second == st) return int(i);
  if (int(taken.size()) >= kFdSlots) return -1;
  taken.emplace_back(dev, st);
  return int(taken.size()) - 1;
}

/// Blocks of fa_decode_kernel<HD, NR> the current device holds at once (occupancy x SMs), cached
/// per device (up to 64 devices; the others query every call).
template <int HD, int NR>
int fd_capacity() {
  static std::atomic<int> cache[64] = {};
  int dev = 0;
  STRATA_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 64)
    if (const int c = cache[dev].load(std::memory_order_relaxed)) return c;
  int per_sm = 0, sms = 0;
  STRATA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fa_decode_kernel<HD, NR>, kFdWarps * 32,
                                                                  FdShape<HD, NR>::kSmem));
  STRATA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int c = per_sm * sms > 1 ? per_sm * sms : 1;
  if (dev < 64) cache[dev].store(c, std::memory_order_relaxed);
  return c;
}

/// Finishers per KV head of a fused call: one per query row while the waiting ones (at most
/// fin x n_head_kv) stay within kFdMaxWaiting and half the device's resident blocks, else fewer
/// (at least 1: the last block, which never waits).
template <int HD, int NR>
int fd_finishers(const AttentionArgs& a, int64_t n_rows) {
  const int cap = fd_capacity<HD, NR>() / 2;
  const int limit = cap < kFdMaxWaiting ? cap : kFdMaxWaiting;
  const int per_head = limit / a.n_head_kv;
  return int(per_head < 1 ? 1 : per_head < n_rows ? per_head : n_rows);
}
}  // namespace

void set_fa_split_allowed(bool on) { g_fa_split.store(on, std::memory_order_relaxed); }

bool fa_fused_enabled() { return g_fd_fused.get() != 0; }

void set_fa_fused_enabled(bool on) { g_fd_fused.set(on ? 1 : 0); }

namespace {

template <int HD>
void launch_fa(const AttentionArgs& a, int group, cudaStream_t st) {
  using S = FaShape<HD>;
  opt_in_smem(reinterpret_cast<const void*>(fa_kernel<HD>), int(S::kSmem));
  const int64_t n_rows = a.n_tok * group;
  const int64_t gy = (n_rows + kFaRows - 1) / kFaRows;
  STRATA_CUDA_REQUIRE(gy <= 65535, "cuda::attention (mma): n_tok * n_head / n_head_kv = " + std::to_string(n_rows) +
                                       " query rows exceed one launch (4194240)");
  const SplitPlan plan = split_plan(a, kFaRows, kFaSeg);
  // Few blocks (decode, small chunks) and more than one segment: the segments in parallel, then
  // fa_combine folds them (the same operations as the one pass, so the same bits).
  if (plan.split && g_fa_split.load(std::memory_order_relaxed)) {
    STRATA_CUDA_REQUIRE(plan.n_seg <= 65535, "cuda::attention (mma): more than 65535 segments");
    float* part = acquire_part(a, plan.bytes, st);
    if (n_rows <= 16 && fd_enabled()) {  // decode: the transposed kernel (the same bits)
      const dim3 grid(unsigned(a.n_head_kv), 1u, unsigned(plan.n_seg));
      // Fused (the fold by the kernel's last blocks, fa_combine's code): a counter slot for the
      // stream, and fd_finishers finishing blocks per KV head.
      const int slot = fa_fused_enabled() && a.n_head_kv <= kFdMaxKv ? fd_slot(st) : -1;
      if (n_rows <= 8) {
        opt_in_smem(reinterpret_cast<const void*>(fa_decode_kernel<HD, 1>), int(FdShape<HD, 1>::kSmem));
        const int fin = slot >= 0 ? fd_finishers<HD, 1>(a, n_rows) : 1;
        detail::launch(fa_decode_kernel<HD, 1>, grid, kFdWarps * 32, FdShape<HD, 1>::kSmem, st, a, group, part,
                       int(plan.n_seg), slot, fin);
      } else {
        opt_in_smem(reinterpret_cast<const void*>(fa_decode_kernel<HD, 2>), int(FdShape<HD, 2>::kSmem));
        const int fin = slot >= 0 ? fd_finishers<HD, 2>(a, n_rows) : 1;
        detail::launch(fa_decode_kernel<HD, 2>, grid, kFdWarps * 32, FdShape<HD, 2>::kSmem, st, a, group, part,
                       int(plan.n_seg), slot, fin);
      }
      if (slot >= 0) {
        STRATA_CUDA_CHECK_LAUNCH();
        release_part(a, part, st);
        return;
      }
    } else {
      const dim3 grid(unsigned(a.n_head_kv), unsigned(gy), unsigned(plan.n_seg));
      detail::launch(fa_kernel<HD>, grid, kFaWarps * 32, S::kSmem, st, a, group, part, int(plan.n_seg));
    }
    STRATA_CUDA_CHECK_LAUNCH();
    const dim3 cgrid(unsigned(n_rows), unsigned(a.n_head_kv));
    detail::launch(fa_combine<HD>, cgrid, HD, 0, st, a, group, part, int(plan.n_seg));
    STRATA_CUDA_CHECK_LAUNCH();
    release_part(a, part, st);
    return;
  }
  if (fa_prefill_enabled()) {  // one pass: the pieces split once, then fa_prefill_kernel (the same bits)
    using F = FpShape<HD>;
    const int64_t kb0 = FpPlanes<HD>::kb0(a), n_tiles = FpPlanes<HD>::n_tiles(a);
    STRATA_CUDA_REQUIRE(a.pos0 + a.n_tok <= INT32_MAX, "cuda::attention (mma): positions past 2^31 - 1");
    __nv_bfloat16* kv = nullptr;
    STRATA_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&kv), FpPlanes<HD>::bytes(a), st));
    detail::launch(fa_split_kv_kernel<HD>, dim3(unsigned(n_tiles), unsigned(a.n_head_kv)), 256, 0, st, a, kb0, n_tiles,
                   kv);
    STRATA_CUDA_CHECK_LAUNCH();
    opt_in_smem(reinterpret_cast<const void*>(fa_prefill_kernel<HD>), int(F::kSmem));
    const dim3 grid(unsigned(a.n_head_kv), unsigned((n_rows + kFpRows - 1) / kFpRows));
    detail::launch(fa_prefill_kernel<HD>, grid, kFpWarps * 32, F::kSmem, st, a, group,
                   static_cast<const __nv_bfloat16*>(kv), kb0, n_tiles);
    STRATA_CUDA_CHECK_LAUNCH();
    STRATA_CUDA_CHECK(cudaFreeAsync(kv, st));
    return;
  }
  const dim3 grid(unsigned(a.n_head_kv), unsigned(gy));
  detail::launch(fa_kernel<HD>, grid, kFaWarps * 32, S::kSmem, st, a, group, nullptr, 0);
  STRATA_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool attention_mma_takes(const AttentionArgs& a) {
  auto al16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return (a.head_dim == 64 || a.head_dim == 128) && al16(a.q) && al16(a.k) && al16(a.v) && a.q_stride % 4 == 0 &&
         a.kv_stride % 4 == 0;
}

void attention_mma(const AttentionArgs& a, void* stream) {
  const int group = a.n_head / a.n_head_kv;
  auto st = static_cast<cudaStream_t>(stream);
  if (a.head_dim == 64) return launch_fa<64>(a, group, st);
  launch_fa<128>(a, group, st);
}

}  // namespace strata::cuda::detail
