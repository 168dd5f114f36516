// Qwen3-Next (general.architecture = "qwen3next"): a hybrid of gated-delta-net (linear
// attention) layers and gated full-attention layers, every layer followed by a routed MoE
// (softmax, top-k, renormalized) plus a shared expert scaled by a sigmoid gate.
//   layer l is full attention when (l + 1) % full_attention_interval == 0, else linear;
//   x += mixer(rmsnorm(x) * attn_norm);  x += moe(h) + sigmoid(h . w_sh) * shexp(h),
//   h = rmsnorm(x) * post_attention_norm.
// References: transformers modeling_qwen3_next.py (Qwen3NextDecoderLayer,
// Qwen3NextGatedDeltaNet, Qwen3NextAttention, Qwen3NextSparseMoeBlock); llama.cpp
// src/models/qwen3next.cpp and convert_hf_to_gguf.py (Qwen3NextModel), whose tensor layout
// we read as is: norms already hold 1 + w (the converter adds the 1 of Qwen3NextRMSNorm,
// except for the gated ssm_norm), ssm_a = -exp(A_log), in_proj_qkvz split into attn_qkv
// ([q all heads | k all heads | v all heads]) and attn_gate (z). docs/architectures.md has the
// formulas.
#include <fmt/format.h>

#include "model/arch.h"
#include "model/qwen_hybrid.h"
#include "model/rope_scaling.h"
#include "model/step.h"

namespace strata::model {
namespace {

bool is_recurrent(const ModelHParams& hp, int l) { return (l + 1) % hp.full_attention_interval != 0; }

backend::GdnSpec gdn_spec(const ModelHParams& hp) {
  return backend::GdnSpec{hp.ssm_group_count, hp.ssm_time_step_rank,
                          hp.ssm_state_size,  hp.ssm_inner_size / hp.ssm_time_step_rank,
                          hp.ssm_conv_kernel, hp.rms_eps};
}

// The tensor table, in the order of llama.cpp's conversion (see models/qwen3next-tiny-bf16.gguf).
std::vector<TensorSpec> tensors(const ModelHParams& hp) {
  const int64_t E = hp.n_embd, V = hp.n_vocab;
  const backend::GdnSpec g = gdn_spec(hp);
  const int64_t nv = hp.ssm_time_step_rank;
  using R = TensorRole;
  using I = TensorInit;
  std::vector<TensorSpec> t;
  if (!hp.tied_output) t.push_back({"output.weight", {E, V}, R::Matrix, I::Weight});
  t.push_back({"token_embd.weight", {E, V}, R::Matrix, I::Weight});
  for (int l = 0; l < hp.n_layer; ++l) {
    auto b = [&](const char* n) { return blk(l, n); };
    const bool rec = is_recurrent(hp, l);
    t.push_back({b("attn_norm.weight"), {E}, R::Vector, I::Norm});
    if (rec)
      t.insert(t.end(), {
                            {b("ssm_a"), {nv}, R::Vector, I::SsmA},
                            {b("ssm_conv1d.weight"), {g.conv_kernel, g.conv_dim()}, R::Vector, I::Conv},
                            {b("ssm_dt.bias"), {nv}, R::Vector, I::DtBias},
                            {b("ssm_ba.weight"), {E, 2 * nv}, R::Matrix, I::Weight},
                            {b("attn_qkv.weight"), {E, g.conv_dim()}, R::Matrix, I::Weight},
                            {b("attn_gate.weight"), {E, g.value_dim()}, R::Matrix, I::Weight},
                            {b("ssm_norm.weight"), {g.head_v_dim}, R::Vector, I::Norm},
                            {b("ssm_out.weight"), {g.value_dim(), E}, R::Matrix, I::Weight},
                        });
    add_shared_expert_moe_tensors(t, hp, l);
    if (!rec) add_gated_attention_tensors(t, hp, l);
  }
  t.push_back({"output_norm.weight", {E}, R::Vector, I::Norm});
  return t;
}

void validate(const gguf::File& f, const ModelHParams& hp) {
  validate_rope_scaling(f, hp);
  if (hp.ssm_time_step_rank % hp.ssm_group_count != 0)
    throw ModelError(
        fmt::format("{}: ssm.time_step_rank {} (value heads) is not a multiple of ssm.group_count {} "
                    "(key heads)",
                    f.path(), hp.ssm_time_step_rank, hp.ssm_group_count));
  if (hp.ssm_inner_size % hp.ssm_time_step_rank != 0)
    throw ModelError(fmt::format("{}: ssm.inner_size {} is not a multiple of ssm.time_step_rank {}", f.path(),
                                 hp.ssm_inner_size, hp.ssm_time_step_rank));
  if (hp.head_dim_v != hp.head_dim_k)
    throw ModelError(fmt::format("{}: qwen3next needs key_length == value_length, got {} and {}", f.path(),
                                 hp.head_dim_k, hp.head_dim_v));
  if (hp.n_expert <= 0 || hp.n_expert_used <= 0 || hp.n_ff_exp <= 0 || hp.n_ff_shexp <= 0)
    throw ModelError(
        fmt::format("{}: qwen3next needs expert_count, expert_used_count, expert_feed_forward_length "
                    "and expert_shared_feed_forward_length > 0",
                    f.path()));
}

struct Layer {
  bool recurrent = false;  // gated delta net (true) or gated full attention
  backend::Tensor attn_norm;
  backend::GdnWeights lin;         // when recurrent
  backend::AttentionWeights att;   // otherwise
  backend::Tensor post_attn_norm;  // before the MoE
  MoeLayer moe;
  backend::FfnWeights shexp;   // the shared expert (resident)
  backend::Tensor shexp_gate;  // ffn_gate_inp_shexp
};

class Qwen3Next final : public Model {
 public:
  Qwen3Next(const gguf::File& f, const BoundWeights& w, backend::Backend& be, const ModelHParams& hp,
            const LoadOptions& opts) {
    hp_ = hp;
    be_ = &be;
    gdn_ = gdn_spec(hp_);
    rope_ =
        scaled_rope(f, hp_, hp_.n_rot, backend::RopeSpec::Mode::Neox, YarnFlavour::Standard, true, opts.rope_freqs_bf16)
            .rope;
    attn_ = attention_spec(&rope_);
    attn_.q_gate = true;
    const backend::RouterSpec router = softmax_router();
    bind_io(w);
    layers_.resize(size_t(hp_.n_layer));
    experts_.resize(size_t(hp_.n_layer));
    for (int l = 0; l < hp_.n_layer; ++l) {
      auto b = [&](const char* n) { return w.get(blk(l, n)); };
      Layer& L = layers_[size_t(l)];
      L.recurrent = is_recurrent(hp_, l);
      L.attn_norm = b("attn_norm.weight");
      if (L.recurrent)
        L.lin = {b("attn_qkv.weight"),   b("attn_gate.weight"), b("ssm_ba.weight"), b("ssm_out.weight"),
                 b("ssm_conv1d.weight"), b("ssm_dt.bias"),      b("ssm_a"),         b("ssm_norm.weight")};
      else
        L.att = bind_attention(w, l);
      L.post_attn_norm = b("post_attention_norm.weight");
      L.moe = bind_moe(w, l, router);
      L.shexp = {b("ffn_gate_shexp.weight"), b("ffn_up_shexp.weight"), b("ffn_down_shexp.weight")};
      L.shexp_gate = b("ffn_gate_inp_shexp.weight");
    }
    dense_bytes_ = w.dense_bytes();
  }

  SequenceState new_state(int64_t n_ctx) const override {
    SequenceState st;
    st.n_ctx = n_ctx;
    const int64_t kv_dim = int64_t(hp_.n_head_kv) * hp_.head_dim_k;
    for (const Layer& L : layers_) {
      st.conv.emplace_back(*be_, L.recurrent ? gdn_.conv_state_size() : 0);
      st.ssm.emplace_back(*be_, L.recurrent ? gdn_.ssm_state_size() : 0);
      st.k.emplace_back(*be_, L.recurrent ? 0 : n_ctx * kv_dim);
      st.v.emplace_back(*be_, L.recurrent ? 0 : n_ctx * kv_dim);
    }
    return st;
  }

  uint64_t state_bytes(int64_t n_ctx) const override {
    uint64_t floats = 0;
    for (const auto& L : layers_)
      floats += L.recurrent ? uint64_t(gdn_.conv_state_size() + gdn_.ssm_state_size())
                            : uint64_t(2) * n_ctx * hp_.n_head_kv * hp_.head_dim_k;
    return floats * sizeof(float);
  }

  void forward(ForwardContext& ctx, std::span<SeqInput> batch) override {
    Step s(ctx, *this, batch);
    s.embed(tok_embd_);
    s.read_ahead_first(layers_[0].moe, layers_[0].post_attn_norm);  // layer 0's experts load during the mixer
    backend::FfnCall shared;  // x += sigmoid(h . gate_inp_shexp) * shared_expert(h)
    shared.accumulate = true;
    for (int l = 0; l < hp_.n_layer; ++l) {
      const Layer& L = layers_[size_t(l)];
      s.norm(L.attn_norm, "attn_norm", l);
      if (L.recurrent)
        s.gated_delta_net(l, gdn_, L.lin);
      else
        s.attention(l, attn_, L.att);
      s.residual("ffn_inp", l);
      s.norm(L.post_attn_norm, "ffn_norm", l);
      s.moe(l, L.moe, moe_ahead(layers_, l, hp_.n_layer, 1), moe_ahead(layers_, l, hp_.n_layer, 2));
      shared.scalar_gate = L.shexp_gate;
      s.ffn(shared, L.shexp, "ffn_out", l);
      s.residual("l_out", l);
    }
    s.output(output_norm_, output_);
  }

 private:
  backend::GdnSpec gdn_;
  std::vector<Layer> layers_;
  backend::RopeSpec rope_;
  backend::AttentionSpec attn_;
};

}  // namespace
}  // namespace strata::model

STRATA_ARCHITECTURE(qwen3next) {
  using namespace strata::model;
  using K = KeySpec;
  using H = ModelHParams;
  Architecture a;
  a.name = "qwen3next";
  a.matches = [](const strata::gguf::File& f) { return f.get_string("general.architecture") == "qwen3next"; };
  a.keys = {
      {"ssm.conv_kernel", &H::ssm_conv_kernel, K::Need::Required},
      {"ssm.state_size", &H::ssm_state_size, K::Need::Required},
      {"ssm.group_count", &H::ssm_group_count, K::Need::Required},
      {"ssm.time_step_rank", &H::ssm_time_step_rank, K::Need::Required},
      {"ssm.inner_size", &H::ssm_inner_size, K::Need::Required},
      {"full_attention_interval", &H::full_attention_interval, K::Need::Required},
  };
  a.tensors = tensors;
  a.validate = validate;
  a.load = [](const strata::gguf::File& f, const ModelHParams& hp, const BoundWeights& w, strata::backend::Backend& be,
              const LoadOptions& o) { return std::unique_ptr<Model>(new Qwen3Next(f, w, be, hp, o)); };
  return a;
}
