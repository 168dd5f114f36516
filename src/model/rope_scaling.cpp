#include "model/rope_scaling.h"

#include <cmath>

#include <fmt/format.h>

#include "model/weights.h"
#include "quant/quant.h"

namespace strata::model {
namespace {

double get_mscale(double s, double m) { return s <= 1 ? 1.0 : 0.1 * m * std::log(s) + 1.0; }

struct YarnKeys {
  bool yarn = false;
  double factor = 1, orig_ctx = 0, beta_fast = 32, beta_slow = 1, attn = 1, log_mul = 0;
};

YarnKeys read_keys(const gguf::File& f, const ModelHParams& hp) {
  YarnKeys y;
  const std::string p = hp.arch + ".rope.scaling.";
  if (!f.has(p + "type")) return y;
  const std::string type = f.get_string(p + "type");
  if (type == "none") return y;
  if (type != "yarn")
    throw ModelError(
        fmt::format("{}: key '{}type' = '{}' is not supported (strata implements none and yarn)", f.path(), p, type));
  y.yarn = true;
  if (!f.has(p + "factor"))
    throw ModelError(fmt::format("{}: rope.scaling.type = yarn needs key '{}factor'", f.path(), p));
  y.factor = f.get_float(p + "factor");
  if (!(y.factor >= 1 && y.factor <= 1e6))
    throw ModelError(fmt::format("{}: key '{}factor' = {} is out of range [1, 1e6]", f.path(), p, y.factor));
  y.orig_ctx = double(f.get_int(p + "original_context_length", hp.n_ctx_train));
  if (!(y.orig_ctx >= 1))
    throw ModelError(fmt::format("{}: key '{}original_context_length' = {} must be >= 1 (or context_length set)",
                                 f.path(), p, y.orig_ctx));
  y.beta_fast = f.get_float(p + "yarn_beta_fast", 32.0);
  y.beta_slow = f.get_float(p + "yarn_beta_slow", 1.0);
  if (!(y.beta_fast > 0 && y.beta_slow > 0 && y.beta_fast >= y.beta_slow))
    throw ModelError(
        fmt::format("{}: keys '{}yarn_beta_fast' = {} and 'yarn_beta_slow' = {} must be > 0 with "
                    "beta_fast >= beta_slow",
                    f.path(), p, y.beta_fast, y.beta_slow));
  if (f.has(p + "yarn_ext_factor") && f.get_float(p + "yarn_ext_factor") != 1.0)
    throw ModelError(fmt::format("{}: key '{}yarn_ext_factor' = {} is not supported (only 1: full NTK-by-parts)",
                                 f.path(), p, f.get_float(p + "yarn_ext_factor")));
  if (f.has(p + "yarn_attn_factor"))
    throw ModelError(
        fmt::format("{}: key '{}yarn_attn_factor' is not supported (an explicit YaRN attention factor: "
                    "llama.cpp ignores it, transformers applies it)",
                    f.path(), p));
  y.attn = f.get_float(p + "attn_factor", 1.0);
  if (!(y.attn > 0 && y.attn <= 100))
    throw ModelError(fmt::format("{}: key '{}attn_factor' = {} is out of range (0, 100]", f.path(), p, y.attn));
  y.log_mul = f.get_float(p + "yarn_log_multiplier", 0.0);
  if (!(y.log_mul >= 0 && y.log_mul <= 100))
    throw ModelError(
        fmt::format("{}: key '{}yarn_log_multiplier' = {} is out of range [0, 100]", f.path(), p, y.log_mul));
  return y;
}

}  // namespace

ScaledRope scaled_rope(const gguf::File& f, const ModelHParams& hp, int n_rot, backend::RopeSpec::Mode mode,
                       YarnFlavour flavour, bool truncate, bool round_to_bf16) {
  const YarnKeys y = read_keys(f, hp);
  ScaledRope r;
  if (!y.yarn) {
    r.rope = backend::RopeSpec::standard(n_rot, hp.rope_freq_base, mode, round_to_bf16);
    return r;
  }
  const bool ds = flavour == YarnFlavour::Deepseek2;
  // llama.cpp divides in float: 0.1f / 0.1f is exactly 1.
  const double M = ds ? double(float(y.log_mul) / 0.1f) : y.log_mul;
  const double m = ds && M != 1.0 ? M : 1.0;
  const double attn = y.attn * (M != 0 ? get_mscale(y.factor, m) / get_mscale(y.factor, M) : get_mscale(y.factor, 1));
  r.yarn = true;
  r.rope = backend::RopeSpec::yarn(n_rot, hp.rope_freq_base, mode, y.factor, y.orig_ctx, y.beta_fast, y.beta_slow,
                                   truncate, attn);
  if (round_to_bf16)
    for (double& v : r.rope.inv_freq) v = quant::bf16_to_fp32(quant::fp32_to_bf16(float(v)));
  if (ds) {
    const double ms = attn * (1 + 0.1 * M * std::log(y.factor));
    r.kq_factor = ms * ms;
  }
  return r;
}

void validate_rope_scaling(const gguf::File& f, const ModelHParams& hp) { (void)read_keys(f, hp); }

}  // namespace strata::model
