// The soft device's own promises about the extended verbs, beyond what the conformance suite
// checks on every device (transport/conformance/extended_api_test.cc): exactly what it refuses
// and with which error, so that programs probing for features (rdma-core's pyverbs tests skip on
// EOPNOTSUPP) and programs with bugs get a clear answer instead of a half-working object.

#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "transport/soft/test_side.h"
#include "transport/verbs/verbs.h"

namespace swirl::soft {
namespace {

// ---- ibv_create_cq_ex ---------------------------------------------------------------------------

// 0, or the errno of a failed ibv_create_cq_ex (the CQ is destroyed again).
int CreateCqEx(Side& side, ibv_cq_init_attr_ex attr) {
  errno = 0;
  ibv_cq_ex* cq = ibv_create_cq_ex(side.ctx->get(), &attr);
  if (cq == nullptr) return errno;
  EXPECT_EQ(side.ctx->ops().DestroyCq(ibv_cq_ex_to_cq(cq)), 0);
  return 0;
}

ibv_cq_init_attr_ex CqAttr() {
  ibv_cq_init_attr_ex attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.cqe = 16;
  return attr;
}

TEST(SoftCqEx, RefusesWhatItCannotReport) {
  Side a = MakeSide("soft0");
  ibv_cq_init_attr_ex attr = CqAttr();
  attr.wc_flags = IBV_WC_STANDARD_FLAGS;
  EXPECT_EQ(CreateCqEx(a, attr), 0);
  // No device clock, no Ethernet layer, no tag matching: "not supported".
  for (uint64_t flag : {IBV_WC_EX_WITH_COMPLETION_TIMESTAMP, IBV_WC_EX_WITH_CVLAN,
                        IBV_WC_EX_WITH_FLOW_TAG, IBV_WC_EX_WITH_TM_INFO,
                        IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK}) {
    attr = CqAttr();
    attr.wc_flags = IBV_WC_STANDARD_FLAGS | flag;
    EXPECT_EQ(CreateCqEx(a, attr), EOPNOTSUPP) << "wc_flags 0x" << std::hex << flag;
  }
  attr = CqAttr();
  attr.comp_mask = IBV_CQ_INIT_ATTR_MASK_PD;  // parent domains
  attr.parent_domain = a.pd->get();
  EXPECT_EQ(CreateCqEx(a, attr), EOPNOTSUPP);
  attr = CqAttr();
  attr.comp_mask = IBV_CQ_INIT_ATTR_MASK_FLAGS;
  attr.flags = IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN;  // an overflowed CQ always goes to error
  EXPECT_EQ(CreateCqEx(a, attr), EOPNOTSUPP);
  attr.flags = IBV_CREATE_CQ_ATTR_SINGLE_THREADED;
  EXPECT_EQ(CreateCqEx(a, attr), 0);
  // Bits libibverbs does not define are invalid, not "unsupported".
  attr = CqAttr();
  attr.wc_flags = uint64_t{1} << 20;
  EXPECT_EQ(CreateCqEx(a, attr), EINVAL);
  attr = CqAttr();
  attr.comp_mask = 1u << 5;
  EXPECT_EQ(CreateCqEx(a, attr), EINVAL);
  attr = CqAttr();
  attr.comp_mask = IBV_CQ_INIT_ATTR_MASK_FLAGS;
  attr.flags = 1u << 5;
  EXPECT_EQ(CreateCqEx(a, attr), EINVAL);
}

// As rxe and mlx5 do: an accessor for a field the CQ was not created for is left null.
TEST(SoftCqEx, OnlyTheFieldsAskedForHaveAccessors) {
  Side a = MakeSide("soft0");
  ibv_cq_init_attr_ex attr = CqAttr();
  attr.wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_QP_NUM;
  ibv_cq_ex* cq = ibv_create_cq_ex(a.ctx->get(), &attr);
  ASSERT_NE(cq, nullptr) << std::strerror(errno);
  EXPECT_NE(cq->start_poll, nullptr);
  EXPECT_NE(cq->next_poll, nullptr);
  EXPECT_NE(cq->end_poll, nullptr);
  EXPECT_NE(cq->read_opcode, nullptr);
  EXPECT_NE(cq->read_vendor_err, nullptr);
  EXPECT_NE(cq->read_wc_flags, nullptr);
  EXPECT_NE(cq->read_byte_len, nullptr);
  EXPECT_NE(cq->read_qp_num, nullptr);
  EXPECT_EQ(cq->read_imm_data, nullptr);
  EXPECT_EQ(cq->read_src_qp, nullptr);
  EXPECT_EQ(cq->read_slid, nullptr);
  EXPECT_EQ(cq->read_sl, nullptr);
  EXPECT_EQ(cq->read_dlid_path_bits, nullptr);
  EXPECT_EQ(cq->read_completion_ts, nullptr);
  EXPECT_EQ(a.ctx->ops().DestroyCq(ibv_cq_ex_to_cq(cq)), 0);
}

}  // namespace
}  // namespace swirl::soft
