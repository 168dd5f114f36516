// AVX2 + FMA + F16C family: row decoders (block -> fp32, values bit-identical to the scalar
// reference) and the drivers of simd_driver.h with 8-lane vectors (2 accumulators = 16 lanes
// per (row, token) pair; panel micro-kernel 2 rows x 3 tokens: 12 accumulators + 2 weights +
// 1 activation register out of 16; fused path up to 4 tokens).
#include "backend/cpu/kernels/simd_intrin.h"
//
#include "backend/cpu/kernels/simd_decoders.h"
#include "backend/cpu/kernels/simd_driver.h"

namespace strata::cpu::kernels::detail {

namespace {

struct V256 {
  using vec = __m256;
  static constexpr int W = 8, RB = 2, TB = 3, FUSED_MAX = 4;
  static vec zero() { return _mm256_setzero_ps(); }
  static vec loadu(const float* p) { return _mm256_loadu_ps(p); }
  static vec loadu_n(const float* p, int n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
  }
  static void store(float* p, vec v) { _mm256_store_ps(p, v); }
  static void storeu(float* p, vec v) { _mm256_storeu_ps(p, v); }
  static vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
  static vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
  static float hsum(vec v) { return simd_hsum8(v); }
  static vec load_f16(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static vec load_bf16(const uint8_t* p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
};

// Keeps the compiler from contracting a multiply into a following add (-ffp-contract=fast is
// GCC's default): the reference rounds the product first.
inline __m256 opaque(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}

/// Emitter of simd_decoders.h: 16 weights per call, two ymm, handed to the sink in order.
struct E256 {
  static float half(uint16_t h) { return _cvtsh_ss(h); }
  static __m256 u8(__m128i q, float d) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_set1_ps(d));
  }
  static __m256 i8v(__m128i q, float d) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(d));
  }
  template <class S>
  static void i8(S& o, __m128i q, float d) {
    o.put(i8v(q, d));
    o.put(i8v(_mm_srli_si128(q, 8), d));
  }
  template <class S>
  static void u8_add(S& o, __m128i q, float d, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    o.put(_mm256_add_ps(opaque(u8(q, d)), mv));
    o.put(_mm256_add_ps(opaque(u8(_mm_srli_si128(q, 8), d)), mv));
  }
  template <class S>
  static void u8_sub(S& o, __m128i q, float d, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    o.put(_mm256_sub_ps(opaque(u8(q, d)), mv));
    o.put(_mm256_sub_ps(opaque(u8(_mm_srli_si128(q, 8), d)), mv));
  }
  /// Sign bit (bit 31) set in lane i where bit i of s is set.
  static __m256 sign_mask8(uint32_t s) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(s)), bit), bit);
    return _mm256_castsi256_ps(_mm256_slli_epi32(on, 31));
  }
  template <class S>
  static void u8_signs(S& o, __m128i q, float d, uint32_t s) {
    o.put(_mm256_xor_ps(u8(q, d), sign_mask8(s & 0xff)));
    o.put(_mm256_xor_ps(u8(_mm_srli_si128(q, 8), d), sign_mask8((s >> 8) & 0xff)));
  }
};

/// The AVX2 block decoders: those of simd_decoders.h with the 8-lane emitter.
struct Blocks256 {
  template <class S>
  static simd::SinkFn<S> get(GgmlType t) {
    return simd::block_decoder<E256, S>(t);
  }
};

}  // namespace

bool decode_row_avx2(GgmlType t, const void* src, float* dst, int64_t n) {
  return simd::decode_row<V256, Blocks256>(t, src, dst, n);
}

bool matmul_avx2(const MatmulArgs& a) { return simd::matmul_family<V256, Blocks256>(a); }

}  // namespace strata::cpu::kernels::detail
