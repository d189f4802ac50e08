// Soft RC QP: creation, the state machine, posting, the link to the peer, and progress.

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <openssl/crypto.h>

#include "absl/strings/numbers.h"
#include "base/log.h"
#include "transport/soft/fabric.h"
#include "transport/soft/qp_ops.h"
#include "transport/soft/soft_device.h"

namespace swirl::soft {
namespace {


uint64_t RingSize() {
  static const uint64_t size = [] {
    uint64_t kb = 1024;
    if (const char* env = std::getenv("SWIRL_SOFT_RING_KB")) {
      uint64_t v;
      if (absl::SimpleAtoi(env, &v)) kb = v;
    }
    uint64_t bytes = 1;
    while (bytes < kb * 1024) bytes <<= 1;
    // Our own rings hold two of the largest frames (a peer's are accepted from kMinRingSize:
    // reading one needs no room). A frame never wraps: one that does not fit before the ring's
    // end goes behind a PAD that can take almost as much again (RingWriter::Reserve), so in a
    // smaller ring a full chunk would wait for room for ever.
    constexpr uint64_t kMinOwnRing =
        std::bit_ceil(2 * wire::FrameBytes(wire::kOpWrite, wire::kMaxChunk));
    static_assert(kMinOwnRing >= wire::kMinRingSize && kMinOwnRing <= wire::kMaxRingSize);
    return std::clamp<uint64_t>(bytes, kMinOwnRing, wire::kMaxRingSize);
  }();
  return size;
}

bool PdOf(ibv_pd* pd, SoftContext* sctx) { return pd != nullptr && pd->context == &sctx->vctx.context; }

// ---- Link ------------------------------------------------------------------------------------------

int CreateSegment(SoftQp* qp) {
  const uint64_t ring = RingSize();
  const uint64_t size = wire::kRingsOffset + 2 * ring;
  int fd = memfd_create("swirl-soft-qp", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return errno;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    close(fd);
    return err;
  }
  // Our writable mapping first, then the seals: F_SEAL_FUTURE_WRITE leaves it writable but
  // refuses every later writable mapping and write(2), so the peer we hand the memfd to (or
  // anyone it passes it on to) can only read what we write. The size seals keep its mapping
  // from faulting; F_SEAL_SEAL keeps all of them. The receiver checks them (MapPeerSegment).
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    int err = errno;
    close(fd);
    return err;
  }
  if (fcntl(fd, F_ADD_SEALS,
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0) {
    int err = errno;
    munmap(base, size);
    close(fd);
    return err;
  }
  auto* header = static_cast<wire::SegmentHeader*>(base);
  header->magic = wire::kSegmentMagic;
  header->version = wire::kWireVersion;
  header->qp_num = qp->qp_num;
  header->segment_size = size;
  header->request_ring_offset = wire::kRingsOffset;
  header->request_ring_size = ring;
  header->response_ring_offset = wire::kRingsOffset + ring;
  header->response_ring_size = ring;
  qp->memfd = fd;
  qp->own_base = static_cast<char*>(base);
  qp->own_size = size;
  qp->own_ctrl = reinterpret_cast<wire::SegmentControl*>(qp->own_base + wire::kControlOffset);
  qp->own_ctrl->acked.value.store(qp->expected_msn, std::memory_order_relaxed);
  qp->acked_published = qp->expected_msn;
  qp->req_tx.Init(qp->own_base + wire::kRingsOffset, ring);
  qp->resp_tx.Init(qp->own_base + wire::kRingsOffset + ring, ring);
  qp->ctrl_for_hca.store(qp->own_ctrl, std::memory_order_release);
  return 0;
}

// Adopts a peer segment that the HCA thread validated, if it is the peer this QP was told about
// at RTR. Candidates that arrive before RTR wait; wrong ones are closed.
bool HandleLinkEvent(SoftQp* qp) {
  // A plain load first: this runs on every progress call and an exchange would be a locked
  // instruction each time.
  if (!qp->link_event.load(std::memory_order_acquire)) return false;
  if (!qp->link_event.exchange(false, std::memory_order_acq_rel)) return false;
  std::vector<PeerSegment> candidates;
  {
    swirl::MutexLock lock(&qp->incoming_mu);
    candidates.swap(qp->incoming);
  }
  std::vector<PeerSegment> keep;
  const bool ready = qp->qstate == IBV_QPS_RTR || qp->qstate == IBV_QPS_RTS;
  for (PeerSegment& c : candidates) {
    if (!ready && qp->qstate != IBV_QPS_ERR && !qp->linked) {
      keep.push_back(c);
      continue;
    }
    // The peer proved the key this QP has (keyed), or the QP has none and neither did the
    // hello: a candidate offered before SetLinkKey, or under an earlier key, is not the peer.
    const bool match = ready && !qp->linked && IsExpectedPeer(qp, c);
    // A matching candidate whose connection already ended (a stale link of a QP that was reset,
    // or a stranger posing as the peer) is dropped like a wrong one: a live match may follow.
    // Except on the connection this QP opened to its peer's address (TCP): what came back on it
    // is the peer's, even if the peer hung up right after (it acknowledged our requests, then
    // failed): the QP takes it and completes what it acknowledged; its next request fails, as
    // the peer is gone.
    const bool own_connection = c.watch == qp->out_watch;
    if (!match || (!own_connection && !AdoptWatch(qp->hca, c.watch))) {
      SWIRL_LOG(DEBUG, "soft: QP 0x%x drops a link from QP 0x%x", qp->qp_num, c.qp_num);
      // Not the connection we opened: that one carries our own frames (TCP) or hello, and
      // closing it would leave the QP with no way out and nothing to fail it. What arrived on
      // it (TCP) stays unread until the link goes; a reply's mapping (shared memory) goes now.
      if (own_connection) c.watch = 0;
      c.Close(qp->hca);
      continue;
    }
    qp->peer = c;
    qp->in_watch = c.watch;
    qp->req_rx.Init(c.base + c.request_ring_offset, c.request_ring_size);
    qp->resp_rx.Init(c.base + c.response_ring_offset, c.response_ring_size);
    qp->req_tx.SetConsumedSource(&c.control()->request_consumed.value);
    qp->resp_tx.SetConsumedSource(&c.control()->response_consumed.value);
    qp->linked = true;
    qp->fabric->LinkAdopted(qp);
  }
  if (!keep.empty()) {
    swirl::MutexLock lock(&qp->incoming_mu);
    for (PeerSegment& c : keep) qp->incoming.push_back(c);
  }
  return true;
}

void TeardownLink(SoftQp* qp) {
  if (qp->own_ctrl != nullptr) {
    wire::SharedRelease();
    qp->own_ctrl->state.value.store(wire::kLinkClosed, std::memory_order_release);
  }
  // A connection that carries both directions goes with the peer segment below, after the
  // pollers are out of it.
  if (qp->out_watch != 0 && qp->out_watch != qp->in_watch) qp->hca->Unwatch(qp->out_watch);
  qp->out_watch = 0;
  if (qp->linked) {
    // A poller may be reading the idle hint, which points into the peer's segment, without our
    // lock (taking it withdrew the hint). Pollers read it only under their CQ's attach lock,
    // and the HCA thread's passes (ProgressAll, ProgressAssisted) under hca->mu: once we have
    // passed through all three, none still can, and the segment may go. (QP lock, then
    // hca->mu, as below; the passes only try QP locks.)
    for (SoftCq* cq : {qp->scq, qp->rcq}) {
      std::lock_guard<SpinLock> pass(cq->attach_lock);
    }
    { swirl::MutexLock pass(&qp->hca->mu); }
    qp->peer.Close(qp->hca);
  }
  qp->peer = PeerSegment();
  qp->in_watch = 0;
  qp->linked = false;
  qp->req_rx = RingReader();
  qp->resp_rx = RingReader();
  std::vector<PeerSegment> pending;
  {
    swirl::MutexLock lock(&qp->incoming_mu);
    pending.swap(qp->incoming);
  }
  for (PeerSegment& c : pending) c.Close(qp->hca);  // takes watch_mu: not under incoming_mu
  // A later link starts with a clean slate.
  qp->peer_gone.store(false, std::memory_order_release);
  qp->link_event.store(false, std::memory_order_release);
  if (qp->own_base != nullptr) {
    {
      // The HCA thread reads our control block under hca->mu; unpublish it first.
      swirl::MutexLock lock(&qp->hca->mu);
      qp->ctrl_for_hca.store(nullptr, std::memory_order_release);
    }
    munmap(qp->own_base, qp->own_size);
  }
  {
    swirl::MutexLock lock(&qp->incoming_mu);  // the HCA thread may be replying with it
    if (qp->memfd >= 0) close(qp->memfd);
    qp->memfd = -1;
    qp->want_reply = false;
    qp->replied_watch = 0;
  }
  qp->own_base = nullptr;
  qp->own_ctrl = nullptr;
  qp->memfd = -1;
  qp->link_deadline_ns = 0;
}

// ---- State machine ---------------------------------------------------------------------------------

struct Transition {
  bool valid;
  int required;
  int optional;
};

Transition TransitionFor(ibv_qp_state from, ibv_qp_state to) {
  const int any_optional = IBV_QP_CUR_STATE;
  // Any state may go to RESET, and any but RESET to ERR (the kernel's qp_state_table, which
  // ib_modify_qp_is_ok applies for every provider).
  if (to == IBV_QPS_RESET || (to == IBV_QPS_ERR && from != IBV_QPS_RESET)) {
    return {true, 0, any_optional};
  }
  switch (from) {
    case IBV_QPS_RESET:
      if (to == IBV_QPS_INIT) {
        return {true, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, any_optional};
      }
      break;
    case IBV_QPS_INIT:
      if (to == IBV_QPS_INIT) {
        return {true, 0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS | any_optional};
      }
      if (to == IBV_QPS_RTR) {
        return {true,
                IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                    IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
                IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX | any_optional};
      }
      break;
    case IBV_QPS_RTR:
      if (to == IBV_QPS_RTS) {
        return {true,
                IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                    IBV_QP_MAX_QP_RD_ATOMIC,
                IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER |
                    IBV_QP_PATH_MIG_STATE | any_optional};
      }
      break;
    case IBV_QPS_RTS:
      if (to == IBV_QPS_RTS) {
        return {true, 0,
                IBV_QP_ACCESS_FLAGS | IBV_QP_ALT_PATH | IBV_QP_PATH_MIG_STATE |
                    IBV_QP_MIN_RNR_TIMER | any_optional};
      }
      break;
    default:
      break;
  }
  return {false, 0, 0};
}

int ValidateAttrValues(const ibv_qp_attr& a, int mask) {
  constexpr int kQpAccess =
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
      IBV_ACCESS_REMOTE_ATOMIC;
  if ((mask & IBV_QP_PORT) && a.port_num != 1) return EINVAL;
  if ((mask & IBV_QP_PKEY_INDEX) && a.pkey_index != 0) return EINVAL;
  if ((mask & IBV_QP_ACCESS_FLAGS) && (a.qp_access_flags & ~kQpAccess)) return EINVAL;
  if ((mask & IBV_QP_PATH_MTU) && (a.path_mtu < IBV_MTU_256 || a.path_mtu > IBV_MTU_4096)) {
    return EINVAL;
  }
  if ((mask & IBV_QP_DEST_QPN) && a.dest_qp_num > wire::kMsnMask) return EINVAL;
  if ((mask & IBV_QP_RQ_PSN) && a.rq_psn > wire::kMsnMask) return EINVAL;
  if ((mask & IBV_QP_SQ_PSN) && a.sq_psn > wire::kMsnMask) return EINVAL;
  if ((mask & IBV_QP_MAX_DEST_RD_ATOMIC) && a.max_dest_rd_atomic > kMaxRdAtomic) return EINVAL;
  if ((mask & IBV_QP_MAX_QP_RD_ATOMIC) && a.max_rd_atomic > kMaxRdAtomic) return EINVAL;
  if ((mask & IBV_QP_MIN_RNR_TIMER) && a.min_rnr_timer > 31) return EINVAL;
  if ((mask & IBV_QP_TIMEOUT) && a.timeout > 31) return EINVAL;
  if ((mask & IBV_QP_RETRY_CNT) && a.retry_cnt > 7) return EINVAL;
  if ((mask & IBV_QP_RNR_RETRY) && a.rnr_retry > 7) return EINVAL;
  if (mask & IBV_QP_AV) {
    // RoCE: the address vector must carry a GRH naming the peer's GID, from our GID index 0.
    if (!a.ah_attr.is_global || a.ah_attr.port_num != 1 || a.ah_attr.grh.sgid_index != 0) {
      return EINVAL;
    }
  }
  return 0;
}

void ApplyAttrs(SoftQp* qp, const ibv_qp_attr& a, int mask) {
  ibv_qp_attr& s = qp->attr;
  if (mask & IBV_QP_PKEY_INDEX) s.pkey_index = a.pkey_index;
  if (mask & IBV_QP_PORT) s.port_num = a.port_num;
  if (mask & IBV_QP_ACCESS_FLAGS) s.qp_access_flags = a.qp_access_flags;
  if (mask & IBV_QP_AV) s.ah_attr = a.ah_attr;
  if (mask & IBV_QP_PATH_MTU) s.path_mtu = a.path_mtu;
  if (mask & IBV_QP_DEST_QPN) s.dest_qp_num = a.dest_qp_num;
  if (mask & IBV_QP_RQ_PSN) s.rq_psn = a.rq_psn;
  if (mask & IBV_QP_SQ_PSN) s.sq_psn = a.sq_psn;
  if (mask & IBV_QP_MAX_DEST_RD_ATOMIC) s.max_dest_rd_atomic = a.max_dest_rd_atomic;
  if (mask & IBV_QP_MAX_QP_RD_ATOMIC) s.max_rd_atomic = a.max_rd_atomic;
  if (mask & IBV_QP_MIN_RNR_TIMER) s.min_rnr_timer = a.min_rnr_timer;
  if (mask & IBV_QP_TIMEOUT) s.timeout = a.timeout;
  if (mask & IBV_QP_RETRY_CNT) s.retry_cnt = a.retry_cnt;
  if (mask & IBV_QP_RNR_RETRY) s.rnr_retry = a.rnr_retry;
}

void ResetQueues(SoftQp* qp) {
  // RESET discards every work request without a completion (IB spec 10.3.1) and drops
  // completions already queued for this QP, so stale ones never release send slots.
  PurgeQp(qp->scq, qp);
  if (qp->rcq != qp->scq) PurgeQp(qp->rcq, qp);
  qp->sq_head = qp->sq_tx = qp->sq_tail;
  qp->newest_signaled = qp->sq_tail - 1;
  qp->failure_pending = false;
  qp->sq_stopped = false;
  qp->sq_released.store(qp->sq_tail, std::memory_order_release);
  qp->rd_atomic_outstanding = 0;
  qp->rq.head = qp->rq.tail;
  qp->cur_recv.active = false;
  qp->cur_read.active = false;
  qp->rnr_waiting = false;
  qp->discard_requests = false;
  qp->write_in_progress = false;
  qp->pending_nak.active = false;
  qp->cq_overflow = false;
  qp->req_consumed_published = 0;
  qp->resp_consumed_published = 0;
  qp->stalled_polls = 0;
  qp->timer = {};
}

void FlushRecv(SoftQp* qp, uint64_t wr_id) {
  ibv_wc wc;
  std::memset(&wc, 0, sizeof(wc));
  wc.wr_id = wr_id;
  wc.status = IBV_WC_WR_FLUSH_ERR;
  wc.opcode = IBV_WC_RECV;
  wc.qp_num = qp->qp_num;
  if (!qp->rcq->Push(wc, nullptr, 0, false)) qp->cq_overflow = true;
}

// ---- Posting ---------------------------------------------------------------------------------

int ValidateSendWr(SoftQp* qp, const ibv_send_wr* wr, bool type1_bind) {
  switch (wr->opcode) {
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_IMM:
    case IBV_WR_SEND_WITH_INV:
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
    case IBV_WR_RDMA_READ:
    case IBV_WR_ATOMIC_CMP_AND_SWP:
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
    case IBV_WR_LOCAL_INV:
      break;
    case IBV_WR_BIND_MW:
      if (wr->bind_mw.mw == nullptr || wr->bind_mw.mw->context != qp->context) return EINVAL;
      if ((wr->bind_mw.mw->type == IBV_MW_TYPE_1) != type1_bind) return EINVAL;
      break;
    default:
      return EINVAL;
  }
  if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > qp->max_send_sge) return EINVAL;
  if (wr->num_sge > 0 && wr->sg_list == nullptr) return EINVAL;
  if (wr->send_flags & IBV_SEND_INLINE) {
    if (wr->opcode != IBV_WR_SEND && wr->opcode != IBV_WR_SEND_WITH_IMM &&
        wr->opcode != IBV_WR_SEND_WITH_INV && wr->opcode != IBV_WR_RDMA_WRITE &&
        wr->opcode != IBV_WR_RDMA_WRITE_WITH_IMM) {
      return EINVAL;
    }
    uint64_t total = 0;
    for (int i = 0; i < wr->num_sge; ++i) total += wr->sg_list[i].length;
    if (total > qp->max_inline) return EINVAL;
  }
  return 0;
}

void FillWqe(SoftQp* qp, uint32_t index, const ibv_send_wr* wr) {
  SendWqe& w = qp->sq[index & qp->sq_mask];
  std::memset(&w, 0, sizeof(w));
  w.wr_id = wr->wr_id;
  w.opcode = wr->opcode;
  w.send_flags = wr->send_flags;
  if (qp->sig_all || (wr->send_flags & IBV_SEND_SIGNALED)) qp->newest_signaled = index;
  w.state = SendWqe::kQueued;
  w.status = IBV_WC_SUCCESS;
  w.num_sge = static_cast<uint32_t>(wr->num_sge);
  ibv_sge* sges = const_cast<ibv_sge*>(WqeSges(qp, index));
  uint64_t total = 0;
  for (int i = 0; i < wr->num_sge; ++i) {
    sges[i] = wr->sg_list[i];
    total += wr->sg_list[i].length;
  }
  switch (wr->opcode) {
    case IBV_WR_SEND_WITH_IMM:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      w.imm_or_inv = wr->imm_data;
      break;
    case IBV_WR_SEND_WITH_INV:
    case IBV_WR_LOCAL_INV:
      w.imm_or_inv = wr->invalidate_rkey;
      break;
    default:
      break;
  }
  if (wr->opcode == IBV_WR_RDMA_WRITE || wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM ||
      wr->opcode == IBV_WR_RDMA_READ) {
    w.remote_addr = wr->wr.rdma.remote_addr;
    w.rkey = wr->wr.rdma.rkey;
  } else if (wr->opcode == IBV_WR_ATOMIC_CMP_AND_SWP ||
             wr->opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) {
    w.remote_addr = wr->wr.atomic.remote_addr;
    w.rkey = wr->wr.atomic.rkey;
    w.compare_add = wr->wr.atomic.compare_add;
    w.swap = wr->wr.atomic.swap;
    if (total != 8) FailAtPost(qp, w, IBV_WC_LOC_LEN_ERR);
  } else if (wr->opcode == IBV_WR_BIND_MW) {
    auto* mw = static_cast<SoftMw*>(wr->bind_mw.mw);
    w.bind_mw_type2 = mw->type == IBV_MW_TYPE_2;
    if (w.bind_mw_type2) {
      PrepareType2Bind(mw, wr->bind_mw.rkey, w);
    } else {
      w.bind_mw_entry = mw->entry;
      w.bind_mw_index = mw->handle;
    }
    w.bind_mw_pd = mw->pd;
    const auto* mr = static_cast<const SoftMr*>(wr->bind_mw.bind_info.mr);
    w.bind_mr_entry = mr != nullptr ? mr->entry : nullptr;
    w.bind_mr_lkey = mr != nullptr ? mr->lkey : 0;
    w.bind_addr = wr->bind_mw.bind_info.addr;
    w.bind_length = wr->bind_mw.bind_info.length;
    w.bind_access = wr->bind_mw.bind_info.mw_access_flags;
    w.bind_rkey = wr->bind_mw.rkey;
  }
  if (total > kMaxMsgSize) FailAtPost(qp, w, IBV_WC_LOC_LEN_ERR);
  w.length = static_cast<uint32_t>(std::min<uint64_t>(total, kMaxMsgSize));
  if (wr->opcode == IBV_WR_LOCAL_INV || wr->opcode == IBV_WR_BIND_MW) w.length = 0;
}

// `wrote`: frames the caller already put on the ring, published with ours by one doorbell.
int PostSendLocked(SoftQp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr, bool type1_bind,
                   bool wrote) {
  if (qp->qstate != IBV_QPS_RTS && qp->qstate != IBV_QPS_ERR) {
    if (wrote) PublishAndWake(qp, true);
    *bad_wr = wr;
    return EINVAL;
  }
  const uint64_t req_head = qp->req_tx.head();
  int err = 0;
  for (; wr != nullptr; wr = wr->next) {
    if ((err = ValidateSendWr(qp, wr, type1_bind)) != 0) break;
    if (qp->sq_tail - qp->sq_released.load(std::memory_order_acquire) >= qp->max_send_wr) {
      err = ENOMEM;
      break;
    }
    const uint32_t index = qp->sq_tail;
    FillWqe(qp, index, wr);
    ++qp->sq_tail;
    SendWqe& w = qp->sq[index & qp->sq_mask];
    if (qp->qstate == IBV_QPS_ERR) {
      w.state = SendWqe::kDone;
      w.status = IBV_WC_WR_FLUSH_ERR;
      qp->sq_tx = qp->sq_tail;
      continue;
    }
    Transmit(qp);
    // Inline data must be captured before post_send returns; copy it if it is still queued.
    if ((w.send_flags & IBV_SEND_INLINE) && w.state == SendWqe::kQueued && w.sent == 0) {
      char* buffer = WqeInline(qp, index);
      const ibv_sge* sge = WqeSges(qp, index);
      uint64_t off = 0;
      for (uint32_t i = 0; i < w.num_sge; ++i) {
        std::memcpy(buffer + off, reinterpret_cast<const void*>(sge[i].addr), sge[i].length);
        off += sge[i].length;
      }
      w.inline_copy = true;
    }
  }
  if (err != 0) *bad_wr = wr;
  CompleteSq(qp);
  if (qp->cq_overflow && qp->qstate != IBV_QPS_ERR) {
    EnterError(qp);
    CompleteSq(qp);
  }
  PublishAndWake(qp, wrote || qp->req_tx.head() != req_head);
  return err;
}

}  // namespace

// ---- Shared helpers ----------------------------------------------------------------------------

int64_t AckTimeoutNs(const ibv_qp_attr& attr) {
  if (attr.timeout == 0) return 0;  // infinite
  return static_cast<int64_t>(4096) << attr.timeout;  // 4.096 us * 2^timeout
}

const ibv_sge* WqeSges(const SoftQp* qp, uint32_t index) {
  return &qp->sq_sge[(index & qp->sq_mask) * std::max<uint32_t>(qp->max_send_sge, 1)];
}

char* WqeInline(SoftQp* qp, uint32_t index) {
  return &qp->sq_inline[(index & qp->sq_mask) * std::max<uint32_t>(qp->max_inline, 1)];
}

bool CopySges(KeyTable& keys, const ibv_pd* pd, const ibv_sge* sge, uint32_t num_sge,
              uint64_t offset, char* buffer, uint64_t length, bool into_sges) {
  for (uint32_t i = 0; i < num_sge && length > 0; ++i) {
    if (offset >= sge[i].length) {
      offset -= sge[i].length;
      continue;
    }
    const uint64_t count = std::min<uint64_t>(sge[i].length - offset, length);
    if (!CopyLocal(keys, pd, sge[i].lkey, sge[i].addr + offset, buffer, count, into_sges)) {
      return false;
    }
    buffer += count;
    length -= count;
    offset = 0;
  }
  return length == 0;
}

void EnterError(SoftQp* qp) {
  if (qp->qstate == IBV_QPS_ERR) return;
  qp->qstate = IBV_QPS_ERR;
  qp->failure_pending = false;  // from now on every poll completes the send queue
  qp->state = IBV_QPS_ERR;
  // The peer learns of it from our control block, after any NAK we still owe it.
  if (qp->own_ctrl != nullptr && !qp->pending_nak.active) {
    wire::SharedRelease();
    qp->own_ctrl->state.value.store(wire::kLinkError, std::memory_order_release);
  }
  for (uint32_t i = qp->sq_head; i != qp->sq_tail; ++i) {
    SendWqe& w = qp->sq[i & qp->sq_mask];
    if (w.state != SendWqe::kDone) {
      w.state = SendWqe::kDone;
      w.status = IBV_WC_WR_FLUSH_ERR;
    }
  }
  qp->sq_tx = qp->sq_tail;
  qp->rd_atomic_outstanding = 0;
  qp->cur_read.active = false;
  qp->rnr_waiting = false;
  qp->write_in_progress = false;
  if (qp->cur_recv.active) {
    qp->cur_recv.active = false;
    FlushRecv(qp, qp->cur_recv.wr_id);
  }
  if (qp->ssrq == nullptr) {
    while (qp->rq.head != qp->rq.tail) {
      FlushRecv(qp, qp->rq.wr_id[qp->rq.head & qp->rq.mask]);
      ++qp->rq.head;
    }
  } else {
    // Nothing more is taken from the SRQ for this QP: applications wait for this event before
    // destroying an SRQ-attached QP (IB spec 11.6.3.2; mlx5 raises it, rxe does not).
    qp->sctx->RaiseQpEvent(IBV_EVENT_QP_LAST_WQE_REACHED, qp);
  }
}

void ProtocolError(SoftQp* qp, const char* what) {
  if (qp->qstate == IBV_QPS_ERR) return;
  SWIRL_LOG(WARNING, "soft: QP 0x%x: peer QP 0x%x broke the wire protocol (%s); QP -> ERR",
            qp->qp_num, qp->attr.dest_qp_num, what);
  for (uint32_t i = qp->sq_head; i != qp->sq_tail; ++i) {
    SendWqe& w = qp->sq[i & qp->sq_mask];
    // A request that failed before this one is the QP's first error: it keeps its status and
    // everything behind it flushes, as on a requester already in the error state.
    if (w.state == SendWqe::kDone && w.status != IBV_WC_SUCCESS) break;
    if (w.state != SendWqe::kDone) {
      w.state = SendWqe::kDone;
      w.status = IBV_WC_BAD_RESP_ERR;
      break;
    }
  }
  EnterError(qp);
}

bool ConsumerLied(SoftQp* qp, const RingWriter& ring) {
  if (!ring.consumer_lied()) return false;
  ProtocolError(qp, "consumer index beyond what was written, or moving backwards");
  return true;
}

void PublishAndWake(SoftQp* qp, bool wrote) {
  if (qp->own_ctrl == nullptr) return;
  bool published = wrote;
  wire::SharedRelease();
  if (qp->linked) {
    wire::SegmentControl* ctrl = qp->own_ctrl;
    if (qp->req_rx.tail() != qp->req_consumed_published) {
      qp->req_consumed_published = qp->req_rx.tail();
      ctrl->request_consumed.value.store(qp->req_consumed_published, std::memory_order_release);
      published = true;
    }
    if (qp->resp_rx.tail() != qp->resp_consumed_published) {
      qp->resp_consumed_published = qp->resp_rx.tail();
      ctrl->response_consumed.value.store(qp->resp_consumed_published,
                                          std::memory_order_release);
      published = true;
    }
  }
  if (qp->expected_msn != qp->acked_published) {
    qp->acked_published = qp->expected_msn;
    qp->own_ctrl->acked.value.store(qp->acked_published, std::memory_order_release);
    published = true;
  }
  if (!published || !qp->linked) return;
  qp->fabric->Publish(qp, wrote);
}

bool IsExpectedPeer(SoftQp* qp, const PeerSegment& c) {
  return c.qp_num == qp->attr.dest_qp_num &&
         std::memcmp(&c.gid, &qp->attr.ah_attr.grh.dgid, sizeof(ibv_gid)) == 0 &&
         c.auth_serial == LinkKeyOf(qp, nullptr);
}

uint64_t LinkKeyOf(SoftQp* qp, LinkKey* key) {
  swirl::MutexLock lock(&qp->key_mu);
  if (qp->key_serial != 0 && key != nullptr) *key = qp->link_key;
  return qp->key_serial;
}

namespace {

// Polls of a stalled request before the peer's HCA thread is kicked, and again between kicks:
// tens of microseconds, far longer than a peer that makes progress takes to answer.
constexpr uint32_t kKickAfterStalledPolls = 2048;
// Polls of a stalled request between looks at RC's transport timer (RunTransportTimer), which
// reads the clock: a few microseconds of busy polling, or one round of the HCA thread's
// progress for a CQ whose owner sleeps. A divisor of kKickAfterStalledPolls.
constexpr uint32_t kTimerEveryStalledPolls = 64;
static_assert(kKickAfterStalledPolls % kTimerEveryStalledPolls == 0);

// A NIC answers RDMA requests by itself; the soft device answers them when the target's owner
// calls into it, or its HCA thread does for a target nobody polls. A target that polls between
// spins on memory (ib_write_lat waits for the peer's WRITE that way) looks polled and is never
// helped: so the requester, stalled this long, kicks the target's HCA thread, which then makes
// one round of progress for every QP (shared memory: the TCP fabric has no wake fd). A kick
// costs a syscall, and only a stalled requester makes one.
void KickPeerHca(SoftQp* qp) {
  if (qp->peer.wake_fd < 0) return;
  uint64_t one = 1;
  ssize_t ignored = write(qp->peer.wake_fd, &one, sizeof(one));
  (void)ignored;
}

// A request has been stalled for another kTimerEveryStalledPolls polls: RC's transport timer,
// and every kKickAfterStalledPolls a kick. Out of line, so that the stalled poll's test stays
// the one it was before the timer ran on every QP.
[[gnu::noinline, gnu::cold]] bool StalledRequester(SoftQp* qp) {
  if (qp->stalled_polls % kKickAfterStalledPolls == 0) KickPeerHca(qp);
  return RunTransportTimer(qp);
}

}  // namespace

// The steady state's work (ProgressLocked decided there is some): a few loads when a poll
// finds nothing, which is the busy-polling hot path.
bool ProgressNormal(SoftQp* qp, bool responses_ready, bool requests_ready) {
  const uint64_t req_head = qp->req_tx.head();
  const uint64_t resp_head = qp->resp_tx.head();
  const uint32_t sq_head = qp->sq_head;
  bool did = false;
  if (responses_ready) did |= ProcessResponses(qp);
  if (requests_ready && !ReceiveWholeSends(qp, &did)) did |= ProcessRequests(qp);
  bool transmitted = false;
  if (qp->qstate == IBV_QPS_RTS && qp->sq_tx != qp->sq_tail) {
    Transmit(qp);
    transmitted = true;
  }
  RetireAckedUnsignaled(qp);
  // A send completes on an ack a frame brought (did), a request just transmitted or executed
  // locally, or the ack word CompleteSq reads when a completion is wanted; with none of those
  // it could not move.
  if (qp->sq_head != qp->sq_tx &&
      (did || transmitted || qp->qstate != IBV_QPS_RTS || CompletionWanted(qp))) {
    CompleteSq(qp);
  }
  if (did || transmitted || qp->sq_head != sq_head || qp->sq_head == qp->sq_tx) {
    qp->stalled_polls = 0;
  } else if (++qp->stalled_polls % kTimerEveryStalledPolls == 0) {
    did |= StalledRequester(qp);
  }
  const bool wrote = qp->req_tx.head() != req_head || qp->resp_tx.head() != resp_head;
  if (did || wrote) PublishAndWake(qp, wrote);
  return did || wrote;
}

bool ProgressSlow(SoftQp* qp) {
  bool did = HandleLinkEvent(qp);
  if (qp->qstate == IBV_QPS_RESET || qp->qstate == IBV_QPS_INIT) return did;
  // Injected faults (faults.cc): a frozen QP moves nothing at all.
  QpFaults* const faults = qp->faults.load(std::memory_order_acquire);
  if (faults != nullptr && FaultsBeforeProgress(qp, faults)) return did;
  const uint64_t req_head = qp->req_tx.head();
  const uint64_t resp_head = qp->resp_tx.head();
  if (qp->linked) {
    // Read the peer's state before draining its rings: a peer publishes its error state only
    // after the NAK that explains it, so whatever that state says, the drain below sees the NAK.
    const uint64_t peer_state = qp->peer.control()->state.value.load(std::memory_order_acquire);
    wire::SharedAcquire();
    const bool gone = qp->peer_gone.load(std::memory_order_acquire);
    // An injected noack: the responder takes, and so acknowledges, nothing more.
    const bool responder = faults == nullptr || !faults->silent;
    if (qp->pending_nak.active && responder) FlushPendingNak(qp);
    did |= ProcessResponses(qp);
    if (responder) did |= ProcessRequests(qp);
    // Completions first: a NAK just processed puts the QP in error with its own status, which
    // must not be mistaken for the peer going silent below.
    CompleteSq(qp);
    if ((peer_state != wire::kLinkActive || gone) && qp->qstate != IBV_QPS_ERR) {
      // The peer stopped answering: the first request still outstanding fails as a real
      // requester's would after its retries, and the QP with it. Without one, nothing fails,
      // as on a NIC, where a QP learns of a vanished peer only by sending to it: a receiver
      // whose peer finished and went away keeps its posted receives (ibv_rc_pingpong's
      // server reads a flushed one as a failure). Its next request fails here.
      bool failed = false;
      for (uint32_t i = qp->sq_head; i != qp->sq_tail; ++i) {
        SendWqe& w = qp->sq[i & qp->sq_mask];
        if (w.state != SendWqe::kDone) {
          w.state = SendWqe::kDone;
          w.status = IBV_WC_RETRY_EXC_ERR;
          failed = true;
          break;
        }
      }
      if (failed) {
        SWIRL_LOG(DEBUG, "soft: QP 0x%x: peer QP 0x%x %s; QP -> ERR", qp->qp_num,
                  qp->attr.dest_qp_num, gone ? "is gone" : "failed");
        EnterError(qp);
        did = true;  // (a QP that stays, with nothing to fail, did nothing: no busy assist)
      }
    }
    // A QP with faults armed never takes ProgressNormal, whose stalled polls run the timer
    // for every other QP: it runs here, at every progress.
    if (faults != nullptr) did |= RunTransportTimer(qp);
  } else if (qp->fabric->RetryLink(qp)) {
    did = true;
  } else if (qp->link_deadline_ns != 0 && qp->sq_head != qp->sq_tail &&
             NowNs() > qp->link_deadline_ns && qp->qstate == IBV_QPS_RTS) {
    // Nobody ever answered at the peer's address: transport retries exhausted.
    SendWqe& w = qp->sq[qp->sq_head & qp->sq_mask];
    if (w.state != SendWqe::kDone) {
      w.state = SendWqe::kDone;
      w.status = IBV_WC_RETRY_EXC_ERR;
    }
    EnterError(qp);
    did = true;
  }
  if (qp->qstate == IBV_QPS_RTS) Transmit(qp);
  CompleteSq(qp);
  if (qp->cq_overflow && qp->qstate != IBV_QPS_ERR) {
    EnterError(qp);
    CompleteSq(qp);
  }
  const bool wrote = qp->req_tx.head() != req_head || qp->resp_tx.head() != resp_head;
  PublishAndWake(qp, wrote);
  return did || wrote;
}

void FailQpLocked(SoftQp* qp, ibv_wc_status) {
  EnterError(qp);
  CompleteSq(qp);
}

// ---- Verbs entry points -------------------------------------------------------------------------

int CreateQp(SoftContext* sctx, ibv_pd* pd, ibv_qp_init_attr* attr, ibv_qp** out) {
  if (!PdOf(pd, sctx) || attr == nullptr) return EINVAL;
  if (attr->qp_type != IBV_QPT_RC) return EOPNOTSUPP;
  if (attr->send_cq == nullptr || attr->recv_cq == nullptr ||
      attr->send_cq->context != pd->context || attr->recv_cq->context != pd->context) {
    return EINVAL;
  }
  if (attr->srq != nullptr && attr->srq->context != pd->context) return EINVAL;
  ibv_qp_cap& cap = attr->cap;
  if (cap.max_send_wr > kMaxQpWr || cap.max_send_sge > kMaxSge || cap.max_inline_data > kMaxInline) {
    return EINVAL;
  }
  if (attr->srq == nullptr && (cap.max_recv_wr > kMaxQpWr || cap.max_recv_sge > kMaxSge)) {
    return EINVAL;
  }
  auto* qp = new SoftQp();
  static std::atomic<uint64_t> next_serial{1};
  qp->serial = next_serial.fetch_add(1, std::memory_order_relaxed);
  qp->sctx = sctx;
  qp->hca = sctx->hca;
  qp->fabric = sctx->hca->fabric.get();
  qp->spd = static_cast<SoftPd*>(pd);
  qp->scq = AsSoft(attr->send_cq);
  qp->rcq = AsSoft(attr->recv_cq);
  qp->ssrq = attr->srq ? static_cast<SoftSrq*>(attr->srq) : nullptr;
  qp->max_send_wr = cap.max_send_wr;
  qp->max_send_sge = cap.max_send_sge;
  qp->max_inline = cap.max_inline_data;
  qp->sig_all = attr->sq_sig_all != 0;
  if (qp->ssrq == nullptr) {
    qp->max_recv_wr = cap.max_recv_wr;
    qp->max_recv_sge = cap.max_recv_sge;
    qp->rq.Init(std::max<uint32_t>(cap.max_recv_wr, 1), std::max<uint32_t>(cap.max_recv_sge, 1));
    qp->rq.capacity = cap.max_recv_wr;
  } else {
    cap.max_recv_wr = 0;
    cap.max_recv_sge = 0;
  }
  const uint32_t depth = std::bit_ceil<uint32_t>(std::max<uint32_t>(cap.max_send_wr, 1));
  qp->sq.resize(depth);
  qp->sq_mask = depth - 1;
  qp->sq_sge.resize(static_cast<size_t>(depth) * std::max<uint32_t>(cap.max_send_sge, 1));
  qp->sq_inline.resize(static_cast<size_t>(depth) * std::max<uint32_t>(cap.max_inline_data, 1));

  qp->context = pd->context;
  qp->qp_context = attr->qp_context;
  qp->pd = pd;
  qp->send_cq = attr->send_cq;
  qp->recv_cq = attr->recv_cq;
  qp->srq = attr->srq;
  qp->state = IBV_QPS_RESET;
  qp->qp_type = IBV_QPT_RC;
  qp->events_completed = 0;
  pthread_mutex_init(&qp->mutex, nullptr);
  pthread_cond_init(&qp->cond, nullptr);
  {
    swirl::MutexLock lock(&qp->hca->mu);
    if (qp->hca->qps.size() >= kMaxQp) {
      delete qp;
      return ENOMEM;
    }
    uint32_t qpn;
    do {
      qpn = absl::Uniform<uint32_t>(qp->hca->bitgen, 2, wire::kMsnMask + 1);
    } while (qp->hca->qps.contains(qpn));
    qp->qp_num = qpn;
    qp->handle = qpn;
    qp->hca->qps[qpn] = qp;
    qp->hca_index = qp->hca->qp_list.size();
    qp->hca->qp_list.push_back(qp);
  }
  {
    // Injected faults (faults.cc): a QP of an armed process gets its QpFaults before any poll
    // of its CQs can reach it; the K-th QP created is what SWIRL_SOFT_FAULTS' qp=#K names.
    static std::atomic<uint64_t> created{0};
    AttachFaults(qp, created.fetch_add(1, std::memory_order_relaxed) + 1);
  }
  AttachQp(qp->scq, qp);
  if (qp->rcq != qp->scq) AttachQp(qp->rcq, qp);
  if (qp->ssrq) qp->ssrq->qp_count.fetch_add(1);
  qp->spd->users.fetch_add(1, std::memory_order_relaxed);
  *out = qp;
  return 0;
}

int ModifyQp(ibv_qp* ibqp, ibv_qp_attr* attr, int mask) {
  SoftQp* qp = AsSoft(ibqp);
  std::lock_guard<QpLock> lock(qp->lock);
  const ibv_qp_state from = qp->qstate;
  if ((mask & IBV_QP_CUR_STATE) && attr->cur_qp_state != from) return EINVAL;
  const ibv_qp_state to = (mask & IBV_QP_STATE) ? attr->qp_state : from;
  const Transition t = TransitionFor(from, to);
  if (!t.valid) return EINVAL;
  const int given = mask & ~IBV_QP_STATE;
  if ((given & t.required) != t.required || (given & ~(t.required | t.optional))) return EINVAL;
  if (int err = ValidateAttrValues(*attr, mask); err != 0) return err;
  ApplyAttrs(qp, *attr, mask);

  if (to == IBV_QPS_RESET) {
    TeardownLink(qp);
    ResetQueues(qp);
    swirl::MutexLock key_lock(&qp->key_mu);
    qp->key_final = false;  // the key may change again before the next RTR
    if (QpFaults* f = qp->faults.load(std::memory_order_acquire)) ResetFaults(f);
  } else if (to == IBV_QPS_ERR) {
    EnterError(qp);
    CompleteSq(qp);
  } else if (from == IBV_QPS_INIT && to == IBV_QPS_RTR) {
    {
      // From now on the key is what it is: keyed hellos waiting for one get their answer.
      swirl::MutexLock key_lock(&qp->key_mu);
      qp->key_final = true;
    }
    qp->hca->keys_changed.store(true, std::memory_order_release);
    qp->hca->Kick();
    qp->expected_msn = qp->attr.rq_psn & wire::kMsnMask;
    if (int err = CreateSegment(qp); err != 0) return err;
    qp->fabric->OpenLink(qp);
    qp->link_event.store(true, std::memory_order_release);  // re-check early candidates
  } else if (from == IBV_QPS_RTR && to == IBV_QPS_RTS) {
    qp->next_msn = qp->attr.sq_psn & wire::kMsnMask;
    qp->peer_acked = qp->next_msn;
    qp->fabric->SetLinkTimeout(qp, AckTimeoutNs(qp->attr) * (qp->attr.retry_cnt + 1));
    if (!qp->linked && AckTimeoutNs(qp->attr) != 0) {
      qp->link_deadline_ns = NowNs() + AckTimeoutNs(qp->attr) * (qp->attr.retry_cnt + 1);
    }
  }
  qp->qstate = to;
  qp->state = to;
  if (to == IBV_QPS_RTR || to == IBV_QPS_RTS) ProgressLocked(qp);
  return 0;
}

int QueryQp(ibv_qp* ibqp, ibv_qp_attr* attr, int, ibv_qp_init_attr* init) {
  SoftQp* qp = AsSoft(ibqp);
  std::lock_guard<QpLock> lock(qp->lock);
  *attr = qp->attr;
  attr->qp_state = qp->qstate;
  attr->cur_qp_state = qp->qstate;
  attr->cap.max_send_wr = qp->max_send_wr;
  attr->cap.max_recv_wr = qp->max_recv_wr;
  attr->cap.max_send_sge = qp->max_send_sge;
  attr->cap.max_recv_sge = qp->max_recv_sge;
  attr->cap.max_inline_data = qp->max_inline;
  if (init != nullptr) {
    std::memset(init, 0, sizeof(*init));
    init->qp_context = qp->qp_context;
    init->send_cq = qp->send_cq;
    init->recv_cq = qp->recv_cq;
    init->srq = qp->srq;
    init->cap = attr->cap;
    init->qp_type = IBV_QPT_RC;
    init->sq_sig_all = qp->sig_all ? 1 : 0;
  }
  return 0;
}

int DestroyQp(ibv_qp* ibqp) {
  SoftQp* qp = AsSoft(ibqp);
  {
    swirl::MutexLock lock(&qp->hca->mu);
    qp->hca->qps.erase(qp->qp_num);
    std::vector<SoftQp*>& list = qp->hca->qp_list;
    list[qp->hca_index] = list.back();
    list[qp->hca_index]->hca_index = qp->hca_index;
    list.pop_back();
  }
  // After these, no poller or HCA thread can be inside this QP.
  DetachQp(qp->scq, qp);
  if (qp->rcq != qp->scq) DetachQp(qp->rcq, qp);
  {
    std::lock_guard<QpLock> lock(qp->lock);
    TeardownLink(qp);
  }
  PurgeQp(qp->scq, qp);
  if (qp->rcq != qp->scq) PurgeQp(qp->rcq, qp);
  const bool acked = WaitForAsyncAcks(&qp->mutex, &qp->cond, &qp->events_completed,
                                      qp->sctx->EndAsyncEvents(qp), "QP");
  if (qp->ssrq) qp->ssrq->qp_count.fetch_sub(1);
  qp->spd->users.fetch_sub(1, std::memory_order_release);
  delete qp->faults.exchange(nullptr, std::memory_order_acq_rel);
  if (!acked) return 0;  // left allocated: a late acknowledgement locks its mutex
  pthread_mutex_destroy(&qp->mutex);
  pthread_cond_destroy(&qp->cond);
  delete qp;
  return 0;
}

namespace {

constexpr uint32_t kPayloadInFirstLine = wire::kCacheLine - sizeof(wire::FrameHeader);

// The common case, kept short: one SEND (with immediate or invalidate) of at most one chunk,
// inline or from one SGE, on an RTS QP with nothing queued ahead of it and room in the ring.
// Returns false without side effects when the general path must handle the request. Inline in
// both of its callers (PostSend, PostSendAll): it is the common post.
[[gnu::always_inline]] inline bool TryFastSend(SoftQp* qp, const ibv_send_wr* wr) {
  // Whatever the general path would reject or treat specially (SGE limits, an overflowed
  // CQ) goes there, so both paths answer alike.
  if (qp->qstate != IBV_QPS_RTS || qp->sq_tx != qp->sq_tail || wr->num_sge != 1 ||
      qp->max_send_sge == 0 || qp->cq_overflow || qp->sq_stopped || wr->sg_list == nullptr ||
      (wr->send_flags & (IBV_SEND_FENCE | IBV_SEND_SOLICITED)) != 0) {
    return false;
  }
  uint8_t flags = wire::kFlagFirst | wire::kFlagLast;
  uint32_t imm_or_inv = 0;
  switch (wr->opcode) {
    case IBV_WR_SEND:
      break;
    case IBV_WR_SEND_WITH_IMM:
      flags |= wire::kFlagWithImm;
      imm_or_inv = wr->imm_data;
      break;
    case IBV_WR_SEND_WITH_INV:
      flags |= wire::kFlagWithInv;
      imm_or_inv = wr->invalidate_rkey;
      break;
    default:
      return false;
  }
  const ibv_sge& sge = wr->sg_list[0];
  const bool is_inline = (wr->send_flags & IBV_SEND_INLINE) != 0;
  if (sge.length > wire::kMaxChunk || (is_inline && sge.length > qp->max_inline) ||
      qp->sq_tail - qp->sq_released.load(std::memory_order_acquire) >= qp->max_send_wr) {
    return false;
  }
  const uint64_t bytes = wire::FrameBytes(wire::kOpSend, sge.length);
  uint64_t pos;
  char* frame = qp->req_tx.Reserve(bytes, &pos, qp->expected_msn);
  if (frame == nullptr) return false;
  // Each of the frame's cache lines is written once, the header's line last: the peer polls
  // that line, and one written, read by the poller and written again would cross between the
  // cores twice before the frame is visible. So the payload beyond the first line goes first.
  char* payload = frame + sizeof(wire::FrameHeader);
  const char* src = reinterpret_cast<const char*>(sge.addr);
  const uint32_t head_bytes = std::min<uint32_t>(sge.length, kPayloadInFirstLine);
  KeyEntry* pinned = nullptr;
  if (!is_inline && sge.length > 0) {
    pinned = PinLocal(qp->hca->keys, qp->pd, sge.lkey, sge.addr, sge.length, false);
    if (pinned == nullptr) return false;  // the general path reports the protection error
  }
  CopyBytes(payload + head_bytes, src + head_bytes, sge.length - head_bytes);
  CopyBytes(payload, src, head_bytes);
  if (pinned != nullptr) KeyTable::Unpin(pinned);
  auto* h = reinterpret_cast<wire::FrameHeader*>(frame);
  h->op = wire::kOpSend;
  h->flags = flags;
  h->rnr_retry = qp->attr.rnr_retry;
  h->reserved = 0;
  h->length = sge.length;
  h->msn = qp->next_msn;
  h->ack = qp->expected_msn;
  h->imm_or_inv = imm_or_inv;
  h->total_length = sge.length;
  qp->req_tx.Commit(frame, pos, bytes);
  SendWqe& w = qp->sq[qp->sq_tail & qp->sq_mask];
  if (qp->sig_all || (wr->send_flags & IBV_SEND_SIGNALED)) qp->newest_signaled = qp->sq_tail;
  w.wr_id = wr->wr_id;
  w.opcode = wr->opcode;
  w.send_flags = wr->send_flags;
  w.state = SendWqe::kAwaiting;
  w.inline_copy = false;
  w.has_msn = true;
  w.status = IBV_WC_SUCCESS;
  w.msn = qp->next_msn;
  w.length = sge.length;
  w.sent = sge.length;
  w.num_sge = 0;
  qp->next_msn = wire::NextMsn(qp->next_msn);
  ++qp->sq_tail;
  ++qp->sq_tx;
  return true;
}

// ibv_post_send with the QP's lock held. Always inline: it is PostSend's whole body, and a call
// would cost the common post a few instructions.
[[gnu::always_inline]] inline int PostSendHeld(SoftQp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) {
  // Common requests go straight to the ring, one doorbell (publish and wake) for the chain;
  // the first one the fast path declines takes the general path with the rest.
  bool posted = false;
  while (wr != nullptr && TryFastSend(qp, wr)) {
    wr = wr->next;
    posted = true;
  }
  if (wr == nullptr) {
    PublishAndWake(qp, posted);
    return 0;
  }
  return PostSendLocked(qp, wr, bad_wr, false, posted);
}

}  // namespace

int PostSend(ibv_qp* ibqp, ibv_send_wr* wr, ibv_send_wr** bad_wr) {
  SoftQp* qp = AsSoft(ibqp);
  std::lock_guard<QpLock> lock(qp->lock);
  return PostSendHeld(qp, wr, bad_wr);
}

int PostSendAll(SoftQp* qp, ibv_send_wr* wr) {
  std::lock_guard<QpLock> lock(qp->lock);
  // Everything PostSendLocked could refuse part-way is checked first (the state, each request,
  // room for all of them); under the lock, none of it can change before the post below.
  if (qp->qstate != IBV_QPS_RTS && qp->qstate != IBV_QPS_ERR) return EINVAL;
  uint32_t count = 0;
  for (const ibv_send_wr* w = wr; w != nullptr; w = w->next, ++count) {
    if (int err = ValidateSendWr(qp, w, false); err != 0) return err;
  }
  if (qp->sq_tail - qp->sq_released.load(std::memory_order_acquire) + count > qp->max_send_wr) {
    return ENOMEM;
  }
  ibv_send_wr* bad = nullptr;
  return PostSendHeld(qp, wr, &bad);
}

int BindMw(ibv_qp* ibqp, ibv_mw* mw, ibv_mw_bind* bind) {
  SoftQp* qp = AsSoft(ibqp);
  if (qp->context != mw->context) return EINVAL;
  if (bind->bind_info.mr != nullptr && bind->bind_info.mr->pd != qp->pd) return EPERM;
  std::lock_guard<QpLock> lock(qp->lock);
  if (qp->qstate != IBV_QPS_RTS) return EINVAL;
  auto* smw = static_cast<SoftMw*>(mw);
  ibv_send_wr wr;
  std::memset(&wr, 0, sizeof(wr));
  wr.wr_id = bind->wr_id;
  wr.opcode = IBV_WR_BIND_MW;
  wr.send_flags = bind->send_flags;
  wr.bind_mw.mw = mw;
  wr.bind_mw.bind_info = bind->bind_info;
  // Type 1: the provider chooses the new key and the consumer sees it at once in mw->rkey.
  wr.bind_mw.rkey = qp->hca->keys.NewKey(smw->entry, mw->rkey);
  ibv_send_wr* bad = nullptr;
  int err = PostSendLocked(qp, &wr, &bad, true, false);
  if (err == 0) mw->rkey = wr.bind_mw.rkey;
  return err;
}

int PostRecv(ibv_qp* ibqp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  SoftQp* qp = AsSoft(ibqp);
  std::lock_guard<QpLock> lock(qp->lock);
  if (qp->ssrq != nullptr || qp->qstate == IBV_QPS_RESET) {
    *bad_wr = wr;
    return EINVAL;
  }
  for (; wr != nullptr; wr = wr->next) {
    if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > qp->max_recv_sge ||
        (wr->num_sge > 0 && wr->sg_list == nullptr)) {
      *bad_wr = wr;
      return EINVAL;
    }
    if (qp->qstate == IBV_QPS_ERR) {
      FlushRecv(qp, wr->wr_id);
      continue;
    }
    RecvQueue& rq = qp->rq;
    if (rq.tail - rq.head >= rq.capacity) {
      *bad_wr = wr;
      return ENOMEM;
    }
    const uint32_t slot = rq.tail & rq.mask;
    rq.wr_id[slot] = wr->wr_id;
    rq.num_sge[slot] = static_cast<uint32_t>(wr->num_sge);
    for (int i = 0; i < wr->num_sge; ++i) rq.sge[slot * rq.max_sge + i] = wr->sg_list[i];
    ++rq.tail;
  }
  return 0;
}

int PostSrqRecv(ibv_srq* ibsrq, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  auto* srq = static_cast<SoftSrq*>(ibsrq);
  std::lock_guard<SpinLock> lock(srq->lock);
  RecvQueue& rq = srq->rq;
  for (; wr != nullptr; wr = wr->next) {
    const int num_sge = wr->num_sge;
    if (num_sge < 0 || static_cast<uint32_t>(num_sge) > rq.max_sge ||
        (num_sge > 0 && wr->sg_list == nullptr)) {
      *bad_wr = wr;
      return EINVAL;
    }
    if (rq.tail - rq.head >= rq.capacity) {
      *bad_wr = wr;
      return ENOMEM;
    }
    const uint32_t slot = rq.tail & rq.mask;
    rq.wr_id[slot] = wr->wr_id;
    rq.num_sge[slot] = static_cast<uint32_t>(num_sge);
    ibv_sge* const sge = &rq.sge[static_cast<size_t>(slot) * rq.max_sge];
    if (num_sge == 1) [[likely]] {  // a receive pool's buffer: one entry, copied as one
      *sge = wr->sg_list[0];
    } else {
      std::copy(wr->sg_list, wr->sg_list + num_sge, sge);
    }
    ++rq.tail;
  }
  return 0;
}

void RecvQueue::Init(uint32_t cap, uint32_t sges) {
  const uint32_t depth = std::bit_ceil<uint32_t>(cap);
  capacity = cap;
  max_sge = sges;
  mask = depth - 1;
  wr_id.assign(depth, 0);
  num_sge.assign(depth, 0);
  sge.assign(static_cast<size_t>(depth) * sges, ibv_sge{});
  head = tail = 0;
}

bool IsSoftQp(const ibv_qp* qp) { return qp != nullptr && IsSoftContext(qp->context); }

absl::Status SetLinkKey(ibv_qp* ibqp, absl::Span<const uint8_t> key) {
  if (ibqp == nullptr || !IsSoftContext(ibqp->context)) {
    return absl::UnimplementedError(
        "link keys are a soft-device extension: this QP's device ignores them (its RC link is "
        "as unauthenticated as RoCE's)");
  }
  if (!key.empty() && key.size() != kLinkKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a link key is ", kLinkKeyBytes, " bytes, not ", key.size()));
  }
  SoftQp* qp = AsSoft(ibqp);
  {
    std::lock_guard<QpLock> lock(qp->lock);
    if (qp->qstate != IBV_QPS_RESET && qp->qstate != IBV_QPS_INIT) {
      return absl::FailedPreconditionError(
          "a QP's link key is set before RTR (the QP is past INIT)");
    }
    static std::atomic<uint64_t> next_serial{1};
    swirl::MutexLock key_lock(&qp->key_mu);
    if (key.empty()) {
      OPENSSL_cleanse(qp->link_key.data(), qp->link_key.size());
      qp->key_serial = 0;
    } else {
      std::memcpy(qp->link_key.data(), key.data(), kLinkKeyBytes);
      qp->key_serial = next_serial.fetch_add(1, std::memory_order_relaxed);
    }
  }
  // A keyed hello that arrived before the key was waiting for it.
  qp->hca->keys_changed.store(true, std::memory_order_release);
  qp->hca->Kick();
  return absl::OkStatus();
}

}  // namespace swirl::soft
