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

}  // namespace
}  // namespace swirl::internal
