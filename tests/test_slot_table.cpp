// SlotTable driven single-threaded through every transition: hit, miss, read-ahead then use,
// promotion, wasted and dropped read-aheads, release, LRU order, pinned slots, all pinned,
// blocked on reads in flight, pieces and pause, failed reads, fake mode, last-use events.
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <vector>

#include "stream/slot_table.h"

using strata::backend::EventPtr;
using strata::stream::SlotState;
using strata::stream::SlotTable;
using Outcome = SlotTable::Outcome;

namespace {

/// An event the test completes by hand.
class ManualEvent : public strata::backend::Event {
 public:
  void wait() override {
    if (!done_) throw std::logic_error("ManualEvent::wait on a pending event in a single-threaded test");
  }
  bool done() override {
    ++polls;
    return done_;
  }
  void complete() { done_ = true; }
  int polls = 0;

 private:
  bool done_ = false;
};

/// Plays an IO thread: hands out every piece it can and finishes it. Returns the slots read.
std::vector<int> drain(SlotTable& t) {
  std::vector<int> order;
  SlotTable::Piece p;
  while (t.next_piece(true, p)) {
    if (p.index == 0) order.push_back(p.slot);
    t.piece_done(p.slot, nullptr);
  }
  return order;
}

/// Requests `experts` of `layer`, expecting none to be blocked.
void request_all(SlotTable& t, int layer, std::vector<int32_t> experts) {
  for (const int32_t e : experts)
    ASSERT_NE(t.request(layer, e), Outcome::Blocked) << "layer " << layer << " expert " << e;
}

}  // namespace

TEST(SlotTable, MissThenHit) {
  SlotTable t({8, 8}, 4);
  EXPECT_EQ(t.request(0, 3), Outcome::Miss);
  const int s = t.slot_of(0, 3);
  ASSERT_GE(s, 0);
  EXPECT_EQ(t.state(s), SlotState::Queued);
  EXPECT_EQ(t.pins(s), 1);
  EXPECT_TRUE(t.take_new_work());
  EXPECT_FALSE(t.take_new_work());

  SlotTable::Piece p;
  ASSERT_TRUE(t.next_piece(true, p));
  EXPECT_EQ(p.slot, s);
  EXPECT_EQ(p.layer, 0);
  EXPECT_EQ(p.expert, 3);
  EXPECT_EQ(p.index, 0);
  EXPECT_EQ(p.reuse_after, nullptr);
  EXPECT_EQ(t.state(s), SlotState::Reading);
  EXPECT_EQ(t.reading(), 1);
  EXPECT_FALSE(t.next_piece(true, p));
  EXPECT_TRUE(t.piece_done(s, nullptr));
  EXPECT_TRUE(t.take_finished());
  EXPECT_EQ(t.state(s), SlotState::Resident);
  EXPECT_TRUE(t.resident(0, 3));
  EXPECT_FALSE(t.resident(1, 3));
  t.release(0);
  EXPECT_EQ(t.pins(s), 0);

  EXPECT_EQ(t.request(0, 3), Outcome::Hit);
  EXPECT_EQ(t.slot_of(0, 3), s);
  EXPECT_FALSE(t.take_new_work());
  t.release(0);

  const auto& st = t.stats();
  EXPECT_EQ(st.needed, 2u);
  EXPECT_EQ(st.hits, 1u);
  EXPECT_EQ(st.misses, 1u);
  EXPECT_EQ(st.reads, 1u);
  EXPECT_EQ(st.streamed_ahead, 0u);
  EXPECT_EQ(st.wasted, 0u);
  EXPECT_EQ(st.dropped, 0u);
}

TEST(SlotTable, RequestedAgainWhileQueuedOrReadingIsAHit) {
  SlotTable t({8}, 4);
  EXPECT_EQ(t.request(0, 1), Outcome::Miss);
  t.release(0);
  EXPECT_EQ(t.request(0, 1), Outcome::Hit);  // urgent read queued, not started
  t.release(0);
  SlotTable::Piece p;
  ASSERT_TRUE(t.next_piece(true, p));
  EXPECT_EQ(t.request(0, 1), Outcome::Hit);  // being read
  t.piece_done(p.slot, nullptr);
  t.release(0);
  EXPECT_EQ(t.stats().misses, 1u);
  EXPECT_EQ(t.stats().hits, 2u);
  EXPECT_EQ(t.stats().reads, 1u);
}

TEST(SlotTable, BadIdsThrow) {
  SlotTable t({4, 4}, 2);
  EXPECT_THROW(t.request(2, 0), std::out_of_range);
  EXPECT_THROW(t.request(-1, 0), std::out_of_range);
  EXPECT_THROW(t.request(0, 4), std::out_of_range);
  EXPECT_THROW(t.slot_of(1, -1), std::out_of_range);
  EXPECT_THROW(t.release(5), std::out_of_range);
  EXPECT_THROW(SlotTable({4, -1}, 2), std::invalid_argument);
  EXPECT_THROW(SlotTable({4}, 0), std::invalid_argument);
  EXPECT_EQ(t.stats().needed, 0u);
}

TEST(SlotTable, ReadAheadThenUseIsStreamedAhead) {
  SlotTable t({8, 8}, 6);
  const std::vector<int32_t> ids = {5, 6};
  t.prefetch(1, ids);
  EXPECT_TRUE(t.take_new_work());
  EXPECT_EQ(drain(t).size(), 2u);
  EXPECT_TRUE(t.resident(1, 5));
  EXPECT_EQ(t.request(1, 5), Outcome::Hit);  // finished read-ahead
  t.release(1);
  EXPECT_EQ(t.request(1, 5), Outcome::Hit);  // second use: not counted as ahead again
  t.release(1);
  EXPECT_EQ(t.stats().streamed_ahead, 1u);
  EXPECT_EQ(t.stats().ahead_in_flight, 0u);  // it had landed
  EXPECT_EQ(t.stats().ahead_late, 0u);
  EXPECT_EQ(t.stats().hits, 2u);
  EXPECT_EQ(t.stats().misses, 0u);
  EXPECT_EQ(t.stats().wasted, 0u);  // (1, 6) is still in the arena
}

TEST(SlotTable, UnstartedReadAheadRequestedIsPromotedAndReadFirst) {
  SlotTable t({8, 8}, 6);
  const std::vector<int32_t> ids = {1, 2, 3};
  t.prefetch(1, ids);
  EXPECT_EQ(t.request(1, 3), Outcome::Miss);  // a read-ahead not started yet is a miss
  EXPECT_EQ(t.request(0, 0), Outcome::Miss);
  const int s3 = t.slot_of(1, 3), s0 = t.slot_of(0, 0);
  // urgent first (in request order), then the read-aheads left
  EXPECT_EQ(drain(t), (std::vector<int>{s3, s0, t.slot_of(1, 1), t.slot_of(1, 2)}));
  t.release(1);
  t.release(0);
  EXPECT_EQ(t.stats().streamed_ahead, 0u);
  EXPECT_EQ(t.stats().misses, 2u);
  EXPECT_EQ(t.stats().ahead_late, 1u);  // (1, 3) was predicted, (0, 0) was not
  EXPECT_EQ(t.stats().ahead_in_flight, 0u);
  EXPECT_EQ(t.stats().dropped, 0u);
}

TEST(SlotTable, StartedReadAheadRequestedKeepsReadingAndJumpsTheQueue) {
  SlotTable t({8, 8}, 6, [](int, int32_t) { return 3; });
  t.prefetch(1, std::vector<int32_t>{4, 5});
  SlotTable::Piece p;
  ASSERT_TRUE(t.next_piece(true, p));  // (1, 4) piece 0 started
  const int s4 = p.slot;
  EXPECT_EQ(t.request(0, 7), Outcome::Miss);
  EXPECT_EQ(t.request(1, 4), Outcome::Hit);  // being read ahead: a hit, streamed ahead, in flight
  EXPECT_EQ(t.stats().streamed_ahead, 1u);
  EXPECT_EQ(t.stats().ahead_in_flight, 1u);
  EXPECT_EQ(t.stats().ahead_late, 0u);
  // (1, 4)'s remaining pieces go in front of the urgent queue, before (0, 7)
  ASSERT_TRUE(t.next_piece(true, p));
  EXPECT_EQ(p.slot, s4);
  EXPECT_EQ(p.index, 1);
  ASSERT_TRUE(t.next_piece(true, p));
  EXPECT_EQ(p.slot, s4);
  EXPECT_EQ(p.index, 2);
  ASSERT_TRUE(t.next_piece(true, p));
  EXPECT_EQ(p.slot, t.slot_of(0, 7));
  EXPECT_EQ(p.index, 0);
}

TEST(SlotTable, PiecesInOrderAndPauseLetsOnlyStartedReadsContinue) {
  SlotTable t({8}, 4, [](int, int32_t e) { return e + 1; });
  request_all(t, 0, {1, 2});  // 2 and 3 pieces
  const int s1 = t.slot_of(0, 1), s2 = t.slot_of(0, 2);
  SlotTable::Piece a, b, c;
  ASSERT_TRUE(t.next_piece(true, a));  // (0,1) piece 0
  ASSERT_TRUE(t.next_piece(true, b));  // (0,1) piece 1: its last, the job leaves the queue
  EXPECT_EQ(a.slot, s1);
  EXPECT_EQ(b.slot, s1);
  EXPECT_EQ(b.index, 1);
  ASSERT_TRUE(t.next_piece(true, c));  // (0,2) piece 0
  EXPECT_EQ(c.slot, s2);
  // paused: (0,2) was started, so its pieces still come; nothing new starts
  t.prefetch(0, std::vector<int32_t>{5});
  SlotTable::Piece p;
  ASSERT_TRUE(t.next_piece(false, p));
  EXPECT_EQ(p.slot, s2);
  EXPECT_EQ(p.index, 1);
  ASSERT_TRUE(t.next_piece(false, p));
  EXPECT_EQ(p.index, 2);
  EXPECT_FALSE(t.next_piece(false, p));
  EXPECT_TRUE(t.has_open_jobs());  // (0,5) waits for the pause to end
  // pieces finish in any order; the read finishes with its last one
  EXPECT_FALSE(t.piece_done(s1, nullptr));
  EXPECT_EQ(t.state(s1), SlotState::Reading);
  EXPECT_TRUE(t.piece_done(s1, nullptr));
  EXPECT_EQ(t.state(s1), SlotState::Resident);
  for (int i = 0; i < 2; ++i) EXPECT_FALSE(t.piece_done(s2, nullptr));
  EXPECT_TRUE(t.piece_done(s2, nullptr));
  EXPECT_EQ(t.reading(), 0);
  EXPECT_EQ(drain(t), (std::vector<int>{t.slot_of(0, 5)}));
  EXPECT_FALSE(t.has_open_jobs());
  EXPECT_THROW(t.piece_done(s1, nullptr), std::logic_error);  // not being read
}

TEST(SlotTable, MergedPiecesAreOneJobAndTheNextReadComesNext) {
  SlotTable t({8}, 4, [](int, int32_t) { return 4; });
  request_all(t, 0, {1, 2});
  const int s1 = t.slot_of(0, 1), s2 = t.slot_of(0, 2);
  SlotTable::Piece a, b;
  ASSERT_TRUE(t.next_piece(true, a));
  EXPECT_EQ(a.slot, s1);
  t.merge_pieces(s1);                  // (0,1) lands whole with piece 0's holder
  ASSERT_TRUE(t.next_piece(true, b));  // not (0,1)'s piece 1: (0,2)'s piece 0
  EXPECT_EQ(b.slot, s2);
  EXPECT_EQ(b.index, 0);
  EXPECT_TRUE(t.piece_done(s1, nullptr));  // the one piece finishes the read
  EXPECT_EQ(t.state(s1), SlotState::Resident);
  SlotTable::Piece c;
  ASSERT_TRUE(t.next_piece(true, c));                  // (0,2) was not merged: its piece 1
  EXPECT_THROW(t.merge_pieces(s2), std::logic_error);  // two pieces handed out
  EXPECT_EQ(c.index, 1);
  EXPECT_THROW(t.merge_pieces(t.slot_of(0, 1)), std::logic_error);  // not being read
  EXPECT_EQ(drain(t), std::vector<int>{});                          // (0,2)'s pieces 2 and 3, finished
  EXPECT_FALSE(t.piece_done(s2, nullptr));                          // piece 0
  EXPECT_TRUE(t.piece_done(s2, nullptr));                           // piece 1, the last
  EXPECT_EQ(t.reading(), 0);
  EXPECT_FALSE(t.has_open_jobs());
  EXPECT_EQ(t.stats().reads, 2u);
}

TEST(SlotTable, ZeroPieceReadIsResidentAtOnce) {
  SlotTable t({4}, 2, [](int, int32_t) { return 0; });
  request_all(t, 0, {0});
  SlotTable::Piece p;
  EXPECT_FALSE(t.next_piece(true, p));
  EXPECT_TRUE(t.take_finished());
  EXPECT_TRUE(t.resident(0, 0));
  EXPECT_EQ(t.reading(), 0);
  EXPECT_EQ(t.stats().reads, 1u);
}

TEST(SlotTable, FailedReadKeepsTheFirstErrorAndIsRetried) {
  SlotTable t({4}, 2, [](int, int32_t) { return 2; });
  request_all(t, 0, {2});
  const int s = t.slot_of(0, 2);
  SlotTable::Piece p;
  ASSERT_TRUE(t.next_piece(true, p));
  ASSERT_TRUE(t.next_piece(true, p));
  t.piece_done(s, std::make_exception_ptr(std::runtime_error("first")));
  t.piece_done(s, std::make_exception_ptr(std::runtime_error("second")));
  EXPECT_EQ(t.state(s), SlotState::Failed);
  ASSERT_TRUE(t.error(s));
  try {
    std::rethrow_exception(t.error(s));
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "first");
  }
  EXPECT_EQ(t.stats().reads, 0u);
  EXPECT_FALSE(t.resident(0, 2));
  t.release(0);
  EXPECT_EQ(t.request(0, 2), Outcome::Miss);  // retried in the same slot
  EXPECT_EQ(t.slot_of(0, 2), s);
  EXPECT_EQ(t.state(s), SlotState::Queued);
  EXPECT_FALSE(t.error(s));
  drain(t);
  EXPECT_TRUE(t.resident(0, 2));
  EXPECT_EQ(t.stats().misses, 2u);
}

TEST(SlotTable, ReleaseUnpinsAndLruOrderDecidesTheVictim) {
  SlotTable t({8}, 3);
  request_all(t, 0, {0, 1, 2});
  drain(t);
  const int s0 = t.slot_of(0, 0), s1 = t.slot_of(0, 1), s2 = t.slot_of(0, 2);
  EXPECT_TRUE(t.lru_order().empty());  // all pinned
  t.release(0);
  for (const int s : {s0, s1, s2}) EXPECT_EQ(t.pins(s), 0);
  EXPECT_EQ(t.lru_order(), (std::vector<int>{s0, s1, s2}));
  request_all(t, 0, {0});  // a hit refreshes (0,0)
  t.release(0);
  EXPECT_EQ(t.lru_order(), (std::vector<int>{s1, s2, s0}));
  request_all(t, 0, {5});  // miss: evicts the least recently used, (0,1)
  EXPECT_EQ(t.slot_of(0, 5), s1);
  EXPECT_EQ(t.slot_of(0, 1), -1);
  request_all(t, 0, {6});  // then (0,2)
  EXPECT_EQ(t.slot_of(0, 6), s2);
  EXPECT_EQ(t.lru_order(), (std::vector<int>{s0}));  // the pinned ones are not evictable
  t.release(0);
  EXPECT_EQ(t.stats().wasted, 0u);  // evicted experts were used
}

TEST(SlotTable, EmptySlotsAreTakenBeforeAnythingIsEvicted) {
  SlotTable t({8}, 3);
  request_all(t, 0, {0});
  drain(t);
  t.release(0);
  request_all(t, 0, {1});  // (0,0) is older than nothing: the empty slots have tick 0
  request_all(t, 0, {2});
  t.release(0);
  EXPECT_TRUE(t.resident(0, 0));
  EXPECT_EQ(t.stats().misses, 3u);
}

TEST(SlotTable, UnusedReadAheadEvictedIsWasted) {
  SlotTable t({8, 8}, 2);
  t.prefetch(1, std::vector<int32_t>{6});
  drain(t);
  // While layer 1 is unreleased the read-ahead is pending: an urgent miss takes a normal slot
  // first (here the empty one), then the pending read-ahead (it must make progress).
  request_all(t, 0, {0});
  drain(t);
  t.release(0);
  EXPECT_TRUE(t.resident(1, 6));
  request_all(t, 0, {1});  // oldest normal slot: (0,0), not the pending (1,6)
  EXPECT_EQ(t.slot_of(0, 0), -1);
  EXPECT_TRUE(t.resident(1, 6));
  request_all(t, 0, {2});  // only the pending read-ahead is left
  EXPECT_EQ(t.slot_of(1, 6), -1);
  EXPECT_EQ(t.stats().wasted, 1u);
  t.release(0);
  // After its layer is released an unused read-ahead is ordinary LRU (and still wasted).
  t.prefetch(1, std::vector<int32_t>{3});
  drain(t);
  t.release(1);
  EXPECT_EQ(t.lru_order().front(), t.slot_of(0, 2));
  request_all(t, 0, {4});
  request_all(t, 0, {5});
  t.release(0);
  EXPECT_EQ(t.stats().wasted, 2u);
  EXPECT_EQ(t.stats().dropped, 0u);
}

TEST(SlotTable, ReadAheadNeverEvictsPinnedSlotsOrItsOwnHead) {
  SlotTable t({8, 8}, 3);
  request_all(t, 0, {0, 1});
  drain(t);
  // one slot free: the prediction list places its head and stops
  t.prefetch(1, std::vector<int32_t>{4, 5, 6});
  EXPECT_GE(t.slot_of(1, 4), 0);
  EXPECT_EQ(t.slot_of(1, 5), -1);
  EXPECT_EQ(t.slot_of(1, 6), -1);
  EXPECT_EQ(t.pins(t.slot_of(0, 0)), 1);
  EXPECT_EQ(t.pins(t.slot_of(0, 1)), 1);
  // a second prediction does not evict the first (pending) one either
  t.prefetch(1, std::vector<int32_t>{7});
  EXPECT_EQ(t.slot_of(1, 7), -1);
  EXPECT_GE(t.slot_of(1, 4), 0);
  // prefetch of a resident expert protects it; one of a queued / pinned one changes nothing
  drain(t);
  t.prefetch(0, std::vector<int32_t>{0});
  EXPECT_EQ(t.pins(t.slot_of(0, 0)), 1);
  EXPECT_EQ(t.stats().dropped, 0u);
  EXPECT_EQ(t.stats().needed, 2u);
}

TEST(SlotTable, ReleaseAndCancelDropUnstartedReadAheads) {
  SlotTable t({8, 8, 8}, 8);
  t.prefetch(1, std::vector<int32_t>{0, 1, 2});
  t.prefetch(2, std::vector<int32_t>{0, 1});
  SlotTable::Piece p;
  ASSERT_TRUE(t.next_piece(true, p));  // (1,0) started: a started read always completes
  EXPECT_EQ(p.slot, t.slot_of(1, 0));
  t.release(1);
  EXPECT_EQ(t.stats().dropped, 2u);  // (1,1), (1,2)
  EXPECT_EQ(t.slot_of(1, 1), -1);
  EXPECT_EQ(t.slot_of(1, 2), -1);
  EXPECT_EQ(t.state(t.slot_of(1, 0)), SlotState::Reading);
  EXPECT_GE(t.slot_of(2, 0), 0);  // other layers' read-aheads stay
  t.cancel_prefetch();
  EXPECT_EQ(t.stats().dropped, 4u);
  EXPECT_EQ(t.slot_of(2, 0), -1);
  EXPECT_EQ(t.slot_of(2, 1), -1);
  t.piece_done(p.slot, nullptr);
  EXPECT_TRUE(t.resident(1, 0));
  EXPECT_FALSE(t.next_piece(true, p));
  // an urgent read is never dropped
  request_all(t, 2, {3});
  t.cancel_prefetch();
  EXPECT_EQ(t.state(t.slot_of(2, 3)), SlotState::Queued);
  EXPECT_EQ(t.stats().dropped, 4u);
}

TEST(SlotTable, AllPinnedThrowsAndChangesNothing) {
  SlotTable t({8}, 2);
  request_all(t, 0, {0, 1});
  EXPECT_THROW(t.request(0, 2), std::logic_error);
  EXPECT_EQ(t.stats().needed, 2u);
  EXPECT_EQ(t.stats().misses, 2u);
  EXPECT_EQ(t.slot_of(0, 2), -1);
}

TEST(SlotTable, BlockedWhileEveryUnpinnedSlotIsBeingRead) {
  SlotTable t({8, 8}, 2);
  request_all(t, 0, {0});
  t.prefetch(1, std::vector<int32_t>{3});
  drain(t);
  t.release(0);
  t.release(1);
  request_all(t, 1, {3});  // hit, pinned
  request_all(t, 0, {1});  // miss into (0,0)'s slot
  t.release(0);
  SlotTable::Piece p;
  ASSERT_TRUE(t.next_piece(true, p));  // (0,1) being read, unpinned
  EXPECT_EQ(t.request(0, 2), Outcome::Blocked);
  EXPECT_EQ(t.stats().needed, 3u);  // nothing counted
  EXPECT_EQ(t.slot_of(0, 2), -1);
  t.piece_done(p.slot, nullptr);
  EXPECT_EQ(t.request(0, 2), Outcome::Miss);
  EXPECT_EQ(t.slot_of(0, 2), p.slot);
  EXPECT_EQ(t.stats().needed, 4u);
}

TEST(SlotTable, FakeModeIsResidentAtOnceAndIgnoresPrefetch) {
  SlotTable t({8}, 2, {}, /*fake=*/true);
  EXPECT_EQ(t.request(0, 4), Outcome::Miss);
  EXPECT_TRUE(t.resident(0, 4));
  EXPECT_FALSE(t.take_new_work());
  SlotTable::Piece p;
  EXPECT_FALSE(t.next_piece(true, p));
  t.prefetch(0, std::vector<int32_t>{5});
  EXPECT_EQ(t.slot_of(0, 5), -1);
  t.release(0);
  EXPECT_EQ(t.request(0, 4), Outcome::Hit);
  EXPECT_EQ(t.stats().reads, 0u);
}

TEST(SlotTable, ResetEmptiesWithoutCountingWastedOrDropped) {
  SlotTable t({8, 8}, 4);
  t.prefetch(1, std::vector<int32_t>{1});
  drain(t);
  t.prefetch(1, std::vector<int32_t>{2});
  request_all(t, 0, {0});
  SlotTable::Piece p;
  ASSERT_TRUE(t.next_piece(true, p));  // (0,0) urgent first
  EXPECT_THROW(t.reset(), std::logic_error);
  t.drop_unstarted();  // (1,2) forgotten, not dropped
  t.piece_done(p.slot, nullptr);
  EXPECT_FALSE(t.has_open_jobs());
  t.reset();
  EXPECT_EQ(t.stats().wasted, 0u);
  EXPECT_EQ(t.stats().dropped, 0u);
  for (const int e : {0, 1, 2}) EXPECT_FALSE(t.resident(e == 0 ? 0 : 1, e));
  EXPECT_EQ(t.lru_order().size(), 4u);
  EXPECT_EQ(t.request(0, 0), Outcome::Miss);  // pins were cleared: no "already pinned" trouble
}

// ---- last-use events ----

TEST(SlotTable, SlotWithPendingLastUseIsNotReusedWhileAnotherIsFree) {
  SlotTable t({8, 8, 8}, 2);
  request_all(t, 0, {0});
  drain(t);
  auto ev = std::make_shared<ManualEvent>();
  t.release(0, ev);  // (0,0)'s slot may still be read by kernels until ev
  request_all(t, 1, {0});
  drain(t);
  t.release(1);  // reusable at once
  const int s_old = t.slot_of(0, 0), s_new = t.slot_of(1, 0);
  EXPECT_EQ(t.lru_order(), (std::vector<int>{s_old, s_new}));  // (0,0) is the LRU victim...
  request_all(t, 2, {0});
  EXPECT_EQ(t.slot_of(2, 0), s_new);  // ...but its event is pending: the other slot is taken
  EXPECT_TRUE(t.resident(0, 0));
  SlotTable::Piece p;
  ASSERT_TRUE(t.next_piece(true, p));
  EXPECT_EQ(p.reuse_after, nullptr);
  t.piece_done(p.slot, nullptr);
  t.release(2);
  // prefetch never takes a slot whose event is pending
  t.prefetch(1, std::vector<int32_t>{5});
  EXPECT_EQ(t.slot_of(1, 5), s_new);
  drain(t);
  t.release(1);
  t.prefetch(1, std::vector<int32_t>{6});
  EXPECT_EQ(t.slot_of(1, 6), s_new);  // the wasted (1,5), never s_old
  EXPECT_TRUE(t.resident(0, 0));
  drain(t);
  t.release(1);
  // the event done: the slot is an ordinary LRU victim again, and its read waits for nothing
  ev->complete();
  request_all(t, 2, {1});
  EXPECT_EQ(t.slot_of(2, 1), s_old);
  ASSERT_TRUE(t.next_piece(true, p));
  EXPECT_EQ(p.slot, s_old);
  EXPECT_EQ(p.reuse_after, nullptr);
}

TEST(SlotTable, NothingElseFreeTakesTheOldestPendingEventAndTheReadWaitsForIt) {
  SlotTable t({8, 8, 8}, 2, [](int, int32_t) { return 2; });
  auto ev0 = std::make_shared<ManualEvent>(), ev1 = std::make_shared<ManualEvent>();
  request_all(t, 1, {0});
  request_all(t, 0, {0});
  drain(t);
  t.release(0, ev0);  // the older event, on the more recently used slot
  t.release(1, ev1);
  const int s0 = t.slot_of(0, 0), s1 = t.slot_of(1, 0);
  // both slots' events are pending: the one recorded first is taken, and its pieces carry it
  EXPECT_EQ(t.request(2, 0), Outcome::Miss);
  EXPECT_EQ(t.slot_of(2, 0), s0);
  EXPECT_EQ(t.slot_of(0, 0), -1);
  SlotTable::Piece p;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(t.next_piece(true, p));
    EXPECT_EQ(p.slot, s0);
    EXPECT_EQ(p.reuse_after, ev0);
  }
  t.piece_done(s0, nullptr);
  t.piece_done(s0, nullptr);
  t.release(2);
  // releases with a null event add nothing to wait for: both slots keep their pending events
  EXPECT_EQ(t.request(1, 0), Outcome::Hit);
  t.release(1);
  EXPECT_EQ(t.request(2, 1), Outcome::Miss);  // again the slot of the oldest event, s0
  EXPECT_EQ(t.slot_of(2, 1), s0);
  ASSERT_TRUE(t.next_piece(true, p));
  EXPECT_EQ(p.slot, s0);
  EXPECT_EQ(p.reuse_after, ev0);
  // ev0 done: s0 is taken although s1 is less recently used, since s1 still waits for ev1
  ev0->complete();
  drain(t);
  t.piece_done(s0, nullptr);
  t.release(2);
  EXPECT_EQ(t.lru_order(), (std::vector<int>{s1, s0}));
  EXPECT_EQ(t.request(0, 5), Outcome::Miss);
  EXPECT_EQ(t.slot_of(0, 5), s0);
  ASSERT_TRUE(t.next_piece(true, p));
  EXPECT_EQ(p.reuse_after, nullptr);
  EXPECT_TRUE(t.resident(1, 0));
}

TEST(SlotTable, DoneEventsAreForgottenAndResetKeepsPendingOnes) {
  SlotTable t({8}, 2);
  auto ev = std::make_shared<ManualEvent>();
  request_all(t, 0, {0, 1});
  drain(t);
  t.release(0, ev);
  t.reset();  // the arena's memory is still in use: the events stay with the slots
  EXPECT_EQ(t.request(0, 2), Outcome::Miss);
  SlotTable::Piece p;
  ASSERT_TRUE(t.next_piece(true, p));
  EXPECT_EQ(p.reuse_after, ev);  // both slots pending: the oldest event's slot, carrying it
  t.piece_done(p.slot, nullptr);
  t.release(0);
  ev->complete();
  const int polls = ev->polls;
  request_all(t, 0, {3});  // seen done once, then forgotten
  request_all(t, 0, {4});
  EXPECT_LE(ev->polls, polls + 2);
  drain(t);
  t.release(0);
}
