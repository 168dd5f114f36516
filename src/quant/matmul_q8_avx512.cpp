// The q8-activation path, AVX-512: int8 dot products (vpdpbusd with VNNI, else vpmaddubsw +
// vpmaddwd, which give the same integers: no pair sum can saturate for these formats), with
// the fp32 factors applied lane by lane exactly as matmul_q8_ref.cpp defines them.
//
// Loop order: blocks of 64 tokens (their int8 codes stay in L2), then rows, then tiles of up
// to 4 tokens that share one decode of the row's weights. Every (row, token) pair runs the
// same instruction sequence whatever the tile, so results are batch invariant.
#include "quant/simd_intrin.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "quant/act_q8.h"
#include "quant/quant_tables.h"

// Software prefetch distance in bytes ahead of the weight being decoded: the hardware prefetcher
// alone left matrix-vector at ~50 % of the read probe (measured 8 KiB: 1 thread 95 %, 2 threads
// 80-90 %; 1 KiB: 65 %; none: 52 %; docs/kernels.md).
constexpr int kPrefetch = 8192;
namespace strata::quant::detail {

namespace {


template <bool VNNI>
inline __m512i dot_u8s8(__m512i u, __m512i s) {
  if constexpr (VNNI) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
  } else {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
  }
}
/// vpermps indices that spread lanes 2c and 2c+1 of an 8-float vector over the two halves of
/// a zmm (lanes 0-7 and 8-15), for c = 0..3: one per-block factor per 8 int32 lanes.
inline void pair_lanes(__m512i (&idx)[4]) {
  for (int c = 0; c < 4; ++c)
    idx[c] = _mm512_inserti64x4(_mm512_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1), 1);
}

/// The codes of TB consecutive tokens, starting at the first: tokens are `cols` codes apart
/// (d: cols/32, s: cols/16 apart).
struct Tokens {
  const int8_t* q;
  const float* d;
  const int16_t* s;
  int64_t cols;
};

/// Q8_0 pair of blocks as unsigned bytes (code + 128, i.e. code ^ 0x80); the second half is
/// zero when the pair has one block.
inline __m512i q8_0_pair(const uint8_t* b, bool two) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i lo = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), flip);
  const __m256i hi = two ? _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 36)), flip)
                         : _mm256_setzero_si256();
  return _mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1);
}

/// Sum of (w + 128) * x over each int32 lane. Without VNNI, vpmaddubsw on (w + 128) could
/// saturate, so the same integers are formed as sum(w * x) + 128 * sum(x).
template <bool VNNI>
inline __m512i dot_q8_0(__m512i wu, __m512i qx) {
  if constexpr (VNNI) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, qx);
  } else {
    const __m512i w = _mm512_xor_si512(wu, _mm512_set1_epi8(static_cast<char>(0x80)));
    const __m512i sx = _mm512_mask_sub_epi8(qx, _mm512_movepi8_mask(w), _mm512_setzero_si512(), qx);
    const __m512i ones = _mm512_set1_epi16(1);
    const __m512i wx = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), sx), ones);
    const __m512i sum = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_set1_epi8(1), qx), ones);
    return _mm512_add_epi32(wx, _mm512_slli_epi32(sum, 7));
  }
}

/// One group of (up to) 8 Q8_0 blocks of a row against TB tokens; FULL: all 8 blocks valid.
template <int TB, bool VNNI, bool FULL>
inline void q8_0_group(const uint8_t* wg, int nv, const Tokens& tk, int64_t g, __m512* acc0, __m512* acc1,
                       __m256* corr) {
  __m512i idx[4];
  pair_lanes(idx);
  __m128i dh;
  if constexpr (FULL) {
    dh = _mm_setr_epi16(static_cast<short>(load_u16(wg)), static_cast<short>(load_u16(wg + 34)),
                        static_cast<short>(load_u16(wg + 68)), static_cast<short>(load_u16(wg + 102)),
                        static_cast<short>(load_u16(wg + 136)), static_cast<short>(load_u16(wg + 170)),
                        static_cast<short>(load_u16(wg + 204)), static_cast<short>(load_u16(wg + 238)));
  } else {
    alignas(16) uint16_t h[8] = {};
    for (int j = 0; j < nv; ++j) h[j] = load_u16(wg + 34 * j);
    dh = _mm_load_si128(reinterpret_cast<const __m128i*>(h));
  }
  const __m256 dw = _mm256_cvtph_ps(dh);
  const __mmask8 m8 = FULL ? __mmask8{0xff} : static_cast<__mmask8>((1u << nv) - 1u);
  const __mmask16 m16 = FULL ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (2 * nv)) - 1u);
  __m512 f[TB];
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t) {
    const __m256 fb = _mm256_mul_ps(dw, _mm256_maskz_loadu_ps(m8, tk.d + t * (tk.cols / 32) + g));
    const __m256i s16 = _mm256_maskz_loadu_epi16(m16, tk.s + t * (tk.cols / 16) + 2 * g);
    corr[t] = _mm256_fmadd_ps(fb, _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1))), corr[t]);
    f[t] = _mm512_zextps256_ps512(fb);
  }
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    if (!FULL && 2 * p >= nv) break;
    const bool two = FULL || 2 * p + 1 < nv;
    const __m512i wu = q8_0_pair(wg + 68 * p, two);
    const __mmask64 mx = two ? ~__mmask64{0} : __mmask64{0xffffffffu};
    // pair index g/2 + p, g/2 a multiple of 4: the accumulator is p's parity
    __m512* acc = (p & 1) ? acc1 : acc0;
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
      const int8_t* xp = tk.q + t * tk.cols + 32 * (g + 2 * p);
      const __m512i qx = FULL ? _mm512_loadu_si512(xp) : _mm512_maskz_loadu_epi8(mx, xp);
      const __m512 pf = _mm512_cvtepi32_ps(dot_q8_0<VNNI>(wu, qx));
      acc[t] = _mm512_fmadd_ps(pf, _mm512_permutexvar_ps(idx[p], f[t]), acc[t]);
    }
  }
}

template <int TB, bool VNNI>
void row_q8_0(const uint8_t* w, const Tokens& tk, float* y, int64_t ldy) {
  __m512 acc0[TB], acc1[TB];
  __m256 corr[TB];
  for (int t = 0; t < TB; ++t) {
    acc0[t] = acc1[t] = _mm512_setzero_ps();
    corr[t] = _mm256_setzero_ps();
  }
  const int64_t nb = tk.cols / 32;
  int64_t g = 0;
  for (; g + 8 <= nb; g += 8) {
    const uint8_t* wg = w + 34 * g;
    for (int o = 0; o < 34 * 8; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wg) + kPrefetch + o, _MM_HINT_T0);
    q8_0_group<TB, VNNI, true>(wg, 8, tk, g, acc0, acc1, corr);
  }
  if (g < nb) q8_0_group<TB, VNNI, false>(w + 34 * g, static_cast<int>(nb - g), tk, g, acc0, acc1, corr);
  for (int t = 0; t < TB; ++t)
    y[t * ldy] = simd_hsum16(_mm512_add_ps(acc0[t], acc1[t])) - 128.0f * simd_hsum8(corr[t]);
}

/// The 8 six-bit scales and mins of a Q4_K block (ggml get_scale_min_k4), unpacked with 32-bit
/// masks: bytes 0-3 of the results come from s[0..7] & 63, bytes 4-7 combine s[8..11] with the
/// top two bits of s[0..7].
inline void k4_scales(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t sc_lo = a & 0x3f3f3f3fu, m_lo = b & 0x3f3f3f3fu;
  const uint32_t sc_hi = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
  const uint32_t m_hi = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
  std::memcpy(sc, &sc_lo, 4);
  std::memcpy(sc + 4, &sc_hi, 4);
  std::memcpy(m, &m_lo, 4);
  std::memcpy(m + 4, &m_hi, 4);
}

inline __m256 u8x8_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int TB, bool VNNI>
void row_q4_k(const uint8_t* w, const Tokens& tk, float* y, int64_t ldy) {
  __m512 acc[TB][2];
  __m256 accm[TB];
  for (int t = 0; t < TB; ++t) {
    acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    accm[t] = _mm256_setzero_ps();
  }
  __m512i idx[4];
  pair_lanes(idx);
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 144) {
    for (int o = 0; o < 144; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + o, _MM_HINT_T0);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(w))), dmin = _mm256_set1_ps(_cvtsh_ss(load_u16(w + 2)));
    alignas(8) uint8_t sc[8], m[8];
    k4_scales(w + 4, sc, m);
    const __m256 dsc = _mm256_mul_ps(d, u8x8_ps(sc)), dm = _mm256_mul_ps(dmin, u8x8_ps(m));
    __m512 fs[TB];
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
      const __m256 dx = _mm256_loadu_ps(tk.d + t * (tk.cols / 32) + 8 * i);
      fs[t] = _mm512_zextps256_ps512(_mm256_mul_ps(dsc, dx));
      const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tk.s + t * (tk.cols / 16) + 16 * i));
      const __m256 s32 = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
      accm[t] = _mm256_fmadd_ps(_mm256_mul_ps(dm, dx), s32, accm[t]);
    }
    const uint8_t* qs = w + 16;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      const __m256i lo = _mm256_and_si256(q, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), lo4);
      const __m512i wq = _mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1);
  #pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
        const __m512i qx = _mm512_loadu_si512(tk.q + t * tk.cols + 256 * i + 64 * c);
        const __m512i p = dot_u8s8<VNNI>(wq, qx);
        const __m512 f = _mm512_permutexvar_ps(idx[c], fs[t]);
        acc[t][c & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), f, acc[t][c & 1]);
      }
    }
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum16(_mm512_add_ps(acc[t][0], acc[t][1])) - simd_hsum8(accm[t]);
}

template <int TB, bool VNNI>
void row_iq2_xs(const uint8_t* w, const Tokens& tk, float* y, int64_t ldy) {
  __m512 acc[TB][2];
  for (int t = 0; t < TB; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i idx[4] = {
      _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
      _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7),
      _mm512_setr_epi32(8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11),
      _mm512_setr_epi32(12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15)};
  const __m128i lo4 = _mm_set1_epi8(0x0f);
  const long long* grid = reinterpret_cast<const long long*>(tables::iq2xs_grid);
  const int64_t nsb = tk.cols / 256;
  for (int64_t i = 0; i < nsb; ++i, w += 74) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch + 64, _MM_HINT_T0);
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(w)));
    const __m128i s = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 66));
    const __m128i ls = _mm_unpacklo_epi8(_mm_and_si128(s, lo4), _mm_and_si128(_mm_srli_epi16(s, 4), lo4));
    const __m512i ls32 = _mm512_cvtepu8_epi32(ls);
    const __m512 odd = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ls32, 1), _mm512_set1_epi32(1)));
    __m512 F[TB];
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
      const __m512 dx = _mm512_permutexvar_ps(pairs, _mm512_zextps256_ps512(_mm256_loadu_ps(tk.d + t * (tk.cols / 32) + 8 * i)));
      F[t] = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(d, dx), odd), _mm512_set1_ps(0.125f));
    }
    const uint8_t* qs = w + 2;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * c));
      const __m512i wq = _mm512_i64gather_epi64(_mm512_cvtepu16_epi64(_mm_and_si128(codes, _mm_set1_epi16(511))), grid, 8);
      // ksigns_iq2xs[k] = k | parity(k) << 7: bit j of byte l negates element 8l + j, which is
      // bit 8l + j of the 64-bit mask
      const __m128i k7 = _mm_srli_epi16(codes, 9);
      __m128i par = _mm_xor_si128(k7, _mm_srli_epi16(k7, 4));
      par = _mm_xor_si128(par, _mm_srli_epi16(par, 2));
      par = _mm_xor_si128(par, _mm_srli_epi16(par, 1));
      const __m128i sb = _mm_or_si128(k7, _mm_slli_epi16(_mm_and_si128(par, _mm_set1_epi16(1)), 7));
      const __mmask64 neg = _cvtu64_mask64(static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_packus_epi16(sb, sb))));
#pragma GCC unroll 4
      for (int t = 0; t < TB; ++t) {
        const __m512i qx = _mm512_loadu_si512(tk.q + t * tk.cols + 256 * i + 64 * c);
        const __m512i p = dot_u8s8<VNNI>(wq, _mm512_mask_sub_epi8(qx, neg, _mm512_setzero_si512(), qx));
        const __m512 f = _mm512_permutexvar_ps(idx[c], F[t]);
        acc[t][c & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), f, acc[t][c & 1]);
      }
    }
  }
  for (int t = 0; t < TB; ++t) y[t * ldy] = simd_hsum16(_mm512_add_ps(acc[t][0], acc[t][1]));
}

template <int TB, bool VNNI>
void run_row(GgmlType type, const uint8_t* w, const Tokens& tk, float* y, int64_t ldy) {
  switch (type) {
    case GgmlType::Q8_0: row_q8_0<TB, VNNI>(w, tk, y, ldy); break;
    case GgmlType::Q4_K: row_q4_k<TB, VNNI>(w, tk, y, ldy); break;
    case GgmlType::IQ2_XS: row_iq2_xs<TB, VNNI>(w, tk, y, ldy); break;
    default: break;
  }
}

template <bool VNNI>
void run(const MatmulArgs& m, const ActQ8& a) {
  constexpr int64_t kTokBlock = 64;
  for (int64_t t0 = 0; t0 < m.n_tok; t0 += kTokBlock) {
    const int64_t t1 = std::min(m.n_tok, t0 + kTokBlock);
    for (int64_t r = m.row_begin; r < m.row_end; ++r) {
      const uint8_t* w = m.W + static_cast<size_t>(r) * m.row_bytes;
      for (int64_t t = t0; t < t1; t += 4) {
        const Tokens tk{a.qt(t), a.dt(t), a.st(t), a.cols};
        float* y = m.y + t * m.ldy + r;
        switch (std::min<int64_t>(4, t1 - t)) {
          case 4: run_row<4, VNNI>(m.type, w, tk, y, m.ldy); break;
          case 3: run_row<3, VNNI>(m.type, w, tk, y, m.ldy); break;
          case 2: run_row<2, VNNI>(m.type, w, tk, y, m.ldy); break;
          default: run_row<1, VNNI>(m.type, w, tk, y, m.ldy); break;
        }
      }
    }
  }
}

}  // namespace

float quantize_block_q8_avx512(const float* x, int8_t* q, int16_t* s16) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const __m512 abs_a = _mm512_abs_ps(a), abs_b = _mm512_abs_ps(b);
  // finite: |x| <= FLT_MAX (false for NaN and infinities), as quantize_block_q8 tests it
  const __m512 big = _mm512_set1_ps(3.4028234e38f);
  const __mmask16 ok = _mm512_cmp_ps_mask(abs_a, big, _CMP_LE_OQ) & _mm512_cmp_ps_mask(abs_b, big, _CMP_LE_OQ);
  if (ok != 0xffff) {
    std::memset(q, 0, 32);
    s16[0] = s16[1] = 0;
    return std::nanf("");
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(abs_a, abs_b));  // max is exact, any order
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  // round to nearest even (MXCSR default), as the scalar's 1.5 * 2^23 trick
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  s16[0] = static_cast<int16_t>(_mm512_reduce_add_epi32(qa));
  s16[1] = static_cast<int16_t>(_mm512_reduce_add_epi32(qb));
  return amax / 127.0f;
}

bool matmul_q8_avx512(const MatmulArgs& m, const ActQ8& a, bool vnni) {
  if (!has_q8_kernel(m.type)) return false;
  if (vnni) {
    run<true>(m, a);
  } else {
    run<false>(m, a);
  }
  return true;
}

}  // namespace strata::quant::detail
