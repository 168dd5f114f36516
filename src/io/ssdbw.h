#pragma once
// The drive's bandwidth for the expert stream's access pattern: random, uncached (O_DIRECT)
// reads of whole expert records at 4 KiB-aligned offsets across a file, from N threads at
// once, each with one read in flight (as the stream's IO threads). `strata ssdbw` prints it;
// `strata bench` divides unique expert bytes by it to get the IO floor.
#include <cstddef>
#include <cstdint>
#include <string>

namespace strata::io {

struct ReadBwOptions {
  size_t record_bytes = size_t(3) << 19;  ///< bytes per read (rounded up to 4 KiB); default 1.5 MiB
  int threads = 8;                        ///< concurrent readers
  double seconds = 3.0;                   ///< stop after this long (when reads == 0)
  uint64_t reads = 0;                     ///< or after this many reads in all (when > 0)
  uint64_t seed = 1;                      ///< offsets are drawn from this seed (per thread)
};

struct ReadBwResult {
  int threads = 0;
  uint64_t record_bytes = 0;  ///< as read (4 KiB multiple)
  uint64_t reads = 0;
  uint64_t bytes = 0;
  double seconds = 0;          ///< wall time of the measurement
  double gbps = 0;             ///< bytes / seconds / 1e9
  double mean_latency_ms = 0;  ///< mean time of one read
  bool direct = false;         ///< reads bypassed the page cache (false: the filesystem refused O_DIRECT)
};

/// Measures random record reads of `path` (see the file comment). Throws IoError if the file
/// cannot be opened or is smaller than one record, or a read fails; std::invalid_argument for
/// threads < 1 or a zero record size.
ReadBwResult measure_read(const std::string& path, const ReadBwOptions& opts);

/// measure_read(...).gbps: GB/s (1e9 bytes per second) of `threads` threads reading random
/// `record_bytes` records of `path` for `seconds`.
double measure_read_gbps(const std::string& path, size_t record_bytes, int threads, double seconds);

}  // namespace strata::io
