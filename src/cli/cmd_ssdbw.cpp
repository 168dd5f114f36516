// strata ssdbw: the drive's rate for random uncached expert-record reads, per thread count.
#include <fmt/format.h>

#include <cmath>
#include <sstream>

#include "cli/commands.h"
#include "cli/common.h"
#include "io/ssdbw.h"

namespace strata::cli {

namespace {

// "1572864", "1536K", "1.5M", "1.5MiB", "2G" (binary units) -> bytes.
uint64_t parse_size(const std::string& s) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = s.substr(used);
  for (auto& c : unit) c = char(std::toupper(static_cast<unsigned char>(c)));
  if (unit.size() > 1 && (unit.back() == 'B')) unit.pop_back();
  if (unit.size() > 1 && unit.back() == 'I') unit.pop_back();
  double mul = 0;
  if (unit.empty())
    mul = 1;
  else if (unit == "K")
    mul = 1024.0;
  else if (unit == "M")
    mul = 1024.0 * 1024;
  else if (unit == "G")
    mul = 1024.0 * 1024 * 1024;
  if (used == 0 || mul == 0 || !(v > 0) || !std::isfinite(v))
    throw std::invalid_argument(fmt::format("'{}' is not a size (bytes, or with K, M, G)", s));
  // 2^62 bytes is far past any RAM or drive and still fits uint64_t after rounding.
  if (v * mul > double(uint64_t(1) << 62)) throw std::invalid_argument(fmt::format("'{}' is too large a size", s));
  return uint64_t(std::llround(v * mul));
}

// parse_size for the value of `flag`, its errors naming the flag.
uint64_t parse_size_flag(const std::string& flag, const std::string& s) {
  try {
    return parse_size(s);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("{}: {}", flag, e.what()));
  }
}

struct SsdbwFlags {
  std::string file, size = "1.5M", threads = "1,4,8,16";
  double seconds = 3.0;
  uint64_t reads = 0;
  bool json = false;
  std::string h2d_size = "256M";  // the copy probes (pinned host-to-device, memcpy)
  int h2d_reps = 8, device = 0;
  bool no_h2d = false;
};

}  // namespace

void register_ssdbw(CLI::App& root) {
  auto f = std::make_shared<SsdbwFlags>();
  CLI::App* app = root.add_subcommand(
      "ssdbw", "the drive's bandwidth for random uncached (O_DIRECT) reads of expert-sized records, per thread count");
  app->add_option("-f,--file", f->file, "a large file on the drive to measure (e.g. a model; bigger than RAM is best)")
      ->required()
      ->check(CLI::ExistingFile);
  app->add_option("--size", f->size, "bytes per read, K/M/G suffixes allowed (default: 1.5M, a typical expert record)");
  app->add_option("--threads", f->threads, "comma-separated thread counts")->capture_default_str();
  auto* secs = app->add_option("--seconds", f->seconds, "seconds per thread count")->capture_default_str();
  secs->check(CLI::Validator(
      [](std::string& v) {
        double x = 0;
        try {
          x = std::stod(v);
        } catch (const std::exception&) {
          return std::string("must be a number of seconds, got '") + v + "'";
        }
        return std::isfinite(x) && x > 0 ? std::string()
                                         : std::string("must be > 0 (a time to measure over), got ") + v;
      },
      "> 0"));
  app->add_option("--reads", f->reads, "reads per thread count instead of a time")->excludes(secs)->check(at_least(1));
  app->add_flag("--json", f->json, "print JSON");
  app->add_option("--h2d-size", f->h2d_size,
                  "bytes per copy of the copy probes (pinned host-to-device on a CUDA device, and memcpy), K/M/G "
                  "suffixes allowed")
      ->capture_default_str();
  app->add_option("--h2d-reps", f->h2d_reps, "timed copies per probe")->capture_default_str()->check(at_least(1));
  app->add_option("--device", f->device, "CUDA device ordinal of the host-to-device probe")->capture_default_str();
  app->add_flag("--no-h2d", f->no_h2d, "skip the copy probes");
  app->callback([f] {
    io::ReadBwOptions o;
    o.record_bytes = size_t(parse_size_flag("--size", f->size));
    size_t cb = 0;  // bytes per copy of the copy probes, checked before the drive is measured
    if (!f->no_h2d) {
      cb = size_t(parse_size_flag("--h2d-size", f->h2d_size));
      // The memcpy probe holds two buffers of this size (the pinned probe one more): more than
      // the RAM there is would end in std::bad_alloc or the OOM killer.
      if (const uint64_t avail = engine::mem_available_bytes(); avail > 0 && 2 * uint64_t(cb) > avail)
        throw std::invalid_argument(fmt::format(
            "--h2d-size {} ({}): the copy probes need two buffers of it, {}, more than the {} of memory available; "
            "give a smaller size (default 256M) or --no-h2d",
            f->h2d_size, human_bytes(double(cb)), human_bytes(2.0 * double(cb)), human_bytes(double(avail))));
    }
    o.seconds = f->seconds;
    o.reads = f->reads;
    std::vector<int32_t> counts = parse_id_list(f->threads, "--threads", "thread count");
    for (int32_t c : counts)
      if (c < 1 || c > 1024)
        throw std::invalid_argument(fmt::format("--threads '{}': {} is not a thread count in 1..1024", f->threads, c));
    nlohmann::json results = nlohmann::json::array();
    bool direct = true;
    uint64_t rec = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      o.threads = counts[i];
      const io::ReadBwResult r = io::measure_read(f->file, o);
      direct = r.direct;
      rec = r.record_bytes;
      if (!f->json) {
        if (i == 0)
          fmt::print("strata ssdbw: {}, random {} reads ({} B), {}\n{:>8} {:>8} {:>8} {:>10} {:>12}\n", f->file,
                     human_bytes(double(r.record_bytes)), r.record_bytes,
                     r.direct ? "O_DIRECT" : "BUFFERED (O_DIRECT refused: the page cache may flatter this)", "threads",
                     "GB/s", "reads", "seconds", "latency ms");
        fmt::print("{:>8} {:>8.3f} {:>8} {:>10.2f} {:>12.2f}\n", r.threads, r.gbps, r.reads, r.seconds,
                   r.mean_latency_ms);
        std::fflush(stdout);
      }
      results.push_back({{"threads", r.threads},
                         {"gbps", r.gbps},
                         {"reads", r.reads},
                         {"bytes", r.bytes},
                         {"seconds", r.seconds},
                         {"mean_latency_ms", r.mean_latency_ms}});
    }
    // ---- copy probes: the host tier's landing rate (pinned host-to-device, memcpy) ----
    nlohmann::json h2d = nullptr, host_copy = nullptr;
    std::string h2d_skip;
    if (!f->no_h2d) {
      if (!engine::cuda_device_present()) {
#ifdef STRATA_HAVE_CUDA
        h2d_skip = "no CUDA device";
#else
        h2d_skip = "this strata was built without the CUDA backend";
#endif
      } else {
        const engine::CopyProbe p = engine::measure_arena_copy(true, f->device, cb, f->h2d_reps);
        h2d = {{"kind", p.kind}, {"device", f->device}, {"bytes", p.bytes}, {"reps", p.reps}, {"gbps", p.gbps}};
        if (!f->json)
          fmt::print("h2d: {} host-to-device {:.2f} GB/s ({} x {}, device {})\n", p.kind.substr(4), p.gbps,
                     human_bytes(double(p.bytes)), p.reps, f->device);
      }
      if (!h2d_skip.empty() && !f->json) fmt::print("h2d: skipped ({})\n", h2d_skip);
      const engine::CopyProbe m = engine::measure_arena_copy(false, 0, cb, f->h2d_reps);
      host_copy = {{"bytes", m.bytes}, {"reps", m.reps}, {"gbps", m.gbps}};
      if (!f->json)
        fmt::print("memcpy: {:.2f} GB/s ({} x {}, host RAM to host RAM: the CPU backend's host-tier copy)\n", m.gbps,
                   human_bytes(double(m.bytes)), m.reps);
    }
    if (f->json) {
      nlohmann::json j{{"file", f->file},    {"record_bytes", rec}, {"direct", direct},
                       {"results", results}, {"h2d", h2d},          {"memcpy", host_copy}};
      if (!h2d_skip.empty()) j["h2d_skipped"] = h2d_skip;
      fmt::print("{}\n", j.dump());
    }
  });
}

}  // namespace strata::cli
