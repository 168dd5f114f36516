#pragma once
// Positional reads of a file, optionally uncached (O_DIRECT). Every call carries an
// explicit offset, so one File may be shared by many IO threads.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

namespace strata::io {

/// Alignment O_DIRECT needs for offsets, lengths and buffers on Linux block devices (bytes).
constexpr size_t kDirectAlign = 4096;

/// Thrown when a file cannot be opened or a read fails or comes back short. what() names the file.
class IoError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A read-only file. Thread-safe: read_at may be called concurrently from any thread.
class File {
 public:
  /// Opens `path`. With want_direct, tries O_DIRECT first; if the filesystem refuses it
  /// (EINVAL, e.g. tmpfs) opens buffered instead and prints one warning to stderr.
  /// Throws IoError if the file cannot be opened.
  static std::unique_ptr<File> open(const std::string& path, bool want_direct);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  /// True if reads bypass the page cache.
  bool direct() const { return direct_; }

  /// Reads exactly n bytes at `offset` into dst. When direct(), offset, n and dst must be
  /// multiples of kDirectAlign (precondition); reads that end past EOF are allowed in direct
  /// mode only up to the aligned end of the file (the tail is zero-filled).
  /// Throws IoError on error or short read.
  void read_at(uint64_t offset, size_t n, void* dst) const;

 private:
  File() = default;
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  bool direct_ = false;
};

/// x86-64's transparent huge page: 2 MiB.
constexpr size_t kHugePage = size_t(2) << 20;

/// `bytes` of memory for large streamed arrays (weights, the expert arena), freed with
/// std::free: aligned to kDirectAlign, and from kHugePage bytes on aligned to kHugePage with
/// madvise(2) MADV_HUGEPAGE, so that the kernel backs it with transparent huge pages where THP
/// is "madvise" (Debian's default) or "always". A mat-vec streams a weight matrix once per token:
/// on 4 KiB pages each page is a TLB miss and a stop of the hardware prefetcher, which does not
/// cross a page (Intel 64 and IA-32 Optimization Reference Manual, "Hardware prefetching").
/// A refused madvise (THP "never") leaves 4 KiB pages. nullptr when the allocation fails.
void* alloc_streamed(size_t bytes);

/// Memory of alloc_streamed, freed with the object. Size in bytes.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& o) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint8_t* data() { return p_; }
  const uint8_t* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  uint8_t* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace strata::io
