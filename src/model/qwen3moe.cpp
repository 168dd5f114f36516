// Qwen3-MoE (general.architecture = "qwen3moe"): every layer is GQA attention with q/k
// RMSNorm and NEOX RoPE, then a routed SwiGLU MoE (softmax, top-k, renormalized).
// Reference: transformers' modeling_qwen3_moe.py; tensor names as llama.cpp's converter
// writes them (blk.N.attn_q.weight, blk.N.ffn_gate_exps.weight, ...).
#include <chrono>

#include <fmt/format.h>

#include "layers/attention.h"
#include "layers/moe.h"
#include "model/model.h"
#include "model/weights.h"
#include "quant/quant.h"

namespace strata::model {
namespace {

struct Qwen3MoeLayer {
  DenseTensor attn_norm;    // [n_embd]
  DenseTensor wq;           // [n_embd, n_head * head_dim]  (ne: cols first)
  DenseTensor wk;           // [n_embd, n_head_kv * head_dim]
  DenseTensor wv;           // [n_embd, n_head_kv * head_dim]
  DenseTensor wo;           // [n_head * head_dim, n_embd]
  DenseTensor q_norm;       // [head_dim]
  DenseTensor k_norm;       // [head_dim]
  DenseTensor ffn_norm;     // [n_embd]
  DenseTensor router;       // ffn_gate_inp [n_embd, n_expert]
  layers::MoeWeights moe;   // router view + expert slice shapes (experts stream)
};

class Qwen3Moe final : public Model {
 public:
  Qwen3Moe(const gguf::File& f, const LoadOptions& opts);
  SequenceState new_state(int64_t n_ctx) const override;
  uint64_t state_bytes(int64_t n_ctx) const override;
  void forward(ForwardContext& ctx, SequenceState& st, std::span<const int32_t> ids, LogitsMode mode,
               std::vector<float>& logits) override;

 private:
  DenseTensor tok_embd_;     // [n_embd, n_vocab]
  DenseTensor output_norm_;  // [n_embd]
  DenseTensor output_;       // [n_embd, n_vocab]; empty when tied to tok_embd
  std::vector<Qwen3MoeLayer> layers_;
  cpu::Rope rope_;
};

layers::ExpertPartShape part_shape(const gguf::TensorInfo& t) {
  return layers::ExpertPartShape{t.type, int64_t(t.ne[1]), int64_t(t.ne[0]), size_t(t.row_bytes)};
}

stream::PartLayout part_layout(const gguf::TensorInfo& t) {
  return stream::PartLayout{t.offset, t.ne[1] * t.row_bytes};
}

Qwen3Moe::Qwen3Moe(const gguf::File& f, const LoadOptions& opts) {
  hp_ = read_common_hparams(f);
  const int64_t E = hp_.n_embd, hd = hp_.head_dim_k, V = hp_.n_vocab;
  const int64_t q_dim = int64_t(hp_.n_head) * hd, kv_dim = int64_t(hp_.n_head_kv) * hd;
  if (hp_.head_dim_v != hp_.head_dim_k)
    throw ModelError(fmt::format("{}: qwen3moe needs key_length == value_length, got {} and {}", f.path(),
                                 hp_.head_dim_k, hp_.head_dim_v));
  if (hp_.n_expert <= 0 || hp_.n_expert_used <= 0 || hp_.n_ff_exp <= 0)
    throw ModelError(fmt::format("{}: qwen3moe needs expert_count, expert_used_count and "
                                 "expert_feed_forward_length > 0",
                                 f.path()));
  const int64_t X = hp_.n_expert, F = hp_.n_ff_exp;
  rope_ = cpu::Rope(hp_.n_rot, hp_.rope_freq_base, opts.rope_freqs_bf16);

  WeightLoader w(f);
  tok_embd_ = w.matrix("token_embd.weight", {E, V});
  output_norm_ = w.vector("output_norm.weight", {E});
  if (!hp_.tied_output) output_ = w.matrix("output.weight", {E, V});

  layers_.resize(hp_.n_layer);
  experts_.resize(hp_.n_layer);
  for (int l = 0; l < hp_.n_layer; ++l) {
    const std::string p = fmt::format("blk.{}.", l);
    Qwen3MoeLayer& L = layers_[l];
    L.attn_norm = w.vector(p + "attn_norm.weight", {E});
    L.wq = w.matrix(p + "attn_q.weight", {E, q_dim});
    L.wk = w.matrix(p + "attn_k.weight", {E, kv_dim});
    L.wv = w.matrix(p + "attn_v.weight", {E, kv_dim});
    L.wo = w.matrix(p + "attn_output.weight", {q_dim, E});
    L.q_norm = w.vector(p + "attn_q_norm.weight", {hd});
    L.k_norm = w.vector(p + "attn_k_norm.weight", {hd});
    L.ffn_norm = w.vector(p + "ffn_norm.weight", {E});
    L.router = w.matrix(p + "ffn_gate_inp.weight", {E, X});
    // Experts: shapes checked here, bytes left on disk for the stream.
    const auto& gate = w.expect(p + "ffn_gate_exps.weight", {E, F, X});
    const auto& up = w.expect(p + "ffn_up_exps.weight", {E, F, X});
    const auto& down = w.expect(p + "ffn_down_exps.weight", {F, E, X});
    L.moe.router = L.router.matrix();
    L.moe.gate = part_shape(gate);
    L.moe.up = part_shape(up);
    L.moe.down = part_shape(down);
    L.moe.n_expert = hp_.n_expert;
    L.moe.top_k = hp_.n_expert_used;
    L.moe.norm_topk = hp_.norm_topk;
    experts_[l].n_expert = hp_.n_expert;
    experts_[l].part[0] = part_layout(gate);
    experts_[l].part[1] = part_layout(up);
    experts_[l].part[2] = part_layout(down);
  }
  dense_bytes_ = w.bytes_loaded();
}

SequenceState Qwen3Moe::new_state(int64_t n_ctx) const {
  SequenceState st;
  st.n_ctx = n_ctx;
  const int64_t kv_dim = int64_t(hp_.n_head_kv) * hp_.head_dim_k;
  st.k.assign(hp_.n_layer, std::vector<float>(n_ctx * kv_dim));
  st.v.assign(hp_.n_layer, std::vector<float>(n_ctx * kv_dim));
  return st;
}

uint64_t Qwen3Moe::state_bytes(int64_t n_ctx) const {
  return uint64_t(2) * hp_.n_layer * n_ctx * hp_.n_head_kv * hp_.head_dim_k * sizeof(float);
}

void Qwen3Moe::forward(ForwardContext& ctx, SequenceState& st, std::span<const int32_t> ids, LogitsMode mode,
                       std::vector<float>& logits) {
  const int64_t T = int64_t(ids.size()), E = hp_.n_embd, pos0 = st.n_past;
  cpu::ThreadPool& pool = ctx.pool;
  std::vector<float> x(T * E), h(T * E), o(T * E);
  embed(tok_embd_.matrix(), ids, x.data());

  const layers::AttentionShape shape{hp_.n_head, hp_.n_head_kv, hp_.head_dim_k, hp_.rms_eps, &rope_};
  auto norm_rows = [&](const float* w) { rms_norm_rows(pool, x.data(), w, T, h.data()); };
  auto add_residual = [&] { add_rows(x.data(), o.data(), T); };

  // Layer 0's experts are predicted from the embeddings and read while attention runs.
  std::vector<int32_t> pred;
  read_ahead_first(ctx, layers_[0].moe.router, layers_[0].ffn_norm.values(), x.data(), T, h.data(), pred);

  for (int l = 0; l < hp_.n_layer; ++l) {
    const Qwen3MoeLayer& L = layers_[l];
    // Attention block: x += attn(rmsnorm(x)).
    norm_rows(L.attn_norm.values());
    const layers::AttentionWeights aw{L.wq.matrix(), L.wk.matrix(), L.wv.matrix(), L.wo.matrix(),
                                      L.q_norm.values(), L.k_norm.values()};
    layers::attention_block(pool, ctx.kernels, aw, shape, h.data(), E, T, pos0, st.k[l].data(), st.v[l].data(), o.data());
    add_residual();

    // MoE block: x += moe(rmsnorm(x)), experts through the stream, layer l+1 read ahead.
    norm_rows(L.ffn_norm.values());
    moe_step(ctx, l, L.moe, l + 1 < hp_.n_layer ? &layers_[l + 1].moe.router : nullptr, h.data(), T, o.data(), pred);
    add_residual();
  }
  st.n_past += T;

  // Final norm and the output head (tied to token_embd when output.weight is absent).
  output_head(ctx, x.data(), T, mode, output_norm_.values(), hp_.tied_output ? tok_embd_.matrix() : output_.matrix(),
              h.data(), logits);
}

}  // namespace

std::unique_ptr<Model> load_qwen3moe(const gguf::File& f, const LoadOptions& opts) {
  return std::make_unique<Qwen3Moe>(f, opts);
}

}  // namespace strata::model
