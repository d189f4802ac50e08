// Hostile responses: a soft requester reads its peer's response ring, the acks the peer
// piggybacks on its frames and publishes in its control block, and the consumer indices the
// peer publishes for the requester's own rings. All of it is untrusted (docs/SOFT_WIRE.md,
// "Validation"). Each test posts real work requests on A (hostile_peer.h) and plays B by hand:
// B's QP never runs (the HCA thread's progress for unpolled CQs is off, SWIRL_SOFT_PROGRESS=off
// in BUILD, and nothing polls B's CQs), and the test writes B's responses into B's own response
// ring, and B's published words into B's control block, as qp_responder.cc would. It then checks
// A's exact outcome: every send completion in order, its receive flushed, its error state
// published to its peer, nothing placed outside what the requests asked for (A's region has
// guard bytes around it), and a bystander pair on the same two devices still working.
//
// A real RC requester fails a request whose response it cannot match (rxe_comp.c: a READ
// response for another kind of request, an atomic acknowledgement for a non-atomic one, a NAK
// with an unknown syndrome) and moves its QP to the error state, flushing the rest. The soft
// device's link is lossless, so nothing is ever retried: every such violation fails the first
// outstanding request with IBV_WC_BAD_RESP_ERR ("an unexpected transport layer opcode was
// returned by the responder", ibv_poll_cq(3)) and flushes the rest (qp.cc, ProtocolError).

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "transport/soft/hostile_peer.h"
#include "transport/soft/qp_ops.h"
#include "transport/soft/soft_internal.h"
#include "transport/soft/wire.h"
#include "transport/verbs/verbs.h"

namespace swirl::soft::hostile {
namespace {

constexpr uint64_t kRecvWrId = 0xa0;  // A's receive: flushed when A fails
// SWIRL_SOFT_RING_KB in BUILD: three frames of a full chunk fit in a ring, a fourth does not.
constexpr uint64_t kRingBytes = 128 * 1024;
constexpr uint64_t kChunkFrame = wire::FrameBytes(wire::kOpReadResponse, wire::kMaxChunk);
static_assert(kChunkFrame == wire::FrameBytes(wire::kOpWrite, wire::kMaxChunk));
static_assert(3 * kChunkFrame <= kRingBytes && 4 * kChunkFrame > kRingBytes);

// ---- A: real requests ------------------------------------------------------------------------

// Posts one signaled request on A (hostile_peer.h, PostRequest).
void Post(Pair& p, uint64_t wr_id, ibv_wr_opcode opcode, uint64_t offset, uint32_t length,
          uint32_t lkey = 0) {
  ASSERT_TRUE(PostRequest(p, wr_id, opcode, offset, length, lkey)) << "wr " << wr_id;
}

// ---- B: crafted responses and published words -------------------------------------------------

Frame ReadResponse(uint32_t msn, uint32_t offset, uint32_t length, uint32_t ack) {
  Frame f;
  f.op = wire::kOpReadResponse;
  f.flags = 0;
  f.msn = msn;
  f.length = length;
  f.total_length = offset;
  f.ack = ack;
  return f;
}

Frame AtomicResponse(uint32_t msn, uint32_t ack) {
  Frame f;
  f.op = wire::kOpAtomicResponse;
  f.flags = 0;
  f.msn = msn;
  f.length = 8;
  f.ack = ack;
  return f;
}

Frame NakFrame(uint32_t msn, uint32_t status, uint32_t ack) {
  Frame f;
  f.op = wire::kOpNak;
  f.flags = 0;
  f.msn = msn;
  f.imm_or_inv = status;
  f.ack = ack;
  return f;
}

uint64_t Respond(Pair& p, const Frame& f) { return Inject(p.b(), f, Ring::kResponse); }

// ---- Checking A -----------------------------------------------------------------------------

using Completions = std::vector<std::pair<uint64_t, ibv_wc_status>>;

std::string Describe(const Completions& c) {
  std::string out;
  for (const auto& [wr_id, status] : c) {
    out += "  wr " + std::to_string(wr_id) + ": " + ibv_wc_status_str(status) + "\n";
  }
  return out.empty() ? "  (none)\n" : out;
}

std::vector<char> Untouched() { return std::vector<char>(kRegion, kFillByte); }

void Place(std::vector<char>& region, uint64_t offset, uint64_t length) {
  std::memset(region.data() + offset, kPayloadByte, length);
}

// A's send completions so far, in order.
Completions Sends(const Pair& p) {
  Completions out;
  for (const ibv_wc& wc : p.a_wcs) {
    if (wc.wr_id != kRecvWrId) out.emplace_back(wc.wr_id, wc.status);
  }
  return out;
}

// The link state A publishes for its peer (its own segment's control block).
uint64_t PublishedState(Pair& p) {
  std::lock_guard<QpLock> lock(p.a()->lock);
  return p.a()->own_ctrl->state.value.load(std::memory_order_acquire);
}

class HostileResponse : public ::testing::Test {
 protected:
  void SetUp() override {
    bystander_ = MakePair(/*post_recvs=*/false);
    ASSERT_NE(bystander_, nullptr);
  }

  // A fresh pair with one receive posted on A. Null on failure.
  std::unique_ptr<Pair> NewPair(const verbs::ConnectOptions& options = {}) {
    std::unique_ptr<Pair> p = MakePair(/*post_recvs=*/false, options);
    if (p == nullptr) return nullptr;
    EXPECT_EQ(p->a()->req_tx.size(), kRingBytes) << "SWIRL_SOFT_RING_KB (BUILD) changed";
    ibv_sge sge{p->a_addr(0), 64, p->a_lkey()};
    ibv_recv_wr wr{kRecvWrId, nullptr, &sge, 1};
    ibv_recv_wr* bad = nullptr;
    if (ibv_post_recv(p->a_qp->get(), &wr, &bad) != 0) {
      ADD_FAILURE() << "post_recv failed";
      return nullptr;
    }
    return p;
  }

  // Polls A until it has the send completions `want` calls for and (if `failed`) is in the
  // error state with its receive flushed, for at most 3 s; then checks exactly that, A's region
  // (`region`: its expected contents) and guards, and that the bystander pair still works.
  void ExpectOutcome(Pair& p, const Completions& want, bool failed,
                     const std::vector<char>& region) {
    const absl::Time deadline = absl::Now() + absl::Seconds(3);
    while (absl::Now() < deadline) {
      PollA(p);
      if (Sends(p).size() >= want.size() &&
          (!failed || (State(*p.a_qp) == IBV_QPS_ERR && p.a_wcs.size() > Sends(p).size() &&
                       PublishedState(p) == wire::kLinkError))) {
        break;
      }
    }
    PollA(p);  // anything queued behind what was waited for
    const Completions got = Sends(p);
    EXPECT_EQ(got, want) << "send completions:\n" << Describe(got) << "expected:\n"
                         << Describe(want);
    size_t flushed = 0;
    for (const ibv_wc& wc : p.a_wcs) {
      if (wc.wr_id != kRecvWrId) continue;
      ++flushed;
      EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR) << ibv_wc_status_str(wc.status);
    }
    if (failed) {
      EXPECT_EQ(State(*p.a_qp), IBV_QPS_ERR);
      EXPECT_EQ(flushed, 1u) << "A's receive is flushed once";
      EXPECT_EQ(PublishedState(p), wire::kLinkError)
          << "A did not publish its error state to its peer";
    } else {
      EXPECT_EQ(State(*p.a_qp), IBV_QPS_RTS);
      EXPECT_EQ(flushed, 0u);
    }
    EXPECT_EQ(p.a_mem.FirstGuardWritten(), -1) << "a guard byte of A's buffer was written";
    ASSERT_EQ(region.size(), kRegion);
    const auto diff = std::mismatch(region.begin(), region.end(), p.a_region());
    EXPECT_TRUE(diff.first == region.end())
        << "A's region differs at offset " << (diff.first - region.begin());
    EXPECT_TRUE(BystanderRoundTrip(*bystander_, ++bystander_round_))
        << "the bystander pair stopped working";
    // The premise: B is the test's puppet; its QP never read a frame of A's.
    std::lock_guard<QpLock> lock(p.b()->lock);
    EXPECT_EQ(p.b()->req_rx.tail(), 0u) << "B's QP ran";
  }

  // The common outcome: the first outstanding request fails with BAD_RESP_ERR, the others
  // (`flushed`, in order) flush.
  void ExpectBadResponse(Pair& p, uint64_t first, std::vector<uint64_t> flushed,
                         const std::vector<char>& region) {
    Completions want = {{first, IBV_WC_BAD_RESP_ERR}};
    for (uint64_t wr_id : flushed) want.emplace_back(wr_id, IBV_WC_WR_FLUSH_ERR);
    ExpectOutcome(p, want, /*failed=*/true, region);
  }

  std::unique_ptr<Pair> bystander_;
  uint64_t bystander_round_ = 0;
};

// ---- (0) The puppet's protocol: well-formed responses complete --------------------------------

// Everything below relies on B's hand-written responses being what A accepts when they are
// right; this checks that they are, field by field.
TEST_F(HostileResponse, WellFormedResponsesComplete) {
  auto p = NewPair();
  ASSERT_NE(p, nullptr);
  Post(*p, 1, IBV_WR_RDMA_READ, 0, 64);
  Post(*p, 2, IBV_WR_ATOMIC_FETCH_AND_ADD, 4096, 8);
  Post(*p, 3, IBV_WR_SEND, 8192, 16);
  const uint32_t m = MsnOf(*p, 1);
  ASSERT_EQ(MsnOf(*p, 2), m + 1);
  ASSERT_EQ(MsnOf(*p, 3), m + 2);
  Respond(*p, ReadResponse(m, 0, 32, m + 1));
  Respond(*p, ReadResponse(m, 32, 32, m + 1));
  Respond(*p, AtomicResponse(m + 1, m + 2));
  Publish(*p, &wire::SegmentControl::acked, m + 3);
  std::vector<char> region = Untouched();
  Place(region, 0, 64);
  Place(region, 4096, 8);
  ExpectOutcome(*p, {{1, IBV_WC_SUCCESS}, {2, IBV_WC_SUCCESS}, {3, IBV_WC_SUCCESS}},
                /*failed=*/false, region);
}

// ACK timeout 0 is no transport timer (docs/SOFT_WIRE.md, "The transport timer"): a request
// its peer never answers waits, well past the ACK timeout x (retry_cnt + 1) that ends it on a QP
// with the default timeout (transport_timer_test), and completes when the peer answers.
TEST_F(HostileResponse, WithAnAckTimeoutOfZeroAnUnansweredRequestWaits) {
  verbs::ConnectOptions no_timer;
  no_timer.timeout = 0;
  auto p = NewPair(no_timer);
  ASSERT_NE(p, nullptr);
  Post(*p, 1, IBV_WR_SEND, 0, 16);
  // Twice what ConnectOptions' default timeout would allow: 4.096 us x 2^14 per try, 7 retries.
  const absl::Time until = absl::Now() + 2 * absl::Nanoseconds((int64_t{4096} << 14) * 8);
  while (absl::Now() < until && p->a_wcs.empty()) PollA(*p);
  EXPECT_TRUE(Sends(*p).empty()) << "the unanswered SEND completed:\n" << Describe(Sends(*p));
  EXPECT_EQ(State(*p->a_qp), IBV_QPS_RTS);
  // It still completes when the peer answers.
  Publish(*p, &wire::SegmentControl::acked, wire::NextMsn(MsnOf(*p, 1)));
  ExpectOutcome(*p, {{1, IBV_WC_SUCCESS}}, /*failed=*/false, Untouched());
}

// ---- (1) Acknowledgements --------------------------------------------------------------------

TEST_F(HostileResponse, AckOfRequestsNeverSent) {
  struct Case {
    const char* name;
    bool piggybacked;  // on a READ response (else in B's published ack word)
    int32_t ahead;     // MSNs past the next one A would send
    uint32_t high;     // bits above the 24-bit MSN
  };
  for (const Case& c : {Case{"published, 5 ahead", false, 5, 0},
                        Case{"published, 1 ahead", false, 1, 0},
                        // Its low 24 bits acknowledge the first request only; taken whole, it
                        // would count as acknowledging both.
                        Case{"published, the first request with a bit above 24", false, -1,
                             1u << 24},
                        Case{"piggybacked, 3 ahead", true, 3, 0}}) {
    SCOPED_TRACE(c.name);
    auto p = NewPair();
    ASSERT_NE(p, nullptr);
    // A READ (answered by the piggybacking frame) or a SEND, then a SEND.
    Post(*p, 1, c.piggybacked ? IBV_WR_RDMA_READ : IBV_WR_SEND, 0, 64);
    Post(*p, 2, IBV_WR_SEND, 4096, 16);
    const uint32_t m = MsnOf(*p, 1);
    // m + 2 acknowledges both; anything past it, or above 24 bits, names requests never sent.
    const uint32_t ack = ((m + 2 + static_cast<uint32_t>(c.ahead)) & wire::kMsnMask) | c.high;
    if (c.piggybacked) {
      Respond(*p, ReadResponse(m, 0, 64, ack));  // the ack is judged before the data
    } else {
      Publish(*p, &wire::SegmentControl::acked, ack);
    }
    ExpectBadResponse(*p, 1, {2}, Untouched());
  }
}

// Acks ride on both of the peer's rings and in its control block, which are not ordered with
// each other: an older ack arriving after a newer one is ignored (as rxe ignores a duplicate
// ACK), and never takes back what the newer one acknowledged.
TEST_F(HostileResponse, AckGoingBackwardsIsIgnored) {
  struct Case {
    const char* name;
    int32_t back;  // the stale ack, relative to the READ's MSN
  };
  for (const Case& c : {Case{"to the READ", 1}, Case{"to before anything was sent", -10}}) {
    SCOPED_TRACE(c.name);
    auto p = NewPair();
    ASSERT_NE(p, nullptr);
    // The SENDs complete in order behind the READ, so they wait for it whatever acks them.
    Post(*p, 1, IBV_WR_RDMA_READ, 0, 64);
    Post(*p, 2, IBV_WR_SEND, 4096, 16);
    Post(*p, 3, IBV_WR_SEND, 8192, 16);
    const uint32_t m = MsnOf(*p, 1);
    const uint32_t stale = (m + c.back) & wire::kMsnMask;
    Respond(*p, ReadResponse(m, 0, 32, m + 3));  // acknowledges all three
    Respond(*p, ReadResponse(m, 32, 32, stale));
    Publish(*p, &wire::SegmentControl::acked, stale);
    std::vector<char> region = Untouched();
    Place(region, 0, 64);
    ExpectOutcome(*p, {{1, IBV_WC_SUCCESS}, {2, IBV_WC_SUCCESS}, {3, IBV_WC_SUCCESS}},
                  /*failed=*/false, region);
  }
}

// ---- (2) Responses that name no outstanding request -------------------------------------------

TEST_F(HostileResponse, ResponseForAnMsnNeverSent) {
  enum Kind { kRead, kAtomic, kNak };
  for (Kind kind : {kRead, kAtomic, kNak}) {
    SCOPED_TRACE(kind == kRead ? "READ response" : kind == kAtomic ? "atomic response" : "NAK");
    auto p = NewPair();
    ASSERT_NE(p, nullptr);
    Post(*p, 1, IBV_WR_RDMA_READ, 0, 64);
    Post(*p, 2, IBV_WR_SEND, 4096, 16);
    const uint32_t never = (MsnOf(*p, 2) + 3) & wire::kMsnMask;
    const uint32_t ack = MsnOf(*p, 1);  // acknowledges nothing
    Respond(*p, kind == kRead     ? ReadResponse(never, 0, 64, ack)
                : kind == kAtomic ? AtomicResponse(never, ack)
                                  : NakFrame(never, IBV_WC_REM_ACCESS_ERR, ack));
    ExpectBadResponse(*p, 1, {2}, Untouched());
  }
}

// A second response for a request already answered: rxe ignores a duplicate, which its link's
// retransmissions can produce; the soft link never retransmits, so it is a broken peer.
TEST_F(HostileResponse, SecondResponseForARequestAlreadyAnswered) {
  auto p = NewPair();
  ASSERT_NE(p, nullptr);
  Post(*p, 1, IBV_WR_ATOMIC_FETCH_AND_ADD, 0, 8);
  Post(*p, 2, IBV_WR_SEND, 4096, 16);
  const uint32_t m = MsnOf(*p, 1);
  Respond(*p, AtomicResponse(m, m + 1));
  Frame again = AtomicResponse(m, m + 1);
  again.fill = '\xcd';
  Respond(*p, again);
  // The atomic completed with the first answer; the second fails the next request.
  std::vector<char> region = Untouched();
  Place(region, 0, 8);
  ExpectOutcome(*p, {{1, IBV_WC_SUCCESS}, {2, IBV_WC_BAD_RESP_ERR}}, /*failed=*/true, region);
}

// ---- (3) READ responses that do not fit their request -----------------------------------------

TEST_F(HostileResponse, ReadResponseLongerThanTheRequest) {
  // The READ's destination ends where A's region does: a chunk placed beyond it would write the
  // trailing guard.
  constexpr uint64_t kDest = kRegion - 64;
  struct Case {
    const char* name;
    uint32_t first;   // bytes of a valid first chunk (0: none)
    uint32_t excess;  // then a chunk of this many bytes
  };
  for (const Case& c : {Case{"one chunk of twice the length", 0, 128},
                        Case{"one byte too many", 0, 65},
                        Case{"a second chunk past the end", 32, 64}}) {
    SCOPED_TRACE(c.name);
    auto p = NewPair();
    ASSERT_NE(p, nullptr);
    Post(*p, 1, IBV_WR_RDMA_READ, kDest, 64);
    Post(*p, 2, IBV_WR_SEND, 4096, 16);
    const uint32_t m = MsnOf(*p, 1);
    if (c.first != 0) Respond(*p, ReadResponse(m, 0, c.first, m + 1));
    Respond(*p, ReadResponse(m, c.first, c.excess, m + 1));
    std::vector<char> region = Untouched();
    Place(region, kDest, c.first);  // only the valid chunk is placed
    ExpectBadResponse(*p, 1, {2}, region);
  }
}

TEST_F(HostileResponse, ReadResponseToTheWrongRequest) {
  struct Case {
    const char* name;
    ibv_wr_opcode opcode;  // the first request, which the response names
    uint32_t length;       // its length
    uint32_t offset;       // the response chunk's offset and length
    uint32_t chunk;
  };
  for (const Case& c : {Case{"a SEND", IBV_WR_SEND, 16, 0, 16},
                        Case{"an atomic", IBV_WR_ATOMIC_FETCH_AND_ADD, 8, 0, 8},
                        Case{"a WRITE", IBV_WR_RDMA_WRITE, 64, 0, 64},
                        Case{"a READ, first chunk at offset 32", IBV_WR_RDMA_READ, 64, 32, 32},
                        Case{"a READ, an empty chunk", IBV_WR_RDMA_READ, 64, 0, 0}}) {
    SCOPED_TRACE(c.name);
    auto p = NewPair();
    ASSERT_NE(p, nullptr);
    Post(*p, 1, c.opcode, 0, c.length);
    Post(*p, 2, IBV_WR_SEND, 4096, 16);
    const uint32_t m = MsnOf(*p, 1);
    Respond(*p, ReadResponse(m, c.offset, c.chunk, m + 1));
    ExpectBadResponse(*p, 1, {2}, Untouched());
  }
}

// A responder executes requests in order and streams all of a READ's data before it takes the
// next request, so a response for a later request while a READ or atomic still waits for its
// own means responses were skipped (rxe: check_psn, COMPST_ERROR_RETRY; nothing to retry on the
// soft link). Nothing of it is placed.
TEST_F(HostileResponse, ResponsesOutOfOrder) {
  struct Case {
    const char* name;
    ibv_wr_opcode second;  // behind a READ of 64 bytes
    uint32_t answered;     // bytes of the READ already answered
  };
  for (const Case& c : {Case{"a READ's before the READ ahead of it", IBV_WR_RDMA_READ, 0},
                        Case{"an atomic's before the READ ahead of it",
                             IBV_WR_ATOMIC_FETCH_AND_ADD, 0},
                        Case{"a READ's inside the READ ahead of it", IBV_WR_RDMA_READ, 32}}) {
    SCOPED_TRACE(c.name);
    auto p = NewPair();
    ASSERT_NE(p, nullptr);
    Post(*p, 1, IBV_WR_RDMA_READ, 0, 64);
    const bool atomic = c.second == IBV_WR_ATOMIC_FETCH_AND_ADD;
    Post(*p, 2, c.second, 4096, atomic ? 8 : 64);
    const uint32_t m = MsnOf(*p, 1);
    if (c.answered != 0) Respond(*p, ReadResponse(m, 0, c.answered, m + 2));
    Respond(*p, atomic ? AtomicResponse(m + 1, m + 2) : ReadResponse(m + 1, 0, 64, m + 2));
    std::vector<char> region = Untouched();
    Place(region, 0, c.answered);
    ExpectBadResponse(*p, 1, {2}, region);
  }
}

// ---- (4) Atomic responses --------------------------------------------------------------------

TEST_F(HostileResponse, AtomicResponseToANonAtomicRequest) {
  struct Case {
    const char* name;
    ibv_wr_opcode opcode;  // the request the response names
    uint32_t length;       // its length
    uint32_t payload;      // the response's
  };
  for (const Case& c : {Case{"a READ of 8 bytes", IBV_WR_RDMA_READ, 8, 8},
                        Case{"a SEND", IBV_WR_SEND, 8, 8},
                        Case{"a WRITE", IBV_WR_RDMA_WRITE, 8, 8},
                        Case{"an atomic, with 16 bytes", IBV_WR_ATOMIC_FETCH_AND_ADD, 8, 16},
                        Case{"an atomic, with none", IBV_WR_ATOMIC_CMP_AND_SWP, 8, 0}}) {
    SCOPED_TRACE(c.name);
    auto p = NewPair();
    ASSERT_NE(p, nullptr);
    Post(*p, 1, c.opcode, 0, c.length);
    Post(*p, 2, IBV_WR_SEND, 4096, 16);
    const uint32_t m = MsnOf(*p, 1);
    Frame f = AtomicResponse(m, m + 1);
    f.length = c.payload;
    Respond(*p, f);
    ExpectBadResponse(*p, 1, {2}, Untouched());
  }
}

// ---- (5) Unknown opcodes and flags -------------------------------------------------------------

TEST_F(HostileResponse, UnknownResponseOpcode) {
  // 0, 7, 15, 19 and 255 are no op at all; 2..6 are request ops, not valid on the response ring.
  for (uint8_t op : {0, 2, 3, 4, 5, 6, 7, 15, 19, 255}) {
    SCOPED_TRACE(::testing::Message() << "op " << int{op});
    auto p = NewPair();
    ASSERT_NE(p, nullptr);
    Post(*p, 1, IBV_WR_RDMA_READ, 0, 64);
    Post(*p, 2, IBV_WR_SEND, 4096, 16);
    const uint32_t m = MsnOf(*p, 1);
    // Shaped like the READ's whole answer, and like a NAK with a valid status: an op taken for
    // either would complete the READ without BAD_RESP_ERR.
    Frame f = ReadResponse(m, 0, 64, m + 1);
    f.op = op;
    f.imm_or_inv = IBV_WC_REM_ACCESS_ERR;
    Respond(*p, f);
    ExpectBadResponse(*p, 1, {2}, Untouched());
  }
}

TEST_F(HostileResponse, UnknownResponseFlagBits) {
  for (uint8_t flag : {0x20, 0x40, 0x80}) {
    SCOPED_TRACE(::testing::Message() << "flag 0x" << std::hex << int{flag});
    auto p = NewPair();
    ASSERT_NE(p, nullptr);
    Post(*p, 1, IBV_WR_RDMA_READ, 0, 64);
    Post(*p, 2, IBV_WR_SEND, 4096, 16);
    const uint32_t m = MsnOf(*p, 1);
    Frame f = ReadResponse(m, 0, 64, m + 1);  // otherwise the READ's whole, valid answer
    f.flags = flag;
    Respond(*p, f);
    ExpectBadResponse(*p, 1, {2}, Untouched());
  }
}

// ---- (6) NAKs -------------------------------------------------------------------------------

// The five statuses a responder may NAK with fail the request they name with that status.
TEST_F(HostileResponse, NakFailsTheRequestItNames) {
  for (ibv_wc_status status : {IBV_WC_REM_ACCESS_ERR, IBV_WC_REM_INV_REQ_ERR, IBV_WC_REM_OP_ERR,
                               IBV_WC_RNR_RETRY_EXC_ERR, IBV_WC_RETRY_EXC_ERR}) {
    SCOPED_TRACE(ibv_wc_status_str(status));
    auto p = NewPair();
    ASSERT_NE(p, nullptr);
    Post(*p, 1, IBV_WR_SEND, 0, 16);
    Post(*p, 2, IBV_WR_SEND, 4096, 16);
    const uint32_t m = MsnOf(*p, 1);
    Respond(*p, NakFrame(m, status, m));
    ExpectOutcome(*p, {{1, status}, {2, IBV_WC_WR_FLUSH_ERR}}, /*failed=*/true, Untouched());
  }
}

// Anything else is not a NAK a responder sends: not success (which would complete a READ that
// placed nothing), not a local status, not a value outside the enum. (rxe completes a NAK with
// a reserved syndrome as REM_OP_ERR; the soft NAK carries a status, not a syndrome, and one
// outside the five is a malformed response.)
TEST_F(HostileResponse, NakWithAnUnknownStatus) {
  for (uint32_t status :
       {uint32_t{IBV_WC_SUCCESS}, uint32_t{IBV_WC_LOC_LEN_ERR}, uint32_t{IBV_WC_LOC_PROT_ERR},
        uint32_t{IBV_WC_WR_FLUSH_ERR}, uint32_t{IBV_WC_MW_BIND_ERR}, uint32_t{IBV_WC_GENERAL_ERR},
        0x7fffffffu, 0xffffffffu}) {
    SCOPED_TRACE(::testing::Message() << "status " << status);
    auto p = NewPair();
    ASSERT_NE(p, nullptr);
    Post(*p, 1, IBV_WR_RDMA_READ, 0, 64);
    Post(*p, 2, IBV_WR_SEND, 4096, 16);
    const uint32_t m = MsnOf(*p, 1);
    Respond(*p, NakFrame(m, status, m));
    ExpectBadResponse(*p, 1, {2}, Untouched());
  }
}

// After a request has failed, what follows on the response ring changes nothing: the failed
// request keeps its status and the rest flush, as on a real requester, whose QP is in the error
// state from its first error on.
TEST_F(HostileResponse, NothingAfterAFailureChangesTheOutcome) {
  enum Then { kSameNak, kNakForTheNext, kMsnNeverSent };
  for (Then then : {kSameNak, kNakForTheNext, kMsnNeverSent}) {
    SCOPED_TRACE(then == kSameNak        ? "the same NAK again"
                 : then == kNakForTheNext ? "a NAK for the next request"
                                          : "a NAK for an MSN never sent");
    auto p = NewPair();
    ASSERT_NE(p, nullptr);
    Post(*p, 1, IBV_WR_SEND, 0, 16);
    Post(*p, 2, IBV_WR_SEND, 4096, 16);
    Post(*p, 3, IBV_WR_SEND, 8192, 16);
    const uint32_t m = MsnOf(*p, 1);
    Respond(*p, NakFrame(m, IBV_WC_REM_ACCESS_ERR, m));
    const uint32_t next = then == kSameNak ? m : then == kNakForTheNext ? m + 1 : m + 7;
    Respond(*p, NakFrame(next & wire::kMsnMask, IBV_WC_REM_OP_ERR, m));
    ExpectOutcome(*p,
                  {{1, IBV_WC_REM_ACCESS_ERR}, {2, IBV_WC_WR_FLUSH_ERR}, {3, IBV_WC_WR_FLUSH_ERR}},
                  /*failed=*/true, Untouched());
  }
}

// Not hostile: a READ fails here (its destination's lkey is dead) while the responder, which
// cannot know, streams the next READ's data. That data is not placed and the next READ flushes:
// nothing completes successfully after a failure.
TEST_F(HostileResponse, ReadBehindALocallyFailedReadIsFlushed) {
  auto p = NewPair();
  ASSERT_NE(p, nullptr);
  uint32_t dead_lkey;
  {
    auto mr = verbs::MemoryRegion::Register(p->a_pd, p->a_region(), 4096, IBV_ACCESS_LOCAL_WRITE);
    ASSERT_TRUE(mr.ok()) << mr.status();
    dead_lkey = (*mr)->lkey();
  }
  Post(*p, 1, IBV_WR_SEND, 8192, 16);
  Post(*p, 2, IBV_WR_RDMA_READ, 0, 64, dead_lkey);
  Post(*p, 3, IBV_WR_RDMA_READ, 4096, 64);
  const uint32_t m = MsnOf(*p, 1);
  // What a correct responder writes: both READs answered in order, each frame acknowledging
  // everything it had taken.
  Respond(*p, ReadResponse(m + 1, 0, 64, m + 3));
  Respond(*p, ReadResponse(m + 2, 0, 64, m + 3));
  ExpectOutcome(*p,
                {{1, IBV_WC_SUCCESS}, {2, IBV_WC_LOC_PROT_ERR}, {3, IBV_WC_WR_FLUSH_ERR}},
                /*failed=*/true, Untouched());
}

// ---- (7) Frame lengths ----------------------------------------------------------------------

TEST_F(HostileResponse, ResponseLongerThanAFrameMayCarry) {
  auto p = NewPair();
  ASSERT_NE(p, nullptr);
  Post(*p, 1, IBV_WR_RDMA_READ, 0, 2 * wire::kMaxChunk);
  Post(*p, 2, IBV_WR_SEND, 4096, 16);
  const uint32_t m = MsnOf(*p, 1);
  // One byte more than a frame may carry (the READ could take it), in one alignment unit.
  Frame f = ReadResponse(m, 0, wire::kMaxChunk + 1, m + 1);
  f.reserve = wire::kFrameAlign;
  Respond(*p, f);
  ExpectBadResponse(*p, 1, {2}, Untouched());
}

TEST_F(HostileResponse, ResponseRunningPastTheRingEnd) {
  auto p = NewPair();
  ASSERT_NE(p, nullptr);
  // A READ of the whole region, answered in full chunks: three fill the ring but for less than
  // a fourth needs; the fourth claims its full length in what is left.
  Post(*p, 1, IBV_WR_RDMA_READ, 0, kRegion);
  const uint32_t m = MsnOf(*p, 1);
  for (uint32_t i = 0; i < 3; ++i) {
    Respond(*p, ReadResponse(m, i * wire::kMaxChunk, wire::kMaxChunk, m + 1));
  }
  Frame last = ReadResponse(m, 3 * wire::kMaxChunk, wire::kMaxChunk, m + 1);
  last.reserve = wire::kFrameAlign;
  const uint64_t pos = Respond(*p, last);
  ASSERT_EQ(kRingBytes - pos % kRingBytes, kRingBytes - 3 * kChunkFrame)
      << "the frame was not placed at the ring's tail";
  ASSERT_LT(kRingBytes - 3 * kChunkFrame, kChunkFrame);
  std::vector<char> region = Untouched();
  Place(region, 0, 3 * wire::kMaxChunk);
  ExpectBadResponse(*p, 1, {}, region);
}

// ---- (8) Consumer indices B publishes for A's rings ---------------------------------------------
//
// A writes a frame into its ring only once B's published consumer index says there is room. A
// value beyond what A wrote, or behind one B published before, is no position a consumer can
// be at: trusting it would let A overwrite frames B has not read.

enum class Lie { kBeyond, kBackwards };

// Polls A until `done()` under A's lock, for at most 3 s.
template <typename Done>
bool PollAUntil(Pair& p, Done done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(3);
  for (;;) {
    {
      std::lock_guard<QpLock> lock(p.a()->lock);
      if (done(p.a())) return true;
    }
    if (absl::Now() > deadline) return false;
    PollA(p);
  }
}

TEST_F(HostileResponse, RequestRingConsumerIndexThatCannotBe) {
  struct Case {
    const char* name;
    ibv_wr_opcode waiting;  // the request that waits for room
    Lie lie;
  };
  for (const Case& c : {Case{"a WRITE waits, index beyond", IBV_WR_RDMA_WRITE, Lie::kBeyond},
                        Case{"a WRITE waits, index going backwards", IBV_WR_RDMA_WRITE,
                             Lie::kBackwards},
                        Case{"a READ waits, index beyond", IBV_WR_RDMA_READ, Lie::kBeyond}}) {
    SCOPED_TRACE(c.name);
    auto p = NewPair();
    ASSERT_NE(p, nullptr);
    auto written = [](uint64_t head) {
      return [head](SoftQp* a) { return a->req_tx.head() == head; };
    };
    // WRITEs that fill A's request ring exactly: three of a full chunk, one for the rest.
    uint64_t wr_id = 0;
    for (int i = 0; i < 3; ++i) Post(*p, ++wr_id, IBV_WR_RDMA_WRITE, 0, wire::kMaxChunk);
    const uint32_t rest = kRingBytes - 3 * kChunkFrame - sizeof(wire::FrameHeader) -
                          sizeof(wire::RemoteExtension);
    static_assert(wire::FrameBytes(wire::kOpWrite, kRingBytes - 3 * kChunkFrame -
                                                       sizeof(wire::FrameHeader) -
                                                       sizeof(wire::RemoteExtension)) ==
                  kRingBytes - 3 * kChunkFrame);
    Post(*p, ++wr_id, IBV_WR_RDMA_WRITE, 0, rest);
    uint64_t head = kRingBytes;
    ASSERT_TRUE(PollAUntil(*p, written(head)));
    if (c.lie == Lie::kBackwards) {
      // B consumes the first frame, truthfully: one more WRITE goes out.
      Publish(*p, &wire::SegmentControl::request_consumed, kChunkFrame);
      Post(*p, ++wr_id, IBV_WR_RDMA_WRITE, 0, wire::kMaxChunk);
      head += kChunkFrame;
      ASSERT_TRUE(PollAUntil(*p, written(head)));
    }
    Post(*p, ++wr_id, c.waiting, 0, c.waiting == IBV_WR_RDMA_READ ? 64 : wire::kMaxChunk);
    PollA(*p);
    {
      std::lock_guard<QpLock> lock(p->a()->lock);
      ASSERT_EQ(p->a()->req_tx.head(), head) << "the last request did not wait for room";
      ASSERT_EQ(p->a()->qstate, IBV_QPS_RTS);
    }
    Publish(*p, &wire::SegmentControl::request_consumed,
            c.lie == Lie::kBeyond ? head + wire::kFrameAlign : 0);
    std::vector<uint64_t> flushed;
    for (uint64_t i = 2; i <= wr_id; ++i) flushed.push_back(i);
    ExpectBadResponse(*p, 1, flushed, Untouched());
    std::lock_guard<QpLock> lock(p->a()->lock);
    EXPECT_EQ(p->a()->req_tx.head(), head)
        << "A wrote into its ring on the strength of the bad index";
  }
}

// The same for A's response ring, where A as a responder streams READ data, atomic results and
// NAKs for B's requests (crafted into B's request ring). A has no request of its own to fail: it
// enters the error state and says so to B.
TEST_F(HostileResponse, ResponseRingConsumerIndexThatCannotBe) {
  enum Stalled { kReadData, kAtomic, kNak };
  struct Case {
    const char* name;
    Stalled stalled;  // what waits for room in A's response ring
    Lie lie;
  };
  for (const Case& c : {Case{"READ data, index beyond", kReadData, Lie::kBeyond},
                        Case{"READ data, index going backwards", kReadData, Lie::kBackwards},
                        Case{"an atomic, index beyond", kAtomic, Lie::kBeyond},
                        Case{"a NAK, index beyond", kNak, Lie::kBeyond}}) {
    SCOPED_TRACE(c.name);
    auto p = NewPair();
    ASSERT_NE(p, nullptr);
    uint32_t msn;
    {
      std::lock_guard<QpLock> lock(p->a()->lock);
      msn = p->a()->expected_msn;
    }
    // B's requests, as its requester would write them: READs of A's region, a FETCH_ADD on it,
    // a READ with a wrong key (NAKed).
    auto request = [&](uint8_t op, uint32_t length, uint32_t rkey) {
      Frame f;
      f.op = op;
      f.msn = msn;
      msn = wire::NextMsn(msn);
      f.total_length = length;
      f.ext.remote_addr = p->a_addr(0);
      f.ext.rkey = rkey;
      f.ext.length = length;
      f.ext.compare_add = 1;
      Inject(p->b(), f, Ring::kRequest);
    };
    auto written = [](uint64_t bytes) {
      return [bytes](SoftQp* a) { return a->resp_tx.head() == bytes; };
    };
    // Three full chunks and one that fills the rest of the ring exactly.
    const uint32_t rest = kRingBytes - 3 * kChunkFrame - sizeof(wire::FrameHeader);
    static_assert(wire::FrameBytes(wire::kOpReadResponse, kRingBytes - 3 * kChunkFrame -
                                                              sizeof(wire::FrameHeader)) ==
                  kRingBytes - 3 * kChunkFrame);
    for (int i = 0; i < 3; ++i) request(wire::kOpReadRequest, wire::kMaxChunk, p->a_rkey());
    request(wire::kOpReadRequest, rest, p->a_rkey());
    ASSERT_TRUE(PollAUntil(*p, written(kRingBytes)));
    uint64_t head = kRingBytes;
    if (c.lie == Lie::kBackwards) {
      // B reads the first frame, truthfully: one more READ's data goes out.
      Publish(*p, &wire::SegmentControl::response_consumed, kChunkFrame);
      request(wire::kOpReadRequest, wire::kMaxChunk, p->a_rkey());
      head += kChunkFrame;
      ASSERT_TRUE(PollAUntil(*p, written(head)));
    }
    switch (c.stalled) {
      case kReadData:
        request(wire::kOpReadRequest, wire::kMaxChunk, p->a_rkey());
        break;
      case kAtomic:
        request(wire::kOpFetchAdd, 0, p->a_rkey());
        break;
      case kNak:
        request(wire::kOpReadRequest, 64, p->a_rkey() ^ 1);
        break;
    }
    // A takes the request and waits for room: nothing written, nothing failed yet (the NAK's
    // QP is in the error state already, but has not said so: its NAK comes first). An atomic
    // leaves no trace while it waits: it runs only once there is room for its answer.
    ASSERT_TRUE(PollAUntil(*p, [&](SoftQp* a) {
      return c.stalled == kReadData ? a->cur_read.active
             : c.stalled == kNak    ? a->pending_nak.active
                                    : true;
    }));
    PollA(*p);  // once more over the waiting request
    {
      std::lock_guard<QpLock> lock(p->a()->lock);
      ASSERT_EQ(p->a()->resp_tx.head(), head);
    }
    ASSERT_EQ(PublishedState(*p), wire::kLinkActive);
    Publish(*p, &wire::SegmentControl::response_consumed,
            c.lie == Lie::kBeyond ? head + wire::kFrameAlign : 0);
    ExpectOutcome(*p, {}, /*failed=*/true, Untouched());  // the atomic never ran
    std::lock_guard<QpLock> lock(p->a()->lock);
    EXPECT_EQ(p->a()->resp_tx.head(), head)
        << "A wrote into its ring on the strength of the bad index";
  }
}

}  // namespace
}  // namespace swirl::soft::hostile
