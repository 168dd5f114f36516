#include "engine/engine.h"

#include "engine/logits_scan.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <regex>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "backend/cpu/cpu_backend.h"
#include "engine/static_rank.h"
#include "io/file.h"
#include "model/dump.h"
#include "model/weights.h"
#include "quant/quant.h"
#include "stream/pack.h"
#ifdef STRATA_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace strata::engine {

namespace {

// Bytes of the arena slot that holds the largest expert record (the stream's own rule: each
// part read as the 4 KiB-aligned range covering it, touching ranges merged).
uint64_t slot_bytes_for(const std::vector<stream::LayerExperts>& layers) {
  return stream::ExpertStream::slot_bytes_for(layers);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

uint64_t mem_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

uint64_t chunk_scratch_bytes_per_token(const model::ModelHParams& hp) {
  const uint64_t E = hp.n_embd, q = uint64_t(hp.n_head) * hp.head_dim_k, kv = uint64_t(hp.n_head_kv) * hp.head_dim_k;
  const uint64_t K = hp.n_expert_used, X = hp.n_expert, F = std::max(hp.n_ff_exp, hp.n_ff_shexp);
  // x, h, o; q, k, v, attention output; router and prediction logits; expert outputs per
  // (token, k); the gathered expert input and its gate/up rows; logits of the token.
  const uint64_t floats = 3 * E + 2 * q + 2 * kv + 2 * X + K * E + E + 2 * F + uint64_t(hp.n_vocab);
  return floats * sizeof(float);
}

int auto_prompt_chunk(const model::ModelHParams& hp, int64_t n_ctx) {
  const uint64_t budget = mem_available_bytes() / 16;
  uint64_t chunk = budget / std::max<uint64_t>(1, chunk_scratch_bytes_per_token(hp));
  chunk = std::min<uint64_t>(chunk, 2048);
  chunk = std::min<uint64_t>(chunk, uint64_t(std::max<int64_t>(n_ctx, 1)));
  chunk = chunk / 64 * 64;
  return int(std::max<uint64_t>(chunk, std::min<int64_t>(64, std::max<int64_t>(n_ctx, 1))));
}

bool cuda_device_present() {
#ifdef STRATA_HAVE_CUDA
  return cuda::device_count() > 0;
#else
  return false;
#endif
}

std::unique_ptr<backend::Backend> make_backend(EngineOptions& opts, const cpu::kernels::KernelConfig& kernels) {
  if (opts.backend == "auto") opts.backend = cuda_device_present() ? "cuda" : "cpu";
  if (opts.backend == "cpu") return std::make_unique<cpu::CpuBackend>(cpu::CpuOptions{opts.n_threads, kernels});
  if (opts.backend != "cuda")
    throw EngineError(fmt::format("--backend must be cpu, cuda or auto, got '{}'", opts.backend));
#ifdef STRATA_HAVE_CUDA
  const int n = cuda::device_count();
  check_ep_ranks_for_devices(opts.ep_ranks, n);
  if (n == 0)
    throw EngineError("--backend cuda: no CUDA device found (cudaGetDeviceCount reports none); use --backend cpu");
  if (opts.device < 0 || opts.device >= n)
    throw EngineError(fmt::format("--device {}: there {} {} CUDA device{} (0..{})", opts.device, n == 1 ? "is" : "are",
                                  n, n == 1 ? "" : "s", n - 1));
  // --act-quant: q8 (auto resolves to q8 unless the scalar CPU family is forced) quantizes the
  // activations of the CUDA q8 path's weight types (cuda::has_q8); the others stay fp32
  return std::make_unique<cuda::CudaBackend>(cuda::CudaOptions{opts.device, kernels.act == cpu::kernels::ActQuant::Q8});
#else
  throw EngineError(
      "--backend cuda: this strata was built without the CUDA backend (configure with nvcc installed, "
      "-DSTRATA_CUDA=ON); use --backend cpu");
#endif
}

void check_ep_ranks_for_devices(int ep_ranks, int device_count) {
  if (ep_ranks > device_count)
    throw EngineError(fmt::format(
        "--ep-ranks {} with --backend cuda needs one CUDA device per rank, but there {} {} CUDA device{}; use "
        "--ep-ranks {} or fewer, or --backend cpu to simulate {} ranks",
        ep_ranks, device_count == 1 ? "is" : "are", device_count, device_count == 1 ? "" : "s",
        std::max(1, device_count), ep_ranks));
  if (ep_ranks > 1)
    throw EngineError(
        fmt::format("--ep-ranks {} with --backend cuda needs the NCCL communicator, which this build does not have yet "
                    "(docs/expert-parallel.md); use --ep-ranks 1, or --backend cpu to simulate {} ranks",
                    ep_ranks, ep_ranks));
}

uint64_t default_arena_bytes(uint64_t all_expert_slot_bytes, uint64_t resident_bytes, uint64_t min_bytes) {
  const uint64_t avail = mem_available_bytes();
  uint64_t budget = avail / 2 > resident_bytes ? avail / 2 - resident_bytes : 0;
  budget = std::min(budget, all_expert_slot_bytes);
  return std::max(budget, min_bytes);
}

uint64_t default_host_cache_bytes(bool arena_on_device, uint64_t arena_bytes, uint64_t all_expert_slot_bytes,
                                  uint64_t mem_available) {
  if (!arena_on_device || arena_bytes >= all_expert_slot_bytes) return 0;
  return std::min(mem_available / 2, all_expert_slot_bytes);
}

uint64_t resolve_host_cache_bytes(int64_t host_cache_mb, bool arena_on_device, uint64_t arena_bytes,
                                  uint64_t all_expert_slot_bytes, uint64_t mem_available) {
  if (host_cache_mb < -1)
    throw EngineError(
        fmt::format("--host-cache-mb must be 0 (off), a size in MiB or -1 (automatic), got {}", host_cache_mb));
  if (host_cache_mb < 0)
    return default_host_cache_bytes(arena_on_device, arena_bytes, all_expert_slot_bytes, mem_available);
  const uint64_t asked = host_cache_mb >= (int64_t(1) << 43) ? UINT64_MAX : uint64_t(host_cache_mb) << 20;
  // More than is available is an error even when the model's experts need less (a size the machine
  // cannot give is a mistake); within it, the tier is capped at every expert.
  if (mem_available > 0 && asked > mem_available)
    throw EngineError(
        fmt::format("--host-cache-mb {}: {:.1f} MiB of {} memory asked for, but only {:.1f} MiB are available "
                    "(MemAvailable); use --host-cache-mb {} or less",
                    host_cache_mb, double(asked) / 1048576.0, arena_on_device ? "pinned host" : "host",
                    double(mem_available) / 1048576.0, mem_available >> 20));
  return std::min(asked, all_expert_slot_bytes);
}

CopyProbe measure_arena_copy(bool device_arena, int device, size_t bytes, int reps) {
  if (bytes == 0 || reps < 1) throw EngineError("copy probe: needs bytes > 0 and reps >= 1");
  CopyProbe r;
  r.bytes = bytes;
  r.reps = reps;
  if (device_arena) {
#ifdef STRATA_HAVE_CUDA
    const cuda::H2dProbe p = cuda::measure_h2d(device, bytes, reps);
    r.kind = p.pinned ? "h2d pinned" : "h2d pageable";
    r.gbps = p.gbps;
    return r;
#else
    (void)device;
    throw EngineError("host-to-device probe: this strata was built without the CUDA backend");
#endif
  }
  io::AlignedBuffer a(bytes), b(bytes);
  std::memset(a.data(), 1, bytes);
  std::memset(b.data(), 0, bytes);  // both paged in before timing
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) {
    a.data()[size_t(i) % bytes] = uint8_t(i);
    std::memcpy(b.data(), a.data(), bytes);
  }
  const double s = seconds_since(t0);
  volatile uint8_t sink = b.data()[size_t(reps - 1) % bytes];
  (void)sink;
  r.kind = "memcpy";
  r.gbps = s > 0 ? double(bytes) * double(reps) / s / 1e9 : 0.0;
  return r;
}

MemoryReport memory_report(int device) {
  MemoryReport r;
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string key;
    uint64_t kb = 0;
    ls >> key >> kb;
    if (key == "VmRSS:") r.rss_bytes = kb * 1024;
    if (key == "VmHWM:") r.rss_peak_bytes = kb * 1024;
  }
  r.mem_available_bytes = mem_available_bytes();
#ifdef STRATA_HAVE_CUDA
  r.pinned_bytes = cuda::pinned_host_bytes();
  try {
    if (device >= 0 && device < cuda::device_count()) {
      size_t f = 0, t = 0;
      cuda::device_mem_info(device, f, t);
      r.has_device = true;
      r.device = device;
      r.vram_free_bytes = f;
      r.vram_total_bytes = t;
    }
  } catch (const std::exception&) {
    r.has_device = false;
  }
#else
  (void)device;
#endif
  return r;
}

stream::StreamStats operator-(const stream::StreamStats& b, const stream::StreamStats& a) {
  stream::StreamStats d = b;
  stream::for_each_counter(d, a, [](auto& x, const auto& y) { x -= y; });
  return d;
}

stream::StreamStats& operator+=(stream::StreamStats& a, const stream::StreamStats& b) {
  stream::for_each_counter(a, b, [](auto& x, const auto& y) { x += y; });
  return a;
}

Engine::Engine(const std::string& path, const EngineOptions& opts) : opts_(opts) {
  if (opts_.prompt_chunk < 0)
    throw EngineError(fmt::format("--prompt-chunk must be at least 1 (or 0 = automatic), got {}", opts_.prompt_chunk));
  if (opts_.n_threads < 0 || opts_.n_threads > kMaxThreads)
    throw EngineError(
        fmt::format("--threads must be between 0 (all cores) and {}, got {}", kMaxThreads, opts_.n_threads));
  if (opts_.io_threads > kMaxThreads)
    throw EngineError(fmt::format("--io-threads must be at most {}, got {}", kMaxThreads, opts_.io_threads));
  if (opts_.io_threads < 1) throw EngineError(fmt::format("--io-threads must be at least 1, got {}", opts_.io_threads));
  if (opts_.arena_mb < 0) throw EngineError(fmt::format("--arena-mb must be positive, got {}", opts_.arena_mb));
  if (opts_.host_cache_mb < -1)
    throw EngineError(
        fmt::format("--host-cache-mb must be 0 (off), a size in MiB or -1 (automatic), got {}", opts_.host_cache_mb));
  if (opts_.ep_ranks < 0)
    throw EngineError(fmt::format("--ep-ranks must be 0 (off) or a number of ranks, got {}", opts_.ep_ranks));
  if (opts_.ep_placement != "auto" && opts_.ep_placement != "id" && opts_.ep_placement != "popularity")
    throw EngineError(fmt::format("--ep-placement must be auto, id or popularity, got '{}'", opts_.ep_placement));
  kernels_ = cpu::kernels::resolve_kernels(opts_.kernels, opts_.act_quant);
  gguf_ = std::make_unique<gguf::File>(gguf::File::open(path));
  gguf_->require_model();
  tok_ = std::make_unique<tokenizer::Tokenizer>(tokenizer::Tokenizer::from_gguf(*gguf_));
  if (opts_.n_threads <= 0) opts_.n_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  backend_ = make_backend(opts_, kernels_);
  if (opts_.profile) backend_->set_loop_profiling(true);  // the stages' thread-scaling projection
  model_ = model::load_model(*gguf_, *backend_, opts_.load);
  const auto& hp = model_->hparams();
  if (tok_->n_vocab() < hp.n_vocab)
    throw model::ModelError(
        fmt::format("{}: tokenizer has {} tokens but token_embd has {} rows", path, tok_->n_vocab(), hp.n_vocab));

  if (opts_.n_ctx < 0)
    throw EngineError(fmt::format("--ctx-size must be positive (or 0 = the model's), got {}", opts_.n_ctx));
  if (opts_.n_ctx <= 0) opts_.n_ctx = std::min<int64_t>(hp.n_ctx_train > 0 ? hp.n_ctx_train : 4096, 4096);
  if (hp.n_ctx_train > 0 && opts_.n_ctx > hp.n_ctx_train)
    throw EngineError(
        fmt::format("--ctx-size {} exceeds the model's context of {} tokens ({}.context_length in the file; "
                    "strata applies the RoPE scaling the file declares, such as YaRN, but does not stretch the "
                    "context beyond it); use at most {}",
                    opts_.n_ctx, hp.n_ctx_train, hp.arch, hp.n_ctx_train));
  // The KV cache (and recurrent state) of one sequence lives in host RAM on the CPU backend:
  // refuse a context it cannot hold before allocating it.
  if (dynamic_cast<cpu::CpuBackend*>(backend_.get()) != nullptr) {
    const uint64_t state = model_->state_bytes(opts_.n_ctx), avail = mem_available_bytes();
    if (avail > 0 && state > avail)
      throw EngineError(
          fmt::format("--ctx-size {}: the KV cache of one sequence needs {:.1f} MiB but only {:.1f} MiB "
                      "are available (MemAvailable); lower -c/--ctx-size",
                      opts_.n_ctx, double(state) / 1048576.0, double(avail) / 1048576.0));
  }
  const bool auto_chunk = opts_.prompt_chunk == 0;
  if (auto_chunk) opts_.prompt_chunk = auto_prompt_chunk(hp, opts_.n_ctx);
  // A chunk never holds more than the context: a larger one would only size scratch (and shrink
  // the automatic arena) for tokens that cannot exist.
  if (opts_.prompt_chunk > opts_.n_ctx) {
    fmt::print(stderr, "strata: --prompt-chunk {} capped at the context of {} tokens\n", opts_.prompt_chunk,
               opts_.n_ctx);
    opts_.prompt_chunk = int(opts_.n_ctx);
  }

  // Arena: at least one layer's worst case for a prompt chunk.
  // Experts come from the pack sidecar when a valid one exists (one read per expert), else the GGUF.
  expert_file_ = path;
  std::vector<stream::LayerExperts> layers = model_->expert_layout();
  if (opts_.use_pack) {
    if (auto pack = stream::open_pack(path, layers)) {
      fmt::print(stderr, "strata: using packed experts from {}\n", pack->path);
      expert_file_ = pack->path;
      layers = std::move(pack->layers);
    }
  }
  const uint64_t slot = slot_bytes_for(layers);
  uint64_t max_experts = 0;
  for (const auto& L : layers) {
    max_experts = std::max<uint64_t>(max_experts, L.n_expert);
    for (const auto& p : L.part) expert_bytes_ += p.expert_bytes * uint64_t(L.n_expert);
  }
  uint64_t all_slots = 0;
  for (const auto& L : layers) all_slots += uint64_t(L.n_expert) * slot;
  const uint64_t top_k = uint64_t(std::max(1, hp.n_expert_used));
  const bool pinned_arena = opts_.arena_bytes > 0 || opts_.arena_mb > 0;
  const uint64_t pinned_bytes =
      opts_.arena_bytes > 0 ? opts_.arena_bytes : uint64_t(std::max<int64_t>(0, opts_.arena_mb)) << 20;
  // A pinned arena with an automatic chunk: the chunk shrinks until one layer's worst case (top-k
  // experts per token) fits, so a small arena works for any prompt (slower: more reads per token).
  // Under --ep-ranks each rank has 1/N of the arena and owns at most ceil(experts / N) of a layer.
  const uint64_t ep_n = uint64_t(std::max(1, opts_.ep_ranks));
  const uint64_t rank_experts = (max_experts + ep_n - 1) / ep_n;
  if (pinned_arena && auto_chunk && max_experts > 0) {
    const uint64_t slots = pinned_bytes / slot / ep_n;
    if (slots < std::min<uint64_t>(top_k * uint64_t(opts_.prompt_chunk), rank_experts))
      // (fewer slots than top-k: chunk 1, so that the error below names the true minimum, one
      // token's top-k experts, not a whole layer)
      opts_.prompt_chunk = int(std::min<uint64_t>(uint64_t(opts_.prompt_chunk), std::max<uint64_t>(1, slots / top_k)));
  }
  const uint64_t min_slots = std::min<uint64_t>(top_k * uint64_t(opts_.prompt_chunk), max_experts);
  min_arena_bytes_ = std::max<uint64_t>(1, min_slots) * slot;
  if (opts_.ep_ranks > 0) min_arena_bytes_ = ep_n * std::max<uint64_t>(1, std::min(min_slots, rank_experts)) * slot;
  // An automatically sized arena gives way to the chunk's scratch; a pinned one does not.
  const uint64_t resident = model_->dense_bytes() + model_->state_bytes(opts_.n_ctx) +
                            chunk_scratch_bytes_per_token(hp) * uint64_t(opts_.prompt_chunk);
  uint64_t arena = pinned_arena ? pinned_bytes : default_arena_bytes(all_slots, resident, min_arena_bytes_);
#ifdef STRATA_HAVE_CUDA
  if (auto* cb = dynamic_cast<cuda::CudaBackend*>(backend_.get()); cb && !pinned_arena) {
    // The arena lives in VRAM: what is free now (the weights are loaded) minus the KV cache, the
    // chunk's scratch and 1 GiB of headroom, capped at all experts, at least one layer's worst case.
    size_t free_b = 0, total_b = 0;
    cb->mem_info(free_b, total_b);
    const uint64_t need = model_->state_bytes(opts_.n_ctx) +
                          chunk_scratch_bytes_per_token(hp) * uint64_t(opts_.prompt_chunk) + (uint64_t(1) << 30);
    arena = std::max(std::min<uint64_t>(free_b > need ? free_b - need : 0, all_slots), min_arena_bytes_);
  }
#endif
  if (opts_.arena_mb == 0) opts_.arena_mb = int64_t((arena + (1 << 20) - 1) >> 20);

  // The host RAM tier: automatic only where the arena is not in host RAM; an explicit size must
  // fit in what the kernel says is available (pinned memory cannot be swapped out).
  bool arena_on_device = false;
#ifdef STRATA_HAVE_CUDA
  arena_on_device = dynamic_cast<cuda::CudaBackend*>(backend_.get()) != nullptr;
#endif
  const uint64_t host_cache =
      resolve_host_cache_bytes(opts_.host_cache_mb, arena_on_device, arena, all_slots, mem_available_bytes());
  if (opts_.host_cache_mb > 0 && host_cache < (uint64_t(opts_.host_cache_mb) << 20))
    fmt::print(stderr, "strata: --host-cache-mb {} capped at {:.1f} MiB, what every expert of the model takes\n",
               opts_.host_cache_mb, double(host_cache) / 1048576.0);

  stream::StreamOptions so;
  so.arena_bytes = arena;
  so.io_threads = opts_.io_threads;
  so.direct = opts_.direct_io;
  so.min_slots = std::max<uint64_t>(1, min_slots);
  so.fake = opts_.fake_stream;
  set_moce_bonus(opts_.moce_bonus);
  so.host_cache_bytes = size_t(host_cache);
  if (opts_.predict_min < 1)
    throw EngineError(fmt::format("--predict-min must be at least 1, got {}", opts_.predict_min));
  if (opts_.read_ahead_layers < 1 || opts_.read_ahead_layers > 2)
    throw EngineError(fmt::format("--read-ahead-layers must be 1 or 2, got {}", opts_.read_ahead_layers));

  // Static rank sidecar: explicit path, or MODEL.strata-rank when present.
  if (opts_.static_rank != "none") {
    const std::string rp = opts_.static_rank.empty() ? default_rank_path(path) : opts_.static_rank;
    if (!opts_.static_rank.empty() && !std::filesystem::exists(rp))
      throw EngineError(fmt::format("static rank file {} does not exist", rp));
    std::optional<ExpertPopularity> pop;
    try {
      pop = read_popularity(rp, path, hp.n_layer, hp.n_expert);
    } catch (const std::runtime_error& e) {
      // A sidecar found beside the model stops nothing the user asked for: say how to go on.
      throw EngineError(fmt::format(
          "static rank file {}{}: run with --static-rank none to ignore it, or delete it or regenerate it with "
          "`strata profile -m {} -f TEXT`",
          e.what(), opts_.static_rank.empty() ? "; it is read because it lies beside the model" : "", path));
    }
    if (pop) {
      static_rank_ = pop->rank();
      static_rank_path_ = rp;
    }
  }
  try {
    if (opts_.ep_ranks > 0)
      ep_ = make_expert_parallel(layers, so);
    else
      stream_ = std::make_unique<stream::ExpertStream>(expert_file_, layers, so, *backend_);
  } catch (const stream::ArenaTooSmall& e) {
    // Both pinned: name both remedies (a smaller chunk needs fewer experts at once).
    const uint64_t fit = (arena / slot / ep_n) / top_k;
    if (!auto_chunk && fit >= 1)
      throw stream::ArenaTooSmall(fmt::format("{}, or --prompt-chunk {} or less", e.what(), fit), e.min_bytes);
    if (!auto_chunk && opts_.prompt_chunk > 1) {  // not even one token's top-k fits: the chunk-1 minimum too
      const uint64_t one = ep_n * top_k * slot;
      throw stream::ArenaTooSmall(
          fmt::format("{} (with --prompt-chunk 1: --arena-mb {} or more)", e.what(), (one + (1u << 20) - 1) >> 20),
          e.min_bytes);
    }
    throw;
  }
  // The stream allocates no more slots than there are experts: a larger --arena-mb is not an
  // error (the model fits), but the size used is said rather than silently differing.
  // (Slots of the asked size beyond the expert count; not the rounding down to whole slots.)
  if (slot > 0 && opts_.arena_mb > 0 && opts_.arena_bytes == 0 && pinned_bytes / slot > all_slots / slot)
    fmt::print(stderr,
               "strata: --arena-mb {} is more than every expert of the model takes: the arena is {:.1f} MiB, all {} "
               "experts resident\n",
               opts_.arena_mb, double(arena_bytes()) / 1048576.0, all_slots / slot);
  if (!opts_.dump_dir.empty()) {
    try {
      dump_ = std::make_unique<model::Dumper>(opts_.dump_dir, opts_.dump_filter);
    } catch (const std::regex_error& e) {
      throw EngineError(
          fmt::format("--dump-filter '{}' is not a valid regular expression: {}", opts_.dump_filter, e.what()));
    } catch (const std::runtime_error& e) {
      throw EngineError(e.what());
    }
  }
  if (opts_.preload) {
    const auto t0 = std::chrono::steady_clock::now();
    const stream::StreamStats s0 = stream_stats();
    if (preload()) {
      const stream::StreamStats s1 = stream_stats();
      fmt::print(stderr, "strata: --preload: read {} experts ({:.2f} GiB) in {:.1f} s; every expert is resident\n",
                 s1.reads - s0.reads, double(s1.bytes_read - s0.bytes_read) / double(1ull << 30), seconds_since(t0));
    } else {
      fmt::print(stderr,
                 "strata: warning: --preload ignored: the arena ({:.0f} MiB) does not hold every expert ({:.0f} MiB){}; "
                 "experts stream as usual\n",
                 double(arena_bytes()) / double(1 << 20), double(expert_bytes_) / double(1 << 20),
                 ep_ ? " or --ep-ranks is on" : "");
    }
  }
}

Engine::~Engine() = default;

bool Engine::preload() {
  if (ep_) return false;
  if (stream_->n_slots() < size_t(std::accumulate(
                               model_->expert_layout().begin(), model_->expert_layout().end(), int64_t(0),
                               [](int64_t a, const stream::LayerExperts& L) { return a + L.n_expert; })))
    return false;
  stream_->fill_all();
  stream_->wait_idle();
  return true;
}

std::unique_ptr<parallel::ExpertParallel> Engine::make_expert_parallel(const std::vector<stream::LayerExperts>& layers,
                                                                       const stream::StreamOptions& so) {
  const bool popularity =
      opts_.ep_placement == "popularity" || (opts_.ep_placement == "auto" && !static_rank_path_.empty());
  const std::vector<parallel::LayerShape> shapes = parallel::layer_shapes(layers);
  try {
    parallel::Placement placement = parallel::Placement::by_id(shapes, opts_.ep_ranks);
    if (popularity) {
      if (static_rank_path_.empty())
        throw EngineError(
            "--ep-placement popularity needs a static rank (MODEL.strata-rank from `strata profile`, or "
            "--static-rank FILE)");
      const auto pop = read_popularity(static_rank_path_, gguf_->path(), hparams().n_layer, hparams().n_expert);
      placement = parallel::Placement::by_popularity(shapes, opts_.ep_ranks, pop->counts);
    }
    return std::make_unique<parallel::ExpertParallel>(expert_file_, layers, std::move(placement), so, *backend_,
                                                      opts_.ep_combine);
  } catch (const parallel::PlacementError& e) {
    throw EngineError(fmt::format("--ep-ranks {}: {}", opts_.ep_ranks, e.what()));
  }
}

uint64_t Engine::arena_bytes() const {
  return ep_ ? ep_->arena_bytes() : uint64_t(stream_->n_slots()) * stream_->slot_bytes();
}
uint64_t Engine::host_cache_bytes() const {
  return ep_ ? ep_->host_cache_bytes() : uint64_t(stream_->host_slots()) * stream_->slot_bytes();
}

std::string Engine::cpu_kernels() const { return cpu::kernels::cpu_kernels_name(kernels_.family); }
std::string Engine::cpu_kernels_label() const { return cpu::kernels::cpu_kernels_label(kernels_); }
std::string Engine::act_quant() const { return cpu::kernels::act_quant_name(kernels_.act); }

model::SequenceState Engine::new_sequence() const { return model_->new_state(opts_.n_ctx); }

void Engine::reset_stats() {
  prefill_ = {};
  decode_ = {};
  times_ = {};
}

void Engine::set_moce_bonus(float bonus) {
  if (!std::isfinite(bonus) || bonus < 0)
    throw EngineError(fmt::format("--moce-bonus must be a finite number >= 0 (0 = exact routing), got {}", bonus));
  opts_.moce_bonus = bonus;
}

void Engine::check_ids(const model::SequenceState& st, std::span<const int32_t> ids) const {
  if (ids.empty()) throw EngineError("empty prompt: give at least one token");
  const int n_vocab = model_->hparams().n_vocab;
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= n_vocab)
      throw EngineError(
          fmt::format("token id {} at position {} is out of the vocabulary (0..{})", ids[i], i, n_vocab - 1));
  if (st.n_past + int64_t(ids.size()) > st.n_ctx) {
    // Advise only what can be done: -c is capped by the model's training context.
    const int64_t train = model_->hparams().n_ctx_train, need = st.n_past + int64_t(ids.size());
    const std::string advice =
        train > 0 && need > train
            ? fmt::format("the model's training context is {} tokens, the most -c/--ctx-size allows: shorten the input",
                          train)
            : fmt::format("raise -c/--ctx-size to {} or more{}", need,
                          train > 0 ? fmt::format(" (the model allows up to {})", train) : std::string());
    throw EngineError(fmt::format("{} tokens after {} past tokens exceed the context of {} tokens ({})", ids.size(),
                                  st.n_past, st.n_ctx, advice));
  }
}

void Engine::run(model::SequenceState& st, std::span<const int32_t> ids, model::LogitsMode mode,
                 std::vector<float>& logits, model::RoutingTrace* trace, PhaseStats& phase) {
  check_ids(st, ids);
  const auto t0 = std::chrono::steady_clock::now();
  const stream::StreamStats s0 = stream_stats();
  model::ForwardContext ctx{*backend_, stream(), trace, &times_, {}, nullptr, dump_.get()};
  ctx.ahead.predict = opts_.predict;
  ctx.ahead.predict_min = opts_.predict_min;
  ctx.ahead.layers = opts_.read_ahead_layers;
  ctx.ahead.static_rank = static_rank_.empty() ? nullptr : &static_rank_;
  ctx.prediction = &phase.prediction;
  ctx.moce_bonus = (&phase == &decode_ || opts_.moce_prefill) ? opts_.moce_bonus : 0.0f;
  if (dump_) dump_->set_phase(&phase == &decode_ ? "decode" : "prefill");
  ctx.moce = &phase.moce;
  ctx.profile = opts_.profile ? &phase.profile : nullptr;
  ctx.ep = ep_.get();
  ctx.interrupt = interrupt_;
  const int64_t n = int64_t(ids.size()), V = model_->hparams().n_vocab;
  if (mode == model::LogitsMode::All) logits.assign(size_t(n) * V, 0.0f);
  std::vector<float> chunk_logits;
  for (int64_t c0 = 0; c0 < n; c0 += opts_.prompt_chunk) {
    const int64_t c1 = std::min<int64_t>(n, c0 + opts_.prompt_chunk);
    const bool last_chunk = c1 == n;
    const model::LogitsMode m = mode == model::LogitsMode::All                    ? model::LogitsMode::All
                                : (last_chunk && mode == model::LogitsMode::Last) ? model::LogitsMode::Last
                                                                                  : model::LogitsMode::None;
    const auto tc = std::chrono::steady_clock::now();
    const double wait0 = stream_stats().exposed_wait_s, expert0 = times_.expert_s;
    try {
      model_->forward(ctx, st, ids.subspan(c0, c1 - c0), m, chunk_logits);
    } catch (const model::Interrupted&) {
      phase.tokens += c0;  // the finished chunks
      phase.seconds += seconds_since(t0);
      phase.stream += stream_stats() - s0;
      throw;
    }
    if (opts_.trace) {
      // One line per prompt chunk: where its time went.
      const double wall = seconds_since(tc), wait = stream_stats().exposed_wait_s - wait0;
      const double expert = times_.expert_s - expert0;
      fmt::print(stderr,
                 "strata: chunk [{}, {}) {} tokens: {:.3f} s = expert matmuls {:.3f} s + exposed wait {:.3f} s + "
                 "other compute and host work {:.3f} s\n",
                 st.n_past - (c1 - c0), st.n_past, c1 - c0, wall, expert, wait, wall - expert - wait);
    }
    if (m == model::LogitsMode::All)
      std::copy(chunk_logits.begin(), chunk_logits.end(), logits.begin() + c0 * V);
    else if (m == model::LogitsMode::Last)
      logits.swap(chunk_logits);  // the last chunk: nothing reads chunk_logits after it
  }
  // A NaN weight or a broken hyper-parameter shows up here: refuse it instead of sampling garbage.
  if (!all_finite(logits))
    throw EngineError(
        "the model produced non-finite logits (NaN or Inf weights, or invalid hyper-parameters in the file)");
  phase.tokens += n;
  phase.seconds += seconds_since(t0);
  phase.stream += stream_stats() - s0;
}

void Engine::forward_batch(std::span<model::SeqInput> batch, model::RoutingTrace* trace) {
  if (batch.empty()) throw EngineError("empty batch: give at least one sequence");
  bool all_single = true;
  int64_t n = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const model::SeqInput& s = batch[i];
    if (!s.state || (s.mode != model::LogitsMode::None && !s.logits))
      throw EngineError(fmt::format("batch entry {} has no state or no logits vector", i));
    for (size_t j = 0; j < i; ++j)
      if (batch[j].state == s.state) throw EngineError(fmt::format("batch entries {} and {} share a state", j, i));
    try {
      check_ids(*s.state, s.ids);
    } catch (const EngineError& e) {
      throw EngineError(fmt::format("batch entry {}: {}", i, e.what()));
    }
    all_single = all_single && s.ids.size() == 1;
    n += int64_t(s.ids.size());
  }
  PhaseStats& phase = all_single ? decode_ : prefill_;
  const auto t0 = std::chrono::steady_clock::now();
  const stream::StreamStats s0 = stream_stats();
  model::ForwardContext ctx{*backend_, stream(), trace, &times_, {}, &phase.prediction, dump_.get()};
  ctx.ahead.predict = opts_.predict;
  ctx.ahead.predict_min = opts_.predict_min;
  ctx.ahead.layers = opts_.read_ahead_layers;
  ctx.ahead.static_rank = static_rank_.empty() ? nullptr : &static_rank_;
  ctx.moce_bonus = (all_single || opts_.moce_prefill) ? opts_.moce_bonus : 0.0f;
  if (dump_) dump_->set_phase(all_single ? "decode" : "prefill");
  ctx.moce = &phase.moce;
  ctx.profile = opts_.profile ? &phase.profile : nullptr;
  ctx.ep = ep_.get();
  ctx.interrupt = interrupt_;
  model_->forward(ctx, batch);
  for (const model::SeqInput& s : batch)
    if (s.mode != model::LogitsMode::None && !all_finite(*s.logits))
      throw EngineError(
          "the model produced non-finite logits (NaN or Inf weights, or invalid hyper-parameters in the file)");
  phase.tokens += n;
  phase.seconds += seconds_since(t0);
  phase.stream += stream_stats() - s0;
}

void Engine::prefill(model::SequenceState& st, std::span<const int32_t> ids, model::LogitsMode mode,
                     std::vector<float>& logits, model::RoutingTrace* trace) {
  run(st, ids, mode, logits, trace, prefill_);
}

void Engine::decode(model::SequenceState& st, int32_t id, std::vector<float>& logits, model::RoutingTrace* trace) {
  const int32_t one[1] = {id};
  run(st, one, model::LogitsMode::Last, logits, trace, decode_);
}

}  // namespace strata::engine
