// The extended verbs API that unmodified verbs programs use (rdma-core's pyverbs tests, perftest):
//
// - extended CQs (ibv_create_cq_ex): start_poll/next_poll/end_poll and the ibv_wc_read_*
//   accessors report every kind of completion as ibv_poll_cq does, ENOENT when empty, and
//   ibv_poll_cq still works on the same CQ;
// - the ibv_wr_* API of a QP made by ibv_create_qp_ex with send_ops_flags: every RC operation,
//   wr_id and wr_flags taken by each builder, a build error reported by ibv_wr_complete with
//   nothing of the batch posted, ibv_wr_abort, batches mixed with ibv_post_send;
// - ibv_query_port and ibv_query_device_ex with a caller's struct of another size (an older or
//   newer header), which must not be overrun;
// - ibv_rereg_mr, ibv_resize_cq, ibv_modify_srq/ibv_query_srq with the SRQ limit event, and
//   ibv_query_pkey (through DeviceOps, as swirl reaches every control-path call).
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

constexpr uint64_t kAllRcOps =
    IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_SEND |
    IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
    IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD | IBV_QP_EX_WITH_LOCAL_INV | IBV_QP_EX_WITH_BIND_MW |
    IBV_QP_EX_WITH_SEND_WITH_INV;

// A short look for something that must not happen (a bounded observation, not a wait).
constexpr absl::Duration kQuiet = absl::Milliseconds(100);

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

// ---- The ibv_wr_* API ---------------------------------------------------------------------------

EndpointOptions WithBuilders() {
  EndpointOptions options;
  options.send_ops_flags = kAllRcOps;
  options.max_inline_data = 64;
  return options;
}

class WrApiTest : public DeviceTest {
 protected:
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(Connect(WithBuilders(), WithBuilders())); }

  // One critical section on `ep`: ibv_wr_start, `build`, ibv_wr_complete's result.
  static int Batch(Endpoint& ep, const std::function<void(ibv_qp_ex*)>& build) {
    ibv_qp_ex* qpx = ep.qpx();
    ibv_wr_start(qpx);
    build(qpx);
    return ibv_wr_complete(qpx);
  }

  // Sets the next builder's wr_id and flags.
  static void Next(ibv_qp_ex* qpx, uint64_t wr_id, unsigned int flags = IBV_SEND_SIGNALED) {
    qpx->wr_id = wr_id;
    qpx->wr_flags = flags;
  }

  // Binds a type 2 window over [offset, offset + length) of b's region through b's builders.
  uint32_t BindOnB(MemoryWindow& mw, size_t offset, uint64_t length, unsigned int access) {
    const uint32_t rkey = ibv_inc_rkey(mw.rkey());
    const ibv_mw_bind_info info{b_->mr().get(), b_->addr(offset), length, access};
    EXPECT_EQ(Batch(*b_,
                    [&](ibv_qp_ex* qpx) {
                      Next(qpx, 0xb1d);
                      ibv_wr_bind_mw(qpx, mw.get(), rkey, &info);
                    }),
              0);
    ExpectWc(Poll(b_->send_cq()), {.wr_id = 0xb1d, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});
    return rkey;
  }

  // a reads 64 bytes at b's `offset` through `rkey` with the builders: the completion's status.
  ibv_wc_status ReadThrough(uint32_t rkey, size_t offset, uint64_t wr_id) {
    EXPECT_EQ(Batch(*a_,
                    [&](ibv_qp_ex* qpx) {
                      Next(qpx, wr_id);
                      ibv_wr_rdma_read(qpx, rkey, b_->addr(offset));
                      ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(1 << 20), 64);
                    }),
              0);
    const ibv_wc wc = Poll(a_->send_cq());
    EXPECT_EQ(wc.wr_id, wr_id);
    return wc.status;
  }
};

TEST_P(WrApiTest, QpToQpExFindsTheBuilders) {
  // libibverbs' own ibv_qp_to_qp_ex reads the QP's layout (struct verbs_qp).
  ibv_qp_ex* qpx = ibv_qp_to_qp_ex(a_->ibqp());
  ASSERT_NE(qpx, nullptr);
  EXPECT_EQ(&qpx->qp_base, a_->ibqp());
  EXPECT_NE(qpx->wr_start, nullptr);
  EXPECT_NE(qpx->wr_complete, nullptr);
  EXPECT_NE(qpx->wr_abort, nullptr);
  // A QP made without send_ops_flags has no builders to offer.
  auto plain = Endpoint::Create(device());
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(ibv_qp_to_qp_ex((*plain)->ibqp()), nullptr);
}

TEST_P(WrApiTest, SendsWithSgeListsImmediatesAndInlineData) {
  for (uint64_t id = 0x60; id < 0x64; ++id) {
    ASSERT_EQ(b_->PostRecv(id, (id - 0x60) * 4096, 4096), 0);
  }
  FillPattern(a_->data(), 4096, 6);
  char inline_one[48];
  char inline_two[2][20];
  FillPattern(inline_one, sizeof(inline_one), 7);
  FillPattern(inline_two, sizeof(inline_two), 8);
  const ibv_sge list[3] = {{a_->addr(0), 100, a_->lkey()},
                           {a_->addr(100), 1, a_->lkey()},
                           {a_->addr(101), 899, a_->lkey()}};
  const ibv_data_buf bufs[2] = {{inline_two[0], 20}, {inline_two[1], 20}};
  ASSERT_EQ(Batch(*a_,
                  [&](ibv_qp_ex* qpx) {
                    Next(qpx, 1);
                    ibv_wr_send(qpx);
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(), 256);
                    Next(qpx, 2);
                    ibv_wr_send_imm(qpx, htonl(0xabcd));
                    ibv_wr_set_sge_list(qpx, 3, list);
                    Next(qpx, 3);
                    ibv_wr_send(qpx);
                    ibv_wr_set_inline_data(qpx, inline_one, sizeof(inline_one));
                    Next(qpx, 4);
                    ibv_wr_send(qpx);
                    ibv_wr_set_inline_data_list(qpx, 2, bufs);
                    // The inline setters copied: the buffers may be reused before the post.
                    std::memset(inline_one, 0, sizeof(inline_one));
                    std::memset(inline_two, 0, sizeof(inline_two));
                  }),
            0);
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0x60, .qp_num = b_->qpn(), .opcode = IBV_WC_RECV,
                                 .byte_len = 256, .wc_flags = 0, .src_qp = a_->qpn()});
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0x61,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 1000,
                                 .wc_flags = IBV_WC_WITH_IMM,
                                 .imm_data = htonl(0xabcd)});
  ExpectWc(Poll(b_->recv_cq()),
           {.wr_id = 0x62, .qp_num = b_->qpn(), .opcode = IBV_WC_RECV, .byte_len = 48});
  ExpectWc(Poll(b_->recv_cq()),
           {.wr_id = 0x63, .qp_num = b_->qpn(), .opcode = IBV_WC_RECV, .byte_len = 40});
  EXPECT_EQ(FindPatternMismatch(b_->data(0), 256, 6), -1);
  EXPECT_EQ(FindPatternMismatch(b_->data(4096), 1000, 6), -1);
  EXPECT_EQ(FindPatternMismatch(b_->data(8192), 48, 7), -1);
  EXPECT_EQ(FindPatternMismatch(b_->data(12288), 40, 8), -1);
  for (uint64_t id = 1; id <= 4; ++id) {
    ExpectWc(Poll(a_->send_cq()), {.wr_id = id, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  }
}

TEST_P(WrApiTest, RdmaWritesAndReads) {
  FillPattern(a_->data(), 2048, 9);
  FillPattern(b_->data(65536), 700, 10);
  ASSERT_EQ(b_->PostRecv(0x70, 0, 0), 0);
  static constexpr char kInline[] = "written inline";
  ASSERT_EQ(Batch(*a_,
                  [&](ibv_qp_ex* qpx) {
                    Next(qpx, 1);
                    ibv_wr_rdma_write(qpx, b_->rkey(), b_->addr(4096));
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(), 2048);
                    Next(qpx, 2);
                    ibv_wr_rdma_write_imm(qpx, b_->rkey(), b_->addr(16384), htonl(99));
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(), 128);
                    Next(qpx, 3);
                    ibv_wr_rdma_write(qpx, b_->rkey(), b_->addr(20480));
                    ibv_wr_set_inline_data(qpx, const_cast<char*>(kInline), sizeof(kInline));
                    Next(qpx, 4);
                    ibv_wr_rdma_read(qpx, b_->rkey(), b_->addr(65536));
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(131072), 700);
                  }),
            0);
  for (uint64_t id = 1; id <= 3; ++id) {
    ExpectWc(Poll(a_->send_cq()), {.wr_id = id, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  }
  ExpectWc(Poll(a_->send_cq()),
           {.wr_id = 4, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_READ, .byte_len = 700});
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0x70,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV_RDMA_WITH_IMM,
                                 .byte_len = 128,
                                 .wc_flags = IBV_WC_WITH_IMM,
                                 .imm_data = htonl(99)});
  EXPECT_EQ(FindPatternMismatch(b_->data(4096), 2048, 9), -1);
  EXPECT_EQ(FindPatternMismatch(b_->data(16384), 128, 9), -1);
  EXPECT_EQ(std::memcmp(b_->data(20480), kInline, sizeof(kInline)), 0);
  EXPECT_EQ(FindPatternMismatch(a_->data(131072), 700, 10), -1);
}

TEST_P(WrApiTest, Atomics) {
  if (!facts().atomics) GTEST_SKIP() << device() << " has no atomics";
  uint64_t value = 1000;
  std::memcpy(b_->data(8192), &value, 8);
  ASSERT_EQ(Batch(*a_,
                  [&](ibv_qp_ex* qpx) {
                    Next(qpx, 1);
                    ibv_wr_atomic_cmp_swp(qpx, b_->rkey(), b_->addr(8192), 1000, 2000);
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(0), 8);
                    Next(qpx, 2);
                    ibv_wr_atomic_fetch_add(qpx, b_->rkey(), b_->addr(8192), 5);
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(8), 8);
                  }),
            0);
  ExpectWc(Poll(a_->send_cq()),
           {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_COMP_SWAP, .byte_len = 8});
  ExpectWc(Poll(a_->send_cq()),
           {.wr_id = 2, .qp_num = a_->qpn(), .opcode = IBV_WC_FETCH_ADD, .byte_len = 8});
  uint64_t swapped_from, added_to;
  std::memcpy(&swapped_from, a_->data(0), 8);
  std::memcpy(&added_to, a_->data(8), 8);
  std::memcpy(&value, b_->data(8192), 8);
  EXPECT_EQ(swapped_from, 1000u);
  EXPECT_EQ(added_to, 2000u);
  EXPECT_EQ(value, 2005u);
}

TEST_P(WrApiTest, BindAndLocalInvalidate) {
  if (!facts().mw_type2) GTEST_SKIP() << device() << " has no type 2 memory windows";
  auto mw = MemoryWindow::Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_TRUE(mw.ok()) << mw.status();
  FillPattern(b_->data(65536), 64, 11);
  const uint32_t rkey = BindOnB(**mw, 65536, 4096, IBV_ACCESS_REMOTE_READ);
  EXPECT_EQ(ReadThrough(rkey, 65536, 1), IBV_WC_SUCCESS);
  EXPECT_EQ(FindPatternMismatch(a_->data(1 << 20), 64, 11), -1);
  ASSERT_EQ(Batch(*b_,
                  [&](ibv_qp_ex* qpx) {
                    Next(qpx, 0x1a);
                    ibv_wr_local_inv(qpx, rkey);
                  }),
            0);
  ExpectWc(Poll(b_->send_cq()), {.wr_id = 0x1a, .qp_num = b_->qpn(), .opcode = IBV_WC_LOCAL_INV});
  EXPECT_EQ(ReadThrough(rkey, 65536, 2), IBV_WC_REM_ACCESS_ERR);
}

// swirl's own use of the API: the peer's last message revokes the window it was given.
TEST_P(WrApiTest, SendWithInvalidateRevokesTheWindow) {
  if (!facts().mw_type2) GTEST_SKIP() << device() << " has no type 2 memory windows";
  auto mw = MemoryWindow::Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_TRUE(mw.ok()) << mw.status();
  const uint32_t rkey =
      BindOnB(**mw, 65536, 4096, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE);
  EXPECT_EQ(ReadThrough(rkey, 65536, 1), IBV_WC_SUCCESS);
  ASSERT_EQ(b_->PostRecv(0x80, 0, 4096), 0);
  FillPattern(a_->data(), 24, 12);
  ASSERT_EQ(Batch(*a_,
                  [&](ibv_qp_ex* qpx) {
                    Next(qpx, 2);
                    ibv_wr_send_inv(qpx, rkey);
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(), 24);
                  }),
            0);
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0x80,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 24,
                                 .wc_flags = IBV_WC_WITH_INV,
                                 .invalidated_rkey = rkey,
                                 .src_qp = a_->qpn()});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 2, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  EXPECT_EQ(FindPatternMismatch(b_->data(), 24, 12), -1);
  // The key is dead: a WRITE through it fails and changes nothing.
  std::memset(b_->data(65536), 0x5a, 4096);
  ASSERT_EQ(Batch(*a_,
                  [&](ibv_qp_ex* qpx) {
                    Next(qpx, 3);
                    ibv_wr_rdma_write(qpx, rkey, b_->addr(65536));
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(), 64);
                  }),
            0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 3, .status = IBV_WC_REM_ACCESS_ERR, .qp_num = a_->qpn()});
  for (size_t i = 0; i < 4096; ++i) ASSERT_EQ(b_->data(65536)[i], 0x5a) << i;
}

// ibv_wr_post(3): each builder takes qp_ex->wr_id and wr_flags as they are when it runs.
TEST_P(WrApiTest, EachBuilderTakesWrIdAndFlagsWhenItRuns) {
  ASSERT_EQ(Batch(*a_,
                  [&](ibv_qp_ex* qpx) {
                    Next(qpx, 1, IBV_SEND_SIGNALED);
                    ibv_wr_rdma_write(qpx, b_->rkey(), b_->addr());
                    Next(qpx, 99, 0);  // read by nothing: the setter belongs to request 1
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(), 64);
                    Next(qpx, 2, 0);  // unsignaled
                    ibv_wr_rdma_write(qpx, b_->rkey(), b_->addr(64));
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(), 64);
                    Next(qpx, 3, IBV_SEND_SIGNALED);
                    ibv_wr_rdma_write(qpx, b_->rkey(), b_->addr(128));
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(), 64);
                  }),
            0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 3, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  EXPECT_TRUE(Observe(a_->send_cq(), kQuiet).empty()) << "a completion for the unsignaled write";
}

// ibv_wr_post(3): a failure found while building is returned by ibv_wr_complete, and "the entire
// posting will be aborted". The errno a device picks differs (EINVAL, ENOMEM, ENOSPC); that
// there is one, and that nothing of the batch happened, does not.
TEST_P(WrApiTest, CompleteReportsABuildErrorAndPostsNothing) {
  const uint32_t max_sge = a_->qp().cap().max_send_sge;
  const uint32_t max_inline = a_->qp().cap().max_inline_data;
  std::vector<ibv_sge> too_many(max_sge + 1, ibv_sge{a_->addr(), 8, a_->lkey()});
  std::vector<char> too_long(max_inline + 1, 'x');
  ASSERT_EQ(b_->PostRecv(0x90, 0, 4096), 0);
  std::memset(b_->data(8192), 0x33, 256);
  FillPattern(a_->data(), 256, 13);
  const std::vector<std::function<void(ibv_qp_ex*)>> bad_tails = {
      [&](ibv_qp_ex* qpx) {
        ibv_wr_send(qpx);
        ibv_wr_set_sge_list(qpx, too_many.size(), too_many.data());
      },
      [&](ibv_qp_ex* qpx) {
        ibv_wr_send(qpx);
        ibv_wr_set_inline_data(qpx, too_long.data(), too_long.size());
      },
  };
  for (size_t i = 0; i < bad_tails.size(); ++i) {
    SCOPED_TRACE(i == 0 ? "more SGEs than max_send_sge" : "more inline data than max_inline_data");
    // A good WRITE, then the bad request: neither may happen.
    EXPECT_NE(Batch(*a_,
                    [&](ibv_qp_ex* qpx) {
                      Next(qpx, 0x100 + i);
                      ibv_wr_rdma_write(qpx, b_->rkey(), b_->addr(8192));
                      ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(), 256);
                      Next(qpx, 0x200 + i);
                      bad_tails[i](qpx);
                    }),
              0);
    EXPECT_TRUE(Observe(a_->send_cq(), kQuiet).empty()) << "something of the batch completed";
    EXPECT_TRUE(Observe(b_->recv_cq(), absl::ZeroDuration()).empty()) << "the SEND arrived";
    for (size_t j = 0; j < 256; ++j) ASSERT_EQ(b_->data(8192)[j], 0x33) << "the WRITE landed";
    EXPECT_EQ(StateOf(a_->qp()), IBV_QPS_RTS);
  }
  // The QP is unharmed: the next batch goes.
  ASSERT_EQ(Batch(*a_,
                  [&](ibv_qp_ex* qpx) {
                    Next(qpx, 0x300);
                    ibv_wr_send(qpx);
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(), 16);
                  }),
            0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 0x300, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  ExpectWc(Poll(b_->recv_cq()),
           {.wr_id = 0x90, .qp_num = b_->qpn(), .opcode = IBV_WC_RECV, .byte_len = 16});
}

TEST_P(WrApiTest, AbortDiscardsTheBatch) {
  ASSERT_EQ(b_->PostRecv(0xa0, 0, 4096), 0);
  std::memset(b_->data(8192), 0x44, 64);
  ibv_qp_ex* qpx = a_->qpx();
  ibv_wr_start(qpx);
  Next(qpx, 1);
  ibv_wr_rdma_write(qpx, b_->rkey(), b_->addr(8192));
  ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(), 64);
  Next(qpx, 2);
  ibv_wr_send(qpx);
  ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(), 32);
  ibv_wr_abort(qpx);
  EXPECT_TRUE(Observe(a_->send_cq(), kQuiet).empty()) << "an aborted request completed";
  EXPECT_TRUE(Observe(b_->recv_cq(), absl::ZeroDuration()).empty()) << "an aborted SEND arrived";
  for (size_t j = 0; j < 64; ++j) ASSERT_EQ(b_->data(8192)[j], 0x44) << "an aborted WRITE landed";
  ASSERT_EQ(Batch(*a_,
                  [&](ibv_qp_ex* qpx) {
                    Next(qpx, 3);
                    ibv_wr_send(qpx);
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(), 8);
                  }),
            0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 3, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  ExpectWc(Poll(b_->recv_cq()),
           {.wr_id = 0xa0, .qp_num = b_->qpn(), .opcode = IBV_WC_RECV, .byte_len = 8});
}

// A QP with the builders still takes ibv_post_send; both feed one send queue, in order.
TEST_P(WrApiTest, MixesWithPostSend) {
  for (uint64_t id = 0xc0; id < 0xc3; ++id) ASSERT_EQ(b_->PostRecv(id, (id - 0xc0) * 64, 64), 0);
  FillPattern(a_->data(), 192, 14);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 64).Post(a_->ibqp()), 0);
  ASSERT_EQ(Batch(*a_,
                  [&](ibv_qp_ex* qpx) {
                    Next(qpx, 2);
                    ibv_wr_send(qpx);
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(64), 64);
                    Next(qpx, 3);
                    ibv_wr_rdma_write(qpx, b_->rkey(), b_->addr(8192));
                    ibv_wr_set_sge(qpx, a_->lkey(), a_->addr(), 192);
                  }),
            0);
  ASSERT_EQ(SendWr(4, IBV_WR_SEND).Local(*a_, 128, 64).Post(a_->ibqp()), 0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 2, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 3, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 4, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  for (uint64_t id = 0xc0; id < 0xc3; ++id) {
    ExpectWc(Poll(b_->recv_cq()),
             {.wr_id = id, .qp_num = b_->qpn(), .opcode = IBV_WC_RECV, .byte_len = 64});
  }
  EXPECT_EQ(FindPatternMismatch(b_->data(0), 192, 14), -1);
  EXPECT_EQ(FindPatternMismatch(b_->data(8192), 192, 14), -1);
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(WrApiTest);

// ---- Attribute queries with the caller's size --------------------------------------------------

constexpr unsigned char kGuard = 0xa5;

// Calls the verbs_context entry with `size`, as a program built against a header whose struct
// has that size does; checks the first `size` bytes against `full` (or zeros past it) and that
// nothing beyond `size` was written.
template <typename Query>
void ExpectSized(Query query, const void* full, size_t full_size, size_t size) {
  SCOPED_TRACE(testing::Message() << "size " << size << " of " << full_size);
  std::vector<unsigned char> buffer(full_size + 64, kGuard);
  ASSERT_EQ(query(buffer.data(), size), 0);
  const auto* expected = static_cast<const unsigned char*>(full);
  for (size_t i = 0; i < std::min(size, full_size); ++i) {
    ASSERT_EQ(buffer[i], expected[i]) << "byte " << i;
  }
  for (size_t i = full_size; i < size; ++i) ASSERT_EQ(buffer[i], 0) << "byte " << i;
  for (size_t i = size; i < buffer.size(); ++i) {
    ASSERT_EQ(buffer[i], kGuard) << "byte " << i << " written past the caller's struct";
  }
}

class QuerySizeTest : public DeviceTest {};

TEST_P(QuerySizeTest, QueryPortFillsOnlyTheCallersSize) {
  auto ep = Endpoint::Create(device());
  ASSERT_TRUE(ep.ok()) << ep.status();
  ibv_context* ctx = (*ep)->context().get();
  verbs_context* vctx = verbs_get_ctx_op(ctx, query_port);
  ASSERT_NE(vctx, nullptr) << "no verbs_context::query_port";
  ibv_port_attr full;
  std::memset(&full, 0, sizeof(full));
  ASSERT_EQ(vctx->query_port(ctx, 1, &full, sizeof(full)), 0);
  auto query = [&](void* attr, size_t size) {
    return vctx->query_port(ctx, 1, static_cast<ibv_port_attr*>(attr), size);
  };
  // Before link_layer and before port_cap_flags2 were added; ours; a newer, longer one.
  for (size_t size : {offsetof(ibv_port_attr, link_layer),
                      offsetof(ibv_port_attr, port_cap_flags2), sizeof(ibv_port_attr),
                      sizeof(ibv_port_attr) + 16}) {
    ExpectSized(query, &full, sizeof(full), size);
  }
}

TEST_P(QuerySizeTest, QueryDeviceExFillsOnlyTheCallersSize) {
  auto ep = Endpoint::Create(device());
  ASSERT_TRUE(ep.ok()) << ep.status();
  ibv_context* ctx = (*ep)->context().get();
  verbs_context* vctx = verbs_get_ctx_op(ctx, query_device_ex);
  ASSERT_NE(vctx, nullptr) << "no verbs_context::query_device_ex";
  ibv_device_attr_ex full;
  std::memset(&full, 0, sizeof(full));
  ASSERT_EQ(vctx->query_device_ex(ctx, nullptr, &full, sizeof(full)), 0);
  // The port count past 255 ports, the same count below that (pyverbs' test_phys_port_cnt_ex).
  EXPECT_EQ(full.phys_port_cnt_ex, full.orig_attr.phys_port_cnt);
  auto query = [&](void* attr, size_t size) {
    return vctx->query_device_ex(ctx, nullptr, static_cast<ibv_device_attr_ex*>(attr), size);
  };
  // The bare ibv_device_attr; a struct from before xrc_odp_caps; ours; a newer, longer one.
  for (size_t size : {sizeof(ibv_device_attr), offsetof(ibv_device_attr_ex, xrc_odp_caps),
                      sizeof(ibv_device_attr_ex), sizeof(ibv_device_attr_ex) + 16}) {
    ExpectSized(query, &full, sizeof(full), size);
  }
  // Smaller than the ibv_device_attr every caller's struct starts with: refused, untouched.
  std::vector<unsigned char> small(sizeof(ibv_device_attr), kGuard);
  EXPECT_EQ(query(small.data(), sizeof(ibv_device_attr) - 1), EINVAL);
  for (size_t i = 0; i < small.size(); ++i) ASSERT_EQ(small[i], kGuard) << "byte " << i;
}

TEST_P(QuerySizeTest, QueryPkeyHasTheDefaultPartitionAtIndexZero) {
  auto ep = Endpoint::Create(device());
  ASSERT_TRUE(ep.ok()) << ep.status();
  verbs::Context& ctx = (*ep)->context();
  absl::StatusOr<uint16_t> pkey = ctx.QueryPkey(1, 0);
  ASSERT_TRUE(pkey.ok()) << pkey.status();
  EXPECT_EQ(*pkey, 0xffff);
  absl::StatusOr<ibv_port_attr> port = ctx.QueryPort(1);
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_FALSE(ctx.QueryPkey(1, port->pkey_tbl_len).ok()) << "an index past the table";
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(QuerySizeTest);

// ---- ibv_rereg_mr ------------------------------------------------------------------------------

class ReregTest : public DeviceTest {
 protected:
  // a WRITEs 64 bytes of pattern `seed` to `addr` with b's current rkey: the status.
  ibv_wc_status WriteToB(uint64_t addr, uint64_t seed, uint64_t wr_id) {
    FillPattern(a_->data(), 64, seed);
    EXPECT_EQ(SendWr(wr_id, IBV_WR_RDMA_WRITE)
                  .Local(*a_, 0, 64)
                  .Remote(addr, b_->rkey())
                  .Post(a_->ibqp()),
              0);
    const ibv_wc wc = Poll(a_->send_cq());
    EXPECT_EQ(wc.wr_id, wr_id);
    return wc.status;
  }
};

TEST_P(ReregTest, ChangeAccessTakesRemoteWriteAway) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  ASSERT_EQ(WriteToB(b_->addr(4096), 15, 1), IBV_WC_SUCCESS);
  EXPECT_EQ(FindPatternMismatch(b_->data(4096), 64, 15), -1);
  SWIRL_ASSERT_OK(b_->mr().Reregister(IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                                      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ));
  std::memset(b_->data(8192), 0x66, 64);
  EXPECT_EQ(WriteToB(b_->addr(8192), 16, 2), IBV_WC_REM_ACCESS_ERR);
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(b_->data(8192)[i], 0x66) << i;
}

TEST_P(ReregTest, ChangeAccessGrantsRemoteRead) {
  EndpointOptions local_only;
  local_only.mr_access = IBV_ACCESS_LOCAL_WRITE;
  ASSERT_NO_FATAL_FAILURE(Connect({}, local_only));
  SWIRL_ASSERT_OK(b_->mr().Reregister(IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                                      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ));
  FillPattern(b_->data(4096), 128, 17);
  ASSERT_EQ(SendWr(1, IBV_WR_RDMA_READ)
                .Local(*a_, 0, 128)
                .Remote(b_->addr(4096), b_->rkey())
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()),
           {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_READ, .byte_len = 128});
  EXPECT_EQ(FindPatternMismatch(a_->data(), 128, 17), -1);
}

TEST_P(ReregTest, ChangeTranslationMovesTheRegion) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  Buffer other(1 << 16);
  SWIRL_ASSERT_OK(b_->mr().Reregister(IBV_REREG_MR_CHANGE_TRANSLATION, nullptr, other.data(),
                                      other.size(), 0));
  EXPECT_EQ(b_->mr().addr(), other.data());
  EXPECT_EQ(b_->mr().length(), other.size());
  ASSERT_EQ(WriteToB(other.addr(512), 18, 1), IBV_WC_SUCCESS);
  EXPECT_EQ(FindPatternMismatch(other.data() + 512, 64, 18), -1);
  // The old range is no longer registered.
  std::memset(b_->data(4096), 0x77, 64);
  EXPECT_EQ(WriteToB(b_->addr(4096), 19, 2), IBV_WC_REM_ACCESS_ERR);
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(b_->data(4096)[i], 0x77) << i;
  // Back over the endpoint's buffer before `other` is freed.
  SWIRL_ASSERT_OK(b_->mr().Reregister(IBV_REREG_MR_CHANGE_TRANSLATION, nullptr, b_->data(),
                                      b_->size(), 0));
}

TEST_P(ReregTest, ChangePdTakesTheRegionFromTheQp) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  auto other_pd = verbs::ProtectionDomain::Create(b_->shared_context());
  ASSERT_TRUE(other_pd.ok()) << other_pd.status();
  SWIRL_ASSERT_OK(b_->mr().Reregister(IBV_REREG_MR_CHANGE_PD, *other_pd, nullptr, 0, 0));
  EXPECT_EQ(b_->mr().get()->pd, (*other_pd)->get());
  // b's QP is in the old PD: the region no longer answers to it.
  std::memset(b_->data(4096), 0x78, 64);
  EXPECT_EQ(WriteToB(b_->addr(4096), 20, 1), IBV_WC_REM_ACCESS_ERR);
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(b_->data(4096)[i], 0x78) << i;
  // A QP of the new PD reaches it.
  std::unique_ptr<Endpoint> peer, on_pd;
  ASSERT_NO_FATAL_FAILURE(ConnectExtra(*other_pd, &peer, &on_pd));
  FillPattern(peer->data(), 64, 21);
  ASSERT_EQ(SendWr(2, IBV_WR_RDMA_WRITE)
                .Local(*peer, 0, 64)
                .Remote(b_->addr(8192), b_->rkey())
                .Post(peer->ibqp()),
            0);
  ExpectWc(Poll(peer->send_cq()),
           {.wr_id = 2, .qp_num = peer->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  EXPECT_EQ(FindPatternMismatch(b_->data(8192), 64, 21), -1);
}

// The region counts against the PD it is in now: that one cannot be freed, the old one can.
TEST_P(ReregTest, ChangePdMovesWhatKeepsAPdBusy) {
  auto ep = Endpoint::Create(device());
  ASSERT_TRUE(ep.ok()) << ep.status();
  verbs::DeviceOps& ops = (*ep)->context().ops();
  ibv_pd* first = nullptr;
  ibv_pd* second = nullptr;
  ASSERT_EQ(ops.AllocPd(&first), 0);
  ASSERT_EQ(ops.AllocPd(&second), 0);
  Buffer buffer(1 << 16);
  ibv_mr* mr = nullptr;
  ASSERT_EQ(ops.RegMr(first, buffer.data(), buffer.size(), IBV_ACCESS_LOCAL_WRITE, &mr), 0);
  EXPECT_EQ(ops.ReregMr(mr, IBV_REREG_MR_CHANGE_PD, second, nullptr, 0, 0), 0);
  EXPECT_EQ(mr->pd, second);
  EXPECT_EQ(ops.DeallocPd(second), EBUSY);
  EXPECT_EQ(ops.DeallocPd(first), 0) << "the old PD still counts the region";
  EXPECT_EQ(ops.DeregMr(mr), 0);
  EXPECT_EQ(ops.DeallocPd(second), 0);
}

TEST_P(ReregTest, RefusesBadArgumentsAndKeepsTheRegion) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  verbs::MemoryRegion& mr = b_->mr();
  const uint32_t rkey = mr.rkey();
  // Nothing to change; a flag that does not exist; a translation without an address or a
  // length; access flags without CHANGE_ACCESS.
  EXPECT_FALSE(mr.Reregister(0, nullptr, nullptr, 0, 0).ok());
  EXPECT_FALSE(mr.Reregister(IBV_REREG_MR_FLAGS_SUPPORTED + 1, nullptr, nullptr, 0, 0).ok());
  EXPECT_FALSE(mr.Reregister(IBV_REREG_MR_CHANGE_TRANSLATION, nullptr, nullptr, 4096, 0).ok());
  EXPECT_FALSE(mr.Reregister(IBV_REREG_MR_CHANGE_TRANSLATION, nullptr, b_->data(), 0, 0).ok());
  EXPECT_FALSE(
      mr.Reregister(IBV_REREG_MR_CHANGE_PD, b_->pd(), nullptr, 0, IBV_ACCESS_LOCAL_WRITE).ok());
  // Remote write without local write (IB spec C10-10), as at registration.
  EXPECT_FALSE(
      mr.Reregister(IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, IBV_ACCESS_REMOTE_WRITE)
          .ok());
  EXPECT_EQ(mr.rkey(), rkey);
  EXPECT_EQ(WriteToB(b_->addr(4096), 22, 1), IBV_WC_SUCCESS);
  EXPECT_EQ(FindPatternMismatch(b_->data(4096), 64, 22), -1);
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(ReregTest);

// ---- ibv_resize_cq -----------------------------------------------------------------------------

class ResizeCqTest : public DeviceTest {};

TEST_P(ResizeCqTest, KeepsWhatIsQueued) {
  EndpointOptions small;
  small.cq_entries = 16;
  ASSERT_NO_FATAL_FAILURE(Connect({}, small));
  constexpr int kQueued = 8;
  for (int i = 0; i < kQueued; ++i) ASSERT_EQ(b_->PostRecv(0x200 + i, i * 4096, 4096), 0);
  // Eight flushed receives wait in b's receive CQ.
  SWIRL_ASSERT_OK(b_->qp().ToError());
  verbs::CompletionQueue& cq = b_->recv_cq();
  absl::Status grown = cq.Resize(64);
  if (absl::IsUnimplemented(grown)) GTEST_SKIP() << device() << " cannot resize CQs: " << grown;
  SWIRL_ASSERT_OK(grown);
  EXPECT_GE(cq.capacity(), 64);
  SWIRL_ASSERT_OK(cq.Resize(kQueued));
  EXPECT_GE(cq.capacity(), kQueued);
  // ibv_resize_cq(3): the size must hold every completion not yet polled.
  absl::Status too_small = cq.Resize(kQueued - 1);
  EXPECT_TRUE(absl::IsInvalidArgument(too_small)) << too_small;
  for (int i = 0; i < kQueued; ++i) {
    ExpectWc(Poll(cq), {.wr_id = 0x200u + i, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = b_->qpn()});
  }
  SWIRL_ASSERT_OK(cq.Resize(1));
  EXPECT_GE(cq.capacity(), 1);
  EXPECT_TRUE(Observe(cq, absl::ZeroDuration()).empty());
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(ResizeCqTest);

// ---- ibv_modify_srq and ibv_query_srq ----------------------------------------------------------

class SrqControlTest : public DeviceTest {
 protected:
  // One sender, one receiver on an SRQ of `max_wr` receives.
  void SetUpSrq(uint32_t max_wr) {
    ASSERT_NO_FATAL_FAILURE(OpenReceiverSide(64, &pd_, &receiver_options_));
    auto srq = verbs::SharedReceiveQueue::Create(pd_, max_wr, 1);
    ASSERT_TRUE(srq.ok()) << srq.status();
    srq_ = *srq;
    receiver_options_.srq = srq_;
    ASSERT_NO_FATAL_FAILURE(ConnectReceivers(pd_, receiver_options_, 1, &senders_, &receivers_));
    Track(receiver_options_.recv_cq);
  }

  // Posts receive `id` into slot `id` of the receiver's region (kSlot bytes each).
  int PostSrqRecv(uint64_t id) {
    ibv_sge sge{receivers_[0]->addr(id * kSlot), kSlot, receivers_[0]->lkey()};
    ibv_recv_wr wr{};
    wr.wr_id = id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    return ibv_post_srq_recv(srq_->get(), &wr, &bad);
  }

  // The sender's SEND of 32 bytes of pattern `seed`, and the receive it completes.
  ibv_wc SendOne(uint64_t seed) {
    Endpoint& sender = *senders_[0];
    FillPattern(sender.data(), 32, seed);
    EXPECT_EQ(SendWr(seed, IBV_WR_SEND).Local(sender, 0, 32).Post(sender.ibqp()), 0);
    ExpectWc(Poll(sender.send_cq()), {.wr_id = seed, .qp_num = sender.qpn()});
    return Poll(*receiver_options_.recv_cq);
  }

  static constexpr uint32_t kSlot = 4096;
  std::shared_ptr<verbs::ProtectionDomain> pd_;
  EndpointOptions receiver_options_;
  std::shared_ptr<verbs::SharedReceiveQueue> srq_;
  std::vector<std::unique_ptr<Endpoint>> senders_, receivers_;
};

// ibv_modify_srq(3): an armed limit raises IBV_EVENT_SRQ_LIMIT_REACHED once the number of
// receives in the SRQ drops below it; ibv_query_srq(3) then reports 0 (disarmed).
TEST_P(SrqControlTest, TheLimitEventFiresOnceBelowTheLimit) {
  ASSERT_NO_FATAL_FAILURE(SetUpSrq(16));
  for (uint64_t id = 0; id < 8; ++id) ASSERT_EQ(PostSrqRecv(id), 0);
  ibv_srq_attr arm{};
  arm.srq_limit = 4;
  SWIRL_ASSERT_OK(srq_->Modify(arm, IBV_SRQ_LIMIT));
  absl::StatusOr<ibv_srq_attr> attr = srq_->Query();
  ASSERT_TRUE(attr.ok()) << attr.status();
  EXPECT_EQ(attr->srq_limit, 4u);
  EXPECT_GE(attr->max_wr, 16u);
  verbs::Context& context = pd_->context();
  // 8 -> 4 receives left: not below the limit.
  for (uint64_t m = 0; m < 4; ++m) {
    ExpectWc(SendOne(m), {.wr_id = m, .qp_num = receivers_[0]->qpn(), .byte_len = 32});
  }
  absl::StatusOr<ibv_async_event> early = context.NextAsyncEvent(kQuiet);
  EXPECT_FALSE(early.ok()) << "an event with 4 receives left: "
                           << ibv_event_type_str(early->event_type);
  // 3 left: below.
  ExpectWc(SendOne(4), {.wr_id = 4, .qp_num = receivers_[0]->qpn(), .byte_len = 32});
  absl::StatusOr<ibv_async_event> event = context.NextAsyncEvent(kTimeout);
  ASSERT_TRUE(event.ok()) << event.status();
  EXPECT_EQ(event->event_type, IBV_EVENT_SRQ_LIMIT_REACHED)
      << ibv_event_type_str(event->event_type);
  EXPECT_EQ(event->element.srq, srq_->get());
  attr = srq_->Query();
  ASSERT_TRUE(attr.ok()) << attr.status();
  EXPECT_EQ(attr->srq_limit, 0u) << "the limit stays armed after it fired";
  // Disarmed: draining further raises nothing more.
  ExpectWc(SendOne(5), {.wr_id = 5, .qp_num = receivers_[0]->qpn(), .byte_len = 32});
  absl::StatusOr<ibv_async_event> again = context.NextAsyncEvent(kQuiet);
  EXPECT_FALSE(again.ok()) << "a second event: " << ibv_event_type_str(again->event_type);
}

// An event not yet read goes with its SRQ: once the SRQ is destroyed it is neither delivered nor
// announced on async_fd (the kernel drops a destroyed object's events the same way).
TEST_P(SrqControlTest, AnUnreadLimitEventGoesWithItsSrq) {
  ASSERT_NO_FATAL_FAILURE(SetUpSrq(8));
  for (uint64_t id = 0; id < 4; ++id) ASSERT_EQ(PostSrqRecv(id), 0);
  ibv_srq_attr arm{};
  arm.srq_limit = 4;
  SWIRL_ASSERT_OK(srq_->Modify(arm, IBV_SRQ_LIMIT));
  ExpectWc(SendOne(0), {.wr_id = 0, .qp_num = receivers_[0]->qpn(), .byte_len = 32});
  absl::StatusOr<ibv_srq_attr> attr = srq_->Query();
  ASSERT_TRUE(attr.ok()) << attr.status();
  ASSERT_EQ(attr->srq_limit, 0u) << "the limit did not fire";
  verbs::Context& context = pd_->context();
  receivers_.clear();  // the QP first: an SRQ with QPs cannot be destroyed
  receiver_options_.srq.reset();
  srq_.reset();
  absl::StatusOr<ibv_async_event> stale = context.NextAsyncEvent(kQuiet);
  EXPECT_FALSE(stale.ok()) << "an event of a destroyed SRQ: "
                           << ibv_event_type_str(stale->event_type);
}

TEST_P(SrqControlTest, ModifyMaxWrGrowsTheQueue) {
  ASSERT_NO_FATAL_FAILURE(SetUpSrq(4));
  absl::StatusOr<ibv_device_attr_ex> device_attr = pd_->context().QueryDevice();
  ASSERT_TRUE(device_attr.ok()) << device_attr.status();
  if (!(device_attr->orig_attr.device_cap_flags & IBV_DEVICE_SRQ_RESIZE)) {
    GTEST_SKIP() << device() << " does not advertise IBV_DEVICE_SRQ_RESIZE";
  }
  absl::StatusOr<ibv_srq_attr> attr = srq_->Query();
  ASSERT_TRUE(attr.ok()) << attr.status();
  const uint64_t room = attr->max_wr;
  for (uint64_t id = 0; id < room; ++id) ASSERT_EQ(PostSrqRecv(id), 0);
  EXPECT_NE(PostSrqRecv(room), 0) << "the SRQ took more than max_wr receives";
  ibv_srq_attr grow{};
  grow.max_wr = static_cast<uint32_t>(room) + 4;
  SWIRL_ASSERT_OK(srq_->Modify(grow, IBV_SRQ_MAX_WR));
  attr = srq_->Query();
  ASSERT_TRUE(attr.ok()) << attr.status();
  EXPECT_GE(attr->max_wr, room + 4);
  for (uint64_t id = room; id < room + 4; ++id) ASSERT_EQ(PostSrqRecv(id), 0) << id;
  // Every receive, those posted before the resize first, in order.
  for (uint64_t m = 0; m < room + 4; ++m) {
    const ibv_wc wc = SendOne(100 + m);
    ExpectWc(wc, {.wr_id = m, .qp_num = receivers_[0]->qpn(), .byte_len = 32});
    EXPECT_EQ(FindPatternMismatch(receivers_[0]->data(m * kSlot), 32, 100 + m), -1);
  }
  // A limit larger than the queue is refused.
  absl::StatusOr<ibv_srq_attr> now = srq_->Query();
  ASSERT_TRUE(now.ok()) << now.status();
  ibv_srq_attr too_high{};
  too_high.srq_limit = now->max_wr + 1;
  EXPECT_FALSE(srq_->Modify(too_high, IBV_SRQ_LIMIT).ok());
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(SrqControlTest);

}  // namespace
}  // namespace swirl::conformance
