#pragma once
// A progress bar on stderr for long writes (synth, pack):
//   synth  [##########..........]  48.1 %  14.9 / 31.0 GiB  1.21 GB/s  ETA 13 s
// Redrawn in place at most every 0.2 s on a terminal; when stderr is not a terminal, one
// line per 10 % so logs stay short. finish() prints the final line with the elapsed time.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace strata::cli {

class ProgressBar {
 public:
  explicit ProgressBar(std::string label, bool quiet = false)
      : label_(std::move(label)), quiet_(quiet), tty_(::isatty(STDERR_FILENO) == 1), t0_(Clock::now()) {}

  /// Reports `done` of `total` bytes.
  void update(uint64_t done, uint64_t total) {
    done_ = done;
    total_ = total;
    if (quiet_) return;
    const auto now = Clock::now();
    if (tty_) {
      if (done < total && now - last_ < std::chrono::milliseconds(200)) return;
      last_ = now;
      fmt::print(stderr, "\r{}", line(false));
      std::fflush(stderr);
    } else {
      const int decile = total ? int(10 * done / total) : 10;
      if (decile <= last_decile_) return;
      last_decile_ = decile;
      fmt::print(stderr, "{}\n", line(false));
    }
  }

  /// Prints the final line; returns the elapsed seconds.
  double finish() {
    const double s = elapsed();
    if (!quiet_) fmt::print(stderr, "{}{}\n", tty_ ? "\r" : "", line(true));
    return s;
  }

  double elapsed() const { return std::chrono::duration<double>(Clock::now() - t0_).count(); }

 private:
  using Clock = std::chrono::steady_clock;

  std::string line(bool final) const {
    const double s = elapsed();
    const double frac = total_ ? double(done_) / double(total_) : 1.0;
    constexpr int kWidth = 24;
    const int fill = int(frac * kWidth + 0.5);
    const double gib = 1024.0 * 1024.0 * 1024.0;
    const double rate = s > 0 ? double(done_) / s / 1e9 : 0.0;
    std::string bar = std::string(size_t(fill), '#') + std::string(size_t(kWidth - fill), '.');
    std::string tail;
    if (final)
      tail = fmt::format("done in {:.1f} s", s);
    else if (rate > 0 && done_ < total_)
      tail = fmt::format("ETA {:.0f} s", double(total_ - done_) / (rate * 1e9));
    return fmt::format("{} [{}] {:5.1f} %  {:.2f} / {:.2f} GiB  {:.2f} GB/s  {}   ", label_, bar, 100.0 * frac,
                       double(done_) / gib, double(total_) / gib, rate, tail);
  }

  std::string label_;
  bool quiet_ = false;
  bool tty_ = false;
  Clock::time_point t0_, last_{};
  int last_decile_ = -1;
  uint64_t done_ = 0, total_ = 0;
};

}  // namespace strata::cli
