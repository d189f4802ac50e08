// Fuzzes the soft device's responder (transport/soft/qp_responder.cc): request frames from the
// input written into a real QP pair's request ring, as a hostile peer process would write them
// into the segment it shares (the same technique as hostile_frame_test, through hostile_peer.h).
//
// Each input gets a fresh pair A <-> B on two soft devices of this process (B with two posted
// receives and a type 2 window bound over 16 KiB of its region, with remote read and write).
// The input is a sequence of 48-byte frame records (FrameRecord below): each names a frame's
// header and remote extension, and with its `fix` bits lets the harness put in values a peer
// could know but a fuzzer would not guess (the message's MSN, B's real rkey or the window's, an
// address inside B's region), so that inputs reach past the first checks. A's side of each frame
// is as a requester's: a frame that starts a message takes the next MSN (TakeMsn; a SEND or
// WRITE chunk without FIRST carries the one before), and a record may have A await an answer
// for it (RecordOutstanding). B is driven by polling until it has failed, taken every
// frame, or waits for a receive, for at most a second.
//
// Properties, for every input:
// - B writes nothing outside its registered region (guard bytes on both sides), nor does A;
// - both QPs end in RTS or ERR;
// - B's receives complete at most once each, with their own wr_ids; B's send queue, which
//   holds nothing, completes nothing; A completes exactly the requests it awaits, each once, in
//   order, and nothing else;
// - another pair on the same two devices still carries a message (the failure stays with the
//   connection that caused it).

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "fuzz/fuzz_support.h"
#include "transport/soft/hostile_peer.h"
#include "transport/soft/soft_internal.h"
#include "transport/soft/wire.h"

namespace {

using swirl::fuzz::Input;
namespace hostile = swirl::soft::hostile;
namespace wire = swirl::soft::wire;
using swirl::soft::QpLock;
using swirl::soft::SoftQp;

// One frame of the input, little-endian, 48 bytes.
struct FrameRecord {
  uint8_t fix;  // FixBits
  uint8_t op;
  uint8_t flags;
  uint8_t fill;  // payload byte
  uint32_t length;
  uint32_t total_length;
  uint32_t msn;           // ignored with kFixMsn
  uint32_t ack;           // used with kRawAck
  uint32_t imm_or_inv;    // with kFixInvalidate: the window's rkey instead
  uint64_t remote_addr;   // with kFixAddress: an offset from B's region's start (low 32 bits,
                          // signed), so guard bytes and the space around are in reach
  uint32_t rkey;          // with kFixRkey: B's region's rkey, or the window's (kUseWindow)
  uint32_t ext_length;
  uint64_t compare_add;
};
static_assert(sizeof(FrameRecord) == 48);

enum FixBits : uint8_t {
  kFixMsn = 1 << 0,         // the message's MSN, as A took it
  kRawAck = 1 << 1,         // `ack` as given (else B's expected MSN, as the QP code writes it)
  kFixRkey = 1 << 2,        // a real key (below)
  kUseWindow = 1 << 3,      // ... the window's rather than the region's
  kFixAddress = 1 << 4,     // remote_addr relative to B's region
  kFixInvalidate = 1 << 5,  // imm_or_inv: the window's rkey (a SEND_WITH_INV's target)
  kAwait = 1 << 6,          // A awaits an answer for this frame's MSN
  kShortFrame = 1 << 7,     // the frame takes one ring unit, whatever it claims
};

constexpr int kMaxFrames = 16;
constexpr uint64_t kWindowOffset = 32 * 1024, kWindowLength = 16 * 1024;

std::unique_ptr<hostile::Pair>& Bystander() {
  static auto* pair = new std::unique_ptr<hostile::Pair>();
  return *pair;
}

// The request A awaits an answer for, by the frame's op (a SEND for anything else).
ibv_wr_opcode OpcodeFor(uint8_t op) {
  switch (op) {
    case wire::kOpWrite:
      return IBV_WR_RDMA_WRITE;
    case wire::kOpReadRequest:
      return IBV_WR_RDMA_READ;
    case wire::kOpCompareSwap:
      return IBV_WR_ATOMIC_CMP_AND_SWP;
    case wire::kOpFetchAdd:
      return IBV_WR_ATOMIC_FETCH_AND_ADD;
    default:
      return IBV_WR_SEND;
  }
}

hostile::Frame ToFrame(const FrameRecord& r, hostile::Pair& p, uint32_t msn,
                       uint32_t window_rkey) {
  hostile::Frame f;
  f.op = r.op;
  f.flags = r.flags;
  f.length = r.length;
  f.total_length = r.total_length;
  f.msn = (r.fix & kFixMsn) ? msn : r.msn;
  if (r.fix & kRawAck) f.ack = r.ack;
  f.imm_or_inv = (r.fix & kFixInvalidate) ? window_rkey : r.imm_or_inv;
  f.extension = true;  // ops without one ignore it
  f.ext.remote_addr =
      (r.fix & kFixAddress)
          ? p.addr(static_cast<int32_t>(static_cast<uint32_t>(r.remote_addr)))
          : r.remote_addr;
  f.ext.rkey = (r.fix & kFixRkey) ? ((r.fix & kUseWindow) ? window_rkey : p.rkey()) : r.rkey;
  f.ext.length = r.ext_length;
  f.ext.compare_add = r.compare_add;
  f.ext.swap = ~r.compare_add;
  f.fill = static_cast<char>(r.fill);
  // What the frame takes of the ring: what its claim needs when that fits one chunk, else one
  // unit (a frame that claims more than it holds).
  f.reserve = (r.fix & kShortFrame) || r.length > wire::kMaxChunk
                  ? wire::kFrameAlign
                  : wire::FrameBytes(r.op, r.length);
  return f;
}

// Polls until B has failed, has taken every frame, or waits for a receive (RNR), or a second
// has passed.
void Drive(hostile::Pair& p) {
  const absl::Time deadline = absl::Now() + absl::Seconds(1);
  for (;;) {
    hostile::PollAll(p);
    if (hostile::State(*p.b_qp) == IBV_QPS_ERR) break;
    {
      std::lock_guard<QpLock> b_lock(p.b()->lock);
      std::lock_guard<QpLock> a_lock(p.a()->lock);
      // (A PAD frame sends B to the ring's end, which may lie past what A wrote.)
      if (p.b()->rnr_waiting || p.b()->req_rx.tail() >= p.a()->req_tx.head()) break;
    }
    if (absl::Now() > deadline) break;
  }
  hostile::PollAll(p);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Rings of 128 KiB: a few frames fill one, and new segments cost little.
  setenv("SWIRL_SOFT_RING_KB", "128", 1);
  setenv("SWIRL_LOG_LEVEL", "error", 0);
  Bystander() = hostile::MakePair(/*post_recvs=*/false);
  FUZZ_CHECK(Bystander() != nullptr, "the bystander pair did not connect");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::unique_ptr<hostile::Pair> p = hostile::MakePair();
  FUZZ_CHECK(p != nullptr, "a fresh pair did not connect");
  std::unique_ptr<swirl::verbs::MemoryWindow> mw;
  uint32_t window_rkey = 0;
  FUZZ_CHECK(hostile::BindWindow(*p, kWindowOffset, kWindowLength,
                                 IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ, &mw,
                                 &window_rkey),
             "the window did not bind");

  Input in(data, size);
  std::vector<uint64_t> awaited;  // A's wr_ids, in order
  uint32_t msn = 0;
  for (int k = 0; k < kMaxFrames && !in.empty(); ++k) {
    const FrameRecord r = in.Take<FrameRecord>();
    // A message takes the next MSN; its later chunks carry the same one.
    const bool continues = (r.op == wire::kOpSend || r.op == wire::kOpWrite) &&
                           !(r.flags & wire::kFlagFirst) && k > 0;
    if (!continues) msn = hostile::TakeMsn(p->a());
    const hostile::Frame f = ToFrame(r, *p, msn, window_rkey);
    if (r.fix & kAwait) {
      const uint64_t wr_id = 0x1000 + k;
      if (hostile::RecordOutstanding(p->a(), wr_id, f.msn, OpcodeFor(r.op), f.total_length)) {
        awaited.push_back(wr_id);
      }
    }
    if (!hostile::TryInject(p->a(), f)) break;  // the ring is full: B has not taken enough
    // Every other frame, B gets a chance to take what is there before the next arrives.
    if (k % 2 == 1) hostile::PollAll(*p);
  }
  Drive(*p);

  FUZZ_CHECK(p->b_mem.FirstGuardWritten() < 0,
             absl::StrCat("B's guard written at ", p->b_mem.FirstGuardWritten()));
  FUZZ_CHECK(p->a_mem.FirstGuardWritten() < 0,
             absl::StrCat("A's guard written at ", p->a_mem.FirstGuardWritten()));
  const ibv_qp_state a_state = hostile::State(*p->a_qp);
  const ibv_qp_state b_state = hostile::State(*p->b_qp);
  FUZZ_CHECK(b_state == IBV_QPS_RTS || b_state == IBV_QPS_ERR, absl::StrCat("B in ", b_state));
  FUZZ_CHECK(a_state == IBV_QPS_RTS || a_state == IBV_QPS_ERR, absl::StrCat("A in ", a_state));

  std::map<uint64_t, int> receives;
  for (const ibv_wc& wc : p->b_recv_wcs) {
    FUZZ_CHECK(wc.wr_id == hostile::kRecvWrId1 || wc.wr_id == hostile::kRecvWrId2,
               absl::StrCat("B completed receive ", wc.wr_id));
    FUZZ_CHECK(++receives[wc.wr_id] == 1, absl::StrCat("receive ", wc.wr_id, " twice"));
  }
  FUZZ_CHECK(p->b_send_wcs.empty(), absl::StrCat("B completed ", p->b_send_wcs.size(),
                                                 " sends it never posted"));
  FUZZ_CHECK(p->a_wcs.size() <= awaited.size(),
             absl::StrCat("A completed ", p->a_wcs.size(), " of ", awaited.size(), " requests"));
  for (size_t i = 0; i < p->a_wcs.size(); ++i) {
    FUZZ_CHECK(p->a_wcs[i].wr_id == awaited[i],
               absl::StrCat("A's completion ", i, " is wr ", p->a_wcs[i].wr_id, ", expected ",
                            awaited[i]));
  }

  static uint64_t round = 0;
  FUZZ_CHECK(hostile::BystanderRoundTrip(*Bystander(), ++round),
             "the bystander pair stopped working");
  return 0;
}
