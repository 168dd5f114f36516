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

}  // namespace

CpuBackend::CpuBackend(const CpuOptions& opts) : pool_(std::max(1, opts.n_threads)), kc_(opts.kernels) {}
CpuBackend::~CpuBackend() = default;

backend::BackendInfo CpuBackend::info() const {
  return {"cpu",
          fmt::format("{} thread{}, {} kernels, {} activations", pool_.n_threads(), pool_.n_threads() == 1 ? "" : "s",
                      kernels::cpu_kernels_label(kc_), kernels::act_quant_name(kc_.act))};
}

std::unique_ptr<backend::Buffer> CpuBackend::alloc(backend::BufferRole role, size_t bytes) {
  return std::make_unique<HostBuffer>(role, bytes);
}

void CpuBackend::upload(const Tensor& dst, const void* src, size_t bytes) {
  flush();
  std::memcpy(dst.data, src, bytes);
}
void CpuBackend::download(void* dst, const Tensor& src, size_t bytes) {
  flush();
  std::memcpy(dst, src.data, bytes);
}
void CpuBackend::copy(const Tensor& dst, const Tensor& src, size_t bytes) {
  flush();
  std::memmove(dst.data, src.data, bytes);
}
backend::EventPtr CpuBackend::record() {
  flush();
  return std::make_shared<DoneEvent>();
}

std::unique_ptr<backend::ArenaMemory> CpuBackend::make_arena(size_t n_slots, size_t slot_bytes, int io_threads) {
  return std::make_unique<HostArena>(n_slots, slot_bytes, io_threads);
}

void CpuBackend::embed(const Tensor& table, std::span<const int32_t> ids, const Tensor& x) {
  flush();
  const int64_t E = table.cols();
  pool_.parallel_for(int64_t(ids.size()), 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      quant::dequantize_row(table.type,
                            static_cast<const uint8_t*>(table.data) + size_t(ids[size_t(t)]) * table.row_bytes(),
                            x.row(t), E);
  });
}

void CpuBackend::rms_norm(const Tensor& x, const Tensor& w, float eps, const Tensor& y) {
  flush();
  const int64_t E = x.cols();
  const float* wv = w.f();
  pool_.parallel_for(x.rows(), 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) cpu::rms_norm(x.row(t), wv, y.row(t), E, eps);
  });
}

void CpuBackend::add(const Tensor& x, const Tensor& y) {
  flush();
  const int64_t E = x.cols();
  // rows split over the pool (element-wise: the same bits for any split)
  pool_.parallel_for(x.rows(), 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* a = x.row(t);
      const float* b = y.row(t);
      for (int64_t i = 0; i < E; ++i) a[i] += b[i];
    }
  });
}

void CpuBackend::matmul(const Tensor& W, const Tensor& x, const Tensor& y) {
  flush();
  cpu::matmul(pool_, kc_, as_matrix(W), x.f(), ld(x), x.rows(), y.f(), ld(y));
}

void CpuBackend::attention(const backend::AttentionSpec& spec, const backend::AttentionWeights& w,
                           const backend::KvCache& kv, int64_t pos0, const Tensor& h, const Tensor& out) {
  flush();
  const AttentionWeights aw{as_matrix(w.wq),      as_matrix(w.wk),          as_matrix(w.wv),
                            as_matrix(w.wo),      values_or_null(w.q_norm), values_or_null(w.k_norm),
                            values_or_null(w.bq), values_or_null(w.bk),     values_or_null(w.bv),
                            values_or_null(w.bo), values_or_null(w.sinks)};
  attention_block(pool_, kc_, aw, spec, h.f(), h.cols(), h.rows(), pos0, kv.k.f(), kv.v.f(), out.f());
}

void CpuBackend::mla_attention(const backend::MlaSpec& spec, const backend::MlaWeights& w, const Tensor& cache,
                               int64_t pos0, const Tensor& h, const Tensor& out) {
  flush();
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
  flush();
  const GatedDeltaNetWeights gw{as_matrix(w.wqkv),  as_matrix(w.wz),    as_matrix(w.wba), as_matrix(w.wout),
                                w.conv.f(),         w.dt_bias.f(),      w.a.f(),          w.norm.f(),
                                as_matrix(w.wbeta), as_matrix(w.walpha)};
  gated_delta_net_block(pool_, kc_, gw, spec, h.f(), h.cols(), h.rows(), state.conv.f(), state.ssm.f(), out.f());
}

void CpuBackend::ffn(const backend::FfnCall& call, const backend::FfnWeights& w, const Tensor& h, const Tensor& out) {
  flush();
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
    ffn_scratch_.grow(size_t(n));
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
  flush();
  const int64_t n_expert = w.rows();
  logits.resize(size_t(h.rows() * n_expert));
  cpu::matmul(pool_, kc_, as_matrix(w), h.f(), ld(h), h.rows(), logits.data(), n_expert);
}

void CpuBackend::route(std::span<const backend::RouteCall> calls, const Tensor& h) {
  // A few blocks per thread: the tokens' selections cost alike.
  route_on_host(calls, h, [this](int64_t T, const std::function<void(int64_t, int64_t)>& fn) {
    pool_.parallel_for(T, std::max<int64_t>(16, T / (int64_t(pool_.n_threads()) * 4)), fn);
  });
}

namespace {

// [first, last) bytes of the rows of a 2-D fp32 view.
std::pair<const char*, const char*> byte_range(const Tensor& t) {
  const char* p = static_cast<const char*>(t.data);
  return {p, p + (t.rows() > 0 ? size_t(t.rows() - 1) * t.row_bytes() + size_t(t.cols()) * sizeof(float) : 0)};
}

bool overlap(const Tensor& a, const Tensor& b) {
  const auto [a0, a1] = byte_range(a);
  const auto [b0, b1] = byte_range(b);
  return a0 < b1 && b0 < a1;
}

void check_bias(const Tensor& b, int64_t n, const char* what) {
  if (!b.empty() && (b.type != GgmlType::F32 || b.numel() != n))
    throw std::invalid_argument(fmt::format("expert_ffn: {} must be F32 with {} values (has {})", what, n, b.numel()));
}

}  // namespace

void CpuBackend::expert_ffn(const backend::FfnSpec& spec, const backend::ExpertJob& job, int top_k, const Tensor& h,
                            const Tensor& expert_out) {
  // Checked now, so that a bad call fails here and not at the flush.
  const backend::FfnWeights& w = job.w;
  const int64_t n_embd = h.cols(), n_ff = w.gate.rows();
  if (h.type != GgmlType::F32 || expert_out.type != GgmlType::F32)
    throw std::invalid_argument("expert_ffn: h and expert_out must be F32");
  if (top_k < 1) throw std::invalid_argument(fmt::format("expert_ffn: top_k must be >= 1 (got {})", top_k));
  if (w.gate.cols() != n_embd || w.up.cols() != n_embd || w.up.rows() != n_ff || w.down.cols() != n_ff ||
      w.down.rows() != expert_out.cols())
    throw std::invalid_argument(fmt::format(
        "expert_ffn: expert {}: expected gate and up ne {{{}, n_ff}} and down ne {{n_ff, {}}}, got gate {{{}, {}}}, "
        "up {{{}, {}}}, down {{{}, {}}}",
        job.expert, n_embd, expert_out.cols(), w.gate.cols(), w.gate.rows(), w.up.cols(), w.up.rows(), w.down.cols(),
        w.down.rows()));
  check_bias(w.gate_b, n_ff, "the gate bias");
  check_bias(w.up_b, n_ff, "the up bias");
  check_bias(w.down_b, w.down.rows(), "the down bias");
  for (const int64_t p : job.pairs)
    if (p < 0 || p >= expert_out.rows() || p / top_k >= h.rows())
      throw std::invalid_argument(
          fmt::format("expert_ffn: expert {}: pair {} outside expert_out ({} rows) or h ({} rows)", job.expert, p,
                      expert_out.rows(), h.rows()));
  if (job.pairs.empty()) return;

  // A call that depends on a queued one (it writes a row a queued call writes, or its rows
  // overlap a queued call's input or output otherwise) runs after the queue.
  if (!queue_.empty()) {
    const Tensor& first = queue_.front().out;
    bool conflict = false;
    for (const ExpertCall& q : queue_)
      conflict = conflict || overlap(expert_out, q.h) || overlap(h, q.out) ||
                 (q.out.data != expert_out.data && overlap(expert_out, q.out));
    const bool same_out = first.data == expert_out.data && first.row_bytes() == expert_out.row_bytes() &&
                          first.rows() == expert_out.rows();
    if (!same_out && overlap(expert_out, first)) conflict = true;
    for (size_t j = 0; same_out && !conflict && j < job.pairs.size(); ++j)
      conflict = written_[size_t(job.pairs[j])] != 0;
    if (conflict) flush();
  }
  if (queue_.empty()) written_.assign(size_t(expert_out.rows()), 0);
  if (queue_.empty() || queue_.front().out.data == expert_out.data)
    for (const int64_t p : job.pairs) written_[size_t(p)] = 1;
  queue_.push_back(ExpertCall{spec, w, std::vector<int64_t>(job.pairs.begin(), job.pairs.end()), top_k, h, expert_out});
}

void CpuBackend::flush() {
  if (queue_.empty()) return;
  std::vector<ExpertCall> calls;
  calls.swap(queue_);  // emptied even when a kernel throws
  run_expert_batch(pool_, kc_, calls, batch_);
  calls.clear();
  calls.swap(queue_);  // keep the capacity
}

void CpuBackend::moe_combine(const backend::Routing& r, const Tensor& expert_out, const Tensor& out) {
  flush();
  const int K = r.top_k;
  const int64_t n_embd = out.cols();
  // tokens split over the pool (each token's sum is the same k-ordered loop on one thread)
  pool_.parallel_for(r.n_tokens(), 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out.row(t);
      std::fill(o, o + n_embd, 0.0f);
      for (int k = 0; k < K; ++k) {
        const float wk = r.weights[t * K + k];
        const float* eo = expert_out.row(t * K + k);
        for (int64_t i = 0; i < n_embd; ++i) o[i] += wk * eo[i];
      }
    }
  });
}

}  // namespace strata::cpu
