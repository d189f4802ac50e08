#include "rpc/credit_ledger.h"

#include "gtest/gtest.h"

namespace swirl::internal {
namespace {

TEST(CreditLedgerTest, EachMessageSpendsOneCreditAndCarriesWhatIsOwed) {
  CreditLedger ledger;
  ledger.Init(/*peer_grant=*/4, /*local_grant=*/8);
  EXPECT_EQ(ledger.send_credits(), 4u);
  ASSERT_TRUE(ledger.OnReceive(0).ok());
  ASSERT_TRUE(ledger.OnReceive(0).ok());
  EXPECT_EQ(ledger.owed(), 2u);
  EXPECT_EQ(ledger.Spend(), 2u) << "everything owed rides on the next message";
  EXPECT_EQ(ledger.owed(), 0u);
  EXPECT_EQ(ledger.send_credits(), 3u);
  EXPECT_EQ(ledger.Spend(), 0u);
}

TEST(CreditLedgerTest, ThePeerMaySendOnlyWhatItWasGiven) {
  CreditLedger ledger;
  ledger.Init(4, /*local_grant=*/2);
  ASSERT_TRUE(ledger.OnReceive(0).ok());
  ASSERT_TRUE(ledger.OnReceive(0).ok());
  const absl::Status beyond = ledger.OnReceive(0);
  EXPECT_EQ(beyond.code(), absl::StatusCode::kResourceExhausted) << beyond;
  // Once we give the two back (on a message of ours), it may send two more.
  CreditLedger fresh;
  fresh.Init(4, 2);
  ASSERT_TRUE(fresh.OnReceive(0).ok());
  ASSERT_TRUE(fresh.OnReceive(0).ok());
  EXPECT_EQ(fresh.Spend(), 2u);
  EXPECT_TRUE(fresh.OnReceive(0).ok());
  EXPECT_TRUE(fresh.OnReceive(0).ok());
  EXPECT_FALSE(fresh.OnReceive(0).ok());
}

TEST(CreditLedgerTest, ThePeerMayNotReturnCreditsWeNeverSpent) {
  CreditLedger ledger;
  ledger.Init(/*peer_grant=*/4, 8);
  ledger.Spend();
  ledger.Spend();
  EXPECT_TRUE(ledger.OnReceive(1).ok());
  EXPECT_EQ(ledger.send_credits(), 3u);
  const absl::Status too_many = ledger.OnReceive(2);
  EXPECT_EQ(too_many.code(), absl::StatusCode::kInvalidArgument) << too_many;
  EXPECT_EQ(ledger.send_credits(), 3u) << "a refused message changes nothing";
}

TEST(CreditLedgerTest, ACallNeedsTwoCreditsAndAReturnOne) {
  CreditLedger ledger;
  ledger.Init(2, 8);
  EXPECT_TRUE(ledger.CanSendCall());
  ledger.Spend();
  EXPECT_FALSE(ledger.CanSendCall()) << "the last credit is kept for returning credits";
  EXPECT_TRUE(ledger.CanSend());
  ledger.Spend();
  EXPECT_FALSE(ledger.CanSend());
}

TEST(CreditLedgerTest, ACreditMessageIsDueOnceHalfTheGrantIsOwed) {
  CreditLedger ledger;
  ledger.Init(8, /*local_grant=*/8);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(ledger.OnReceive(0).ok());
    EXPECT_FALSE(ledger.ShouldReturn()) << i;
  }
  ASSERT_TRUE(ledger.OnReceive(0).ok());
  EXPECT_TRUE(ledger.ShouldReturn());
  ledger.Spend();
  EXPECT_FALSE(ledger.ShouldReturn());
  CreditLedger tiny;
  tiny.Init(1, 1);
  ASSERT_TRUE(tiny.OnReceive(0).ok());
  EXPECT_TRUE(tiny.ShouldReturn()) << "a grant of one is returned at once";
}

TEST(CreditLedgerTest, ParkedMessagesLeaveInOrderOnlyWithCredits) {
  CreditLedger ledger;
  ledger.Init(1, 8);
  EXPECT_FALSE(ledger.MustPark());
  ledger.Spend();
  EXPECT_TRUE(ledger.MustPark()) << "no credit";
  ledger.Park({1, 40, 0, 0});
  ledger.Park({2, 40, 0x1234, 0});
  ParkedMessage m;
  EXPECT_FALSE(ledger.Unpark(&m)) << "still no credit";
  ASSERT_TRUE(ledger.OnReceive(1).ok());
  EXPECT_TRUE(ledger.MustPark()) << "a credit, but older messages wait: they go first";
  ASSERT_TRUE(ledger.Unpark(&m));
  EXPECT_EQ(m.buffer, 1u);
  ledger.Spend();
  EXPECT_FALSE(ledger.Unpark(&m));
  ASSERT_TRUE(ledger.OnReceive(1).ok());
  ASSERT_TRUE(ledger.Unpark(&m));
  EXPECT_EQ(m.buffer, 2u);
  EXPECT_EQ(m.invalidate_rkey, 0x1234u);
  EXPECT_EQ(ledger.parked(), 0u);
}

TEST(CreditLedgerTest, ParkedMessagesHoldTheGate) {
  Gate gate;
  CreditLedger ledger;
  ledger.set_gate(&gate);
  ledger.Init(1, 8);
  ledger.Spend();  // none left: what is emitted now parks
  ledger.Park({1, 1, 0, 0});
  ledger.Park({2, 1, 0, 0});
  ledger.Park({3, 1, 0, 0});
  EXPECT_EQ(gate.count(), 3u);
  ASSERT_TRUE(ledger.OnReceive(1).ok());
  ParkedMessage m;
  ASSERT_TRUE(ledger.Unpark(&m));
  EXPECT_EQ(gate.count(), 2u);
  ledger.TakeParked();
  EXPECT_EQ(gate.count(), 0u);
}

TEST(CreditLedgerTest, TakeParkedEmptiesTheQueue) {
  CreditLedger ledger;
  ledger.Init(0, 8);
  ledger.Park({7, 1, 0, 0});
  ledger.Park({8, 1, 0, 0});
  EXPECT_EQ(ledger.TakeParked().size(), 2u);
  EXPECT_EQ(ledger.parked(), 0u);
}


// ---- The shared pool ----

// A connection granted only its floor at first, with `pool` to grow from: the peer holds 4
// (of a negotiated 32) and we owe it nothing.
CreditLedger Pooled(CreditPool* pool) {
  CreditLedger ledger;
  ledger.Init({.peer_grant = 32, .local_grant = 32, .local_initial = kCreditFloor, .pool = pool});
  return ledger;
}

TEST(CreditPoolTest, TakesNoMoreThanItHas) {
  CreditPool pool;
  pool.Init(10);
  EXPECT_EQ(pool.Take(4), 4u);
  EXPECT_EQ(pool.Take(8), 6u) << "what is left";
  EXPECT_EQ(pool.Take(1), 0u);
  pool.Give(3);
  EXPECT_EQ(pool.available(), 3u);
}

TEST(CreditLedgerTest, ASequentialCallerNeverTakesFromThePool) {
  CreditPool pool;
  pool.Init(100);
  CreditLedger ledger = Pooled(&pool);
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(ledger.OnReceive(i == 0 ? 0 : 1).ok());  // a request, returning our last
    EXPECT_EQ(ledger.Spend(), 1u) << "the response returns its credit";
  }
  EXPECT_EQ(ledger.allotted(), kCreditFloor);
  EXPECT_EQ(pool.available(), 100u);
}

TEST(CreditLedgerTest, APeerThatRunsLowGrowsFromThePoolUpToItsGrant) {
  CreditPool pool;
  pool.Init(1000);
  CreditLedger ledger = Pooled(&pool);
  // Three requests in flight leave the peer one credit: below half, so we lend it more, which
  // goes back with what is owed.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(ledger.OnReceive(0).ok());
  EXPECT_EQ(ledger.allotted(), 2 * kCreditFloor);
  EXPECT_EQ(pool.available(), 1000u - kCreditFloor);
  EXPECT_TRUE(ledger.ShouldReturn()) << "the new credits must reach the peer";
  EXPECT_EQ(ledger.Spend(), 3u + kCreditFloor);
  EXPECT_EQ(ledger.peer_holds(), 2 * kCreditFloor);
  // Keep it pipelining: it doubles, and stops at the negotiated grant.
  for (int round = 0; round < 10; ++round) {
    const uint32_t holds = ledger.peer_holds();
    for (uint32_t i = 0; i < holds; ++i) ASSERT_TRUE(ledger.OnReceive(0).ok());
    ledger.Spend();
  }
  EXPECT_EQ(ledger.allotted(), 32u);
  EXPECT_EQ(pool.available(), 1000u - (32u - kCreditFloor));
  EXPECT_EQ(ledger.borrowed(), 32u - kCreditFloor);
}

TEST(CreditLedgerTest, AFloodingPeerGetsItsGrantAndNoMore) {
  CreditPool pool;
  pool.Init(1000);
  CreditLedger ledger = Pooled(&pool);
  // The peer spends everything it holds, always: it can never hold more than 32, and sending
  // beyond what it holds is refused.
  for (int round = 0; round < 20; ++round) {
    const uint32_t holds = ledger.peer_holds();
    for (uint32_t i = 0; i < holds; ++i) ASSERT_TRUE(ledger.OnReceive(0).ok());
    EXPECT_EQ(ledger.OnReceive(0).code(), absl::StatusCode::kResourceExhausted);
    ledger.Spend();
    EXPECT_LE(ledger.peer_holds(), 32u);
  }
  EXPECT_EQ(pool.available(), 1000u - (32u - kCreditFloor));
}

TEST(CreditLedgerTest, AnEmptyPoolLeavesTheFloor) {
  CreditPool pool;
  pool.Init(0);
  CreditLedger ledger = Pooled(&pool);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(ledger.OnReceive(0).ok());
  EXPECT_EQ(ledger.allotted(), kCreditFloor) << "nothing to lend";
  EXPECT_EQ(ledger.Spend(), 3u);
  EXPECT_TRUE(ledger.CanSendCall());
}

TEST(CreditLedgerTest, AQuietConnectionGivesWhatItBorrowedBack) {
  CreditPool pool;
  pool.Init(100);
  CreditLedger ledger;
  // Granted everything at first (the pool had room): 28 borrowed.
  ledger.Init({.peer_grant = 32, .local_grant = 32, .local_initial = 32, .pool = &pool});
  pool.Take(32 - kCreditFloor);
  ASSERT_EQ(ledger.borrowed(), 32u - kCreditFloor);
  // Two messages, owed back: a reclaim after them finds it quiet and keeps those two.
  ASSERT_TRUE(ledger.OnReceive(0).ok());
  ASSERT_TRUE(ledger.OnReceive(0).ok());
  EXPECT_EQ(ledger.Reclaim(), 2u);
  EXPECT_EQ(ledger.owed(), 0u);
  EXPECT_EQ(pool.available(), 100u - 28u + 2u);
  // The peer's 30 come back one message at a time, each withheld, down to the floor.
  for (int i = 0; i < 26; ++i) ASSERT_TRUE(ledger.OnReceive(0).ok());
  EXPECT_EQ(ledger.allotted(), kCreditFloor);
  EXPECT_EQ(ledger.owed(), 0u) << "nothing returned while shrinking";
  EXPECT_EQ(ledger.peer_holds(), kCreditFloor);
  EXPECT_EQ(pool.available(), 100u);
  // At the floor, messages are returned again.
  ASSERT_TRUE(ledger.OnReceive(0).ok());
  EXPECT_EQ(ledger.Spend(), 1u);
}

TEST(CreditLedgerTest, ABusyConnectionKeepsWhatItBorrowed) {
  CreditPool pool;
  pool.Init(100);
  CreditLedger ledger;
  ledger.Init({.peer_grant = 32, .local_grant = 32, .local_initial = 32, .pool = &pool});
  pool.Take(32 - kCreditFloor);
  for (int i = 0; i < 16; ++i) ASSERT_TRUE(ledger.OnReceive(0).ok());
  EXPECT_EQ(ledger.Reclaim(), 0u) << "half its allotment since the last look: not quiet";
  EXPECT_EQ(ledger.allotted(), 32u);
  EXPECT_EQ(ledger.Reclaim(), 16u) << "quiet since the last look: what it is owed goes back";
  EXPECT_EQ(ledger.allotted(), 16u);
}

TEST(CreditLedgerTest, GrantsBeyondOurSendQueueAreHeldButNeverSpent) {
  CreditLedger ledger;
  ledger.Init({.peer_grant = 64, .peer_initial = 8, .send_cap = 16, .local_grant = 8});
  EXPECT_EQ(ledger.send_credits(), 8u);
  ASSERT_TRUE(ledger.OnReceive(40).ok()) << "the peer may grant up to 64";
  EXPECT_EQ(ledger.send_credits(), 16u) << "our send queue takes 16";
  EXPECT_EQ(ledger.OnReceive(17).code(), absl::StatusCode::kInvalidArgument)
      << "48 held (16 usable), 17 more exceed the 64 granted";
}

}  // namespace
}  // namespace swirl::internal
