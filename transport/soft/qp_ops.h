// Internal helpers shared by the QP engine's files (qp.cc, qp_requester.cc, qp_responder.cc).

#ifndef SWIRL_TRANSPORT_SOFT_QP_OPS_H_
#define SWIRL_TRANSPORT_SOFT_QP_OPS_H_

#include "transport/soft/soft_internal.h"

namespace swirl::soft {

inline SoftQp* AsSoft(ibv_qp* qp) { return static_cast<SoftQp*>(qp); }

// A full memory barrier (store-load ordering). On x86 a locked no-op on the stack does it
// faster than mfence, as the Linux kernel's smp_mb() does.
inline void FullFence() {
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
  asm volatile("lock orl $0, -8(%%rsp)" ::: "memory", "cc");
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

// Copies between a flat buffer and the memory an SGE list names, starting `offset` bytes into
// the list, validating each lkey (MR of the same PD, range inside it, LOCAL_WRITE when `write`).
// Returns false on a protection failure (nothing is copied past the failing SGE).
bool ScatterToSges(KeyTable& keys, const ibv_pd* pd, const ibv_sge* sge, uint32_t num_sge,
                   uint64_t offset, const char* src, uint64_t length);
bool GatherFromSges(KeyTable& keys, const ibv_pd* pd, const ibv_sge* sge, uint32_t num_sge,
                    uint64_t offset, char* dst, uint64_t length);

// Checks that `key` grants `access` over [addr, addr+length) to requests arriving on `qp`.
// Returns the pinned entry or nullptr. Zero-length accesses are not checked (IB spec).
KeyEntry* PinRemote(SoftQp* qp, uint32_t rkey, uint64_t addr, uint64_t length, int access);

// Requester side (qp_requester.cc).
bool Transmit(SoftQp* qp);
bool ProcessResponses(SoftQp* qp);
void NoteAck(SoftQp* qp, uint32_t ack);
void CompleteSq(SoftQp* qp);
void ExecuteLocalOp(SoftQp* qp, SendWqe& w);

// Responder side (qp_responder.cc).
bool ProcessRequests(SoftQp* qp);
bool FlushPendingNak(SoftQp* qp);

// State (qp.cc).
void EnterError(SoftQp* qp);
// The peer broke the wire protocol (a bad frame): fail the QP as a requester would.
void ProtocolError(SoftQp* qp, const char* what);
void PublishAndWake(SoftQp* qp, bool wrote);
const ibv_sge* WqeSges(const SoftQp* qp, uint32_t index);
char* WqeInline(SoftQp* qp, uint32_t index);

}  // namespace swirl::soft

#endif  // SWIRL_TRANSPORT_SOFT_QP_OPS_H_
