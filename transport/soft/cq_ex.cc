// ibv_create_cq_ex: the extended CQ and its polling functions.
//
// The extended CQ is an ordinary SoftCq (every SoftCq is an ibv_cq_ex) with the iterator and
// the read_* accessors filled in. start_poll and next_poll take one completion each through
// PollCq, so everything PollCq does (progress, releasing send slots, overflow) is unchanged and
// ibv_poll_cq keeps working on the same CQ; the completion read_* reads is the CQ's ex_wc.

#include <cerrno>

#include "transport/soft/qp_ops.h"

namespace swirl::soft {
namespace {

// What the soft device can report per completion: every field of an ibv_wc. SLID, SL and DLID
// path bits are those of a RoCE port (zero), as ibv_poll_cq reports them.
constexpr uint64_t kSupportedWcFlags = IBV_WC_STANDARD_FLAGS;
// Flags libibverbs defines that the soft device cannot honour: completion timestamps (it has no
// device clock), CVLAN and flow tags (no Ethernet layer), tag matching.
constexpr uint64_t kKnownWcFlags = IBV_CREATE_CQ_SUP_WC_FLAGS;

constexpr uint32_t kKnownCompMask = IBV_CQ_INIT_ATTR_MASK_FLAGS | IBV_CQ_INIT_ATTR_MASK_PD;
constexpr uint32_t kKnownCqFlags =
    IBV_CREATE_CQ_ATTR_SINGLE_THREADED | IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN;

SoftCq* Ex(ibv_cq_ex* cq) { return static_cast<SoftCq*>(cq); }

// The next completion into ex_wc: 0, ENOENT if there is none, or the poll's error.
int TakeOne(SoftCq* cq) {
  const int n = PollCq(cq->ibv(), 1, &cq->ex_wc);
  if (n == 1) {
    cq->status = cq->ex_wc.status;
    cq->wr_id = cq->ex_wc.wr_id;
    return 0;
  }
  if (n == 0) return ENOENT;
  return errno != 0 ? errno : EIO;
}

int StartPoll(ibv_cq_ex* ibcq, ibv_poll_cq_attr* attr) {
  if (attr != nullptr && attr->comp_mask != 0) return EINVAL;
  SoftCq* cq = Ex(ibcq);
  if (!cq->ex_single_threaded) cq->ex_lock.lock();
  const int err = TakeOne(cq);
  // On an error the batch never started: ibv_create_cq_ex(3) says end_poll is not called.
  if (err != 0 && !cq->ex_single_threaded) cq->ex_lock.unlock();
  return err;
}

// On an error the batch stays open: end_poll is still called.
int NextPoll(ibv_cq_ex* ibcq) { return TakeOne(Ex(ibcq)); }

void EndPoll(ibv_cq_ex* ibcq) {
  SoftCq* cq = Ex(ibcq);
  if (!cq->ex_single_threaded) cq->ex_lock.unlock();
}

ibv_wc_opcode ReadOpcode(ibv_cq_ex* cq) { return Ex(cq)->ex_wc.opcode; }
uint32_t ReadVendorErr(ibv_cq_ex* cq) { return Ex(cq)->ex_wc.vendor_err; }
uint32_t ReadByteLen(ibv_cq_ex* cq) { return Ex(cq)->ex_wc.byte_len; }
// Also ibv_wc_read_invalidated_rkey: the two share the field, as in ibv_wc.
__be32 ReadImmData(ibv_cq_ex* cq) { return Ex(cq)->ex_wc.imm_data; }
uint32_t ReadQpNum(ibv_cq_ex* cq) { return Ex(cq)->ex_wc.qp_num; }
uint32_t ReadSrcQp(ibv_cq_ex* cq) { return Ex(cq)->ex_wc.src_qp; }
unsigned int ReadWcFlags(ibv_cq_ex* cq) { return Ex(cq)->ex_wc.wc_flags; }
uint32_t ReadSlid(ibv_cq_ex* cq) { return Ex(cq)->ex_wc.slid; }
uint8_t ReadSl(ibv_cq_ex* cq) { return Ex(cq)->ex_wc.sl; }
uint8_t ReadDlidPathBits(ibv_cq_ex* cq) { return Ex(cq)->ex_wc.dlid_path_bits; }

}  // namespace

ibv_cq_ex* CreateCqEx(ibv_context* context, ibv_cq_init_attr_ex* attr) {
  int err = 0;
  // Unknown bits are invalid; known ones the soft device lacks are "not supported", which is
  // what callers probing for features (rdma-core's pyverbs tests among them) look for.
  if ((attr->comp_mask & ~kKnownCompMask) ||
      ((attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS) && (attr->flags & ~kKnownCqFlags)) ||
      (attr->wc_flags & ~kKnownWcFlags)) {
    err = EINVAL;
  } else if ((attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_PD) ||  // parent domains
             ((attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS) &&
              (attr->flags & IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN)) ||
             (attr->wc_flags & ~kSupportedWcFlags)) {
    err = EOPNOTSUPP;
  } else if (attr->comp_vector >= static_cast<uint32_t>(context->num_comp_vectors) ||
             attr->cqe > kMaxCqe) {
    err = EINVAL;
  }
  ibv_cq* ibcq = nullptr;
  if (err == 0) {
    err = CreateCq(ToSoft(context), static_cast<int>(attr->cqe), attr->cq_context, attr->channel,
                   &ibcq);
  }
  if (err != 0) {
    errno = err;
    return nullptr;
  }
  SoftCq* cq = AsSoft(ibcq);
  cq->ex_single_threaded = (attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS) &&
                           (attr->flags & IBV_CREATE_CQ_ATTR_SINGLE_THREADED);
  cq->start_poll = StartPoll;
  cq->next_poll = NextPoll;
  cq->end_poll = EndPoll;
  cq->read_opcode = ReadOpcode;
  cq->read_vendor_err = ReadVendorErr;
  cq->read_wc_flags = ReadWcFlags;
  // Like rxe and mlx5, only the fields asked for get an accessor.
  const uint64_t flags = attr->wc_flags;
  if (flags & IBV_WC_EX_WITH_BYTE_LEN) cq->read_byte_len = ReadByteLen;
  if (flags & IBV_WC_EX_WITH_IMM) cq->read_imm_data = ReadImmData;
  if (flags & IBV_WC_EX_WITH_QP_NUM) cq->read_qp_num = ReadQpNum;
  if (flags & IBV_WC_EX_WITH_SRC_QP) cq->read_src_qp = ReadSrcQp;
  if (flags & IBV_WC_EX_WITH_SLID) cq->read_slid = ReadSlid;
  if (flags & IBV_WC_EX_WITH_SL) cq->read_sl = ReadSl;
  if (flags & IBV_WC_EX_WITH_DLID_PATH_BITS) cq->read_dlid_path_bits = ReadDlidPathBits;
  return cq;
}

}  // namespace swirl::soft
