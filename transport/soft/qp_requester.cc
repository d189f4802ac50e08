// The requester half of a soft RC QP: turning send work requests into frames, matching
// responses and acknowledgements, and completing the send queue in order.

#include <cstring>

#include "transport/soft/qp_ops.h"

namespace swirl::soft {
namespace {

ibv_wc_opcode WcOpcodeFor(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM: return IBV_WC_RDMA_WRITE;
    case IBV_WR_RDMA_READ: return IBV_WC_RDMA_READ;
    case IBV_WR_ATOMIC_CMP_AND_SWP: return IBV_WC_COMP_SWAP;
    case IBV_WR_ATOMIC_FETCH_AND_ADD: return IBV_WC_FETCH_ADD;
    case IBV_WR_BIND_MW: return IBV_WC_BIND_MW;
    case IBV_WR_LOCAL_INV: return IBV_WC_LOCAL_INV;
    default: return IBV_WC_SEND;
  }
}

bool IsReadOrAtomic(ibv_wr_opcode op) {
  return op == IBV_WR_RDMA_READ || op == IBV_WR_ATOMIC_CMP_AND_SWP ||
         op == IBV_WR_ATOMIC_FETCH_AND_ADD;
}

// Inline data still in the application's buffers (during post_send only): no lkey applies.
void GatherRaw(const ibv_sge* sge, uint32_t num_sge, uint64_t offset, char* dst, uint64_t length) {
  for (uint32_t i = 0; i < num_sge && length > 0; ++i) {
    if (offset >= sge[i].length) {
      offset -= sge[i].length;
      continue;
    }
    uint64_t n = std::min<uint64_t>(sge[i].length - offset, length);
    std::memcpy(dst, reinterpret_cast<const char*>(sge[i].addr) + offset, n);
    dst += n;
    length -= n;
    offset = 0;
  }
}

void AssignMsn(SoftQp* qp, SendWqe& w) {
  if (w.has_msn) return;
  w.msn = qp->next_msn;
  w.has_msn = true;
  qp->next_msn = wire::NextMsn(qp->next_msn);
}

// Writes the SEND or WRITE as chunk frames. Returns false when the ring is full (the rest goes
// later); the WQE is then partly sent.
bool TransmitData(SoftQp* qp, SendWqe& w, uint32_t index) {
  const bool is_write = w.opcode == IBV_WR_RDMA_WRITE || w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
  const uint8_t op = is_write ? wire::kOpWrite : wire::kOpSend;
  AssignMsn(qp, w);
  do {
    const uint32_t chunk = std::min<uint32_t>(w.length - w.sent, wire::kMaxChunk);
    const uint64_t bytes = wire::FrameBytes(op, chunk);
    uint64_t pos;
    char* frame = qp->req_tx.Reserve(bytes, &pos, qp->expected_msn);
    if (frame == nullptr) return false;
    auto* h = reinterpret_cast<wire::FrameHeader*>(frame);
    const bool first = w.sent == 0;
    const bool last = w.sent + chunk == w.length;
    uint8_t flags = (first ? wire::kFlagFirst : 0) | (last ? wire::kFlagLast : 0);
    if (last) {
      if (w.opcode == IBV_WR_SEND_WITH_IMM || w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
        flags |= wire::kFlagWithImm;
      }
      if (w.opcode == IBV_WR_SEND_WITH_INV) flags |= wire::kFlagWithInv;
      if (w.send_flags & IBV_SEND_SOLICITED) flags |= wire::kFlagSolicited;
    }
    h->op = op;
    h->flags = flags;
    h->rnr_retry = qp->attr.rnr_retry;
    h->reserved = 0;
    h->length = chunk;
    h->msn = w.msn;
    h->ack = qp->expected_msn;
    h->imm_or_inv = last ? w.imm_or_inv : 0;
    h->total_length = w.length;
    char* payload = frame + sizeof(wire::FrameHeader);
    if (is_write) {
      auto* ext = reinterpret_cast<wire::RemoteExtension*>(payload);
      ext->remote_addr = w.remote_addr + w.sent;
      ext->rkey = w.rkey;
      ext->length = w.length;
      ext->compare_add = 0;
      ext->swap = 0;
      payload += sizeof(wire::RemoteExtension);
    }
    if (chunk > 0) {
      if (w.inline_copy) {
        std::memcpy(payload, WqeInline(qp, index) + w.sent, chunk);
      } else if (w.send_flags & IBV_SEND_INLINE) {
        GatherRaw(WqeSges(qp, index), w.num_sge, w.sent, payload, chunk);
      } else if (!GatherFromSges(qp->hca->keys, qp->pd, WqeSges(qp, index), w.num_sge, w.sent,
                                 payload, chunk)) {
        FailWqe(qp, w, IBV_WC_LOC_PROT_ERR);
        return true;  // nothing committed for this chunk; the QP fails at completion
      }
    }
    qp->req_tx.Commit(frame, pos, bytes);
    w.sent += chunk;
  } while (w.sent < w.length);
  w.state = SendWqe::kAwaiting;
  return true;
}

bool TransmitReadOrAtomic(SoftQp* qp, SendWqe& w) {
  const uint8_t op = w.opcode == IBV_WR_RDMA_READ            ? wire::kOpReadRequest
                     : w.opcode == IBV_WR_ATOMIC_CMP_AND_SWP ? wire::kOpCompareSwap
                                                             : wire::kOpFetchAdd;
  const uint64_t bytes = wire::FrameBytes(op, 0);
  uint64_t pos;
  char* frame = qp->req_tx.Reserve(bytes, &pos, qp->expected_msn);
  if (frame == nullptr) return false;
  AssignMsn(qp, w);
  auto* h = reinterpret_cast<wire::FrameHeader*>(frame);
  h->op = op;
  h->flags = wire::kFlagFirst | wire::kFlagLast;
  h->rnr_retry = qp->attr.rnr_retry;
  h->reserved = 0;
  h->length = 0;
  h->msn = w.msn;
  h->ack = qp->expected_msn;
  h->imm_or_inv = 0;
  h->total_length = w.length;
  auto* ext = reinterpret_cast<wire::RemoteExtension*>(frame + sizeof(wire::FrameHeader));
  ext->remote_addr = w.remote_addr;
  ext->rkey = w.rkey;
  ext->length = w.length;
  ext->compare_add = w.compare_add;
  ext->swap = w.swap;
  qp->req_tx.Commit(frame, pos, bytes);
  w.state = SendWqe::kAwaiting;
  ++qp->rd_atomic_outstanding;
  return true;
}

// What a response names: the transmitted request with its MSN, whatever its state (nullptr:
// none), and what lies before that request in the send queue.
struct Named {
  SendWqe* w = nullptr;
  // A request before it already failed: this QP is on its way to the error state, and what
  // arrives for the requests behind that one is dropped, as a NIC drops what arrives for a QP in
  // error. They flush; nothing completes successfully after a failure. (A correct responder
  // still sends it: it cannot know that a READ's data could not be placed here.)
  bool behind_failure = false;
  // A READ or atomic before it still waits for its own response. Responders execute requests in
  // order and stream all of a READ's data before they take the next request, so the responses
  // come in request order; one that skips a READ or atomic is one no responder sends.
  bool skips_response = false;
};

Named FindTransmitted(SoftQp* qp, uint32_t msn) {
  Named named;
  for (uint32_t i = qp->sq_head; i != qp->sq_tx; ++i) {
    SendWqe& w = qp->sq[i & qp->sq_mask];
    if (w.has_msn && w.msn == msn) {
      named.w = &w;
      return named;
    }
    if (w.state == SendWqe::kDone && w.status != IBV_WC_SUCCESS) named.behind_failure = true;
    if (w.state == SendWqe::kAwaiting && IsReadOrAtomic(w.opcode)) named.skips_response = true;
  }
  return named;
}

bool IsNakStatus(uint32_t status) {
  return status == IBV_WC_REM_ACCESS_ERR || status == IBV_WC_REM_INV_REQ_ERR ||
         status == IBV_WC_REM_OP_ERR || status == IBV_WC_RNR_RETRY_EXC_ERR ||
         status == IBV_WC_RETRY_EXC_ERR;
}

}  // namespace

// ---- Local operations: BIND_MW and LOCAL_INV, executed in send-queue order ---------------------

void ExecuteLocalOp(SoftQp* qp, SendWqe& w) {
  KeyTable& keys = qp->hca->keys;
  swirl::MutexLock lock(&qp->hca->mw_mu);
  if (w.opcode == IBV_WR_LOCAL_INV) {
    KeyEntry* e = keys.EntryFor(w.imm_or_inv);
    // Only type 2 windows are invalidated by a work request; MRs and type 1 windows are not.
    if (KeyTable::PublishedKey(e) != w.imm_or_inv || w.imm_or_inv == 0 ||
        e->kind != KeyKind::kMw2 || e->pd != qp->pd) {
      FailWqe(qp, w, IBV_WC_LOC_QP_OP_ERR);
      return;
    }
    KeyTable::Unbind(e);
    ReleaseIfRetired(keys, e);
    FailWqe(qp, w, IBV_WC_SUCCESS);
    return;
  }

  // BIND_MW (type 2 through post_send, type 1 through ibv_bind_mw).
  KeyEntry* e = w.bind_mw_entry;
  const bool type2 = w.bind_mw_type2;
  const unsigned int access = w.bind_access;
  auto bind_error = [&w, qp] { FailWqe(qp, w, IBV_WC_MW_BIND_ERR); };
  // The window (or region) may have been freed since the post, and its slot reused: slot
  // metadata changes only under mw_mu, which we hold.
  if (e->kind != (type2 ? KeyKind::kMw2 : KeyKind::kMw1) || e->index != w.bind_mw_index) {
    return bind_error();
  }
  if (w.bind_mw_pd != qp->pd) return bind_error();
  if (type2 && KeyTable::PublishedKey(e) != 0) return bind_error();  // only from the free state
  // A bind into a fresh slot: the window must be free in the slot it leaves too (once that
  // slot is released or reused, it holds none of the window's bindings).
  KeyEntry* from = w.bind_from;
  const bool from_ours = from != nullptr &&
                         keys.Extra(from).generation == w.bind_from_generation &&
                         from->kind == KeyKind::kMw2;
  if (from_ours && KeyTable::PublishedKey(from) != 0) return bind_error();
  // Local bits mean nothing for a window and are ignored, as rxe and mlx5 do (applications
  // pass their MR's flags); zero-based and other modes are not supported.
  constexpr unsigned int kIgnored = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND;
  if (access & ~static_cast<unsigned int>(IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE |
                                          IBV_ACCESS_REMOTE_ATOMIC | kIgnored)) {
    return bind_error();
  }
  KeyEntry* mre = w.bind_mr_entry;
  const bool unbind = mre == nullptr || w.bind_length == 0;
  if (type2 && unbind) return bind_error();
  if (!unbind) {
    // The region's PD as it is now, not as it was at the post: ibv_rereg_mr may have moved it
    // to another PD while the bind waited.
    if (KeyTable::PublishedKey(mre) != w.bind_mr_lkey || mre->pd != qp->pd) {
      return bind_error();
    }
    if (!(mre->access & IBV_ACCESS_MW_BIND)) return bind_error();
    if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
        !(mre->access & IBV_ACCESS_LOCAL_WRITE)) {
      return bind_error();
    }
    if (w.bind_addr < mre->addr || w.bind_length > mre->length ||
        w.bind_addr - mre->addr > mre->length - w.bind_length) {
      return bind_error();
    }
  }
  // Retire the old binding (type 1 rebinds), then publish the new one.
  KeyTable::Unbind(e);
  e->access = static_cast<int>(access & ~kIgnored);
  e->addr = unbind ? 0 : w.bind_addr;
  e->length = unbind ? 0 : w.bind_length;
  e->qp_serial = type2 ? qp->serial : 0;
  if (!unbind) {
    e->mr = mre;
    std::atomic_ref<uint32_t>(e->mr->bound_windows).fetch_add(1, std::memory_order_acq_rel);
  }
  KeyTable::Publish(e, (e->index << 8) | (w.bind_rkey & 0xff));
  if (from_ours) keys.Release(from);  // the window lives in `e` now
  FailWqe(qp, w, IBV_WC_SUCCESS);
}

// ---- Transmit -------------------------------------------------------------------------------------

bool Transmit(SoftQp* qp) {
  if (qp->qstate != IBV_QPS_RTS) return false;
  bool wrote = false;
  while (qp->sq_tx != qp->sq_tail && !qp->sq_stopped) {
    const uint32_t index = qp->sq_tx;
    SendWqe& w = qp->sq[index & qp->sq_mask];
    if (w.state == SendWqe::kDone) {  // failed as it was posted
      ++qp->sq_tx;
      if (w.status != IBV_WC_SUCCESS) qp->sq_stopped = true;
      continue;
    }
    // A fenced request waits for every earlier RDMA READ and atomic to complete.
    if ((w.send_flags & IBV_SEND_FENCE) && qp->rd_atomic_outstanding > 0) break;
    if (w.opcode == IBV_WR_BIND_MW || w.opcode == IBV_WR_LOCAL_INV) {
      ExecuteLocalOp(qp, w);
      ++qp->sq_tx;
      continue;
    }
    // A request that does not fit waits for the responder to read further, unless the
    // responder's published consumer index is one it cannot have (ConsumerLied).
    if (IsReadOrAtomic(w.opcode)) {
      if (qp->rd_atomic_outstanding >= std::max<uint32_t>(qp->attr.max_rd_atomic, 1)) break;
      if (!TransmitReadOrAtomic(qp, w)) {
        ConsumerLied(qp, qp->req_tx);
        break;
      }
    } else {
      if (!TransmitData(qp, w, index)) {
        wrote = true;  // some chunks may have gone
        ConsumerLied(qp, qp->req_tx);
        break;
      }
    }
    wrote = true;
    ++qp->sq_tx;
  }
  return wrote;
}

// ---- Responses and acknowledgements ---------------------------------------------------------------

bool ProcessResponses(SoftQp* qp) {
  bool did = false;
  wire::FrameHeader h;
  while (qp->resp_rx.Peek(&h)) {
    const uint64_t avail = qp->resp_rx.ContiguousBytes();
    if (!wire::IsResponseOp(h.op) || h.length > wire::kMaxChunk ||
        wire::FrameBytes(h.op, h.length) > avail || (h.flags & ~wire::kFlagsAll)) {
      ProtocolError(qp, "malformed response frame");
      return true;
    }
    did = true;
    if (h.op == wire::kOpPad) {
      qp->resp_rx.Consume(avail);
      continue;
    }
    NoteAck(qp, h.ack);
    if (qp->qstate == IBV_QPS_ERR) return true;
    const char* payload = qp->resp_rx.frame() + sizeof(wire::FrameHeader);
    const Named named = FindTransmitted(qp, h.msn);
    SendWqe* w = named.w;
    if (w != nullptr &&
        (named.behind_failure ||
         (w->state == SendWqe::kDone && w->status != IBV_WC_SUCCESS &&
          w->opcode == IBV_WR_RDMA_READ && h.op == wire::kOpReadResponse))) {
      // For a request behind one that failed, or the rest of a READ that already failed here (a
      // chunk could not be placed): dropped, as a NIC drops the responses of a request it
      // completed in error and everything that arrives for a QP in error.
      qp->resp_rx.Consume(wire::FrameBytes(h.op, h.length));
      continue;
    }
    if (w == nullptr || w->state != SendWqe::kAwaiting) {
      ProtocolError(qp, "response for no outstanding request");
      return true;
    }
    if (named.skips_response) {
      ProtocolError(qp, "response out of order");
      return true;
    }
    if (h.op == wire::kOpReadResponse) {
      if (w->opcode != IBV_WR_RDMA_READ || h.total_length != w->received ||
          h.length > w->length - w->received || (h.length == 0 && w->length != 0)) {
        ProtocolError(qp, "READ response out of sequence");
        return true;
      }
      const uint32_t index = static_cast<uint32_t>(w - qp->sq.data());
      if (h.length > 0 && !ScatterToSges(qp->hca->keys, qp->pd, WqeSges(qp, index), w->num_sge,
                                         w->received, payload, h.length)) {
        FailWqe(qp, *w, IBV_WC_LOC_PROT_ERR);
        --qp->rd_atomic_outstanding;
      } else {
        w->received += h.length;
        if (w->received == w->length) {
          FailWqe(qp, *w, IBV_WC_SUCCESS);
          --qp->rd_atomic_outstanding;
        }
      }
    } else if (h.op == wire::kOpAtomicResponse) {
      if ((w->opcode != IBV_WR_ATOMIC_CMP_AND_SWP && w->opcode != IBV_WR_ATOMIC_FETCH_AND_ADD) ||
          h.length != 8) {
        ProtocolError(qp, "atomic response for a non-atomic request");
        return true;
      }
      const uint32_t index = static_cast<uint32_t>(w - qp->sq.data());
      bool ok = ScatterToSges(qp->hca->keys, qp->pd, WqeSges(qp, index), w->num_sge, 0, payload, 8);
      FailWqe(qp, *w, ok ? IBV_WC_SUCCESS : IBV_WC_LOC_PROT_ERR);
      --qp->rd_atomic_outstanding;
    } else {  // NAK
      if (!IsNakStatus(h.imm_or_inv)) {
        ProtocolError(qp, "NAK with an invalid status");
        return true;
      }
      if (IsReadOrAtomic(w->opcode)) --qp->rd_atomic_outstanding;
      FailWqe(qp, *w, static_cast<ibv_wc_status>(h.imm_or_inv));
    }
    qp->resp_rx.Consume(wire::FrameBytes(h.op, h.length));
  }
  return did;
}

// ---- In-order completion ----------------------------------------------------------------------

void CompleteSq(SoftQp* qp) {
  RetireAckedUnsignaled(qp);
  bool read_ack_word = false;
  while (qp->sq_head != qp->sq_tx) {
    const uint32_t index = qp->sq_head;
    SendWqe& w = qp->sq[index & qp->sq_mask];
    if (w.state == SendWqe::kAwaiting && IsSendOrWrite(w.opcode)) {
      if (!wire::MsnBefore(w.msn, qp->peer_acked)) {
        // Piggybacked acks did not cover it; look at the responder's published ack, once, and
        // only if a completion is wanted now.
        if (read_ack_word || !qp->linked || !CompletionWanted(qp)) break;
        read_ack_word = true;
        NoteAck(qp, static_cast<uint32_t>(
                        qp->peer.control()->acked.value.load(std::memory_order_acquire)));
        wire::SharedAcquire();
        if (w.state == SendWqe::kAwaiting && !wire::MsnBefore(w.msn, qp->peer_acked)) break;
      }
      if (w.state == SendWqe::kAwaiting) FailWqe(qp, w, IBV_WC_SUCCESS);
    }
    if (w.state != SendWqe::kDone) break;
    const bool failed = w.status != IBV_WC_SUCCESS;
    if (failed || qp->sig_all || (w.send_flags & IBV_SEND_SIGNALED)) {
      ibv_wc wc;
      std::memset(&wc, 0, sizeof(wc));
      wc.wr_id = w.wr_id;
      wc.status = w.status;
      wc.opcode = WcOpcodeFor(w.opcode);
      wc.byte_len = w.length;
      wc.qp_num = qp->qp_num;
      if (!qp->scq->Push(wc, qp, index + 1, false)) qp->cq_overflow = true;
    }
    ++qp->sq_head;
    if (failed && qp->qstate != IBV_QPS_ERR) EnterError(qp);
  }
}

}  // namespace swirl::soft
