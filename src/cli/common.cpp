#include "cli/common.h"

#include "engine/quality.h"
#include "server/openai.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace strata::cli {

void EngineFlags::add(CLI::App& app) {
  opts.backend = "auto";  // the command line's default: the GPU when there is one
  app.add_option("-m,--model", model, "GGUF model file")->required()->check(CLI::ExistingFile);
  app.add_option("-t,--threads", opts.n_threads,
                 "compute threads, 0..1024 (0 = all cores); between loops they spin up to STRATA_POOL_SPIN_US "
                 "microseconds (environment, default 100, 0 = sleep at once) before sleeping, unless there are more "
                 "threads than cores")
      ->capture_default_str();
  app.add_option("--backend", opts.backend,
                 "where the forward pass runs: cpu, cuda (a CUDA GPU; an error without one), auto (cuda when a "
                 "device is present, else cpu)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  device_opt = app.add_option("--device", opts.device, "CUDA device ordinal for --backend cuda")->capture_default_str();
  app.add_option("--arena-mb", opts.arena_mb,
                 "expert arena size in MiB (0 = automatic: half of available RAM minus dense weights "
                 "and KV cache, capped at all experts)")
      ->capture_default_str();
  app.add_option("--host-cache-mb", opts.host_cache_mb,
                 "host RAM tier between the disk and the arena, in MiB (pinned for CUDA): disk reads fill it, "
                 "arena misses it holds land from it without a disk read; LRU. 0 = off, -1 = automatic: half of "
                 "available RAM for a GPU arena, 0 for the CPU backend")
      ->capture_default_str();
  app.add_option("--prompt-chunk", opts.prompt_chunk,
                 "tokens per prefill chunk (0 = automatic: what 1/16 of available RAM holds, 64..2048)")
      ->capture_default_str();
  app.add_option("-c,--ctx-size", opts.n_ctx,
                 "context size in tokens (0 = the model's training context, capped at 4096; at most the model's)")
      ->capture_default_str();
  app.add_option("--io-threads", opts.io_threads, "threads reading experts from disk")->capture_default_str();
  app.add_flag("--no-direct-io", no_direct_io, "read experts through the page cache instead of O_DIRECT");
  app.add_flag("--no-pack", no_pack, "read experts from the GGUF even when a valid MODEL.strata-pack exists");
  app.add_flag("--preload", opts.preload,
               "when the arena holds every expert, read them all at start (then decode runs each MoE layer "
               "without a host round trip on --backend cuda); otherwise a warning");
  app.add_option("--cpu-kernels", cpu_kernels,
                 "matrix kernels: auto (the best this CPU has, from CPUID), scalar, avx2, avx512 (with AMX tiles for "
                 "the Q8_0/Q4_K/IQ4_XS prefill GEMMs where the CPU has them; environment STRATA_CPU_AMX=0: without)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "scalar", "avx2", "avx512"}));
  app.add_option("--act-quant", act_quant,
                 "activations of the quantized weights' matmuls: q8 (int8 dot products, as llama.cpp), f32 (exact, "
                 "slower), auto (q8 with the avx2 and avx512 kernels, f32 with scalar); --backend cuda: q8 for Q8_0 "
                 "weights (int8 tensor cores), fp32 activations for the other types")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "q8", "f32"}));
  app.add_option("--predict", predict, "read ahead the next layer's experts predicted from this layer (on|off)")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--predict-min", opts.predict_min, "read ahead only experts predicted by at least N tokens")
      ->capture_default_str();
  app.add_option("--read-ahead-layers", opts.read_ahead_layers,
                 "layers a MoE layer predicts and reads ahead: 1 (the next) or 2 (also the one after it)")
      ->capture_default_str();
  app.add_option("--static-rank", opts.static_rank,
                 "expert popularity file from `strata profile` (default: MODEL.strata-rank if present; 'none' = off)");
  app.add_flag("--trace", opts.trace, "print one line per prompt chunk splitting compute, exposed wait and host time");
  app.add_flag("--fake-stream", opts.fake_stream,
               "no reads: treat every expert as resident (garbage output; measures the compute floor)");
  app.add_option("--dump", opts.dump_dir,
                 "write the named intermediates of every forward call (attn_norm-3, ffn_moe_out-7, result_output, "
                 "...) to DIR as raw fp32 files with an index.tsv, to compare two runs tensor by tensor");
  app.add_option("--moce-bonus", opts.moce_bonus,
                 "cache-conditional routing (MoCE, arXiv:2412.00099): add B x the token's router-logit range to the "
                 "logits of experts resident in the arena before top-k selection (weights from the original logits); "
                 "0 = exact routing. With B > 0 results depend on what is resident, so they are NOT deterministic "
                 "across arena sizes, prompt chunks or IO timing; applies to decode only unless --moce-prefill")
      ->capture_default_str();
  app.add_flag("--moce-prefill", opts.moce_prefill, "apply --moce-bonus to prefill (prompt) tokens too");
  app.add_option("--moce-kld-budget", moce_kld_budget,
                 "choose --moce-bonus automatically: the largest of the grid 0.025 .. 1 such that it and every smaller "
                 "grid bonus keep mean + 1.645 x standard error (16-token blocks) of the teacher-forced KLD (nats, "
                 "decode path, against bonus 0) on the calibration text at most this: a 95 % upper bound, since the "
                 "mean of a short sample is noisy and held-back text differs; prints the grid and the choice, then "
                 "runs with it")
      ->check(positive_real());
  app.add_option("--moce-calibrate", moce_calibrate,
                 "calibration text for --moce-kld-budget (its first 256 tokens, as 4 sequences of 64; default: 4 x 64 "
                 "tokens of the model's own text sampled at temperature 1 with fixed seeds after a fixed prompt, as "
                 "uncertain as the model is on real text, where its greedy text would be over-confident)")
      ->check(CLI::ExistingFile);
  app.add_flag("--profile", opts.profile,
               "after the run, print the time of each forward stage (attention, gated delta net, router, expert "
               "matmuls, expert wait, read-ahead, ...) for prefill and decode (on cuda the device is synchronized "
               "around every stage, which slows the run)");
  app.add_option("--ep-ranks,--gpus", opts.ep_ranks,
                 "expert parallelism: partition the routed experts over N ranks, each with its own share of the arena, "
                 "host tier and IO threads (docs/expert-parallel.md); results are bit-identical to one rank. With "
                 "--backend cpu the N ranks are simulated in this process; with --backend cuda one GPU per rank "
                 "(N > 1 needs NCCL, not built yet). 0 = off")
      ->capture_default_str();
  ep_placement_opt =
      app.add_option(
             "--ep-placement", opts.ep_placement,
             "with --ep-ranks: which rank owns each expert: id (contiguous id ranges), popularity (balance the "
             "static rank's pick counts over the ranks), auto (popularity when a static rank is loaded, else id)")
          ->capture_default_str()
          ->check(CLI::IsMember({"auto", "id", "popularity"}));
  dump_filter_opt =
      app.add_option("--dump-filter", opts.dump_filter,
                     "with --dump: only tensors whose whole name matches this ECMAScript regex, e.g. 'ffn_moe_out-.*'");
}

std::string threads_warning(int n_threads) {
  const unsigned hw = std::thread::hardware_concurrency();
  if (hw == 0 || n_threads <= int(hw)) return "";
  return fmt::format(
      "strata: warning: -t {} is more than the {} hardware thread{} of this machine; compute threads beyond them "
      "only take turns (use -t {} or 0 = all)",
      n_threads, hw, hw == 1 ? "" : "s", hw);
}

void add_seed_option(CLI::App& app, int64_t& seed, const std::string& help) {
  app.add_option("-s,--seed", seed, help)->check(at_least(-1));
}

void SamplingFlags::add(CLI::App& app, bool defaults) {
  request_defaults = defaults;
  // serve: each flag is the default of a request field (OpenAI's name in the help)
  auto h = [defaults](const char* text, const char* field) {
    return defaults ? fmt::format("{}; the default of requests that leave \"{}\" unset", text, field)
                    : std::string(text);
  };
  app.add_option("--temp", sp.temp,
                 h(defaults ? "temperature, 0 to 2 (0 = greedy)" : "temperature (0 = greedy)", "temperature"))
      ->capture_default_str();
  app.add_option("--top-k", sp.top_k, h("top-k sampling (0 = off)", "top_k"))->capture_default_str();
  app.add_option("--top-p", sp.top_p, h("top-p sampling (1 = off, 0 = only the most likely token)", "top_p"))
      ->capture_default_str();
  app.add_option("--min-p", sp.min_p, h("min-p sampling (0 = off)", "min_p"))->capture_default_str();
  app.add_option("--repeat-penalty", sp.repeat_penalty, h("repetition penalty (1 = off)", "repeat_penalty"))
      ->capture_default_str();
  app.add_option("--repeat-last-n", sp.repeat_last_n,
                 h("tokens the repetition penalty looks back (0 = off, -1 = the whole context)", "repeat_last_n"))
      ->capture_default_str();
  // CLI11 would read an empty value ("--temp ''") as 0: the text must be a number; the ranges are resolve()'s
  for (const char* name : {"--temp", "--top-p", "--min-p", "--repeat-penalty"}) app.get_option(name)->check(a_number());
  for (const char* name : {"--top-k", "--repeat-last-n"}) app.get_option(name)->check(an_integer());
  if (defaults)
    add_seed_option(app, seed,
                    "sampling seed of requests that leave \"seed\" unset (-1 = a random seed per request, which "
                    "the response does not report; default -1)");
  else
    add_seed_option(app, seed);
}

engine::SamplerParams SamplingFlags::resolve() const {
  if (!std::isfinite(sp.temp) || sp.temp < 0)
    throw std::invalid_argument(fmt::format("--temp must be a number >= 0 (0 = greedy), got {}", sp.temp));
  // serve: a default must be a value a request could give (openai.h's limits of its fields)
  if (request_defaults) {
    namespace oa = server::openai;
    if (sp.temp > oa::kMaxTemperature)
      throw std::invalid_argument(
          fmt::format("--temp must be in [0, {}] for serve, the range of a request's temperature, got {}",
                      oa::kMaxTemperature, sp.temp));
    auto at_most = [](const char* flag, const char* field, auto value, auto max) {
      if (value > max)
        throw std::invalid_argument(fmt::format("{} must be at most {} for serve, the range of a request's {}, got {}",
                                                flag, max, field, value));
    };
    at_most("--top-k", "top_k", sp.top_k, oa::kMaxTopK);
    at_most("--repeat-penalty", "repeat_penalty", sp.repeat_penalty, oa::kMaxRepeatPenalty);
    at_most("--repeat-last-n", "repeat_last_n", sp.repeat_last_n, oa::kMaxRepeatLastN);
  }
  // [0, 1] as the server's top_p (OpenAI's range): 0 keeps only the most likely token, as
  // llama.cpp's top-p sampler does (it keeps the first token whose running sum reaches p).
  if (!(sp.top_p >= 0 && sp.top_p <= 1))
    throw std::invalid_argument(
        fmt::format("--top-p must be in [0, 1] (1 = off, 0 = only the most likely token), got {}", sp.top_p));
  if (!(sp.min_p >= 0 && sp.min_p <= 1))
    throw std::invalid_argument(fmt::format("--min-p must be in [0, 1], got {}", sp.min_p));
  if (sp.top_k < 0) throw std::invalid_argument(fmt::format("--top-k must be >= 0 (0 = off), got {}", sp.top_k));
  if (!(sp.repeat_penalty > 0) || !std::isfinite(sp.repeat_penalty))
    throw std::invalid_argument(fmt::format("--repeat-penalty must be > 0 (1 = off), got {}", sp.repeat_penalty));
  if (sp.repeat_last_n < -1)
    throw std::invalid_argument(
        fmt::format("--repeat-last-n must be >= -1 (-1 = the whole context, 0 = off), got {}", sp.repeat_last_n));
  engine::SamplerParams out = sp;
  out.seed = resolve_seed(seed);
  return out;
}

CLI::Option* add_n_predict_option(CLI::App& app, int& n, const std::string& description) {
  return app.add_option("-n,--n-predict", n, description)->capture_default_str()->check(at_least(-1));
}

uint64_t resolve_seed(int64_t seed) {
  if (seed < -1) throw std::invalid_argument(fmt::format("--seed must be >= -1 (-1 = random), got {}", seed));
  return seed == -1 ? engine::kRandomSeed : uint64_t(seed);
}

std::string llama_cpp_flag_error(int argc, const char* const* argv) {
  struct Known {
    const char* names[3];
    const char* advice;
  };
  static const Known known[] = {
      {{"-ngl", "--n-gpu-layers", "--gpu-layers"},
       "strata does not offload a number of layers: --backend cuda puts every dense weight on the GPU and streams the "
       "experts into a VRAM arena (--arena-mb); --backend cpu keeps everything on the CPU"},
      {{"-tb", "--threads-batch", nullptr}, "strata uses one thread count for prefill and decode: -t/--threads N"},
      {{"-b", "--batch-size", nullptr}, "the prompt is processed in chunks of --prompt-chunk N tokens"},
      {{"-ub", "--ubatch-size", nullptr}, "the prompt is processed in chunks of --prompt-chunk N tokens"},
      {{"-fa", "--flash-attn", nullptr}, "strata's attention needs no switch: drop the flag"},
      {{"-cnv", "--conversation", nullptr}, "for a conversation use `strata chat -m MODEL`"},
      {{"-mg", "--main-gpu", nullptr}, "choose the GPU with --device N (with --backend cuda)"},
      {{"-ctk", "--cache-type-k", nullptr}, "the KV cache is fp32 in strata: drop the flag"},
      {{"-ctv", "--cache-type-v", nullptr}, "the KV cache is fp32 in strata: drop the flag"},
      {{"--no-mmap", "--mlock", nullptr},
       "strata reads experts from disk through its arena (--arena-mb) and keeps dense weights resident: drop it"},
      {{"-ot", "--override-tensor", nullptr},
       "strata streams every routed expert through its arena (--arena-mb): there is no per-tensor placement"},
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "-p" || a == "--prompt") && i + 1 < argc) {
      ++i;  // the prompt text
      continue;
    }
    const std::string name = a.substr(0, a.find('='));
    for (const Known& k : known)
      for (const char* n : k.names)
        if (n && name == n) return fmt::format("{} is a llama.cpp flag strata does not take: {}", name, k.advice);
  }
  return "";
}

engine::EngineOptions EngineFlags::resolve() const {
  // Out of range: one error (the engine would refuse it too), not the warning first.
  if (opts.n_threads < 0 || opts.n_threads > engine::kMaxThreads)
    throw std::invalid_argument(
        fmt::format("-t/--threads must be between 0 (all cores) and {}, got {}", engine::kMaxThreads, opts.n_threads));
  if (opts.device < 0)
    throw std::invalid_argument(fmt::format("--device {}: a CUDA device ordinal is 0 or more", opts.device));
  if (dump_filter_opt && dump_filter_opt->count() > 0 && opts.dump_dir.empty())
    throw std::invalid_argument("--dump-filter selects what --dump DIR writes: give --dump DIR too");
  if (ep_placement_opt && ep_placement_opt->count() > 0 && opts.ep_ranks <= 0)
    throw std::invalid_argument(
        "--ep-placement places experts on the ranks of --ep-ranks N: give --ep-ranks N too (expert parallelism is "
        "off)");
  if (device_opt && device_opt->count() > 0 &&
      (opts.backend == "cpu" || (opts.backend == "auto" && !engine::cuda_device_present())))
    fmt::print(stderr, "strata: warning: --device {} is ignored: {}\n", opts.device,
               opts.backend == "cpu" ? "--backend cpu runs on no GPU" : "no CUDA device, so the CPU backend runs");
  const std::string tw = threads_warning(opts.n_threads);
  if (!tw.empty()) fmt::print(stderr, "{}\n", tw);
  engine::EngineOptions o = opts;
  o.kernels = cpu::kernels::parse_cpu_kernels(cpu_kernels);
  o.act_quant = cpu::kernels::parse_act_quant(act_quant);
  o.direct_io = !no_direct_io;
  o.use_pack = !no_pack;
  o.predict = predict == "on";
  return o;
}

quality::MoceCalibration EngineFlags::calibrate_moce(engine::Engine& eng) const {
  if (moce_kld_budget <= 0) {
    if (!moce_calibrate.empty()) throw std::invalid_argument("--moce-calibrate needs --moce-kld-budget X");
    return {};
  }
  // Sequences of at most kMoceSampleTokens (each teacher-forced from an empty arena), at most
  // kMoceSampleSequences of them: the file's first tokens, or the model's own sampled text.
  const size_t len = size_t(std::min<int64_t>(quality::kMoceSampleTokens, eng.n_ctx()));
  std::vector<std::vector<int32_t>> cal;
  if (!moce_calibrate.empty()) {
    std::ifstream in(moce_calibrate, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    if (!in) throw std::invalid_argument(fmt::format("cannot read the calibration file '{}'", moce_calibrate));
    const std::vector<int32_t> ids = eng.tokenizer().encode(ss.str());
    if (ids.size() < size_t(2 * quality::kMoceBlock))
      throw std::invalid_argument(fmt::format(
          "the calibration file '{}' has {} tokens: give at least {} (two blocks of {} for the standard error)",
          moce_calibrate, ids.size(), 2 * quality::kMoceBlock, quality::kMoceBlock));
    for (size_t i = 0; i + 1 < ids.size() && cal.size() < size_t(quality::kMoceSampleSequences); i += len)
      cal.emplace_back(ids.begin() + ptrdiff_t(i), ids.begin() + ptrdiff_t(std::min(ids.size(), i + len)));
  } else {
    cal = quality::moce_sampled_texts(eng, quality::kMoceSampleSequences, int(len));
  }
  const quality::MoceCalibration c = quality::calibrate_moce(eng, cal, moce_kld_budget);
  fmt::print(stderr,
             "moce calibration on {} sequences, {} tokens ({}), teacher-forced decode from an empty arena, KLD vs "
             "bonus 0 (mean + {} x standard error):",
             c.sequences, c.tokens,
             moce_calibrate.empty() ? "the model's own text sampled at temperature 1" : moce_calibrate,
             quality::kMoceZ);
  for (const auto& g : c.grid) fmt::print(stderr, " {}:{:.5f}+{:.5f}", g.bonus, g.kld, quality::kMoceZ * g.kld_error);
  fmt::print(stderr, "\nmoce calibration: chose --moce-bonus {} (KLD {:.5f}, bound {:.5f} <= budget {})\n", c.bonus,
             c.kld, c.kld_bound, moce_kld_budget);
  return c;
}

CLI::Validator existing_file_or_stdin() {
  return CLI::Validator([](std::string& s) -> std::string { return s == "-" ? std::string() : CLI::ExistingFile(s); },
                        "FILE|-");
}

std::string read_prompt_file(const std::string& path, const std::string& purpose) {
  const bool stdin_ = path == "-";
  const std::string name = stdin_ ? std::string("standard input (-f -)") : fmt::format("the prompt file '{}'", path);
  std::ifstream file;
  if (!stdin_) {
    // Pipes, FIFOs (`-f <(cmd)`) and devices are read like files; one that never ends
    // (/dev/zero) stops at kMaxPromptFileBytes below.
    file.open(path, std::ios::binary);
    if (!file) throw std::invalid_argument(fmt::format("cannot read prompt file '{}'", path));
  }
  std::istream& in = stdin_ ? std::cin : file;
  std::string text;
  char buf[1 << 16];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    text.append(buf, size_t(in.gcount()));
    if (text.size() > kMaxPromptFileBytes)
      throw std::invalid_argument(
          fmt::format("{} is larger than {} MiB (tokenizing it would take minutes and "
                      "gigabytes); cut it first",
                      name, kMaxPromptFileBytes >> 20));
  }
  if (in.bad()) throw std::invalid_argument(fmt::format("cannot read the prompt from {}", name));
  if (text.empty()) throw std::invalid_argument(fmt::format("{} is empty: nothing to {}", name, purpose));
  return text;
}

void PromptFlags::add(CLI::App& app) {
  text_opt = app.add_option("-p,--prompt", text, "prompt text");
  app.add_option("-f,--file", file, "read the prompt from a file ('-' = standard input)")
      ->check(existing_file_or_stdin());
  ids_opt = app.add_option("--prompt-ids", ids, "prompt as comma-separated token ids");
}

std::vector<int32_t> parse_id_list(const std::string& s, const std::string& flag, const std::string& what) {
  // "--prompt-ids '1,2,'" names where the list came from; without a flag, the list alone.
  const std::string where = flag.empty() ? fmt::format("'{}'", s) : fmt::format("{} '{}'", flag, s);
  if (s.find_first_not_of(" \t\n") == std::string::npos)
    throw std::invalid_argument(
        fmt::format("{}: empty list (give comma-separated {}s, e.g. 1,2,3)", flag.empty() ? where : flag, what));
  std::vector<int32_t> out;
  size_t start = 0;
  for (size_t n = 1;; ++n) {
    const size_t comma = s.find(',', start);
    std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t b = item.find_first_not_of(" \t\n"), e = item.find_last_not_of(" \t\n");
    if (b == std::string::npos)
      throw std::invalid_argument(fmt::format("{}: entry {} is empty (a stray comma?)", where, n));
    item = item.substr(b, e - b + 1);
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || v < INT32_MIN || v > INT32_MAX)
      throw std::invalid_argument(fmt::format("{}: '{}' is not a {} (an integer)", where, item, what));
    out.push_back(int32_t(v));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

std::vector<int32_t> PromptFlags::tokens(const tokenizer::Tokenizer& tok) const {
  const bool has_text = !text.empty() || (text_opt != nullptr && text_opt->count() > 0);
  const bool has_ids = !ids.empty() || (ids_opt != nullptr && ids_opt->count() > 0);
  const int given = int(has_text) + int(!file.empty()) + int(has_ids);
  if (given != 1) throw std::invalid_argument("give exactly one of -p TEXT, -f FILE or --prompt-ids IDS");
  if (has_text && text.empty()) throw std::invalid_argument("empty prompt: -p was given an empty text");
  if (has_ids) return parse_id_list(ids, "--prompt-ids");
  if (!file.empty()) {
    const std::string content = read_prompt_file(file, purpose);
    try {
      return tok.encode(content, parse_special);
    } catch (const tokenizer::TokenizerError& e) {
      throw tokenizer::TokenizerError(
          fmt::format("{} (-f): {}", file == "-" ? std::string("standard input") : "prompt file '" + file + "'",
                      e.what()));
    }
  }
  try {
    return tok.encode(text, parse_special);
  } catch (const tokenizer::TokenizerError& e) {
    throw tokenizer::TokenizerError(fmt::format("the -p prompt: {}", e.what()));
  }
}

void print_profile(engine::Engine& e) {
  if (!e.options().profile) return;
  fmt::print(stderr, "\nprofile (host wall time per stage{})\n",
             e.backend_info().name == "cpu" ? "; the CPU backend is synchronous, so this is compute"
                                            : "; the device is synchronized at each stage's start and end, so a "
                                              "stage's time is its GPU time; the syncs slow the run");
  const engine::PhaseStats &pf = e.prefill_stats(), &dc = e.decode_stats();
  using backend::LoopProfile;
  LoopProfile loops_p, loops_d;
  for (int s = 0; s < model::StageProfile::kCount; ++s) {
    loops_p.add(pf.profile.loops[s]);
    loops_d.add(dc.profile.loops[s]);
  }
  const bool pooled = loops_p.loops + loops_d.loops > 0;
  const int n = e.options().n_threads;
  // With the backend's loop accounting (the CPU pool): per stage, the share of its time in
  // parallel loops and its time projected on n free cores (the code outside loops as measured).
  auto projected = [](double secs, const LoopProfile& l) { return secs - l.loop_s + l.projected_s; };
  fmt::print(stderr, "{:<16} {:>10} {:>7} {:>9} {:>10} {:>7} {:>9}{}\n", "stage", "prefill s", "%", "calls", "decode s",
             "%", "calls", pooled ? fmt::format("   prefill: in loops  on {:>2} cores", n) : "");
  double sum_p = 0, sum_d = 0;
  auto pct = [](double s, double total) { return total > 0 ? 100.0 * s / total : 0.0; };
  for (int s = 0; s < model::StageProfile::kCount; ++s) {
    const double a = pf.profile.seconds[s], b = dc.profile.seconds[s];
    sum_p += a;
    sum_d += b;
    if (pf.profile.calls[s] == 0 && dc.profile.calls[s] == 0) continue;
    const LoopProfile& l = pf.profile.loops[s];
    fmt::print(stderr, "{:<16} {:>10.4f} {:>6.1f}% {:>9} {:>10.4f} {:>6.1f}% {:>9}{}\n", model::StageProfile::name(s),
               a, pct(a, pf.seconds), pf.profile.calls[s], b, pct(b, dc.seconds), dc.profile.calls[s],
               pooled ? fmt::format("   {:>16.1f}% {:>10.4f}", pct(l.loop_s, a), projected(a, l)) : "");
  }
  fmt::print(stderr, "{:<16} {:>10.4f} {:>6.1f}% {:>9} {:>10.4f} {:>6.1f}%\n", "other (engine)", pf.seconds - sum_p,
             pct(pf.seconds - sum_p, pf.seconds), "", dc.seconds - sum_d, pct(dc.seconds - sum_d, dc.seconds));
  if (!pooled) return;
  fmt::print(stderr,
             "thread scaling (Amdahl over the pool's loops as this run split them for {} thread{}: a loop takes "
             "max(its blocks' CPU time / {}, its longest block) on {} free cores, code outside loops runs on one "
             "thread; memory bandwidth and hand-offs are not modelled):\n",
             n, n == 1 ? "" : "s", n, n);
  // The exposed expert wait is the drive's, not compute: left out of both sides.
  auto line = [&](const char* phase, const engine::PhaseStats& ph, const LoopProfile& l) {
    if (ph.seconds <= 0) return;
    const double wait = ph.profile.seconds[model::StageProfile::ExpertWait];
    const double serial = std::max(0.0, ph.seconds - wait - l.loop_s), one = serial + l.work_s,
                 at_n = serial + l.projected_s;
    fmt::print(stderr,
               "  {:<8} outside loops {:.4f} s ({:.1f}%), {} loops of {:.4f} s CPU; one thread's work {:.4f} s, on {} "
               "cores >= {:.4f} s: {:.2f}x (expert wait {:.4f} s left out)\n",
               phase, serial, pct(serial, one), l.loops, l.work_s, one, n, at_n, at_n > 0 ? one / at_n : 0.0, wait);
  };
  line("prefill", pf, loops_p);
  line("decode", dc, loops_d);
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", b) : fmt::format("{:.1f} {}", b, units[u]);
}

nlohmann::json recall_json(const model::PredictionStats& p) {
  nlohmann::json out = nlohmann::json::array();
  for (size_t l = 0; l < p.picks.size(); ++l)
    out.push_back(p.picks[l] ? nlohmann::json(double(p.predicted[l]) / double(p.picks[l])) : nlohmann::json(nullptr));
  return out;
}

double overall_recall(const model::PredictionStats& p) {
  uint64_t picks = 0, hit = 0;
  for (size_t l = 0; l < p.picks.size(); ++l) {
    picks += p.picks[l];
    hit += p.predicted[l];
  }
  return picks ? double(hit) / double(picks) : 0.0;
}

nlohmann::json phase_json(const engine::PhaseStats& p) {
  return {{"prediction_recall", overall_recall(p.prediction)},
          {"prediction_recall_per_layer", recall_json(p.prediction)},
          {"tokens", p.tokens},
          {"seconds", p.seconds},
          {"tokens_per_s", p.tokens_per_s()},
          {"needed", p.stream.needed},
          {"hit", p.stream.hits},
          {"missed", p.stream.misses},
          {"streamed_ahead", p.stream.streamed_ahead},
          {"ahead_late", p.stream.ahead_late},
          {"ahead_in_flight", p.stream.ahead_in_flight},
          {"wasted", p.stream.wasted},
          {"reads", p.stream.reads},
          {"bytes_read", p.stream.bytes_read},
          {"exposed_wait_s", p.stream.exposed_wait_s},
          {"moce_substituted", p.moce.substituted},
          {"moce_misses_avoided", p.moce.misses_avoided},
          // tiers (docs/streaming.md, "Tiers"): reads = host_hits + disk_reads
          {"arena_hits", p.stream.hits},
          {"host_hits", p.stream.host_hits},
          {"host_hit_bytes", p.stream.host_hit_bytes},
          {"disk_reads", p.stream.disk_reads},
          {"disk_bytes", p.stream.bytes_read},
          {"host_fills", p.stream.host_fills},
          {"host_evictions", p.stream.host_evictions},
          {"h2d_bytes", p.stream.h2d_bytes},
          {"h2d_busy_s", p.stream.h2d_busy_s}};
}

nlohmann::json arena_json(engine::Engine& e) {
  return {{"bytes", e.arena_bytes()},
          {"slots", e.stream().n_slots()},
          {"slot_bytes", e.stream().slot_bytes()},
          {"expert_bytes", e.expert_bytes()},
          {"expert_count",
           [&] {
             uint64_t n = 0;
             for (const auto& L : e.model().expert_layout()) n += uint64_t(L.n_expert);
             return n;
           }()},
          {"direct_io", e.stream().direct()},
          {"host_cache_bytes", e.host_cache_bytes()},
          {"host_cache_slots", e.stream().host_slots()},
          {"host_cache_pinned", e.host_cache_pinned()}};
}

nlohmann::json memory_json(const engine::MemoryReport& m) {
  nlohmann::json vram = nullptr;
  if (m.has_device)
    vram = {{"device", m.device},
            {"free_bytes", m.vram_free_bytes},
            {"total_bytes", m.vram_total_bytes},
            {"used_bytes", m.vram_total_bytes - m.vram_free_bytes}};
  return {{"rss_bytes", m.rss_bytes},
          {"rss_peak_bytes", m.rss_peak_bytes},
          {"mem_available_bytes", m.mem_available_bytes},
          {"pinned_bytes", m.pinned_bytes},
          {"vram", vram}};
}

std::string memory_line(const engine::MemoryReport& m) {
  std::string s = fmt::format("memory: RSS {} (peak {}), pinned {}", human_bytes(double(m.rss_bytes)),
                              human_bytes(double(m.rss_peak_bytes)), human_bytes(double(m.pinned_bytes)));
  if (m.has_device)
    s += fmt::format(", VRAM {} of {} used (device {})", human_bytes(double(m.vram_total_bytes - m.vram_free_bytes)),
                     human_bytes(double(m.vram_total_bytes)), m.device);
  return s;
}

void print_stats(engine::Engine& e) {
  auto line = [&](const char* name, const engine::PhaseStats& p) {
    const auto& s = p.stream;
    const double hit_rate = s.needed ? 100.0 * double(s.hits) / double(s.needed) : 0.0;
    fmt::print(stderr,
               "{:<8} {:5d} tokens in {:7.3f} s = {:8.2f} tok/s | experts needed {} hit {} ({:.1f} %) missed {} "
               "(late {}) | ahead {} (in flight {}) wasted {} | read {} | exposed wait {:.3f} s | recall {:.1f} %\n",
               name, p.tokens, p.seconds, p.tokens_per_s(), s.needed, s.hits, hit_rate, s.misses, s.ahead_late,
               s.streamed_ahead, s.ahead_in_flight, s.wasted, human_bytes(double(s.bytes_read)), s.exposed_wait_s,
               100.0 * overall_recall(p.prediction));
    if (p.moce.substituted || p.moce.misses_avoided)
      fmt::print(stderr, "{:<8} moce: {} experts substituted, {} misses avoided\n", "", p.moce.substituted,
                 p.moce.misses_avoided);
  };
  // The tiers of one phase: where the needed experts came from (docs/streaming.md, "Tiers").
  auto tiers = [&](const char* name, const engine::PhaseStats& p) {
    const auto& s = p.stream;
    fmt::print(stderr, "{:<8} tiers: arena hits {} | host hits {} ({}) | disk reads {} ({}) | copied to arena {}\n",
               name, s.hits, s.host_hits, human_bytes(double(s.host_hit_bytes)), s.disk_reads,
               human_bytes(double(s.bytes_read)), human_bytes(double(s.h2d_bytes)));
  };
  fmt::print(stderr, "\n");
  line("prefill", e.prefill_stats());
  line("decode", e.decode_stats());
  tiers("prefill", e.prefill_stats());
  tiers("decode", e.decode_stats());
  uint64_t total_experts = 0;
  for (const auto& L : e.model().expert_layout()) total_experts += uint64_t(L.n_expert);
  const size_t n_slots = e.expert_parallel() ? e.expert_parallel()->n_slots() : e.stream().n_slots();
  fmt::print(stderr, "arena    {} x {} = {} (room for {:.0f} % of the {} experts, {} of expert bytes), {} reads, {}\n",
             count_of(n_slots, "slot"), human_bytes(double(e.stream().slot_bytes())),
             human_bytes(double(e.arena_bytes())),
             100.0 * double(n_slots) / double(std::max<uint64_t>(1, total_experts)), total_experts,
             human_bytes(double(e.expert_bytes())), e.stream().direct() ? "O_DIRECT" : "buffered",
             count_of(e.options().n_threads, "thread"));
  fmt::print(stderr, "{}", ep_rank_lines(e));
  if (e.options().moce_bonus > 0)
    fmt::print(stderr, "moce     bonus {} on {} (results depend on residency)\n", e.options().moce_bonus,
               e.options().moce_prefill ? "prefill and decode" : "decode");
  if (e.stream().host_slots() > 0)
    fmt::print(stderr, "host     {} slots = {} of {} host memory (LRU), between the disk and the arena\n",
               e.stream().host_slots(), human_bytes(double(e.host_cache_bytes())),
               e.host_cache_pinned() ? "pinned" : "pageable");
}

std::string ep_rank_lines(const engine::Engine& e) {
  const parallel::ExpertParallel* ep = e.expert_parallel();
  if (!ep) return "";
  const parallel::Placement& p = ep->placement();
  std::string out;
  const int io = std::max(1, e.options().io_threads / ep->n_ranks());
  const auto& sent = ep->communicator().stats().sent_bytes;
  for (int r = 0; r < ep->n_ranks(); ++r) {
    size_t owned = 0;
    for (int l = 0; l < p.n_layers(); ++l) owned += p.owned(r, l).size();
    const stream::StreamStats s = ep->rank_stats(r);
    out += fmt::format(
        "ep rank {}: owns {} ({}, by {}) | arena {}, {} | needed {} missed {} | reads {} "
        "read {} | combine sent {}\n",
        r, count_of(owned, "expert"), human_bytes(double(p.rank_bytes(r))), p.kind(),
        count_of(ep->stream(r).n_slots(), "slot"), count_of(io, "IO thread"), s.needed, s.misses, s.reads,
        human_bytes(double(s.bytes_read)), human_bytes(double(sent[size_t(r)])));
  }
  const auto& cs = ep->communicator().stats();
  out += fmt::format("ep       {} ({} communicator): {} in {:.3f} s\n", count_of(ep->n_ranks(), "rank"),
                     ep->communicator().name(), count_of(cs.calls, "collective"), cs.seconds);
  return out;
}

}  // namespace strata::cli
