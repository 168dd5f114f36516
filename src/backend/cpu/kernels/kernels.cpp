// Public entry points of the CPU kernels: resolving a KernelConfig (CPUID), argument checking,
// and dispatch of matmul to the family the config names.
#include "backend/cpu/kernels/kernels.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "backend/cpu/kernels/act_q8.h"
#include "backend/cpu/kernels/kernels_impl.h"

namespace strata::cpu::kernels {

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

// The q8 family of k: AVX-512 or AVX2 kernels (the type has one in both), else the scalar
// definition; all give the same bits except Q8_0, Q4_K and IQ4_XS in the AVX-512 family and Q8_0
// in the AVX2 family, whose definitions are the serial ones of matmul_q8_scalar_avx512 (for Q8_0
// the CUDA q8 arithmetic; matmul_q8_scalar_avx2).
void run_q8(const KernelConfig& k, const detail::MatmulArgs& a, const ActQ8& act) {
  // the AVX-512 sub-level (VNNI, GFNI/VBMI) is a property of the CPU, not a choice
  static const detail::Q8Isa isa = cpu_has_avx512() ? detail::best_q8_isa() : detail::Q8Isa::Avx512;
  if (k.family == CpuKernels::Avx512 && detail::matmul_q8_avx512(a, act, isa)) return;
  if (k.family == CpuKernels::Avx2 && detail::matmul_q8_avx2(a, act)) return;
  detail::matmul_q8_scalar(a, act);
}

}  // namespace

namespace detail {

// (here, in a translation unit compiled for any x86-64: the test may run on a CPU without AVX-512)
bool amx_int8_usable() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return false;  // OSXSAVE (xgetbv)
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1)) return false;
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo >> 17 & 3) != 3) return false;  // XTILECFG, XTILEDATA enabled by the OS
#ifdef __linux__
    constexpr int kGetPerm = 0x1022, kReqPerm = 0x1023, kXtileData = 18;
    if (syscall(SYS_arch_prctl, kReqPerm, kXtileData) != 0) return false;
    unsigned long perm = 0;
    if (syscall(SYS_arch_prctl, kGetPerm, &perm) != 0) return false;
    return (perm >> kXtileData & 1) != 0;
#else
    return false;
#endif
  }();
  return ok;
}

namespace {
std::atomic<int> g_avx_vnni{-1};  // -1: not read yet; else 0 / 1
}  // namespace

bool avx_vnni_enabled() {
  int v = g_avx_vnni.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* e = std::getenv("STRATA_CPU_AVXVNNI");
    int want = e && std::string(e) == "0" ? 0 : 1;
    g_avx_vnni.compare_exchange_strong(v, want, std::memory_order_relaxed);
    v = g_avx_vnni.load(std::memory_order_relaxed);
  }
  return v != 0;
}

void set_avx_vnni_enabled(bool on) { g_avx_vnni.store(on ? 1 : 0, std::memory_order_relaxed); }

bool avx_vnni_usable() {
  // CPUID.(EAX=7, ECX=1):EAX bit 4 = AVX-VNNI (Intel SDM vol. 2, CPUID); the OS must save the
  // ymm state, which AVX2 (cpu_has_avx2, checked by the caller's family) already needs.
  static const bool cpu = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1) && cpu_has_avx2();
  }();
  return cpu && avx_vnni_enabled();
}

}  // namespace detail

KernelConfig resolve_kernels(CpuKernels family, ActQuant act) {
  // STRATA_CPU_KERNELS=scalar|avx2|avx512 stands for `auto` (so that a whole test run can go
  // through one family, e.g. the AVX2 one on an AVX-512 machine); an explicit choice wins.
  if (family == CpuKernels::Auto)
    if (const char* e = std::getenv("STRATA_CPU_KERNELS"); e && *e) family = parse_cpu_kernels(e);
  if (family == CpuKernels::Auto) family = best_family();
  if (family == CpuKernels::Avx2 && !cpu_has_avx2())
    throw std::runtime_error("cpu kernels: avx2 requested but this CPU lacks AVX2/FMA/F16C/BMI2");
  if (family == CpuKernels::Avx512 && !cpu_has_avx512())
    throw std::runtime_error("cpu kernels: avx512 requested but this CPU lacks AVX-512 F/BW/VL/DQ");
  // int8 kernels exist in the AVX-512 and AVX2 families (the scalar one would only run the
  // definition, exact but slow)
  if (act == ActQuant::Auto) act = family == CpuKernels::Scalar ? ActQuant::F32 : ActQuant::Q8;
  return {family, act};
}

const char* cpu_kernels_name(CpuKernels k) {
  switch (k) {
    case CpuKernels::Auto: return "auto";
    case CpuKernels::Scalar: return "scalar";
    case CpuKernels::Avx2: return "avx2";
    case CpuKernels::Avx512: return "avx512";
  }
  return "?";
}

std::string cpu_kernels_label(const KernelConfig& k) {
  std::string s = cpu_kernels_name(k.family);
  if (k.act != ActQuant::Q8) return s;
  if (k.family == CpuKernels::Avx2 && detail::avx_vnni_usable()) s += " + AVX-VNNI";
  if (k.family == CpuKernels::Avx512 && cpu_has_avx512()) {
    const detail::Q8Isa isa = detail::best_q8_isa();
    s += isa == detail::Q8Isa::Avx512Amx ? " + AMX" : isa == detail::Q8Isa::Avx512 ? "" : " + VNNI";
  }
  return s;
}

CpuKernels parse_cpu_kernels(const std::string& s) {
  if (s == "auto") return CpuKernels::Auto;
  if (s == "scalar") return CpuKernels::Scalar;
  if (s == "avx2") return CpuKernels::Avx2;
  if (s == "avx512") return CpuKernels::Avx512;
  throw std::invalid_argument("unknown cpu kernel family '" + s + "' (expected scalar|avx2|avx512|auto)");
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

bool has_q8_activations(const KernelConfig& k, GgmlType t) { return k.act == ActQuant::Q8 && detail::has_q8_kernel(t); }

void ActQ8::resize(int64_t n_tok_, int64_t cols_, GgmlType for_type) {
  if (cols_ <= 0 || cols_ % 32 != 0 || n_tok_ < 0)
    throw std::runtime_error("cpu::kernels: q8 activations need a positive multiple of 32 columns, got " +
                             std::to_string(cols_));
  cols = cols_;
  n_tok = n_tok_;
  const auto grow = [](auto& v, int64_t n) { v.grow(static_cast<size_t>(n)); };
  grow(q, n_tok * cols);
  grow(d, n_tok * cols / 32);
  grow(s16, n_tok * cols / 16);
  lanes = detail::has_lane_order(for_type) && cols % 256 == 0 ? for_type : GgmlType::F32;
  if (lanes != GgmlType::F32) {
    grow(ql, n_tok * cols);
    grow(dxl, n_tok * cols / 16);
    grow(xs, n_tok * cols / 32);
  }
  // (the Q8_0 mat-vec reads the natural order: no layout for decode-sized inputs)
  tok16 = detail::has_tok16(for_type) && n_tok > detail::kQ8_0MatVecMax;
  tok16_xs = tok16 && for_type == GgmlType::Q4_K;
  if (tok16) {
    const int64_t groups = (n_tok + 15) / 16;
    grow(xg, groups * 16 * cols);
    grow(dxg, groups * 16 * (cols / 32));
    if (tok16_xs) grow(xsg, groups * 16 * (cols / 32));
  }
}

void quantize_activations(const KernelConfig& k, const float* x, int64_t ldx, int64_t t0, int64_t t1, ActQ8& a) {
  if (t0 < 0 || t1 > a.n_tok || t0 > t1)
    throw std::runtime_error("cpu::kernels::quantize_activations: token range outside the buffer");
  const CpuKernels fam = k.family;
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
        for (int j = 0; j < 16; ++j) sum += q[32 * b + 16 * h + j];
        s[2 * b + h] = static_cast<int16_t>(sum);
      }
    }
  }
  if (a.lanes != GgmlType::F32)
    detail::lane_order(a.lanes, a, t0, t1, a.ql.data() + t0 * a.cols, a.dxl.data() + t0 * (a.cols / 16),
                       a.xs.data() + t0 * (a.cols / 32));
  if (a.tok16) detail::token_lanes(a, t0, t1, a.xg.data(), a.dxg.data(), a.tok16_xs ? a.xsg.data() : nullptr);
}

void matmul_q8(const KernelConfig& k, GgmlType t, const void* W, size_t row_bytes, int64_t row_begin, int64_t row_end,
               int64_t cols, const ActQ8& act, float* y, int64_t ldy) {
  if (!has_q8_activations(k, t))
    throw std::runtime_error("cpu::kernels::matmul_q8: no q8 activations for " + std::string(detail::type_name(t)));
  if (act.cols != cols)
    throw std::runtime_error("cpu::kernels::matmul_q8: activations have " + std::to_string(act.cols) +
                             " columns, W has " + std::to_string(cols));
  if (row_begin < 0 || row_end < row_begin) throw std::runtime_error("cpu::kernels::matmul_q8: bad row range");
  if (row_bytes < quant::row_size(t, cols))
    throw std::runtime_error("cpu::kernels::matmul_q8: row_bytes smaller than one row");
  if (row_end == row_begin || act.n_tok == 0) return;
  run_q8(k, {t, static_cast<const uint8_t*>(W), row_bytes, row_begin, row_end, cols, nullptr, 0, act.n_tok, y, ldy},
         act);
}

void matmul(const KernelConfig& k, GgmlType t, const void* W, size_t row_bytes, int64_t row_begin, int64_t row_end,
            int64_t cols, const float* x, int64_t ldx, int64_t n_tok, float* y, int64_t ldy) {
  const detail::Geometry g = detail::geometry(t);
  if (!detail::implemented(t))
    throw std::runtime_error("cpu::kernels::matmul: unsupported type " + std::string(detail::type_name(t)));
  if (cols <= 0 || cols % g.elems != 0)
    throw std::runtime_error("cpu::kernels::matmul: cols=" + std::to_string(cols) +
                             " is not a positive multiple of the " + std::to_string(g.elems) + "-element block of " +
                             std::string(detail::type_name(t)));
  if (row_begin < 0 || row_end < row_begin || n_tok < 0)
    throw std::runtime_error("cpu::kernels::matmul: bad row range or token count");
  if (row_bytes < quant::row_size(t, cols))
    throw std::runtime_error("cpu::kernels::matmul: row_bytes smaller than one row");
  if (row_end == row_begin || n_tok == 0) return;
  const detail::MatmulArgs a{t,  static_cast<const uint8_t*>(W), row_bytes, row_begin, row_end, cols, x, ldx, n_tok, y,
                             ldy};
  if (has_q8_activations(k, t)) {
    thread_local ActQ8 act;
    act.resize(n_tok, cols, t);
    quantize_activations(k, x, ldx, 0, n_tok, act);
    run_q8(k, a, act);
    return;
  }
  switch (k.family) {
    case CpuKernels::Avx512:
      if (detail::matmul_avx512(a)) return;
      [[fallthrough]];
    case CpuKernels::Avx2:
      if (detail::matmul_avx2(a)) return;
      [[fallthrough]];
    default: detail::matmul_scalar(a);
  }
}

}  // namespace strata::cpu::kernels
