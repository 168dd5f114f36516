#pragma once
// RoPE scaling from a file's `<arch>.rope.scaling.*` keys, as llama.cpp's loader and context
// read them (llama-model.cpp, llama-context.cpp) and as transformers' _compute_yarn_parameters
// defines YaRN (arXiv:2309.00071).
#include "backend/backend.h"
#include "gguf/gguf.h"
#include "model/hparams.h"

namespace strata::model {

/// How an architecture's file spells YaRN's magnitude correction.
enum class YarnFlavour : uint8_t {
  /// cos/sin times mscale = 0.1 ln(factor) + 1 (or get_mscale(f, 1) / get_mscale(f, M) when the
  /// file has rope.scaling.yarn_log_multiplier = M); the q.k scale is untouched (gpt-oss, and
  /// every architecture other than deepseek2).
  Standard,
  /// deepseek2: the converter writes yarn_log_multiplier = 0.1 * mscale_all_dim (llama.cpp
  /// divides it by 0.1 again, [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]); cos/sin keep
  /// get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) (= 1 for DeepSeek V2/V3, whose config has
  /// mscale = mscale_all_dim) and the q.k scale is multiplied by
  /// (attn * (1 + 0.1 mscale_all_dim ln f))^2 (transformers DeepseekV3Attention: softmax_scale *=
  /// yarn_get_mscale(factor, mscale_all_dim)^2).
  Deepseek2,
};

/// RoPE of a file with its scaling applied.
struct ScaledRope {
  backend::RopeSpec rope;
  /// Factor on the attention's q.k scale (1 without YaRN; Deepseek2 flavour only).
  double kq_factor = 1.0;
  bool yarn = false;  ///< rope.scaling.type = yarn
};

/// The RoPE of `f` for `n_rot` dims, base hp.rope_freq_base, layout `mode`:
/// - rope.scaling.type absent or "none": RopeSpec::standard (round_to_bf16 as given).
/// - "yarn": RopeSpec::yarn with factor = rope.scaling.factor (required, >= 1),
///   original context = rope.scaling.original_context_length (default context_length),
///   beta_fast / beta_slow = rope.scaling.yarn_beta_fast / yarn_beta_slow (default 32 / 1, as
///   llama.cpp and transformers), `truncate` (transformers' option: floor/ceil the correction
///   range; false for gpt-oss, whose config sets truncate = false; llama.cpp always truncates),
///   get_mscale(s, m) = (s <= 1 ? 1 : 0.1 m ln s + 1) and, with A = rope.scaling.attn_factor
///   (default 1) and M the log multiplier (0 absent):
///     attn = A * (M != 0 ? get_mscale(f, m) / get_mscale(f, M) : get_mscale(f, 1)),
///     m = (Deepseek2 flavour and M != 1) ? M : 1;   RopeSpec.attn_factor = attn;
///     Deepseek2: kq_factor = (attn * (1 + 0.1 M ln f))^2.
///   round_to_bf16 rounds the final table like standard() does.
/// Throws ModelError naming the key for another scaling type (linear, longrope, ...), a missing
/// or out-of-range factor, context or beta, and for rope.scaling.yarn_ext_factor other than 1 or
/// rope.scaling.yarn_attn_factor (an explicit attention factor llama.cpp ignores under YaRN and
/// transformers applies: refused rather than guessed).
ScaledRope scaled_rope(const gguf::File& f, const ModelHParams& hp, int n_rot, backend::RopeSpec::Mode mode,
                       YarnFlavour flavour, bool truncate, bool round_to_bf16);

/// Checks the keys scaled_rope() reads (the same errors), for an architecture's validate().
void validate_rope_scaling(const gguf::File& f, const ModelHParams& hp);

}  // namespace strata::model
