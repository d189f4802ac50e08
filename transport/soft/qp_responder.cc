// The responder half of a soft RC QP: executing the peer's requests against local memory, with
// every check a real RC responder makes, and answering with responses, NAKs and acks.

#include <cstring>

#include "transport/soft/qp_ops.h"

namespace swirl::soft {
namespace {

// IB spec table of RNR timer values (min_rnr_timer encoding), in microseconds.
constexpr int64_t kRnrTimerUs[32] = {655360, 10,    20,    30,     40,     60,     80,     120,
                                     160,    240,   320,   480,    640,    960,    1280,   1920,
                                     2560,   3840,  5120,  7680,   10240,  15360,  20480,  30720,
                                     40960,  61440, 81920, 122880, 163840, 245760, 327680, 491520};

enum class Outcome { kDone, kStall, kFailed };

// Queues or writes a NAK for `msn` and puts the QP in error. The requester completes that
// request with `status`; everything after it is flushed on both sides.
void Nak(SoftQp* qp, uint32_t msn, ibv_wc_status status) {
  qp->pending_nak.active = true;
  qp->pending_nak.msn = msn;
  qp->pending_nak.status = status;
  FlushPendingNak(qp);
  const bool was_in_error = qp->qstate == IBV_QPS_ERR;
  EnterError(qp);
  // The responder's own failure has no completion to report it, so it is an affiliated
  // asynchronous error on its QP (IB spec 11.6.3.1; mlx5 raises these): an access violation, an
  // invalid request, or a catastrophic error for anything else the responder cannot carry out.
  // An out-of-sequence request is the soft device's stand-in for a retry failure, not a
  // responder error, and raises nothing.
  if (was_in_error || status == IBV_WC_RETRY_EXC_ERR) return;
  qp->sctx->RaiseQpEvent(status == IBV_WC_REM_ACCESS_ERR    ? IBV_EVENT_QP_ACCESS_ERR
                         : status == IBV_WC_REM_INV_REQ_ERR ? IBV_EVENT_QP_REQ_ERR
                                                            : IBV_EVENT_QP_FATAL,
                         qp);
}

// The fields of a receive completion, into a zeroed ibv_wc.
inline void FillRecvWc(const SoftQp* qp, ibv_wc& wc, uint64_t wr_id, ibv_wc_status status,
                       ibv_wc_opcode opcode, uint32_t byte_len, unsigned int flags,
                       uint32_t imm_or_inv) {
  wc.wr_id = wr_id;
  wc.status = status;
  wc.opcode = opcode;
  wc.byte_len = byte_len;
  wc.wc_flags = flags;
  wc.imm_data = imm_or_inv;  // union with invalidated_rkey
  wc.qp_num = qp->qp_num;
  wc.src_qp = qp->attr.dest_qp_num;
}

void PushRecv(SoftQp* qp, uint64_t wr_id, ibv_wc_status status, ibv_wc_opcode opcode,
              uint32_t byte_len, unsigned int flags, uint32_t imm_or_inv, bool solicited) {
  const bool pushed = qp->rcq->Push(nullptr, 0, solicited, status, [&](ibv_wc& wc) {
    FillRecvWc(qp, wc, wr_id, status, opcode, byte_len, flags, imm_or_inv);
  });
  if (!pushed) qp->cq_overflow = true;
}

// Takes the next receive WQE (own RQ or SRQ) into cur_recv. False if none is posted.
bool TakeRecv(SoftQp* qp) {
  auto take = [qp](RecvQueue& rq) {
    if (rq.head == rq.tail) return false;
    const uint32_t slot = rq.head & rq.mask;
    qp->cur_recv.wr_id = rq.wr_id[slot];
    qp->cur_recv.num_sge = rq.num_sge[slot];
    uint64_t capacity = 0;
    for (uint32_t i = 0; i < rq.num_sge[slot]; ++i) {
      qp->cur_recv.sge[i] = rq.sge[slot * rq.max_sge + i];
      capacity += qp->cur_recv.sge[i].length;
    }
    qp->cur_recv.capacity = static_cast<uint32_t>(std::min<uint64_t>(capacity, kMaxMsgSize));
    ++rq.head;
    return true;
  };
  bool got;
  if (qp->ssrq != nullptr) {
    bool limit_reached;
    {
      std::lock_guard<SpinLock> lock(qp->ssrq->lock);
      got = take(qp->ssrq->rq);
      limit_reached = got && qp->ssrq->CrossedLimit();
    }
    if (limit_reached) [[unlikely]] RaiseSrqLimitReached(qp->ssrq);
  } else {
    got = take(qp->rq);
  }
  if (got) {
    qp->cur_recv.active = true;
    qp->cur_recv.offset = 0;
  }
  return got;
}

// No receive WQE for a SEND (or WRITE with immediate): the RNR NAK loop, done in place. The
// frame stays unconsumed until a receive is posted, or the requester's rnr_retry runs out.
Outcome ReceiverNotReady(SoftQp* qp, const wire::FrameHeader& h) {
  const int64_t now = NowNs();
  if (!qp->rnr_waiting) {
    qp->rnr_waiting = true;
    const int retries = h.rnr_retry & 7;
    qp->rnr_deadline_ns =
        retries == 7 ? 0 : now + retries * kRnrTimerUs[qp->attr.min_rnr_timer & 31] * 1000;
    if (retries == 0) qp->rnr_deadline_ns = now;
  }
  if (qp->rnr_deadline_ns != 0 && now >= qp->rnr_deadline_ns) {
    // Retries exhausted: the requester fails this message and everything after it. This side
    // stays usable; it discards the rest of the failed requester's stream.
    qp->rnr_waiting = false;
    qp->pending_nak.active = true;
    qp->pending_nak.msn = h.msn;
    qp->pending_nak.status = IBV_WC_RNR_RETRY_EXC_ERR;
    FlushPendingNak(qp);
    qp->discard_requests = true;
    return Outcome::kFailed;
  }
  return Outcome::kStall;
}

// A whole SEND (its one frame both first and last chunk) into the next receive WQE when that
// has one SGE able to hold it: placed straight from the frame, without the per-message receive
// state a chunked SEND needs. Returns false, having changed nothing, for anything else; the
// general path then reports whatever is wrong (RNR, length, protection) as it always does.
[[gnu::always_inline]] inline bool PlaceWholeSend(SoftQp* qp, const wire::FrameHeader& h,
                                                const char* payload, uint64_t* wr_id) {
  // The WQE is taken, and its buffer checked and pinned, under the SRQ's lock if there is one;
  // the copy runs after it, so QPs sharing the SRQ never wait behind a copy.
  ibv_sge sge;
  KeyEntry* pinned = nullptr;
  auto take = [&](RecvQueue& rq) {
    if (rq.head == rq.tail) return false;
    const uint32_t slot = rq.head & rq.mask;
    if (rq.num_sge[slot] != 1) return false;
    sge = rq.sge[static_cast<size_t>(slot) * rq.max_sge];
    if (h.length > sge.length) return false;
    if (h.length > 0) {
      pinned = PinLocal(qp->hca->keys, qp->pd, sge.lkey, sge.addr, h.length, true);
      if (pinned == nullptr) return false;
    }
    *wr_id = rq.wr_id[slot];
    ++rq.head;
    return true;
  };
  bool taken;
  if (qp->ssrq == nullptr) {
    taken = take(qp->rq);
  } else {
    bool limit_reached;
    {
      std::lock_guard<SpinLock> lock(qp->ssrq->lock);
      taken = take(qp->ssrq->rq);
      limit_reached = taken && qp->ssrq->CrossedLimit();
    }
    if (limit_reached) [[unlikely]] RaiseSrqLimitReached(qp->ssrq);
  }
  if (!taken) return false;
  if (pinned != nullptr) {
    CopyBytes(reinterpret_cast<void*>(sge.addr), payload, h.length);
    KeyTable::Unpin(pinned);
  }
  return true;
}

// Remote invalidation: only a valid type 2 window of this QP's PD, bound to this QP, may be
// revoked. Out of line: the common SEND carries none.
[[gnu::noinline]] bool InvalidateRemote(SoftQp* qp, uint32_t rkey) {
  swirl::MutexLock lock(&qp->hca->mw_mu);
  KeyEntry* e = qp->hca->keys.EntryFor(rkey);
  if (rkey == 0 || KeyTable::PublishedKey(e) != rkey || e->kind != KeyKind::kMw2 ||
      e->pd != qp->pd || e->qp_serial != qp->serial) {
    return false;
  }
  KeyTable::Unbind(e);
  ReleaseIfRetired(qp->hca->keys, e);
  return true;
}

// A SEND whose data is all placed: the remote invalidation it carries, if any, then its receive
// completion. The window is revoked before the completion exists, so the consumer never sees
// the message while the window is still usable.
[[gnu::always_inline]] inline Outcome FinishSend(SoftQp* qp, const wire::FrameHeader& h,
                                                uint64_t wr_id, uint32_t byte_len) {
  unsigned int wc_flags = (h.flags & wire::kFlagWithImm) ? IBV_WC_WITH_IMM : 0;
  if (h.flags & wire::kFlagWithInv) {
    if (!InvalidateRemote(qp, h.imm_or_inv)) {
      PushRecv(qp, wr_id, IBV_WC_REM_INV_REQ_ERR, IBV_WC_RECV, 0, 0, 0, false);
      Nak(qp, h.msn, IBV_WC_REM_INV_REQ_ERR);
      return Outcome::kFailed;
    }
    wc_flags |= IBV_WC_WITH_INV;
  }
  auto fill = [&](ibv_wc& wc) {
    FillRecvWc(qp, wc, wr_id, IBV_WC_SUCCESS, IBV_WC_RECV, byte_len, wc_flags,
               wc_flags != 0 ? h.imm_or_inv : 0);
  };
  // A poll running this progress takes the completion directly when it can (SoftCq::Push).
  if (!qp->rcq->Push(nullptr, 0, h.flags & wire::kFlagSolicited, IBV_WC_SUCCESS, fill,
                     qp->poll_sink)) {
    qp->cq_overflow = true;
  }
  qp->expected_msn = wire::NextMsn(qp->expected_msn);
  return Outcome::kDone;
}

Outcome HandleSend(SoftQp* qp, const wire::FrameHeader& h, const char* payload) {
  const bool first = h.flags & wire::kFlagFirst;
  const bool last = h.flags & wire::kFlagLast;
  if (first) {  // ProcessRequests saw to it that no other message is in progress
    uint64_t wr_id;
    if (last && h.length == h.total_length && PlaceWholeSend(qp, h, payload, &wr_id)) {
      qp->rnr_waiting = false;
      return FinishSend(qp, h, wr_id, h.length);
    }
    if (!TakeRecv(qp)) return ReceiverNotReady(qp, h);
    qp->rnr_waiting = false;
    qp->cur_recv.msn = h.msn;
    qp->cur_recv.total = h.total_length;
    if (h.total_length > qp->cur_recv.capacity) {
      // Responder length error: the receive completes with LOC_LEN_ERR, the requester with an
      // invalid-request NAK.
      qp->cur_recv.active = false;
      PushRecv(qp, qp->cur_recv.wr_id, IBV_WC_LOC_LEN_ERR, IBV_WC_RECV, 0, 0, 0, false);
      Nak(qp, h.msn, IBV_WC_REM_INV_REQ_ERR);
      return Outcome::kFailed;
    }
  } else if (!qp->cur_recv.active || h.msn != qp->cur_recv.msn) {
    ProtocolError(qp, "SEND continuation without a message");
    return Outcome::kFailed;
  }
  if (h.length > qp->cur_recv.total - qp->cur_recv.offset ||
      (last && qp->cur_recv.offset + h.length != qp->cur_recv.total)) {
    ProtocolError(qp, "SEND chunk lengths do not add up");
    return Outcome::kFailed;
  }
  if (h.length > 0 && !ScatterToSges(qp->hca->keys, qp->pd, qp->cur_recv.sge, qp->cur_recv.num_sge,
                                     qp->cur_recv.offset, payload, h.length)) {
    qp->cur_recv.active = false;
    PushRecv(qp, qp->cur_recv.wr_id, IBV_WC_LOC_PROT_ERR, IBV_WC_RECV, 0, 0, 0, false);
    Nak(qp, h.msn, IBV_WC_REM_OP_ERR);
    return Outcome::kFailed;
  }
  qp->cur_recv.offset += h.length;
  if (!last) return Outcome::kDone;
  qp->cur_recv.active = false;
  return FinishSend(qp, h, qp->cur_recv.wr_id, qp->cur_recv.total);
}

Outcome HandleWrite(SoftQp* qp, const wire::FrameHeader& h, const wire::RemoteExtension& ext,
                    const char* payload) {
  const bool first = h.flags & wire::kFlagFirst;
  const bool last = h.flags & wire::kFlagLast;
  // A start inside another message, or a continuation of another MSN, ProcessRequests refused.
  if (!first && !qp->write_in_progress) {
    ProtocolError(qp, "WRITE continuation without a start");
    return Outcome::kFailed;
  }
  if (first) {
    qp->write_total = h.total_length;
    qp->write_placed = 0;
  }
  if (h.length > qp->write_total - qp->write_placed ||
      (last && qp->write_placed + h.length != qp->write_total)) {
    ProtocolError(qp, "WRITE chunk lengths do not add up");
    return Outcome::kFailed;
  }
  if (!(qp->attr.qp_access_flags & IBV_ACCESS_REMOTE_WRITE)) {
    Nak(qp, h.msn, IBV_WC_REM_ACCESS_ERR);
    return Outcome::kFailed;
  }
  // WRITE with immediate consumes a receive; without one, nothing of the last chunk is placed.
  if (last && (h.flags & wire::kFlagWithImm) && !qp->cur_recv.active) {
    if (!TakeRecv(qp)) return ReceiverNotReady(qp, h);
    qp->rnr_waiting = false;
  }
  if (h.length > 0) {
    KeyEntry* e = PinRemote(qp, ext.rkey, ext.remote_addr, h.length, IBV_ACCESS_REMOTE_WRITE);
    if (e == nullptr) {
      // A receive taken for the immediate stays in cur_recv and is flushed with the QP.
      Nak(qp, h.msn, IBV_WC_REM_ACCESS_ERR);
      return Outcome::kFailed;
    }
    wire::PlaceRemoteData(reinterpret_cast<void*>(ext.remote_addr), payload, h.length);
    KeyTable::Unpin(e);
  }
  qp->write_placed += h.length;
  qp->write_in_progress = !last;
  if (!last) return Outcome::kDone;
  if (h.flags & wire::kFlagWithImm) {
    qp->cur_recv.active = false;
    PushRecv(qp, qp->cur_recv.wr_id, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, h.total_length,
             IBV_WC_WITH_IMM, h.imm_or_inv, h.flags & wire::kFlagSolicited);
  }
  qp->expected_msn = wire::NextMsn(qp->expected_msn);
  return Outcome::kDone;
}

// Streams READ data into the response ring. Returns false while data remains.
bool ContinueRead(SoftQp* qp) {
  auto& r = qp->cur_read;
  do {
    const uint32_t chunk = std::min<uint32_t>(r.length - r.offset, wire::kMaxChunk);
    const uint64_t bytes = wire::FrameBytes(wire::kOpReadResponse, chunk);
    uint64_t pos;
    char* frame = qp->resp_tx.Reserve(bytes, &pos, qp->expected_msn);
    // No room: the rest streams later, unless the peer lied about its reads (the QP failed).
    if (frame == nullptr) return ConsumerLied(qp, qp->resp_tx);
    if (chunk > 0) {
      // Checked again per chunk: a local invalidation may have revoked the key meanwhile.
      KeyEntry* e = PinRemote(qp, r.rkey, r.addr + r.offset, chunk, IBV_ACCESS_REMOTE_READ);
      if (e == nullptr) {
        r.active = false;
        Nak(qp, r.msn, IBV_WC_REM_ACCESS_ERR);
        return true;
      }
      wire::FetchLocalData(frame + sizeof(wire::FrameHeader),
                           reinterpret_cast<const void*>(r.addr + r.offset), chunk);
      KeyTable::Unpin(e);
    }
    auto* h = reinterpret_cast<wire::FrameHeader*>(frame);
    h->op = wire::kOpReadResponse;
    h->flags = 0;
    h->rnr_retry = 0;
    h->reserved = 0;
    h->length = chunk;
    h->msn = r.msn;
    h->ack = qp->expected_msn;
    h->imm_or_inv = 0;
    h->total_length = r.offset;
    qp->resp_tx.Commit(frame, pos, bytes);
    r.offset += chunk;
  } while (r.offset < r.length);
  r.active = false;
  return true;
}

Outcome HandleRead(SoftQp* qp, const wire::FrameHeader& h, const wire::RemoteExtension& ext) {
  if (!(qp->attr.qp_access_flags & IBV_ACCESS_REMOTE_READ)) {
    Nak(qp, h.msn, IBV_WC_REM_ACCESS_ERR);
    return Outcome::kFailed;
  }
  if (ext.length > kMaxMsgSize) {
    Nak(qp, h.msn, IBV_WC_REM_INV_REQ_ERR);
    return Outcome::kFailed;
  }
  if (ext.length > 0) {
    KeyEntry* e = PinRemote(qp, ext.rkey, ext.remote_addr, ext.length, IBV_ACCESS_REMOTE_READ);
    if (e == nullptr) {
      Nak(qp, h.msn, IBV_WC_REM_ACCESS_ERR);
      return Outcome::kFailed;
    }
    KeyTable::Unpin(e);
  }
  qp->cur_read.active = true;
  qp->cur_read.msn = h.msn;
  qp->cur_read.addr = ext.remote_addr;
  qp->cur_read.rkey = ext.rkey;
  qp->cur_read.length = ext.length;
  qp->cur_read.offset = 0;
  qp->expected_msn = wire::NextMsn(qp->expected_msn);
  ContinueRead(qp);
  return Outcome::kDone;  // the request is consumed; its data may still be streaming
}

Outcome HandleAtomic(SoftQp* qp, const wire::FrameHeader& h, const wire::RemoteExtension& ext) {
  if (!(qp->attr.qp_access_flags & IBV_ACCESS_REMOTE_ATOMIC)) {
    Nak(qp, h.msn, IBV_WC_REM_ACCESS_ERR);
    return Outcome::kFailed;
  }
  if (ext.remote_addr % 8 != 0) {
    Nak(qp, h.msn, IBV_WC_REM_INV_REQ_ERR);  // misaligned atomic: invalid request
    return Outcome::kFailed;
  }
  const uint64_t bytes = wire::FrameBytes(wire::kOpAtomicResponse, 8);
  uint64_t pos;
  char* frame = qp->resp_tx.Reserve(bytes, &pos, qp->expected_msn);
  if (frame == nullptr) {  // execute only once there is room to answer
    return ConsumerLied(qp, qp->resp_tx) ? Outcome::kFailed : Outcome::kStall;
  }
  KeyEntry* e = PinRemote(qp, ext.rkey, ext.remote_addr, 8, IBV_ACCESS_REMOTE_ATOMIC);
  if (e == nullptr) {
    Nak(qp, h.msn, IBV_WC_REM_ACCESS_ERR);
    return Outcome::kFailed;
  }
  auto* target = reinterpret_cast<uint64_t*>(ext.remote_addr);
  uint64_t original;
  if (h.op == wire::kOpCompareSwap) {
    original = ext.compare_add;
    __atomic_compare_exchange_n(target, &original, ext.swap, false, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
  } else {
    original = __atomic_fetch_add(target, ext.compare_add, __ATOMIC_SEQ_CST);
  }
  KeyTable::Unpin(e);
  auto* r = reinterpret_cast<wire::FrameHeader*>(frame);
  r->op = wire::kOpAtomicResponse;
  r->flags = 0;
  r->rnr_retry = 0;
  r->reserved = 0;
  r->length = 8;
  r->msn = h.msn;
  r->ack = wire::NextMsn(qp->expected_msn);
  r->imm_or_inv = 0;
  r->total_length = 0;
  std::memcpy(frame + sizeof(wire::FrameHeader), &original, 8);
  qp->resp_tx.Commit(frame, pos, bytes);
  qp->expected_msn = wire::NextMsn(qp->expected_msn);
  return Outcome::kDone;
}

}  // namespace

KeyEntry* PinRemote(SoftQp* qp, uint32_t rkey, uint64_t addr, uint64_t length, int access) {
  KeyEntry* e = qp->hca->keys.Pin(rkey);
  if (e == nullptr) return nullptr;
  bool ok = e->pd == qp->pd && (e->access & access) && length <= e->length && addr >= e->addr &&
            addr - e->addr <= e->length - length;
  if (e->kind != KeyKind::kMr) {
    if (e->kind == KeyKind::kMw2) ok = ok && e->qp_serial == qp->serial;
    // A window's lease (SetWindowDeadline) ends here, at the responder, whatever the owner
    // still has to do to revoke it. Only a window with one reads the clock.
    const int64_t deadline =
        std::atomic_ref<int64_t>(qp->hca->keys.Extra(e).deadline_ns).load(std::memory_order_relaxed);
    ok = ok && (deadline == 0 || NowNs() < deadline);
  }
  if (!ok) {
    KeyTable::Unpin(e);
    return nullptr;
  }
  return e;
}

bool FlushPendingNak(SoftQp* qp) {
  if (!qp->pending_nak.active) return true;
  const uint64_t bytes = wire::FrameBytes(wire::kOpNak, 0);
  uint64_t pos;
  char* frame = qp->resp_tx.Reserve(bytes, &pos, qp->expected_msn);
  // A peer that published an impossible consumer index for the ring will never make room for
  // the NAK: it is dropped, so that the error state it was to precede is published now.
  const bool dropped = frame == nullptr && qp->resp_tx.consumer_lied();
  if (frame == nullptr && !dropped) return false;
  if (!dropped) {
    auto* h = reinterpret_cast<wire::FrameHeader*>(frame);
    h->op = wire::kOpNak;
    h->flags = 0;
    h->rnr_retry = 0;
    h->reserved = 0;
    h->length = 0;
    h->msn = qp->pending_nak.msn;
    h->ack = qp->expected_msn;
    h->imm_or_inv = qp->pending_nak.status;
    h->total_length = 0;
    qp->resp_tx.Commit(frame, pos, bytes);
  }
  qp->pending_nak.active = false;
  if (qp->qstate == IBV_QPS_ERR && qp->own_ctrl != nullptr) {
    wire::SharedRelease();
    qp->own_ctrl->state.value.store(wire::kLinkError, std::memory_order_release);
  }
  if (dropped) ConsumerLied(qp, qp->resp_tx);  // an RNR NAK's QP is not in error yet
  return true;
}

bool ReceiveWholeSends(SoftQp* qp, bool* did) {
  if (qp->discard_requests || qp->cur_recv.active || qp->write_in_progress ||
      qp->cur_read.active || (qp->qstate != IBV_QPS_RTR && qp->qstate != IBV_QPS_RTS)) {
    return false;
  }
  constexpr uint8_t kWhole = wire::kFlagFirst | wire::kFlagLast;
  constexpr uint8_t kOptional = wire::kFlagWithImm | wire::kFlagWithInv | wire::kFlagSolicited;
  wire::FrameHeader h;
  while (qp->req_rx.Peek(&h)) {
    // The general path's checks for a frame that starts a message, in one pass; any frame
    // that is not a well-formed whole SEND with the expected MSN goes to the general path.
    const uint64_t bytes = wire::FrameBytes(wire::kOpSend, h.length);
    if (h.op != wire::kOpSend || (h.flags & ~kOptional) != kWhole || h.length > wire::kMaxChunk ||
        h.length != h.total_length || bytes > qp->req_rx.ContiguousBytes() ||
        h.msn != qp->expected_msn) {
      return false;
    }
    NoteAck(qp, h.ack);
    if (qp->qstate == IBV_QPS_ERR) {
      *did = true;
      return true;
    }
    uint64_t wr_id;
    const char* payload = qp->req_rx.frame() + sizeof(wire::FrameHeader);
    if (!PlaceWholeSend(qp, h, payload, &wr_id)) return false;  // RNR or an error to report
    qp->rnr_waiting = false;
    const Outcome outcome = FinishSend(qp, h, wr_id, h.length);
    qp->req_rx.Consume(bytes);
    *did = true;
    if (outcome == Outcome::kFailed) return true;
  }
  return true;
}

bool ProcessRequests(SoftQp* qp) {
  if (qp->qstate != IBV_QPS_RTR && qp->qstate != IBV_QPS_RTS) return false;
  bool did = false;
  if (qp->cur_read.active) {
    if (!ContinueRead(qp)) return false;
    did = true;
  }
  wire::FrameHeader h;
  while (qp->qstate != IBV_QPS_ERR && qp->req_rx.Peek(&h)) {
    const uint64_t avail = qp->req_rx.ContiguousBytes();
    if (!wire::IsRequestOp(h.op) || h.length > wire::kMaxChunk ||
        wire::FrameBytes(h.op, h.length) > avail || (h.flags & ~wire::kFlagsAll)) {
      ProtocolError(qp, "malformed request frame");
      return true;
    }
    if (h.op == wire::kOpPad) {
      qp->req_rx.Consume(avail);
      did = true;
      continue;
    }
    NoteAck(qp, h.ack);
    if (qp->qstate == IBV_QPS_ERR) return true;
    const uint64_t bytes = wire::FrameBytes(h.op, h.length);
    if (qp->discard_requests) {
      qp->req_rx.Consume(bytes);
      did = true;
      continue;
    }
    const char* body = qp->req_rx.frame() + sizeof(wire::FrameHeader);
    wire::RemoteExtension ext{};
    if (wire::HasRemoteExtension(h.op)) {
      std::memcpy(&ext, body, sizeof(ext));
      body += sizeof(ext);
    }
    // A new message must carry the next MSN. A mismatch is what a PSN error looks like on a
    // real link: the requester would retry until its retry count ran out.
    const bool starts_message =
        (h.op != wire::kOpSend && h.op != wire::kOpWrite) || (h.flags & wire::kFlagFirst);
    if (h.msn != qp->expected_msn) {
      if (starts_message) {
        Nak(qp, h.msn, IBV_WC_RETRY_EXC_ERR);
      } else {
        ProtocolError(qp, "continuation frame out of sequence");
      }
      return true;
    }
    // Nor may a message start before the one in progress has its last chunk: a requester never
    // interleaves messages, and the one starting would share its MSN and run on its state (a
    // WRITE_WITH_IMM inside a SEND completed the SEND's receive as its own; a SEND inside a
    // WRITE completed, and left the WRITE to fail later). SEND and WRITE check their continuations.
    if (starts_message && (qp->cur_recv.active || qp->write_in_progress)) {
      ProtocolError(qp, "message starts inside another");
      return true;
    }
    Outcome outcome;
    switch (h.op) {
      case wire::kOpSend:
        outcome = HandleSend(qp, h, body);
        break;
      case wire::kOpWrite:
        outcome = HandleWrite(qp, h, ext, body);
        break;
      case wire::kOpReadRequest:
        outcome = HandleRead(qp, h, ext);
        break;
      default:
        outcome = HandleAtomic(qp, h, ext);
        break;
    }
    if (outcome == Outcome::kStall) return did;
    qp->req_rx.Consume(bytes);
    did = true;
    if (outcome == Outcome::kFailed) return true;
    if (qp->cur_read.active) return true;  // response ring full: finish the READ first
  }
  return did;
}

}  // namespace swirl::soft
