#pragma once
// Model hyper-parameters, read from GGUF keys (`<arch>.*`). One plain struct for every
// architecture; fields an architecture does not use stay at their defaults.
#include <cstdint>
#include <string>

namespace strata::model {

struct ModelHParams {
  std::string arch;                 ///< general.architecture, e.g. "qwen3moe"
  std::string name;                 ///< general.name
  int n_layer = 0;                  ///< <arch>.block_count
  int n_embd = 0;                   ///< <arch>.embedding_length (hidden size)
  int n_head = 0;                   ///< <arch>.attention.head_count
  int n_head_kv = 0;                ///< <arch>.attention.head_count_kv
  int head_dim_k = 0;               ///< <arch>.attention.key_length (default n_embd / n_head)
  int head_dim_v = 0;               ///< <arch>.attention.value_length (default head_dim_k)
  int n_rot = 0;                    ///< <arch>.rope.dimension_count (default head_dim_k)
  int n_ff = 0;                     ///< <arch>.feed_forward_length (dense FFN; unused by all-MoE layers)
  int n_ff_exp = 0;                 ///< <arch>.expert_feed_forward_length
  int n_ff_shexp = 0;               ///< <arch>.expert_shared_feed_forward_length (0: no shared expert)
  int n_expert = 0;                 ///< <arch>.expert_count
  int n_expert_used = 0;            ///< <arch>.expert_used_count (top-k)
  bool norm_topk = true;            ///< renormalize the top-k router weights to sum to 1
  int64_t n_ctx_train = 0;          ///< <arch>.context_length (tokens)
  double rope_freq_base = 10000.0;  ///< <arch>.rope.freq_base
  float rms_eps = 1e-6f;            ///< <arch>.attention.layer_norm_rms_epsilon
  // Linear-attention (gated delta net) layers: qwen3next's `ssm.*` keys (llama.cpp's names in parentheses).
  int ssm_conv_kernel = 0;          ///< <arch>.ssm.conv_kernel (ssm_d_conv): taps of the causal conv
  int ssm_state_size = 0;           ///< <arch>.ssm.state_size (ssm_d_state): key head dim
  int ssm_group_count = 0;          ///< <arch>.ssm.group_count (ssm_n_group): key heads
  int ssm_time_step_rank = 0;       ///< <arch>.ssm.time_step_rank (ssm_dt_rank): value heads
  int ssm_inner_size = 0;           ///< <arch>.ssm.inner_size (ssm_d_inner): value heads x value head dim
  int full_attention_interval = 0;  ///< <arch>.full_attention_interval: every n-th layer is full attention
  /// <arch>.nextn_predict_layers: the last n_nextn of the n_layer blocks are multi-token-prediction
  /// (NextN/MTP) blocks, in the file but not part of the forward pass (0: none)
  int n_nextn = 0;
  // Routed-MoE options of the deepseek2 / glm4moe families (llama.cpp's names in parentheses).
  int n_expert_shared = 0;         ///< <arch>.expert_shared_count: ungated shared experts (n_expert_shared)
  int n_layer_dense_lead = 0;      ///< <arch>.leading_dense_block_count: first layers with a dense FFN
  int n_expert_groups = 0;         ///< <arch>.expert_group_count: expert groups for group-limited routing
  int n_group_used = 0;            ///< <arch>.expert_group_used_count: groups that may be selected
  int expert_gating_func = 0;      ///< <arch>.expert_gating_func: 0 absent, 1 softmax, 2 sigmoid (llama.cpp's enum)
  float expert_weights_scale = 0;  ///< <arch>.expert_weights_scale: factor on the mixing weights (0: absent = 1)
  // Multi-head latent attention (deepseek2).
  int q_lora_rank = 0;       ///< <arch>.attention.q_lora_rank (0: plain attn_q)
  int kv_lora_rank = 0;      ///< <arch>.attention.kv_lora_rank: latent KV width
  int head_dim_k_mla = 0;    ///< <arch>.attention.key_length_mla: q/k dims per head (nope + rope)
  int head_dim_v_mla = 0;    ///< <arch>.attention.value_length_mla: value dims per head
  int n_swa = 0;             ///< <arch>.attention.sliding_window: positions a sliding-window layer attends (0: none)
  int n_vocab = 0;           ///< rows of token_embd
  bool tied_output = false;  ///< no output.weight: logits use token_embd
};

}  // namespace strata::model

namespace strata::gguf {
class File;
}
namespace strata::model {
/// Reads the keys every transformer architecture shares (model/arch.h common_keys(): block count,
/// embedding length, heads, rope, norm epsilon, expert counts, context length; gguf.md "LLM"
/// keys) and the vocabulary size from token_embd, for any architecture (`info` on files this
/// build cannot run). Throws gguf::GgufError for malformed keys and ModelError for missing or
/// inconsistent values (e.g. heads not dividing, top-k > experts).
ModelHParams read_common_hparams(const gguf::File& f);
}  // namespace strata::model
