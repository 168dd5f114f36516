#pragma once
// Sequential writing of a large output file (a synthetic GGUF, a pack sidecar) that never
// leaves a half-written file under its final name and does not fill the page cache:
//
//   create(path)  -> writes go to path + ".tmp"
//   write(...)    -> sequential. Direct mode (the default): bytes are staged in 4 KiB-aligned
//                    chunks that IO threads write with O_DIRECT while the caller produces the
//                    next ones (several writes in flight keep the drive busy; no page cache).
//                    Buffered mode (O_DIRECT refused, e.g. by tmpfs): plain writes with
//                    drop-behind: every kWindow bytes writeback of the newest window starts and
//                    the one before it is waited for and dropped from the page cache.
//   sync()        -> everything written is on the device (the tmp file may be verified now)
//   commit()      -> sync, close, drop the file's pages from the page cache, rename
//                    path.tmp -> path
//   destructor    -> without commit(): waits for writes in flight, removes path.tmp
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace strata::io {

struct WriteFileOptions {
  bool direct = true;                    ///< O_DIRECT writes (buffered with drop-behind if refused)
  size_t chunk_bytes = size_t(8) << 20;  ///< bytes per direct write (multiple of 4 KiB)
  int queue_depth = 4;                   ///< direct writes in flight at once (IO threads)
  /// Buffered mode: drop written ranges from the page cache as writing proceeds, and the whole
  /// file at commit(). Off: an ordinary buffered write (small files that will be read soon).
  bool drop_behind = true;
};

class WriteFile {
 public:
  /// Buffered mode: bytes between drop-behind points.
  static constexpr uint64_t kWindow = uint64_t(64) << 20;

  /// Creates (truncates) `path + ".tmp"`. Throws IoError naming the file.
  static std::unique_ptr<WriteFile> create(const std::string& path, const WriteFileOptions& opts = {});
  ~WriteFile();
  WriteFile(const WriteFile&) = delete;
  WriteFile& operator=(const WriteFile&) = delete;

  const std::string& path() const { return path_; }          ///< final name
  const std::string& tmp_path() const { return tmp_path_; }  ///< where the bytes go until commit()
  uint64_t size() const { return written_; }                 ///< bytes written so far
  bool direct() const;                                       ///< writes bypass the page cache

  /// Appends n bytes. Throws IoError (disk full, I/O error) naming the file; errors of
  /// asynchronous writes surface at the next call.
  void write(const void* p, size_t n);
  /// Appends n zero bytes.
  void write_zeros(uint64_t n);
  /// Writes out everything appended so far and flushes it to the device (fdatasync). After
  /// sync() only commit() may follow. Throws IoError.
  void sync();
  /// sync(), close, drop the file's pages from the page cache, and rename the tmp file to
  /// path(). Throws IoError; the tmp file is removed on failure.
  void commit();

 private:
  struct Impl;
  explicit WriteFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::string path_, tmp_path_;
  uint64_t written_ = 0;
};

/// fdatasync + posix_fadvise(POSIX_FADV_DONTNEED) over a whole existing file, so that a freshly
/// written file does not flatter later reads. Best effort: returns false on failure.
bool drop_file_cache(const std::string& path);

/// Throws IoError unless a file can be created in the folder of `path` (checked by creating and
/// removing an empty uniquely named file there), so that a long job fails before it starts,
/// not when it writes its result. `what` names the option in the message ("--kl-divergence-base").
/// The message says why (read-only file system, permission denied, no such folder).
void check_writable(const std::string& path, const std::string& what);

}  // namespace strata::io
