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

// Polls both sides' CQs for `window`; what `side`'s CQ produced (for "nothing happens" checks,
// a bounded observation).
std::vector<ibv_wc> Observe(Side& side, Side& other, absl::Duration window) {
  std::vector<ibv_wc> out;
  const absl::Time end = absl::Now() + window;
  while (absl::Now() < end) {
    ibv_wc wc;
    if (side.cq->Poll(1, &wc) == 1) out.push_back(wc);
    other.cq->Poll(0, nullptr);
  }
  return out;
}

// The next completion of `side`'s CQ, polling `other`'s meanwhile.
ibv_wc Wait(Side& side, Side& other) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  ibv_wc wc;
  while (absl::Now() < deadline) {
    if (side.cq->Poll(1, &wc) == 1) return wc;
    other.cq->Poll(0, nullptr);
  }
  ADD_FAILURE() << "no completion within 10 s";
  std::memset(&wc, 0, sizeof(wc));
  wc.status = IBV_WC_GENERAL_ERR;
  return wc;
}

int PostRecv(Side& side, uint64_t wr_id, uint32_t length) {
  ibv_sge sge{reinterpret_cast<uint64_t>(side.buf.data()), length, side.mr->lkey()};
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  return ibv_post_recv(side.qp->get(), &wr, &bad);
}

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

// ---- ibv_create_qp_ex ---------------------------------------------------------------------------

constexpr uint64_t kSendOnly = IBV_QP_EX_WITH_SEND;

// 0, or the errno of a failed ibv_create_qp_ex; `*qpx_out` (optional) receives what
// ibv_qp_to_qp_ex says of the QP before it is destroyed again.
int CreateQpEx(Side& side, ibv_qp_init_attr_ex attr, bool* has_builders = nullptr) {
  errno = 0;
  ibv_qp* qp = ibv_create_qp_ex(side.ctx->get(), &attr);
  if (qp == nullptr) return errno;
  if (has_builders != nullptr) *has_builders = ibv_qp_to_qp_ex(qp) != nullptr;
  EXPECT_EQ(side.ctx->ops().DestroyQp(qp), 0);
  return 0;
}

ibv_qp_init_attr_ex QpAttr(Side& side) {
  ibv_qp_init_attr_ex attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.send_cq = side.cq->get();
  attr.recv_cq = side.cq->get();
  attr.cap.max_send_wr = 16;
  attr.cap.max_recv_wr = 16;
  attr.cap.max_send_sge = 1;
  attr.cap.max_recv_sge = 1;
  attr.qp_type = IBV_QPT_RC;
  attr.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  attr.pd = side.pd->get();
  attr.send_ops_flags = kSendOnly;
  return attr;
}

TEST(SoftQpEx, RefusesWhatItCannotDo) {
  Side a = MakeSide("soft0");
  bool has_builders = false;
  EXPECT_EQ(CreateQpEx(a, QpAttr(a), &has_builders), 0);
  EXPECT_TRUE(has_builders);
  // RC only: UD, TSO and atomic writes are "not supported", as are XRC, create flags, RSS.
  ibv_qp_init_attr_ex attr = QpAttr(a);
  attr.qp_type = IBV_QPT_UD;
  EXPECT_EQ(CreateQpEx(a, attr), EOPNOTSUPP);
  for (uint64_t op : {uint64_t{IBV_QP_EX_WITH_TSO}, uint64_t{IBV_QP_EX_WITH_ATOMIC_WRITE}}) {
    attr = QpAttr(a);
    attr.send_ops_flags = kSendOnly | op;
    EXPECT_EQ(CreateQpEx(a, attr), EOPNOTSUPP) << "send_ops_flags 0x" << std::hex << op;
  }
  attr = QpAttr(a);
  attr.comp_mask |= IBV_QP_INIT_ATTR_CREATE_FLAGS;
  attr.create_flags = IBV_QP_CREATE_SCATTER_FCS;
  EXPECT_EQ(CreateQpEx(a, attr), EOPNOTSUPP);
  for (uint32_t mask : {uint32_t{IBV_QP_INIT_ATTR_XRCD}, uint32_t{IBV_QP_INIT_ATTR_MAX_TSO_HEADER},
                        uint32_t{IBV_QP_INIT_ATTR_IND_TABLE}, uint32_t{IBV_QP_INIT_ATTR_RX_HASH}}) {
    attr = QpAttr(a);
    attr.comp_mask |= mask;
    EXPECT_EQ(CreateQpEx(a, attr), EOPNOTSUPP) << "comp_mask 0x" << std::hex << mask;
  }
  // A mask bit libibverbs does not define, and an RC QP without its PD: invalid.
  attr = QpAttr(a);
  attr.comp_mask |= 1u << 9;
  EXPECT_EQ(CreateQpEx(a, attr), EINVAL);
  attr = QpAttr(a);
  attr.comp_mask = IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  EXPECT_EQ(CreateQpEx(a, attr), EINVAL);
  // Without SEND_OPS_FLAGS the QP is an ordinary one: no builders.
  attr = QpAttr(a);
  attr.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS;
  attr.create_flags = 0;
  EXPECT_EQ(CreateQpEx(a, attr, &has_builders), 0);
  EXPECT_FALSE(has_builders);
}

// One ibv_wr_* batch on `side`: `build`, then ibv_wr_complete's result.
template <typename Build>
int Batch(Side& side, Build build) {
  ibv_qp_ex* qpx = side.qp->ex();
  ibv_wr_start(qpx);
  qpx->wr_id = 1;
  qpx->wr_flags = IBV_SEND_SIGNALED;
  build(qpx);
  return ibv_wr_complete(qpx);
}

// The misuses an RC QP's batch records (the first one is what ibv_wr_complete returns), and
// that none of them lets the batch's valid SEND through.
TEST(SoftQpEx, MisusedBuildersFailTheBatch) {
  Side a = MakeSide("soft0", {.max_send_wr = 4, .send_ops_flags = kSendOnly});
  Side b = MakeSide("soft1");
  ASSERT_TRUE(ConnectSides(a, b).ok());
  ASSERT_EQ(PostRecv(b, 7, 64), 0);
  ibv_sge sge{reinterpret_cast<uint64_t>(a.buf.data()), 16, a.mr->lkey()};
  auto good_send = [&](ibv_qp_ex* qpx) {
    ibv_wr_send(qpx);
    ibv_wr_set_sge(qpx, sge.lkey, sge.addr, sge.length);
  };
  struct Case {
    const char* what;
    int error;
    std::function<void(ibv_qp_ex*)> tail;
  };
  const std::vector<Case> cases = {
      {"an operation the QP was not created for", EINVAL,
       [&](ibv_qp_ex* qpx) { ibv_wr_rdma_write(qpx, 1, 0); }},
      {"UD addressing", EINVAL, [&](ibv_qp_ex* qpx) { ibv_wr_set_ud_addr(qpx, nullptr, 1, 1); }},
      {"an XRC SRQ number", EINVAL, [&](ibv_qp_ex* qpx) { ibv_wr_set_xrc_srqn(qpx, 1); }},
      {"TSO", EINVAL, [&](ibv_qp_ex* qpx) { ibv_wr_send_tso(qpx, nullptr, 0, 0); }},
      {"more requests than the send queue holds", ENOMEM,
       [&](ibv_qp_ex* qpx) {
         for (int i = 0; i < 4; ++i) good_send(qpx);
       }},
      {"more SGEs than max_send_sge", EINVAL,
       [&](ibv_qp_ex* qpx) {
         const ibv_sge two[2] = {sge, sge};
         ibv_wr_send(qpx);
         ibv_wr_set_sge_list(qpx, 2, two);
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    EXPECT_EQ(Batch(a,
                    [&](ibv_qp_ex* qpx) {
                      good_send(qpx);
                      c.tail(qpx);
                    }),
              c.error);
    EXPECT_TRUE(Observe(a, b, absl::Milliseconds(20)).empty()) << "a completion of the batch";
    EXPECT_TRUE(Observe(b, a, absl::ZeroDuration()).empty()) << "its SEND arrived";
  }
  // A setter with no request to attach to.
  EXPECT_EQ(Batch(a, [&](ibv_qp_ex* qpx) { ibv_wr_set_sge(qpx, sge.lkey, sge.addr, 16); }),
            EINVAL);
  // The QP is unharmed.
  ASSERT_EQ(Batch(a, good_send), 0);
  const ibv_wc sent = Wait(a, b);
  EXPECT_EQ(sent.status, IBV_WC_SUCCESS) << ibv_wc_status_str(sent.status);
  const ibv_wc received = Wait(b, a);
  EXPECT_EQ(received.wr_id, 7u);
  EXPECT_EQ(received.byte_len, 16u);
}

// A data setter on a request that takes no data (ibv_wr_post(3): LOCAL_INV's setters: none).
TEST(SoftQpEx, DataForARequestWithoutDataFailsTheBatch) {
  Side a = MakeSide("soft0", {.send_ops_flags = IBV_QP_EX_WITH_LOCAL_INV});
  Side b = MakeSide("soft1");
  ASSERT_TRUE(ConnectSides(a, b).ok());
  EXPECT_EQ(Batch(a,
                  [&](ibv_qp_ex* qpx) {
                    ibv_wr_local_inv(qpx, 0x1234);
                    ibv_wr_set_sge(qpx, a.mr->lkey(),
                                   reinterpret_cast<uint64_t>(a.buf.data()), 8);
                  }),
            EINVAL);
  EXPECT_TRUE(Observe(a, b, absl::Milliseconds(20)).empty()) << "the LOCAL_INV ran";
}

// ---- ibv_rereg_mr -------------------------------------------------------------------------------

constexpr int kBindAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
                            IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_MW_BIND;

TEST(SoftRereg, ABoundWindowMakesTheRegionBusy) {
  Side a = MakeSide("soft0", {.mr_access = kBindAccess});
  Side b = MakeSide("soft1");
  ASSERT_TRUE(ConnectSides(a, b).ok());
  auto mw = verbs::MemoryWindow::Allocate(a.pd, IBV_MW_TYPE_2);
  ASSERT_TRUE(mw.ok()) << mw.status();
  const uint32_t rkey = ibv_inc_rkey((*mw)->rkey());
  ibv_send_wr bind{};
  bind.wr_id = 1;
  bind.opcode = IBV_WR_BIND_MW;
  bind.send_flags = IBV_SEND_SIGNALED;
  bind.bind_mw.mw = (*mw)->get();
  bind.bind_mw.rkey = rkey;
  bind.bind_mw.bind_info = {a.mr->get(), reinterpret_cast<uint64_t>(a.buf.data()), 4096,
                            IBV_ACCESS_REMOTE_READ};
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a.qp->get(), &bind, &bad), 0);
  ASSERT_EQ(Wait(a, b).status, IBV_WC_SUCCESS);
  // The window keeps its own range: moving the region under it would leave it granting access
  // to memory the region no longer covers. So, as for deregistration: busy.
  absl::Status busy = a.mr->Reregister(IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                                       IBV_ACCESS_LOCAL_WRITE);
  EXPECT_TRUE(absl::IsFailedPrecondition(busy)) << busy;  // EBUSY
  ibv_send_wr inv{};
  inv.wr_id = 2;
  inv.opcode = IBV_WR_LOCAL_INV;
  inv.send_flags = IBV_SEND_SIGNALED;
  inv.invalidate_rkey = rkey;
  ASSERT_EQ(ibv_post_send(a.qp->get(), &inv, &bad), 0);
  ASSERT_EQ(Wait(a, b).status, IBV_WC_SUCCESS);
  EXPECT_TRUE(a.mr->Reregister(IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                               IBV_ACCESS_LOCAL_WRITE)
                  .ok());
}

TEST(SoftRereg, RefusesWhatRegistrationRefuses) {
  Side a = MakeSide("soft0");
  // An unmapped range (EFAULT, as from a real provider that cannot pin it).
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* hole = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(hole, MAP_FAILED);
  ASSERT_EQ(munmap(hole, page), 0);
  absl::Status unmapped =
      a.mr->Reregister(IBV_REREG_MR_CHANGE_TRANSLATION, nullptr, hole, page, 0);
  EXPECT_TRUE(absl::IsInvalidArgument(unmapped)) << unmapped;
  EXPECT_NE(unmapped.message().find("Bad address"), std::string::npos) << unmapped;
  // On-demand paging: not supported.
  absl::Status odp = a.mr->Reregister(IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                                      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_ON_DEMAND);
  EXPECT_TRUE(absl::IsUnimplemented(odp)) << odp;
  // A PD of another context.
  Side other = MakeSide("soft0");
  absl::Status foreign = a.mr->Reregister(IBV_REREG_MR_CHANGE_PD, other.pd, nullptr, 0, 0);
  EXPECT_TRUE(absl::IsInvalidArgument(foreign)) << foreign;
  EXPECT_EQ(a.mr->get()->pd, a.pd->get());
  EXPECT_EQ(a.mr->addr(), a.buf.data());
}

// ---- ibv_modify_srq -----------------------------------------------------------------------------

TEST(SoftSrq, ModifyChangesNothingUnlessEverythingFits) {
  Side a = MakeSide("soft0");
  auto srq = verbs::SharedReceiveQueue::Create(a.pd, 8, 1);
  ASSERT_TRUE(srq.ok()) << srq.status();
  for (uint64_t id = 0; id < 2; ++id) {
    ibv_sge sge{reinterpret_cast<uint64_t>(a.buf.data()), 64, a.mr->lkey()};
    ibv_recv_wr wr{};
    wr.wr_id = id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_srq_recv((*srq)->get(), &wr, &bad), 0);
  }
  auto attrs = [](uint32_t max_wr, uint32_t limit) {
    ibv_srq_attr attr{};
    attr.max_wr = max_wr;
    attr.srq_limit = limit;
    return attr;
  };
  auto expect_state = [&](uint32_t max_wr, uint32_t limit) {
    absl::StatusOr<ibv_srq_attr> now = (*srq)->Query();
    ASSERT_TRUE(now.ok()) << now.status();
    EXPECT_EQ(now->max_wr, max_wr);
    EXPECT_EQ(now->srq_limit, limit);
    EXPECT_EQ(now->max_sge, 1u);
  };
  EXPECT_TRUE((*srq)->Modify(attrs(0, 6), IBV_SRQ_LIMIT).ok());
  ASSERT_NO_FATAL_FAILURE(expect_state(8, 6));
  // Smaller than the armed limit, smaller than what is posted, zero, past the device's limit,
  // an unknown mask bit: refused.
  EXPECT_FALSE((*srq)->Modify(attrs(4, 0), IBV_SRQ_MAX_WR).ok());
  EXPECT_FALSE((*srq)->Modify(attrs(1, 0), IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT).ok());
  EXPECT_FALSE((*srq)->Modify(attrs(0, 0), IBV_SRQ_MAX_WR).ok());
  auto device = a.ctx->QueryDevice();
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_FALSE(
      (*srq)->Modify(attrs(device->orig_attr.max_srq_wr + 1, 0), IBV_SRQ_MAX_WR).ok());
  EXPECT_FALSE((*srq)->Modify(attrs(8, 0), 1 << 5).ok());
  // One invalid attribute: neither changes.
  EXPECT_FALSE((*srq)->Modify(attrs(6, 7), IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT).ok());
  ASSERT_NO_FATAL_FAILURE(expect_state(8, 6));
  // Both valid together: the limit is disarmed as the queue shrinks under it.
  EXPECT_TRUE((*srq)->Modify(attrs(4, 0), IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT).ok());
  ASSERT_NO_FATAL_FAILURE(expect_state(4, 0));
  EXPECT_TRUE((*srq)->Modify(attrs(2, 0), IBV_SRQ_MAX_WR).ok());
  ASSERT_NO_FATAL_FAILURE(expect_state(2, 0));
}

TEST(SoftPkey, OneEntry) {
  Side a = MakeSide("soft0");
  absl::StatusOr<uint16_t> pkey = a.ctx->QueryPkey(1, 0);
  ASSERT_TRUE(pkey.ok()) << pkey.status();
  EXPECT_EQ(*pkey, 0xffff);
  EXPECT_FALSE(a.ctx->QueryPkey(1, 1).ok());
  EXPECT_FALSE(a.ctx->QueryPkey(2, 0).ok());
}

}  // namespace
}  // namespace swirl::soft
