// Random uncached record reads across a file, N threads at once: the drive's rate for the
// expert stream's access pattern.
#include "io/ssdbw.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "io/file.h"

namespace strata::io {

namespace {
using Clock = std::chrono::steady_clock;

uint64_t splitmix(uint64_t& s) {
  uint64_t x = (s += 0x9e3779b97f4a7c15ull);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

ReadBwResult measure_read(const std::string& path, const ReadBwOptions& opts) {
  if (opts.threads < 1)
    throw std::invalid_argument(fmt::format("ssdbw: threads must be at least 1, got {}", opts.threads));
  if (opts.record_bytes == 0) throw std::invalid_argument("ssdbw: record size must be positive");
  const uint64_t rec = (uint64_t(opts.record_bytes) + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  const std::unique_ptr<File> f = File::open(path, true);
  if (f->size() < rec)
    throw IoError(fmt::format("{}: the file ({} bytes) is smaller than one record of {} bytes", path, f->size(), rec));
  // Record starts: any 4 KiB boundary such that the record ends within the file.
  const uint64_t n_starts = (f->size() - rec) / kDirectAlign + 1;

  std::atomic<uint64_t> reads_left{opts.reads > 0 ? opts.reads : UINT64_MAX};
  std::atomic<bool> stop{false};
  std::vector<uint64_t> reads(size_t(opts.threads), 0);
  std::vector<double> busy(size_t(opts.threads), 0.0);
  std::exception_ptr err;
  std::mutex err_mu;
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opts.seconds));
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int i = 0; i < opts.threads; ++i) {
    threads.emplace_back([&, i] {
      try {
        AlignedBuffer buf(static_cast<size_t>(rec));
        uint64_t s = opts.seed * 0x100000001b3ull + uint64_t(i) * 0x9e3779b97f4a7c15ull;
        for (;;) {
          if (stop.load(std::memory_order_relaxed)) return;
          if (opts.reads > 0) {
            uint64_t left = reads_left.load();
            do {
              if (left == 0) return;
            } while (!reads_left.compare_exchange_weak(left, left - 1));
          } else if (Clock::now() >= deadline) {
            return;
          }
          const uint64_t off = (splitmix(s) % n_starts) * kDirectAlign;
          const auto r0 = Clock::now();
          f->read_at(off, static_cast<size_t>(rec), buf.data());
          busy[size_t(i)] += std::chrono::duration<double>(Clock::now() - r0).count();
          ++reads[size_t(i)];
        }
      } catch (...) {
        std::lock_guard lk(err_mu);
        if (!err) err = std::current_exception();
        stop = true;
      }
    });
  }
  for (auto& t : threads) t.join();
  if (err) std::rethrow_exception(err);

  ReadBwResult r;
  r.threads = opts.threads;
  r.record_bytes = rec;
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  double busy_s = 0;
  for (int i = 0; i < opts.threads; ++i) {
    r.reads += reads[size_t(i)];
    busy_s += busy[size_t(i)];
  }
  r.bytes = r.reads * rec;
  r.gbps = r.seconds > 0 ? double(r.bytes) / r.seconds / 1e9 : 0.0;
  r.mean_latency_ms = r.reads ? 1e3 * busy_s / double(r.reads) : 0.0;
  r.direct = f->direct();
  return r;
}

double measure_read_gbps(const std::string& path, size_t record_bytes, int threads, double seconds) {
  ReadBwOptions o;
  o.record_bytes = record_bytes;
  o.threads = threads;
  o.seconds = seconds;
  return measure_read(path, o).gbps;
}

}  // namespace strata::io
