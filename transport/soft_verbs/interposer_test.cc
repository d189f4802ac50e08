// libswirl_soft_verbs.so as a program sees it: this test links libibverbs like any verbs
// program and runs with the interposer preloaded (BUILD), calling libibverbs' exported
// functions, never swirl's. Each case checks a convention of libibverbs' own (its man pages and
// code): what the call returns, what errno says, what it leaves alone.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <poll.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// libibverbs' private query (IBVERBS_PRIVATE_*), which ibv_devinfo and pyverbs import.
enum ibv_gid_type_sysfs { kSysfsRoceV1, kSysfsRoceV2 };
extern "C" int ibv_query_gid_type(ibv_context*, uint8_t, unsigned int, ibv_gid_type_sysfs*);

ibv_device* FindDevice(ibv_device** list, const char* name) {
  for (int i = 0; list != nullptr && list[i] != nullptr; ++i) {
    if (std::strcmp(ibv_get_device_name(list[i]), name) == 0) return list[i];
  }
  return nullptr;
}

class InterposerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    list_ = ibv_get_device_list(&count_);
    ASSERT_NE(list_, nullptr) << std::strerror(errno);
    device_ = FindDevice(list_, "soft0");
    ASSERT_NE(device_, nullptr) << "soft0 is not in the device list";
    context_ = ibv_open_device(device_);
    ASSERT_NE(context_, nullptr) << std::strerror(errno);
  }
  void TearDown() override {
    if (context_ != nullptr) {
      EXPECT_EQ(ibv_close_device(context_), 0);
    }
    ibv_free_device_list(list_);
  }

  ibv_device** list_ = nullptr;
  int count_ = 0;
  ibv_device* device_ = nullptr;
  ibv_context* context_ = nullptr;
};

TEST(InterposerDevices, Soft0IsListedAfterRealDevicesEvenWithoutKernelSupport) {
  int count = -1;
  ibv_device** list = ibv_get_device_list(&count);
  ASSERT_NE(list, nullptr) << std::strerror(errno);
  ASSERT_GE(count, 1);
  EXPECT_EQ(list[count], nullptr) << "the list is NULL-terminated";
  EXPECT_STREQ(ibv_get_device_name(list[count - 1]), "soft0");
  for (int i = 0; i + 1 < count; ++i) {
    EXPECT_STRNE(ibv_get_device_name(list[i]), "soft0") << "soft0 comes after real devices";
  }
  ibv_free_device_list(list);
}

TEST(InterposerDevices, EveryListPresentsTheSameDeviceWithAStableGuid) {
  ibv_device** a = ibv_get_device_list(nullptr);
  ibv_device** b = ibv_get_device_list(nullptr);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ibv_device* da = FindDevice(a, "soft0");
  ibv_device* db = FindDevice(b, "soft0");
  EXPECT_EQ(da, db);
  const __be64 guid = ibv_get_device_guid(da);
  EXPECT_NE(guid, 0u);
  EXPECT_EQ(ibv_get_device_guid(db), guid);
  ibv_context* context = ibv_open_device(da);
  ASSERT_NE(context, nullptr);
  EXPECT_EQ(context->device, da) << "the context names the device the program opened";
  ibv_device_attr attr;
  ASSERT_EQ(ibv_query_device(context, &attr), 0);
  EXPECT_EQ(attr.node_guid, guid);
  EXPECT_NE(attr.vendor_id, 0u);
  EXPECT_EQ(ibv_get_device_index(da), -1) << "no kernel device, no kernel index";
  EXPECT_EQ(ibv_close_device(context), 0);
  ibv_free_device_list(a);
  ibv_free_device_list(b);
}

// A provider probe reads past ibv_device into libibverbs' own device structure (mlx5's
// mlx5dv_is_supported reads the provider's ops pointer there): the block is zeros, not another
// allocation.
TEST_F(InterposerTest, TheDeviceBlockPastIbvDeviceIsZeros) {
  const unsigned char* past = reinterpret_cast<const unsigned char*>(device_) + sizeof(ibv_device);
  for (size_t i = 0; i < 256; ++i) EXPECT_EQ(past[i], 0) << "byte " << i << " past ibv_device";
}

TEST_F(InterposerTest, GidQueriesFollowLibibverbsConventions) {
  ibv_port_attr port;
  ASSERT_EQ(ibv_query_port(context_, 1, &port), 0);
  ASSERT_GE(port.gid_tbl_len, 1);
  ibv_gid gid;
  ASSERT_EQ(ibv_query_gid(context_, 1, 0, &gid), 0);
  errno = 0;
  EXPECT_EQ(ibv_query_gid(context_, 1, port.gid_tbl_len, &gid), -1) << "past the table: -1";
  EXPECT_EQ(errno, EINVAL);
  ibv_gid_entry entry;
  ASSERT_EQ(ibv_query_gid_ex(context_, 1, 0, &entry, 0), 0);
  EXPECT_EQ(std::memcmp(&entry.gid, &gid, sizeof(gid)), 0);
  EXPECT_EQ(entry.gid_type, IBV_GID_TYPE_ROCE_V2);
  EXPECT_EQ(ibv_query_gid_ex(context_, 1, 0, &entry, 1), EOPNOTSUPP) << "no flags: positive errno";
  std::vector<ibv_gid_entry> table(port.gid_tbl_len);
  EXPECT_EQ(ibv_query_gid_table(context_, table.data(), table.size(), 0),
            static_cast<ssize_t>(table.size()));
  EXPECT_EQ(ibv_query_gid_table(context_, table.data(), 0, 0), -EINVAL) << "too small: -errno";
  ibv_gid_type_sysfs type = kSysfsRoceV1;
  ASSERT_EQ(ibv_query_gid_type(context_, 1, 0, &type), 0);
  EXPECT_EQ(type, kSysfsRoceV2);
  __be16 pkey = 0;
  ASSERT_EQ(ibv_query_pkey(context_, 1, 0, &pkey), 0);
  EXPECT_EQ(pkey, htobe16(0xffff));
  EXPECT_EQ(ibv_query_pkey(context_, 1, port.pkey_tbl_len, &pkey), -1);
}

TEST_F(InterposerTest, WhatTheSoftDeviceDoesNotOfferFailsWithEopnotsupp) {
  ibv_pd* pd = ibv_alloc_pd(context_);
  ASSERT_NE(pd, nullptr);
  ibv_ah_attr ah{};
  errno = 0;
  EXPECT_EQ(ibv_create_ah(pd, &ah), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  errno = 0;
  EXPECT_EQ(ibv_reg_dmabuf_mr(pd, 0, 4096, 0, -1, IBV_ACCESS_LOCAL_WRITE), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  std::vector<char> buffer(8192);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr_iova(pd, buffer.data(), buffer.size(), 0x10000, IBV_ACCESS_LOCAL_WRITE),
            nullptr)
      << "a region at another IOVA";
  EXPECT_EQ(errno, EOPNOTSUPP);
  errno = 0;
  EXPECT_EQ(ibv_import_pd(context_, 1), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
}

TEST_F(InterposerTest, ObjectsOfTheWrongContextAreRefused) {
  ibv_context* other = ibv_open_device(device_);
  ASSERT_NE(other, nullptr);
  ibv_pd* pd = ibv_alloc_pd(context_);
  ibv_cq* foreign_cq = ibv_create_cq(other, 16, nullptr, nullptr, 0);
  ibv_comp_channel* foreign_channel = ibv_create_comp_channel(other);
  ASSERT_NE(pd, nullptr);
  ASSERT_NE(foreign_cq, nullptr);
  ASSERT_NE(foreign_channel, nullptr);
  errno = 0;
  EXPECT_EQ(ibv_create_cq(context_, 16, nullptr, foreign_channel, 0), nullptr);
  EXPECT_EQ(errno, EINVAL);
  ibv_qp_init_attr init{};
  init.send_cq = init.recv_cq = foreign_cq;
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = init.cap.max_recv_wr = 4;
  init.cap.max_send_sge = init.cap.max_recv_sge = 1;
  errno = 0;
  EXPECT_EQ(ibv_create_qp(pd, &init), nullptr);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(ibv_destroy_comp_channel(foreign_channel), 0);
  EXPECT_EQ(ibv_destroy_cq(foreign_cq), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
  EXPECT_EQ(ibv_close_device(other), 0);
}

// ibv_get_async_event blocks by default, as libibverbs' read() of the kernel's fd does, and
// fails with EAGAIN once the program makes the fd non-blocking.
TEST_F(InterposerTest, AsyncEventsBlockUnlessTheFdIsNonBlocking) {
  const int flags = fcntl(context_->async_fd, F_GETFL);
  ASSERT_GE(flags, 0);
  EXPECT_FALSE(flags & O_NONBLOCK) << "libibverbs' default is a blocking fd";
  pollfd ready{context_->async_fd, POLLIN, 0};
  EXPECT_EQ(poll(&ready, 1, 0), 0) << "no event is pending";
  ASSERT_EQ(fcntl(context_->async_fd, F_SETFL, flags | O_NONBLOCK), 0);
  ibv_async_event event;
  errno = 0;
  EXPECT_EQ(ibv_get_async_event(context_, &event), -1);
  EXPECT_EQ(errno, EAGAIN);
}

// Programs often exit without destroying everything: closing the device still succeeds, and
// what was left open can still be destroyed (the context lives on until the last of it goes).
TEST_F(InterposerTest, ClosingADeviceWithObjectsLeftSucceedsAndTheyCanStillBeDestroyed) {
  ibv_context* context = ibv_open_device(device_);
  ASSERT_NE(context, nullptr);
  ibv_pd* pd = ibv_alloc_pd(context);
  ibv_cq* cq = ibv_create_cq(context, 16, nullptr, nullptr, 0);
  ASSERT_NE(pd, nullptr);
  ASSERT_NE(cq, nullptr);
  EXPECT_EQ(ibv_close_device(context), 0);
  EXPECT_EQ(ibv_destroy_cq(cq), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
}

// The same for objects made by libibverbs' inline extended calls, which reach the device through
// the context's tables, not through an exported call.
TEST_F(InterposerTest, ExtendedObjectsKeepAClosedDeviceAliveToo) {
  ibv_context* context = ibv_open_device(device_);
  ASSERT_NE(context, nullptr);
  ibv_pd* pd = ibv_alloc_pd(context);
  ASSERT_NE(pd, nullptr);
  ibv_cq_init_attr_ex cq_attr{};
  cq_attr.cqe = 16;
  cq_attr.wc_flags = IBV_WC_EX_WITH_BYTE_LEN;
  ibv_cq_ex* cq = ibv_create_cq_ex(context, &cq_attr);
  ASSERT_NE(cq, nullptr) << std::strerror(errno);
  ibv_qp_init_attr_ex qp_attr{};
  qp_attr.qp_type = IBV_QPT_RC;
  qp_attr.send_cq = qp_attr.recv_cq = ibv_cq_ex_to_cq(cq);
  qp_attr.cap.max_send_wr = qp_attr.cap.max_recv_wr = 4;
  qp_attr.cap.max_send_sge = qp_attr.cap.max_recv_sge = 1;
  qp_attr.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  qp_attr.pd = pd;
  qp_attr.send_ops_flags = IBV_QP_EX_WITH_SEND;
  ibv_qp* qp = ibv_create_qp_ex(context, &qp_attr);
  ASSERT_NE(qp, nullptr) << std::strerror(errno);
  ASSERT_EQ(ibv_dealloc_pd(pd), EBUSY);
  EXPECT_EQ(ibv_close_device(context), 0);
  EXPECT_EQ(ibv_destroy_qp(qp), 0);
  EXPECT_EQ(ibv_destroy_cq(ibv_cq_ex_to_cq(cq)), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
}

TEST_F(InterposerTest, AProtectionDomainInUseIsBusy) {
  ibv_pd* pd = ibv_alloc_pd(context_);
  ASSERT_NE(pd, nullptr);
  std::vector<char> buffer(4096);
  ibv_mr* mr = ibv_reg_mr(pd, buffer.data(), buffer.size(), IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY) << "a positive errno, as libibverbs returns";
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
}

}  // namespace
