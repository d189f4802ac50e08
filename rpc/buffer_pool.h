// A registered pool of equal-sized buffers: one allocation, one MR, a free list. Owned and used
// by one worker thread (not thread-safe).

#ifndef SWIRL_RPC_BUFFER_POOL_H_
#define SWIRL_RPC_BUFFER_POOL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "transport/verbs/verbs.h"

namespace swirl::internal {

class BufferPool {
 public:
  // `count` buffers of `size` bytes (rounded up to 64), registered with `access`.
  static absl::StatusOr<std::unique_ptr<BufferPool>> Create(
      std::shared_ptr<verbs::ProtectionDomain> pd, uint32_t count, uint32_t size, int access);
  ~BufferPool();

  char* at(uint32_t index) const { return base_ + static_cast<size_t>(index) * size_; }
  uint32_t size() const { return size_; }
  uint32_t count() const { return count_; }
  uint32_t lkey() const { return mr_->lkey(); }
  verbs::MemoryRegion& mr() const { return *mr_; }
  // Index of the buffer holding `p`, or -1.
  int64_t IndexOf(const void* p) const;

  // Free list.
  bool empty() const { return free_.empty(); }
  uint32_t free_count() const { return static_cast<uint32_t>(free_.size()); }
  uint32_t Take() {
    uint32_t index = free_.back();
    free_.pop_back();
    return index;
  }
  void Give(uint32_t index) { free_.push_back(index); }

 private:
  BufferPool() = default;
  char* base_ = nullptr;
  size_t bytes_ = 0;
  uint32_t size_ = 0;
  uint32_t count_ = 0;
  std::unique_ptr<verbs::MemoryRegion> mr_;
  std::vector<uint32_t> free_;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_BUFFER_POOL_H_
