// io::WriteFile: sequential writes to path.tmp (O_DIRECT from IO threads, or buffered with
// drop-behind), then rename. See write_file.h.
#include "io/write_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "io/file.h"

namespace strata::io {

namespace {
std::string errno_text(int err) { return std::strerror(err); }

int open_out(const std::string& path, bool direct) {
  int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  if (direct) flags |= O_DIRECT;
  int fd;
  do {
    fd = ::open(path.c_str(), flags, 0644);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// Writes all of [p, p + n) at `off`; returns 0 or an errno.
int pwrite_all(int fd, const uint8_t* p, size_t n, uint64_t off) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pwrite(fd, p + done, n - done, off_t(off + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) return EIO;
    done += size_t(r);
  }
  return 0;
}
}  // namespace

struct WriteFile::Impl {
  std::string tmp;
  int fd = -1;
  bool direct = false;
  bool drop_behind = true;
  bool committed = false;
  bool finished = false;  // sync() ran: no more writes
  uint64_t pos = 0;       // bytes appended (logical size)

  // Buffered mode: drop-behind marks.
  uint64_t started = 0, dropped = 0;

  // Direct mode: staging chunks written by IO threads.
  size_t chunk = 0;
  std::vector<AlignedBuffer> bufs;
  std::vector<int> free_bufs;
  struct Job {
    int buf;
    uint64_t off;
    size_t len;
  };
  std::deque<Job> jobs;
  int in_flight = 0;  // queued or being written
  bool stop = false;
  std::string err;  // first asynchronous error
  std::mutex mu;
  std::condition_variable work_cv, done_cv;
  std::vector<std::thread> threads;
  int cur = -1;  // staging buffer being filled
  size_t cur_fill = 0;

  void io_main() {
    std::unique_lock lk(mu);
    for (;;) {
      work_cv.wait(lk, [&] { return stop || !jobs.empty(); });
      if (jobs.empty()) return;  // stop, and nothing left to write
      const Job j = jobs.front();
      jobs.pop_front();
      lk.unlock();
      const int e = pwrite_all(fd, bufs[size_t(j.buf)].data(), j.len, j.off);
      lk.lock();
      if (e != 0 && err.empty())
        err = "write failed: " + tmp + " (at byte " + std::to_string(j.off) + "): " + errno_text(e);
      free_bufs.push_back(j.buf);
      --in_flight;
      done_cv.notify_all();
    }
  }

  void throw_if_failed() {
    std::lock_guard lk(mu);
    if (!err.empty()) throw IoError(err);
  }

  void submit(int buf, uint64_t off, size_t len) {
    {
      std::lock_guard lk(mu);
      jobs.push_back(Job{buf, off, len});
      ++in_flight;
    }
    work_cv.notify_one();
  }

  int acquire() {
    std::unique_lock lk(mu);
    done_cv.wait(lk, [&] { return !free_bufs.empty() || !err.empty(); });
    if (!err.empty()) throw IoError(err);
    const int b = free_bufs.back();
    free_bufs.pop_back();
    return b;
  }

  void wait_all() {
    std::unique_lock lk(mu);
    done_cv.wait(lk, [&] { return in_flight == 0; });
  }

  void stop_threads() {
    {
      std::lock_guard lk(mu);
      stop = true;
    }
    work_cv.notify_all();
    for (auto& t : threads) t.join();
    threads.clear();
  }

  void write_direct(const uint8_t* p, size_t n) {
    throw_if_failed();
    while (n > 0) {
      if (cur < 0) {
        cur = acquire();
        cur_fill = 0;
      }
      const size_t k = std::min(n, chunk - cur_fill);
      std::memcpy(bufs[size_t(cur)].data() + cur_fill, p, k);
      cur_fill += k;
      pos += k;
      p += k;
      n -= k;
      if (cur_fill == chunk) {
        submit(cur, pos - chunk, chunk);
        cur = -1;
      }
    }
  }

  void write_buffered(const uint8_t* p, size_t n) {
    const int e = pwrite_all(fd, p, n, pos);
    if (e != 0) throw IoError("write failed: " + tmp + " (at byte " + std::to_string(pos) + "): " + errno_text(e));
    pos += n;
    if (drop_behind && pos - started >= kWindow) drop_behind_step();
  }

  // Start writeback of [started, pos); wait for the window before it and drop it from the
  // page cache: the drive has about one window queued and at most two are cached.
  void drop_behind_step() {
    const uint64_t begin = started, end = pos;
    ::sync_file_range(fd, off_t(begin), off_t(end - begin), SYNC_FILE_RANGE_WRITE);
    started = end;
    if (begin > dropped) {
      // Errors surface again at fdatasync; this is pacing and cache hygiene only.
      ::sync_file_range(fd, off_t(dropped), off_t(begin - dropped),
                        SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
      ::posix_fadvise(fd, off_t(dropped), off_t(begin - dropped), POSIX_FADV_DONTNEED);
      dropped = begin;
    }
  }

  // Writes out the partial staging chunk (padded to 4 KiB, then truncated back), waits for
  // all writes, and flushes the file to the device.
  void finish() {
    if (finished) return;
    if (direct) {
      if (cur >= 0 && cur_fill > 0) {
        const size_t padded = (cur_fill + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
        std::memset(bufs[size_t(cur)].data() + cur_fill, 0, padded - cur_fill);
        submit(cur, pos - cur_fill, padded);
        cur = -1;
      }
      wait_all();
      throw_if_failed();
      if (::ftruncate(fd, off_t(pos)) != 0) throw IoError("cannot truncate " + tmp + ": " + errno_text(errno));
    }
    if (::fdatasync(fd) != 0) throw IoError("cannot flush " + tmp + ": " + errno_text(errno));
    finished = true;
  }
};

WriteFile::WriteFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<WriteFile> WriteFile::create(const std::string& path, const WriteFileOptions& opts) {
  auto m = std::make_unique<Impl>();
  m->tmp = path + ".tmp";
  bool direct = opts.direct;
  int fd = open_out(m->tmp, direct);
  if (fd < 0 && direct && errno == EINVAL) {
    direct = false;
    fd = open_out(m->tmp, false);
  }
  if (fd < 0) throw IoError("cannot create " + m->tmp + ": " + errno_text(errno));
  m->fd = fd;
  if (direct) {
    // Some filesystems accept O_DIRECT at open and refuse the writes: probe one block.
    AlignedBuffer probe(kDirectAlign);
    std::memset(probe.data(), 0, kDirectAlign);
    const int e = pwrite_all(fd, probe.data(), kDirectAlign, 0);
    if (e == EINVAL) {
      ::close(fd);
      direct = false;
      m->fd = fd = open_out(m->tmp, false);
      if (fd < 0) throw IoError("cannot create " + m->tmp + ": " + errno_text(errno));
    } else if (e != 0) {
      const std::string tmp = m->tmp;
      ::close(fd);
      m->fd = -1;
      ::unlink(tmp.c_str());
      throw IoError("cannot write " + tmp + ": " + errno_text(e));
    } else if (::ftruncate(fd, 0) != 0) {
      throw IoError("cannot truncate " + m->tmp + ": " + errno_text(errno));
    }
  }
  m->direct = direct;
  m->drop_behind = opts.drop_behind;
  if (direct) {
    m->chunk = std::max<size_t>(kDirectAlign, opts.chunk_bytes / kDirectAlign * kDirectAlign);
    const int depth = std::max(1, opts.queue_depth);
    // One chunk per writer in flight plus one being filled.
    for (int i = 0; i <= depth; ++i) {
      m->bufs.emplace_back(m->chunk);
      m->free_bufs.push_back(i);
    }
    Impl* raw = m.get();
    for (int i = 0; i < depth; ++i) m->threads.emplace_back([raw] { raw->io_main(); });
  }
  std::unique_ptr<WriteFile> f(new WriteFile(std::move(m)));
  f->path_ = path;
  f->tmp_path_ = path + ".tmp";
  return f;
}

WriteFile::~WriteFile() {
  Impl& m = *impl_;
  m.stop_threads();
  if (m.fd >= 0) ::close(m.fd);
  if (!m.committed) ::unlink(m.tmp.c_str());
}

bool WriteFile::direct() const { return impl_->direct; }

void WriteFile::write(const void* p, size_t n) {
  Impl& m = *impl_;
  if (m.fd < 0 || m.finished) throw IoError(m.tmp + ": write after sync/commit");
  if (m.direct)
    m.write_direct(static_cast<const uint8_t*>(p), n);
  else
    m.write_buffered(static_cast<const uint8_t*>(p), n);
  written_ = m.pos;
}

void WriteFile::write_zeros(uint64_t n) {
  static const uint8_t zeros[4096] = {};
  while (n > 0) {
    const size_t k = static_cast<size_t>(std::min<uint64_t>(n, sizeof zeros));
    write(zeros, k);
    n -= k;
  }
}

void WriteFile::sync() {
  if (impl_->fd < 0) return;
  impl_->finish();
}

void WriteFile::commit() {
  Impl& m = *impl_;
  m.finish();
  m.stop_threads();
  if (m.direct || m.drop_behind) ::posix_fadvise(m.fd, 0, 0, POSIX_FADV_DONTNEED);
  const int fd = m.fd;
  m.fd = -1;
  if (::close(fd) != 0) throw IoError("cannot close " + m.tmp + ": " + errno_text(errno));
  if (std::rename(m.tmp.c_str(), path_.c_str()) != 0)
    throw IoError("cannot rename " + m.tmp + " to " + path_ + ": " + errno_text(errno));
  m.committed = true;
}

bool drop_file_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  bool ok = ::fdatasync(fd) == 0;
  ok = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0 && ok;
  ::close(fd);
  return ok;
}

void check_writable(const std::string& path, const std::string& what) {
  std::string dir = path;
  const size_t slash = dir.find_last_of('/');
  dir = slash == std::string::npos ? std::string(".") : slash == 0 ? std::string("/") : dir.substr(0, slash);
  const std::string probe = dir + "/.strata-write-check-" + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int e = errno;
    throw IoError(what + " '" + path + "': cannot create a file in '" + dir + "': " + std::strerror(e));
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

}  // namespace strata::io
