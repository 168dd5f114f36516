#include "model/routed_moe.h"

#include <fmt/format.h>

#include "model/model.h"
#include "model/rope_scaling.h"

namespace strata::model {

std::vector<KeySpec> routed_moe_keys() {
  using K = KeySpec;
  using H = ModelHParams;
  return {
      {"expert_shared_count", &H::n_expert_shared, K::Need::Optional},
      {"leading_dense_block_count", &H::n_layer_dense_lead, K::Need::Optional},
      {"expert_group_count", &H::n_expert_groups, K::Need::Optional},
      {"expert_group_used_count", &H::n_group_used, K::Need::Optional},
      {"expert_gating_func", &H::expert_gating_func, K::Need::Optional},
      {"expert_weights_scale", &H::expert_weights_scale, K::Need::Optional},
      {"nextn_predict_layers", &H::n_nextn, K::Need::Optional},
  };
}

bool routed_norm_topk(const gguf::File& f, const ModelHParams& hp) {
  const std::string key = hp.arch + ".expert_weights_norm";
  const gguf::Value* v = f.find(key);
  if (!v) return false;
  if (const bool* b = std::get_if<bool>(&v->v)) return *b;
  throw ModelError(fmt::format("{}: key '{}' must be a bool", f.path(), key));
}

backend::RouterSpec::Gating routed_gating(const gguf::File& f, const ModelHParams& hp) {
  using G = backend::RouterSpec::Gating;
  switch (hp.expert_gating_func) {
    case 1: return G::Softmax;
    case 2: return G::Sigmoid;
    case 0: break;
    default:
      throw ModelError(fmt::format("{}: key '{}.expert_gating_func' = {} is not supported (1 softmax, 2 sigmoid)",
                                   f.path(), hp.arch, hp.expert_gating_func));
  }
  for (int l = 0; l < forward_layers(hp); ++l)
    if (f.find_tensor(blk(l, "exp_probs_b.bias"))) return G::Sigmoid;
  return G::Softmax;
}

int routed_shexp_ff(const ModelHParams& hp) {
  return hp.n_ff_shexp > 0 ? hp.n_ff_shexp : hp.n_ff_exp * hp.n_expert_shared;
}

void validate_routed_moe(const gguf::File& f, const ModelHParams& hp) {
  const std::string& a = hp.arch;
  if (hp.n_expert <= 0 || hp.n_expert_used <= 0 || hp.n_ff_exp <= 0)
    throw ModelError(
        fmt::format("{}: {} needs expert_count, expert_used_count and expert_feed_forward_length > 0", f.path(), a));
  if (hp.n_nextn >= hp.n_layer)
    throw ModelError(fmt::format("{}: key '{}.nextn_predict_layers' = {} leaves no layers of {}.block_count = {}",
                                 f.path(), a, hp.n_nextn, a, hp.n_layer));
  if (hp.n_layer_dense_lead > forward_layers(hp))
    throw ModelError(fmt::format("{}: key '{}.leading_dense_block_count' = {} exceeds the {} forward layers", f.path(),
                                 a, hp.n_layer_dense_lead, forward_layers(hp)));
  if (hp.n_layer_dense_lead > 0 && hp.n_ff <= 0)
    throw ModelError(fmt::format("{}: {} has {} leading dense layers but no '{}.feed_forward_length'", f.path(), a,
                                 hp.n_layer_dense_lead, a));
  if (hp.n_expert_groups > 1) {
    if (hp.n_expert % hp.n_expert_groups != 0)
      throw ModelError(fmt::format("{}: key '{}.expert_group_count' = {} does not divide expert_count {}", f.path(), a,
                                   hp.n_expert_groups, hp.n_expert));
    if (hp.n_group_used < 1 || hp.n_group_used > hp.n_expert_groups ||
        int64_t(hp.n_group_used) * (hp.n_expert / hp.n_expert_groups) < hp.n_expert_used)
      throw ModelError(
          fmt::format("{}: key '{}.expert_group_used_count' = {} is out of range for {} groups of {} "
                      "experts and top-{}",
                      f.path(), a, hp.n_group_used, hp.n_expert_groups, hp.n_expert / hp.n_expert_groups,
                      hp.n_expert_used));
  }
  if (hp.expert_weights_scale < 0)
    throw ModelError(
        fmt::format("{}: key '{}.expert_weights_scale' = {} is negative", f.path(), a, hp.expert_weights_scale));
  (void)routed_gating(f, hp);  // an unsupported expert_gating_func fails here
  (void)routed_norm_topk(f, hp);
  validate_rope_scaling(f, hp);
}

void add_routed_ffn_tensors(std::vector<TensorSpec>& t, const ModelHParams& hp, int l) {
  const int64_t E = hp.n_embd, X = hp.n_expert, F = hp.n_ff_exp, FS = routed_shexp_ff(hp), FD = hp.n_ff;
  using R = TensorRole;
  using I = TensorInit;
  const bool opt = true;
  auto b = [&](const char* n) { return blk(l, n); };
  if (l < hp.n_layer_dense_lead) {
    t.insert(t.end(), {
                          {b("ffn_down.weight"), {FD, E}, R::Matrix, I::Weight},
                          {b("ffn_gate.weight"), {E, FD}, R::Matrix, I::Weight},
                          {b("ffn_up.weight"), {E, FD}, R::Matrix, I::Weight},
                      });
  } else {
    t.insert(t.end(), {
                          {b("ffn_down_exps.weight"), {F, E, X}, R::Expert, I::Weight},
                          {b("ffn_gate_exps.weight"), {E, F, X}, R::Expert, I::Weight},
                          {b("ffn_up_exps.weight"), {E, F, X}, R::Expert, I::Weight},
                          // synth: small like router weights (a norm-like ~1 bias would pick the experts alone)
                          {b("exp_probs_b.bias"), {X}, R::Vector, I::Router, {}, opt},
                          {b("ffn_gate_inp.weight"), {E, X}, R::Matrix, I::Router},
                      });
    if (hp.n_expert_shared > 0)
      t.insert(t.end(), {
                            {b("ffn_down_shexp.weight"), {FS, E}, R::Matrix, I::Weight},
                            {b("ffn_gate_shexp.weight"), {E, FS}, R::Matrix, I::Weight},
                            {b("ffn_up_shexp.weight"), {E, FS}, R::Matrix, I::Weight},
                        });
  }
}

backend::RouterSpec routed_router_spec(const gguf::File& f, const ModelHParams& hp, const BoundWeights& w,
                                       backend::Backend& be, int layer) {
  backend::RouterSpec r;
  r.gating = routed_gating(f, hp);
  r.n_expert = hp.n_expert;
  r.top_k = hp.n_expert_used;
  r.norm_topk = routed_norm_topk(f, hp);
  r.n_group = hp.n_expert_groups;
  r.n_group_used = hp.n_group_used;
  r.weights_scale = hp.expert_weights_scale > 0 ? hp.expert_weights_scale : 1.0f;
  const backend::Tensor b = w.maybe(blk(layer, "exp_probs_b.bias"));
  if (!b.empty()) {
    r.selection_bias.resize(size_t(hp.n_expert));
    be.download(r.selection_bias.data(), b, r.selection_bias.size() * sizeof(float));
  }
  return r;
}

}  // namespace strata::model
