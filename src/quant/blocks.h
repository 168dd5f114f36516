#pragma once
// The block layouts of the quantized ggml types (ggml/src/ggml-common.h), one packed struct per
// type, field by field as the bytes lie in a GGUF file. Scales stored as IEEE half are kept as
// their raw uint16_t bits (quant::fp16_to_fp32 converts them). The reference dequantization
// (dequant_ref.cpp) reads blocks through these structs; the SIMD kernels use the same offsets
// (quant_impl.h geometry, B32Format) and the sizes below are what those assume.
//
// Element numbering inside a block, and what each field means, is spelled out per type in
// dequant_ref.cpp next to its dequantizer.
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace strata::quant::blocks {

#pragma pack(push, 1)

/// Q8_0 (32 weights): value = qs[j] * d.
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[32];
};
/// Q4_0 (32 weights): nibbles, value = d * (q - 8).
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[16];
};
/// Q4_1 (32 weights): nibbles, value = d * q + m.
struct BlockQ4_1 {
  uint16_t d, m;
  uint8_t qs[16];
};
/// Q5_0 (32 weights): nibbles plus a fifth bit per weight in qh, value = d * (q - 16).
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[16];
};
/// Q5_1 (32 weights): as Q5_0 with a min, value = d * q + m.
struct BlockQ5_1 {
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[16];
};
/// Q2_K (256 weights): 2-bit codes, a 4-bit scale and min per 16 weights.
struct BlockQ2_K {
  uint8_t scales[16];
  uint8_t qs[64];
  uint16_t d, dmin;
};
/// Q3_K (256 weights): 2 low bits in qs, the third in hmask, 16 six-bit scales packed in 12 bytes.
struct BlockQ3_K {
  uint8_t hmask[32];
  uint8_t qs[64];
  uint8_t scales[12];
  uint16_t d;
};
/// Q4_K (256 weights): nibbles, 8 six-bit scale/min pairs packed in 12 bytes.
struct BlockQ4_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
/// Q5_K (256 weights): as Q4_K plus a fifth bit plane.
struct BlockQ5_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
/// Q6_K (256 weights): 4 low bits in ql, 2 high bits in qh, an int8 scale per 16 weights.
struct BlockQ6_K {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
/// IQ2_XS (256 weights): per 8 weights a 9-bit iq2xs_grid index and a 7-bit ksigns index; a
/// 4-bit scale per 16 weights.
struct BlockIQ2_XS {
  uint16_t d;
  uint16_t qs[32];
  uint8_t scales[8];
};
/// IQ3_S (256 weights): per 4 weights an iq3s_grid index (8 bits in qs, the 9th in qh), explicit
/// sign bits, a 4-bit scale per 32 weights.
struct BlockIQ3_S {
  uint16_t d;
  uint8_t qs[64];
  uint8_t qh[8];
  uint8_t signs[32];
  uint8_t scales[4];
};
/// IQ4_XS (256 weights): nibbles indexing kvalues_iq4nl, a six-bit scale per 32 weights (low 4
/// bits in scales_l, high 2 in scales_h).
struct BlockIQ4_XS {
  uint16_t d;
  uint16_t scales_h;
  uint8_t scales_l[4];
  uint8_t qs[128];
};
/// IQ4_NL (32 weights): Q4_0's layout, nibbles indexing kvalues_iq4nl.
struct BlockIQ4_NL {
  uint16_t d;
  uint8_t qs[16];
};
/// MXFP4 (32 weights): an E8M0 scale byte, nibbles indexing kvalues_fp4 (E2M1 doubled).
struct BlockMXFP4 {
  uint8_t e;
  uint8_t qs[16];
};

#pragma pack(pop)

static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ2_K) == 84);
static_assert(sizeof(BlockQ3_K) == 110);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);
static_assert(sizeof(BlockIQ2_XS) == 74);
static_assert(sizeof(BlockIQ3_S) == 110);
static_assert(sizeof(BlockIQ4_XS) == 136);
static_assert(sizeof(BlockIQ4_NL) == 18);
static_assert(sizeof(BlockMXFP4) == 17);
// the field offsets the SIMD kernels hard-code (backend/cpu/kernels)
static_assert(offsetof(BlockQ5_0, qs) == 6 && offsetof(BlockQ5_1, qh) == 4 && offsetof(BlockQ5_1, qs) == 8);
static_assert(offsetof(BlockQ2_K, qs) == 16 && offsetof(BlockQ2_K, d) == 80 && offsetof(BlockQ2_K, dmin) == 82);
static_assert(offsetof(BlockQ3_K, qs) == 32 && offsetof(BlockQ3_K, scales) == 96 && offsetof(BlockQ3_K, d) == 108);
static_assert(offsetof(BlockQ4_K, scales) == 4 && offsetof(BlockQ4_K, qs) == 16);
static_assert(offsetof(BlockQ5_K, qh) == 16 && offsetof(BlockQ5_K, qs) == 48);
static_assert(offsetof(BlockQ6_K, qh) == 128 && offsetof(BlockQ6_K, scales) == 192 && offsetof(BlockQ6_K, d) == 208);
static_assert(offsetof(BlockIQ2_XS, scales) == 66);
static_assert(offsetof(BlockIQ3_S, qh) == 66 && offsetof(BlockIQ3_S, signs) == 74 &&
              offsetof(BlockIQ3_S, scales) == 106);
static_assert(offsetof(BlockIQ4_XS, scales_l) == 4 && offsetof(BlockIQ4_XS, qs) == 8);

/// Block i of a row of blocks at `row`, copied out (well-defined for any alignment of the bytes).
template <class B>
inline B load_block(const uint8_t* row, int64_t i) {
  B b;
  std::memcpy(&b, row + static_cast<size_t>(i) * sizeof(B), sizeof(B));
  return b;
}

}  // namespace strata::quant::blocks
