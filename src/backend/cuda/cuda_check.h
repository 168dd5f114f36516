#pragma once
// Checked CUDA runtime calls: STRATA_CUDA_CHECK(expr) throws strata::cuda::CudaError with the
// CUDA error name and string, the expression, the file and the line; it never aborts.
// Include only from .cu / CUDA-aware sources (it includes cuda_runtime.h).
#include <cuda_runtime.h>

#include "backend/cuda/kernels.h"

namespace strata::cuda::detail {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);
/// Throws CudaError("<what> (file:line)") for an argument the kernels cannot take.
[[noreturn]] void throw_arg_error(const std::string& what, const char* file, int line);

/// cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) on the current
/// device, skipped when this kernel was already opted in to `bytes` or more there: the call costs
/// host time on every launch otherwise (decode launches each kernel hundreds of times a token).
/// Thread-safe. Throws CudaError as STRATA_CUDA_CHECK.
void opt_in_smem(const void* func, int bytes);

#ifdef STRATA_CUDA_STAMPS
// In-chain timing stamps of a profiling build (CMake STRATA_CUDA_STAMPS=ON; launch.cuh, docs/cuda.md "Stamps").
/// The stamp buffer's capacity (stamps).
constexpr unsigned long long kStampCap = 1ull << 22;
/// Registers a translation unit's setter of its stamp-buffer symbol (called at static init).
bool register_stamp_setter(void (*set)(unsigned long long*));
/// Notes launch i (kernel, grid, block) on the host, in stream order (detail::launch).
void stamps_note(const void* kernel, dim3 grid, dim3 block);
/// The first call allocates the device buffer and points every translation unit's symbol at it
/// (synchronizes the device). Later calls copy the stamps taken so far to the host, pair stamp i
/// with noted launch i and add each kernel's in-chain time (its stamp to the next one's, ns) to a
/// table keyed by kernel name, grid and block threads, then reset the buffer. Throws CudaError.
void stamps_collect();
/// Collects, then writes the table (largest total first) to $STRATA_CUDA_STAMPS_OUT, else to
/// stderr, and clears it.
void stamps_report();
#endif

}  // namespace strata::cuda::detail

#define STRATA_CUDA_CHECK(expr)                                                              \
  do {                                                                                       \
    const cudaError_t strata_cuda_err_ = (expr);                                             \
    if (strata_cuda_err_ != cudaSuccess)                                                     \
      ::strata::cuda::detail::throw_cuda_error(strata_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

/// After a kernel launch: a bad configuration is reported at the launch site.
#define STRATA_CUDA_CHECK_LAUNCH() STRATA_CUDA_CHECK(cudaGetLastError())

/// Argument check on the host, before any launch.
#define STRATA_CUDA_REQUIRE(cond, msg)                                                          \
  do {                                                                                          \
    if (!(cond)) ::strata::cuda::detail::throw_arg_error(std::string(msg), __FILE__, __LINE__); \
  } while (0)
