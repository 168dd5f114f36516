#pragma once
// Pieces shared by the architectures with DeepSeek-style routed MoE (deepseek2, glm4moe):
// sigmoid or softmax gating, a selection bias, group-limited selection, scaled weights,
// ungated shared experts and leading dense layers. Formulas: backend::RouterSpec.
#include <string>
#include <vector>

#include "backend/backend.h"
#include "gguf/gguf.h"
#include "model/arch.h"
#include "model/hparams.h"

namespace strata::model {

/// The GGUF keys of this routing (expert_shared_count, leading_dense_block_count,
/// expert_group_count, expert_group_used_count, expert_gating_func, expert_weights_scale,
/// nextn_predict_layers), all optional. expert_weights_norm is a bool key: routed_norm_topk().
std::vector<KeySpec> routed_moe_keys();

/// `<arch>.expert_weights_norm` (GGUF bool): renormalize the top-k weights; absent: false (as
/// llama.cpp's loader). Throws ModelError naming the key if it is not a bool.
bool routed_norm_topk(const gguf::File& f, const ModelHParams& hp);

/// The gating function: expert_gating_func 1 = softmax, 2 = sigmoid; any other value is a
/// ModelError naming the key. Absent: sigmoid when the file has selection biases
/// (blk.N.exp_probs_b.bias: DeepSeek-V3 and later, whose scoring is sigmoid), else softmax
/// (DeepSeek-V2/V2.5). llama.cpp defaults an absent key to softmax for every deepseek2 file
/// (llama-model.cpp, "compatibility with existing DeepSeek V2 and V2.5 GGUFs"), which is wrong
/// for V3-style files written without the key (tests/test_deepseek2.cpp).
backend::RouterSpec::Gating routed_gating(const gguf::File& f, const ModelHParams& hp);

/// Feed-forward width of the shared experts: expert_shared_feed_forward_length if present,
/// else expert_feed_forward_length * expert_shared_count (how llama.cpp shapes ffn_*_shexp).
int routed_shexp_ff(const ModelHParams& hp);

/// Checks of these keys (ModelError naming them): experts, top-k and expert FFN present;
/// leading dense layers fewer than the forward layers and needing feed_forward_length; groups
/// dividing the experts with enough experts in the used groups; nextn layers fewer than blocks;
/// the rope.scaling keys (validate_rope_scaling).
void validate_routed_moe(const gguf::File& f, const ModelHParams& hp);

/// Appends layer `l`'s feed-forward tensors, in llama.cpp's order: a leading dense layer's
/// ffn_{down,gate,up} (width feed_forward_length), else the routed experts ffn_{down,gate,up}_exps
/// (Expert, width expert_feed_forward_length), the optional selection bias exp_probs_b.bias, the
/// router ffn_gate_inp and, with expert_shared_count > 0, the shared experts ffn_*_shexp (width
/// routed_shexp_ff). Shared by deepseek2 and glm4moe.
void add_routed_ffn_tensors(std::vector<TensorSpec>& t, const ModelHParams& hp, int l);

/// Layer `layer`'s router spec: gating, top-k, norm, groups, scale, and the selection bias
/// blk.N.exp_probs_b.bias (if the table bound it) downloaded to the host.
backend::RouterSpec routed_router_spec(const gguf::File& f, const ModelHParams& hp, const BoundWeights& w,
                                       backend::Backend& be, int layer);

/// Forward layers: block_count minus the NextN/MTP blocks at the end.
inline int forward_layers(const ModelHParams& hp) { return hp.n_layer - hp.n_nextn; }

}  // namespace strata::model
