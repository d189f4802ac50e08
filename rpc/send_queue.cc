#include "rpc/send_queue.h"

#include <bit>

#include "base/check.h"

namespace swirl::internal {

void SendQueue::Init(uint32_t depth) {
  SWIRL_CHECK(depth > kSignalInterval);
  depth_ = depth;
  held_buffer_.assign(std::bit_ceil(depth), kNothing);
  held_op_.assign(held_buffer_.size(), kNothing);
}

uint64_t SendQueue::Commit(int32_t buffer, int32_t op) {
  SWIRL_DCHECK(batch_size_ < kBatch);
  ibv_send_wr& wr = batch_wr_[batch_size_];
  const uint64_t seq = next_++;
  // Signaled when something waits for it, and often enough that unsignaled WRs never fill the
  // send queue.
  const bool signal = buffer != kNothing || op != kNothing || ++unsignaled_ >= kSignalInterval ||
                      seq - completed_ + kSignalInterval >= depth_;
  if (signal) {
    unsignaled_ = 0;
    wr.send_flags |= IBV_SEND_SIGNALED;
  }
  held_buffer_[Slot(seq)] = buffer;
  held_op_[Slot(seq)] = op;
  wr.wr_id = seq;
  wr.next = nullptr;
  ++batch_size_;
  return seq;
}

int SendQueue::Flush(absl::FunctionRef<int(ibv_send_wr*)> post) {
  if (batch_size_ == 0) return 0;
  for (int i = 0; i + 1 < batch_size_; ++i) batch_wr_[i].next = &batch_wr_[i + 1];
  batch_size_ = 0;
  return post(batch_wr_);
}

bool SendQueue::Retire(uint64_t seq, absl::FunctionRef<void(uint64_t, int32_t, int32_t)> retired) {
  if (seq >= next_) return false;
  const uint64_t first = completed_ + 1;
  if (seq > completed_) completed_ = seq;
  for (uint64_t s = first; s <= seq; ++s) {
    const size_t slot = Slot(s);
    const int32_t buffer = held_buffer_[slot];
    const int32_t op = held_op_[slot];
    held_buffer_[slot] = held_op_[slot] = kNothing;
    retired(s, buffer, op);
  }
  return true;
}

void SendQueue::DropUnposted(absl::FunctionRef<void(int32_t)> release) {
  if (batch_size_ == 0) return;
  for (int i = 0; i < batch_size_; ++i) {
    int32_t& buffer = held_buffer_[Slot(batch_wr_[i].wr_id)];
    if (buffer != kNothing) release(buffer);
    buffer = kNothing;
    held_op_[Slot(batch_wr_[i].wr_id)] = kNothing;
  }
  next_ = batch_wr_[0].wr_id;
  batch_size_ = 0;
}

void SendQueue::ForgetOutstanding(absl::FunctionRef<void(int32_t)> release) {
  for (uint64_t s = completed_ + 1; s < next_; ++s) {
    int32_t& buffer = held_buffer_[Slot(s)];
    if (buffer != kNothing) release(buffer);
    buffer = kNothing;
    held_op_[Slot(s)] = kNothing;
  }
  completed_ = next_ - 1;
}

}  // namespace swirl::internal
