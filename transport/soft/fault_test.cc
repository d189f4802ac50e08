// Injected faults (soft_device.h, "Injected faults"; docs/SOFT_WIRE.md), each at the verbs level
// on a QP pair A <-> B of this process (hostile_peer.h): the fault is armed on one QP, and the
// test checks what the other, the survivor, reports (its completions' statuses and its state),
// which must be what a real RC requester or responder reports for that fault, and that a
// bystander pair on the same two devices keeps working. fault_test_tcp runs the same cases on
// the TCP fabric.
//
// Injecting a fault arms the process: every QP runs RC's transport timer from then on, so the
// timer cases expect RETRY_EXC_ERR no sooner than ConnectOptions' ACK timeout x (retry_cnt + 1);
// the cases that must not depend on the timer connect with timeout 0 (no timer), so only the
// fault itself can end their requests.

#include <poll.h>

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "transport/soft/hostile_peer.h"
#include "transport/soft/soft_device.h"
#include "transport/verbs/verbs.h"

namespace swirl::soft::hostile {
namespace {

using Action = FaultSpec::Action;

// ConnectOptions' defaults: 4.096 us x 2^14 per try, 7 retries.
constexpr absl::Duration kTransportTimeout = absl::Nanoseconds((int64_t{4096} << 14) * 8);
constexpr uint64_t kSendWrId = 0x5e;
constexpr uint64_t kARecvWrId = 0xa0;

verbs::ConnectOptions NoTimer() {
  verbs::ConnectOptions options;
  options.timeout = 0;  // an RC QP with timeout 0 waits for its peer for ever
  return options;
}

// A SEND of `length` bytes from `offset` in the sender's region (A's or B's).
void PostSend(Pair& p, bool from_a, uint64_t wr_id, uint64_t offset, uint32_t length) {
  ibv_sge sge{from_a ? p.a_addr(static_cast<int64_t>(offset)) : p.addr(static_cast<int64_t>(offset)),
              length, from_a ? p.a_lkey() : p.b_mem.mr->lkey()};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(from_a ? p.a_qp->get() : p.b_qp->get(), &wr, &bad), 0);
}

void PostReceiveOnA(Pair& p) {
  ibv_sge sge{p.a_addr(64 * 1024), 4096, p.a_lkey()};
  ibv_recv_wr wr{kARecvWrId, nullptr, &sge, 1};
  ibv_recv_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_recv(p.a_qp->get(), &wr, &bad), 0);
}

// Polls both sides until `done` holds, for at most `limit`; true if it did.
bool PollUntil(Pair& p, const std::function<bool()>& done,
               absl::Duration limit = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + limit;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    PollAll(p);
  }
  return true;
}

// A's completions of its sends (not its receive).
std::vector<ibv_wc> ASends(const Pair& p) {
  std::vector<ibv_wc> out;
  for (const ibv_wc& wc : p.a_wcs) {
    if (wc.opcode != IBV_WC_RECV) out.push_back(wc);
  }
  return out;
}

bool AnySuccess(const std::vector<ibv_wc>& wcs) {
  return std::any_of(wcs.begin(), wcs.end(),
                     [](const ibv_wc& wc) { return wc.status == IBV_WC_SUCCESS; });
}

void FillPattern(char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<char>(i * 7 + 3);
}

class Faults : public ::testing::Test {
 protected:
  void SetUp() override {
    bystander_ = MakePair(/*post_recvs=*/false);
    ASSERT_NE(bystander_, nullptr);
  }
  void TearDown() override {
    EXPECT_TRUE(BystanderRoundTrip(*bystander_, ++round_)) << "the bystander pair stopped working";
  }

  std::unique_ptr<Pair> bystander_;
  uint64_t round_ = 0;
};

TEST(FaultRules, ParseWhatTheEnvironmentSays) {
  absl::StatusOr<std::vector<FaultRule>> rules = ParseFaultRules(
      "qp=*,at_frame=3,action=stall:250; qp=0x1a2b,action=drop;qp=#2,at_frame=1,action=corrupt;"
      "action=fail;qp=77,action=err;qp=*,action=noack");
  ASSERT_TRUE(rules.ok()) << rules.status();
  ASSERT_EQ(rules->size(), 6u);
  EXPECT_EQ((*rules)[0].match, FaultRule::Match::kAny);
  EXPECT_EQ((*rules)[0].spec.at_frame, 3u);
  EXPECT_EQ((*rules)[0].spec.action, Action::kStall);
  EXPECT_EQ((*rules)[0].spec.stall_ms, 250u);
  EXPECT_EQ((*rules)[1].match, FaultRule::Match::kQpNum);
  EXPECT_EQ((*rules)[1].value, 0x1a2bu);
  EXPECT_EQ((*rules)[1].spec.at_frame, 0u);
  EXPECT_EQ((*rules)[1].spec.action, Action::kDrop);
  EXPECT_EQ((*rules)[2].match, FaultRule::Match::kOrdinal);
  EXPECT_EQ((*rules)[2].value, 2u);
  EXPECT_EQ((*rules)[2].spec.action, Action::kCorrupt);
  EXPECT_EQ((*rules)[3].match, FaultRule::Match::kAny);
  EXPECT_EQ((*rules)[3].spec.action, Action::kFail);
  EXPECT_EQ((*rules)[4].value, 77u);
  EXPECT_EQ((*rules)[4].spec.action, Action::kErr);
  EXPECT_EQ((*rules)[5].spec.action, Action::kNoAck);
  absl::StatusOr<std::vector<FaultRule>> none = ParseFaultRules("none");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST(FaultRules, RefuseWhatTheyCannotMean) {
  for (const char* text :
       {"", "qp=*", "action=explode", "action=stall", "action=stall:soon", "qp=#0,action=drop",
        "qp=0,action=drop", "qp=0x1000000,action=drop", "qp=abc,action=drop",
        "at_frame=-1,action=drop", "at_frame=x,action=drop", "colour=red,action=drop",
        "qp,action=drop", "qp=,action=drop"}) {
    absl::StatusOr<std::vector<FaultRule>> rules = ParseFaultRules(text);
    EXPECT_FALSE(rules.ok()) << "'" << text << "' parsed";
    if (!rules.ok()) {
      EXPECT_EQ(rules.status().code(), absl::StatusCode::kInvalidArgument) << rules.status();
    }
  }
}

// A stalled responder answers late, and correctly.
TEST_F(Faults, StalledResponderCompletesLateAndCorrectly) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  FillPattern(p->a_region(), 1000);
  const absl::Time injected = absl::Now();
  ASSERT_TRUE(InjectFault(p->b_qp->get(), {Action::kStall, 0, 300}).ok());
  PollAll(*p);  // B's next progress: the stall begins
  PostSend(*p, /*from_a=*/true, kSendWrId, 0, 1000);
  ASSERT_TRUE(PollUntil(*p, [&] { return !p->a_wcs.empty() && !p->b_recv_wcs.empty(); }));
  const absl::Duration took = absl::Now() - injected;
  ASSERT_EQ(p->a_wcs.size(), 1u);
  EXPECT_EQ(p->a_wcs[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(p->a_wcs[0].status);
  ASSERT_EQ(p->b_recv_wcs.size(), 1u);
  EXPECT_EQ(p->b_recv_wcs[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(p->b_recv_wcs[0].wr_id, kRecvWrId1);
  EXPECT_EQ(p->b_recv_wcs[0].byte_len, 1000u);
  std::vector<char> want(1000);
  FillPattern(want.data(), want.size());
  EXPECT_EQ(std::memcmp(p->region() + kRecv1Offset, want.data(), want.size()), 0);
  EXPECT_GE(took, absl::Milliseconds(300)) << "the stalled responder answered during its stall";
  EXPECT_EQ(State(*p->a_qp), IBV_QPS_RTS);
  EXPECT_EQ(State(*p->b_qp), IBV_QPS_RTS);
}

// A requester stalled at its first frame holds the frame back, then sends it.
TEST_F(Faults, StalledRequesterSendsItsFrameWhenTheStallEnds) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  FillPattern(p->a_region(), 64);
  const absl::Time injected = absl::Now();
  ASSERT_TRUE(InjectFault(p->a_qp->get(), {Action::kStall, 1, 300}).ok());
  PostSend(*p, /*from_a=*/true, kSendWrId, 0, 64);
  ASSERT_TRUE(PollUntil(*p, [&] { return !p->a_wcs.empty() && !p->b_recv_wcs.empty(); }));
  EXPECT_GE(absl::Now() - injected, absl::Milliseconds(300));
  EXPECT_EQ(p->a_wcs[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(p->a_wcs[0].status);
  EXPECT_EQ(p->b_recv_wcs[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(p->b_recv_wcs[0].byte_len, 64u);
  std::vector<char> want(64);
  FillPattern(want.data(), want.size());
  EXPECT_EQ(std::memcmp(p->region() + kRecv1Offset, want.data(), want.size()), 0);
}

// A stall longer than the requester's ACK timeout: the requester gives up, as RC's retries do.
TEST_F(Faults, StallPastThePeersAckTimeoutFailsItsRequest) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  ASSERT_TRUE(InjectFault(p->b_qp->get(), {Action::kStall, 0, 3000}).ok());
  PollAll(*p);
  const absl::Time posted = absl::Now();
  PostSend(*p, /*from_a=*/true, kSendWrId, 0, 64);
  ASSERT_TRUE(PollUntil(*p, [&] { return !p->a_wcs.empty(); }));
  EXPECT_EQ(p->a_wcs[0].status, IBV_WC_RETRY_EXC_ERR) << ibv_wc_status_str(p->a_wcs[0].status);
  EXPECT_GE(absl::Now() - posted, kTransportTimeout);
  EXPECT_EQ(State(*p->a_qp), IBV_QPS_ERR);
}

// A peer that stops acknowledging: the requester's request fails at its ACK timeout, and the
// silent responder has taken none of it.
TEST_F(Faults, NoAckFailsThePeersRequestAtItsAckTimeout) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  ASSERT_TRUE(InjectFault(p->b_qp->get(), {Action::kNoAck, 0, 0}).ok());
  PollAll(*p);
  const absl::Time posted = absl::Now();
  PostSend(*p, /*from_a=*/true, kSendWrId, 0, 64);
  ASSERT_TRUE(PollUntil(*p, [&] { return !p->a_wcs.empty(); }));
  EXPECT_GE(absl::Now() - posted, kTransportTimeout);
  EXPECT_EQ(p->a_wcs[0].status, IBV_WC_RETRY_EXC_ERR) << ibv_wc_status_str(p->a_wcs[0].status);
  EXPECT_EQ(State(*p->a_qp), IBV_QPS_ERR);
  PollAll(*p);
  EXPECT_FALSE(AnySuccess(p->b_recv_wcs)) << "the silent responder received the SEND";
  // B sent nothing: like a NIC, it learns nothing until it does, and keeps its receives.
  EXPECT_EQ(State(*p->b_qp), IBV_QPS_RTS);
  EXPECT_TRUE(p->b_recv_wcs.empty());
}

// A dropped link carries nothing either way: each side's request fails at its own ACK timeout,
// and neither learns anything sooner (A's error state does not reach B either).
TEST_F(Faults, DroppedLinkFailsEachSideAtItsOwnAckTimeout) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  ASSERT_NO_FATAL_FAILURE(PostReceiveOnA(*p));
  ASSERT_TRUE(InjectFault(p->a_qp->get(), {Action::kDrop, 1, 0}).ok());
  const absl::Time a_posted = absl::Now();
  PostSend(*p, /*from_a=*/true, kSendWrId, 0, 64);  // frame 1: the link drops here
  ASSERT_TRUE(PollUntil(*p, [&] { return !ASends(*p).empty(); }));
  EXPECT_GE(absl::Now() - a_posted, kTransportTimeout);
  EXPECT_EQ(ASends(*p)[0].status, IBV_WC_RETRY_EXC_ERR)
      << ibv_wc_status_str(ASends(*p)[0].status);
  EXPECT_EQ(State(*p->a_qp), IBV_QPS_ERR);
  // A is in ERR, which B would see at once over a working link (its next request would fail
  // straight away): over the dropped one, B's request waits out B's own timer.
  EXPECT_FALSE(AnySuccess(p->b_recv_wcs)) << "B received A's SEND over a dropped link";
  EXPECT_EQ(State(*p->b_qp), IBV_QPS_RTS);
  const absl::Time b_posted = absl::Now();
  PostSend(*p, /*from_a=*/false, kSendWrId, 0, 64);
  ASSERT_TRUE(PollUntil(*p, [&] { return !p->b_send_wcs.empty(); }));
  EXPECT_GE(absl::Now() - b_posted, kTransportTimeout);
  EXPECT_EQ(p->b_send_wcs[0].status, IBV_WC_RETRY_EXC_ERR)
      << ibv_wc_status_str(p->b_send_wcs[0].status);
  EXPECT_EQ(State(*p->b_qp), IBV_QPS_ERR);
}

// A failed link (both ends see it): what was acknowledged before stays done, the request at
// the failure and the peer's next one fail with RETRY_EXC_ERR, with no timer to help.
TEST_F(Faults, FailedLinkFailsTheOutstandingAndTheNextRequests) {
  auto p = MakePair(/*post_recvs=*/true, NoTimer());
  ASSERT_NE(p, nullptr);
  FillPattern(p->a_region(), 64);
  ASSERT_TRUE(InjectFault(p->a_qp->get(), {Action::kFail, 2, 0}).ok());
  PostSend(*p, /*from_a=*/true, 1, 0, 64);  // frame 1: delivered
  ASSERT_TRUE(PollUntil(*p, [&] { return p->a_wcs.size() == 1 && p->b_recv_wcs.size() == 1; }));
  EXPECT_EQ(p->a_wcs[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(p->b_recv_wcs[0].status, IBV_WC_SUCCESS);
  PostSend(*p, /*from_a=*/true, 2, 0, 64);  // frame 2: the link fails
  ASSERT_TRUE(PollUntil(*p, [&] { return p->a_wcs.size() == 2; }));
  EXPECT_EQ(p->a_wcs[1].wr_id, 2u);
  EXPECT_EQ(p->a_wcs[1].status, IBV_WC_RETRY_EXC_ERR) << ibv_wc_status_str(p->a_wcs[1].status);
  EXPECT_EQ(State(*p->a_qp), IBV_QPS_ERR);
  // B had nothing outstanding: it stays, with its other receive, until it sends.
  EXPECT_EQ(State(*p->b_qp), IBV_QPS_RTS);
  EXPECT_EQ(p->b_recv_wcs.size(), 1u);
  PostSend(*p, /*from_a=*/false, kSendWrId, 0, 64);
  ASSERT_TRUE(PollUntil(*p, [&] { return !p->b_send_wcs.empty(); }));
  EXPECT_EQ(p->b_send_wcs[0].status, IBV_WC_RETRY_EXC_ERR)
      << ibv_wc_status_str(p->b_send_wcs[0].status);
  EXPECT_EQ(State(*p->b_qp), IBV_QPS_ERR);
}

// A QP killed into ERR: its work flushes, the device raises IBV_EVENT_QP_FATAL for it, and its
// peer's next request fails, with no timer to help.
TEST_F(Faults, KilledQpFlushesRaisesFatalAndItsPeerFails) {
  auto p = MakePair(/*post_recvs=*/true, NoTimer());
  ASSERT_NE(p, nullptr);
  ASSERT_NO_FATAL_FAILURE(PostReceiveOnA(*p));
  ASSERT_TRUE(InjectFault(p->a_qp->get(), {Action::kErr, 1, 0}).ok());
  PostSend(*p, /*from_a=*/true, kSendWrId, 0, 64);  // frame 1: the QP dies
  ASSERT_TRUE(PollUntil(*p, [&] { return p->a_wcs.size() == 2; }));
  for (const ibv_wc& wc : p->a_wcs) {
    EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR) << "wr " << wc.wr_id << ": "
                                              << ibv_wc_status_str(wc.status);
  }
  EXPECT_EQ(State(*p->a_qp), IBV_QPS_ERR);
  absl::StatusOr<ibv_async_event> event = p->a_ctx->NextAsyncEvent(absl::Seconds(5));
  ASSERT_TRUE(event.ok()) << event.status();
  EXPECT_EQ(event->event_type, IBV_EVENT_QP_FATAL);
  EXPECT_EQ(event->element.qp, p->a_qp->get());
  PostSend(*p, /*from_a=*/false, kSendWrId, 0, 64);
  ASSERT_TRUE(PollUntil(*p, [&] { return !p->b_send_wcs.empty(); }));
  EXPECT_EQ(p->b_send_wcs[0].status, IBV_WC_RETRY_EXC_ERR)
      << ibv_wc_status_str(p->b_send_wcs[0].status);
  EXPECT_FALSE(AnySuccess(p->b_recv_wcs)) << "B received the SEND of a QP that died sending it";
}

// As libibverbs' destroys (and the kernel's count of events read) promise: a QP's destroy
// waits until every asynchronous event handed out on it is acknowledged, since the
// acknowledgement locks the QP's mutex; events never handed out go with the QP, unawaited.
TEST_F(Faults, ADestroyWaitsForTheAcknowledgementOfEachEventHandedOutOnItsQp) {
  auto p = MakePair(/*post_recvs=*/true, NoTimer());
  ASSERT_NE(p, nullptr);
  ASSERT_NO_FATAL_FAILURE(PostReceiveOnA(*p));
  ASSERT_TRUE(InjectFault(p->a_qp->get(), {Action::kErr, 1, 0}).ok());
  PostSend(*p, /*from_a=*/true, kSendWrId, 0, 64);  // frame 1: the QP dies, FATAL is raised
  ASSERT_TRUE(PollUntil(*p, [&] { return p->a_wcs.size() == 2; }));
  ibv_async_event event;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  int err = EAGAIN;
  while (err == EAGAIN && absl::Now() < deadline) err = p->a_ctx->ops().GetAsyncEvent(&event);
  ASSERT_EQ(err, 0);
  // Acknowledged below; on an early return too, or the pair's teardown waits out the bound.
  bool acked = false;
  struct AckGuard {
    std::function<void()> fn;
    ~AckGuard() { fn(); }
  } guard{[&] {
    if (!acked) p->a_ctx->ops().AckAsyncEvent(&event);
  }};
  ASSERT_EQ(event.event_type, IBV_EVENT_QP_FATAL);
  ASSERT_EQ(event.element.qp, p->a_qp->get());

  std::atomic<bool> destroyed{false};
  std::thread destroyer([&] {
    p->a_qp.reset();
    destroyed.store(true);
  });
  // Not acknowledged yet: the destroy must still be waiting a while later.
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(destroyed.load()) << "the QP was destroyed under an unacknowledged event";
  p->a_ctx->ops().AckAsyncEvent(&event);
  acked = true;
  const absl::Time ack_deadline = absl::Now() + absl::Seconds(5);
  while (!destroyed.load() && absl::Now() < ack_deadline) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_TRUE(destroyed.load()) << "the destroy did not end after the acknowledgement";
  destroyer.join();

  // B's QP, killed the same way, its event left queued: its destroy drops the event and does
  // not wait (well within the 10 s a missing acknowledgement is given).
  ASSERT_TRUE(InjectFault(p->b_qp->get(), {Action::kErr, 0, 0}).ok());
  PostSend(*p, /*from_a=*/false, kSendWrId, 0, 64);
  ASSERT_TRUE(PollUntil(*p, [&] { return !p->b_send_wcs.empty(); }));
  pollfd raised{p->b_ctx->get()->async_fd, POLLIN, 0};
  ASSERT_EQ(poll(&raised, 1, 5000), 1) << "B's QP raised no event to leave queued";
  const absl::Time start = absl::Now();
  p->b_qp.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  absl::StatusOr<ibv_async_event> left = p->b_ctx->NextAsyncEvent(absl::ZeroDuration());
  EXPECT_FALSE(left.ok()) << "an event of a destroyed QP was handed out: " << left->event_type;
}

// A corrupted request: the responder refuses the frame (a protocol error: it fails, flushing its
// receives), and the requester's request fails as over a peer gone into error.
TEST_F(Faults, CorruptedRequestIsAProtocolErrorAtTheResponder) {
  auto p = MakePair(/*post_recvs=*/true, NoTimer());
  ASSERT_NE(p, nullptr);
  ASSERT_TRUE(InjectFault(p->a_qp->get(), {Action::kCorrupt, 1, 0}).ok());
  PostSend(*p, /*from_a=*/true, kSendWrId, 0, 64);
  ASSERT_TRUE(PollUntil(*p, [&] { return !p->a_wcs.empty() && p->b_recv_wcs.size() == 2; }));
  EXPECT_EQ(State(*p->b_qp), IBV_QPS_ERR);
  for (const ibv_wc& wc : p->b_recv_wcs) EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(p->a_wcs[0].status, IBV_WC_RETRY_EXC_ERR) << ibv_wc_status_str(p->a_wcs[0].status);
  EXPECT_EQ(State(*p->a_qp), IBV_QPS_ERR);
  EXPECT_EQ(p->b_mem.FirstGuardWritten(), -1);
}

// A corrupted response: the requester completes its READ with IBV_WC_BAD_RESP_ERR and places
// nothing.
TEST_F(Faults, CorruptedResponseIsABadResponseAtTheRequester) {
  auto p = MakePair(/*post_recvs=*/true, NoTimer());
  ASSERT_NE(p, nullptr);
  FillPattern(p->region() + 96 * 1024, 256);
  ASSERT_TRUE(InjectFault(p->b_qp->get(), {Action::kCorrupt, 1, 0}).ok());
  ASSERT_TRUE(PostRequest(*p, kSendWrId, IBV_WR_RDMA_READ, 96 * 1024, 256));
  ASSERT_TRUE(PollUntil(*p, [&] { return !p->a_wcs.empty(); }));
  EXPECT_EQ(p->a_wcs[0].status, IBV_WC_BAD_RESP_ERR) << ibv_wc_status_str(p->a_wcs[0].status);
  EXPECT_EQ(State(*p->a_qp), IBV_QPS_ERR);
  EXPECT_EQ(FirstMismatch(p->a_region() + 96 * 1024, 256, kFillByte), 256u)
      << "the requester placed a corrupted response";
}

// A fault in progress is not replaced under the QP's feet.
TEST_F(Faults, InjectingDuringAStallIsRefused) {
  auto p = MakePair();
  ASSERT_NE(p, nullptr);
  ASSERT_TRUE(InjectFault(p->a_qp->get(), {Action::kStall, 0, 200}).ok());
  PollAll(*p);
  const absl::Status again = InjectFault(p->a_qp->get(), {Action::kErr, 0, 0});
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_EQ(State(*p->a_qp), IBV_QPS_RTS);
}

}  // namespace
}  // namespace swirl::soft::hostile
