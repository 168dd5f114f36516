// Device queries, memory helpers and the error paths of cuda_check.h.
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/env_switch.h"
#include "backend/cuda/launch.cuh"

namespace strata::cuda {

namespace detail {

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  throw CudaError(std::string("CUDA error ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ") in " + expr +
                  " at " + file + ":" + std::to_string(line));
}

void opt_in_smem(const void* func, int bytes) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, int> done;
  int dev = 0;
  STRATA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  int& have = done[{dev, func}];
  if (have >= bytes) return;
  STRATA_CUDA_CHECK(cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  have = bytes;
}

bool pdl_enabled() {
  static EnvSwitch env{"STRATA_CUDA_PDL", off_if_zero};
  if (!env.get()) return false;
  constexpr int kMaxDevices = 64;
  static std::atomic<signed char> known[kMaxDevices] = {};  // 0 unknown, 1 yes, -1 no
  int dev = 0;
  STRATA_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) return false;
  signed char k = known[dev].load(std::memory_order_relaxed);
  if (k == 0) {
    int major = 0;
    STRATA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    k = major >= 9 ? 1 : -1;
    known[dev].store(k, std::memory_order_relaxed);
  }
  return k > 0;
}

void throw_arg_error(const std::string& what, const char* file, int line) {
  throw CudaError("strata::cuda: " + what + " (" + file + ":" + std::to_string(line) + ")");
}

}  // namespace detail

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return n;
}

void set_device(int dev) { STRATA_CUDA_CHECK(cudaSetDevice(dev)); }

std::string device_description(int dev) {
  cudaDeviceProp p{};
  STRATA_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  char gib[32];
  snprintf(gib, sizeof gib, "%.1f", double(p.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  return std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.multiProcessorCount) + " SMs, " + gib + " GiB)";
}

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    (void)cudaMemGetInfo(&free_b, &total_b);
    throw CudaError("strata::cuda: cudaMalloc of " + std::to_string(bytes) + " bytes failed: " +
                    cudaGetErrorString(e) + " (" + std::to_string(free_b) + " of " + std::to_string(total_b) +
                    " bytes free)");
  }
  return p;
}

void device_free(void* p) noexcept {
  if (p) (void)cudaFree(p);
}

void copy_to_device(void* dst, const void* src, size_t bytes) {
  STRATA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void copy_to_host(void* dst, const void* src, size_t bytes) {
  STRATA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

void synchronize(void* stream) { STRATA_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream))); }

}  // namespace strata::cuda
