#pragma once
// The backend interface: what an architecture's forward pass asks of the machine it runs on.
//
// Block-level, in the spirit of ggml-backend's split between memory (buffers by role),
// transfers and synchronization (upload, download, events) and compute, but without a graph:
// in every MoE layer the host must stand between the router and the expert matmuls (the cut:
// the routed ids decide which expert reads are urgent and which slots are pinned), and the
// next layer's read-ahead must leave for the IO threads before this layer's experts run. So
// the boundary is one call per block, and a device backend queues its kernels asynchronously
// and only routing decisions cross back to the host each layer (docs/architecture.md).
//
// Conventions: a Tensor is a non-owning view with a ggml type, a shape in ggml `ne` order
// (ne[0] is the contiguous dimension: the columns of a weight matrix, the features of an
// activation row) and byte strides nb[] (nb[0] = element or block size, nb[1] = row stride).
// Activations are fp32 rows of [T][n_embd] (ne = {n_embd, T}). Weight matrices W with
// `rows` output features and `cols` input features are ne = {cols, rows} and y = x W^T.
// Every compute call computes each token's result from that token's inputs only, in an order
// that does not depend on how many tokens share the call (batch invariance: results do not
// depend on prompt chunking, arena size, IO timing or thread count).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"

namespace strata::backend {

/// Where a tensor's bytes live: host memory, or the memory of the backend's device.
enum class Place : uint8_t { Host, Device };

/// What a buffer holds; a backend may place roles differently (e.g. a GPU backend keeps weights,
/// activations, state and the arena in device memory and staging in pinned host memory).
enum class BufferRole : uint8_t {
  Weights,      ///< resident (dense) weights
  Activations,  ///< per-call scratch: hidden states, projections, expert outputs
  State,        ///< per-sequence state: KV cache, recurrent state (zero-initialized)
  Arena,        ///< the expert arena's slots
  Staging,      ///< host memory that reads land in before a copy to the device
};

/// A non-owning view of a tensor. Shape in ggml `ne` order (ne[0] contiguous); nb[] in bytes.
struct Tensor {
  GgmlType type = GgmlType::F32;
  int64_t ne[4] = {0, 1, 1, 1};
  size_t nb[4] = {0, 0, 0, 0};
  void* data = nullptr;
  Place place = Place::Host;

  /// `rows` rows of `cols` elements of type `t`, `row_bytes` apart (a weight matrix or a
  /// block of activation rows). nb[0] is the type's block size in bytes (ggml's convention).
  static Tensor matrix(GgmlType t, const void* data, int64_t cols, int64_t rows, size_t row_bytes,
                       Place place = Place::Host);
  /// Contiguous fp32 rows: ne = {cols, rows}, nb[1] = cols * 4 bytes.
  static Tensor f32(float* data, int64_t cols, int64_t rows = 1, Place place = Place::Host);

  bool empty() const { return data == nullptr; }
  int64_t cols() const { return ne[0]; }
  /// ne[1] * ne[2] * ne[3]: the number of rows of ne[0] elements.
  int64_t rows() const { return ne[1] * ne[2] * ne[3]; }
  size_t row_bytes() const { return nb[1]; }
  /// Elements in all.
  int64_t numel() const { return ne[0] * rows(); }
  /// Rows [r0, r0 + n) of a 2-D view (same type, stride and place).
  Tensor rows_view(int64_t r0, int64_t n) const;
  /// fp32 data (precondition: type F32). Host pointer only when place == Host.
  float* f() const { return static_cast<float*>(data); }
  /// fp32 row r (precondition: type F32, r < rows()).
  float* row(int64_t r) const { return reinterpret_cast<float*>(static_cast<char*>(data) + size_t(r) * nb[1]); }
};

/// Memory owned by a backend. Tensors are views into it.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual BufferRole role() const = 0;
  virtual Place place() const = 0;
  virtual void* data() = 0;
  virtual size_t bytes() const = 0;
  /// True for page-locked (CUDA pinned) host memory; false for pageable host memory (also a
  /// failed pin that fell back to pageable) and for device memory.
  virtual bool pinned() const { return false; }
  /// fp32 rows [cols x rows] starting `offset_bytes` into the buffer (precondition: fits).
  Tensor f32(int64_t cols, int64_t rows, size_t offset_bytes = 0);
};

/// A point in a backend's queue of work. done() when all work queued before record() finished.
/// wait() and done() may be called from any thread, also concurrently (the expert stream's IO
/// threads wait for a slot's last-use event while the compute thread polls it).
class Event {
 public:
  virtual ~Event() = default;
  /// Blocks the calling thread until the event has completed. Rethrows a device error.
  virtual void wait() = 0;
  /// True if it has completed (never blocks).
  virtual bool done() = 0;
};
using EventPtr = std::shared_ptr<Event>;

/// The expert arena's memory and how an IO thread lands a read in a slot. The stream
/// (src/stream/) owns the slot bookkeeping and the IO threads; the backend owns the memory.
///   CPU: the IO thread reads straight into the slot; land() does nothing.
///   GPU: the IO thread reads into its own pinned staging buffer, land() copies it to the device
///        slot on a copy stream and returns when the copy completed.
class ArenaMemory {
 public:
  virtual ~ArenaMemory() = default;
  virtual size_t n_slots() const = 0;
  /// Bytes per slot (a multiple of 4 KiB).
  virtual size_t slot_bytes() const = 0;
  /// Host memory (4 KiB-aligned, slot_bytes() long) into which IO thread `io_thread` reads the
  /// bytes destined for `slot`, each at its offset within the slot. Valid until land() returns.
  virtual uint8_t* read_target(size_t slot, int io_thread) = 0;
  /// Makes bytes [offset, offset + bytes) read into read_target(slot, io_thread) visible at
  /// slot_data(slot) + offset to kernels queued after it returns (offset 0: the first `bytes`).
  /// Called by that IO thread, once per piece: the stream cuts a slot's read into pieces that
  /// several IO threads read and land in parallel (offsets are multiples of 4 KiB, the ranges of
  /// one slot's pieces do not overlap). Thread-safe for distinct io_thread. Throws on a device
  /// error.
  virtual void land(size_t slot, int io_thread, size_t bytes, size_t offset = 0) = 0;
  /// Like land(), but the bytes for [offset, offset + bytes) of `slot` are at `src` in host
  /// memory the caller owns (the stream's host RAM tier; pinned or pageable), not in
  /// read_target(): a host-tier hit or fill lands without a disk read. Same threading and
  /// completion rules as land(): `src` may be reused when it returns. Default: copy `src`
  /// into read_target(slot, io_thread) + offset, then land() (the CPU's HostArena: one memcpy
  /// into the slot); a device arena copies host-to-device straight from `src`.
  virtual void land_from(size_t slot, int io_thread, const uint8_t* src, size_t bytes, size_t offset) {
    std::memcpy(read_target(slot, io_thread) + offset, src, bytes);
    land(slot, io_thread, bytes, offset);
  }
  /// One range of a slot to land from host memory: [offset, offset + bytes) from `src`.
  struct HostRange {
    const uint8_t* src = nullptr;
    size_t bytes = 0;
    size_t offset = 0;  ///< within the slot, a multiple of 4 KiB
  };
  /// True if a host-tier hit should land whole, in one land_ranges() call by one IO thread,
  /// instead of as 256 KiB pieces spread over the IO threads. A device arena says true: each
  /// land_from() is a host-to-device copy plus its synchronization, a fixed cost of several
  /// microseconds that pieces multiply (a 5 MiB expert is 20 pieces), while a host-to-device
  /// copy needs no second thread to reach the link's rate. Default false (a host arena's
  /// memcpy gains from pieces copied by several threads).
  virtual bool lands_whole() const { return false; }
  /// Lands every range of `ranges` (distinct, non-overlapping, of one slot) as land_from()
  /// would, and returns when all of them are visible to kernels queued afterwards. Default:
  /// land_from() for each in turn; a device arena queues every copy, then synchronizes once.
  /// Same threading rules as land(). Throws on a device error.
  virtual void land_ranges(size_t slot, int io_thread, std::span<const HostRange> ranges) {
    for (const HostRange& r : ranges) land_from(slot, io_thread, r.src, r.bytes, r.offset);
  }
  /// Where kernels find slot `slot` (a host or device address, as place() says).
  virtual const uint8_t* slot_data(size_t slot) const = 0;
  virtual Place place() const = 0;
};

// ---- block specifications (from the model file; constant per layer) ----------------------

/// Rotary position embedding (Su et al. 2021, "RoFormer"). inv_freq[i] = base^(-2i/n_rot), or
/// as the model file's scaling says; the host computes the table once.
struct RopeSpec {
  enum class Mode : uint8_t {
    Neox,  ///< pairs (i, i + n_rot/2) of each head (GPT-NeoX, transformers' rotate_half)
    Norm,  ///< adjacent pairs (2i, 2i+1) (the original layout; llama.cpp's "NORM")
  };
  Mode mode = Mode::Neox;
  int n_rot = 0;                 ///< rotated dimensions per head (<= head_dim, even); 0 = NoPE
  std::vector<double> inv_freq;  ///< [n_rot / 2], radians per token
  /// Factor on cos and sin of every rotated pair (YaRN's "attention factor" / mscale: it scales
  /// the rotated q and k dims, so their part of q.k by its square); 1 = a pure rotation.
  double attn_factor = 1.0;

  /// The plain table inv_freq[i] = base^(-2i/n_rot). round_to_bf16 rounds each to bfloat16,
  /// which is what transformers computes for a checkpoint loaded in bf16 (its inv_freq buffer
  /// is cast with the model): only for parity tests against such references.
  static RopeSpec standard(int n_rot, double base, Mode mode = Mode::Neox, bool round_to_bf16 = false);

  /// YaRN's NTK-by-parts frequencies (Peng et al. 2023, arXiv:2309.00071, sec. 3.2). With
  /// f = `factor`, L = `orig_ctx`, d = n_rot and the plain table p_i = base^(-2i/d):
  ///   corr(b)  = d ln(L / (2 pi b)) / (2 ln base)   (the pair index that turns b times in L)
  ///   lo, hi   = corr(beta_fast), corr(beta_slow); floor(lo), ceil(hi) when `truncate`;
  ///              then lo = max(lo, 0), hi = min(hi, d - 1)
  ///   ramp_i   = 1 - clamp((i - lo) / max(hi - lo, 0.001), 0, 1)   (1: extrapolate, 0: interpolate)
  ///   inv_freq_i = p_i / f * (1 - ramp_i) + p_i * ramp_i
  /// and attn_factor = `attn_factor` (the caller's mscale; see model/rope_scaling.h). Matches
  /// transformers' _compute_yarn_parameters (its `truncate` option) and ggml's
  /// ggml_rope_yarn_corr_dims + rope_yarn with ext_factor 1 (which always truncates).
  /// Throws std::invalid_argument for factor < 1, orig_ctx < 1, n_rot odd or < 2, base <= 1,
  /// or beta_fast <= 0 / beta_slow <= 0.
  static RopeSpec yarn(int n_rot, double base, Mode mode, double factor, double orig_ctx, double beta_fast,
                       double beta_slow, bool truncate, double attn_factor);
};

/// Grouped-query self-attention of one layer (Vaswani et al. 2017; GQA: Ainslie et al. 2023).
struct AttentionSpec {
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;       ///< per-head dimension of q, k and v
  float rms_eps = 1e-6f;  ///< epsilon of the per-head q/k RMSNorm
  const RopeSpec* rope = nullptr;
  /// attn_q rows are [n_head][q(head_dim), gate(head_dim)] and the output is multiplied by
  /// sigmoid(gate) per element before attn_output (qwen3next). False: [n_head][head_dim].
  bool q_gate = false;
  /// Attend only to the last `window` positions (0 = full causal attention).
  int64_t window = 0;
  /// Scale of q.k; 0 = 1/sqrt(head_dim).
  float scale = 0;
  /// q/k RMSNorm over the whole projection row (n_head * head_dim for q, n_head_kv * head_dim
  /// for k; attn_q_norm / attn_k_norm have that many weights) instead of per head: MiniMax-M2
  /// (transformers MiniMaxM2Attention, qk_norm_type "per_layer"; llama.cpp minimax-m2 norms
  /// Qcur/Kcur before the per-head reshape). False: per head, weights ne {head_dim}.
  bool qk_norm_full = false;
};

/// Weights of one attention layer; empty tensors are absent (no bias, no q/k norm).
struct AttentionWeights {
  Tensor wq;      ///< attn_q: ne {n_embd, n_head * head_dim (x2 if q_gate)}
  Tensor wk;      ///< attn_k: ne {n_embd, n_head_kv * head_dim}
  Tensor wv;      ///< attn_v: ne {n_embd, n_head_kv * head_dim}
  Tensor wo;      ///< attn_output: ne {n_head * head_dim, n_embd}
  Tensor q_norm;  ///< attn_q_norm: F32 ne {head_dim} (ne {n_head * head_dim} if spec.qk_norm_full), or empty
  Tensor k_norm;  ///< attn_k_norm: F32 ne {head_dim} (ne {n_head_kv * head_dim} if spec.qk_norm_full), or empty
  /// Projection biases, F32, each added to its projection's output row (y = x W^T + b; before
  /// the q/k norm and RoPE for q and k): attn_q.bias ne {rows of wq}, attn_k.bias and
  /// attn_v.bias ne {n_head_kv * head_dim}, attn_output.bias ne {n_embd}; empty = no bias
  /// (gpt-oss: transformers GptOssAttention nn.Linear(..., bias=attention_bias)).
  Tensor bq{}, bk{}, bv{}, bo{};
  /// attn_sinks: F32 ne {n_head}, one extra logit per query head in the softmax denominator,
  /// in the same units as the scaled scores (q.k * scale); it takes probability mass but has no
  /// value row: p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink_h)). Empty = none. (gpt-oss:
  /// transformers eager_attention_forward concatenates `sinks` to the scaled scores and drops
  /// that column after the softmax; llama.cpp ggml_soft_max_add_sinks.)
  Tensor sinks{};
};

/// The attention cache of one layer of one sequence: K and V rows of n_head_kv * head_dim
/// floats for positions 0..n_ctx-1 (ne = {n_head_kv * head_dim, n_ctx}).
struct KvCache {
  Tensor k, v;
};

/// Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434), computed in the absorbed form
/// over a latent cache. Per token t and head h (transformers DeepseekV3Attention; llama.cpp
/// deepseek2 with MLA tensors):
///   q[h]      = q_b(RMSNorm(q_a(x)) * q_a_norm)[h]   (or attn_q(x)[h] when q_lora_rank = 0),
///               [q_nope (n_nope) | q_pe (n_rot)]
///   [c | kpe] = kv_a_mqa(x);  c = RMSNorm(c) * kv_a_norm  (kv_lora_rank), kpe (n_rot, one for all heads)
///   q_pe, kpe rotated by `rope` (deepseek: Mode::Norm, adjacent pairs)
///   score(t, s) = scale * (q_nope[h] . k_nope[h](s) + q_pe[h] . kpe(s)), k_nope[h](s) = k_b[h] c(s)
///   out[h]    = v_b[h] sum_s softmax(score)(s) c(s);  attn_output(out)
/// Absorbed: q_nope[h] . (k_b[h] c) = (k_b[h]^T q_nope[h]) . c, so the cache holds only c and
/// kpe per token: MlaCache rows of kv_lora_rank + n_rot floats.
struct MlaSpec {
  int n_head = 0;
  int q_lora_rank = 0;    ///< attention.q_lora_rank; 0 = a plain attn_q projection
  int kv_lora_rank = 0;   ///< attention.kv_lora_rank: latent width
  int n_nope = 0;         ///< key_length_mla - rope.dimension_count: non-rotated q/k dims per head
  int n_rot = 0;          ///< rope.dimension_count: rotated q/k dims per head (and of kpe)
  int v_dim = 0;          ///< value_length_mla: value dims per head
  float rms_eps = 1e-6f;  ///< epsilon of q_a_norm and kv_a_norm
  const RopeSpec* rope = nullptr;
  float scale = 0;  ///< scale of the scores; 0 = 1/sqrt(n_nope + n_rot)
  /// Floats per cached token: [c (kv_lora_rank) | kpe (n_rot)].
  int64_t cache_dim() const { return int64_t(kv_lora_rank) + n_rot; }
};

/// Weights of one MLA layer (ggml ne order). Empty: absent.
struct MlaWeights {
  Tensor wq_a;       ///< attn_q_a: ne {n_embd, q_lora_rank} (empty when q_lora_rank = 0)
  Tensor q_a_norm;   ///< attn_q_a_norm: F32 ne {q_lora_rank}
  Tensor wq_b;       ///< attn_q_b: ne {q_lora_rank, n_head * (n_nope + n_rot)}
  Tensor wq;         ///< attn_q: ne {n_embd, n_head * (n_nope + n_rot)} (when q_lora_rank = 0)
  Tensor wkv_a;      ///< attn_kv_a_mqa: ne {n_embd, kv_lora_rank + n_rot}
  Tensor kv_a_norm;  ///< attn_kv_a_norm: F32 ne {kv_lora_rank}
  Tensor wk_b;       ///< attn_k_b: ne {n_nope, kv_lora_rank, n_head} (head h: rows = latent, cols = nope)
  Tensor wv_b;       ///< attn_v_b: ne {kv_lora_rank, v_dim, n_head} (head h: rows = v dims, cols = latent)
  Tensor wo;         ///< attn_output: ne {n_head * v_dim, n_embd}
};

/// Gated delta net (Yang, Kautz & Hatamizadeh 2024, arXiv:2412.06464), the linear-attention
/// layer of Qwen3-Next; formulas in src/backend/cpu/gated_delta_net.h.
struct GdnSpec {
  int n_k_head = 0;       ///< ssm.group_count: key (and query) heads
  int n_v_head = 0;       ///< ssm.time_step_rank: value heads (a multiple of n_k_head)
  int head_k_dim = 0;     ///< ssm.state_size: dk
  int head_v_dim = 0;     ///< ssm.inner_size / n_v_head: dv
  int conv_kernel = 0;    ///< ssm.conv_kernel: taps of the causal depthwise convolution
  float rms_eps = 1e-6f;  ///< epsilon of the gated RMSNorm
  /// Which key head value head j (0 <= j < n_v_head) reads, r = n_v_head / n_k_head:
  enum class VHeadOrder : uint8_t {
    Grouped,  ///< j / r: value heads grouped by key head, as transformers' repeat_interleave (qwen3next files)
    Tiled,    ///< j % n_k_head: llama.cpp's converter permutes Qwen3.5's value heads (of attn_qkv's v rows,
              ///< attn_gate, ssm_alpha/beta, ssm_a, ssm_dt, ssm_conv1d's v channels and ssm_out's columns) so
              ///< that ggml_repeat's tiled broadcast applies (convert_hf_to_gguf.py _LinearAttentionVReorderBase)
  };
  VHeadOrder v_head_order = VHeadOrder::Grouped;

  int64_t key_dim() const { return int64_t(n_k_head) * head_k_dim; }
  int64_t value_dim() const { return int64_t(n_v_head) * head_v_dim; }
  /// Channels of the convolution: q, k and v side by side.
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  /// Floats of the rolling convolution state: [K-1][conv_dim], oldest input first.
  int64_t conv_state_size() const { return int64_t(conv_kernel - 1) * conv_dim(); }
  /// Floats of the delta-rule state: [n_v_head][dk][dv].
  int64_t ssm_state_size() const { return int64_t(n_v_head) * head_k_dim * head_v_dim; }
};

struct GdnWeights {
  Tensor wqkv;     ///< attn_qkv: ne {n_embd, conv_dim}
  Tensor wz;       ///< attn_gate: ne {n_embd, n_v_head * dv}
  Tensor wba;      ///< ssm_ba: ne {n_embd, 2 * n_v_head}, per key head [b (r), a (r)]; or empty, then:
  Tensor wout;     ///< ssm_out: ne {n_v_head * dv, n_embd}
  Tensor conv;     ///< ssm_conv1d: F32 ne {K, conv_dim} (a channel's taps contiguous)
  Tensor dt_bias;  ///< ssm_dt.bias: F32 ne {n_v_head}
  Tensor a;        ///< ssm_a: F32 ne {n_v_head}, -exp(A_log)
  Tensor norm;     ///< ssm_norm: F32 ne {dv}
  /// Separate b and a projections (qwen35moe: HF's in_proj_b / in_proj_a), used when wba is empty.
  Tensor wbeta{};   ///< ssm_beta: ne {n_embd, n_v_head}, b per value head (beta = sigmoid(b))
  Tensor walpha{};  ///< ssm_alpha: ne {n_embd, n_v_head}, a per value head (g = softplus(a + dt_bias) * ssm_a)
};

/// The recurrent state of one gated-delta-net layer of one sequence.
struct RecurrentState {
  Tensor conv;  ///< F32 [K-1][conv_dim], oldest input first
  Tensor ssm;   ///< F32 [n_v_head][dk][dv]
};

/// A feed-forward network: SwiGLU (Shazeer 2020), out = down(silu(gate h) * up h).
struct FfnSpec {
  enum class Act : uint8_t {
    SwiGLU,  ///< act(g, u) = silu(g) * u
    /// gpt-oss's clamped SwiGLU ("swiglu_oai"): with g' = min(g, limit) and
    /// u' = clamp(u, -limit, limit), act(g, u) = g' * sigmoid(alpha * g') * (u' + 1).
    /// Sources: transformers GptOssExperts.forward (alpha 1.702, limit 7.0), llama.cpp
    /// ggml_swiglu_oai (LLM_FFN_SWIGLU_OAI_MOE, the same constants).
    SwiGluOai,
  };
  Act act = Act::SwiGLU;
  float alpha = 1.702f;  ///< SwiGluOai: slope inside the sigmoid (dimensionless)
  float limit = 7.0f;    ///< SwiGluOai: clamp bound of g (above) and u (both sides)
};

struct FfnWeights {
  Tensor gate;  ///< ffn_gate(_exps slice): ne {n_embd, n_ff}
  Tensor up;    ///< ffn_up: ne {n_embd, n_ff}
  Tensor down;  ///< ffn_down: ne {n_ff, n_embd}
  /// Biases added to each projection's output (F32; empty = none): gate and up ne {n_ff}, down
  /// ne {n_embd}. For a routed expert: row `expert` of the layer's resident
  /// ffn_{gate,up,down}_exps.bias (ne {n_ff or n_embd, n_expert}) (gpt-oss).
  Tensor gate_b{}, up_b{}, down_b{};
};

/// Options of one ffn() call.
struct FfnCall {
  FfnSpec spec;
  /// When set (ne {n_embd, 1}), each token's result is scaled by sigmoid(h . scalar_gate)
  /// (qwen3next's shared expert: ffn_gate_inp_shexp). Requires accumulate.
  Tensor scalar_gate;
  /// Add to `out` instead of overwriting it; without scalar_gate: out += ffn(h) (the ungated
  /// shared experts of deepseek2 / glm4moe, expert_shared_count).
  bool accumulate = false;
};

/// How a router turns its logits into experts and mixing weights. Steps, in order (each a no-op
/// at its default; transformers DeepseekV3TopkRouter / Glm4MoeTopkRouter, llama.cpp
/// build_moe_ffn):
///   1. p = gating(logits): softmax over all experts, or sigmoid per expert;
///   2. selection score s = p + selection_bias (selection only; the weights use p);
///   3. group limit: experts split into n_group equal groups of consecutive ids, a group
///      scores the sum of its two best s, only the n_group_used best groups compete;
///   4. top-k of s (ties: lower id first), ids in descending s;
///   5. weights = p of the selected, divided by their sum if norm_topk, times weights_scale.
struct RouterSpec {
  enum class Gating : uint8_t {
    Softmax,  ///< softmax over all experts, then top-k (qwen3moe, qwen3next; expert_gating_func 1)
    Sigmoid,  ///< sigmoid of each logit (deepseek V3, glm4moe; expert_gating_func 2)
    /// top-k of the raw logits, then softmax over the k selected only (the weights sum to 1;
    /// norm_topk has no effect). gpt-oss: transformers GptOssTopKRouter (topk, then softmax of
    /// the top values); llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT.
    SoftmaxTopK,
  };
  Gating gating = Gating::Softmax;
  int n_expert = 0;
  int top_k = 0;
  bool norm_topk = true;  ///< renormalize the selected weights to sum to 1 (expert_weights_norm)
  /// Added to the gating probabilities for selection only: blk.N.exp_probs_b.bias, fp32 [n_expert]
  /// on the host (transformers e_score_correction_bias). Empty: none.
  std::vector<float> selection_bias;
  /// expert_group_count: groups of n_expert / n_group consecutive experts (0 or 1: no groups).
  int n_group = 0;
  /// expert_group_used_count: groups whose experts may be selected (transformers topk_group).
  int n_group_used = 0;
  /// expert_weights_scale: factor on the final mixing weights (transformers routed_scaling_factor).
  float weights_scale = 1.0f;
};

/// Routing of T tokens: [T][top_k], experts by descending score (ties: lower id first).
struct Routing {
  int top_k = 0;
  std::vector<int32_t> ids;    ///< [T * top_k]
  std::vector<float> probs;    ///< gating probabilities of the selected experts (without selection bias)
  std::vector<float> weights;  ///< mixing weights (probs, renormalized if norm_topk, times weights_scale)
  /// [T]: the gating probability of the (k+1)-th candidate in selection order (0 when top_k =
  /// n_expert or none is left after the group limit). SoftmaxTopK: the (k+1)-th expert's
  /// exp(logit - max) over the selected experts' normalizer, so that probs[k-1] - next_prob is
  /// the selection margin on the same scale as the probs.
  std::vector<float> next_prob;
  int64_t n_tokens() const { return top_k ? int64_t(ids.size()) / top_k : 0; }
};

/// In-place softmax over n values (max-subtracted, sum in double): the gating of the softmax
/// routers (transformers: softmax(router_logits, dtype=float)), on the host.
void softmax(float* x, int64_t n);

/// Selects experts from router logits [T][n_expert] on the host (replaced in place by the gating
/// probabilities; left as they are for SoftmaxTopK), as `spec` says. The selection every backend shares; throws
/// std::invalid_argument for a spec it cannot apply, and for logits it cannot select from (the
/// first such token t, in token order; router_logits_defect says which).
void select_experts(const RouterSpec& spec, float* logits, int64_t T, Routing& out);

/// How select_experts spreads its tokens: calls fn(t_begin, t_end) over ranges covering [0, T)
/// once each, in any order and on any threads, returns when all are done and rethrows what fn
/// threw (a backend's thread pool; the CPU backend's ThreadPool::parallel_for). A token's
/// selection reads its own logits row and writes its own rows of the result only, so every
/// split gives the same bits. Empty: up to 8 threads of its own for T >= 512, each a range of
/// >= 256 tokens, else the calling thread.
using TokenRanges = std::function<void(int64_t T, const std::function<void(int64_t, int64_t)>& fn)>;

/// select_experts with the tokens spread by `ranges` (TokenRanges): the same result as the plain
/// form, bit for bit, and the same errors.
void select_experts(const RouterSpec& spec, float* logits, int64_t T, Routing& out, const TokenRanges& ranges);

/// What makes one token's router logits (n_expert values) unusable for `gating`: 0 = none;
/// 1 = a NaN (any gating); 2 = +inf, 3 = no finite value (Softmax and SoftmaxTopK: the softmax's
/// max-subtraction would give inf - inf). -inf is a defined input (probability 0; Sigmoid takes
/// +inf too, probability 1). Checked in this order; every backend's selection uses these codes.
int router_logits_defect(RouterSpec::Gating gating, const float* logits, int n_expert);

/// The std::invalid_argument message for defect `code` (router_logits_defect) at token `t`.
std::string router_logits_defect_message(int code, int64_t t);

/// Cache-conditional routing (MoCE; Skliar et al., "Mixture of Cache-Conditional Experts",
/// arXiv:2412.00099): experts already resident in the arena get a bonus in the *selection*
/// only. For token t with router logits l (ne {n_expert, T}, n_expert contiguous, before any
/// gating), the selection uses
///     l'[e] = l[e] + bonus * (max_e l - min_e l) * resident[e]
/// through the family's own gating, selection bias and group limit (RouterSpec steps 1-4),
/// while probs and weights come from the original l of the chosen experts, normalized as the
/// family does (step 5; SoftmaxTopK: softmax over the chosen experts' original logits). The
/// bonus is on the logits (the router's common pre-activation score for softmax, sigmoid and
/// softmax-top-k gating, as the paper's cache prior is) and in units of the token's logit range
/// (a token whose range is not finite, e.g. with a -inf logit, gets no bonus),
/// so 0.5 means the same on every family: a resident expert beats a non-resident one whose logit
/// is less than half the range higher; >= 1 puts every resident expert ahead of every other.
struct ResidencyBonus {
  float bonus = 0;                    ///< B >= 0, in units of the token's logit range; 0 = exact routing
  std::span<const uint8_t> resident;  ///< [n_expert]: 1 = in the arena now
};

/// select_experts with a residency bonus (see ResidencyBonus): identical to the plain form when
/// bonus.bonus == 0. Throws std::invalid_argument as the plain form does, and for a residency
/// span that is not n_expert long or a bonus that is negative or not finite.
void select_experts(const RouterSpec& spec, float* logits, int64_t T, Routing& out, const ResidencyBonus& bonus);

/// One router of a Backend::route call.
struct RouteCall {
  const RouterSpec* spec = nullptr;  ///< the selection (n_expert = w.rows())
  Tensor w;                          ///< ffn_gate_inp: ne {n_embd, n_expert}
  Tensor bias;                       ///< ffn_gate_inp.bias: F32 ne {n_expert}, added to the logits; or empty
  Routing* out = nullptr;            ///< the result
  /// Only out->ids are needed (the next-layer prediction): probs, weights and next_prob may be
  /// left empty.
  bool ids_only = false;
};

/// One resident expert applied to the tokens routed to it.
struct ExpertJob {
  int32_t expert = -1;
  FfnWeights w;                    ///< views of the expert's slices inside its arena slot
  std::span<const int64_t> pairs;  ///< (token, k) pairs as t * top_k + k, ascending
};

/// One routed-MoE layer for Backend::moe_on_device: router, selection, experts and the weighted
/// sum in one call, with every expert of the layer resident for good (the arena holds every expert
/// of the model: stream::ExpertStream::resident_layer).
struct DeviceMoeCall {
  const RouterSpec* spec = nullptr;  ///< the layer's selection (n_expert = router.rows())
  Tensor router;                     ///< ffn_gate_inp: ne {n_embd, n_expert}
  Tensor router_bias;                ///< ffn_gate_inp.bias: F32 ne {n_expert}, or empty
  const FfnSpec* ffn = nullptr;      ///< the experts' activation
  /// Which expert table this is: (owner, layer, generation) names one set of views; a backend
  /// may keep its own copy of the table under that key and call `experts` only for a key it has
  /// not seen (owner: the stream; generation: changes when the stream's slots were emptied).
  const void* owner = nullptr;
  int layer = -1;
  uint64_t generation = 0;
  /// Fills one FfnWeights per expert id (views into the arena slots; biases as in ExpertJob).
  std::function<void(std::vector<FfnWeights>&)> experts;
  Tensor h;           ///< the MoE input, ne {n_embd, T}
  Tensor expert_out;  ///< scratch rows, ne {n_embd, T * top_k} (as for expert_ffn)
  Tensor out;         ///< the layer's output (overwritten), ne {n_embd, T}
};

/// Names a backend and what it runs on, for logs and `info`.
struct BackendInfo {
  std::string name;    ///< "cpu", "cuda"
  std::string device;  ///< e.g. "2 threads, avx2 kernels, q8 activations"
};

/// What a backend ran in parallel loops over host threads (the CPU backend's pool), summed
/// since profiling was turned on (Backend::set_loop_profiling), for `--profile`'s thread-scaling
/// projection. A loop's projection is max(work / threads, its longest block): its time on as
/// many free cores as the pool has threads (Amdahl's bound with the loop's own granularity;
/// memory-bandwidth contention and hand-offs not modelled). All zero on a backend without loops.
struct LoopProfile {
  double loop_s = 0;       ///< the caller's wall time inside loops (s)
  double work_s = 0;       ///< every block's own CPU time, summed over threads (s)
  double projected_s = 0;  ///< the loops' projected time at the pool's thread count (s)
  uint64_t loops = 0;      ///< loops run

  /// The difference this - before, field by field (what ran between two snapshots).
  LoopProfile minus(const LoopProfile& before) const {
    return {loop_s - before.loop_s, work_s - before.work_s, projected_s - before.projected_s, loops - before.loops};
  }
  /// Adds another span's totals to this one.
  void add(const LoopProfile& o) {
    loop_s += o.loop_s;
    work_s += o.work_s;
    projected_s += o.projected_s;
    loops += o.loops;
  }
};

/// The machine an architecture's forward pass runs on. One instance per engine; not
/// thread-safe (one compute thread drives it). All compute calls may run asynchronously with
/// respect to the host; download() and Event::wait() synchronize.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendInfo info() const = 0;

  // ---- memory and transfers ----
  /// A buffer of `bytes` for `role` (State buffers are zeroed). Throws std::bad_alloc or a
  /// backend error naming the size when the memory is not there.
  virtual std::unique_ptr<Buffer> alloc(BufferRole role, size_t bytes) = 0;
  /// Makes a resident weight tensor (host bytes `host`, shape of `t`) usable by the kernels:
  /// the CPU returns a view of the host bytes (which must outlive it); a GPU copies them.
  virtual Tensor weights(const Tensor& host) = 0;
  /// Copies `bytes` host bytes into dst (at dst.data) / dst.data bytes to the host.
  virtual void upload(const Tensor& dst, const void* src, size_t bytes) = 0;
  virtual void download(void* dst, const Tensor& src, size_t bytes) = 0;
  /// Copies `bytes` from src.data to dst.data, both in this backend's memory (state snapshots).
  virtual void copy(const Tensor& dst, const Tensor& src, size_t bytes) = 0;
  /// An event that completes when all work queued so far has finished.
  virtual EventPtr record() = 0;
  /// Blocks until all queued work has finished.
  virtual void synchronize() = 0;
  /// Starts work the backend holds back to batch it (the CUDA backend's queue of expert_ffn
  /// calls, run as grouped launches), without waiting for it; results are unchanged. The step
  /// calls it before blocking on an expert's arrival, so the device computes the queued experts
  /// meanwhile. Default: nothing is held back.
  virtual void flush() {}
  /// Turns the accounting of loop_profile() on (the engine does for --profile) or off.
  /// Default: nothing to account.
  virtual void set_loop_profiling(bool) {}
  /// The host-thread loops' totals so far (LoopProfile); zero on a backend without them.
  virtual LoopProfile loop_profile() const { return {}; }
  /// The arena of `n_slots` slots of `slot_bytes` (a multiple of 4 KiB) for `io_threads`
  /// reader threads. Throws (naming the sizes) when the memory cannot be had.
  virtual std::unique_ptr<ArenaMemory> make_arena(size_t n_slots, size_t slot_bytes, int io_threads) = 0;

  // ---- compute: one call per block; x/h/out are fp32 rows ne {n_embd, T} ----
  /// Token embeddings: x[t] = dequantized row ids[t] of `table` (ne {n_embd, n_vocab}).
  virtual void embed(const Tensor& table, std::span<const int32_t> ids, const Tensor& x) = 0;
  /// y[t] = RMSNorm(x[t]) * w (Zhang & Sennrich 2019; mean of squares in double). x may alias y.
  virtual void rms_norm(const Tensor& x, const Tensor& w, float eps, const Tensor& y) = 0;
  /// x += y, elementwise.
  virtual void add(const Tensor& x, const Tensor& y) = 0;
  /// x += y, then out[t] = RMSNorm(x[t]) * w: a residual add and the next block's norm. The same
  /// results as add(x, y) followed by rms_norm(x, w, eps, out), which is what this default does;
  /// a backend overrides it to do both in one pass (CUDA: one launch per layer boundary instead of
  /// two). out must not alias x or y.
  virtual void add_rms_norm(const Tensor& x, const Tensor& y, const Tensor& w, float eps, const Tensor& out) {
    add(x, y);
    rms_norm(x, w, eps, out);
  }
  /// y = x W^T: y[t][r] = sum_k W[r][k] x[t][k]. W ne {cols, rows}; x ne {cols, T}; y ne {rows, T}.
  virtual void matmul(const Tensor& W, const Tensor& x, const Tensor& y) = 0;
  /// Causal self-attention for T consecutive tokens at positions [pos0, pos0 + T) of one
  /// sequence: projections, q/k norm, RoPE, K/V rows pos0.. written to `kv`, attention over
  /// positions 0..pos0+t (or the window), output projection into `out` (overwritten).
  virtual void attention(const AttentionSpec& spec, const AttentionWeights& w, const KvCache& kv, int64_t pos0,
                         const Tensor& h, const Tensor& out) = 0;
  /// Multi-head latent attention (MlaSpec) for T consecutive tokens at positions
  /// [pos0, pos0 + T) of one sequence: rows pos0.. of `cache` (ne {spec.cache_dim(), n_ctx})
  /// written, output projection into `out` (overwritten). Default: throws std::logic_error
  /// (a backend that has not implemented it).
  virtual void mla_attention(const MlaSpec& spec, const MlaWeights& w, const Tensor& cache, int64_t pos0,
                             const Tensor& h, const Tensor& out);
  /// The gated delta net for T consecutive tokens of one sequence, advancing `state`.
  virtual void gated_delta_net(const GdnSpec& spec, const GdnWeights& w, const RecurrentState& state, const Tensor& h,
                               const Tensor& out) = 0;
  /// A dense FFN on every row of h into out (see FfnCall for the gate and accumulation).
  virtual void ffn(const FfnCall& call, const FfnWeights& w, const Tensor& h, const Tensor& out) = 0;
  /// Router logits [T][n_expert] of `w` (ne {n_embd, n_expert}) on h, on the host.
  virtual void router_logits(const Tensor& w, const Tensor& h, std::vector<float>& logits) = 0;
  /// Router logits plus a per-expert bias: logits[t][e] = h[t] . w[e] + bias[e] (bias:
  /// ffn_gate_inp.bias, F32 ne {n_expert}; gpt-oss: transformers GptOssTopKRouter's F.linear
  /// with bias). The default calls router_logits, downloads the bias and adds it on the host,
  /// so every backend has it; a backend may add it on its device instead.
  virtual void router_logits_biased(const Tensor& w, const Tensor& bias, const Tensor& h, std::vector<float>& logits);
  /// The whole expert selection of MoE routers on the same h (ne {n_embd, T}), one RouteCall
  /// each (a layer's router and the next layer's for the prediction share the layer's MoE
  /// input, so a device backend needs one round trip for both): logits[t][e] = h[t] . w[e]
  /// (+ bias[e]), then select_experts(*spec, ...) into *out. Throws what select_experts throws,
  /// for the same tokens (the calls in order). The default runs router_logits(_biased) and
  /// select_experts on the host (the CPU backend); the CUDA backend selects on its device and
  /// brings back only the [T][top_k] results (cuda_backend.h says which ids and weights it
  /// guarantees equal to this default's).
  virtual void route(std::span<const RouteCall> calls, const Tensor& h);
  /// route() of one router.
  void route(const RouterSpec& spec, const Tensor& w, const Tensor& bias, const Tensor& h, Routing& out,
             bool ids_only = false) {
    const RouteCall c{&spec, w, bias, &out, ids_only};
    route(std::span<const RouteCall>(&c, 1), h);
  }
  /// Applies one expert to its tokens: for each pair p of job.pairs, row p of expert_out
  /// (ne {n_embd, T * top_k}) = ffn(job.w, h[p / top_k]). Rows not in pairs are untouched.
  virtual void expert_ffn(const FfnSpec& spec, const ExpertJob& job, int top_k, const Tensor& h,
                          const Tensor& expert_out) = 0;
  /// out[t] = sum over k in order of routing.weights[t][k] * expert_out[t * top_k + k]
  /// (overwrites out; the fixed k order keeps results independent of expert arrival order).
  virtual void moe_combine(const Routing& routing, const Tensor& expert_out, const Tensor& out) = 0;
  /// The whole routed-MoE layer `c` with no host step between router and experts: route() of
  /// the layer's router, expert_ffn for every (token, k) pair into c.expert_out, moe_combine into
  /// c.out, queued, giving the same bits as those calls. Returns the host address where, once
  /// the queued work is done (after the next synchronize() or download()), the selection will
  /// be as 4-byte arrays back to back: [T] int32 statuses (router_logits_defect codes, 0 =
  /// fine), [T][top_k] int32 ids, [T][top_k] probs, [T][top_k] weights, [T] next_prob (Routing's
  /// fields); valid until moe_on_device is called again for the same c.layer. Returns null,
  /// queuing nothing, when the backend does not take the call (then the caller routes on the
  /// host's side as usual). Default: null (the CPU backend: the host is between them anyway).
  virtual const int32_t* moe_on_device(const DeviceMoeCall& c) {
    (void)c;
    return nullptr;
  }

 protected:
  /// route()'s host form (the default's body): router_logits(_biased), then select_experts
  /// with the tokens spread by `ranges` (TokenRanges; empty: select_experts' own threads).
  void route_on_host(std::span<const RouteCall> calls, const Tensor& h, const TokenRanges& ranges);
};

}  // namespace strata::backend
