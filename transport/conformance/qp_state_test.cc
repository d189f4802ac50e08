// The RC QP state machine: ibv_modify_qp accepts exactly the transitions and attribute masks of
// the IB spec (kernel ib_modify_qp_is_ok) and refuses everything else with EINVAL, leaving the
// state unchanged; posting sends before RTS is refused; a QP in ERR flushes what is posted; a QP
// taken through RESET can be connected again.

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "transport/conformance/conformance.h"
#include "transport/verbs/status.h"
#include "transport/verbs/verbs.h"

namespace swirl::conformance {
namespace {

constexpr int kInitMask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
constexpr int kRtrMask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                         IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
constexpr int kRtsMask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                         IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;

class QpStateTest : public DeviceTest {
 protected:
  // Two unconnected endpoints (RESET), and each one's address for the other.
  void SetUp() override {
    auto a = Endpoint::Create(device());
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    auto b = Endpoint::Create(device());
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    a_ = std::move(*a);
    b_ = std::move(*b);
    options_ = DefaultConnectOptions();
    // The raw attributes below name a GID table entry, as QueuePair's methods do after
    // resolving "automatic" (the default) to one.
    auto gid_index = a_->context().ResolveGidIndex(options_.port_num, options_.gid_index);
    ASSERT_TRUE(gid_index.ok()) << gid_index.status().ToString();
    options_.gid_index = *gid_index;
    auto a_address = a_->qp().LocalAddress(1, options_);
    ASSERT_TRUE(a_address.ok()) << a_address.status().ToString();
    auto b_address = b_->qp().LocalAddress(2, options_);
    ASSERT_TRUE(b_address.ok()) << b_address.status().ToString();
    a_address_ = *a_address;
    b_address_ = *b_address;
  }

  // Attributes for every transition of a_ toward b_ (as QueuePair's methods would fill them).
  ibv_qp_attr InitAttr() const {
    ibv_qp_attr attr;
    std::memset(&attr, 0, sizeof(attr));
    attr.qp_state = IBV_QPS_INIT;
    attr.port_num = options_.port_num;
    attr.qp_access_flags = options_.access_flags;
    return attr;
  }
  ibv_qp_attr RtrAttr() const {
    ibv_qp_attr attr;
    std::memset(&attr, 0, sizeof(attr));
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = b_address_.mtu;
    attr.dest_qp_num = b_address_.qp_num;
    attr.rq_psn = b_address_.psn;
    attr.max_dest_rd_atomic = options_.max_dest_rd_atomic;
    attr.min_rnr_timer = options_.min_rnr_timer;
    attr.ah_attr.dlid = b_address_.lid;
    attr.ah_attr.port_num = options_.port_num;
    static const ibv_gid kZero{};
    if (std::memcmp(&b_address_.gid, &kZero, sizeof(kZero)) != 0) {
      attr.ah_attr.is_global = 1;
      attr.ah_attr.grh.dgid = b_address_.gid;
      attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(options_.gid_index);
      attr.ah_attr.grh.hop_limit = 64;
    }
    return attr;
  }
  ibv_qp_attr RtsAttr() const {
    ibv_qp_attr attr;
    std::memset(&attr, 0, sizeof(attr));
    attr.qp_state = IBV_QPS_RTS;
    attr.sq_psn = 1;
    attr.timeout = options_.timeout;
    attr.retry_cnt = options_.retry_cnt;
    attr.rnr_retry = options_.rnr_retry;
    attr.max_rd_atomic = options_.max_rd_atomic;
    return attr;
  }

  int Modify(ibv_qp_attr attr, int mask) {
    return a_->context().ops().ModifyQp(a_->ibqp(), &attr, mask);
  }

  // ibv_modify_qp(attr, mask) on a_ must fail with EINVAL and leave a_ in `state`.
  void ExpectRefused(ibv_qp_attr attr, int mask, ibv_qp_state state) {
    EXPECT_EQ(Modify(attr, mask), EINVAL);
    EXPECT_EQ(StateOf(a_->qp()), state);
  }

  // Connects both (b_ first reaches RTR, so a_'s requests find it ready).
  void ConnectBoth() {
    SWIRL_ASSERT_OK(b_->qp().Connect(a_address_, 2, options_));
    SWIRL_ASSERT_OK(a_->qp().Connect(b_address_, 1, options_));
    WarmUp(*a_, *b_);
  }

  // Completes the connection from wherever a_ is (INIT, RTR or RTS) and checks it works: a test
  // that leaves a_ pointed at b_ should not end with the connection half made.
  void FinishConnection() {
    if (StateOf(a_->qp()) == IBV_QPS_INIT) SWIRL_ASSERT_OK(a_->qp().ToRtr(b_address_, options_));
    if (StateOf(a_->qp()) == IBV_QPS_RTR) SWIRL_ASSERT_OK(a_->qp().ToRts(1, options_));
    SWIRL_ASSERT_OK(b_->qp().Connect(a_address_, 2, options_));
    WarmUp(*a_, *b_);
  }

  verbs::ConnectOptions options_;
  verbs::PeerAddress a_address_;
  verbs::PeerAddress b_address_;
};

TEST_P(QpStateTest, NewQpIsInReset) { EXPECT_EQ(StateOf(a_->qp()), IBV_QPS_RESET); }

TEST_P(QpStateTest, ResetToRtrIsRefused) { ExpectRefused(RtrAttr(), kRtrMask, IBV_QPS_RESET); }

TEST_P(QpStateTest, ResetToRtsIsRefused) { ExpectRefused(RtsAttr(), kRtsMask, IBV_QPS_RESET); }

// The kernel's qp_state_table (which ib_modify_qp_is_ok applies for every provider) has no
// RESET -> ERR: a QP must be initialized before it can fail.
TEST_P(QpStateTest, ResetToErrIsRefused) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  ExpectRefused(attr, IBV_QP_STATE, IBV_QPS_RESET);
}

TEST_P(QpStateTest, InitToRtsIsRefused) {
  ASSERT_EQ(Modify(InitAttr(), kInitMask), 0);
  ExpectRefused(RtsAttr(), kRtsMask, IBV_QPS_INIT);
}

TEST_P(QpStateTest, RtrWithoutDestQpnIsRefused) {
  ASSERT_EQ(Modify(InitAttr(), kInitMask), 0);
  ExpectRefused(RtrAttr(), kRtrMask & ~IBV_QP_DEST_QPN, IBV_QPS_INIT);
  // The complete mask then works.
  EXPECT_EQ(Modify(RtrAttr(), kRtrMask), 0);
  EXPECT_EQ(StateOf(a_->qp()), IBV_QPS_RTR);
  FinishConnection();
}

TEST_P(QpStateTest, MissingRequiredAttributesAreRefused) {
  ExpectRefused(InitAttr(), kInitMask & ~IBV_QP_ACCESS_FLAGS, IBV_QPS_RESET);
  ExpectRefused(InitAttr(), kInitMask & ~IBV_QP_PORT, IBV_QPS_RESET);
  ASSERT_EQ(Modify(InitAttr(), kInitMask), 0);
  ExpectRefused(RtrAttr(), kRtrMask & ~IBV_QP_AV, IBV_QPS_INIT);
  ExpectRefused(RtrAttr(), kRtrMask & ~IBV_QP_RQ_PSN, IBV_QPS_INIT);
  ASSERT_EQ(Modify(RtrAttr(), kRtrMask), 0);
  ExpectRefused(RtsAttr(), kRtsMask & ~IBV_QP_SQ_PSN, IBV_QPS_RTR);
  ExpectRefused(RtsAttr(), kRtsMask & ~IBV_QP_TIMEOUT, IBV_QPS_RTR);
  ExpectRefused(RtsAttr(), kRtsMask & ~IBV_QP_RETRY_CNT, IBV_QPS_RTR);
  EXPECT_EQ(Modify(RtsAttr(), kRtsMask), 0);
  EXPECT_EQ(StateOf(a_->qp()), IBV_QPS_RTS);
  FinishConnection();
}

TEST_P(QpStateTest, ExtraAttributesAreRefused) {
  // RESET -> INIT does not take a send PSN or a destination QPN.
  ibv_qp_attr init = InitAttr();
  ExpectRefused(init, kInitMask | IBV_QP_SQ_PSN, IBV_QPS_RESET);
  ExpectRefused(init, kInitMask | IBV_QP_DEST_QPN, IBV_QPS_RESET);
  ASSERT_EQ(Modify(init, kInitMask), 0);
  // INIT -> RTR does not take RTS attributes.
  ibv_qp_attr rtr = RtrAttr();
  rtr.timeout = options_.timeout;
  ExpectRefused(rtr, kRtrMask | IBV_QP_TIMEOUT, IBV_QPS_INIT);
  ASSERT_EQ(Modify(RtrAttr(), kRtrMask), 0);
  // RTR -> RTS cannot change the destination.
  ibv_qp_attr rts = RtsAttr();
  rts.dest_qp_num = b_address_.qp_num;
  ExpectRefused(rts, kRtsMask | IBV_QP_DEST_QPN, IBV_QPS_RTR);
  FinishConnection();
}

TEST_P(QpStateTest, QueuePairMethodsReportInvalidArgument) {
  absl::Status rts = a_->qp().ToRts(1, options_);
  EXPECT_EQ(rts.code(), absl::StatusCode::kInvalidArgument) << rts.ToString();
  absl::Status rtr = a_->qp().ToRtr(b_address_, options_);
  EXPECT_EQ(rtr.code(), absl::StatusCode::kInvalidArgument) << rtr.ToString();
  EXPECT_EQ(StateOf(a_->qp()), IBV_QPS_RESET);
  SWIRL_ASSERT_OK(a_->qp().ToInit(options_));
  absl::Status again = a_->qp().ToRts(1, options_);
  EXPECT_EQ(again.code(), absl::StatusCode::kInvalidArgument) << again.ToString();
  EXPECT_EQ(StateOf(a_->qp()), IBV_QPS_INIT);
}

TEST_P(QpStateTest, PostSendBeforeRtsIsRefused) {
  auto expect_refused = [&](ibv_qp_state state) {
    SCOPED_TRACE(verbs::QpStateName(state));
    ASSERT_EQ(StateOf(a_->qp()), state);
    SendWr wr(1, IBV_WR_SEND);
    wr.Local(*a_, 0, 8);
    ibv_send_wr* bad = nullptr;
    EXPECT_EQ(wr.Post(a_->ibqp(), &bad), EINVAL);
    EXPECT_EQ(bad, wr.get());
  };
  expect_refused(IBV_QPS_RESET);
  SWIRL_ASSERT_OK(a_->qp().ToInit(options_));
  expect_refused(IBV_QPS_INIT);
  SWIRL_ASSERT_OK(b_->qp().Connect(a_address_, 2, options_));
  SWIRL_ASSERT_OK(a_->qp().ToRtr(b_address_, options_));
  expect_refused(IBV_QPS_RTR);
  // Nothing was queued: after RTS the first completion is the first request posted there.
  SWIRL_ASSERT_OK(a_->qp().ToRts(1, options_));
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 64), 0);
  ASSERT_EQ(SendWr(2, IBV_WR_SEND).Local(*a_, 0, 8).Post(a_->ibqp()), 0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 2, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 8,
                                 .src_qp = a_->qpn()});
}

TEST_P(QpStateTest, ReceivesPostedInInitAreKept) {
  SWIRL_ASSERT_OK(b_->qp().ToInit(options_));
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 64), 0);
  ASSERT_EQ(b_->PostRecv(0xb1, 64, 64), 0);
  SWIRL_ASSERT_OK(b_->qp().ToRtr(a_address_, options_));
  SWIRL_ASSERT_OK(b_->qp().ToRts(2, options_));
  SWIRL_ASSERT_OK(a_->qp().Connect(b_address_, 1, options_));
  FillPattern(a_->data(), 16, 1);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 16).Post(a_->ibqp()), 0);
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 16,
                                 .src_qp = a_->qpn()});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  EXPECT_EQ(FindPatternMismatch(b_->data(), 16, 1), -1);
}

// A QP that only receives need never leave RTR (perftest's ib_send_bw leaves its server
// there): it takes SENDs and WRITEs and acknowledges them, though its own send side, and so
// the PSN the peer's acknowledgements of it are relative to, does not exist yet.
TEST_P(QpStateTest, AQpLeftInRtrReceivesAndAcknowledges) {
  SWIRL_ASSERT_OK(b_->qp().ToInit(options_));
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 64), 0);
  SWIRL_ASSERT_OK(b_->qp().ToRtr(a_address_, options_));
  SWIRL_ASSERT_OK(a_->qp().Connect(b_address_, 1, options_));
  FillPattern(a_->data(), 64, 4);
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(SendWr(10 + i, IBV_WR_RDMA_WRITE)
                  .Local(*a_, 0, 64)
                  .Remote(b_->addr(4096 + 64 * i), b_->rkey())
                  .Post(a_->ibqp()),
              0);
  }
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 16).Post(a_->ibqp()), 0);
  std::vector<ibv_wc> sends = PollN(a_->send_cq(), 4);
  ASSERT_EQ(sends.size(), 4u);
  for (int i = 0; i < 3; ++i) {
    ExpectWc(sends[i], {.wr_id = static_cast<uint64_t>(10 + i), .qp_num = a_->qpn(),
                        .opcode = IBV_WC_RDMA_WRITE});
  }
  ExpectWc(sends[3], {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 16,
                                 .src_qp = a_->qpn()});
  for (int i = 0; i < 3; ++i) EXPECT_EQ(FindPatternMismatch(b_->data(4096 + 64 * i), 64, 4), -1);
  EXPECT_EQ(StateOf(b_->qp()), IBV_QPS_RTR);
  EXPECT_EQ(StateOf(a_->qp()), IBV_QPS_RTS);
}

TEST_P(QpStateTest, PostingToErrorQpFlushes) {
  ASSERT_NO_FATAL_FAILURE(ConnectBoth());
  SWIRL_ASSERT_OK(a_->qp().ToError());
  EXPECT_EQ(StateOf(a_->qp()), IBV_QPS_ERR);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 8).Post(a_->ibqp()), 0);
  ASSERT_EQ(SendWr(2, IBV_WR_RDMA_WRITE, /*unsignaled*/ 0)
                .Local(*a_, 0, 8)
                .Remote(b_->addr(), b_->rkey())
                .Post(a_->ibqp()),
            0);
  ASSERT_EQ(a_->PostRecv(0xa0, 0, 64), 0);
  std::vector<ibv_wc> sends = PollN(a_->send_cq(), 2);
  ASSERT_EQ(sends.size(), 2u);
  ExpectWc(sends[0], {.wr_id = 1, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  ExpectWc(sends[1], {.wr_id = 2, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  ExpectWc(Poll(a_->recv_cq()),
           {.wr_id = 0xa0, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
}

TEST_P(QpStateTest, ResetAndReconnect) {
  ASSERT_NO_FATAL_FAILURE(ConnectBoth());
  SWIRL_ASSERT_OK(a_->qp().ToError());
  SWIRL_ASSERT_OK(b_->qp().ToError());
  SWIRL_ASSERT_OK(a_->qp().ToReset());
  SWIRL_ASSERT_OK(b_->qp().ToReset());
  EXPECT_EQ(StateOf(a_->qp()), IBV_QPS_RESET);
  EXPECT_EQ(StateOf(b_->qp()), IBV_QPS_RESET);
  // RESET discards: nothing is left to complete.
  EXPECT_TRUE(Observe(a_->send_cq(), absl::Milliseconds(10)).empty());

  auto a_address = a_->qp().LocalAddress(100, options_);
  ASSERT_TRUE(a_address.ok()) << a_address.status().ToString();
  auto b_address = b_->qp().LocalAddress(200, options_);
  ASSERT_TRUE(b_address.ok()) << b_address.status().ToString();
  SWIRL_ASSERT_OK(b_->qp().Connect(*a_address, 200, options_));
  SWIRL_ASSERT_OK(a_->qp().Connect(*b_address, 100, options_));
  FillPattern(a_->data(), 100, 2);
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 100).Post(a_->ibqp()), 0);
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 100,
                                 .src_qp = a_->qpn()});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  EXPECT_EQ(FindPatternMismatch(b_->data(), 100, 2), -1);
}

// As rdma-core's test_mr_rereg_pd restates its QPs: one side is reset and brought back to RTS
// while its peer is still in ERR, then the peer; the new connection must work, with nothing of
// the old one (its link, its closed state) leaking into it. Repeated: it was a race.
TEST_P(QpStateTest, OneSideReconnectsWhileThePeerIsStillInError) {
  ASSERT_NO_FATAL_FAILURE(ConnectBoth());
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE(testing::Message() << "round " << round);
    SWIRL_ASSERT_OK(a_->qp().ToError());
    SWIRL_ASSERT_OK(b_->qp().ToError());
    // Flushes from the last round's ERR are not this round's business.
    (void)Observe(a_->send_cq(), absl::Milliseconds(1));
    (void)Observe(b_->recv_cq(), absl::Milliseconds(1));
    SWIRL_ASSERT_OK(b_->qp().ToReset());
    SWIRL_ASSERT_OK(b_->qp().Connect(a_address_, 2, options_));  // a_ is still in ERR
    // While a_ is still in ERR: whatever b_'s connection sends it now, a_ cannot take.
    (void)Observe(a_->recv_cq(), absl::Milliseconds(50));
    SWIRL_ASSERT_OK(a_->qp().ToReset());
    SWIRL_ASSERT_OK(a_->qp().Connect(b_address_, 1, options_));
    FillPattern(a_->data(), 100, round);
    ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
    ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 100).Post(a_->ibqp()), 0);
    ExpectWc(Poll(a_->send_cq()), {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
    ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                   .qp_num = b_->qpn(),
                                   .opcode = IBV_WC_RECV,
                                   .byte_len = 100,
                                   .src_qp = a_->qpn()});
    ASSERT_EQ(FindPatternMismatch(b_->data(), 100, round), -1);
    // And back: the side that reconnected first sends too.
    ASSERT_EQ(a_->PostRecv(0xa0, 4096, 4096), 0);
    ASSERT_EQ(SendWr(2, IBV_WR_SEND).Local(*b_, 0, 100).Post(b_->ibqp()), 0);
    ExpectWc(Poll(b_->send_cq()), {.wr_id = 2, .qp_num = b_->qpn(), .opcode = IBV_WC_SEND});
    ExpectWc(Poll(a_->recv_cq()), {.wr_id = 0xa0,
                                   .qp_num = a_->qpn(),
                                   .opcode = IBV_WC_RECV,
                                   .byte_len = 100,
                                   .src_qp = b_->qpn()});
  }
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(QpStateTest);

}  // namespace
}  // namespace swirl::conformance
