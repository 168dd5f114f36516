#pragma once
// A layer's routed experts in one pool loop (issue 18, item 3 "threading that scales").
//
// The step hands the backend one expert_ffn call per resident expert (src/model/step.cpp) and
// calls flush() before it blocks on a miss and record() at the end of the layer. The CPU
// backend queues the calls and runs them here, all at once: one ThreadPool::parallel_for over
// work items of four stages, each item a piece of one expert,
//
//   0  gather   tokens [a, b) of the expert's rows of h into its x, quantized (q8 mode)
//   1  gate/up  rows [a, b) of gate AND up for all the expert's tokens, + biases, then the
//               activation (SwiGLU or gpt-oss's clamped one) of those columns
//   2  quantize tokens [a, b) of the activation for down (q8 mode only; no items otherwise)
//   3  down     rows [a, b) of down for all the expert's tokens, + bias, copied into the
//               (token, k) rows of expert_out
//
// listed stage by stage (all stage-0 items of every expert, then all stage-1 items, ...), the
// experts in decreasing token count within a stage. An item waits (condition variable) until
// the earlier stages of its own expert are done, not for the other experts: there is no
// barrier between stages. Items are handed out in list order and wait only on items before
// them, which are already running, so this cannot deadlock (with one thread they run in order).
//
// Pieces are sized by work (tokens x rows): rows per piece = the stage's MACs / (threads x 8)
// over the expert's tokens x columns, rounded up to 8 rows, at most 128 KiB of weights per matrix
// (so a piece's weights stay in L2 while its token blocks pass) and at least 8 rows. With 16
// or 64 threads a layer of 128 experts at 32 tokens each gives ~1500 gate/up and ~4000 down
// pieces; a decode step (8 experts, 1 token) ~400 and ~500 at 64 threads.
//
// Bits: every (row, token) output is computed by the same kernel call arithmetic as one
// cpu::matmul per projection (kernels::matmul / matmul_q8 are invariant to the row range and
// to the other tokens; the activations are quantized per token with the projection's lane
// order, as cpu::matmul does), and biases and activations are the same fp32 operations per
// element, so the results do not depend on how many experts share a flush, on the thread count
// or on the order the items run in (tests/test_expert_batch.cpp).
#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernels/kernels.h"
#include "backend/cpu/thread_pool.h"

namespace strata::cpu {

/// One queued expert_ffn call: backend::Backend::expert_ffn's arguments, with the (token, k)
/// pairs copied (the caller's span may die before the flush).
struct ExpertCall {
  backend::FfnSpec spec;
  backend::FfnWeights w;       ///< gate, up: ne {n_embd, n_ff}; down: ne {n_ff, n_embd}; biases F32 or empty
  std::vector<int64_t> pairs;  ///< (token, k) as t * top_k + k; rows of `out`
  int top_k = 1;
  backend::Tensor h;    ///< fp32 ne {n_embd, T}: row pairs[j] / top_k is the j-th token's input
  backend::Tensor out;  ///< fp32 ne {n_embd, T * top_k}: row pairs[j] receives the j-th result
};

/// Scratch of run_expert_batch, kept by the caller between flushes (buffers only grow).
struct ExpertBatchScratch {
  GrowBuffer<float> x, g, u;  ///< per call: inputs (then down's outputs), gate, up (then the activation)
  std::vector<std::unique_ptr<kernels::ActQ8>> act_x, act_h;  ///< q8 activations of x and of the activation
};

/// Runs `calls` (any number, any mix of shapes and types) in one pool loop, as the file comment
/// says: for every call c and pair j, row c.pairs[j] of c.out = down(act(gate x + bg, up x + bu))
/// + bd with x = row c.pairs[j] / c.top_k of c.h, the bits one cpu::matmul per projection gives.
/// Preconditions (checked by CpuBackend::expert_ffn when it queues a call): shapes agree, no two
/// calls write the same out row, no call's out overlaps a call's h. Throws what the kernels throw
/// (std::runtime_error for an unsupported type); an exception in one item stops the loop and is
/// rethrown after every thread stopped (outputs then partly written).
void run_expert_batch(ThreadPool& pool, const kernels::KernelConfig& kc, std::span<const ExpertCall> calls,
                      ExpertBatchScratch& scratch);

/// The work items run_expert_batch would make for `calls` on `n_threads` threads, per stage
/// (gather, gate/up, quantize, down), so that tests and docs can check the split keeps many
/// threads busy. No compute.
std::array<int64_t, 4> expert_batch_items(const kernels::KernelConfig& kc, std::span<const ExpertCall> calls,
                                          int n_threads);

}  // namespace strata::cpu
