// Causal GQA attention against an fp32 KV cache, flash-attention style (one kernel for decode
// and prefill, so both give the same bits for a query at a given position). Contract: kernels.h.
// This file holds AttentionPath::Simt (fp32 on the CUDA cores) and the dispatch; the tensor-core
// kernel (AttentionPath::Mma, the default where attention_has_mma) is attention_mma.cu.
#include <cmath>
#include <string>

#include <cstdlib>

#include "backend/cuda/attention_mma.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/env_switch.h"
#include "backend/cuda/launch.cuh"

namespace strata::cuda {

namespace {

constexpr int kAttnWarps = 8;  // query rows per block, one warp each
constexpr int kKvTile = 32;    // cache positions per tile (one per lane when scoring)
constexpr int kKvSeg = 256;    // cache positions per segment: each segment's softmax state starts fresh

/// Folds a segment's online-softmax state (m, l, o) into the running state (M, L, O) of the
/// segments before it, in position order: M' = max(M, m), L = L e^(M - M') + l e^(m - M'),
/// O = O e^(M - M') + o e^(m - M'). `first`: the running state is the segment's.
template <int DPL>
__device__ __forceinline__ void fold_segment(bool first, float& M, float& L, float O[DPL], float m, float l,
                                             const float o[DPL]) {
  if (first) {
    M = m, L = l;
#pragma unroll
    for (int i = 0; i < DPL; ++i) O[i] = o[i];
    return;
  }
  const float Mn = fmaxf(M, m);
  const float ca = expf(__fsub_rn(M, Mn)), cb = expf(__fsub_rn(m, Mn));
  L = __fadd_rn(__fmul_rn(L, ca), __fmul_rn(l, cb));
#pragma unroll
  for (int i = 0; i < DPL; ++i) O[i] = __fadd_rn(__fmul_rn(O[i], ca), __fmul_rn(o[i], cb));
  M = Mn;
}

/// The first position query row at position P sees: P + 1 - window (at least 0), or 0 without one.
__device__ __forceinline__ int64_t first_pos(int64_t P, int64_t window) {
  return window > 0 ? (P + 1 - window > 0 ? P + 1 - window : 0) : 0;
}

/// Folds head h's sink logit into the final state (M, L, O): M' = max(M, sink),
/// L = L e^(M - M') + e^(sink - M'), O = O e^(M - M'). No-op without sinks.
template <int DPL>
__device__ __forceinline__ void fold_sink(const float* sinks, int h, float M, float& L, float O[DPL]) {
  if (!sinks) return;
  const float sk = sinks[h];
  const float Mn = fmaxf(M, sk);
  const float ca = expf(__fsub_rn(M, Mn)), cb = expf(__fsub_rn(sk, Mn));
  L = __fadd_rn(__fmul_rn(L, ca), cb);
#pragma unroll
  for (int i = 0; i < DPL; ++i) O[i] = __fmul_rn(O[i], ca);
}

/// Block (kv head, 8 consecutive query rows R = t * group + head-in-group). DPL = head_dim / 32
/// dimensions per lane for the output accumulators.
/// seg < 0: the block walks every segment, folding each into its running state, and writes
/// out = O / L. seg >= 0: it computes segment `seg` only and writes the segment's state
/// [m, l, o[HD]] of row R to part + (R * n_seg + seg) * (HD + 2) (attention_combine folds them).
template <int DPL>
__global__ void __launch_bounds__(kAttnWarps * 32)
    attention_kernel(AttentionArgs a, int group, float* __restrict__ part, int n_seg) {
  detail::grid_dependency_enter();
  const int seg = part ? int(blockIdx.z) : -1;
  constexpr int HD = 32 * DPL;
  extern __shared__ float smem[];
  float* Ks = smem;                     // [kKvTile][HD + 1] (padded: lane p reads row p)
  float* Vs = Ks + kKvTile * (HD + 1);  // [kKvTile][HD]
  float* Qs = Vs + kKvTile * HD;        // [kAttnWarps][HD]
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) & 31;
  const int kvh = int(blockIdx.x);
  const int64_t n_rows = a.n_tok * group;
  const int64_t R0 = int64_t(blockIdx.y) * kAttnWarps;
  const int64_t R = R0 + warp;
  const bool valid = R < n_rows;
  const int64_t t = valid ? R / group : 0;
  const int h = kvh * group + int(R % group);
  const int64_t P = a.pos0 + t;              // last position this row sees
  const int64_t F = first_pos(P, a.window);  // first position this row sees
  const int64_t fs = F / kKvSeg;             // its segment: the folds start there
  const int64_t r_last = (R0 + kAttnWarps < n_rows ? R0 + kAttnWarps : n_rows) - 1;
  const int64_t p_max = a.pos0 + r_last / group;  // last position any row of the block sees
  float* q_sh = Qs + warp * HD;
  if (valid) {
    const float* qrow = a.q + t * a.q_stride + int64_t(h) * HD;
    for (int d = lane; d < HD; d += 32) q_sh[d] = qrow[d];
  }
  float o[DPL];
#pragma unroll
  for (int i = 0; i < DPL; ++i) o[i] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  float M = -INFINITY, L = 0.0f, O[DPL];
  const int64_t kv_off = int64_t(kvh) * HD;
  // one pass: from the segment of the block's earliest first position (its first row's)
  const int64_t kb0 = seg < 0 ? first_pos(a.pos0 + R0 / group, a.window) / kKvSeg * kKvSeg : int64_t(seg) * kKvSeg;
  const int64_t kb_end = seg < 0 ? p_max : min(p_max, kb0 + kKvSeg - 1);
  for (int64_t kb = kb0; kb <= kb_end; kb += kKvTile) {
    if (seg < 0 && kb > kb0 && kb % kKvSeg == 0 && valid && kb <= P) {
      const int64_t ps = kb / kKvSeg - 1;  // the segment just finished
      if (ps >= fs) fold_segment<DPL>(ps == fs, M, L, O, m, l, o);
      m = -INFINITY, l = 0.0f;
#pragma unroll
      for (int i = 0; i < DPL; ++i) o[i] = 0.0f;
    }
    __syncthreads();  // the previous tile has been consumed (and q_sh written, the first time)
    for (int idx = int(threadIdx.x); idx < kKvTile * HD; idx += kAttnWarps * 32) {
      const int p = idx / HD, d = idx % HD;
      const int64_t pos = kb + p;
      float kv = 0.0f, vv = 0.0f;
      if (pos <= kb_end) {
        kv = a.k[pos * a.kv_stride + kv_off + d];
        vv = a.v[pos * a.kv_stride + kv_off + d];
      }
      Ks[p * (HD + 1) + d] = kv;
      Vs[p * HD + d] = vv;
    }
    __syncthreads();
    if (valid && kb <= P && kb + kKvTile - 1 >= F) {
      const bool live = kb + lane <= P && kb + lane >= F;
      float s = -INFINITY;
      if (live) {
        const float* kr = Ks + lane * (HD + 1);
        float dot = 0.0f;
#pragma unroll 8
        for (int d = 0; d < HD; ++d) dot = __fmaf_rn(q_sh[d], kr[d], dot);
        s = __fmul_rn(dot, a.scale);
      }
      float tmax = s;
#pragma unroll
      for (int off = 16; off >= 1; off /= 2) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
      const float m_new = fmaxf(m, tmax);
      const float corr = expf(__fsub_rn(m, m_new));  // 0 on the first tile (m = -inf)
      const float e = live ? expf(__fsub_rn(s, m_new)) : 0.0f;
      float es = e;
#pragma unroll
      for (int off = 16; off >= 1; off /= 2) es = __fadd_rn(es, __shfl_xor_sync(0xffffffffu, es, off));
      l = __fadd_rn(__fmul_rn(l, corr), es);
#pragma unroll
      for (int i = 0; i < DPL; ++i) o[i] = __fmul_rn(o[i], corr);
      const int np = P - kb + 1 < kKvTile ? int(P - kb + 1) : kKvTile;
      for (int p = 0; p < np; ++p) {
        const float ep = __shfl_sync(0xffffffffu, e, p);
        const float* vr = Vs + p * HD;
#pragma unroll
        for (int i = 0; i < DPL; ++i) o[i] = __fmaf_rn(ep, vr[lane + 32 * i], o[i]);
      }
      m = m_new;
    }
  }
  if (!valid) return;
  if (seg >= 0) {
    if (kb0 > P || seg < fs) return;  // the row does not see this segment; attention_combine skips it
    float* pr = part + ((int64_t(kvh) * n_rows + R) * n_seg + seg) * (HD + 2);
    if (lane == 0) pr[0] = m, pr[1] = l;
#pragma unroll
    for (int i = 0; i < DPL; ++i) pr[2 + lane + 32 * i] = o[i];
    return;
  }
  fold_segment<DPL>(P / kKvSeg == fs, M, L, O, m, l, o);
  fold_sink<DPL>(a.sinks, h, M, L, O);
  float* orow = a.out + t * a.out_stride + int64_t(h) * HD;
#pragma unroll
  for (int i = 0; i < DPL; ++i) orow[lane + 32 * i] = __fdiv_rn(O[i], L);
}

/// One warp per query row R: folds the row's segments 0 .. P / kKvSeg in order (fold_segment,
/// as attention_kernel does in one pass), out = O / L.
template <int DPL>
__global__ void attention_combine(AttentionArgs a, int group, const float* __restrict__ part, int n_seg) {
  detail::grid_dependency_enter();
  constexpr int HD = 32 * DPL;
  const int64_t R = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = int(threadIdx.x) & 31;
  if (R >= a.n_tok * group) return;
  const int64_t t = R / group;
  const int h = int(blockIdx.y) * group + int(R % group);
  const int64_t P = a.pos0 + t;
  const int64_t fs = first_pos(P, a.window) / kKvSeg;
  float M = -INFINITY, L = 0.0f, O[DPL], o[DPL];
  for (int64_t sg = fs; sg * kKvSeg <= P; ++sg) {
    const float* pr = part + ((int64_t(blockIdx.y) * a.n_tok * group + R) * n_seg + sg) * (HD + 2);
#pragma unroll
    for (int i = 0; i < DPL; ++i) o[i] = pr[2 + lane + 32 * i];
    fold_segment<DPL>(sg == fs, M, L, O, pr[0], pr[1], o);
  }
  fold_sink<DPL>(a.sinks, h, M, L, O);
  float* orow = a.out + t * a.out_stride + int64_t(h) * HD;
#pragma unroll
  for (int i = 0; i < DPL; ++i) orow[lane + 32 * i] = __fdiv_rn(O[i], L);
}

template <int DPL>
void launch_attention(const AttentionArgs& a, int group, cudaStream_t st) {
  constexpr int HD = 32 * DPL;
  const size_t smem = sizeof(float) * (size_t(kKvTile) * (HD + 1) + size_t(kKvTile) * HD + size_t(kAttnWarps) * HD);
  detail::opt_in_smem(reinterpret_cast<const void*>(attention_kernel<DPL>), int(smem));
  const int64_t n_rows = a.n_tok * group;
  const int64_t gy = (n_rows + kAttnWarps - 1) / kAttnWarps;
  STRATA_CUDA_REQUIRE(gy <= 65535, "cuda::attention: n_tok * n_head / n_head_kv = " + std::to_string(n_rows) +
                                       " query rows exceed one launch (524280)");
  const detail::SplitPlan plan = detail::split_plan(a, kAttnWarps, kKvSeg);
  // Few blocks (decode, small chunks) and a long cache: the segments in parallel, then the fold
  // (the same sums as the one-pass kernel, so the same bits).
  if (plan.split) {
    const int n_seg = int(plan.n_seg);
    float* part = detail::acquire_part(a, plan.bytes, st);
    const dim3 grid(unsigned(a.n_head_kv), unsigned(gy), unsigned(n_seg));
    detail::launch(attention_kernel<DPL>, grid, kAttnWarps * 32, smem, st, a, group, part, n_seg);
    STRATA_CUDA_CHECK_LAUNCH();
    const dim3 cgrid(unsigned((n_rows + 3) / 4), unsigned(a.n_head_kv));
    detail::launch(attention_combine<DPL>, cgrid, 128, 0, st, a, group, part, n_seg);
    STRATA_CUDA_CHECK_LAUNCH();
    detail::release_part(a, part, st);
    return;
  }
  const dim3 grid(unsigned(a.n_head_kv), unsigned(gy));
  detail::launch(attention_kernel<DPL>, grid, kAttnWarps * 32, smem, st, a, group, nullptr, 0);
  STRATA_CUDA_CHECK_LAUNCH();
}

}  // namespace

namespace {

// The kernel cuda::attention picks: Mma when asked, or for Auto where it takes the shape and the
// environment does not ask for Simt (STRATA_CUDA_ATTN=simt, for before / after measurements).
bool takes_mma(const AttentionArgs& a) {
  static detail::EnvSwitch simt{"STRATA_CUDA_ATTN",
                                [](const char* v) { return v && std::string(v) == "simt" ? 1 : 0; }};
  const bool simt_env = simt.get() != 0;
  return a.path == AttentionPath::Mma || (a.path == AttentionPath::Auto && !simt_env && attention_has_mma(a));
}

}  // namespace

size_t attention_scratch_bytes(const AttentionArgs& a) {
  if (a.n_tok <= 0 || a.n_head_kv <= 0 || a.n_head % a.n_head_kv != 0) return 0;
  return takes_mma(a) ? detail::split_plan(a, detail::kAttnMmaRows, detail::kAttnMmaSegment).bytes
                      : detail::split_plan(a, kAttnWarps, kKvSeg).bytes;
}

void attention(const AttentionArgs& a, void* stream) {
  STRATA_CUDA_REQUIRE(a.head_dim > 0 && a.head_dim % 32 == 0 && (a.head_dim <= 256 || a.head_dim == 576),
                      "cuda::attention: head_dim=" + std::to_string(a.head_dim) +
                          " must be a multiple of 32, <= 256, or 576 (MLA's absorbed head)");
  STRATA_CUDA_REQUIRE(a.n_head > 0 && a.n_head_kv > 0 && a.n_head % a.n_head_kv == 0,
                      "cuda::attention: n_head must be a positive multiple of n_head_kv");
  STRATA_CUDA_REQUIRE(a.n_tok > 0 && a.pos0 >= 0, "cuda::attention: n_tok must be > 0 and pos0 >= 0");
  STRATA_CUDA_REQUIRE(a.window >= 0, "cuda::attention: window must be >= 0");
  STRATA_CUDA_REQUIRE(a.q_stride >= int64_t(a.n_head) * a.head_dim && a.out_stride >= int64_t(a.n_head) * a.head_dim &&
                          a.kv_stride >= int64_t(a.n_head_kv) * a.head_dim,
                      "cuda::attention: a stride is smaller than its row");
  STRATA_CUDA_REQUIRE(a.q && a.k && a.v && a.out, "cuda::attention: null pointer");
  STRATA_CUDA_REQUIRE(a.path != AttentionPath::Mma || attention_has_mma(a),
                      "cuda::attention: AttentionPath::Mma takes head_dim 64 or 128 with 16-byte aligned q, k, v and "
                      "strides of 4 floats (head_dim=" +
                          std::to_string(a.head_dim) + ")");
  if (takes_mma(a)) {
    detail::attention_mma(a, stream);
    return;
  }
  const int group = a.n_head / a.n_head_kv;
  auto st = static_cast<cudaStream_t>(stream);
  switch (a.head_dim / 32) {
    case 1: launch_attention<1>(a, group, st); return;
    case 2: launch_attention<2>(a, group, st); return;
    case 3: launch_attention<3>(a, group, st); return;
    case 4: launch_attention<4>(a, group, st); return;
    case 5: launch_attention<5>(a, group, st); return;
    case 6: launch_attention<6>(a, group, st); return;
    case 7: launch_attention<7>(a, group, st); return;
    case 8: launch_attention<8>(a, group, st); return;
    case 18: launch_attention<18>(a, group, st); return;  // MLA's absorbed head: 512 latent + 64 rotary
    default: break;
  }
}

bool attention_has_mma(const AttentionArgs& a) { return detail::attention_mma_takes(a); }

}  // namespace strata::cuda
