// The send queue: flushing on error (unsignaled requests included), inline data, and selective
// signaling (unsignaled requests keep their slots until a later signaled completion is polled).

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "transport/conformance/conformance.h"
#include "transport/verbs/verbs.h"

namespace swirl::conformance {
namespace {

class SendQueueTest : public DeviceTest {};

// a_'s SEND waits for a receive (rnr_retry 7) with more requests, signaled and not, behind it
// and receives posted; moving a_ to ERR flushes every one of them, in order.
TEST_P(SendQueueTest, ErrorStateFlushesEverything) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  for (uint64_t i = 0; i < 4; ++i) ASSERT_EQ(a_->PostRecv(0xa0 + i, 64 * i, 64), 0);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 64).Post(a_->ibqp()), 0);
  ASSERT_EQ(SendWr(2, IBV_WR_RDMA_WRITE, 0)
                .Local(*a_, 0, 64)
                .Remote(b_->addr(4096), b_->rkey())
                .Post(a_->ibqp()),
            0);
  ASSERT_EQ(SendWr(3, IBV_WR_SEND, 0).Local(*a_, 0, 8).Post(a_->ibqp()), 0);
  ASSERT_EQ(SendWr(4, IBV_WR_RDMA_READ)
                .Local(*a_, 8192, 64)
                .Remote(b_->addr(0), b_->rkey())
                .Post(a_->ibqp()),
            0);
  EXPECT_TRUE(Observe(a_->send_cq(), absl::Milliseconds(20)).empty())
      << "the first SEND must be waiting for a receive";
  SWIRL_ASSERT_OK(a_->qp().ToError());

  std::vector<ibv_wc> sends = PollN(a_->send_cq(), 4);
  ASSERT_EQ(sends.size(), 4u);
  for (uint64_t i = 0; i < 4; ++i) {
    ExpectWc(sends[i], {.wr_id = 1 + i, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  }
  std::vector<ibv_wc> recvs = PollN(a_->recv_cq(), 4);
  ASSERT_EQ(recvs.size(), 4u);
  for (uint64_t i = 0; i < 4; ++i) {
    ExpectWc(recvs[i], {.wr_id = 0xa0 + i, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = a_->qpn()});
  }
  EXPECT_TRUE(Observe(a_->send_cq(), absl::Milliseconds(10)).empty()) << "extra completions";

  // The responder's receives flush when it goes to ERR too.
  for (uint64_t i = 0; i < 3; ++i) ASSERT_EQ(b_->PostRecv(0xb0 + i, 64 * i, 64), 0);
  SWIRL_ASSERT_OK(b_->qp().ToError());
  std::vector<ibv_wc> b_recvs = PollN(b_->recv_cq(), 3);
  ASSERT_EQ(b_recvs.size(), 3u);
  for (uint64_t i = 0; i < 3; ++i) {
    ExpectWc(b_recvs[i], {.wr_id = 0xb0 + i, .status = IBV_WC_WR_FLUSH_ERR, .qp_num = b_->qpn()});
  }
}

TEST_P(SendQueueTest, InlineBufferIsReusableRightAfterPost) {
  EndpointOptions a_options;
  a_options.max_inline_data = 256;
  ASSERT_NO_FATAL_FAILURE(Connect(a_options));
  ASSERT_GE(a_->qp().cap().max_inline_data, 200u);
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
  ASSERT_EQ(b_->PostRecv(0xb1, 4096, 4096), 0);

  // Unregistered memory: inline data is copied at post time and needs no lkey.
  std::vector<char> message(200);
  FillPattern(message.data(), message.size(), 1);
  SendWr send(1, IBV_WR_SEND, IBV_SEND_SIGNALED | IBV_SEND_INLINE);
  send.Sge(reinterpret_cast<uint64_t>(message.data()), 200, 0);
  ASSERT_EQ(send.Post(a_->ibqp()), 0);
  std::memset(message.data(), 0xee, message.size());  // before anything is polled

  // An inline RDMA WRITE, likewise.
  std::vector<char> payload(128);
  FillPattern(payload.data(), payload.size(), 2);
  SendWr write(2, IBV_WR_RDMA_WRITE, IBV_SEND_SIGNALED | IBV_SEND_INLINE);
  write.Sge(reinterpret_cast<uint64_t>(payload.data()), 128, 0).Remote(b_->addr(65536), b_->rkey());
  ASSERT_EQ(write.Post(a_->ibqp()), 0);
  std::memset(payload.data(), 0xdd, payload.size());

  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 200,
                                 .src_qp = a_->qpn()});
  std::vector<ibv_wc> sends = PollN(a_->send_cq(), 2);
  ASSERT_EQ(sends.size(), 2u);
  ExpectWc(sends[0], {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  ExpectWc(sends[1], {.wr_id = 2, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  EXPECT_EQ(FindPatternMismatch(b_->data(), 200, 1), -1) << "the SEND saw the overwrite";
  EXPECT_EQ(FindPatternMismatch(b_->data(65536), 128, 2), -1) << "the WRITE saw the overwrite";
}

TEST_P(SendQueueTest, InlineAboveTheCapIsRefused) {
  EndpointOptions a_options;
  a_options.max_inline_data = 64;
  ASSERT_NO_FATAL_FAILURE(Connect(a_options));
  const uint32_t cap = a_->qp().cap().max_inline_data;
  ASSERT_GE(cap, 64u);
  ASSERT_LT(cap + 1, a_->size());
  SendWr send(1, IBV_WR_SEND, IBV_SEND_SIGNALED | IBV_SEND_INLINE);
  send.Local(*a_, 0, cap + 1);
  ibv_send_wr* bad = nullptr;
  EXPECT_EQ(send.Post(a_->ibqp(), &bad), EINVAL);
  EXPECT_EQ(bad, send.get());

  // Exactly the cap is fine, and the refusal left the QP usable.
  ASSERT_EQ(b_->PostRecv(0xb0, 0, cap), 0);
  FillPattern(a_->data(), cap, 3);
  ASSERT_EQ(SendWr(2, IBV_WR_SEND, IBV_SEND_SIGNALED | IBV_SEND_INLINE)
                .Local(*a_, 0, cap)
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = cap,
                                 .src_qp = a_->qpn()});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 2, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  EXPECT_EQ(FindPatternMismatch(b_->data(), cap, 3), -1);
}

TEST_P(SendQueueTest, UnsignaledRequestsHoldTheirSlotsUntilASignaledCompletionIsPolled) {
  EndpointOptions a_options;
  a_options.max_send_wr = 8;
  ASSERT_NO_FATAL_FAILURE(Connect(a_options));
  const uint32_t depth = a_->qp().cap().max_send_wr;
  ASSERT_GE(depth, 8u);
  ASSERT_LE(depth, 1024u);

  // depth - 1 unsignaled WRITEs and a signaled one fill the send queue.
  auto write = [&](uint64_t wr_id, uint32_t i, unsigned int flags) {
    *reinterpret_cast<uint64_t*>(a_->data(8 * i)) = wr_id;
    return SendWr(wr_id, IBV_WR_RDMA_WRITE, flags)
        .Local(*a_, 8 * i, 8)
        .Remote(b_->addr(8 * i), b_->rkey())
        .Post(a_->ibqp());
  };
  for (uint32_t i = 0; i + 1 < depth; ++i) ASSERT_EQ(write(0x100 + i, i, 0), 0) << i;
  ASSERT_EQ(write(0x1ff, depth - 1, IBV_SEND_SIGNALED), 0);

  SendWr extra(0x200, IBV_WR_RDMA_WRITE);
  extra.Local(*a_, 0, 8).Remote(b_->addr(0), b_->rkey());
  ibv_send_wr* bad = nullptr;
  EXPECT_EQ(extra.Post(a_->ibqp(), &bad), ENOMEM) << "the send queue holds " << depth;
  EXPECT_EQ(bad, extra.get());

  // Even once all of it has landed, the slots stay taken until the completion is polled.
  ASSERT_TRUE(WaitUntil([&] {
    return *reinterpret_cast<volatile uint64_t*>(b_->data(8 * (depth - 1))) == 0x1ff;
  })) << "the last WRITE never landed";
  EXPECT_EQ(extra.Post(a_->ibqp(), &bad), ENOMEM);

  ExpectWc(Poll(a_->send_cq()), {.wr_id = 0x1ff, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  for (uint32_t i = 0; i < depth; ++i) {
    EXPECT_EQ(*reinterpret_cast<uint64_t*>(b_->data(8 * i)), i + 1 < depth ? 0x100 + i : 0x1ff);
  }

  // Now the whole queue is free again; only signaled requests complete.
  for (uint32_t i = 0; i + 1 < depth; ++i) ASSERT_EQ(write(0x300 + i, i, 0), 0) << i;
  ASSERT_EQ(write(0x3ff, depth - 1, IBV_SEND_SIGNALED), 0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 0x3ff, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  EXPECT_TRUE(Observe(a_->send_cq(), absl::Milliseconds(10)).empty())
      << "unsignaled requests completed";
}

// A signaled request between unsignaled ones, with the queue far from full and a peer that
// sends nothing back (no frame could carry an acknowledgement): it still completes.
TEST_P(SendQueueTest, ASignaledRequestBetweenUnsignaledOnesCompletes) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const unsigned int flags[] = {0, IBV_SEND_SIGNALED, 0};
  for (uint64_t i = 0; i < 3; ++i) {
    ASSERT_EQ(SendWr(1 + i, IBV_WR_RDMA_WRITE, flags[i])
                  .Local(*a_, 64 * i, 64)
                  .Remote(b_->addr(64 * i), b_->rkey())
                  .Post(a_->ibqp()),
              0);
  }
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 2, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  EXPECT_TRUE(Observe(a_->send_cq(), absl::Milliseconds(10)).empty())
      << "unsignaled requests completed";
}

TEST_P(SendQueueTest, SqSigAllSignalsEveryRequest) {
  EndpointOptions a_options;
  a_options.sq_sig_all = true;
  ASSERT_NO_FATAL_FAILURE(Connect(a_options));
  for (uint64_t i = 0; i < 3; ++i) {
    ASSERT_EQ(SendWr(1 + i, IBV_WR_RDMA_WRITE, /*no IBV_SEND_SIGNALED*/ 0)
                  .Local(*a_, 64 * i, 64)
                  .Remote(b_->addr(64 * i), b_->rkey())
                  .Post(a_->ibqp()),
              0);
  }
  std::vector<ibv_wc> wcs = PollN(a_->send_cq(), 3);
  ASSERT_EQ(wcs.size(), 3u);
  for (uint64_t i = 0; i < 3; ++i) {
    ExpectWc(wcs[i], {.wr_id = 1 + i, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  }
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(SendQueueTest);

}  // namespace
}  // namespace swirl::conformance
