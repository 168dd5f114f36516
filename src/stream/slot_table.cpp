// SlotTable: see slot_table.h for the transitions and docs/streaming.md for the policy.
//
// Evictable slots (unpinned, not being read) sit in two sets ordered by LRU tick: "normal",
// and "pending read-ahead" (a read-ahead, or a resident expert a prefetch re-confirmed, whose
// layer has not been released yet). Empty slots have tick 0, so they are taken before anything
// is evicted. Queue entries carry the slot's generation, so entries of dropped or reassigned
// slots are skipped lazily.
#include "stream/slot_table.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

namespace strata::stream {

SlotTable::SlotTable(std::vector<int> experts_per_layer, size_t n_slots, PieceCount pieces, bool fake)
    : piece_count_(std::move(pieces)), fake_(fake), n_expert_(std::move(experts_per_layer)) {
  if (n_slots == 0) throw std::invalid_argument("slot table: no slots");
  int64_t total = 0;
  layer_base_.reserve(n_expert_.size());
  for (const int n : n_expert_) {
    if (n < 0) throw std::invalid_argument("expert stream: negative n_expert");
    layer_base_.push_back(total);
    total += n;
  }
  slots_.resize(n_slots);
  slot_of_.assign(static_cast<size_t>(total), -1);
  pinned_by_layer_.resize(n_expert_.size());
  for (size_t s = 0; s < n_slots; ++s) reindex(static_cast<int>(s));
}

int64_t SlotTable::key_of(int layer, int32_t e) const {
  if (layer < 0 || static_cast<size_t>(layer) >= n_expert_.size())
    throw std::out_of_range(fmt::format("expert stream: layer {} out of range (0..{})", layer, n_expert_.size()));
  const int n = n_expert_[static_cast<size_t>(layer)];
  if (e < 0 || e >= n)
    throw std::out_of_range(
        fmt::format("expert stream: expert {} of layer {} out of range (n_expert {})", e, layer, n));
  return layer_base_[static_cast<size_t>(layer)] + e;
}

// Call after any change of pins / state / pending / tick of slot s.
void SlotTable::reindex(int s) {
  Slot& sl = slots_[static_cast<size_t>(s)];
  if (sl.in_set == 1) lru_normal_.erase({sl.set_tick, s});
  if (sl.in_set == 2) lru_pending_.erase({sl.set_tick, s});
  sl.in_set = 0;
  if (sl.pins == 0 && sl.state != SlotState::Reading) {
    sl.set_tick = sl.tick;
    sl.in_set = sl.pending ? 2 : 1;
    (sl.pending ? lru_pending_ : lru_normal_).insert({sl.tick, s});
  }
}

// True while kernels may still read the slot; forgets the event once it is done.
bool SlotTable::event_pending(Slot& sl) {
  if (!sl.last_use) return false;
  if (!sl.last_use->done()) return true;
  sl.last_use.reset();
  return false;
}

// The slot to (re)assign, or -1. In order: the oldest normal slot without a pending last-use
// event; for an urgent miss then the oldest pending read-ahead without one, then the slot
// whose pending event is oldest (its read waits for the event). Prefetch never takes a
// pending read-ahead or a slot whose event is pending.
int SlotTable::pick_victim(bool for_prefetch) {
  int oldest = -1;
  uint64_t oldest_seq = std::numeric_limits<uint64_t>::max();
  auto scan = [&](const std::set<std::pair<uint64_t, int>>& set) {
    for (const auto& [tick, s] : set) {
      Slot& sl = slots_[static_cast<size_t>(s)];
      if (!event_pending(sl)) return s;
      if (sl.last_use_seq < oldest_seq) {
        oldest_seq = sl.last_use_seq;
        oldest = s;
      }
    }
    return -1;
  };
  if (const int s = scan(lru_normal_); s >= 0) return s;
  if (for_prefetch) return -1;
  if (const int s = scan(lru_pending_); s >= 0) return s;
  return oldest;
}

// Forgets what slot s holds (counting a wasted or dropped read-ahead) and leaves it empty. The
// last-use event stays: it belongs to the slot's memory, not to what it held.
void SlotTable::evict(int s) {
  Slot& sl = slots_[static_cast<size_t>(s)];
  if (sl.ahead && sl.state == SlotState::Resident) ++st_.wasted;
  if (sl.state == SlotState::Queued && !sl.urgent) ++st_.dropped;
  if (sl.key >= 0) slot_of_[static_cast<size_t>(sl.key)] = -1;
  sl.layer = sl.expert = -1;
  sl.key = -1;
  sl.state = SlotState::Empty;
  sl.urgent = sl.ahead = sl.pending = false;
  sl.err = nullptr;
  sl.reuse_after.reset();
  sl.tick = 0;
  ++sl.gen;
  reindex(s);
}

void SlotTable::assign(int s, int layer, int32_t e, int64_t key, bool urgent) {
  Slot& sl = slots_[static_cast<size_t>(s)];
  sl.layer = layer;
  sl.expert = e;
  sl.key = key;
  slot_of_[static_cast<size_t>(key)] = s;
  queue(s, urgent);
}

void SlotTable::queue(int s, bool urgent) {
  Slot& sl = slots_[static_cast<size_t>(s)];
  sl.err = nullptr;
  sl.tick = ++clock_;
  ++sl.gen;
  if (fake_) {  // no IO: resident at once, with whatever bytes the slot holds
    sl.state = SlotState::Resident;
    sl.urgent = sl.ahead = sl.pending = false;
    reindex(s);
    return;
  }
  sl.state = SlotState::Queued;
  sl.urgent = urgent;
  sl.ahead = !urgent;
  sl.pending = !urgent;
  sl.reuse_after = event_pending(sl) ? sl.last_use : nullptr;
  (urgent ? urgent_q_ : ahead_q_).push_back(Job{s, sl.gen});
  new_work_ = true;
  reindex(s);
}

// The job still has pieces to hand out (not started, or started with pieces left).
bool SlotTable::job_open(const Job& j) const {
  const Slot& sl = slots_[static_cast<size_t>(j.slot)];
  if (sl.gen != j.gen) return false;
  return sl.state == SlotState::Queued || (sl.state == SlotState::Reading && sl.next_piece < sl.n_pieces);
}

// Drops unstarted read-aheads for which pred(slot) holds; compacts the queue.
template <class Pred>
void SlotTable::drop_ahead(Pred pred) {
  std::deque<Job> keep;
  for (const Job& j : ahead_q_) {
    if (!job_open(j)) continue;
    Slot& sl = slots_[static_cast<size_t>(j.slot)];
    if (sl.state == SlotState::Reading) {  // started: its remaining pieces are read too
      keep.push_back(j);
      continue;
    }
    if (!sl.urgent && pred(sl))
      evict(j.slot);
    else if (!sl.urgent)
      keep.push_back(j);
  }
  ahead_q_.swap(keep);
}

SlotTable::Outcome SlotTable::request(int layer, int32_t e) {
  const uint64_t misses_before = st_.misses;
  const int64_t key = key_of(layer, e);
  int s = slot_of_[static_cast<size_t>(key)];
  if (s >= 0) {
    Slot& sl = slots_[static_cast<size_t>(s)];
    switch (sl.state) {
      case SlotState::Resident:
      case SlotState::Reading:
        ++st_.hits;
        if (sl.ahead) ++st_.streamed_ahead;
        if (sl.ahead && sl.state == SlotState::Reading) ++st_.ahead_in_flight;
        if (sl.state == SlotState::Reading && sl.next_piece < sl.n_pieces) {
          urgent_q_.push_front(Job{s, sl.gen});  // started read-ahead: its remaining pieces jump ahead
          new_work_ = true;
        }
        break;
      case SlotState::Queued:
        if (sl.urgent) {
          ++st_.hits;  // requested again before its urgent read started
        } else {
          ++st_.misses;  // read-ahead not started yet: promote it
          ++st_.ahead_late;
          queue(s, true);
        }
        break;
      case SlotState::Failed:
      case SlotState::Empty:
        ++st_.misses;  // retry the read
        queue(s, true);
        break;
    }
  } else {
    s = pick_victim(false);
    if (s < 0) {
      // Every slot is pinned or being read. Reads finish: the caller waits for one. All
      // pinned: the caller broke the precondition.
      const bool unpinned_reading = std::any_of(slots_.begin(), slots_.end(), [](const Slot& x) {
        return x.state == SlotState::Reading && x.pins == 0;
      });
      if (unpinned_reading) return Outcome::Blocked;
      throw std::logic_error(
          fmt::format("expert stream: all {} slots are pinned; cannot make layer {} expert {} "
                      "resident (release layers, or use a larger arena)",
                      slots_.size(), layer, e));
    }
    ++st_.misses;
    evict(s);
    assign(s, layer, e, key, true);
  }
  Slot& sl = slots_[static_cast<size_t>(s)];
  sl.ahead = false;
  sl.pending = false;
  sl.tick = ++clock_;
  ++sl.pins;
  pinned_by_layer_[static_cast<size_t>(layer)].push_back(s);
  reindex(s);
  ++st_.needed;
  return st_.misses != misses_before ? Outcome::Miss : Outcome::Hit;
}

void SlotTable::prefetch(int layer, std::span<const int32_t> experts) {
  if (fake_) return;
  for (const int32_t e : experts) {
    const int64_t key = key_of(layer, e);
    int s = slot_of_[static_cast<size_t>(key)];
    if (s >= 0) {
      Slot& sl = slots_[static_cast<size_t>(s)];
      if (sl.state == SlotState::Resident) {
        // Already here: keep it until the layer is released.
        if (sl.pins == 0) {
          sl.pending = true;
          sl.tick = ++clock_;
          reindex(s);
        }
      } else if (sl.state == SlotState::Failed || sl.state == SlotState::Empty) {
        if (sl.pins == 0) queue(s, false);
      }
      continue;  // queued or reading: nothing to do
    }
    s = pick_victim(true);
    if (s < 0) break;  // arena full of pinned slots, pending read-aheads and slots in use
    evict(s);
    assign(s, layer, e, key, false);
  }
}

void SlotTable::release(int layer, backend::EventPtr last_use) {
  if (layer < 0 || static_cast<size_t>(layer) >= n_expert_.size())
    throw std::out_of_range(fmt::format("expert stream: release of layer {} out of range", layer));
  const uint64_t seq = ++release_seq_;
  auto& pinned = pinned_by_layer_[static_cast<size_t>(layer)];
  for (const int s : pinned) {
    Slot& sl = slots_[static_cast<size_t>(s)];
    if (sl.pins > 0) --sl.pins;
    if (last_use) {  // null adds nothing to wait for (an older pending event stays)
      sl.last_use = last_use;
      sl.last_use_seq = seq;
    }
    reindex(s);
  }
  pinned.clear();
  // The layer is done: its unstarted read-aheads are not needed any more, and its finished
  // but unused ones (or re-confirmed residents) lose their protection from prefetch.
  drop_ahead([&](const Slot& sl) { return sl.layer == layer; });
  for (size_t s = 0; s < slots_.size(); ++s) {
    Slot& sl = slots_[s];
    if (sl.pending && sl.layer == layer) {
      sl.pending = false;
      reindex(static_cast<int>(s));
    }
  }
}

void SlotTable::cancel_prefetch() {
  drop_ahead([](const Slot&) { return true; });
}

int SlotTable::slot_of(int layer, int32_t e) const { return slot_of_[static_cast<size_t>(key_of(layer, e))]; }

bool SlotTable::resident(int layer, int32_t e) const {
  const int s = slot_of(layer, e);
  return s >= 0 && slots_[static_cast<size_t>(s)].state == SlotState::Resident;
}

bool SlotTable::count_hit(int layer, int32_t e) {
  const int s = slot_of(layer, e);
  if (s < 0) return false;
  Slot& sl = slots_[static_cast<size_t>(s)];
  if (sl.state != SlotState::Resident) return false;
  ++st_.needed;
  ++st_.hits;
  if (sl.ahead) ++st_.streamed_ahead;
  sl.ahead = false;
  sl.pending = false;
  sl.tick = ++clock_;
  reindex(s);
  return true;
}

std::vector<int> SlotTable::lru_order() const {
  std::vector<int> out;
  out.reserve(lru_normal_.size() + lru_pending_.size());
  for (const auto& [tick, s] : lru_normal_) out.push_back(s);
  for (const auto& [tick, s] : lru_pending_) out.push_back(s);
  return out;
}

// Hands out the next piece: urgent jobs first, each job's pieces in order; a job leaves its
// queue with its last piece. Without start_new only reads already started continue (a started
// read always completes).
bool SlotTable::next_piece(bool start_new, Piece& out) {
  for (auto* q : {&urgent_q_, &ahead_q_}) {
    for (auto it = q->begin(); it != q->end();) {
      const Job j = *it;
      if (!job_open(j)) {
        it = q->erase(it);
        continue;
      }
      Slot& sl = slots_[static_cast<size_t>(j.slot)];
      if (!start_new && sl.state == SlotState::Queued) {
        ++it;
        continue;
      }
      if (sl.state == SlotState::Queued) {
        sl.state = SlotState::Reading;
        ++reading_;
        sl.n_pieces = piece_count_ ? piece_count_(sl.layer, sl.expert) : 1;
        sl.next_piece = 0;
        sl.pieces_left = sl.n_pieces;
        reindex(j.slot);
        if (sl.n_pieces <= 0) {  // nothing to read (zero-byte expert)
          sl.n_pieces = 0;
          it = q->erase(it);
          finish(j.slot);
          continue;
        }
      }
      out = Piece{j.slot, sl.layer, sl.expert, sl.next_piece++, sl.reuse_after};
      if (sl.next_piece == sl.n_pieces) q->erase(it);
      return true;
    }
  }
  return false;
}

void SlotTable::merge_pieces(int slot) {
  Slot& sl = slots_[static_cast<size_t>(slot)];
  if (sl.state != SlotState::Reading || sl.next_piece != 1 || sl.pieces_left != sl.n_pieces)
    throw std::logic_error("slot table: merge_pieces needs a read whose only handed-out piece is piece 0");
  // The job's queue entry, if it is still there, is no longer open (next_piece == n_pieces) and
  // is dropped when next_piece() passes it.
  sl.n_pieces = 1;
  sl.pieces_left = 1;
}

bool SlotTable::piece_done(int slot, std::exception_ptr err) {
  Slot& sl = slots_[static_cast<size_t>(slot)];
  if (sl.state != SlotState::Reading)
    throw std::logic_error("slot table: piece_done for a slot that is not being read");
  if (err && !sl.err) sl.err = err;
  if (--sl.pieces_left > 0) return false;
  finish(slot);
  return true;
}

// The last piece of slot s finished: resident, or failed with the first error.
void SlotTable::finish(int s) {
  Slot& sl = slots_[static_cast<size_t>(s)];
  --reading_;
  if (sl.err) {
    sl.state = SlotState::Failed;
  } else {
    sl.state = SlotState::Resident;
    ++st_.reads;
  }
  sl.reuse_after.reset();
  reindex(s);
  finished_ = true;
}

bool SlotTable::has_open_jobs() const {
  auto open = [&](const Job& j) { return job_open(j); };
  return std::any_of(urgent_q_.begin(), urgent_q_.end(), open) || std::any_of(ahead_q_.begin(), ahead_q_.end(), open);
}

void SlotTable::drop_unstarted() {
  for (auto* q : {&urgent_q_, &ahead_q_}) {
    std::deque<Job> keep;
    for (const Job& j : *q)
      if (job_open(j) && slots_[static_cast<size_t>(j.slot)].state == SlotState::Reading) keep.push_back(j);
    q->swap(keep);
  }
}

void SlotTable::reset() {
  if (reading_ != 0) throw std::logic_error("slot table: reset while reads are in flight");
  for (size_t s = 0; s < slots_.size(); ++s) {
    Slot& sl = slots_[s];
    sl.pins = 0;
    sl.ahead = false;  // a cold start is not a wasted read
    sl.urgent = true;  // nor a dropped one
    evict(static_cast<int>(s));
  }
  for (auto& p : pinned_by_layer_) p.clear();
}

}  // namespace strata::stream
