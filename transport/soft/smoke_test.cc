// Quick end-to-end checks of the soft device in one process (the full conformance suite lives in
// transport/conformance).

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "transport/soft/soft_device.h"
#include "transport/soft/test_side.h"
#include "transport/verbs/verbs.h"

namespace swirl::soft {
namespace {

// Whole 1 MiB buffers with every remote access, so each opcode has room and rights.
Side MakeSmokeSide(const char* name) {
  return MakeSide(name, {.buffer_size = 1 << 20,
                         .mr_access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                      IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC});
}

void Connect(Side& a, Side& b) { ASSERT_TRUE(ConnectSides(a, b).ok()); }

// Polls both CQs until `side`'s CQ yields a completion.
ibv_wc Wait(Side& side, Side& other) {
  ibv_wc wc;
  ibv_wc ignored[4];
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    if (side.cq->Poll(1, &wc) == 1) return wc;
    if (&other != &side) other.cq->Poll(0, ignored);
  }
  ADD_FAILURE() << "no completion within 10 s";
  std::memset(&wc, 0, sizeof(wc));
  wc.status = IBV_WC_GENERAL_ERR;
  return wc;
}

TEST(SoftSmoke, SendRecvWriteReadAcrossTwoDevices) {
  Side a = MakeSmokeSide("soft0");
  Side b = MakeSmokeSide("soft1");
  Connect(a, b);

  ibv_sge rsge{reinterpret_cast<uint64_t>(b.buf.data()), 4096, b.mr->lkey()};
  ibv_recv_wr recv{};
  recv.wr_id = 7;
  recv.sg_list = &rsge;
  recv.num_sge = 1;
  ibv_recv_wr* bad_recv;
  ASSERT_EQ(ibv_post_recv(b.qp->get(), &recv, &bad_recv), 0);

  std::strcpy(a.buf.data(), "hello soft device");
  ibv_sge ssge{reinterpret_cast<uint64_t>(a.buf.data()), 18, a.mr->lkey()};
  ibv_send_wr send{};
  send.wr_id = 1;
  send.opcode = IBV_WR_SEND;
  send.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
  send.sg_list = &ssge;
  send.num_sge = 1;
  ibv_send_wr* bad;
  ASSERT_EQ(ibv_post_send(a.qp->get(), &send, &bad), 0);
  ibv_wc wc = Wait(b, a);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.wr_id, 7u);
  EXPECT_EQ(wc.opcode, IBV_WC_RECV);
  EXPECT_EQ(wc.byte_len, 18u);
  EXPECT_EQ(wc.src_qp, a.qp->qp_num());
  EXPECT_STREQ(b.buf.data(), "hello soft device");
  wc = Wait(a, b);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.wr_id, 1u);
  EXPECT_EQ(wc.opcode, IBV_WC_SEND);

  // 1 MiB RDMA WRITE then READ back into a different place.
  for (size_t i = 0; i < 512 * 1024; ++i) a.buf[i] = static_cast<char>(i * 7);
  ibv_sge wsge{reinterpret_cast<uint64_t>(a.buf.data()), 512 * 1024, a.mr->lkey()};
  ibv_send_wr write{};
  write.wr_id = 2;
  write.opcode = IBV_WR_RDMA_WRITE;
  write.send_flags = IBV_SEND_SIGNALED;
  write.sg_list = &wsge;
  write.num_sge = 1;
  write.wr.rdma.remote_addr = reinterpret_cast<uint64_t>(b.buf.data()) + 512 * 1024;
  write.wr.rdma.rkey = b.mr->rkey();
  ASSERT_EQ(ibv_post_send(a.qp->get(), &write, &bad), 0);
  wc = Wait(a, b);
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << wc.status;
  EXPECT_EQ(std::memcmp(a.buf.data(), b.buf.data() + 512 * 1024, 512 * 1024), 0);

  std::memset(a.buf.data() + 512 * 1024, 0, 512 * 1024);
  ibv_sge rdsge{reinterpret_cast<uint64_t>(a.buf.data()) + 512 * 1024, 512 * 1024, a.mr->lkey()};
  ibv_send_wr read{};
  read.wr_id = 3;
  read.opcode = IBV_WR_RDMA_READ;
  read.send_flags = IBV_SEND_SIGNALED;
  read.sg_list = &rdsge;
  read.num_sge = 1;
  read.wr.rdma.remote_addr = reinterpret_cast<uint64_t>(b.buf.data()) + 512 * 1024;
  read.wr.rdma.rkey = b.mr->rkey();
  ASSERT_EQ(ibv_post_send(a.qp->get(), &read, &bad), 0);
  wc = Wait(a, b);
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << wc.status;
  EXPECT_EQ(wc.opcode, IBV_WC_RDMA_READ);
  EXPECT_EQ(std::memcmp(a.buf.data(), a.buf.data() + 512 * 1024, 512 * 1024), 0);

  // A bad rkey: remote access error, both sides go to error.
  read.wr.rdma.rkey = b.mr->rkey() ^ 0x100;
  read.wr_id = 4;
  ASSERT_EQ(ibv_post_send(a.qp->get(), &read, &bad), 0);
  wc = Wait(a, b);
  EXPECT_EQ(wc.status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(*a.qp->QueryState(), IBV_QPS_ERR);
  absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (*b.qp->QueryState() != IBV_QPS_ERR && absl::Now() < deadline) b.cq->Poll(0, nullptr);
  EXPECT_EQ(*b.qp->QueryState(), IBV_QPS_ERR);
}

// The device answers whether two GIDs can link (DeviceOps::CheckReachable, what a server asks
// before it accepts a client): only within one fabric, shared memory or TCP.
TEST(SoftSmoke, APeerOnTheOtherFabricIsUnreachableSayingWhy) {
  auto ops = OpenSoftDevice("soft0");
  ASSERT_TRUE(ops.ok()) << ops.status();
  std::shared_ptr<verbs::Context> context = verbs::Context::Wrap(std::move(*ops));
  absl::StatusOr<ibv_gid> own = context->QueryGid(1, 0);
  ASSERT_TRUE(own.ok()) << own.status();
  ibv_gid shm{};  // fe80::1
  shm.raw[0] = 0xfe;
  shm.raw[1] = 0x80;
  shm.raw[15] = 1;
  ibv_gid tcp{};  // ::ffff:127.0.0.1, port 7000 in bytes 8-9
  tcp.raw[8] = 7000 >> 8;
  tcp.raw[9] = 7000 & 0xff;
  tcp.raw[10] = tcp.raw[11] = 0xff;
  tcp.raw[12] = 127;
  tcp.raw[15] = 1;
  EXPECT_TRUE(context->CheckReachable(*own, *own).ok());
  EXPECT_TRUE(context->CheckReachable(shm, shm).ok());
  EXPECT_TRUE(context->CheckReachable(tcp, tcp).ok());
  for (const auto& [local, remote] : {std::pair(shm, tcp), std::pair(tcp, shm)}) {
    absl::Status s = context->CheckReachable(local, remote);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("SWIRL_SOFT_TCP on both ends"), absl::string_view::npos) << s;
  }
  absl::Status s = context->CheckReachable(shm, tcp);
  EXPECT_NE(s.message().find("the peer's soft device is on TCP"), absl::string_view::npos) << s;
}

}  // namespace
}  // namespace swirl::soft
