// AVX2 + FMA + F16C family: row decoders (block -> fp32, values bit-identical to the scalar
// reference) and the shared driver of simd_driver.h with 8-lane vectors (2 accumulators = 16
// lanes per (row, token) pair, micro-kernel 2 rows x 3 tokens: 12 accumulators + 2 weights +
// 1 activation register out of 16).
#include "quant/simd_intrin.h"

#include "quant/simd_driver.h"
#include "quant/simd_decoders.h"

namespace strata::quant::detail {

namespace {

struct V256 {
  using vec = __m256;
  static constexpr int W = 8, RB = 2, TB = 3;
  static vec zero() { return _mm256_setzero_ps(); }
  static vec load(const float* p) { return _mm256_load_ps(p); }
  static vec loadu(const float* p) { return _mm256_loadu_ps(p); }
  static vec loadu_n(const float* p, int n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
  }
  static vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
  static vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
  static float hsum(vec v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
  }
};

// Keeps the compiler from contracting a multiply into a following add (-ffp-contract=fast is
// GCC's default): the reference rounds the product first.
inline __m256 opaque(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}

/// Emitter of simd_decoders.h: 16 floats per call, two ymm.
struct E256 {
  static float half(uint16_t h) { return _cvtsh_ss(h); }
  static void i8(float* o, __m128i q, float d) {
    const __m256 dv = _mm256_set1_ps(d);
    _mm256_store_ps(o, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), dv));
    _mm256_store_ps(o + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), dv));
  }
  static __m256 u8(__m128i q, float d) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_set1_ps(d));
  }
  static void u8_add(float* o, __m128i q, float d, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    _mm256_store_ps(o, _mm256_add_ps(opaque(u8(q, d)), mv));
    _mm256_store_ps(o + 8, _mm256_add_ps(opaque(u8(_mm_srli_si128(q, 8), d)), mv));
  }
  static void u8_sub(float* o, __m128i q, float d, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    _mm256_store_ps(o, _mm256_sub_ps(opaque(u8(q, d)), mv));
    _mm256_store_ps(o + 8, _mm256_sub_ps(opaque(u8(_mm_srli_si128(q, 8), d)), mv));
  }
  /// Sign bit (bit 31) set in lane i where bit i of s is set.
  static __m256 sign_mask8(uint32_t s) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(s)), bit), bit);
    return _mm256_castsi256_ps(_mm256_slli_epi32(on, 31));
  }
  static void u8_signs(float* o, __m128i q, float d, uint32_t s) {
    _mm256_store_ps(o, _mm256_xor_ps(u8(q, d), sign_mask8(s & 0xff)));
    _mm256_store_ps(o + 8, _mm256_xor_ps(u8(_mm_srli_si128(q, 8), d), sign_mask8((s >> 8) & 0xff)));
  }
};

void dec_f32(const uint8_t* s, float* o, int64_t n) { std::memcpy(o, s, static_cast<size_t>(n) * 4); }

void dec_f16(const uint8_t* s, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_store_ps(o + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * i))));
  for (; i < n; ++i) o[i] = half_to_float(load_u16(s + 2 * i));
}

void dec_bf16(const uint8_t* s, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * i)));
    _mm256_store_ps(o + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
  }
  for (; i < n; ++i) o[i] = bf16_to_float(load_u16(s + 2 * i));
}

simd::DecodeFn decoder(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return dec_f32;
    case GgmlType::F16: return dec_f16;
    case GgmlType::BF16: return dec_bf16;
    default: return simd::block_decoder<E256>(t);
  }
}

}  // namespace

bool decode_row_avx2(GgmlType t, const void* src, float* dst, int64_t n) {
  const simd::DecodeFn f = decoder(t);
  if (!f) return false;
  float* tmp = simd::scratch(static_cast<size_t>(n));  // decoders store aligned
  f(static_cast<const uint8_t*>(src), tmp, n);
  std::memcpy(dst, tmp, static_cast<size_t>(n) * sizeof(float));
  return true;
}

bool matmul_avx2(const MatmulArgs& a) {
  const simd::DecodeFn f = decoder(a.type);
  if (!f) return false;
  simd::run<V256>(f, a);
  return true;
}

}  // namespace strata::quant::detail
