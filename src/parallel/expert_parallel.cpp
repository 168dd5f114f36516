#include "parallel/expert_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

namespace strata::parallel {

using backend::Tensor;

std::vector<LayerShape> layer_shapes(const std::vector<stream::LayerExperts>& layers) {
  const uint64_t slot = stream::ExpertStream::slot_bytes_for(layers);
  std::vector<LayerShape> out;
  for (const auto& L : layers) out.push_back({L.n_expert, slot});
  return out;
}

ExpertParallel::ExpertParallel(const std::string& path, const std::vector<stream::LayerExperts>& layers,
                               Placement placement, const stream::StreamOptions& total, backend::Backend& be,
                               CombineOrder combine)
    : placement_(std::move(placement)), be_(be), combine_(combine) {
  const int N = placement_.n_ranks();
  if (placement_.n_layers() != int(layers.size()))
    throw std::invalid_argument(
        fmt::format("expert placement has {} layers, the model {}", placement_.n_layers(), layers.size()));
  for (size_t l = 0; l < layers.size(); ++l) {
    size_t n = 0;
    for (int r = 0; r < N; ++r) n += placement_.owned(r, int(l)).size();
    if (n != size_t(layers[l].n_expert))
      throw std::invalid_argument(
          fmt::format("expert placement of layer {} covers {} experts, the model has {}", l, n, layers[l].n_expert));
  }
  // Each rank's share; the worst case of a rank is the experts of one layer it owns.
  const size_t slot = stream::ExpertStream::slot_bytes_for(layers);
  const size_t share = total.arena_bytes / size_t(N);
  size_t need_total = 0;
  for (int r = 0; r < N; ++r) {
    const size_t need =
        std::max<size_t>(1, std::min<size_t>(total.min_slots, size_t(placement_.max_owned_per_layer(r))));
    need_total = std::max(need_total, need * slot * size_t(N));
  }
  if (!total.fake && share / slot * slot * size_t(N) < need_total) {
    const double MiB = 1024.0 * 1024.0;
    throw stream::ArenaTooSmall(
        fmt::format("arena of {:.1f} MiB split over {} expert-parallel ranks gives each {} expert slots of {:.1f} KiB; "
                    "one layer can need {} at once on one rank: use --arena-mb {} or more",
                    double(total.arena_bytes) / MiB, N, share / slot, double(slot) / 1024.0,
                    need_total / slot / size_t(N), (need_total + (size_t(1) << 20) - 1) >> 20),
        need_total);
  }
  comm_ = std::make_unique<InProcessCommunicator>(be, N);
  for (int r = 0; r < N; ++r) {
    stream::StreamOptions o = total;
    o.arena_bytes = share;
    o.host_cache_bytes = total.host_cache_bytes / size_t(N);
    o.io_threads = std::max(1, total.io_threads / N);
    o.min_slots = std::max<size_t>(1, std::min<size_t>(total.min_slots, size_t(placement_.max_owned_per_layer(r))));
    streams_.push_back(std::make_unique<stream::ExpertStream>(path, layers, o, be));
  }
  rows_.resize(size_t(N));
  partial_.resize(size_t(N));
}

ExpertParallel::~ExpertParallel() = default;

std::vector<std::vector<int32_t>> ExpertParallel::split(int layer, std::span<const int32_t> experts) const {
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(n_ranks()));
  for (int32_t e : experts) out[size_t(owner(layer, e))].push_back(e);
  return out;
}

void ExpertParallel::prefetch(int layer, std::span<const int32_t> experts) {
  const auto per_rank = split(layer, experts);
  for (int r = 0; r < n_ranks(); ++r)
    if (!per_rank[size_t(r)].empty()) stream(r).prefetch(layer, per_rank[size_t(r)]);
}

bool ExpertParallel::resident(int layer, int32_t expert) const {
  return stream(owner(layer, expert)).resident(layer, expert);
}

Tensor ExpertParallel::rank_rows(int rank, const Tensor& gathered) {
  if (n_ranks() == 1 && combine_ == CombineOrder::PerToken) return gathered;
  const size_t bytes = size_t(gathered.numel()) * sizeof(float);
  auto& buf = rows_.at(size_t(rank));
  if (!buf || buf->bytes() < bytes) buf = be_.alloc(backend::BufferRole::Activations, bytes);
  const Tensor t = buf->f32(gathered.cols(), gathered.rows());
  if (combine_ == CombineOrder::RankPartialSums) {
    // Rows of other ranks' experts enter this rank's partial sum with weight 0: they must be finite.
    const std::vector<float> zeros(size_t(gathered.numel()), 0.0f);
    be_.upload(t, zeros.data(), bytes);
  }
  return t;
}

Tensor ExpertParallel::rank_view(int rank, const Tensor& gathered) const {
  const auto& buf = rows_.at(size_t(rank));
  if (!buf || buf->bytes() < size_t(gathered.numel()) * sizeof(float))
    throw std::logic_error(fmt::format("combine: rank {} has no expert-output rows for this layer", rank));
  return buf->f32(gathered.cols(), gathered.rows());
}

void ExpertParallel::combine(int layer, const backend::Routing& routing, const Tensor& gathered, const Tensor& out) {
  const int N = n_ranks();
  const int64_t rows = int64_t(routing.ids.size());
  if (gathered.rows() != rows || out.rows() != routing.n_tokens() || gathered.cols() != out.cols())
    throw std::invalid_argument(fmt::format("combine: {} (token, k) rows and {} output rows for {} tokens of top-{}",
                                            gathered.rows(), out.rows(), routing.n_tokens(), routing.top_k));
  std::vector<int32_t> owner_of(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) owner_of[size_t(i)] = owner(layer, routing.ids[size_t(i)]);
  std::vector<Tensor> src;
  for (int r = 0; r < N; ++r)
    src.push_back(N == 1 && combine_ == CombineOrder::PerToken ? gathered : rank_view(r, gathered));
  if (combine_ == CombineOrder::PerToken) {
    const Tensor dst[1] = {gathered};
    comm_->all_gather_rows(src, owner_of, dst);
    be_.moe_combine(routing, gathered, out);
    return;
  }
  // RankPartialSums: each rank's top-k-order sum of its own rows, then a sum in rank order.
  std::vector<Tensor> parts;
  const size_t pbytes = size_t(out.numel()) * sizeof(float);
  for (int r = 0; r < N; ++r) {
    backend::Routing mine = routing;
    for (int64_t i = 0; i < rows; ++i)
      if (owner_of[size_t(i)] != r) mine.weights[size_t(i)] = 0.0f;
    auto& buf = partial_[size_t(r)];
    if (!buf || buf->bytes() < pbytes) buf = be_.alloc(backend::BufferRole::Activations, pbytes);
    parts.push_back(buf->f32(out.cols(), out.rows()));
    be_.moe_combine(mine, src[size_t(r)], parts.back());
  }
  const Tensor dst[1] = {out};
  comm_->all_reduce_sum(parts, dst);
}

stream::StreamStats ExpertParallel::stats() const {
  stream::StreamStats s;
  for (const auto& st : streams_) stream::for_each_counter(s, st->stats(), [](auto& x, const auto& y) { x += y; });
  return s;
}

uint64_t ExpertParallel::arena_bytes() const {
  uint64_t b = 0;
  for (const auto& s : streams_) b += uint64_t(s->n_slots()) * s->slot_bytes();
  return b;
}

uint64_t ExpertParallel::host_cache_bytes() const {
  uint64_t b = 0;
  for (const auto& s : streams_) b += uint64_t(s->host_slots()) * s->slot_bytes();
  return b;
}

size_t ExpertParallel::n_slots() const {
  size_t n = 0;
  for (const auto& s : streams_) n += s->n_slots();
  return n;
}

void ExpertParallel::cancel_prefetch() {
  for (auto& s : streams_) s->cancel_prefetch();
}
void ExpertParallel::wait_idle() {
  for (auto& s : streams_) s->wait_idle();
}
void ExpertParallel::clear() {
  for (auto& s : streams_) s->clear();
}

}  // namespace strata::parallel
