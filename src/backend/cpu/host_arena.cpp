#include "backend/cpu/host_arena.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

#include "io/file.h"

namespace strata::cpu {

namespace {
constexpr size_t kAlign = 4096;
}

HostArena::HostArena(size_t n_slots, size_t slot_bytes, int io_threads) : n_slots_(n_slots), slot_bytes_(slot_bytes) {
  if (slot_bytes == 0 || slot_bytes % kAlign != 0)
    throw std::invalid_argument(
        fmt::format("host arena: slot size {} bytes is not a positive multiple of 4 KiB", slot_bytes));
  if (n_slots > std::numeric_limits<size_t>::max() / slot_bytes)
    throw std::invalid_argument(fmt::format("host arena: {} slots of {} bytes overflow", n_slots, slot_bytes));
  const size_t bytes = n_slots * slot_bytes;
  if (bytes == 0) return;
  data_ = static_cast<uint8_t*>(io::alloc_streamed(bytes));  // huge pages where THP allows
  if (!data_)
    throw std::runtime_error(fmt::format("host arena: cannot allocate {} slots x {:.1f} KiB = {:.1f} MiB", n_slots,
                                         static_cast<double>(slot_bytes) / 1024.0,
                                         static_cast<double>(bytes) / (1024.0 * 1024.0)));
  // Page the arena in now, so first-use page faults are not charged to IO.
  std::memset(data_, 0, bytes);
}

HostArena::~HostArena() { std::free(data_); }

}  // namespace strata::cpu
