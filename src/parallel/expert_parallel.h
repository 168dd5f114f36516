#pragma once
// ExpertParallel: the routed experts of a model partitioned over ranks (docs/expert-parallel.md).
//
//   every rank (replicated)          rank r (its experts only)                 every rank
//   -----------------------          -------------------------                 ----------
//   attention, router, top-k  ->  split the layer's experts by owner  ->  stream(r).request (the cut)
//                                 read-ahead: prediction split by owner ->  stream(r).prefetch
//                                 expert_ffn for its experts into its rows  (token, k) of rank_rows(r)
//   all_gather_rows: row (t, k) from the rank owning expert ids[t][k]  ->  moe_combine in top-k order
//
// Each rank has its own ExpertStream: its share of the arena (arena / ranks), of the host
// tier (host cache / ranks) and of the IO threads (io_threads / ranks, at least 1), and reads
// ahead only experts it owns. The combine gathers every (token, k) output row unchanged and
// sums each token's rows in top-k order on every rank, exactly as one rank does, so the
// logits do not depend on the number of ranks.
//
// In one process on the CPU backend the ranks are simulated: they share the backend (the dense
// compute runs once, its result is what every rank would hold) and run one after another on the
// compute thread, each with its own stream, arena, IO threads and expert-output rows.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "parallel/communicator.h"
#include "parallel/placement.h"
#include "stream/expert_stream.h"

namespace strata::parallel {

/// How expert outputs are summed per token.
enum class CombineOrder {
  /// Gather every (token, k) row, then sum each token's rows in top-k order: bit-identical to
  /// one rank whatever the number of ranks. The engine's.
  PerToken,
  /// Each rank sums the (token, k) rows it owns in top-k order, then the ranks' partial sums are
  /// added in rank order (what a reduce-scatter/all-reduce combine computes). Its rounding
  /// depends on the ranks: kept only so tests can show the bit-identity check catches it.
  RankPartialSums,
};

class ExpertParallel {
 public:
  /// Opens one ExpertStream per rank over `path` (each sees every layer; it is asked only for
  /// the experts `placement` gives its rank) with arena memory from `be`. `total`: the options
  /// of the whole (arena_bytes, host_cache_bytes and io_threads are split over the ranks; each
  /// rank's min_slots is total.min_slots capped at the most experts of a layer it owns).
  /// `be` must outlive this. Throws stream::ArenaTooSmall naming the smallest total --arena-mb
  /// when a rank's share cannot hold its worst-case layer, std::invalid_argument when placement
  /// and layers disagree, and whatever ExpertStream throws.
  ExpertParallel(const std::string& path, const std::vector<stream::LayerExperts>& layers, Placement placement,
                 const stream::StreamOptions& total, backend::Backend& be,
                 CombineOrder combine = CombineOrder::PerToken);
  ~ExpertParallel();

  int n_ranks() const { return placement_.n_ranks(); }
  const Placement& placement() const { return placement_; }
  int owner(int layer, int32_t expert) const { return placement_.owner(layer, expert); }
  stream::ExpertStream& stream(int rank) { return *streams_.at(size_t(rank)); }
  const stream::ExpertStream& stream(int rank) const { return *streams_.at(size_t(rank)); }
  const Communicator& communicator() const { return *comm_; }

  /// `experts` of `layer` split by owning rank, each rank's list in the given order.
  std::vector<std::vector<int32_t>> split(int layer, std::span<const int32_t> experts) const;
  /// Read-ahead: each rank queues the experts it owns, in the given order (most wanted first).
  void prefetch(int layer, std::span<const int32_t> experts);
  /// True if `expert` of `layer` is resident in its owner's arena.
  bool resident(int layer, int32_t expert) const;

  /// Rank `rank`'s expert-output rows for this layer, shaped as `gathered` (fp32 ne {n_embd,
  /// T * top_k}, the (token, k) rows): `gathered` itself for a world of 1, else the rank's own
  /// buffer (grown on demand; zeroed first under CombineOrder::RankPartialSums). Valid until the
  /// next call for the same rank.
  backend::Tensor rank_rows(int rank, const backend::Tensor& gathered);
  /// The combine of `layer` (rank_rows must have been called for every rank since the last
  /// combine, and each rank's expert kernels must have written its rows): out[t] = sum over k in top-k order of
  /// routing.weights[t][k] * (row t * top_k + k of the rank owning routing.ids[t][k]), via `gathered` (the (token, k)
  /// rows on every rank after the all-gather). Throws std::invalid_argument for shapes that
  /// disagree with the routing.
  void combine(int layer, const backend::Routing& routing, const backend::Tensor& gathered, const backend::Tensor& out);

  /// Counters summed over the ranks, and of one rank.
  stream::StreamStats stats() const;
  stream::StreamStats rank_stats(int rank) const { return stream(rank).stats(); }
  /// Arena and host-tier bytes and slots summed over the ranks.
  uint64_t arena_bytes() const;
  uint64_t host_cache_bytes() const;
  size_t n_slots() const;
  /// Every rank's cancel_prefetch / wait_idle / clear.
  void cancel_prefetch();
  void wait_idle();
  void clear();

 private:
  /// The rows rank_rows(rank, ...) last returned, as they are now. Throws std::logic_error when
  /// rank_rows was not called for this rank and shape.
  backend::Tensor rank_view(int rank, const backend::Tensor& gathered) const;

  Placement placement_;
  backend::Backend& be_;
  CombineOrder combine_;
  std::unique_ptr<Communicator> comm_;
  std::vector<std::unique_ptr<stream::ExpertStream>> streams_;
  std::vector<std::unique_ptr<backend::Buffer>> rows_;     // [rank]: expert-output rows
  std::vector<std::unique_ptr<backend::Buffer>> partial_;  // [rank]: RankPartialSums only
};

/// The LayerShape of each layer of `layers` for placement: its expert count and slot bytes.
std::vector<LayerShape> layer_shapes(const std::vector<stream::LayerExperts>& layers);

}  // namespace strata::parallel
