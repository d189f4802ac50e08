// Test helpers for playing a hostile peer against the soft device: a QP pair A <-> B in this
// process, with guard bytes around each side's registered region, and crafted frames written
// straight into one side's own segment (its request or response ring) the way qp_requester.cc
// and qp_responder.cc write real ones, so that the other side reads them as the peer's.
//
// hostile_frame_test crafts A's requests and checks B, the responder; hostile_response_test
// crafts B's responses and published counters and checks A, the requester.

#ifndef SWIRL_TRANSPORT_SOFT_HOSTILE_PEER_H_
#define SWIRL_TRANSPORT_SOFT_HOSTILE_PEER_H_

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "transport/soft/qp_ops.h"
#include "transport/soft/soft_internal.h"
#include "transport/soft/wire.h"
#include "transport/verbs/verbs.h"

namespace swirl::soft::hostile {

// Each side's buffer: a guard, the registered region, a guard.
inline constexpr size_t kGuard = 4096;
inline constexpr size_t kRegion = 128 * 1024;
inline constexpr char kGuardByte = '\xee';
inline constexpr char kFillByte = '\x5a';     // the regions' initial contents
inline constexpr char kPayloadByte = '\xab';  // what crafted frames carry
// B's two receives (MakePair): a large one (so that a SEND is never refused for its length)
// and a small one.
inline constexpr uint64_t kRecv1Offset = 0, kRecv1Length = 64 * 1024;
inline constexpr uint64_t kRecv2Offset = 64 * 1024, kRecv2Length = 4096;
inline constexpr uint64_t kRecvWrId1 = 0x101, kRecvWrId2 = 0x102;

inline constexpr uint8_t kFirstLast = wire::kFlagFirst | wire::kFlagLast;

// A registered region between two guards.
struct GuardedRegion {
  std::vector<char> mem = std::vector<char>(kGuard + kRegion + kGuard, kGuardByte);
  std::unique_ptr<verbs::MemoryRegion> mr;

  char* region() { return mem.data() + kGuard; }
  uint64_t addr(int64_t offset) { return reinterpret_cast<uint64_t>(region()) + offset; }
  // The offset of the first guard byte that changed, or -1.
  int64_t FirstGuardWritten() const;
};

// Two soft devices in this process, one RC QP on each, connected (as smoke_test.cc does).
struct Pair {
  std::shared_ptr<verbs::Context> a_ctx, b_ctx;
  std::shared_ptr<verbs::ProtectionDomain> a_pd, b_pd;
  std::shared_ptr<verbs::CompletionQueue> a_cq, b_send_cq, b_recv_cq;
  std::unique_ptr<verbs::QueuePair> a_qp, b_qp;
  GuardedRegion a_mem, b_mem;

  // What polling collected.
  std::vector<ibv_wc> a_wcs, b_send_wcs, b_recv_wcs;

  SoftQp* a() const { return AsSoft(a_qp->get()); }
  SoftQp* b() const { return AsSoft(b_qp->get()); }
  // B's region, which hostile_frame_test's crafted requests aim at.
  char* region() { return b_mem.region(); }
  uint64_t addr(int64_t offset) { return b_mem.addr(offset); }
  uint32_t rkey() const { return b_mem.mr->rkey(); }
  // A's region, where the requests that hostile_response_test answers take and put their data.
  char* a_region() { return a_mem.region(); }
  uint64_t a_addr(int64_t offset) { return a_mem.addr(offset); }
  uint32_t a_lkey() const { return a_mem.mr->lkey(); }
  uint32_t a_rkey() const { return a_mem.mr->rkey(); }
};

bool Linked(SoftQp* qp);

// A fresh pair; both regions filled with kFillByte and registered with every access; B's two
// receives posted unless `post_recvs` is false; connected with `options`. Null on failure.
std::unique_ptr<Pair> MakePair(bool post_recvs = true, const verbs::ConnectOptions& options = {});

// ---- Writing crafted frames ---------------------------------------------------------------

struct Frame {
  uint8_t op = wire::kOpSend;
  uint8_t flags = kFirstLast;
  uint32_t length = 0;  // the header's claim
  uint32_t total_length = 0;
  uint32_t msn = 0;
  uint32_t imm_or_inv = 0;
  std::optional<uint32_t> ack;  // default: the writer's expected_msn, as the QP code writes it
  bool extension = false;       // write `ext` even for an op that has none
  wire::RemoteExtension ext{};
  char fill = kPayloadByte;  // payload byte
  uint64_t reserve = 0;      // ring bytes to take; default FrameBytes(op, length)
};

enum class Ring { kRequest, kResponse };

// Writes `f` into `qp`'s own request or response ring as the QP code does: under its lock,
// Reserve (which pads a too-short ring tail), everything but the stamp, Commit (which stamps
// it), then the doorbell. Returns the frame's ring position.
uint64_t Inject(SoftQp* qp, const Frame& f, Ring ring = Ring::kRequest);
// The same, or nothing if the ring has no room for the frame (the peer has not consumed enough).
std::optional<uint64_t> TryInject(SoftQp* qp, const Frame& f, Ring ring = Ring::kRequest);

// A's next MSN for a crafted message, taken as the requester takes one (A must never see an ack
// for an MSN it did not hand out: that is itself a protocol error).
uint32_t TakeMsn(SoftQp* a);

// Records in A's send queue the request that crafted frames with `msn` stand for, as
// TryFastSend records a SEND it wrote: signaled, transmitted, awaiting B's ack, NAK or failure.
// False if A's send queue is full.
bool RecordOutstanding(SoftQp* a, uint64_t wr_id, uint32_t msn, ibv_wr_opcode opcode,
                       uint32_t length);

// ---- Driving the pair ---------------------------------------------------------------------

ibv_qp_state State(verbs::QueuePair& qp);  // the device's query_qp

// Polls every CQ of the pair (both sides make progress) into its *_wcs.
void PollAll(Pair& p);
// Polls A's CQ only (hostile_response_test: B never runs) into a_wcs.
void PollA(Pair& p);

// Posts one signaled request on A: its local data is `length` bytes at `offset` in A's region
// (READ and atomic destination, SEND and WRITE source; `lkey` 0: A's region's), and READs,
// WRITEs and atomics aim at the same offset in B's region. False if ibv_post_send refused it.
bool PostRequest(Pair& p, uint64_t wr_id, ibv_wr_opcode opcode, uint64_t offset,
                 uint32_t length, uint32_t lkey = 0);
// The MSN A gave request `wr_id` when it transmitted it (a gtest failure and 0 if it has none).
uint32_t MsnOf(Pair& p, uint64_t wr_id);
// Stores `value` into one of B's published words (B's control block, which A maps), as the QP
// code publishes them.
void Publish(Pair& p, wire::Published wire::SegmentControl::*word, uint64_t value);

size_t FirstMismatch(const char* p, size_t n, char want);

// A valid SEND from the bystander's A to its B, received: the devices still work.
bool BystanderRoundTrip(Pair& by, uint64_t i);

// Binds a type 2 window over [offset, offset + length) of B's region through B's QP; its
// completion is collected and removed from b_send_wcs. True on success (else a gtest failure
// says what went wrong).
bool BindWindow(Pair& p, uint64_t offset, uint64_t length, unsigned int access,
                std::unique_ptr<verbs::MemoryWindow>* mw, uint32_t* rkey);

}  // namespace swirl::soft::hostile

#endif  // SWIRL_TRANSPORT_SOFT_HOSTILE_PEER_H_
