#include "backend/cpu/cpu_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "backend/cpu/attention_block.h"
#include "backend/cpu/ffn.h"
#include "backend/cpu/gated_delta_net.h"
#include "backend/cpu/host_arena.h"
#include "io/file.h"
#include "quant/quant.h"

namespace strata::cpu {

using backend::Tensor;

MatrixRef as_matrix(const Tensor& t) { return MatrixRef{t.type, t.data, t.rows(), t.cols(), t.row_bytes()}; }

namespace {

// Host memory for every role: one 4 KiB-aligned allocation (state zeroed).
class HostBuffer final : public backend::Buffer {
 public:
  HostBuffer(backend::BufferRole role, size_t bytes) : role_(role), mem_(std::max<size_t>(bytes, 1)), bytes_(bytes) {
    if (role == backend::BufferRole::State) std::memset(mem_.data(), 0, mem_.size());
  }
  backend::BufferRole role() const override { return role_; }
  backend::Place place() const override { return backend::Place::Host; }
  void* data() override { return mem_.data(); }
  size_t bytes() const override { return bytes_; }

 private:
  backend::BufferRole role_;
  io::AlignedBuffer mem_;
  size_t bytes_;
};

// Work on the CPU is done when the call returns.
class DoneEvent final : public backend::Event {
 public:
  void wait() override {}
  bool done() override { return true; }
};

// Floats between rows of an fp32 activation tensor.
int64_t ld(const Tensor& t) { return int64_t(t.row_bytes() / sizeof(float)); }

const float* values_or_null(const Tensor& t) { return t.empty() ? nullptr : static_cast<const float*>(t.data); }

// y[j][i] += b[i] for n rows of m floats (b null: nothing).
void add_rows(float* y, const float* b, int64_t n, int64_t m) {
  if (!b) return;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) y[j * m + i] += b[i];
}

// g = x·gateᵀ and u = x·upᵀ for n tokens (x: n rows of `cols` floats; g, u: n rows of gate.rows
// floats). When both take q8 activations of one weight type, x is quantized once (with that
// type's lane order) and both matmuls run as one pool loop over the rows of gate then up, so the
// threads split 2·rows row blocks instead of waiting at the end of each matmul; otherwise two
// cpu::matmul calls. Either way every output has the bits cpu::matmul gives it.
void gate_up(ThreadPool& pool, const kernels::KernelConfig& kc, const MatrixRef& gate, const MatrixRef& up,
             const float* x, int64_t n, float* g, float* u) {
  const int64_t cols = gate.cols, rows = gate.rows;
  if (!kernels::has_q8_activations(kc, gate.type) || up.type != gate.type || up.cols != cols || up.rows != rows) {
    cpu::matmul(pool, kc, gate, x, cols, n, g, rows);
    cpu::matmul(pool, kc, up, x, cols, n, u, rows);
    return;
  }
  thread_local kernels::ActQ8 tl_act;
  kernels::ActQ8& act = tl_act;  // the pool's threads must see this thread's buffer
  act.resize(n, cols, gate.type);
  if (n * cols >= 32768) {
    pool.parallel_for(n, 1, [&](int64_t t0, int64_t t1) { kernels::quantize_activations(kc, x, cols, t0, t1, act); });
  } else {
    kernels::quantize_activations(kc, x, cols, 0, n, act);
  }
  // row blocks of the same grain as cpu::matmul's, never straddling the two matrices
  const int64_t grain = std::max<int64_t>(8, rows / (pool.n_threads() * 8));
  const int64_t per = (rows + grain - 1) / grain;
  pool.parallel_for(2 * per, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const MatrixRef& W = b < per ? gate : up;
      const int64_t r0 = (b % per) * grain, r1 = std::min(rows, r0 + grain);
      kernels::matmul_q8(kc, W.type, W.data, W.row_bytes, r0, r1, cols, act, b < per ? g : u, rows);
    }
  });
}

}  // namespace

CpuBackend::CpuBackend(const CpuOptions& opts) : pool_(std::max(1, opts.n_threads)), kc_(opts.kernels) {}
CpuBackend::~CpuBackend() = default;

backend::BackendInfo CpuBackend::info() const {
  return {"cpu", fmt::format("{} threads, {} kernels, {} activations", pool_.n_threads(),
                             kernels::cpu_kernels_name(kc_.family), kernels::act_quant_name(kc_.act))};
}

std::unique_ptr<backend::Buffer> CpuBackend::alloc(backend::BufferRole role, size_t bytes) {
  return std::make_unique<HostBuffer>(role, bytes);
}

void CpuBackend::upload(const Tensor& dst, const void* src, size_t bytes) { std::memcpy(dst.data, src, bytes); }
void CpuBackend::download(void* dst, const Tensor& src, size_t bytes) { std::memcpy(dst, src.data, bytes); }
void CpuBackend::copy(const Tensor& dst, const Tensor& src, size_t bytes) { std::memmove(dst.data, src.data, bytes); }
backend::EventPtr CpuBackend::record() { return std::make_shared<DoneEvent>(); }

std::unique_ptr<backend::ArenaMemory> CpuBackend::make_arena(size_t n_slots, size_t slot_bytes, int io_threads) {
  return std::make_unique<HostArena>(n_slots, slot_bytes, io_threads);
}

void CpuBackend::embed(const Tensor& table, std::span<const int32_t> ids, const Tensor& x) {
  const int64_t E = table.cols();
  for (size_t t = 0; t < ids.size(); ++t)
    quant::dequantize_row(table.type, static_cast<const uint8_t*>(table.data) + size_t(ids[t]) * table.row_bytes(),
                          x.row(int64_t(t)), E);
}

void CpuBackend::rms_norm(const Tensor& x, const Tensor& w, float eps, const Tensor& y) {
  const int64_t E = x.cols();
  const float* wv = w.f();
  pool_.parallel_for(x.rows(), 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) cpu::rms_norm(x.row(t), wv, y.row(t), E, eps);
  });
}

void CpuBackend::add(const Tensor& x, const Tensor& y) {
  const int64_t E = x.cols();
  for (int64_t t = 0; t < x.rows(); ++t) {
    float* a = x.row(t);
    const float* b = y.row(t);
    for (int64_t i = 0; i < E; ++i) a[i] += b[i];
  }
}

void CpuBackend::matmul(const Tensor& W, const Tensor& x, const Tensor& y) {
  cpu::matmul(pool_, kc_, as_matrix(W), x.f(), ld(x), x.rows(), y.f(), ld(y));
}

void CpuBackend::attention(const backend::AttentionSpec& spec, const backend::AttentionWeights& w,
                           const backend::KvCache& kv, int64_t pos0, const Tensor& h, const Tensor& out) {
  const AttentionWeights aw{as_matrix(w.wq),      as_matrix(w.wk),          as_matrix(w.wv),
                            as_matrix(w.wo),      values_or_null(w.q_norm), values_or_null(w.k_norm),
                            values_or_null(w.bq), values_or_null(w.bk),     values_or_null(w.bv),
                            values_or_null(w.bo), values_or_null(w.sinks)};
  attention_block(pool_, kc_, aw, spec, h.f(), h.cols(), h.rows(), pos0, kv.k.f(), kv.v.f(), out.f());
}

void CpuBackend::mla_attention(const backend::MlaSpec& spec, const backend::MlaWeights& w, const Tensor& cache,
                               int64_t pos0, const Tensor& h, const Tensor& out) {
  MlaWeights mw;
  mw.wq_a = as_matrix(w.wq_a);
  mw.wq_b = as_matrix(w.wq_b);
  mw.wq = as_matrix(w.wq);
  mw.wkv_a = as_matrix(w.wkv_a);
  mw.wk_b = as_matrix(w.wk_b);
  mw.wv_b = as_matrix(w.wv_b);
  mw.wo = as_matrix(w.wo);
  mw.q_a_norm = values_or_null(w.q_a_norm);
  mw.kv_a_norm = values_or_null(w.kv_a_norm);
  mla_attention_block(pool_, kc_, mw, spec, h.f(), h.cols(), h.rows(), pos0, cache.f(), out.f());
}

void CpuBackend::gated_delta_net(const backend::GdnSpec& spec, const backend::GdnWeights& w,
                                 const backend::RecurrentState& state, const Tensor& h, const Tensor& out) {
  const GatedDeltaNetWeights gw{as_matrix(w.wqkv),  as_matrix(w.wz),    as_matrix(w.wba), as_matrix(w.wout),
                                w.conv.f(),         w.dt_bias.f(),      w.a.f(),          w.norm.f(),
                                as_matrix(w.wbeta), as_matrix(w.walpha)};
  gated_delta_net_block(pool_, kc_, gw, spec, h.f(), h.cols(), h.rows(), state.conv.f(), state.ssm.f(), out.f());
}

void CpuBackend::ffn(const backend::FfnCall& call, const backend::FfnWeights& w, const Tensor& h, const Tensor& out) {
  if (call.spec.act != backend::FfnSpec::Act::SwiGLU || !w.gate_b.empty() || !w.up_b.empty() || !w.down_b.empty())
    throw std::invalid_argument("ffn: the dense FFN supports SwiGLU without biases only (see expert_ffn)");
  const FfnWeights fw{as_matrix(w.gate), as_matrix(w.up), as_matrix(w.down)};
  if (!call.scalar_gate.empty()) {
    if (!call.accumulate) throw std::invalid_argument("ffn: a scalar gate is only supported with accumulate");
    add_gated_swiglu_ffn(pool_, kc_, fw, as_matrix(call.scalar_gate), h.f(), h.cols(), h.rows(), out.f());
    return;
  }
  if (call.accumulate) {  // out += ffn(h)
    const int64_t n = h.rows() * out.cols();
    ffn_scratch_.resize(size_t(n));
    swiglu_ffn(pool_, kc_, fw, h.f(), h.cols(), h.rows(), ffn_scratch_.data());
    for (int64_t t = 0; t < h.rows(); ++t) {
      float* o = out.row(t);
      const float* y = ffn_scratch_.data() + t * out.cols();
      for (int64_t i = 0; i < out.cols(); ++i) o[i] += y[i];
    }
    return;
  }
  swiglu_ffn(pool_, kc_, fw, h.f(), h.cols(), h.rows(), out.f());
}

void CpuBackend::router_logits(const Tensor& w, const Tensor& h, std::vector<float>& logits) {
  const int64_t n_expert = w.rows();
  logits.resize(size_t(h.rows() * n_expert));
  cpu::matmul(pool_, kc_, as_matrix(w), h.f(), ld(h), h.rows(), logits.data(), n_expert);
}

void CpuBackend::expert_ffn(const backend::FfnSpec& spec, const backend::ExpertJob& job, int top_k, const Tensor& h,
                            const Tensor& expert_out) {
  // SwiGLU on all the expert's tokens at once: down(silu(gate x) * up x) into the (token, k) rows
  // (biases, when given, added to each projection's output; SwiGluOai: the clamped variant).
  const int64_t n_embd = h.cols(), n_ff = job.w.gate.rows(), n = int64_t(job.pairs.size());
  x_.resize(size_t(n * n_embd));
  g_.resize(size_t(n * n_ff));
  u_.resize(size_t(n * n_ff));
  for (int64_t j = 0; j < n; ++j) std::copy_n(h.row(job.pairs[j] / top_k), n_embd, x_.data() + j * n_embd);
  gate_up(pool_, kc_, as_matrix(job.w.gate), as_matrix(job.w.up), x_.data(), n, g_.data(), u_.data());
  add_rows(g_.data(), values_or_null(job.w.gate_b), n, n_ff);
  add_rows(u_.data(), values_or_null(job.w.up_b), n, n_ff);
  if (spec.act == backend::FfnSpec::Act::SwiGluOai) {
    for (int64_t i = 0; i < n * n_ff; ++i) g_[i] = swiglu_oai(g_[i], u_[i], spec.alpha, spec.limit);
  } else {
    for (int64_t i = 0; i < n * n_ff; ++i) g_[i] = silu(g_[i]) * u_[i];
  }
  cpu::matmul(pool_, kc_, as_matrix(job.w.down), g_.data(), n_ff, n, x_.data(), n_embd);
  add_rows(x_.data(), values_or_null(job.w.down_b), n, n_embd);
  for (int64_t j = 0; j < n; ++j) std::copy_n(x_.data() + j * n_embd, n_embd, expert_out.row(job.pairs[j]));
}

void CpuBackend::moe_combine(const backend::Routing& r, const Tensor& expert_out, const Tensor& out) {
  const int K = r.top_k;
  const int64_t n_embd = out.cols();
  for (int64_t t = 0; t < r.n_tokens(); ++t) {
    float* o = out.row(t);
    std::fill(o, o + n_embd, 0.0f);
    for (int k = 0; k < K; ++k) {
      const float wk = r.weights[t * K + k];
      const float* eo = expert_out.row(t * K + k);
      for (int64_t i = 0; i < n_embd; ++i) o[i] += wk * eo[i];
    }
  }
}

}  // namespace strata::cpu
