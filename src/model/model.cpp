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
  auto w = std::make_unique<const BoundWeights>(gguf, a.tensors(hp), be);
  std::unique_ptr<Model> m = a.load(gguf, hp, *w, be, opts);
  m->weights_ = std::move(w);
  return m;
}

}  // namespace strata::model
