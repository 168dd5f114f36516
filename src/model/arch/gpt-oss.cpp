// gpt-oss (general.architecture = "gpt-oss"; transformers GptOssForCausalLM, llama.cpp
// LLM_ARCH_OPENAI_MOE / llm_build_openai_moe_iswa). Every layer is
//   x += attn_output(attention(RMSNorm(x) * attn_norm)) + attn_output.bias
//   x += MoE(RMSNorm(x) * post_attention_norm)
// Attention: GQA with q/k/v/o biases, NEOX RoPE, one learned sink logit per query head in the
// softmax denominator (attn_sinks), scale 1/sqrt(head_dim); even layers (0, 2, ...) attend to
// the last `attention.sliding_window` positions only, odd layers to all (transformers
// config.layer_types = sliding, full, ...; llama.cpp set_swa_pattern(2): layer il slides iff
// il % 2 == 0). MoE: router with bias; top-k of the raw logits, softmax over those k
// (RouterSpec::Gating::SoftmaxTopK); each expert y = down(swiglu_oai(gate x + bg, up x + bu)) + bd
// with per-expert biases (FfnSpec::Act::SwiGluOai, alpha 1.702, limit 7.0). No q/k norm.
//
// Tensor names as llama.cpp's converter (GptOssModel) writes them: the HF fused, interleaved
// gate_up_proj is split into ffn_gate_exps (even columns) and ffn_up_exps (odd ones); the
// pre-MoE norm is called post_attention_norm (HF post_attention_layernorm).
//
// RoPE: rope.freq_base, with YaRN where the file says so (released gpt-oss: rope.scaling.type =
// yarn, factor 32, original_context_length 4096, beta 32/1): NTK-by-parts inverse frequencies
// without truncating the correction range (transformers GptOssConfig truncate = false, as
// OpenAI's reference; llama.cpp floors/ceils it) and cos/sin times 0.1 ln(factor) + 1
// (model/rope_scaling.h).
#include <fmt/format.h>

#include "model/arch.h"
#include "model/rope_scaling.h"
#include "model/step.h"

namespace strata::model {
namespace {

// The tensor table, in the order llama.cpp writes it.
std::vector<TensorSpec> tensors(const ModelHParams& hp) {
  const int64_t E = hp.n_embd, V = hp.n_vocab, X = hp.n_expert, F = hp.n_ff_exp, hd = hp.head_dim_k;
  const int64_t H = hp.n_head, q = H * hd, kv = int64_t(hp.n_head_kv) * hd;
  using R = TensorRole;
  using I = TensorInit;
  std::vector<TensorSpec> t;
  if (!hp.tied_output) t.push_back({"output.weight", {E, V}, R::Matrix, I::Weight});
  t.push_back({"token_embd.weight", {E, V}, R::Matrix, I::Weight});
  for (int l = 0; l < hp.n_layer; ++l) {
    auto b = [&](const char* n) { return blk(l, n); };
    t.insert(t.end(), {
                          {b("attn_norm.weight"), {E}, R::Vector, I::Norm},
                          {b("ffn_down_exps.weight"), {F, E, X}, R::Expert, I::Weight},
                          {b("ffn_down_exps.bias"), {E, X}, R::Vector, I::Weight},
                          {b("ffn_gate_exps.weight"), {E, F, X}, R::Expert, I::Weight},
                          {b("ffn_up_exps.weight"), {E, F, X}, R::Expert, I::Weight},
                          {b("ffn_gate_exps.bias"), {F, X}, R::Vector, I::Weight},
                          {b("ffn_up_exps.bias"), {F, X}, R::Vector, I::Weight},
                          {b("ffn_gate_inp.bias"), {X}, R::Vector, I::Weight},
                          {b("ffn_gate_inp.weight"), {E, X}, R::Matrix, I::Router},
                          {b("post_attention_norm.weight"), {E}, R::Vector, I::Norm},
                          {b("attn_k.bias"), {kv}, R::Vector, I::Weight},
                          {b("attn_k.weight"), {E, kv}, R::Matrix, I::Weight},
                          {b("attn_output.bias"), {E}, R::Vector, I::Weight},
                          {b("attn_output.weight"), {q, E}, R::Matrix, I::Weight},
                          {b("attn_q.bias"), {q}, R::Vector, I::Weight},
                          {b("attn_q.weight"), {E, q}, R::Matrix, I::Weight},
                          {b("attn_sinks.weight"), {H}, R::Vector, I::Weight},
                          {b("attn_v.bias"), {kv}, R::Vector, I::Weight},
                          {b("attn_v.weight"), {E, kv}, R::Matrix, I::Weight},
                      });
  }
  t.push_back({"output_norm.weight", {E}, R::Vector, I::Norm});
  return t;
}

void validate(const gguf::File& f, const ModelHParams& hp) {
  if (hp.head_dim_v != hp.head_dim_k)
    throw ModelError(fmt::format("{}: gpt-oss needs key_length == value_length, got {} and {}", f.path(), hp.head_dim_k,
                                 hp.head_dim_v));
  if (hp.n_expert <= 0 || hp.n_expert_used <= 0 || hp.n_ff_exp <= 0)
    throw ModelError(
        fmt::format("{}: gpt-oss needs expert_count, expert_used_count and "
                    "expert_feed_forward_length > 0",
                    f.path()));
  validate_rope_scaling(f, hp);
}

class GptOss final : public AttnMoeModel {
 public:
  GptOss(const gguf::File& f, const BoundWeights& w, backend::Backend& be, const ModelHParams& hp,
         const LoadOptions& opts) {
    hp_ = hp;
    be_ = &be;
    rope_ = scaled_rope(f, hp_, hp_.n_rot, backend::RopeSpec::Mode::Neox, YarnFlavour::Standard, false,
                        opts.rope_freqs_bf16)
                .rope;
    attn_full_ = attention_spec(&rope_);
    attn_swa_ = attn_full_;
    attn_swa_.window = hp_.n_swa;
    backend::RouterSpec router;
    router.gating = backend::RouterSpec::Gating::SoftmaxTopK;
    router.n_expert = hp_.n_expert;
    router.top_k = hp_.n_expert_used;
    router.norm_topk = false;           // the k weights are a softmax already
    ffn_norm_name_ = "attn_post_norm";  // llama.cpp's name of the pre-MoE norm here
    bind_io(w);
    bind_layers(
        w, [&](int l) { return l % 2 == 0 ? &attn_swa_ : &attn_full_; },  // even layers slide
        [&](int) { return router; }, "post_attention_norm.weight");
    for (AttnMoeLayer& L : layers_) L.moe.ffn.act = backend::FfnSpec::Act::SwiGluOai;
    dense_bytes_ = w.dense_bytes();
  }

 private:
  backend::RopeSpec rope_;
  backend::AttentionSpec attn_full_, attn_swa_;
};

}  // namespace
}  // namespace strata::model

STRATA_ARCHITECTURE(gpt_oss) {
  using namespace strata::model;
  Architecture a;
  a.name = "gpt-oss";
  a.matches = [](const strata::gguf::File& f) { return f.get_string("general.architecture") == "gpt-oss"; };
  a.keys = {{"attention.sliding_window", &ModelHParams::n_swa, KeySpec::Need::Required}};
  a.tensors = tensors;
  a.validate = validate;
  a.load = [](const strata::gguf::File& f, const ModelHParams& hp, const BoundWeights& w, strata::backend::Backend& be,
              const LoadOptions& o) { return std::unique_ptr<Model>(new GptOss(f, w, be, hp, o)); };
  return a;
}
