#pragma once
// Internal to src/quant and the CPU kernels (src/backend/cpu/kernels): block geometry and inline
// scalar conversions and scale unpacking. Not part of the public API (include quant/quant.h).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "gguf/ggml_types.h"
#include "quant/blocks.h"

// The helpers below are `static`: this header is included by translation units compiled with
// different -m flags, and an inline function with external linkage could be resolved to the
// AVX-512 copy from a baseline caller (ODR merge), which would fault on older CPUs.

namespace strata::quant::detail {

/// Block geometry of the formats this module implements: `elems` weights in `bytes` bytes.
/// Plain types (F32/F16/BF16) report a block of one element. {0, 0} for unsupported types.
struct Geometry {
  int elems;
  int bytes;
};
/// Hard-coded here (not taken from gguf/) on purpose: the kernels depend on these exact layouts
/// (the structs of quant/blocks.h, whose sizes are static_asserted there).
static constexpr Geometry geometry(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return {1, 4};
    case GgmlType::F16: return {1, 2};
    case GgmlType::BF16: return {1, 2};
    case GgmlType::Q8_0: return {32, int{sizeof(blocks::BlockQ8_0)}};
    case GgmlType::Q4_0: return {32, int{sizeof(blocks::BlockQ4_0)}};
    case GgmlType::Q4_1: return {32, int{sizeof(blocks::BlockQ4_1)}};
    case GgmlType::Q5_0: return {32, int{sizeof(blocks::BlockQ5_0)}};
    case GgmlType::Q5_1: return {32, int{sizeof(blocks::BlockQ5_1)}};
    case GgmlType::Q2_K: return {256, int{sizeof(blocks::BlockQ2_K)}};
    case GgmlType::Q3_K: return {256, int{sizeof(blocks::BlockQ3_K)}};
    case GgmlType::Q4_K: return {256, int{sizeof(blocks::BlockQ4_K)}};
    case GgmlType::Q5_K: return {256, int{sizeof(blocks::BlockQ5_K)}};
    case GgmlType::Q6_K: return {256, int{sizeof(blocks::BlockQ6_K)}};
    case GgmlType::IQ2_XS: return {256, int{sizeof(blocks::BlockIQ2_XS)}};
    case GgmlType::IQ3_S: return {256, int{sizeof(blocks::BlockIQ3_S)}};
    case GgmlType::IQ4_XS: return {256, int{sizeof(blocks::BlockIQ4_XS)}};
    case GgmlType::IQ4_NL: return {32, int{sizeof(blocks::BlockIQ4_NL)}};
    case GgmlType::MXFP4: return {32, int{sizeof(blocks::BlockMXFP4)}};
    default: return {0, 0};
  }
}

/// Types with a reference dequantizer and kernels in this build (is_supported()).
static constexpr bool implemented(GgmlType t) {
  switch (t) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
    case GgmlType::Q8_0:
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
    case GgmlType::IQ2_XS:
    case GgmlType::IQ3_S:
    case GgmlType::IQ4_XS:
    case GgmlType::IQ4_NL:
    case GgmlType::MXFP4: return true;
    default: return false;
  }
}

/// Name of a type as llama.cpp prints it ("Q8_0"); "type#<id>" for others. Local so that this
/// module does not depend on src/gguf's implementation.
const char* type_name(GgmlType t);

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// E8M0 scale halved (OCP Microscaling Formats spec v1.0: 2^(e-127); halved as ggml's
/// e8m0_to_fp32_half, because its kvalues_fp4 are the E2M1 values doubled): 2^(e-128) exactly,
/// subnormal for e < 2.
static inline float e8m0_half(uint8_t e) {
  return bits_f32(e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23));
}

/// IEEE binary16 -> binary32, exact (subnormals, infinities and NaN payloads included).
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24, exact in fp32
    const float v = static_cast<float>(mant) * 0x1p-24f;
    return bits_f32(f32_bits(v) | sign);
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

/// bfloat16 -> binary32, exact.
static inline float bf16_to_float(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

static inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
static inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

/// Scale and min of sub-block g (0..7) of a Q4_K/Q5_K block: 8 six-bit pairs packed in the
/// 12 bytes at `s` (ggml get_scale_min_k4).
static inline void k4_scale_min(const uint8_t* s, int g, int& sc, int& m) {
  if (g < 4) {
    sc = s[g] & 63;
    m = s[g + 4] & 63;
  } else {
    sc = (s[g + 4] & 0xf) | ((s[g - 4] >> 6) << 4);
    m = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
  }
}

/// All 8 scales and mins of a Q4_K/Q5_K block (k4_scale_min for g = 0..7), byte g of sc and m,
/// unpacked with 32-bit masks: bytes 0-3 come from s[0..7] & 63, bytes 4-7 combine s[8..11]
/// with the top two bits of s[0..7].
static inline void k4_scales_packed(const uint8_t* s, uint64_t& sc, uint64_t& m) {
  const uint32_t a = load_u32(s), b = load_u32(s + 4), c = load_u32(s + 8);
  const uint32_t sc_hi = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
  const uint32_t m_hi = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
  sc = (a & 0x3f3f3f3fu) | (static_cast<uint64_t>(sc_hi) << 32);
  m = (b & 0x3f3f3f3fu) | (static_cast<uint64_t>(m_hi) << 32);
}

/// Six-bit scale, minus 32, of 16-weight group g (0..15) of a Q3_K block: low 4 bits from
/// scales[g % 8] >> 4*(g / 8), high 2 bits from scales[8 + g % 4] >> 2*(g / 4) (`sc`: the 12
/// scale bytes; ggml dequantize_row_q3_K).
static inline int q3k_scale(const uint8_t* sc, int g) {
  return (((sc[g % 8] >> (4 * (g / 8))) & 0xf) | (((sc[8 + g % 4] >> (2 * (g / 4))) & 3) << 4)) - 32;
}

/// Six-bit scale, minus 32, of 32-weight sub-block g (0..7) of an IQ4_XS block at `b`: nibble g
/// of scales_l (bytes 4..7) | bits 2g..2g+1 of scales_h (bytes 2..3) << 4.
static inline int iq4xs_scale(const uint8_t* b, int g) {
  const int sh = b[2] | (b[3] << 8);
  return (((b[4 + g / 2] >> (4 * (g % 2))) & 0xf) | (((sh >> (2 * g)) & 3) << 4)) - 32;
}

}  // namespace strata::quant::detail
