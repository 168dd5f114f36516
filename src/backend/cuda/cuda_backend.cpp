// CudaBackend (contracts in cuda_backend.h and backend/backend.h).
#include "backend/cuda/cuda_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>

#include "backend/cuda/backend_kernels.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/family_kernels.h"
#include "backend/cuda/route.h"

namespace strata::cuda {

using backend::BufferRole;
using backend::Place;
using backend::Tensor;

struct CudaContext {
  int device = 0;
  cudaStream_t stream = nullptr;
  ~CudaContext() {
    if (stream) {
      (void)cudaSetDevice(device);
      (void)cudaStreamSynchronize(stream);
      (void)cudaStreamDestroy(stream);
    }
  }
};

namespace {

constexpr size_t kAlign = 256;          // carve alignment of scratch regions (bytes)
constexpr size_t kRingBytes = 8 << 20;  // pinned upload ring (bytes)
constexpr uint64_t kPoolKeepBytes = uint64_t(256) << 20;  // freed pool memory kept across syncs
constexpr size_t kMaxAttnPartBytes = size_t(64) << 20;  // the persistent attention partials' cap
constexpr double kMiB = 1024.0 * 1024.0;

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

const char* role_name(BufferRole r) {
  switch (r) {
    case BufferRole::Weights: return "weights";
    case BufferRole::Activations: return "activations";
    case BufferRole::State: return "state";
    case BufferRole::Arena: return "arena";
    case BufferRole::Staging: return "staging";
  }
  return "?";
}

// Throws a CudaError naming the sizes when `bytes` of device memory are more than is free.
void require_vram(int device, size_t bytes, const char* what) {
  size_t free_b = 0, total_b = 0;
  STRATA_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (bytes > free_b)
    throw CudaError(
        fmt::format("strata::cuda: {} needs {:.1f} MiB of device memory but only {:.1f} MiB of {:.1f} MiB "
                    "are free on device {}",
                    what, double(bytes) / kMiB, double(free_b) / kMiB, double(total_b) / kMiB, device));
}

// A failed allocation as a CudaError naming the sizes.
[[noreturn]] void throw_alloc_error(cudaError_t e, int device, size_t bytes, const char* what) {
  (void)cudaGetLastError();
  size_t free_b = 0, total_b = 0;
  (void)cudaMemGetInfo(&free_b, &total_b);
  throw CudaError(
      fmt::format("strata::cuda: cannot allocate {:.1f} MiB for {} on device {} ({}): {:.1f} MiB of "
                  "{:.1f} MiB free",
                  double(bytes) / kMiB, what, device, cudaGetErrorString(e), double(free_b) / kMiB,
                  double(total_b) / kMiB));
}

// A grow-only device buffer in stream order: when `bytes` exceeds `cap`, frees `p` after the work
// queued on `stream` and allocates max(1 MiB, bytes + 25 %, rounded up to 1 MiB) there; returns p.
// Throws CudaError naming `what` and the sizes when the allocation fails (p is then null, cap 0).
char* grow_stream_buffer(void*& p, size_t& cap, size_t bytes, cudaStream_t stream, int device, const char* what) {
  if (bytes > cap) {
    if (p) STRATA_CUDA_CHECK(cudaFreeAsync(p, stream));
    p = nullptr;
    cap = 0;
    const size_t want = std::max<size_t>(align_up(bytes + bytes / 4, 1 << 20), 1 << 20);
    const cudaError_t e = cudaMallocAsync(&p, want, stream);
    if (e != cudaSuccess) throw_alloc_error(e, device, want, what);
    cap = want;
  }
  return static_cast<char*>(p);
}

// Pinned host memory, or 4 KiB-aligned pageable memory with a warning when pinning fails.
// Pinned bytes held, per allocation (for pinned_host_bytes(): memory reporting).
std::mutex g_pinned_mu;
std::map<const void*, size_t> g_pinned;
size_t g_pinned_total = 0;

uint8_t* host_alloc(size_t bytes, bool& pinned, const char* what) {
  void* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocPortable);
  if (e == cudaSuccess) {
    pinned = true;
    std::lock_guard lk(g_pinned_mu);
    g_pinned[p] = std::max<size_t>(bytes, 1);
    g_pinned_total += std::max<size_t>(bytes, 1);
    return static_cast<uint8_t*>(p);
  }
  (void)cudaGetLastError();
  fmt::print(stderr,
             "strata: warning: cannot pin {:.1f} MiB of host memory for {} ({}); using pageable memory "
             "(slower host-to-device copies)\n",
             double(bytes) / kMiB, what, cudaGetErrorString(e));
  pinned = false;
  p = std::aligned_alloc(4096, align_up(std::max<size_t>(bytes, 1), 4096));
  if (!p) throw std::bad_alloc();
  return static_cast<uint8_t*>(p);
}

void host_free(uint8_t* p, bool pinned) noexcept {
  if (!p) return;
  if (pinned) {
    {
      std::lock_guard lk(g_pinned_mu);
      if (auto it = g_pinned.find(p); it != g_pinned.end()) {
        g_pinned_total -= it->second;
        g_pinned.erase(it);
      }
    }
    (void)cudaFreeHost(p);
  } else
    std::free(p);
}

// A buffer of any role: device memory (activations stream-ordered), or pinned staging.
class CudaBuffer final : public backend::Buffer {
 public:
  CudaBuffer(std::shared_ptr<CudaContext> ctx, BufferRole role, size_t bytes)
      : ctx_(std::move(ctx)), role_(role), bytes_(bytes) {
    if (bytes == 0) return;
    STRATA_CUDA_CHECK(cudaSetDevice(ctx_->device));
    if (role == BufferRole::Staging) {
      data_ = host_alloc(bytes, pinned_, "a staging buffer");
      return;
    }
    const std::string what = fmt::format("a {} buffer", role_name(role));
    if (role != BufferRole::Activations) require_vram(ctx_->device, bytes, what.c_str());
    cudaError_t e =
        role == BufferRole::Activations ? cudaMallocAsync(&data_, bytes, ctx_->stream) : cudaMalloc(&data_, bytes);
    if (e != cudaSuccess) throw_alloc_error(e, ctx_->device, bytes, what.c_str());
    if (role == BufferRole::State) STRATA_CUDA_CHECK(cudaMemsetAsync(data_, 0, bytes, ctx_->stream));
  }
  ~CudaBuffer() override {
    if (!data_) return;
    (void)cudaSetDevice(ctx_->device);
    if (role_ == BufferRole::Staging)
      host_free(static_cast<uint8_t*>(data_), pinned_);
    else if (role_ == BufferRole::Activations)
      (void)cudaFreeAsync(data_, ctx_->stream);  // after the work queued on it
    else
      (void)cudaFree(data_);  // synchronizes the device first
  }
  BufferRole role() const override { return role_; }
  Place place() const override { return role_ == BufferRole::Staging ? Place::Host : Place::Device; }
  void* data() override { return data_; }
  size_t bytes() const override { return bytes_; }
  bool pinned() const override { return pinned_; }

 private:
  std::shared_ptr<CudaContext> ctx_;
  BufferRole role_;
  size_t bytes_;
  void* data_ = nullptr;
  bool pinned_ = false;
};

// A CUDA event recorded on the compute stream. cudaEventSynchronize / cudaEventQuery are
// thread-safe, so wait() and done() may be called from any thread.
class CudaEvent final : public backend::Event {
 public:
  CudaEvent(std::shared_ptr<CudaContext> ctx) : ctx_(std::move(ctx)) {
    STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
    STRATA_CUDA_CHECK(cudaEventRecord(ev_, ctx_->stream));
  }
  ~CudaEvent() override { (void)cudaEventDestroy(ev_); }
  void wait() override { STRATA_CUDA_CHECK(cudaEventSynchronize(ev_)); }
  bool done() override {
    const cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaErrorNotReady) return false;
    STRATA_CUDA_CHECK(e);
    return true;
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  cudaEvent_t ev_ = nullptr;
};

// The expert arena in device memory (see cuda_backend.h).
class DeviceArena final : public backend::ArenaMemory {
 public:
  DeviceArena(std::shared_ptr<CudaContext> ctx, size_t n_slots, size_t slot_bytes, int io_threads)
      : ctx_(std::move(ctx)), n_slots_(n_slots), slot_bytes_(slot_bytes) {
    if (slot_bytes == 0 || slot_bytes % 4096 != 0)
      throw std::invalid_argument(
          fmt::format("cuda arena: slot size {} bytes is not a positive multiple of 4 KiB", slot_bytes));
    if (io_threads < 1) throw std::invalid_argument("cuda arena: needs at least one IO thread");
    if (n_slots > SIZE_MAX / slot_bytes)
      throw std::invalid_argument(fmt::format("cuda arena: {} slots of {} bytes overflow", n_slots, slot_bytes));
    STRATA_CUDA_CHECK(cudaSetDevice(ctx_->device));
    const size_t bytes = n_slots * slot_bytes;
    const std::string what =
        fmt::format("the expert arena ({} slots x {:.1f} KiB)", n_slots, double(slot_bytes) / 1024.0);
    require_vram(ctx_->device, bytes, what.c_str());
    if (bytes > 0) {
      const cudaError_t e = cudaMalloc(&slots_, bytes);
      if (e != cudaSuccess) throw_alloc_error(e, ctx_->device, bytes, what.c_str());
    }
    io_.resize(size_t(io_threads));
    try {
      for (Io& io : io_) {
        io.staging = host_alloc(slot_bytes, io.pinned, "an expert staging buffer");
        STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&io.stream, cudaStreamNonBlocking));
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~DeviceArena() override { release(); }

  size_t n_slots() const override { return n_slots_; }
  size_t slot_bytes() const override { return slot_bytes_; }
  uint8_t* read_target(size_t, int io_thread) override { return io_[size_t(io_thread)].staging; }
  void land(size_t slot, int io_thread, size_t bytes, size_t offset) override {
    Io& io = io_[size_t(io_thread)];
    STRATA_CUDA_CHECK(cudaSetDevice(ctx_->device));
    STRATA_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(slots_) + slot * slot_bytes_ + offset, io.staging + offset,
                                      bytes, cudaMemcpyHostToDevice, io.stream));
    STRATA_CUDA_CHECK(cudaStreamSynchronize(io.stream));
  }
  // A host-tier hit or fill: host-to-device straight from the tier's (pinned) entry.
  void land_from(size_t slot, int io_thread, const uint8_t* src, size_t bytes, size_t offset) override {
    const HostRange r{src, bytes, offset};
    land_ranges(slot, io_thread, std::span<const HostRange>(&r, 1));
  }
  // A whole host-tier hit: every range's copy queued on this IO thread's stream, one
  // synchronization (not one copy and one synchronization per 256 KiB piece).
  // Opt-in (STRATA_CUDA_WHOLE_LANDING=1): measured on an H100 within the host tier's run-to-run
  // spread, not faster (docs/cuda.md, thirteenth session); pieces stay the default.
  bool lands_whole() const override {
    static detail::EnvSwitch whole_env{"STRATA_CUDA_WHOLE_LANDING", detail::on_if_set};
    return whole_env.get() != 0;
  }
  void land_ranges(size_t slot, int io_thread, std::span<const HostRange> ranges) override {
    Io& io = io_[size_t(io_thread)];
    STRATA_CUDA_CHECK(cudaSetDevice(ctx_->device));
    uint8_t* base = static_cast<uint8_t*>(slots_) + slot * slot_bytes_;
    for (const HostRange& r : ranges)
      if (r.bytes > 0)
        STRATA_CUDA_CHECK(cudaMemcpyAsync(base + r.offset, r.src, r.bytes, cudaMemcpyHostToDevice, io.stream));
    STRATA_CUDA_CHECK(cudaStreamSynchronize(io.stream));
  }
  const uint8_t* slot_data(size_t slot) const override {
    return static_cast<const uint8_t*>(slots_) + slot * slot_bytes_;
  }
  Place place() const override { return Place::Device; }

 private:
  struct Io {
    uint8_t* staging = nullptr;
    bool pinned = false;
    cudaStream_t stream = nullptr;
  };
  void release() noexcept {
    (void)cudaSetDevice(ctx_->device);
    for (Io& io : io_) {
      if (io.stream) (void)cudaStreamSynchronize(io.stream), (void)cudaStreamDestroy(io.stream);
      host_free(io.staging, io.pinned);
      io = Io{};
    }
    if (slots_) (void)cudaFree(slots_);
    slots_ = nullptr;
  }

  std::shared_ptr<CudaContext> ctx_;
  size_t n_slots_, slot_bytes_;
  void* slots_ = nullptr;
  std::vector<Io> io_;
};

// Floats between rows of an fp32 activation tensor.
int64_t ld(const Tensor& t) { return int64_t(t.row_bytes() / sizeof(float)); }

void require_device(const Tensor& t, const char* what) {
  if (t.place != Place::Device)
    throw CudaError(
        fmt::format("strata::cuda: {} is not in device memory (make it with the CUDA backend's alloc or weights)",
                    what));
}

// Bump allocator over one scratch region.
struct Carve {
  char* base;
  size_t off = 0;
  template <class T>
  T* take(size_t n) {
    T* p = reinterpret_cast<T*>(base + off);
    off += align_up(n * sizeof(T), kAlign);
    return p;
  }
};
template <class T>
size_t sz(size_t n) {
  return align_up(n * sizeof(T), kAlign);
}

}  // namespace

// ---- STRATA_CUDA_PROFILE: device time per backend call -----------------------------------------

/// Records a CUDA event pair around each profiled call on the compute stream (no synchronization
/// added, except a resolve every kBatch calls), sums the elapsed device time per (call, phase),
/// phase = "decode" for calls on 1 token, else "prefill". Host waits (the synchronizations of
/// router_logits / download) are timed on the host clock. The table goes to stderr at the end.
class OpProfile {
 public:
  explicit OpProfile(cudaStream_t s) : stream_(s) {}
  ~OpProfile() {
    try {
      resolve();
      std::vector<std::pair<std::string, Sum>> v(sums_.begin(), sums_.end());
      std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
      std::fprintf(stderr, "cuda profile: %-34s %8s %11s %9s\n", "call [phase]", "calls", "ms", "us/call");
      for (const auto& [k, x] : v)
        std::fprintf(stderr, "cuda profile: %-34s %8ld %11.3f %9.2f\n", k.c_str(), x.n, x.ms,
                     x.n ? 1e3 * x.ms / double(x.n) : 0.0);
      for (auto& r : free_) (void)cudaEventDestroy(r);
    } catch (...) {}
  }
  size_t begin(const char* name, int64_t T) {
    Rec r{name, T <= 1, open_ == 0, take(), nullptr};
    STRATA_CUDA_CHECK(cudaEventRecord(r.a, stream_));
    recs_.push_back(r);
    return recs_.size() - 1;
  }
  void end(size_t i) {
    recs_[i].b = take();
    STRATA_CUDA_CHECK(cudaEventRecord(recs_[i].b, stream_));
    if (open_ == 0 && recs_.size() >= kBatch) resolve();
  }
  void host_wait(const char* name, const char* phase, double ms) {
    Sum& x = sums_[std::string(name) + phase];
    x.n += 1, x.ms += ms;
  }
  int open_ = 0;  // scopes open (resolve only between top-level calls)

 private:
  static constexpr size_t kBatch = 4096;
  struct Rec {
    const char* name;
    bool dec;
    bool top;  // not nested in another profiled call
    cudaEvent_t a, b;
  };
  struct Sum {
    long n = 0;
    double ms = 0;
  };
  cudaEvent_t take() {
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    STRATA_CUDA_CHECK(cudaEventCreate(&e));
    return e;
  }
  void resolve() {
    if (recs_.empty()) return;
    STRATA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    const Rec* prev = nullptr;  // the last top-level call: the device idles from its end to the next start
    for (const Rec& r : recs_) {
      float ms = 0;
      if (r.b) STRATA_CUDA_CHECK(cudaEventElapsedTime(&ms, r.a, r.b));
      const char* ph = r.dec ? " [decode]" : " [prefill]";
      Sum& x = sums_[std::string(r.name) + ph];
      x.n += 1, x.ms += double(ms);
      if (r.top) {
        Sum& t = sums_[std::string("= device busy, top-level calls") + ph];
        t.n += 1, t.ms += double(ms);
        float gap = 0;
        if (prev && prev->b && prev->dec == r.dec) STRATA_CUDA_CHECK(cudaEventElapsedTime(&gap, prev->b, r.a));
        if (gap > 0 && gap < 50.0f) {  // longer: a pause between phases, not a gap inside one
          Sum& g = sums_[std::string("= device idle between calls") + ph];
          g.n += 1, g.ms += double(gap);
        }
        prev = &r;
      }
      free_.push_back(r.a);
      if (r.b) free_.push_back(r.b);
    }
    recs_.clear();
  }
  cudaStream_t stream_;
  std::vector<Rec> recs_;
  std::vector<cudaEvent_t> free_;
  std::map<std::string, Sum> sums_;
};

/// One profiled call (a no-op when profiling is off). Nested scopes are timed too (their own rows).
class ProfScope {
 public:
  ProfScope(CudaBackend& b, const char* name, int64_t T) : p_(b.prof_.get()) {
    if (p_) i_ = p_->begin(name, T), ++p_->open_;
  }
  ~ProfScope() {
    if (p_) {
      --p_->open_;
      try {
        p_->end(i_);
      } catch (...) {}
    }
  }
  ProfScope(const ProfScope&) = delete;
  ProfScope& operator=(const ProfScope&) = delete;

 private:
  OpProfile* p_;
  size_t i_ = 0;
};

CudaBackend::CudaBackend(const CudaOptions& opts) : device_(opts.device), act_q8_(opts.act_q8) {
  const int n = device_count();
  if (n == 0) throw CudaError("strata::cuda: no CUDA device found (cudaGetDeviceCount reports none)");
  if (opts.device < 0 || opts.device >= n)
    throw CudaError(fmt::format("strata::cuda: device {} does not exist ({} device{} found: 0..{})", opts.device, n,
                                n == 1 ? "" : "s", n - 1));
  set_device(device_);
  ctx_ = std::make_shared<CudaContext>();
  ctx_->device = device_;
  STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx_->stream, cudaStreamNonBlocking));
  {
    // The stream-ordered allocations (cudaMallocAsync: scratch growth, activations) come from the
    // device's default pool, which by default returns freed memory to the driver at every
    // synchronization; decode synchronizes once per MoE layer, and remapping memory then costs far
    // more than a launch. Keep up to kPoolKeepBytes of freed memory in the pool instead.
    cudaMemPool_t pool = nullptr;
    STRATA_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device_));
    uint64_t keep = 0;
    STRATA_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    if (keep < kPoolKeepBytes) {
      keep = kPoolKeepBytes;
      STRATA_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    }
  }
  ring_bytes_ = kRingBytes;
  ring_ = host_alloc(ring_bytes_, ring_pinned_, "the upload ring");
  // Read per backend (not once per process): a test may construct backends under several settings.
  if (detail::on_if_set(std::getenv("STRATA_CUDA_PROFILE"))) prof_ = std::make_unique<OpProfile>(ctx_->stream);
  host_route_ = opts.host_route || detail::on_if_set(std::getenv("STRATA_CUDA_HOST_ROUTE"));
  if (detail::on_if_set(std::getenv("STRATA_CUDA_HOST_MOE"))) host_moe_ = true;
  if (!detail::off_if_zero(std::getenv("STRATA_CUDA_FUSED_ROUTE"))) fused_route_ = false;
  route_counter_ = DeviceBuffer(sizeof(unsigned));
  STRATA_CUDA_CHECK(cudaMemsetAsync(route_counter_.get(), 0, sizeof(unsigned), ctx_->stream));
  STRATA_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));  // zero before any kernel can count on it
#ifdef STRATA_CUDA_STAMPS
  detail::stamps_collect();  // a profiling build: the stamps of every kernel from here on (docs/cuda.md)
#endif
}

CudaBackend::~CudaBackend() {
  (void)cudaSetDevice(device_);
  prof_.reset();
  (void)cudaStreamSynchronize(ctx_->stream);
#ifdef STRATA_CUDA_STAMPS
  try {
    detail::stamps_report();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata: cuda stamps: %s\n", e.what());
  }
#endif
  if (scratch_) (void)cudaFreeAsync(scratch_, ctx_->stream);
  if (q8_scratch_) (void)cudaFreeAsync(q8_scratch_, ctx_->stream);
  if (attn_part_) (void)cudaFreeAsync(attn_part_, ctx_->stream);
  (void)cudaStreamSynchronize(ctx_->stream);
  host_free(ring_, ring_pinned_);
  if (route_host_) host_free(route_host_, route_host_pinned_);
  for (MoeLanding& m : moe_host_) host_free(reinterpret_cast<uint8_t*>(m.p), m.pinned);
  moe_tables_.clear();
  inv_freq_.clear();
  sel_bias_.clear();
  weights_.clear();
}

void* CudaBackend::stream() const { return ctx_->stream; }

void CudaBackend::mem_info(size_t& free_bytes, size_t& total_bytes) const {
  STRATA_CUDA_CHECK(cudaSetDevice(device_));
  STRATA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
}

backend::BackendInfo CudaBackend::info() const {
  return {"cuda", fmt::format("device {}: {}", device_, device_description(device_))};
}

std::unique_ptr<backend::Buffer> CudaBackend::alloc(BufferRole role, size_t bytes) {
  flush_experts();
  return std::make_unique<CudaBuffer>(ctx_, role, bytes);
}

Tensor CudaBackend::weights(const Tensor& host) {
  flush_experts();
  if (host.place != Place::Host) throw CudaError("strata::cuda: weights() takes a host tensor");
  if (!is_supported(host.type))
    throw CudaError(fmt::format("strata::cuda: weight type {} ({} x {}) is not supported by the CUDA kernels",
                                ggml_type_name(uint32_t(host.type)), host.cols(), host.rows()));
  const size_t bytes = host.row_bytes() * size_t(host.rows());
  require_vram(device_, bytes, "a resident weight tensor");
  DeviceBuffer buf(bytes);
  if (bytes) STRATA_CUDA_CHECK(cudaMemcpy(buf.get(), host.data, bytes, cudaMemcpyHostToDevice));
  Tensor t = host;
  t.data = buf.get();
  t.place = Place::Device;
  weight_bytes_ += bytes;
  weights_.push_back(std::move(buf));
  return t;
}

void CudaBackend::upload_async(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  if (bytes > ring_bytes_ || !ring_pinned_) {
    // Too large for the ring (or no pinned ring): a copy from pageable memory, complete on return.
    STRATA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx_->stream));
    STRATA_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
    return;
  }
  if (ring_off_ + bytes > ring_bytes_) {
    // Wrap: the copies out of the ring queued so far must have run before it is overwritten.
    STRATA_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
    ring_off_ = 0;
  }
  uint8_t* slot = ring_ + ring_off_;
  std::memcpy(slot, src, bytes);
  STRATA_CUDA_CHECK(cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, ctx_->stream));
  ring_off_ = align_up(ring_off_ + bytes, 64);
}

char* CudaBackend::scratch(size_t bytes) {
  return grow_stream_buffer(scratch_, scratch_bytes_, bytes, ctx_->stream, device_, "compute scratch");
}

void CudaBackend::attention_part(AttentionArgs& a) {
  const size_t bytes = cuda::attention_scratch_bytes(a);
  if (bytes == 0 || bytes > kMaxAttnPartBytes) return;  // one pass, or large: cuda::attention allocates
  a.part = grow_stream_buffer(attn_part_, attn_part_bytes_, bytes, ctx_->stream, device_, "attention partial states");
  a.part_bytes = attn_part_bytes_;
}

char* CudaBackend::q8_scratch(size_t bytes) {
  return grow_stream_buffer(q8_scratch_, q8_scratch_bytes_, bytes, ctx_->stream, device_, "q8 activation scratch");
}

CudaBackend::Q8Ffn CudaBackend::q8_ffn_scratch(int64_t n, int64_t E, int64_t F) {
  const size_t cx = align_up(size_t(n * E), 256), sx = align_up(size_t(n * E / 32) * sizeof(float), 256),
               ca = align_up(size_t(n * F), 256);
  char* qb = q8_scratch(cx + sx + ca + size_t(n * F / 32) * sizeof(float));
  return {reinterpret_cast<int8_t*>(qb), reinterpret_cast<float*>(qb + cx), reinterpret_cast<int8_t*>(qb + cx + sx),
          reinterpret_cast<float*>(qb + cx + sx + ca)};
}

CudaBackend::Q8Act CudaBackend::quantize_act(const float* x, int64_t ldx, int64_t cols, int64_t n_tok, void* st) {
  const size_t codes = align_up(size_t(n_tok * cols), 256);
  char* base = q8_scratch(codes + size_t(n_tok * cols / 32) * sizeof(float));
  Q8Act a{reinterpret_cast<int8_t*>(base), reinterpret_cast<float*>(base + codes)};
  quantize_q8(x, ldx, cols, n_tok, a.q, a.d, st);
  return a;
}

void CudaBackend::mm(GgmlType type, const void* W, size_t row_bytes, int64_t rows, int64_t cols, const float* x,
                     int64_t ldx, int64_t n_tok, float* y, int64_t ldy, void* st) {
  if (!act_q8_ || !has_q8(type, cols) || n_tok <= 0) {
    cuda::matmul(type, W, row_bytes, rows, cols, x, ldx, n_tok, y, ldy, st);
    return;
  }
  if (n_tok == 1 && reinterpret_cast<uintptr_t>(W) % 16 == 0 && q8_x1_takes(type, row_bytes, cols, x, ldx)) {
    matmul_q8_x1(type, W, row_bytes, rows, cols, x, y, ldy, st);  // quantized inside the launch, the same bits
    return;
  }
  const Q8Act a = quantize_act(x, ldx, cols, n_tok, st);
  matmul_q8(type, W, row_bytes, rows, cols, a.q, a.d, n_tok, y, ldy, st);
}

void CudaBackend::upload(const Tensor& dst, const void* src, size_t bytes) {
  flush_experts();
  if (dst.place == Place::Host) {
    std::memcpy(dst.data, src, bytes);
    return;
  }
  upload_async(dst.data, src, bytes);
}

void CudaBackend::download(void* dst, const Tensor& src, size_t bytes) {
  flush_experts();
  if (src.place == Place::Host) {
    STRATA_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
    std::memcpy(dst, src.data, bytes);
    return;
  }
  STRATA_CUDA_CHECK(cudaMemcpyAsync(dst, src.data, bytes, cudaMemcpyDeviceToHost, ctx_->stream));
  const auto t0 = std::chrono::steady_clock::now();
  STRATA_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
  note_sync(t0);
  if (prof_)
    prof_->host_wait("host wait: download sync", " [any]",
                     std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
}

void CudaBackend::copy(const Tensor& dst, const Tensor& src, size_t bytes) {
  flush_experts();
  STRATA_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, bytes, cudaMemcpyDefault, ctx_->stream));
}

backend::EventPtr CudaBackend::record() {
  flush_experts();
  return std::make_shared<CudaEvent>(ctx_);
}

void CudaBackend::synchronize() {
  flush_experts();
  const auto t0 = host_times_ ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  STRATA_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
  note_sync(t0);
}

void CudaBackend::note_sync(std::chrono::steady_clock::time_point t0) {
  if (!host_times_) return;
  const auto t1 = std::chrono::steady_clock::now();
  const double wait = std::chrono::duration<double, std::micro>(t1 - t0).count();
  const double since = sync_last_.time_since_epoch().count() == 0
                           ? 0.0
                           : std::chrono::duration<double, std::micro>(t0 - sync_last_).count();
  std::fprintf(stderr, "strata: cuda host times: %.1f us on the host since the last sync, %.1f us waiting\n", since,
               wait);
  sync_last_ = t1;
}

std::unique_ptr<backend::ArenaMemory> CudaBackend::make_arena(size_t n_slots, size_t slot_bytes, int io_threads) {
  flush_experts();
  return std::make_unique<DeviceArena>(ctx_, n_slots, slot_bytes, io_threads);
}

// ---- compute ------------------------------------------------------------------------------

void CudaBackend::embed(const Tensor& table, std::span<const int32_t> ids, const Tensor& x) {
  flush_experts();
  ProfScope ps(*this, "embed", int64_t(ids.size()));
  require_device(table, "embed: the table");
  const int64_t n = int64_t(ids.size());
  if (n == 0) return;
  Carve c{scratch(sz<int32_t>(size_t(n)))};
  int32_t* d_ids = c.take<int32_t>(size_t(n));
  upload_async(d_ids, ids.data(), size_t(n) * sizeof(int32_t));
  get_rows(table.type, table.data, table.row_bytes(), table.cols(), d_ids, n, x.f(), ld(x), stream());
}

void CudaBackend::rms_norm(const Tensor& x, const Tensor& w, float eps, const Tensor& y) {
  flush_experts();
  ProfScope ps(*this, "rms_norm", x.rows());
  cuda::rms_norm(x.f(), ld(x), w.f(), y.f(), ld(y), x.cols(), x.rows(), eps, stream());
}

void CudaBackend::add(const Tensor& x, const Tensor& y) {
  flush_experts();
  ProfScope ps(*this, "add", x.rows());
  add_rows(x.f(), ld(x), y.f(), ld(y), x.cols(), x.rows(), stream());
}

void CudaBackend::add_rms_norm(const Tensor& x, const Tensor& y, const Tensor& w, float eps, const Tensor& out) {
  flush_experts();
  ProfScope ps(*this, "add + rms_norm", x.rows());
  cuda::add_rms_norm(x.f(), ld(x), y.f(), ld(y), w.f(), out.f(), ld(out), x.cols(), x.rows(), eps, stream());
}

void CudaBackend::matmul(const Tensor& W, const Tensor& x, const Tensor& y) {
  flush_experts();
  ProfScope ps(*this, "matmul", x.rows());
  require_device(W, "matmul: the weights");
  mm(W.type, W.data, W.row_bytes(), W.rows(), W.cols(), x.f(), ld(x), x.rows(), y.f(), ld(y), stream());
}

const double* CudaBackend::inv_freq(const backend::RopeSpec& rope) {
  auto it = inv_freq_.find(&rope);
  const size_t bytes = rope.inv_freq.size() * sizeof(double);
  if (it == inv_freq_.end() || it->second.bytes() != bytes) {
    DeviceBuffer b(bytes);
    STRATA_CUDA_CHECK(cudaMemcpy(b.get(), rope.inv_freq.data(), bytes, cudaMemcpyHostToDevice));
    it = inv_freq_.insert_or_assign(&rope, std::move(b)).first;
  }
  return it->second.as<double>();
}

void CudaBackend::attention(const backend::AttentionSpec& s, const backend::AttentionWeights& w,
                            const backend::KvCache& kv, int64_t pos0, const Tensor& h, const Tensor& out) {
  flush_experts();
  const int64_t T = h.rows();
  if (T == 0) return;
  ProfScope ps(*this, "attention (all)", T);
  const int64_t q_dim = int64_t(s.n_head) * s.head_dim, kv_dim = int64_t(s.n_head_kv) * s.head_dim;
  if (pos0 + T > kv.k.rows())
    throw CudaError(
        fmt::format("strata::cuda: attention: positions up to {} do not fit the cache of {}", pos0 + T, kv.k.rows()));
  if (s.window < 0) throw CudaError(fmt::format("strata::cuda: attention: window {} is negative", s.window));
  // Biases and sinks: F32 device vectors of the documented lengths (AttentionWeights).
  auto check_vec = [](const Tensor& b, int64_t n, const char* what) {
    if (b.empty()) return;
    require_device(b, what);
    if (b.type != GgmlType::F32 || b.numel() != n)
      throw CudaError(fmt::format("strata::cuda: attention: {} must be F32 with {} values (has {} of type {})", what, n,
                                  b.numel(), ggml_type_name(uint32_t(b.type))));
  };
  check_vec(w.bq, w.wq.rows(), "attn_q.bias");
  check_vec(w.bk, kv_dim, "attn_k.bias");
  check_vec(w.bv, kv_dim, "attn_v.bias");
  check_vec(w.bo, out.cols(), "attn_output.bias");
  check_vec(w.sinks, s.n_head, "attn_sinks");
  const backend::RopeSpec* rope = s.rope;

  Carve c{scratch(sz<float>(size_t(T * q_dim)) * (s.q_gate ? 4 : 2) + sz<int32_t>(size_t(T)))};
  float* q = c.take<float>(size_t(T * q_dim));
  float* att = c.take<float>(size_t(T * q_dim));
  float* gate = nullptr;
  int32_t* pos = c.take<int32_t>(size_t(T));
  const int64_t ldh = ld(h);
  // q8 activations: h quantized once for the three projections (the codes mm would make for each);
  // one token (decode): quantized inside the one q/k/v launch instead (matmul_q8_multi_x1).
  const bool q8_qkv = act_q8_ && has_q8(w.wq.type, h.cols()) && has_q8(w.wk.type, h.cols()) &&
                      has_q8(w.wv.type, h.cols()) && w.wk.type == w.wq.type && w.wv.type == w.wq.type;
  auto a16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool x1_qkv = q8_qkv && T == 1 && w.wq.row_bytes() == w.wk.row_bytes() &&
                      w.wq.row_bytes() == w.wv.row_bytes() && a16(w.wq.data) && a16(w.wk.data) && a16(w.wv.data) &&
                      q8_x1_takes(w.wq.type, w.wq.row_bytes(), h.cols(), h.f(), ldh);
  Q8Act hq{};
  if (q8_qkv && !x1_qkv) hq = quantize_act(h.f(), ldh, h.cols(), T, stream());
  auto proj = [&](const Tensor& W, float* y, int64_t ldy) {
    if (hq.q)
      matmul_q8(W.type, W.data, W.row_bytes(), W.rows(), W.cols(), hq.q, hq.d, T, y, ldy, stream());
    else
      mm(W.type, W.data, W.row_bytes(), W.rows(), W.cols(), h.f(), ldh, T, y, ldy, stream());
  };
  // Projections; K and V go straight into the cache rows pos0.. (normed and rotated in place).
  // With q8 activations the three run as one matmul_q8_multi (one launch in decode).
  float* kc = kv.k.f() + pos0 * kv_dim;
  float* vc = kv.v.f() + pos0 * kv_dim;
  float* qg = s.q_gate ? c.take<float>(size_t(T * 2 * q_dim)) : nullptr;
  if (s.q_gate) gate = c.take<float>(size_t(T * q_dim));
  float* qy = s.q_gate ? qg : q;
  const int64_t ldq = s.q_gate ? 2 * q_dim : q_dim;
  // Opt-in until measured on a device (STRATA_CUDA_QKV_ONE_LAUNCH=1; docs/cuda.md "Next").
  static detail::EnvSwitch qkv_env{"STRATA_CUDA_QKV_ONE_LAUNCH",
                                   [](const char* v) { return v && std::string(v) == "1" ? 1 : 0; }};
  const bool qkv_one_launch = qkv_env.get() != 0;
  const bool fused_qkv =
      qkv_one_launch && hq.q && w.wq.row_bytes() == w.wk.row_bytes() && w.wq.row_bytes() == w.wv.row_bytes();
  if (x1_qkv || fused_qkv) {
    const MatmulQ8Part parts[3] = {{w.wq.data, w.wq.rows(), qy, ldq},
                                   {w.wk.data, w.wk.rows(), kc, kv_dim},
                                   {w.wv.data, w.wv.rows(), vc, kv_dim}};
    if (x1_qkv) {
      L2Prefetch wo;  // the output projection into L2 while q, k and v stream (decode)
      wo.p[0] = w.wo.data, wo.bytes[0] = size_t(w.wo.rows()) * w.wo.row_bytes(), wo.n = w.wo.data ? 1 : 0;
      matmul_q8_multi_x1(w.wq.type, parts, 3, w.wq.row_bytes(), h.cols(), h.f(), stream(), &wo);
    } else {
      matmul_q8_multi(w.wq.type, parts, 3, w.wq.row_bytes(), h.cols(), hq.q, hq.d, T, stream());
    }
  } else {
    proj(w.wq, qy, ldq);
    proj(w.wk, kc, kv_dim);
    proj(w.wv, vc, kv_dim);
  }
  if (!w.bq.empty()) add_bias(qy, ldq, w.bq.f(), ldq, T, stream());
  if (s.q_gate) split_q_gate(qg, T, s.n_head, s.head_dim, q, gate, stream());
  if (!w.bk.empty()) add_bias(kc, kv_dim, w.bk.f(), kv_dim, T, stream());
  if (!w.bv.empty()) add_bias(vc, kv_dim, w.bv.f(), kv_dim, T, stream());
  // RMSNorm of q and k: per head (rows of head_dim), or over the whole projection row (MiniMax-M2);
  // then RoPE. The common case (per-head norms, NEOX without YaRN's factor) is one launch with the
  // positions pos0.. as an argument (the same bits as the separate kernels below).
  const bool fused = !s.qk_norm_full && rope && rope->n_rot > 0 && rope->mode == backend::RopeSpec::Mode::Neox &&
                     rope->attn_factor == 1.0;
  if (fused) {
    qk_norm_rope(q, q_dim, s.n_head, kc, kv_dim, s.n_head_kv, s.head_dim, T, w.q_norm.empty() ? nullptr : w.q_norm.f(),
                 w.k_norm.empty() ? nullptr : w.k_norm.f(), s.rms_eps, rope->n_rot, pos0, inv_freq(*rope), stream());
  } else if (s.qk_norm_full) {
    if (!w.q_norm.empty()) cuda::rms_norm(q, q_dim, w.q_norm.f(), q, q_dim, q_dim, T, s.rms_eps, stream());
    if (!w.k_norm.empty()) cuda::rms_norm(kc, kv_dim, w.k_norm.f(), kc, kv_dim, kv_dim, T, s.rms_eps, stream());
  } else {
    if (!w.q_norm.empty())
      cuda::rms_norm(q, s.head_dim, w.q_norm.f(), q, s.head_dim, s.head_dim, T * s.n_head, s.rms_eps, stream());
    if (!w.k_norm.empty())
      cuda::rms_norm(kc, s.head_dim, w.k_norm.f(), kc, s.head_dim, s.head_dim, T * s.n_head_kv, s.rms_eps, stream());
  }
  if (!fused && rope && rope->n_rot > 0) {
    std::vector<int32_t> p(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) p[size_t(t)] = int32_t(pos0 + t);
    upload_async(pos, p.data(), p.size() * sizeof(int32_t));
    const double* inv = inv_freq(*rope);
    const bool neox = rope->mode == backend::RopeSpec::Mode::Neox;
    if (neox && rope->attn_factor == 1.0) {
      rope_neox(q, q_dim, T, s.n_head, s.head_dim, rope->n_rot, pos, inv, stream());
      rope_neox(kc, kv_dim, T, s.n_head_kv, s.head_dim, rope->n_rot, pos, inv, stream());
    } else {  // NORM layout and/or YaRN's attention factor on cos and sin
      cuda::rope(q, q_dim, T, s.n_head, s.head_dim, rope->n_rot, pos, inv, neox, rope->attn_factor, stream());
      cuda::rope(kc, kv_dim, T, s.n_head_kv, s.head_dim, rope->n_rot, pos, inv, neox, rope->attn_factor, stream());
    }
  }
  AttentionArgs a;
  a.q = q, a.q_stride = q_dim;
  a.k = kv.k.f(), a.v = kv.v.f(), a.kv_stride = kv_dim;
  a.out = att, a.out_stride = q_dim;
  a.n_tok = T, a.pos0 = pos0;
  a.n_head = s.n_head, a.n_head_kv = s.n_head_kv, a.head_dim = s.head_dim;
  a.scale = s.scale != 0 ? s.scale : 1.0f / std::sqrt(float(s.head_dim));
  a.window = s.window;
  a.sinks = w.sinks.empty() ? nullptr : w.sinks.f();
  attention_part(a);
  {
    ProfScope pk(*this, "attention kernel", T);
    cuda::attention(a, stream());
  }
  if (s.q_gate) sigmoid_mul(att, gate, T * q_dim, stream());
  mm(w.wo.type, w.wo.data, w.wo.row_bytes(), w.wo.rows(), w.wo.cols(), att, q_dim, T, out.f(), ld(out), stream());
  if (!w.bo.empty()) add_bias(out.f(), ld(out), w.bo.f(), out.cols(), T, stream());
}

void CudaBackend::mla_attention(const backend::MlaSpec& s, const backend::MlaWeights& w, const Tensor& cache,
                                int64_t pos0, const Tensor& h, const Tensor& out) {
  flush_experts();
  const int64_t T = h.rows();
  if (T == 0) return;
  const int64_t H = s.n_head, R = s.kv_lora_rank, P = s.n_rot, N = s.n_nope, Vd = s.v_dim, QL = s.q_lora_rank;
  const int64_t qk = N + P, C = R + P;  // q/k dims per head; cache row (= absorbed query) dims
  require_device(cache, "mla_attention: the latent cache");
  if (cache.cols() != C || pos0 + T > cache.rows())
    throw CudaError(
        fmt::format("strata::cuda: mla_attention: the cache ({} x {}) does not hold {} dims for positions "
                    "up to {}",
                    cache.cols(), cache.rows(), C, pos0 + T));
  if (!(C % 32 == 0 && (C <= 256 || C == 576)))
    throw CudaError(
        fmt::format("strata::cuda: mla_attention: kv_lora_rank + n_rot = {} is not a head size the CUDA "
                    "attention kernel has (multiples of 32 up to 256, or 576); use --backend cpu",
                    C));
  if (!s.rope || s.rope->n_rot != P || P <= 0)
    throw CudaError("strata::cuda: mla_attention: needs a RoPE of n_rot rotated dims");
  const int64_t qrows = QL > 0 ? QL : 0;
  Carve c{scratch(sz<float>(size_t(T * H * qk)) + sz<float>(size_t(T * qrows)) + 2 * sz<float>(size_t(T * H * C)) +
                  sz<float>(size_t(T * H * Vd)) + sz<int32_t>(size_t(T)))};
  float* q = c.take<float>(size_t(T * H * qk));
  float* qa = c.take<float>(size_t(T * qrows));
  float* qabs = c.take<float>(size_t(T * H * C));
  float* att = c.take<float>(size_t(T * H * C));
  float* o = c.take<float>(size_t(T * H * Vd));
  int32_t* pos = c.take<int32_t>(size_t(T));
  auto mm = [&](const Tensor& W, int64_t rows, const void* data, const float* x, int64_t ldx, float* y, int64_t ldy) {
    this->mm(W.type, data, W.row_bytes(), rows, W.cols(), x, ldx, T, y, ldy, stream());
  };
  // Queries [T][H][N + P].
  if (QL > 0) {
    mm(w.wq_a, w.wq_a.rows(), w.wq_a.data, h.f(), ld(h), qa, QL);
    cuda::rms_norm(qa, QL, w.q_a_norm.f(), qa, QL, QL, T, s.rms_eps, stream());
    mm(w.wq_b, w.wq_b.rows(), w.wq_b.data, qa, QL, q, H * qk);
  } else {
    mm(w.wq, w.wq.rows(), w.wq.data, h.f(), ld(h), q, H * qk);
  }
  // [c | kpe] straight into the cache rows pos0..; c normed, kpe rotated in place.
  float* crow = cache.f() + pos0 * C;
  mm(w.wkv_a, w.wkv_a.rows(), w.wkv_a.data, h.f(), ld(h), crow, C);
  cuda::rms_norm(crow, C, w.kv_a_norm.f(), crow, C, R, T, s.rms_eps, stream());
  std::vector<int32_t> p(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) p[size_t(t)] = int32_t(pos0 + t);
  upload_async(pos, p.data(), p.size() * sizeof(int32_t));
  const double* inv = inv_freq(*s.rope);
  const bool neox = s.rope->mode == backend::RopeSpec::Mode::Neox;
  cuda::rope(crow + R, C, T, 1, int(P), int(P), pos, inv, neox, s.rope->attn_factor, stream());
  // q_pe of every head (dims N.. of each head's qk), then copied after the absorbed q_nope.
  cuda::rope(q + N, H * qk, T, int(H), int(qk), int(P), pos, inv, neox, s.rope->attn_factor, stream());
  STRATA_CUDA_CHECK(cudaMemcpy2DAsync(qabs + R, size_t(C) * sizeof(float), q + N, size_t(qk) * sizeof(float),
                                      size_t(P) * sizeof(float), size_t(T * H), cudaMemcpyDeviceToDevice,
                                      ctx_->stream));
  // qabs[t][h][:R] = k_b[h] q_nope[t][h]: k_b[h] has R rows of N columns.
  const size_t kb_head_bytes = size_t(R) * w.wk_b.row_bytes(), vb_head_bytes = size_t(Vd) * w.wv_b.row_bytes();
  for (int64_t hh = 0; hh < H; ++hh)
    mm(w.wk_b, R, static_cast<const uint8_t*>(w.wk_b.data) + size_t(hh) * kb_head_bytes, q + hh * qk, H * qk,
       qabs + hh * C, H * C);
  // All heads over the one shared latent head (keys and values: the cache rows).
  AttentionArgs a;
  a.q = qabs, a.q_stride = H * C;
  a.k = cache.f(), a.v = cache.f(), a.kv_stride = C;
  a.out = att, a.out_stride = H * C;
  a.n_tok = T, a.pos0 = pos0;
  a.n_head = int(H), a.n_head_kv = 1, a.head_dim = int(C);
  a.scale = s.scale != 0 ? s.scale : 1.0f / std::sqrt(float(qk));
  attention_part(a);
  cuda::attention(a, stream());
  // o[h] = v_b[h] ctx[h] (ctx: the first R dims of each head's output), then attn_output.
  for (int64_t hh = 0; hh < H; ++hh)
    mm(w.wv_b, Vd, static_cast<const uint8_t*>(w.wv_b.data) + size_t(hh) * vb_head_bytes, att + hh * C, H * C,
       o + hh * Vd, H * Vd);
  mm(w.wo, w.wo.rows(), w.wo.data, o, H * Vd, out.f(), ld(out));
}

void CudaBackend::gated_delta_net(const backend::GdnSpec& s, const backend::GdnWeights& w,
                                  const backend::RecurrentState& state, const Tensor& h, const Tensor& out) {
  flush_experts();
  const int64_t T = h.rows();
  if (T == 0) return;
  const bool separate_ba = w.wba.empty();  // qwen35moe: ssm_beta and ssm_alpha
  if (separate_ba && (w.wbeta.empty() || w.walpha.empty()))
    throw CudaError("strata::cuda: gated delta net: neither ssm_ba nor both ssm_beta and ssm_alpha are given");
  ProfScope ps(*this, "gated_delta_net", T);
  const int64_t C = s.conv_dim(), VD = s.value_dim(), nv = s.n_v_head;
  Carve c{scratch(2 * sz<float>(size_t(T * C)) + 2 * sz<float>(size_t(T * VD)) + sz<float>(size_t(T * 2 * nv)))};
  float* x = c.take<float>(size_t(T * C));
  float* xc = c.take<float>(size_t(T * C));
  float* z = c.take<float>(size_t(T * VD));
  float* o = c.take<float>(size_t(T * VD));
  float* ba = c.take<float>(size_t(T * 2 * nv));
  const int64_t ldh = ld(h);
  auto mm = [&](const Tensor& W, const float* in, int64_t ldi, float* y, int64_t ldy) {
    this->mm(W.type, W.data, W.row_bytes(), W.rows(), W.cols(), in, ldi, T, y, ldy, stream());
  };
  mm(w.wqkv, h.f(), ldh, x, C);
  mm(w.wz, h.f(), ldh, z, VD);
  if (!separate_ba) {
    mm(w.wba, h.f(), ldh, ba, 2 * nv);
  } else {  // per token [b (nv) | a (nv)]
    mm(w.wbeta, h.f(), ldh, ba, 2 * nv);
    mm(w.walpha, h.f(), ldh, ba + nv, 2 * nv);
  }
  gdn_conv(x, C, T, w.conv.f(), s.conv_kernel, state.conv.f(), xc, stream());
  gdn_recurrent(xc, C, T, ba, w.dt_bias.f(), w.a.f(), s.n_k_head, s.n_v_head, s.head_k_dim, s.head_v_dim, state.ssm.f(),
                o, stream(), separate_ba, s.v_head_order == backend::GdnSpec::VHeadOrder::Tiled);
  // Gated RMSNorm per value head: (rmsnorm(o) * ssm_norm) * silu(z).
  cuda::rms_norm(o, s.head_v_dim, w.norm.f(), o, s.head_v_dim, s.head_v_dim, T * nv, s.rms_eps, stream());
  swiglu(z, o, o, T * VD, stream());
  mm(w.wout, o, VD, out.f(), ld(out));
}

void CudaBackend::swiglu_ffn(const backend::FfnWeights& w, const float* h, int64_t ldh, int64_t T, float* out,
                             int64_t ldo, char* base) {
  const int64_t F = w.gate.rows();
  Carve c{base};
  float* g = c.take<float>(size_t(T * F));
  float* u = c.take<float>(size_t(T * F));
  mm(w.gate.type, w.gate.data, w.gate.row_bytes(), F, w.gate.cols(), h, ldh, T, g, F, stream());
  mm(w.up.type, w.up.data, w.up.row_bytes(), w.up.rows(), w.up.cols(), h, ldh, T, u, F, stream());
  swiglu(g, u, g, T * F, stream());
  mm(w.down.type, w.down.data, w.down.row_bytes(), w.down.rows(), w.down.cols(), g, F, T, out, ldo, stream());
}

// The dense FFN: SwiGLU without biases (as the CPU backend's ffn; the biased, clamped form is
// gpt-oss's routed experts only, see expert_ffn).
static void check_ffn(const backend::FfnSpec& spec, const backend::FfnWeights& w, const char* what) {
  if (spec.act != backend::FfnSpec::Act::SwiGLU || !w.gate_b.empty() || !w.up_b.empty() || !w.down_b.empty())
    throw CudaError(
        fmt::format("strata::cuda: {}: the dense FFN supports SwiGLU without biases only (as the CPU backend; "
                    "biases and the clamped SwiGLU are for routed experts)",
                    what));
}

// True when a routed expert needs the general path: gpt-oss's clamped SwiGLU or expert biases.
// Checks the biases' shapes (F32 device vectors of n_ff / n_embd values).
static bool general_expert(const backend::FfnSpec& spec, const backend::FfnWeights& w) {
  if (spec.act != backend::FfnSpec::Act::SwiGLU && spec.act != backend::FfnSpec::Act::SwiGluOai)
    throw CudaError("strata::cuda: expert_ffn: unknown activation");
  auto check = [](const Tensor& b, int64_t n, const char* what) {
    if (b.empty()) return;
    require_device(b, what);
    if (b.type != GgmlType::F32 || b.numel() != n)
      throw CudaError(
          fmt::format("strata::cuda: expert_ffn: {} must be F32 with {} values (has {})", what, n, b.numel()));
  };
  check(w.gate_b, w.gate.rows(), "ffn_gate_exps.bias row");
  check(w.up_b, w.up.rows(), "ffn_up_exps.bias row");
  check(w.down_b, w.down.rows(), "ffn_down_exps.bias row");
  return spec.act != backend::FfnSpec::Act::SwiGLU || !w.gate_b.empty() || !w.up_b.empty() || !w.down_b.empty();
}

void CudaBackend::ffn(const backend::FfnCall& call, const backend::FfnWeights& w, const Tensor& h, const Tensor& out) {
  flush_experts();
  const int64_t T = h.rows(), E = out.cols(), F = w.gate.rows();
  if (T == 0) return;
  check_ffn(call.spec, w, "ffn");
  ProfScope ps(*this, "ffn (dense)", T);
  if (call.scalar_gate.empty()) {
    if (call.accumulate) {  // out += ffn(h): the ungated shared experts (glm4moe, deepseek2)
      const size_t ff = 2 * sz<float>(size_t(T * F));
      char* base = scratch(ff + sz<float>(size_t(T * E)));
      float* y = Carve{base + ff}.take<float>(size_t(T * E));
      swiglu_ffn(w, h.f(), ld(h), T, y, E, base);
      add_rows(out.f(), ld(out), y, E, E, T, stream());
      return;
    }
    swiglu_ffn(w, h.f(), ld(h), T, out.f(), ld(out), scratch(2 * sz<float>(size_t(T * F))));
    return;
  }
  if (!call.accumulate) throw std::invalid_argument("ffn: a scalar gate is only supported with accumulate");
  const size_t ff = 2 * sz<float>(size_t(T * F));
  char* base = scratch(ff + sz<float>(size_t(T * E)) + sz<float>(size_t(T)));
  Carve c{base + ff};
  float* y = c.take<float>(size_t(T * E));
  float* gs = c.take<float>(size_t(T));
  swiglu_ffn(w, h.f(), ld(h), T, y, E, base);
  const Tensor& sg = call.scalar_gate;
  mm(sg.type, sg.data, sg.row_bytes(), 1, sg.cols(), h.f(), ld(h), T, gs, 1, stream());
  gated_accumulate(out.f(), ld(out), y, E, gs, E, T, stream());
}

void CudaBackend::router_logits(const Tensor& w, const Tensor& h, std::vector<float>& logits) {
  flush_experts();
  const int64_t n_expert = w.rows(), T = h.rows();
  logits.resize(size_t(T * n_expert));
  if (T == 0) return;
  float* d = Carve{scratch(sz<float>(size_t(T * n_expert)))}.take<float>(size_t(T * n_expert));
  {
    ProfScope ps(*this, "router_logits", T);
    mm(w.type, w.data, w.row_bytes(), n_expert, w.cols(), h.f(), ld(h), T, d, n_expert, stream());
    STRATA_CUDA_CHECK(
        cudaMemcpyAsync(logits.data(), d, logits.size() * sizeof(float), cudaMemcpyDeviceToHost, ctx_->stream));
  }
  const auto t0 = std::chrono::steady_clock::now();
  STRATA_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
  if (prof_)
    prof_->host_wait("host wait: router_logits sync", T <= 1 ? " [decode]" : " [prefill]",
                     std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
}

const float* CudaBackend::selection_bias(const std::vector<float>& bias) {
  if (bias.empty()) return nullptr;
  auto it = sel_bias_.find(bias.data());
  if (it != sel_bias_.end() && it->second.host == bias) return it->second.dev.as<float>();
  if (sel_bias_.size() >= 1024) sel_bias_.clear();  // keys of vectors gone; bounded
  BiasCopy c{bias, DeviceBuffer(bias.size() * sizeof(float))};
  // Synchronous: a new buffer, which no queued kernel reads; an old entry's buffer is freed by
  // cudaFree, which waits for the device.
  STRATA_CUDA_CHECK(cudaMemcpy(c.dev.get(), bias.data(), bias.size() * sizeof(float), cudaMemcpyHostToDevice));
  it = sel_bias_.insert_or_assign(bias.data(), std::move(c)).first;
  return it->second.dev.as<float>();
}

namespace {

// Whether select_topk takes this router (what the host would reject goes to the host, so that
// the error is the host's).
bool device_routable(const backend::RouteCall& c) {
  using G = backend::RouterSpec::Gating;
  const backend::RouterSpec& s = *c.spec;
  const int64_t n = c.w.rows();
  const bool grouped = s.n_group > 1 && s.n_group_used < s.n_group;
  return (s.gating == G::Softmax || s.gating == G::Sigmoid || s.gating == G::SoftmaxTopK) && s.n_expert == n &&
         n >= 1 && n <= kMaxRouteExperts && s.top_k >= 1 && s.top_k <= n &&
         (s.selection_bias.empty() || int64_t(s.selection_bias.size()) == n) && (c.bias.empty() || c.bias.numel() == n) &&
         (!grouped || (s.n_group <= kMaxRouteGroups && n % s.n_group == 0 && s.n_group_used >= 1 &&
                       int64_t(s.n_group_used) * (n / s.n_group) >= s.top_k));
}

}  // namespace

void CudaBackend::launch_route(const backend::RouteCall& c, const Tensor& h, float* logits, const RouteOut& ro,
                               const PairJobs* jobs) {
  using G = backend::RouterSpec::Gating;
  const backend::RouterSpec& spec = *c.spec;
  const int64_t n_expert = c.w.rows(), T = h.rows();
  RouteSpec rs;
  rs.gating = spec.gating == G::Softmax ? 0 : spec.gating == G::Sigmoid ? 1 : 2;
  rs.n_expert = int(n_expert);
  rs.top_k = spec.top_k;
  rs.norm_topk = spec.norm_topk;
  rs.n_group = spec.n_group;
  rs.n_group_used = spec.n_group_used;
  rs.weights_scale = spec.weights_scale;
  rs.selection_bias = selection_bias(spec.selection_bias);
  const Tensor& w = c.w;
  if (fused_route_ && w.type == GgmlType::F32 &&
      route_fused_fits(rs.n_expert, w.cols(), T, w.data, w.row_bytes(), h.f(), ld(h))) {
    route_fused(rs, static_cast<const float*>(w.data), w.row_bytes(), w.cols(), c.bias.empty() ? nullptr : c.bias.f(),
                h.f(), ld(h), T, logits, ro, route_counter_.as<unsigned>(), stream(), jobs);
    return;
  }
  cuda::matmul(w.type, w.data, w.row_bytes(), n_expert, w.cols(), h.f(), ld(h), T, logits, n_expert, stream());
  if (!c.bias.empty()) add_bias(logits, n_expert, c.bias.f(), n_expert, T, stream());
  select_topk(rs, logits, n_expert, T, ro, stream(), jobs);
}

void CudaBackend::route(std::span<const backend::RouteCall> calls, const Tensor& h) {
  bool all_device = !host_route_;
  for (const backend::RouteCall& c : calls) all_device = all_device && device_routable(c);
  if (!all_device) {
    backend::Backend::route(calls, h);
    return;
  }
  flush_experts();
  const int64_t T = h.rows();
  for (const backend::RouteCall& c : calls) {
    c.out->top_k = c.spec->top_k;
    c.out->ids.clear(), c.out->probs.clear(), c.out->weights.clear(), c.out->next_prob.clear();
  }
  if (T == 0 || calls.empty()) return;
  // Device scratch: per call the logits, then the RouteOut arrays; host: per call the
  // downloaded part ([status][ids] for ids_only, else all of RouteOut), back to back.
  // The first full (not ids_only) call's RouteOut goes to route_dev_ instead, where it outlives
  // the scratch: moe_combine takes its weights from there (no upload of the weights).
  size_t dev_bytes = 0, host_bytes = 0;
  const backend::RouteCall* kept = nullptr;
  for (const backend::RouteCall& c : calls) {
    const int K = c.spec->top_k;
    dev_bytes += sz<float>(size_t(T * c.w.rows())) + align_up(route_bytes(T, K), kAlign);
    host_bytes += c.ids_only ? size_t(T) * size_t(K + 1) * 4 : route_bytes(T, K);
    if (!kept && !c.ids_only) kept = &c;
  }
  route_w_.clear();  // route_dev_ is rewritten below (or stale)
  if (kept && route_dev_.bytes() < route_bytes(T, kept->spec->top_k)) {
    STRATA_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));  // queued kernels may still read it
    route_dev_ = DeviceBuffer();
    route_dev_ = DeviceBuffer(route_bytes(T, kept->spec->top_k));
  }
  char* base = scratch(dev_bytes);
  if (route_host_bytes_ < host_bytes) {
    if (route_host_) host_free(route_host_, route_host_pinned_);
    route_host_ = nullptr, route_host_bytes_ = 0;
    route_host_ = host_alloc(host_bytes, route_host_pinned_, "the routing download buffer");
    route_host_bytes_ = host_bytes;
  }
  {
    ProfScope ps(*this, "route (router + top-k)", T);
    size_t dev_off = 0, host_off = 0;
    for (const backend::RouteCall& c : calls) {
      const int64_t n_expert = c.w.rows();
      const int K = c.spec->top_k;
      float* d = reinterpret_cast<float*>(base + dev_off);
      dev_off += sz<float>(size_t(T * n_expert));
      const RouteOut ro = route_layout(&c == kept ? route_dev_.get() : base + dev_off, T, K);
      dev_off += align_up(route_bytes(T, K), kAlign);
      launch_route(c, h, d, ro);
      const size_t down = c.ids_only ? size_t(T) * size_t(K + 1) * 4 : route_bytes(T, K);
      STRATA_CUDA_CHECK(
          cudaMemcpyAsync(route_host_ + host_off, ro.status, down, cudaMemcpyDeviceToHost, ctx_->stream));
      host_off += down;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  STRATA_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
  if (prof_)
    prof_->host_wait("host wait: route sync", T <= 1 ? " [decode]" : " [prefill]",
                     std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  size_t host_off = 0;
  for (const backend::RouteCall& c : calls) {
    const int K = c.spec->top_k;
    const RouteOut hr = route_layout(route_host_ + host_off, T, K);
    host_off += c.ids_only ? size_t(T) * size_t(K + 1) * 4 : route_bytes(T, K);
    for (int64_t t = 0; t < T; ++t)
      if (hr.status[t]) throw std::invalid_argument(backend::router_logits_defect_message(hr.status[t], t));
    const size_t TK = size_t(T) * size_t(K);
    backend::Routing& out = *c.out;
    out.ids.assign(hr.ids, hr.ids + TK);
    if (c.ids_only) continue;
    out.probs.assign(hr.probs, hr.probs + TK);
    out.weights.assign(hr.weights, hr.weights + TK);
    out.next_prob.assign(hr.next_prob, hr.next_prob + T);
    if (&c == kept) route_w_ = out.weights, route_k_ = K;
  }
}

namespace {

// Whether an expert of n_embd E and n_ff F can join a grouped launch (flush_experts): gate and up
// of one type and row size, the shapes of an F x E / E x F SwiGLU, and types with the grouped
// (tensor-core) kernels.
bool groupable(const backend::FfnWeights& w, int64_t E, int64_t F) {
  return w.gate.type == w.up.type && w.gate.row_bytes() == w.up.row_bytes() && w.gate.rows() == F &&
         w.up.rows() == F && w.gate.cols() == E && w.up.cols() == E && w.down.rows() == E && w.down.cols() == F &&
         has_mma(w.gate.type, E) && has_mma(w.down.type, F);
}

}  // namespace

void CudaBackend::expert_ffn(const backend::FfnSpec& spec, const backend::ExpertJob& job, int top_k, const Tensor& h,
                             const Tensor& expert_out) {
  const int64_t n = int64_t(job.pairs.size()), E = h.cols(), F = job.w.gate.rows();
  if (n == 0) return;
  const backend::FfnWeights& w = job.w;
  if (general_expert(spec, w)) {
    // gpt-oss: biases after each projection, the clamped SwiGLU. One expert at a time (the
    // grouped launch fuses plain SwiGLU only); matmul's arithmetic per (row, token) is the same
    // for any number of tokens, so this is as batch-invariant as the grouped path.
    flush_experts();
    const size_t head = sz<int64_t>(size_t(n)) + 2 * sz<float>(size_t(n * E));
    Carve c{scratch(head + 2 * sz<float>(size_t(n * F)))};
    int64_t* pairs = c.take<int64_t>(size_t(n));
    float* xg = c.take<float>(size_t(n * E));
    float* y = c.take<float>(size_t(n * E));
    float* g = c.take<float>(size_t(n * F));
    float* u = c.take<float>(size_t(n * F));
    upload_async(pairs, job.pairs.data(), size_t(n) * sizeof(int64_t));
    gather_rows(h.f(), ld(h), pairs, top_k, n, xg, E, E, stream());
    mm(w.gate.type, w.gate.data, w.gate.row_bytes(), F, w.gate.cols(), xg, E, n, g, F, stream());
    mm(w.up.type, w.up.data, w.up.row_bytes(), w.up.rows(), w.up.cols(), xg, E, n, u, F, stream());
    if (!w.gate_b.empty()) add_bias(g, F, w.gate_b.f(), F, n, stream());
    if (!w.up_b.empty()) add_bias(u, F, w.up_b.f(), F, n, stream());
    if (spec.act == backend::FfnSpec::Act::SwiGluOai)
      swiglu_oai(g, u, g, n * F, spec.alpha, spec.limit, stream());
    else
      swiglu(g, u, g, n * F, stream());
    mm(w.down.type, w.down.data, w.down.row_bytes(), w.down.rows(), w.down.cols(), g, F, n, y, E, stream());
    if (!w.down_b.empty()) add_bias(y, E, w.down_b.f(), E, n, stream());
    scatter_rows(y, E, pairs, n, expert_out.f(), ld(expert_out), E, stream());
    return;
  }
  if (groupable(w, E, F)) {
    // Queued; the layer's experts run as one grouped launch per projection (flush_experts).
    const bool same = !pending_.empty() && pend_.h == h.f() && pend_.ldh == ld(h) && pend_.out == expert_out.f() &&
                      pend_.ldo == ld(expert_out) && pend_.top_k == top_k && pend_.E == E && pend_.F == F &&
                      pend_.gate_type == w.gate.type && pend_.down_type == w.down.type &&
                      pend_.gate_rb == w.gate.row_bytes() && pend_.down_rb == w.down.row_bytes();
    if (!same) flush_experts();
    if (pending_.empty()) {
      pend_ = PendingGroup{h.f(),       ld(h),       expert_out.f(),     ld(expert_out),    top_k, E, F,
                           w.gate.type, w.down.type, w.gate.row_bytes(), w.down.row_bytes()};
    }
    pending_.push_back(PendingExpert{w.gate.data, w.up.data, w.down.data, {job.pairs.begin(), job.pairs.end()}});
    if (int(pending_.size()) >= kMaxPendingExperts) flush_experts();
    return;
  }
  flush_experts();
  ProfScope ps(*this, "expert_ffn (ungrouped)", n);
  // Gather the expert's token rows, SwiGLU on all of them at once, scatter to the (token, k) rows.
  const size_t head = sz<int64_t>(size_t(n)) + 2 * sz<float>(size_t(n * E));
  char* base = scratch(head + 2 * sz<float>(size_t(n * F)));
  Carve c{base};
  int64_t* pairs = c.take<int64_t>(size_t(n));
  float* xg = c.take<float>(size_t(n * E));
  float* y = c.take<float>(size_t(n * E));
  upload_async(pairs, job.pairs.data(), size_t(n) * sizeof(int64_t));
  gather_rows(h.f(), ld(h), pairs, top_k, n, xg, E, E, stream());
  swiglu_ffn(job.w, xg, E, n, y, E, base + head);
  scatter_rows(y, E, pairs, n, expert_out.f(), ld(expert_out), E, stream());
}

void CudaBackend::grouped_down_q8_to_pairs(const GroupedMatmulPlan& plan, GgmlType type, const GroupedMatmulJob* jobs,
                                           int n_jobs, size_t row_bytes, int64_t E, int64_t F, const int8_t* aq,
                                           const float* ad, const int64_t* pairs, int64_t n, float* y, float* out,
                                           int64_t ldo, int64_t prof_tokens) {
  const bool scattered_store = plan.tile_tokens == kGemmTileTokens;  // the GEMM stores row j to row pairs[j]
  {
    ProfScope pk(*this, "experts grouped down (q8)", prof_tokens);
    grouped_matmul_q8(plan, type, jobs, n_jobs, row_bytes, E, F, aq, ad, scattered_store ? out : y,
                      scattered_store ? ldo : E, false, stream(), scattered_store ? pairs : nullptr);
  }
  if (!scattered_store) scatter_rows(y, E, pairs, n, out, ldo, E, stream());
}

void CudaBackend::flush_experts() {
  if (pending_.empty()) return;
  const PendingGroup g = pend_;
  std::vector<PendingExpert> jobs;
  jobs.swap(pending_);
  const int nj = int(jobs.size());
  std::vector<int64_t> pairs;
  std::vector<GroupedMatmulJob> gu(static_cast<size_t>(nj)), dn(static_cast<size_t>(nj));
  for (int i = 0; i < nj; ++i) {
    const PendingExpert& j = jobs[size_t(i)];
    gu[size_t(i)].w = j.gate, gu[size_t(i)].w2 = j.up, dn[size_t(i)].w = j.down;
    gu[size_t(i)].row0 = dn[size_t(i)].row0 = int64_t(pairs.size());
    gu[size_t(i)].n_tok = dn[size_t(i)].n_tok = int64_t(j.pairs.size());
    pairs.insert(pairs.end(), j.pairs.begin(), j.pairs.end());
  }
  // q8 activations: the gathered rows quantized once for gate and up, the SwiGLU output once
  // for down. The plans fill in the job tables' block ranges, so plan before the upload.
  const bool q8 = act_q8_ && has_q8(g.gate_type, g.E) && has_q8(g.down_type, g.F);
  const GroupedMatmulPlan pgu = q8 ? plan_grouped_q8(gu.data(), nj, g.F, g.E, g.gate_rb)
                                   : plan_grouped(gu.data(), nj, g.F, g.E, true),
                          pdn = q8 ? plan_grouped_q8(dn.data(), nj, g.E, g.F, g.down_rb)
                                   : plan_grouped(dn.data(), nj, g.E, g.F, false);
  const int64_t N = int64_t(pairs.size());
  ProfScope ps(*this, "experts grouped (all)", N / std::max(1, g.top_k));
  Carve c{scratch(sz<int64_t>(size_t(N)) + 2 * sz<GroupedMatmulJob>(size_t(nj)) + 2 * sz<float>(size_t(N * g.E)) +
                  sz<float>(size_t(N * g.F)))};
  int64_t* d_pairs = c.take<int64_t>(size_t(N));
  auto* d_gu = c.take<GroupedMatmulJob>(size_t(nj));
  auto* d_dn = c.take<GroupedMatmulJob>(size_t(nj));
  float* xg = c.take<float>(size_t(N * g.E));
  float* act = c.take<float>(size_t(N * g.F));
  float* y = c.take<float>(size_t(N * g.E));
  {
    // The pairs and both job tables are contiguous in the carve: one upload (one copy call
    // instead of three per flush; decode's host time per layer).
    const size_t o_gu = size_t(reinterpret_cast<char*>(d_gu) - reinterpret_cast<char*>(d_pairs));
    const size_t o_dn = size_t(reinterpret_cast<char*>(d_dn) - reinterpret_cast<char*>(d_pairs));
    const size_t bytes = o_dn + dn.size() * sizeof(GroupedMatmulJob);
    std::vector<uint8_t>& st = upload_stage_;
    st.resize(bytes);
    std::memcpy(st.data(), pairs.data(), pairs.size() * sizeof(int64_t));
    std::memcpy(st.data() + o_gu, gu.data(), gu.size() * sizeof(GroupedMatmulJob));
    std::memcpy(st.data() + o_dn, dn.data(), dn.size() * sizeof(GroupedMatmulJob));
    upload_async(d_pairs, st.data(), bytes);
  }
  if (q8) {
    // the rows gathered by the quantizer itself (no fp32 copy of them)
    const auto [xq, xd, aq, ad] = q8_ffn_scratch(N, g.E, g.F);
    quantize_q8_rows(g.h, g.ldh, g.E, N, d_pairs, g.top_k, xq, xd, stream());
    {
      ProfScope pk(*this, "experts grouped gate/up (q8)", N / std::max(1, g.top_k));
      grouped_matmul_q8(pgu, g.gate_type, d_gu, nj, g.gate_rb, g.F, g.E, xq, xd, act, g.F, true, stream());
    }
    quantize_q8(act, g.F, g.F, N, aq, ad, stream());
    grouped_down_q8_to_pairs(pdn, g.down_type, d_dn, nj, g.down_rb, g.E, g.F, aq, ad, d_pairs, N, y, g.out, g.ldo,
                             N / std::max(1, g.top_k));
    return;
  }
  gather_rows(g.h, g.ldh, d_pairs, g.top_k, N, xg, g.E, g.E, stream());
  {
    ProfScope pk(*this, "experts grouped gate/up", N / std::max(1, g.top_k));
    grouped_matmul(pgu, g.gate_type, d_gu, nj, g.gate_rb, g.F, g.E, xg, g.E, act, g.F, true, stream());
  }
  {
    ProfScope pk(*this, "experts grouped down", N / std::max(1, g.top_k));
    grouped_matmul(pdn, g.down_type, d_dn, nj, g.down_rb, g.E, g.F, act, g.F, y, g.E, false, stream());
  }
  scatter_rows(y, g.E, d_pairs, N, g.out, g.ldo, g.E, stream());
}

const CudaBackend::DeviceMoeTable& CudaBackend::moe_table(const backend::DeviceMoeCall& c) {
  DeviceMoeTable& t = moe_tables_[{c.owner, c.layer}];
  if (t.generation == c.generation && (t.ok || t.n_expert < 0)) return t;
  t = DeviceMoeTable{};
  t.generation = c.generation;
  t.n_expert = -1;  // checked, not usable (until the generation changes)
  std::vector<backend::FfnWeights> ws;
  c.experts(ws);
  const int64_t n = int64_t(ws.size()), E = c.h.cols();
  if (n < 1 || n != c.router.rows() || n > INT32_MAX / 3) return t;
  const backend::FfnWeights& w0 = ws[0];
  const int64_t F = w0.gate.rows();
  std::vector<const void*> ptrs(size_t(3 * n));
  std::vector<GroupedMatmulJob> gu(static_cast<size_t>(n)), dn(static_cast<size_t>(n));
  bool al8_gu = true, al8_dn = true, al4 = true, al16_gu = true, al16_dn = true;
  for (int64_t e = 0; e < n; ++e) {
    const backend::FfnWeights& w = ws[size_t(e)];
    if (general_expert(*c.ffn, w)) return t;  // biases or the clamped SwiGLU: one expert at a time
    // what flush_experts groups, with every expert of the layer in one group (expert 0's types)
    const bool same = groupable(w, E, F) && w.gate.type == w0.gate.type && w.down.type == w0.down.type &&
                      w.gate.row_bytes() == w0.gate.row_bytes() && w.down.row_bytes() == w0.down.row_bytes();
    if (!same) return t;
    ptrs[size_t(3 * e)] = w.gate.data, ptrs[size_t(3 * e + 1)] = w.up.data, ptrs[size_t(3 * e + 2)] = w.down.data;
    for (int p = 0; p < 3; ++p) {
      const auto a = reinterpret_cast<uintptr_t>(ptrs[size_t(3 * e + p)]);
      (p < 2 ? al8_gu : al8_dn) = (p < 2 ? al8_gu : al8_dn) && a % 8 == 0;
      (p < 2 ? al16_gu : al16_dn) = (p < 2 ? al16_gu : al16_dn) && a % 16 == 0;
      al4 = al4 && a % 4 == 0;
    }
    gu[size_t(e)].w = w.gate.data, gu[size_t(e)].w2 = w.up.data, gu[size_t(e)].n_tok = 1;
    dn[size_t(e)].w = w.down.data, dn[size_t(e)].n_tok = 1;
    gu[size_t(e)].row0 = dn[size_t(e)].row0 = e;
  }
  t.E = E, t.F = F;
  t.gate_type = w0.gate.type, t.down_type = w0.down.type;
  t.gate_rb = w0.gate.row_bytes(), t.down_rb = w0.down.row_bytes();
  t.q8 = act_q8_ && has_q8(t.gate_type, E) && has_q8(t.down_type, F);
  t.gemm_gu = al8_gu && t.gate_rb % 8 == 0;
  t.gemm_dn = al8_dn && t.down_rb % 8 == 0;
  t.words = al4 && t.gate_rb % 4 == 0 && t.down_rb % 4 == 0;
  t.vec16_gu = al16_gu && t.gate_rb % 16 == 0;
  t.vec16_dn = al16_dn && t.down_rb % 16 == 0;
  // The plans flush_experts would make for one token per expert (the tile and the weight-word
  // alignment over every expert of the layer); blocks per job = blocks / n.
  t.pgu = t.q8 ? plan_grouped_q8(gu.data(), int(n), F, E, t.gate_rb) : plan_grouped(gu.data(), int(n), F, E, true);
  t.pdn = t.q8 ? plan_grouped_q8(dn.data(), int(n), E, F, t.down_rb) : plan_grouped(dn.data(), int(n), E, F, false);
  t.pgu.blocks /= n;
  t.pdn.blocks /= n;
  t.ptrs = DeviceBuffer(ptrs.size() * sizeof(void*));
  STRATA_CUDA_CHECK(cudaMemcpy(t.ptrs.get(), ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice));
  t.n_expert = int(n);
  t.ok = true;
  return t;
}

int32_t* CudaBackend::moe_landing(int layer, size_t n) {
  if (size_t(layer) >= moe_host_.size()) moe_host_.resize(size_t(layer) + 1);
  MoeLanding& m = moe_host_[size_t(layer)];
  if (n > m.words) {
    // Only this layer's area is replaced: the addresses handed out for the other layers stay valid.
    if (m.p) {
      STRATA_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));  // a queued copy may still land in it
      host_free(reinterpret_cast<uint8_t*>(m.p), m.pinned);
    }
    m = MoeLanding{};
    m.p = reinterpret_cast<int32_t*>(host_alloc(n * 4, m.pinned, "the MoE routing landing area"));
    m.words = n;
    void* dev = nullptr;
    if (m.pinned && cudaHostGetDevicePointer(&dev, m.p, 0) == cudaSuccess)
      m.dev = static_cast<int32_t*>(dev);
    else
      (void)cudaGetLastError();
  }
  return m.p;
}

const int32_t* CudaBackend::moe_on_device(const backend::DeviceMoeCall& c) {
  if (host_route_ || host_moe_ || !c.spec || !c.ffn || !c.experts || c.layer < 0) return nullptr;
  const backend::RouteCall rc{c.spec, c.router, c.router_bias, nullptr, false};
  if (!device_routable(rc) || c.ffn->act != backend::FfnSpec::Act::SwiGLU) return nullptr;
  const int64_t T = c.h.rows();
  const int K = c.spec->top_k;
  const int64_t TK = T * K;
  if (T < 1 || TK > INT32_MAX || c.expert_out.rows() < TK) return nullptr;
  flush_experts();
  const DeviceMoeTable& tb = moe_table(c);
  if (!tb.ok || tb.E != c.h.cols()) return nullptr;
  // More pairs than a decode step (prefill): grouped by expert on the device, so that each
  // expert's weights are read once per projection (the q8 GEMM only; else the host path).
  const bool grouped = TK > kDeviceMoeMaxPairs;
  if (grouped && (!tb.q8 || tb.n_expert > 4096)) return nullptr;
  ProfScope ps(*this, "moe on device (route, experts, combine)", T);
  route_w_.clear();  // route_dev_ is rewritten below
  if (route_dev_.bytes() < route_bytes(T, K)) {
    STRATA_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));  // queued kernels may still read it
    route_dev_ = DeviceBuffer();
    route_dev_ = DeviceBuffer(route_bytes(T, K));
  }
  const RouteOut ro = route_layout(route_dev_.get(), T, K);
  const int64_t E = tb.E, F = tb.F;
  if (grouped) {
    moe_grouped_on_device(c, rc, tb, ro, T, K);
    int32_t* land = moe_landing(c.layer, route_bytes(T, K) / 4);
    STRATA_CUDA_CHECK(cudaMemcpyAsync(land, ro.status, route_bytes(T, K), cudaMemcpyDeviceToHost, ctx_->stream));
    ++device_moe_layers_;
    return land;
  }
  Carve cv{scratch(sz<float>(size_t(T) * size_t(tb.n_expert)) + 2 * sz<GroupedMatmulJob>(size_t(TK)) +
                   sz<float>(size_t(TK * E)) + sz<float>(size_t(TK * F)))};
  float* logits = cv.take<float>(size_t(T) * size_t(tb.n_expert));
  auto* d_gu = cv.take<GroupedMatmulJob>(size_t(TK));
  auto* d_dn = cv.take<GroupedMatmulJob>(size_t(TK));
  float* xg = cv.take<float>(size_t(TK * E));
  float* act = cv.take<float>(size_t(TK * F));
  PairJobs pj;
  pj.table = static_cast<const void* const*>(tb.ptrs.get());
  pj.blocks_gu = tb.pgu.blocks, pj.blocks_dn = tb.pdn.blocks;
  pj.gate_up = d_gu, pj.down = d_dn;
  launch_route(rc, c.h, logits, ro, &pj);
  GroupedMatmulPlan pgu = tb.pgu, pdn = tb.pdn;
  pgu.blocks *= TK;
  pdn.blocks *= TK;
  float* y = c.expert_out.f();
  const int64_t ldy = ld(c.expert_out);
  // One pair a job (pgu / pdn: one_token): the mat-vecs quantize their activations themselves
  // (grouped_matmul_q8_x1, the bits of the quantizer launches below).
  const bool x1 = tb.q8 && pgu.one_token && pgu.vec16 && pdn.one_token && pdn.vec16 &&
                  q8_x1_takes(tb.gate_type, tb.gate_rb, E, c.h.f(), ld(c.h)) &&
                  q8_x1_takes(tb.down_type, tb.down_rb, F, act, F);
  if (x1) {
    L2Prefetch down_w;  // the pairs' down weights into L2 while gate/up streams its own
    down_w.jobs = d_dn, down_w.n_jobs = int(TK), down_w.job_bytes = size_t(E) * tb.down_rb;
    grouped_matmul_q8_x1(pgu, tb.gate_type, d_gu, int(TK), tb.gate_rb, F, E, c.h.f(), ld(c.h), K, act, F, true,
                         stream(), &down_w);  // pair j: token j / K's row
    grouped_matmul_q8_x1(pdn, tb.down_type, d_dn, int(TK), tb.down_rb, E, F, act, F, 1, y, ldy, false, stream());
  } else if (tb.q8) {
    const auto [xq, xd, aq, ad] = q8_ffn_scratch(TK, E, F);
    quantize_q8(c.h.f(), ld(c.h), E, TK, xq, xd, stream(), K);  // row j: token j / K's codes
    grouped_matmul_q8(pgu, tb.gate_type, d_gu, int(TK), tb.gate_rb, F, E, xq, xd, act, F, true, stream());
    quantize_q8(act, F, F, TK, aq, ad, stream());
    grouped_matmul_q8(pdn, tb.down_type, d_dn, int(TK), tb.down_rb, E, F, aq, ad, y, ldy, false, stream());
  } else {
    repeat_rows(c.h.f(), ld(c.h), K, TK, xg, E, E, stream());
    grouped_matmul(pgu, tb.gate_type, d_gu, int(TK), tb.gate_rb, F, E, xg, E, act, F, true, stream());
    grouped_matmul(pdn, tb.down_type, d_dn, int(TK), tb.down_rb, E, F, act, F, y, ldy, false, stream());
  }
  const int64_t words = int64_t(route_bytes(T, K) / 4);
  int32_t* land = moe_landing(c.layer, size_t(words));
  // The routing words reach the landing from the combine kernel itself where the device can
  // write it (no copy node between this layer's kernels and the next's);
  // STRATA_CUDA_ROUTE_PUBLISH=0 for the copy of before (docs/cuda.md, thirteenth session).
  static detail::EnvSwitch publish_env{"STRATA_CUDA_ROUTE_PUBLISH", detail::off_if_zero};
  int32_t* dev_land = publish_env.get() != 0 && c.out.cols() > 0 ? moe_host_[size_t(c.layer)].dev : nullptr;
  cuda::moe_combine(y, ldy, ro.weights, K, T, c.out.f(), ld(c.out), c.out.cols(), stream(), ro.status, dev_land,
                    dev_land ? words : 0);
  if (!dev_land)
    STRATA_CUDA_CHECK(cudaMemcpyAsync(land, ro.status, route_bytes(T, K), cudaMemcpyDeviceToHost, ctx_->stream));
  ++device_moe_layers_;
  return land;
}

void CudaBackend::moe_grouped_on_device(const backend::DeviceMoeCall& c, const backend::RouteCall& rc,
                                        const DeviceMoeTable& tb, const RouteOut& ro, int64_t T, int K) {
  const int64_t TK = T * K, E = tb.E, F = tb.F;
  const int nj = tb.n_expert;
  int64_t rb_gu = 0, rb_dn = 0;
  const GroupedMatmulPlan pgu = plan_grouped_q8_bound(nj, TK, F, tb.gemm_gu, tb.words, tb.vec16_gu, rb_gu),
                          pdn = plan_grouped_q8_bound(nj, TK, E, tb.gemm_dn, tb.words, tb.vec16_dn, rb_dn);
  Carve cv{scratch(sz<float>(size_t(T) * size_t(nj)) + sz<int64_t>(size_t(TK)) + 2 * sz<GroupedMatmulJob>(size_t(nj)) +
                   sz<float>(size_t(TK * E)) + sz<float>(size_t(TK * F)))};
  float* logits = cv.take<float>(size_t(T) * size_t(nj));
  int64_t* d_pairs = cv.take<int64_t>(size_t(TK));
  auto* d_gu = cv.take<GroupedMatmulJob>(size_t(nj));
  auto* d_dn = cv.take<GroupedMatmulJob>(size_t(nj));
  float* act = cv.take<float>(size_t(TK * F));
  float* y = cv.take<float>(size_t(TK * E));
  launch_route(rc, c.h, logits, ro);
  group_pairs(ro.ids, TK, static_cast<const void* const*>(tb.ptrs.get()), nj, pgu.tile_tokens, rb_gu,
              pdn.tile_tokens, rb_dn, d_pairs, d_gu, d_dn, stream());
  // flush_experts' sequence from here on, with the device's job tables (the quantizer gathers)
  const auto [xq, xd, aq, ad] = q8_ffn_scratch(TK, E, F);
  quantize_q8_rows(c.h.f(), ld(c.h), E, TK, d_pairs, K, xq, xd, stream());
  {
    ProfScope pk(*this, "experts grouped gate/up (q8)", T);
    grouped_matmul_q8(pgu, tb.gate_type, d_gu, nj, tb.gate_rb, F, E, xq, xd, act, F, true, stream());
  }
  quantize_q8(act, F, F, TK, aq, ad, stream());
  grouped_down_q8_to_pairs(pdn, tb.down_type, d_dn, nj, tb.down_rb, E, F, aq, ad, d_pairs, TK, y, c.expert_out.f(),
                           ld(c.expert_out), T);
  cuda::moe_combine(c.expert_out.f(), ld(c.expert_out), ro.weights, K, T, c.out.f(), ld(c.out), c.out.cols(),
                    stream());
}

void CudaBackend::moe_combine(const backend::Routing& r, const Tensor& expert_out, const Tensor& out) {
  flush_experts();
  const int64_t T = r.n_tokens();
  if (T == 0) return;
  ProfScope ps(*this, "moe_combine", T);
  const float* w = nullptr;
  if (!route_w_.empty() && route_k_ == r.top_k && route_w_ == r.weights) {
    // The weights of the last route(), still on the device (route_dev_): no upload. Compared by
    // value, so a Routing edited on the host, or another routing, is uploaded as before.
    w = route_layout(route_dev_.get(), T, r.top_k).weights;
  } else {
    float* up = Carve{scratch(sz<float>(r.weights.size()))}.take<float>(r.weights.size());
    upload_async(up, r.weights.data(), r.weights.size() * sizeof(float));
    w = up;
  }
  cuda::moe_combine(expert_out.f(), ld(expert_out), w, r.top_k, T, out.f(), ld(out), out.cols(), stream());
}

// ---- memory reporting and the pinned host-to-device probe (cuda_backend.h) ----

size_t pinned_host_bytes() noexcept {
  std::lock_guard lk(g_pinned_mu);
  return g_pinned_total;
}

void device_mem_info(int device, size_t& free_bytes, size_t& total_bytes) {
  STRATA_CUDA_CHECK(cudaSetDevice(device));
  STRATA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
}

H2dProbe measure_h2d(int device, size_t bytes, int reps) {
  if (bytes == 0 || reps < 1) throw std::invalid_argument("h2d probe: needs bytes > 0 and reps >= 1");
  STRATA_CUDA_CHECK(cudaSetDevice(device));
  H2dProbe r;
  r.bytes = bytes;
  r.reps = reps;
  uint8_t* host = host_alloc(bytes, r.pinned, "the host-to-device probe");
  void* dev = nullptr;
  cudaStream_t st = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  auto cleanup = [&] {
    if (e0) (void)cudaEventDestroy(e0);
    if (e1) (void)cudaEventDestroy(e1);
    if (st) (void)cudaStreamDestroy(st);
    if (dev) (void)cudaFree(dev);
    host_free(host, r.pinned);
  };
  try {
    std::memset(host, 1, bytes);  // page in (pageable fallback) before timing
    require_vram(device, bytes, "the host-to-device probe");
    const cudaError_t e = cudaMalloc(&dev, bytes);
    if (e != cudaSuccess) throw_alloc_error(e, device, bytes, "the host-to-device probe");
    STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    STRATA_CUDA_CHECK(cudaEventCreate(&e0));
    STRATA_CUDA_CHECK(cudaEventCreate(&e1));
    // one untimed copy (first-touch of the device pages, link wake-up), then `reps` timed ones
    STRATA_CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, st));
    STRATA_CUDA_CHECK(cudaEventRecord(e0, st));
    for (int i = 0; i < reps; ++i) STRATA_CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, st));
    STRATA_CUDA_CHECK(cudaEventRecord(e1, st));
    STRATA_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    STRATA_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    r.seconds = double(ms) / 1e3;
    r.gbps = r.seconds > 0 ? double(bytes) * double(reps) / r.seconds / 1e9 : 0.0;
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
  return r;
}

}  // namespace strata::cuda
