// MiniMax-M2 / M2.1 (general.architecture = "minimax-m2"; transformers MiniMaxM2ForCausalLM,
// llama.cpp LLM_ARCH_MINIMAX_M2). Every layer is
//   x += attn_output(attention(RMSNorm(x) * attn_norm))
//   x += MoE(RMSNorm(x) * ffn_norm)
// Attention: GQA, no biases, q and k RMS-normed over the whole projection row before the split
// into heads (qk_norm_type "per_layer": attn_q_norm ne {n_head * head_dim}, attn_k_norm ne
// {n_head_kv * head_dim}; backend::AttentionSpec::qk_norm_full), NEOX RoPE on the first
// rope.dimension_count dims of each head (partial rotary: rotary_dim 64 of head_dim 128 in the
// released models), scale 1/sqrt(head_dim). MoE: sigmoid scores; the selection bias
// blk.N.exp_probs_b.bias (HF e_score_correction_bias) is added for the top-k choice only; the
// mixing weights are the unbiased sigmoid scores of the chosen k, renormalized to sum 1
// (transformers MiniMaxM2SparseMoeBlock; llama.cpp build_moe_ffn with norm_w = true); SwiGLU
// experts ffn_{gate,up,down}_exps; no shared experts, no dense layers.
//
// Keys: the common ones, expert_feed_forward_length, and expert_gating_func (2 = sigmoid as the
// converter writes it; absent: sigmoid, since the file has selection biases; 1 = softmax is
// accepted as llama.cpp's build_moe_ffn would run it). The multi-token-prediction modules of
// the checkpoint (num_mtp_modules) are not written by llama.cpp's converter.
//
// Tested against tests/data/moe_reference.py (an independent standard-library forward) on
// `strata synth --like minimax-m2-tiny --type F32`: tests/test_minimax_m2.cpp.
#include <fmt/format.h>

#include "model/arch.h"
#include "model/rope_scaling.h"
#include "model/routed_moe.h"
#include "model/step.h"

namespace strata::model {
namespace {

// The tensor table, in the order llama.cpp's converter writes it.
std::vector<TensorSpec> tensors(const ModelHParams& hp) {
  const int64_t E = hp.n_embd, V = hp.n_vocab, X = hp.n_expert, F = hp.n_ff_exp, hd = hp.head_dim_k;
  const int64_t q = int64_t(hp.n_head) * hd, kv = int64_t(hp.n_head_kv) * hd;
  using R = TensorRole;
  using I = TensorInit;
  std::vector<TensorSpec> t;
  t.push_back({"token_embd.weight", {E, V}, R::Matrix, I::Weight});
  t.push_back({"output_norm.weight", {E}, R::Vector, I::Norm});
  if (!hp.tied_output) t.push_back({"output.weight", {E, V}, R::Matrix, I::Weight});
  for (int l = 0; l < hp.n_layer; ++l) {
    auto b = [&](const char* n) { return blk(l, n); };
    t.insert(t.end(), {
                          {b("attn_norm.weight"), {E}, R::Vector, I::Norm},
                          {b("attn_q.weight"), {E, q}, R::Matrix, I::Weight},
                          {b("attn_k.weight"), {E, kv}, R::Matrix, I::Weight},
                          {b("attn_v.weight"), {E, kv}, R::Matrix, I::Weight},
                          {b("attn_output.weight"), {q, E}, R::Matrix, I::Weight},
                          {b("attn_q_norm.weight"), {q}, R::Vector, I::Norm},
                          {b("attn_k_norm.weight"), {kv}, R::Vector, I::Norm},
                          {b("ffn_norm.weight"), {E}, R::Vector, I::Norm},
                          {b("ffn_gate_inp.weight"), {E, X}, R::Matrix, I::Router},
                          {b("exp_probs_b.bias"), {X}, R::Vector, I::Norm},
                          {b("ffn_gate_exps.weight"), {E, F, X}, R::Expert, I::Weight},
                          {b("ffn_down_exps.weight"), {F, E, X}, R::Expert, I::Weight},
                          {b("ffn_up_exps.weight"), {E, F, X}, R::Expert, I::Weight},
                      });
  }
  return t;
}

void validate(const gguf::File& f, const ModelHParams& hp) {
  validate_rope_scaling(f, hp);
  if (hp.head_dim_v != hp.head_dim_k)
    throw ModelError(fmt::format("{}: minimax-m2 needs key_length == value_length, got {} and {}", f.path(),
                                 hp.head_dim_k, hp.head_dim_v));
  if (hp.n_expert <= 0 || hp.n_expert_used <= 0 || hp.n_ff_exp <= 0)
    throw ModelError(
        fmt::format("{}: minimax-m2 needs expert_count, expert_used_count and expert_feed_forward_length > 0",
                    f.path()));
  (void)routed_gating(f, hp);  // an unsupported expert_gating_func fails here, naming the key
}

class MiniMaxM2 final : public AttnMoeModel {
 public:
  MiniMaxM2(const gguf::File& f, const BoundWeights& w, backend::Backend& be, const ModelHParams& hp,
            const LoadOptions& opts) {
    hp_ = hp;
    hp_.norm_topk = true;
    be_ = &be;
    rope_ =
        scaled_rope(f, hp_, hp_.n_rot, backend::RopeSpec::Mode::Neox, YarnFlavour::Standard, true, opts.rope_freqs_bf16)
            .rope;
    attn_ = attention_spec(&rope_);
    attn_.qk_norm_full = true;
    bind_io(w);
    bind_layers(
        w, [&](int) { return &attn_; },
        [&](int l) {
          backend::RouterSpec r;
          r.gating = routed_gating(f, hp_);
          r.n_expert = hp_.n_expert;
          r.top_k = hp_.n_expert_used;
          r.norm_topk = true;
          r.selection_bias.resize(size_t(hp_.n_expert));
          be.download(r.selection_bias.data(), w.get(blk(l, "exp_probs_b.bias")),
                      r.selection_bias.size() * sizeof(float));
          return r;
        });
    dense_bytes_ = w.dense_bytes();
  }

 private:
  backend::RopeSpec rope_;
  backend::AttentionSpec attn_;
};

}  // namespace
}  // namespace strata::model

STRATA_ARCHITECTURE(minimax_m2) {
  using namespace strata::model;
  Architecture a;
  a.name = "minimax-m2";
  a.matches = [](const strata::gguf::File& f) { return f.get_string("general.architecture") == "minimax-m2"; };
  a.keys = {{"expert_gating_func", &ModelHParams::expert_gating_func, KeySpec::Need::Optional}};
  a.tensors = tensors;
  a.validate = validate;
  a.load = [](const strata::gguf::File& f, const ModelHParams& hp, const BoundWeights& w, strata::backend::Backend& be,
              const LoadOptions& o) { return std::unique_ptr<Model>(new MiniMaxM2(f, w, be, hp, o)); };
  return a;
}
