#include "model/qwen_hybrid.h"

namespace strata::model {

void add_shared_expert_moe_tensors(std::vector<TensorSpec>& t, const ModelHParams& hp, int l) {
  const int64_t E = hp.n_embd, X = hp.n_expert, F = hp.n_ff_exp, FS = hp.n_ff_shexp;
  using R = TensorRole;
  using I = TensorInit;
  auto b = [&](const char* n) { return blk(l, n); };
  t.insert(t.end(), {
                        {b("ffn_down_exps.weight"), {F, E, X}, R::Expert, I::Weight},
                        {b("ffn_gate_exps.weight"), {E, F, X}, R::Expert, I::Weight},
                        {b("ffn_up_exps.weight"), {E, F, X}, R::Expert, I::Weight},
                        {b("ffn_gate_inp.weight"), {E, X}, R::Matrix, I::Router},
                        {b("ffn_down_shexp.weight"), {FS, E}, R::Matrix, I::Weight},
                        {b("ffn_gate_shexp.weight"), {E, FS}, R::Matrix, I::Weight},
                        {b("ffn_up_shexp.weight"), {E, FS}, R::Matrix, I::Weight},
                        // the converter writes [n_embd, 1]; llama.cpp also takes [n_embd]
                        {b("ffn_gate_inp_shexp.weight"), {E, 1}, R::Matrix, I::Router, {E}},
                        {b("post_attention_norm.weight"), {E}, R::Vector, I::Norm},
                    });
}

void add_gated_attention_tensors(std::vector<TensorSpec>& t, const ModelHParams& hp, int l) {
  const int64_t E = hp.n_embd, hd = hp.head_dim_k, q = int64_t(hp.n_head) * hd, kv = int64_t(hp.n_head_kv) * hd;
  using R = TensorRole;
  using I = TensorInit;
  auto b = [&](const char* n) { return blk(l, n); };
  t.insert(t.end(), {
                        {b("attn_k_norm.weight"), {hd}, R::Vector, I::Norm},
                        {b("attn_k.weight"), {E, kv}, R::Matrix, I::Weight},
                        {b("attn_output.weight"), {q, E}, R::Matrix, I::Weight},
                        {b("attn_q_norm.weight"), {hd}, R::Vector, I::Norm},
                        {b("attn_q.weight"), {E, 2 * q}, R::Matrix, I::Weight},  // query and gate per head
                        {b("attn_v.weight"), {E, kv}, R::Matrix, I::Weight},
                    });
}

}  // namespace strata::model
