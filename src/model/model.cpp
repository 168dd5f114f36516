#include "model/model.h"

#include <fmt/format.h>

#include <algorithm>

#include "model/weights.h"
#include "quant/quant.h"

namespace strata::model {

// Defined in one file per architecture.
std::unique_ptr<Model> load_qwen3moe(const gguf::File& gguf, const LoadOptions& opts);
std::unique_ptr<Model> load_qwen3next(const gguf::File& gguf, const LoadOptions& opts);

namespace {
struct ArchEntry {
  const char* name;
  std::unique_ptr<Model> (*load)(const gguf::File&, const LoadOptions&);
};
// The table of architectures: one line per architecture file.
const ArchEntry kArchitectures[] = {
    {"qwen3moe", &load_qwen3moe},
    {"qwen3next", &load_qwen3next},
};
}  // namespace

void Model::record_routing(RoutingTrace* trace, int layer, const layers::Routing& r, int top_k) const {
  if (!trace) return;
  trace->ids.resize(hp_.n_layer);
  trace->probs.resize(hp_.n_layer);
  trace->next_prob.resize(hp_.n_layer);
  const size_t T = r.next_prob.size(), K = size_t(top_k);
  for (size_t t = 0; t < T; ++t) {
    trace->ids[layer].emplace_back(r.ids.begin() + t * K, r.ids.begin() + (t + 1) * K);
    trace->probs[layer].emplace_back(r.probs.begin() + t * K, r.probs.begin() + (t + 1) * K);
    trace->next_prob[layer].push_back(r.next_prob[t]);
  }
}

layers::ReadAhead Model::plan_read_ahead(const ForwardContext& ctx, int layer, const cpu::MatrixRef* router,
                                         int64_t T, std::vector<int32_t>* predicted) const {
  layers::ReadAhead ra;
  if (layer < 0 || layer >= hp_.n_layer || experts_[layer].n_expert == 0) return ra;
  ra.layer = layer;
  ra.n_expert = experts_[layer].n_expert;
  ra.top_k = hp_.n_expert_used;
  ra.min_tokens = ctx.ahead.predict_min;
  if (ctx.ahead.predict && router) {
    ra.router = router;
    ra.predicted = predicted;
  }
  const auto* rank = ctx.ahead.static_rank;
  if (rank && size_t(layer) < rank->size() && (!ra.router || layer == 0)) {
    ra.static_rank = (*rank)[layer];
    ra.static_count = std::min<int64_t>(int64_t(ra.top_k) * T, ra.n_expert);
  }
  return ra;
}

void Model::score_prediction(ForwardContext& ctx, int layer, const layers::Routing& r,
                             const std::vector<int32_t>& predicted) const {
  if (!ctx.prediction || predicted.size() != r.ids.size() || predicted.empty()) return;
  auto& p = *ctx.prediction;
  p.picks.resize(hp_.n_layer, 0);
  p.predicted.resize(hp_.n_layer, 0);
  const size_t K = size_t(hp_.n_expert_used), T = r.ids.size() / K;
  for (size_t t = 0; t < T; ++t)
    for (size_t k = 0; k < K; ++k) {
      const int32_t e = r.ids[t * K + k];
      ++p.picks[layer];
      for (size_t j = 0; j < K; ++j)
        if (predicted[t * K + j] == e) {
          ++p.predicted[layer];
          break;
        }
    }
}

void Model::read_ahead_first(ForwardContext& ctx, const cpu::MatrixRef& router0, const float* norm0, const float* x,
                             int64_t T, float* scratch, std::vector<int32_t>& pred) const {
  const int64_t E = hp_.n_embd;
  for (int64_t t = 0; t < T; ++t) cpu::rms_norm(x + t * E, norm0, scratch + t * E, E, hp_.rms_eps);
  pred.clear();
  const layers::ReadAhead ra = plan_read_ahead(ctx, 0, &router0, T, &pred);
  layers::read_ahead(ctx.pool, ctx.kernels, ctx.stream, ra, scratch, E, T);
}

void Model::moe_step(ForwardContext& ctx, int layer, const layers::MoeWeights& w, const cpu::MatrixRef* next_router,
                     const float* h, int64_t T, float* out, std::vector<int32_t>& pred) const {
  std::vector<int32_t> pred_next;
  const layers::ReadAhead ra = plan_read_ahead(ctx, layer + 1, next_router, T, &pred_next);
  layers::Routing routing;
  layers::moe_block(ctx.pool, ctx.kernels, ctx.stream, layer, w, h, hp_.n_embd, T, out, &routing,
                    ctx.times ? &ctx.times->expert_s : nullptr, &ra);
  score_prediction(ctx, layer, routing, pred);
  record_routing(ctx.trace, layer, routing, w.top_k);
  pred.swap(pred_next);
}

void Model::rms_norm_rows(cpu::ThreadPool& pool, const float* x, const float* w, int64_t T, float* h) const {
  const int64_t E = hp_.n_embd;
  pool.parallel_for(T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) cpu::rms_norm(x + t * E, w, h + t * E, E, hp_.rms_eps);
  });
}

void Model::add_rows(float* x, const float* o, int64_t T) const {
  for (int64_t i = 0, n = T * hp_.n_embd; i < n; ++i) x[i] += o[i];
}

void Model::embed(const cpu::MatrixRef& tok_embd, std::span<const int32_t> ids, float* x) const {
  const int64_t E = hp_.n_embd;
  for (size_t t = 0; t < ids.size(); ++t)
    quant::dequantize_row(tok_embd.type, static_cast<const uint8_t*>(tok_embd.data) + size_t(ids[t]) * tok_embd.row_bytes,
                          x + int64_t(t) * E, E);
}

void Model::output_head(ForwardContext& ctx, const float* x, int64_t T, LogitsMode mode, const float* norm,
                        const cpu::MatrixRef& head, float* scratch, std::vector<float>& logits) const {
  if (mode == LogitsMode::None) return;
  const int64_t E = hp_.n_embd;
  const int64_t first = mode == LogitsMode::Last ? T - 1 : 0, rows = T - first;
  for (int64_t t = first; t < T; ++t) cpu::rms_norm(x + t * E, norm, scratch + (t - first) * E, E, hp_.rms_eps);
  logits.resize(size_t(rows) * hp_.n_vocab);
  cpu::matmul(ctx.pool, ctx.kernels, head, scratch, E, rows, logits.data(), hp_.n_vocab);
}

std::vector<std::string> supported_architectures() {
  std::vector<std::string> out;
  for (const auto& a : kArchitectures) out.push_back(a.name);
  return out;
}

std::unique_ptr<Model> load_model(const gguf::File& gguf, const LoadOptions& opts) {
  const std::string arch = gguf.get_string("general.architecture");
  for (const auto& a : kArchitectures) {
    if (arch != a.name) continue;
    std::unique_ptr<Model> m = a.load(gguf, opts);
    // a layer tensor past block_count would be silently unused: the file and its metadata disagree
    const int n_layer = m->hparams().n_layer;
    for (const auto& t : gguf.tensors())
      if (t.layer() >= n_layer)
        throw ModelError(fmt::format("{}: tensor '{}' belongs to layer {}, but {}.block_count says {} layers",
                                     gguf.path(), t.name, t.layer(), arch, n_layer));
    return m;
  }
  throw ModelError(fmt::format("{}: unsupported architecture '{}' (supported: {})", gguf.path(), arch,
                               fmt::join(supported_architectures(), ", ")));
}

}  // namespace strata::model
