// GLM-4.5 / 4.6 / 4.7 MoE (general.architecture = "glm4moe"). Per forward layer l:
//   h = rmsnorm(x) * attn_norm
//   x += attn_output(attention(q, k, v)),  q/k/v = attn_{q,k,v}(h) + bias, per-head q/k
//        RMSNorm (when attn_{q,k}_norm are present), NEOX RoPE on the first rope.dimension_count
//        dims of each head (partial rotary), scale 1/sqrt(head_dim), GQA
//   h = rmsnorm(x) * post_attention_norm
//   x += l < leading_dense_block_count ? ffn(h)                      (ffn_{gate,up,down})
//                                      : moe(h) + shexp(h)           (ungated shared experts)
//   moe: sigmoid gating, exp_probs_b.bias for selection only, top-k, renormalized, times
//        expert_weights_scale (backend::RouterSpec)
// The last nextn_predict_layers blocks are the multi-token-prediction head: not in the forward
// pass (their tensors are not read).
// References: transformers modeling_glm4_moe.py (Glm4MoeAttention, Glm4MoeTopkRouter,
// Glm4MoeMoE, Glm4MoeDecoderLayer); llama.cpp src/models/glm4-moe.cpp and
// convert_hf_to_gguf.py (Glm4MoeModel) for the tensor names and keys.
#include <fmt/format.h>

#include "model/arch.h"
#include "model/rope_scaling.h"
#include "model/routed_moe.h"
#include "model/step.h"

namespace strata::model {
namespace {

std::vector<TensorSpec> tensors(const ModelHParams& hp) {
  const int64_t E = hp.n_embd, V = hp.n_vocab, hd = hp.head_dim_k;
  const int64_t q = int64_t(hp.n_head) * hd, kv = int64_t(hp.n_head_kv) * hd;
  using R = TensorRole;
  using I = TensorInit;
  const bool opt = true;
  std::vector<TensorSpec> t;
  if (!hp.tied_output) t.push_back({"output.weight", {E, V}, R::Matrix, I::Weight});
  t.push_back({"token_embd.weight", {E, V}, R::Matrix, I::Weight});
  for (int l = 0; l < forward_layers(hp); ++l) {
    auto b = [&](const char* n) { return blk(l, n); };
    t.push_back({b("attn_norm.weight"), {E}, R::Vector, I::Norm});
    add_routed_ffn_tensors(t, hp, l);
    t.insert(t.end(), {
                          {b("post_attention_norm.weight"), {E}, R::Vector, I::Norm},
                          {b("attn_k_norm.weight"), {hd}, R::Vector, I::Norm, {}, opt},
                          {b("attn_k.bias"), {kv}, R::Vector, I::Norm, {}, opt},
                          {b("attn_k.weight"), {E, kv}, R::Matrix, I::Weight},
                          {b("attn_output.weight"), {q, E}, R::Matrix, I::Weight},
                          {b("attn_q_norm.weight"), {hd}, R::Vector, I::Norm, {}, opt},
                          {b("attn_q.bias"), {q}, R::Vector, I::Norm, {}, opt},
                          {b("attn_q.weight"), {E, q}, R::Matrix, I::Weight},
                          {b("attn_v.bias"), {kv}, R::Vector, I::Norm, {}, opt},
                          {b("attn_v.weight"), {E, kv}, R::Matrix, I::Weight},
                      });
  }
  t.push_back({"output_norm.weight", {E}, R::Vector, I::Norm});
  return t;
}

void validate(const gguf::File& f, const ModelHParams& hp) {
  if (hp.head_dim_v != hp.head_dim_k)
    throw ModelError(fmt::format("{}: glm4moe needs key_length == value_length, got {} and {}", f.path(), hp.head_dim_k,
                                 hp.head_dim_v));
  validate_routed_moe(f, hp);
}

struct Layer {
  backend::Tensor attn_norm, ffn_norm;
  backend::AttentionWeights attn;
  bool dense = false;
  backend::FfnWeights ffn;    // dense layers: ffn_{gate,up,down}
  MoeLayer moe;               // MoE layers
  backend::FfnWeights shexp;  // MoE layers with shared experts (empty otherwise)
};

class Glm4Moe final : public Model {
 public:
  Glm4Moe(const gguf::File& f, const BoundWeights& w, backend::Backend& be, const ModelHParams& hp,
          const LoadOptions& opts) {
    hp_ = hp;
    be_ = &be;
    n_fwd_ = forward_layers(hp_);
    rope_ =
        scaled_rope(f, hp_, hp_.n_rot, backend::RopeSpec::Mode::Neox, YarnFlavour::Standard, true, opts.rope_freqs_bf16)
            .rope;
    attn_.n_head = hp_.n_head;
    attn_.n_head_kv = hp_.n_head_kv;
    attn_.head_dim = hp_.head_dim_k;
    attn_.rms_eps = hp_.rms_eps;
    attn_.rope = &rope_;
    bind_io(w);
    layers_.resize(size_t(n_fwd_));
    experts_.resize(size_t(hp_.n_layer));  // dense and NextN layers: n_expert = 0
    for (int l = 0; l < n_fwd_; ++l) {
      auto b = [&](const char* n) { return w.get(blk(l, n)); };
      Layer& L = layers_[size_t(l)];
      L.attn_norm = b("attn_norm.weight");
      L.attn = bind_attention(w, l);
      L.ffn_norm = b("post_attention_norm.weight");
      L.dense = l < hp_.n_layer_dense_lead;
      if (L.dense) {
        L.ffn = {b("ffn_gate.weight"), b("ffn_up.weight"), b("ffn_down.weight")};
      } else {
        L.moe = bind_moe(w, l, routed_router_spec(f, hp_, w, be, l));
        if (hp_.n_expert_shared > 0)
          L.shexp = {b("ffn_gate_shexp.weight"), b("ffn_up_shexp.weight"), b("ffn_down_shexp.weight")};
      }
    }
    dense_bytes_ = w.dense_bytes();
  }

  SequenceState new_state(int64_t n_ctx) const override {
    SequenceState st;
    st.n_ctx = n_ctx;
    const int64_t kv_dim = int64_t(hp_.n_head_kv) * hp_.head_dim_k;
    for (int l = 0; l < hp_.n_layer; ++l) {
      const bool fwd = l < n_fwd_;
      st.k.emplace_back(*be_, fwd ? n_ctx * kv_dim : 0);
      st.v.emplace_back(*be_, fwd ? n_ctx * kv_dim : 0);
    }
    return st;
  }

  uint64_t state_bytes(int64_t n_ctx) const override {
    return uint64_t(2) * n_fwd_ * n_ctx * hp_.n_head_kv * hp_.head_dim_k * sizeof(float);
  }

  void forward(ForwardContext& ctx, std::span<SeqInput> batch) override {
    Step s(ctx, *this, batch);
    s.embed(tok_embd_);
    const int first_moe = hp_.n_layer_dense_lead;
    if (first_moe < n_fwd_)  // the first MoE layer's experts load during the layers before it
      s.read_ahead_first(layers_[size_t(first_moe)].moe, layers_[size_t(first_moe)].ffn_norm, first_moe);
    backend::FfnCall dense, shared;
    shared.accumulate = true;  // o += shared experts(h), after the routed sum
    for (int l = 0; l < n_fwd_; ++l) {
      const Layer& L = layers_[size_t(l)];
      s.norm(L.attn_norm, "attn_norm", l);
      s.attention(l, attn_, L.attn);
      s.residual("ffn_inp", l);
      s.norm(L.ffn_norm, "ffn_norm", l);
      if (L.dense) {
        s.ffn(dense, L.ffn, "ffn_out", l);
      } else {
        s.moe(l, L.moe, moe_ahead(layers_, l, n_fwd_, 1), moe_ahead(layers_, l, n_fwd_, 2));
        if (!L.shexp.gate.empty()) s.ffn(shared, L.shexp, "ffn_out", l);
      }
      s.residual("l_out", l);
    }
    s.output(output_norm_, output_);
  }

 private:
  int n_fwd_ = 0;
  std::vector<Layer> layers_;
  backend::RopeSpec rope_;
  backend::AttentionSpec attn_;
};

}  // namespace
}  // namespace strata::model

STRATA_ARCHITECTURE(glm4moe) {
  using namespace strata::model;
  Architecture a;
  a.name = "glm4moe";
  a.matches = [](const strata::gguf::File& f) { return f.get_string("general.architecture") == "glm4moe"; };
  a.keys = routed_moe_keys();
  a.tensors = tensors;
  a.validate = validate;
  a.load = [](const strata::gguf::File& f, const ModelHParams& hp, const BoundWeights& w, strata::backend::Backend& be,
              const LoadOptions& o) { return std::unique_ptr<Model>(new Glm4Moe(f, w, be, hp, o)); };
  return a;
}
