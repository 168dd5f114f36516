#pragma once
// SlotTable: the expert arena's slot state machine, without threads, IO or clocks.
//
// It decides which (layer, expert) each slot holds, which slots are pinned, which slot is
// evicted (LRU among unpinned slots), which read an IO thread takes next (urgent first, then
// read-ahead, a read cut into pieces) and what the stream counters say. stream::ExpertStream
// wraps it in a mutex and adds the IO threads, the condition variables and the arena memory
// (docs/streaming.md). Tests drive it single-threaded (tests/test_slot_table.cpp).
//
//   request(l, e):  resident / reading ---------> pin (hit)
//                   queued read-ahead ----------> pin, promote to urgent (miss)
//                   absent, failed -------------> victim, pin, urgent read (miss)
//                   no victim, a read in flight -> Blocked (the caller waits and retries)
//   prefetch(l, e): absent ---------------------> victim among "normal" slots, read-ahead
//   next_piece():   urgent queue, then read-ahead queue; Queued -> Reading
//   piece_done():   last piece -> Resident (or Failed with the first error)
//   release(l, ev): unpin l; drop l's unstarted read-aheads; ev = last use of those slots
//
// The last-use event: release(layer, ev) records ev on the slots the layer pinned; until ev
// is done the slot's memory may still be read by kernels queued before ev, so the slot is not
// chosen as a victim while any slot without a pending event is free. When nothing else is
// free an urgent miss takes the slot with the oldest pending event and the piece jobs of its
// read carry that event (Piece::reuse_after): the IO thread waits for it before the bytes
// reach the slot. That wait cannot deadlock: an event completes when the work queued before
// it was recorded has finished, and that work needs nothing from the IO threads or from the
// compute thread (it was queued before release() returned).
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "stream/stats.h"

namespace strata::stream {

/// The state of one arena slot.
enum class SlotState : uint8_t {
  Empty,     ///< holds nothing
  Queued,    ///< assigned, its read waits in the urgent or the read-ahead queue
  Reading,   ///< an IO thread took its first piece; the read completes before anything else
  Resident,  ///< its bytes are in the slot
  Failed,    ///< its read failed; error() holds the exception, a request retries the read
};

/// The slot state machine of an ExpertStream. Single-threaded and pure: the owner serializes
/// every call (ExpertStream holds its mutex). Slots are numbered 0..n_slots()-1.
class SlotTable {
 public:
  /// Pieces a read of (layer, expert) is cut into (IO threads take them one at a time).
  using PieceCount = std::function<int(int layer, int32_t expert)>;

  /// What request() did with one expert.
  enum class Outcome : uint8_t {
    Hit,      ///< resident or being read (a started read-ahead, or an urgent read queued before)
    Miss,     ///< an urgent read was queued (absent, failed, or an unstarted read-ahead promoted)
    Blocked,  ///< no slot can take it now: every unpinned slot is being read. Nothing changed;
              ///< call request() again after a read finished.
  };

  /// One piece of work for an IO thread.
  struct Piece {
    int slot = -1;
    int layer = -1;
    int32_t expert = -1;
    int index = 0;  ///< piece index within the expert's read, 0..pieces-1
    /// When set, the slot's memory may still be in use by kernels: wait for this event before
    /// the piece's bytes reach the slot.
    backend::EventPtr reuse_after;
  };

  /// `experts_per_layer[l]` experts in layer l (each >= 0), `n_slots` slots (>= 1). `pieces`
  /// gives the piece count of each read (null: 1 piece each). `fake`: no reads; a queued expert
  /// becomes resident at once (--fake-stream). Throws std::invalid_argument on a negative count.
  SlotTable(std::vector<int> experts_per_layer, size_t n_slots, PieceCount pieces = {}, bool fake = false);

  size_t n_slots() const { return slots_.size(); }
  size_t n_layers() const { return layer_base_.size(); }

  // ---- the compute thread's side ----
  /// Pins expert `e` of `layer` for the layer's compute (counted in needed/hits/misses). Throws
  /// std::out_of_range for a bad layer or expert, std::logic_error when every slot is pinned
  /// (the caller pinned more than n_slots() experts). Precondition: e not pinned by this layer.
  Outcome request(int layer, int32_t e);
  /// Read-ahead hint: queues the absent `experts` of `layer` in order, each into the oldest
  /// "normal" evictable slot (never a pinned slot, a pending read-ahead or a slot whose last-use
  /// event is pending); stops at the first that finds none. Does nothing in fake mode.
  void prefetch(int layer, std::span<const int32_t> experts);
  /// Unpins the slots `layer` pinned, records `last_use` on them (null: reusable at once),
  /// drops the layer's unstarted read-aheads (dropped) and makes its unused ones normal LRU.
  /// Throws std::out_of_range for a bad layer.
  void release(int layer, backend::EventPtr last_use = nullptr);
  /// Drops every unstarted read-ahead (dropped).
  void cancel_prefetch();

  /// The slot holding (layer, e), or -1. Throws std::out_of_range for a bad layer or expert.
  int slot_of(int layer, int32_t e) const;
  SlotState state(int slot) const { return slots_[static_cast<size_t>(slot)].state; }
  int pins(int slot) const { return slots_[static_cast<size_t>(slot)].pins; }
  /// The error of a Failed slot (null otherwise).
  std::exception_ptr error(int slot) const { return slots_[static_cast<size_t>(slot)].err; }
  /// True if (layer, e) is resident. Does not touch LRU order or counters.
  bool resident(int layer, int32_t e) const;
  /// Counts a use of resident (layer, e) as request() counts a hit (needed, hits, streamed_ahead;
  /// LRU touch) without pinning it: for a layer a backend computed on its device from slots that
  /// cannot be evicted (ExpertStream::resident_layer). Returns false, counting nothing, if
  /// (layer, e) is not resident. Throws std::out_of_range for a bad layer or expert.
  bool count_hit(int layer, int32_t e);
  /// Unpinned evictable slots from least to most recently used, normal ones first, then
  /// pending read-aheads (the order victims are taken in, before last-use events are looked at).
  std::vector<int> lru_order() const;

  // ---- the IO threads' side ----
  /// The next piece to read: urgent jobs first, a job's pieces in order. With `start_new`
  /// false only reads already started hand out pieces (pause_io). A read with no pieces
  /// becomes resident at once. Returns false when there is nothing to hand out.
  bool next_piece(bool start_new, Piece& out);
  /// Makes the read of `slot` one piece, held by the caller: for the IO thread that was just
  /// handed piece 0 of a read that lands whole (a host-tier hit on a device arena), before any
  /// other piece was handed out. Its piece_done() then finishes the read. Throws
  /// std::logic_error if the slot is not being read or another piece was handed out.
  void merge_pieces(int slot);
  /// Piece of `slot` finished (`err`: its error, or null). After the last piece the slot is
  /// Resident (reads + 1) or Failed with the first error. Returns true when the read finished.
  bool piece_done(int slot, std::exception_ptr err);

  // ---- bookkeeping ----
  /// Reads started and not finished.
  int reading() const { return reading_; }
  /// True if a queued job still has pieces to hand out (paused reads included).
  bool has_open_jobs() const;
  /// Forgets queued reads that have not started (started ones keep their remaining pieces);
  /// not counted as dropped. Part of clear().
  void drop_unstarted();
  /// Empties every slot and unpins everything (cold start; neither wasted nor dropped). Keeps
  /// the slots' last-use events. Precondition: reading() == 0.
  void reset();

  /// True once per batch: a job was queued since the last call (wake the IO threads).
  bool take_new_work() { return std::exchange(new_work_, false); }
  /// True once per batch: a read finished since the last call (wake the waiters).
  bool take_finished() { return std::exchange(finished_, false); }

  /// Counters kept by the table: needed, hits, misses, streamed_ahead, wasted, dropped, reads.
  /// The owner adds bytes_read, exposed_wait_s and read_busy_s.
  StreamStats& stats() { return st_; }
  const StreamStats& stats() const { return st_; }

 private:
  struct Slot {
    int32_t layer = -1;
    int32_t expert = -1;
    int64_t key = -1;  // index into slot_of_, -1 when empty
    SlotState state = SlotState::Empty;
    int pins = 0;
    bool urgent = false;   // queued as urgent
    bool ahead = false;    // assigned by a read-ahead, not yet used by request()
    bool pending = false;  // protected from prefetch eviction until its layer is released
    uint64_t tick = 0;     // LRU time of last use / assignment (0: empty, taken first)
    uint64_t gen = 0;      // bumped whenever the slot's assignment changes
    int in_set = 0;        // 0 none, 1 normal LRU set, 2 pending set
    uint64_t set_tick = 0;
    std::exception_ptr err;
    int n_pieces = 0, next_piece = 0, pieces_left = 0;  // valid while Reading
    backend::EventPtr last_use;                         // kernels may read the slot until this is done
    uint64_t last_use_seq = 0;                          // order of the release that recorded it
    backend::EventPtr reuse_after;                      // the read waits for this before writing the slot
  };
  struct Job {
    int slot;
    uint64_t gen;
  };

  int64_t key_of(int layer, int32_t e) const;
  void reindex(int s);
  bool event_pending(Slot& sl);
  int pick_victim(bool for_prefetch);
  void evict(int s);
  void assign(int s, int layer, int32_t e, int64_t key, bool urgent);
  void queue(int s, bool urgent);
  bool job_open(const Job& j) const;
  template <class Pred>
  void drop_ahead(Pred pred);
  void finish(int s);

  PieceCount piece_count_;
  bool fake_ = false;
  std::vector<int> n_expert_;
  std::vector<int64_t> layer_base_;
  std::vector<Slot> slots_;
  std::vector<int> slot_of_;  // key -> slot, -1 when not assigned
  std::set<std::pair<uint64_t, int>> lru_normal_, lru_pending_;
  std::deque<Job> urgent_q_, ahead_q_;
  std::vector<std::vector<int>> pinned_by_layer_;
  uint64_t clock_ = 0;
  uint64_t release_seq_ = 0;
  int reading_ = 0;
  bool new_work_ = false, finished_ = false;
  StreamStats st_;
};

}  // namespace strata::stream
