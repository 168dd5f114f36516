// Qwen3-MoE (general.architecture = "qwen3moe"): every layer is GQA attention with q/k
// RMSNorm and NEOX RoPE, then a routed SwiGLU MoE (softmax, top-k, renormalized).
// Reference: transformers' modeling_qwen3_moe.py; tensor names as llama.cpp's converter
// writes them (blk.N.attn_q.weight, blk.N.ffn_gate_exps.weight, ...).
#include <fmt/format.h>

#include "model/arch.h"
#include "model/rope_scaling.h"
#include "model/step.h"

namespace strata::model {
namespace {

// The tensor table, in the order llama.cpp writes it: globals, then each block's tensors
// sorted by name.
std::vector<TensorSpec> tensors(const ModelHParams& hp) {
  const int64_t E = hp.n_embd, V = hp.n_vocab, X = hp.n_expert, F = hp.n_ff_exp, hd = hp.head_dim_k;
  const int64_t q = int64_t(hp.n_head) * hd, kv = int64_t(hp.n_head_kv) * hd;
  using R = TensorRole;
  using I = TensorInit;
  std::vector<TensorSpec> t = {
      {"output_norm.weight", {E}, R::Vector, I::Norm},
      {"token_embd.weight", {E, V}, R::Matrix, I::Weight},
  };
  if (!hp.tied_output) t.push_back({"output.weight", {E, V}, R::Matrix, I::Weight});
  for (int l = 0; l < hp.n_layer; ++l) {
    auto b = [&](const char* n) { return blk(l, n); };
    t.insert(t.end(), {
                          {b("attn_k.weight"), {E, kv}, R::Matrix, I::Weight},
                          {b("attn_k_norm.weight"), {hd}, R::Vector, I::Norm},
                          {b("attn_norm.weight"), {E}, R::Vector, I::Norm},
                          {b("attn_output.weight"), {q, E}, R::Matrix, I::Weight},
                          {b("attn_q.weight"), {E, q}, R::Matrix, I::Weight},
                          {b("attn_q_norm.weight"), {hd}, R::Vector, I::Norm},
                          {b("attn_v.weight"), {E, kv}, R::Matrix, I::Weight},
                          {b("ffn_down_exps.weight"), {F, E, X}, R::Expert, I::Weight},
                          {b("ffn_gate_exps.weight"), {E, F, X}, R::Expert, I::Weight},
                          {b("ffn_gate_inp.weight"), {E, X}, R::Matrix, I::Router},
                          {b("ffn_norm.weight"), {E}, R::Vector, I::Norm},
                          {b("ffn_up_exps.weight"), {E, F, X}, R::Expert, I::Weight},
                      });
  }
  return t;
}

void validate(const gguf::File& f, const ModelHParams& hp) {
  validate_rope_scaling(f, hp);
  if (hp.head_dim_v != hp.head_dim_k)
    throw ModelError(fmt::format("{}: qwen3moe needs key_length == value_length, got {} and {}", f.path(),
                                 hp.head_dim_k, hp.head_dim_v));
  if (hp.n_expert <= 0 || hp.n_expert_used <= 0 || hp.n_ff_exp <= 0)
    throw ModelError(
        fmt::format("{}: qwen3moe needs expert_count, expert_used_count and "
                    "expert_feed_forward_length > 0",
                    f.path()));
}

class Qwen3Moe final : public AttnMoeModel {
 public:
  Qwen3Moe(const gguf::File& f, const BoundWeights& w, backend::Backend& be, const ModelHParams& hp,
           const LoadOptions& opts) {
    hp_ = hp;
    be_ = &be;
    rope_ =
        scaled_rope(f, hp_, hp_.n_rot, backend::RopeSpec::Mode::Neox, YarnFlavour::Standard, true, opts.rope_freqs_bf16)
            .rope;
    attn_ = attention_spec(&rope_);
    const backend::RouterSpec router = softmax_router();
    bind_io(w);
    bind_layers(
        w, [&](int) { return &attn_; }, [&](int) { return router; });
    dense_bytes_ = w.dense_bytes();
  }

 private:
  backend::RopeSpec rope_;
  backend::AttentionSpec attn_;
};

}  // namespace
}  // namespace strata::model

STRATA_ARCHITECTURE(qwen3moe) {
  using namespace strata::model;
  Architecture a;
  a.name = "qwen3moe";
  a.matches = [](const strata::gguf::File& f) { return f.get_string("general.architecture") == "qwen3moe"; };
  a.tensors = tensors;
  a.validate = validate;
  a.load = [](const strata::gguf::File& f, const ModelHParams& hp, const BoundWeights& w, strata::backend::Backend& be,
              const LoadOptions& o) { return std::unique_ptr<Model>(new Qwen3Moe(f, w, be, hp, o)); };
  return a;
}
