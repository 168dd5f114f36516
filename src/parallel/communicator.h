#pragma once
// Communicator: the collectives expert parallelism needs between ranks (docs/expert-parallel.md,
// "Dispatch and combine"). One process drives every rank, so each call takes the buffers of all
// ranks at once (as NCCL's single-process form does: one communicator per device, the calls of
// all devices between ncclGroupStart and ncclGroupEnd).
//
// InProcessCommunicator is the implementation for ranks that share one backend's memory (the
// simulated ranks of the CPU backend, and a world of 1 on any backend): the collectives are
// backend copies and adds. An NCCL implementation (one device per rank) is the GPU machine's.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace strata::parallel {

/// What the collectives moved: per rank, the bytes it would send to the other ranks (what an
/// interconnect carries; in-process copies of shared memory count the same), calls and time.
struct CommStats {
  std::vector<uint64_t> sent_bytes;  ///< [rank]: bytes rank r sends to other ranks
  uint64_t calls = 0;                ///< collectives issued
  double seconds = 0;                ///< host wall time inside the collectives
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int world_size() const = 0;
  virtual std::string name() const = 0;

  /// All-gather of rows by owner. `src[r]`: rank r's fp32 rows ne {cols, rows}, of which it
  /// wrote only the rows it owns; `owner[i]` (rows entries, each in [0, world_size)): the rank
  /// that wrote row i. After the call, row i of every destination is row i of src[owner[i]],
  /// bit for bit. `dst`: every rank's copy of the replicated result (world_size tensors), or one
  /// tensor when the ranks share memory (InProcessCommunicator). All tensors: same cols and rows.
  /// Throws std::invalid_argument for mismatched shapes or counts, or an owner out of range.
  virtual void all_gather_rows(std::span<const backend::Tensor> src, std::span<const int32_t> owner,
                               std::span<const backend::Tensor> dst) = 0;
  /// All-reduce sum in rank order: every dst = ((src[0] + src[1]) + src[2]) + ... elementwise,
  /// fp32. Only what a reduce-scatter/all-reduce combine would compute; the engine's combine
  /// does not use it (its rounding depends on the world size: see docs/expert-parallel.md).
  /// Throws std::invalid_argument as all_gather_rows does.
  virtual void all_reduce_sum(std::span<const backend::Tensor> src, std::span<const backend::Tensor> dst) = 0;

  virtual const CommStats& stats() const = 0;
};

/// The collectives as copies and adds on one backend whose memory every rank shares.
class InProcessCommunicator : public Communicator {
 public:
  /// `world_size` ranks on `be` (which must outlive this). Throws std::invalid_argument for a
  /// world size below 1.
  InProcessCommunicator(backend::Backend& be, int world_size);
  int world_size() const override { return world_; }
  std::string name() const override { return "in-process"; }
  void all_gather_rows(std::span<const backend::Tensor> src, std::span<const int32_t> owner,
                       std::span<const backend::Tensor> dst) override;
  void all_reduce_sum(std::span<const backend::Tensor> src, std::span<const backend::Tensor> dst) override;
  const CommStats& stats() const override { return stats_; }

 private:
  void check(std::span<const backend::Tensor> src, std::span<const backend::Tensor> dst, int64_t rows) const;

  backend::Backend& be_;
  int world_;
  CommStats stats_;
};

}  // namespace strata::parallel
