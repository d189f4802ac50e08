#include "rpc/send_queue.h"

#include <algorithm>
#include <bit>
#include <utility>

#include "base/check.h"

namespace swirl::internal {

void SendQueue::Init(uint32_t depth) {
  SWIRL_CHECK(depth > kSignalInterval);
  depth_ = depth;
  signal_at_ = SignalAt();
  held_.assign(std::bit_ceil(depth), Held{});
  slot_mask_ = held_.size() - 1;
}

void SendQueue::DropUnposted(absl::FunctionRef<void(int32_t)> release) {
  if (batch_size_ == 0) return;
  for (int i = 0; i < batch_size_; ++i) {
    const Held held = std::exchange(held_[Slot(batch_wr_[i].wr_id)], Held{});
    if ((held.buffer & held.op) != kNothing) --holding_;
    if (held.buffer != kNothing) release(held.buffer);
  }
  next_ = batch_wr_[0].wr_id;
  last_signaled_ = std::min(last_signaled_, next_ - 1);
  signal_at_ = SignalAt();
  batch_size_ = 0;
}

void SendQueue::ForgetOutstanding(absl::FunctionRef<void(int32_t)> release) {
  for (uint64_t s = completed_ + 1; s < next_; ++s) {
    const Held held = std::exchange(held_[Slot(s)], Held{});
    if (held.buffer != kNothing) release(held.buffer);
  }
  completed_ = next_ - 1;
  signal_at_ = SignalAt();
  holding_ = 0;
}

}  // namespace swirl::internal
