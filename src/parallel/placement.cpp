#include "parallel/placement.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

namespace strata::parallel {

namespace {

// Each rank's share of a layer of n experts: n / N, and one more for the n % N ranks holding
// the fewest bytes so far (ties: lower rank).
std::vector<int> layer_shares(int n, int n_ranks, const std::vector<uint64_t>& bytes) {
  std::vector<int> share(size_t(n_ranks), n / n_ranks);
  std::vector<int> order(static_cast<size_t>(n_ranks));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return bytes[size_t(a)] < bytes[size_t(b)]; });
  for (int i = 0; i < n % n_ranks; ++i) ++share[size_t(order[size_t(i)])];
  return share;
}

}  // namespace

Placement::Placement(std::span<const LayerShape> layers, int n_ranks) : n_ranks_(n_ranks) {
  if (n_ranks < 1) throw PlacementError(fmt::format("expert parallelism needs at least 1 rank, got {}", n_ranks));
  layers_.assign(layers.begin(), layers.end());
  for (size_t l = 0; l < layers_.size(); ++l) {
    const int n = layers_[l].n_expert;
    if (n < 0) throw PlacementError(fmt::format("layer {} has a negative expert count {}", l, n));
    if (n > 0 && n < n_ranks)
      throw PlacementError(fmt::format("{} expert-parallel ranks but layer {} has only {} experts (at most {} ranks)",
                                       n_ranks, l, n, n));
  }
  owner_.resize(layers_.size());
  bytes_.assign(size_t(n_ranks), 0);
}

void Placement::finish() {
  owned_.assign(size_t(n_ranks_), std::vector<std::vector<int32_t>>(layers_.size()));
  bytes_.assign(size_t(n_ranks_), 0);
  for (size_t l = 0; l < layers_.size(); ++l)
    for (int32_t e = 0; e < int32_t(owner_[l].size()); ++e) {
      const int r = owner_[l][size_t(e)];
      owned_[size_t(r)][l].push_back(e);
      bytes_[size_t(r)] += layers_[l].expert_bytes;
    }
}

Placement Placement::by_id(std::span<const LayerShape> layers, int n_ranks) {
  Placement p(layers, n_ranks);
  for (size_t l = 0; l < p.layers_.size(); ++l) {
    const int n = p.layers_[l].n_expert;
    p.owner_[l].resize(size_t(n));
    if (n == 0) continue;
    const std::vector<int> share = layer_shares(n, n_ranks, p.bytes_);
    int32_t e = 0;
    for (int r = 0; r < n_ranks; ++r)
      for (int i = 0; i < share[size_t(r)]; ++i) p.owner_[l][size_t(e++)] = r;
    for (int r = 0; r < n_ranks; ++r) p.bytes_[size_t(r)] += uint64_t(share[size_t(r)]) * p.layers_[l].expert_bytes;
  }
  p.finish();
  return p;
}

Placement Placement::by_popularity(std::span<const LayerShape> layers, int n_ranks,
                                   const std::vector<std::vector<uint64_t>>& counts) {
  Placement p(layers, n_ranks);
  p.by_popularity_ = true;
  if (counts.size() != p.layers_.size())
    throw PlacementError(fmt::format("expert popularity has {} layers, the model {}", counts.size(), p.layers_.size()));
  for (size_t l = 0; l < p.layers_.size(); ++l) {
    const int n = p.layers_[l].n_expert;
    if (n > 0 && counts[l].size() != size_t(n))
      throw PlacementError(
          fmt::format("expert popularity of layer {} has {} experts, the model {}", l, counts[l].size(), n));
  }
  for (size_t l = 0; l < p.layers_.size(); ++l) {
    const int n = p.layers_[l].n_expert;
    p.owner_[l].resize(size_t(n));
    if (n == 0) continue;
    const std::vector<int> share = layer_shares(n, n_ranks, p.bytes_);
    const std::vector<uint64_t>& c = counts[l];
    const bool any = std::any_of(c.begin(), c.end(), [](uint64_t v) { return v > 0; });
    if (!any) {  // nothing profiled for this layer: by id
      int32_t e = 0;
      for (int r = 0; r < n_ranks; ++r)
        for (int i = 0; i < share[size_t(r)]; ++i) p.owner_[l][size_t(e++)] = r;
    } else {
      // Greedy by decreasing popularity (LPT scheduling, Graham 1969) under the shares.
      std::vector<int32_t> ids(static_cast<size_t>(n));
      std::iota(ids.begin(), ids.end(), 0);
      std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return c[size_t(a)] > c[size_t(b)]; });
      std::vector<uint64_t> load(size_t(n_ranks), 0);
      std::vector<int> taken(size_t(n_ranks), 0);
      for (int32_t e : ids) {
        int best = -1;
        for (int r = 0; r < n_ranks; ++r) {
          if (taken[size_t(r)] >= share[size_t(r)]) continue;
          if (best < 0 || load[size_t(r)] < load[size_t(best)] ||
              (load[size_t(r)] == load[size_t(best)] && p.bytes_[size_t(r)] < p.bytes_[size_t(best)]))
            best = r;
        }
        p.owner_[l][size_t(e)] = best;
        load[size_t(best)] += c[size_t(e)];
        ++taken[size_t(best)];
      }
    }
    for (int r = 0; r < n_ranks; ++r) p.bytes_[size_t(r)] += uint64_t(share[size_t(r)]) * p.layers_[l].expert_bytes;
  }
  p.finish();
  return p;
}

int Placement::owner(int layer, int32_t expert) const {
  const auto& row = owner_.at(size_t(layer));
  return row.at(size_t(expert));
}

std::span<const int32_t> Placement::owned(int rank, int layer) const {
  return owned_.at(size_t(rank)).at(size_t(layer));
}

int Placement::max_owned_per_layer(int rank) const {
  size_t m = 0;
  for (const auto& ids : owned_.at(size_t(rank))) m = std::max(m, ids.size());
  return int(m);
}

uint64_t Placement::rank_bytes(int rank) const { return bytes_.at(size_t(rank)); }

std::vector<uint64_t> rank_picks(const Placement& p, const std::vector<std::vector<uint64_t>>& counts, int layer) {
  std::vector<uint64_t> out(size_t(p.n_ranks()), 0);
  for (int r = 0; r < p.n_ranks(); ++r)
    for (int32_t e : p.owned(r, layer)) out[size_t(r)] += counts.at(size_t(layer)).at(size_t(e));
  return out;
}

}  // namespace strata::parallel
