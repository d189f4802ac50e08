// Completion queues: overflow is reported (IBV_EVENT_CQ_ERR and/or a failing ibv_poll_cq), and a
// CQ armed with ibv_req_notify_cq wakes a thread blocked on its completion channel even though
// nobody polls: the device makes the progress itself.

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <cstdio>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/cleanup/cleanup.h"
#include "transport/conformance/conformance.h"
#include "transport/device.h"
#include "transport/verbs/verbs.h"

namespace swirl::conformance {
namespace {

using verbs::CompletionChannel;

class CqTest : public DeviceTest {
 protected:
  // b_'s receive CQ reports to channel_; b_'s CQs are not progressed by this thread's waits.
  void ConnectWithChannel() {
    auto ctx = OpenDevice(device());
    ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
    auto pd = verbs::ProtectionDomain::Create(*ctx);
    ASSERT_TRUE(pd.ok()) << pd.status().ToString();
    auto channel = CompletionChannel::Create(*ctx);
    ASSERT_TRUE(channel.ok()) << channel.status().ToString();
    channel_ = *channel;
    EndpointOptions b_options;
    b_options.recv_channel = channel_;
    auto b = Endpoint::Create(*pd, b_options);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    auto a = Endpoint::Create(device());
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    a_ = std::move(*a);
    b_ = std::move(*b);
    SWIRL_ASSERT_OK(ConnectPair(*a_, *b_));
    ASSERT_NO_FATAL_FAILURE(WarmUp(*a_, *b_));
    Untrack(&b_->send_cq());
    Untrack(&b_->recv_cq());
  }

  std::shared_ptr<CompletionChannel> channel_;
};

TEST_P(CqTest, OverflowIsReported) {
  EndpointOptions a_options;
  a_options.cq_entries = 4;
  a_options.max_send_wr = 128;
  ASSERT_NO_FATAL_FAILURE(Connect(a_options));
  const int capacity = a_->send_cq().capacity();
  const int count = capacity + 2;
  ASSERT_GE(capacity, 4);
  if (count > static_cast<int>(a_->qp().cap().max_send_wr)) {
    GTEST_SKIP() << "CQ capacity " << capacity << " exceeds the send queue";
  }
  for (int i = 0; i < count; ++i) {
    ASSERT_EQ(SendWr(i, IBV_WR_RDMA_WRITE)
                  .Local(*a_, 64 * i, 64)
                  .Remote(b_->addr(64 * i), b_->rkey())
                  .Post(a_->ibqp()),
              0)
        << "WRITE " << i;
  }
  // Nobody takes completions off the small CQ; everything is progressed (poll_cq with 0
  // entries) until the device reports the overflow.
  bool cq_error_event = false;
  std::vector<std::string> other_events;
  const absl::Time deadline = absl::Now() + kTimeout;
  while (!cq_error_event && absl::Now() < deadline) {
    ProgressAll();
    absl::StatusOr<ibv_event_type> event = a_->context().WaitAsyncEvent(absl::ZeroDuration());
    if (!event.ok()) continue;
    if (*event == IBV_EVENT_CQ_ERR) {
      cq_error_event = true;
    } else {
      other_events.push_back(ibv_event_type_str(*event));
    }
  }
  ibv_wc wc[1];
  const int polled = ibv_poll_cq(a_->send_cq().get(), 1, wc);
  std::printf("CQ overflow on %s: IBV_EVENT_CQ_ERR %s, ibv_poll_cq returned %d\n", device().c_str(),
              cq_error_event ? "raised" : "not raised", polled);
  EXPECT_TRUE(cq_error_event || polled < 0)
      << "neither IBV_EVENT_CQ_ERR nor a failing ibv_poll_cq after " << count
      << " completions into a CQ of " << capacity;
  for (const std::string& event : other_events)
    std::printf("  other async event: %s\n", event.c_str());
}

TEST_P(CqTest, CompletionChannelWakesAWaiterThatDoesNotPoll) {
  ASSERT_NO_FATAL_FAILURE(ConnectWithChannel());
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
  SWIRL_ASSERT_OK(b_->recv_cq().RequestNotify());
  absl::StatusOr<ibv_cq*> fired = absl::UnknownError("never waited");
  std::thread waiter([&] { fired = channel_->WaitEvent(kTimeout); });
  // Joined on every way out: a failed ASSERT must not leave a joinable thread (std::terminate).
  absl::Cleanup join_waiter = [&] {
    if (waiter.joinable()) waiter.join();
  };

  FillPattern(a_->data(), 128, 1);
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 128).Post(a_->ibqp()), 0);
  // a_'s SEND completes only once b_ has taken it, which nobody here makes happen.
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  waiter.join();
  ASSERT_TRUE(fired.ok()) << fired.status().ToString();
  EXPECT_EQ(*fired, b_->recv_cq().get());

  ExpectWc(Poll(b_->recv_cq()), {.wr_id = 0xb0,
                                 .qp_num = b_->qpn(),
                                 .opcode = IBV_WC_RECV,
                                 .byte_len = 128,
                                 .src_qp = a_->qpn()});
  EXPECT_EQ(FindPatternMismatch(b_->data(), 128, 1), -1);
}

TEST_P(CqTest, SolicitedOnlyNotificationWaitsForASolicitedMessage) {
  ASSERT_NO_FATAL_FAILURE(ConnectWithChannel());
  ASSERT_EQ(b_->PostRecv(0xb0, 0, 4096), 0);
  ASSERT_EQ(b_->PostRecv(0xb1, 4096, 4096), 0);
  SWIRL_ASSERT_OK(b_->recv_cq().RequestNotify(/*solicited_only=*/true));

  // An unsolicited SEND: delivered (a_'s completion proves it) but no event.
  ASSERT_EQ(SendWr(1, IBV_WR_SEND).Local(*a_, 0, 16).Post(a_->ibqp()), 0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 1, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  absl::StatusOr<ibv_cq*> early = channel_->WaitEvent(absl::Milliseconds(100));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded)
      << "an unsolicited message fired a solicited-only CQ";

  // A solicited one fires it.
  absl::StatusOr<ibv_cq*> fired = absl::UnknownError("never waited");
  std::thread waiter([&] { fired = channel_->WaitEvent(kTimeout); });
  // Joined on every way out: a failed ASSERT must not leave a joinable thread (std::terminate).
  absl::Cleanup join_waiter = [&] {
    if (waiter.joinable()) waiter.join();
  };
  ASSERT_EQ(SendWr(2, IBV_WR_SEND, IBV_SEND_SIGNALED | IBV_SEND_SOLICITED)
                .Local(*a_, 0, 16)
                .Post(a_->ibqp()),
            0);
  ExpectWc(Poll(a_->send_cq()), {.wr_id = 2, .qp_num = a_->qpn(), .opcode = IBV_WC_SEND});
  waiter.join();
  ASSERT_TRUE(fired.ok()) << fired.status().ToString();
  EXPECT_EQ(*fired, b_->recv_cq().get());
  std::vector<ibv_wc> recvs = PollN(b_->recv_cq(), 2);
  ASSERT_EQ(recvs.size(), 2u);
  EXPECT_EQ(recvs[0].wr_id, 0xb0u);
  EXPECT_EQ(recvs[1].wr_id, 0xb1u);
}

// Completions of one receive queue come out in the order the messages arrived, whatever the
// batch a poll asks for and whenever messages land. The soft device hands a poll's own receive
// completions over without its ring while the ring is empty and queues them otherwise; this
// pins the order across both: one poll takes a single completion while more wait, then more
// messages land behind the queued ones and polls of every size take the rest.
TEST_P(CqTest, ReceiveCompletionsKeepTheirOrderWhateverThePollBatch) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  Untrack(&b_->recv_cq());  // only the polls below make b_'s receive progress
  constexpr int kPerBurst = 20;
  constexpr int kBursts = 2;
  for (int i = 0; i < kPerBurst * kBursts; ++i) {
    ASSERT_EQ(b_->PostRecv(0x1000 + i, 64 * static_cast<size_t>(i), 64), 0);
  }
  auto send_burst = [&](int burst) {
    for (int i = 0; i < kPerBurst; ++i) {
      const uint32_t seq = static_cast<uint32_t>(burst * kPerBurst + i);
      // One signaled send per burst: the send queue holds a burst.
      const unsigned int flags = i + 1 == kPerBurst ? IBV_SEND_SIGNALED : 0;
      ASSERT_EQ(SendWr(seq, IBV_WR_SEND_WITH_IMM, flags)
                    .Local(*a_, 0, 16)
                    .Imm(htonl(seq))
                    .Post(a_->ibqp()),
                0);
    }
  };
  uint32_t next = 0;
  // One poll of up to `want`; checks what it returns. Returns how many.
  auto poll = [&](int want) {
    ibv_wc wcs[64];
    const int got = b_->recv_cq().Poll(want, wcs);
    EXPECT_GE(got, 0);
    EXPECT_LE(got, want);
    for (int k = 0; k < got; ++k, ++next) {
      ExpectWc(wcs[k], {.wr_id = 0x1000 + next,
                        .qp_num = b_->qpn(),
                        .opcode = IBV_WC_RECV,
                        .byte_len = 16,
                        .wc_flags = IBV_WC_WITH_IMM,
                        .imm_data = htonl(next)});
    }
    return got;
  };

  ASSERT_NO_FATAL_FAILURE(send_burst(0));
  ASSERT_TRUE(WaitUntil([&] { return poll(1) == 1; }));
  ASSERT_NO_FATAL_FAILURE(send_burst(1));
  constexpr int kBatches[] = {64, 3, 16, 2, 1, 7};
  int batch = 0;
  ASSERT_TRUE(WaitUntil([&] {
    poll(kBatches[batch++ % std::size(kBatches)]);
    return next >= kPerBurst * kBursts;
  })) << "received " << next << " of " << kPerBurst * kBursts;
  EXPECT_EQ(next, static_cast<uint32_t>(kPerBurst * kBursts));
  for (int burst = 0; burst < kBursts; ++burst) {
    ExpectWc(Poll(a_->send_cq()), {.wr_id = static_cast<uint64_t>(burst + 1) * kPerBurst - 1,
                                   .qp_num = a_->qpn(),
                                   .opcode = IBV_WC_SEND});
  }
}

// Two threads poll one CQ shared by two QPs' receive queues while messages stream in. Each
// message is delivered exactly once, and each thread sees every queue's completions in order
// (completions of one work queue keep their order whoever polls them). On the soft device this
// runs its polls' progress concurrently: each QP is progressed by whichever poller gets it, its
// completions going to that poller directly or through the ring.
TEST_P(CqTest, TwoPollersOfOneCqSeeEachQueueInOrder) {
  constexpr int kQps = 2;
  constexpr uint32_t kPerQp = 200;
  constexpr uint32_t kSignalEvery = 16;
  std::shared_ptr<verbs::ProtectionDomain> pd;
  EndpointOptions shared;
  ASSERT_NO_FATAL_FAILURE(OpenReceiverSide(1024, &pd, &shared));
  const std::shared_ptr<verbs::CompletionQueue> recv_cq = shared.recv_cq;
  shared.max_recv_wr = kPerQp;
  std::vector<std::unique_ptr<Endpoint>> senders, receivers;
  ASSERT_NO_FATAL_FAILURE(ConnectReceivers(pd, shared, kQps, &senders, &receivers));
  for (auto& receiver : receivers) {
    for (uint32_t m = 0; m < kPerQp; ++m) {
      ASSERT_EQ(receiver->PostRecv(m, 64 * static_cast<size_t>(m), 64), 0);
    }
  }
  std::map<uint32_t, int> index_of_qpn;
  for (int i = 0; i < kQps; ++i) index_of_qpn[receivers[i]->qpn()] = i;

  std::atomic<uint32_t> received{0};
  const absl::Time deadline = absl::Now() + kTimeout;
  // Per poller: per QP, the sequence numbers in the order that poller saw them.
  std::vector<std::vector<std::vector<uint32_t>>> seen(2, std::vector<std::vector<uint32_t>>(kQps));
  std::vector<std::string> errors(2);
  auto poller = [&](int self) {
    ibv_wc wcs[4];
    int batch = self + 1;  // the two pollers ask for different batch sizes
    while (received.load() < kQps * kPerQp && absl::Now() < deadline) {
      const int got = recv_cq->Poll(batch, wcs);
      if (got < 0) {
        errors[self] = "ibv_poll_cq failed";
        return;
      }
      for (int k = 0; k < got; ++k) {
        const auto it = index_of_qpn.find(wcs[k].qp_num);
        if (wcs[k].status != IBV_WC_SUCCESS || it == index_of_qpn.end() ||
            !(wcs[k].wc_flags & IBV_WC_WITH_IMM)) {
          errors[self] = Describe(wcs[k]);
          return;
        }
        seen[self][it->second].push_back(ntohl(wcs[k].imm_data));
      }
      received.fetch_add(got);
      batch = batch == 4 ? 1 : batch + 1;
    }
  };
  std::thread first(poller, 0), second(poller, 1);
  absl::Cleanup join_pollers = [&] {
    if (first.joinable()) first.join();
    if (second.joinable()) second.join();
  };
  // The sender side: both QPs interleaved, one signaled SEND in kSignalEvery, whose completion
  // is awaited before the next group (it frees the send queue's slots).
  for (uint32_t m = 0; m < kPerQp; ++m) {
    for (int i = 0; i < kQps; ++i) {
      const bool signaled = (m + 1) % kSignalEvery == 0 || m + 1 == kPerQp;
      ASSERT_EQ(SendWr(m, IBV_WR_SEND_WITH_IMM, signaled ? IBV_SEND_SIGNALED : 0)
                    .Local(*senders[i], 0, 32)
                    .Imm(htonl(m))
                    .Post(senders[i]->ibqp()),
                0);
      if (signaled) {
        ExpectWc(Poll(senders[i]->send_cq()),
                 {.wr_id = m, .qp_num = senders[i]->qpn(), .opcode = IBV_WC_SEND});
      }
    }
  }
  first.join();
  second.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  ASSERT_EQ(received.load(), kQps * kPerQp);
  for (int i = 0; i < kQps; ++i) {
    std::vector<uint32_t> all;
    for (int self = 0; self < 2; ++self) {
      const std::vector<uint32_t>& mine = seen[self][i];
      for (size_t k = 1; k < mine.size(); ++k) {
        EXPECT_LT(mine[k - 1], mine[k]) << "poller " << self << ", QP " << i << ": out of order";
      }
      all.insert(all.end(), mine.begin(), mine.end());
    }
    std::sort(all.begin(), all.end());
    ASSERT_EQ(all.size(), kPerQp) << "QP " << i;
    for (uint32_t m = 0; m < kPerQp; ++m) EXPECT_EQ(all[m], m) << "QP " << i;
  }
}

SWIRL_INSTANTIATE_FOR_EVERY_DEVICE(CqTest);

}  // namespace
}  // namespace swirl::conformance
