#pragma once
// Tensor-table pieces shared by the Qwen hybrid (gated delta net + gated attention) families,
// qwen3next and qwen35moe, in the order llama.cpp's converter writes them.
#include <vector>

#include "model/arch.h"
#include "model/hparams.h"

namespace strata::model {

/// Appends layer `l`'s routed MoE with one gated shared expert: ffn_{down,gate,up}_exps (Expert,
/// width expert_feed_forward_length), the router ffn_gate_inp, ffn_{down,gate,up}_shexp (width
/// expert_shared_feed_forward_length), the shared expert's gate ffn_gate_inp_shexp ([n_embd, 1],
/// or [n_embd]) and post_attention_norm.
void add_shared_expert_moe_tensors(std::vector<TensorSpec>& t, const ModelHParams& hp, int l);

/// Appends layer `l`'s gated full attention: attn_q ([n_embd, 2 * n_head * head_dim]: query and
/// gate per head), attn_k, attn_v, attn_output and the per-head q/k norms (ne {head_dim}).
void add_gated_attention_tensors(std::vector<TensorSpec>& t, const ModelHParams& hp, int l);

}  // namespace strata::model
