// strata synth: a GGUF with the exact tensor names, shapes and types of a real MoE model and
// random weights, so that models larger than RAM can be run and measured here.
//
// Weights are valid blocks of their type: random quant bits with fp16 scales calibrated (per
// type, by dequantizing sample blocks) so that values have mean ~0 and std ~0.02, jittered
// +-25 % per block; norms ~1 +- 0.1 (F32); routers F32 with std 0.02. Every block is a pure
// function of (seed, tensor name, block index), so the file is the same however it is cut into
// pieces. Tensors are generated piece by piece while the file is written (gguf::Writer's
// streamed tensors): memory stays constant and a 31 GB file writes at disk speed.
//
// The tokenizer (tokenizer.ggml.*) is copied from a real GGUF (default: the shipped
// models/qwen3moe-code-Q8_0.gguf, 8192 tokens) and padded with unused "[PADn]" tokens up to
// the vocabulary size, as llama.cpp's converter does for Qwen's padded vocabulary.
#include <fmt/format.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <thread>

#include "cli/commands.h"
#include "cli/common.h"
#include "cli/progress.h"
#include "gguf/gguf_writer.h"
#include "io/write_file.h"
#include "model/arch.h"
#include "quant/quant.h"

namespace strata::cli {

namespace {

namespace fs = std::filesystem;

// ---- architectures ----------------------------------------------------------------------

// A real model's shape: its hyper-parameters as the GGUF keys would hold them. The tensors come
// from the architecture's table (src/model/arch/), the keys from its key table.
struct SynthShape {
  std::string like, name;
  model::ModelHParams hp;
  /// Keys beyond the key table (suffixes of "<arch>."): bool and array keys, RoPE scaling.
  std::vector<std::pair<std::string, gguf::Value>> extra_kv = {};
  /// Optional table tensors the real file does not have (suffixes of "blk.N."), e.g. q/k norms.
  std::vector<std::string> omit = {};
};

// The keys most shapes share; the shapes below set the rest.
model::ModelHParams shape_hp(const char* arch, int n_layer, int n_embd, int n_head, int n_head_kv, int head_dim,
                             int n_expert, int n_expert_used, int n_ff, int n_ff_exp, int64_t n_vocab, int64_t n_ctx,
                             double rope_base) {
  model::ModelHParams h;
  h.arch = arch;
  h.n_layer = n_layer, h.n_embd = n_embd, h.n_head = n_head, h.n_head_kv = n_head_kv;
  h.head_dim_k = h.head_dim_v = h.n_rot = head_dim;
  h.n_expert = n_expert, h.n_expert_used = n_expert_used, h.n_ff = n_ff, h.n_ff_exp = n_ff_exp;
  h.n_vocab = int(n_vocab), h.n_ctx_train = n_ctx, h.rope_freq_base = rope_base, h.rms_eps = 1e-6f;
  return h;
}

// Shapes from the models' Hugging Face config.json (and, for the code model, the shipped GGUF).
std::vector<SynthShape> known_shapes() {
  std::vector<SynthShape> v;
  v.push_back({"qwen3moe-30b-a3b", "Qwen3 30B A3B",  // Qwen/Qwen3-30B-A3B
               shape_hp("qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 6144, 768, 151936, 40960, 1e6)});
  v.push_back({"qwen3moe-235b-a22b", "Qwen3 235B A22B",  // Qwen/Qwen3-235B-A22B
               shape_hp("qwen3moe", 94, 4096, 64, 4, 128, 128, 8, 12288, 1536, 151936, 40960, 1e6)});
  {
    SynthShape s{"qwen3-next-80b-a3b", "Qwen3 Next 80B A3B",  // Qwen/Qwen3-Next-80B-A3B-Instruct
                 shape_hp("qwen3next", 48, 2048, 16, 2, 256, 512, 10, 5120, 512, 151936, 262144, 1e7)};
    model::ModelHParams& h = s.hp;
    h.n_ff_shexp = 512;
    h.n_rot = 64;  // partial_rotary_factor 0.25 of head_dim 256
    h.ssm_conv_kernel = 4, h.ssm_state_size = 128, h.ssm_group_count = 16, h.ssm_time_step_rank = 32;
    h.ssm_inner_size = 32 * 128, h.full_attention_interval = 4;
    v.push_back(s);
  }
  // The families of issue 14. Sources: each model's config.json on Hugging Face (the repository
  // named), converted to GGUF keys as llama.cpp's convert_hf_to_gguf.py writes them. No NextN/MTP
  // blocks (nextn_predict_layers 0): strata skips them in a real file anyway.
  {
    // openai/gpt-oss-120b: hidden 2880, 36 layers, 64 heads / 8 kv of 64, 128 experts top-4 of
    // width 2880, sliding window 128 on even layers, rope_theta 150000, YaRN factor 32 over 4096
    // (beta 32/1), vocab 201088, context 131072, rms_norm_eps 1e-5. Real file: MXFP4 experts.
    SynthShape s{"gpt-oss-120b", "gpt-oss 120b",
                 shape_hp("gpt-oss", 36, 2880, 64, 8, 64, 128, 4, 2880, 2880, 201088, 131072, 150000)};
    s.hp.n_swa = 128;
    s.hp.rms_eps = 1e-5f;
    s.extra_kv = {{"rope.scaling.type", gguf::make_string("yarn")},
                  {"rope.scaling.factor", gguf::make_f32(32)},
                  {"rope.scaling.original_context_length", gguf::make_u32(4096)}};
    v.push_back(s);
  }
  {
    // deepseek-ai/DeepSeek-V3: hidden 7168, 61 layers (first 3 dense, intermediate 18432), 128
    // heads, MLA q_lora 1536 / kv_lora 512, qk_nope 128 + qk_rope 64, v 128; 256 experts of 2048
    // top-8, 1 shared, sigmoid scoring with selection bias (noaux_tc), 8 groups / 4 used,
    // routed_scaling_factor 2.5, norm_topk_prob; rope_theta 10000, YaRN factor 40 over 4096,
    // mscale = mscale_all_dim = 1 (yarn_log_multiplier 0.1); vocab 129280, context 163840.
    SynthShape s{"deepseek-v3", "DeepSeek V3",
                 shape_hp("deepseek2", 61, 7168, 128, 1, 576, 256, 8, 18432, 2048, 129280, 163840, 10000)};
    model::ModelHParams& h = s.hp;
    h.head_dim_v = 512, h.n_rot = 64;  // MLA in llama.cpp's form: key = kv_lora + rope, value = kv_lora
    h.q_lora_rank = 1536, h.kv_lora_rank = 512, h.head_dim_k_mla = 192, h.head_dim_v_mla = 128;
    h.n_expert_shared = 1, h.n_layer_dense_lead = 3, h.n_expert_groups = 8, h.n_group_used = 4;
    h.expert_gating_func = 2, h.expert_weights_scale = 2.5f;
    s.extra_kv = {{"expert_weights_norm", gguf::make_bool(true)},
                  {"rope.scaling.type", gguf::make_string("yarn")},
                  {"rope.scaling.factor", gguf::make_f32(40)},
                  {"rope.scaling.original_context_length", gguf::make_u32(4096)},
                  {"rope.scaling.yarn_log_multiplier", gguf::make_f32(0.1f)}};
    v.push_back(s);
  }
  {
    // zai-org/GLM-4.5-Air: hidden 4096, 46 layers (first 1 dense, intermediate 10944), 96 heads /
    // 8 kv of 128, partial rotary 0.5 (64 dims), attention biases, no q/k norm; 128 experts of
    // 1408 top-8, 1 shared, sigmoid with selection bias, 1 group, routed_scaling_factor 1,
    // norm_topk_prob; rope_theta 1e6, vocab 151552, context 131072, rms_norm_eps 1e-5.
    SynthShape s{"glm-4.5-air", "GLM 4.5 Air",
                 shape_hp("glm4moe", 46, 4096, 96, 8, 128, 128, 8, 10944, 1408, 151552, 131072, 1e6)};
    model::ModelHParams& h = s.hp;
    h.n_rot = 64, h.rms_eps = 1e-5f;
    h.n_expert_shared = 1, h.n_layer_dense_lead = 1, h.n_expert_groups = 1, h.n_group_used = 1;
    h.expert_gating_func = 2, h.expert_weights_scale = 1.0f;
    s.extra_kv = {{"expert_weights_norm", gguf::make_bool(true)}};
    s.omit = {"attn_q_norm.weight", "attn_k_norm.weight"};
    v.push_back(s);
  }
  {
    // Qwen/Qwen3.5-122B-A10B (text model): 48 layers, every 4th gated full attention (12 of 48),
    // the rest gated delta net; 256 experts top-8 plus 1 shared expert, vocab 248320, context
    // 262144 (these from the model card). From its config.json: hidden 3072, 32 heads / 2 kv of
    // 256, partial rotary 0.25 (64 dims, IMRoPE sections 11/11/10), rope_theta 1e7, expert and
    // shared-expert width 1024, delta net 16 key heads / 64 value heads of 128, conv kernel 4.
    SynthShape s{"qwen3.5-122b-a10b", "Qwen3.5 122B A10B",
                 shape_hp("qwen35moe", 48, 3072, 32, 2, 256, 256, 8, 0, 1024, 248320, 262144, 1e7)};
    model::ModelHParams& h = s.hp;
    h.n_ff_shexp = 1024, h.n_rot = 64;
    h.ssm_conv_kernel = 4, h.ssm_state_size = 128, h.ssm_group_count = 16, h.ssm_time_step_rank = 64;
    h.ssm_inner_size = 64 * 128, h.full_attention_interval = 4;
    s.extra_kv = {{"rope.dimension_sections", gguf::make_i32_array({11, 11, 10, 0})}};
    v.push_back(s);
  }
  {
    // MiniMaxAI/MiniMax-M2 (and M2.1, same shape): hidden 3072, 62 layers, 48 heads / 8 kv of
    // 128, rotary_dim 64 (partial rotary), full-width q/k norm (qk_norm_type per_layer); 256
    // experts of 1536 top-8, sigmoid scoring with routing bias (use_routing_bias), no shared
    // experts; rope_theta 5e6, vocab 200064, context 196608, rms_norm_eps 1e-6. The MTP modules
    // (num_mtp_modules 3) are not in llama.cpp's GGUF.
    SynthShape s{"minimax-m2", "MiniMax M2",
                 shape_hp("minimax-m2", 62, 3072, 48, 8, 128, 256, 8, 0, 1536, 200064, 196608, 5e6)};
    s.hp.n_rot = 64, s.hp.expert_gating_func = 2;
    v.push_back(s);
  }
  {
    // A tiny MiniMax-M2-layout model for the reference test (tests/test_minimax_m2.cpp), not a
    // real model: partial rotary (8 of 16 dims), 8 experts top-2.
    SynthShape s{"minimax-m2-tiny", "MiniMax M2 tiny (test shape)",
                 shape_hp("minimax-m2", 2, 64, 4, 2, 16, 8, 2, 0, 32, 8192, 4096, 1e4)};
    s.hp.n_rot = 8, s.hp.expert_gating_func = 2;
    v.push_back(s);
  }
  // mistralai/Mixtral-8x7B-v0.1: hidden 4096, 32 layers, 32 heads / 8 kv of 128, 8 experts of
  // 14336 top-2, vocab 32000, rope_theta 1e6, rms_norm_eps 1e-5, context 32768 ("llama" in GGUF;
  // the experts' width is feed_forward_length).
  v.push_back(
      {"mixtral-8x7b", "Mixtral 8x7B", shape_hp("llama", 32, 4096, 32, 8, 128, 8, 2, 14336, 0, 32000, 32768, 1e6)});
  v.back().hp.rms_eps = 1e-5f;
  // A tiny Mixtral-layout model for the reference test (tests/test_mixtral.cpp), not a real model.
  v.push_back(
      {"mixtral-tiny", "Mixtral tiny (test shape)", shape_hp("llama", 2, 64, 4, 2, 16, 4, 2, 32, 0, 8192, 4096, 1e4)});
  {
    SynthShape s{"qwen3moe-code", "Qwen3Moe Code",  // the shipped trained model (models/qwen3moe-code-Q8_0.gguf)
                 shape_hp("qwen3moe", 8, 256, 4, 2, 64, 64, 8, 512, 64, 8192, 4096, 1e6)};
    s.hp.tied_output = true;
    v.push_back(s);
  }
  return v;
}

std::string known_names() {
  std::string s;
  for (const auto& k : known_shapes()) s += (s.empty() ? "" : ", ") + k.like;
  return s;
}

// ---- types --------------------------------------------------------------------------------

// Where a block keeps its scale(s): fp16 d at d_off, an fp16 min (or additive m) at m_off
// (-1: none); MXFP4 keeps an E8M0 exponent byte at 0 instead.
struct ScaleLayout {
  GgmlType type;
  int d_off;
  int m_off;
  bool e8m0;
};
constexpr std::array<ScaleLayout, 15> kScaleLayouts = {{
    {GgmlType::Q4_0, 0, -1, false},
    {GgmlType::Q4_1, 0, 2, false},
    {GgmlType::Q5_0, 0, -1, false},
    {GgmlType::Q5_1, 0, 2, false},
    {GgmlType::Q8_0, 0, -1, false},
    {GgmlType::Q2_K, 80, 82, false},
    {GgmlType::Q3_K, 108, -1, false},
    {GgmlType::Q4_K, 0, 2, false},
    {GgmlType::Q5_K, 0, 2, false},
    {GgmlType::Q6_K, 208, -1, false},
    {GgmlType::IQ2_XS, 0, -1, false},
    {GgmlType::IQ3_S, 0, -1, false},
    {GgmlType::IQ4_XS, 0, -1, false},
    {GgmlType::IQ4_NL, 0, -1, false},
    {GgmlType::MXFP4, 0, -1, true},
}};

bool is_float_type(GgmlType t) { return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16; }

const ScaleLayout* scale_layout(GgmlType t) {
  for (const auto& s : kScaleLayouts)
    if (s.type == t) return &s;
  return nullptr;
}

bool synth_supports(GgmlType t) { return is_float_type(t) || (scale_layout(t) && quant::is_supported(t)); }

std::string synth_type_list() {
  std::string s = "F32, F16, BF16";
  for (const auto& l : kScaleLayouts)
    if (quant::is_supported(l.type)) s += ", " + ggml_type_name(l.type);
  return s;
}

GgmlType parse_type(const std::string& name) {
  std::string up = name;
  for (auto& c : up) c = char(std::toupper(static_cast<unsigned char>(c)));
  for (uint32_t id = 0; id < 64; ++id) {
    const auto info = ggml_type_info(id);
    if (info && up == info->name && synth_supports(info->type)) return info->type;
  }
  throw std::invalid_argument(
      fmt::format("unknown or unsupported type '{}' (synth writes: {})", name, synth_type_list()));
}

uint32_t llama_file_type(GgmlType t) {  // llama_ftype of a file whose bulk (the experts) is `t`
  switch (t) {
    case GgmlType::F32: return 0;
    case GgmlType::F16: return 1;
    case GgmlType::Q4_0: return 2;
    case GgmlType::Q4_1: return 3;
    case GgmlType::Q8_0: return 7;
    case GgmlType::Q5_0: return 8;
    case GgmlType::Q5_1: return 9;
    case GgmlType::Q2_K: return 10;
    case GgmlType::Q3_K: return 12;
    case GgmlType::Q4_K: return 14;
    case GgmlType::Q5_K: return 16;
    case GgmlType::Q6_K: return 18;
    case GgmlType::IQ2_XS: return 20;
    case GgmlType::IQ4_NL: return 25;
    case GgmlType::IQ3_S: return 26;
    case GgmlType::IQ4_XS: return 30;
    case GgmlType::BF16: return 32;
    case GgmlType::MXFP4: return 38;
    default: return 0;
  }
}

// The type a tensor with rows of `cols` elements gets when `want` does not divide them,
// following llama.cpp's quantizer (llama_tensor_get_type's fallbacks).
GgmlType row_compatible(GgmlType want, uint64_t cols) {
  auto fits = [&](GgmlType t) { return cols % uint64_t(ggml_type_info(uint32_t(t))->block_elems) == 0; };
  if (fits(want)) return want;
  GgmlType t = want;
  switch (want) {
    case GgmlType::IQ2_XS:
    case GgmlType::IQ3_S:
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::IQ4_XS: t = GgmlType::IQ4_NL; break;
    case GgmlType::Q4_K: t = GgmlType::Q5_0; break;
    case GgmlType::Q5_K: t = GgmlType::Q5_1; break;
    case GgmlType::Q6_K: t = GgmlType::Q8_0; break;
    default: break;
  }
  return fits(t) ? t : GgmlType::F16;
}

// ---- random blocks ------------------------------------------------------------------------

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t hash_name(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

struct Rng {  // wyrand: fast, good enough for weights
  uint64_t s;
  uint64_t next() {
    s += 0xa0761d6478bd642full;
    const __uint128_t t = static_cast<__uint128_t>(s) * (s ^ 0xe7037ed1a0b428dbull);
    return uint64_t(t >> 64) ^ uint64_t(t);
  }
  float uniform() { return float(next() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
  // ~N(0, 1): Irwin-Hall sum of four 16-bit uniforms.
  float gauss() {
    const uint64_t r = next();
    const float sum = float((r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48));
    return (sum - 131070.0f) * (1.0f / 37837.2f);
  }
};

// What a float tensor holds: the architecture table's TensorInit.
using Kind = model::TensorInit;

constexpr float kStd = 0.02f;
constexpr int64_t kFloatUnit = 256;  // elements per generation unit of float tensors

float sample(Kind k, Rng& r) {
  switch (k) {
    case Kind::Weight:
    case Kind::Router: return kStd * r.gauss();
    case Kind::Conv: return 2 * kStd * r.gauss();
    case Kind::Norm: return 1.0f + 0.1f * r.gauss();
    case Kind::SsmA: return -std::exp(r.uniform() * std::log(16.0f));  // -exp(A_log), A in [1, 16)
    case Kind::DtBias: return 1.0f + 0.05f * r.gauss();
  }
  return 0.0f;
}

// Block scales of one quantized type: d (and m) such that values have mean ~0 and std kStd.
struct BlockScales {
  float d = 1, m = 0;
  int e = 127;  // MXFP4
};

// Generates one unit (a block, or kFloatUnit elements of a float type) of a tensor.
class UnitGen {
 public:
  UnitGen(GgmlType t, Kind kind, uint64_t seed, BlockScales sc) : t_(t), kind_(kind), seed_(seed), sc_(sc) {
    const auto info = ggml_type_info(uint32_t(t));
    if (is_float_type(t)) {
      elem_bytes_ = info->block_bytes;
      unit_bytes_ = size_t(kFloatUnit) * elem_bytes_;
    } else {
      layout_ = scale_layout(t);
      unit_bytes_ = info->block_bytes;
      // fp16 scales for 256 jitter levels in [0.75, 1.25]: no float conversion per block.
      for (int k = 0; k < 256; ++k) {
        const float j = 0.75f + 0.5f * float(k) / 255.0f;
        d16_[size_t(k)] = quant::fp32_to_fp16(sc_.d * j);
        m16_[size_t(k)] = quant::fp32_to_fp16(sc_.m * j);
      }
    }
  }
  size_t unit_bytes() const { return unit_bytes_; }

  void unit(uint64_t u, uint8_t* dst) const {
    Rng r{splitmix(seed_ ^ (u * 0xd1342543de82ef95ull))};
    if (layout_ == nullptr) {
      for (int64_t i = 0; i < kFloatUnit; ++i) {
        const float x = sample(kind_, r);
        if (t_ == GgmlType::F32) {
          std::memcpy(dst + 4 * i, &x, 4);
        } else {
          const uint16_t h = t_ == GgmlType::F16 ? quant::fp32_to_fp16(x) : quant::fp32_to_bf16(x);
          std::memcpy(dst + 2 * i, &h, 2);
        }
      }
      return;
    }
    size_t i = 0;
    for (; i + 8 <= unit_bytes_; i += 8) {
      const uint64_t x = r.next();
      std::memcpy(dst + i, &x, 8);
    }
    const uint64_t tail = r.next();  // low bytes: the block's last bytes; top byte: the jitter
    std::memcpy(dst + i, &tail, unit_bytes_ - i);
    const size_t jitter = size_t(tail >> 56);
    if (layout_->e8m0) {
      dst[0] = uint8_t(sc_.e + int(jitter % 3) - 1);
      return;
    }
    std::memcpy(dst + layout_->d_off, &d16_[jitter], 2);
    if (layout_->m_off >= 0) std::memcpy(dst + layout_->m_off, &m16_[jitter], 2);
  }

  // Bytes [off, off + n) of a tensor of `total` bytes: whole units straight into dst, the
  // partial ones at either end through a scratch unit.
  void fill(uint64_t off, uint8_t* dst, size_t n) const {
    std::vector<uint8_t> scratch(unit_bytes_);
    uint64_t pos = off;
    const uint64_t end = off + n;
    while (pos < end) {
      const uint64_t u = pos / unit_bytes_, u0 = u * unit_bytes_;
      if (pos == u0 && end - pos >= unit_bytes_) {
        unit(u, dst + (pos - off));
        pos += unit_bytes_;
      } else {
        unit(u, scratch.data());
        const uint64_t k = std::min<uint64_t>(end, u0 + unit_bytes_) - pos;
        std::memcpy(dst + (pos - off), scratch.data() + (pos - u0), size_t(k));
        pos += k;
      }
    }
  }

 private:
  GgmlType t_;
  Kind kind_;
  uint64_t seed_;
  BlockScales sc_;
  const ScaleLayout* layout_ = nullptr;
  size_t unit_bytes_ = 0, elem_bytes_ = 0;
  std::array<uint16_t, 256> d16_{}, m16_{};
};

// Mean and std of the values of `blocks` generated blocks of type t with scales sc.
std::pair<double, double> block_stats(GgmlType t, const BlockScales& sc, int blocks) {
  const UnitGen g(t, Kind::Weight, 12345, sc);
  const int64_t be = ggml_type_info(uint32_t(t))->block_elems;
  std::vector<uint8_t> raw(g.unit_bytes());
  std::vector<float> vals(static_cast<size_t>(be));
  double s = 0, s2 = 0;
  for (int b = 0; b < blocks; ++b) {
    g.unit(uint64_t(b), raw.data());
    quant::dequantize_row(t, raw.data(), vals.data(), be);
    for (float x : vals) {
      s += x;
      s2 += double(x) * x;
    }
  }
  const double n = double(blocks) * double(be), mean = s / n;
  return {mean, std::sqrt(std::max(0.0, s2 / n - mean * mean))};
}

BlockScales calibrate(GgmlType t) {
  BlockScales sc;
  const ScaleLayout* l = scale_layout(t);
  if (!l) return sc;
  constexpr int kBlocks = 256;
  if (l->e8m0) {
    sc.e = 128;  // d = 2^(e - 128) = 1 (ggml's halved E8M0); the +-1 jitter averages out
    const double sd = block_stats(t, sc, kBlocks).second;
    sc.e = 128 + int(std::lround(std::log2(kStd / sd)));
    return sc;
  }
  sc.d = 1, sc.m = 0;
  const double mean_d = block_stats(t, sc, kBlocks).first;
  if (l->m_off >= 0) {
    BlockScales only_m{0, 1, 127};
    const double mean_m = block_stats(t, only_m, kBlocks).first;
    sc.m = float(-mean_d / mean_m);  // cancels the mean
  }
  const double sd = block_stats(t, sc, kBlocks).second;
  sc.d = float(kStd / sd);
  sc.m = float(sc.m * kStd / sd);
  return sc;
}

// ---- the tensor plan ----------------------------------------------------------------------

struct PlannedTensor {
  std::string name;
  GgmlType type;
  std::vector<uint64_t> ne;
  Kind kind;
};

struct Plan {
  std::vector<PlannedTensor> tensors;
  uint64_t expert_bytes = 0;  // all routed experts
  uint64_t record_bytes = 0;  // one expert's gate + up + down (largest layer)
};

// The tensors of the architecture's table for these hyper-parameters, with the types of a
// quantized file: experts `expert_type`, dense weight matrices `dense_type` (each falling back as
// llama.cpp's quantizer does where the type does not divide the rows), norms, routers and other
// small tensors F32.
Plan make_plan(const SynthShape& s, GgmlType expert_type, GgmlType dense_type) {
  const model::Architecture* arch = model::find_architecture(s.hp.arch);
  if (!arch) throw std::logic_error("synth: no architecture " + s.hp.arch);
  Plan plan;
  std::map<int, uint64_t> record;  // per layer: one expert's gate + up + down bytes
  auto omitted = [&](const model::TensorSpec& t) {
    if (!t.optional) return false;
    for (const std::string& suf : s.omit)
      if (t.name.size() > suf.size() && t.name.compare(t.name.size() - suf.size(), suf.size(), suf) == 0) return true;
    return false;
  };
  for (const model::TensorSpec& t : arch->tensors(s.hp)) {
    if (t.role == model::TensorRole::Skip || omitted(t)) continue;
    std::vector<uint64_t> ne(t.ne.begin(), t.ne.end());
    const bool weight = t.init == Kind::Weight && t.role != model::TensorRole::Vector;
    const GgmlType want = t.role == model::TensorRole::Expert ? expert_type : dense_type;
    const GgmlType type = weight ? row_compatible(want, ne[0]) : GgmlType::F32;
    plan.tensors.push_back(PlannedTensor{t.name, type, ne, t.init});
    if (t.role == model::TensorRole::Expert) {
      const uint64_t bytes = gguf::Writer::tensor_bytes(type, ne);
      plan.expert_bytes += bytes;
      record[std::atoi(t.name.c_str() + 4)] += bytes / ne[2];  // "blk.N.ffn_*_exps.weight"
    }
  }
  for (const auto& [layer, bytes] : record) plan.record_bytes = std::max(plan.record_bytes, bytes);
  return plan;
}

// tokenizer.* keys of `src`, the token list padded with unused "[PADn]" tokens to n_vocab.
void add_tokenizer(gguf::Writer& w, const gguf::File& src, int64_t n_vocab) {
  const int64_t n_tok = int64_t(src.get_string_array("tokenizer.ggml.tokens").size());
  if (n_vocab < n_tok)
    throw std::invalid_argument(
        fmt::format("--vocab {} is smaller than the tokenizer's {} tokens (from {})", n_vocab, n_tok, src.path()));
  for (const auto& [key, v] : src.metadata()) {
    if (key.rfind("tokenizer.", 0) != 0) continue;
    if (key == "tokenizer.ggml.tokens" && n_vocab > n_tok) {
      std::vector<std::string> toks = src.get_string_array(key);
      for (int64_t i = n_tok; i < n_vocab; ++i) toks.push_back(fmt::format("[PAD{}]", i));
      w.add_string_array(key, toks);
    } else if (key == "tokenizer.ggml.token_type" && n_vocab > n_tok) {
      gguf::Value padded = v;
      auto& arr = std::get<gguf::Array>(padded.v);
      for (int64_t i = n_tok; i < n_vocab; ++i) arr.items.push_back(gguf::make_i32(5));  // UNUSED
      w.add_kv(key, std::move(padded));
    } else {
      w.add_kv(key, v);
    }
  }
}

// The tokenizer source when --tokenizer-from is not given: the shipped model, looked up
// relative to the working directory and to the strata binary (build dir inside the repo).
std::string default_tokenizer_source() {
  const std::string rel = "models/qwen3moe-code-Q8_0.gguf";
  std::vector<fs::path> cands = {fs::path(rel)};
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec)
    for (fs::path d = exe.parent_path(); !d.empty() && d != d.root_path(); d = d.parent_path())
      cands.push_back(d / rel);
  for (const auto& c : cands)
    if (fs::is_regular_file(c, ec)) return c.string();
  throw std::invalid_argument("cannot find " + rel + " for the tokenizer: give --tokenizer-from GGUF");
}

struct SynthFlags {
  std::string like, type = "Q8_0", expert_type, dense_type, out, tokenizer_from;
  int layers = 0, experts = 0, expert_used = 0;
  int64_t vocab = 0;
  uint64_t seed = 1;
  bool force = false, quiet = false, json = false;
};

void run_synth(const SynthFlags& f) {
  std::optional<SynthShape> shape;
  for (const auto& k : known_shapes())
    if (k.like == f.like) shape = k;
  if (!shape) throw std::invalid_argument(fmt::format("unknown --like '{}' (known: {})", f.like, known_names()));
  SynthShape s = *shape;
  model::ModelHParams& hp = s.hp;
  if (f.layers > 0) hp.n_layer = f.layers;
  if (f.experts > 0) hp.n_expert = f.experts;
  if (f.expert_used > 0) hp.n_expert_used = f.expert_used;
  if (f.vocab > 0) hp.n_vocab = int(f.vocab);
  if (hp.n_expert_used > hp.n_expert)
    throw std::invalid_argument(
        fmt::format("top-k {} exceeds the {} experts (use --expert-used)", hp.n_expert_used, hp.n_expert));
  const GgmlType type = parse_type(f.type);
  const GgmlType expert_type = f.expert_type.empty() ? type : parse_type(f.expert_type);
  const GgmlType dense_type = !f.dense_type.empty() ? parse_type(f.dense_type)
                              : (type == GgmlType::BF16 || type == GgmlType::F16 || type == GgmlType::F32)
                                  ? type
                                  : GgmlType::Q8_0;

  const gguf::File tok_src = gguf::File::open(f.tokenizer_from.empty() ? default_tokenizer_source() : f.tokenizer_from);

  if (fs::exists(f.out) && !f.force)
    throw std::invalid_argument(fmt::format("{} exists (use --force to overwrite)", f.out));

  const Plan plan = make_plan(s, expert_type, dense_type);
  gguf::Writer w;
  w.add_string("general.architecture", hp.arch);
  w.add_string("general.type", "model");
  const bool overridden = f.layers > 0 || f.experts > 0 || f.expert_used > 0;
  w.add_string("general.name", fmt::format("{}{} (strata synth, random weights)", s.name, overridden ? " shaped" : ""));
  model::write_hparams(w, hp, *model::find_architecture(hp.arch));
  for (const auto& [suffix, value] : s.extra_kv) w.add_kv(hp.arch + "." + suffix, value);
  w.add_u32("general.file_type", llama_file_type(expert_type));
  w.add_u32("general.quantization_version", 2);
  w.add_string("strata.synth.like", s.like);
  w.add_u64("strata.synth.seed", f.seed);
  add_tokenizer(w, tok_src, hp.n_vocab);

  std::map<GgmlType, BlockScales> scales;
  std::map<std::string, int> type_count;
  for (const PlannedTensor& t : plan.tensors) {
    if (!is_float_type(t.type) && !scales.count(t.type)) scales[t.type] = calibrate(t.type);
    type_count[ggml_type_name(t.type)]++;
    const UnitGen gen(t.type, t.kind, splitmix(f.seed) ^ hash_name(t.name),
                      is_float_type(t.type) ? BlockScales{} : scales.at(t.type));
    // Two threads fill each piece (the second half on a helper thread).
    w.add_tensor_streamed(t.name, t.type, t.ne, [gen](uint64_t off, uint8_t* dst, size_t n) {
      const size_t ub = gen.unit_bytes();
      const size_t half = n >= 4 * ub ? (n / 2) / ub * ub : 0;
      if (half == 0) {
        gen.fill(off, dst, n);
        return;
      }
      std::thread helper([&] { gen.fill(off + half, dst + half, n - half); });
      gen.fill(off, dst, half);
      helper.join();
    });
  }

  const uint64_t total = w.file_bytes();
  io::check_writable(f.out, "-o");  // read-only or missing folder: say so, not "0 B free"
  const fs::path dir = fs::absolute(fs::path(f.out)).parent_path();
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) == 0) {
    const uint64_t avail = uint64_t(vfs.f_bavail) * uint64_t(vfs.f_frsize);
    if (avail < total + (uint64_t(256) << 20))
      throw std::invalid_argument(fmt::format("{} needs {} but {} has {} free", f.out, human_bytes(double(total)),
                                              dir.string(), human_bytes(double(avail))));
  }
  std::string types;
  for (const auto& [k, v] : type_count) types += fmt::format(" {} x{}", k, v);
  if (!f.quiet)
    fmt::print(stderr,
               "strata synth: {} like {} ({} layers, {} experts top-{}, vocab {}), experts {}, dense {}: {} tensors "
               "({}), {} ({} of experts, {} per expert record)\n",
               f.out, s.like, hp.n_layer, hp.n_expert, hp.n_expert_used, hp.n_vocab, ggml_type_name(expert_type),
               ggml_type_name(dense_type), plan.tensors.size(), types.substr(1), human_bytes(double(total)),
               human_bytes(double(plan.expert_bytes)), human_bytes(double(plan.record_bytes)));

  ProgressBar bar("synth", f.quiet);
  gguf::WriteOptions wo;
  wo.chunk_bytes = size_t(16) << 20;
  wo.drop_cache = true;
  wo.progress = [&](uint64_t done, uint64_t all) { bar.update(done, all); };
  w.write(f.out, wo);
  const double secs = bar.finish();
  if (f.json)
    fmt::print("{}\n", nlohmann::json{{"file", f.out},
                                      {"like", s.like},
                                      {"bytes", total},
                                      {"expert_bytes", plan.expert_bytes},
                                      {"expert_record_bytes", plan.record_bytes},
                                      {"tensors", plan.tensors.size()},
                                      {"seconds", secs},
                                      {"gbps", secs > 0 ? double(total) / secs / 1e9 : 0.0}}
                           .dump());
}

}  // namespace

void register_synth(CLI::App& root) {
  auto f = std::make_shared<SynthFlags>();
  CLI::App* app = root.add_subcommand(
      "synth",
      "write a GGUF with the tensor names, shapes and types of a real MoE model and random weights (valid blocks), "
      "so that models larger than RAM can be run and measured");
  app->add_option("--like", f->like, "model to imitate: " + known_names())->required();
  app->add_option("--type", f->type,
                  "type of the routed experts (" + synth_type_list() +
                      "); dense weights get Q8_0 (BF16/F16/F32 when --type is one of those)")
      ->capture_default_str();
  app->add_option("--expert-type", f->expert_type, "override the experts' type (default: --type)");
  app->add_option("--dense-type", f->dense_type, "override the dense weights' type (norms and routers stay F32)");
  app->add_option("--layers", f->layers, "override the number of layers")->check(at_least(1));
  app->add_option("--experts", f->experts, "override the number of experts per layer")->check(at_least(1));
  app->add_option("--expert-used", f->expert_used, "override top-k (experts used per token)")->check(at_least(1));
  app->add_option("--vocab", f->vocab,
                  "rows of token_embd/output (default: the real model's, 151936 for the Qwen3 models). The "
                  "tokenizer is a real one copied from --tokenizer-from (8192 tokens for the shipped model), padded "
                  "with unused [PADn] tokens up to this size; --vocab 8192 matches it exactly")
      ->check(at_least(1));
  app->add_option("--tokenizer-from", f->tokenizer_from,
                  "GGUF whose tokenizer.* keys are copied (default: models/qwen3moe-code-Q8_0.gguf)")
      ->check(CLI::ExistingFile);
  app->add_option("-o,--output", f->out, "output GGUF (written to FILE.tmp, renamed when complete)")->required();
  app->add_option("-s,--seed", f->seed, "seed of the random weights")->capture_default_str();
  app->add_flag("--force", f->force, "overwrite an existing output file");
  app->add_flag("-q,--quiet", f->quiet, "no progress bar");
  app->add_flag("--json", f->json, "print a JSON summary (file, bytes, seconds, gbps) to stdout");
  app->callback([f] { run_synth(*f); });
}

}  // namespace strata::cli
