// RC's transport timer, which every QP of the soft device runs, faults armed or not (faults.cc,
// RunTransportTimer; docs/SOFT_WIRE.md, "The transport timer"): a request that the peer leaves
// unanswered (no ack, no response, nothing of it consumed) for ACK timeout x (retry_cnt + 1)
// fails with IBV_WC_RETRY_EXC_ERR and the QP with it, as a NIC's retries run out; a pair that
// is idle, or whose peer answers late but within the timer, is never failed.
//
// A <-> B in this process (hostile_peer.h), nothing injected (the process stays unarmed, so
// its QPs take the steady-state paths). The HCA thread's progress for CQs nobody polls is off
// (BUILD): B answers only when the test polls it, so a B the test never polls is a peer that is
// alive, its link up, and never progressing its QP. transport_timer_test_tcp runs the same
// cases on the TCP fabric.

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "transport/soft/hostile_peer.h"
#include "transport/verbs/verbs.h"

namespace swirl::soft::hostile {
namespace {

// 4.096 us x 2^14 = 67 ms per try, 3 retries: the timer fails a request after about 268 ms.
constexpr uint8_t kTimeout = 14;
constexpr uint8_t kRetries = 3;
constexpr absl::Duration kTransportTimeout =
    absl::Nanoseconds((int64_t{4096} << kTimeout) * (kRetries + 1));

verbs::ConnectOptions TimerOptions() {
  verbs::ConnectOptions options;
  options.timeout = kTimeout;
  options.retry_cnt = kRetries;
  return options;
}

// B's progress: the test's poll of B's CQs is all that moves B.
void PollB(Pair& p) {
  ibv_wc wc[8];
  for (int n = p.b_recv_cq->Poll(8, wc); n > 0; n = p.b_recv_cq->Poll(8, wc)) {
    p.b_recv_wcs.insert(p.b_recv_wcs.end(), wc, wc + n);
  }
  for (int n = p.b_send_cq->Poll(8, wc); n > 0; n = p.b_send_cq->Poll(8, wc)) {
    p.b_send_wcs.insert(p.b_send_wcs.end(), wc, wc + n);
  }
}

// Calls `poll` until `done` holds, for at most `limit`; true if it did.
bool Until(const std::function<void()>& poll, const std::function<bool()>& done,
           absl::Duration limit = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + limit;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    poll();
  }
  return true;
}

// An unsignaled SEND of 64 bytes from A's region (into B's next receive).
bool PostUnsignaledSend(Pair& p, uint64_t wr_id) {
  ibv_sge sge{p.a_addr(0), 64, p.a_lkey()};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.opcode = IBV_WR_SEND;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_send_wr* bad = nullptr;
  return ibv_post_send(p.a_qp->get(), &wr, &bad) == 0;
}

bool AllSucceeded(const std::vector<ibv_wc>& wcs) {
  for (const ibv_wc& wc : wcs) {
    if (wc.status != IBV_WC_SUCCESS) return false;
  }
  return true;
}

// The request needs B's device to answer: a READ's and an atomic's response, a SEND's and a
// WRITE's ack. B never polled, each fails at the timer, not before, and B's QP is untouched.
TEST(TransportTimer, ARequestToAPeerThatNeverProgressesFailsWithRetryExceeded) {
  for (ibv_wr_opcode opcode : {IBV_WR_RDMA_READ, IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_SEND,
                               IBV_WR_RDMA_WRITE}) {
    SCOPED_TRACE(testing::Message() << "opcode " << opcode);
    std::unique_ptr<Pair> p = MakePair(/*post_recvs=*/true, TimerOptions());
    ASSERT_NE(p, nullptr);
    constexpr uint64_t kWrId = 0x77;
    const absl::Time posted = absl::Now();
    ASSERT_TRUE(PostRequest(*p, kWrId, opcode, 0,
                            opcode == IBV_WR_ATOMIC_FETCH_AND_ADD ? 8 : 4096));
    ASSERT_TRUE(Until([&] { PollA(*p); }, [&] { return !p->a_wcs.empty(); }))
        << "the request to a peer that never answers never completed";
    const absl::Duration waited = absl::Now() - posted;
    ASSERT_EQ(p->a_wcs.size(), 1u);
    EXPECT_EQ(p->a_wcs[0].wr_id, kWrId);
    EXPECT_EQ(p->a_wcs[0].status, IBV_WC_RETRY_EXC_ERR)
        << ibv_wc_status_str(p->a_wcs[0].status);
    EXPECT_GE(waited, kTransportTimeout) << "failed before ACK timeout x (retry_cnt + 1)";
    EXPECT_EQ(State(*p->a_qp), IBV_QPS_ERR);
    EXPECT_EQ(State(*p->b_qp), IBV_QPS_RTS) << "the live peer's QP was failed too";
  }
}

// Traffic, then several timer periods with nothing outstanding (the last SEND unsignaled, so
// A retires it only at a later completion, its ack word read), both sides polled: nothing
// fails, and the pair still works.
TEST(TransportTimer, AnIdlePairIsNotFailed) {
  std::unique_ptr<Pair> p = MakePair(/*post_recvs=*/true, TimerOptions());
  ASSERT_NE(p, nullptr);
  auto both = [&] { PollAll(*p); };
  ASSERT_TRUE(PostUnsignaledSend(*p, 1));
  ASSERT_TRUE(PostRequest(*p, 2, IBV_WR_RDMA_READ, 4096, 4096));
  ASSERT_TRUE(Until(both, [&] { return p->a_wcs.size() == 1 && p->b_recv_wcs.size() == 1; }));
  ASSERT_TRUE(PostUnsignaledSend(*p, 3));
  ASSERT_TRUE(Until(both, [&] { return p->b_recv_wcs.size() == 2; }));
  // Idle for four timer periods, A polled throughout and B now and then (a peer that moves
  // only when its owner polls, and has nothing to do).
  const absl::Time idle_until = absl::Now() + 4 * kTransportTimeout;
  absl::Time next_b = absl::Now();
  while (absl::Now() < idle_until) {
    PollA(*p);
    if (absl::Now() >= next_b) {
      PollB(*p);
      next_b = absl::Now() + kTransportTimeout / 2;
    }
  }
  EXPECT_EQ(p->a_wcs.size(), 1u) << "a completion for nothing outstanding";
  EXPECT_TRUE(AllSucceeded(p->a_wcs));
  EXPECT_TRUE(AllSucceeded(p->b_recv_wcs));
  ASSERT_EQ(State(*p->a_qp), IBV_QPS_RTS) << "the idle pair's requester was failed";
  ASSERT_EQ(State(*p->b_qp), IBV_QPS_RTS);
  ASSERT_TRUE(PostRequest(*p, 4, IBV_WR_RDMA_READ, 8192, 4096));
  ASSERT_TRUE(Until(both, [&] { return p->a_wcs.size() == 2; }));
  EXPECT_TRUE(AllSucceeded(p->a_wcs));
  EXPECT_EQ(p->a_wcs[1].wr_id, 4u);
}

// B polled only every fifth of the timer: each READ waits up to that long, A's send queue is
// never empty for long, and the whole run lasts three timer periods. The timer counts from the
// last thing B did for A's requests, so none fails.
TEST(TransportTimer, APeerThatAnswersLateButWithinTheTimerIsNotFailed) {
  std::unique_ptr<Pair> p = MakePair(/*post_recvs=*/true, TimerOptions());
  ASSERT_NE(p, nullptr);
  uint64_t posted = 0;
  ASSERT_TRUE(PostRequest(*p, ++posted, IBV_WR_RDMA_READ, 0, 4096));
  const absl::Time end = absl::Now() + 3 * kTransportTimeout;
  absl::Time next_b = absl::Now() + kTransportTimeout / 5;
  while (absl::Now() < end) {
    PollA(*p);
    if (p->a_wcs.size() == posted) {
      if (p->a_wcs.back().status != IBV_WC_SUCCESS) break;
      ASSERT_TRUE(PostRequest(*p, ++posted, IBV_WR_RDMA_READ, 0, 4096));
    }
    if (absl::Now() >= next_b) {
      PollB(*p);
      next_b = absl::Now() + kTransportTimeout / 5;
    }
  }
  ASSERT_TRUE(AllSucceeded(p->a_wcs))
      << "READ " << p->a_wcs.size() << " failed: " << ibv_wc_status_str(p->a_wcs.back().status);
  // About fifteen READs, each answered a fifth of the timer after it was posted.
  EXPECT_GE(p->a_wcs.size(), 5u) << "B answered too few READs for the run to span the timer";
  EXPECT_EQ(State(*p->a_qp), IBV_QPS_RTS);
}

}  // namespace
}  // namespace swirl::soft::hostile
