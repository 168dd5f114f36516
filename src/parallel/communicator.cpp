#include "parallel/communicator.h"

#include <fmt/format.h>

#include <chrono>
#include <stdexcept>

namespace strata::parallel {

using backend::Tensor;

InProcessCommunicator::InProcessCommunicator(backend::Backend& be, int world_size) : be_(be), world_(world_size) {
  if (world_size < 1)
    throw std::invalid_argument(fmt::format("a communicator needs a world size of at least 1, got {}", world_size));
  stats_.sent_bytes.assign(size_t(world_size), 0);
}

void InProcessCommunicator::check(std::span<const Tensor> src, std::span<const Tensor> dst, int64_t rows) const {
  if (int(src.size()) != world_)
    throw std::invalid_argument(fmt::format("collective: {} source tensors for a world of {}", src.size(), world_));
  if (dst.empty() || (dst.size() != 1 && int(dst.size()) != world_))
    throw std::invalid_argument(
        fmt::format("collective: {} destination tensors for a world of {} (1 or {})", dst.size(), world_, world_));
  auto same = [&](const Tensor& t) {
    return t.type == GgmlType::F32 && t.cols() == src[0].cols() && t.rows() == src[0].rows();
  };
  for (const Tensor& t : src)
    if (!same(t)) throw std::invalid_argument("collective: source tensors differ in type or shape");
  for (const Tensor& t : dst)
    if (!same(t)) throw std::invalid_argument("collective: destination shape differs from the sources");
  if (rows >= 0 && src[0].rows() != rows)
    throw std::invalid_argument(fmt::format("collective: {} owners for {} rows", rows, src[0].rows()));
}

void InProcessCommunicator::all_gather_rows(std::span<const Tensor> src, std::span<const int32_t> owner,
                                            std::span<const Tensor> dst) {
  const auto t0 = std::chrono::steady_clock::now();
  check(src, dst, int64_t(owner.size()));
  const int64_t n = int64_t(owner.size());
  const size_t row = size_t(src[0].cols()) * sizeof(float);
  for (int64_t i = 0; i < n; ++i)
    if (owner[size_t(i)] < 0 || owner[size_t(i)] >= world_)
      throw std::invalid_argument(
          fmt::format("all_gather_rows: row {} has owner {} outside the world of {}", i, owner[size_t(i)], world_));
  // Runs of rows with one owner are one copy each (rows are contiguous when the stride is the row).
  for (int64_t i = 0; i < n;) {
    const int32_t r = owner[size_t(i)];
    int64_t j = i + 1;
    while (j < n && owner[size_t(j)] == r) ++j;
    stats_.sent_bytes[size_t(r)] += uint64_t(j - i) * row * uint64_t(world_ - 1);
    for (const Tensor& d : dst) {
      if (d.data == src[size_t(r)].data) continue;  // a rank's own copy
      const bool packed = d.row_bytes() == row && src[size_t(r)].row_bytes() == row;
      if (packed) {
        be_.copy(d.rows_view(i, j - i), src[size_t(r)].rows_view(i, j - i), size_t(j - i) * row);
      } else {
        for (int64_t k = i; k < j; ++k) be_.copy(d.rows_view(k, 1), src[size_t(r)].rows_view(k, 1), row);
      }
    }
    i = j;
  }
  ++stats_.calls;
  stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void InProcessCommunicator::all_reduce_sum(std::span<const Tensor> src, std::span<const Tensor> dst) {
  const auto t0 = std::chrono::steady_clock::now();
  check(src, dst, -1);
  const size_t bytes = size_t(src[0].numel()) * sizeof(float);
  for (const Tensor& d : dst) {
    be_.copy(d, src[0], bytes);
    for (int r = 1; r < world_; ++r) be_.add(d, src[size_t(r)]);
  }
  for (int r = 0; r < world_; ++r) stats_.sent_bytes[size_t(r)] += bytes * uint64_t(world_ - 1);
  ++stats_.calls;
  stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace strata::parallel
