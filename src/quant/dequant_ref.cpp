// Scalar reference dequantization, bit-exact with gguf-py (gguf/quants.py), which computes in
// float32 numpy: every product below is one float32 multiply in the same order as there, so
// the results match bit for bit (no FMA: this file is compiled for baseline x86-64).
// Block layouts: ggml/src/ggml-common.h, as the structs of quant/blocks.h.
#include <stdexcept>
#include <string>

#include "quant/blocks.h"
#include "quant/quant.h"
#include "quant/quant_impl.h"
#include "quant/quant_tables.h"

namespace strata::quant {

namespace {

using detail::bits_f32;
using detail::half_to_float;
using detail::k4_scale_min;
using detail::load_u16;
using detail::load_u32;
using detail::q3k_scale;
using namespace blocks;

// Each dequantizer reads block i of the row as its struct (quant/blocks.h: the fields, in file
// order) and writes its 32 or 256 values.

// Q8_0: value = q * d
void deq_q8_0(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const auto blk = load_block<BlockQ8_0>(b, i);
    const float d = half_to_float(blk.d);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(blk.qs[j]) * d;
  }
}

// Q4_0: element j < 16: low nibble of qs[j], j >= 16: high nibble of qs[j-16]; value = d * (q - 8)
void deq_q4_0(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const auto blk = load_block<BlockQ4_0>(b, i);
    const float d = half_to_float(blk.d);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>((blk.qs[j] & 0xf) - 8);
      y[j + 16] = d * static_cast<float>((blk.qs[j] >> 4) - 8);
    }
  }
}

// Q4_1: Q4_0's nibbles; value = (d * q) + m
void deq_q4_1(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const auto blk = load_block<BlockQ4_1>(b, i);
    const float d = half_to_float(blk.d), m = half_to_float(blk.m);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>(blk.qs[j] & 0xf) + m;
      y[j + 16] = d * static_cast<float>(blk.qs[j] >> 4) + m;
    }
  }
}

// Q5_0: 5th bit of element j is bit j of qh (little-endian uint32); value = d * (q - 16)
void deq_q5_0(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const auto blk = load_block<BlockQ5_0>(b, i);
    const float d = half_to_float(blk.d);
    const uint32_t qh = load_u32(blk.qh);
    for (int j = 0; j < 16; ++j) {
      const int lo = (blk.qs[j] & 0xf) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (blk.qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      y[j] = d * static_cast<float>(lo - 16);
      y[j + 16] = d * static_cast<float>(hi - 16);
    }
  }
}

// Q5_1: Q5_0's codes; value = (d * q) + m
void deq_q5_1(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const auto blk = load_block<BlockQ5_1>(b, i);
    const float d = half_to_float(blk.d), m = half_to_float(blk.m);
    const uint32_t qh = load_u32(blk.qh);
    for (int j = 0; j < 16; ++j) {
      const int lo = (blk.qs[j] & 0xf) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (blk.qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      y[j] = d * static_cast<float>(lo) + m;
      y[j + 16] = d * static_cast<float>(hi) + m;
    }
  }
}

// Q2_K (256): element e = 128h + 32s + j (h < 2, s < 4, j < 32) is bits 2s..2s+1 of
// qs[32h + j]; group g = e / 16 has scale scales[g] & 15 and min scales[g] >> 4;
// value = (d * sc) * q - (dmin * m)
void deq_q2_k(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 256) {
    const auto blk = load_block<BlockQ2_K>(b, i);
    const float d = half_to_float(blk.d), dmin = half_to_float(blk.dmin);
    for (int e = 0; e < 256; ++e) {
      const int h = e / 128, s = (e / 32) % 4, j = e % 32, g = e / 16;
      const float dl = d * static_cast<float>(blk.scales[g] & 0xf), ml = dmin * static_cast<float>(blk.scales[g] >> 4);
      const int q = (blk.qs[32 * h + j] >> (2 * s)) & 3;
      y[e] = dl * static_cast<float>(q) - ml;
    }
  }
}

// Q3_K (256): element e = 128h + 32s + j: low 2 bits from qs[32h + j] >> 2s, high bit (e / 32)
// of hmask[j] (a set bit means no -4 offset); 16 six-bit scales (minus 32), one per 16 elements:
// low 4 bits from scales[g % 8] >> 4*(g / 8), high 2 bits from scales[8 + g % 4] >> 2*(g / 4).
// value = (d * sc) * q
void deq_q3_k(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 256) {
    const auto blk = load_block<BlockQ3_K>(b, i);
    const float d = half_to_float(blk.d);
    float dl[16];
    for (int g = 0; g < 16; ++g) {
      dl[g] = d * static_cast<float>(q3k_scale(blk.scales, g));
    }
    for (int e = 0; e < 256; ++e) {
      const int h = e / 128, s = (e / 32) % 4, j = e % 32;
      const int ql = (blk.qs[32 * h + j] >> (2 * s)) & 3;
      const int hbit = (blk.hmask[j] >> (e / 32)) & 1;
      y[e] = dl[e / 16] * static_cast<float>(ql - (hbit ? 0 : 4));
    }
  }
}

// Q4_K (256): sub-block g (32 elements) is the low (g even) or high (g odd) nibbles of
// qs[32*(g/2) .. +32]; scale and min: k4_scale_min; value = (d*sc) * q - (dmin*m)
void deq_q4_k(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 256) {
    const auto blk = load_block<BlockQ4_K>(b, i);
    const float d = half_to_float(blk.d), dmin = half_to_float(blk.dmin);
    for (int g = 0; g < 8; ++g) {
      int sc, m;
      k4_scale_min(blk.scales, g, sc, m);
      const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
      for (int j = 0; j < 32; ++j) {
        const int q = (blk.qs[32 * (g / 2) + j] >> (4 * (g % 2))) & 0xf;
        y[32 * g + j] = dl * static_cast<float>(q) - ml;
      }
    }
  }
}

// Q5_K (256): as Q4_K plus a 5th bit: bit g of qh[j] for element 32g + j.
void deq_q5_k(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 256) {
    const auto blk = load_block<BlockQ5_K>(b, i);
    const float d = half_to_float(blk.d), dmin = half_to_float(blk.dmin);
    for (int g = 0; g < 8; ++g) {
      int sc, m;
      k4_scale_min(blk.scales, g, sc, m);
      const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
      for (int j = 0; j < 32; ++j) {
        const int q = ((blk.qs[32 * (g / 2) + j] >> (4 * (g % 2))) & 0xf) | (((blk.qh[j] >> g) & 1) << 4);
        y[32 * g + j] = dl * static_cast<float>(q) - ml;
      }
    }
  }
}

// Q6_K (256): element e = 128h + 32s + j: low nibble of ql[64h + 32(s%2) + j] (s < 2) or high
// nibble (s >= 2), top 2 bits from qh[32h + j] >> 2s; value = (d * sc[e/16]) * (q - 32)
void deq_q6_k(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 256) {
    const auto blk = load_block<BlockQ6_K>(b, i);
    const float d = half_to_float(blk.d);
    for (int e = 0; e < 256; ++e) {
      const int h = e / 128, s = (e / 32) % 4, j = e % 32;
      const int lo = (blk.ql[64 * h + 32 * (s % 2) + j] >> (4 * (s / 2))) & 0xf;
      const int hi = (blk.qh[32 * h + j] >> (2 * s)) & 3;
      y[e] = (d * static_cast<float>(blk.scales[e / 16])) * static_cast<float>((lo | (hi << 4)) - 32);
    }
  }
}

// IQ4_NL: Q4_0 layout, nibbles index kvalues_iq4nl; value = d * kv
void deq_iq4_nl(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const auto blk = load_block<BlockIQ4_NL>(b, i);
    const float d = half_to_float(blk.d);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>(tables::kvalues_iq4nl[blk.qs[j] & 0xf]);
      y[j + 16] = d * static_cast<float>(tables::kvalues_iq4nl[blk.qs[j] >> 4]);
    }
  }
}

// IQ4_XS (256): sub-block g of 32: six-bit scale (minus 32) = nibble g of scales_l | bits
// 2g..2g+1 of scales_h << 4; elements: low nibbles then high nibbles of qs[16g .. +16];
// value = (d * sc) * kvalues_iq4nl[q]
void deq_iq4_xs(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 256) {
    const auto blk = load_block<BlockIQ4_XS>(b, i);
    const float d = half_to_float(blk.d);
    for (int g = 0; g < 8; ++g) {
      const int sc = (((blk.scales_l[g / 2] >> (4 * (g % 2))) & 0xf) | (((blk.scales_h >> (2 * g)) & 3) << 4)) - 32;
      const float dl = d * static_cast<float>(sc);
      for (int j = 0; j < 16; ++j) {
        y[32 * g + j] = dl * static_cast<float>(tables::kvalues_iq4nl[blk.qs[16 * g + j] & 0xf]);
        y[32 * g + j + 16] = dl * static_cast<float>(tables::kvalues_iq4nl[blk.qs[16 * g + j] >> 4]);
      }
    }
  }
}

// IQ2_XS (256): qs[k] covers elements 8k..8k+7: bits 0-8 index iq2xs_grid (8 magnitudes, one
// per byte), bits 9-15 index ksigns_iq2xs (bit l set: element l negative); scale nibble k/2
// (one per 16 elements): db = (d * (0.5 + nibble)) * 0.25, value = (db * grid) * sign
void deq_iq2_xs(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 256) {
    const auto blk = load_block<BlockIQ2_XS>(b, i);
    const float d = half_to_float(blk.d);
    for (int k = 0; k < 32; ++k) {
      const uint16_t q = blk.qs[k];
      const int nib = (blk.scales[k / 4] >> (4 * ((k / 2) % 2))) & 0xf;
      const float db = (d * (0.5f + static_cast<float>(nib))) * 0.25f;
      const uint64_t g = tables::iq2xs_grid[q & 511];
      const uint8_t sg = tables::ksigns_iq2xs[q >> 9];
      for (int l = 0; l < 8; ++l) {
        const float v = db * static_cast<float>((g >> (8 * l)) & 0xff);
        y[8 * k + l] = (sg >> l) & 1 ? -v : v;
      }
    }
  }
}

// IQ3_S (256): qs[k] | (bit k%8 of qh[k/8]) << 8 indexes iq3s_grid (4 magnitudes) for elements
// 4k..4k+3; bit l of signs[m] negates element 8m + l; scale nibble e/32: db = d * (1 + 2*nibble),
// value = (db * grid) * sign
void deq_iq3_s(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 256) {
    const auto blk = load_block<BlockIQ3_S>(b, i);
    const float d = half_to_float(blk.d);
    for (int k = 0; k < 64; ++k) {
      const int e0 = 4 * k;
      const int nib = (blk.scales[e0 / 64] >> (4 * ((e0 / 32) % 2))) & 0xf;
      const float db = d * static_cast<float>(1 + 2 * nib);
      const uint32_t g = tables::iq3s_grid[blk.qs[k] | (((blk.qh[k / 8] >> (k % 8)) & 1) << 8)];
      for (int l = 0; l < 4; ++l) {
        const int e = e0 + l;
        const float v = db * static_cast<float>((g >> (8 * l)) & 0xff);
        y[e] = (blk.signs[e / 8] >> (e % 8)) & 1 ? -v : v;
      }
    }
  }
}

// MXFP4: Q4_0 nibble layout; kvalues_fp4 are the E2M1 values doubled, hence the halved scale
// (e8m0_half); value = d * kv
void deq_mxfp4(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const auto blk = load_block<BlockMXFP4>(b, i);
    const float d = detail::e8m0_half(blk.e);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>(tables::kvalues_fp4[blk.qs[j] & 0xf]);
      y[j + 16] = d * static_cast<float>(tables::kvalues_fp4[blk.qs[j] >> 4]);
    }
  }
}

}  // namespace

void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n) {
  const detail::Geometry g = detail::geometry(t);
  if (!detail::implemented(t))
    throw std::runtime_error("quant::dequantize_row: unsupported type " + std::string(detail::type_name(t)));
  if (n < 0 || n % g.elems != 0)
    throw std::runtime_error("quant::dequantize_row: n=" + std::to_string(n) + " is not a multiple of the " +
                             std::to_string(g.elems) + "-element block of " + std::string(detail::type_name(t)));
  const auto* s = static_cast<const uint8_t*>(src);
  const int64_t nb = n / g.elems;
  switch (t) {
    case GgmlType::F32: std::memcpy(dst, s, static_cast<size_t>(n) * 4); return;
    case GgmlType::F16:
      for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(detail::load_u16(s + 2 * i));
      return;
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = detail::bf16_to_float(detail::load_u16(s + 2 * i));
      return;
    case GgmlType::Q8_0: deq_q8_0(s, dst, nb); return;
    case GgmlType::Q4_0: deq_q4_0(s, dst, nb); return;
    case GgmlType::Q4_1: deq_q4_1(s, dst, nb); return;
    case GgmlType::Q5_0: deq_q5_0(s, dst, nb); return;
    case GgmlType::Q5_1: deq_q5_1(s, dst, nb); return;
    case GgmlType::Q2_K: deq_q2_k(s, dst, nb); return;
    case GgmlType::Q3_K: deq_q3_k(s, dst, nb); return;
    case GgmlType::Q4_K: deq_q4_k(s, dst, nb); return;
    case GgmlType::Q5_K: deq_q5_k(s, dst, nb); return;
    case GgmlType::Q6_K: deq_q6_k(s, dst, nb); return;
    case GgmlType::IQ2_XS: deq_iq2_xs(s, dst, nb); return;
    case GgmlType::IQ3_S: deq_iq3_s(s, dst, nb); return;
    case GgmlType::IQ4_XS: deq_iq4_xs(s, dst, nb); return;
    case GgmlType::IQ4_NL: deq_iq4_nl(s, dst, nb); return;
    case GgmlType::MXFP4: deq_mxfp4(s, dst, nb); return;
    default: break;
  }
  throw std::runtime_error("quant::dequantize_row: no reference dequantizer for " + std::string(detail::type_name(t)));
}

}  // namespace strata::quant
