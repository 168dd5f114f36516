#pragma once
// Each subcommand registers itself on the root app; its callback does the work and
// throws on error (main prints the message and exits 1).
#include <CLI/CLI.hpp>

namespace strata::cli {
void register_run(CLI::App& root);
void register_logits(CLI::App& root);
void register_tokenize(CLI::App& root);
void register_info(CLI::App& root);
void register_serve(CLI::App& root);
void register_chat(CLI::App& root);
void register_profile(CLI::App& root);
void register_bench(CLI::App& root);
void register_synth(CLI::App& root);
void register_ssdbw(CLI::App& root);
void register_pack(CLI::App& root);
void register_perplexity(CLI::App& root);
void register_route_parity(CLI::App& root);
void register_moce_bench(CLI::App& root);
void register_template(CLI::App& root);
}  // namespace strata::cli
