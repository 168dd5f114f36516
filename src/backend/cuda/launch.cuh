#pragma once
// Internal to the CUDA kernels (included by .cu files only): every kernel launch of the backend
// goes through detail::launch, and every kernel starts with detail::grid_dependency_enter().
//
// Programmatic dependent launch (CUDA programming guide, "Programmatic Dependent Launch and
// Synchronization"; PTX ISA, griddepcontrol, sm_90 and later): a kernel launched with the
// attribute cudaLaunchAttributeProgrammaticStreamSerialization may start while the kernel before
// it in the stream is still running, once every block of that one has executed
// `griddepcontrol.launch_dependents` (or exited). Its blocks then wait in `griddepcontrol.wait`
// until the earlier kernel has completed and its memory writes are visible. Decode runs ~18 small
// kernels a layer back to back; with this, a kernel's launch and block start-up overlap the tail
// of the one before instead of following it.
//
// The rule that keeps it exact: grid_dependency_enter() is the first statement of every kernel,
// before any global read or write and before any early return, so no kernel touches memory before
// the one before it has finished (reads after writes and writes after reads alike), and a kernel
// completes only after its predecessor did (so waiting for the latest kernel waits for all). It
// allows the next kernel to launch only after the wait, so at most one kernel waits ahead.
// The exception: the q8 mat-vecs on one model weight matrix (mv16_q8_kernel, mv2_q8_kernel)
// copy their first stage of weights, and the RMSNorm kernels (rms_norm_kernel,
// add_rms_norm_kernel) load their weight vector, before the wait (memory no kernel writes), so
// that those reads overlap the kernel before it; each waits before any other global access and
// on every path.
// Results are the same bits with and without (STRATA_CUDA_PDL=0 turns the attribute off).
#include <cuda_runtime.h>

#include <utility>

#include "backend/cuda/cuda_check.h"

namespace strata::cuda::detail {

#ifdef STRATA_CUDA_STAMPS
// In-chain timing stamps (a profiling build, CMake STRATA_CUDA_STAMPS=ON; docs/cuda.md "Stamps"):
// block 0's thread 0 of every kernel writes %globaltimer (PTX ISA, special registers: ns) right
// after its dependency wait, which returns when the kernel before it has completed. The
// difference between consecutive stamps is therefore what each kernel adds to the stream's
// chain, with programmatic dependent launch and every overlap as they run. Word 0 of the buffer
// counts the stamps; stamp i is launch i noted by detail::launch (stamps_note).
namespace {
__device__ unsigned long long* g_stamps = nullptr;  // this translation unit's copy (no device linking)
void set_tu_stamps(unsigned long long* p) { STRATA_CUDA_CHECK(cudaMemcpyToSymbol(g_stamps, &p, sizeof p)); }
[[maybe_unused]] const bool g_stamps_registered = register_stamp_setter(&set_tu_stamps);
__device__ __forceinline__ void take_stamp() {
  if ((threadIdx.x | threadIdx.y | threadIdx.z | blockIdx.x | blockIdx.y | blockIdx.z) != 0) return;
  unsigned long long* b = g_stamps;
  if (!b) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  const unsigned long long i = atomicAdd(b, 1ull);
  if (i < kStampCap) b[1 + i] = t;
}
}  // namespace
#endif

/// First statement of every kernel: waits until the kernel before this one in the stream has
/// completed and its writes are visible, then lets the next kernel launch. Both instructions are
/// no-ops when the launch had no programmatic dependency (and are left out before sm_90).
__device__ __forceinline__ void grid_dependency_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
#ifdef STRATA_CUDA_STAMPS
  take_stamp();
#endif
}

/// Whether launches on the current device carry the programmatic-serialization attribute: the
/// device's compute capability is 9.0 or later and STRATA_CUDA_PDL is not "0" (read once).
/// Throws CudaError when the device cannot be queried.
bool pdl_enabled();

/// Launches kernel<<<grid, block, smem, stream>>>(args...) through cudaLaunchKernelEx, with
/// programmatic stream serialization where pdl_enabled(). Throws CudaError (file and line of this
/// helper's caller are not known: the message names the kernel launch) on a bad configuration.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  STRATA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
#ifdef STRATA_CUDA_STAMPS
  stamps_note(reinterpret_cast<const void*>(kernel), grid, block);
#endif
}

}  // namespace strata::cuda::detail
