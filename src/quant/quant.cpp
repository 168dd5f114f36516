// Public entry points of src/quant: kernel-family selection (CPUID), conversions, argument
// checking and dispatch of matmul to the active family.
#include "quant/quant.h"

#include <atomic>
#include <stdexcept>
#include <string>

#include "quant/act_q8.h"
#include "quant/quant_impl.h"

namespace strata::quant {

namespace {

bool cpu_has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("bmi2");
}
bool cpu_has_avx512() {
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

CpuKernels best_family() {
  if (cpu_has_avx512()) return CpuKernels::Avx512;
  if (cpu_has_avx2()) return CpuKernels::Avx2;
  return CpuKernels::Scalar;
}

std::atomic<CpuKernels>& active_family() {
  static std::atomic<CpuKernels> k{best_family()};
  return k;
}

// The q8 family in use: AVX-512 kernels when active (and the type has one), else the scalar
// definition; both give the same bits.
void run_q8(const detail::MatmulArgs& a, const ActQ8& act) {
  static const detail::Q8Isa isa = cpu_has_avx512() ? detail::best_q8_isa() : detail::Q8Isa::Avx512;
  if (active_cpu_kernels() == CpuKernels::Avx512 && detail::matmul_q8_avx512(a, act, isa)) return;
  if (active_cpu_kernels() == CpuKernels::Avx2 && detail::matmul_q8_avx2(a, act)) return;
  detail::matmul_q8_scalar(a, act);
}

std::atomic<ActQuant>& act_mode() {
  static std::atomic<ActQuant> a{ActQuant::Auto};
  return a;
}

}  // namespace

void set_cpu_kernels(CpuKernels k) {
  if (k == CpuKernels::Auto) k = best_family();
  if (k == CpuKernels::Avx2 && !cpu_has_avx2())
    throw std::runtime_error("cpu kernels: avx2 requested but this CPU lacks AVX2/FMA/F16C/BMI2");
  if (k == CpuKernels::Avx512 && !cpu_has_avx512())
    throw std::runtime_error("cpu kernels: avx512 requested but this CPU lacks AVX-512 F/BW/VL/DQ");
  active_family().store(k, std::memory_order_relaxed);
}

CpuKernels active_cpu_kernels() { return active_family().load(std::memory_order_relaxed); }

const char* cpu_kernels_name(CpuKernels k) {
  switch (k) {
    case CpuKernels::Auto: return "auto";
    case CpuKernels::Scalar: return "scalar";
    case CpuKernels::Avx2: return "avx2";
    case CpuKernels::Avx512: return "avx512";
  }
  return "?";
}

CpuKernels parse_cpu_kernels(const std::string& s) {
  if (s == "auto") return CpuKernels::Auto;
  if (s == "scalar") return CpuKernels::Scalar;
  if (s == "avx2") return CpuKernels::Avx2;
  if (s == "avx512") return CpuKernels::Avx512;
  throw std::invalid_argument("unknown cpu kernel family '" + s + "' (expected scalar|avx2|avx512|auto)");
}

void set_act_quant(ActQuant a) { act_mode().store(a, std::memory_order_relaxed); }

ActQuant active_act_quant() {
  const ActQuant a = act_mode().load(std::memory_order_relaxed);
  if (a != ActQuant::Auto) return a;
  // int8 kernels exist in the AVX-512 and AVX2 families (the scalar one would only run the
  // definition, exact but slow)
  return active_cpu_kernels() == CpuKernels::Scalar ? ActQuant::F32 : ActQuant::Q8;
}

const char* act_quant_name(ActQuant a) {
  switch (a) {
    case ActQuant::Auto: return "auto";
    case ActQuant::F32: return "f32";
    case ActQuant::Q8: return "q8";
  }
  return "?";
}

ActQuant parse_act_quant(const std::string& s) {
  if (s == "auto") return ActQuant::Auto;
  if (s == "f32") return ActQuant::F32;
  if (s == "q8") return ActQuant::Q8;
  throw std::invalid_argument("unknown activation mode '" + s + "' (expected f32|q8|auto)");
}

bool has_q8_activations(GgmlType t) { return active_act_quant() == ActQuant::Q8 && detail::has_q8_kernel(t); }

namespace detail {
const char* type_name(GgmlType t) {
  switch (t) {
#define STRATA_QUANT_NAME(x) \
  case GgmlType::x: return #x;
    STRATA_QUANT_NAME(F32) STRATA_QUANT_NAME(F16) STRATA_QUANT_NAME(BF16) STRATA_QUANT_NAME(Q8_0)
    STRATA_QUANT_NAME(Q4_0) STRATA_QUANT_NAME(Q4_1) STRATA_QUANT_NAME(Q5_0) STRATA_QUANT_NAME(Q5_1)
    STRATA_QUANT_NAME(Q2_K) STRATA_QUANT_NAME(Q3_K) STRATA_QUANT_NAME(Q4_K) STRATA_QUANT_NAME(Q5_K)
    STRATA_QUANT_NAME(Q6_K) STRATA_QUANT_NAME(IQ2_XS) STRATA_QUANT_NAME(IQ3_S) STRATA_QUANT_NAME(IQ4_XS)
    STRATA_QUANT_NAME(IQ4_NL) STRATA_QUANT_NAME(MXFP4)
#undef STRATA_QUANT_NAME
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

void ActQ8::resize(int64_t n_tok_, int64_t cols_, GgmlType for_type) {
  if (cols_ <= 0 || cols_ % 32 != 0 || n_tok_ < 0)
    throw std::runtime_error("quant: q8 activations need a positive multiple of 32 columns, got " + std::to_string(cols_));
  cols = cols_;
  n_tok = n_tok_;
  const auto grow = [](auto& v, int64_t n) {
    if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
  };
  grow(q, n_tok * cols);
  grow(d, n_tok * cols / 32);
  grow(s16, n_tok * cols / 16);
  lanes = detail::has_lane_order(for_type) && cols % 256 == 0 ? for_type : GgmlType::F32;
  if (lanes != GgmlType::F32) {
    grow(ql, n_tok * cols);
    grow(dxl, n_tok * cols / 16);
    grow(xs, n_tok * cols / 32);
  }
}

void quantize_activations(const float* x, int64_t ldx, int64_t t0, int64_t t1, ActQ8& a) {
  if (t0 < 0 || t1 > a.n_tok || t0 > t1) throw std::runtime_error("quant::quantize_activations: token range outside the buffer");
  const CpuKernels fam = active_cpu_kernels();
  const int64_t nb = a.cols / 32;
  for (int64_t t = t0; t < t1; ++t) {
    const float* xt = x + t * ldx;
    int8_t* q = a.q.data() + t * a.cols;
    float* d = a.d.data() + t * nb;
    int16_t* s = a.s16.data() + t * 2 * nb;
    for (int64_t b = 0; b < nb; ++b) {
      if (fam == CpuKernels::Avx512) {
        d[b] = detail::quantize_block_q8_avx512(xt + 32 * b, q + 32 * b, s + 2 * b);
        continue;
      }
      if (fam == CpuKernels::Avx2) {
        d[b] = detail::quantize_block_q8_avx2(xt + 32 * b, q + 32 * b, s + 2 * b);
        continue;
      }
      d[b] = detail::quantize_block_q8(xt + 32 * b, q + 32 * b);
      for (int h = 0; h < 2; ++h) {
        int sum = 0;
        for (int k = 0; k < 16; ++k) sum += q[32 * b + 16 * h + k];
        s[2 * b + h] = static_cast<int16_t>(sum);
      }
    }
  }
  if (a.lanes != GgmlType::F32)
    detail::lane_order(a.lanes, a, t0, t1, a.ql.data() + t0 * a.cols, a.dxl.data() + t0 * (a.cols / 16),
                       a.xs.data() + t0 * (a.cols / 32));
}

void matmul_q8(GgmlType t, const void* W, size_t row_bytes, int64_t row_begin, int64_t row_end, int64_t cols,
               const ActQ8& act, float* y, int64_t ldy) {
  if (!has_q8_activations(t)) throw std::runtime_error("quant::matmul_q8: no q8 activations for " + std::string(detail::type_name(t)));
  if (act.cols != cols) throw std::runtime_error("quant::matmul_q8: activations have " + std::to_string(act.cols) + " columns, W has " + std::to_string(cols));
  if (row_begin < 0 || row_end < row_begin) throw std::runtime_error("quant::matmul_q8: bad row range");
  if (row_bytes < row_size(t, cols)) throw std::runtime_error("quant::matmul_q8: row_bytes smaller than one row");
  if (row_end == row_begin || act.n_tok == 0) return;
  run_q8({t, static_cast<const uint8_t*>(W), row_bytes, row_begin, row_end, cols, nullptr, 0, act.n_tok, y, ldy}, act);
}

void matmul(GgmlType t, const void* W, size_t row_bytes, int64_t row_begin, int64_t row_end, int64_t cols,
            const float* x, int64_t ldx, int64_t n_tok, float* y, int64_t ldy) {
  const detail::Geometry g = detail::geometry(t);
  if (!detail::implemented(t)) throw std::runtime_error("quant::matmul: unsupported type " + std::string(detail::type_name(t)));
  if (cols <= 0 || cols % g.elems != 0)
    throw std::runtime_error("quant::matmul: cols=" + std::to_string(cols) + " is not a positive multiple of the " +
                             std::to_string(g.elems) + "-element block of " + std::string(detail::type_name(t)));
  if (row_begin < 0 || row_end < row_begin || n_tok < 0)
    throw std::runtime_error("quant::matmul: bad row range or token count");
  if (row_bytes < row_size(t, cols)) throw std::runtime_error("quant::matmul: row_bytes smaller than one row");
  if (row_end == row_begin || n_tok == 0) return;
  const detail::MatmulArgs a{t, static_cast<const uint8_t*>(W), row_bytes, row_begin, row_end, cols, x, ldx, n_tok, y, ldy};
  if (has_q8_activations(t)) {
    thread_local ActQ8 act;
    act.resize(n_tok, cols, t);
    quantize_activations(x, ldx, 0, n_tok, act);
    run_q8(a, act);
    return;
  }
  switch (active_cpu_kernels()) {
    case CpuKernels::Avx512:
      if (detail::matmul_avx512(a)) return;
      [[fallthrough]];
    case CpuKernels::Avx2:
      if (detail::matmul_avx2(a)) return;
      [[fallthrough]];
    default: detail::matmul_scalar(a);
  }
}

}  // namespace strata::quant
