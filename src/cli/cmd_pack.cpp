// strata pack: write the pack sidecar (one contiguous 4 KiB-aligned record per expert) that
// the engine then reads instead of the GGUF's three expert tensors.
#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/common.h"
#include "cli/progress.h"
#include "model/arch.h"
#include "stream/pack.h"

namespace strata::cli {

void register_pack(CLI::App& root) {
  struct Flags {
    std::string model, out;
    bool quiet = false, json = false;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* app = root.add_subcommand(
      "pack",
      "write a sidecar with each expert's gate, up and down as one 4 KiB-aligned record (one read per "
      "expert); the engine uses it when present and valid (--no-pack to ignore it)");
  app->add_option("-m,--model", f->model, "GGUF model file")->required()->check(CLI::ExistingFile);
  app->add_option("-o,--output", f->out, "pack file (default: MODEL.strata-pack, where the engine looks for it)");
  app->add_flag("-q,--quiet", f->quiet, "no progress bar");
  app->add_flag("--json", f->json, "print a JSON summary to stdout");
  app->callback([f] {
    ProgressBar bar("pack", f->quiet);
    stream::PackOptions o;
    o.progress = [&](uint64_t done, uint64_t total) { bar.update(done, total); };
    // the experts as the architecture's table lays them out (by llama.cpp's names when unsupported)
    const gguf::File g = gguf::File::open(f->model);
    for (const auto& a : model::architectures())
      if (a.matches(g)) o.layers = model::expert_layout(g, a);
    const stream::PackResult r = stream::write_pack(f->model, f->out, o);
    bar.finish();
    if (f->json) {
      fmt::print("{}\n", nlohmann::json{{"pack", r.path},
                                        {"bytes", r.bytes},
                                        {"records", r.records},
                                        {"record_bytes", r.record_bytes},
                                        {"verified", r.verified},
                                        {"seconds", r.seconds}}
                             .dump());
    } else if (!f->quiet) {
      fmt::print(stderr, "strata pack: {}: {} experts, records of up to {}, {} in all; {} records verified; {:.1f} s\n",
                 r.path, r.records, human_bytes(double(r.record_bytes)), human_bytes(double(r.bytes)), r.verified,
                 r.seconds);
    }
  });
}

}  // namespace strata::cli
