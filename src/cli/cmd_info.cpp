// strata tokenize / strata info: inspect a GGUF without running it.
#include <fmt/format.h>

#include <map>

#include "cli/commands.h"
#include "cli/common.h"
#include "model/arch.h"
#include "model/hparams.h"
#include "model/model.h"

namespace strata::cli {

void register_tokenize(CLI::App& root) {
  struct Flags {
    std::string model, text, file;
    bool json = false, no_special = false;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* app = root.add_subcommand("tokenize", "print the token ids of a text");
  app->add_option("-m,--model", f->model, "GGUF model file")->required()->check(CLI::ExistingFile);
  app->add_option("-p,--prompt", f->text, "text to tokenize");
  app->add_option("-f,--file", f->file, "read the text from a file ('-' = standard input)")
      ->check(existing_file_or_stdin());
  app->add_flag("--no-parse-special", f->no_special, "treat special-token strings as plain text");
  app->add_flag("--json", f->json, "print {\"ids\": [...]}");
  app->callback([f] {
    const gguf::File g = gguf::File::open(f->model);
    g.require_model();
    const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_gguf(g);
    PromptFlags p;
    p.text = f->text;
    p.file = f->file;
    p.purpose = "tokenize";
    p.parse_special = !f->no_special;
    const std::vector<int32_t> ids = p.tokens(tok);
    if (f->json) {
      fmt::print("{}\n", nlohmann::json{{"ids", ids}}.dump());
      return;
    }
    for (int32_t id : ids) {
      nlohmann::json piece = tok.token_bytes(id);
      fmt::print("{:6d} {}\n", id, piece.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    }
  });
}

void register_info(CLI::App& root) {
  struct Flags {
    std::string model;
    bool json = false;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* app =
      root.add_subcommand("info", "architecture, hyper-parameters, tensor types and expert bytes of a GGUF");
  app->add_option("-m,--model", f->model, "GGUF model file")->required()->check(CLI::ExistingFile);
  app->add_flag("--json", f->json, "print JSON");
  app->callback([f] {
    const gguf::File g = gguf::File::open(f->model);
    g.require_model();
    // A supported architecture's table says which tensors are routed experts (read through the
    // stream), dense, or skipped; for other files the expert parts go by llama.cpp's names.
    const model::Architecture* arch = nullptr;
    for (const auto& a : model::architectures())
      if (a.matches(g)) arch = &a;
    const model::ModelHParams hp = arch ? model::read_hparams(g, *arch) : model::read_common_hparams(g);
    std::map<std::string, model::TensorRole> role;
    if (arch)
      for (const auto& t : arch->tensors(hp)) role.emplace(t.name, t.role);
    std::map<std::string, int> per_type;
    uint64_t dense = 0, experts = 0, skipped = 0;
    std::vector<uint64_t> per_layer(hp.n_layer, 0);
    for (const auto& t : g.tensors()) {
      per_type[ggml_type_name(t.type)]++;
      const auto r = role.find(t.name);
      const bool is_expert =
          r != role.end() ? r->second == model::TensorRole::Expert : t.name.find("_exps.") != std::string::npos;
      if (is_expert) {
        experts += t.n_bytes;
        const int layer = t.layer();
        if (layer >= 0 && layer < hp.n_layer) per_layer[layer] += t.n_bytes;
      } else if (r != role.end() && r->second == model::TensorRole::Skip) {
        skipped += t.n_bytes;
      } else {
        dense += t.n_bytes;
      }
    }
    const bool supported = arch != nullptr;
    nlohmann::json j = {{"file", f->model},
                        {"file_bytes", g.file_size()},
                        {"gguf_version", g.version()},
                        {"architecture", hp.arch},
                        {"supported", supported},
                        {"name", hp.name},
                        {"hparams",
                         {{"n_layer", hp.n_layer},
                          {"n_embd", hp.n_embd},
                          {"n_head", hp.n_head},
                          {"n_head_kv", hp.n_head_kv},
                          {"head_dim", hp.head_dim_k},
                          {"n_rot", hp.n_rot},
                          {"n_ff_exp", hp.n_ff_exp},
                          {"n_expert", hp.n_expert},
                          {"n_expert_used", hp.n_expert_used},
                          {"n_vocab", hp.n_vocab},
                          {"n_ctx_train", hp.n_ctx_train},
                          {"rope_freq_base", hp.rope_freq_base},
                          {"rms_eps", hp.rms_eps},
                          {"tied_output", hp.tied_output}}},
                        {"tensor_count", g.tensors().size()},
                        {"tensors_per_type", per_type},
                        {"dense_bytes", dense},
                        {"expert_bytes", experts},
                        {"expert_bytes_per_layer", per_layer},
                        {"skipped_bytes", skipped}};
    // Memory of this process now (the header and tensor table are read) and of CUDA device 0.
    const engine::MemoryReport mem = engine::memory_report(0);
    j["memory"] = memory_json(mem);
    if (f->json) {
      fmt::print("{}\n", j.dump());
      return;
    }
    fmt::print("file          {} ({}, GGUF v{})\n", f->model, human_bytes(double(g.file_size())), g.version());
    fmt::print("architecture  {}{}  \"{}\"\n", hp.arch, supported ? "" : " (not supported by this build)", hp.name);
    fmt::print("layers        {}   hidden {}   heads {} (kv {}, dim {})   vocab {}   context {}\n", hp.n_layer,
               hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.n_vocab, hp.n_ctx_train);
    fmt::print("experts       {} per layer, top-{}, expert FFN {}\n", hp.n_expert, hp.n_expert_used, hp.n_ff_exp);
    fmt::print("rope base     {}   rms eps {}   output {}\n", hp.rope_freq_base, hp.rms_eps,
               hp.tied_output ? "tied to token_embd" : "output.weight");
    std::string types;
    for (const auto& [k, v] : per_type) types += fmt::format("{} x{}  ", k, v);
    fmt::print("tensors       {}: {}\n", g.tensors().size(), types);
    fmt::print("dense bytes   {}\n", human_bytes(double(dense)));
    fmt::print("expert bytes  {} in all, {} per layer\n", human_bytes(double(experts)),
               human_bytes(hp.n_layer ? double(experts) / hp.n_layer : 0.0));
    if (skipped > 0)
      fmt::print("skipped bytes {} (tensors the forward pass does not use, e.g. NextN blocks)\n",
                 human_bytes(double(skipped)));
    fmt::print("{}\n", memory_line(mem));
  });
}

}  // namespace strata::cli
