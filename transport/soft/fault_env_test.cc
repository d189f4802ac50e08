// SWIRL_SOFT_FAULTS from the environment (set in BUILD: "qp=#1,at_frame=1,action=corrupt"): the
// first QP this process creates corrupts its first frame, and nothing else is touched. The case
// that reads it must be the process's only one, so it is a binary of its own.

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <memory>

#include "absl/time/clock.h"
#include "transport/soft/hostile_peer.h"

namespace swirl::soft::hostile {
namespace {

TEST(FaultEnvironment, TheFirstQpCorruptsItsFirstFrame) {
  verbs::ConnectOptions no_timer;
  no_timer.timeout = 0;
  auto p = MakePair(/*post_recvs=*/true, no_timer);  // A is the process's first QP
  ASSERT_NE(p, nullptr);
  auto second = MakePair(/*post_recvs=*/false, no_timer);
  ASSERT_NE(second, nullptr);
  // A's SEND arrives corrupted: B fails it as a malformed frame.
  ASSERT_TRUE(PostRequest(*p, 1, IBV_WR_SEND, 0, 64));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while ((p->a_wcs.empty() || p->b_recv_wcs.size() < 2) && absl::Now() < deadline) PollAll(*p);
  ASSERT_EQ(p->a_wcs.size(), 1u);
  EXPECT_EQ(p->a_wcs[0].status, IBV_WC_RETRY_EXC_ERR) << ibv_wc_status_str(p->a_wcs[0].status);
  EXPECT_EQ(State(*p->b_qp), IBV_QPS_ERR);
  ASSERT_EQ(p->b_recv_wcs.size(), 2u);
  for (const ibv_wc& wc : p->b_recv_wcs) EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
  // The rule names one QP: the next pair's first frames go through.
  EXPECT_TRUE(BystanderRoundTrip(*second, 1));
}

}  // namespace
}  // namespace swirl::soft::hostile
