#pragma once
// Flags shared by the subcommands (llama.cpp names where they exist) and helpers.
#include <CLI/CLI.hpp>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/quality.h"
#include "engine/sampler.h"

namespace strata::cli {

/// Model and engine flags: -m, -t/--threads, --arena-mb, --prompt-chunk, -c/--ctx-size,
/// --io-threads, --no-direct-io, --no-pack, --cpu-kernels, --predict, --predict-min,
/// --static-rank, --fake-stream, --dump, --dump-filter.
struct EngineFlags {
  std::string model;
  engine::EngineOptions opts;
  std::string cpu_kernels = "auto";
  std::string act_quant = "auto";
  bool no_direct_io = false;
  bool no_pack = false;
  std::string predict = "on";
  double moce_kld_budget = 0;  ///< --moce-kld-budget (nats; 0 = no calibration)
  std::string moce_calibrate;  ///< --moce-calibrate FILE ("" = the built-in greedy sample)
  // Given on the command line (count() > 0), to refuse or name flags that would be ignored.
  const CLI::Option* device_opt = nullptr;
  const CLI::Option* dump_filter_opt = nullptr;
  const CLI::Option* ep_placement_opt = nullptr;
  void add(CLI::App& app);
  /// With --moce-kld-budget: picks the bonus (quality::calibrate_moce) on the calibration text,
  /// prints the grid and the choice to stderr, leaves `eng` at it and returns it (with its grid);
  /// else does nothing and returns an empty calibration (bonus 0, no grid). Throws
  /// std::invalid_argument for an unreadable or too short file, EngineError as decode does.
  quality::MoceCalibration calibrate_moce(engine::Engine& eng) const;
  /// The options with string flags resolved. Throws std::invalid_argument on bad values and on
  /// flags that would do nothing: -t outside 0..1024, a negative --device, --dump-filter
  /// without --dump, --ep-placement without --ep-ranks. Prints one warning line to stderr for
  /// -t beyond the hardware threads, and for --device where no CUDA backend runs (it is ignored).
  engine::EngineOptions resolve() const;
};

/// Prompt flags: -p TEXT, -f FILE (`-f -` reads standard input), --prompt-ids 1,2,3 (exactly one).
struct PromptFlags {
  std::string text;
  std::string file;
  std::string ids;
  const CLI::Option* text_opt = nullptr;  ///< -p, to tell `-p ""` from no -p
  const CLI::Option* ids_opt = nullptr;   ///< --prompt-ids, to tell `--prompt-ids ""` from none
  /// What the command does with the prompt, for the error on an empty file: "the prompt file
  /// 'x' is empty: nothing to <purpose>".
  std::string purpose = "run";
  /// false: special-token strings in the text (-p, -f) are plain text (`tokenize --no-parse-special`).
  bool parse_special = true;
  void add(CLI::App& app);
  /// Token ids of the prompt; text and files go through the model's tokenizer.
  /// Throws std::invalid_argument if none or several are given, ids do not parse, or the file
  /// (or standard input, for `-f -`) cannot be read.
  std::vector<int32_t> tokens(const tokenizer::Tokenizer& tok) const;
};

/// CLI11 check for a -f option: an existing file, or "-" for standard input.
CLI::Validator existing_file_or_stdin();

/// The bytes of the prompt file `path` given to -f ("-" = all of standard input). Throws
/// std::invalid_argument naming the file when it cannot be read, or when it is empty
/// ("... is empty: nothing to <purpose>"), or holds more than kMaxPromptFileBytes (/dev/zero too).
std::string read_prompt_file(const std::string& path, const std::string& purpose);
/// The largest prompt file read_prompt_file takes (bytes): 64 MiB of text is ~16 M tokens, more than
/// any context or perplexity run needs; beyond it the error says so instead of growing without bound.
inline constexpr size_t kMaxPromptFileBytes = size_t(64) << 20;

/// `s` read whole as a decimal integer (std::stoll takes every character: no "", "1.5", "x");
/// nullopt otherwise.
inline std::optional<long long> parse_integer(const std::string& s) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(s, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (used == 0 || used != s.size()) return std::nullopt;
  return v;
}

/// CLI11 check for an integer option: at least `lo`. Its message reads "--top: must be at least
/// 1, got 0" (CLI11's PositiveNumber would print its range up to 1.8e308).
inline CLI::Validator at_least(long long lo) {
  return CLI::Validator(
      [lo](std::string& s) -> std::string {
        const std::optional<long long> v = parse_integer(s);
        if (!v) return "must be an integer, got '" + s + "'";
        if (*v < lo) return "must be at least " + std::to_string(lo) + ", got " + s;
        return std::string();
      },
      "INT>=" + std::to_string(lo));
}

/// `s` read whole as a finite decimal number (std::stod takes every character; no "1x", "", nan,
/// inf, and no hexadecimal "0x10", which stod would read as 16); nullopt otherwise.
inline std::optional<double> parse_finite(const std::string& s) {
  if (s.find_first_of("xX") != std::string::npos) return std::nullopt;
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (used != s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

/// CLI11 check for a real-valued option: a finite number above 0. Its message reads
/// "must be a number > 0, got '-1'".
inline CLI::Validator positive_real() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        const std::optional<double> v = parse_finite(s);
        if (!v || !(*v > 0)) return "must be a number > 0, got '" + s + "'";
        return std::string();
      },
      "NUM>0");
}

/// CLI11 check for a real-valued option: a finite number >= 0. Its message reads
/// "must be a number >= 0, got '-1'" (CLI11's NonNegativeNumber would print 1.8e308 in full).
inline CLI::Validator non_negative_real() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        const std::optional<double> v = parse_finite(s);
        if (!v || !(*v >= 0)) return "must be a number >= 0, got '" + s + "'";
        return std::string();
      },
      "NUM>=0");
}

/// CLI11 check that an option's text is a number at all (finite; not "", "1x", nan): CLI11 would
/// read an empty value as 0. The option's own range is checked where it is used.
inline CLI::Validator a_number() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        return parse_finite(s) ? std::string() : "must be a number, got '" + s + "'";
      },
      "NUM");
}

/// CLI11 check that an option's text is an integer (not "", "1.5", "x"); its range is checked
/// where it is used.
inline CLI::Validator an_integer() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        return parse_integer(s) ? std::string() : "must be an integer, got '" + s + "'";
      },
      "INT");
}

/// Sampling flags, with llama.cpp's names and defaults, shared by every command that samples
/// (run, chat): --temp, --top-k, --top-p, --min-p, --repeat-penalty, --repeat-last-n and
/// -s/--seed. One validation for all of them (resolve()).
struct SamplingFlags {
  engine::SamplerParams sp;  ///< as parsed; sp.seed is set by resolve() from `seed`
  int64_t seed = -1;         ///< -s/--seed: -1 = random
  /// Adds the flags to `app`. request_defaults (serve): the help says that each flag is the
  /// default of requests that leave the field unset, and resolve() also keeps --temp, --top-k,
  /// --repeat-penalty and --repeat-last-n within a request's ranges (server/openai.h).
  void add(CLI::App& app, bool request_defaults = false);
  bool request_defaults = false;  ///< set by add()
  /// The sampler's parameters, checked: --temp finite and >= 0, --top-p in [0, 1] (as the server's top_p), --min-p in
  /// [0, 1], --top-k >= 0, --repeat-penalty finite and > 0, --repeat-last-n >= -1 (-1 = the
  /// context, 0 = off, as llama.cpp), --seed >= -1. Throws std::invalid_argument naming the flag
  /// (NaN fails every range).
  engine::SamplerParams resolve() const;
};

/// -n/--n-predict: tokens to generate into `n`, an integer >= -1 (-1 = no limit but the end of
/// text or of the context); the one check every generating command (run, chat, serve) uses.
CLI::Option* add_n_predict_option(CLI::App& app, int& n, const std::string& description);

/// -s/--seed as llama.cpp spells it: an integer >= -1 into `seed`, -1 (the default) = random.
/// `help`: the option's description (default: run's and chat's).
void add_seed_option(CLI::App& app, int64_t& seed,
                     const std::string& help = "sampling seed (-1 = random, printed when sampling; default -1)");
/// The sampler's seed for a --seed value: -1 -> engine::SamplerParams' random marker
/// (engine::kRandomSeed), else the value. Throws std::invalid_argument below -1.
uint64_t resolve_seed(int64_t seed);

/// llama.cpp flags strata does not take under that name (-ngl, --n-gpu-layers, -tb, -fa, -b,
/// -ub, -cnv, -mg, -ctk, ...): for argv[1..argc) returns the error naming the strata equivalent
/// for the first one found (arguments right after -p/--prompt are text and skipped), or "".
/// CLI11 would otherwise read "-ngl 99" as "-n gl 99".
std::string llama_cpp_flag_error(int argc, const char* const* argv);

/// A warning when `n_threads` exceeds the hardware threads (empty when it does not, or when
/// the count is unknown).
std::string threads_warning(int n_threads);

/// Parses a comma-separated integer list "1,2,3" (spaces around entries allowed) given to
/// `flag` ("" = not from a flag), whose entries are each a `what` ("token id", "thread count").
/// Throws std::invalid_argument naming the flag and the list: an empty list, an empty entry
/// ("1,,2", "1,2,") or an entry that is not an integer in the int32 range.
std::vector<int32_t> parse_id_list(const std::string& s, const std::string& flag = "",
                                   const std::string& what = "token id");

/// Per-layer prediction recall (predicted / picks; null where no prediction was made).
nlohmann::json recall_json(const model::PredictionStats& p);
/// Overall recall over all layers (0 when nothing was predicted).
double overall_recall(const model::PredictionStats& p);
/// Stream counters and timings of one phase as JSON.
nlohmann::json phase_json(const engine::PhaseStats& p);
/// Arena facts as JSON: bytes, slots, slot_bytes, direct_io, expert_bytes.
nlohmann::json arena_json(engine::Engine& e);
/// engine::memory_report() as JSON: rss_bytes, rss_peak_bytes, mem_available_bytes,
/// pinned_bytes, and "vram": {device, free_bytes, total_bytes, used_bytes} (null without a device).
nlohmann::json memory_json(const engine::MemoryReport& m);
/// The same as one line: "memory: RSS 1.2 GiB (peak 1.5 GiB), pinned 0 B, VRAM 3.4 GiB of 140.0 GiB used".
std::string memory_line(const engine::MemoryReport& m);
/// One human-readable summary block (to stderr) of prefill, decode and the stream.
void print_stats(engine::Engine& e);
/// Under --ep-ranks: one line per rank (experts owned and their bytes, arena share, IO threads,
/// the rank's counters since the engine started: needed, missed, reads, bytes read) and one
/// for the combine (bytes each rank sends, collective calls and time); "" when off.
std::string ep_rank_lines(const engine::Engine& e);

/// With --profile: seconds per forward stage of prefill and decode, and their share of the
/// phase's wall time (to stderr); the CUDA backend's note that its times are host-side.
void print_profile(engine::Engine& e);

/// `n` and `noun` with English plural: "1 thread", "2 threads", "0 threads" (noun in the singular).
template <class N>
std::string count_of(N n, const std::string& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

/// Human-readable byte count ("3.2 MiB").
std::string human_bytes(double bytes);

int cmd_run(CLI::App& app);
int cmd_logits(CLI::App& app);

}  // namespace strata::cli
