// Internal helpers shared by the QP engine's files (qp.cc, qp_requester.cc, qp_responder.cc).

#ifndef SWIRL_TRANSPORT_SOFT_QP_OPS_H_
#define SWIRL_TRANSPORT_SOFT_QP_OPS_H_

#include <cstring>

#include "base/copy.h"  // CopyBytes
#include "transport/soft/soft_internal.h"

namespace swirl::soft {

inline SoftQp* AsSoft(ibv_qp* qp) { return static_cast<SoftQp*>(qp); }

// Requests the responder acknowledges without a response frame.
inline bool IsSendOrWrite(ibv_wr_opcode op) {
  return op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM || op == IBV_WR_SEND_WITH_INV ||
         op == IBV_WR_RDMA_WRITE || op == IBV_WR_RDMA_WRITE_WITH_IMM;
}

// A full memory barrier (store-load ordering). On x86 a locked no-op on the stack does it
// faster than mfence, as the Linux kernel's smp_mb() does.
inline void FullFence() {
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
  asm volatile("lock orl $0, -8(%%rsp)" ::: "memory", "cc");
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

// Copies `count` bytes between a flat buffer and local memory at `addr` under `lkey`, after the
// checks every local access gets: an MR (not a window) of the same PD, LOCAL_WRITE when writing
// into it, the range inside it. The key stays pinned for the copy.
// PinLocal does the checks and returns the pinned entry (KeyTable::Unpin after the access), or
// nullptr.
inline KeyEntry* PinLocal(KeyTable& keys, const ibv_pd* pd, uint32_t lkey, uint64_t addr,
                          uint64_t count, bool into_memory) {
  KeyEntry* e = keys.Pin(lkey);
  if (e == nullptr) return nullptr;
  const bool ok = e->kind == KeyKind::kMr && e->pd == pd &&
                  (!into_memory || (e->access & IBV_ACCESS_LOCAL_WRITE)) && count <= e->length &&
                  addr >= e->addr && addr - e->addr <= e->length - count;
  if (ok) return e;
  KeyTable::Unpin(e);
  return nullptr;
}
inline bool CopyLocal(KeyTable& keys, const ibv_pd* pd, uint32_t lkey, uint64_t addr,
                      char* buffer, uint64_t count, bool into_memory) {
  KeyEntry* e = PinLocal(keys, pd, lkey, addr, count, into_memory);
  if (e == nullptr) return false;
  if (into_memory) {
    CopyBytes(reinterpret_cast<void*>(addr), buffer, count);
  } else {
    CopyBytes(buffer, reinterpret_cast<const void*>(addr), count);
  }
  KeyTable::Unpin(e);
  return true;
}

// Copies between a flat buffer and the memory an SGE list names, starting `offset` bytes into
// the list, validating each lkey as CopyLocal does. Returns false on a protection failure
// (nothing is copied past the failing SGE) or if the list is shorter than offset + length.
bool CopySges(KeyTable& keys, const ibv_pd* pd, const ibv_sge* sge, uint32_t num_sge,
              uint64_t offset, char* buffer, uint64_t length, bool into_sges);

// The common case, one SGE holding the whole range, stays inline.
inline bool ScatterToSges(KeyTable& keys, const ibv_pd* pd, const ibv_sge* sge, uint32_t num_sge,
                          uint64_t offset, const char* src, uint64_t length) {
  if (num_sge == 1 && length > 0 && offset + length <= sge[0].length) {
    return CopyLocal(keys, pd, sge[0].lkey, sge[0].addr + offset, const_cast<char*>(src), length,
                     true);
  }
  return CopySges(keys, pd, sge, num_sge, offset, const_cast<char*>(src), length, true);
}
inline bool GatherFromSges(KeyTable& keys, const ibv_pd* pd, const ibv_sge* sge,
                           uint32_t num_sge, uint64_t offset, char* dst, uint64_t length) {
  if (num_sge == 1 && length > 0 && offset + length <= sge[0].length) {
    return CopyLocal(keys, pd, sge[0].lkey, sge[0].addr + offset, dst, length, false);
  }
  return CopySges(keys, pd, sge, num_sge, offset, dst, length, false);
}

// Checks that `key` grants `access` over [addr, addr+length) to requests arriving on `qp`.
// Returns the pinned entry or nullptr. Zero-length accesses are not checked (IB spec).
KeyEntry* PinRemote(SoftQp* qp, uint32_t rkey, uint64_t addr, uint64_t length, int access);

// Requester side (qp_requester.cc).
bool Transmit(SoftQp* qp);
bool ProcessResponses(SoftQp* qp);
// Ends a WQE being transmitted or awaiting its response with `status`. A failure's completion
// is owed even for an unsignaled request, so it makes a completion wanted (CompletionWanted)
// until the QP enters the error state, and it stops the send queue behind it (sq_stopped).
inline void FailWqe(SoftQp* qp, SendWqe& w, ibv_wc_status status) {
  w.status = status;
  w.state = SendWqe::kDone;
  if (status != IBV_WC_SUCCESS) {
    qp->failure_pending = true;
    qp->sq_stopped = true;
  }
}
// A request that fails as it is posted (its length), possibly behind requests still queued:
// those go first; Transmit stops the queue when it reaches this one.
inline void FailAtPost(SoftQp* qp, SendWqe& w, ibv_wc_status status) {
  w.status = status;
  w.state = SendWqe::kDone;
  qp->failure_pending = true;
}
// CompleteSq's common case, inline for the poll path: retires the unsignaled SENDs and WRITEs
// at the head of the send queue that a piggybacked ack covers (they owe no completion).
inline void RetireAckedUnsignaled(SoftQp* qp) {
  while (qp->sq_head != qp->sq_tx && !qp->sig_all) {
    SendWqe& w = qp->sq[qp->sq_head & qp->sq_mask];
    if (w.state != SendWqe::kAwaiting || (w.send_flags & IBV_SEND_SIGNALED) ||
        !wire::MsnBefore(w.msn, qp->peer_acked) || !IsSendOrWrite(w.opcode)) {
      return;
    }
    FailWqe(qp, w, IBV_WC_SUCCESS);
    ++qp->sq_head;
  }
}
// Completes the send queue in order: RetireAckedUnsignaled, then everything else (signaled and
// failed requests, READs and atomics, the peer's ack word when a completion is wanted).
void CompleteSq(SoftQp* qp);
void ExecuteLocalOp(SoftQp* qp, SendWqe& w);

// Responder side (qp_responder.cc).
bool ProcessRequests(SoftQp* qp);
// The common case of ProcessRequests, kept short: whole SENDs (one frame each) into one-SGE
// receives, with the same checks and outcomes. Returns true if it drained the request ring
// (or failed the QP); false when the general path must look at the next frame. Sets *did if
// it consumed anything.
bool ReceiveWholeSends(SoftQp* qp, bool* did);
bool FlushPendingNak(SoftQp* qp);

// State (qp.cc).
void EnterError(SoftQp* qp);
// The peer broke the wire protocol (a bad frame): fail the QP as a requester would.
void ProtocolError(SoftQp* qp, const char* what);
// A Reserve on `ring`, one of the QP's, failed. True if that is because the peer published an
// impossible consumer index for it (RingWriter::consumer_lied): the QP then fails as for a bad
// frame. False if the peer simply has not read far enough yet: the caller waits for room.
bool ConsumerLied(SoftQp* qp, const RingWriter& ring);
// A piggybacked or published ack from the peer: the next MSN it expects.
inline void NoteAck(SoftQp* qp, uint32_t ack) {
  if (ack == qp->peer_acked) return;
  // Before RTS our send side does not exist: the peer acknowledges relative to the sq_psn we
  // have not been given yet (a receive-only QP may stay in RTR for good). Nothing to complete,
  // and nothing to check it against; RTS starts from sq_psn.
  if (qp->qstate == IBV_QPS_RTR) return;
  // Acks ride on both of the peer's rings and in its control block; those are not ordered with
  // each other, so an older one can arrive after a newer one: keep the newest. But a peer may
  // never acknowledge what was not sent.
  if (ack > wire::kMsnMask || wire::MsnBefore(qp->next_msn, ack)) {
    ProtocolError(qp, "acknowledgement of requests never sent");
    return;
  }
  if (wire::MsnBefore(qp->peer_acked, ack)) qp->peer_acked = ack;
}
void PublishAndWake(SoftQp* qp, bool wrote);
const ibv_sge* WqeSges(const SoftQp* qp, uint32_t index);
char* WqeInline(SoftQp* qp, uint32_t index);

}  // namespace swirl::soft

#endif  // SWIRL_TRANSPORT_SOFT_QP_OPS_H_
