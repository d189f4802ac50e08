// Destroying QPs at awkward moments: nothing may crash or hang, and the surviving side's work
// fails the way it would if the peer's node had gone away (transport retries exhausted).
//
// A separate target on purpose: on a device with a teardown bug these tests abort the process.

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <memory>

#include "transport/conformance/conformance.h"
#include "transport/verbs/verbs.h"

namespace swirl::conformance {
namespace {

class TeardownTest : public DeviceTest {};

// b_ is destroyed while a_ has already gone to RTR toward it (b_ itself never got past INIT):
// a connection setup abandoned halfway. a_'s first request then fails with RETRY_EXC_ERR.
TEST_P(TeardownTest, DestroyQpWhilePeerIsConnecting) {
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(testing::Message() << "round " << round);
    auto a = Endpoint::Create(device());
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    auto b = Endpoint::Create(device());
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    const verbs::ConnectOptions options = DefaultConnectOptions();
    auto b_address = (*b)->qp().LocalAddress(2, options);
    ASSERT_TRUE(b_address.ok()) << b_address.status().ToString();
    SWIRL_ASSERT_OK((*b)->qp().ToInit(options));
    SWIRL_ASSERT_OK((*a)->qp().Connect(*b_address, 1, options));
    // Give the devices a moment to deliver a_'s connection attempt to b_ (a bounded
    // observation: nothing must complete meanwhile).
    EXPECT_TRUE(Observe((*a)->send_cq(), absl::Milliseconds(50)).empty());
    b->reset();

    ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(**a, 0, 8).Post((*a)->ibqp()), 0);
    ASSERT_EQ(SendWr(2, IBV_WR_SEND).Local(**a, 0, 8).Post((*a)->ibqp()), 0);
    std::vector<ibv_wc> wcs = PollN((*a)->send_cq(), 2);
    ASSERT_EQ(wcs.size(), 2u);
    ExpectWc(wcs[0], {.wr_id = 1, .status = IBV_WC_RETRY_EXC_ERR, .qp_num = (*a)->qpn()});
    ExpectWc(wcs[1], {.wr_id = 2, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = (*a)->qpn()});
    EXPECT_TRUE(WaitForState((*a)->qp(), IBV_QPS_ERR));
  }
}

// b_ is destroyed while a_'s SEND waits for a receive (RNR, infinite retry) and more requests
// queue behind it: the SEND fails with RETRY_EXC_ERR, the rest flush.
TEST_P(TeardownTest, DestroyPeerWithRequestsOutstanding) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  FillPattern(a_->data(), 4096, 1);
  ASSERT_EQ(a_->PostRecv(0xa0, 0, 64), 0);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 64).Post(a_->ibqp()), 0);
  ASSERT_EQ(SendWr(2, IBV_WR_RDMA_WRITE)
                .Local(*a_, 0, 4096)
                .Remote(b_->addr(), b_->rkey())
                .Post(a_->ibqp()),
            0);
  EXPECT_TRUE(Observe(a_->send_cq(), absl::Milliseconds(20)).empty())
      << "the SEND must wait for a receive (rnr_retry 7)";
  b_.reset();

  std::vector<ibv_wc> wcs = PollN(a_->send_cq(), 2);
  ASSERT_EQ(wcs.size(), 2u);
  ExpectWc(wcs[0], {.wr_id = 1, .status = IBV_WC_RETRY_EXC_ERR, .qp_num = a_->qpn()});
  ExpectWc(wcs[1], {.wr_id = 2, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  ExpectWc(Poll(a_->recv_cq()),
           {.wr_id = 0xa0, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  EXPECT_TRUE(WaitForState(a_->qp(), IBV_QPS_ERR));
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(TeardownTest);

}  // namespace
}  // namespace swirl::conformance
