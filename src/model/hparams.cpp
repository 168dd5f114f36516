#include "model/hparams.h"

#include <fmt/format.h>

#include <cmath>

#include "gguf/gguf.h"
#include "model/weights.h"

namespace strata::model {

ModelHParams read_common_hparams(const gguf::File& f) {
  ModelHParams hp;
  hp.arch = f.get_string("general.architecture");
  hp.name = f.get_string("general.name", "");
  const std::string a = hp.arch + ".";
  auto positive = [&](const std::string& key, int64_t v) {
    if (v <= 0 || v > (int64_t(1) << 30))
      throw ModelError(fmt::format("{}: key '{}' = {} is out of range", f.path(), key, v));
    return int(v);
  };
  hp.n_layer = positive(a + "block_count", f.get_int(a + "block_count"));
  hp.n_embd = positive(a + "embedding_length", f.get_int(a + "embedding_length"));
  hp.n_head = positive(a + "attention.head_count", f.get_int(a + "attention.head_count"));
  hp.n_head_kv = positive(a + "attention.head_count_kv", f.get_int(a + "attention.head_count_kv", hp.n_head));
  hp.head_dim_k = positive(a + "attention.key_length", f.get_int(a + "attention.key_length", hp.n_embd / hp.n_head));
  hp.head_dim_v = positive(a + "attention.value_length", f.get_int(a + "attention.value_length", hp.head_dim_k));
  // optional counts: 0 when absent; checked against the tensors by each architecture, but first
  // kept in int range so that an error prints the value the file holds
  auto count = [&](const std::string& key, int64_t def) {
    const int64_t v = f.get_int(key, def);
    if (v < 0 || v > (int64_t(1) << 30))
      throw ModelError(fmt::format("{}: key '{}' = {} is out of range", f.path(), key, v));
    return int(v);
  };
  hp.n_rot = count(a + "rope.dimension_count", hp.head_dim_k);
  hp.n_ff = count(a + "feed_forward_length", 0);
  hp.n_ff_exp = count(a + "expert_feed_forward_length", 0);
  hp.n_ff_shexp = count(a + "expert_shared_feed_forward_length", 0);
  hp.n_expert = count(a + "expert_count", 0);
  hp.n_expert_used = count(a + "expert_used_count", 0);
  hp.n_ctx_train = f.get_int(a + "context_length", 4096);
  hp.rope_freq_base = f.get_float(a + "rope.freq_base", 10000.0);
  hp.rms_eps = float(f.get_float(a + "attention.layer_norm_rms_epsilon", 1e-6));
  if (!(hp.rope_freq_base > 0) || !std::isfinite(hp.rope_freq_base))
    throw ModelError(fmt::format("{}: rope.freq_base = {} must be a positive number", f.path(), hp.rope_freq_base));
  if (!(hp.rms_eps > 0) || !std::isfinite(hp.rms_eps))
    throw ModelError(fmt::format("{}: layer_norm_rms_epsilon = {} must be a positive number", f.path(), hp.rms_eps));
  if (hp.n_head % hp.n_head_kv != 0)
    throw ModelError(fmt::format("{}: head_count {} is not a multiple of head_count_kv {}", f.path(), hp.n_head,
                                 hp.n_head_kv));
  if (hp.n_rot <= 0 || hp.n_rot > hp.head_dim_k || hp.n_rot % 2 != 0)
    throw ModelError(fmt::format("{}: rope.dimension_count {} invalid for head dim {}", f.path(), hp.n_rot, hp.head_dim_k));
  if (hp.n_expert < 0 || hp.n_expert_used < 0 || hp.n_expert_used > hp.n_expert)
    throw ModelError(fmt::format("{}: expert_used_count {} exceeds expert_count {}", f.path(), hp.n_expert_used,
                                 hp.n_expert));
  const gguf::TensorInfo* emb = f.find_tensor("token_embd.weight");
  if (!emb || emb->ne.size() != 2)
    throw ModelError(fmt::format("{}: missing tensor 'token_embd.weight' (expected shape [{}, n_vocab])", f.path(), hp.n_embd));
  hp.n_vocab = int(emb->ne[1]);
  hp.tied_output = f.find_tensor("output.weight") == nullptr;
  return hp;
}

}  // namespace strata::model
