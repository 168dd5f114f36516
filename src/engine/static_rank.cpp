#include "engine/static_rank.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <stdexcept>

namespace strata::engine {

std::vector<std::vector<int32_t>> ExpertPopularity::rank() const {
  std::vector<std::vector<int32_t>> out;
  for (const auto& row : counts) {
    std::vector<int32_t> ids(row.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
    out.push_back(std::move(ids));
  }
  return out;
}

void ExpertPopularity::count(const model::RoutingTrace& trace) {
  for (size_t l = 0; l < trace.ids.size(); ++l)
    for (const auto& tok : trace.ids[l])
      for (int32_t e : tok) counts.at(l).at(size_t(e))++;
}

std::string default_rank_path(const std::string& model_path) { return model_path + ".strata-rank"; }

void write_popularity(const std::string& path, const std::string& model_path, const ExpertPopularity& pop) {
  nlohmann::json j = {{"format", "strata-rank"},
                      {"version", 1},
                      {"model_bytes", std::filesystem::file_size(model_path)},
                      {"tokens", pop.tokens},
                      {"counts", pop.counts}};
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) throw std::runtime_error(fmt::format("cannot write {}", tmp));
    out << j.dump() << "\n";
    if (!out.flush()) throw std::runtime_error(fmt::format("cannot write {}", tmp));
  }
  std::filesystem::rename(tmp, path);
}

std::optional<ExpertPopularity> read_popularity(const std::string& path, const std::string& model_path, int n_layer,
                                                int n_expert) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}: not a strata-rank file ({})", path, e.what()));
  }
  if (!j.is_object() || j.value("format", "") != "strata-rank" || j.value("version", 0) != 1)
    throw std::runtime_error(fmt::format("{}: not a strata-rank v1 file", path));
  if (j.value("model_bytes", uint64_t(0)) != std::filesystem::file_size(model_path))
    throw std::runtime_error(
        fmt::format("{}: made for another model (size differs from {}); rerun strata profile", path, model_path));
  ExpertPopularity pop;
  try {
    pop.tokens = j.at("tokens").get<uint64_t>();
    pop.counts = j.at("counts").get<std::vector<std::vector<uint64_t>>>();
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}: malformed counts ({})", path, e.what()));
  }
  bool ok = int(pop.counts.size()) == n_layer;
  for (const auto& row : pop.counts) ok = ok && int(row.size()) == n_expert;
  if (!ok)
    throw std::runtime_error(
        fmt::format("{}: shape differs from the model ({} layers x {} experts)", path, n_layer, n_expert));
  return pop;
}

}  // namespace strata::engine
