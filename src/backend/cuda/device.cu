// Device queries, memory helpers and the error paths of cuda_check.h.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
#ifdef STRATA_CUDA_STAMPS
#include <cxxabi.h>
#endif

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

#ifdef STRATA_CUDA_STAMPS
namespace {
struct StampNote {
  const void* kernel;
  dim3 grid, block;
};
struct StampRow {
  double total_ns = 0;
  uint64_t n = 0;
};
struct Stamps {
  std::mutex mu;
  std::vector<void (*)(unsigned long long*)> setters;
  unsigned long long* buf = nullptr;  // device: [0] count, [1..] stamps
  std::vector<StampNote> notes;
  std::map<std::string, StampRow> rows;
  uint64_t launches = 0, unpaired = 0, mismatched = 0;
  double all_ns = 0;
};
Stamps& stamps() {
  static Stamps s;
  return s;
}
std::string kernel_name(const void* k) {
  const char* n = nullptr;
  if (cudaFuncGetName(&n, k) != cudaSuccess || !n) {
    (void)cudaGetLastError();
    return "?";
  }
  int st = 0;
  char* d = abi::__cxa_demangle(n, nullptr, nullptr, &st);
  std::string r = st == 0 && d ? d : n;
  std::free(d);
  // the kernel's name and template arguments, without the namespaces (first: "(anonymous
  // namespace)" holds a parenthesis), the parameter list or the return type
  for (const char* ns : {"(anonymous namespace)::", "strata::cuda::", "detail::"})
    for (size_t q; (q = r.find(ns)) != std::string::npos;) r.erase(q, std::string_view(ns).size());
  if (const size_t p = r.find('('); p != std::string::npos) r.resize(p);
  if (r.rfind("void ", 0) == 0) r.erase(0, 5);
  return r.empty() ? std::string(n) : r;
}
}  // namespace

bool register_stamp_setter(void (*set)(unsigned long long*)) {
  Stamps& s = stamps();
  std::lock_guard<std::mutex> lock(s.mu);
  s.setters.push_back(set);
  return true;
}

void stamps_note(const void* kernel, dim3 grid, dim3 block) {
  Stamps& s = stamps();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.buf && s.notes.size() < kStampCap) s.notes.push_back({kernel, grid, block});
}

void stamps_collect() {
  Stamps& s = stamps();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.buf) {  // the first call: the buffer, every translation unit's symbol, nothing to collect
    STRATA_CUDA_CHECK(cudaDeviceSynchronize());
    void* p = nullptr;
    STRATA_CUDA_CHECK(cudaMalloc(&p, sizeof(unsigned long long) * (1 + kStampCap)));
    STRATA_CUDA_CHECK(cudaMemset(p, 0, sizeof(unsigned long long)));
    s.buf = static_cast<unsigned long long*>(p);
    for (auto* set : s.setters) set(s.buf);
    STRATA_CUDA_CHECK(cudaDeviceSynchronize());
    s.notes.clear();
    return;
  }
  STRATA_CUDA_CHECK(cudaDeviceSynchronize());
  unsigned long long n = 0;
  STRATA_CUDA_CHECK(cudaMemcpy(&n, s.buf, sizeof n, cudaMemcpyDeviceToHost));
  n = std::min<unsigned long long>(n, kStampCap);
  std::vector<unsigned long long> t(n);
  if (n) STRATA_CUDA_CHECK(cudaMemcpy(t.data(), s.buf + 1, n * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  if (n != s.notes.size()) ++s.mismatched;  // a kernel that stamps without being noted, or the reverse
  const size_t m = std::min<size_t>(n, s.notes.size());
  s.launches += m;
  static std::map<const void*, std::string> names;
  for (size_t i = 0; i + 1 < m; ++i) {
    const StampNote& k = s.notes[i];
    auto it = names.find(k.kernel);
    if (it == names.end()) it = names.emplace(k.kernel, kernel_name(k.kernel)).first;
    char key[64];
    snprintf(key, sizeof key, " %ux%ux%u %u", k.grid.x, k.grid.y, k.grid.z, k.block.x * k.block.y * k.block.z);
    StampRow& r = s.rows[it->second + key];
    const double d = double(t[i + 1] - t[i]);
    r.total_ns += d, ++r.n, s.all_ns += d;
  }
  if (m) ++s.unpaired;  // the last stamp of each collection has no successor
  s.notes.clear();
  STRATA_CUDA_CHECK(cudaMemset(s.buf, 0, sizeof(unsigned long long)));
}

void stamps_report() {
  stamps_collect();
  Stamps& s = stamps();
  std::lock_guard<std::mutex> lock(s.mu);
  const char* path = std::getenv("STRATA_CUDA_STAMPS_OUT");
  FILE* f = path && *path ? std::fopen(path, "w") : nullptr;
  FILE* o = f ? f : stderr;
  std::vector<std::pair<std::string, StampRow>> v(s.rows.begin(), s.rows.end());
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second.total_ns > b.second.total_ns; });
  std::fprintf(o, "# strata cuda stamps: %llu launches, %.3f ms between stamps, %llu collections (the last launch of "
               "each unpaired), %llu with a count mismatch\n# total_ms n avg_us name grid block_threads\n",
               (unsigned long long)s.launches, s.all_ns / 1e6, (unsigned long long)s.unpaired,
               (unsigned long long)s.mismatched);
  for (const auto& [k, r] : v)
    std::fprintf(o, "%10.3f %8llu %9.2f %s\n", r.total_ns / 1e6, (unsigned long long)r.n, r.total_ns / 1e3 / double(r.n),
                 k.c_str());
  if (f) std::fclose(f);
  s.rows.clear(), s.launches = s.unpaired = s.mismatched = 0, s.all_ns = 0;
}
#endif

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
