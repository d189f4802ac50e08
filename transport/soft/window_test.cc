// Memory windows beyond RoCE, on the soft device: a window's lease lives in the device's key
// entry, so the responder itself refuses an access after it (SetWindowDeadline), and a bind of
// a type 2 window can land in a fresh random key slot (FreshWindowRkey: about 31 random bits
// per bind instead of ibv_inc_rkey's 8; memory.cc, PrepareType2Bind). Written as the
// conformance suite's tests are (its fixture, on soft0), plus a look at the key table's size.

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <cstring>
#include <set>
#include <vector>

#include "absl/time/clock.h"
#include "transport/conformance/conformance.h"
#include "transport/soft/soft_device.h"
#include "transport/soft/soft_internal.h"
#include "transport/verbs/verbs.h"

namespace swirl::conformance {
namespace {

constexpr size_t kWindowOffset = 64 * 1024;
constexpr uint32_t kWindowLength = 16 * 1024;
constexpr unsigned int kAccess = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;

class SoftWindowTest : public DeviceTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(Connect());
    auto mw = verbs::MemoryWindow::Allocate(b_->pd(), IBV_MW_TYPE_2);
    ASSERT_TRUE(mw.ok()) << mw.status();
    mw_ = std::move(*mw);
  }

  ibv_wc Bind(uint32_t rkey) {
    return BindType2(*b_, mw_->get(), rkey, b_->mr().get(), b_->addr(kWindowOffset),
                     kWindowLength, kAccess);
  }

  // a_ reads 256 bytes through `rkey`: the completion.
  ibv_wc Read(uint32_t rkey) {
    EXPECT_EQ(SendWr(0x78, IBV_WR_RDMA_READ)
                  .Local(*a_, 4096, 256)
                  .Remote(b_->addr(kWindowOffset), rkey)
                  .Post(a_->ibqp()),
              0);
    return Poll(a_->send_cq());
  }

  void LocalInvalidate(uint32_t rkey) {
    ASSERT_EQ(SendWr(0x1a, IBV_WR_LOCAL_INV).Invalidate(rkey).Post(b_->ibqp()), 0);
    ExpectWc(Poll(b_->send_cq()), {.wr_id = 0x1a, .qp_num = b_->qpn(), .opcode = IBV_WC_LOCAL_INV});
  }

  uint32_t LiveKeys() { return soft::ToSoft(b_->context().get())->hca->keys.live(); }

  std::unique_ptr<verbs::MemoryWindow> mw_;
};

TEST_P(SoftWindowTest, AnAccessBeforeTheLeaseEndsSucceedsAndOneAfterFails) {
  const uint32_t rkey = ibv_inc_rkey(mw_->get()->rkey);
  ExpectWc(Bind(rkey), {.wr_id = 0xb1d, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});
  SWIRL_ASSERT_OK(soft::SetWindowDeadline(mw_->get(), absl::Now() + absl::Hours(1)));
  FillPattern(b_->data(kWindowOffset), 256, 7);
  ExpectWc(Read(rkey), {.wr_id = 0x78, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_READ,
                        .byte_len = 256});
  EXPECT_EQ(FindPatternMismatch(a_->data(4096), 256, 7), -1);
  // The lease is over: the window is still bound (nobody revoked it), yet the responder refuses.
  SWIRL_ASSERT_OK(soft::SetWindowDeadline(mw_->get(), absl::Now() - absl::Milliseconds(1)));
  std::memset(a_->data(4096), 0x22, 256);
  ExpectWc(Read(rkey), {.wr_id = 0x78, .status = IBV_WC_REM_ACCESS_ERR, .qp_num = a_->qpn()});
  for (int i = 0; i < 256; ++i) ASSERT_EQ(a_->data(4096)[i], 0x22) << "data came back at " << i;
  EXPECT_EQ(soft::SetWindowDeadline(nullptr, absl::Now()).code(),
            absl::StatusCode::kUnimplemented);
}

// The lease is the window's: removed (InfiniteFuture), the window serves again; and it moves
// with the window to the fresh slot of its next bind.
TEST_P(SoftWindowTest, TheLeaseBelongsToTheWindow) {
  SWIRL_ASSERT_OK(soft::SetWindowDeadline(mw_->get(), absl::Now() - absl::Seconds(1)));
  SWIRL_ASSERT_OK(soft::SetWindowDeadline(mw_->get(), absl::InfiniteFuture()));
  uint32_t rkey = ibv_inc_rkey(mw_->get()->rkey);
  ExpectWc(Bind(rkey), {.wr_id = 0xb1d, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});
  ExpectWc(Read(rkey), {.wr_id = 0x78, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_READ,
                        .byte_len = 256});
  LocalInvalidate(rkey);
  SWIRL_ASSERT_OK(soft::SetWindowDeadline(mw_->get(), absl::Now() - absl::Seconds(1)));
  const absl::StatusOr<uint32_t> fresh = soft::FreshWindowRkey(mw_->get());
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  const uint32_t moved = *fresh;
  ASSERT_NE(moved >> 8, rkey >> 8) << "not a fresh slot";
  ExpectWc(Bind(moved), {.wr_id = 0xb1d, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});
  ExpectWc(Read(moved), {.wr_id = 0x78, .status = IBV_WC_REM_ACCESS_ERR, .qp_num = a_->qpn()});
}

// Binds with FreshWindowRkey's rkeys land in fresh random slots: their rkeys differ far beyond
// the key byte, each works while bound, each dies with its invalidation, the slots left are
// released (the key table does not grow), and mw->rkey stays what it was, as on a NIC.
TEST_P(SoftWindowTest, EachBindWithAFreshRkeyLandsInAFreshSlot) {
  constexpr int kBinds = 200;
  const uint32_t allocated = mw_->get()->rkey;
  std::vector<uint32_t> rkeys;
  uint32_t live = 0;
  for (int i = 0; i < kBinds; ++i) {
    const absl::StatusOr<uint32_t> fresh = soft::FreshWindowRkey(mw_->get());
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    const uint32_t rkey = *fresh;
    ExpectWc(Bind(rkey), {.wr_id = 0xb1d, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});
    ExpectWc(Read(rkey), {.wr_id = 0x78, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_READ,
                          .byte_len = 256});
    LocalInvalidate(rkey);
    rkeys.push_back(rkey);
    if (i == 1) live = LiveKeys();
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_EQ(LiveKeys(), live) << "slots a window left were not released";
  EXPECT_EQ(mw_->get()->rkey, allocated);
  std::set<uint32_t> indexes, slots, high;
  for (uint32_t rkey : rkeys) {
    indexes.insert(rkey >> 8);
    slots.insert((rkey >> 8) & (soft::KeyTable::kSlots - 1));
    high.insert(rkey >> (8 + soft::KeyTable::kSlotBits));
  }
  // 200 draws of 17 slot bits rarely repeat; the 7 high bits take many of their 128 values.
  EXPECT_GE(indexes.size(), 195u);
  EXPECT_GE(slots.size(), 195u);
  EXPECT_GE(high.size(), 32u);
  // An rkey of an earlier binding is dead, in whichever slot it was.
  ExpectWc(Read(rkeys[kBinds / 2]), {.wr_id = 0x78, .status = IBV_WC_REM_ACCESS_ERR,
                                     .qp_num = a_->qpn()});
}

// libibverbs' convention (and swirl's RPC layer's): an rkey with the window's own index and a
// new key byte binds in place, as on any device; a bind into a fresh slot while the window is
// still bound where it is fails, as any bind of a bound type 2 window does.
TEST_P(SoftWindowTest, AnRkeyWithTheWindowsOwnIndexBindsInPlace) {
  const uint32_t own = mw_->get()->rkey;
  for (uint32_t byte = 1; byte <= 3; ++byte) {
    const uint32_t rkey = (own & ~0xffu) | ((own + byte) & 0xff);  // ibv_inc_rkey, thrice
    ExpectWc(Bind(rkey), {.wr_id = 0xb1d, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});
    ExpectWc(Read(rkey), {.wr_id = 0x78, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_READ,
                          .byte_len = 256});
    LocalInvalidate(rkey);
  }
  const uint32_t bound = (own & ~0xffu) | ((own + 9) & 0xff);
  ExpectWc(Bind(bound), {.wr_id = 0xb1d, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});
  const absl::StatusOr<uint32_t> fresh = soft::FreshWindowRkey(mw_->get());
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  ASSERT_NE(*fresh >> 8, own >> 8);
  ExpectWc(Bind(*fresh), {.wr_id = 0xb1d, .status = IBV_WC_MW_BIND_ERR, .qp_num = b_->qpn()});
}

INSTANTIATE_TEST_SUITE_P(Soft, SoftWindowTest, ::testing::Values(std::string("soft0")));

}  // namespace
}  // namespace swirl::conformance
