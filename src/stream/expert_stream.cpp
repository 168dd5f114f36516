// ExpertStream: a fixed arena of expert slots fed from disk by IO threads.
//
//   compute thread (one)                                 IO threads (io_threads >= 1)
//   --------------------                                 ----------------------------
//   request(l, ids) --+-- resident / reading ---> pin (hit; streamed_ahead if read ahead)
//                     +-- queued read-ahead ----> pin, promote to urgent (miss)
//                     +-- absent --> victim slot, pin, ----+
//                                     (miss)               v
//                                                   +--------------+     next piece, urgent
//   prefetch(l+1, ids) -> victim slot (never pinned,| urgent  FIFO |---> first: read_at()
//                         never a pending read-ahead)| read-ahead Q |     into read_target,
//                         -----------------------> +--------------+     land(), last piece:
//                                                                        slot -> resident,
//   wait(l, e)  <---------- condvar "done" -------------------------------- notify_all
//   release(l, ev) unpin l's slots (-> LRU once ev is done); drop l's unstarted read-aheads
//
// The bookkeeping on the left and in the queues is stream::SlotTable (slot_table.h), a pure
// state machine; this file runs it under one mutex and adds the IO threads, the condition
// variables, the file and the slot geometry. The IO threads hold the mutex only to take a
// piece and to publish its result, never during a read, a land() or an event wait.
//
//   arena (a backend::ArenaMemory; the CPU's HostArena is one aligned buffer, paged in at
//   construction):
//   +-----------------+-----------------+-----+-----------------+
//   | slot 0          | slot 1          | ... | slot n-1        |   n = arena_bytes / slot_bytes
//   +-----------------+-----------------+-----+-----------------+
//   slot = [gate aligned range][up aligned range][down aligned range][unused tail]
//           ^ 4 KiB aligned     ^ 4 KiB aligned   ^ 4 KiB aligned
//   aligned range of a slice [off, off+len) = [floor4k(off), ceil4k(off+len)); the view
//   points at slot_data(slot) + part_start + (off - floor4k(off)). A part whose aligned range
//   starts inside (or right at the end of) the previous part's range joins that read: a packed
//   record (gate, up, down back to back) is one read of ceil4k(record) bytes:
//   slot = [gate|up|down aligned as one range][unused tail]
//
// A read is cut into pieces of at most kPiece bytes. IO thread i reads a piece to
// read_target(slot, i) + its offset in the slot, then land(slot, i, bytes, offset) makes it
// visible at slot_data(slot) + offset. A piece carrying the slot's last-use event
// (SlotTable::Piece::reuse_after) waits for it before its bytes can reach the slot: before the
// read for a host arena (read_target may be the slot), before land() for a device arena.
//
// The host RAM tier (StreamOptions::host_cache_bytes; docs/streaming.md, "Tiers"): entries of
// slot_bytes each, laid out as a slot, keyed by (layer, expert). When an IO thread takes the
// first piece of a read it plans the whole read (under the mutex, so no other piece of it can
// be taken first): a complete entry -> host hit (every piece: land_from(entry), no disk read);
// else an entry is taken (empty first, then least recently used among the entries no read is
// using) -> fill (every piece: read into the entry, then land_from(entry)); no free entry ->
// the plain path (read_target, land). The plan's entry is held until the read finishes; a
// failed fill empties it. An arena hit refreshes the entry's LRU time, so the tier keeps the
// most recently used experts of both tiers.
//
// Why urgent first: an urgent read is something the compute thread is blocked on (or soon
// will be) at the cut; a read-ahead only saves a later wait. Serving urgent reads first
// bounds the exposed wait of the current layer by its own misses.
#include "stream/expert_stream.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "backend/cpu/host_arena.h"
#include "io/file.h"
#include "stream/slot_table.h"

namespace strata::stream {

namespace {

constexpr uint64_t kAlign = io::kDirectAlign;
uint64_t floor_a(uint64_t x) { return x / kAlign * kAlign; }
uint64_t ceil_a(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// Largest piece (a multiple of the O_DIRECT alignment).
constexpr uint64_t kPiece = uint64_t{1} << 18;

// Where one expert's bytes lie in the file and in its slot: 1 to 3 aligned reads (parts
// whose aligned ranges touch or overlap share a read) and where each part's slice starts.
struct ExpertRanges {
  struct Read {
    uint64_t file_off;  // aligned start in the file
    uint64_t len;       // aligned length
    uint64_t slot_off;  // start within the slot (multiple of 4 KiB)
  };
  Read read[3];
  int n_reads = 0;
  uint64_t view_off[3];   // first byte of each part's slice within the slot
  uint64_t slice_off[3];  // absolute start of each slice in the file
  uint64_t slice_end[3];  // absolute end of each slice in the file
  uint64_t slot_end = 0;  // bytes of the slot in use

  explicit ExpertRanges(const LayerExperts& L, int32_t e) {
    uint64_t pos = 0;
    for (int p = 0; p < 3; ++p) {
      const uint64_t off = L.part[p].offset(e);
      const uint64_t end = off + L.part[p].expert_bytes;
      slice_off[p] = off;
      slice_end[p] = end;
      if (L.part[p].expert_bytes == 0) {
        view_off[p] = pos;
        continue;
      }
      const uint64_t a = floor_a(off), b = ceil_a(end);
      Read* cur = n_reads > 0 ? &read[n_reads - 1] : nullptr;
      if (cur && a >= cur->file_off && a <= cur->file_off + cur->len) {
        cur->len = std::max(cur->len, b - cur->file_off);  // touches the previous read: extend it
      } else {
        read[n_reads++] = Read{a, b - a, pos};
        cur = &read[n_reads - 1];
      }
      view_off[p] = cur->slot_off + (off - cur->file_off);
      pos = cur->slot_off + cur->len;
    }
    slot_end = pos;
  }

  static uint64_t pieces_in(uint64_t len) { return (len + kPiece - 1) / kPiece; }
  int n_pieces() const {
    uint64_t n = 0;
    for (int i = 0; i < n_reads; ++i) n += pieces_in(read[i].len);
    return static_cast<int>(n);
  }
  /// Piece `idx` (the reads' pieces in order) as a read: file offset, length, slot offset.
  Read piece(int idx) const {
    uint64_t k = static_cast<uint64_t>(idx);
    for (int i = 0; i < n_reads; ++i) {
      const uint64_t n = pieces_in(read[i].len);
      if (k < n) {
        const uint64_t o = k * kPiece;
        return Read{read[i].file_off + o, std::min(kPiece, read[i].len - o), read[i].slot_off + o};
      }
      k -= n;
    }
    throw std::logic_error("expert stream: piece index out of range");
  }
};

// Pageable 4 KiB-aligned host memory for the host tier (when no factory is given).
class PageableBuffer final : public backend::Buffer {
 public:
  explicit PageableBuffer(size_t bytes) : mem_(bytes) {}
  backend::BufferRole role() const override { return backend::BufferRole::Staging; }
  backend::Place place() const override { return backend::Place::Host; }
  void* data() override { return mem_.data(); }
  size_t bytes() const override { return mem_.size(); }

 private:
  io::AlignedBuffer mem_;
};

// The host RAM tier's bookkeeping (see the file comment). Guarded by the stream's mutex; the
// bytes of an entry are touched outside it only by the read that holds the entry (users > 0).
struct HostTier {
  std::unique_ptr<backend::Buffer> mem;
  size_t n = 0;                // entries
  size_t entry_bytes = 0;      // = slot bytes
  std::vector<int64_t> key;    // per entry: (layer, expert) key, -1 when empty
  std::vector<uint64_t> tick;  // per entry: LRU time (0: empty)
  std::vector<int> users;      // per entry: reads using it (filling it or copying out of it)
  std::vector<uint8_t> valid;  // per entry: every byte is there
  std::vector<int> entry_of;   // per key: entry, -1
  uint64_t clock = 0;

  uint8_t* data(int e) { return static_cast<uint8_t*>(mem->data()) + size_t(e) * entry_bytes; }
  int complete(int64_t k) const {
    const int e = entry_of[size_t(k)];
    return e >= 0 && valid[size_t(e)] ? e : -1;
  }
  void touch(int64_t k) {
    if (n == 0) return;
    if (const int e = complete(k); e >= 0) tick[size_t(e)] = ++clock;
  }
  // An entry for a fill of `k`: an empty one, else the least recently used one nobody uses; -1.
  int take(int64_t k, StreamStats& st) {
    int best = -1;
    for (size_t e = 0; e < n; ++e)
      if (users[e] == 0 && (best < 0 || tick[e] < tick[size_t(best)])) best = int(e);
    if (best < 0) return -1;
    const size_t b = size_t(best);
    if (key[b] >= 0) {
      entry_of[size_t(key[b])] = -1;
      ++st.host_evictions;
    }
    key[b] = k;
    entry_of[size_t(k)] = best;
    valid[b] = 0;
    users[b] = 1;
    tick[b] = ++clock;
    return best;
  }
  void drop(int e) {
    const size_t b = size_t(e);
    if (key[b] >= 0) entry_of[size_t(key[b])] = -1;
    key[b] = -1;
    valid[b] = 0;
    tick[b] = 0;
  }
};

// How one arena read is served (decided at its first piece).
struct ReadPlan {
  int entry = -1;    // host-tier entry, or -1: the plain path
  bool hit = false;  // true: copy out of the entry; false with entry >= 0: fill it
};

}  // namespace

struct ExpertStream::Impl {
  std::unique_ptr<io::File> file;
  std::vector<LayerExperts> layers;
  size_t slot_bytes = 0;
  size_t n_slots = 0;
  std::unique_ptr<backend::ArenaMemory> arena;
  bool event_before_read = true;  // host arena: read_target may be the slot itself

  mutable std::mutex mu;
  std::condition_variable work_cv;  // IO threads: a job was queued / stop / unpause
  std::condition_variable done_cv;  // compute thread: a read finished
  std::unique_ptr<SlotTable> table;
  bool stop = false;
  bool paused = false;
  bool fake = false;
  std::vector<std::thread> threads;
  HostTier host;
  std::vector<int64_t> layer_base;  // key of (layer, expert) = layer_base[layer] + expert
  std::vector<ReadPlan> plan;       // per arena slot: the plan of its read in flight
  uint64_t generation = 0;          // clear() count: resident_layer()'s views are new after it
  bool holds_all = false;           // a slot for every expert of the model: nothing is evicted
  std::vector<std::vector<ExpertView>> all_views;  // per layer: resident_layer()'s cache (empty: not yet)

  const LayerExperts& layer(int l) const { return layers[static_cast<size_t>(l)]; }
  int64_t key(int l, int32_t e) const { return layer_base[size_t(l)] + e; }

  // With mu held, at a read's first piece: how the read is served.
  void plan_read(const SlotTable::Piece& job) {
    ReadPlan& pl = plan[size_t(job.slot)];
    pl = ReadPlan{};
    if (host.n == 0) return;
    const int64_t k = key(job.layer, job.expert);
    if (const int e = host.complete(k); e >= 0) {
      ++host.users[size_t(e)];
      host.tick[size_t(e)] = ++host.clock;
      pl = ReadPlan{e, true};
      return;
    }
    if (host.entry_of[size_t(k)] >= 0) return;  // an incomplete entry (cannot happen: one read per key)
    pl.entry = host.take(k, table->stats());
  }

  // With mu held, after the read into `slot` finished: the tier counters, the entry's fate.
  void finish_read(int slot) {
    const ReadPlan pl = plan[size_t(slot)];
    plan[size_t(slot)] = ReadPlan{};
    const bool ok = table->state(slot) == SlotState::Resident;
    StreamStats& st = table->stats();
    if (pl.entry >= 0) {
      --host.users[size_t(pl.entry)];
      if (pl.hit) {
        if (ok) ++st.host_hits;
      } else if (ok) {
        host.valid[size_t(pl.entry)] = 1;
        ++st.host_fills;
        ++st.disk_reads;
      } else {
        host.drop(pl.entry);
      }
    } else if (ok) {
      ++st.disk_reads;
    }
  }

  // With mu held: wake whoever the table's last changes concern.
  void notify() {
    if (table->take_new_work()) work_cv.notify_all();
    if (table->take_finished()) done_cv.notify_all();
  }

  // ---- IO thread ----
  void io_main(int tid) {
    std::unique_lock lk(mu);
    for (;;) {
      SlotTable::Piece job;
      work_cv.wait(lk, [&] {
        if (stop) return true;
        const bool got = table->next_piece(!paused, job);
        if (table->take_finished()) done_cv.notify_all();  // a zero-byte expert finished at once
        return got;
      });
      if (stop) return;
      bool whole = false;  // this job lands the whole read (every range), not one piece
      if (job.index == 0) {
        plan_read(job);
        if (plan[size_t(job.slot)].hit && arena->lands_whole()) {
          table->merge_pieces(job.slot);
          whole = true;
        }
      }
      const ReadPlan pl = plan[static_cast<size_t>(job.slot)];
      lk.unlock();

      std::exception_ptr err;
      uint64_t bytes = 0, copied = 0, hit_bytes = 0;
      double busy = 0, copy_busy = 0;
      try {
        const LayerExperts& L = layer(job.layer);
        const ExpertRanges r(L, job.expert);
        for (int p = 0; p < 3; ++p)
          if (L.part[p].expert_bytes > 0 && r.slice_end[p] > file->size())
            throw io::IoError(
                fmt::format("{}: layer {} expert {} part {}: slice [{}, {}) runs past the end of the file "
                            "({} bytes)",
                            file->path(), job.layer, job.expert, p, r.slice_off[p], r.slice_end[p], file->size()));
        // Buffered reads may not run past EOF; direct reads may (up to the aligned EOF).
        auto clamp = [&](const ExpertRanges::Read& rd) {
          if (file->direct()) return rd.len;
          return rd.file_off >= file->size() ? uint64_t{0} : std::min<uint64_t>(rd.len, file->size() - rd.file_off);
        };
        const size_t slot = static_cast<size_t>(job.slot);
        const ExpertRanges::Read pc = whole ? ExpertRanges::Read{} : r.piece(job.index);
        const uint64_t n = whole ? 0 : clamp(pc);
        if (whole) {
          // A host-tier hit landed whole: each of the expert's 1-3 aligned ranges out of the
          // entry, the bytes the pieces would have landed.
          backend::ArenaMemory::HostRange rs[3];
          size_t nr = 0;
          uint64_t total = 0;
          for (int i = 0; i < r.n_reads; ++i) {
            const uint64_t len = clamp(r.read[i]);
            if (len == 0) continue;
            rs[nr++] = {host.data(pl.entry) + r.read[i].slot_off, size_t(len), size_t(r.read[i].slot_off)};
            total += len;
          }
          if (job.reuse_after) job.reuse_after->wait();
          if (nr > 0) {
            const auto t1 = Clock::now();
            arena->land_ranges(slot, tid, std::span<const backend::ArenaMemory::HostRange>(rs, nr));
            copy_busy += seconds_since(t1);
            copied += total;
            hit_bytes += total;
          }
        } else if (pl.entry >= 0) {
          // Host tier: a hit copies out of the entry; a fill reads into the entry (not the
          // slot, so the last-use event is waited for only before the copy), then copies.
          uint8_t* ent = host.data(pl.entry) + pc.slot_off;
          if (n > 0 && !pl.hit) {
            const auto t0 = Clock::now();
            try {
              file->read_at(pc.file_off, static_cast<size_t>(n), ent);
            } catch (...) {
              busy += seconds_since(t0);
              throw;
            }
            busy += seconds_since(t0);
            bytes += n;
          }
          if (job.reuse_after) job.reuse_after->wait();
          if (n > 0) {
            const auto t1 = Clock::now();
            arena->land_from(slot, tid, ent, static_cast<size_t>(n), static_cast<size_t>(pc.slot_off));
            copy_busy += seconds_since(t1);
            copied += n;
            if (pl.hit) hit_bytes += n;
          }
        } else {
          if (job.reuse_after && event_before_read) job.reuse_after->wait();
          if (n > 0) {
            uint8_t* dst = arena->read_target(slot, tid);
            const auto t0 = Clock::now();
            try {
              file->read_at(pc.file_off, static_cast<size_t>(n), dst + pc.slot_off);
            } catch (...) {
              busy += seconds_since(t0);
              throw;
            }
            busy += seconds_since(t0);
            bytes += n;
            if (job.reuse_after && !event_before_read) job.reuse_after->wait();
            const auto t1 = Clock::now();
            arena->land(slot, tid, static_cast<size_t>(n), static_cast<size_t>(pc.slot_off));
            if (!event_before_read) {  // a device arena: land() copied host-to-device
              copy_busy += seconds_since(t1);
              copied += n;
            }
          }
        }
      } catch (...) {
        err = std::current_exception();
      }

      lk.lock();
      StreamStats& st = table->stats();
      st.read_busy_s += busy;
      st.bytes_read += bytes;
      st.h2d_bytes += copied;
      st.h2d_busy_s += copy_busy;
      st.host_hit_bytes += hit_bytes;
      if (table->piece_done(job.slot, err)) finish_read(job.slot);
      notify();
    }
  }
};

ExpertStream::ExpertStream(const std::string& path, std::vector<LayerExperts> layers, const StreamOptions& opts)
    : ExpertStream(path, std::move(layers), opts, [](size_t n_slots, size_t slot_bytes, int io_threads) {
        return std::make_unique<cpu::HostArena>(n_slots, slot_bytes, io_threads);
      }) {}

ExpertStream::ExpertStream(const std::string& path, std::vector<LayerExperts> layers, const StreamOptions& opts,
                           backend::Backend& backend)
    : ExpertStream(
          path, std::move(layers), opts,
          [&backend](size_t n_slots, size_t slot_bytes, int io_threads) {
            return backend.make_arena(n_slots, slot_bytes, io_threads);
          },
          [&backend](size_t bytes) { return backend.alloc(backend::BufferRole::Staging, bytes); }) {}

ExpertStream::ExpertStream(const std::string& path, std::vector<LayerExperts> layers, const StreamOptions& opts,
                           ArenaFactory make_arena, HostTierFactory make_host)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.layers = std::move(layers);
  int64_t total = 0;
  std::vector<int> experts_per_layer;
  experts_per_layer.reserve(m.layers.size());
  for (const LayerExperts& L : m.layers) {
    if (L.n_expert < 0) throw std::invalid_argument("expert stream: negative n_expert");
    m.layer_base.push_back(total);
    experts_per_layer.push_back(L.n_expert);
    total += L.n_expert;
  }
  m.slot_bytes = slot_bytes_for(m.layers);
  m.fake = opts.fake;

  m.file = io::File::open(path, opts.direct);

  const size_t min_slots = std::max<size_t>(1, opts.min_slots);
  size_t n = opts.arena_bytes / m.slot_bytes;
  if (n < min_slots) {
    const size_t min_bytes = min_slots * m.slot_bytes;
    const double MiB = 1024.0 * 1024.0;
    const size_t min_mb = static_cast<size_t>((min_bytes + (1u << 20) - 1) >> 20);
    throw ArenaTooSmall(fmt::format("arena of {:.1f} MiB holds {} expert slots of {:.1f} KiB; one layer can need {} at "
                                    "once: use --arena-mb {} or more",
                                    static_cast<double>(opts.arena_bytes) / MiB, n,
                                    static_cast<double>(m.slot_bytes) / 1024.0, min_slots, min_mb),
                        min_bytes);
  }
  // More slots than experts can never be used: don't allocate them.
  n = std::min(n, static_cast<size_t>(std::max<int64_t>(total, static_cast<int64_t>(min_slots))));
  m.n_slots = n;
  m.holds_all = int64_t(n) >= total;
  m.all_views.assign(m.layers.size(), {});
  const int threads = std::max(1, opts.io_threads);

  if (!make_arena) throw std::invalid_argument("expert stream: no arena factory");
  m.arena = make_arena(n, m.slot_bytes, threads);
  if (!m.arena || m.arena->n_slots() < n || m.arena->slot_bytes() < m.slot_bytes)
    throw std::invalid_argument(
        fmt::format("expert stream: the backend's arena has {} slots of {} bytes, {} of {} "
                    "were asked for",
                    m.arena ? m.arena->n_slots() : 0, m.arena ? m.arena->slot_bytes() : 0, n, m.slot_bytes));
  m.event_before_read = m.arena->place() == backend::Place::Host;
  m.plan.assign(n, ReadPlan{});

  // The host tier: whole slots, at most one per expert.
  const size_t host_n =
      opts.fake ? 0 : std::min<size_t>(opts.host_cache_bytes / m.slot_bytes, static_cast<size_t>(total));
  if (host_n > 0) {
    HostTier& h = m.host;
    const size_t bytes = host_n * m.slot_bytes;
    try {
      h.mem = make_host ? make_host(bytes) : std::make_unique<PageableBuffer>(bytes);
    } catch (const std::bad_alloc&) {
      throw std::runtime_error(
          fmt::format("expert stream: cannot allocate the host tier of {:.1f} MiB ({} slots of "
                      "{:.1f} KiB); use a smaller --host-cache-mb",
                      double(bytes) / (1024.0 * 1024.0), host_n, double(m.slot_bytes) / 1024.0));
    }
    if (!h.mem || h.mem->bytes() < bytes || h.mem->place() != backend::Place::Host ||
        reinterpret_cast<uintptr_t>(h.mem->data()) % kAlign != 0)
      throw std::invalid_argument(
          fmt::format("expert stream: the host tier needs {} bytes of 4 KiB-aligned host memory", bytes));
    h.n = host_n;
    h.entry_bytes = m.slot_bytes;
    h.key.assign(host_n, -1);
    h.tick.assign(host_n, 0);
    h.users.assign(host_n, 0);
    h.valid.assign(host_n, 0);
    h.entry_of.assign(static_cast<size_t>(total), -1);
  }

  Impl* impl = &m;
  m.table = std::make_unique<SlotTable>(
      std::move(experts_per_layer), n,
      [impl](int layer, int32_t e) { return ExpertRanges(impl->layer(layer), e).n_pieces(); }, opts.fake);

  m.threads.reserve(static_cast<size_t>(threads));
  try {
    for (int i = 0; i < threads; ++i) m.threads.emplace_back([&m, i] { m.io_main(i); });
  } catch (...) {
    {
      std::lock_guard lk(m.mu);
      m.stop = true;
    }
    m.work_cv.notify_all();
    for (auto& t : m.threads) t.join();
    throw;
  }
}

ExpertStream::~ExpertStream() {
  {
    std::lock_guard lk(impl_->mu);
    impl_->stop = true;
  }
  impl_->work_cv.notify_all();
  for (auto& t : impl_->threads) t.join();
}

size_t ExpertStream::slot_bytes_for(const std::vector<LayerExperts>& layers) {
  // The largest expert record (its aligned reads back to back) over all layers.
  uint64_t slot = kAlign;
  for (const LayerExperts& L : layers)
    for (int32_t e = 0; e < L.n_expert; ++e) slot = std::max(slot, ExpertRanges(L, e).slot_end);
  return static_cast<size_t>(slot);
}

size_t ExpertStream::slot_bytes() const { return impl_->slot_bytes; }
size_t ExpertStream::host_slots() const { return impl_->host.n; }
bool ExpertStream::host_pinned() const { return impl_->host.mem && impl_->host.mem->pinned(); }

bool ExpertStream::in_host_tier(int layer, int32_t expert) const {
  std::lock_guard lk(impl_->mu);
  const Impl& m = *impl_;
  if (m.host.n == 0) return false;
  if (layer < 0 || size_t(layer) >= m.layers.size() || expert < 0 || expert >= m.layer(layer).n_expert)
    throw std::out_of_range(fmt::format("expert stream: no layer {} expert {}", layer, expert));
  return m.host.complete(m.key(layer, expert)) >= 0;
}
size_t ExpertStream::n_slots() const { return impl_->n_slots; }
bool ExpertStream::direct() const { return impl_->file->direct(); }

void ExpertStream::request(int layer, std::span<const int32_t> experts) {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  for (const int32_t e : experts) {
    SlotTable::Outcome o;
    while ((o = m.table->request(layer, e)) == SlotTable::Outcome::Blocked) {
      // Every unpinned slot is being read: wait for a read to finish (exposed wait, the
      // compute thread is blocked), then try again.
      m.notify();
      const auto t0 = Clock::now();
      m.done_cv.wait(lk);
      m.table->stats().exposed_wait_s += seconds_since(t0);
    }
    if (o == SlotTable::Outcome::Hit) m.host.touch(m.key(layer, e));  // a use in either tier counts for LRU
  }
  m.notify();
}

ExpertView ExpertStream::wait(int layer, int32_t expert) {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  SlotTable& t = *m.table;
  const int s = t.slot_of(layer, expert);
  if (s < 0 || t.pins(s) == 0)
    throw std::logic_error(
        fmt::format("expert stream: wait for layer {} expert {} which is not requested", layer, expert));
  // pinned: cannot be evicted while we wait
  auto in_flight = [&] { return t.state(s) == SlotState::Queued || t.state(s) == SlotState::Reading; };
  if (in_flight()) {
    const auto t0 = Clock::now();
    m.done_cv.wait(lk, [&] { return !in_flight(); });
    t.stats().exposed_wait_s += seconds_since(t0);
  }
  if (t.state(s) == SlotState::Failed) std::rethrow_exception(t.error(s));
  const ExpertRanges r(m.layer(layer), expert);
  const uint8_t* base = m.arena->slot_data(static_cast<size_t>(s));
  ExpertView v;
  for (int p = 0; p < 3; ++p) v.part[p] = base + r.view_off[p];
  return v;
}

void ExpertStream::release(int layer, backend::EventPtr last_use) {
  std::lock_guard lk(impl_->mu);
  impl_->table->release(layer, std::move(last_use));
}

void ExpertStream::prefetch(int layer, std::span<const int32_t> experts) {
  Impl& m = *impl_;
  if (m.fake) return;
  std::lock_guard lk(m.mu);
  m.table->prefetch(layer, experts);
  m.notify();
}

void ExpertStream::cancel_prefetch() {
  std::lock_guard lk(impl_->mu);
  impl_->table->cancel_prefetch();
}

bool ExpertStream::resident(int layer, int32_t expert) const {
  std::lock_guard lk(impl_->mu);
  return impl_->table->resident(layer, expert);
}

const std::vector<ExpertView>* ExpertStream::resident_layer(int layer) {
  Impl& m = *impl_;
  if (!m.holds_all || layer < 0 || size_t(layer) >= m.layers.size()) return nullptr;
  std::vector<ExpertView>& v = m.all_views[size_t(layer)];
  if (!v.empty()) return &v;
  const LayerExperts& L = m.layer(layer);
  if (L.n_expert <= 0) return &v;  // no experts: nothing to wait for (an empty table)
  std::lock_guard lk(m.mu);
  SlotTable& t = *m.table;
  std::vector<ExpertView> out(size_t(L.n_expert));
  for (int32_t e = 0; e < L.n_expert; ++e) {
    const int s = t.slot_of(layer, e);
    if (s < 0 || t.state(s) != SlotState::Resident) return nullptr;
    const ExpertRanges r(L, e);
    const uint8_t* base = m.arena->slot_data(static_cast<size_t>(s));
    for (int p = 0; p < 3; ++p) out[size_t(e)].part[p] = base + r.view_off[p];
  }
  v = std::move(out);
  return &v;
}

size_t ExpertStream::fill_all() {
  Impl& m = *impl_;
  if (!m.holds_all || m.fake) return 0;
  size_t queued = 0;
  std::vector<int32_t> todo;
  std::lock_guard lk(m.mu);
  for (int l = 0; l < int(m.layers.size()); ++l) {
    todo.clear();
    for (int32_t e = 0; e < m.layers[size_t(l)].n_expert; ++e)
      if (m.table->slot_of(l, e) < 0) todo.push_back(e);
    m.table->prefetch(l, todo);
    queued += todo.size();
  }
  m.notify();
  return queued;
}

uint64_t ExpertStream::generation() const { return impl_->generation; }

void ExpertStream::count_resident_use(int layer, std::span<const int32_t> experts) {
  std::lock_guard lk(impl_->mu);
  for (const int32_t e : experts)
    if (!impl_->table->count_hit(layer, e))
      throw std::logic_error(
          fmt::format("expert stream: layer {} expert {} was used from the device but is not resident", layer, e));
}

void ExpertStream::wait_idle() {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  m.done_cv.wait(lk, [&] {
    if (m.table->reading() > 0) return false;
    return m.paused || !m.table->has_open_jobs();
  });
}

void ExpertStream::pause_io(bool paused) {
  {
    std::lock_guard lk(impl_->mu);
    impl_->paused = paused;
  }
  impl_->work_cv.notify_all();
  impl_->done_cv.notify_all();
}

StreamStats ExpertStream::stats() const {
  std::lock_guard lk(impl_->mu);
  return impl_->table->stats();
}

void ExpertStream::reset_stats() {
  std::lock_guard lk(impl_->mu);
  impl_->table->stats() = StreamStats{};
}

void ExpertStream::clear() {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  // unstarted reads are forgotten; started ones finish (their remaining pieces stay queued)
  m.table->drop_unstarted();
  m.done_cv.wait(lk, [&] { return m.table->reading() == 0; });
  m.table->reset();
  for (size_t e = 0; e < m.host.n; ++e) m.host.drop(int(e));
  for (auto& v : m.all_views) v.clear();
  ++m.generation;
}

}  // namespace strata::stream
