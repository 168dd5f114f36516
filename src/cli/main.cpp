// strata: one binary, subcommands for running, inspecting and measuring MoE GGUF models.
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"

namespace {

// Edits (insertions, deletions, substitutions) that turn a into b (Levenshtein distance).
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// When argv[1] is a word that names no subcommand of `app`: the error naming it, the closest
// commands (at most 2 edits away, as git suggests) and all commands; else "". CLI11 alone says
// "The following argument was not expected".
std::string unknown_command_error(const CLI::App& app, int argc, const char* const* argv) {
  if (argc < 2 || argv[1][0] == '-' || argv[1][0] == '\0') return "";
  const std::string word = argv[1];
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    if (sub->get_name() == word) return "";
    names.push_back(sub->get_name());
  }
  std::string close;
  for (const std::string& n : names)
    if (edit_distance(word, n) <= 2 || (word.size() >= 3 && n.rfind(word, 0) == 0))
      close += (close.empty() ? "" : " or ") + ("'" + n + "'");
  std::string all;
  for (const std::string& n : names) all += (all.empty() ? "" : ", ") + n;
  return fmt::format(
      "'{}' is not a strata command{}\nthe commands are: {}\nsee 'strata --help' or 'strata COMMAND --help'", word,
      close.empty() ? "" : "; did you mean " + close + "?", all);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"strata: run Mixture-of-Experts GGUF models larger than memory, streaming experts from disk", "strata"};
  app.set_version_flag("--version", std::string("strata ") + STRATA_VERSION);
  app.require_subcommand(1);
  strata::cli::register_run(app);
  strata::cli::register_logits(app);
  strata::cli::register_tokenize(app);
  strata::cli::register_info(app);
  strata::cli::register_serve(app);
  strata::cli::register_chat(app);
  strata::cli::register_profile(app);
  strata::cli::register_bench(app);
  strata::cli::register_synth(app);
  strata::cli::register_ssdbw(app);
  strata::cli::register_pack(app);
  strata::cli::register_perplexity(app);
  strata::cli::register_route_parity(app);
  strata::cli::register_moce_bench(app);
  strata::cli::register_template(app);
  // llama.cpp spellings CLI11 would misread ("-ngl 99" as "-n gl"): refused, naming strata's flag.
  if (const std::string err = strata::cli::llama_cpp_flag_error(argc, argv); !err.empty()) {
    fmt::print(stderr, "strata: error: {}\n", err);
    return 2;  // a usage error
  }
  if (const std::string err = unknown_command_error(app, argc, argv); !err.empty()) {
    fmt::print(stderr, "strata: error: {}\n", err);
    return 2;
  }
  // An option before any command (`strata -x`, `strata -m M run`): the top level takes only
  // --help and --version, every other option belongs to a command. A usage error: exit 2.
  if (argc >= 2 && argv[1][0] == '-') {
    const std::string a = argv[1];
    if (a != "-h" && a != "--help" && a != "--version") {
      fmt::print(stderr,
                 "strata: error: unknown option '{}' before the command: options go after it (strata COMMAND "
                 "[OPTIONS]; 'strata COMMAND --help' lists them)\n\n{}",
                 a, app.help());
      return 2;
    }
  }
  // No command at all: the usage with the command list, exit 2 (CLI11 alone says only "A
  // subcommand is required").
  if (argc < 2) {
    fmt::print(stderr, "strata: error: no command given\n\n{}", app.help());
    return 2;
  }
  int rc = 0;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints the message; every usage error (an unknown flag, a missing or malformed
    // value, a file that does not exist) exits 2, as the option-before-the-command case above,
    // instead of CLI11's own codes (CLI::ExitCodes 100-127). --help and --version exit 0; a
    // CLI::RuntimeError keeps its code (an interrupted run: 130).
    const int c = app.exit(e);
    rc = c >= 100 && c <= 127 ? 2 : c;
  } catch (const std::exception& e) {
    fmt::print(stderr, "strata: error: {}\n", e.what());
    rc = 1;
  }
  // Output that never arrived (a full disk, /dev/full, a closed pipe) is an error, not success.
  errno = 0;
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    const int e = errno;
    fmt::print(stderr, "strata: error: writing to standard output failed{}{}\n", e ? ": " : "",
               e ? std::strerror(e) : "");
    return rc != 0 ? rc : 1;
  }
  return rc;
}
