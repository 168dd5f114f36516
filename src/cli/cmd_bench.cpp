// strata bench: prefill and decode speed with the stream counters, set against the two
// floors measured in the same run: the drive (ssdbw over the model file: the IO floor) and
// the compute (the same tokens with --fake-stream: the compute floor).
#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include "cli/bench_roofline.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "engine/logits_scan.h"
#include "io/ssdbw.h"

namespace strata::cli {

namespace {

struct BenchFlags {
  EngineFlags engine;
  std::string prompt_file, prompt_ids, decode_from;
  int prompt_tokens = 1024;
  int gen = 64;
  bool cold = false, json = false, no_ssd = false;
  double ssd_seconds = 3.0;
  const CLI::Option* prompt_ids_opt = nullptr;  // to tell `--prompt-ids ""` from none
};

// The fewest expert reads any schedule could do for this run with this arena: Belady's
// optimal replacement (evict the expert whose next use is farthest; Belady 1966) over the
// run's (layer, expert) requests in order, each (chunk, layer) group resident at once (the
// pinning the engine needs), starting cold. Returns the reads of each phase: prefill's
// groups come first, then decode's. Times the record size, over the drive's rate, this is
// the IO floor.
std::pair<uint64_t, uint64_t> optimal_reads(const model::RoutingTrace& pre, int64_t chunk,
                                            const model::RoutingTrace& dec, uint64_t slots) {
  // Requests as groups: for each chunk (prefill) or token (decode), for each layer, the
  // distinct experts. Keys are layer * 2^32 + expert.
  std::vector<std::vector<uint64_t>> groups;
  size_t n_pre_groups = 0;
  auto add = [&](const model::RoutingTrace& tr, int64_t step) {
    if (tr.ids.empty()) return;
    const size_t T = tr.ids[0].size();
    for (size_t t0 = 0; t0 < T; t0 += size_t(step))
      for (size_t l = 0; l < tr.ids.size(); ++l) {
        std::set<uint64_t> g;
        for (size_t t = t0; t < std::min(T, t0 + size_t(step)); ++t)
          for (int32_t e : tr.ids[l][t]) g.insert((uint64_t(l) << 32) | uint32_t(e));
        groups.emplace_back(g.begin(), g.end());
      }
  };
  add(pre, chunk);
  n_pre_groups = groups.size();
  add(dec, 1);
  // next_use[g][i]: the next group index that uses groups[g][i] (or infinity).
  const size_t INF = SIZE_MAX;
  std::map<uint64_t, size_t> last_seen;
  std::vector<std::vector<size_t>> next_use(groups.size());
  for (size_t g = groups.size(); g-- > 0;) {
    next_use[g].resize(groups[g].size());
    for (size_t i = 0; i < groups[g].size(); ++i) {
      auto it = last_seen.find(groups[g][i]);
      next_use[g][i] = it == last_seen.end() ? INF : it->second;
    }
    for (uint64_t k : groups[g]) last_seen[k] = g;
  }
  std::map<uint64_t, size_t> cache;               // key -> next use
  std::set<std::pair<size_t, uint64_t>> by_next;  // (next use, key)
  uint64_t reads_pre = 0, reads_dec = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::set<uint64_t> pinned(groups[g].begin(), groups[g].end());
    for (size_t i = 0; i < groups[g].size(); ++i) {
      const uint64_t k = groups[g][i];
      auto it = cache.find(k);
      if (it != cache.end()) {
        by_next.erase({it->second, k});
      } else {
        (g < n_pre_groups ? reads_pre : reads_dec)++;
        if (cache.size() >= slots) {
          // Evict the farthest-used expert that this group does not need.
          for (auto v = by_next.rbegin(); v != by_next.rend(); ++v)
            if (!pinned.count(v->second)) {
              cache.erase(v->second);
              by_next.erase(std::next(v).base());
              break;
            }
        }
      }
      cache[k] = next_use[g][i];
      by_next.insert({next_use[g][i], k});
    }
  }
  return {reads_pre, reads_dec};
}

struct PhaseRun {
  engine::PhaseStats stats;
  model::RoutingTrace trace;
  std::vector<int32_t> fed;  // decode: the ids fed

  // --ep-ranks: each rank's counters of the phase.
  std::vector<stream::StreamStats> ranks;
};

// Each expert-parallel rank's counters now (empty without --ep-ranks).
std::vector<stream::StreamStats> rank_stats(const engine::Engine& eng) {
  std::vector<stream::StreamStats> out;
  if (const auto* ep = eng.expert_parallel())
    for (int r = 0; r < ep->n_ranks(); ++r) out.push_back(ep->rank_stats(r));
  return out;
}
std::vector<stream::StreamStats> minus(const std::vector<stream::StreamStats>& b,
                                       const std::vector<stream::StreamStats>& a) {
  std::vector<stream::StreamStats> d;
  for (size_t i = 0; i < b.size(); ++i) d.push_back(engine::operator-(b[i], a[i]));
  return d;
}

// Prefill `prompt`, then decode: free-running greedy for `gen` tokens, or teacher-forced over
// `forced` when given. The trace of both phases is recorded.
// Without `cold`, the arena is warmed first: every expert when it holds them all (Engine::preload),
// then one untimed prefill of the prompt.
void run_phases(engine::Engine& eng, const std::vector<int32_t>& prompt, int gen, const std::vector<int32_t>& forced,
                bool cold, PhaseRun& pre, PhaseRun& dec) {
  std::vector<float> logits;
  if (!cold) {
    eng.preload();  // an arena that holds every expert gets all of them (as with every weight in VRAM)
    model::SequenceState warm = eng.new_sequence();
    eng.prefill(warm, prompt, model::LogitsMode::None, logits);
  }
  eng.stream().wait_idle();
  eng.reset_stats();
  model::SequenceState st = eng.new_sequence();
  const auto ranks0 = rank_stats(eng);
  eng.prefill(st, prompt, model::LogitsMode::Last, logits, &pre.trace);
  const auto ranks1 = rank_stats(eng);
  const int n = forced.empty() ? gen : int(std::min<size_t>(forced.size(), size_t(gen)));
  for (int i = 0; i < n && st.n_past < st.n_ctx; ++i) {
    const int32_t id = forced.empty() ? engine::argmax(logits) : forced[size_t(i)];
    dec.fed.push_back(id);
    eng.decode(st, id, logits, &dec.trace);
  }
  pre.stats = eng.prefill_stats();
  dec.stats = eng.decode_stats();
  pre.ranks = minus(ranks1, ranks0);
  dec.ranks = minus(rank_stats(eng), ranks1);
}

std::vector<int32_t> read_tokens(const tokenizer::Tokenizer& tok, const std::string& path, const char* purpose) {
  return tok.encode(read_prompt_file(path, purpose));
}

}  // namespace

void register_bench(CLI::App& root) {
  auto f = std::make_shared<BenchFlags>();
  CLI::App* app = root.add_subcommand(
      "bench", "prefill and decode tokens/s with stream counters, against the IO floor (drive) and compute floor");
  f->engine.add(*app);
  app->add_option("--prompt-tokens", f->prompt_tokens, "prompt length (random ids unless -f/--prompt-ids)")
      ->capture_default_str()
      ->check(at_least(1));
  app->add_option("-f,--file", f->prompt_file,
                  "prompt text file (its first --prompt-tokens tokens; '-' = standard input)")
      ->check(existing_file_or_stdin());
  f->prompt_ids_opt = app->add_option("--prompt-ids", f->prompt_ids, "prompt as comma-separated token ids");
  app->add_option("--gen", f->gen, "decode tokens")->capture_default_str()->check(at_least(0));
  app->add_option("--decode-from", f->decode_from, "teacher-forced decode: feed this text's tokens one at a time")
      ->check(CLI::ExistingFile);
  app->add_flag("--cold", f->cold, "start with an empty arena");
  app->add_option("--ssd-seconds", f->ssd_seconds, "seconds of the drive measurement (--no-ssdbw: none)")
      ->capture_default_str()
      ->check(positive_real());
  app->add_flag("--no-ssdbw", f->no_ssd, "skip the drive measurement (no IO floor)");
  app->add_flag("--json", f->json, "print JSON");
  app->callback([f] {
    const engine::EngineOptions opts = f->engine.resolve();
    std::vector<int32_t> prompt, forced;
    PhaseRun pre, dec, fpre, fdec;
    double ssd_gbps = 0;
    uint64_t record = 0, io_pre = 0, io_dec = 0, arena_bytes = 0, n_slots = 0;
    std::string expert_file, kernels, kernels_label, actq, backend_name, backend_device;
    int n_threads = 0, ep_ranks = 0;
    // ---- tiers (host RAM tier, memory): filled in the first engine's scope ----
    engine::CopyProbe copy;  // the landing peak: pinned host-to-device (CUDA) or memcpy (CPU)
    engine::MemoryReport mem;
    uint64_t host_bytes = 0, host_slots = 0;
    bool host_pinned = false;
    {
      engine::Engine eng(f->engine.model, opts);
      kernels = eng.cpu_kernels();
      kernels_label = eng.cpu_kernels_label();
      actq = eng.act_quant();
      backend_name = eng.backend_info().name;
      backend_device = eng.backend_info().device;
      n_threads = eng.options().n_threads;
      const auto& tok = eng.tokenizer();
      if (f->prompt_ids_opt->count() > 0) {
        prompt = parse_id_list(f->prompt_ids, "--prompt-ids");
      } else if (!f->prompt_file.empty()) {
        prompt = read_tokens(tok, f->prompt_file, "bench");
        if (int(prompt.size()) > f->prompt_tokens) prompt.resize(size_t(f->prompt_tokens));
      } else {
        std::mt19937 rng(1234);
        std::uniform_int_distribution<int32_t> d(0, eng.hparams().n_vocab - 1);
        for (int i = 0; i < f->prompt_tokens; ++i) prompt.push_back(d(rng));
      }
      if (!f->decode_from.empty()) forced = read_tokens(tok, f->decode_from, "teacher-force");
      // Decode tokens this run feeds: --gen, or the file's tokens when --decode-from has fewer.
      // Prompt and decode share the context: refused up front rather than stopping early and
      // reporting --gen tokens that were never decoded.
      const size_t n_decode = forced.empty() ? size_t(f->gen) : std::min(forced.size(), size_t(f->gen));
      const int64_t n_ctx = eng.n_ctx();
      if (int64_t(prompt.size() + n_decode) > n_ctx) {
        const std::string decode = forced.empty() ? fmt::format("--gen {}", f->gen)
                                                  : fmt::format("--decode-from '{}' ({} of its {} tokens, --gen {})",
                                                                f->decode_from, n_decode, forced.size(), f->gen);
        // -c cannot go past the model's training context: only suggest raising it below that
        const int64_t train = eng.hparams().n_ctx_train;
        const bool at_limit = train > 0 && n_ctx >= train;
        // decoding fewer tokens is a remedy only while the prompt alone leaves room for some
        const int64_t room = n_ctx - int64_t(prompt.size());
        const std::string raise =
            at_limit ? std::string()
                     : fmt::format(" or raise -c{}", train > 0 ? fmt::format(" (up to {})", train) : std::string());
        throw std::invalid_argument(fmt::format(
            "the prompt's {} tokens and {} need {} positions, more than the context of {} tokens (-c/--ctx-size{}); "
            "{}",
            prompt.size(), decode, prompt.size() + n_decode, n_ctx,
            at_limit ? ", already the model's training context" : "",
            room > 0 ? fmt::format("decode at most {} tokens, shorten the prompt{}", room, raise)
                     : fmt::format("shorten the prompt{}", raise)));
      }
      record = eng.stream().slot_bytes();
      arena_bytes = eng.arena_bytes();
      n_slots = eng.expert_parallel() ? eng.expert_parallel()->n_slots() : eng.stream().n_slots();
      ep_ranks = eng.expert_parallel() ? eng.expert_parallel()->n_ranks() : 0;
      expert_file = eng.expert_file();
      if (!f->no_ssd) {
        if (!f->json)
          fmt::print(stderr, "measuring the drive: random reads of {} by {} for {:.0f} s ...\n",
                     human_bytes(double(record)), count_of(opts.io_threads, "IO thread"), f->ssd_seconds);
        ssd_gbps = io::measure_read_gbps(expert_file, record, opts.io_threads, f->ssd_seconds);
      }
      if (!f->json)
        fmt::print(stderr, "running {} prompt token{}, {} decode token{}{} ...\n", prompt.size(),
                   prompt.size() == 1 ? "" : "s", n_decode, n_decode == 1 ? "" : "s",
                   !forced.empty() && forced.size() < size_t(f->gen)
                       ? fmt::format(" (all of --decode-from '{}', fewer than --gen {})", f->decode_from, f->gen)
                       : std::string());
      // ---- tiers: the copy probe runs where the run copies (a GPU arena or a host tier) ----
      const bool device_arena = eng.backend_info().name == "cuda";
      host_bytes = eng.host_cache_bytes();
      host_slots = eng.stream().host_slots();
      host_pinned = eng.host_cache_pinned();
      if (device_arena || host_bytes > 0) {
        if (!f->json)
          fmt::print(stderr, "measuring the {} copy peak ...\n", device_arena ? "host-to-device" : "memcpy");
        copy = engine::measure_arena_copy(device_arena, eng.options().device, device_arena ? 256u << 20 : 64u << 20, 8);
      }
      run_phases(eng, prompt, f->gen, forced, f->cold, pre, dec);
      mem = engine::memory_report(eng.options().device);  // with the arena, host tier and KV cache allocated
      const auto [r_pre, r_dec] = optimal_reads(pre.trace, eng.options().prompt_chunk, dec.trace, n_slots);
      io_pre = r_pre * record;
      io_dec = r_dec * record;
    }
    {
      // The compute floor: the same tokens, no reads.
      engine::EngineOptions fo = opts;
      fo.fake_stream = true;
      engine::Engine eng(f->engine.model, fo);
      if (!f->json) fmt::print(stderr, "running the same tokens with --fake-stream (compute floor) ...\n");
      run_phases(eng, prompt, int(dec.fed.size()), dec.fed, true, fpre, fdec);
    }
    auto phase = [&](const PhaseRun& r, const PhaseRun& fake, uint64_t io_bytes) {
      nlohmann::json j = phase_json(r.stats);
      const double io_floor = ssd_gbps > 0 ? double(io_bytes) / (ssd_gbps * 1e9) : 0.0;
      const double compute_floor = fake.stats.seconds;
      j["io_floor_s"] = io_floor;
      j["io_floor_bytes"] = io_bytes;  // Belady-optimal reads from a cold arena, times the record size
      j["compute_floor_s"] = compute_floor;
      j["ratio_to_floor"] = r.stats.seconds / std::max({io_floor, compute_floor, 1e-12});
      // A floor is a lower bound: a run faster than it means the floor's own measurement (the
      // --fake-stream run, or the drive probe) was slowed by other load on the machine.
      // (below 0.995 only: within half a percent of the floor is that floor's own noise, and the
      // ratio then prints as 1.00)
      j["floor_disturbed"] = r.stats.tokens > 0 && j["ratio_to_floor"].get<double>() < 0.995;
      j["read_gbps"] = r.stats.seconds > 0 ? double(r.stats.stream.bytes_read) / r.stats.seconds / 1e9 : 0.0;
      // ---- tiers: the IO floor per tier from this run's counters, the copy rate achieved ----
      const auto& st = r.stats.stream;
      const double disk_floor = ssd_gbps > 0 ? double(st.bytes_read) / (ssd_gbps * 1e9) : 0.0;
      const double copy_floor = copy.gbps > 0 ? double(st.h2d_bytes) / (copy.gbps * 1e9) : 0.0;
      j["disk_floor_s"] = disk_floor;
      j["copy_floor_s"] = copy_floor;
      j["h2d_gbps"] = r.stats.seconds > 0 ? double(st.h2d_bytes) / r.stats.seconds / 1e9 : 0.0;
      j["copy_peak_gbps"] = copy.gbps;
      j["ratio_to_tier_floors"] = r.stats.seconds / std::max({disk_floor, copy_floor, compute_floor, 1e-12});
      return j;
    };
    nlohmann::json out = {{"model", f->engine.model},
                          {"expert_file", expert_file},
                          {"ssd_gbps", ssd_gbps},
                          {"arena_bytes", arena_bytes},
                          {"arena_slots", n_slots},
                          {"record_bytes", record},
                          {"prompt_chunk", opts.prompt_chunk},
                          {"predict", opts.predict},
                          {"threads", n_threads},
                          {"cpu_kernels", kernels},
                          {"act_quant", actq},
                          {"backend", backend_name},
                          {"backend_device", backend_device},
                          {"decode_mode", forced.empty() ? "free-running greedy" : "teacher-forced"},
                          {"prefill", phase(pre, fpre, io_pre)},
                          {"decode", phase(dec, fdec, io_dec)},
                          // tiers
                          {"host_cache_bytes", host_bytes},
                          {"host_cache_slots", host_slots},
                          {"host_cache_pinned", host_pinned},
                          {"copy_probe", {{"kind", copy.kind}, {"bytes", copy.bytes}, {"gbps", copy.gbps}}},
                          {"memory", memory_json(mem)}};
    // --ep-ranks: each rank's expert reads per phase (simulated ranks on the CPU backend)
    if (ep_ranks > 0) {
      nlohmann::json ranks = nlohmann::json::array();
      for (int r = 0; r < ep_ranks; ++r) {
        nlohmann::json j;
        for (const auto& [name, run] : {std::pair{"prefill", &pre}, std::pair{"decode", &dec}}) {
          const auto& st = run->ranks[size_t(r)];
          j[name] = {{"needed", st.needed},
                     {"missed", st.misses},
                     {"reads", st.reads},
                     {"bytes_read", st.bytes_read},
                     {"exposed_wait_s", st.exposed_wait_s}};
        }
        ranks.push_back(j);
      }
      out["ep"] = {{"ranks", ep_ranks}, {"per_rank", ranks}};
    }
    // roofline (issue 18): matmul GFLOP/s and weight GB/s per phase against probes of this machine
    out["roofline"] = bench_roofline(f->engine.model, out);
    if (!f->json) print_roofline(out["roofline"]);
    if (f->json) {
      fmt::print("{}\n", out.dump(2));
      return;
    }
    const std::string drive = ssd_gbps > 0
                                  ? fmt::format("{:.2f} GB/s (random {} reads, {})", ssd_gbps,
                                                human_bytes(double(record)), count_of(opts.io_threads, "thread"))
                                  : std::string("not measured (no IO floor)");
    fmt::print("drive: {}   arena: {} in {}   predict: {}   compute: {}, {} kernels, {} activations\n", drive,
               human_bytes(double(arena_bytes)), count_of(n_slots, "slot"), opts.predict ? "on" : "off",
               count_of(n_threads, "thread"), kernels_label, actq);
    fmt::print("backend: {} ({})\n", backend_name, backend_device);
    for (const char* name : {"prefill", "decode"}) {
      const auto& j = out[name];
      if (j["tokens"].get<int64_t>() == 0) {  // --gen 0: nothing was measured
        fmt::print("{:<8} not run (0 tokens)\n", name);
        continue;
      }
      // without a drive measurement there is no IO floor to print
      const std::string io_floor = ssd_gbps > 0 ? fmt::format("{:.3f} s", j["io_floor_s"].get<double>()) : "-";
      fmt::print(
          "{:<8} {:5d} tok {:8.3f} s {:8.2f} tok/s | needed {} hit {} ahead {} (in flight {}) missed {} (late {}) "
          "wasted {} | read {} "
          "({:.2f} GB/s) wait {:.3f} s | IO floor {} (Belady-optimal reads), compute floor {:.3f} s, ratio {:.2f}{} | "
          "recall "
          "{:.1f} %\n",
          name, j["tokens"].get<int64_t>(), j["seconds"].get<double>(), j["tokens_per_s"].get<double>(),
          j["needed"].get<uint64_t>(), j["hit"].get<uint64_t>(), j["streamed_ahead"].get<uint64_t>(),
          j["ahead_in_flight"].get<uint64_t>(), j["missed"].get<uint64_t>(), j["ahead_late"].get<uint64_t>(),
          j["wasted"].get<uint64_t>(), human_bytes(double(j["bytes_read"].get<uint64_t>())),
          j["read_gbps"].get<double>(), j["exposed_wait_s"].get<double>(), io_floor, j["compute_floor_s"].get<double>(),
          j["ratio_to_floor"].get<double>(),
          j["floor_disturbed"].get<bool>()
              ? " (below 1: the floor measurement was disturbed by other load; not a valid ratio, rerun on a quiet "
                "machine)"
              : "",
          100.0 * j["prediction_recall"].get<double>());
      // ---- tiers: one line per phase (docs/tools.md, "bench") ----
      const std::string disk_floor = ssd_gbps > 0 ? fmt::format("{:.3f} s", j["disk_floor_s"].get<double>()) : "-";
      const std::string copy_floor =
          copy.gbps > 0 ? fmt::format("{:.3f} s", j["copy_floor_s"].get<double>()) : std::string("-");
      const std::string peak =
          copy.gbps > 0 ? fmt::format("{:.2f} GB/s {}", copy.gbps, copy.kind) : std::string("not measured");
      // A run with nothing to copy (a host arena and no host tier: the CPU backend) has no copy tier.
      const uint64_t h2d = j["h2d_bytes"].get<uint64_t>();
      const bool copies = copy.gbps > 0 || h2d > 0 || host_slots > 0;
      const std::string copied = copies ? fmt::format("copied {} at {:.2f} GB/s (peak {})", human_bytes(double(h2d)),
                                                      j["h2d_gbps"].get<double>(), peak)
                                        : std::string("no copies (the arena is in host memory)");
      fmt::print(
          "{:<8} tiers: arena hits {} | host hits {} ({}) | disk reads {} ({}) | {} | "
          "floors: disk {} (this run's reads){}, compute {:.3f} s | time / max(floors) {:.2f}\n",
          name, j["arena_hits"].get<uint64_t>(), j["host_hits"].get<uint64_t>(),
          human_bytes(double(j["host_hit_bytes"].get<uint64_t>())), j["disk_reads"].get<uint64_t>(),
          human_bytes(double(j["disk_bytes"].get<uint64_t>())), copied, disk_floor,
          copies ? ", copy " + copy_floor : std::string(), j["compute_floor_s"].get<double>(),
          j["ratio_to_tier_floors"].get<double>());
    }
    for (int r = 0; r < ep_ranks; ++r)
      for (const auto& [name, run] : {std::pair{"prefill", &pre}, std::pair{"decode", &dec}}) {
        const auto& st = run->ranks[size_t(r)];
        fmt::print("{:<8} ep rank {}/{}: needed {} missed {} | reads {} = {} | wait {:.3f} s\n", name, r, ep_ranks,
                   st.needed, st.misses, st.reads, human_bytes(double(st.bytes_read)), st.exposed_wait_s);
      }
    fmt::print("host tier: {}\n", host_slots > 0
                                      ? fmt::format("{} in {} slots, {} (LRU)", human_bytes(double(host_bytes)),
                                                    host_slots, host_pinned ? "pinned" : "pageable")
                                      : std::string("off"));
    fmt::print("{}\n", memory_line(mem));
    fmt::print("decode mode: {}\n", out["decode_mode"].get<std::string>());
  });
}

}  // namespace strata::cli
