// ibv_create_qp_ex and the ibv_wr_* work-request API (ibv_wr_post(3)).
//
// The builders do not reach the send queue: each one appends an ibv_send_wr to the QP's batch
// (WrBatch, storage sized at creation, so nothing is allocated per request), and wr_complete
// hands the chain to PostSendAll, which is ibv_post_send with an all-or-nothing check in front.
// Every semantic of a request (protection, fences, remote invalidation, errors, flushes) is thus
// the one ibv_post_send has.
//
// Errors: the API's builders and setters return nothing. The first error one of them meets is
// kept, later calls of the batch are ignored, and wr_complete returns it without posting any of
// the batch (as mlx5 and rxe do). Errors: EINVAL for a builder whose operation the QP was not
// created for (send_ops_flags), for a setter with no request that takes data, and for the UD,
// XRC and TSO calls an RC QP has no use for; ENOMEM for more requests than the send queue
// holds; and at wr_complete whatever ibv_post_send would refuse (too many SGEs or inline bytes,
// a bad window, the QP's state, a full send queue).

#include <cerrno>
#include <cstring>

#include "transport/soft/qp_ops.h"

namespace swirl::soft {
namespace {

constexpr uint64_t kRcSendOps =
    IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_SEND |
    IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
    IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD | IBV_QP_EX_WITH_LOCAL_INV | IBV_QP_EX_WITH_BIND_MW |
    IBV_QP_EX_WITH_SEND_WITH_INV;

constexpr uint32_t kKnownCompMask =
    IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_XRCD | IBV_QP_INIT_ATTR_CREATE_FLAGS |
    IBV_QP_INIT_ATTR_MAX_TSO_HEADER | IBV_QP_INIT_ATTR_IND_TABLE | IBV_QP_INIT_ATTR_RX_HASH |
    IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
// Known, but for QP types and offloads the soft device does not have.
constexpr uint32_t kUnsupportedCompMask = IBV_QP_INIT_ATTR_XRCD |
                                          IBV_QP_INIT_ATTR_MAX_TSO_HEADER |
                                          IBV_QP_INIT_ATTR_IND_TABLE | IBV_QP_INIT_ATTR_RX_HASH;

SoftQp* FromEx(ibv_qp_ex* qpx) { return AsSoft(&qpx->qp_base); }
WrBatch& BatchOf(ibv_qp_ex* qpx) { return *FromEx(qpx)->wr_batch; }

void Fail(WrBatch& b, int err) {
  if (b.error == 0) b.error = err;
}

// Starts the next request of the batch: wr_id and flags as the application set them now.
// Returns nullptr (having recorded why) if it cannot.
ibv_send_wr* Begin(ibv_qp_ex* qpx, uint64_t op, ibv_wr_opcode opcode, bool takes_data) {
  WrBatch& b = BatchOf(qpx);
  if (b.error != 0) return nullptr;
  if (!(b.send_ops & op)) {
    Fail(b, EINVAL);
    return nullptr;
  }
  if (b.count == b.wrs.size()) {
    Fail(b, ENOMEM);
    return nullptr;
  }
  ibv_send_wr& wr = b.wrs[b.count];
  std::memset(&wr, 0, sizeof(wr));
  wr.wr_id = qpx->wr_id;
  // Inline data comes only from the inline setters (mlx5 ignores the flag here too).
  wr.send_flags = qpx->wr_flags & ~static_cast<unsigned int>(IBV_SEND_INLINE);
  wr.opcode = opcode;
  wr.sg_list = &b.sges[static_cast<size_t>(b.count) * b.sge_slots];
  if (b.count > 0) b.wrs[b.count - 1].next = &wr;
  ++b.count;
  b.takes_data = takes_data;
  return &wr;
}

// The newest request, for a data setter; nullptr (recorded) if there is none that takes data.
ibv_send_wr* DataTarget(WrBatch& b) {
  if (b.error != 0) return nullptr;
  if (b.count == 0 || !b.takes_data) {
    Fail(b, EINVAL);
    return nullptr;
  }
  return &b.wrs[b.count - 1];
}

// ---- Builders ---------------------------------------------------------------------------------

void WrAtomicCmpSwp(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr, uint64_t compare,
                    uint64_t swap) {
  ibv_send_wr* wr =
      Begin(qpx, IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_CMP_AND_SWP, true);
  if (wr == nullptr) return;
  wr->wr.atomic.remote_addr = remote_addr;
  wr->wr.atomic.rkey = rkey;
  wr->wr.atomic.compare_add = compare;
  wr->wr.atomic.swap = swap;
}

void WrAtomicFetchAdd(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr, uint64_t add) {
  ibv_send_wr* wr =
      Begin(qpx, IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD, IBV_WR_ATOMIC_FETCH_AND_ADD, true);
  if (wr == nullptr) return;
  wr->wr.atomic.remote_addr = remote_addr;
  wr->wr.atomic.rkey = rkey;
  wr->wr.atomic.compare_add = add;
}

void WrBindMw(ibv_qp_ex* qpx, ibv_mw* mw, uint32_t rkey, const ibv_mw_bind_info* bind_info) {
  ibv_send_wr* wr = Begin(qpx, IBV_QP_EX_WITH_BIND_MW, IBV_WR_BIND_MW, false);
  if (wr == nullptr) return;
  wr->bind_mw.mw = mw;
  wr->bind_mw.rkey = rkey;
  wr->bind_mw.bind_info = *bind_info;
}

void WrLocalInv(ibv_qp_ex* qpx, uint32_t invalidate_rkey) {
  ibv_send_wr* wr = Begin(qpx, IBV_QP_EX_WITH_LOCAL_INV, IBV_WR_LOCAL_INV, false);
  if (wr == nullptr) return;
  wr->invalidate_rkey = invalidate_rkey;
}

void WrRdmaRead(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr) {
  ibv_send_wr* wr = Begin(qpx, IBV_QP_EX_WITH_RDMA_READ, IBV_WR_RDMA_READ, true);
  if (wr == nullptr) return;
  wr->wr.rdma.remote_addr = remote_addr;
  wr->wr.rdma.rkey = rkey;
}

void WrRdmaWrite(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr) {
  ibv_send_wr* wr = Begin(qpx, IBV_QP_EX_WITH_RDMA_WRITE, IBV_WR_RDMA_WRITE, true);
  if (wr == nullptr) return;
  wr->wr.rdma.remote_addr = remote_addr;
  wr->wr.rdma.rkey = rkey;
}

void WrRdmaWriteImm(ibv_qp_ex* qpx, uint32_t rkey, uint64_t remote_addr, __be32 imm_data) {
  ibv_send_wr* wr =
      Begin(qpx, IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM, IBV_WR_RDMA_WRITE_WITH_IMM, true);
  if (wr == nullptr) return;
  wr->wr.rdma.remote_addr = remote_addr;
  wr->wr.rdma.rkey = rkey;
  wr->imm_data = imm_data;
}

void WrSend(ibv_qp_ex* qpx) { Begin(qpx, IBV_QP_EX_WITH_SEND, IBV_WR_SEND, true); }

void WrSendImm(ibv_qp_ex* qpx, __be32 imm_data) {
  ibv_send_wr* wr = Begin(qpx, IBV_QP_EX_WITH_SEND_WITH_IMM, IBV_WR_SEND_WITH_IMM, true);
  if (wr == nullptr) return;
  wr->imm_data = imm_data;
}

void WrSendInv(ibv_qp_ex* qpx, uint32_t invalidate_rkey) {
  ibv_send_wr* wr = Begin(qpx, IBV_QP_EX_WITH_SEND_WITH_INV, IBV_WR_SEND_WITH_INV, true);
  if (wr == nullptr) return;
  wr->invalidate_rkey = invalidate_rkey;
}

// Calls for UD, XRC and raw packet QPs, and atomic writes (which creation refused): an RC QP
// records an error instead of leaving the pointer null for the application to call.
void WrSendTso(ibv_qp_ex* qpx, void*, uint16_t, uint16_t) { Fail(BatchOf(qpx), EINVAL); }
void WrSetUdAddr(ibv_qp_ex* qpx, ibv_ah*, uint32_t, uint32_t) { Fail(BatchOf(qpx), EINVAL); }
void WrSetXrcSrqn(ibv_qp_ex* qpx, uint32_t) { Fail(BatchOf(qpx), EINVAL); }
void WrAtomicWrite(ibv_qp_ex* qpx, uint32_t, uint64_t, const void*) {
  Fail(BatchOf(qpx), EINVAL);
}

// ---- Data setters -----------------------------------------------------------------------------

void WrSetSgeList(ibv_qp_ex* qpx, size_t num_sge, const ibv_sge* sg_list) {
  WrBatch& b = BatchOf(qpx);
  ibv_send_wr* wr = DataTarget(b);
  if (wr == nullptr) return;
  // The slot holds max_send_sge entries; more is refused, as ibv_post_send refuses it.
  if (num_sge > b.sge_slots || (num_sge > 0 && sg_list == nullptr)) {
    Fail(b, EINVAL);
    return;
  }
  std::memcpy(wr->sg_list, sg_list, num_sge * sizeof(ibv_sge));
  wr->num_sge = static_cast<int>(num_sge);
  wr->send_flags &= ~static_cast<unsigned int>(IBV_SEND_INLINE);
}

void WrSetSge(ibv_qp_ex* qpx, uint32_t lkey, uint64_t addr, uint32_t length) {
  const ibv_sge sge{addr, length, lkey};
  WrSetSgeList(qpx, 1, &sge);
}

// The data is copied now (the caller may reuse its buffers at once) into the request's slot,
// which the request names as one SGE with IBV_SEND_INLINE: ibv_post_send copies it from there.
void WrSetInlineDataList(ibv_qp_ex* qpx, size_t num_buf, const ibv_data_buf* buf_list) {
  WrBatch& b = BatchOf(qpx);
  ibv_send_wr* wr = DataTarget(b);
  if (wr == nullptr) return;
  size_t total = 0;
  for (size_t i = 0; i < num_buf; ++i) {
    total += buf_list[i].length;
    if (total > b.max_inline) {  // more than max_inline_data: ibv_post_send refuses it too
      Fail(b, EINVAL);
      return;
    }
  }
  const size_t slot = static_cast<size_t>(wr - b.wrs.data());
  char* dst = b.inline_data.get() + slot * b.max_inline;
  size_t off = 0;
  for (size_t i = 0; i < num_buf; ++i) {
    if (buf_list[i].length > 0) std::memcpy(dst + off, buf_list[i].addr, buf_list[i].length);
    off += buf_list[i].length;
  }
  wr->sg_list[0] = ibv_sge{reinterpret_cast<uint64_t>(dst), static_cast<uint32_t>(total), 0};
  wr->num_sge = total > 0 ? 1 : 0;
  wr->send_flags |= IBV_SEND_INLINE;
}

void WrSetInlineData(ibv_qp_ex* qpx, void* addr, size_t length) {
  const ibv_data_buf buf{addr, length};
  WrSetInlineDataList(qpx, 1, &buf);
}

// ---- The critical section ---------------------------------------------------------------------

void Reset(WrBatch& b) {
  b.count = 0;
  b.error = 0;
  b.takes_data = false;
}

void WrStart(ibv_qp_ex* qpx) {
  WrBatch& b = BatchOf(qpx);
  b.mu.Lock();
  Reset(b);
}

int WrComplete(ibv_qp_ex* qpx) {
  WrBatch& b = BatchOf(qpx);
  int err = b.error;
  if (err == 0 && b.count > 0) err = PostSendAll(FromEx(qpx), b.wrs.data());
  Reset(b);
  b.mu.Unlock();
  return err;
}

void WrAbort(ibv_qp_ex* qpx) {
  WrBatch& b = BatchOf(qpx);
  Reset(b);
  b.mu.Unlock();
}

}  // namespace

ibv_qp* CreateQpEx(ibv_context* context, ibv_qp_init_attr_ex* attr) {
  const uint32_t mask = attr->comp_mask;
  const bool builders = mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  int err = 0;
  if (mask & ~kKnownCompMask) {
    err = EINVAL;
  } else if ((mask & kUnsupportedCompMask) ||
             ((mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) && attr->create_flags != 0) ||
             (builders && (attr->send_ops_flags & ~kRcSendOps))) {
    err = EOPNOTSUPP;  // UD, TSO, atomic write, ...: the soft device has RC only
  } else if (!(mask & IBV_QP_INIT_ATTR_PD) || attr->pd == nullptr) {
    err = EINVAL;  // an RC QP needs its PD
  }
  ibv_qp* ibqp = nullptr;
  if (err == 0) {
    ibv_qp_init_attr plain;
    std::memset(&plain, 0, sizeof(plain));
    plain.qp_context = attr->qp_context;
    plain.send_cq = attr->send_cq;
    plain.recv_cq = attr->recv_cq;
    plain.srq = attr->srq;
    plain.cap = attr->cap;
    plain.qp_type = attr->qp_type;
    plain.sq_sig_all = attr->sq_sig_all;
    err = CreateQp(ToSoft(context), attr->pd, &plain, &ibqp);
    attr->cap = plain.cap;  // what the QP got, as ibv_create_qp reports it
  }
  if (err != 0) {
    errno = err;
    return nullptr;
  }
  SoftQp* qp = AsSoft(ibqp);
  if (!builders) return ibqp;
  auto batch = std::make_unique<WrBatch>();
  batch->send_ops = attr->send_ops_flags;
  batch->sge_slots = std::max<uint32_t>(qp->max_send_sge, 1);
  batch->max_inline = qp->max_inline;
  batch->wrs.resize(qp->max_send_wr);
  batch->sges.resize(static_cast<size_t>(qp->max_send_wr) * batch->sge_slots);
  batch->inline_data.reset(new char[static_cast<size_t>(qp->max_send_wr) * qp->max_inline]);
  qp->wr_batch = std::move(batch);
  ibv_qp_ex* qpx = qp->qp_ex();
  qpx->wr_atomic_cmp_swp = WrAtomicCmpSwp;
  qpx->wr_atomic_fetch_add = WrAtomicFetchAdd;
  qpx->wr_bind_mw = WrBindMw;
  qpx->wr_local_inv = WrLocalInv;
  qpx->wr_rdma_read = WrRdmaRead;
  qpx->wr_rdma_write = WrRdmaWrite;
  qpx->wr_rdma_write_imm = WrRdmaWriteImm;
  qpx->wr_send = WrSend;
  qpx->wr_send_imm = WrSendImm;
  qpx->wr_send_inv = WrSendInv;
  qpx->wr_send_tso = WrSendTso;
  qpx->wr_set_ud_addr = WrSetUdAddr;
  qpx->wr_set_xrc_srqn = WrSetXrcSrqn;
  qpx->wr_set_inline_data = WrSetInlineData;
  qpx->wr_set_inline_data_list = WrSetInlineDataList;
  qpx->wr_set_sge = WrSetSge;
  qpx->wr_set_sge_list = WrSetSgeList;
  qpx->wr_start = WrStart;
  qpx->wr_complete = WrComplete;
  qpx->wr_abort = WrAbort;
  qpx->wr_atomic_write = WrAtomicWrite;
  // Last: from here libibverbs' ibv_qp_to_qp_ex hands out the ibv_qp_ex.
  qp->comp_mask |= VerbsQp::kVerbsQpEx;
  return ibqp;
}

}  // namespace swirl::soft
