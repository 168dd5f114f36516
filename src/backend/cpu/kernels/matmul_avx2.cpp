// AVX2 + FMA + F16C family: row decoders (block -> fp32, values bit-identical to the scalar
// reference) and the drivers of simd_driver.h with 8-lane vectors (2 accumulators = 16 lanes
// per (row, token) pair; panel micro-kernel 2 rows x 3 tokens: 12 accumulators + 2 weights +
// 1 activation register out of 16; fused path up to 4 tokens).
#include "backend/cpu/kernels/simd_intrin.h"
//
#include "backend/cpu/kernels/simd_driver.h"
#include "backend/cpu/kernels/simd_decoders.h"

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

simd::DecodeFn plain_decoder(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return dec_f32;
    case GgmlType::F16: return dec_f16;
    case GgmlType::BF16: return dec_bf16;
    default: return nullptr;
  }
}

using StoreSink = simd::Store<V256>;

// F32/F16/BF16 as sink decoders (n % 8 == 0), so that decode-sized calls can use the fused path.
template <class S>
void sink_f32(const uint8_t* b, S& out, int64_t n) {
  S o = out;
  for (int64_t i = 0; i < n; i += 8) o.put(_mm256_loadu_ps(reinterpret_cast<const float*>(b) + i));
  out = o;
}

template <class S>
void sink_f16(const uint8_t* b, S& out, int64_t n) {
  S o = out;
  for (int64_t i = 0; i < n; i += 8)
    o.put(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * i))));
  out = o;
}

template <class S>
void sink_bf16(const uint8_t* b, S& out, int64_t n) {
  S o = out;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * i)));
    o.put(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
  }
  out = o;
}

template <class S>
simd::SinkDecodeFn<E256, S> decoder256(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return sink_f32<S>;
    case GgmlType::F16: return sink_f16<S>;
    case GgmlType::BF16: return sink_bf16<S>;
    default: return simd::block_decoder<E256, S>(t);
  }
}

template <int NT>
bool fused(const MatmulArgs& a) {
  const auto dec = decoder256<simd::Fused<V256, NT>>(a.type);
  if (!dec) return false;
  simd::run_fused<V256, NT>(dec, a);
  return true;
}

}  // namespace

bool decode_row_avx2(GgmlType t, const void* src, float* dst, int64_t n) {
  const auto* s = static_cast<const uint8_t*>(src);
  float* tmp = simd::scratch(static_cast<size_t>(n) + 16);  // decoders store aligned
  if (const simd::DecodeFn f = plain_decoder(t)) {
    f(s, tmp, n);
  } else if (const auto dec = simd::block_decoder<E256, StoreSink>(t)) {  // block types only here
    StoreSink sink{tmp};
    dec(s, sink, n);
  } else {
    return false;
  }
  std::memcpy(dst, tmp, static_cast<size_t>(n) * sizeof(float));
  return true;
}

bool matmul_avx2(const MatmulArgs& a) {
  const bool plain = plain_decoder(a.type) != nullptr;
  if (plain && a.cols % (2 * V256::W) != 0) {  // ragged rows: only the panel path has tails
    simd::run<V256>(plain_decoder(a.type), a);
    return true;
  }
  switch (a.n_tok) {
    case 1: return fused<1>(a);
    case 2: return fused<2>(a);
    case 3: return fused<3>(a);
    case 4: return fused<4>(a);
    default: break;
  }
  if (a.type == GgmlType::F32 && a.row_bytes % sizeof(float) == 0) {  // prefill on F32: no copy
    simd::run_direct<V256>(a);
    return true;
  }
  if (plain) {
    simd::run<V256>(plain_decoder(a.type), a);
    return true;
  }
  const auto dec = simd::block_decoder<E256, StoreSink>(a.type);
  if (!dec) return false;
  simd::run<V256>(
      [dec](const uint8_t* src, float* dst, int64_t cols) {
        StoreSink sink{dst};
        dec(src, sink, cols);
      },
      a);
  return true;
}

}  // namespace strata::cpu::kernels::detail
