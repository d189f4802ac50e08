#include "gtest/gtest.h"
#include "rpc/connection.h"

namespace swirl::internal {
namespace {

using Verdict = Liveness::Verdict;

const absl::Time kStart = absl::FromUnixSeconds(1000);
const Liveness::Timeouts kTimeouts{absl::Seconds(5), absl::Seconds(10)};

TEST(LivenessTest, APeerThatSpeaksIsAlive) {
  Liveness l;
  l.Activate(kStart);
  for (int s = 1; s < 60; ++s) {
    l.OnReceive();
    EXPECT_EQ(l.Tick(kStart + absl::Seconds(s), kTimeouts, /*is_server=*/true), Verdict::kAlive);
  }
}

TEST(LivenessTest, SilencePingsOnceThenFailsAfterThreeKeepalives) {
  Liveness l;
  l.Activate(kStart);
  l.OnReceive();
  EXPECT_EQ(l.Tick(kStart, kTimeouts, false), Verdict::kAlive);
  EXPECT_EQ(l.Tick(kStart + absl::Seconds(5), kTimeouts, false), Verdict::kAlive) << "not yet";
  EXPECT_EQ(l.Tick(kStart + absl::Seconds(6), kTimeouts, false), Verdict::kSendPing);
  EXPECT_EQ(l.Tick(kStart + absl::Seconds(7), kTimeouts, false), Verdict::kAlive)
      << "one ping outstanding at a time";
  EXPECT_EQ(l.Tick(kStart + absl::Seconds(21), kTimeouts, false), Verdict::kAlive);
  EXPECT_EQ(l.Tick(kStart + absl::Seconds(22), kTimeouts, false), Verdict::kStoppedAnswering);
}

TEST(LivenessTest, APongOrAnyMessageEndsTheWait) {
  Liveness l;
  l.Activate(kStart);
  l.OnReceive();
  l.Tick(kStart, kTimeouts, false);
  ASSERT_EQ(l.Tick(kStart + absl::Seconds(6), kTimeouts, false), Verdict::kSendPing);
  l.OnReceive();  // the pong arrives (it is a message too)
  l.OnPong();
  EXPECT_EQ(l.Tick(kStart + absl::Seconds(30), kTimeouts, false), Verdict::kAlive);
  EXPECT_EQ(l.Tick(kStart + absl::Seconds(36), kTimeouts, false), Verdict::kSendPing)
      << "silence is measured from the last message";
}

TEST(LivenessTest, AServerFailsAClientThatNeverSpeaks) {
  Liveness l;
  l.Activate(kStart);
  EXPECT_NE(l.Tick(kStart + absl::Seconds(10), kTimeouts, /*is_server=*/true),
            Verdict::kSilentClient);
  EXPECT_EQ(l.Tick(kStart + absl::Seconds(11), kTimeouts, true), Verdict::kSilentClient);
  Liveness client;
  client.Activate(kStart);
  EXPECT_NE(client.Tick(kStart + absl::Seconds(11), kTimeouts, /*is_server=*/false),
            Verdict::kSilentClient)
      << "only servers wait for the other side's first word";
  Liveness spoke;
  spoke.Activate(kStart);
  spoke.OnReceive();
  spoke.Tick(kStart + absl::Seconds(1), kTimeouts, true);
  EXPECT_NE(spoke.Tick(kStart + absl::Seconds(11), kTimeouts, true), Verdict::kSilentClient);
}

TEST(LivenessTest, ZeroTimeoutsDisableTheChecks) {
  Liveness l;
  l.Activate(kStart);
  const Liveness::Timeouts none{absl::ZeroDuration(), absl::ZeroDuration()};
  EXPECT_EQ(l.Tick(kStart + absl::Hours(10), none, true), Verdict::kAlive);
}

}  // namespace
}  // namespace swirl::internal
