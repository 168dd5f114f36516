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
};

}  // namespace strata::stream
