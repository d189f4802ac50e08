#include "rpc/window_table.h"

#include <set>

#include "absl/random/random.h"
#include "base/check.h"
#include "gtest/gtest.h"

namespace swirl::internal {
namespace {

const absl::Time kNow = absl::FromUnixSeconds(5000);

class WindowTableTest : public ::testing::Test {
 protected:
  void SetUp() override { table_.Init(4); }
  // A window without a device behind it, with the key a device would have given it.
  int32_t AddWindow(uint32_t index) {
    EXPECT_EQ(table_.TakeFree(), -1);
    return table_.Add(nullptr, (index << 8) | 0x11);
  }
  uint32_t Expose(int32_t w, Window::Purpose purpose, uint64_t request_id = 0,
                  absl::Time lease = absl::InfiniteFuture()) {
    const uint32_t rkey = table_.NextRkey(w, gen_);
    table_.Expose(w, rkey, 0x1000 * (w + 1), 4096, purpose, request_id, lease);
    return rkey;
  }
  WindowTable table_;
  absl::BitGen gen_;
};

TEST_F(WindowTableTest, ExposedWindowsAreFoundByTheirCurrentKeyOnly) {
  const int32_t w = AddWindow(7);
  const uint32_t first = Expose(w, Window::Purpose::kDownload, 42);
  EXPECT_EQ(first >> 8, 7u) << "the index bits stay";
  EXPECT_EQ(table_.FindExposed(first), w);
  EXPECT_EQ(table_.FindExposed(first ^ 0x100), -1) << "another window's index";
  table_.Free(w);
  EXPECT_EQ(table_.FindExposed(first), -1) << "a free window exposes nothing";
  EXPECT_EQ(table_.TakeFree(), w);
  const uint32_t second = Expose(w, Window::Purpose::kDownload, 43);
  EXPECT_NE(second, first) << "a fresh key per binding";
  EXPECT_EQ(table_.FindExposed(first), -1) << "the old key names nothing";
  EXPECT_EQ(table_.FindExposed(second), w);
}

TEST_F(WindowTableTest, TheKeyByteNeverRepeatsThePreviousOne) {
  const int32_t w = AddWindow(1);
  std::set<uint32_t> seen;
  uint32_t previous = table_.at(w).rkey;
  for (int i = 0; i < 2000; ++i) {
    const uint32_t rkey = Expose(w, Window::Purpose::kGrant);
    EXPECT_NE(rkey, previous);
    EXPECT_EQ(rkey >> 8, 1u);
    seen.insert(rkey & 0xff);
    previous = rkey;
    table_.Free(w);
    ASSERT_EQ(table_.TakeFree(), w);
  }
  EXPECT_GT(seen.size(), 200u) << "key bytes are drawn, not counted through a few values";
}

TEST_F(WindowTableTest, RevokingWindowsAreNotFoundAndCountAsTransfers) {
  const int32_t w = AddWindow(2);
  const uint32_t rkey = Expose(w, Window::Purpose::kDownload, 9);
  EXPECT_EQ(table_.transfers(), 1u);
  table_.BeginRevoke(w, /*op=*/3);
  EXPECT_EQ(table_.at(w).state, Window::State::kRevoking);
  EXPECT_EQ(table_.at(w).revoke_op, 3);
  EXPECT_EQ(table_.FindExposed(rkey), -1) << "no ack may name a window being revoked";
  EXPECT_EQ(table_.transfers(), 1u);
  table_.Free(w);
  EXPECT_EQ(table_.transfers(), 0u);
  EXPECT_EQ(table_.at(w).revoke_op, -1);
}

TEST_F(WindowTableTest, AnUnusedGrantIsNotATransferUnderWay) {
  const int32_t w = AddWindow(3);
  Expose(w, Window::Purpose::kGrant);
  EXPECT_EQ(table_.transfers(), 0u);
  EXPECT_EQ(table_.live(), 1u);
}

TEST_F(WindowTableTest, TransfersHoldTheGateUntilFreedOrCleared) {
  Gate gate;
  table_.set_gate(&gate);
  const int32_t a = AddWindow(1);
  const int32_t b = AddWindow(2);
  const int32_t g = AddWindow(3);
  Expose(a, Window::Purpose::kDownload, 1);
  Expose(b, Window::Purpose::kMirrorReply, 2);
  Expose(g, Window::Purpose::kGrant);
  EXPECT_EQ(gate.count(), 2u) << "a grant nobody used is no work under way";
  table_.BeginRevoke(a, 0);
  EXPECT_EQ(gate.count(), 2u) << "still under way while its revocation is";
  table_.Free(a);
  EXPECT_EQ(gate.count(), 1u);
  table_.Free(g);
  EXPECT_EQ(gate.count(), 1u);
  table_.Clear();
  EXPECT_EQ(gate.count(), 0u) << "a connection's end releases what it held";
}

TEST_F(WindowTableTest, LeasesExpireInOrderAndGrantsNever) {
  const int32_t a = AddWindow(1);
  const int32_t b = AddWindow(2);
  const int32_t g = AddWindow(3);
  Expose(a, Window::Purpose::kDownload, 1, kNow + absl::Seconds(1));
  Expose(b, Window::Purpose::kMirrorRequest, 2, kNow + absl::Seconds(5));
  Expose(g, Window::Purpose::kGrant);
  std::vector<int32_t> expired;
  table_.ForEachExpired(kNow, [&](int32_t w) { expired.push_back(w); });
  EXPECT_TRUE(expired.empty());
  table_.ForEachExpired(kNow + absl::Seconds(2), [&](int32_t w) { expired.push_back(w); });
  EXPECT_EQ(expired, (std::vector<int32_t>{a}));
  expired.clear();
  table_.BeginRevoke(a, 0);
  table_.ForEachExpired(kNow + absl::Hours(1), [&](int32_t w) { expired.push_back(w); });
  EXPECT_EQ(expired, (std::vector<int32_t>{b})) << "only exposed windows expire; grants never";
}

TEST_F(WindowTableTest, GrowsToItsLimitAndReusesFreedWindows) {
  for (uint32_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(table_.can_grow());
    AddWindow(i + 1);
  }
  EXPECT_FALSE(table_.can_grow());
  EXPECT_EQ(table_.TakeFree(), -1);
  table_.PutBack(2);  // taken, never bound
  EXPECT_EQ(table_.TakeFree(), 2);
}

TEST_F(WindowTableTest, FreeingGivesTheBufferBackAndClearForgetsEverything) {
  const int32_t a = AddWindow(1);
  const int32_t b = AddWindow(2);
  Expose(a, Window::Purpose::kDownload, 1);
  Expose(b, Window::Purpose::kGrant);
  table_.BeginRevoke(a, 0);
  EXPECT_EQ(table_.live(), 2u);
  EXPECT_EQ(table_.Clear(), 2u) << "both were live";
  EXPECT_TRUE(table_.empty());
  EXPECT_EQ(table_.live(), 0u);
}

#if SWIRL_DCHECK_IS_ON
TEST_F(WindowTableTest, IllegalTransitionsAbortInDebugBuilds) {
  const int32_t w = AddWindow(1);
  EXPECT_DEATH(table_.BeginRevoke(w, 0), "kExposed") << "revoking a free window";
  EXPECT_DEATH(table_.Free(w), "kFree") << "freeing a free window";
  Expose(w, Window::Purpose::kDownload, 1);
  EXPECT_DEATH(Expose(w, Window::Purpose::kDownload, 1), "kFree") << "binding an exposed one";
}
#endif

TEST(UploadGrantsTest, TheSmallestGrantThatFitsIsUsed) {
  UploadGrants grants;
  grants.Add({0x1000, 65536, 1});
  grants.Add({0x2000, 4096, 2});
  grants.Add({0x3000, 16384, 3});
  EXPECT_EQ(grants.BestFit(100000), -1);
  const int i = grants.BestFit(5000);
  ASSERT_GE(i, 0);
  EXPECT_EQ(grants.Take(i).rkey, 3u);
  EXPECT_EQ(grants.size(), 2u);
  EXPECT_EQ(grants.Take(grants.BestFit(1)).rkey, 2u);
  EXPECT_EQ(grants.Take(grants.BestFit(1)).rkey, 1u);
  EXPECT_EQ(grants.BestFit(1), -1);
}

}  // namespace
}  // namespace swirl::internal
