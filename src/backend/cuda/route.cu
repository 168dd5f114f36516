// Expert selection on the device (contract in route.h): one warp per token; for decode, the
// router's logits and the selection in one launch (route_fused).
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/route.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace strata::cuda {

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxWarpsPerBlock = 4;
constexpr size_t kSmemPerBlock = 48 * 1024;  // the default dynamic shared memory limit

// route_fused_kernel: warps per block (one router row each) and column steps of 256 whose weights
// a lane loads before its FMAs.
constexpr int kFusedWarps = 4;
constexpr int kFusedUnroll = 8;
static_assert(kFusedRouteMaxTokens <= kFusedWarps, "the last block selects with one warp per token");

// 4-byte words of shared memory one warp uses: logits, probabilities, scores, the chosen ids
// (top_k <= n_expert), group scores, group flags.
__host__ __device__ size_t warp_floats(int n_expert) { return 4 * size_t(n_expert) + 2 * size_t(kMaxRouteGroups); }
// route_fused_kernel's dynamic shared memory for T tokens, bytes.
size_t fused_smem(int n_expert, int64_t T) { return size_t(T) * warp_floats(n_expert) * sizeof(float); }

// exp in double, rounded once to float: the correctly rounded expf except within 1 double ulp
// of a float midpoint (CUDA's double exp is within 1 ulp; CUDA C Programming Guide, "Double-
// Precision Floating-Point Functions"). Closer to glibc's expf (<= 0.502 ulp) than CUDA's expf.
__device__ __forceinline__ float exp_rounded(float x) { return float(exp(double(x))); }

// A 32-bit key whose unsigned order is the float order of v (not NaN), with -0 and +0 the same
// key (they compare equal, so the lower id must win between them as between any tie): the
// sign-magnitude bits flipped into an ordered integer. Keys are >= 0x007fffff (-inf), so 0 can
// mean "no candidate".
__device__ __forceinline__ unsigned order_key(float v) {
  const unsigned u = __float_as_uint(v == 0.0f ? 0.0f : v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The host's strict order: higher score first, ties: lower id first. id < 0: nothing yet.
__device__ __forceinline__ void keep_better(float& v, int& id, float v2, int id2) {
  if (id2 >= 0 && (id < 0 || v2 > v || (v2 == v && id2 < id))) v = v2, id = id2;
}

/// Token t's top_k pair jobs (PairJobs) from its ids (ids[k], k < K: shared memory, after a
/// __syncwarp that orders lane 0's writes before these reads), lane k writing pairs k, k + 32, ...;
/// ok == false: expert 0 for each (ids unread). pre: lane k's table row of ids[k] for k < 32,
/// loaded during the top-k rounds (select_token), so that those reads overlap the later rounds;
/// pre == null (or k >= 32): read here.
__device__ void write_pair_jobs(const PairJobs& pj, const int* ids, int64_t t, int K, bool ok, int lane,
                                const void* const* pre) {
  for (int k = lane; k < K; k += 32) {
    const int64_t j = t * K + k;
    const int e = ok ? ids[k] : 0;
    const bool have = pre && k < 32;
    GroupedMatmulJob g;
    g.w = have ? pre[0] : pj.table[3 * e];
    g.w2 = have ? pre[1] : pj.table[3 * e + 1];
    g.row0 = j;
    g.n_tok = 1;
    g.block0 = j * pj.blocks_gu;
    pj.gate_up[j] = g;
    GroupedMatmulJob d;
    d.w = have ? pre[2] : pj.table[3 * e + 2];
    d.w2 = nullptr;
    d.row0 = j;
    d.n_tok = 1;
    d.block0 = j * pj.blocks_dn;
    pj.down[j] = d;
  }
}

/// The selection of one token by one warp (all 32 lanes, converged): backend::select_experts on
/// the logits `lg` (global, n_expert floats; read once, through L2, so that logits another block
/// of the same kernel wrote after its __threadfence are seen: route_fused_kernel), writing token
/// t's status, ids, probs, weights, next_prob and (pj.table) pair jobs. wsm: the warp's shared
/// memory, warp_floats(n_expert) words. Shared by select_topk_kernel and route_fused_kernel, so
/// both give the same bits by construction.
///
/// Global memory round trips: one load phase (the logits with the defect flags, and the selection
/// bias, all issued together), then shared memory only, the chosen experts' table rows issued as
/// each is chosen, then the stores. The arithmetic is the header's, operation for operation.
__device__ void select_token(const RouteSpec& sp, const float* lg, int64_t t, const RouteOut& out, const PairJobs& pj,
                             float* wsm, int lane) {
  const int n = sp.n_expert, K = sp.top_k;
  float* l = wsm;  // the logits, loaded once
  float* p = l + n;
  float* s = p + n;
  int* sid = reinterpret_cast<int*>(s + n);  // the chosen ids, in order
  float* gs = reinterpret_cast<float*>(sid + n);
  int* gok = reinterpret_cast<int*>(gs + kMaxRouteGroups);
  const bool sel_bias = sp.selection_bias && sp.gating != 2;

  // Load, and the defects, in backend::router_logits_defect's order of codes. The selection bias
  // goes into s (read back below where the host adds it).
  bool nan = false, pinf = false, fin = false;
#pragma unroll 4
  for (int i = lane; i < n; i += 32) {
    const float v = __ldcg(lg + i);
    if (sel_bias) s[i] = __ldg(sp.selection_bias + i);
    l[i] = v;
    nan = nan || isnan(v);
    pinf = pinf || (isinf(v) && v > 0);
    fin = fin || isfinite(v);
  }
  nan = __any_sync(kFull, nan), pinf = __any_sync(kFull, pinf), fin = __any_sync(kFull, fin);
  const int code = nan ? 1 : sp.gating == 1 ? 0 : pinf ? 2 : fin ? 0 : 3;
  if (lane == 0) out.status[t] = code;
  if (code) {
    if (pj.table) write_pair_jobs(pj, sid, t, sp.top_k, false, lane, nullptr);
    return;
  }
  __syncwarp();

  // Gating (p) and selection scores (s): backend.cpp select_impl / softmax, operation for operation.
  if (sp.gating == 2) {
    for (int i = lane; i < n; i += 32) s[i] = l[i];
  } else {
    if (sp.gating == 0) {
      float mx = -INFINITY;  // the exact max (no NaN here; the sign of a zero max does not matter)
      for (int i = lane; i < n; i += 32) mx = fmaxf(mx, l[i]);
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
      for (int i = lane; i < n; i += 32) p[i] = exp_rounded(__fsub_rn(l[i], mx));
      // The sum in double: each lane its experts in order, then a fixed butterfly over the lanes.
      // Not the host's order (experts 0..n-1), but a double sum of n <= 2048 floats in [0, 1]
      // differs from it by far less than the float rounding of 1 / sum that follows, and the order
      // is fixed per token (the same bits in any batch, decode and prefill alike).
      double part = 0;
      for (int i = lane; i < n; i += 32) part += double(p[i]);
      for (int o = 16; o > 0; o /= 2) part += __shfl_xor_sync(kFull, part, o);
      const float inv = float(1.0 / part);
      for (int i = lane; i < n; i += 32) p[i] = __fmul_rn(p[i], inv);
    } else {
      for (int i = lane; i < n; i += 32) p[i] = __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_rounded(-l[i])));
    }
    for (int i = lane; i < n; i += 32) s[i] = sel_bias ? __fadd_rn(p[i], s[i]) : p[i];
  }
  __syncwarp();

  // Group limit: a group scores the sum of its two best s; the n_group_used best groups (ties:
  // lower group first, as the host's stable sort) keep their experts, the others' s become NaN,
  // which the top-k below skips (valid scores are never NaN).
  int n_cand = n;
  if (sp.n_group > 1 && sp.n_group_used < sp.n_group) {
    const int gsz = n / sp.n_group;
    for (int g = lane; g < sp.n_group; g += 32) {
      float b1 = -INFINITY, b2 = -INFINITY;
      for (int i = g * gsz; i < (g + 1) * gsz; ++i) {
        if (s[i] > b1) {
          b2 = b1;
          b1 = s[i];
        } else if (s[i] > b2) {
          b2 = s[i];
        }
      }
      gs[g] = gsz >= 2 ? __fadd_rn(b1, b2) : b1;
      gok[g] = 0;
    }
    __syncwarp();
    if (lane == 0) {
      for (int r = 0; r < sp.n_group_used; ++r) {
        int best = -1;
        for (int g = 0; g < sp.n_group; ++g)
          if (!gok[g] && (best < 0 || gs[g] > gs[best])) best = g;
        gok[best] = 1;
      }
    }
    __syncwarp();
    for (int i = lane; i < n; i += 32)
      if (!gok[i / gsz]) s[i] = NAN;
    n_cand = sp.n_group_used * gsz;
    __syncwarp();
  }

  // Top-k (+1 for the next candidate): rounds of a warp arg-max in the host's strict order
  // (higher score first, ties: lower id). Each lane keeps the best of its own experts (i = lane
  // mod 32); a round takes the highest score by one redux over order-preserving keys, then the
  // lowest id among the lanes holding it by another; only the winner's lane marks that expert
  // taken and rescans its own. Round r < 32's lane r issues the loads of the chosen expert's
  // table row (pair jobs) right away; they complete while the later rounds run.
  const int n_sorted = min(K + 1, n_cand);
  int next_id = -1;
  float bv = 0;
  int bi = -1;
  const void* pre[3] = {nullptr, nullptr, nullptr};
  bool too_few = false;  // fewer than K valid scores (e.g. a NaN selection bias): warp-uniform
  for (int i = lane; i < n; i += 32)
    if (!isnan(s[i])) keep_better(bv, bi, s[i], i);
  for (int r = 0; r < n_sorted; ++r) {
    const unsigned key = bi < 0 ? 0u : order_key(bv);
    const unsigned best = __reduce_max_sync(kFull, key);
    const int id = int(__reduce_min_sync(kFull, key == best && bi >= 0 ? unsigned(bi) : 0xffffffffu));
    too_few = too_few || (r < K && id < 0);
    if (lane == 0) {
      if (r < K)
        sid[r] = id;
      else
        next_id = id;
    }
    if (pj.table && r < K && r == lane && id >= 0) {
      pre[0] = pj.table[3 * id];
      pre[1] = pj.table[3 * id + 1];
      pre[2] = pj.table[3 * id + 2];
    }
    if (id >= 0 && id == bi) {  // this lane's best was taken: mark it and find its next best
      s[id] = NAN;
      bi = -1;
      for (int i = lane; i < n; i += 32)
        if (!isnan(s[i])) keep_better(bv, bi, s[i], i);
    }
  }
  __syncwarp();  // lane 0's sid writes before every lane reads them
  if (too_few) {  // status 4 ("unusable"), and pair jobs on expert 0 so that the expert launches read valid weights
    if (lane == 0) out.status[t] = 4;
    if (pj.table) write_pair_jobs(pj, sid, t, K, false, lane, nullptr);
    return;
  }
  if (pj.table) write_pair_jobs(pj, sid, t, K, true, lane, pre);
  for (int k = lane; k < K; k += 32) out.ids[t * K + k] = sid[k];

  // Probabilities and weights of the chosen, as the host computes them: the sums in double over
  // k in order (every lane forms the same sum), then lane k's element.
  if (sp.gating == 2) {
    float mx = l[sid[0]];
    for (int k = 1; k < K; ++k) mx = fmaxf(mx, l[sid[k]]);
    for (int k = lane; k < K; k += 32) p[k] = exp_rounded(__fsub_rn(l[sid[k]], mx));  // p is free here
    __syncwarp();
    double sum = 0;
    for (int k = 0; k < K; ++k) sum += double(p[k]);
    const float inv = float(1.0 / sum);
    for (int k = lane; k < K; k += 32) {
      const float v = __fmul_rn(p[k], inv);
      out.probs[t * K + k] = out.weights[t * K + k] = v;
    }
    if (lane == 0) out.next_prob[t] = next_id >= 0 ? __fmul_rn(exp_rounded(__fsub_rn(l[next_id], mx)), inv) : 0.0f;
    return;
  }
  double sum = 0;
  for (int k = 0; k < K; ++k) sum += double(p[sid[k]]);
  for (int k = lane; k < K; k += 32) {
    const float pk = p[sid[k]];
    float w = sp.norm_topk ? float(double(pk) / sum) : pk;
    if (sp.weights_scale != 1.0f) w = __fmul_rn(w, sp.weights_scale);
    out.probs[t * K + k] = pk;
    out.weights[t * K + k] = w;
  }
  if (lane == 0) out.next_prob[t] = next_id >= 0 ? p[next_id] : 0.0f;
}

/// One warp per token (blocks of up to kMaxWarpsPerBlock warps), warp_floats(n_expert) words of
/// shared memory per warp.
__global__ void select_topk_kernel(RouteSpec sp, const float* __restrict__ logits, int64_t ld, int64_t T, RouteOut out,
                                   PairJobs pj) {
  detail::grid_dependency_enter();
  extern __shared__ float smem[];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + warp;
  if (t >= T) return;  // the whole warp; the kernel has no block-wide barrier
  select_token(sp, logits + t * ld, t, out, pj, smem + size_t(warp) * warp_floats(sp.n_expert), lane);
}

/// Router logits of T <= kFusedRouteMaxTokens tokens for row r (one warp), as cuda::matmul's F32
/// mat-vec (mm_kernel, matmul.cu) and add_bias (family_kernels.cu) compute them: lane l owns
/// columns [256i + 8l, 256i + 8l + 8), one __fmaf_rn chain per token in column order (w first,
/// as there), the xor butterfly of __fadd_rn over the lanes, lane 0's value, then
/// __fadd_rn(logit, bias[r]) where there is a bias. Only the loads differ: the lane's weights of
/// kFusedUnroll column steps are loaded before any FMA (one round trip per 256 * kFusedUnroll
/// columns instead of one per step), and every token reuses them.
__device__ __forceinline__ void router_row(const float* __restrict__ w, int cols, const float* __restrict__ x,
                                           int64_t ldx, int T, const float* __restrict__ bias, int r, float* y, int ldy,
                                           int lane) {
  float acc[kFusedRouteMaxTokens];
#pragma unroll
  for (int t = 0; t < kFusedRouteMaxTokens; ++t) acc[t] = 0.0f;
  for (int c0 = 8 * lane; c0 < cols; c0 += 256 * kFusedUnroll) {
    float4 wa[kFusedUnroll], wb[kFusedUnroll];
#pragma unroll
    for (int u = 0; u < kFusedUnroll; ++u) {
      const int c = c0 + 256 * u;
      if (c < cols) {
        wa[u] = __ldg(reinterpret_cast<const float4*>(w + c));
        wb[u] = __ldg(reinterpret_cast<const float4*>(w + c + 4));
      } else {
        wa[u] = wb[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // unused
      }
    }
#pragma unroll
    for (int t = 0; t < kFusedRouteMaxTokens; ++t) {
      if (t < T) {
        const float* xt = x + t * ldx;
        float s = acc[t];
#pragma unroll
        for (int u = 0; u < kFusedUnroll; ++u) {
          const int c = c0 + 256 * u;
          if (c < cols) {
            const float4 a = __ldg(reinterpret_cast<const float4*>(xt + c));
            const float4 b = __ldg(reinterpret_cast<const float4*>(xt + c + 4));
            s = __fmaf_rn(wa[u].x, a.x, s);
            s = __fmaf_rn(wa[u].y, a.y, s);
            s = __fmaf_rn(wa[u].z, a.z, s);
            s = __fmaf_rn(wa[u].w, a.w, s);
            s = __fmaf_rn(wb[u].x, b.x, s);
            s = __fmaf_rn(wb[u].y, b.y, s);
            s = __fmaf_rn(wb[u].z, b.z, s);
            s = __fmaf_rn(wb[u].w, b.w, s);
          }
        }
        acc[t] = s;
      }
    }
  }
  const float b = bias ? __ldg(bias + r) : 0.0f;
#pragma unroll
  for (int t = 0; t < kFusedRouteMaxTokens; ++t) {
    if (t < T) {
      float s = acc[t];
#pragma unroll
      for (int off = 16; off >= 1; off /= 2) s = __fadd_rn(s, __shfl_xor_sync(kFull, s, off));
      if (lane == 0) y[t * ldy + r] = bias ? __fadd_rn(s, b) : s;
    }
  }
}

/// route_fused (route.h): block b's warp w computes router row r = b * kFusedWarps + w for all
/// tokens (router_row) into `logits`; then each block publishes its rows (__threadfence, then one
/// atomicInc on *counter), and the block that takes the count to gridDim.x - 1 (the last to
/// finish; atomicInc wraps the counter back to 0 there, ready for the next launch) runs the
/// selection, warp t < T on token t (select_token, the same code as select_topk_kernel).
/// Dynamic shared memory: T * warp_floats(n_expert) words.
__global__ void __launch_bounds__(kFusedWarps * 32)
    route_fused_kernel(RouteSpec sp, const float* __restrict__ W, int64_t ldw, int cols, const float* __restrict__ bias,
                       const float* __restrict__ x, int64_t ldx, int T, float* logits, RouteOut out, PairJobs pj,
                       unsigned* counter) {
  detail::grid_dependency_enter();
  extern __shared__ float smem[];
  __shared__ int is_last;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int n = sp.n_expert;
  const int r = int(blockIdx.x) * kFusedWarps + warp;
  if (r < n) router_row(W + int64_t(r) * ldw, cols, x, ldx, T, bias, r, logits, n, lane);
  __threadfence();  // this block's logits are visible device-wide before its count
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned done = atomicInc(counter, gridDim.x - 1);
    __threadfence();  // and the other blocks' logits are seen after their counts
    is_last = done == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last || warp >= T) return;
  select_token(sp, logits + int64_t(warp) * n, warp, out, pj, smem + size_t(warp) * warp_floats(n), lane);
}

// select_experts' rejections and the kernels' limits (select_topk, route_fused).
void check_route(const RouteSpec& sp, int64_t ld, const PairJobs* jobs, const char* fn) {
  const std::string f(fn);
  STRATA_CUDA_REQUIRE(sp.gating >= 0 && sp.gating <= 2, f + ": unknown gating");
  STRATA_CUDA_REQUIRE(sp.n_expert >= 1 && sp.n_expert <= kMaxRouteExperts,
                      f + ": n_expert must be in [1, " + std::to_string(kMaxRouteExperts) + "]");
  STRATA_CUDA_REQUIRE(sp.top_k >= 1 && sp.top_k <= sp.n_expert, f + ": top_k must be in [1, n_expert]");
  STRATA_CUDA_REQUIRE(ld >= sp.n_expert, f + ": ld must be >= n_expert");
  if (sp.n_group > 1 && sp.n_group_used < sp.n_group) {
    STRATA_CUDA_REQUIRE(sp.n_group <= kMaxRouteGroups, f + ": at most " + std::to_string(kMaxRouteGroups) + " groups");
    STRATA_CUDA_REQUIRE(sp.n_expert % sp.n_group == 0 && sp.n_group_used >= 1 &&
                            int64_t(sp.n_group_used) * (sp.n_expert / sp.n_group) >= sp.top_k,
                        f + ": n_group must divide n_expert and n_group_used groups must hold top_k experts");
  }
  STRATA_CUDA_REQUIRE(!jobs ||
                          (jobs->table && jobs->gate_up && jobs->down && jobs->blocks_gu >= 1 && jobs->blocks_dn >= 1),
                      f + ": the pair jobs need a table, both job arrays and blocks >= 1");
}

}  // namespace

void select_topk(const RouteSpec& sp, const float* logits, int64_t ld, int64_t T, const RouteOut& out, void* stream,
                 const PairJobs* jobs) {
  check_route(sp, ld, jobs, "select_topk");
  if (T <= 0) return;
  const size_t per_warp = warp_floats(sp.n_expert) * sizeof(float);
  const int wpb = int(std::clamp<size_t>(kSmemPerBlock / per_warp, 1, kMaxWarpsPerBlock));
  const int64_t blocks = (T + wpb - 1) / wpb;
  STRATA_CUDA_REQUIRE(blocks <= 0x7fffffff, "select_topk: too many tokens for one launch");
  detail::launch(select_topk_kernel, unsigned(blocks), unsigned(32 * wpb), per_warp * size_t(wpb),
                 static_cast<cudaStream_t>(stream), sp, logits, ld, T, out, jobs ? *jobs : PairJobs{});
  STRATA_CUDA_CHECK_LAUNCH();
}

bool route_fused_fits(int n_expert, int64_t cols, int64_t T, const void* W, size_t row_bytes, const float* x,
                      int64_t ldx) {
  return n_expert >= 1 && n_expert <= kMaxRouteExperts && T >= 1 && T <= kFusedRouteMaxTokens && cols > 0 &&
         cols % 8 == 0 && cols <= (int64_t(1) << 30) && row_bytes >= size_t(cols) * 4 && row_bytes % 16 == 0 &&
         reinterpret_cast<uintptr_t>(W) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && ldx % 4 == 0 &&
         ldx >= cols && fused_smem(n_expert, T) + 64 <= kSmemPerBlock;  // + the kernel's static flag
}

void route_fused(const RouteSpec& sp, const float* W, size_t row_bytes, int64_t cols, const float* bias, const float* x,
                 int64_t ldx, int64_t T, float* logits, const RouteOut& out, unsigned* counter, void* stream,
                 const PairJobs* jobs) {
  check_route(sp, sp.n_expert, jobs, "route_fused");
  STRATA_CUDA_REQUIRE(route_fused_fits(sp.n_expert, cols, T, W, row_bytes, x, ldx),
                      "route_fused: T=" + std::to_string(T) + ", cols=" + std::to_string(cols) +
                          " or the alignment of W / x is outside route_fused_fits");
  STRATA_CUDA_REQUIRE(W && x && logits && counter, "route_fused: null pointer");
  const unsigned blocks = unsigned((sp.n_expert + kFusedWarps - 1) / kFusedWarps);
  detail::launch(route_fused_kernel, blocks, unsigned(32 * kFusedWarps), fused_smem(sp.n_expert, T),
                 static_cast<cudaStream_t>(stream), sp, W, int64_t(row_bytes / 4), int(cols), bias, x, ldx, int(T),
                 logits, out, jobs ? *jobs : PairJobs{}, counter);
  STRATA_CUDA_CHECK_LAUNCH();
}

}  // namespace strata::cuda
