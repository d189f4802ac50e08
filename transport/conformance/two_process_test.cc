// A peer in another process (conformance_peer, started with posix_spawn): SEND/RECV ping-pong,
// large RDMA WRITE and READ, and a peer killed with SIGKILL while work is outstanding: the
// survivor's first outstanding request fails with IBV_WC_RETRY_EXC_ERR, the rest flush, within
// a bounded time.

#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "transport/conformance/conformance.h"
#include "transport/conformance/peer_process.h"
#include "transport/verbs/verbs.h"

namespace swirl::conformance {
namespace {

constexpr uint32_t kTestPsn = 0x7e57;

class TwoProcessTest : public DeviceTest {
 protected:
  void SetUp() override {
    auto peer = PeerProcess::Spawn(device(), kTimeout);
    ASSERT_TRUE(peer.ok()) << peer.status().ToString() << " (peer binary " << PeerBinaryPath()
                           << ")";
    peer_ = std::move(*peer);
    EndpointOptions options;
    options.buffer_size = 8 << 20;
    options.max_send_wr = 256;
    options.max_recv_wr = 256;
    auto local = Endpoint::Create(device(), options);
    ASSERT_TRUE(local.ok()) << local.status().ToString();
    a_ = std::move(*local);
    const verbs::ConnectOptions connect = DefaultConnectOptions();
    auto address = a_->qp().LocalAddress(kTestPsn, connect);
    ASSERT_TRUE(address.ok()) << address.status().ToString();
    SWIRL_ASSERT_OK(peer_->Connect(*address, kTimeout));
    SWIRL_ASSERT_OK(a_->qp().Connect(peer_->hello().address, kTestPsn, connect));
  }

  void TearDown() override {
    // The QP goes before the peer process (declaration order would do it the other way).
    a_.reset();
    peer_.reset();
  }

  uint64_t peer_addr(uint64_t offset) const { return peer_->hello().buffer_addr + offset; }
  uint32_t peer_rkey() const { return peer_->hello().rkey; }

  absl::StatusOr<uint64_t> Call(PeerOp op, uint64_t offset = 0, uint64_t length = 0,
                                uint64_t seed = 0, uint32_t count = 0) {
    PeerCommand command{};
    command.op = op;
    command.count = count;
    command.offset = offset;
    command.length = length;
    command.seed = seed;
    return peer_->Call(command, kTimeout);
  }

  std::unique_ptr<PeerProcess> peer_;
};

TEST_P(TwoProcessTest, SendRecvPingPong) {
  ASSERT_TRUE(Call(PeerOp::kPostReceives, 0, 0, 0, 16).ok());
  constexpr int kRounds = 200;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(testing::Message() << "round " << round);
    const uint32_t length = 1 + (round * 37) % static_cast<uint32_t>(kPeerSlotSize);
    ASSERT_EQ(a_->PostRecv(0x1000 + round, 1 << 20, kPeerSlotSize), 0);
    FillPattern(a_->data(), length, round);
    std::memset(a_->data(1 << 20), 0, length);
    ASSERT_EQ(SendWr(round, IBV_WR_SEND).Local(*a_, 0, length).Post(a_->ibqp()), 0);
    ExpectWc(Poll(a_->send_cq()),
             {.wr_id = static_cast<uint64_t>(round), .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
    ibv_wc pong = Poll(a_->recv_cq());
    ExpectWc(pong, {.wr_id = 0x1000 + static_cast<uint64_t>(round),
                    .qp_num = a_->qpn(),
                    .opcode = IBV_WC_RECV,
                    .byte_len = length,
                    .wc_flags = 0,
                    .src_qp = peer_->hello().address.qp_num});
    ASSERT_EQ(FindPatternMismatch(a_->data(1 << 20), length, round), -1);
  }
  absl::StatusOr<int> exit = peer_->Exit(kTimeout);
  ASSERT_TRUE(exit.ok()) << exit.status().ToString();
  EXPECT_TRUE(WIFEXITED(*exit) && WEXITSTATUS(*exit) == 0) << "peer wait status " << *exit;
}

// As on a NIC, a QP learns that its peer went away only by sending to it: a receiver whose
// peer finished and exited keeps its posted receives (ibv_rc_pingpong's server reads a flushed
// one as a failure), and its next request fails with RETRY_EXC_ERR, the receives flushing
// behind it.
TEST_P(TwoProcessTest, APeerThatExitsFailsOnlyTheNextRequest) {
  ASSERT_EQ(a_->PostRecv(0xa0, 0, 64), 0);
  ASSERT_EQ(a_->PostRecv(0xa1, 64, 64), 0);
  absl::StatusOr<int> exit = peer_->Exit(kTimeout);
  ASSERT_TRUE(exit.ok()) << exit.status().ToString();
  // A bounded observation: nothing completes, and the QP stays ready to send.
  std::vector<ibv_wc> early = Observe(a_->recv_cq(), absl::Milliseconds(300));
  EXPECT_TRUE(early.empty()) << "a receive completed with no peer: " << Describe(early.front());
  EXPECT_EQ(StateOf(a_->qp()), IBV_QPS_RTS);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 8).Post(a_->ibqp()), 0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 1, .status = IBV_WC_RETRY_EXC_ERR, .qp_num = a_->qpn()});
  std::vector<ibv_wc> recvs = PollN(a_->recv_cq(), 2);
  ASSERT_EQ(recvs.size(), 2u);
  ExpectWc(recvs[0], {.wr_id = 0xa0, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  ExpectWc(recvs[1], {.wr_id = 0xa1, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  EXPECT_TRUE(WaitForState(a_->qp(), IBV_QPS_ERR));
}

TEST_P(TwoProcessTest, LargeRdmaWriteAndRead) {
  constexpr uint32_t kLength = 4 << 20;
  static_assert(kLength <= kPeerDataSize);
  FillPattern(a_->data(), kLength, 7);
  ASSERT_EQ(SendWr(1, IBV_WR_RDMA_WRITE)
                .Local(*a_, 0, kLength)
                .Remote(peer_addr(kPeerDataOffset), peer_rkey())
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  absl::StatusOr<uint64_t> sum = Call(PeerOp::kChecksum, kPeerDataOffset, kLength);
  ASSERT_TRUE(sum.ok()) << sum.status().ToString();
  EXPECT_EQ(*sum, PeerChecksum(a_->data(), kLength)) << "the peer's memory differs";

  ASSERT_TRUE(Call(PeerOp::kFill, kPeerDataOffset, kLength, 8).ok());
  ASSERT_EQ(SendWr(2, IBV_WR_RDMA_READ)
                .Local(*a_, kLength, kLength)
                .Remote(peer_addr(kPeerDataOffset), peer_rkey())
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()),
           {.wr_id = 2, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_READ, .byte_len = kLength});
  EXPECT_EQ(FindPatternMismatch(a_->data(kLength), kLength, 8), -1);
}

// Eight 512 KiB WRITEs, then a SEND the peer has no receive for (it waits: rnr_retry 7), then
// eight more WRITEs queued behind it. Once the first WRITE completes the peer is killed.
TEST_P(TwoProcessTest, PeerKilledMidTransfer) {
  constexpr uint32_t kChunk = 512 << 10;
  constexpr int kBefore = 8;
  constexpr int kAfter = 8;
  constexpr uint64_t kSendWrId = 100;
  FillPattern(a_->data(), kChunk, 9);
  ASSERT_EQ(a_->PostRecv(0xa0, 0, 64), 0);
  ASSERT_EQ(a_->PostRecv(0xa1, 64, 64), 0);
  std::vector<uint64_t> order;
  auto post_write = [&](uint64_t wr_id, int i) {
    order.push_back(wr_id);
    return SendWr(wr_id, IBV_WR_RDMA_WRITE)
        .Local(*a_, 0, kChunk)
        .Remote(peer_addr(kPeerDataOffset + (i % 8) * kChunk), peer_rkey())
        .Post(a_->ibqp());
  };
  for (int i = 0; i < kBefore; ++i) ASSERT_EQ(post_write(i, i), 0);
  order.push_back(kSendWrId);
  ASSERT_EQ(SendWr(kSendWrId, IBV_WR_SEND).Local(*a_, 0, 64).Post(a_->ibqp()), 0);
  for (int i = 0; i < kAfter; ++i) ASSERT_EQ(post_write(200 + i, i), 0);

  std::vector<ibv_wc> wcs;
  wcs.push_back(Poll(a_->send_cq()));
  ExpectWc(wcs[0], {.wr_id = 0, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  const absl::Time killed = absl::Now();
  SWIRL_ASSERT_OK(peer_->Kill());

  for (ibv_wc& wc : PollN(a_->send_cq(), static_cast<int>(order.size()) - 1)) wcs.push_back(wc);
  const absl::Duration took = absl::Now() - killed;
  ASSERT_EQ(wcs.size(), order.size());
  std::printf("peer killed: all %zu completions %s after SIGKILL\n", wcs.size(),
              absl::FormatDuration(took).c_str());
  // Successes (only among the WRITEs before the SEND), then exactly one RETRY_EXC_ERR, then
  // flushes; the SEND never succeeds.
  size_t i = 0;
  while (i < wcs.size() && wcs[i].status == IBV_WC_SUCCESS) {
    EXPECT_LT(i, static_cast<size_t>(kBefore)) << Describe(wcs[i]);
    ++i;
  }
  ASSERT_LT(i, wcs.size()) << "everything succeeded although the SEND had no receive";
  ExpectWc(wcs[i], {.wr_id = order[i], .status = IBV_WC_RETRY_EXC_ERR, .qp_num = a_->qpn()});
  for (++i; i < wcs.size(); ++i) {
    ExpectWc(wcs[i], {.wr_id = order[i], .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  }
  for (size_t k = 0; k < wcs.size(); ++k) EXPECT_EQ(wcs[k].wr_id, order[k]) << "order";
  std::vector<ibv_wc> recvs = PollN(a_->recv_cq(), 2);
  ASSERT_EQ(recvs.size(), 2u);
  ExpectWc(recvs[0], {.wr_id = 0xa0, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  ExpectWc(recvs[1], {.wr_id = 0xa1, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  // (How long it took is printed above, not judged: PollN already bounds it by kTimeout.)
  EXPECT_TRUE(WaitForState(a_->qp(), IBV_QPS_ERR));
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(TwoProcessTest);

}  // namespace
}  // namespace swirl::conformance
