#pragma once
// The CPU backend: backend::Backend over host memory, the thread pool and the SIMD kernels of
// src/backend/cpu (matmul over threads, attention, gated delta net, SwiGLU FFN). Every call
// runs synchronously on the calling thread and the pool, except expert_ffn: those calls are
// queued and run together, as one pool loop over the pieces of all the queued experts
// (expert_batch.h), at flush() or at the next call of any other method (record, synchronize,
// download, any compute call: so events are always complete when made, and the step's
// one flush per layer is what batches a layer's experts). Until then the caller keeps the
// expert's weights (its arena slot) and the rows of h alive and unchanged, as for any
// asynchronous backend (backend.h).
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/expert_batch.h"
#include "backend/cpu/kernels/kernels.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/thread_pool.h"

namespace strata::cpu {

/// Settings of one CPU backend instance.
struct CpuOptions {
  int n_threads = 1;              ///< compute threads (>= 1)
  kernels::KernelConfig kernels;  ///< kernel family and activation mode (resolved: kernels::resolve_kernels)
};

/// A weight tensor as a row matrix for the CPU kernels (rows = ne[1]*ne[2]*ne[3], cols = ne[0]).
MatrixRef as_matrix(const backend::Tensor& t);

class CpuBackend final : public backend::Backend {
 public:
  explicit CpuBackend(const CpuOptions& opts);
  ~CpuBackend() override;

  ThreadPool& pool() { return pool_; }
  /// The kernel family and activation mode of this instance.
  const kernels::KernelConfig& kernels() const { return kc_; }

  backend::BackendInfo info() const override;
  std::unique_ptr<backend::Buffer> alloc(backend::BufferRole role, size_t bytes) override;
  backend::Tensor weights(const backend::Tensor& host) override { return host; }
  void upload(const backend::Tensor& dst, const void* src, size_t bytes) override;
  void download(void* dst, const backend::Tensor& src, size_t bytes) override;
  void copy(const backend::Tensor& dst, const backend::Tensor& src, size_t bytes) override;
  backend::EventPtr record() override;
  /// Runs the queued expert_ffn calls (if any) before returning.
  void synchronize() override { flush(); }
  /// Runs the queued expert_ffn calls now, in one pool loop (expert_batch.h); nothing when the
  /// queue is empty. Rethrows what a kernel threw (the queue is emptied either way).
  void flush() override;
  /// expert_ffn calls queued and not yet run.
  size_t queued_experts() const { return queue_.size(); }
  void set_loop_profiling(bool on) override { pool_.set_profiling(on); }
  backend::LoopProfile loop_profile() const override { return pool_.loop_profile(); }
  std::unique_ptr<backend::ArenaMemory> make_arena(size_t n_slots, size_t slot_bytes, int io_threads) override;

  void embed(const backend::Tensor& table, std::span<const int32_t> ids, const backend::Tensor& x) override;
  void rms_norm(const backend::Tensor& x, const backend::Tensor& w, float eps, const backend::Tensor& y) override;
  void add(const backend::Tensor& x, const backend::Tensor& y) override;
  void matmul(const backend::Tensor& W, const backend::Tensor& x, const backend::Tensor& y) override;
  void attention(const backend::AttentionSpec& spec, const backend::AttentionWeights& w, const backend::KvCache& kv,
                 int64_t pos0, const backend::Tensor& h, const backend::Tensor& out) override;
  void mla_attention(const backend::MlaSpec& spec, const backend::MlaWeights& w, const backend::Tensor& cache,
                     int64_t pos0, const backend::Tensor& h, const backend::Tensor& out) override;
  void gated_delta_net(const backend::GdnSpec& spec, const backend::GdnWeights& w, const backend::RecurrentState& state,
                       const backend::Tensor& h, const backend::Tensor& out) override;
  void ffn(const backend::FfnCall& call, const backend::FfnWeights& w, const backend::Tensor& h,
           const backend::Tensor& out) override;
  void router_logits(const backend::Tensor& w, const backend::Tensor& h, std::vector<float>& logits) override;
  /// Backend::route's host form, with the selection's tokens spread over this backend's pool
  /// (select_experts' TokenRanges form; the same bits) instead of threads of its own.
  void route(std::span<const backend::RouteCall> calls, const backend::Tensor& h) override;
  /// Queues the expert (backend::Backend::expert_ffn; run at flush()). Throws
  /// std::invalid_argument at once for shapes that do not agree (gate/up ne {n_embd, n_ff} with
  /// n_embd = h's columns, down ne {n_ff, out's columns}, biases of those lengths) or a pair
  /// outside h or expert_out. A call that would write a row a queued call writes, or whose rows
  /// overlap a queued call's input, flushes the queue first (so the results are those of
  /// running the calls one by one).
  void expert_ffn(const backend::FfnSpec& spec, const backend::ExpertJob& job, int top_k, const backend::Tensor& h,
                  const backend::Tensor& expert_out) override;
  void moe_combine(const backend::Routing& routing, const backend::Tensor& expert_out,
                   const backend::Tensor& out) override;

 private:
  ThreadPool pool_;
  kernels::KernelConfig kc_;
  std::vector<ExpertCall> queue_;   // expert_ffn calls not yet run
  ExpertBatchScratch batch_;        // their scratch, reused across flushes
  std::vector<uint8_t> written_;    // rows of queue_'s out tensor that a queued call writes
  GrowBuffer<float> ffn_scratch_;   // ffn(accumulate) without a gate: the FFN's rows before the add
};

}  // namespace strata::cpu
