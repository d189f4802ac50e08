// Memory windows and remote invalidation (see /work/shared/reference/verbs-semantics.md).
//
// b_ exposes memory through a type 2 window bound through its QP (the one a_ is connected to);
// a_ uses it, then the window dies by local invalidation (IBV_WR_LOCAL_INV on b_) or by remote
// invalidation (a_'s IBV_WR_SEND_WITH_INV naming the rkey). After that the rkey must be dead: an
// RDMA READ or WRITE with it fails with IBV_WC_REM_ACCESS_ERR and changes nothing. A
// SEND_WITH_INV naming anything but a valid type 2 window of the receiving QP's PD bound to that
// QP fails the receive with IBV_WC_REM_INV_REQ_ERR and takes both QPs to the error state.

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <cstdio>
#include <cstring>
#include <memory>

#include "transport/conformance/conformance.h"
#include "transport/verbs/verbs.h"

namespace swirl::conformance {
namespace {

using verbs::MemoryWindow;
using verbs::ProtectionDomain;

constexpr size_t kWindowOffset = 64 * 1024;
constexpr uint32_t kWindowLength = 16 * 1024;
constexpr unsigned int kWindowAccess = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;

enum class Kill { kLocal, kRemote };

class MemoryWindowTest : public DeviceTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(Connect());
    if (!facts().mw_type2) GTEST_SKIP() << device() << " has no type 2 memory windows";
  }

  std::unique_ptr<MemoryWindow> Allocate(const std::shared_ptr<ProtectionDomain>& pd,
                                         ibv_mw_type type) {
    auto mw = MemoryWindow::Allocate(pd, type);
    EXPECT_TRUE(mw.ok()) << mw.status().ToString();
    return mw.ok() ? std::move(*mw) : nullptr;
  }

  // Binds `mw` over b_'s window range through `ep` (b_ unless given) with `rkey`.
  void Bind(MemoryWindow& mw, uint32_t rkey, Endpoint* ep = nullptr) {
    Endpoint& through = ep ? *ep : *b_;
    ExpectWc(BindType2(through, mw.get(), rkey, b_->mr().get(), b_->addr(kWindowOffset),
                       kWindowLength, kWindowAccess),
             {.wr_id = 0xb1d, .qp_num = through.qpn(), .opcode = IBV_WC_BIND_MW});
  }

  // a_ writes 256 bytes of pattern `seed` through `rkey` and reads them back.
  void ExpectUsable(uint32_t rkey, uint64_t seed) {
    FillPattern(a_->data(), 256, seed);
    ASSERT_EQ(SendWr(0x77, IBV_WR_RDMA_WRITE)
                  .Local(*a_, 0, 256)
                  .Remote(b_->addr(kWindowOffset + 512), rkey)
                  .Post(a_->ibqp()),
              0);
    ExpectWc(Poll(a_->send_cq()),
             {.wr_id = 0x77, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
    EXPECT_EQ(FindPatternMismatch(b_->data(kWindowOffset + 512), 256, seed), -1);
    ASSERT_EQ(SendWr(0x78, IBV_WR_RDMA_READ)
                  .Local(*a_, 4096, 256)
                  .Remote(b_->addr(kWindowOffset + 512), rkey)
                  .Post(a_->ibqp()),
              0);
    ExpectWc(Poll(a_->send_cq()),
             {.wr_id = 0x78, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_READ, .byte_len = 256});
    EXPECT_EQ(FindPatternMismatch(a_->data(4096), 256, seed), -1);
  }

  // Kills `rkey` one way or the other and checks the completions that report it.
  void Invalidate(uint32_t rkey, Kill how) {
    if (how == Kill::kLocal) {
      ASSERT_EQ(SendWr(0x1a, IBV_WR_LOCAL_INV).Invalidate(rkey).Post(b_->ibqp()), 0);
      ExpectWc(Poll(b_->send_cq()),
               {.wr_id = 0x1a, .qp_num = b_->qpn(), .opcode = IBV_WC_LOCAL_INV, .wc_flags = 0});
      return;
    }
    FillPattern(a_->data(8192), 32, 40);
    ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
    ASSERT_EQ(
        SendWr(0x5e, IBV_WR_SEND_WITH_INV).Local(*a_, 8192, 32).Invalidate(rkey).Post(a_->ibqp()),
        0);
    ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                   .qp_num = b_->qpn(),
                                   .opcode = IBV_WC_RECV,
                                   .byte_len = 32,
                                   .wc_flags = IBV_WC_WITH_INV,
                                   .invalidated_rkey = rkey,
                                   .src_qp = a_->qpn()});
    ExpectWc(Poll(a_->send_cq()), {.wr_id = 0x5e, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
    EXPECT_EQ(FindPatternMismatch(b_->data(), 32, 40), -1);
  }

  // An RDMA WRITE (or READ) with the dead `rkey`: REM_ACCESS_ERR, both QPs to ERR, the target
  // (or the READ's destination) unchanged.
  void ExpectDead(uint32_t rkey, ibv_wr_opcode opcode) {
    std::memset(b_->data(kWindowOffset), 0x11, kWindowLength);
    std::memset(a_->data(65536), 0x22, 256);
    SendWr wr(0xdead, opcode);
    wr.Local(*a_, 65536, 256).Remote(b_->addr(kWindowOffset), rkey);
    ASSERT_EQ(wr.Post(a_->ibqp()), 0);
    ExpectWc(Poll(a_->send_cq()),
             {.wr_id = 0xdead, .status = IBV_WC_REM_ACCESS_ERR, .qp_num = a_->qpn()});
    EXPECT_TRUE(WaitForState(a_->qp(), IBV_QPS_ERR));
    EXPECT_TRUE(WaitForState(b_->qp(), IBV_QPS_ERR));
    for (size_t i = 0; i < kWindowLength; ++i) {
      ASSERT_EQ(b_->data(kWindowOffset)[i], 0x11) << "the window's memory changed at " << i;
    }
    for (size_t i = 0; i < 256; ++i) {
      ASSERT_EQ(a_->data(65536)[i], 0x22) << "the READ destination changed at " << i;
    }
  }

  // a_ sends SEND_WITH_INV naming `rkey`, which b_'s QP must refuse to invalidate.
  void ExpectInvalidateRefused(uint32_t rkey) {
    ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
    ASSERT_EQ(b_->PostRecv(0xb1, 4096, 4096), 0);
    ASSERT_EQ(
        SendWr(0x5e, IBV_WR_SEND_WITH_INV).Local(*a_, 0, 32).Invalidate(rkey).Post(a_->ibqp()), 0);
    std::vector<ibv_wc> recvs = PollN(b_->recv_cq(), 2);
    ASSERT_EQ(recvs.size(), 2u);
    ExpectWc(recvs[0], {.wr_id = 0xb0, .status = IBV_WC_REM_INV_REQ_ERR, .qp_num = b_->qpn()});
    ExpectWc(recvs[1], {.wr_id = 0xb1, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = b_->qpn()});
    ExpectWc(Poll(a_->send_cq()),
             {.wr_id = 0x5e, .status = IBV_WC_REM_INV_REQ_ERR, .qp_num = a_->qpn()});
    EXPECT_TRUE(WaitForState(a_->qp(), IBV_QPS_ERR));
    EXPECT_TRUE(WaitForState(b_->qp(), IBV_QPS_ERR));
  }

  // `peer` reads through `rkey` over its own connection: the key is still valid.
  void ExpectStillValid(Endpoint& peer, uint32_t rkey, uint64_t remote_addr) {
    ASSERT_EQ(SendWr(0x5a, IBV_WR_RDMA_READ)
                  .Local(peer, 0, 64)
                  .Remote(remote_addr, rkey)
                  .Post(peer.ibqp()),
              0);
    ExpectWc(Poll(peer.send_cq()),
             {.wr_id = 0x5a, .qp_num = peer.qpn(), .opcode = IBV_WC_RDMA_READ, .byte_len = 64});
  }
};

TEST_P(MemoryWindowTest, RemoteInvalidationThenWriteFails) {
  std::unique_ptr<MemoryWindow> mw = Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey());
  ASSERT_NO_FATAL_FAILURE(Bind(*mw, rkey));
  ASSERT_NO_FATAL_FAILURE(ExpectUsable(rkey, 1));
  ASSERT_NO_FATAL_FAILURE(Invalidate(rkey, Kill::kRemote));
  ExpectDead(rkey, IBV_WR_RDMA_WRITE);
}

TEST_P(MemoryWindowTest, RemoteInvalidationThenReadFails) {
  std::unique_ptr<MemoryWindow> mw = Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey());
  ASSERT_NO_FATAL_FAILURE(Bind(*mw, rkey));
  ASSERT_NO_FATAL_FAILURE(ExpectUsable(rkey, 2));
  ASSERT_NO_FATAL_FAILURE(Invalidate(rkey, Kill::kRemote));
  ExpectDead(rkey, IBV_WR_RDMA_READ);
}

TEST_P(MemoryWindowTest, LocalInvalidationThenWriteFails) {
  std::unique_ptr<MemoryWindow> mw = Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey());
  ASSERT_NO_FATAL_FAILURE(Bind(*mw, rkey));
  ASSERT_NO_FATAL_FAILURE(ExpectUsable(rkey, 3));
  ASSERT_NO_FATAL_FAILURE(Invalidate(rkey, Kill::kLocal));
  ExpectDead(rkey, IBV_WR_RDMA_WRITE);
}

TEST_P(MemoryWindowTest, LocalInvalidationThenReadFails) {
  std::unique_ptr<MemoryWindow> mw = Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey());
  ASSERT_NO_FATAL_FAILURE(Bind(*mw, rkey));
  ASSERT_NO_FATAL_FAILURE(ExpectUsable(rkey, 4));
  ASSERT_NO_FATAL_FAILURE(Invalidate(rkey, Kill::kLocal));
  ExpectDead(rkey, IBV_WR_RDMA_READ);
}

// Bind, invalidate, rebind with ibv_inc_rkey, over and over: each new key works and the one
// before it is dead.
TEST_P(MemoryWindowTest, RebindWithIncrementedKey) {
  std::unique_ptr<MemoryWindow> mw = Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  uint32_t rkey = mw->rkey();
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE(testing::Message() << "round " << round);
    rkey = ibv_inc_rkey(rkey);
    ASSERT_NO_FATAL_FAILURE(Bind(*mw, rkey));
    ASSERT_NO_FATAL_FAILURE(ExpectUsable(rkey, 10 + round));
    ASSERT_NO_FATAL_FAILURE(Invalidate(rkey, round % 2 == 0 ? Kill::kRemote : Kill::kLocal));
  }
  // The last key is dead too; so is every earlier one (the first such access kills the QPs).
  ExpectDead(rkey, IBV_WR_RDMA_WRITE);
}

TEST_P(MemoryWindowTest, PreviousKeyIsDeadAfterRebind) {
  std::unique_ptr<MemoryWindow> mw = Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t first = ibv_inc_rkey(mw->rkey());
  ASSERT_NO_FATAL_FAILURE(Bind(*mw, first));
  ASSERT_NO_FATAL_FAILURE(Invalidate(first, Kill::kRemote));
  const uint32_t second = ibv_inc_rkey(first);
  ASSERT_NO_FATAL_FAILURE(Bind(*mw, second));
  ASSERT_NO_FATAL_FAILURE(ExpectUsable(second, 20));
  ExpectDead(first, IBV_WR_RDMA_WRITE);
}

TEST_P(MemoryWindowTest, SendWithInvalidateOfMemoryRegionIsRefused) {
  // A second connection to b_'s PD shows the region survived the refused invalidation.
  std::unique_ptr<Endpoint> a2, b2;
  ASSERT_NO_FATAL_FAILURE(ConnectExtra(b_->pd(), &a2, &b2));
  ASSERT_NO_FATAL_FAILURE(ExpectInvalidateRefused(b_->rkey()));
  ExpectStillValid(*a2, b_->rkey(), b_->addr());
}

TEST_P(MemoryWindowTest, SendWithInvalidateOfType1WindowIsRefused) {
  if (!facts().mw_type1) GTEST_SKIP() << device() << " has no type 1 memory windows";
  std::unique_ptr<MemoryWindow> mw = Allocate(b_->pd(), IBV_MW_TYPE_1);
  ASSERT_NE(mw, nullptr);
  ibv_mw_bind bind{};
  bind.wr_id = 0x71;
  bind.send_flags = IBV_SEND_SIGNALED;
  bind.bind_info.mr = b_->mr().get();
  bind.bind_info.addr = b_->addr(kWindowOffset);
  bind.bind_info.length = kWindowLength;
  bind.bind_info.mw_access_flags = kWindowAccess;
  ASSERT_EQ(ibv_bind_mw(b_->ibqp(), mw->get(), &bind), 0);
  ExpectWc(Poll(b_->send_cq()), {.wr_id = 0x71, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});
  const uint32_t rkey = mw->rkey();
  std::unique_ptr<Endpoint> a2, b2;
  ASSERT_NO_FATAL_FAILURE(ConnectExtra(b_->pd(), &a2, &b2));

  ASSERT_NO_FATAL_FAILURE(ExpectInvalidateRefused(rkey));
  // A type 1 window serves every QP of its PD: b2's peer can still use it.
  ExpectStillValid(*a2, rkey, b_->addr(kWindowOffset));
}

TEST_P(MemoryWindowTest, SendWithInvalidateOfWindowOfAnotherPdIsRefused) {
  // The window lives in another PD of b_'s context, bound through a QP of that PD (a type 2
  // window can only be bound through a QP of its own PD).
  auto other_pd = ProtectionDomain::Create(b_->shared_context());
  ASSERT_TRUE(other_pd.ok()) << other_pd.status().ToString();
  std::unique_ptr<Endpoint> a2, b2;
  ASSERT_NO_FATAL_FAILURE(ConnectExtra(*other_pd, &a2, &b2));
  std::unique_ptr<MemoryWindow> mw = Allocate(*other_pd, IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey());
  ExpectWc(BindType2(*b2, mw->get(), rkey, b2->mr().get(), b2->addr(kWindowOffset), kWindowLength,
                     kWindowAccess),
           {.wr_id = 0xb1d, .qp_num = b2->qpn(), .opcode = IBV_WC_BIND_MW});

  ASSERT_NO_FATAL_FAILURE(ExpectInvalidateRefused(rkey));
  ExpectStillValid(*a2, rkey, b2->addr(kWindowOffset));
}

TEST_P(MemoryWindowTest, SendWithInvalidateOfWindowBoundToAnotherQpIsRefused) {
  std::unique_ptr<Endpoint> a2, b2;
  ASSERT_NO_FATAL_FAILURE(ConnectExtra(b_->pd(), &a2, &b2));
  std::unique_ptr<MemoryWindow> mw = Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey());
  ASSERT_NO_FATAL_FAILURE(Bind(*mw, rkey, b2.get()));

  ASSERT_NO_FATAL_FAILURE(ExpectInvalidateRefused(rkey));
  ExpectStillValid(*a2, rkey, b_->addr(kWindowOffset));
}

// A type 2 window stays tied to the QP it was bound through: once that QP is destroyed, no
// other QP can use its key, not even a new one that takes the destroyed QP's place. The new QP
// is the first object created after the destroy, on b_'s existing CQs, so a userspace device
// probably gives it the destroyed QP's memory (the soft device once matched windows to QPs by
// address, and this is how that showed).
TEST_P(MemoryWindowTest, AWindowOfADestroyedQpAnswersNoOtherQp) {
  std::unique_ptr<MemoryWindow> mw = Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey());
  auto a3 = Endpoint::Create(device());
  ASSERT_TRUE(a3.ok()) << a3.status();
  verbs::QueuePairConfig config;
  config.send_cq = b_->shared_send_cq();
  config.recv_cq = b_->shared_recv_cq();
  const void* destroyed = nullptr;
  {
    std::unique_ptr<Endpoint> a2, b2;
    ASSERT_NO_FATAL_FAILURE(ConnectExtra(b_->pd(), &a2, &b2));
    ASSERT_NO_FATAL_FAILURE(Bind(*mw, rkey, b2.get()));
    ASSERT_NO_FATAL_FAILURE(ExpectStillValid(*a2, rkey, b_->addr(kWindowOffset)));
    destroyed = b2->ibqp();
    a2.reset();
    b2.reset();  // the bound QP goes last
  }
  auto b3 = verbs::QueuePair::Create(b_->pd(), config);
  ASSERT_TRUE(b3.ok()) << b3.status();
  std::printf("the new QP %s the destroyed one's address\n",
              static_cast<const void*>((*b3)->get()) == destroyed ? "took" : "did not take");
  const verbs::ConnectOptions options = DefaultConnectOptions();
  auto a_address = (*a3)->qp().LocalAddress(0x33, options);
  auto b_address = (*b3)->LocalAddress(0x44, options);
  ASSERT_TRUE(a_address.ok() && b_address.ok());
  SWIRL_ASSERT_OK((*b3)->Connect(*a_address, 0x44, options));
  SWIRL_ASSERT_OK((*a3)->qp().Connect(*b_address, 0x33, options));
  Endpoint& reader = **a3;
  ASSERT_EQ(SendWr(0xdead, IBV_WR_RDMA_READ)
                .Local(reader, 0, 64)
                .Remote(b_->addr(kWindowOffset), rkey)
                .Post(reader.ibqp()),
            0);
  ExpectWc(Poll(reader.send_cq()),
           {.wr_id = 0xdead, .status = IBV_WC_REM_ACCESS_ERR, .qp_num = reader.qpn()});
}

// Invalidation is ordered before the receive completion: as soon as b_ sees the message the
// window is free again, so b_ can bind it at once (binding a window that is not free fails), and
// the old key is dead.
TEST_P(MemoryWindowTest, WindowIsFreeWhenTheInvalidatingReceiveCompletes) {
  std::unique_ptr<MemoryWindow> mw = Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_NE(mw, nullptr);
  const uint32_t rkey = ibv_inc_rkey(mw->rkey());
  ASSERT_NO_FATAL_FAILURE(Bind(*mw, rkey));
  ASSERT_NO_FATAL_FAILURE(Invalidate(rkey, Kill::kRemote));
  ASSERT_NO_FATAL_FAILURE(Bind(*mw, ibv_inc_rkey(rkey)));
  ExpectDead(rkey, IBV_WR_RDMA_READ);
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(MemoryWindowTest);

}  // namespace
}  // namespace swirl::conformance
