// Hostile frames: a soft QP's peer writes the request ring it reads, so every frame is untrusted
// (docs/SOFT_WIRE.md, "Validation"). Each test connects a fresh QP pair A <-> B in this process
// (hostile_peer.h), writes crafted frames straight into A's request ring the way qp_requester.cc
// writes real ones, drives B by polling its CQs, and checks that B answers exactly as the
// responder code says it must (a protocol error, or a NAK with the right status), that A
// completes its request with the matching status, that B's receives are flushed, and that nothing
// outside what the frames were entitled to touch changed (B's buffer has guard bytes around its
// registered region). hostile_response_test does the same for the other direction.
//
// A protocol error puts B in the error state without a response frame; A then sees B's link
// state go to error and fails its outstanding request with RETRY_EXC_ERR (qp.cc, ProgressLocked).
// A NAK is a frame on B's response ring; A fails the request it names with the NAK's status.

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <random>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/time/clock.h"
#include "transport/soft/hostile_peer.h"
#include "transport/soft/qp_ops.h"
#include "transport/soft/soft_internal.h"
#include "transport/soft/wire.h"
#include "transport/verbs/verbs.h"

namespace swirl::soft::hostile {
namespace {

using verbs::MemoryWindow;

// Where crafted WRITEs aim (32 KiB, clear of the receives).
constexpr uint64_t kTarget = 96 * 1024;
// A's send-queue entry for the crafted request.
constexpr uint64_t kRequestWrId = 0xa1;

// ---- Writing crafted frames as A -----------------------------------------------------------

// Records the crafted request as A's outstanding kRequestWrId (hostile_peer.h).
void Outstanding(SoftQp* a, uint32_t msn, ibv_wr_opcode opcode, uint32_t length) {
  ASSERT_TRUE(RecordOutstanding(a, kRequestWrId, msn, opcode, length));
}

Frame Send(uint32_t msn, uint8_t flags, uint32_t length, uint32_t total) {
  Frame f;
  f.op = wire::kOpSend;
  f.flags = flags;
  f.msn = msn;
  f.length = length;
  f.total_length = total;
  return f;
}

Frame Write(uint32_t msn, uint8_t flags, uint32_t length, uint32_t total, uint64_t remote_addr,
            uint32_t rkey) {
  Frame f;
  f.op = wire::kOpWrite;
  f.flags = flags;
  f.msn = msn;
  f.length = length;
  f.total_length = total;
  f.ext.remote_addr = remote_addr;
  f.ext.rkey = rkey;
  f.ext.length = total;
  return f;
}

// ---- Driving B and checking the outcome -----------------------------------------------------

// Polls every CQ until B and A are in the error state and A has `a_wcs` completions and B
// `recv_wcs` receive completions, or for at most 3 s.
void Drive(Pair& p, size_t a_wcs, size_t recv_wcs) {
  const absl::Time deadline = absl::Now() + absl::Seconds(3);
  while (absl::Now() < deadline) {
    PollAll(p);
    if (State(*p.b_qp) == IBV_QPS_ERR && State(*p.a_qp) == IBV_QPS_ERR && p.a_wcs.size() >= a_wcs &&
        p.b_recv_wcs.size() >= recv_wcs) {
      break;
    }
  }
  PollAll(p);  // anything queued behind what was waited for
}

// Frames B wrote on its response ring. They stay in B's own segment after A consumed them.
std::vector<wire::FrameHeader> Responses(SoftQp* b) {
  std::lock_guard<QpLock> lock(b->lock);
  std::vector<wire::FrameHeader> out;
  const uint64_t size = b->resp_tx.size();
  // The response ring follows the request ring (qp.cc, CreateSegment).
  const char* ring = b->own_base + wire::kRingsOffset + b->req_tx.size();
  for (uint64_t pos = 0; pos < b->resp_tx.head();) {
    wire::FrameHeader h;
    std::memcpy(&h, ring + (pos & (size - 1)), sizeof(h));
    if (h.op == wire::kOpPad) {
      pos += size - (pos & (size - 1));
      continue;
    }
    out.push_back(h);
    pos += wire::FrameBytes(h.op, h.length);
  }
  return out;
}

struct Expect {
  // B's answer: a NAK for `msn` with `status`; none means a protocol error (no response frame).
  struct Nak {
    uint32_t msn;
    ibv_wc_status status;
  };
  std::optional<Nak> nak;
  // A's completion for its outstanding request (kRequestWrId); none: A has no request.
  std::optional<ibv_wc_status> a_status;
  // B's receive completions by wr_id.
  std::map<uint64_t, ibv_wc_status> recv = {{kRecvWrId1, IBV_WC_WR_FLUSH_ERR},
                                            {kRecvWrId2, IBV_WC_WR_FLUSH_ERR}};
  // The region as it must be afterwards (default: untouched).
  std::vector<char> region = std::vector<char>(kRegion, kFillByte);
};

Expect ProtocolErrorExpected() {
  Expect e;
  e.a_status = IBV_WC_RETRY_EXC_ERR;  // A sees B's link state go to error
  return e;
}

Expect NakExpected(uint32_t msn, ibv_wc_status status) {
  Expect e;
  e.nak = Expect::Nak{msn, status};
  e.a_status = status;
  return e;
}

void DriveAndCheck(Pair& p, const Expect& e) {
  Drive(p, e.a_status ? 1 : 0, e.recv.size());

  EXPECT_EQ(State(*p.b_qp), IBV_QPS_ERR) << "B accepted the frames";

  // ProtocolError vs Nak: exactly the response frames the responder code writes.
  std::vector<wire::FrameHeader> responses = Responses(p.b());
  if (e.nak) {
    ASSERT_EQ(responses.size(), 1u) << "expected exactly one NAK from B";
    EXPECT_EQ(responses[0].op, wire::kOpNak);
    EXPECT_EQ(responses[0].msn, e.nak->msn);
    EXPECT_EQ(responses[0].imm_or_inv, static_cast<uint32_t>(e.nak->status))
        << ibv_wc_status_str(static_cast<ibv_wc_status>(responses[0].imm_or_inv));
  } else {
    EXPECT_TRUE(responses.empty()) << "B answered a protocol violation with a frame (op "
                                   << int{responses.empty() ? 0 : responses[0].op} << ")";
  }

  // A: its request completes with the status the case calls for, and A is in error.
  EXPECT_EQ(State(*p.a_qp), IBV_QPS_ERR);
  if (e.a_status) {
    ASSERT_EQ(p.a_wcs.size(), 1u);
    EXPECT_EQ(p.a_wcs[0].wr_id, kRequestWrId);
    EXPECT_EQ(p.a_wcs[0].status, *e.a_status)
        << ibv_wc_status_str(p.a_wcs[0].status) << ", expected " << ibv_wc_status_str(*e.a_status);
  } else {
    EXPECT_TRUE(p.a_wcs.empty());
  }

  // B's receives: each completes once, flushed unless the case says otherwise.
  std::map<uint64_t, ibv_wc_status> recv;
  for (const ibv_wc& wc : p.b_recv_wcs) {
    EXPECT_TRUE(recv.emplace(wc.wr_id, wc.status).second) << "receive " << wc.wr_id << " twice";
    if (wc.status == IBV_WC_WR_FLUSH_ERR) {
      EXPECT_EQ(wc.byte_len, 0u);
    } else if (wc.status == IBV_WC_SUCCESS) {
      EXPECT_EQ(wc.opcode, IBV_WC_RECV);  // never RECV_RDMA_WITH_IMM from a crafted WRITE
    }
  }
  EXPECT_EQ(recv, e.recv);
  EXPECT_TRUE(p.b_send_wcs.empty() || p.b_send_wcs.back().opcode == IBV_WC_BIND_MW);

  // Memory: the guards untouched, the region exactly as expected.
  EXPECT_EQ(FirstMismatch(p.b_mem.mem.data(), kGuard, kGuardByte), kGuard) << "leading guard written";
  EXPECT_EQ(FirstMismatch(p.region() + kRegion, kGuard, kGuardByte), kGuard)
      << "trailing guard written";
  ASSERT_EQ(e.region.size(), kRegion);
  const auto diff = std::mismatch(e.region.begin(), e.region.end(), p.region());
  EXPECT_TRUE(diff.first == e.region.end())
      << "region differs at offset " << (diff.first - e.region.begin());
}

void Place(std::vector<char>& region, uint64_t offset, uint64_t length, char byte) {
  std::memset(region.data() + offset, byte, length);
}

// ---- (1) WRITE chunks must add up to the total the first chunk announced -------------------

TEST(HostileFrame, WriteSingleChunkShorterThanItsTotal) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  const uint32_t msn = TakeMsn(p->a());
  Outstanding(p->a(), msn, IBV_WR_RDMA_WRITE, 100);
  // First and last chunk at once, announcing 100 bytes and carrying 10.
  Inject(p->a(), Write(msn, kFirstLast, 10, 100, p->addr(kTarget), p->rkey()));
  // Nothing placed: the check comes before the placement.
  DriveAndCheck(*p, ProtocolErrorExpected());
}

// Two 64-byte WRITE chunks announcing `total` bytes (anything but 128): the first is valid and
// placed, the last does not add up and nothing of it is placed.
void ExpectSecondWriteChunkRefused(uint32_t total) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  const uint32_t msn = TakeMsn(p->a());
  Outstanding(p->a(), msn, IBV_WR_RDMA_WRITE, total);
  Inject(p->a(), Write(msn, wire::kFlagFirst, 64, total, p->addr(kTarget), p->rkey()));
  Frame last = Write(msn, wire::kFlagLast, 64, total, p->addr(kTarget + 64), p->rkey());
  last.fill = '\xcd';
  Inject(p->a(), last);
  Expect e = ProtocolErrorExpected();
  Place(e.region, kTarget, 64, kPayloadByte);
  DriveAndCheck(*p, e);
}

TEST(HostileFrame, WriteSecondChunkOvershootsTotal) { ExpectSecondWriteChunkRefused(100); }

TEST(HostileFrame, WriteLastChunkShortOfTotal) { ExpectSecondWriteChunkRefused(256); }

// ---- (2) WRITE_WITH_IMM whose chunks do not add up: no receive completion --------------------

TEST(HostileFrame, WriteWithImmSingleChunkShorterThanItsTotal) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  const uint32_t msn = TakeMsn(p->a());
  Outstanding(p->a(), msn, IBV_WR_RDMA_WRITE_WITH_IMM, 100);
  Frame f = Write(msn, kFirstLast | wire::kFlagWithImm, 10, 100, p->addr(kTarget), p->rkey());
  f.imm_or_inv = 0x12345678;
  Inject(p->a(), f);
  // Both receives flush: none completes as RECV_RDMA_WITH_IMM with byte_len 100.
  DriveAndCheck(*p, ProtocolErrorExpected());
}

TEST(HostileFrame, WriteWithImmChunksShortOfTotal) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  const uint32_t msn = TakeMsn(p->a());
  Outstanding(p->a(), msn, IBV_WR_RDMA_WRITE_WITH_IMM, 200);
  Inject(p->a(), Write(msn, wire::kFlagFirst, 64, 200, p->addr(kTarget), p->rkey()));
  Frame last =
      Write(msn, wire::kFlagLast | wire::kFlagWithImm, 64, 200, p->addr(kTarget + 64), p->rkey());
  last.imm_or_inv = 0x12345678;
  last.fill = '\xcd';
  Inject(p->a(), last);
  Expect e = ProtocolErrorExpected();
  Place(e.region, kTarget, 64, kPayloadByte);
  DriveAndCheck(*p, e);
}

// ---- (3) SEND chunk lengths must add up ---------------------------------------------------------

TEST(HostileFrame, SendChunkLongerThanTotal) {
  struct Case {
    const char* name;
    uint8_t flags;
    uint32_t length, total;
  };
  for (const Case& c : {Case{"only chunk longer than total", kFirstLast, 100, 10},
                        Case{"first chunk longer than total", wire::kFlagFirst, 100, 10},
                        Case{"only chunk shorter than total", kFirstLast, 10, 100}}) {
    SCOPED_TRACE(c.name);
    auto p = MakePair();
    ASSERT_NE(p, nullptr);
    const uint32_t msn = TakeMsn(p->a());
    Outstanding(p->a(), msn, IBV_WR_SEND, c.total);
    Inject(p->a(), Send(msn, c.flags, c.length, c.total));
    // The receive was taken for the message; it is flushed with the QP, and nothing of the chunk
    // reached its buffer.
    DriveAndCheck(*p, ProtocolErrorExpected());
  }
}

// ---- (4) Continuation chunks belong to the message in progress -------------------------------

TEST(HostileFrame, SendContinuationWithoutFirstChunk) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  // A complete, valid SEND first: it leaves the responder's last receive state behind
  // (offset == total == 16), which a zero-length "last" chunk would otherwise complete again.
  const uint32_t valid = TakeMsn(p->a());
  Inject(p->a(), Send(valid, kFirstLast, 16, 16));
  const uint32_t msn = TakeMsn(p->a());
  Outstanding(p->a(), msn, IBV_WR_SEND, 0);
  Inject(p->a(), Send(msn, wire::kFlagLast, 0, 0));
  Expect e = ProtocolErrorExpected();
  e.recv[kRecvWrId1] = IBV_WC_SUCCESS;  // the valid SEND
  Place(e.region, kRecv1Offset, 16, kPayloadByte);
  DriveAndCheck(*p, e);
}

TEST(HostileFrame, SendContinuationInsideWrite) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  const uint32_t msn = TakeMsn(p->a());
  Outstanding(p->a(), msn, IBV_WR_RDMA_WRITE, 128);
  Inject(p->a(), Write(msn, wire::kFlagFirst, 64, 128, p->addr(kTarget), p->rkey()));
  Inject(p->a(), Send(msn, wire::kFlagLast, 0, 0));
  Expect e = ProtocolErrorExpected();
  Place(e.region, kTarget, 64, kPayloadByte);
  DriveAndCheck(*p, e);
}

TEST(HostileFrame, WriteContinuationWithoutFirstChunk) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  // After a complete WRITE, a "last" chunk of a WRITE that never started.
  const uint32_t valid = TakeMsn(p->a());
  Inject(p->a(), Write(valid, kFirstLast, 64, 64, p->addr(kTarget), p->rkey()));
  const uint32_t msn = TakeMsn(p->a());
  Outstanding(p->a(), msn, IBV_WR_RDMA_WRITE, 64);
  Frame f = Write(msn, wire::kFlagLast, 64, 64, p->addr(kTarget + 64), p->rkey());
  f.fill = '\xcd';
  Inject(p->a(), f);
  Expect e = ProtocolErrorExpected();
  Place(e.region, kTarget, 64, kPayloadByte);
  DriveAndCheck(*p, e);
}

// The responder copies and validates a frame's header each time it looks at it: a frame it is
// stalled on (no receive for a WRITE_WITH_IMM) may change under it, and is judged as it is now.
TEST(HostileFrame, StalledFrameRewrittenAsContinuation) {
  auto p = MakePair(/*post_recvs=*/false);
  ASSERT_NE(p, nullptr);
  const uint32_t msn = TakeMsn(p->a());
  Outstanding(p->a(), msn, IBV_WR_RDMA_WRITE_WITH_IMM, 128);
  const uint64_t pos = Inject(
      p->a(), Write(msn, kFirstLast | wire::kFlagWithImm, 128, 128, p->addr(kTarget), p->rkey()));
  // B waits for a receive (rnr_retry 7: for ever) with the frame unconsumed.
  const absl::Time deadline = absl::Now() + absl::Seconds(3);
  bool waiting = false;
  while (!waiting && absl::Now() < deadline) {
    p->b_recv_cq->Poll(0, nullptr);
    std::lock_guard<QpLock> lock(p->b()->lock);
    waiting = p->b()->rnr_waiting;
  }
  ASSERT_TRUE(waiting) << "B never waited for a receive";
  {
    // A turns it into the last chunk of a WRITE that never started (same stamp, same MSN).
    std::lock_guard<QpLock> lock(p->a()->lock);
    char* ring = p->a()->own_base + wire::kRingsOffset;
    auto* h = reinterpret_cast<wire::FrameHeader*>(ring + (pos & (p->a()->req_tx.size() - 1)));
    __atomic_store_n(&h->flags, uint8_t{wire::kFlagLast}, __ATOMIC_RELEASE);
  }
  Expect e = ProtocolErrorExpected();
  e.recv.clear();  // none posted
  DriveAndCheck(*p, e);
}

// A message may not start while another is in progress: it would share its MSN, and it would
// run on the state of the message it interrupted (a WRITE_WITH_IMM inside a SEND completed the
// SEND's receive as its own).
TEST(HostileFrame, MessageStartingInsideAnother) {
  enum Outer { kSend, kWrite };
  struct Case {
    const char* name;
    Outer outer;
    Frame inner;  // msn, remote address and rkey filled in below
    ibv_wr_opcode opcode;
  };
  Frame imm = Write(0, kFirstLast | wire::kFlagWithImm, 16, 16, 0, 0);
  imm.imm_or_inv = 0x1234;
  Frame write = Write(0, kFirstLast, 16, 16, 0, 0);
  Frame send = Send(0, kFirstLast, 16, 16);
  Frame read;
  read.op = wire::kOpReadRequest;
  read.total_length = 16;
  read.ext.length = 16;
  Frame fetch_add;
  fetch_add.op = wire::kOpFetchAdd;
  fetch_add.total_length = 8;
  fetch_add.ext.compare_add = 1;
  for (const Case& c : {Case{"WRITE_WITH_IMM inside a SEND", kSend, imm, IBV_WR_SEND},
                        Case{"WRITE inside a SEND", kSend, write, IBV_WR_SEND},
                        Case{"FETCH_ADD inside a SEND", kSend, fetch_add, IBV_WR_SEND},
                        Case{"SEND inside a WRITE", kWrite, send, IBV_WR_RDMA_WRITE},
                        Case{"READ inside a WRITE", kWrite, read, IBV_WR_RDMA_WRITE}}) {
    SCOPED_TRACE(c.name);
    auto p = MakePair();
    ASSERT_NE(p, nullptr);
    const uint32_t msn = TakeMsn(p->a());
    Outstanding(p->a(), msn, c.opcode, 64);
    Expect e = ProtocolErrorExpected();
    if (c.outer == kSend) {
      Inject(p->a(), Send(msn, wire::kFlagFirst, 32, 64));
      Place(e.region, kRecv1Offset, 32, kPayloadByte);  // the SEND's first chunk
    } else {
      Inject(p->a(), Write(msn, wire::kFlagFirst, 32, 64, p->addr(kTarget), p->rkey()));
      Place(e.region, kTarget, 32, kPayloadByte);
    }
    Frame inner = c.inner;
    inner.msn = msn;  // the MSN the responder still expects
    inner.ext.remote_addr = p->addr(kTarget + 4096);
    inner.ext.rkey = p->rkey();
    inner.fill = '\xcd';
    Inject(p->a(), inner);
    DriveAndCheck(*p, e);
  }
}

// ---- (5) Unknown opcodes and flag bits ------------------------------------------------------

TEST(HostileFrame, UnknownOpcode) {
  // 0, 7, 15 and 255 are no op at all; 16..18 are response ops, not valid on the request ring.
  for (uint8_t op : {0, 7, 15, 16, 17, 18, 255}) {
    SCOPED_TRACE(testing::Message() << "op " << int{op});
    auto p = MakePair();
    ASSERT_NE(p, nullptr);
    const uint32_t msn = TakeMsn(p->a());
    Outstanding(p->a(), msn, IBV_WR_SEND, 0);
    // Shaped like a FETCH_ADD of 1 at the target (an unchecked op falls through to the atomics).
    Frame f;
    f.op = op;
    f.msn = msn;
    f.extension = true;
    f.ext.remote_addr = p->addr(kTarget);
    f.ext.rkey = p->rkey();
    f.ext.compare_add = 1;
    Inject(p->a(), f);
    DriveAndCheck(*p, ProtocolErrorExpected());
  }
}

TEST(HostileFrame, UnknownFlagBits) {
  for (uint8_t flag : {0x20, 0x40, 0x80}) {
    SCOPED_TRACE(testing::Message() << "flag 0x" << std::hex << int{flag});
    auto p = MakePair();
    ASSERT_NE(p, nullptr);
    const uint32_t msn = TakeMsn(p->a());
    Outstanding(p->a(), msn, IBV_WR_SEND, 16);
    Inject(p->a(), Send(msn, kFirstLast | flag, 16, 16));  // otherwise a valid SEND
    DriveAndCheck(*p, ProtocolErrorExpected());
  }
}

// ---- (6) Frame length limits -----------------------------------------------------------------

TEST(HostileFrame, FrameLongerThanMaxChunk) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  const uint32_t msn = TakeMsn(p->a());
  Outstanding(p->a(), msn, IBV_WR_SEND, wire::kMaxChunk + 1);
  // A SEND claiming one byte more than a frame may carry (the receive could hold it), in a
  // frame that takes one alignment unit of the ring.
  Frame f = Send(msn, kFirstLast, wire::kMaxChunk + 1, wire::kMaxChunk + 1);
  f.reserve = wire::kFrameAlign;
  Inject(p->a(), f);
  DriveAndCheck(*p, ProtocolErrorExpected());
}

TEST(HostileFrame, FrameRunningPastRingEnd) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  const uint64_t ring = p->a()->req_tx.size();
  const uint64_t filler = wire::FrameBytes(wire::kOpWrite, wire::kMaxChunk);
  // Valid 32 KiB WRITEs (of the region's own fill, so it stays as it was) until less than one
  // full frame is left before the ring's end.
  uint64_t left = ring;
  int fillers = 0;
  while (left > filler) {
    Frame f = Write(TakeMsn(p->a()), kFirstLast, wire::kMaxChunk, wire::kMaxChunk, p->addr(kTarget),
                    p->rkey());
    f.fill = kFillByte;
    Inject(p->a(), f);
    left -= filler;
    ++fillers;
  }
  if (left == filler) {  // make it strictly less: one empty WRITE
    Inject(p->a(), Write(TakeMsn(p->a()), kFirstLast, 0, 0, p->addr(kTarget), p->rkey()));
    left -= wire::FrameBytes(wire::kOpWrite, 0);
  }
  ASSERT_GT(fillers, 0);
  const uint32_t msn = TakeMsn(p->a());
  Outstanding(p->a(), msn, IBV_WR_SEND, wire::kMaxChunk);
  // A maximal SEND (a legal length) in the last `left` bytes: it would run past the ring's end.
  ASSERT_GT(wire::FrameBytes(wire::kOpSend, wire::kMaxChunk), left);
  Frame f = Send(msn, kFirstLast, wire::kMaxChunk, wire::kMaxChunk);
  f.reserve = wire::kFrameAlign;
  const uint64_t pos = Inject(p->a(), f);
  ASSERT_EQ(ring - pos % ring, left) << "the frame was not placed at the ring's tail";
  DriveAndCheck(*p, ProtocolErrorExpected());
  std::lock_guard<QpLock> lock(p->b()->lock);
  EXPECT_EQ(p->b()->expected_msn, msn) << "B did not accept the valid WRITEs before it";
}

// ---- (7) MSNs out of sequence -----------------------------------------------------------------

TEST(HostileFrame, MessageWithFutureMsnIsNaked) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  // A request three MSNs ahead of what B expects: what a PSN error looks like. B NAKs it with
  // RETRY_EXC_ERR, and A (which sent it under that MSN) fails it with that status.
  uint32_t msn = TakeMsn(p->a());
  for (int i = 0; i < 3; ++i) msn = TakeMsn(p->a());
  Outstanding(p->a(), msn, IBV_WR_SEND, 16);
  Inject(p->a(), Send(msn, kFirstLast, 16, 16));
  DriveAndCheck(*p, NakExpected(msn, IBV_WC_RETRY_EXC_ERR));
}

TEST(HostileFrame, ReplayedMsnIsNaked) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  const uint32_t msn = TakeMsn(p->a());
  Inject(p->a(), Send(msn, kFirstLast, 16, 16));
  Frame replay = Send(msn, kFirstLast, 16, 16);
  replay.fill = '\xcd';
  Inject(p->a(), replay);
  // A has no request under that MSN any more (it completed): the NAK names none, so A fails
  // too, without a completion.
  Expect e;
  e.nak = Expect::Nak{msn, IBV_WC_RETRY_EXC_ERR};
  e.recv[kRecvWrId1] = IBV_WC_SUCCESS;
  Place(e.region, kRecv1Offset, 16, kPayloadByte);
  DriveAndCheck(*p, e);
}

TEST(HostileFrame, ContinuationWithAnotherMsn) {
  for (bool send : {true, false}) {
    SCOPED_TRACE(send ? "SEND" : "WRITE");
    auto p = MakePair();
    ASSERT_NE(p, nullptr);
    const uint32_t msn = TakeMsn(p->a());
    const uint32_t next = TakeMsn(p->a());
    Outstanding(p->a(), msn, send ? IBV_WR_SEND : IBV_WR_RDMA_WRITE, 128);
    Expect e = ProtocolErrorExpected();
    if (send) {
      Inject(p->a(), Send(msn, wire::kFlagFirst, 64, 128));
      Inject(p->a(), Send(next, wire::kFlagLast, 64, 128));
      Place(e.region, kRecv1Offset, 64, kPayloadByte);
    } else {
      Inject(p->a(), Write(msn, wire::kFlagFirst, 64, 128, p->addr(kTarget), p->rkey()));
      Inject(p->a(), Write(next, wire::kFlagLast, 64, 128, p->addr(kTarget + 64), p->rkey()));
      Place(e.region, kTarget, 64, kPayloadByte);
    }
    DriveAndCheck(*p, e);
  }
}

TEST(HostileFrame, AckOfRequestsNeverSent) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  const uint32_t msn = TakeMsn(p->a());
  Outstanding(p->a(), msn, IBV_WR_SEND, 16);
  uint32_t b_next;
  {
    std::lock_guard<QpLock> lock(p->b()->lock);
    b_next = p->b()->next_msn;
  }
  Frame f = Send(msn, kFirstLast, 16, 16);  // otherwise a valid SEND
  f.ack = (b_next + 5) & wire::kMsnMask;    // B never sent anything
  Inject(p->a(), f);
  DriveAndCheck(*p, ProtocolErrorExpected());
}

// ---- (8) Remote keys and ranges: the responder NAKs ------------------------------------------

TEST(HostileFrame, WriteOutsideRegisteredRange) {
  struct Case {
    const char* name;
    int64_t offset;  // from the region's start
    uint32_t length;
  };
  for (const Case& c : {Case{"straddling the end", static_cast<int64_t>(kRegion) - 32, 64},
                        Case{"just past the end", static_cast<int64_t>(kRegion), 16},
                        Case{"before the start", -64, 64}, Case{"straddling the start", -1, 64}}) {
    SCOPED_TRACE(c.name);
    auto p = MakePair();
    ASSERT_NE(p, nullptr);
    const uint32_t msn = TakeMsn(p->a());
    Outstanding(p->a(), msn, IBV_WR_RDMA_WRITE, c.length);
    Inject(p->a(), Write(msn, kFirstLast, c.length, c.length, p->addr(c.offset), p->rkey()));
    DriveAndCheck(*p, NakExpected(msn, IBV_WC_REM_ACCESS_ERR));
  }
}

TEST(HostileFrame, WriteAddressWrappingAround) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  const uint32_t msn = TakeMsn(p->a());
  Outstanding(p->a(), msn, IBV_WR_RDMA_WRITE, 64);
  // addr + length overflows 64 bits: a naive end check would pass it.
  Inject(p->a(), Write(msn, kFirstLast, 64, 64, ~uint64_t{0} - 31, p->rkey()));
  DriveAndCheck(*p, NakExpected(msn, IBV_WC_REM_ACCESS_ERR));
}

TEST(HostileFrame, WriteWithWrongRkey) {
  struct Case {
    const char* name;
    uint32_t rkey_xor;
  };
  for (const Case& c :
       {Case{"another key byte, same slot", 0x1}, Case{"another slot", 0x100}, Case{"zero", 0}}) {
    SCOPED_TRACE(c.name);
    auto p = MakePair();
    ASSERT_NE(p, nullptr);
    const uint32_t rkey = c.rkey_xor == 0 ? 0 : p->rkey() ^ c.rkey_xor;
    const uint32_t msn = TakeMsn(p->a());
    Outstanding(p->a(), msn, IBV_WR_RDMA_WRITE, 64);
    Inject(p->a(), Write(msn, kFirstLast, 64, 64, p->addr(kTarget), rkey));
    DriveAndCheck(*p, NakExpected(msn, IBV_WC_REM_ACCESS_ERR));
  }
}

TEST(HostileFrame, WriteSecondChunkOutsideRegisteredRange) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  const uint32_t msn = TakeMsn(p->a());
  Outstanding(p->a(), msn, IBV_WR_RDMA_WRITE, 128);
  // Each chunk names its own address and key, and each is checked.
  Inject(p->a(), Write(msn, wire::kFlagFirst, 64, 128, p->addr(kRegion - 64), p->rkey()));
  Inject(p->a(), Write(msn, wire::kFlagLast, 64, 128, p->addr(kRegion), p->rkey()));
  Expect e = NakExpected(msn, IBV_WC_REM_ACCESS_ERR);
  Place(e.region, kRegion - 64, 64, kPayloadByte);
  DriveAndCheck(*p, e);
}

TEST(HostileFrame, WriteOutsideMemoryWindow) {
  constexpr uint64_t kWindow = kTarget, kWindowLength = 4096;
  struct Case {
    const char* name;
    int64_t offset;  // from the window's start
  };
  for (const Case& c :
       {Case{"straddling the window's end", kWindowLength - 32}, Case{"before the window", -64}}) {
    SCOPED_TRACE(c.name);
    auto p = MakePair();
    ASSERT_NE(p, nullptr);
    // A type 2 window over part of B's region, bound through B's QP.
    std::unique_ptr<MemoryWindow> mw;
    uint32_t window_rkey = 0;
    ASSERT_TRUE(
        BindWindow(*p, kWindow, kWindowLength, IBV_ACCESS_REMOTE_WRITE, &mw, &window_rkey));

    // A valid WRITE through the window first (the key works), then one outside it, inside the
    // region the window is bound over.
    const uint32_t valid = TakeMsn(p->a());
    Inject(p->a(), Write(valid, kFirstLast, 64, 64, p->addr(kWindow + 512), window_rkey));
    const uint32_t msn = TakeMsn(p->a());
    Outstanding(p->a(), msn, IBV_WR_RDMA_WRITE, 64);
    Frame f = Write(msn, kFirstLast, 64, 64, p->addr(kWindow + c.offset), window_rkey);
    f.fill = '\xcd';
    Inject(p->a(), f);
    Expect e = NakExpected(msn, IBV_WC_REM_ACCESS_ERR);
    Place(e.region, kWindow + 512, 64, kPayloadByte);
    DriveAndCheck(*p, e);
  }
}

// ---- (9) Random frames ----------------------------------------------------------------------
//
// The cases above each aim at one rule. Here frames are drawn at random, biased toward the edges
// those rules guard (lengths around a chunk, addresses around the region, keys one bit off, MSNs
// and acks just out of sequence, flag and opcode bytes beyond the defined ones), a few per fresh
// pair. Whatever B makes of them, it may only ever write inside its registered region, its QP
// ends in RTS or ERR, and another pair on the same two devices keeps carrying messages. Each
// iteration's seed is its index, so a failure names what to replay; SWIRL_FUZZ_ITERATIONS runs
// more than the default.

uint64_t Pick(std::mt19937_64& rng, std::initializer_list<uint64_t> values) {
  return values.begin()[rng() % values.size()];
}

// `odds`: one field in `odds` is drawn from its hostile values (low: mostly well-formed frames
// that reach deep into the responder; high: mostly rejected ones).
Frame RandomFrame(std::mt19937_64& rng, Pair& p, uint32_t next_msn, uint64_t odds,
                  uint32_t window_rkey) {
  auto hostile = [&] { return rng() % odds == 0; };
  Frame f;
  // READs and atomics count as hostile: A never asked for their responses.
  const uint64_t kind = hostile() ? 9 + rng() % 7 : rng() % 9;
  f.op = kind < 5    ? uint8_t{wire::kOpSend}
         : kind < 9  ? uint8_t{wire::kOpWrite}
         : kind < 11 ? uint8_t{wire::kOpReadRequest}
         : kind < 12 ? uint8_t{wire::kOpCompareSwap}
         : kind < 13 ? uint8_t{wire::kOpFetchAdd}
         : kind < 14 ? uint8_t{wire::kOpPad}
                     : static_cast<uint8_t>(rng());
  // One draw per statement: the operands of | are evaluated in no fixed order, and a seed must
  // give the same frames whatever the compiler.
  uint64_t flags = hostile() ? Pick(rng, {wire::kFlagFirst, wire::kFlagLast, 0}) : kFirstLast;
  flags |= hostile() ? uint64_t{wire::kFlagWithInv}
                     : Pick(rng, {0, 0, 0, wire::kFlagWithImm, wire::kFlagSolicited});
  if (hostile()) flags = rng();
  f.flags = static_cast<uint8_t>(flags);
  f.length = static_cast<uint32_t>(
      hostile() ? Pick(rng, {wire::kMaxChunk + 1, rng() % (2 * wire::kMaxChunk), 0xffffffffu})
                : Pick(rng, {0, 1, 8, 16, 64, 4096, wire::kMaxChunk - 1, wire::kMaxChunk}));
  f.total_length =
      hostile() ? static_cast<uint32_t>(Pick(rng, {0, 1, 64, 1u << 20, rng()})) : f.length;
  f.msn = hostile() ? static_cast<uint32_t>(next_msn + Pick(rng, {1, 2, ~0ull, rng()})) : next_msn;
  if (hostile()) f.ack = static_cast<uint32_t>(rng());
  // What a SEND_WITH_INV names: mostly the window (a valid invalidation, once), else keys it
  // may not invalidate.
  f.imm_or_inv = static_cast<uint32_t>(
      hostile() ? Pick(rng, {p.rkey(), window_rkey ^ 1, rng()}) : window_rkey);
  f.extension = hostile();
  const int64_t offset = hostile() ? static_cast<int64_t>(rng())
                                   : static_cast<int64_t>(rng() % (kRegion + 2 * kGuard)) - kGuard;
  f.ext.remote_addr = p.addr(0) + static_cast<uint64_t>(offset);
  f.ext.rkey = static_cast<uint32_t>(
      hostile() ? Pick(rng, {p.rkey() ^ 1, p.rkey() ^ 0x100, window_rkey ^ 0x80, 0, rng()})
                : Pick(rng, {p.rkey(), window_rkey}));
  f.ext.length = hostile() ? static_cast<uint32_t>(rng() % (1 << 17)) : f.total_length;
  f.ext.compare_add = rng();
  f.ext.swap = rng();
  f.fill = static_cast<char>(rng());
  // The ring bytes the frame takes: what its claim needs when that fits a chunk, else one unit
  // (a frame that claims more than it holds).
  const uint64_t claimed = wire::FrameBytes(f.op, std::min(f.length, wire::kMaxChunk));
  f.reserve = f.length <= wire::kMaxChunk && !hostile() ? claimed : wire::kFrameAlign;
  return f;
}

TEST(HostileFrame, RandomFramesStayInsideTheRegion) {
  int iterations = 60;
  if (const char* env = std::getenv("SWIRL_FUZZ_ITERATIONS")) iterations = std::atoi(env);
  auto bystander = MakePair(/*post_recvs=*/false);
  ASSERT_NE(bystander, nullptr);
  int errors = 0, survived = 0;
  for (int seed = 0; seed < iterations; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937_64 rng(static_cast<uint64_t>(seed));
    auto p = MakePair();
    ASSERT_NE(p, nullptr);
    // A type 2 window with remote read and write over 16 KiB of the region: frames may write
    // through it, read through it, or invalidate it, rightly or not.
    std::unique_ptr<MemoryWindow> mw;
    uint32_t window_rkey = 0;
    ASSERT_TRUE(BindWindow(*p, 32 * 1024, 16 * 1024,
                           IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ, &mw, &window_rkey));
    p->b_send_wcs.clear();
    const int frames = 1 + static_cast<int>(rng() % 6);
    for (int k = 0; k < frames; ++k) {
      const uint32_t next = TakeMsn(p->a());
      Inject(p->a(), RandomFrame(rng, *p, next, seed % 2 == 0 ? 4 : 24, window_rkey));
    }
    // Drive until B has failed, has taken every frame, or waits for a receive (RNR), for at
    // most a second.
    const absl::Time deadline = absl::Now() + absl::Seconds(1);
    for (;;) {
      PollAll(*p);
      if (State(*p->b_qp) == IBV_QPS_ERR) break;
      {
        std::lock_guard<QpLock> lock(p->b()->lock);
        std::lock_guard<QpLock> a_lock(p->a()->lock);
        if (p->b()->rnr_waiting || p->b()->req_rx.tail() == p->a()->req_tx.head()) break;
      }
      if (absl::Now() > deadline) break;
    }
    const ibv_qp_state b_state = State(*p->b_qp);
    EXPECT_TRUE(b_state == IBV_QPS_ERR || b_state == IBV_QPS_RTS) << "B in state " << b_state;
    (b_state == IBV_QPS_ERR ? errors : survived) += 1;
    EXPECT_EQ(FirstMismatch(p->b_mem.mem.data(), kGuard, kGuardByte), kGuard)
        << "leading guard written";
    EXPECT_EQ(FirstMismatch(p->region() + kRegion, kGuard, kGuardByte), kGuard)
        << "trailing guard written";
    ASSERT_TRUE(BystanderRoundTrip(*bystander, static_cast<uint64_t>(seed)))
        << "the bystander pair stopped working";
    if (HasFailure()) break;
  }
  // The generator must reach both outcomes, or it tests less than it claims.
  EXPECT_GT(errors, 0);
  EXPECT_GT(survived, 0);
  std::printf("%d iterations: B failed the connection in %d, carried on in %d\n", iterations,
              errors, survived);
}

}  // namespace
}  // namespace swirl::soft::hostile
