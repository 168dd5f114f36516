#include "model/model.h"

#include <fmt/format.h>

#include "model/weights.h"

namespace strata::model {

// Defined in one file per architecture.
std::unique_ptr<Model> load_qwen3moe(const gguf::File& gguf, const LoadOptions& opts);
std::unique_ptr<Model> load_qwen3next(const gguf::File& gguf, const LoadOptions& opts);

namespace {
struct ArchEntry {
  const char* name;
  std::unique_ptr<Model> (*load)(const gguf::File&, const LoadOptions&);
};
// The table of architectures: one line per architecture file.
const ArchEntry kArchitectures[] = {
    {"qwen3moe", &load_qwen3moe},
    {"qwen3next", &load_qwen3next},
};
}  // namespace

void Model::record_routing(RoutingTrace* trace, int layer, const layers::Routing& r, int top_k) const {
  if (!trace) return;
  trace->ids.resize(hp_.n_layer);
  trace->probs.resize(hp_.n_layer);
  trace->next_prob.resize(hp_.n_layer);
  const size_t T = r.next_prob.size(), K = size_t(top_k);
  for (size_t t = 0; t < T; ++t) {
    trace->ids[layer].emplace_back(r.ids.begin() + t * K, r.ids.begin() + (t + 1) * K);
    trace->probs[layer].emplace_back(r.probs.begin() + t * K, r.probs.begin() + (t + 1) * K);
    trace->next_prob[layer].push_back(r.next_prob[t]);
  }
}

std::vector<std::string> supported_architectures() {
  std::vector<std::string> out;
  for (const auto& a : kArchitectures) out.push_back(a.name);
  return out;
}

std::unique_ptr<Model> load_model(const gguf::File& gguf, const LoadOptions& opts) {
  const std::string arch = gguf.get_string("general.architecture");
  for (const auto& a : kArchitectures)
    if (arch == a.name) return a.load(gguf, opts);
  throw ModelError(fmt::format("{}: unsupported architecture '{}' (supported: {})", gguf.path(), arch,
                               fmt::join(supported_architectures(), ", ")));
}

}  // namespace strata::model
