#pragma once
// ExpertStream: routed experts stay on disk and pass through a fixed-size arena of
// expert slots. See docs/streaming.md for the diagram of what overlaps with what.
//
//   compute thread                        IO threads (StreamOptions::io_threads)
//   --------------                        --------------------------------------
//   request(l, ids)  --misses-->  urgent queue  --> read_at(O_DIRECT) into slot
//   prefetch(l+1, ids) ------->  read-ahead queue (served only when urgent is empty)
//   wait(l, e)  <-- blocks until e is resident (time counted as exposed wait)
//   release(l)      unpins layer l's slots (they become evictable, LRU)
//
// An expert = the gate, up and down slices of one layer's expert. Each slice is read
// as the 4 KiB-aligned range covering it; slices whose ranges touch or overlap (a packed
// record: gate, up, down back to back) are read together, so a packed expert is one read.
// ExpertView points at the slice's first byte.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"

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

/// Pointers to one resident expert's slices inside its arena slot. Valid until release().
struct ExpertView {
  const uint8_t* part[3] = {nullptr, nullptr, nullptr};  ///< gate, up, down
};

/// Counters of one run. Counts are (layer, expert) lookups.
struct StreamStats {
  uint64_t needed = 0;          ///< experts requested by the compute
  uint64_t hits = 0;            ///< of those, already resident (or already being read ahead)
  uint64_t misses = 0;          ///< of those, not resident and not in flight: urgent reads
  uint64_t streamed_ahead = 0;  ///< hits whose slot was filled by a read-ahead
  uint64_t wasted = 0;          ///< read-ahead reads evicted without ever being used
  uint64_t reads = 0;           ///< expert reads completed
  uint64_t bytes_read = 0;      ///< bytes read from disk (aligned ranges, as issued)
  double exposed_wait_s = 0;    ///< seconds the compute thread blocked in wait()
  double read_busy_s = 0;       ///< seconds IO threads spent inside read calls (summed over threads)
  uint64_t dropped = 0;         ///< read-aheads dropped before they started (release, cancel, eviction)
};

struct StreamOptions {
  size_t arena_bytes = 0;      ///< total arena size in bytes (rounded down to whole slots)
  int io_threads = 8;          ///< IO threads issuing reads
  bool direct = true;          ///< O_DIRECT (falls back to buffered with a warning)
  size_t min_slots = 1;        ///< fewer slots than this: throw ArenaTooSmall
  /// Fake stream (`--fake-stream`): no reads at all; a requested expert becomes resident at
  /// once in a slot holding stale bytes. Results are garbage; the time is the compute floor.
  bool fake = false;
};

/// Thrown when the arena cannot hold the experts one layer needs at once.
class ArenaTooSmall : public std::runtime_error {
 public:
  ArenaTooSmall(const std::string& msg, size_t min_bytes) : std::runtime_error(msg), min_bytes(min_bytes) {}
  size_t min_bytes;  ///< the smallest arena that would work (bytes)
};

/// The arena and its IO threads. request/wait/release/prefetch are called from one compute
/// thread; the IO threads are internal. Eviction: least recently used unpinned slot.
class ExpertStream {
 public:
  /// Opens `path` for expert reads and allocates the arena. Throws io::IoError,
  /// ArenaTooSmall (naming the minimum in MiB) when arena_bytes holds fewer than min_slots slots.
  ExpertStream(const std::string& path, std::vector<LayerExperts> layers, const StreamOptions& opts);
  ~ExpertStream();

  size_t slot_bytes() const;  ///< bytes per slot (largest aligned expert record)
  /// The slot size an ExpertStream over `layers` uses: the largest expert's aligned reads, back
  /// to back (bytes; at least 4 KiB).
  static size_t slot_bytes_for(const std::vector<LayerExperts>& layers);
  size_t n_slots() const;
  bool direct() const;        ///< whether reads bypass the page cache

  /// Layer `layer` needs `experts` now: pins them and queues urgent reads for the misses.
  /// Precondition: experts are distinct, and at most n_slots() experts are pinned in all.
  /// If every unpinned slot is being read, blocks until a read finishes (exposed wait);
  /// throws std::logic_error if every slot is pinned.
  void request(int layer, std::span<const int32_t> experts);
  /// Blocks until `expert` of `layer` (previously requested) is resident; returns its view.
  /// Rethrows an IO error from the read.
  ExpertView wait(int layer, int32_t expert);
  /// Unpins every slot pinned by request(layer, ...). Unstarted read-aheads for `layer` are dropped.
  void release(int layer);
  /// Read-ahead hint: queue non-resident `experts` of `layer` in the given order (most wanted
  /// first), never evicting pinned slots. May be ignored when the arena is full of pinned slots.
  void prefetch(int layer, std::span<const int32_t> experts);
  /// Drops all read-aheads not yet started.
  void cancel_prefetch();

  /// True if `expert` of `layer` is resident now (its bytes are in a slot). For MoCE-style
  /// residency-aware routing and for diagnostics; does not touch LRU order or counters.
  bool resident(int layer, int32_t expert) const;
  /// Blocks until both queues are empty and no read is in flight (tests, benchmarks).
  /// Does not count as exposed wait. Returns at once while IO is paused.
  void wait_idle();
  /// Test/diagnostic hook: while paused, IO threads start no new reads (reads already in
  /// flight complete). Lets tests make queue states deterministic.
  void pause_io(bool paused);

  StreamStats stats() const;
  void reset_stats();
  /// Empties the arena (cold start). Precondition: nothing pinned, no reads in flight.
  void clear();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::stream
