// Local errors: a bad lkey, a receive buffer too small for the message, memory window binds the
// device must refuse, and deregistering a region that still has a window bound over it.

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <cstring>
#include <memory>

#include "absl/strings/match.h"
#include "transport/conformance/conformance.h"
#include "transport/verbs/verbs.h"

namespace swirl::conformance {
namespace {

using verbs::MemoryRegion;
using verbs::MemoryWindow;

class LocalErrorTest : public DeviceTest {
 protected:
  // Posts a type 2 bind that the device must refuse, then a SEND behind it; expects the bind to
  // complete with IBV_WC_MW_BIND_ERR, the SEND to flush and b_'s QP to reach ERR.
  // The SEND rides in the bind's own post, as a SEND carrying the new rkey would: it must never
  // reach a_ (the requester stops at its first error).
  void ExpectBindError(ibv_mw* mw, uint32_t rkey, ibv_mr* mr, uint64_t addr, uint64_t length,
                       unsigned int access) {
    ASSERT_EQ(a_->PostRecv(0xa0, 0, 4096), 0);
    SendWr bind(0xbad, IBV_WR_BIND_MW);
    bind.Bind(mw, rkey, mr, addr, length, access);
    SendWr send(0xb2, IBV_WR_SEND);
    send.Local(*b_, 0, 8);
    bind.Then(send);
    ASSERT_EQ(bind.Post(b_->ibqp()), 0);
    std::vector<ibv_wc> wcs = PollN(b_->send_cq(), 2);
    ASSERT_EQ(wcs.size(), 2u);
    ExpectWc(wcs[0], {.wr_id = 0xbad, .status = IBV_WC_MW_BIND_ERR, .qp_num = b_->qpn()});
    ExpectWc(wcs[1], {.wr_id = 0xb2, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = b_->qpn()});
    EXPECT_TRUE(WaitForState(b_->qp(), IBV_QPS_ERR));
    EXPECT_TRUE(Observe(a_->recv_cq(), absl::Milliseconds(100)).empty())
        << "the SEND behind the failed bind reached the peer";
  }

  std::unique_ptr<MemoryWindow> AllocateType2() {
    auto mw = MemoryWindow::Allocate(b_->pd(), IBV_MW_TYPE_2);
    EXPECT_TRUE(mw.ok()) << mw.status().ToString();
    return mw.ok() ? std::move(*mw) : nullptr;
  }

  // The lkey of a region of a_'s buffer that was registered and deregistered again.
  void DeregisteredLkeyOnA(uint32_t* lkey) {
    auto mr = MemoryRegion::Register(a_->pd(), a_->data(65536), 4096, kFullAccess);
    ASSERT_TRUE(mr.ok()) << mr.status().ToString();
    *lkey = (*mr)->lkey();
    SWIRL_ASSERT_OK((*mr)->Deregister());
  }

  // a_ reads 64 bytes of pattern `seed`, written at b_'s `offset`, through `rkey`.
  void ExpectReadable(uint32_t rkey, size_t offset, uint64_t seed, uint64_t wr_id) {
    FillPattern(b_->data(offset), 64, seed);
    ASSERT_EQ(SendWr(wr_id, IBV_WR_RDMA_READ)
                  .Local(*a_, 0, 64)
                  .Remote(b_->addr(offset), rkey)
                  .Post(a_->ibqp()),
              0);
    ExpectWc(Poll(a_->send_cq()),
             {.wr_id = wr_id, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_READ, .byte_len = 64});
    EXPECT_EQ(FindPatternMismatch(a_->data(), 64, seed), -1);
  }

  std::unique_ptr<MemoryRegion> RegisterOnB(int access, size_t offset, size_t length) {
    auto mr = MemoryRegion::Register(b_->pd(), b_->data(offset), length, access);
    EXPECT_TRUE(mr.ok()) << mr.status().ToString();
    return mr.ok() ? std::move(*mr) : nullptr;
  }
};

TEST_P(LocalErrorTest, SendWithBadLkey) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  uint32_t dead = 0;
  ASSERT_NO_FATAL_FAILURE(DeregisteredLkeyOnA(&dead));

  ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Sge(a_->addr(65536), 64, dead).Post(a_->ibqp()), 0);
  ASSERT_EQ(SendWr(2, IBV_WR_SEND).Local(*a_, 0, 64).Post(a_->ibqp()), 0);
  std::vector<ibv_wc> wcs = PollN(a_->send_cq(), 2);
  ASSERT_EQ(wcs.size(), 2u);
  ExpectWc(wcs[0], {.wr_id = 1, .status = IBV_WC_LOC_PROT_ERR, .qp_num = a_->qpn()});
  ExpectWc(wcs[1], {.wr_id = 2, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  EXPECT_TRUE(WaitForState(a_->qp(), IBV_QPS_ERR));
}

// A failing request behind an unsignaled one still completes (with its error) when the peer
// sends nothing back: the unsignaled SEND ahead of it is acknowledged without a response, and
// the error completion is owed even though neither request asked for one.
TEST_P(LocalErrorTest, AnUnsignaledFailureBehindAnUnsignaledSendIsReported) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  uint32_t dead = 0;
  ASSERT_NO_FATAL_FAILURE(DeregisteredLkeyOnA(&dead));

  ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
  ASSERT_EQ(b_->PostRecv(0xb1, 4096, 4096), 0);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND, 0).Local(*a_, 0, 64).Post(a_->ibqp()), 0);
  ASSERT_EQ(SendWr(2, IBV_WR_SEND, 0).Sge(a_->addr(65536), 64, dead).Post(a_->ibqp()), 0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 2, .status = IBV_WC_LOC_PROT_ERR, .qp_num = a_->qpn()});
  EXPECT_TRUE(WaitForState(a_->qp(), IBV_QPS_ERR));
  // The first SEND arrived.
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0, .qp_num = b_->qpn(), .opcode = IBV_WC_RECV,
                                 .byte_len = 64});
}

// Nothing behind a request that failed locally reaches the peer, whether it was posted in the
// same chain or in a later post: the requester stops at its first error, and the QP then enters
// ERR and flushes the rest (rxe's requester goes to its error state; mlx5 stops the queue).
TEST_P(LocalErrorTest, NothingBehindALocalFailureReachesThePeer) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  uint32_t dead = 0;
  ASSERT_NO_FATAL_FAILURE(DeregisteredLkeyOnA(&dead));
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
  ASSERT_EQ(b_->PostRecv(0xb1, 4096, 4096), 0);
  SendWr bad(1, IBV_WR_SEND);
  bad.Sge(a_->addr(65536), 64, dead);
  SendWr chained(2, IBV_WR_SEND);
  chained.Local(*a_, 0, 64);
  bad.Then(chained);
  ASSERT_EQ(bad.Post(a_->ibqp()), 0);
  ASSERT_EQ(SendWr(3, IBV_WR_SEND).Local(*a_, 0, 64).Post(a_->ibqp()), 0);
  std::vector<ibv_wc> wcs = PollN(a_->send_cq(), 3);
  ASSERT_EQ(wcs.size(), 3u);
  ExpectWc(wcs[0], {.wr_id = 1, .status = IBV_WC_LOC_PROT_ERR, .qp_num = a_->qpn()});
  ExpectWc(wcs[1], {.wr_id = 2, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  ExpectWc(wcs[2], {.wr_id = 3, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  EXPECT_TRUE(WaitForState(a_->qp(), IBV_QPS_ERR));
  EXPECT_TRUE(Observe(b_->recv_cq(), absl::Milliseconds(100)).empty())
      << "a request behind the failure reached the peer";
}

// A READ whose local buffer is refused fails alone, with LOC_PROT_ERR, even when its data comes
// back in several response chunks; the SEND before it completes as it should.
TEST_P(LocalErrorTest, AReadIntoABadLkeyFailsAloneAcrossItsResponses) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  uint32_t dead = 0;
  ASSERT_NO_FATAL_FAILURE(DeregisteredLkeyOnA(&dead));
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 64).Post(a_->ibqp()), 0);
  ASSERT_EQ(SendWr(2, IBV_WR_RDMA_READ)
                .Sge(a_->addr(65536), 256 * 1024, dead)
                .Remote(b_->addr(), b_->rkey())
                .Post(a_->ibqp()),
            0);
  std::vector<ibv_wc> wcs = PollN(a_->send_cq(), 2);
  ASSERT_EQ(wcs.size(), 2u);
  ExpectWc(wcs[0], {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  ExpectWc(wcs[1], {.wr_id = 2, .status = IBV_WC_LOC_PROT_ERR, .qp_num = a_->qpn()});
  EXPECT_TRUE(WaitForState(a_->qp(), IBV_QPS_ERR));
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0, .qp_num = b_->qpn(), .opcode = IBV_WC_RECV,
                                 .byte_len = 64});
}

// Bits a window cannot use (local write, MW_BIND) are ignored in a bind's access flags, as rxe
// and mlx5 ignore them: applications pass their region's flags.
TEST_P(LocalErrorTest, ABindIgnoresLocalAccessBits) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  std::unique_ptr<MemoryRegion> mr = RegisterOnB(kFullAccess, 65536, 8192);
  ASSERT_NE(mr, nullptr);
  std::unique_ptr<MemoryWindow> mw = AllocateType2();
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey());
  ExpectWc(BindType2(*b_, mw->get(), rkey, mr->get(), b_->addr(65536), 4096,
                     IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND),
           {.wr_id = 0xb1d, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});
  ASSERT_NO_FATAL_FAILURE(ExpectReadable(rkey, 65536, 5, 1));
  // Still a window: remote write was not granted.
  ASSERT_EQ(
      SendWr(2, IBV_WR_RDMA_WRITE).Local(*a_, 0, 64).Remote(b_->addr(65536), rkey).Post(a_->ibqp()),
      0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 2, .status = IBV_WC_REM_ACCESS_ERR, .qp_num = a_->qpn()});
}

TEST_P(LocalErrorTest, SendWithLkeyOutsideItsRegion) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  auto mr = MemoryRegion::Register(a_->pd(), a_->data(65536), 4096, kFullAccess);
  ASSERT_TRUE(mr.ok()) << mr.status().ToString();
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 8192), 0);
  // 64 bytes starting 32 bytes before the end of the 4 KiB region.
  ASSERT_EQ(
      SendWr(1, IBV_WR_SEND).Sge(a_->addr(65536 + 4096 - 32), 64, (*mr)->lkey()).Post(a_->ibqp()),
      0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 1, .status = IBV_WC_LOC_PROT_ERR, .qp_num = a_->qpn()});
  EXPECT_TRUE(WaitForState(a_->qp(), IBV_QPS_ERR));
}

TEST_P(LocalErrorTest, ReceiveBufferTooSmall) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 16), 0);
  ASSERT_EQ(b_->PostRecv(0xb1, 4096, 4096), 0);
  FillPattern(a_->data(), 64, 1);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 64).Post(a_->ibqp()), 0);
  ASSERT_EQ(SendWr(2, IBV_WR_SEND).Local(*a_, 0, 8).Post(a_->ibqp()), 0);

  std::vector<ibv_wc> recvs = PollN(b_->recv_cq(), 2);
  ASSERT_EQ(recvs.size(), 2u);
  ExpectWc(recvs[0], {.wr_id = 0xb0, .status = IBV_WC_LOC_LEN_ERR, .qp_num = b_->qpn()});
  ExpectWc(recvs[1], {.wr_id = 0xb1, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = b_->qpn()});
  std::vector<ibv_wc> sends = PollN(a_->send_cq(), 2);
  ASSERT_EQ(sends.size(), 2u);
  ExpectWc(sends[0], {.wr_id = 1, .status = IBV_WC_REM_INV_REQ_ERR, .qp_num = a_->qpn()});
  ExpectWc(sends[1], {.wr_id = 2, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  EXPECT_TRUE(WaitForState(a_->qp(), IBV_QPS_ERR));
  EXPECT_TRUE(WaitForState(b_->qp(), IBV_QPS_ERR));
}

TEST_P(LocalErrorTest, BindWindowThatIsNotFree) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  if (!facts().mw_type2) GTEST_SKIP() << device() << " has no type 2 memory windows";
  std::unique_ptr<MemoryWindow> mw = AllocateType2();
  ASSERT_NE(mw, nullptr);
  const uint32_t first = ibv_inc_rkey(mw->rkey());
  ExpectWc(
      BindType2(*b_, mw->get(), first, b_->mr().get(), b_->addr(0), 4096, IBV_ACCESS_REMOTE_READ),
      {.wr_id = 0xb1d, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});
  // Bound (valid), not free: a type 2 window must be invalidated before it is bound again.
  ExpectBindError(mw->get(), ibv_inc_rkey(first), b_->mr().get(), b_->addr(4096), 4096,
                  IBV_ACCESS_REMOTE_READ);
}

TEST_P(LocalErrorTest, BindRangeOutsideTheRegion) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  if (!facts().mw_type2) GTEST_SKIP() << device() << " has no type 2 memory windows";
  std::unique_ptr<MemoryWindow> mw = AllocateType2();
  ASSERT_NE(mw, nullptr);
  std::unique_ptr<MemoryRegion> mr = RegisterOnB(kFullAccess, 65536, 65536);
  ASSERT_NE(mr, nullptr);
  // Starts inside the region, ends 4 KiB past it.
  ExpectBindError(mw->get(), ibv_inc_rkey(mw->rkey()), mr->get(), b_->addr(65536 + 61440), 8192,
                  IBV_ACCESS_REMOTE_READ);
}

TEST_P(LocalErrorTest, BindOverRegionWithoutMwBindAccess) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  if (!facts().mw_type2) GTEST_SKIP() << device() << " has no type 2 memory windows";
  std::unique_ptr<MemoryWindow> mw = AllocateType2();
  ASSERT_NE(mw, nullptr);
  std::unique_ptr<MemoryRegion> mr = RegisterOnB(
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE, 65536, 65536);
  ASSERT_NE(mr, nullptr);
  ExpectBindError(mw->get(), ibv_inc_rkey(mw->rkey()), mr->get(), b_->addr(65536), 4096,
                  IBV_ACCESS_REMOTE_READ);
}

TEST_P(LocalErrorTest, BindRemoteWriteOverRegionWithoutLocalWrite) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  if (!facts().mw_type2) GTEST_SKIP() << device() << " has no type 2 memory windows";
  std::unique_ptr<MemoryWindow> mw = AllocateType2();
  ASSERT_NE(mw, nullptr);
  std::unique_ptr<MemoryRegion> mr =
      RegisterOnB(IBV_ACCESS_REMOTE_READ | IBV_ACCESS_MW_BIND, 65536, 65536);
  ASSERT_NE(mr, nullptr);
  ExpectBindError(mw->get(), ibv_inc_rkey(mw->rkey()), mr->get(), b_->addr(65536), 4096,
                  IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE);
}

TEST_P(LocalErrorTest, DeregisterRegionWithBoundWindowFailsUntilInvalidated) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  if (!facts().mw_type2) GTEST_SKIP() << device() << " has no type 2 memory windows";
  std::unique_ptr<MemoryRegion> mr = RegisterOnB(kFullAccess, 65536, 65536);
  ASSERT_NE(mr, nullptr);
  std::unique_ptr<MemoryWindow> mw = AllocateType2();
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey());
  ExpectWc(
      BindType2(*b_, mw->get(), rkey, mr->get(), b_->addr(65536), 4096, IBV_ACCESS_REMOTE_READ),
      {.wr_id = 0xb1d, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});

  absl::Status busy = mr->Deregister();
  EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition) << busy.ToString();
  EXPECT_TRUE(absl::StrContains(busy.message(), "errno 16")) << "EBUSY expected: " << busy;
  ASSERT_NE(mr->get(), nullptr) << "a failed deregistration leaves the region registered";

  // The region and the window still work.
  ASSERT_NO_FATAL_FAILURE(ExpectReadable(rkey, 65536, 2, 1));

  ASSERT_EQ(SendWr(0x1a, IBV_WR_LOCAL_INV).Invalidate(rkey).Post(b_->ibqp()), 0);
  ExpectWc(Poll(b_->send_cq()), {.wr_id = 0x1a, .qp_num = b_->qpn(), .opcode = IBV_WC_LOCAL_INV});
  SWIRL_ASSERT_OK(mr->Deregister());
}

// A protection domain with objects in it cannot be deallocated (EBUSY, as the kernel's uverbs
// answers): they would otherwise outlive the domain that checks their access.
TEST_P(LocalErrorTest, DeallocatingAProtectionDomainInUseFails) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  EXPECT_EQ(a_->context().ops().DeallocPd(a_->pd()->get()), EBUSY);
  // Still a working domain: its QP carries traffic.
  ASSERT_NO_FATAL_FAILURE(WarmUp(*a_, *b_));
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(LocalErrorTest);

}  // namespace
}  // namespace swirl::conformance
