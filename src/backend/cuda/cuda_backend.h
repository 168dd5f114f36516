#pragma once
// The CUDA backend: backend::Backend on one GPU with the kernels of src/backend/cuda.
//
// Memory: weights, activations, per-sequence state and the expert arena live in device memory
// (cudaMalloc; activations stream-ordered with cudaMallocAsync); staging buffers are pinned
// host memory (cudaHostAlloc, pageable with a warning when pinning fails). Every compute call
// is queued on one compute stream and returns before it runs; only download(), router_logits()
// and route() (the routing decisions of the MoE cut), Event::wait() and synchronize() wait for
// the device.
// Small host arrays a call needs (token ids, (token, k) pairs, positions, routing weights) go
// through a pinned upload ring on the same stream.
//
// The expert arena (make_arena): slot memory on the device, one pinned staging buffer of
// slot_bytes per IO thread, and one copy stream per IO thread. land() copies the piece from
// the thread's staging to the slot on its copy stream and waits for that copy only, so the IO
// thread blocks and the compute stream does not; the stream's wait() returns after land(), so
// kernels queued afterwards see the bytes. Slot reuse waits on the last-use event (release()).
//
// Numerics: the per-element arithmetic of every kernel is fixed by that element's own inputs
// (kernels.h, backend_kernels.h), so results are independent of the prompt chunk, the arena
// size and IO timing (batch invariance), as on the CPU. Against the CPU backend with fp32
// activations the results differ by accumulation order (matmul lanes, attention's online
// softmax) and CUDA's expf (<= 2 ulp): see tests/test_cuda_backend.cpp for the tolerances.
//
// This header includes no CUDA header.
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/env_switch.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/route.h"

namespace strata::cuda {

/// Settings of one CUDA backend instance.
struct CudaOptions {
  int device = 0;  ///< CUDA device ordinal (cudaSetDevice)
  /// --act-quant q8: matmuls of the weight types the q8 path takes (cuda::has_q8: Q8_0) quantize
  /// their activations to int8 (cuda::quantize_q8) and run cuda::matmul_q8 / grouped_matmul_q8;
  /// the other types keep the exact fp32-activation paths. false: every matmul has fp32 activations.
  bool act_q8 = false;
  /// route() selects on the host (backend::Backend::route: all logits downloaded) instead of on
  /// the device; also set by the environment variable STRATA_CUDA_HOST_ROUTE=1. For before /
  /// after measurements and tests (docs/cuda.md "Routing on the device").
  bool host_route = false;
};

/// Shared by the backend, its buffers and its arenas: the device, the compute stream (a
/// cudaStream_t), and the stream-ordered allocator's release. Destroyed by the last holder, so a
/// buffer that outlives the backend is still freed correctly.
struct CudaContext;
/// Per-call device timings (STRATA_CUDA_PROFILE); defined in cuda_backend.cpp.
class OpProfile;

class CudaBackend final : public backend::Backend {
 public:
  /// Opens device `opts.device`. Throws CudaError when there is no such device.
  explicit CudaBackend(const CudaOptions& opts);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  /// Free and total device memory in bytes (cudaMemGetInfo).
  void mem_info(size_t& free_bytes, size_t& total_bytes) const;
  /// Launches the queued expert jobs now (flush_experts); see backend::Backend::flush.
  void flush() override { flush_experts(); }
  /// Bytes of device memory held by resident weights (weights()).
  size_t weight_bytes() const { return weight_bytes_; }
  int device() const { return device_; }

  backend::BackendInfo info() const override;
  std::unique_ptr<backend::Buffer> alloc(backend::BufferRole role, size_t bytes) override;
  /// Copies the tensor's rows (rows() x nb[1] bytes) to the device; the result keeps type, shape
  /// and strides, place Device. Throws CudaError naming the type for a weight type the kernels
  /// cannot take, and when the memory is not there.
  backend::Tensor weights(const backend::Tensor& host) override;
  void upload(const backend::Tensor& dst, const void* src, size_t bytes) override;
  void download(void* dst, const backend::Tensor& src, size_t bytes) override;
  void copy(const backend::Tensor& dst, const backend::Tensor& src, size_t bytes) override;
  backend::EventPtr record() override;
  void synchronize() override;
  std::unique_ptr<backend::ArenaMemory> make_arena(size_t n_slots, size_t slot_bytes, int io_threads) override;

  void embed(const backend::Tensor& table, std::span<const int32_t> ids, const backend::Tensor& x) override;
  void rms_norm(const backend::Tensor& x, const backend::Tensor& w, float eps, const backend::Tensor& y) override;
  void add(const backend::Tensor& x, const backend::Tensor& y) override;
  void add_rms_norm(const backend::Tensor& x, const backend::Tensor& y, const backend::Tensor& w, float eps,
                    const backend::Tensor& out) override;
  void matmul(const backend::Tensor& W, const backend::Tensor& x, const backend::Tensor& y) override;
  void attention(const backend::AttentionSpec& spec, const backend::AttentionWeights& w, const backend::KvCache& kv,
                 int64_t pos0, const backend::Tensor& h, const backend::Tensor& out) override;
  /// MLA in the absorbed form over the latent cache (backend::MlaSpec), as the CPU backend's
  /// mla_attention_block: the same projections, norms, rotations and per-head k_b / v_b products,
  /// attention of all heads over the one shared latent "KV head" of kv_lora_rank + n_rot dims.
  /// Requires kv_lora_rank + n_rot = 576 (DeepSeek V2/V3, Kimi K2) or a multiple of 32 up to 256
  /// (cuda::attention's head sizes); CudaError otherwise.
  void mla_attention(const backend::MlaSpec& spec, const backend::MlaWeights& w, const backend::Tensor& cache,
                     int64_t pos0, const backend::Tensor& h, const backend::Tensor& out) override;
  void gated_delta_net(const backend::GdnSpec& spec, const backend::GdnWeights& w, const backend::RecurrentState& state,
                       const backend::Tensor& h, const backend::Tensor& out) override;
  void ffn(const backend::FfnCall& call, const backend::FfnWeights& w, const backend::Tensor& h,
           const backend::Tensor& out) override;
  void router_logits(const backend::Tensor& w, const backend::Tensor& h, std::vector<float>& logits) override;
  /// Each call's router matmul, its bias and the selection (cuda::select_topk, route.h) on the
  /// device, queued together; one synchronization for all, one download per call of [T] status +
  /// [T][top_k] ids (ids_only) or of ids, probs, weights and next_prob. The ids and weights equal
  /// the host selection's as route.h states (bit for bit where the probabilities do; probs within
  /// 8 ulp, weights within 16 ulp otherwise). All calls go to the host selection
  /// (backend::Backend::route) with host_route, when one has a spec the host rejects (so the error
  /// is the host's), n_expert > kMaxRouteExperts or a group limit over more than kMaxRouteGroups
  /// groups. Throws std::invalid_argument as select_experts does, for the same token, when a
  /// token's logits are defective (backend::router_logits_defect).
  void route(std::span<const backend::RouteCall> calls, const backend::Tensor& h) override;
  using backend::Backend::route;
  void expert_ffn(const backend::FfnSpec& spec, const backend::ExpertJob& job, int top_k, const backend::Tensor& h,
                  const backend::Tensor& expert_out) override;
  void moe_combine(const backend::Routing& routing, const backend::Tensor& expert_out,
                   const backend::Tensor& out) override;
  /// The layer with nothing on the host between router and experts (backend::Backend::
  /// moe_on_device): the router matmul and select_topk (as route()), a kernel that writes one
  /// grouped-matmul job per (token, k) pair from the ids (route.h PairJobs, in select_topk's launch, from the
  /// layer's expert table uploaded once per DeviceMoeCall key), the grouped gate/up and down
  /// launches of flush_experts (q8 or fp32 as it would choose) with the down rows landing straight
  /// in c.expert_out, and moe_combine with the device weights; then the RouteOut arrays (status,
  /// ids, probs, weights, next_prob: route.h's layout) to a pinned landing area of the layer. One job per pair computes each element with the same
  /// arithmetic as one job per expert (kernels.h: a grouped matmul's element does not depend on
  /// n_tok or the other jobs), so the results are flush_experts' bits. Null (nothing queued) when
  /// route() would select on the host (host_route, a router it does not take), T * top_k >
  /// kDeviceMoeMaxPairs without q8 activations or 8-byte aligned experts (the grouped GEMM that
  /// moe_grouped_on_device needs), the activation is not plain SwiGLU, an expert has biases, or the experts are not one grouped launch's types and
  /// shapes; STRATA_CUDA_HOST_MOE=1 turns it off (comparisons).
  const int32_t* moe_on_device(const backend::DeviceMoeCall& c) override;
  /// (token, k) pairs moe_on_device runs as one job per pair (a decode step of 8 tokens at top-8);
  /// more are grouped by expert on the device (moe_grouped_on_device).
  static constexpr int64_t kDeviceMoeMaxPairs = 64;
  /// Layers moe_on_device has taken since construction (tests, diagnostics).
  uint64_t device_moe_layers() const { return device_moe_layers_; }

 private:
  /// Queues call c's router matmul (+ bias) on h into `logits` (device, [T][n_expert]) and
  /// select_topk into `ro`: one route_fused launch where it takes them (fused_route_, an F32
  /// router, T <= kFusedRouteMaxTokens: the same bits), else cuda::matmul, add_bias, select_topk.
  void launch_route(const backend::RouteCall& c, const backend::Tensor& h, float* logits, const RouteOut& ro,
                    const PairJobs* jobs = nullptr);
  /// moe_on_device's expert table of one (owner, layer): device pointers [n_expert][3] and the
  /// launch shapes; ok = false when the layer's experts cannot take that path (cached too).
  struct DeviceMoeTable {
    uint64_t generation = 0;
    bool ok = false;
    DeviceBuffer ptrs;
    int n_expert = 0;
    int64_t E = 0, F = 0;
    GgmlType gate_type = GgmlType::F32, down_type = GgmlType::F32;
    size_t gate_rb = 0, down_rb = 0;
    bool q8 = false;
    // prefill's grouped launches (moe_grouped_on_device): the q8 GEMM where every expert's rows
    // of that projection are 8-byte aligned, else the mat-vec (32-bit word loads when 4-aligned,
    // 16-byte staging when 16-aligned)
    bool gemm_gu = false, gemm_dn = false, words = false, vec16_gu = false, vec16_dn = false;
    GroupedMatmulPlan pgu, pdn;  // for one job; blocks = per job
  };
  std::map<std::pair<const void*, int>, DeviceMoeTable> moe_tables_;
  const DeviceMoeTable& moe_table(const backend::DeviceMoeCall& c);
  /// moe_on_device for more than kDeviceMoeMaxPairs pairs (prefill): route, group the pairs by
  /// expert on the device (group_pairs), then flush_experts' gather, q8 GEMMs, scatter and
  /// combine with one job per expert, as flush_experts would run them (the same bits).
  void moe_grouped_on_device(const backend::DeviceMoeCall& c, const backend::RouteCall& rc, const DeviceMoeTable& tb,
                             const RouteOut& ro, int64_t T, int K);
  /// The pinned landing area of layer `layer`'s RouteOut arrays (at least n 4-byte words): one
  /// allocation per layer, kept across calls, so growing one never moves another's (the step
  /// reads every layer's after the token's synchronization).
  int32_t* moe_landing(int layer, size_t n);
  struct MoeLanding {
    int32_t* p = nullptr;
    bool pinned = false;
    size_t words = 0;
    int32_t* dev = nullptr;  // p as the device addresses it (pinned, unified addressing); null: copy
  };
  std::vector<MoeLanding> moe_host_;
  bool host_moe_ = false;  // STRATA_CUDA_HOST_MOE=1
  uint64_t device_moe_layers_ = 0;
  void* stream() const;
  /// cuda::matmul, or with act_q8_ and a has_q8 type: quantize_q8 of x into the q8 scratch, then
  /// cuda::matmul_q8 (same arguments as cuda::matmul, on the compute stream).
  void mm(GgmlType type, const void* W, size_t row_bytes, int64_t rows, int64_t cols, const float* x, int64_t ldx,
          int64_t n_tok, float* y, int64_t ldy, void* stream);
  /// Device scratch of at least `bytes` for the activation codes and scales of the q8 path, apart
  /// from scratch() (whose buffers hold the fp32 inputs being quantized); grown stream-ordered.
  char* q8_scratch(size_t bytes);
  /// int8 codes [cols, n_tok] and one fp32 scale per 32 (quantize_q8) of an activation matrix.
  struct Q8Act {
    int8_t* q = nullptr;
    float* d = nullptr;
  };
  /// Quantizes x ([cols, n_tok], rows ldx floats apart) into q8_scratch on stream `st` (valid
  /// until the next q8_scratch user): the input of one or more matmul_q8 calls.
  Q8Act quantize_act(const float* x, int64_t ldx, int64_t cols, int64_t n_tok, void* st);
  /// The q8 scratch of a grouped SwiGLU over n rows: codes / scales of its [E, n] input (xq, xd)
  /// and of its [F, n] activation (aq, ad), carved from q8_scratch (valid until its next user).
  struct Q8Ffn {
    int8_t* xq;
    float* xd;
    int8_t* aq;
    float* ad;
  };
  Q8Ffn q8_ffn_scratch(int64_t n, int64_t E, int64_t F);
  /// Points a.part at the persistent partial-state buffer (grown as needed) when the call splits
  /// its KV segments and needs at most 64 MiB (decode, small chunks): no allocation per call.
  void attention_part(AttentionArgs& a);
  /// Device scratch of at least `bytes` for the current call (grown stream-ordered; reused by
  /// the next call, which the stream orders after this one).
  char* scratch(size_t bytes);
  /// Queues a copy of `bytes` host bytes to device `dst` on the compute stream through the
  /// pinned ring; `src` may be reused when it returns.
  void upload_async(void* dst, const void* src, size_t bytes);
  /// The device copy of `rope`'s inv_freq table (doubles), uploaded once per spec.
  const double* inv_freq(const backend::RopeSpec& rope);
  void swiglu_ffn(const backend::FfnWeights& w, const float* h, int64_t ldh, int64_t T, float* out, int64_t ldo,
                  char* scratch_base);
  /// Runs the queued expert jobs (expert_ffn of tensor-core types) as one gather, one grouped
  /// gate/up SwiGLU launch, one grouped down launch and one scatter. Every other public call
  /// flushes first, so the stream's order of work is the order of the calls (an event recorded
  /// after expert_ffn covers its kernels).
  void flush_experts();
  /// The q8 down projection of a MoE layer's n pair rows (codes aq, scales ad, in expert order)
  /// into their (token, k) rows of out (rows ldo apart; row pairs[j] gets x row j): the GEMM plan
  /// stores there directly (grouped_matmul_q8's y_rows), the mat-vec plan writes y (n x E scratch)
  /// and scatters it. prof_tokens: the tokens the profile counts for the call.
  void grouped_down_q8_to_pairs(const GroupedMatmulPlan& plan, GgmlType type, const GroupedMatmulJob* jobs, int n_jobs,
                                size_t row_bytes, int64_t E, int64_t F, const int8_t* aq, const float* ad,
                                const int64_t* pairs, int64_t n, float* y, float* out, int64_t ldo,
                                int64_t prof_tokens);

  /// Experts queued per flush at most. The scratch is bounded by the chunk's T * top_k pairs
  /// anyway; a layer starts early through flush(), which the step calls before it blocks on a
  /// missing expert. 128 (was 32): a 128-expert layer with every expert resident runs as one
  /// grouped launch per projection.
  static constexpr int kMaxPendingExperts = 128;
  struct PendingExpert {
    const void* gate;
    const void* up;
    const void* down;
    std::vector<int64_t> pairs;
  };
  /// What the queued jobs share (a flush happens when a job differs).
  struct PendingGroup {
    const float* h = nullptr;
    int64_t ldh = 0;
    float* out = nullptr;
    int64_t ldo = 0;
    int top_k = 0;
    int64_t E = 0, F = 0;
    GgmlType gate_type = GgmlType::F32, down_type = GgmlType::F32;
    size_t gate_rb = 0, down_rb = 0;
  };
  std::vector<PendingExpert> pending_;
  PendingGroup pend_;

  int device_ = 0;
  std::shared_ptr<CudaContext> ctx_;
  std::vector<DeviceBuffer> weights_;  // device copies made by weights()
  size_t weight_bytes_ = 0;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  bool act_q8_ = false;  // CudaOptions::act_q8
  void* q8_scratch_ = nullptr;
  size_t q8_scratch_bytes_ = 0;
  void* attn_part_ = nullptr;  // split-KV attention's partial states (AttentionArgs::part), grow-only
  size_t attn_part_bytes_ = 0;
  uint8_t* ring_ = nullptr;  // pinned upload ring (or pageable when pinning failed)
  bool ring_pinned_ = false;
  size_t ring_bytes_ = 0, ring_off_ = 0;
  std::map<const backend::RopeSpec*, DeviceBuffer> inv_freq_;
  /// Device copies of RouterSpec::selection_bias, keyed by the host vector's data and checked
  /// against a host copy of its values on every use (route()).
  struct BiasCopy {
    std::vector<float> host;
    DeviceBuffer dev;
  };
  std::map<const float*, BiasCopy> sel_bias_;
  const float* selection_bias(const std::vector<float>& bias);
  bool host_route_ = false;
  /// launch_route's one-launch decode routing (cuda::route_fused) for an F32 router and T <=
  /// kFusedRouteMaxTokens; STRATA_CUDA_FUSED_ROUTE=0 turns it off (the router matmul and
  /// select_topk as two launches: the same bits, for before/after timings).
  bool fused_route_ = true;
  /// route_fused's block counter (one unsigned, zeroed at construction; every launch leaves it 0).
  DeviceBuffer route_counter_;
  /// The last route()'s first full RouteOut (status, ids, probs, weights, next_prob) on the
  /// device, and its weights as downloaded (empty: none valid); moe_combine reads the device
  /// weights when the Routing it is given has these weights.
  DeviceBuffer route_dev_;
  std::vector<float> route_w_;
  int route_k_ = 0;
  std::vector<uint8_t> upload_stage_;  // flush_experts' one upload
  uint8_t* route_host_ = nullptr;  // pinned landing buffer of route()'s download
  bool route_host_pinned_ = false;
  size_t route_host_bytes_ = 0;
  /// STRATA_CUDA_PROFILE=1: per-call device time (CUDA events around each call) and host
  /// waits, printed to stderr when the backend is destroyed (docs/cuda.md "Profile"); null when off.
  std::unique_ptr<OpProfile> prof_;
  /// STRATA_CUDA_HOST_TIMES=1 (any value but 0): each synchronize / download sync prints the host time since the
  /// previous sync ended (enqueueing) and the time it waited (stderr), to tell a host-bound
  /// decode from a device-bound one.
  void note_sync(std::chrono::steady_clock::time_point t0);
  bool host_times_ = detail::on_if_set(std::getenv("STRATA_CUDA_HOST_TIMES"));
  std::chrono::steady_clock::time_point sync_last_{};
  friend class ProfScope;
};

// ---- memory reporting and the pinned host-to-device probe ----

/// Bytes of page-locked host memory this process holds through strata::cuda (staging buffers,
/// the upload ring, the expert stream's host tier when it is pinned); pageable fallbacks are not
/// counted. Thread-safe.
size_t pinned_host_bytes() noexcept;

/// Free and total memory of device `device` in bytes (cudaMemGetInfo). Throws CudaError.
void device_mem_info(int device, size_t& free_bytes, size_t& total_bytes);

/// What measure_h2d measured.
struct H2dProbe {
  size_t bytes = 0;     ///< bytes per copy
  int reps = 0;         ///< timed copies
  double seconds = 0;   ///< device time of the timed copies (CUDA events)
  double gbps = 0;      ///< bytes * reps / seconds / 1e9
  bool pinned = false;  ///< the host buffer was pinned (false: pinning failed, pageable with a warning)
};

/// The peak of host-to-device copies from pinned memory: one `bytes` buffer copied `reps` times
/// to device `device` on one stream (after one untimed copy), timed with CUDA events (`strata
/// ssdbw` prints it; `strata bench` uses it for the host tier's IO floor). Throws
/// std::invalid_argument for bytes == 0 or reps < 1, CudaError (naming the sizes) when the
/// device memory is not there.
H2dProbe measure_h2d(int device, size_t bytes, int reps);

}  // namespace strata::cuda
