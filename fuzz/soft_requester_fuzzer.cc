// Fuzzes the soft device's requester (transport/soft/qp_requester.cc, and the ack and consumer
// index handling of qp.cc): what a hostile responder writes into its response ring and control
// block, against real requests, as hostile_response_test does by hand (hostile_peer.h).
//
// Each input gets a fresh pair A <-> B whose B never runs: the HCA thread's help for unpolled
// CQs is off (SWIRL_SOFT_PROGRESS=off, set below before any device opens) and nothing polls B's
// CQs; the harness writes B's responses into B's own response ring and B's published words into
// B's control block, as qp_responder.cc would. The input starts with A's requests (up to four
// real work requests, posted before any response: READs, WRITEs, SENDs and atomics at offsets in
// A's region) and goes on with B's answers, 32-byte records (Answer below) that are frames or
// published words, with `how` bits that let them name A's real MSNs and ring positions. A is
// polled until it has read every frame B wrote, or failed, then a few times more (nothing else
// can move: B never runs), for at most a second.
//
// Properties, for every input:
// - A's send completions are its requests', in the order posted, each once, with a status a
//   requester may report; its receive completes at most once, and only as a flush;
// - A places data only where its READs and atomics put their results: every other byte of its
//   region, and the guards around it, keep their contents;
// - A ends in RTS or ERR, and in ERR it has published its error state to its peer;
// - B's QP never read anything (the premise); another pair on the same devices still works.

#include <infiniband/verbs.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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

constexpr uint64_t kRecvWrId = 0xa0;
constexpr int kMaxAnswers = 16;

// One of A's requests, 8 bytes.
struct Request {
  uint8_t opcode;   // % 5: READ, WRITE, SEND, FETCH_ADD, CMP_AND_SWP
  uint8_t unused;
  uint16_t offset;  // x 64 bytes into A's region (and B's)
  uint32_t length;  // % 64 KiB (atomics: 8)
};
static_assert(sizeof(Request) == 8);

// One of B's answers, 32 bytes.
struct Answer {
  uint8_t how;  // HowBits
  uint8_t op;   // with kRawOp: the frame's op; with kPublish: which word (% 4)
  uint8_t flags;
  uint8_t request;      // with kMsnOfRequest: whose MSN (% requests)
  uint8_t ack_request;  // with kAckUpTo: acknowledge up to and with this request (% requests)
  uint8_t fill;
  uint16_t unused;
  uint32_t length;
  uint32_t total_length;  // READ response: the chunk's offset in the READ
  uint32_t msn;
  uint32_t ack;
  uint32_t status;  // NAK: the status A is to complete with
  uint32_t high;    // kPublish without kHonest: the value's upper 32 bits (`msn` the lower)
};
static_assert(sizeof(Answer) == 32);

enum HowBits : uint8_t {
  kKind = 3,              // 0 READ response, 1 atomic response, 2 NAK, 3 raw `op`
  kPublish = 1 << 2,      // a published word instead of a frame
  kMsnOfRequest = 1 << 3, // frame: msn = that request's MSN; word: an honest value (below)
  kAckUpTo = 1 << 4,      // ack = that request's MSN + 1 (else `ack`, or B's expected MSN)
  kRawAck = 1 << 5,
  kShortFrame = 1 << 6,   // the frame takes one ring unit, whatever it claims
  kPollAfter = 1 << 7,    // A polls before the next answer arrives
};

std::unique_ptr<hostile::Pair>& Bystander() {
  static auto* pair = new std::unique_ptr<hostile::Pair>();
  return *pair;
}

ibv_wr_opcode OpcodeOf(uint8_t choice) {
  static constexpr ibv_wr_opcode kOpcodes[] = {IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE, IBV_WR_SEND,
                                               IBV_WR_ATOMIC_FETCH_AND_ADD,
                                               IBV_WR_ATOMIC_CMP_AND_SWP};
  return kOpcodes[choice % 5];
}

struct Posted {
  uint64_t wr_id;
  ibv_wr_opcode opcode;
  uint64_t offset;
  uint32_t length;
  uint32_t msn;
};

bool Allowed(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_SUCCESS:
    case IBV_WC_WR_FLUSH_ERR:
    case IBV_WC_BAD_RESP_ERR:
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_REM_OP_ERR:
      return true;
    default:
      return false;
  }
}

void Answer1(hostile::Pair& p, const Answer& a, const std::vector<Posted>& posted) {
  const Posted& named = posted[a.request % posted.size()];
  const Posted& acked = posted[a.ack_request % posted.size()];
  if (a.how & kPublish) {
    static constexpr wire::Published wire::SegmentControl::*kWords[] = {
        &wire::SegmentControl::request_consumed, &wire::SegmentControl::response_consumed,
        &wire::SegmentControl::acked, &wire::SegmentControl::state};
    const int word = a.op % 4;
    uint64_t value = (uint64_t{a.high} << 32) | a.msn;
    if (a.how & kMsnOfRequest) {  // what an honest B would publish
      std::lock_guard<QpLock> lock(p.a()->lock);
      value = word == 0   ? p.a()->req_tx.head()
              : word == 1 ? 0
              : word == 2 ? wire::NextMsn(acked.msn)
                          : uint64_t{wire::kLinkActive};
    }
    hostile::Publish(p, kWords[word], value);
    return;
  }
  hostile::Frame f;
  static constexpr uint8_t kOps[] = {wire::kOpReadResponse, wire::kOpAtomicResponse,
                                     wire::kOpNak};
  f.op = (a.how & kKind) == 3 ? a.op : kOps[a.how & kKind];
  f.flags = a.flags;
  f.length = f.op == wire::kOpAtomicResponse && !(a.how & kRawAck) ? 8 : a.length;
  f.total_length = a.total_length;
  f.msn = (a.how & kMsnOfRequest) ? named.msn : a.msn;
  if (a.how & kAckUpTo) {
    f.ack = wire::NextMsn(acked.msn);
  } else if (a.how & kRawAck) {
    f.ack = a.ack;
  }
  f.imm_or_inv = a.status;
  f.fill = static_cast<char>(a.fill);
  f.reserve = (a.how & kShortFrame) || f.length > wire::kMaxChunk
                  ? wire::kFrameAlign
                  : wire::FrameBytes(f.op, f.length);
  hostile::TryInject(p.b(), f, hostile::Ring::kResponse);  // no room: B's ring is full, skip it
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // B must never run on its own (the premise above); small rings, so answers can fill one.
  setenv("SWIRL_SOFT_PROGRESS", "off", 1);
  setenv("SWIRL_SOFT_RING_KB", "128", 1);
  setenv("SWIRL_LOG_LEVEL", "error", 0);
  Bystander() = hostile::MakePair(/*post_recvs=*/false);
  FUZZ_CHECK(Bystander() != nullptr, "the bystander pair did not connect");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::unique_ptr<hostile::Pair> p = hostile::MakePair(/*post_recvs=*/false);
  FUZZ_CHECK(p != nullptr, "a fresh pair did not connect");
  {
    ibv_sge sge{p->a_addr(0), 64, p->a_lkey()};
    ibv_recv_wr wr{kRecvWrId, nullptr, &sge, 1};
    ibv_recv_wr* bad = nullptr;
    FUZZ_CHECK(ibv_post_recv(p->a_qp->get(), &wr, &bad) == 0);
  }

  Input in(data, size);
  const int count = 1 + in.Take<uint8_t>() % 4;
  std::vector<Posted> posted;
  std::vector<char> expected(hostile::kRegion, hostile::kFillByte);
  std::vector<bool> may_change(hostile::kRegion, false);
  for (int i = 0; i < count; ++i) {
    const Request r = in.Take<Request>();
    Posted q;
    q.wr_id = 1 + i;
    q.opcode = OpcodeOf(r.opcode);
    const bool atomic =
        q.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD || q.opcode == IBV_WR_ATOMIC_CMP_AND_SWP;
    q.offset = (uint64_t{r.offset} * 64) % hostile::kRegion;
    q.length = atomic ? 8 : std::min<uint32_t>(r.length % (64 * 1024),
                                               static_cast<uint32_t>(hostile::kRegion - q.offset));
    if (q.offset + q.length > hostile::kRegion) q.offset = hostile::kRegion - q.length;
    FUZZ_CHECK(hostile::PostRequest(*p, q.wr_id, q.opcode, q.offset, q.length),
               absl::StrCat("post of request ", q.wr_id));
    if (q.opcode == IBV_WR_RDMA_READ || atomic) {
      std::fill(may_change.begin() + q.offset, may_change.begin() + q.offset + q.length, true);
    }
    posted.push_back(q);
  }
  for (Posted& q : posted) q.msn = hostile::MsnOf(*p, q.wr_id);

  for (int k = 0; k < kMaxAnswers && !in.empty(); ++k) {
    const Answer a = in.Take<Answer>();
    Answer1(*p, a, posted);
    if (a.how & kPollAfter) hostile::PollA(*p);
  }
  // A reads everything B wrote (or fails), then settles: B never runs, so a few more polls are
  // all it takes for anything that follows from what A read.
  const absl::Time deadline = absl::Now() + absl::Seconds(1);
  for (int settle = 0; settle < 8 && absl::Now() < deadline;) {
    hostile::PollA(*p);
    std::lock_guard<QpLock> b_lock(p->b()->lock);
    std::lock_guard<QpLock> a_lock(p->a()->lock);
    if (p->a()->qstate == IBV_QPS_ERR || p->a()->resp_rx.tail() >= p->b()->resp_tx.head()) {
      ++settle;
    }
  }
  hostile::PollA(*p);

  size_t next = 0;
  int receives = 0;
  for (const ibv_wc& wc : p->a_wcs) {
    if (wc.wr_id == kRecvWrId) {
      FUZZ_CHECK(++receives == 1, "A's receive completed twice");
      FUZZ_CHECK(wc.status == IBV_WC_WR_FLUSH_ERR, ibv_wc_status_str(wc.status));
      continue;
    }
    FUZZ_CHECK(next < posted.size() && wc.wr_id == posted[next].wr_id,
               absl::StrCat("A's send completion ", next, " is wr ", wc.wr_id));
    FUZZ_CHECK(Allowed(wc.status), absl::StrCat("wr ", wc.wr_id, ": ",
                                                ibv_wc_status_str(wc.status)));
    ++next;
  }
  for (size_t i = 0; i < hostile::kRegion; ++i) {
    if (!may_change[i]) {
      FUZZ_CHECK(p->a_region()[i] == hostile::kFillByte,
                 absl::StrCat("A's region changed at offset ", i, ", where no READ or atomic "
                              "of A's puts its result"));
    }
  }
  FUZZ_CHECK(p->a_mem.FirstGuardWritten() < 0,
             absl::StrCat("A's guard written at ", p->a_mem.FirstGuardWritten()));
  const ibv_qp_state a_state = hostile::State(*p->a_qp);
  FUZZ_CHECK(a_state == IBV_QPS_RTS || a_state == IBV_QPS_ERR, absl::StrCat("A in ", a_state));
  {
    std::lock_guard<QpLock> lock(p->a()->lock);
    if (a_state == IBV_QPS_ERR) {
      FUZZ_CHECK(p->a()->own_ctrl->state.value.load() == wire::kLinkError,
                 "A failed without telling its peer");
    }
  }
  {
    std::lock_guard<QpLock> lock(p->b()->lock);
    FUZZ_CHECK(p->b()->req_rx.tail() == 0, "B's QP ran (SWIRL_SOFT_PROGRESS=off?)");
  }
  static uint64_t round = 0;
  FUZZ_CHECK(hostile::BystanderRoundTrip(*Bystander(), ++round),
             "the bystander pair stopped working");
  return 0;
}
