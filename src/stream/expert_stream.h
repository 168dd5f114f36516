#pragma once
// ExpertStream: routed experts stay on disk and pass through a fixed-size arena of
// expert slots. See docs/streaming.md for the diagram of what overlaps with what.
//
//   compute thread                        IO threads (StreamOptions::io_threads)
//   --------------                        --------------------------------------
//   request(l, ids)  --misses-->  urgent queue  --> read_at(O_DIRECT) into slot
//   prefetch(l+1, ids) ------->  read-ahead queue (served only when urgent is empty)
//   wait(l, e)  <-- blocks until e is resident (time counted as exposed wait)
//   release(l, ev)  unpins layer l's slots (they become evictable, LRU, once ev is done)
//
// Three layers: stream::SlotTable (slot_table.h) is the state machine (which expert each slot
// holds, pins, LRU, the queues, the counters); ExpertStream runs it under one mutex with the
// IO threads and condition variables; the slots' memory and the way a read lands in a slot
// come from a backend::ArenaMemory (CPU: cpu::HostArena, the read goes straight into
// the slot; a GPU backend: pinned staging and a copy). The stream never dereferences slot
// memory itself.
//
// An expert = the gate, up and down slices of one layer's expert. Each slice is read
// as the 4 KiB-aligned range covering it; slices whose ranges touch or overlap (a packed
// record: gate, up, down back to back) are read together, so a packed expert is one read.
// ExpertView points at the slice's first byte.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "gguf/ggml_types.h"
#include "stream/stats.h"

namespace strata::stream {

/// Where one part (gate, up or down) of every expert of one layer lives in the file:
/// expert e's bytes are [offset(e), offset(e) + expert_bytes), offset(e) = base_offset + e * stride.
/// In a GGUF the slices of a part are back to back in one tensor (stride 0 = expert_bytes); in a
/// pack (stream/pack.h) the three parts of an expert are one record and stride is the record size.
struct PartLayout {
  uint64_t base_offset = 0;   ///< absolute file offset of expert 0's slice (bytes)
  uint64_t expert_bytes = 0;  ///< bytes of one expert's slice (rows * row_bytes)
  uint64_t stride = 0;        ///< bytes from one expert's slice to the next; 0 means expert_bytes
  uint64_t offset(int64_t e) const { return base_offset + uint64_t(e) * (stride ? stride : expert_bytes); }
};

/// The experts of one layer: n_expert experts, 3 parts each (0 = gate, 1 = up, 2 = down).
struct LayerExperts {
  int n_expert = 0;
  PartLayout part[3];
};

/// Pointers to one resident expert's slices inside its arena slot (host or device addresses,
/// as the arena's place() says). Valid until release().
struct ExpertView {
  const uint8_t* part[3] = {nullptr, nullptr, nullptr};  ///< gate, up, down
};

struct StreamOptions {
  size_t arena_bytes = 0;  ///< total arena size in bytes (rounded down to whole slots)
  int io_threads = 8;      ///< IO threads issuing reads
  bool direct = true;      ///< O_DIRECT (falls back to buffered with a warning)
  size_t min_slots = 1;    ///< fewer slots than this: throw ArenaTooSmall
  /// Fake stream (`--fake-stream`): no reads at all; a requested expert becomes resident at
  /// once in a slot holding stale bytes. Results are garbage; the time is the compute floor.
  bool fake = false;
  /// Host RAM tier between the disk and the arena (`--host-cache-mb`): bytes of host memory
  /// (pinned where the backend can) holding expert records, rounded down to whole slots and
  /// capped at every expert; 0 (or less than one slot) = off. Disk reads fill it; an arena miss
  /// it holds lands from it with no disk read. Eviction: least recently used, where an arena hit
  /// of the expert also counts as a use (docs/streaming.md, "Tiers").
  size_t host_cache_bytes = 0;
};

/// Thrown when the arena cannot hold the experts one layer needs at once.
class ArenaTooSmall : public std::runtime_error {
 public:
  ArenaTooSmall(const std::string& msg, size_t min_bytes) : std::runtime_error(msg), min_bytes(min_bytes) {}
  size_t min_bytes;  ///< the smallest arena that would work (bytes)
};

/// Makes the arena memory of an ExpertStream: `n_slots` slots of `slot_bytes` bytes (a multiple
/// of 4 KiB) for `io_threads` IO threads (numbered 0..io_threads-1). May throw; the stream's
/// constructor passes the exception on.
using ArenaFactory =
    std::function<std::unique_ptr<backend::ArenaMemory>(size_t n_slots, size_t slot_bytes, int io_threads)>;
/// Makes the host tier's memory: one buffer of `bytes` host bytes, 4 KiB-aligned (Place::Host;
/// pinned() says whether it is page-locked). May throw.
using HostTierFactory = std::function<std::unique_ptr<backend::Buffer>(size_t bytes)>;

/// The arena and its IO threads. request/wait/release/prefetch are called from one compute
/// thread; the IO threads are internal. Eviction: least recently used unpinned slot whose
/// last-use event (release) is done. All public methods are thread-safe (one mutex), but the
/// pin bookkeeping assumes a single compute thread.
class ExpertStream {
 public:
  /// Opens `path` for expert reads and allocates the arena in host memory (cpu::
  /// HostArena). Throws io::IoError, ArenaTooSmall (naming the minimum in MiB) when arena_bytes
  /// holds fewer than min_slots slots, std::invalid_argument for a negative expert count.
  ExpertStream(const std::string& path, std::vector<LayerExperts> layers, const StreamOptions& opts);
  /// As above, with the arena memory from `make_arena` (called once, with the slot count the
  /// options give). Throws std::invalid_argument if it returns null or fewer or smaller slots
  /// than asked for, and whatever it throws.
  /// `make_host` makes the host tier's memory when opts.host_cache_bytes holds a slot (null:
  /// pageable 4 KiB-aligned host memory); it throws std::runtime_error naming the size when
  /// the memory cannot be allocated.
  ExpertStream(const std::string& path, std::vector<LayerExperts> layers, const StreamOptions& opts,
               ArenaFactory make_arena, HostTierFactory make_host = {});
  /// As above, with the arena memory from `backend.make_arena(n_slots, slot_bytes, io_threads)`
  /// and the host tier from `backend.alloc(BufferRole::Staging, bytes)` (CUDA: pinned, pageable
  /// with a warning when pinning fails). The backend must outlive the constructor call only.
  ExpertStream(const std::string& path, std::vector<LayerExperts> layers, const StreamOptions& opts,
               backend::Backend& backend);
  ~ExpertStream();

  size_t slot_bytes() const;  ///< bytes per slot (largest aligned expert record)
  /// The slot size an ExpertStream over `layers` uses: the largest expert's aligned reads, back
  /// to back (bytes; at least 4 KiB).
  static size_t slot_bytes_for(const std::vector<LayerExperts>& layers);
  size_t n_slots() const;
  bool direct() const;  ///< whether reads bypass the page cache
  /// Host tier entries (slots of slot_bytes() each; 0 = no host tier), and whether its memory
  /// is pinned (page-locked).
  size_t host_slots() const;
  bool host_pinned() const;
  /// True if `expert` of `layer` is held, complete, in the host tier. Does not touch LRU order.
  bool in_host_tier(int layer, int32_t expert) const;

  /// Layer `layer` needs `experts` now: pins them and queues urgent reads for the misses.
  /// Precondition: experts are distinct, and at most n_slots() experts are pinned in all.
  /// If every unpinned slot is being read, blocks until a read finishes (exposed wait);
  /// throws std::logic_error if every slot is pinned.
  void request(int layer, std::span<const int32_t> experts);
  /// Blocks until `expert` of `layer` (previously requested) is resident; returns its view.
  /// Rethrows an IO error from the read.
  ExpertView wait(int layer, int32_t expert);
  /// Unpins every slot pinned by request(layer, ...). Unstarted read-aheads for `layer` are
  /// dropped. `last_use`: the event after which those slots' memory may be overwritten (the
  /// kernels that read them were queued before it); until it is done the slots are not reused
  /// while another slot is free, and when none is, the IO thread that reads into such a slot
  /// waits for the event first (it completes without any help from the stream: no deadlock).
  /// Null: reusable at once (CPU). Throws std::out_of_range for a bad layer.
  void release(int layer, backend::EventPtr last_use = nullptr);
  /// Read-ahead hint: queue non-resident `experts` of `layer` in the given order (most wanted
  /// first), never evicting pinned slots. May be ignored when the arena is full of pinned slots.
  void prefetch(int layer, std::span<const int32_t> experts);
  /// Drops all read-aheads not yet started.
  void cancel_prefetch();

  /// True if `expert` of `layer` is resident now (its bytes are in a slot). For MoCE-style
  /// residency-aware routing and for diagnostics; does not touch LRU order or counters.
  bool resident(int layer, int32_t expert) const;
  /// Every expert of `layer`, one view per expert id, when the arena has a slot for every expert
  /// of the model (so nothing resident is ever evicted: slots never change hands) and all of this
  /// layer's experts are resident now; null otherwise. The views stay valid until clear(). A
  /// backend that routes and computes a whole MoE layer on its device uses them with no host
  /// step between router and experts (backend::Backend::moe_on_device); the layer's use is
  /// counted afterwards with count_resident_use. Cheap once true (cached per layer). A layer
  /// without experts gives an empty table.
  const std::vector<ExpertView>* resident_layer(int layer);
  /// Counts `experts` of `layer` (distinct; a layer computed from resident_layer()'s views) as
  /// request() counts hits, without pinning. Throws std::logic_error if one is not resident (the
  /// precondition of resident_layer was broken), std::out_of_range for a bad layer or expert.
  void count_resident_use(int layer, std::span<const int32_t> experts);
  /// When the arena has a slot for every expert of the model: queues a read-ahead of every expert
  /// not resident yet (all layers, in layer order) and returns how many; 0 otherwise (nothing is
  /// queued). wait_idle() then waits for them. --preload; the reads count as read-aheads.
  size_t fill_all();
  /// Changes whenever resident_layer()'s views may have changed (each clear()).
  uint64_t generation() const;
  /// Blocks until both queues are empty and no read is in flight (tests, benchmarks).
  /// Does not count as exposed wait. Returns at once while IO is paused.
  void wait_idle();
  /// Test/diagnostic hook: while paused, IO threads start no new reads (reads already in
  /// flight complete). Lets tests make queue states deterministic.
  void pause_io(bool paused);

  StreamStats stats() const;
  void reset_stats();
  /// Empties the arena and the host tier (cold start). Precondition: nothing pinned, no reads
  /// in flight.
  void clear();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::stream
