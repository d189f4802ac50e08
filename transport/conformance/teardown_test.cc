// Destroying QPs at awkward moments: nothing may crash or hang, and the surviving side's work
// fails the way it would if the peer's node had gone away (transport retries exhausted).
//
// A separate target on purpose: on a device with a teardown bug these tests abort the process.

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <arpa/inet.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/cleanup/cleanup.h"
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

// One thread keeps polling a receive CQ shared by several QPs while the test thread connects a
// QP to it, receives on it, takes it back to RESET and destroys it, round after round; an idle
// QP stays attached throughout. Every message arrives exactly once, on its QP, and nothing
// crashes: a poller must never act on, or read through, the state of a link being torn down
// (the soft device's pollers skip idle QPs without their lock).
TEST_P(TeardownTest, QpsComeAndGoWhileAnotherThreadPollsTheirCq) {
  constexpr int kRounds = 40;
  std::shared_ptr<verbs::ProtectionDomain> pd;
  EndpointOptions shared;
  ASSERT_NO_FATAL_FAILURE(OpenReceiverSide(256, &pd, &shared));
  const std::shared_ptr<verbs::CompletionQueue> recv_cq = shared.recv_cq;
  std::vector<std::unique_ptr<Endpoint>> idle_senders, idle_receivers;
  ASSERT_NO_FATAL_FAILURE(ConnectReceivers(pd, shared, 1, &idle_senders, &idle_receivers));
  ASSERT_EQ(idle_receivers[0]->PostRecv(0x1d1e, 0, 64), 0);

  std::atomic<bool> stop{false};
  std::mutex mu;
  std::vector<ibv_wc> received;  // guarded by mu
  std::thread poller([&] {
    ibv_wc wcs[4];
    const absl::Time deadline = absl::Now() + 4 * kTimeout;
    while (!stop.load() && absl::Now() < deadline) {
      const int got = recv_cq->Poll(4, wcs);
      if (got <= 0) continue;
      std::lock_guard<std::mutex> lock(mu);
      received.insert(received.end(), wcs, wcs + got);
    }
  });
  // Stopped and joined on every way out: a failed ASSERT must not leave a joinable thread.
  absl::Cleanup stop_poller = [&] {
    stop.store(true);
    if (poller.joinable()) poller.join();
  };
  auto received_count = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return received.size();
  };
  std::vector<uint32_t> qpns;
  for (int round = 0; round < kRounds && !HasFatalFailure(); ++round) {
    SCOPED_TRACE(testing::Message() << "round " << round);
    std::vector<std::unique_ptr<Endpoint>> senders, receivers;
    ASSERT_NO_FATAL_FAILURE(ConnectReceivers(pd, shared, 1, &senders, &receivers));
    qpns.push_back(receivers[0]->qpn());
    ASSERT_EQ(receivers[0]->PostRecv(round, 0, 64), 0);
    // Let the poller see the new QP idle for a moment first.
    EXPECT_TRUE(Observe(senders[0]->send_cq(), absl::Microseconds(200)).empty());
    ASSERT_EQ(SendWr(round, IBV_WR_SEND_WITH_IMM).Local(*senders[0], 0, 16).Imm(htonl(round))
                  .Post(senders[0]->ibqp()),
              0);
    ExpectWc(Poll(senders[0]->send_cq()), {.wr_id = static_cast<uint64_t>(round),
                                           .qp_num = senders[0]->qpn(),
                                           .opcode = IBV_WC_SEND});
    ASSERT_TRUE(WaitUntil([&] { return received_count() == static_cast<size_t>(round) + 1; }))
        << "the poller did not receive round " << round << "'s message";
    // Alternate which side goes first: our QP reset while its peer lives, or the peer destroyed
    // under our idle QP before we reset it.
    if (round % 2 == 0) {
      SWIRL_ASSERT_OK(receivers[0]->qp().ToReset());
      senders.clear();
    } else {
      senders.clear();
      EXPECT_TRUE(Observe(idle_senders[0]->send_cq(), absl::Microseconds(200)).empty());
      SWIRL_ASSERT_OK(receivers[0]->qp().ToReset());
    }
    receivers.clear();
  }
  // The idle QP still works after all that.
  ASSERT_EQ(SendWr(0x1d1e, IBV_WR_SEND).Local(*idle_senders[0], 0, 8).Post(idle_senders[0]->ibqp()),
            0);
  ExpectWc(Poll(idle_senders[0]->send_cq()),
           {.wr_id = 0x1d1e, .qp_num = idle_senders[0]->qpn(), .opcode = IBV_WC_SEND});
  EXPECT_TRUE(WaitUntil([&] { return received_count() == kRounds + 1; }));
  stop.store(true);
  poller.join();
  ASSERT_EQ(received.size(), static_cast<size_t>(kRounds) + 1);
  for (int round = 0; round < kRounds; ++round) {
    ExpectWc(received[round], {.wr_id = static_cast<uint64_t>(round),
                               .qp_num = qpns[round],
                               .opcode = IBV_WC_RECV,
                               .byte_len = 16,
                               .wc_flags = IBV_WC_WITH_IMM,
                               .imm_data = htonl(round)});
  }
  ExpectWc(received[kRounds], {.wr_id = 0x1d1e,
                               .qp_num = idle_receivers[0]->qpn(),
                               .opcode = IBV_WC_RECV,
                               .byte_len = 8});
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(TeardownTest);

}  // namespace
}  // namespace swirl::conformance
