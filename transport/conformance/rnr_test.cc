// Receiver not ready: a SEND that finds no receive posted is retried rnr_retry times (the
// responder's min_rnr_timer apart) and then fails with IBV_WC_RNR_RETRY_EXC_ERR; rnr_retry 7
// means forever, so the SEND completes once the receive is finally posted.

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <memory>

#include "transport/conformance/conformance.h"
#include "transport/verbs/verbs.h"

namespace swirl::conformance {
namespace {

class RnrTest : public DeviceTest {
 protected:
  // a_ with `rnr_retry`; b_ (the responder) asks for `min_rnr_timer` between retries (the IB
  // encoding: 1 is 0.01 ms, 20 is 10.24 ms).
  void ConnectWithRnrRetry(uint8_t rnr_retry, uint8_t min_rnr_timer = 1) {
    verbs::ConnectOptions a_connect = DefaultConnectOptions();
    a_connect.rnr_retry = rnr_retry;
    verbs::ConnectOptions b_connect = DefaultConnectOptions();
    b_connect.min_rnr_timer = min_rnr_timer;
    ASSERT_NO_FATAL_FAILURE(Connect({}, {}, a_connect, b_connect));
  }
};

constexpr uint8_t kRnrTimer10ms = 20;  // 10.24 ms
constexpr absl::Duration kRnrDelay = absl::Microseconds(10240);

// The retries are real: failing takes at least rnr_retry timer periods (a device that gave up
// at the first RNR NAK would fail at once), and a receive posted within them saves the SEND.
TEST_P(RnrTest, FiniteRetriesWaitTheResponderTimerBetweenTries) {
  constexpr uint8_t kRetries = 3;
  ASSERT_NO_FATAL_FAILURE(ConnectWithRnrRetry(kRetries, kRnrTimer10ms));
  const absl::Time start = absl::Now();
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 64).Post(a_->ibqp()), 0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 1, .status = IBV_WC_RNR_RETRY_EXC_ERR, .qp_num = a_->qpn()});
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, kRetries * kRnrDelay * 0.9) << "gave up after " << took;
}

TEST_P(RnrTest, AReceivePostedWithinTheRetriesSavesTheSend) {
  // Timer code 0 is the longest, 655.36 ms, and 6 is the most retries short of forever: the
  // SEND has about 3.9 s of retries, so the receive posted after the 12 ms below saves it even
  // on a machine stalled for seconds. (The SEND completes as soon as the receive is there: the
  // long window costs nothing.)
  ASSERT_NO_FATAL_FAILURE(ConnectWithRnrRetry(6, /*min_rnr_timer=*/0));
  FillPattern(a_->data(), 64, 3);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 64).Post(a_->ibqp()), 0);
  std::vector<ibv_wc> early = Observe(a_->send_cq(), absl::Milliseconds(12));
  ASSERT_TRUE(early.empty()) << "finished without a receive: " << Describe(early.front());
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  ExpectWc(Poll(b_->recv_cq()),
           {.wr_id = 0xb0, .qp_num = b_->qpn(), .opcode = IBV_WC_RECV, .byte_len = 64});
  EXPECT_EQ(FindPatternMismatch(b_->data(), 64, 3), -1);
}

TEST_P(RnrTest, RetriesExhaustedForEveryFiniteRnrRetry) {
  for (uint8_t rnr_retry = 0; rnr_retry <= 6; ++rnr_retry) {
    SCOPED_TRACE(testing::Message() << "rnr_retry " << static_cast<int>(rnr_retry));
    ASSERT_NO_FATAL_FAILURE(ConnectWithRnrRetry(rnr_retry));
    ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 64).Post(a_->ibqp()), 0);
    ASSERT_EQ(SendWr(2, IBV_WR_RDMA_WRITE)
                  .Local(*a_, 0, 64)
                  .Remote(b_->addr(4096), b_->rkey())
                  .Post(a_->ibqp()),
              0);
    std::vector<ibv_wc> wcs = PollN(a_->send_cq(), 2);
    ASSERT_EQ(wcs.size(), 2u);
    ExpectWc(wcs[0], {.wr_id = 1, .status = IBV_WC_RNR_RETRY_EXC_ERR, .qp_num = a_->qpn()});
    ExpectWc(wcs[1], {.wr_id = 2, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
    EXPECT_TRUE(WaitForState(a_->qp(), IBV_QPS_ERR));
    // Receiver not ready is not an error of the responder.
    EXPECT_EQ(StateOf(b_->qp()), IBV_QPS_RTS);
    EXPECT_EQ(b_->data(4096)[0], 0) << "the WRITE behind the failed SEND was executed";
    a_.reset();
    b_.reset();
  }
}

TEST_P(RnrTest, InfiniteRetryWaitsForTheReceive) {
  ASSERT_NO_FATAL_FAILURE(ConnectWithRnrRetry(7));
  FillPattern(a_->data(), 64, 1);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 64).Post(a_->ibqp()), 0);
  // A bounded observation: with no receive the SEND neither completes nor fails.
  std::vector<ibv_wc> early = Observe(a_->send_cq(), absl::Milliseconds(200));
  ASSERT_TRUE(early.empty()) << "completed without a receive: " << Describe(early.front());
  EXPECT_EQ(StateOf(a_->qp()), IBV_QPS_RTS);

  ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 64,
                                 .wc_flags = 0,
                                 .src_qp = a_->qpn()});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  EXPECT_EQ(FindPatternMismatch(b_->data(), 64, 1), -1);
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(RnrTest);

}  // namespace
}  // namespace swirl::conformance
