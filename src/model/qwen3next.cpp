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

#include "layers/attention.h"
#include "layers/ffn.h"
#include "layers/gated_delta_net.h"
#include "layers/moe.h"
#include "model/model.h"
#include "model/weights.h"
#include "quant/quant.h"

namespace strata::model {
namespace {

/// The qwen3next keys beyond the common ones (llama.cpp's names in parentheses).
struct Qwen3NextHParams {
  int conv_kernel = 0;        ///< qwen3next.ssm.conv_kernel (ssm_d_conv): taps of the causal conv
  int head_k_dim = 0;         ///< qwen3next.ssm.state_size (ssm_d_state): linear-attention key head dim
  int n_k_head = 0;           ///< qwen3next.ssm.group_count (ssm_n_group): linear-attention key heads
  int n_v_head = 0;           ///< qwen3next.ssm.time_step_rank (ssm_dt_rank): linear-attention value heads
  int inner_size = 0;         ///< qwen3next.ssm.inner_size (ssm_d_inner): n_v_head * head_v_dim
  int full_attn_interval = 0; ///< qwen3next.full_attention_interval: every n-th layer is full attention
};

struct LinearAttnWeights {
  DenseTensor wqkv;     // attn_qkv [n_embd, conv_dim]  (ne: cols first)
  DenseTensor wz;       // attn_gate [n_embd, n_v_head * dv]
  DenseTensor wba;      // ssm_ba [n_embd, 2 * n_v_head]
  DenseTensor conv;     // ssm_conv1d [K, conv_dim]
  DenseTensor dt_bias;  // ssm_dt.bias [n_v_head]
  DenseTensor a;        // ssm_a [n_v_head]
  DenseTensor norm;     // ssm_norm [dv]
  DenseTensor wout;     // ssm_out [n_v_head * dv, n_embd]
};

struct FullAttnWeights {
  DenseTensor wq;      // attn_q [n_embd, n_head * head_dim * 2]  (per head [q, gate])
  DenseTensor wk;      // attn_k [n_embd, n_head_kv * head_dim]
  DenseTensor wv;      // attn_v [n_embd, n_head_kv * head_dim]
  DenseTensor wo;      // attn_output [n_head * head_dim, n_embd]
  DenseTensor q_norm;  // attn_q_norm [head_dim]
  DenseTensor k_norm;  // attn_k_norm [head_dim]
};

struct Qwen3NextLayer {
  bool recurrent = false;     // gated delta net (true) or gated full attention
  DenseTensor attn_norm;      // [n_embd]
  LinearAttnWeights lin;      // when recurrent
  FullAttnWeights att;        // otherwise
  DenseTensor post_attn_norm; // post_attention_norm [n_embd], before the MoE
  DenseTensor router;         // ffn_gate_inp [n_embd, n_expert]
  layers::MoeWeights moe;     // router view + expert slice shapes (experts stream)
  DenseTensor sh_gate;        // ffn_gate_shexp [n_embd, n_ff_shexp]
  DenseTensor sh_up;          // ffn_up_shexp [n_embd, n_ff_shexp]
  DenseTensor sh_down;        // ffn_down_shexp [n_ff_shexp, n_embd]
  DenseTensor sh_gate_inp;    // ffn_gate_inp_shexp [n_embd] or [n_embd, 1]
};

class Qwen3Next final : public Model {
 public:
  Qwen3Next(const gguf::File& f, const LoadOptions& opts);
  SequenceState new_state(int64_t n_ctx) const override;
  uint64_t state_bytes(int64_t n_ctx) const override;
  void forward(ForwardContext& ctx, SequenceState& st, std::span<const int32_t> ids, LogitsMode mode,
               std::vector<float>& logits) override;

 private:
  Qwen3NextHParams nx_;
  layers::GatedDeltaNetShape gdn_;
  DenseTensor tok_embd_;     // [n_embd, n_vocab]
  DenseTensor output_norm_;  // [n_embd]
  DenseTensor output_;       // [n_embd, n_vocab]; empty when tied to tok_embd
  std::vector<Qwen3NextLayer> layers_;
  cpu::Rope rope_;
};

layers::ExpertPartShape part_shape(const gguf::TensorInfo& t) {
  return layers::ExpertPartShape{t.type, int64_t(t.ne[1]), int64_t(t.ne[0]), size_t(t.row_bytes)};
}

stream::PartLayout part_layout(const gguf::TensorInfo& t) {
  return stream::PartLayout{t.offset, t.ne[1] * t.row_bytes};
}

Qwen3NextHParams read_next_hparams(const gguf::File& f) {
  Qwen3NextHParams nx;
  auto positive = [&](const char* key) {
    const std::string k = std::string("qwen3next.") + key;
    const int64_t v = f.get_int(k);
    if (v <= 0 || v > (int64_t(1) << 30))
      throw ModelError(fmt::format("{}: key '{}' = {} is out of range", f.path(), k, v));
    return int(v);
  };
  nx.conv_kernel = positive("ssm.conv_kernel");
  nx.head_k_dim = positive("ssm.state_size");
  nx.n_k_head = positive("ssm.group_count");
  nx.n_v_head = positive("ssm.time_step_rank");
  nx.inner_size = positive("ssm.inner_size");
  nx.full_attn_interval = positive("full_attention_interval");
  if (nx.n_v_head % nx.n_k_head != 0)
    throw ModelError(fmt::format("{}: ssm.time_step_rank {} (value heads) is not a multiple of ssm.group_count {} "
                                 "(key heads)",
                                 f.path(), nx.n_v_head, nx.n_k_head));
  if (nx.inner_size % nx.n_v_head != 0)
    throw ModelError(fmt::format("{}: ssm.inner_size {} is not a multiple of ssm.time_step_rank {}", f.path(),
                                 nx.inner_size, nx.n_v_head));
  return nx;
}

Qwen3Next::Qwen3Next(const gguf::File& f, const LoadOptions& opts) {
  hp_ = read_common_hparams(f);
  nx_ = read_next_hparams(f);
  const int64_t E = hp_.n_embd, hd = hp_.head_dim_k, V = hp_.n_vocab;
  const int64_t q_dim = int64_t(hp_.n_head) * hd, kv_dim = int64_t(hp_.n_head_kv) * hd;
  if (hp_.head_dim_v != hp_.head_dim_k)
    throw ModelError(fmt::format("{}: qwen3next needs key_length == value_length, got {} and {}", f.path(),
                                 hp_.head_dim_k, hp_.head_dim_v));
  if (hp_.n_expert <= 0 || hp_.n_expert_used <= 0 || hp_.n_ff_exp <= 0 || hp_.n_ff_shexp <= 0)
    throw ModelError(fmt::format("{}: qwen3next needs expert_count, expert_used_count, expert_feed_forward_length "
                                 "and expert_shared_feed_forward_length > 0",
                                 f.path()));
  const int64_t X = hp_.n_expert, F = hp_.n_ff_exp, FS = hp_.n_ff_shexp;
  rope_ = cpu::Rope(hp_.n_rot, hp_.rope_freq_base, opts.rope_freqs_bf16);
  gdn_ = layers::GatedDeltaNetShape{nx_.n_k_head, nx_.n_v_head,  nx_.head_k_dim,
                                    nx_.inner_size / nx_.n_v_head, nx_.conv_kernel, hp_.rms_eps};
  const int64_t conv_dim = gdn_.conv_dim(), vdim = gdn_.value_dim();

  WeightLoader w(f);
  tok_embd_ = w.matrix("token_embd.weight", {E, V});
  output_norm_ = w.vector("output_norm.weight", {E});
  if (!hp_.tied_output) output_ = w.matrix("output.weight", {E, V});

  layers_.resize(hp_.n_layer);
  experts_.resize(hp_.n_layer);
  for (int l = 0; l < hp_.n_layer; ++l) {
    const std::string p = fmt::format("blk.{}.", l);
    Qwen3NextLayer& L = layers_[l];
    L.recurrent = (l + 1) % nx_.full_attn_interval != 0;
    L.attn_norm = w.vector(p + "attn_norm.weight", {E});
    if (L.recurrent) {
      LinearAttnWeights& A = L.lin;
      A.wqkv = w.matrix(p + "attn_qkv.weight", {E, conv_dim});
      A.wz = w.matrix(p + "attn_gate.weight", {E, vdim});
      A.wba = w.matrix(p + "ssm_ba.weight", {E, 2 * int64_t(nx_.n_v_head)});
      A.conv = w.vector(p + "ssm_conv1d.weight", {nx_.conv_kernel, conv_dim});
      A.dt_bias = w.vector(p + "ssm_dt.bias", {nx_.n_v_head});
      A.a = w.vector(p + "ssm_a", {nx_.n_v_head});
      A.norm = w.vector(p + "ssm_norm.weight", {gdn_.head_v_dim});
      A.wout = w.matrix(p + "ssm_out.weight", {vdim, E});
    } else {
      FullAttnWeights& A = L.att;
      A.wq = w.matrix(p + "attn_q.weight", {E, 2 * q_dim});
      A.wk = w.matrix(p + "attn_k.weight", {E, kv_dim});
      A.wv = w.matrix(p + "attn_v.weight", {E, kv_dim});
      A.wo = w.matrix(p + "attn_output.weight", {q_dim, E});
      A.q_norm = w.vector(p + "attn_q_norm.weight", {hd});
      A.k_norm = w.vector(p + "attn_k_norm.weight", {hd});
    }
    L.post_attn_norm = w.vector(p + "post_attention_norm.weight", {E});

    // Routed experts: shapes checked here, bytes left on disk for the stream.
    L.router = w.matrix(p + "ffn_gate_inp.weight", {E, X});
    if (w.has(p + "ffn_gate_up_exps.weight"))
      // llama.cpp's fused layout: per expert, n_ff gate rows then n_ff up rows. The stream reads
      // each part as one contiguous slice per expert, so gate and up would need a stride.
      throw ModelError(fmt::format("{}: tensor '{}ffn_gate_up_exps.weight' (fused expert gate+up, shape [{}, {}, {}]) "
                                   "is not supported yet: re-convert with separate ffn_gate_exps/ffn_up_exps",
                                   f.path(), p, E, 2 * F, X));
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

    // Shared expert (resident) and its gate.
    L.sh_gate = w.matrix(p + "ffn_gate_shexp.weight", {E, FS});
    L.sh_up = w.matrix(p + "ffn_up_shexp.weight", {E, FS});
    L.sh_down = w.matrix(p + "ffn_down_shexp.weight", {FS, E});
    const gguf::TensorInfo* gi = f.find_tensor(p + "ffn_gate_inp_shexp.weight");
    const bool gate_2d = gi && gi->ne.size() == 2;  // the converter writes [n_embd, 1]; llama.cpp also takes [n_embd]
    L.sh_gate_inp = gate_2d ? w.matrix(p + "ffn_gate_inp_shexp.weight", {E, 1})
                            : w.matrix(p + "ffn_gate_inp_shexp.weight", {E});
  }
  dense_bytes_ = w.bytes_loaded();
}

SequenceState Qwen3Next::new_state(int64_t n_ctx) const {
  SequenceState st;
  st.n_ctx = n_ctx;
  const int64_t kv_dim = int64_t(hp_.n_head_kv) * hp_.head_dim_k;
  st.k.resize(hp_.n_layer);
  st.v.resize(hp_.n_layer);
  st.conv.resize(hp_.n_layer);
  st.ssm.resize(hp_.n_layer);
  for (int l = 0; l < hp_.n_layer; ++l) {
    if (layers_[l].recurrent) {
      st.conv[l].assign(gdn_.conv_state_size(), 0.0f);
      st.ssm[l].assign(gdn_.ssm_state_size(), 0.0f);
    } else {
      st.k[l].assign(n_ctx * kv_dim, 0.0f);
      st.v[l].assign(n_ctx * kv_dim, 0.0f);
    }
  }
  return st;
}

uint64_t Qwen3Next::state_bytes(int64_t n_ctx) const {
  uint64_t floats = 0;
  for (const auto& L : layers_)
    floats += L.recurrent ? uint64_t(gdn_.conv_state_size() + gdn_.ssm_state_size())
                          : uint64_t(2) * n_ctx * hp_.n_head_kv * hp_.head_dim_k;
  return floats * sizeof(float);
}

void Qwen3Next::forward(ForwardContext& ctx, SequenceState& st, std::span<const int32_t> ids, LogitsMode mode,
                        std::vector<float>& logits) {
  const int64_t T = int64_t(ids.size()), E = hp_.n_embd, pos0 = st.n_past;
  cpu::ThreadPool& pool = ctx.pool;
  std::vector<float> x(T * E), h(T * E), o(T * E);

  embed(tok_embd_.matrix(), ids, x.data());

  layers::AttentionShape shape{hp_.n_head, hp_.n_head_kv, hp_.head_dim_k, hp_.rms_eps, &rope_};
  shape.q_gate = true;
  auto norm_rows = [&](const float* w) { rms_norm_rows(pool, x.data(), w, T, h.data()); };
  auto add_residual = [&] { add_rows(x.data(), o.data(), T); };

  // Layer 0's experts are predicted from the embeddings and read while the mixer runs.
  std::vector<int32_t> pred;
  read_ahead_first(ctx, layers_[0].moe.router, layers_[0].post_attn_norm.values(), x.data(), T, h.data(), pred);

  for (int l = 0; l < hp_.n_layer; ++l) {
    const Qwen3NextLayer& L = layers_[l];
    // Token mixer: x += mixer(rmsnorm(x)), gated delta net or gated full attention.
    norm_rows(L.attn_norm.values());
    if (L.recurrent) {
      const LinearAttnWeights& A = L.lin;
      const layers::GatedDeltaNetWeights gw{A.wqkv.matrix(),    A.wz.matrix(),      A.wba.matrix(),
                                            A.wout.matrix(),    A.conv.values(),    A.dt_bias.values(),
                                            A.a.values(),       A.norm.values()};
      layers::gated_delta_net_block(pool, ctx.kernels, gw, gdn_, h.data(), E, T, st.conv[l].data(), st.ssm[l].data(), o.data());
    } else {
      const FullAttnWeights& A = L.att;
      const layers::AttentionWeights aw{A.wq.matrix(),     A.wk.matrix(),     A.wv.matrix(), A.wo.matrix(),
                                        A.q_norm.values(), A.k_norm.values()};
      layers::attention_block(pool, ctx.kernels, aw, shape, h.data(), E, T, pos0, st.k[l].data(), st.v[l].data(), o.data());
    }
    add_residual();

    // MoE block: x += moe(h) + sigmoid(h . gate_inp_shexp) * shared_expert(h), h = rmsnorm(x).
    norm_rows(L.post_attn_norm.values());
    moe_step(ctx, l, L.moe, l + 1 < hp_.n_layer ? &layers_[l + 1].moe.router : nullptr, h.data(), T, o.data(), pred);
    const layers::FfnWeights shexp{L.sh_gate.matrix(), L.sh_up.matrix(), L.sh_down.matrix()};
    layers::add_gated_swiglu_ffn(pool, ctx.kernels, shexp, L.sh_gate_inp.matrix(), h.data(), E, T, o.data());
    add_residual();
  }
  st.n_past += T;

  // Final norm and the output head (tied to token_embd when output.weight is absent).
  output_head(ctx, x.data(), T, mode, output_norm_.values(), hp_.tied_output ? tok_embd_.matrix() : output_.matrix(),
              h.data(), logits);
}

}  // namespace

std::unique_ptr<Model> load_qwen3next(const gguf::File& f, const LoadOptions& opts) {
  return std::make_unique<Qwen3Next>(f, opts);
}

}  // namespace strata::model
