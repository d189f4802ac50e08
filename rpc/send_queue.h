// Internal: one connection's send queue as the worker keeps it: the work requests gathered for
// the next doorbell, a sequence number for every WR posted, what each one holds until it is
// known complete (a send buffer, a bulk operation), and selective signaling. Loop thread only.
// The doorbell itself is the caller's (Flush takes the post function), so send_queue_test
// drives all of it without a device.
//
// Selective signaling: a WR is signaled when something waits for its completion (it holds a
// buffer or an operation), every kSignalInterval WRs, and whenever unsignaled WRs could
// otherwise fill the QP's send queue. A signaled completion for sequence S retires every WR up
// to S (RC completes in order), so the unsignaled ones before it are accounted then.

#ifndef SWIRL_RPC_SEND_QUEUE_H_
#define SWIRL_RPC_SEND_QUEUE_H_

#include <infiniband/verbs.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "base/check.h"

namespace swirl::internal {

class SendQueue {
 public:
  static constexpr int kBatch = 32;  // WRs per doorbell at most
  static constexpr uint32_t kSignalInterval = 16;
  static constexpr int32_t kNothing = -1;  // no buffer, no operation

  // `depth`: the QP's send queue (max_send_wr).
  void Init(uint32_t depth);
  uint32_t depth() const { return depth_; }

  // ---- Queueing ----
  // The next WR of the batch and its scatter entry, written in place (the message path is the
  // hot path), then Commit()ed. Only while !full().
  ibv_send_wr& next_wr() { return batch_wr_[batch_size_]; }
  ibv_sge& next_sge() { return batch_sge_[batch_size_]; }
  // Numbers the WR just written, signals it if it must be, and records what it holds until it
  // completes: a send-pool `buffer` and a bulk `op` (or kNothing). Returns its sequence.
  uint64_t Commit(int32_t buffer, int32_t op) {
    SWIRL_DCHECK(batch_size_ < kBatch);
    ibv_send_wr& wr = batch_wr_[batch_size_];
    const uint64_t seq = next_++;
    // Signaled when something waits for it (a buffer or an operation: either is not kNothing,
    // and then neither is their AND), and at signal_at_: often enough that unsignaled WRs
    // never fill the send queue.
    const bool holds = (buffer & op) != kNothing;
    if (holds || seq >= signal_at_) {
      last_signaled_ = seq;
      signal_at_ = SignalAt();
      wr.send_flags |= IBV_SEND_SIGNALED;
    }
    // A slot holds nothing unless written here: Init, Retire, DropUnposted and
    // ForgetOutstanding leave every slot they are done with at Held{}.
    if (holds) {
      held_[Slot(seq)] = Held{buffer, op};
      ++holding_;
    }
    wr.wr_id = seq;
    wr.next = nullptr;
    ++batch_size_;
    return seq;
  }
  bool full() const { return batch_size_ == kBatch; }
  bool empty() const { return batch_size_ == 0; }
  // Chains the batch and rings the doorbell once: `post` gets the first WR and returns 0 or an
  // errno. The batch is empty afterwards either way (a failed post fails the connection).
  template <typename Post>
  int Flush(Post&& post) {
    if (batch_size_ == 0) return 0;
    for (int i = 0; i + 1 < batch_size_; ++i) batch_wr_[i].next = &batch_wr_[i + 1];
    batch_size_ = 0;
    return post(batch_wr_);
  }

  // ---- Completions ----
  // A completion for `seq` retires every WR up to it: `retired(s, buffer, op)`, in order, for
  // each that holds something (a buffer or an operation); most hold nothing, and a completion
  // that retires only those does not look at their slots. False, retiring nothing, if `seq`
  // names no WR posted (a stray completion).
  template <typename Retired>
  bool Retire(uint64_t seq, Retired&& retired) {
    if (seq >= next_) return false;
    const uint64_t first = completed_ + 1;
    if (seq > completed_) {
      completed_ = seq;
      signal_at_ = SignalAt();
    }
    for (uint64_t s = first; s <= seq && holding_ > 0; ++s) {
      const Held held = std::exchange(held_[Slot(s)], Held{});
      if ((held.buffer & held.op) == kNothing) continue;
      --holding_;
      retired(s, held.buffer, held.op);
    }
    return true;
  }
  // Every WR posted is known complete.
  bool all_retired() const { return completed_ + 1 >= next_; }
  uint64_t outstanding() const { return next_ - 1 - completed_; }

  // ---- Failure and teardown ----
  // Drops the WRs queued but never posted, `release(buffer)` for each buffer they held; their
  // sequence numbers are used again.
  void DropUnposted(absl::FunctionRef<void(int32_t)> release);
  // A sequence number for a WR posted by hand (the signaled marker after an error), and giving
  // it back if that post failed.
  uint64_t TakeSeq() { return next_++; }
  void UntakeSeq() { --next_; }
  // The WRs posted will never complete (the QP is gone): `release(buffer)` for each.
  void ForgetOutstanding(absl::FunctionRef<void(int32_t)> release);

 private:
  size_t Slot(uint64_t seq) const { return seq & slot_mask_; }
  // The first sequence that is signaled even if nothing waits for it: kSignalInterval after
  // the last signaled one, or earlier if the unsignaled ones since the last completion would
  // otherwise come within kSignalInterval of filling the queue.
  uint64_t SignalAt() const {
    return std::min(last_signaled_ + kSignalInterval, completed_ + depth_ - kSignalInterval);
  }

  uint32_t depth_ = 0;
  uint64_t next_ = 1;       // sequence of the next WR
  uint64_t completed_ = 0;  // every WR up to this one is complete
  uint64_t last_signaled_ = 0;
  uint64_t signal_at_ = kSignalInterval;  // SignalAt(), kept up to date
  // By sequence, modulo a power of two >= depth (slot_mask_ + 1): what the WR holds.
  struct Held {
    int32_t buffer = kNothing;
    int32_t op = kNothing;
  };
  std::vector<Held> held_;
  uint64_t holding_ = 0;  // WRs posted or queued whose slot holds something
  uint64_t slot_mask_ = 0;
  ibv_send_wr batch_wr_[kBatch];
  ibv_sge batch_sge_[kBatch];
  int batch_size_ = 0;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_SEND_QUEUE_H_
