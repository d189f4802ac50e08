// Every send opcode's happy path, with the exact completions on both sides.

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <cstring>
#include <memory>
#include <vector>

#include "transport/conformance/conformance.h"
#include "transport/verbs/verbs.h"

namespace swirl::conformance {
namespace {

using verbs::MemoryWindow;

class OpcodeTest : public DeviceTest {
 protected:
  uint64_t Load64(const Endpoint& ep, size_t offset) {
    return __atomic_load_n(reinterpret_cast<uint64_t*>(ep.data(offset)), __ATOMIC_SEQ_CST);
  }
  void Store64(const Endpoint& ep, size_t offset, uint64_t value) {
    __atomic_store_n(reinterpret_cast<uint64_t*>(ep.data(offset)), value, __ATOMIC_SEQ_CST);
  }
};

TEST_P(OpcodeTest, Send) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  FillPattern(a_->data(), 1000, 1);
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 1000).Post(a_->ibqp()), 0);

  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 1000,
                                 .wc_flags = 0,
                                 .src_qp = a_->qpn()});
  ExpectWc(Poll(a_->send_cq()),
           {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND, .wc_flags = 0});
  EXPECT_EQ(FindPatternMismatch(b_->data(), 1000, 1), -1);
  EXPECT_EQ(b_->data()[1000], 0) << "SEND wrote past its length";
}

TEST_P(OpcodeTest, SendWithImmediate) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const uint32_t imm = htonl(0x12345678);
  FillPattern(a_->data(), 333, 2);
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
  ASSERT_EQ(SendWr(2, IBV_WR_SEND_WITH_IMM).Local(*a_, 0, 333).Imm(imm).Post(a_->ibqp()), 0);

  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 333,
                                 .wc_flags = IBV_WC_WITH_IMM,
                                 .imm_data = imm,
                                 .src_qp = a_->qpn()});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 2, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  EXPECT_EQ(FindPatternMismatch(b_->data(), 333, 2), -1);
}

TEST_P(OpcodeTest, SendWithInvalidate) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  if (!facts().mw_type2) GTEST_SKIP() << device() << " has no type 2 memory windows";
  auto mw = MemoryWindow::Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_TRUE(mw.ok()) << mw.status().ToString();
  const uint32_t rkey = ibv_inc_rkey((*mw)->rkey());
  ExpectWc(BindType2(*b_, (*mw)->get(), rkey, b_->mr().get(), b_->addr(8192), 4096,
                     IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE),
           {.wr_id = 0xb1d, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});

  FillPattern(a_->data(), 64, 3);
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
  ASSERT_EQ(SendWr(3, IBV_WR_SEND_WITH_INV).Local(*a_, 0, 64).Invalidate(rkey).Post(a_->ibqp()), 0);
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 64,
                                 .wc_flags = IBV_WC_WITH_INV,
                                 .invalidated_rkey = rkey,
                                 .src_qp = a_->qpn()});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 3, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  EXPECT_EQ(FindPatternMismatch(b_->data(), 64, 3), -1);
}

TEST_P(OpcodeTest, RdmaWriteConsumesNoReceive) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  FillPattern(a_->data(), 4096, 4);
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 64), 0);
  ASSERT_EQ(SendWr(4, IBV_WR_RDMA_WRITE)
                .Local(*a_, 0, 4096)
                .Remote(b_->addr(8192), b_->rkey())
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()),
           {.wr_id = 4, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE, .wc_flags = 0});
  EXPECT_EQ(FindPatternMismatch(b_->data(8192), 4096, 4), -1);
  EXPECT_EQ(b_->data()[8192 + 4096], 0) << "RDMA WRITE wrote past its length";

  // The receive posted before the WRITE is still the first one a SEND consumes.
  ASSERT_EQ(SendWr(5, IBV_WR_SEND).Local(*a_, 0, 8).Post(a_->ibqp()), 0);
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 8,
                                 .wc_flags = 0,
                                 .src_qp = a_->qpn()});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 5, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
}

TEST_P(OpcodeTest, RdmaWriteWithImmediateConsumesAReceive) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const uint32_t imm = htonl(0xfeedf00d);
  FillPattern(a_->data(), 4096, 5);
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 64), 0);
  ASSERT_EQ(SendWr(6, IBV_WR_RDMA_WRITE_WITH_IMM)
                .Local(*a_, 0, 4096)
                .Remote(b_->addr(8192), b_->rkey())
                .Imm(imm)
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV_RDMA_WITH_IMM,
                                 .byte_len = 4096,
                                 .wc_flags = IBV_WC_WITH_IMM,
                                 .imm_data = imm,
                                 .src_qp = a_->qpn()});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 6, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  EXPECT_EQ(FindPatternMismatch(b_->data(8192), 4096, 5), -1);
  for (int i = 0; i < 64; ++i) {
    ASSERT_EQ(b_->data()[i], 0) << "the receive buffer of a WRITE with immediate was written";
  }
}

TEST_P(OpcodeTest, RdmaRead) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  FillPattern(b_->data(8192), 4096, 6);
  ASSERT_EQ(SendWr(7, IBV_WR_RDMA_READ)
                .Local(*a_, 0, 4096)
                .Remote(b_->addr(8192), b_->rkey())
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 7,
                                 .qp_num = a_->qpn(),
                                 .opcode = IBV_WC_RDMA_READ,
                                 .byte_len = 4096,
                                 .wc_flags = 0});
  EXPECT_EQ(FindPatternMismatch(a_->data(), 4096, 6), -1);
  EXPECT_EQ(a_->data()[4096], 0) << "RDMA READ wrote past its length";
}

TEST_P(OpcodeTest, AtomicCompareAndSwap) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  if (!facts().atomics) GTEST_SKIP() << device() << " has no atomics";
  Store64(*b_, 64, 100);
  ASSERT_EQ(SendWr(8, IBV_WR_ATOMIC_CMP_AND_SWP)
                .Local(*a_, 0, 8)
                .Atomic(b_->addr(64), b_->rkey(), /*compare=*/100, /*swap=*/555)
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()),
           {.wr_id = 8, .qp_num = a_->qpn(), .opcode = IBV_WC_COMP_SWAP, .byte_len = 8});
  EXPECT_EQ(Load64(*a_, 0), 100u) << "the original value comes back";
  EXPECT_EQ(Load64(*b_, 64), 555u) << "equal: swapped";

  // Not equal: no swap, the current value comes back.
  ASSERT_EQ(SendWr(9, IBV_WR_ATOMIC_CMP_AND_SWP)
                .Local(*a_, 8, 8)
                .Atomic(b_->addr(64), b_->rkey(), /*compare=*/100, /*swap=*/777)
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()),
           {.wr_id = 9, .qp_num = a_->qpn(), .opcode = IBV_WC_COMP_SWAP, .byte_len = 8});
  EXPECT_EQ(Load64(*a_, 8), 555u);
  EXPECT_EQ(Load64(*b_, 64), 555u);
}

TEST_P(OpcodeTest, AtomicFetchAndAdd) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  if (!facts().atomics) GTEST_SKIP() << device() << " has no atomics";
  Store64(*b_, 128, 1000);
  for (uint64_t i = 0; i < 2; ++i) {
    ASSERT_EQ(SendWr(10 + i, IBV_WR_ATOMIC_FETCH_AND_ADD)
                  .Local(*a_, 8 * i, 8)
                  .Atomic(b_->addr(128), b_->rkey(), /*add=*/24)
                  .Post(a_->ibqp()),
              0);
    ExpectWc(Poll(a_->send_cq()),
             {.wr_id = 10 + i, .qp_num = a_->qpn(), .opcode = IBV_WC_FETCH_ADD, .byte_len = 8});
    EXPECT_EQ(Load64(*a_, 8 * i), 1000 + 24 * i);
  }
  EXPECT_EQ(Load64(*b_, 128), 1048u);
}

TEST_P(OpcodeTest, LocalInvalidate) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  if (!facts().mw_type2) GTEST_SKIP() << device() << " has no type 2 memory windows";
  auto mw = MemoryWindow::Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_TRUE(mw.ok()) << mw.status().ToString();
  const uint32_t rkey = ibv_inc_rkey((*mw)->rkey());
  ExpectWc(
      BindType2(*b_, (*mw)->get(), rkey, b_->mr().get(), b_->addr(0), 4096, IBV_ACCESS_REMOTE_READ),
      {.wr_id = 0xb1d, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW});
  ASSERT_EQ(SendWr(0x1a, IBV_WR_LOCAL_INV).Invalidate(rkey).Post(b_->ibqp()), 0);
  ExpectWc(Poll(b_->send_cq()),
           {.wr_id = 0x1a, .qp_num = b_->qpn(), .opcode = IBV_WC_LOCAL_INV, .wc_flags = 0});

  // The key is dead.
  ASSERT_EQ(
      SendWr(11, IBV_WR_RDMA_READ).Local(*a_, 0, 64).Remote(b_->addr(0), rkey).Post(a_->ibqp()), 0);
  ExpectWc(Poll(a_->send_cq()),
           {.wr_id = 11, .status = IBV_WC_REM_ACCESS_ERR, .qp_num = a_->qpn()});
}

TEST_P(OpcodeTest, BindType2ThroughPostSend) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  if (!facts().mw_type2) GTEST_SKIP() << device() << " has no type 2 memory windows";
  auto mw = MemoryWindow::Allocate(b_->pd(), IBV_MW_TYPE_2);
  ASSERT_TRUE(mw.ok()) << mw.status().ToString();
  EXPECT_EQ((*mw)->type(), IBV_MW_TYPE_2);
  const uint32_t allocated = (*mw)->rkey();
  const uint32_t rkey = ibv_inc_rkey(allocated);
  ExpectWc(BindType2(*b_, (*mw)->get(), rkey, b_->mr().get(), b_->addr(8192), 4096,
                     IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE, 0x2b),
           {.wr_id = 0x2b, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW, .wc_flags = 0});
  EXPECT_EQ((*mw)->rkey(), allocated) << "posting a type 2 bind does not update mw->rkey";

  FillPattern(a_->data(), 4096, 7);
  ASSERT_EQ(SendWr(12, IBV_WR_RDMA_WRITE)
                .Local(*a_, 0, 4096)
                .Remote(b_->addr(8192), rkey)
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 12, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  EXPECT_EQ(FindPatternMismatch(b_->data(8192), 4096, 7), -1);

  ASSERT_EQ(SendWr(13, IBV_WR_RDMA_READ)
                .Local(*a_, 8192, 4096)
                .Remote(b_->addr(8192), rkey)
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()),
           {.wr_id = 13, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_READ, .byte_len = 4096});
  EXPECT_EQ(FindPatternMismatch(a_->data(8192), 4096, 7), -1);
}

TEST_P(OpcodeTest, BindType1ThroughIbvBindMw) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  if (!facts().mw_type1) GTEST_SKIP() << device() << " has no type 1 memory windows";
  auto mw = MemoryWindow::Allocate(b_->pd(), IBV_MW_TYPE_1);
  ASSERT_TRUE(mw.ok()) << mw.status().ToString();
  const uint32_t allocated = (*mw)->rkey();
  ibv_mw_bind bind{};
  bind.wr_id = 0x71;
  bind.send_flags = IBV_SEND_SIGNALED;
  bind.bind_info.mr = b_->mr().get();
  bind.bind_info.addr = b_->addr(8192);
  bind.bind_info.length = 4096;
  bind.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
  ASSERT_EQ(ibv_bind_mw(b_->ibqp(), (*mw)->get(), &bind), 0);
  ExpectWc(Poll(b_->send_cq()),
           {.wr_id = 0x71, .qp_num = b_->qpn(), .opcode = IBV_WC_BIND_MW, .wc_flags = 0});
  const uint32_t rkey = (*mw)->rkey();
  EXPECT_NE(rkey, allocated) << "a type 1 bind gives the window a new rkey in mw->rkey";

  FillPattern(a_->data(), 4096, 8);
  ASSERT_EQ(SendWr(14, IBV_WR_RDMA_WRITE)
                .Local(*a_, 0, 4096)
                .Remote(b_->addr(8192), rkey)
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 14, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  EXPECT_EQ(FindPatternMismatch(b_->data(8192), 4096, 8), -1);
  ASSERT_EQ(SendWr(15, IBV_WR_RDMA_READ)
                .Local(*a_, 8192, 4096)
                .Remote(b_->addr(8192), rkey)
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()),
           {.wr_id = 15, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_READ, .byte_len = 4096});
  EXPECT_EQ(FindPatternMismatch(a_->data(8192), 4096, 8), -1);
}

TEST_P(OpcodeTest, MultiSgeSendGathersAndScatters) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  // Source: three pieces of different sizes, in different places.
  FillPattern(a_->data(0), 100, 10);
  FillPattern(a_->data(4096), 300, 11);
  FillPattern(a_->data(10000), 1, 12);
  std::vector<char> message;
  message.insert(message.end(), a_->data(0), a_->data(100));
  message.insert(message.end(), a_->data(4096), a_->data(4396));
  message.insert(message.end(), a_->data(10000), a_->data(10001));
  ASSERT_EQ(message.size(), 401u);

  // Destination: three pieces with other boundaries, 1250 bytes in all.
  ASSERT_EQ(b_->PostRecv(0xb0, {{b_->addr(0), 50, b_->lkey()},
                                {b_->addr(8192), 200, b_->lkey()},
                                {b_->addr(20000), 1000, b_->lkey()}}),
            0);
  ASSERT_EQ(SendWr(16, IBV_WR_SEND)
                .Local(*a_, 0, 100)
                .Local(*a_, 4096, 300)
                .Local(*a_, 10000, 1)
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 401,
                                 .wc_flags = 0,
                                 .src_qp = a_->qpn()});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 16, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  EXPECT_EQ(std::memcmp(b_->data(0), message.data(), 50), 0);
  EXPECT_EQ(std::memcmp(b_->data(8192), message.data() + 50, 200), 0);
  EXPECT_EQ(std::memcmp(b_->data(20000), message.data() + 250, 151), 0);
  EXPECT_EQ(b_->data(50)[0], 0);
  EXPECT_EQ(b_->data(20151)[0], 0);
}

TEST_P(OpcodeTest, MultiSgeRdmaWriteAndRead) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  FillPattern(a_->data(0), 1000, 13);
  FillPattern(a_->data(8192), 3000, 14);
  FillPattern(a_->data(16384), 5, 15);
  ASSERT_EQ(SendWr(17, IBV_WR_RDMA_WRITE)
                .Local(*a_, 0, 1000)
                .Local(*a_, 8192, 3000)
                .Local(*a_, 16384, 5)
                .Remote(b_->addr(65536), b_->rkey())
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 17, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  EXPECT_EQ(FindPatternMismatch(b_->data(65536), 1000, 13), -1);
  EXPECT_EQ(FindPatternMismatch(b_->data(65536 + 1000), 3000, 14), -1);
  EXPECT_EQ(FindPatternMismatch(b_->data(65536 + 4000), 5, 15), -1);

  // Read the 4005 bytes back, scattered over three other pieces.
  ASSERT_EQ(SendWr(18, IBV_WR_RDMA_READ)
                .Local(*a_, 100000, 7)
                .Local(*a_, 200000, 2000)
                .Local(*a_, 300000, 1998)
                .Remote(b_->addr(65536), b_->rkey())
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()),
           {.wr_id = 18, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_READ, .byte_len = 4005});
  EXPECT_EQ(std::memcmp(a_->data(100000), b_->data(65536), 7), 0);
  EXPECT_EQ(std::memcmp(a_->data(200000), b_->data(65536 + 7), 2000), 0);
  EXPECT_EQ(std::memcmp(a_->data(300000), b_->data(65536 + 2007), 1998), 0);
}

TEST_P(OpcodeTest, SendLargerThan64KiB) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  constexpr uint32_t kLength = (1 << 20) + 7;
  FillPattern(a_->data(), kLength, 16);
  ASSERT_EQ(b_->PostRecv(0xb0, 0, (3 << 19)), 0);
  ASSERT_EQ(SendWr(19, IBV_WR_SEND).Local(*a_, 0, kLength).Post(a_->ibqp()), 0);
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = kLength,
                                 .wc_flags = 0,
                                 .src_qp = a_->qpn()});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 19, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  EXPECT_EQ(FindPatternMismatch(b_->data(), kLength, 16), -1);
}

TEST_P(OpcodeTest, RdmaWriteAndReadLargerThan64KiB) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  constexpr uint32_t kLength = 1 << 20;
  FillPattern(a_->data(), kLength, 17);
  ASSERT_EQ(SendWr(20, IBV_WR_RDMA_WRITE)
                .Local(*a_, 0, kLength)
                .Remote(b_->addr(4096), b_->rkey())
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 20, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_WRITE});
  EXPECT_EQ(FindPatternMismatch(b_->data(4096), kLength, 17), -1);

  ASSERT_EQ(SendWr(21, IBV_WR_RDMA_READ)
                .Local(*a_, kLength, kLength)
                .Remote(b_->addr(4096), b_->rkey())
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()),
           {.wr_id = 21, .qp_num = a_->qpn(), .opcode = IBV_WC_RDMA_READ, .byte_len = kLength});
  EXPECT_EQ(FindPatternMismatch(a_->data(kLength), kLength, 17), -1);
}

TEST_P(OpcodeTest, ZeroLengthSend) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  std::memset(b_->data(), 0xaa, 64);
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 64), 0);
  ASSERT_EQ(SendWr(22, IBV_WR_SEND).Post(a_->ibqp()), 0);  // no scatter/gather entries
  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 0,
                                 .wc_flags = 0,
                                 .src_qp = a_->qpn()});
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 22, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  for (int i = 0; i < 64; ++i) ASSERT_EQ(static_cast<uint8_t>(b_->data()[i]), 0xaa);
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(OpcodeTest);

}  // namespace
}  // namespace swirl::conformance
