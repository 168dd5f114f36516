// io::File and io::AlignedBuffer: positional reads with optional O_DIRECT.
//
// O_DIRECT fallback. Some filesystems refuse O_DIRECT at open (tmpfs: EINVAL); others
// accept the flag at open and fail the first read with EINVAL. open() handles both: after
// a successful O_DIRECT open it issues one aligned probe read at offset 0, and on EINVAL
// from either the open or the probe it reopens the file buffered and prints one warning.
// So direct() is settled once open() returns and never changes afterwards.
#include "io/file.h"
#include "io/file_testing.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

namespace strata::io {

namespace {

std::atomic<bool> g_simulate_direct_read_einval{false};

std::string errno_text(int err) { return std::strerror(err); }

uint64_t align_up(uint64_t x) { return (x + kDirectAlign - 1) / kDirectAlign * kDirectAlign; }

int open_fd(const std::string& path, bool direct) {
  int flags = O_RDONLY | O_CLOEXEC;
  if (direct) flags |= O_DIRECT;
  int fd;
  do {
    fd = ::open(path.c_str(), flags);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

void warn_buffered(const std::string& path) {
  std::fprintf(stderr, "strata: warning: %s: O_DIRECT refused by the filesystem, using buffered reads\n", path.c_str());
}

// True if an aligned read at offset 0 fails with EINVAL (O_DIRECT accepted at open, refused
// at read time). Other errors are left for the real reads to report.
bool direct_read_refused(int fd) {
  if (g_simulate_direct_read_einval.load()) return true;
  void* p = nullptr;
  if (posix_memalign(&p, kDirectAlign, kDirectAlign) != 0) throw std::bad_alloc();
  ssize_t r;
  do {
    r = ::pread(fd, p, kDirectAlign, 0);
  } while (r < 0 && errno == EINTR);
  const bool refused = r < 0 && errno == EINVAL;
  std::free(p);
  return refused;
}

}  // namespace

void testing::simulate_direct_read_einval(bool on) { g_simulate_direct_read_einval.store(on); }

std::unique_ptr<File> File::open(const std::string& path, bool want_direct) {
  std::unique_ptr<File> f(new File());
  f->path_ = path;
  bool direct = want_direct;
  int fd = open_fd(path, direct);
  if (fd < 0 && direct && errno == EINVAL) {
    warn_buffered(path);
    direct = false;
    fd = open_fd(path, false);
  }
  if (fd < 0) throw IoError("cannot open " + path + ": " + errno_text(errno));
  if (direct && direct_read_refused(fd)) {
    ::close(fd);
    warn_buffered(path);
    direct = false;
    fd = open_fd(path, false);
    if (fd < 0) throw IoError("cannot open " + path + ": " + errno_text(errno));
  }
  f->fd_ = fd;  // owned by f from here on (closed by ~File)
  f->direct_ = direct;
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw IoError("cannot stat " + path + ": " + errno_text(errno));
  if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) throw IoError("not a regular file: " + path);
  f->size_ = static_cast<uint64_t>(st.st_size);
  return f;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

void File::read_at(uint64_t offset, size_t n, void* dst) const {
  auto where = [&] {
    return path_ + " (offset " + std::to_string(offset) + ", length " + std::to_string(n) + ", file size " +
           std::to_string(size_) + ")";
  };
  if (direct_ &&
      (offset % kDirectAlign != 0 || n % kDirectAlign != 0 || reinterpret_cast<uintptr_t>(dst) % kDirectAlign != 0))
    throw IoError("unaligned O_DIRECT read of " + where());
  auto* out = static_cast<uint8_t*>(dst);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd_, out + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw IoError("read failed: " + where() + ": " + errno_text(errno));
    }
    done += static_cast<size_t>(r);
    if (done == n) return;
    if (r == 0 || offset + done >= size_) {
      // End of file. Direct mode: a read whose aligned range ends within the aligned end of
      // the file is fine once it has covered everything up to EOF; zero-fill the tail.
      if (direct_ && offset + done >= size_ && offset + n <= align_up(size_)) {
        std::memset(out + done, 0, n - done);
        return;
      }
      throw IoError("short read (" + std::to_string(done) + " of " + std::to_string(n) + " bytes) from " + where());
    }
  }
}

void* alloc_streamed(size_t bytes) {
  const bool huge = bytes >= kHugePage;
  void* p = nullptr;
  if (posix_memalign(&p, huge ? kHugePage : kDirectAlign, bytes) != 0) return nullptr;
  if (huge) (void)madvise(p, bytes / kHugePage * kHugePage, MADV_HUGEPAGE);  // a hint: refusal is fine
  return p;
}

AlignedBuffer::AlignedBuffer(size_t bytes) : n_(bytes) {
  if (bytes == 0) return;
  p_ = static_cast<uint8_t*>(alloc_streamed(bytes));
  if (!p_) throw std::bad_alloc();
}

AlignedBuffer::~AlignedBuffer() { std::free(p_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& o) noexcept
    : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    std::free(p_);
    p_ = std::exchange(o.p_, nullptr);
    n_ = std::exchange(o.n_, 0);
  }
  return *this;
}

}  // namespace strata::io
