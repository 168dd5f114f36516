// AVX-512 family: row decoders (block -> fp32, values bit-identical to the scalar reference)
// and the drivers of simd_driver.h with 16-lane vectors (2 accumulators = 32 lanes per
// (row, token) pair; panel micro-kernel 3 rows x 4 tokens; fused path up to 4 tokens).
#include "backend/cpu/kernels/simd_intrin.h"
//
#include "backend/cpu/kernels/act_q8.h"
#include "backend/cpu/kernels/simd_decoders.h"
#include "backend/cpu/kernels/simd_driver.h"

namespace strata::cpu::kernels::detail {

namespace {

struct V512 {
  using vec = __m512;
  static constexpr int W = 16, RB = 3, TB = 4, FUSED_MAX = 4;
  static vec zero() { return _mm512_setzero_ps(); }
  static vec loadu(const float* p) { return _mm512_loadu_ps(p); }
  static vec loadu_n(const float* p, int n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p); }
  static void store(float* p, vec v) { _mm512_store_ps(p, v); }
  static void storeu(float* p, vec v) { _mm512_storeu_ps(p, v); }
  static vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
  static float hsum(vec v) { return simd_hsum16(v); }
  static vec load_f16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static vec load_bf16(const uint8_t* p) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
};

// Keeps the compiler from contracting a multiply into a following add (-ffp-contract=fast is
// GCC's default): the reference rounds the product first.
inline __m512 opaque(__m512 v) {
  __asm__("" : "+v"(v));
  return v;
}

/// Emitter of simd_decoders.h: 16 weights per call, one zmm, handed to the sink.
struct E512 {
  static float half(uint16_t h) { return _cvtsh_ss(h); }
  static __m512 u8(__m128i q, float d) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), _mm512_set1_ps(d));
  }
  template <class S>
  static void i8(S& o, __m128i q, float d) {
    o.put(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(d)));
  }
  template <class S>
  static void u8_add(S& o, __m128i q, float d, float m) {
    o.put(_mm512_add_ps(opaque(u8(q, d)), _mm512_set1_ps(m)));
  }
  template <class S>
  static void u8_sub(S& o, __m128i q, float d, float m) {
    o.put(_mm512_sub_ps(opaque(u8(q, d)), _mm512_set1_ps(m)));
  }
  template <class S>
  static void u8_signs(S& o, __m128i q, float d, uint32_t s) {
    const __m512 v = u8(q, d);
    o.put(_mm512_mask_xor_ps(v, static_cast<__mmask16>(s), v, _mm512_set1_ps(-0.0f)));
  }
};

// ---- table decoders (AVX-512 only) ----
// 4- and 5-bit formats have at most 32 distinct values per (sub-)block: build that table of
// floats once per (sub-)block with exactly the reference's operations (so every entry is
// bit-identical to what dequant_ref.cpp computes for that code), then expand 16 codes with one
// vpermps (16 entries) or vpermt2ps (32 entries). This moves the per-weight work from the FMA
// port (convert, multiply, subtract) to the shuffle port.

inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline __m512 i8_table(const int8_t* t) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(simd::table16(t))); }
/// 16 codes (bytes) widened to dword indices; vpermps only looks at bits 3:0.
inline __m512i idx16(__m128i bytes) { return _mm512_cvtepu8_epi32(bytes); }
inline __m512i hi4(__m512i idx) { return _mm512_srli_epi32(idx, 4); }

/// 5-bit codes: low nibble from idx (bits 3:0), 5th bit from `h` (bit i for lane i) into bit 4.
inline __m512i idx5(__m512i nib_idx, __mmask16 h) {
  const __m512i lo = _mm512_and_si512(nib_idx, _mm512_set1_epi32(15));
  return _mm512_mask_or_epi32(lo, h, lo, _mm512_set1_epi32(16));
}

/// The 32-weight block types with at most 32 values per block (b32_format: Q4_0, Q4_1, Q5_0,
/// Q5_1, IQ4_NL, MXFP4). The table of a block: entry u = base[u] * d (+ m with a min: the product
/// rounded first), base[u] = values[u] (IQ4_NL, MXFP4) or u - offset (u < 16 in tl, u + 16 in th
/// for the 5-bit types), all exact; 16 codes are expanded with one vpermps (4 bits) or
/// vpermt2ps (5 bits).
template <GgmlType T, class S>
void lut_b32(const uint8_t* b, S& out, int64_t n) {
  constexpr B32Format F = b32_format(T);
  constexpr bool kFive = F.qh >= 0;
  static_assert(F.bytes != 0 && F.qs + 32 != F.bytes, "not a 4/5-bit type");
  S o = out;
  const __m512 off = _mm512_set1_ps(F.min >= 0 ? 0.f : static_cast<float>(F.offset));
  __m512 lo_base, hi_base = _mm512_sub_ps(_mm512_add_ps(iota16(), _mm512_set1_ps(16.f)), off);
  if constexpr (F.table) {
    lo_base = i8_table(F.values);
  } else {
    lo_base = _mm512_sub_ps(iota16(), off);
  }
  for (int64_t i = 0; i < n; i += 32, b += F.bytes) {
    float d;
    if constexpr (F.e8m0) {
      d = e8m0_half(b[0]);
    } else {
      d = _cvtsh_ss(load_u16(b));
    }
    const __m512 dv = _mm512_set1_ps(d);
    __m512 tl, th = _mm512_setzero_ps();
    if constexpr (F.min >= 0) {
      const __m512 mv = _mm512_set1_ps(_cvtsh_ss(load_u16(b + F.min)));
      tl = _mm512_add_ps(opaque(_mm512_mul_ps(lo_base, dv)), mv);
      if constexpr (kFive) th = _mm512_add_ps(opaque(_mm512_mul_ps(hi_base, dv)), mv);
    } else {
      tl = _mm512_mul_ps(lo_base, dv);
      if constexpr (kFive) th = _mm512_mul_ps(hi_base, dv);
    }
    const __m512i q = idx16(simd::ld16(b + F.qs));
    if constexpr (kFive) {
      const uint32_t qh = load_u32(b + F.qh);
      o.put(_mm512_permutex2var_ps(tl, idx5(q, static_cast<__mmask16>(qh)), th));
      o.put(_mm512_permutex2var_ps(tl, idx5(hi4(q), static_cast<__mmask16>(qh >> 16)), th));
    } else {
      o.put(_mm512_permutexvar_ps(q, tl));
      o.put(_mm512_permutexvar_ps(hi4(q), tl));
    }
  }
  out = o;
}

template <class S>
void lut_iq4_xs(const uint8_t* b, S& out, int64_t n) {
  S o = out;
  const __m512 kv = i8_table(tables::kvalues_iq4nl);
  for (int64_t i = 0; i < n; i += 256, b += 136) {
    const float d = _cvtsh_ss(load_u16(b));
#pragma GCC unroll 16
    for (int g = 0; g < 8; ++g) {
      const __m512 t = _mm512_mul_ps(kv, _mm512_set1_ps(d * static_cast<float>(iq4xs_scale(b, g))));
      const __m512i q = idx16(simd::ld16(b + 8 + 16 * g));
      o.put(_mm512_permutexvar_ps(q, t));
      o.put(_mm512_permutexvar_ps(hi4(q), t));
    }
  }
  out = o;
}

/// Q4_K scales of one block, vectorized: the 8 six-bit scales and mins unpacked with ggml's
/// 32-bit masks, then dl[g] = d * sc[g] (lanes 0-7) and ml[g] = dmin * m[g] (lanes 8-15), the
/// reference's products, stored to `dm` (16 floats).
inline void q4_k_scales(const uint8_t* b, float* dm) {
  uint32_t u[3];
  std::memcpy(u, b + 4, 12);
  const uint32_t sc_lo = u[0] & 0x3f3f3f3fu, m_lo = u[1] & 0x3f3f3f3fu;
  const uint32_t sc_hi = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
  const uint32_t m_hi = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
  const __m128i v =
      _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi), static_cast<int>(m_lo), static_cast<int>(m_hi));
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
  const __m512 dd =
      _mm512_insertf32x8(_mm512_set1_ps(_cvtsh_ss(load_u16(b))), _mm256_set1_ps(_cvtsh_ss(load_u16(b + 2))), 1);
  _mm512_store_ps(dm, _mm512_mul_ps(dd, f));
}

template <class S>
void lut_q4_k(const uint8_t* b, S& out, int64_t n) {
  S o = out;
  alignas(64) float dm[16];
  for (int64_t i = 0; i < n; i += 256, b += 144) {
    q4_k_scales(b, dm);
    __asm__ volatile("" : : "r"(dm) : "memory");  // broadcasts from memory, not vpermd (see lut_iq2_xs)
    const uint8_t* qs = b + 16;
#pragma GCC unroll 16
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p+1 (high nibbles)
      const __m512 t0 =
          _mm512_sub_ps(opaque(_mm512_mul_ps(iota16(), _mm512_set1_ps(dm[2 * p]))), _mm512_set1_ps(dm[8 + 2 * p]));
      const __m512 t1 = _mm512_sub_ps(opaque(_mm512_mul_ps(iota16(), _mm512_set1_ps(dm[2 * p + 1]))),
                                      _mm512_set1_ps(dm[8 + 2 * p + 1]));
      const __m512i q0 = idx16(simd::ld16(qs + 32 * p)), q1 = idx16(simd::ld16(qs + 32 * p + 16));
      o.put(_mm512_permutexvar_ps(q0, t0));
      o.put(_mm512_permutexvar_ps(q1, t0));
      o.put(_mm512_permutexvar_ps(hi4(q0), t1));
      o.put(_mm512_permutexvar_ps(hi4(q1), t1));
    }
  }
  out = o;
}

/// IQ2_XS grid as floats: entry i = the 8 bytes of iq2xs_grid[i] converted (exact), 16 KiB.
/// Built on first use (here, not at static-init time: this file runs only on AVX-512 CPUs).
const float* iq2xs_grid_f32() {
  static const float* const t = [] {
    auto* p = static_cast<float*>(std::aligned_alloc(64, 512 * 8 * sizeof(float)));
    if (!p) throw std::bad_alloc();
    for (int i = 0; i < 512; ++i)
      for (int l = 0; l < 8; ++l) p[8 * i + l] = static_cast<float>((tables::iq2xs_grid[i] >> (8 * l)) & 0xff);
    return p;
  }();
  return t;
}

/// IQ2_XS with the per-block scalar work vectorized: the 32 grid offsets, the 32 sign bytes
/// (ksigns_iq2xs[s] = s | parity(s) << 7, computed) and the 16 group scales
/// db = (d * (0.5 + nib)) * 0.25 (the reference's operations) are made once per block with
/// 512-bit integer ops and parked on the stack; each 16 weights are then two 8-float grid rows,
/// one multiply by db and a masked sign flip (exactly the reference's db * grid, negated).
template <class S>
void lut_iq2_xs(const uint8_t* b, S& out, int64_t n) {
  S o = out;
  const char* grid = reinterpret_cast<const char*>(iq2xs_grid_f32());
  alignas(64) uint16_t off[32];
  alignas(64) uint16_t sgn[16];
  alignas(64) float dbs[16];
  const __m512i m511 = _mm512_set1_epi16(511), one = _mm512_set1_epi16(1);
  for (int64_t i = 0; i < n; i += 256, b += 74) {
    const __m512i q = _mm512_loadu_si512(b + 2);
    _mm512_store_si512(off, _mm512_slli_epi16(_mm512_and_si512(q, m511), 5));  // byte offsets (32 B rows)
    const __m512i s = _mm512_srli_epi16(q, 9);
    __m512i par = _mm512_xor_si512(s, _mm512_srli_epi16(s, 4));
    par = _mm512_xor_si512(par, _mm512_srli_epi16(par, 2));
    par = _mm512_xor_si512(par, _mm512_srli_epi16(par, 1));
    const __m512i sb = _mm512_or_si512(s, _mm512_slli_epi16(_mm512_and_si512(par, one), 7));
    _mm256_store_si256(reinterpret_cast<__m256i*>(sgn), _mm512_cvtepi16_epi8(sb));
    const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 66));
    const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(sc, _mm_set1_epi8(0x0f)),
                                          _mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(0x0f)));
    const __m512 fn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nib));
    const __m512 db = _mm512_mul_ps(opaque(_mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(load_u16(b))),
                                                         _mm512_add_ps(_mm512_set1_ps(0.5f), fn))),
                                    _mm512_set1_ps(0.25f));
    _mm512_store_ps(dbs, db);
    // Read the three tables back from memory (one load each, folded into the address or the
    // broadcast) rather than let the compiler extract lanes with port-5 shuffles (vpextrw, vpermd).
    __asm__ volatile("" : : "r"(off), "r"(sgn), "r"(dbs) : "memory");
#pragma GCC unroll 16
    for (int g = 0; g < 16; ++g) {
      const __m256 lo = _mm256_load_ps(reinterpret_cast<const float*>(grid + off[2 * g]));
      const __m256 hi = _mm256_load_ps(reinterpret_cast<const float*>(grid + off[2 * g + 1]));
      const __m512 v = _mm512_mul_ps(_mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1), _mm512_set1_ps(dbs[g]));
      o.put(_mm512_mask_xor_ps(v, static_cast<__mmask16>(sgn[g]), v, _mm512_set1_ps(-0.0f)));
    }
  }
  out = o;
}

template <class S>
void lut_q5_k(const uint8_t* b, S& out, int64_t n) {
  S o = out;
  const __m512 hi_base = _mm512_add_ps(iota16(), _mm512_set1_ps(16.f));
  for (int64_t i = 0; i < n; i += 256, b += 176) {
    const float d = _cvtsh_ss(load_u16(b)), dmin = _cvtsh_ss(load_u16(b + 2));
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48;
    // bit g of qh[j] is the 5th bit of element 32g + j: gather it per g as 32-bit lane masks
    const __m256i qhv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
#pragma GCC unroll 16
    for (int g = 0; g < 8; ++g) {
      int sc, m;
      k4_scale_min(b + 4, g, sc, m);
      const __m512 dv = _mm512_set1_ps(d * static_cast<float>(sc)), mv = _mm512_set1_ps(dmin * static_cast<float>(m));
      const __m512 tl = _mm512_sub_ps(opaque(_mm512_mul_ps(iota16(), dv)), mv);
      const __m512 th = _mm512_sub_ps(opaque(_mm512_mul_ps(hi_base, dv)), mv);
      // bit 7 of each byte <- bit g: movemask gives the 32 lane bits
      const uint32_t hb = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(qhv, 7 - g)));
      __m512i q0 = idx16(simd::ld16(qs + 32 * (g / 2))), q1 = idx16(simd::ld16(qs + 32 * (g / 2) + 16));
      if (g % 2) {
        q0 = hi4(q0);
        q1 = hi4(q1);
      }
      o.put(_mm512_permutex2var_ps(tl, idx5(q0, static_cast<__mmask16>(hb)), th));
      o.put(_mm512_permutex2var_ps(tl, idx5(q1, static_cast<__mmask16>(hb >> 16)), th));
    }
  }
  out = o;
}

/// The AVX-512 decoder of block type t for sink S: table decoders where they apply, the shared
/// decoders otherwise (the plain types are the family driver's, simd_driver.h).
template <class S>
simd::SinkFn<S> decoder512(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: return lut_b32<GgmlType::Q4_0, S>;
    case GgmlType::Q4_1: return lut_b32<GgmlType::Q4_1, S>;
    case GgmlType::Q5_0: return lut_b32<GgmlType::Q5_0, S>;
    case GgmlType::Q5_1: return lut_b32<GgmlType::Q5_1, S>;
    case GgmlType::Q4_K: return lut_q4_k<S>;
    case GgmlType::Q5_K: return lut_q5_k<S>;
    case GgmlType::IQ4_NL: return lut_b32<GgmlType::IQ4_NL, S>;
    case GgmlType::IQ4_XS: return lut_iq4_xs<S>;
    case GgmlType::IQ2_XS: return lut_iq2_xs<S>;
    case GgmlType::MXFP4: return lut_b32<GgmlType::MXFP4, S>;
    default: return simd::block_decoder<E512, S>(t);
  }
}

/// The AVX-512 block decoders (decoder512) for the family driver.
struct Blocks512 {
  template <class S>
  static simd::SinkFn<S> get(GgmlType t) {
    return decoder512<S>(t);
  }
};

}  // namespace

bool decode_row_avx512(GgmlType t, const void* src, float* dst, int64_t n) {
  return simd::decode_row<V512, Blocks512>(t, src, dst, n);
}

bool matmul_avx512(const MatmulArgs& a) { return simd::matmul_family<V512, Blocks512>(a); }

}  // namespace strata::cpu::kernels::detail
