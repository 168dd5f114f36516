#pragma once
// Static rank (DESIGN.md): per-layer expert popularity recorded by `strata profile`, kept in
// a small JSON sidecar next to the model (MODEL.strata-rank). The stream reads ahead in
// this order for layer 0 and wherever no prediction is made.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/model.h"

namespace strata::engine {

/// Pick counts per layer and expert: counts[layer][expert].
struct ExpertPopularity {
  std::vector<std::vector<uint64_t>> counts;
  uint64_t tokens = 0;  ///< tokens profiled
  /// Expert ids of each layer by descending count (ties: lower id first).
  std::vector<std::vector<int32_t>> rank() const;
  /// Adds one pick per (layer, token, k) of a prefill's routing trace (trace.ids[layer][token]
  /// holds the token's top-k expert ids) to `counts`, which must be sized n_layer x n_expert;
  /// `tokens` is left to the caller. Throws std::out_of_range for an id outside `counts`.
  void count(const model::RoutingTrace& trace);
};

/// The default sidecar path for a model: model_path + ".strata-rank".
std::string default_rank_path(const std::string& model_path);

/// Writes `pop` for the model at model_path (its size is recorded to detect a stale sidecar)
/// to `path`, via a temporary file renamed into place. Throws std::runtime_error.
void write_popularity(const std::string& path, const std::string& model_path, const ExpertPopularity& pop);

/// Reads a sidecar. std::nullopt when the file is absent; throws std::runtime_error (naming
/// the file) when it is malformed, was made for another model (size differs), or its shape
/// differs from n_layer x n_expert.
std::optional<ExpertPopularity> read_popularity(const std::string& path, const std::string& model_path, int n_layer,
                                                int n_expert);

}  // namespace strata::engine
