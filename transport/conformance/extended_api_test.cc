// The extended verbs API that unmodified verbs programs use (rdma-core's pyverbs tests, perftest):
//
// - extended CQs (ibv_create_cq_ex): start_poll/next_poll/end_poll and the ibv_wc_read_*
//   accessors report every kind of completion as ibv_poll_cq does, ENOENT when empty, and
//   ibv_poll_cq still works on the same CQ.
//
// What only the soft device promises (its exact refusals) is in transport/soft's
// extended_verbs_test.

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/time/clock.h"
#include "transport/conformance/conformance.h"
#include "transport/verbs/verbs.h"

namespace swirl::conformance {
namespace {

using verbs::MemoryWindow;

// ---- Extended CQ polling ------------------------------------------------------------------------

// The completion the iterator of `cq` (made with IBV_WC_STANDARD_FLAGS) points at, read field by
// field through its accessors, as an ibv_wc for ExpectWc.
ibv_wc ReadEx(ibv_cq_ex* cq) {
  ibv_wc wc;
  std::memset(&wc, 0, sizeof(wc));
  wc.wr_id = cq->wr_id;
  wc.status = cq->status;
  wc.opcode = ibv_wc_read_opcode(cq);
  wc.vendor_err = ibv_wc_read_vendor_err(cq);
  wc.byte_len = ibv_wc_read_byte_len(cq);
  wc.wc_flags = ibv_wc_read_wc_flags(cq);
  if (wc.wc_flags & IBV_WC_WITH_INV) {
    wc.invalidated_rkey = ibv_wc_read_invalidated_rkey(cq);
  } else {
    wc.imm_data = ibv_wc_read_imm_data(cq);
  }
  wc.qp_num = ibv_wc_read_qp_num(cq);
  wc.src_qp = ibv_wc_read_src_qp(cq);
  wc.slid = static_cast<uint16_t>(ibv_wc_read_slid(cq));
  wc.sl = ibv_wc_read_sl(cq);
  wc.dlid_path_bits = ibv_wc_read_dlid_path_bits(cq);
  return wc;
}

// The next completion of an extended CQ, taken with start_poll/end_poll (ENOENT: none yet, keep
// progressing), or nullopt after `timeout` or an error.
std::optional<ibv_wc> TryPollEx(verbs::CompletionQueue& cq, absl::Duration timeout = kTimeout) {
  const absl::Time deadline = absl::Now() + timeout;
  ibv_poll_cq_attr attr{};
  for (;;) {
    const int ret = ibv_start_poll(cq.ex(), &attr);
    if (ret == 0) {
      ibv_wc wc = ReadEx(cq.ex());
      ibv_end_poll(cq.ex());
      return wc;
    }
    if (ret != ENOENT) {
      ADD_FAILURE() << "ibv_start_poll: " << std::strerror(ret);
      return std::nullopt;  // no end_poll after a failed start (ibv_create_cq_ex(3))
    }
    if (absl::Now() >= deadline) return std::nullopt;
    ProgressAll(&cq);
  }
}

ibv_wc PollEx(verbs::CompletionQueue& cq) {
  std::optional<ibv_wc> wc = TryPollEx(cq);
  if (wc.has_value()) return *wc;
  ADD_FAILURE() << "no completion through ibv_start_poll within " << absl::FormatDuration(kTimeout);
  ibv_wc none{};
  none.wr_id = kNoCompletion;
  none.status = IBV_WC_GENERAL_ERR;
  return none;
}

EndpointOptions ExtendedCqs() {
  EndpointOptions options;
  options.extended_cqs = true;
  return options;
}

class ExtendedCqTest : public DeviceTest {
 protected:
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(Connect(ExtendedCqs(), ExtendedCqs())); }

  uint16_t LidOf(Endpoint& ep) {
    absl::StatusOr<ibv_port_attr> port = ep.context().QueryPort(1);
    EXPECT_TRUE(port.ok()) << port.status();
    return port.ok() ? port->lid : 0;
  }
};

TEST_P(ExtendedCqTest, SendAndReceiveWithImmediate) {
  ASSERT_EQ(b_->PostRecv(0x10, 0, 4096), 0);
  FillPattern(a_->data(), 100, 3);
  ASSERT_EQ(SendWr(0x20, IBV_WR_SEND_WITH_IMM)
                .Local(*a_, 0, 100)
                .Imm(htonl(0x12345678))
                .Post(a_->ibqp()),
            0);
  const ibv_wc recv = PollEx(b_->recv_cq());
  ExpectWc(recv, {.wr_id = 0x10,
                  .qp_num = b_->qpn(),
                  .opcode = IBV_WC_RECV,
                  .byte_len = 100,
                  .wc_flags = IBV_WC_WITH_IMM,
                  .imm_data = htonl(0x12345678),
                  .src_qp = a_->qpn()});
  // The sender's LID (0 on RoCE), service level 0 as connected, no path bits (LMC 0).
  EXPECT_EQ(recv.slid, LidOf(*a_));
  EXPECT_EQ(recv.sl, 0);
  EXPECT_EQ(recv.dlid_path_bits, 0);
  EXPECT_EQ(FindPatternMismatch(b_->data(), 100, 3), -1);
  ExpectWc(PollEx(a_->send_cq()), {.wr_id = 0x20, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
}

TEST_P(ExtendedCqTest, RdmaAndAtomicCompletions) {
  FillPattern(a_->data(), 512, 4);
  ASSERT_EQ(SendWr(1, IBV_WR_RDMA_WRITE)
                .Local(*a_, 0, 512)
                .Remote(b_->addr(4096), b_->rkey())
                .Post(a_->ibqp()),
            0);
  ExpectWc(PollEx(a_->send_cq()), {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  EXPECT_EQ(FindPatternMismatch(b_->data(4096), 512, 4), -1);

  ASSERT_EQ(b_->PostRecv(0x30, 0, 0), 0);
  ASSERT_EQ(SendWr(2, IBV_WR_RDMA_WRITE_WITH_IMM)
                .Local(*a_, 0, 300)
                .Remote(b_->addr(8192), b_->rkey())
                .Imm(htonl(77))
                .Post(a_->ibqp()),
            0);
  ExpectWc(PollEx(b_->recv_cq()), {.wr_id = 0x30,
                                   .qp_num = b_->qpn(),
                                   .opcode = IBV_WC_RECV_RDMA_WITH_IMM,
                                   .byte_len = 300,
                                   .wc_flags = IBV_WC_WITH_IMM,
                                   .imm_data = htonl(77),
                                   .src_qp = a_->qpn()});
  ExpectWc(PollEx(a_->send_cq()), {.wr_id = 2, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});

  FillPattern(b_->data(16384), 200, 5);
  ASSERT_EQ(SendWr(3, IBV_WR_RDMA_READ)
                .Local(*a_, 32768, 200)
                .Remote(b_->addr(16384), b_->rkey())
                .Post(a_->ibqp()),
            0);
  ExpectWc(PollEx(a_->send_cq()),
           {.wr_id = 3, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_READ, .byte_len = 200});
  EXPECT_EQ(FindPatternMismatch(a_->data(32768), 200, 5), -1);

  if (!facts().atomics) GTEST_SKIP() << device() << " has no atomics; the rest needs them";
  uint64_t target = 40;
  std::memcpy(b_->data(24576), &target, 8);
  ASSERT_EQ(SendWr(4, IBV_WR_ATOMIC_CMP_AND_SWP)
                .Local(*a_, 40960, 8)
                .Atomic(b_->addr(24576), b_->rkey(), 40, 50)
                .Post(a_->ibqp()),
            0);
  ExpectWc(PollEx(a_->send_cq()),
           {.wr_id = 4, .qp_num = a_->qpn(), .opcode = IBV_WC_COMP_SWAP, .byte_len = 8});
  ASSERT_EQ(SendWr(5, IBV_WR_ATOMIC_FETCH_AND_ADD)
                .Local(*a_, 40968, 8)
                .Atomic(b_->addr(24576), b_->rkey(), 7)
                .Post(a_->ibqp()),
            0);
  ExpectWc(PollEx(a_->send_cq()),
           {.wr_id = 5, .qp_num = a_->qpn(), .opcode = IBV_WC_FETCH_ADD, .byte_len = 8});
  uint64_t before_swap, before_add;
  std::memcpy(&before_swap, a_->data(40960), 8);
  std::memcpy(&before_add, a_->data(40968), 8);
  std::memcpy(&target, b_->data(24576), 8);
  EXPECT_EQ(before_swap, 40u);
  EXPECT_EQ(before_add, 50u);
  EXPECT_EQ(target, 57u);
}

TEST_P(ExtendedCqTest, WindowsAndRemoteInvalidation) {
  if (!facts().mw_type2) GTEST_SKIP() << device() << " has no type 2 memory windows";
  auto mw = MemoryWindow::Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_TRUE(mw.ok()) << mw.status();
  uint32_t rkey = ibv_inc_rkey((*mw)->rkey());
  ASSERT_EQ(SendWr(0xb1, IBV_WR_BIND_MW)
                .Bind((*mw)->get(), rkey, b_->mr().get(), b_->addr(65536), 4096,
                      IBV_ACCESS_REMOTE_READ)
                .Post(b_->ibqp()),
            0);
  ExpectWc(PollEx(b_->send_cq()), {.wr_id = 0xb1, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});
  // The peer's SEND_WITH_INV revokes it: the receive says so and names the key.
  ASSERT_EQ(b_->PostRecv(0x40, 0, 4096), 0);
  ASSERT_EQ(SendWr(6, IBV_WR_SEND_WITH_INV).Local(*a_, 0, 16).Invalidate(rkey).Post(a_->ibqp()),
            0);
  ExpectWc(PollEx(b_->recv_cq()), {.wr_id = 0x40,
                                   .qp_num = b_->qpn(),
                                   .opcode = IBV_WC_RECV,
                                   .byte_len = 16,
                                   .wc_flags = IBV_WC_WITH_INV,
                                   .invalidated_rkey = rkey,
                                   .src_qp = a_->qpn()});
  ExpectWc(PollEx(a_->send_cq()), {.wr_id = 6, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  // Bound again, and revoked locally.
  rkey = ibv_inc_rkey(rkey);
  ASSERT_EQ(SendWr(0xb2, IBV_WR_BIND_MW)
                .Bind((*mw)->get(), rkey, b_->mr().get(), b_->addr(65536), 4096,
                      IBV_ACCESS_REMOTE_READ)
                .Post(b_->ibqp()),
            0);
  ExpectWc(PollEx(b_->send_cq()), {.wr_id = 0xb2, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});
  ASSERT_EQ(SendWr(0x1a, IBV_WR_LOCAL_INV).Invalidate(rkey).Post(b_->ibqp()), 0);
  ExpectWc(PollEx(b_->send_cq()),
           {.wr_id = 0x1a, .qp_num = b_->qpn(), .opcode = IBV_WC_LOCAL_INV});
}

TEST_P(ExtendedCqTest, ErrorsAndFlushes) {
  ASSERT_EQ(b_->PostRecv(0x50, 0, 4096), 0);
  ASSERT_EQ(b_->PostRecv(0x51, 4096, 4096), 0);
  // A READ with a key b never issued fails at b; the WRITE queued behind it is flushed.
  SendWr second(8, IBV_WR_RDMA_WRITE);
  second.Local(*a_, 0, 64).Remote(b_->addr(), b_->rkey());
  ASSERT_EQ(SendWr(7, IBV_WR_RDMA_READ)
                .Local(*a_, 0, 64)
                .Remote(b_->addr(), b_->rkey() ^ 0x80)
                .Then(second)
                .Post(a_->ibqp()),
            0);
  ExpectWc(PollEx(a_->send_cq()),
           {.wr_id = 7, .status = IBV_WC_REM_ACCESS_ERR, .qp_num = a_->qpn()});
  ExpectWc(PollEx(a_->send_cq()), {.wr_id = 8, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  // b refused the request, so b is in error too and flushes its receives.
  ExpectWc(PollEx(b_->recv_cq()),
           {.wr_id = 0x50, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = b_->qpn()});
  ExpectWc(PollEx(b_->recv_cq()),
           {.wr_id = 0x51, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = b_->qpn()});
}

// start_poll takes the first completion, next_poll the ones after it; ENOENT ends a batch.
TEST_P(ExtendedCqTest, NextPollWalksABatch) {
  constexpr int kCount = 8;
  for (int i = 0; i < kCount; ++i) ASSERT_EQ(b_->PostRecv(0x100 + i, i * 4096, 4096), 0);
  // The transition to the error state flushes every receive at once.
  SWIRL_ASSERT_OK(b_->qp().ToError());
  std::vector<ibv_wc> got;
  int from_next_poll = 0;
  ibv_cq_ex* cq = b_->recv_cq().ex();
  const absl::Time deadline = absl::Now() + kTimeout;
  while (static_cast<int>(got.size()) < kCount && absl::Now() < deadline) {
    ibv_poll_cq_attr attr{};
    int ret = ibv_start_poll(cq, &attr);
    if (ret == ENOENT) {
      ProgressAll(&b_->recv_cq());
      continue;
    }
    ASSERT_EQ(ret, 0) << std::strerror(ret);
    got.push_back(ReadEx(cq));
    while (static_cast<int>(got.size()) < kCount && (ret = ibv_next_poll(cq)) == 0) {
      got.push_back(ReadEx(cq));
      ++from_next_poll;
    }
    EXPECT_TRUE(ret == 0 || ret == ENOENT) << "ibv_next_poll: " << std::strerror(ret);
    ibv_end_poll(cq);  // also after next_poll's ENOENT (ibv_create_cq_ex(3))
  }
  ASSERT_EQ(got.size(), static_cast<size_t>(kCount));
  for (int i = 0; i < kCount; ++i) {
    ExpectWc(got[i], {.wr_id = 0x100u + i, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = b_->qpn()});
  }
  EXPECT_GT(from_next_poll, 0) << "every completion came from start_poll";
  ibv_poll_cq_attr attr{};
  EXPECT_EQ(ibv_start_poll(cq, &attr), ENOENT) << "a ninth completion";
}

TEST_P(ExtendedCqTest, AnEmptyCqReportsEnoent) {
  ibv_poll_cq_attr attr{};
  // Empty after the warm-up; an empty start_poll leaves no batch open (no end_poll).
  for (int i = 0; i < 3; ++i) EXPECT_EQ(ibv_start_poll(a_->send_cq().ex(), &attr), ENOENT);
  ASSERT_EQ(SendWr(9, IBV_WR_RDMA_WRITE)
                .Local(*a_, 0, 8)
                .Remote(b_->addr(), b_->rkey())
                .Post(a_->ibqp()),
            0);
  ExpectWc(PollEx(a_->send_cq()), {.wr_id = 9, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  EXPECT_EQ(ibv_start_poll(a_->send_cq().ex(), &attr), ENOENT);
}

// ibv_poll_cq and the iterator take from the same queue, in order.
TEST_P(ExtendedCqTest, PollCqAndStartPollShareTheQueue) {
  for (uint64_t id = 1; id <= 6; ++id) {
    ASSERT_EQ(SendWr(id, IBV_WR_RDMA_WRITE)
                  .Local(*a_, 0, 64)
                  .Remote(b_->addr(), b_->rkey())
                  .Post(a_->ibqp()),
              0);
  }
  for (uint64_t id = 1; id <= 6; ++id) {
    const ibv_wc wc = id % 2 == 1 ? Poll(a_->send_cq()) : PollEx(a_->send_cq());
    ExpectWc(wc, {.wr_id = id, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  }
}

// rdma-core's convention (its pyverbs tests rely on it): a wc_flag or creation flag a device
// cannot honour fails the creation with EOPNOTSUPP, nothing else; sizes out of range are EINVAL.
TEST_P(ExtendedCqTest, CreationAnswersEveryFlag) {
  ibv_context* ctx = a_->context().get();
  auto try_create = [&](ibv_cq_init_attr_ex attr) {
    errno = 0;
    ibv_cq_ex* cq = ibv_create_cq_ex(ctx, &attr);
    if (cq == nullptr) return errno;
    EXPECT_EQ(a_->context().ops().DestroyCq(ibv_cq_ex_to_cq(cq)), 0);
    return 0;
  };
  ibv_cq_init_attr_ex base;
  std::memset(&base, 0, sizeof(base));
  base.cqe = 16;
  EXPECT_EQ(try_create(base), 0);
  for (uint64_t flag = 1; flag <= IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK; flag <<= 1) {
    ibv_cq_init_attr_ex attr = base;
    attr.wc_flags = flag;
    const int err = try_create(attr);
    EXPECT_TRUE(err == 0 || err == EOPNOTSUPP) << "wc_flags 0x" << std::hex << flag << ": "
                                               << std::strerror(err);
    if (flag & IBV_WC_STANDARD_FLAGS) {
      EXPECT_EQ(err, 0) << "standard wc_flags 0x" << flag;
    }
  }
  for (uint32_t flag : {IBV_CREATE_CQ_ATTR_SINGLE_THREADED, IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN}) {
    ibv_cq_init_attr_ex attr = base;
    attr.comp_mask = IBV_CQ_INIT_ATTR_MASK_FLAGS;
    attr.flags = flag;
    const int err = try_create(attr);
    EXPECT_TRUE(err == 0 || err == EOPNOTSUPP) << "flags " << flag << ": " << std::strerror(err);
  }
  absl::StatusOr<ibv_device_attr_ex> device = a_->context().QueryDevice();
  ASSERT_TRUE(device.ok()) << device.status();
  ibv_cq_init_attr_ex too_big = base;
  too_big.cqe = static_cast<uint32_t>(device->orig_attr.max_cqe) + 1;
  EXPECT_EQ(try_create(too_big), EINVAL);
  ibv_cq_init_attr_ex bad_vector = base;
  bad_vector.comp_vector = static_cast<uint32_t>(ctx->num_comp_vectors);
  EXPECT_EQ(try_create(bad_vector), EINVAL);
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(ExtendedCqTest);

}  // namespace
}  // namespace swirl::conformance
