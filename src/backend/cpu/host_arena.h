#pragma once
// HostArena: the CPU backend's expert arena, one 4 KiB-aligned host allocation of n_slots
// slots. IO threads read straight into the slot (read_target is the slot itself) and land()
// has nothing to do.
#include <cstddef>
#include <cstdint>

#include "backend/backend.h"

namespace strata::cpu {

/// The arena in host memory: slot s is bytes [s * slot_bytes, (s + 1) * slot_bytes) of one
/// aligned allocation, zeroed (and so paged in) at construction so first-use page faults are
/// not charged to IO. Thread-safe: its methods only compute addresses.
class HostArena final : public backend::ArenaMemory {
 public:
  /// `n_slots` slots of `slot_bytes` bytes (a multiple of 4 KiB, > 0). `io_threads` is not
  /// needed (every thread reads into the slot). Throws std::invalid_argument for a slot size
  /// that is not a positive multiple of 4 KiB or a size that overflows, and std::runtime_error
  /// naming the sizes when the memory cannot be allocated.
  HostArena(size_t n_slots, size_t slot_bytes, int io_threads = 1);
  ~HostArena() override;
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  size_t n_slots() const override { return n_slots_; }
  size_t slot_bytes() const override { return slot_bytes_; }
  /// The slot itself (precondition: slot < n_slots()).
  uint8_t* read_target(size_t slot, int io_thread) override { return data_ + slot * slot_bytes_; }
  /// Nothing to do: the bytes were read into the slot.
  void land(size_t slot, int io_thread, size_t bytes, size_t offset = 0) override {}
  const uint8_t* slot_data(size_t slot) const override { return data_ + slot * slot_bytes_; }
  backend::Place place() const override { return backend::Place::Host; }

 private:
  size_t n_slots_ = 0;
  size_t slot_bytes_ = 0;
  uint8_t* data_ = nullptr;
};

}  // namespace strata::cpu
