// DeepSeek-V2 / V3 / R1, Kimi K2, GLM-4.7-Flash (general.architecture = "deepseek2"), in the
// MLA layout llama.cpp's converter writes (attn_k_b / attn_v_b split from kv_b). Per layer l:
//   h = rmsnorm(x) * attn_norm
//   x += multi-head latent attention(h)           (backend::MlaSpec: q_a/q_a_norm/q_b or attn_q,
//        kv_a_mqa, kv_a_norm, k_b, v_b; a latent cache of kv_lora_rank + n_rot floats per token;
//        NORM (interleaved pairs) RoPE on the n_rot rope dims; scale 1/sqrt(key_length_mla))
//   h = rmsnorm(x) * ffn_norm
//   x += l < leading_dense_block_count ? ffn(h) : moe(h) + shexp(h)
//   moe: backend::RouterSpec with sigmoid or softmax gating (routed_gating), exp_probs_b.bias
//        for selection only, expert_group_count groups scored by the sum of their top-2 of
//        which expert_group_used_count compete, top-k, renormalized if expert_weights_norm,
//        times expert_weights_scale.
// Keys: attention.q_lora_rank, attention.kv_lora_rank, attention.key_length_mla (nope + rope
// dims per head), attention.value_length_mla; attention.key_length / value_length are the
// absorbed widths (kv_lora_rank + n_rot, kv_lora_rank) and head_count_kv is 1.
// References: transformers modeling_deepseek_v3.py (DeepseekV3Attention with rope_interleave,
// DeepseekV3TopkRouter, DeepseekV3MoE); llama.cpp src/models/deepseek2.cpp, llama-model.cpp and
// convert_hf_to_gguf.py (DeepseekV2Model) for names and keys.
#include <cmath>

#include <fmt/format.h>

#include "model/arch.h"
#include "model/rope_scaling.h"
#include "model/routed_moe.h"
#include "model/step.h"

namespace strata::model {
namespace {

int n_nope(const ModelHParams& hp) { return hp.head_dim_k_mla - hp.n_rot; }

std::vector<TensorSpec> tensors(const ModelHParams& hp) {
  const int64_t E = hp.n_embd, V = hp.n_vocab;
  const int64_t H = hp.n_head, QL = hp.q_lora_rank, KL = hp.kv_lora_rank, P = hp.n_rot;
  const int64_t N = n_nope(hp), Vd = hp.head_dim_v_mla, qk = N + P;
  using R = TensorRole;
  using I = TensorInit;
  std::vector<TensorSpec> t;
  if (!hp.tied_output) t.push_back({"output.weight", {E, V}, R::Matrix, I::Weight});
  t.push_back({"token_embd.weight", {E, V}, R::Matrix, I::Weight});
  for (int l = 0; l < forward_layers(hp); ++l) {
    auto b = [&](const char* n) { return blk(l, n); };
    t.push_back({b("attn_norm.weight"), {E}, R::Vector, I::Norm});
    add_routed_ffn_tensors(t, hp, l);
    t.insert(t.end(), {
                          {b("ffn_norm.weight"), {E}, R::Vector, I::Norm},
                          {b("attn_kv_a_norm.weight"), {KL}, R::Vector, I::Norm},
                          {b("attn_kv_a_mqa.weight"), {E, KL + P}, R::Matrix, I::Weight},
                          {b("attn_k_b.weight"), {N, KL, H}, R::Matrix, I::Weight},
                          {b("attn_v_b.weight"), {KL, Vd, H}, R::Matrix, I::Weight},
                          {b("attn_output.weight"), {H * Vd, E}, R::Matrix, I::Weight},
                      });
    if (QL > 0)
      t.insert(t.end(), {
                            {b("attn_q_a_norm.weight"), {QL}, R::Vector, I::Norm},
                            {b("attn_q_a.weight"), {E, QL}, R::Matrix, I::Weight},
                            {b("attn_q_b.weight"), {QL, H * qk}, R::Matrix, I::Weight},
                        });
    else
      t.push_back({b("attn_q.weight"), {E, H * qk}, R::Matrix, I::Weight});
  }
  t.push_back({"output_norm.weight", {E}, R::Vector, I::Norm});
  return t;
}

void validate(const gguf::File& f, const ModelHParams& hp) {
  const std::string& a = hp.arch;
  for (int l = 0; l < forward_layers(hp); ++l)
    if (f.find_tensor(blk(l, "attn_kv_b.weight")) && !f.find_tensor(blk(l, "attn_k_b.weight")))
      throw ModelError(
          fmt::format("{}: tensor '{}' (the pre-MLA layout, converted before llama.cpp split it into "
                      "attn_k_b and attn_v_b) is not supported: re-convert with a current "
                      "convert_hf_to_gguf.py",
                      f.path(), blk(l, "attn_kv_b.weight")));
  if (hp.kv_lora_rank <= 0)
    throw ModelError(fmt::format("{}: key '{}.attention.kv_lora_rank' is missing or 0 (MLA needs it)", f.path(), a));
  if (hp.head_dim_k_mla <= 0 || hp.head_dim_v_mla <= 0)
    throw ModelError(
        fmt::format("{}: keys '{}.attention.key_length_mla' and '{}.attention.value_length_mla' are "
                    "needed (MLA head sizes)",
                    f.path(), a, a));
  if (hp.n_rot <= 0 || hp.n_rot % 2 != 0 || hp.n_rot >= hp.head_dim_k_mla)
    throw ModelError(
        fmt::format("{}: key '{}.rope.dimension_count' = {} must be even and below "
                    "attention.key_length_mla = {}",
                    f.path(), a, hp.n_rot, hp.head_dim_k_mla));
  if (hp.n_head_kv != 1 || hp.head_dim_k != hp.kv_lora_rank + hp.n_rot || hp.head_dim_v != hp.kv_lora_rank)
    throw ModelError(
        fmt::format("{}: MLA expects head_count_kv 1, key_length = kv_lora_rank + rope dims ({}) and "
                    "value_length = kv_lora_rank ({}); got {}, {} and {}",
                    f.path(), hp.kv_lora_rank + hp.n_rot, hp.kv_lora_rank, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v));
  validate_routed_moe(f, hp);
}

struct Layer {
  backend::Tensor attn_norm, ffn_norm;
  backend::MlaWeights attn;
  bool dense = false;
  backend::FfnWeights ffn;
  MoeLayer moe;
  backend::FfnWeights shexp;
};

class Deepseek2 final : public Model {
 public:
  Deepseek2(const gguf::File& f, const BoundWeights& w, backend::Backend& be, const ModelHParams& hp,
            const LoadOptions& opts) {
    hp_ = hp;
    be_ = &be;
    n_fwd_ = forward_layers(hp_);
    // The rope dims use the interleaved layout (adjacent pairs): llama.cpp's LLAMA_ROPE_TYPE_NORM
    // for deepseek2; transformers' rope_interleave de-interleaves q_pe and k_pe alike before
    // rotate_half, the same scores.
    // YaRN (DeepSeek V2/V3 files): the q.k scale also takes mscale^2 (model/rope_scaling.h).
    const ScaledRope sr = scaled_rope(f, hp_, hp_.n_rot, backend::RopeSpec::Mode::Norm, YarnFlavour::Deepseek2, true,
                                      opts.rope_freqs_bf16);
    rope_ = sr.rope;
    mla_.n_head = hp_.n_head;
    mla_.q_lora_rank = hp_.q_lora_rank;
    mla_.kv_lora_rank = hp_.kv_lora_rank;
    mla_.n_nope = n_nope(hp_);
    mla_.n_rot = hp_.n_rot;
    mla_.v_dim = hp_.head_dim_v_mla;
    mla_.rms_eps = hp_.rms_eps;
    mla_.rope = &rope_;
    if (sr.kq_factor != 1.0) mla_.scale = float(sr.kq_factor / std::sqrt(double(mla_.n_nope + mla_.n_rot)));
    bind_io(w);
    layers_.resize(size_t(n_fwd_));
    experts_.resize(size_t(hp_.n_layer));  // dense and NextN layers: n_expert = 0
    for (int l = 0; l < n_fwd_; ++l) {
      auto b = [&](const char* n) { return w.get(blk(l, n)); };
      auto m = [&](const char* n) { return w.maybe(blk(l, n)); };
      Layer& L = layers_[size_t(l)];
      L.attn_norm = b("attn_norm.weight");
      L.attn.wq_a = m("attn_q_a.weight");
      L.attn.q_a_norm = m("attn_q_a_norm.weight");
      L.attn.wq_b = m("attn_q_b.weight");
      L.attn.wq = m("attn_q.weight");
      L.attn.wkv_a = b("attn_kv_a_mqa.weight");
      L.attn.kv_a_norm = b("attn_kv_a_norm.weight");
      L.attn.wk_b = b("attn_k_b.weight");
      L.attn.wv_b = b("attn_v_b.weight");
      L.attn.wo = b("attn_output.weight");
      L.ffn_norm = b("ffn_norm.weight");
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
    for (int l = 0; l < hp_.n_layer; ++l) {
      st.k.emplace_back(*be_, l < n_fwd_ ? n_ctx * mla_.cache_dim() : 0);  // the latent cache
      st.v.emplace_back(*be_, 0);
    }
    return st;
  }

  uint64_t state_bytes(int64_t n_ctx) const override {
    return uint64_t(n_fwd_) * uint64_t(n_ctx) * uint64_t(mla_.cache_dim()) * sizeof(float);
  }

  void forward(ForwardContext& ctx, std::span<SeqInput> batch) override {
    Step s(ctx, *this, batch);
    s.embed(tok_embd_);
    const int first_moe = hp_.n_layer_dense_lead;
    if (first_moe < n_fwd_)
      s.read_ahead_first(layers_[size_t(first_moe)].moe, layers_[size_t(first_moe)].ffn_norm, first_moe);
    backend::FfnCall dense, shared;
    shared.accumulate = true;
    for (int l = 0; l < n_fwd_; ++l) {
      const Layer& L = layers_[size_t(l)];
      s.norm(L.attn_norm, "attn_norm", l);
      s.mla_attention(l, mla_, L.attn);
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
  backend::MlaSpec mla_;
};

}  // namespace
}  // namespace strata::model

STRATA_ARCHITECTURE(deepseek2) {
  using namespace strata::model;
  using K = KeySpec;
  using H = ModelHParams;
  Architecture a;
  a.name = "deepseek2";
  a.matches = [](const strata::gguf::File& f) { return f.get_string("general.architecture") == "deepseek2"; };
  a.keys = routed_moe_keys();
  a.keys.insert(a.keys.end(), {
                                  {"attention.q_lora_rank", &H::q_lora_rank, K::Need::Optional},
                                  {"attention.kv_lora_rank", &H::kv_lora_rank, K::Need::Optional},
                                  {"attention.key_length_mla", &H::head_dim_k_mla, K::Need::Optional},
                                  {"attention.value_length_mla", &H::head_dim_v_mla, K::Need::Optional},
                              });
  a.tensors = tensors;
  a.validate = validate;
  a.load = [](const strata::gguf::File& f, const ModelHParams& hp, const BoundWeights& w, strata::backend::Backend& be,
              const LoadOptions& o) { return std::unique_ptr<Model>(new Deepseek2(f, w, be, hp, o)); };
  return a;
}
