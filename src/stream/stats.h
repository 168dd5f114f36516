#pragma once
// StreamStats: the counters of an ExpertStream (docs/streaming.md, "Counters").
#include <cstdint>

namespace strata::stream {

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
  /// Of the misses: read-aheads still queued, not started, when their layer asked (predicted
  /// but late: promoted to urgent reads). misses - ahead_late were not read ahead at all.
  uint64_t ahead_late = 0;
  /// Of the hits: read-aheads still being read when their layer asked (the compute waits for
  /// the rest in wait()). streamed_ahead - ahead_in_flight had landed in time.
  uint64_t ahead_in_flight = 0;

  // ---- tiers: arena <- host RAM tier <- disk (docs/streaming.md, "Tiers") ----
  // Every completed arena fill (`reads`) came from exactly one place: reads = host_hits + disk_reads.
  // Arena hits are `hits` above. With the host tier off, host_hits = 0 and disk_reads = reads.
  uint64_t host_hits = 0;       ///< arena fills served from the host RAM tier (no disk read)
  uint64_t host_hit_bytes = 0;  ///< bytes copied from the host tier into arena slots by those hits
  uint64_t disk_reads = 0;      ///< arena fills read from disk (their bytes are bytes_read)
  uint64_t host_fills = 0;      ///< disk reads that were also kept in the host tier
  uint64_t host_evictions = 0;  ///< host-tier entries replaced by a newer fill
  /// Bytes copied from host memory into arena slots: host-to-device for a device arena (every
  /// landed byte: staging and host-tier copies); for a host arena only copies out of the host
  /// tier (hits and fills; a direct disk read lands in the slot and copies nothing).
  uint64_t h2d_bytes = 0;
  double h2d_busy_s = 0;  ///< seconds IO threads spent in those copies (summed over threads)
};

/// Applies f(field_a, field_b) to every counter of two StreamStats, field by field (the phase
/// deltas and sums of engine::Engine, the ranks' sum of ExpertParallel): one list of the fields,
/// so that a new counter is never left out of one of them.
template <typename F>
void for_each_counter(StreamStats& a, const StreamStats& b, F f) {
  f(a.needed, b.needed);
  f(a.hits, b.hits);
  f(a.misses, b.misses);
  f(a.streamed_ahead, b.streamed_ahead);
  f(a.wasted, b.wasted);
  f(a.reads, b.reads);
  f(a.bytes_read, b.bytes_read);
  f(a.exposed_wait_s, b.exposed_wait_s);
  f(a.read_busy_s, b.read_busy_s);
  f(a.dropped, b.dropped);
  f(a.ahead_late, b.ahead_late);
  f(a.ahead_in_flight, b.ahead_in_flight);
  // tiers
  f(a.host_hits, b.host_hits);
  f(a.host_hit_bytes, b.host_hit_bytes);
  f(a.disk_reads, b.disk_reads);
  f(a.host_fills, b.host_fills);
  f(a.host_evictions, b.host_evictions);
  f(a.h2d_bytes, b.h2d_bytes);
  f(a.h2d_busy_s, b.h2d_busy_s);
}

}  // namespace strata::stream
