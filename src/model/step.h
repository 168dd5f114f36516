#pragma once
// Step: the stages every architecture's forward pass is written in, over any backend.
//
// An architecture's forward reads top to bottom with one line per stage (embed, norm,
// attention, residual, moe, output); Step owns the activations of the call (x: the residual
// stream, h: the normed input of a block, o: a block's output, each fp32 ne {n_embd, T} with
// the tokens of every sequence of the batch back to back), splits the per-sequence blocks
// (attention, gated delta net) by sequence, names every intermediate for --dump, and holds
// the one shared MoE step with the cut and the read-ahead (DESIGN.md: "the cut",
// "next-layer prediction", "static rank"):
//
//   route(l) on the backend -> ids on the host -> group (token, k) pairs by expert
//   -> stream.request(l, needed)            the cut: misses become urgent reads
//   -> read-ahead for l+1 (its router on this layer's input, then the static rank)
//   -> expert_ffn for each resident expert, then each miss as it lands
//   -> stream.release(l, event after the last expert kernel) -> moe_combine in top-k order
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "model/model.h"

namespace strata::model {

/// Shape and type of one part (gate, up or down) of every expert of a layer: each expert's
/// slice is ne {cols, rows} (cols contiguous), `row_bytes` per row.
struct ExpertPartShape {
  GgmlType type = GgmlType::F32;
  int64_t rows = 0;
  int64_t cols = 0;
  size_t row_bytes = 0;
};

/// A routed-MoE layer: its router (resident) and the shapes of its streamed experts.
struct MoeLayer {
  backend::Tensor router;       ///< ffn_gate_inp: ne {n_embd, n_expert}
  backend::Tensor router_bias;  ///< ffn_gate_inp.bias: F32 ne {n_expert}, added to the logits; or empty
  backend::RouterSpec spec;
  backend::FfnSpec ffn;
  ExpertPartShape gate;  ///< ffn_gate_exps slice: ne {n_embd, n_ff_exp}
  ExpertPartShape up;    ///< ffn_up_exps slice
  ExpertPartShape down;  ///< ffn_down_exps slice: ne {n_ff_exp, n_embd}
  /// Resident expert biases, F32, one row per expert (or empty): ffn_gate_exps.bias and
  /// ffn_up_exps.bias ne {n_ff_exp, n_expert}, ffn_down_exps.bias ne {n_embd, n_expert}. Row e
  /// goes with expert e's job (FfnWeights::gate_b, up_b, down_b).
  backend::Tensor gate_bias, up_bias, down_bias;
};

class Step {
 public:
  /// Allocates the call's activations for the batch's tokens. Throws std::invalid_argument
  /// for an empty batch.
  Step(ForwardContext& ctx, const Model& model, std::span<SeqInput> batch);
  ~Step();

  int64_t n_tokens() const { return T_; }
  backend::Backend& be() { return be_; }

  /// x = token embeddings of the batch's ids (`table`: ne {n_embd, n_vocab}). Names "inp_embd".
  void embed(const backend::Tensor& table);
  /// h = RMSNorm(x) * w; names "<name>-<layer>".
  void norm(const backend::Tensor& w, const char* name, int layer);
  /// x += o; names x "<name>-<layer>".
  void residual(const char* name, int layer);
  /// residual(name, layer) then norm(w, norm_name, norm_layer), through Backend::add_rms_norm
  /// (one pass on backends that fuse them; the same results as the two calls).
  void residual_norm(const char* name, int layer, const backend::Tensor& w, const char* norm_name, int norm_layer);
  /// o = attention(h) per sequence, with `layer`'s KV cache of each. Names "attn_out-<layer>".
  void attention(int layer, const backend::AttentionSpec& spec, const backend::AttentionWeights& w);
  /// o = multi-head latent attention(h) per sequence, with `layer`'s latent cache of each (the
  /// state's k buffer, rows of spec.cache_dim() floats). Names "attn_out-<layer>".
  void mla_attention(int layer, const backend::MlaSpec& spec, const backend::MlaWeights& w);
  /// o = gated delta net(h) per sequence, advancing `layer`'s recurrent state of each.
  /// Names "linear_attn_out-<layer>".
  void gated_delta_net(int layer, const backend::GdnSpec& spec, const backend::GdnWeights& w);
  /// o += (or =) ffn(h) as `call` says. Names "<name>-<layer>" (o after the call).
  void ffn(const backend::FfnCall& call, const backend::FfnWeights& w, const char* name, int layer);
  /// The first MoE layer's read-ahead before any compute: `first`'s router on the embeddings
  /// normed with `norm0` (that layer's pre-MoE norm), then the static rank. `layer` is that
  /// layer's index (0 unless leading layers are dense).
  void read_ahead_first(const MoeLayer& first, const backend::Tensor& norm0, int layer = 0);
  /// o = routed MoE of `layer` on h with experts from the stream (the cut), layer+1's experts
  /// read ahead with `next`'s router (null: the last MoE layer) and, with --read-ahead-layers 2,
  /// layer+2's with `after_next`'s on the same h (null: none), queued after layer+1's. Names
  /// "ffn_moe_out-<layer>".
  void moe(int layer, const MoeLayer& w, const MoeLayer* next, const MoeLayer* after_next = nullptr);
  /// The final norm and output head for the rows each sequence's mode asks for, into its
  /// logits. Names "result_norm" and "result_output".
  void output(const backend::Tensor& norm, const backend::Tensor& head);
  /// After the backend's queued work is done: checks and counts the layers that ran on the
  /// device (Backend::moe_on_device): a non-zero selection status throws the host's
  /// std::invalid_argument, the experts used are counted in the stream's counters and the
  /// routing goes to the trace (if any), in layer order. output()
  /// calls it; a forward without output() must call it before its results are used.
  void settle_device_moe();

  /// Offers tensor `t` under `name` (and `layer` >= 0 as "-<layer>") to the dumper, if any.
  void name(const backend::Tensor& t, std::string_view name, int layer = -1);

 private:
  struct ReadAhead;
  ReadAhead plan_read_ahead(int layer, const MoeLayer* router_of, std::vector<int32_t>* predicted) const;
  /// Queues the read-ahead `ra` plans; the prediction (ra.router_of on h) is routed here unless
  /// `predicted` already holds its ids (routed with the layer's own router in one call).
  void read_ahead(const ReadAhead& ra, const backend::Tensor& h, const backend::Routing* predicted = nullptr);
  void score_prediction(int layer, const backend::Routing& r, const std::vector<int32_t>& predicted);
  /// `m`'s router logits on h (plus its bias, if it has one).
  void router_logits(const MoeLayer& m, const backend::Tensor& h, std::vector<float>& logits);
  void record_routing(int layer, const backend::Routing& r);
  /// The whole layer on the device when every expert of it (and of the next MoE layer) is
  /// resident for good and the backend takes it; false: nothing was queued.
  /// settle_device_moe() at the end of output(): on its error the call's n_past advance is undone.
  void settle_or_roll_back();
  bool moe_on_device(int layer, const MoeLayer& w, const MoeLayer* next, const backend::Tensor& expert_out);
  /// MoCE counters of one layer: `r` (with the bonus) against `exact`, `resident` as it routed.
  static void count_moce(const backend::Routing& r, const backend::Routing& exact, std::span<const uint8_t> resident,
                         MoceStats& out);

  ForwardContext& ctx_;
  backend::Backend& be_;
  const Model& model_;
  std::span<SeqInput> batch_;
  int64_t T_ = 0, E_ = 0;
  std::unique_ptr<backend::Buffer> act_;  // x, h, o
  backend::Tensor x_, h_, o_;
  std::unique_ptr<backend::Buffer> expert_out_;  // [T * top_k] rows, grown on demand
  std::vector<int32_t> pred_;                    // the prediction for the next MoE layer, per token [T][top_k]
  struct DeviceMoeResult {
    int layer;
    int top_k;
    const int32_t* host;  // [T] status, [T][top_k] ids, probs, weights, [T] next_prob, once the queue is done
  };
  std::vector<DeviceMoeResult> device_moe_;  // layers moe_on_device took, not yet settled
};

/// One layer of the plain attention + routed-MoE decoder (qwen3moe, gpt-oss, Mixtral):
///   x += attention(RMSNorm(x) * attn_norm);  x += MoE(RMSNorm(x) * ffn_norm)
struct AttnMoeLayer {
  backend::Tensor attn_norm, ffn_norm;
  backend::AttentionWeights attn;
  const backend::AttentionSpec* spec = nullptr;  ///< owned by the model (sliding or full, ...)
  MoeLayer moe;
};

/// A model made only of AttnMoeLayers with a KV cache per layer (K and V rows of
/// n_head_kv * head_dim_k floats): the state and the forward loop its architectures share.
/// The architecture's constructor fills layers_ (and experts_, via bind_moe) and may rename the
/// pre-MoE norm for --dump (ffn_norm_name_, llama.cpp's callback name).
class AttnMoeModel : public Model {
 public:
  SequenceState new_state(int64_t n_ctx) const override;
  uint64_t state_bytes(int64_t n_ctx) const override;
  void forward(ForwardContext& ctx, std::span<SeqInput> batch) override;

 protected:
  /// Fills layers_ and experts_ for every block l < hp_.n_layer: blk.l.attn_norm.weight, the
  /// attention weights (bind_attention), spec(l) as the layer's attention spec (owned by the
  /// model), the pre-MoE norm blk.l.<ffn_norm> and the routed MoE (bind_moe) with router(l).
  /// Throws ModelError (from BoundWeights::get) if the table lacks one of these tensors.
  void bind_layers(const BoundWeights& w, const std::function<const backend::AttentionSpec*(int)>& spec,
                   const std::function<backend::RouterSpec(int)>& router, const char* ffn_norm = "ffn_norm.weight");

  std::vector<AttnMoeLayer> layers_;
  const char* ffn_norm_name_ = "ffn_norm";
};

/// &layers[l + d].moe when l + d < n, else null: the routers a family's forward hands Step::moe
/// for its read-ahead (d = 1: next, d = 2: after_next).
template <class Layers>
const MoeLayer* moe_ahead(const Layers& layers, int l, int n, int d) {
  return l + d < n ? &layers[size_t(l + d)].moe : nullptr;
}

}  // namespace strata::model
