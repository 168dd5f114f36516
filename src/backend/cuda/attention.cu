// Causal GQA attention against an fp32 KV cache, flash-attention style (one kernel for decode
// and prefill, so both give the same bits for a query at a given position). Contract: kernels.h.
#include <cmath>
#include <string>

#include "backend/cuda/cuda_check.h"

namespace strata::cuda {

namespace {

constexpr int kAttnWarps = 8;  // query rows per block, one warp each
constexpr int kKvTile = 32;    // cache positions per tile (one per lane when scoring)

/// Block (kv head, 8 consecutive query rows R = t * group + head-in-group). DPL = head_dim / 32
/// dimensions per lane for the output accumulators.
template <int DPL>
__global__ void __launch_bounds__(kAttnWarps * 32) attention_kernel(AttentionArgs a, int group) {
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
  const int64_t P = a.pos0 + t;  // last position this row sees
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
  const int64_t kv_off = int64_t(kvh) * HD;
  for (int64_t kb = 0; kb <= p_max; kb += kKvTile) {
    __syncthreads();  // the previous tile has been consumed (and q_sh written, the first time)
    for (int idx = int(threadIdx.x); idx < kKvTile * HD; idx += kAttnWarps * 32) {
      const int p = idx / HD, d = idx % HD;
      const int64_t pos = kb + p;
      float kv = 0.0f, vv = 0.0f;
      if (pos <= p_max) {
        kv = a.k[pos * a.kv_stride + kv_off + d];
        vv = a.v[pos * a.kv_stride + kv_off + d];
      }
      Ks[p * (HD + 1) + d] = kv;
      Vs[p * HD + d] = vv;
    }
    __syncthreads();
    if (valid && kb <= P) {
      const bool live = kb + lane <= P;
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
  if (valid) {
    float* orow = a.out + t * a.out_stride + int64_t(h) * HD;
#pragma unroll
    for (int i = 0; i < DPL; ++i) orow[lane + 32 * i] = __fdiv_rn(o[i], l);
  }
}

template <int DPL>
void launch_attention(const AttentionArgs& a, int group, cudaStream_t st) {
  constexpr int HD = 32 * DPL;
  const size_t smem = sizeof(float) * (size_t(kKvTile) * (HD + 1) + size_t(kKvTile) * HD + size_t(kAttnWarps) * HD);
  STRATA_CUDA_CHECK(cudaFuncSetAttribute(attention_kernel<DPL>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const int64_t n_rows = a.n_tok * group;
  const int64_t gy = (n_rows + kAttnWarps - 1) / kAttnWarps;
  STRATA_CUDA_REQUIRE(gy <= 65535, "cuda::attention: n_tok * n_head / n_head_kv = " + std::to_string(n_rows) +
                                       " query rows exceed one launch (524280)");
  const dim3 grid(unsigned(a.n_head_kv), unsigned(gy));
  attention_kernel<DPL><<<grid, kAttnWarps * 32, smem, st>>>(a, group);
  STRATA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention(const AttentionArgs& a, void* stream) {
  STRATA_CUDA_REQUIRE(a.head_dim > 0 && a.head_dim % 32 == 0 && a.head_dim <= 256,
                      "cuda::attention: head_dim=" + std::to_string(a.head_dim) + " must be a multiple of 32, <= 256");
  STRATA_CUDA_REQUIRE(a.n_head > 0 && a.n_head_kv > 0 && a.n_head % a.n_head_kv == 0,
                      "cuda::attention: n_head must be a positive multiple of n_head_kv");
  STRATA_CUDA_REQUIRE(a.n_tok > 0 && a.pos0 >= 0, "cuda::attention: n_tok must be > 0 and pos0 >= 0");
  STRATA_CUDA_REQUIRE(a.q_stride >= int64_t(a.n_head) * a.head_dim && a.out_stride >= int64_t(a.n_head) * a.head_dim &&
                          a.kv_stride >= int64_t(a.n_head_kv) * a.head_dim,
                      "cuda::attention: a stride is smaller than its row");
  STRATA_CUDA_REQUIRE(a.q && a.k && a.v && a.out, "cuda::attention: null pointer");
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
    default: break;
  }
}

}  // namespace strata::cuda
