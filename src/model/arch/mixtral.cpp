// Mixtral (general.architecture = "llama" with routed experts: Mixtral 8x7B / 8x22B as llama.cpp's
// converter writes them; transformers MixtralForCausalLM; llama.cpp llm_build_llama with
// n_expert > 0). Every layer is
//   x += attn_output(attention(RMSNorm(x) * attn_norm))
//   x += MoE(RMSNorm(x) * ffn_norm)
// Attention: GQA, no biases, no q/k norm, RoPE in the "NORM" layout (adjacent pairs: the
// converter permutes attn_q/attn_k rows so that llama.cpp's LLAMA_ROPE_TYPE_NORM matches HF's
// rotate_half), scale 1/sqrt(head_dim). MoE: softmax over all experts, top-k (2), the k weights
// renormalized to sum 1 (transformers MixtralSparseMoeBlock; llama.cpp build_moe_ffn with
// norm_w = true), SwiGLU experts ffn_{gate,up,down}_exps.
//
// A "llama" file without ffn_gate_exps (a dense Llama) is not this architecture; one with the old
// per-expert tensors (blk.N.ffn_gate.E.weight) fails naming the missing ffn_gate_exps; one with
// rope_freqs.weight (Llama-3.1 frequency factors) is refused.
//
// Tested against tests/data/moe_reference.py (an independent numpy-free forward written from this
// description) on `strata synth --like mixtral-tiny --type F32`: tests/test_mixtral.cpp.
#include <fmt/format.h>

#include "model/arch.h"
#include "model/rope_scaling.h"
#include "model/step.h"

namespace strata::model {
namespace {

std::vector<TensorSpec> tensors(const ModelHParams& hp) {
  const int64_t E = hp.n_embd, V = hp.n_vocab, X = hp.n_expert, hd = hp.head_dim_k;
  const int64_t q = int64_t(hp.n_head) * hd, kv = int64_t(hp.n_head_kv) * hd;
  const int64_t F = hp.n_ff_exp > 0 ? hp.n_ff_exp : hp.n_ff;  // read_hparams sets n_ff_exp; synth's shape may not
  using R = TensorRole;
  using I = TensorInit;
  std::vector<TensorSpec> t = {
      {"token_embd.weight", {E, V}, R::Matrix, I::Weight},
      {"output_norm.weight", {E}, R::Vector, I::Norm},
  };
  if (!hp.tied_output) t.push_back({"output.weight", {E, V}, R::Matrix, I::Weight});
  for (int l = 0; l < hp.n_layer; ++l) {
    auto b = [&](const char* n) { return blk(l, n); };
    t.insert(t.end(), {
                          {b("attn_norm.weight"), {E}, R::Vector, I::Norm},
                          {b("attn_q.weight"), {E, q}, R::Matrix, I::Weight},
                          {b("attn_k.weight"), {E, kv}, R::Matrix, I::Weight},
                          {b("attn_v.weight"), {E, kv}, R::Matrix, I::Weight},
                          {b("attn_output.weight"), {q, E}, R::Matrix, I::Weight},
                          {b("ffn_gate_inp.weight"), {E, X}, R::Matrix, I::Router},
                          {b("ffn_norm.weight"), {E}, R::Vector, I::Norm},
                          {b("ffn_gate_exps.weight"), {E, F, X}, R::Expert, I::Weight},
                          {b("ffn_down_exps.weight"), {F, E, X}, R::Expert, I::Weight},
                          {b("ffn_up_exps.weight"), {E, F, X}, R::Expert, I::Weight},
                      });
  }
  return t;
}

void validate(const gguf::File& f, const ModelHParams& hp) {
  validate_rope_scaling(f, hp);
  if (f.find_tensor("rope_freqs.weight"))
    throw ModelError(
        fmt::format("{}: tensor 'rope_freqs.weight' (RoPE frequency factors) is not supported for llama", f.path()));
  if (hp.head_dim_v != hp.head_dim_k)
    throw ModelError(fmt::format("{}: llama needs key_length == value_length, got {} and {}", f.path(), hp.head_dim_k,
                                 hp.head_dim_v));
  if (hp.n_expert <= 0 || hp.n_expert_used <= 0 || hp.n_ff_exp <= 0)
    throw ModelError(
        fmt::format("{}: a llama MoE (Mixtral) needs expert_count, expert_used_count and expert feed-forward width > 0",
                    f.path()));
}

class Mixtral final : public AttnMoeModel {
 public:
  Mixtral(const gguf::File& f, const BoundWeights& w, backend::Backend& be, const ModelHParams& hp,
          const LoadOptions& opts) {
    hp_ = hp;
    hp_.norm_topk = true;
    be_ = &be;
    rope_ =
        scaled_rope(f, hp_, hp_.n_rot, backend::RopeSpec::Mode::Norm, YarnFlavour::Standard, true, opts.rope_freqs_bf16)
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

STRATA_ARCHITECTURE(mixtral) {
  using namespace strata::model;
  Architecture a;
  a.name = "llama";
  a.matches = [](const strata::gguf::File& f) {
    return f.get_string("general.architecture") == "llama" && f.find_tensor("blk.0.ffn_gate_exps.weight") != nullptr;
  };
  a.tensors = tensors;
  a.validate = validate;
  a.load = [](const strata::gguf::File& f, const ModelHParams& hp, const BoundWeights& w, strata::backend::Backend& be,
              const LoadOptions& o) { return std::unique_ptr<Model>(new Mixtral(f, w, be, hp, o)); };
  return a;
}
