#pragma once
// Expert placement for expert parallelism (docs/expert-parallel.md): which rank (GPU, or a
// simulated rank on the CPU backend) owns each routed expert of each layer. Dense weights are
// replicated on every rank; a routed expert lives in exactly one rank's arena, host-tier share
// and read queue, so its bytes cross one host link and are read by one rank's IO threads.
#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

namespace strata::parallel {

/// One layer as placement sees it: how many routed experts, and the bytes of one expert (its
/// arena slot: the aligned gate+up+down record). A layer without routed experts has n_expert 0.
struct LayerShape {
  int n_expert = 0;
  uint64_t expert_bytes = 0;
};

/// Thrown for a placement that cannot be made: no ranks, more ranks than a layer has experts,
/// popularity counts of the wrong shape. The message names the numbers.
class PlacementError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Expert id -> rank, for every layer. Immutable once built; every expert of every layer is
/// owned by exactly one rank, and every rank owns floor(n_expert / n_ranks) or one more experts
/// of each layer (so each rank's arena share holds the same bytes to within one expert a layer).
class Placement {
 public:
  /// The static partition by expert id: each layer's experts in contiguous id ranges, rank 0
  /// the lowest ids (as DeepSeek-V3's EP and vLLM lay them out). When n_ranks does not divide a
  /// layer's count, the extra experts go to the ranks holding the fewest bytes so far (ties:
  /// lower rank), which balances bytes across layers. Throws PlacementError for n_ranks < 1 or
  /// n_ranks greater than a layer's n_expert (a rank would own none of that layer).
  static Placement by_id(std::span<const LayerShape> layers, int n_ranks);
  /// Placement by popularity (`counts[layer][expert]`: picks from `strata profile`, the static
  /// rank): per layer, experts from the most picked down (ties: lower id) each go to the rank
  /// with the fewest picks so far in that layer among the ranks below their share of the layer
  /// (the shares as by_id gives them; ties: fewer bytes in all, then lower rank), so each rank
  /// serves about 1/n_ranks of the layer's picks and holds the same bytes as by_id. Deterministic.
  /// A layer whose counts are all 0 is placed by id. Throws PlacementError as by_id does and when
  /// counts is not n_layer rows of n_expert entries.
  static Placement by_popularity(std::span<const LayerShape> layers, int n_ranks,
                                 const std::vector<std::vector<uint64_t>>& counts);

  int n_ranks() const { return n_ranks_; }
  int n_layers() const { return int(owner_.size()); }
  /// The rank owning `expert` of `layer`. Precondition: both in range (checked: std::out_of_range).
  int owner(int layer, int32_t expert) const;
  /// The experts of `layer` rank `rank` owns, ascending ids.
  std::span<const int32_t> owned(int rank, int layer) const;
  /// The most experts of any one layer that `rank` owns (its arena share's worst case per layer).
  int max_owned_per_layer(int rank) const;
  /// Bytes of all the experts `rank` owns (LayerShape::expert_bytes summed).
  uint64_t rank_bytes(int rank) const;
  /// "id" or "popularity".
  const char* kind() const { return by_popularity_ ? "popularity" : "id"; }

 private:
  Placement(std::span<const LayerShape> layers, int n_ranks);
  void finish();  // fills owned_ and bytes_ from owner_

  int n_ranks_ = 0;
  bool by_popularity_ = false;
  std::vector<LayerShape> layers_;
  std::vector<std::vector<int32_t>> owner_;               // [layer][expert] -> rank
  std::vector<std::vector<std::vector<int32_t>>> owned_;  // [rank][layer] -> ascending ids
  std::vector<uint64_t> bytes_;                           // [rank]
};

/// Each rank's share of layer `layer`'s picks in `counts` (the load it would serve there):
/// out[r] = sum over the experts of `layer` owned by r of counts[layer][expert]. For benchmarks
/// and tests of the balance. Throws std::out_of_range for a layer or expert outside counts.
std::vector<uint64_t> rank_picks(const Placement& p, const std::vector<std::vector<uint64_t>>& counts, int layer);

}  // namespace strata::parallel
