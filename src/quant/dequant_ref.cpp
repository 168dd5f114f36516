// Scalar reference dequantization, bit-exact with gguf-py (gguf/quants.py), which computes in
// float32 numpy: every product below is one float32 multiply in the same order as there, so
// the results match bit for bit (no FMA: this file is compiled for baseline x86-64).
// Block layouts: ggml/src/ggml-common.h.
#include <stdexcept>
#include <string>

#include "quant/quant.h"
#include "quant/quant_impl.h"

namespace strata::quant {

namespace {

using detail::half_to_float;

// Q8_0: { fp16 d; int8 q[32]; }  value = d * q
void deq_q8_0(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 34, y += 32) {
    const float d = half_to_float(detail::load_u16(b));
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
  }
}

}  // namespace

void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n) {
  const detail::Geometry g = detail::geometry(t);
  if (!detail::implemented(t)) throw std::runtime_error("quant::dequantize_row: unsupported type " + std::string(detail::type_name(t)));
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
    default: break;
  }
  throw std::runtime_error("quant::dequantize_row: no reference dequantizer for " + std::string(detail::type_name(t)));
}

}  // namespace strata::quant
