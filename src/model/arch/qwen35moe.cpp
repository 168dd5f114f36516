// Qwen3.5 MoE text model (general.architecture = "qwen35moe"; transformers
// Qwen3_5MoeForCausalLM): the Qwen3-Next layer stack (gated-delta-net layers, a gated
// full-attention layer every full_attention_interval-th layer, routed softmax top-k MoE plus a
// sigmoid-gated shared expert) with three differences in the file and one in the RoPE:
//   - the linear layers' b and a projections are two tensors, ssm_beta and ssm_alpha
//     (ne {n_embd, n_v_head}: HF's in_proj_b / in_proj_a), not qwen3next's interleaved ssm_ba;
//   - llama.cpp's converter permutes the value heads from HF's grouped order (value head
//     g r + i reads key head g) to a tiled order (value head i n_k + g reads key head g), in
//     every tensor indexed by value head (convert_hf_to_gguf.py _LinearAttentionVReorderBase):
//     GdnSpec::VHeadOrder::Tiled. The permutation is consistent from attn_qkv's v rows to
//     ssm_out's columns, so reading it as is gives HF's result;
//   - block_count counts the NextN / multi-token-prediction blocks the converter appends
//     (`nextn_predict_layers`, HF's mtp.*): the last n_nextn blocks are in the table as
//     TensorRole::Skip and the forward pass stops before them (llama.cpp's main graph does too);
//   - RoPE is interleaved multi-section ("IMRoPE", rope.dimension_sections = HF's mrope_section,
//     mrope_interleaved): rotary pair i takes its position from section t, h or w by i mod 3
//     (HF apply_interleaved_mrope). For text, transformers gives every section the same
//     position, so each pair rotates by pos * theta^(-2i/n_rot): exactly plain NEOX partial
//     rotary, which is what this file runs (tests/test_qwen35moe.cpp checks the identity and the
//     logits). llama.cpp differs on files whose sections do not cover n_rot/2 pairs: it gives
//     text tokens position 0 in the fourth section, so pairs past 3 x section are not rotated
//     (here: pair 7 of 8, inverse frequency 1e7^-0.875 = 7.5e-7 rad/token, invisible).
// Norm weights as qwen3next: the converter stores 1 + w (Qwen3_5MoeRMSNorm multiplies by
// 1 + w) except the gated ssm_norm, stored as is. ssm_a = -exp(A_log).
// References: transformers models/qwen3_5_moe/modeling_qwen3_5_moe.py; llama.cpp
// src/models/qwen35moe.cpp and convert_hf_to_gguf.py (Qwen3_5MoeTextModel). Formulas:
// docs/architectures.md.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "model/arch.h"
#include "model/qwen_hybrid.h"
#include "model/rope_scaling.h"
#include "model/step.h"

namespace strata::model {
namespace {

// full_attention_interval: llama.cpp defaults to 4 when the key is absent.
int interval(const ModelHParams& hp) { return hp.full_attention_interval > 0 ? hp.full_attention_interval : 4; }
// Blocks the forward pass runs: block_count less the NextN blocks at the end.
int n_main(const ModelHParams& hp) { return hp.n_layer - hp.n_nextn; }
bool is_nextn(const ModelHParams& hp, int l) { return l >= n_main(hp); }
bool is_recurrent(const ModelHParams& hp, int l) { return !is_nextn(hp, l) && (l + 1) % interval(hp) != 0; }

backend::GdnSpec gdn_spec(const ModelHParams& hp) {
  backend::GdnSpec g{hp.ssm_group_count, hp.ssm_time_step_rank,
                     hp.ssm_state_size,  hp.ssm_inner_size / hp.ssm_time_step_rank,
                     hp.ssm_conv_kernel, hp.rms_eps};
  g.v_head_order = backend::GdnSpec::VHeadOrder::Tiled;
  return g;
}

// The tensor table, in the order of llama.cpp's conversion (models/qwen35moe-tiny-bf16.gguf).
std::vector<TensorSpec> tensors(const ModelHParams& hp) {
  const int64_t E = hp.n_embd, V = hp.n_vocab, X = hp.n_expert, F = hp.n_ff_exp, FS = hp.n_ff_shexp;
  const int64_t hd = hp.head_dim_k, q = int64_t(hp.n_head) * hd, kv = int64_t(hp.n_head_kv) * hd;
  const backend::GdnSpec g = gdn_spec(hp);
  const int64_t nv = hp.ssm_time_step_rank;
  using R = TensorRole;
  using I = TensorInit;
  std::vector<TensorSpec> t;
  if (!hp.tied_output) t.push_back({"output.weight", {E, V}, R::Matrix, I::Weight});
  t.push_back({"token_embd.weight", {E, V}, R::Matrix, I::Weight});
  for (int l = 0; l < hp.n_layer; ++l) {
    auto b = [&](const char* n) { return blk(l, n); };
    if (is_nextn(hp, l)) {
      // A NextN block (llama.cpp load_block_mtp): a full-attention decoder block with the MoE,
      // plus the projection of [embedding; hidden] and its norms. Not run.
      t.insert(t.end(), {
                            {b("attn_norm.weight"), {E}, R::Skip, I::Norm},
                            {b("post_attention_norm.weight"), {E}, R::Skip, I::Norm},
                            {b("attn_q.weight"), {E, 2 * q}, R::Skip, I::Weight},
                            {b("attn_k.weight"), {E, kv}, R::Skip, I::Weight},
                            {b("attn_v.weight"), {E, kv}, R::Skip, I::Weight},
                            {b("attn_output.weight"), {q, E}, R::Skip, I::Weight},
                            {b("attn_q_norm.weight"), {hd}, R::Skip, I::Norm},
                            {b("attn_k_norm.weight"), {hd}, R::Skip, I::Norm},
                            {b("ffn_gate_inp.weight"), {E, X}, R::Skip, I::Router},
                            {b("ffn_down_exps.weight"), {F, E, X}, R::Skip, I::Weight},
                            {b("ffn_gate_exps.weight"), {E, F, X}, R::Skip, I::Weight},
                            {b("ffn_up_exps.weight"), {E, F, X}, R::Skip, I::Weight},
                            {b("ffn_gate_inp_shexp.weight"), {E, 1}, R::Skip, I::Router, {E}},
                            {b("ffn_gate_shexp.weight"), {E, FS}, R::Skip, I::Weight},
                            {b("ffn_up_shexp.weight"), {E, FS}, R::Skip, I::Weight},
                            {b("ffn_down_shexp.weight"), {FS, E}, R::Skip, I::Weight},
                            {b("nextn.eh_proj.weight"), {2 * E, E}, R::Skip, I::Weight},
                            {b("nextn.enorm.weight"), {E}, R::Skip, I::Norm},
                            {b("nextn.hnorm.weight"), {E}, R::Skip, I::Norm},
                            {b("nextn.shared_head_norm.weight"), {E}, R::Skip, I::Norm},
                        });
      continue;
    }
    const bool rec = is_recurrent(hp, l);
    t.push_back({b("attn_norm.weight"), {E}, R::Vector, I::Norm});
    if (rec)
      t.insert(t.end(), {
                            {b("ssm_a"), {nv}, R::Vector, I::SsmA},
                            {b("ssm_conv1d.weight"), {g.conv_kernel, g.conv_dim()}, R::Vector, I::Conv},
                            {b("ssm_dt.bias"), {nv}, R::Vector, I::DtBias},
                            {b("ssm_alpha.weight"), {E, nv}, R::Matrix, I::Weight},
                            {b("ssm_beta.weight"), {E, nv}, R::Matrix, I::Weight},
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
  if (hp.n_nextn >= hp.n_layer)
    throw ModelError(fmt::format("{}: qwen35moe.nextn_predict_layers {} leaves no decoder block of block_count {}",
                                 f.path(), hp.n_nextn, hp.n_layer));
  if (hp.ssm_time_step_rank % hp.ssm_group_count != 0)
    throw ModelError(
        fmt::format("{}: ssm.time_step_rank {} (value heads) is not a multiple of ssm.group_count {} "
                    "(key heads)",
                    f.path(), hp.ssm_time_step_rank, hp.ssm_group_count));
  if (hp.ssm_inner_size % hp.ssm_time_step_rank != 0)
    throw ModelError(fmt::format("{}: ssm.inner_size {} is not a multiple of ssm.time_step_rank {}", f.path(),
                                 hp.ssm_inner_size, hp.ssm_time_step_rank));
  if (hp.head_dim_v != hp.head_dim_k)
    throw ModelError(fmt::format("{}: qwen35moe needs key_length == value_length, got {} and {}", f.path(),
                                 hp.head_dim_k, hp.head_dim_v));
  if (hp.n_expert <= 0 || hp.n_expert_used <= 0 || hp.n_ff_exp <= 0 || hp.n_ff_shexp <= 0)
    throw ModelError(
        fmt::format("{}: qwen35moe needs expert_count, expert_used_count, expert_feed_forward_length "
                    "and expert_shared_feed_forward_length > 0",
                    f.path()));
  // IMRoPE sections (t, h, w, unused 4th): pair i < n_rot/2 takes section i mod 3 while
  // i < 3 x that section; text gives every section the same position, so the values only have
  // to be well formed. llama.cpp requires the key.
  const std::string key = "qwen35moe.rope.dimension_sections";
  if (!f.has(key)) throw ModelError(fmt::format("{}: missing key '{}' (IMRoPE sections)", f.path(), key));
  const std::vector<int64_t> sec = f.get_int_array(key);
  int64_t sum = 0;
  bool ok = !sec.empty() && sec.size() <= 4;
  for (int64_t s : sec) {
    ok = ok && s >= 0;
    sum += s;
  }
  if (!ok || sum <= 0 || sum > hp.n_rot / 2)
    throw ModelError(
        fmt::format("{}: key '{}' = [{}]: expected up to 4 sections >= 0 summing to 1..{} "
                    "(rope.dimension_count / 2)",
                    f.path(), key, fmt::join(sec, ", "), hp.n_rot / 2));
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

class Qwen35Moe final : public Model {
 public:
  Qwen35Moe(const gguf::File& f, const BoundWeights& w, backend::Backend& be, const ModelHParams& hp,
            const LoadOptions& opts) {
    hp_ = hp;
    be_ = &be;
    gdn_ = gdn_spec(hp_);
    // IMRoPE on text = NEOX partial rotary (see the top of this file).
    rope_ =
        scaled_rope(f, hp_, hp_.n_rot, backend::RopeSpec::Mode::Neox, YarnFlavour::Standard, true, opts.rope_freqs_bf16)
            .rope;
    attn_ = attention_spec(&rope_);
    attn_.q_gate = true;
    const backend::RouterSpec router = softmax_router();
    bind_io(w);
    n_main_ = n_main(hp_);
    layers_.resize(size_t(n_main_));
    experts_.resize(size_t(hp_.n_layer));  // NextN blocks keep n_expert = 0: never streamed
    for (int l = 0; l < n_main_; ++l) {
      auto b = [&](const char* n) { return w.get(blk(l, n)); };
      Layer& L = layers_[size_t(l)];
      L.recurrent = is_recurrent(hp_, l);
      L.attn_norm = b("attn_norm.weight");
      if (L.recurrent) {
        L.lin.wqkv = b("attn_qkv.weight");
        L.lin.wz = b("attn_gate.weight");
        L.lin.wout = b("ssm_out.weight");
        L.lin.conv = b("ssm_conv1d.weight");
        L.lin.dt_bias = b("ssm_dt.bias");
        L.lin.a = b("ssm_a");
        L.lin.norm = b("ssm_norm.weight");
        L.lin.wbeta = b("ssm_beta.weight");
        L.lin.walpha = b("ssm_alpha.weight");
      } else {
        L.att = bind_attention(w, l);
      }
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
    for (int l = 0; l < hp_.n_layer; ++l) {  // one entry per block; NextN blocks hold nothing
      const bool run = l < n_main_, rec = run && layers_[size_t(l)].recurrent, att = run && !rec;
      st.conv.emplace_back(*be_, rec ? gdn_.conv_state_size() : 0);
      st.ssm.emplace_back(*be_, rec ? gdn_.ssm_state_size() : 0);
      st.k.emplace_back(*be_, att ? n_ctx * kv_dim : 0);
      st.v.emplace_back(*be_, att ? n_ctx * kv_dim : 0);
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
    for (int l = 0; l < n_main_; ++l) {  // the NextN blocks after n_main_ are not run
      const Layer& L = layers_[size_t(l)];
      s.norm(L.attn_norm, "attn_norm", l);
      if (L.recurrent)
        s.gated_delta_net(l, gdn_, L.lin);
      else
        s.attention(l, attn_, L.att);
      s.residual("ffn_inp", l);
      s.norm(L.post_attn_norm, "ffn_norm", l);
      s.moe(l, L.moe, moe_ahead(layers_, l, n_main_, 1), moe_ahead(layers_, l, n_main_, 2));
      shared.scalar_gate = L.shexp_gate;
      s.ffn(shared, L.shexp, "ffn_out", l);
      s.residual("l_out", l);
    }
    s.output(output_norm_, output_);
  }

 private:
  int n_main_ = 0;
  backend::GdnSpec gdn_;
  std::vector<Layer> layers_;  // the n_main_ blocks that run
  backend::RopeSpec rope_;
  backend::AttentionSpec attn_;
};

}  // namespace
}  // namespace strata::model

STRATA_ARCHITECTURE(qwen35moe) {
  using namespace strata::model;
  using K = KeySpec;
  using H = ModelHParams;
  Architecture a;
  a.name = "qwen35moe";
  a.matches = [](const strata::gguf::File& f) { return f.get_string("general.architecture") == "qwen35moe"; };
  a.keys = {
      {"ssm.conv_kernel", &H::ssm_conv_kernel, K::Need::Required},
      {"ssm.state_size", &H::ssm_state_size, K::Need::Required},
      {"ssm.group_count", &H::ssm_group_count, K::Need::Required},
      {"ssm.time_step_rank", &H::ssm_time_step_rank, K::Need::Required},
      {"ssm.inner_size", &H::ssm_inner_size, K::Need::Required},
      {"full_attention_interval", &H::full_attention_interval, K::Need::Optional},  // absent: 4
      {"nextn_predict_layers", &H::n_nextn, K::Need::Optional},
  };
  a.tensors = tensors;
  a.validate = validate;
  a.load = [](const strata::gguf::File& f, const ModelHParams& hp, const BoundWeights& w, strata::backend::Backend& be,
              const LoadOptions& o) { return std::unique_ptr<Model>(new Qwen35Moe(f, w, be, hp, o)); };
  return a;
}
