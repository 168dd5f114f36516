#pragma once
// The engine: one loaded model, its expert stream and thread pool, and the prompt-chunked
// forward pass over sequences. Front ends (CLI, server) talk to this header only.
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernels/kernels.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "parallel/expert_parallel.h"
#include "stream/expert_stream.h"
#include "tokenizer/tokenizer.h"

namespace strata::engine {

/// Thrown for requests the engine cannot serve: ids out of vocabulary, an empty prompt,
/// a prompt longer than the context. The message says what to change.
class EngineError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Run settings (from the user), as opposed to model hyper-parameters (from the file).
/// The most compute (-t) or IO (--io-threads) threads the engine starts.
inline constexpr int kMaxThreads = 1024;

struct EngineOptions {
  int n_threads = 0;  ///< compute threads; 0 = all hardware threads, at most kMaxThreads
  /// --backend: "cpu", "cuda" (the CudaBackend on `device`; an EngineError without a device or
  /// in a build without CUDA) or "auto" (cuda when the build has it and a device is present).
  std::string backend = "cpu";
  int device = 0;        ///< --device: CUDA device ordinal for the cuda backend
  int64_t arena_mb = 0;  ///< arena size in MiB; 0 = automatic (see default_arena_bytes)
  /// --host-cache-mb: the host RAM tier between the disk and the arena, in MiB; 0 = off, -1 =
  /// automatic (see default_host_cache_bytes: half of MemAvailable for a device arena, 0 for the
  /// CPU backend, whose arena already lives in RAM). More than MemAvailable is an EngineError.
  int64_t host_cache_mb = -1;
  uint64_t arena_bytes = 0;  ///< exact arena size in bytes; overrides arena_mb when nonzero
  int prompt_chunk = 0;      ///< tokens per prefill chunk (--prompt-chunk); 0 = from available memory
                             ///< (see auto_prompt_chunk)
  int64_t n_ctx = 0;         ///< context in tokens; 0 = min(context_length of the model, 4096)
  int io_threads = 8;        ///< expert-reading threads
  bool direct_io = true;     ///< O_DIRECT expert reads (buffered fallback with a warning)
  bool use_pack = true;      ///< read experts from MODEL.strata-pack when it is valid (--no-pack: never)
  /// --preload: when the arena holds every expert, read them all before the first forward
  /// (Engine::preload); otherwise a warning, and experts stream as usual.
  bool preload = false;
  cpu::kernels::CpuKernels kernels = cpu::kernels::CpuKernels::Auto;  ///< --cpu-kernels (auto: CPUID)
  /// --act-quant: activations of Q8_0/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ2_XS/IQ3_S/IQ4_XS matmuls quantized to int8 (Q8, as
  /// llama.cpp does) or kept fp32 (F32: exact, slower); Auto (default) is Q8 with the AVX-512
  /// kernels, else F32. This engine's only (resolved once into its KernelConfig); docs/kernels.md.
  cpu::kernels::ActQuant act_quant = cpu::kernels::ActQuant::Auto;
  model::LoadOptions load;  ///< numerics switches for parity tests (defaults are exact)
  bool predict = true;      ///< --predict: read ahead the next layer's predicted experts
  int predict_min = 1;      ///< --predict-min: only experts predicted by >= N tokens
  int read_ahead_layers = 1;  ///< --read-ahead-layers: 1 the next layer, 2 also the one after it
  /// Static-rank sidecar; "" = MODEL.strata-rank when present, "none" = do not use one.
  std::string static_rank;
  bool fake_stream = false;
  bool trace = false;  ///< --trace: one line per prompt chunk splitting its time (stderr)
  /// --dump DIR: write the named intermediates of every forward call there (model/dump.h); "" = off.
  std::string dump_dir;
  std::string dump_filter;  ///< --dump-filter REGEX: only names matching it (whole name); "" = all
  /// --moce-bonus: cache-conditional routing (backend::ResidencyBonus); 0 = exact routing. Results
  /// then depend on what is resident (arena size, IO timing). --moce-prefill: in prefill too.
  float moce_bonus = 0;
  bool moce_prefill = false;
  bool profile = false;  ///< --profile: time per forward stage into PhaseStats::profile
  /// --ep-ranks (alias --gpus): routed experts partitioned over N expert-parallel ranks, each with
  /// its own share of the arena, host tier and IO threads (docs/expert-parallel.md); 0 = off (one
  /// stream). With the CPU backend the ranks are simulated in this process; with --backend cuda N
  /// must not exceed the device count (EngineError naming both), and N > 1 needs the NCCL
  /// communicator, which this build lacks (EngineError).
  int ep_ranks = 0;
  /// --ep-placement: "id" (contiguous id ranges), "popularity" (balanced by the static rank's
  /// pick counts; an EngineError without one) or "auto" (popularity when a static rank is loaded).
  std::string ep_placement = "auto";
  /// Tests only: the combine's summation order (parallel::CombineOrder::RankPartialSums breaks
  /// bit-identity with one rank; the tests show their check catches it).
  parallel::CombineOrder ep_combine = parallel::CombineOrder::PerToken;
};

/// Tokens, wall time and stream counters of one phase (prefill or decode).
struct PhaseStats {
  int64_t tokens = 0;
  double seconds = 0;
  stream::StreamStats stream;
  model::PredictionStats prediction;
  model::MoceStats moce;        ///< --moce-bonus counters
  model::StageProfile profile;  ///< --profile: seconds per forward stage
  double tokens_per_s() const { return seconds > 0 ? double(tokens) / seconds : 0.0; }
};

class Engine {
 public:
  /// Loads the GGUF at `path`: header, tokenizer, dense weights (resident), and an arena
  /// for the experts. Throws gguf::GgufError, model::ModelError, tokenizer::TokenizerError,
  /// io::IoError, stream::ArenaTooSmall (naming the minimum --arena-mb).
  Engine(const std::string& path, const EngineOptions& opts);
  ~Engine();

  const gguf::File& gguf() const { return *gguf_; }
  const model::ModelHParams& hparams() const { return model_->hparams(); }
  const model::Model& model() const { return *model_; }
  /// The backend the forward pass runs on.
  backend::Backend& backend() { return *backend_; }
  /// Its name and what it runs on ("cpu", "2 threads, ..." / "cuda", "device 0: NVIDIA H200 ...").
  backend::BackendInfo backend_info() const { return backend_->info(); }
  const tokenizer::Tokenizer& tokenizer() const { return *tok_; }
  /// The expert stream; under --ep-ranks, rank 0's (expert_parallel() has every rank's).
  stream::ExpertStream& stream() { return ep_ ? ep_->stream(0) : *stream_; }
  /// The expert-parallel ranks (--ep-ranks), or null when off.
  const parallel::ExpertParallel* expert_parallel() const { return ep_.get(); }
  parallel::ExpertParallel* expert_parallel() { return ep_.get(); }
  /// The stream counters now, summed over the expert-parallel ranks.
  stream::StreamStats stream_stats() const { return ep_ ? ep_->stats() : stream_->stats(); }
  /// The file experts are read from: the GGUF, or its pack sidecar when one is in use.
  const std::string& expert_file() const { return expert_file_; }
  const EngineOptions& options() const { return opts_; }
  int64_t n_ctx() const { return opts_.n_ctx; }
  /// The CPU kernel family and activation mode in use after resolving `auto`, e.g. "avx512" and
  /// "q8" (cpu::kernels::cpu_kernels_name, act_quant_name).
  std::string cpu_kernels() const;
  /// cpu_kernels() with the int8 extension the q8 kernels use ("avx2 + AVX-VNNI", "avx512 + AMX").
  std::string cpu_kernels_label() const;
  std::string act_quant() const;
  /// The resolved kernel family and activation mode every forward of this engine runs.
  const cpu::kernels::KernelConfig& kernel_config() const { return kernels_; }

  /// Bytes of all routed experts in the file, and the arena actually allocated.
  uint64_t expert_bytes() const { return expert_bytes_; }
  uint64_t arena_bytes() const;
  /// The host tier actually allocated (bytes; 0 = none) and whether it is pinned.
  uint64_t host_cache_bytes() const;
  bool host_cache_pinned() const { return ep_ ? ep_->stream(0).host_pinned() : stream_->host_pinned(); }
  /// Smallest arena for the configured prompt chunk: one layer's worst case,
  /// min(top-k x chunk tokens, expert count) slots (bytes).
  uint64_t min_arena_bytes() const { return min_arena_bytes_; }

  /// A fresh sequence (empty KV cache) of n_ctx() tokens.
  model::SequenceState new_sequence() const;

  /// Runs `ids` after the sequence's past tokens, in prompt chunks of options().prompt_chunk
  /// tokens. logits: [1][n_vocab] (Last) or [ids.size()][n_vocab] (All). Counts as prefill.
  /// Throws EngineError for an empty input, ids outside [0, n_vocab), or too little context left.
  void prefill(model::SequenceState& st, std::span<const int32_t> ids, model::LogitsMode mode,
               std::vector<float>& logits, model::RoutingTrace* trace = nullptr);
  /// Runs several sequences in one forward call (no prompt chunking): every matmul and each
  /// layer's expert reads are shared by all their tokens; each sequence's logits are exactly what
  /// running it alone gives (batch invariance). Counts as decode when every entry has one token,
  /// else as prefill. Throws EngineError as prefill does (naming the entry), or for a state that
  /// appears twice.
  void forward_batch(std::span<model::SeqInput> batch, model::RoutingTrace* trace = nullptr);
  /// Runs one token; logits [n_vocab]. Counts as decode. Same errors as prefill.
  void decode(model::SequenceState& st, int32_t id, std::vector<float>& logits, model::RoutingTrace* trace = nullptr);

  const PhaseStats& prefill_stats() const { return prefill_; }
  const PhaseStats& decode_stats() const { return decode_; }
  const model::ForwardTimes& times() const { return times_; }
  /// The static rank in use (empty when none), and the file it came from.
  const std::vector<std::vector<int32_t>>& static_rank() const { return static_rank_; }
  const std::string& static_rank_path() const { return static_rank_path_; }
  void reset_stats();
  /// When the arena has a slot for every expert of the model (and no --ep-ranks): reads every
  /// expert not resident yet and waits for the reads; afterwards every MoE layer can run with no
  /// host step between router and experts (backend::Backend::moe_on_device). Returns false,
  /// reading nothing, when the arena is smaller. Rethrows nothing: a failed read is retried (and
  /// its error thrown) when a forward needs that expert. Not counted in the phase stats.
  bool preload();
  /// Later forwards (prefill, decode, forward_batch) stop between layers with model::Interrupted
  /// once `*flag` is true (null: never). A prefill so stopped counts only its finished chunks
  /// in prefill_stats(). The flag must outlive the engine's use of it.
  void set_interrupt(const std::atomic<bool>* flag) { interrupt_ = flag; }
  /// Changes the MoCE bonus for later calls (calibration); throws EngineError unless finite and >= 0.
  void set_moce_bonus(float bonus);
  /// Throws EngineError unless `ids` can be fed to `st`: not empty, every id in the vocabulary,
  /// and room in its context (prefill and decode call it; front ends may call it first).
  void check_ids(const model::SequenceState& st, std::span<const int32_t> ids) const;

 private:
  /// The --ep-ranks ranks over `layers` with `so` split among them (placement as --ep-placement says).
  std::unique_ptr<parallel::ExpertParallel> make_expert_parallel(const std::vector<stream::LayerExperts>& layers,
                                                                 const stream::StreamOptions& so);
  void run(model::SequenceState& st, std::span<const int32_t> ids, model::LogitsMode mode, std::vector<float>& logits,
           model::RoutingTrace* trace, PhaseStats& phase);

  EngineOptions opts_;
  std::unique_ptr<gguf::File> gguf_;
  std::unique_ptr<tokenizer::Tokenizer> tok_;
  std::unique_ptr<backend::Backend> backend_;  // before model_: the model's weights live in it
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<model::Dumper> dump_;
  cpu::kernels::KernelConfig kernels_;  ///< resolved from opts_.kernels / act_quant in the constructor
  std::unique_ptr<stream::ExpertStream> stream_;

  // --ep-ranks: the ranks' streams (stream_ is then null).
  std::unique_ptr<parallel::ExpertParallel> ep_;
  uint64_t expert_bytes_ = 0;
  uint64_t min_arena_bytes_ = 0;
  const std::atomic<bool>* interrupt_ = nullptr;
  PhaseStats prefill_, decode_;
  std::vector<std::vector<int32_t>> static_rank_;
  std::string expert_file_;
  std::string static_rank_path_;
  model::ForwardTimes times_;
};

/// The --ep-ranks check of the CUDA backend: throws EngineError naming both numbers when
/// `ep_ranks` is more than `device_count` (one device per rank), and for 1 < ep_ranks <=
/// device_count (the NCCL communicator is not built yet). 0 (off) and 1 pass.
void check_ep_ranks_for_devices(int ep_ranks, int device_count);

/// The automatic arena size: half of MemAvailable (/proc/meminfo) minus the dense weights
/// and KV cache, capped at all experts' slots and never below `min_bytes` (bytes).
uint64_t default_arena_bytes(uint64_t all_expert_slot_bytes, uint64_t resident_bytes, uint64_t min_bytes);

/// The automatic host tier (--host-cache-mb -1): 0 when the arena lives in host memory (the
/// CPU backend: a copy in RAM of what RAM already holds gains nothing) or already holds every
/// expert; else half of `mem_available` (bytes), capped at all experts' slots.
uint64_t default_host_cache_bytes(bool arena_on_device, uint64_t arena_bytes, uint64_t all_expert_slot_bytes,
                                  uint64_t mem_available);

/// The host tier --host-cache-mb asks for (bytes): -1 = default_host_cache_bytes, 0 = off, N =
/// N MiB capped at `all_expert_slot_bytes`. Throws EngineError below -1, and naming both sizes
/// when the (capped) request is more than `mem_available` (when that is known, > 0).
uint64_t resolve_host_cache_bytes(int64_t host_cache_mb, bool arena_on_device, uint64_t arena_bytes,
                                  uint64_t all_expert_slot_bytes, uint64_t mem_available);

/// Memory use of this process and its device, for `strata info --json` and `strata bench`.
struct MemoryReport {
  uint64_t rss_bytes = 0;            ///< VmRSS of /proc/self/status (resident set now)
  uint64_t rss_peak_bytes = 0;       ///< VmHWM of /proc/self/status (peak resident set)
  uint64_t mem_available_bytes = 0;  ///< MemAvailable of /proc/meminfo
  uint64_t pinned_bytes = 0;         ///< page-locked host memory held through the CUDA backend (0 without)
  bool has_device = false;           ///< a CUDA device was queried
  int device = 0;
  uint64_t vram_free_bytes = 0, vram_total_bytes = 0;  ///< cudaMemGetInfo of that device
};
/// Fills a MemoryReport now; the VRAM fields for CUDA device `device` when this build has CUDA
/// and the device exists (has_device). Never throws: unknown values stay 0.
MemoryReport memory_report(int device = 0);

/// The peak rate of the copy that lands a host-tier entry in an arena slot (strata ssdbw, strata bench).
struct CopyProbe {
  std::string kind;  ///< "h2d pinned", "h2d pageable" (pinning failed) or "memcpy" (host arena)
  size_t bytes = 0;  ///< bytes per copy
  int reps = 0;      ///< timed copies
  double gbps = 0;   ///< bytes * reps / seconds / 1e9
};
/// With `device_arena`: pinned host-to-device copies to CUDA device `device` (cuda::measure_h2d;
/// throws EngineError in a build without CUDA); else memcpy between two 4 KiB-aligned host
/// buffers (the CPU backend's host-tier hit). Throws EngineError for bytes == 0 or reps < 1.
CopyProbe measure_arena_copy(bool device_arena, int device, size_t bytes, int reps);

/// Bytes of scratch one prompt-chunk token needs in the forward pass (activations, q/k/v,
/// router logits, the per-(token, k) expert outputs, logits), from the hyper-parameters.
uint64_t chunk_scratch_bytes_per_token(const model::ModelHParams& hp);

/// The automatic prompt chunk: as many tokens as 1/16 of MemAvailable holds in scratch,
/// rounded down to a multiple of 64, between 64 and 2048 and at most n_ctx. Bigger chunks
/// read each expert once for more tokens (DESIGN.md: 1024 -> 2048 cut expert reads 43 %).
int auto_prompt_chunk(const model::ModelHParams& hp, int64_t n_ctx);

/// True when this build has the CUDA backend and a CUDA device is present.
bool cuda_device_present();

/// The backend `opts.backend` names ("auto" resolved in place to "cuda" or "cpu"): the CPU
/// backend with opts.n_threads threads and `kernels`, or the CUDA backend on opts.device.
/// Throws EngineError for an unknown name, for "cuda" without a device or in a build without
/// CUDA, and for a device ordinal that does not exist.
std::unique_ptr<backend::Backend> make_backend(EngineOptions& opts, const cpu::kernels::KernelConfig& kernels);

/// MemAvailable from /proc/meminfo in bytes (0 if unknown).
uint64_t mem_available_bytes();

/// Difference of counters (b - a), for per-phase deltas.
stream::StreamStats operator-(const stream::StreamStats& b, const stream::StreamStats& a);
/// Sum of counters, for accumulating phases.
stream::StreamStats& operator+=(stream::StreamStats& a, const stream::StreamStats& b);

}  // namespace strata::engine
