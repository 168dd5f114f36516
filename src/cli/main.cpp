// strata: one binary, subcommands for running, inspecting and measuring MoE GGUF models.
#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>

#include "cli/commands.h"
#include "cli/common.h"

int main(int argc, char** argv) {
  CLI::App app{"strata: run Mixture-of-Experts GGUF models larger than memory, streaming experts from disk"};
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
    return 1;
  }
  int rc = 0;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    rc = app.exit(e);
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
