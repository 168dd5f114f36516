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
// The one exception: mv16_q8_kernel on one model weight matrix copies its first stage of
// weights (memory no kernel writes) before the wait, so that those reads overlap the kernel
// before it; it waits before any other global access and on every path.
// Results are the same bits with and without (STRATA_CUDA_PDL=0 turns the attribute off).
#include <cuda_runtime.h>

#include <utility>

#include "backend/cuda/cuda_check.h"

namespace strata::cuda::detail {

/// First statement of every kernel: waits until the kernel before this one in the stream has
/// completed and its writes are visible, then lets the next kernel launch. Both instructions are
/// no-ops when the launch had no programmatic dependency (and are left out before sm_90).
__device__ __forceinline__ void grid_dependency_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
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
}

}  // namespace strata::cuda::detail
