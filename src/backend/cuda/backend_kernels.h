#pragma once
// The small CUDA kernels of the CudaBackend that src/backend/cuda/kernels.h does not have:
// row gathers and scatters for the expert FFN, the q/gate split and the sigmoid gates of
// qwen3next, a strided residual add, and the MoE combine. Same conventions as kernels.h: no
// CUDA header, streams as void*, every pointer a device pointer, fp32 activations with rows
// `ld*` floats apart, asynchronous launches, CudaError on a bad argument or a failed launch.
//
// Each kernel computes an output element from that element's own inputs with a fixed sequence
// of IEEE operations (__fadd_rn / __fmul_rn: no contraction), so results never depend on how
// many rows share a launch (batch invariance) and match the CPU backend's loops bit for bit
// except where an expf is involved (CUDA's expf: <= 2 ulp).
#include <cstdint>

#include "backend/cuda/kernels.h"

namespace strata::cuda {

/// dst row j = src row (pairs[j] / top_k), `cols` floats, for j < n. pairs: device, n int64
/// (token, k) entries t * top_k + k. src rows lds apart; dst rows ldd apart.
void gather_rows(const float* src, int64_t lds, const int64_t* pairs, int top_k, int64_t n, float* dst, int64_t ldd,
                 int64_t cols, void* stream = nullptr);

/// dst row j = src row (j / top_k), `cols` floats, for j < n: every (token, k) pair of a layer in
/// pair order (gather_rows with pairs[j] = j). src rows lds apart; dst rows ldd apart.
void repeat_rows(const float* src, int64_t lds, int top_k, int64_t n, float* dst, int64_t ldd, int64_t cols,
                 void* stream = nullptr);
/// The (token, k) pairs of a MoE layer grouped by expert on the device, for one grouped launch per
/// projection with every expert of the layer resident (CudaBackend::moe_on_device in prefill):
/// with e_j = ids[j] (an id outside [0, n_expert) counts as 0: its token's selection failed and
/// its status says so) and c_e the pairs of expert e,
///   pairs[o_e .. o_e + c_e) = the j with e_j = e (o_e = c_0 + ... + c_{e-1}; their order within
///                             an expert is not fixed, which changes no result: a grouped
///                             matmul's element depends only on its own row of x),
///   gate_up[e] = {w = table[3e], w2 = table[3e + 1], row0 = o_e, n_tok = c_e,
///                 block0 = rb_gu * (sum over e' < e of ceil(c_e' / tile_gu))}
///   down[e]    = {w = table[3e + 2], w2 = null, row0 = o_e, n_tok = c_e, block0 likewise with
///                 rb_dn and tile_dn}
/// for every e < n_expert (c_e may be 0: such a job has no blocks). One block; n_expert <= 4096.
/// ids: device, n_pairs int32; table: device, [n_expert][3] weight pointers; pairs: device,
/// n_pairs int64; gate_up / down: device, n_expert jobs each.
void group_pairs(const int32_t* ids, int64_t n_pairs, const void* const* table, int n_expert, int tile_gu,
                 int64_t rb_gu, int tile_dn, int64_t rb_dn, int64_t* pairs, GroupedMatmulJob* gate_up,
                 GroupedMatmulJob* down, void* stream = nullptr);
/// dst row pairs[j] = src row j, `cols` floats, for j < n (pairs distinct). src rows lds apart,
/// dst rows ldd apart.
void scatter_rows(const float* src, int64_t lds, const int64_t* pairs, int64_t n, float* dst, int64_t ldd, int64_t cols,
                  void* stream = nullptr);

/// x[t][i] += y[t][i] for t < n_rows, i < cols (exact fp32 adds); rows ldx / ldy apart.
void add_rows(float* x, int64_t ldx, const float* y, int64_t ldy, int64_t cols, int64_t n_rows, void* stream = nullptr);

/// Splits qwen3next's gated query projection: qg [2 * head_dim * n_head, T] (per token and head
/// [q(head_dim), gate(head_dim)]) into q and gate, each [head_dim * n_head, T] contiguous.
void split_q_gate(const float* qg, int64_t T, int n_head, int head_dim, float* q, float* gate, void* stream = nullptr);

/// x[i] *= 1 / (1 + expf(-gate[i])) for i < n (the gated attention output).
void sigmoid_mul(float* x, const float* gate, int64_t n, void* stream = nullptr);

/// out[t][i] += (1 / (1 + expf(-s[t]))) * y[t][i] for t < T, i < cols (qwen3next's shared
/// expert with its scalar gate). s: T floats; out rows ldo apart, y rows ldy apart.
void gated_accumulate(float* out, int64_t ldo, const float* y, int64_t ldy, const float* s, int64_t cols, int64_t T,
                      void* stream = nullptr);

/// out[t][i] = sum over k = 0..K-1, in that order, of w[t*K + k] * eo[t*K + k][i], starting
/// from 0 (each product rounded, then added: the CPU backend's loop). eo rows lde apart, out
/// rows ldo apart, w: T*K floats. With pub_words > 0 the launch also copies pub_words int32
/// words from pub_src (device) to pub_dst (host memory the device can write: pinned, under
/// unified addressing) after its dependency wait, so that the words are on the host once the
/// stream is synchronized (a layer's routing results, without a copy node in the stream).
/// Throws CudaError for a bad shape, null publish pointers, or a publish with T or cols 0.
void moe_combine(const float* eo, int64_t lde, const float* w, int K, int64_t T, float* out, int64_t ldo, int64_t cols,
                 void* stream = nullptr, const int32_t* pub_src = nullptr, int32_t* pub_dst = nullptr,
                 int64_t pub_words = 0);

}  // namespace strata::cuda
