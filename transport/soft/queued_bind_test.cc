// A memory-window bind that waits in the send queue while the application frees what it names.
// Verbs leave that to the application ("do not deallocate a window a posted bind uses"), but a
// device must not touch freed objects for it: the bind fails with IBV_WC_MW_BIND_ERR when its
// turn comes (and ASan builds would report any use of the freed window or region).
//
// The bind is held back by IBV_SEND_FENCE behind an RDMA READ that stays outstanding until the
// test polls the responder; the HCA thread's progress for unpolled CQs is off
// (SWIRL_SOFT_PROGRESS=off in BUILD), so nothing answers the READ before the test lets it.

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <cstring>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "transport/soft/test_side.h"
#include "transport/verbs/verbs.h"

namespace swirl::soft {
namespace {

using verbs::MemoryRegion;
using verbs::MemoryWindow;

constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                        IBV_ACCESS_REMOTE_READ | IBV_ACCESS_MW_BIND;

Side MakeBindSide(const char* name) {
  return MakeSide(name, {.mr_access = kAccess, .max_inline_data = 0, .cq_entries = 64});
}

void Connect(Side& a, Side& b) { ASSERT_TRUE(ConnectSides(a, b).ok()); }

// `n` completions from a's CQ, polling b's meanwhile (which answers the READ).
std::vector<ibv_wc> Collect(Side& a, Side& b, size_t n) {
  std::vector<ibv_wc> out;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (out.size() < n && absl::Now() < deadline) {
    ibv_wc wc;
    if (a.cq->Poll(1, &wc) == 1) out.push_back(wc);
    b.cq->Poll(0, nullptr);
  }
  EXPECT_EQ(out.size(), n) << "completions missing after 10 s";
  return out;
}

// Posts a's READ of 4 KiB from b (into a's region), then a fenced type 2 bind of `mw` over
// `region`, which must wait for the READ.
void PostReadThenFencedBind(Side& a, Side& b, ibv_mw* mw, MemoryRegion& region) {
  ibv_sge sge{reinterpret_cast<uint64_t>(a.buf.data()), 4096, a.mr->lkey()};
  ibv_send_wr read{};
  read.wr_id = 1;
  read.opcode = IBV_WR_RDMA_READ;
  read.send_flags = IBV_SEND_SIGNALED;
  read.sg_list = &sge;
  read.num_sge = 1;
  read.wr.rdma.remote_addr = reinterpret_cast<uint64_t>(b.buf.data());
  read.wr.rdma.rkey = b.mr->rkey();
  ibv_send_wr bind{};
  bind.wr_id = 2;
  bind.opcode = IBV_WR_BIND_MW;
  bind.send_flags = IBV_SEND_SIGNALED | IBV_SEND_FENCE;
  bind.bind_mw.mw = mw;
  bind.bind_mw.rkey = ibv_inc_rkey(mw->rkey);
  bind.bind_mw.bind_info.mr = region.get();
  bind.bind_mw.bind_info.addr = reinterpret_cast<uint64_t>(region.get()->addr);
  bind.bind_mw.bind_info.length = 4096;
  bind.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_READ;
  read.next = &bind;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a.qp->get(), &read, &bad), 0);
  // Still waiting: nothing has answered the READ.
  ibv_wc wc;
  ASSERT_EQ(a.cq->Poll(1, &wc), 0) << "completed before the READ was answered";
}

TEST(QueuedBind, AWindowDeallocatedBeforeItsBindRunsFailsTheBind) {
  Side a = MakeBindSide("soft0");
  Side b = MakeBindSide("soft1");
  ASSERT_NO_FATAL_FAILURE(Connect(a, b));
  auto mw = MemoryWindow::Allocate(a.pd, IBV_MW_TYPE_2);
  ASSERT_TRUE(mw.ok()) << mw.status();
  ASSERT_NO_FATAL_FAILURE(PostReadThenFencedBind(a, b, (*mw)->get(), *a.mr));
  mw->reset();  // ibv_dealloc_mw with the bind still queued
  std::vector<ibv_wc> wcs = Collect(a, b, 2);
  ASSERT_EQ(wcs.size(), 2u);
  EXPECT_EQ(wcs[0].wr_id, 1u);
  EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(wcs[0].status);
  EXPECT_EQ(wcs[1].wr_id, 2u);
  EXPECT_EQ(wcs[1].status, IBV_WC_MW_BIND_ERR) << ibv_wc_status_str(wcs[1].status);
}

TEST(QueuedBind, ARegionDeregisteredBeforeABindOverItRunsFailsTheBind) {
  Side a = MakeBindSide("soft0");
  Side b = MakeBindSide("soft1");
  ASSERT_NO_FATAL_FAILURE(Connect(a, b));
  std::vector<char> other(1 << 16);
  auto region = MemoryRegion::Register(a.pd, other.data(), other.size(), kAccess);
  ASSERT_TRUE(region.ok()) << region.status();
  auto mw = MemoryWindow::Allocate(a.pd, IBV_MW_TYPE_2);
  ASSERT_TRUE(mw.ok()) << mw.status();
  ASSERT_NO_FATAL_FAILURE(PostReadThenFencedBind(a, b, (*mw)->get(), **region));
  ASSERT_TRUE((*region)->Deregister().ok()) << "no window is bound over it yet";
  // A new region may take the freed slot; the bind must still not land on it.
  auto newcomer = MemoryRegion::Register(a.pd, other.data(), other.size(), kAccess);
  ASSERT_TRUE(newcomer.ok()) << newcomer.status();
  std::vector<ibv_wc> wcs = Collect(a, b, 2);
  ASSERT_EQ(wcs.size(), 2u);
  EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(wcs[0].status);
  EXPECT_EQ(wcs[1].wr_id, 2u);
  EXPECT_EQ(wcs[1].status, IBV_WC_MW_BIND_ERR) << ibv_wc_status_str(wcs[1].status);
  EXPECT_TRUE((*newcomer)->Deregister().ok()) << "a window was bound over the newcomer";
}

// ibv_rereg_mr moves the region to another PD while a bind over it waits: the bind runs against
// the region as it is then, in a PD its QP does not share, and fails.
TEST(QueuedBind, ARegionMovedToAnotherPdBeforeABindOverItRunsFailsTheBind) {
  Side a = MakeBindSide("soft0");
  Side b = MakeBindSide("soft1");
  ASSERT_NO_FATAL_FAILURE(Connect(a, b));
  std::vector<char> other(1 << 16);
  auto region = MemoryRegion::Register(a.pd, other.data(), other.size(), kAccess);
  ASSERT_TRUE(region.ok()) << region.status();
  auto mw = MemoryWindow::Allocate(a.pd, IBV_MW_TYPE_2);
  ASSERT_TRUE(mw.ok()) << mw.status();
  ASSERT_NO_FATAL_FAILURE(PostReadThenFencedBind(a, b, (*mw)->get(), **region));
  auto elsewhere = verbs::ProtectionDomain::Create(a.ctx);
  ASSERT_TRUE(elsewhere.ok()) << elsewhere.status();
  ASSERT_TRUE((*region)->Reregister(IBV_REREG_MR_CHANGE_PD, *elsewhere, nullptr, 0, 0).ok())
      << "no window is bound over it yet";
  std::vector<ibv_wc> wcs = Collect(a, b, 2);
  ASSERT_EQ(wcs.size(), 2u);
  EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(wcs[0].status);
  EXPECT_EQ(wcs[1].wr_id, 2u);
  EXPECT_EQ(wcs[1].status, IBV_WC_MW_BIND_ERR) << ibv_wc_status_str(wcs[1].status);
  EXPECT_TRUE((*region)->Deregister().ok()) << "a window was bound over the moved region";
}

}  // namespace
}  // namespace swirl::soft
