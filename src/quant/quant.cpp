// Public entry points of src/quant: block geometry, type names and fp16/bf16 conversions.
#include "quant/quant.h"

#include <stdexcept>
#include <string>

#include "quant/quant_impl.h"

namespace strata::quant {

namespace detail {
const char* type_name(GgmlType t) {
  switch (t) {
    // one case per line: clang-format cannot lay out these macro calls stably
    // clang-format off
#define STRATA_QUANT_NAME(x) case GgmlType::x: return #x;
    STRATA_QUANT_NAME(F32)
    STRATA_QUANT_NAME(F16)
    STRATA_QUANT_NAME(BF16)
    STRATA_QUANT_NAME(Q8_0)
    STRATA_QUANT_NAME(Q4_0)
    STRATA_QUANT_NAME(Q4_1)
    STRATA_QUANT_NAME(Q5_0)
    STRATA_QUANT_NAME(Q5_1)
    STRATA_QUANT_NAME(Q2_K)
    STRATA_QUANT_NAME(Q3_K)
    STRATA_QUANT_NAME(Q4_K)
    STRATA_QUANT_NAME(Q5_K)
    STRATA_QUANT_NAME(Q6_K)
    STRATA_QUANT_NAME(IQ2_XS)
    STRATA_QUANT_NAME(IQ3_S)
    STRATA_QUANT_NAME(IQ4_XS)
    STRATA_QUANT_NAME(IQ4_NL)
    STRATA_QUANT_NAME(MXFP4)
#undef STRATA_QUANT_NAME
    // clang-format on
    default: return "unsupported type";
  }
}
}  // namespace detail

bool is_supported(GgmlType t) { return detail::implemented(t); }

int block_elems(GgmlType t) { return detail::implemented(t) ? detail::geometry(t).elems : 0; }

size_t row_size(GgmlType t, int64_t cols) {
  const detail::Geometry g = detail::geometry(t);
  if (!detail::implemented(t)) throw std::runtime_error("quant: unsupported type " + std::string(detail::type_name(t)));
  if (cols < 0 || cols % g.elems != 0)
    throw std::runtime_error("quant: " + std::to_string(cols) + " columns is not a multiple of the " +
                             std::to_string(g.elems) + "-element block of " + std::string(detail::type_name(t)));
  return static_cast<size_t>(cols / g.elems) * static_cast<size_t>(g.bytes);
}

float fp16_to_fp32(uint16_t h) { return detail::half_to_float(h); }

uint16_t fp32_to_fp16(float f) {
  // Round to nearest even (F. Giesen's float_to_half_fast3_rtne scheme, rewritten here).
  uint32_t x = detail::f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) {  // Inf or NaN (NaN stays NaN, quiet, top payload bits kept)
    if (x == 0x7f800000u) return sign | 0x7c00u;
    return static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  }
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (x < 0x38800000u) {
    // Result is subnormal (or zero): let the FPU round at 2^-24 granularity by adding 0.5,
    // whose ulp is exactly 2^-24.
    const float t = detail::bits_f32(x) + 0.5f;
    return static_cast<uint16_t>(sign | (detail::f32_bits(t) - 0x3f000000u));
  }
  const uint32_t odd = (x >> 13) & 1u;
  x += 0xc8000fffu + odd;  // rebias exponent (15-127) and round half to even
  return static_cast<uint16_t>(sign | (x >> 13));
}

float bf16_to_fp32(uint16_t h) { return detail::bf16_to_float(h); }

uint16_t fp32_to_bf16(float f) {
  const uint32_t x = detail::f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace strata::quant
