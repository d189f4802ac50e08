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
