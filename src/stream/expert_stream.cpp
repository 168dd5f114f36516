// ExpertStream: a fixed arena of expert slots fed from disk by IO threads.
//
//   compute thread (one)                                 IO threads (io_threads >= 1)
//   --------------------                                 ----------------------------
//   request(l, ids) --+-- resident / reading ---> pin (hit; streamed_ahead if read ahead)
//                     +-- queued read-ahead ----> pin, promote to urgent (miss)
//                     +-- absent --> victim slot, pin, ----+
//                                     (miss)               v
//                                                   +--------------+     pop urgent first,
//   prefetch(l+1, ids) -> victim slot (never pinned,| urgent  FIFO |---> then read-ahead:
//                         never a pending read-ahead)| read-ahead Q |     read_at() each part
//                         -----------------------> +--------------+     into the slot,
//                                                                        slot -> resident,
//   wait(l, e)  <---------- condvar "done" -------------------------------- notify_all
//   release(l)   unpin l's slots (-> LRU); drop l's unstarted read-aheads
//
//   arena (one AlignedBuffer, paged in at construction):
//   +-----------------+-----------------+-----+-----------------+
//   | slot 0          | slot 1          | ... | slot n-1        |   n = arena_bytes / slot_bytes
//   +-----------------+-----------------+-----+-----------------+
//   slot = [gate aligned range][up aligned range][down aligned range][unused tail]
//           ^ 4 KiB aligned     ^ 4 KiB aligned   ^ 4 KiB aligned
//   aligned range of a slice [off, off+len) = [floor4k(off), ceil4k(off+len)); the view
//   points at slot + part_start + (off - floor4k(off)). A part whose aligned range starts
//   inside (or right at the end of) the previous part's range joins that read: a packed
//   record (gate, up, down back to back) is one read of ceil4k(record) bytes:
//   slot = [gate|up|down aligned as one range][unused tail]
//
// Slot states: empty -> queued (urgent or read-ahead) -> reading -> resident | failed.
// A slot is evictable when it is unpinned and not reading. Evictable slots sit in two
// LRU-ordered sets: "normal" and "pending read-ahead" (a read-ahead, or a resident expert
// a prefetch re-confirmed, whose layer has not been released yet). Victims:
//   urgent miss: oldest normal slot, else oldest pending read-ahead (it must make progress);
//                if all unpinned slots are being read, wait for one read to finish;
//   prefetch:    oldest normal slot only, so a long prediction list never evicts its own
//                head; prefetch stops when there is none.
// Empty slots have tick 0, so they are used before anything is evicted.
//
// Why urgent first: an urgent read is something the compute thread is blocked on (or soon
// will be) at the cut; a read-ahead only saves a later wait. Serving urgent reads first
// bounds the exposed wait of the current layer by its own misses.
//
// One mutex guards all bookkeeping; the IO threads hold it only to pop a job and to
// publish its result, never during a read. Queue entries carry the slot's generation so
// entries of dropped / reassigned slots are skipped lazily.
#include "stream/expert_stream.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "io/file.h"

namespace strata::stream {

namespace {

constexpr uint64_t kAlign = io::kDirectAlign;
uint64_t floor_a(uint64_t x) { return x / kAlign * kAlign; }
uint64_t ceil_a(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

enum class State : uint8_t { Empty, Queued, Reading, Resident, Failed };

/// One aligned read of part of an expert: file range and where it lands in the slot.
struct Piece {
  uint64_t file_off, len, slot_off;
};
/// Largest piece (a multiple of the O_DIRECT alignment).
constexpr uint64_t kPiece = uint64_t{1} << 18;

struct Slot {
  int32_t layer = -1;
  int32_t expert = -1;
  int64_t key = -1;      // index into slot_of_, -1 when empty
  State state = State::Empty;
  int pins = 0;
  bool urgent = false;   // queued as urgent
  bool ahead = false;    // assigned by a read-ahead, not yet used by request()
  bool pending = false;  // protected from prefetch eviction until its layer is released
  uint64_t tick = 0;     // LRU time of last use / assignment
  uint64_t gen = 0;      // bumped whenever the slot's assignment changes
  int in_set = 0;        // 0 none, 1 normal LRU set, 2 pending set
  uint64_t set_tick = 0; // tick under which it sits in its set
  std::exception_ptr err;
  // A read is cut into pieces of at most kPiece bytes that IO threads take one at a time, so
  // an urgent read waits for at most one piece of a read-ahead before it starts, and several
  // threads read one urgent expert in parallel. Valid while state == Reading.
  int next_piece = 0;    // next piece to hand out
  int pieces_left = 0;   // pieces not finished yet
  std::vector<Piece> pieces;
};

struct Job {
  int slot;
  uint64_t gen;
};

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
  uint64_t view_off[3];    // first byte of each part's slice within the slot
  uint64_t slice_off[3];   // absolute start of each slice in the file
  uint64_t slice_end[3];   // absolute end of each slice in the file
  uint64_t slot_end = 0;   // bytes of the slot in use
};

}  // namespace

struct ExpertStream::Impl {
  std::unique_ptr<io::File> file;
  std::vector<LayerExperts> layers;
  std::vector<int64_t> layer_base;  // key of (layer, 0)
  size_t slot_bytes = 0;
  size_t n_slots = 0;
  io::AlignedBuffer arena;

  mutable std::mutex mu;
  std::condition_variable work_cv;  // IO threads: a job was queued / stop / unpause
  std::condition_variable done_cv;  // compute thread: a read finished
  std::vector<Slot> slots;
  std::vector<int> slot_of;  // key -> slot, -1 when not assigned
  std::set<std::pair<uint64_t, int>> lru_normal, lru_pending;
  std::deque<Job> urgent_q, ahead_q;
  std::vector<std::vector<int>> pinned_by_layer;
  uint64_t clock = 0;
  int reading = 0;
  bool stop = false;
  bool paused = false;
  bool fake = false;
  StreamStats st;
  std::vector<std::thread> threads;

  // ---- geometry ----
  static void ranges(const LayerExperts& L, int32_t e, ExpertRanges& r) {
    r.n_reads = 0;
    uint64_t pos = 0;
    for (int p = 0; p < 3; ++p) {
      const uint64_t off = L.part[p].offset(e);
      const uint64_t end = off + L.part[p].expert_bytes;
      r.slice_off[p] = off;
      r.slice_end[p] = end;
      if (L.part[p].expert_bytes == 0) {
        r.view_off[p] = pos;
        continue;
      }
      const uint64_t a = floor_a(off), b = ceil_a(end);
      ExpertRanges::Read* cur = r.n_reads > 0 ? &r.read[r.n_reads - 1] : nullptr;
      if (cur && a >= cur->file_off && a <= cur->file_off + cur->len) {
        cur->len = std::max(cur->len, b - cur->file_off);  // touches the previous read: extend it
      } else {
        r.read[r.n_reads++] = ExpertRanges::Read{a, b - a, pos};
        cur = &r.read[r.n_reads - 1];
      }
      r.view_off[p] = cur->slot_off + (off - cur->file_off);
      pos = cur->slot_off + cur->len;
    }
    r.slot_end = pos;
  }
  void ranges(int layer, int32_t e, ExpertRanges& r) const { ranges(layers[static_cast<size_t>(layer)], e, r); }

  int64_t key_of(int layer, int32_t e) const {
    if (layer < 0 || static_cast<size_t>(layer) >= layers.size())
      throw std::out_of_range(fmt::format("expert stream: layer {} out of range (0..{})", layer, layers.size()));
    if (e < 0 || e >= layers[static_cast<size_t>(layer)].n_expert)
      throw std::out_of_range(fmt::format("expert stream: expert {} of layer {} out of range (n_expert {})", e, layer,
                                          layers[static_cast<size_t>(layer)].n_expert));
    return layer_base[static_cast<size_t>(layer)] + e;
  }

  // ---- LRU index (call with mu held after any change of pins / state / pending / tick) ----
  void reindex(int s) {
    Slot& sl = slots[static_cast<size_t>(s)];
    if (sl.in_set == 1) lru_normal.erase({sl.set_tick, s});
    if (sl.in_set == 2) lru_pending.erase({sl.set_tick, s});
    sl.in_set = 0;
    if (sl.pins == 0 && sl.state != State::Reading) {
      sl.set_tick = sl.tick;
      sl.in_set = sl.pending ? 2 : 1;
      (sl.pending ? lru_pending : lru_normal).insert({sl.tick, s});
    }
  }

  // Oldest evictable slot, or -1. Prefetch never takes a pending read-ahead.
  int pick_victim(bool for_prefetch) const {
    if (!lru_normal.empty()) return lru_normal.begin()->second;
    if (!for_prefetch && !lru_pending.empty()) return lru_pending.begin()->second;
    return -1;
  }

  // Forget what slot s holds (counting a wasted or dropped read-ahead) and leave it empty.
  void evict(int s) {
    Slot& sl = slots[static_cast<size_t>(s)];
    if (sl.ahead && sl.state == State::Resident) ++st.wasted;
    if (sl.state == State::Queued && !sl.urgent) ++st.dropped;
    if (sl.key >= 0) slot_of[static_cast<size_t>(sl.key)] = -1;
    sl.layer = sl.expert = -1;
    sl.key = -1;
    sl.state = State::Empty;
    sl.urgent = sl.ahead = sl.pending = false;
    sl.err = nullptr;
    sl.tick = 0;
    ++sl.gen;
    reindex(s);
  }

  void assign(int s, int layer, int32_t e, int64_t key, bool urgent) {
    Slot& sl = slots[static_cast<size_t>(s)];
    sl.layer = layer;
    sl.expert = e;
    sl.key = key;
    slot_of[static_cast<size_t>(key)] = s;
    queue(s, urgent);
  }

  void queue(int s, bool urgent) {
    Slot& sl = slots[static_cast<size_t>(s)];
    if (fake) {  // no IO: resident at once, with whatever bytes the slot holds
      sl.state = State::Resident;
      sl.urgent = sl.ahead = sl.pending = false;
      sl.err = nullptr;
      sl.tick = ++clock;
      ++sl.gen;
      reindex(s);
      return;
    }
    sl.state = State::Queued;
    sl.urgent = urgent;
    sl.ahead = !urgent;
    sl.pending = !urgent;
    sl.err = nullptr;
    sl.tick = ++clock;
    ++sl.gen;
    (urgent ? urgent_q : ahead_q).push_back(Job{s, sl.gen});
    reindex(s);
  }

  /// The job still has pieces to hand out (not started, or started with pieces left).
  bool job_open(const Job& j) const {
    const Slot& sl = slots[static_cast<size_t>(j.slot)];
    if (sl.gen != j.gen) return false;
    return sl.state == State::Queued ||
           (sl.state == State::Reading && sl.next_piece < static_cast<int>(sl.pieces.size()));
  }

  // Drops unstarted read-aheads for which pred(slot) holds; compacts the queue.
  template <class Pred>
  void drop_ahead(Pred pred) {
    std::deque<Job> keep;
    for (const Job& j : ahead_q) {
      if (!job_open(j)) continue;
      Slot& sl = slots[static_cast<size_t>(j.slot)];
      if (sl.state == State::Reading) {  // started: its remaining pieces are read too
        keep.push_back(j);
        continue;
      }
      if (!sl.urgent && pred(sl))
        evict(j.slot);
      else if (!sl.urgent)
        keep.push_back(j);
    }
    ahead_q.swap(keep);
  }

  // ---- IO thread ----
  // Cuts slot s's expert into pieces (called when its first piece is handed out).
  void plan_pieces(Slot& sl) {
    ExpertRanges r;
    ranges(sl.layer, sl.expert, r);
    sl.pieces.clear();
    for (int i = 0; i < r.n_reads; ++i)
      for (uint64_t o = 0; o < r.read[i].len; o += kPiece)
        sl.pieces.push_back(Piece{r.read[i].file_off + o, std::min(kPiece, r.read[i].len - o), r.read[i].slot_off + o});
    sl.next_piece = 0;
    sl.pieces_left = static_cast<int>(sl.pieces.size());
  }

  // Hands out the next piece: urgent jobs first, each job's pieces in order; a job leaves its
  // queue with its last piece. While paused, only reads already started continue (a started
  // read always completes).
  bool pop(int& slot, Piece& piece) {
    for (auto* q : {&urgent_q, &ahead_q}) {
      for (auto it = q->begin(); it != q->end();) {
        const Job j = *it;
        if (!job_open(j)) {
          it = q->erase(it);
          continue;
        }
        Slot& sl = slots[static_cast<size_t>(j.slot)];
        if (paused && sl.state == State::Queued) {
          ++it;
          continue;
        }
        if (sl.state == State::Queued) {
          sl.state = State::Reading;
          ++reading;
          plan_pieces(sl);
          reindex(j.slot);
          if (sl.pieces.empty()) {  // nothing to read (zero-byte expert)
            it = q->erase(it);
            finish(j.slot);
            continue;
          }
        }
        slot = j.slot;
        piece = sl.pieces[static_cast<size_t>(sl.next_piece++)];
        if (sl.next_piece == static_cast<int>(sl.pieces.size())) q->erase(it);
        return true;
      }
    }
    return false;
  }

  // The last piece of slot s finished: resident, or failed with the first error.
  void finish(int s) {
    Slot& sl = slots[static_cast<size_t>(s)];
    --reading;
    if (sl.err) {
      sl.state = State::Failed;
    } else {
      sl.state = State::Resident;
      ++st.reads;
    }
    reindex(s);
    done_cv.notify_all();
  }

  void io_main() {
    std::unique_lock lk(mu);
    for (;;) {
      int s = -1;
      Piece pc{};
      work_cv.wait(lk, [&] { return stop || pop(s, pc); });
      if (stop) return;
      Slot& sl = slots[static_cast<size_t>(s)];
      const int layer = sl.layer;
      const int32_t e = sl.expert;
      uint8_t* dst = arena.data() + static_cast<size_t>(s) * slot_bytes;
      lk.unlock();

      std::exception_ptr err;
      uint64_t bytes = 0;
      double busy = 0;
      try {
        ExpertRanges r;
        ranges(layer, e, r);
        const LayerExperts& L = layers[static_cast<size_t>(layer)];
        for (int p = 0; p < 3; ++p)
          if (L.part[p].expert_bytes > 0 && r.slice_end[p] > file->size())
            throw io::IoError(fmt::format("{}: layer {} expert {} part {}: slice [{}, {}) runs past the end of the file "
                                          "({} bytes)",
                                          file->path(), layer, e, p, r.slice_off[p], r.slice_end[p], file->size()));
        uint64_t n = pc.len;
        // Buffered reads may not run past EOF; direct reads may (up to the aligned EOF).
        if (!file->direct()) n = pc.file_off >= file->size() ? 0 : std::min<uint64_t>(n, file->size() - pc.file_off);
        const auto t0 = Clock::now();
        try {
          if (n > 0) file->read_at(pc.file_off, static_cast<size_t>(n), dst + pc.slot_off);
        } catch (...) {
          busy += seconds_since(t0);
          throw;
        }
        busy += seconds_since(t0);
        bytes += n;
      } catch (...) {
        err = std::current_exception();
      }

      lk.lock();
      st.read_busy_s += busy;
      st.bytes_read += bytes;
      if (err && !sl.err) sl.err = err;
      if (--sl.pieces_left == 0) finish(s);
    }
  }
};

ExpertStream::ExpertStream(const std::string& path, std::vector<LayerExperts> layers, const StreamOptions& opts)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.layers = std::move(layers);
  int64_t total = 0;
  m.layer_base.reserve(m.layers.size());
  for (const LayerExperts& L : m.layers) {
    if (L.n_expert < 0) throw std::invalid_argument("expert stream: negative n_expert");
    m.layer_base.push_back(total);
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
  m.arena = io::AlignedBuffer(n * m.slot_bytes);
  // Page the arena in now, so first-use page faults are not charged to IO.
  std::memset(m.arena.data(), 0, m.arena.size());

  m.slots.resize(n);
  m.slot_of.assign(static_cast<size_t>(total), -1);
  m.pinned_by_layer.resize(m.layers.size());
  for (size_t s = 0; s < n; ++s) m.reindex(static_cast<int>(s));

  const int threads = std::max(1, opts.io_threads);
  m.threads.reserve(static_cast<size_t>(threads));
  try {
    for (int i = 0; i < threads; ++i) m.threads.emplace_back([&m] { m.io_main(); });
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
  for (const LayerExperts& L : layers) {
    for (int32_t e = 0; e < L.n_expert; ++e) {
      ExpertRanges r;
      Impl::ranges(L, e, r);
      slot = std::max(slot, r.slot_end);
    }
  }
  return static_cast<size_t>(slot);
}

size_t ExpertStream::slot_bytes() const { return impl_->slot_bytes; }
size_t ExpertStream::n_slots() const { return impl_->n_slots; }
bool ExpertStream::direct() const { return impl_->file->direct(); }

void ExpertStream::request(int layer, std::span<const int32_t> experts) {
  Impl& m = *impl_;
  bool queued = false;
  {
    std::unique_lock lk(m.mu);
    for (const int32_t e : experts) {
      const int64_t key = m.key_of(layer, e);
      int s = m.slot_of[static_cast<size_t>(key)];
      if (s >= 0) {
        Slot& sl = m.slots[static_cast<size_t>(s)];
        switch (sl.state) {
          case State::Resident:
          case State::Reading:
            ++m.st.hits;
            if (sl.ahead) ++m.st.streamed_ahead;
            if (sl.state == State::Reading && sl.next_piece < static_cast<int>(sl.pieces.size())) {
              m.urgent_q.push_front(Job{s, sl.gen});  // started read-ahead: its remaining pieces jump ahead
              queued = true;
            }
            break;
          case State::Queued:
            if (sl.urgent) {
              ++m.st.hits;  // requested again before its urgent read started
            } else {
              ++m.st.misses;  // read-ahead not started yet: promote it
              m.queue(s, true);
              queued = true;
            }
            break;
          case State::Failed:
          case State::Empty:
            ++m.st.misses;  // retry the read
            m.queue(s, true);
            queued = true;
            break;
        }
      } else {
        s = m.pick_victim(false);
        if (s < 0) {
          // Every slot is pinned or being read. Reads finish: wait for one (exposed wait,
          // the compute thread is blocked). All pinned: the caller broke the precondition.
          auto unpinned_reading = [&] {
            return std::any_of(m.slots.begin(), m.slots.end(),
                               [](const Slot& x) { return x.state == State::Reading && x.pins == 0; });
          };
          const auto t0 = Clock::now();
          while (s < 0 && unpinned_reading()) {
            m.done_cv.wait(lk);
            s = m.pick_victim(false);
          }
          m.st.exposed_wait_s += seconds_since(t0);
        }
        if (s < 0)
          throw std::logic_error(fmt::format("expert stream: all {} slots are pinned; cannot make layer {} expert {} "
                                             "resident (release layers, or use a larger arena)",
                                             m.n_slots, layer, e));
        ++m.st.misses;
        m.evict(s);
        m.assign(s, layer, e, key, true);
        queued = true;
      }
      Slot& sl = m.slots[static_cast<size_t>(s)];
      sl.ahead = false;
      sl.pending = false;
      sl.tick = ++m.clock;
      ++sl.pins;
      m.pinned_by_layer[static_cast<size_t>(layer)].push_back(s);
      m.reindex(s);
      ++m.st.needed;
    }
  }
  if (queued) m.work_cv.notify_all();
}

ExpertView ExpertStream::wait(int layer, int32_t expert) {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  const int64_t key = m.key_of(layer, expert);
  const int s = m.slot_of[static_cast<size_t>(key)];
  if (s < 0 || m.slots[static_cast<size_t>(s)].pins == 0)
    throw std::logic_error(fmt::format("expert stream: wait for layer {} expert {} which is not requested", layer, expert));
  Slot& sl = m.slots[static_cast<size_t>(s)];  // pinned: cannot be evicted while we wait
  if (sl.state == State::Queued || sl.state == State::Reading) {
    const auto t0 = Clock::now();
    m.done_cv.wait(lk, [&] { return sl.state != State::Queued && sl.state != State::Reading; });
    m.st.exposed_wait_s += seconds_since(t0);
  }
  if (sl.state == State::Failed) std::rethrow_exception(sl.err);
  ExpertRanges r;
  m.ranges(layer, expert, r);
  const uint8_t* base = m.arena.data() + static_cast<size_t>(s) * m.slot_bytes;
  ExpertView v;
  for (int p = 0; p < 3; ++p) v.part[p] = base + r.view_off[p];
  return v;
}

void ExpertStream::release(int layer) {
  Impl& m = *impl_;
  std::lock_guard lk(m.mu);
  if (layer < 0 || static_cast<size_t>(layer) >= m.layers.size())
    throw std::out_of_range(fmt::format("expert stream: release of layer {} out of range", layer));
  auto& pinned = m.pinned_by_layer[static_cast<size_t>(layer)];
  for (const int s : pinned) {
    Slot& sl = m.slots[static_cast<size_t>(s)];
    if (sl.pins > 0) --sl.pins;
    m.reindex(s);
  }
  pinned.clear();
  // The layer is done: its unstarted read-aheads are not needed any more, and its finished
  // but unused ones (or re-confirmed residents) lose their protection from prefetch.
  m.drop_ahead([&](const Slot& sl) { return sl.layer == layer; });
  for (size_t s = 0; s < m.slots.size(); ++s) {
    Slot& sl = m.slots[s];
    if (sl.pending && sl.layer == layer) {
      sl.pending = false;
      m.reindex(static_cast<int>(s));
    }
  }
}

void ExpertStream::prefetch(int layer, std::span<const int32_t> experts) {
  Impl& m = *impl_;
  if (m.fake) return;
  bool queued = false;
  {
    std::lock_guard lk(m.mu);
    for (const int32_t e : experts) {
      const int64_t key = m.key_of(layer, e);
      int s = m.slot_of[static_cast<size_t>(key)];
      if (s >= 0) {
        Slot& sl = m.slots[static_cast<size_t>(s)];
        if (sl.state == State::Resident) {
          // Already here: keep it until the layer is released.
          if (sl.pins == 0) {
            sl.pending = true;
            sl.tick = ++m.clock;
            m.reindex(s);
          }
        } else if (sl.state == State::Failed || sl.state == State::Empty) {
          if (sl.pins == 0) {
            m.queue(s, false);
            queued = true;
          }
        }
        continue;  // queued or reading: nothing to do
      }
      s = m.pick_victim(true);
      if (s < 0) break;  // arena full of pinned slots and pending read-aheads
      m.evict(s);
      m.assign(s, layer, e, key, false);
      queued = true;
    }
  }
  if (queued) m.work_cv.notify_all();
}

void ExpertStream::cancel_prefetch() {
  Impl& m = *impl_;
  std::lock_guard lk(m.mu);
  m.drop_ahead([](const Slot&) { return true; });
}

bool ExpertStream::resident(int layer, int32_t expert) const {
  const Impl& m = *impl_;
  std::lock_guard lk(m.mu);
  const int s = m.slot_of[static_cast<size_t>(m.key_of(layer, expert))];
  return s >= 0 && m.slots[static_cast<size_t>(s)].state == State::Resident;
}

void ExpertStream::wait_idle() {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  m.done_cv.wait(lk, [&] {
    if (m.reading > 0) return false;
    if (m.paused) return true;
    return std::none_of(m.urgent_q.begin(), m.urgent_q.end(), [&](const Job& j) { return m.job_open(j); }) &&
           std::none_of(m.ahead_q.begin(), m.ahead_q.end(), [&](const Job& j) { return m.job_open(j); });
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
  return impl_->st;
}

void ExpertStream::reset_stats() {
  std::lock_guard lk(impl_->mu);
  impl_->st = StreamStats{};
}

void ExpertStream::clear() {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  // unstarted reads are forgotten; started ones finish (their remaining pieces stay queued)
  for (auto* q : {&m.urgent_q, &m.ahead_q}) {
    std::deque<Job> keep;
    for (const Job& j : *q)
      if (m.job_open(j) && m.slots[static_cast<size_t>(j.slot)].state == State::Reading) keep.push_back(j);
    q->swap(keep);
  }
  m.done_cv.wait(lk, [&] { return m.reading == 0; });
  for (size_t s = 0; s < m.slots.size(); ++s) {
    Slot& sl = m.slots[s];
    sl.pins = 0;
    sl.ahead = false;  // a cold start is not a wasted read
    sl.urgent = true;  // nor a dropped one
    m.evict(static_cast<int>(s));
  }
  for (auto& p : m.pinned_by_layer) p.clear();
}

}  // namespace strata::stream
