#include "rpc/call_table.h"

#include <vector>

#include "gtest/gtest.h"

namespace swirl::internal {
namespace {

class CallTableTest : public ::testing::Test {
 protected:
  void SetUp() override { table_.Init(4); }
  CallTable table_;
  ClientCall calls_[8];
};

TEST_F(CallTableTest, AdmittedCallsAreFoundByCallAndStrangersAreNot) {
  CallState& a = table_.Admit(&calls_[0]);
  CallState& b = table_.Admit(&calls_[1]);
  EXPECT_EQ(table_.StateOf(&calls_[0]), &a);
  EXPECT_EQ(table_.StateOf(&calls_[1]), &b);
  EXPECT_EQ(table_.StateOf(&calls_[2]), nullptr);
  EXPECT_EQ(table_.admitted(), 2u);
  table_.Retire(a);
  EXPECT_EQ(table_.StateOf(&calls_[0]), nullptr) << "a retired call is a stranger";
  EXPECT_EQ(table_.admitted(), 1u);
}

TEST_F(CallTableTest, RequestIdsNameTheirSlotAndAFreshGenerationEachTime) {
  CallState& s = table_.Admit(&calls_[0]);
  const uint64_t first = table_.Allocate(s);
  EXPECT_EQ(table_.Find(first), &s);
  EXPECT_EQ(table_.in_flight(), 1u);
  table_.Release(s);
  EXPECT_EQ(s.request_id, 0u);
  EXPECT_EQ(table_.Find(first), nullptr) << "a released slot answers to nobody";
  const uint64_t second = table_.Allocate(s);
  EXPECT_EQ(static_cast<uint32_t>(second), static_cast<uint32_t>(first)) << "same slot reused";
  EXPECT_NE(second, first) << "but under a new generation";
  // A late answer to the first use of the slot finds nothing, and is not "never made".
  EXPECT_EQ(table_.Find(first), nullptr);
  EXPECT_FALSE(table_.NeverMade(first));
  EXPECT_EQ(table_.Find(second), &s);
}

TEST_F(CallTableTest, IdsFromTheFutureOrBeyondTheTableWereNeverMade) {
  CallState& s = table_.Admit(&calls_[0]);
  const uint64_t id = table_.Allocate(s);
  EXPECT_FALSE(table_.NeverMade(id));
  EXPECT_TRUE(table_.NeverMade(id + (uint64_t{1} << 32))) << "a generation not reached yet";
  EXPECT_TRUE(table_.NeverMade((uint64_t{1} << 32) | 4)) << "slot 4 of a 4-slot table";
  EXPECT_TRUE(table_.NeverMade((uint64_t{1} << 32) | 0xffffffffu));
}

TEST_F(CallTableTest, GenerationsCompareAcrossTheWrap) {
  CallState& s = table_.Admit(&calls_[0]);
  uint64_t id = 0;
  // Far more uses of one slot than generations of 32 bits would allow without wrapping is not
  // practical here; instead check the comparison at the edge directly: generation 0xffffffff
  // is behind generation 1 once the slot has wrapped to 1.
  for (int i = 0; i < 3; ++i) {
    id = table_.Allocate(s);
    table_.Release(s);
  }
  const uint32_t slot = static_cast<uint32_t>(id);
  const uint64_t old_generation = (uint64_t{0xffffffffu} << 32) | slot;
  EXPECT_FALSE(table_.NeverMade(old_generation)) << "an old generation, modulo 2^32";
}

TEST_F(CallTableTest, FullWhenEverySlotIsTaken) {
  std::vector<CallState*> states;
  for (int i = 0; i < 4; ++i) {
    states.push_back(&table_.Admit(&calls_[i]));
    EXPECT_FALSE(table_.full());
    table_.Allocate(*states.back());
  }
  EXPECT_TRUE(table_.full());
  table_.Release(*states[2]);
  EXPECT_FALSE(table_.full());
  EXPECT_EQ(table_.in_flight(), 3u);
}

TEST_F(CallTableTest, BacklogKeepsOrderAndRemovesFromAnywhere) {
  CallState* s[4];
  for (int i = 0; i < 4; ++i) {
    s[i] = &table_.Admit(&calls_[i]);
    table_.PushBack(*s[i]);
  }
  EXPECT_TRUE(table_.Remove(*s[3])) << "the tail";
  EXPECT_TRUE(table_.Remove(*s[1])) << "the middle";
  EXPECT_FALSE(table_.Remove(*s[1])) << "not there any more";
  CallState& e = table_.Admit(&calls_[4]);
  table_.PushBack(e);  // after a removed tail: the tail must have moved back
  EXPECT_EQ(table_.backlog_front(), s[0]);
  table_.PopFront();
  EXPECT_EQ(table_.backlog_front(), s[2]);
  table_.PopFront();
  EXPECT_EQ(table_.backlog_front(), &e);
  table_.PushFront(*s[0]);
  EXPECT_EQ(table_.backlog_front(), s[0]);
  table_.PopFront();
  table_.PopFront();
  EXPECT_TRUE(table_.backlog_empty());
}

TEST_F(CallTableTest, UnlinkTakesTheSelectedAndLeavesTheRestLinked) {
  CallState* s[5];
  for (int i = 0; i < 5; ++i) {
    s[i] = &table_.Admit(&calls_[i]);
    table_.PushBack(*s[i]);
  }
  std::vector<CallState*> out =
      table_.Unlink([&](const CallState& st) { return &st == s[0] || &st == s[4]; });
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0], s[0]);
  EXPECT_EQ(out[1], s[4]);
  // The tail is s[3] now: a call pushed joins after it.
  CallState& f = table_.Admit(&calls_[5]);
  table_.PushBack(f);
  std::vector<CallState*> order;
  while (CallState* front = table_.backlog_front()) {
    order.push_back(front);
    table_.PopFront();
  }
  EXPECT_EQ(order, (std::vector<CallState*>{s[1], s[2], s[3], &f}));
}

TEST_F(CallTableTest, AllListsInFlightThenBacklogAndClearEmptiesBoth) {
  CallState& a = table_.Admit(&calls_[0]);
  CallState& b = table_.Admit(&calls_[1]);
  CallState& c = table_.Admit(&calls_[2]);
  table_.Allocate(a);
  table_.PushBack(b);
  table_.Allocate(c);
  std::vector<CallState*> all = table_.All();
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[2], &b) << "the backlog comes last";
  table_.Clear();
  EXPECT_EQ(table_.in_flight(), 0u);
  EXPECT_TRUE(table_.backlog_empty());
  EXPECT_EQ(a.request_id, 0u);
  EXPECT_EQ(b.next, CallState::kNone);
  EXPECT_EQ(table_.admitted(), 3u) << "cleared calls stay admitted until retired";
}

TEST_F(CallTableTest, StatesStayPutWhileMoreAreAdmitted) {
  CallState& first = table_.Admit(&calls_[0]);
  first.request_window = 7;
  ClientCall more[64];
  for (ClientCall& call : more) table_.Admit(&call);
  EXPECT_EQ(table_.StateOf(&calls_[0]), &first);
  EXPECT_EQ(first.request_window, 7);
}

TEST_F(CallTableTest, RetireResetsWhatTheCallHeldAndReusesTheState) {
  CallState& s = table_.Admit(&calls_[0]);
  s.request_window = 3;
  s.read_op = 5;
  s.abandoned = absl::CancelledError("x");
  table_.Retire(s);
  CallState& again = table_.Admit(&calls_[1]);
  EXPECT_EQ(&again, &s) << "the state is reused";
  EXPECT_EQ(again.request_window, -1);
  EXPECT_EQ(again.read_op, -1);
  EXPECT_TRUE(again.abandoned.ok());
  EXPECT_EQ(again.call, &calls_[1]);
}

TEST_F(CallTableTest, ForEachInFlightMayReleaseAsItGoes) {
  CallState* s[4];
  for (int i = 0; i < 4; ++i) {
    s[i] = &table_.Admit(&calls_[i]);
    table_.Allocate(*s[i]);
  }
  int visited = 0;
  table_.ForEachInFlight([&](CallState& st) {
    ++visited;
    table_.Release(st);
  });
  EXPECT_EQ(visited, 4);
  EXPECT_EQ(table_.in_flight(), 0u);
}

}  // namespace
}  // namespace swirl::internal
