#pragma once
// Expert selection on the device: the MoE router's gating, selection bias, group limit, top-k
// and weight normalization of backend::select_experts (src/backend/backend.cpp), one warp per
// token, so that only [T][top_k] ids and weights cross to the host instead of [T][n_expert]
// logits (issue 13 item 4; docs/cuda.md "Routing on the device"); for decode, route_fused does the
// router matmul and the selection in one launch. Same conventions as
// kernels.h: no CUDA header, streams as void*, device pointers, asynchronous launches,
// CudaError on a bad argument or a failed launch.
//
// Equality with the host selection, given the same logits:
//  - every comparison, max, add and product is the host's (__fadd_rn / __fmul_rn, no
//    contraction; the top-k sum in double sequentially over k), and the top-k order is the host's
//    strict order (score descending, ties: lower id first);
//  - the softmax's sum over experts is in double as on the host, but each lane sums its experts
//    (lane, lane + 32, ...) and a fixed xor butterfly adds the 32 parts: with n <= 2048 terms in
//    [0, 1] it differs from the host's sequential sum by < 2^-41 relative, far below the float
//    rounding of 1 / sum that follows (the order is fixed per token, so batches, decode and
//    prefill give the same bits);
//  - exp: the device takes exp in double and rounds it to float (correctly
//    rounded unless the double result is within 1 ulp of a float rounding midpoint), the host
//    takes glibc's expf (<= 0.502 ulp: sysdeps/ieee754/flt-32/e_expf.c). Measured on random
//    logits (tests/test_cuda_kernels.cpp RouteSelectMatchesHost) the probs and weights agree
//    within a few ulp (the test's bound: 8 ulp, derived there); the ids agree unless two experts'
//    probabilities at the k-th / (k+1)-th boundary are within that rounding of each other.
//  - defective logits (backend::router_logits_defect: NaN; +inf or no finite value for the
//    softmax gatings) give the host's code in status[t] and no results for that token.
#include <cstddef>
#include <cstdint>

namespace strata::cuda {

/// The selection options of backend::RouterSpec, as the kernel takes them.
struct RouteSpec {
  int gating = 0;           ///< 0 Softmax, 1 Sigmoid, 2 SoftmaxTopK (backend::RouterSpec::Gating's order)
  int n_expert = 0;         ///< experts; 1 ..= kMaxRouteExperts
  int top_k = 0;            ///< 1 ..= n_expert
  bool norm_topk = true;    ///< weights = probs / their sum (Softmax, Sigmoid)
  int n_group = 0;          ///< groups of n_expert / n_group consecutive experts (<= 1: none)
  int n_group_used = 0;     ///< groups that compete (n_group_used < n_group: the group limit is on)
  float weights_scale = 1;  ///< factor on the final weights (applied when != 1, as the host does)
  const float* selection_bias = nullptr;  ///< device, n_expert floats, or null
};

/// Experts per router the kernel takes (shared memory per warp: 4 * n_expert + 128 words); a larger
/// router goes through the host selection (CudaBackend::route).
constexpr int kMaxRouteExperts = 2048;
/// Groups the group limit takes at most on the device.
constexpr int kMaxRouteGroups = 64;

/// Where select_topk writes, all device arrays of one allocation (route_layout).
struct RouteOut {
  int32_t* status = nullptr;  ///< [T]: backend::router_logits_defect code, 0 = selected
  int32_t* ids = nullptr;     ///< [T][top_k], by descending score
  float* probs = nullptr;     ///< [T][top_k]
  float* weights = nullptr;   ///< [T][top_k]
  float* next_prob = nullptr; ///< [T]
};

/// Bytes of the RouteOut arrays for T tokens and top_k, laid out status, ids, probs, weights,
/// next_prob contiguously (4-byte elements), so [status, ids] and the whole are each one copy.
inline size_t route_bytes(int64_t T, int top_k) { return size_t(T) * (3 * size_t(top_k) + 2) * 4; }
/// The RouteOut views of `base` (route_bytes(T, top_k) bytes, 4-byte aligned).
inline RouteOut route_layout(void* base, int64_t T, int top_k) {
  RouteOut o;
  o.status = static_cast<int32_t*>(base);
  o.ids = o.status + T;
  o.probs = reinterpret_cast<float*>(o.ids + T * top_k);
  o.weights = o.probs + T * top_k;
  o.next_prob = o.weights + T * top_k;
  return o;
}

struct GroupedMatmulJob;  // kernels.h

/// Optional output of select_topk for a MoE layer run on the device (CudaBackend::
/// moe_on_device): one grouped-matmul job per (token, k) pair, j = t * top_k + k, e = ids[j]
/// (expert 0 for a token whose selection failed: its status says so, and the jobs stay valid):
///   gate_up[j] = {w = table[3e], w2 = table[3e + 1], row0 = j, n_tok = 1, block0 = j * blocks_gu}
///   down[j]    = {w = table[3e + 2], w2 = null, row0 = j, n_tok = 1, block0 = j * blocks_dn}
/// table: device, [n_expert][3] weight pointers (gate, up, down); blocks_*: the blocks of one job
/// in the plan of that launch (every job has the same shape); gate_up / down: device, T * top_k.
struct PairJobs {
  const void* const* table = nullptr;
  int64_t blocks_gu = 0, blocks_dn = 0;
  GroupedMatmulJob* gate_up = nullptr;
  GroupedMatmulJob* down = nullptr;
};

/// Selects experts for T tokens from router logits (device, [T][n_expert], rows `ld` floats
/// apart, left unchanged) as backend::select_experts does (see the header comment for what is
/// equal to it). Throws CudaError for a spec outside the kernel's limits (n_expert, n_group) or
/// that select_experts would reject (top_k, groups not dividing n_expert, too few used groups).
/// With `jobs` (not null) the same launch also writes the pair jobs (PairJobs) from the ids.
void select_topk(const RouteSpec& spec, const float* logits, int64_t ld, int64_t T, const RouteOut& out,
                 void* stream = nullptr, const PairJobs* jobs = nullptr);

/// Tokens route_fused takes at most (decode; larger batches: cuda::matmul + select_topk).
constexpr int kFusedRouteMaxTokens = 4;

/// Whether route_fused takes T tokens of an n_expert x cols F32 router: 1 <= T <=
/// kFusedRouteMaxTokens, n_expert <= kMaxRouteExperts, cols a positive multiple of 8, W and x
/// 16-byte aligned with row_bytes % 16 == 0 and ldx % 4 == 0 (cuda::matmul's F32 conditions), and
/// T warps' selection shared memory (4 * n_expert + 128 words each) within the default 48 KiB
/// (n_expert = 2048 fits one token, 512 fits four).
bool route_fused_fits(int n_expert, int64_t cols, int64_t T, const void* W, size_t row_bytes, const float* x,
                      int64_t ldx);

/// The decode routing in one launch: the router logits of T tokens
///   logits[t][e] = x[t] . W[e] (+ bias[e])   (W: device F32 [n_expert][cols], rows row_bytes
///   apart; x: device [T][cols], rows ldx floats apart; bias: device n_expert floats or null;
///   logits: device [T][n_expert], written as the two-launch path writes them)
/// then select_topk(spec, logits, n_expert, T, out, stream, jobs). Every output (logits, status,
/// ids, probs, weights, next_prob, pair jobs) has the bits of cuda::matmul(F32, W, ...) +
/// add_bias + select_topk: each logit is the same FMA chain, butterfly and bias add as the F32
/// mat-vec / tiled kernels (one warp per row, lane l's columns 256i + 8l .. + 8 in order), and the
/// selection runs select_topk's own device code. The row warps are spread over n_expert / 4 blocks
/// so that the weights are read in parallel; the last block to finish (one atomicInc on
/// `counter`) selects, one warp per token.
/// counter: device, one unsigned, 0 before the first call (zero it once); each launch leaves it 0
/// again. Launches sharing a counter must not run concurrently (one stream: they cannot, PDL
/// included, since a kernel touches memory only after its predecessor completed: launch.cuh).
/// Throws CudaError where route_fused_fits is false or for what select_topk rejects.
void route_fused(const RouteSpec& spec, const float* W, size_t row_bytes, int64_t cols, const float* bias,
                 const float* x, int64_t ldx, int64_t T, float* logits, const RouteOut& out, unsigned* counter,
                 void* stream = nullptr, const PairJobs* jobs = nullptr);

}  // namespace strata::cuda
