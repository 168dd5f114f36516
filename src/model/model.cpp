#include "model/model.h"

#include <fmt/format.h>

#include "model/arch.h"
#include "model/step.h"

namespace strata::model {

StateBuf::StateBuf(backend::Backend& be, int64_t floats) : be_(&be) {
  if (floats > 0) buf_ = be.alloc(backend::BufferRole::State, size_t(floats) * sizeof(float));
}

StateBuf::StateBuf(const StateBuf& o) : be_(o.be_) {
  if (!o.buf_) return;
  buf_ = be_->alloc(backend::BufferRole::State, o.buf_->bytes());
  be_->copy(tensor(1), o.tensor(1), o.buf_->bytes());
}

StateBuf& StateBuf::operator=(const StateBuf& o) {
  if (this != &o) *this = StateBuf(o);
  return *this;
}

void StateBuf::zero() {
  if (buf_) buf_ = be_->alloc(backend::BufferRole::State, buf_->bytes());  // State buffers start zeroed
}

backend::Tensor StateBuf::tensor(int64_t cols) const {
  if (!buf_) return {};
  return buf_->f32(cols, int64_t(size()) / cols);
}

Model::~Model() = default;

void Model::forward(ForwardContext& ctx, SequenceState& st, std::span<const int32_t> ids, LogitsMode mode,
                    std::vector<float>& logits) {
  SeqInput one[1] = {SeqInput{&st, ids, mode, &logits}};
  forward(ctx, std::span<SeqInput>(one));
}

void Model::bind_io(const BoundWeights& w) {
  tok_embd_ = w.get("token_embd.weight");
  output_norm_ = w.get("output_norm.weight");
  output_ = hp_.tied_output ? tok_embd_ : w.get("output.weight");
}

backend::AttentionWeights Model::bind_attention(const BoundWeights& w, int layer) const {
  auto get = [&](const char* n) { return w.get(blk(layer, n)); };
  auto maybe = [&](const char* n) { return w.maybe(blk(layer, n)); };
  backend::AttentionWeights a;
  a.wq = get("attn_q.weight");
  a.wk = get("attn_k.weight");
  a.wv = get("attn_v.weight");
  a.wo = get("attn_output.weight");
  a.q_norm = maybe("attn_q_norm.weight");
  a.k_norm = maybe("attn_k_norm.weight");
  a.bq = maybe("attn_q.bias");
  a.bk = maybe("attn_k.bias");
  a.bv = maybe("attn_v.bias");
  a.bo = maybe("attn_output.bias");
  a.sinks = maybe("attn_sinks.weight");
  return a;
}

backend::AttentionSpec Model::attention_spec(const backend::RopeSpec* rope) const {
  backend::AttentionSpec a;
  a.n_head = hp_.n_head;
  a.n_head_kv = hp_.n_head_kv;
  a.head_dim = hp_.head_dim_k;
  a.rms_eps = hp_.rms_eps;
  a.rope = rope;
  return a;
}

backend::RouterSpec Model::softmax_router() const {
  backend::RouterSpec r;
  r.gating = backend::RouterSpec::Gating::Softmax;
  r.n_expert = hp_.n_expert;
  r.top_k = hp_.n_expert_used;
  r.norm_topk = hp_.norm_topk;
  return r;
}

MoeLayer Model::bind_moe(const BoundWeights& w, int layer, const backend::RouterSpec& spec) {
  auto part = [&](const char* name, int i) {
    const gguf::TensorInfo& t = w.expert(blk(layer, name));
    experts_[size_t(layer)].part[i] = stream::PartLayout{t.offset, t.ne[1] * t.row_bytes};
    return ExpertPartShape{t.type, int64_t(t.ne[1]), int64_t(t.ne[0]), size_t(t.row_bytes)};
  };
  MoeLayer m;
  m.router = w.get(blk(layer, "ffn_gate_inp.weight"));
  // biases only where the architecture's table lists them (gpt-oss); empty otherwise
  m.router_bias = w.maybe(blk(layer, "ffn_gate_inp.bias"));
  m.gate_bias = w.maybe(blk(layer, "ffn_gate_exps.bias"));
  m.up_bias = w.maybe(blk(layer, "ffn_up_exps.bias"));
  m.down_bias = w.maybe(blk(layer, "ffn_down_exps.bias"));
  m.spec = spec;
  experts_[size_t(layer)].n_expert = spec.n_expert;
  m.gate = part("ffn_gate_exps.weight", 0);
  m.up = part("ffn_up_exps.weight", 1);
  m.down = part("ffn_down_exps.weight", 2);
  return m;
}

std::unique_ptr<Model> load_model(const gguf::File& gguf, backend::Backend& be, const LoadOptions& opts) {
  const Architecture& a = architecture_for(gguf);
  const ModelHParams hp = read_hparams(gguf, a);
  // a layer tensor past block_count would be silently unused: the file and its metadata disagree
  for (const auto& t : gguf.tensors())
    if (t.layer() >= hp.n_layer)
      throw ModelError(fmt::format("{}: tensor '{}' belongs to layer {}, but {}.block_count says {} layers",
                                   gguf.path(), t.name, t.layer(), hp.arch, hp.n_layer));
  // llama.cpp's fused expert layout (per expert, n_ff gate rows then n_ff up rows) would need a
  // strided read per part; the stream reads each part as one contiguous slice, so no
  // architecture takes it yet.
  for (int l = 0; l < hp.n_layer; ++l)
    if (gguf.find_tensor(blk(l, "ffn_gate_up_exps.weight")))
      throw ModelError(
          fmt::format("{}: tensor '{}' (fused expert gate+up, shape [{}, {}, {}]) is not supported yet: "
                      "re-convert with separate ffn_gate_exps/ffn_up_exps",
                      gguf.path(), blk(l, "ffn_gate_up_exps.weight"), hp.n_embd, 2 * hp.n_ff_exp, hp.n_expert));
  auto w = std::make_unique<const BoundWeights>(gguf, a.tensors(hp), be);
  std::unique_ptr<Model> m = a.load(gguf, hp, *w, be, opts);
  m->weights_ = std::move(w);
  return m;
}

}  // namespace strata::model
