#include "rpc/send_queue.h"

#include <vector>

#include "gtest/gtest.h"

namespace swirl::internal {
namespace {

// Queues one WR holding `buffer` and `op`, as the worker writes one.
uint64_t QueueOne(SendQueue& q, int32_t buffer = SendQueue::kNothing,
                  int32_t op = SendQueue::kNothing) {
  ibv_send_wr& wr = q.next_wr();
  wr = ibv_send_wr{};
  wr.opcode = IBV_WR_SEND;
  return q.Commit(buffer, op);
}

// What a doorbell posted: the chain, in order.
struct Posted {
  std::vector<uint64_t> seqs;
  std::vector<bool> signaled;
};
Posted Ring(SendQueue& q, int result = 0) {
  Posted posted;
  EXPECT_EQ(q.Flush([&](ibv_send_wr* wr) {
              for (; wr != nullptr; wr = wr->next) {
                posted.seqs.push_back(wr->wr_id);
                posted.signaled.push_back((wr->send_flags & IBV_SEND_SIGNALED) != 0);
              }
              return result;
            }),
            result);
  return posted;
}

TEST(SendQueueTest, OneDoorbellPostsTheWholeBatchInOrder) {
  SendQueue q;
  q.Init(128);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(QueueOne(q), static_cast<uint64_t>(i + 1));
  EXPECT_FALSE(q.empty());
  int doorbells = 0;
  std::vector<uint64_t> seqs;
  q.Flush([&](ibv_send_wr* wr) {
    ++doorbells;
    for (; wr != nullptr; wr = wr->next) seqs.push_back(wr->wr_id);
    return 0;
  });
  EXPECT_EQ(doorbells, 1);
  EXPECT_EQ(seqs, (std::vector<uint64_t>{1, 2, 3, 4, 5}));
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(q.Flush([](ibv_send_wr*) { return 99; }), 0) << "an empty batch rings nothing";
}

TEST(SendQueueTest, TheBatchIsFullAtThirtyTwo) {
  SendQueue q;
  q.Init(128);
  for (int i = 0; i < SendQueue::kBatch; ++i) {
    EXPECT_FALSE(q.full());
    QueueOne(q);
  }
  EXPECT_TRUE(q.full());
  EXPECT_EQ(Ring(q).seqs.size(), static_cast<size_t>(SendQueue::kBatch));
}

TEST(SendQueueTest, SignalsWhatHoldsSomethingAndEverySixteenthOtherwise) {
  SendQueue q;
  q.Init(1024);
  for (int i = 0; i < 15; ++i) QueueOne(q);
  QueueOne(q);  // the 16th unsignaled in a row: signaled
  QueueOne(q, /*buffer=*/3);
  QueueOne(q, SendQueue::kNothing, /*op=*/0);
  QueueOne(q);
  const Posted p = Ring(q);
  for (int i = 0; i < 15; ++i) EXPECT_FALSE(p.signaled[i]) << i;
  EXPECT_TRUE(p.signaled[15]);
  EXPECT_TRUE(p.signaled[16]) << "holds a send buffer";
  EXPECT_TRUE(p.signaled[17]) << "a bulk operation waits for it";
  EXPECT_FALSE(p.signaled[18]);
}

TEST(SendQueueTest, SignalsBeforeUnsignaledWorkCouldFillTheQueue) {
  SendQueue q;
  q.Init(/*depth=*/20);
  // Nothing completes: by the fifth outstanding WR, 5 + 16 >= 20 and every WR is signaled.
  std::vector<bool> signaled;
  for (int i = 0; i < 8; ++i) {
    QueueOne(q);
    for (bool s : Ring(q).signaled) signaled.push_back(s);
  }
  EXPECT_FALSE(signaled[2]);
  EXPECT_TRUE(signaled[3]) << "seq 4: 4 + 16 >= 20";
  EXPECT_TRUE(signaled[7]);
}

TEST(SendQueueTest, ACompletionRetiresEveryWrUpToItAndWhatTheyHeld) {
  SendQueue q;
  q.Init(128);
  QueueOne(q, /*buffer=*/10);
  QueueOne(q);
  QueueOne(q, SendQueue::kNothing, /*op=*/4);
  const uint64_t last = QueueOne(q, /*buffer=*/11);
  Ring(q);
  EXPECT_EQ(q.outstanding(), 4u);
  std::vector<uint64_t> seqs;
  std::vector<int32_t> buffers, ops;
  ASSERT_TRUE(q.Retire(3, [&](uint64_t s, int32_t b, int32_t o) {
    seqs.push_back(s);
    buffers.push_back(b);
    ops.push_back(o);
  }));
  // Seq 2 holds nothing: retired without a call.
  EXPECT_EQ(seqs, (std::vector<uint64_t>{1, 3}));
  EXPECT_EQ(buffers, (std::vector<int32_t>{10, -1}));
  EXPECT_EQ(ops, (std::vector<int32_t>{-1, 4}));
  EXPECT_FALSE(q.all_retired());
  buffers.clear();
  ASSERT_TRUE(q.Retire(last, [&](uint64_t, int32_t b, int32_t) { buffers.push_back(b); }));
  EXPECT_EQ(buffers, (std::vector<int32_t>{11}));
  EXPECT_TRUE(q.all_retired());
  int again = 0;
  EXPECT_TRUE(q.Retire(last, [&](uint64_t, int32_t, int32_t) { ++again; }));
  EXPECT_EQ(again, 0) << "retired once";
}

TEST(SendQueueTest, ACompletionForNoWrPostedIsAStray) {
  SendQueue q;
  q.Init(128);
  QueueOne(q, 1);
  Ring(q);
  int retired = 0;
  EXPECT_FALSE(q.Retire(2, [&](uint64_t, int32_t, int32_t) { ++retired; }));
  EXPECT_FALSE(q.Retire(~uint64_t{0}, [&](uint64_t, int32_t, int32_t) { ++retired; }));
  EXPECT_EQ(retired, 0);
  EXPECT_EQ(q.outstanding(), 1u);
}

TEST(SendQueueTest, DroppingTheUnpostedBatchGivesBuffersBackAndReusesItsNumbers) {
  SendQueue q;
  q.Init(128);
  QueueOne(q, 1);
  Ring(q);
  QueueOne(q, 2);
  QueueOne(q);
  QueueOne(q, 3);
  std::vector<int32_t> released;
  q.DropUnposted([&](int32_t b) { released.push_back(b); });
  EXPECT_EQ(released, (std::vector<int32_t>{2, 3}));
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(q.TakeSeq(), 2u) << "the dropped WRs' sequence numbers are used again";
}

TEST(SendQueueTest, ForgettingOutstandingWrsGivesTheirBuffersBack) {
  SendQueue q;
  q.Init(128);
  QueueOne(q, 5);
  QueueOne(q);
  QueueOne(q, 6);
  Ring(q);
  q.Retire(1, [](uint64_t, int32_t, int32_t) {});
  std::vector<int32_t> released;
  q.ForgetOutstanding([&](int32_t b) { released.push_back(b); });
  EXPECT_EQ(released, (std::vector<int32_t>{6}));
  EXPECT_TRUE(q.all_retired());
}

TEST(SendQueueTest, AFailedDoorbellStillEmptiesTheBatch) {
  SendQueue q;
  q.Init(128);
  QueueOne(q);
  Ring(q, /*result=*/ENOMEM);
  EXPECT_TRUE(q.empty());
}

TEST(SendQueueTest, AHandPostedMarkerTakesTheNextNumber) {
  SendQueue q;
  q.Init(128);
  QueueOne(q);
  Ring(q);
  const uint64_t marker = q.TakeSeq();
  EXPECT_EQ(marker, 2u);
  EXPECT_FALSE(q.all_retired());
  q.UntakeSeq();
  EXPECT_EQ(QueueOne(q), 2u);
}

}  // namespace
}  // namespace swirl::internal
