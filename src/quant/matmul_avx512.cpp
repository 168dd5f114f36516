// AVX-512 family: row decoders (block -> fp32, values bit-identical to the scalar reference)
// and the shared driver of simd_driver.h with 16-lane vectors (2 accumulators = 32 lanes per
// (row, token) pair, micro-kernel 3 rows x 4 tokens).
#include "quant/simd_intrin.h"

#include "quant/simd_driver.h"
#include "quant/simd_decoders.h"

namespace strata::quant::detail {

namespace {

struct V512 {
  using vec = __m512;
  static constexpr int W = 16, RB = 3, TB = 4;
  static vec zero() { return _mm512_setzero_ps(); }
  static vec load(const float* p) { return _mm512_load_ps(p); }
  static vec loadu(const float* p) { return _mm512_loadu_ps(p); }
  static vec loadu_n(const float* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
  }
  static vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
  static float hsum(vec v) {
    __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
  }
};

// Keeps the compiler from contracting a multiply into a following add (-ffp-contract=fast is
// GCC's default): the reference rounds the product first.
inline __m512 opaque(__m512 v) {
  __asm__("" : "+v"(v));
  return v;
}

/// Emitter of simd_decoders.h: 16 floats per call, one zmm.
struct E512 {
  static float half(uint16_t h) { return _cvtsh_ss(h); }
  static void i8(float* o, __m128i q, float d) {
    _mm512_store_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(d)));
  }
  static __m512 u8(__m128i q, float d) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), _mm512_set1_ps(d));
  }
  static void u8_add(float* o, __m128i q, float d, float m) {
    _mm512_store_ps(o, _mm512_add_ps(opaque(u8(q, d)), _mm512_set1_ps(m)));
  }
  static void u8_sub(float* o, __m128i q, float d, float m) {
    _mm512_store_ps(o, _mm512_sub_ps(opaque(u8(q, d)), _mm512_set1_ps(m)));
  }
  static void u8_signs(float* o, __m128i q, float d, uint32_t s) {
    const __m512 v = u8(q, d);
    _mm512_store_ps(o, _mm512_mask_xor_ps(v, static_cast<__mmask16>(s), v, _mm512_set1_ps(-0.0f)));
  }
};

void dec_f32(const uint8_t* s, float* o, int64_t n) { std::memcpy(o, s, static_cast<size_t>(n) * 4); }

void dec_f16(const uint8_t* s, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_store_ps(o + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 2 * i))));
  for (; i < n; ++i) o[i] = half_to_float(load_u16(s + 2 * i));
}

void dec_bf16(const uint8_t* s, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 2 * i)));
    _mm512_store_ps(o + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
  for (; i < n; ++i) o[i] = bf16_to_float(load_u16(s + 2 * i));
}

simd::DecodeFn decoder(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return dec_f32;
    case GgmlType::F16: return dec_f16;
    case GgmlType::BF16: return dec_bf16;
    default: return simd::block_decoder<E512>(t);
  }
}

}  // namespace

bool decode_row_avx512(GgmlType t, const void* src, float* dst, int64_t n) {
  const simd::DecodeFn f = decoder(t);
  if (!f) return false;
  float* tmp = simd::scratch(static_cast<size_t>(n));  // decoders store aligned
  f(static_cast<const uint8_t*>(src), tmp, n);
  std::memcpy(dst, tmp, static_cast<size_t>(n) * sizeof(float));
  return true;
}

bool matmul_avx512(const MatmulArgs& a) {
  const simd::DecodeFn f = decoder(a.type);
  if (!f) return false;
  simd::run<V512>(f, a);
  return true;
}

}  // namespace strata::quant::detail
