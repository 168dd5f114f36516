#pragma once
// Row decoders (block bytes -> fp32) shared by the SIMD families; included only by
// *_avx2.cpp / *_avx512.cpp. The byte work (nibbles, bit planes, table lookups) is done on
// 16 bytes at a time with SSE/SSSE3 operations; the family's emitter `E` widens 16 int8/uint8
// values to floats, scales them and stores them. Every value is computed with the same float
// operations, in the same order, as the scalar reference (dequant_ref.cpp), so the expanded
// weights are bit-identical to it (the tests check this on the gguf-py reference rows).
//
// The decoders produce the weights of a row strictly in order, 16 at a time, and hand them to a
// sink `o` (S::put(vector) of V::W floats, called in element order): either a store into a
// buffer, or FMAs straight into the (row, token) accumulators (simd_driver.h).
//
// Emitter interface (the next 16 weights w[i], i < 16, go to the sink):
//   E::i8(o, q, d)            w[i] = float(int8 q[i]) * d
//   E::u8_add(o, q, d, m)     w[i] = float(uint8 q[i]) * d + m     (product rounded first)
//   E::u8_sub(o, q, d, m)     w[i] = float(uint8 q[i]) * d - m
//   E::u8_signs(o, q, d, s)   w[i] = float(uint8 q[i]) * d, negated where bit i of s is set
//   E::half(h)                exact fp16 -> fp32 (F16C)
#include <cstdint>
#include <cstring>

#include "backend/cpu/kernels/act_q8.h"
#include "backend/cpu/kernels/kernels_impl.h"
#include "backend/cpu/kernels/simd_driver.h"
#include "backend/cpu/kernels/simd_intrin.h"
#include "quant/quant_tables.h"

namespace strata::cpu::kernels::detail::simd {
namespace {  // internal linkage: compiled once per instruction set

inline __m128i ld16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m128i lo_nib(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(0x0f)); }
inline __m128i hi_nib(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f)); }
/// (v >> s) & mask on every byte.
inline __m128i shr_and(__m128i v, int s, int mask) {
  return _mm_and_si128(_mm_srli_epi16(v, s), _mm_set1_epi8(static_cast<char>(mask)));  // immediate once unrolled
}
/// 16 bytes whose byte i is bit i of `bits` (as 0/1).
inline __m128i bits_to_bytes(uint32_t bits) {
  const __m128i sel = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  const __m128i b = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits)),
                                     _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b, sel), sel), _mm_set1_epi8(1));
}
inline __m128i table16(const int8_t* t) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(t)); }

/// The 32-weight block types (b32_format in act_q8.h: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL,
/// MXFP4), one decoder: the codes are the nibbles of qs (element j < 16 low, j >= 16 high) with
/// the fifth bit from qh where there is one, or qs's int8 values (Q8_0); then the reference's
/// value: q * d (Q8_0), d * values[q] (IQ4_NL, MXFP4), d * q + m (Q4_1, Q5_1), d * (q - offset)
/// (Q4_0, Q5_0). d is fp16, or the halved E8M0 byte (MXFP4).
template <GgmlType T, class E, class S>
void dec_b32(const uint8_t* b, S& out, int64_t n) {
  constexpr B32Format F = b32_format(T);
  static_assert(F.bytes != 0);
  S o = out;  // local copy: the sink's registers cannot alias x or the blocks
  [[maybe_unused]] const __m128i off = _mm_set1_epi8(static_cast<char>(F.offset));
  [[maybe_unused]] __m128i kv = _mm_setzero_si128();
  if constexpr (F.table) kv = table16(F.values);
  for (int64_t i = 0; i < n; i += 32, b += F.bytes) {
    float d;
    if constexpr (F.e8m0) {
      d = e8m0_half(b[0]);
    } else {
      d = E::half(load_u16(b));
    }
    if constexpr (F.qs + 32 == F.bytes) {  // Q8_0: 32 int8 codes
      E::i8(o, ld16(b + F.qs), d);
      E::i8(o, ld16(b + F.qs + 16), d);
    } else {
      const __m128i v = ld16(b + F.qs);
      __m128i lo = lo_nib(v), hi = hi_nib(v);
      if constexpr (F.qh >= 0) {
        const uint32_t qh = load_u32(b + F.qh);
        lo = _mm_or_si128(lo, _mm_slli_epi16(bits_to_bytes(qh & 0xffffu), 4));
        hi = _mm_or_si128(hi, _mm_slli_epi16(bits_to_bytes(qh >> 16), 4));
      }
      if constexpr (F.table) {
        E::i8(o, _mm_shuffle_epi8(kv, lo), d);
        E::i8(o, _mm_shuffle_epi8(kv, hi), d);
      } else if constexpr (F.min >= 0) {
        const float m = E::half(load_u16(b + F.min));
        E::u8_add(o, lo, d, m);
        E::u8_add(o, hi, d, m);
      } else {
        E::i8(o, _mm_sub_epi8(lo, off), d);
        E::i8(o, _mm_sub_epi8(hi, off), d);
      }
    }
  }
  out = o;
}

template <class E, class S>
void dec_q2_k(const uint8_t* b, S& out, int64_t n) {
  S o = out;  // local copy: the sink's registers cannot alias x or the blocks
  for (int64_t i = 0; i < n; i += 256, b += 84) {
    const float d = E::half(load_u16(b + 80)), dmin = E::half(load_u16(b + 82));
#pragma GCC unroll 16
    for (int g = 0; g < 16; ++g) {  // 16 elements per group: e = 16g.., h = g/8, s = (g/2)%4
      const float dl = d * static_cast<float>(b[g] & 0xf), ml = dmin * static_cast<float>(b[g] >> 4);
      const __m128i v = ld16(b + 16 + 32 * (g / 8) + 16 * (g % 2));
      E::u8_sub(o, shr_and(v, 2 * ((g / 2) % 4), 3), dl, ml);
    }
  }
  out = o;
}

template <class E, class S>
void dec_q3_k(const uint8_t* b, S& out, int64_t n) {
  S o = out;  // local copy: the sink's registers cannot alias x or the blocks
  const __m128i four = _mm_set1_epi8(4);
  for (int64_t i = 0; i < n; i += 256, b += 110) {
    const uint8_t* hm = b;
    const uint8_t* qs = b + 32;
    const uint8_t* sc = b + 96;
    const float d = E::half(load_u16(b + 108));
    const __m128i hm0 = ld16(hm), hm1 = ld16(hm + 16);
#pragma GCC unroll 16
    for (int g = 0; g < 16; ++g) {
      const float dl = d * static_cast<float>(q3k_scale(sc, g));
      const __m128i ql = shr_and(ld16(qs + 32 * (g / 8) + 16 * (g % 2)), 2 * ((g / 2) % 4), 3);
      const __m128i hb = shr_and(g % 2 ? hm1 : hm0, g / 2, 1);
      // q = ql - 4 + 4 * hbit
      E::i8(o, _mm_sub_epi8(_mm_or_si128(ql, _mm_slli_epi16(hb, 2)), four), dl);
    }
  }
  out = o;
}

template <class E, class S>
void dec_q4_k(const uint8_t* b, S& out, int64_t n) {
  S o = out;  // local copy: the sink's registers cannot alias x or the blocks
  for (int64_t i = 0; i < n; i += 256, b += 144) {
    const float d = E::half(load_u16(b)), dmin = E::half(load_u16(b + 2));
    const uint8_t* qs = b + 16;
#pragma GCC unroll 16
    for (int p = 0; p < 4; ++p) {  // pair of sub-blocks 2p (low nibbles), 2p+1 (high nibbles)
      const __m128i v0 = ld16(qs + 32 * p), v1 = ld16(qs + 32 * p + 16);
      int sc, m;
      k4_scale_min(b + 4, 2 * p, sc, m);
      float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
      E::u8_sub(o, lo_nib(v0), dl, ml);
      E::u8_sub(o, lo_nib(v1), dl, ml);
      k4_scale_min(b + 4, 2 * p + 1, sc, m);
      dl = d * static_cast<float>(sc);
      ml = dmin * static_cast<float>(m);
      E::u8_sub(o, hi_nib(v0), dl, ml);
      E::u8_sub(o, hi_nib(v1), dl, ml);
    }
  }
  out = o;
}

template <class E, class S>
void dec_q5_k(const uint8_t* b, S& out, int64_t n) {
  S o = out;  // local copy: the sink's registers cannot alias x or the blocks
  const __m128i sixteen = _mm_set1_epi8(16);
  for (int64_t i = 0; i < n; i += 256, b += 176) {
    const float d = E::half(load_u16(b)), dmin = E::half(load_u16(b + 2));
    const __m128i qh0 = ld16(b + 16), qh1 = ld16(b + 32);
    const uint8_t* qs = b + 48;
#pragma GCC unroll 16
    for (int g = 0; g < 8; ++g) {
      int sc, m;
      k4_scale_min(b + 4, g, sc, m);
      const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
      const __m128i v0 = ld16(qs + 32 * (g / 2)), v1 = ld16(qs + 32 * (g / 2) + 16);
      const __m128i l0 = g % 2 ? hi_nib(v0) : lo_nib(v0), l1 = g % 2 ? hi_nib(v1) : lo_nib(v1);
      // 5th bit: bit g of qh[j]; shifting the 0/1 byte plane left by 4 sets the value 16
      const __m128i h0 = _mm_and_si128(_mm_slli_epi16(shr_and(qh0, g, 1), 4), sixteen);
      const __m128i h1 = _mm_and_si128(_mm_slli_epi16(shr_and(qh1, g, 1), 4), sixteen);
      E::u8_sub(o, _mm_or_si128(l0, h0), dl, ml);
      E::u8_sub(o, _mm_or_si128(l1, h1), dl, ml);
    }
  }
  out = o;
}

template <class E, class S>
void dec_q6_k(const uint8_t* b, S& out, int64_t n) {
  S o = out;  // local copy: the sink's registers cannot alias x or the blocks
  const __m128i k32 = _mm_set1_epi8(32);
  for (int64_t i = 0; i < n; i += 256, b += 210) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = E::half(load_u16(b + 208));
#pragma GCC unroll 16
    for (int g = 0; g < 16; ++g) {  // e = 16g..: h = g/8, s = (g/2)%4, j0 = 16(g%2)
      const int h = g / 8, s = (g / 2) % 4, j0 = 16 * (g % 2);
      const __m128i lo = shr_and(ld16(ql + 64 * h + 32 * (s % 2) + j0), 4 * (s / 2), 0xf);
      const __m128i hi = shr_and(ld16(qh + 32 * h + j0), 2 * s, 3);
      const __m128i q = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), k32);
      E::i8(o, q, d * static_cast<float>(sc[g]));
    }
  }
  out = o;
}

template <class E, class S>
void dec_iq4_xs(const uint8_t* b, S& out, int64_t n) {
  S o = out;  // local copy: the sink's registers cannot alias x or the blocks
  const __m128i kv = table16(tables::kvalues_iq4nl);
  for (int64_t i = 0; i < n; i += 256, b += 136) {
    const float d = E::half(load_u16(b));
#pragma GCC unroll 16
    for (int g = 0; g < 8; ++g) {
      const float dl = d * static_cast<float>(iq4xs_scale(b, g));
      const __m128i v = ld16(b + 8 + 16 * g);
      E::i8(o, _mm_shuffle_epi8(kv, lo_nib(v)), dl);
      E::i8(o, _mm_shuffle_epi8(kv, hi_nib(v)), dl);
    }
  }
  out = o;
}

template <class E, class S>
void dec_iq2_xs(const uint8_t* b, S& out, int64_t n) {
  S o = out;  // local copy: the sink's registers cannot alias x or the blocks
  for (int64_t i = 0; i < n; i += 256, b += 74) {
    const float d = E::half(load_u16(b));
#pragma GCC unroll 16
    for (int k = 0; k < 32; k += 2) {  // 16 elements: grid entries k, k+1 share one scale nibble
      const uint16_t q0 = load_u16(b + 2 + 2 * k), q1 = load_u16(b + 4 + 2 * k);
      const int nib = (b[66 + k / 4] >> (4 * ((k / 2) % 2))) & 0xf;
      const float db = (d * (0.5f + static_cast<float>(nib))) * 0.25f;
      const __m128i g = _mm_set_epi64x(static_cast<long long>(tables::iq2xs_grid[q1 & 511]),
                                       static_cast<long long>(tables::iq2xs_grid[q0 & 511]));
      const uint32_t s = tables::ksigns_iq2xs[q0 >> 9] | (static_cast<uint32_t>(tables::ksigns_iq2xs[q1 >> 9]) << 8);
      E::u8_signs(o, g, db, s);
    }
  }
  out = o;
}

template <class E, class S>
void dec_iq3_s(const uint8_t* b, S& out, int64_t n) {
  S o = out;  // local copy: the sink's registers cannot alias x or the blocks
  for (int64_t i = 0; i < n; i += 256, b += 110) {
    const float d = E::half(load_u16(b));
    const uint8_t* qs = b + 2;
    const uint8_t* qh = b + 66;
    const uint8_t* sg = b + 74;
    const uint8_t* sc = b + 106;
#pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) {  // 16 elements = grid entries 4c .. 4c+3
      const int nib = (sc[c / 4] >> (4 * ((c / 2) % 2))) & 0xf;
      const float db = d * static_cast<float>(1 + 2 * nib);
      const uint32_t hb = qh[c / 2] >> (4 * (c % 2));
      const __m128i g = _mm_setr_epi32(static_cast<int>(tables::iq3s_grid[qs[4 * c] | ((hb & 1u) << 8)]),
                                       static_cast<int>(tables::iq3s_grid[qs[4 * c + 1] | ((hb & 2u) << 7)]),
                                       static_cast<int>(tables::iq3s_grid[qs[4 * c + 2] | ((hb & 4u) << 6)]),
                                       static_cast<int>(tables::iq3s_grid[qs[4 * c + 3] | ((hb & 8u) << 5)]));
      E::u8_signs(o, g, db, load_u16(sg + 2 * c));
    }
  }
  out = o;
}

/// The decoder of type t for emitter E, or nullptr. Plain types are handled by the family
/// driver (simd_driver.h).
template <class E, class S>
SinkFn<S> block_decoder(GgmlType t) {
  switch (t) {
    case GgmlType::Q8_0: return dec_b32<GgmlType::Q8_0, E, S>;
    case GgmlType::Q4_0: return dec_b32<GgmlType::Q4_0, E, S>;
    case GgmlType::Q4_1: return dec_b32<GgmlType::Q4_1, E, S>;
    case GgmlType::Q5_0: return dec_b32<GgmlType::Q5_0, E, S>;
    case GgmlType::Q5_1: return dec_b32<GgmlType::Q5_1, E, S>;
    case GgmlType::Q2_K: return dec_q2_k<E, S>;
    case GgmlType::Q3_K: return dec_q3_k<E, S>;
    case GgmlType::Q4_K: return dec_q4_k<E, S>;
    case GgmlType::Q5_K: return dec_q5_k<E, S>;
    case GgmlType::Q6_K: return dec_q6_k<E, S>;
    case GgmlType::IQ2_XS: return dec_iq2_xs<E, S>;
    case GgmlType::IQ3_S: return dec_iq3_s<E, S>;
    case GgmlType::IQ4_XS: return dec_iq4_xs<E, S>;
    case GgmlType::IQ4_NL: return dec_b32<GgmlType::IQ4_NL, E, S>;
    case GgmlType::MXFP4: return dec_b32<GgmlType::MXFP4, E, S>;
    default: return nullptr;
  }
}

}  // namespace
}  // namespace strata::cpu::kernels::detail::simd
