// Internal: the registered memory behind BulkBuffers. One region, registered once with
// LOCAL_WRITE | MW_BIND (remote access only ever through a memory window), managed as a buddy
// allocator of power-of-two size classes: a freed buffer merges with its free buddy, so many
// small buffers freed leave large ones possible again (no tenant's small downloads can leave
// nothing large for anyone). Thread-safe (allocation is per bulk transfer, not per message).

#ifndef SWIRL_RPC_BULK_POOL_H_
#define SWIRL_RPC_BULK_POOL_H_

#include <bit>
#include <cstdint>
#include <memory>
#include <set>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"
#include "swirl/bulk.h"
#include "transport/verbs/verbs.h"

namespace swirl::internal {

class BulkPool : public std::enable_shared_from_this<BulkPool> {
 public:
  static constexpr size_t kMinClass = 4096;

  // `bytes` of registered memory, for local access and window binds only: its own rkey grants
  // no remote access.
  static absl::StatusOr<std::shared_ptr<BulkPool>> Create(
      std::shared_ptr<verbs::ProtectionDomain> pd, size_t bytes);
  ~BulkPool();

  // A buffer of at least `size` bytes, or RESOURCE_EXHAUSTED.
  absl::StatusOr<BulkBuffer> Allocate(size_t size);
  // The largest buffer Allocate can return: its biggest size class, a power of two no larger
  // than the pool (a 48 MiB pool serves at most 32 MiB).
  size_t max_allocation() const { return std::bit_floor(bytes_); }

  ibv_mr* mr() const { return mr_->get(); }
  uint32_t lkey() const { return mr_->lkey(); }
  bool Contains(const void* p, size_t n) const {
    const char* c = static_cast<const char*>(p);
    return c >= base_ && n <= bytes_ && c - base_ <= static_cast<ptrdiff_t>(bytes_ - n);
  }
  size_t bytes_in_use() const;

 private:
  friend class ::swirl::BulkBuffer;
  BulkPool() = default;
  void Free(int size_class, char* data);

  char* base_ = nullptr;
  size_t bytes_ = 0;
  std::unique_ptr<verbs::MemoryRegion> mr_;
  mutable swirl::Mutex mu_;
  size_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  // Free blocks per size class (kMinClass << class), as offsets from base_, each aligned to
  // its size; the lowest is taken first, which keeps the top of the pool whole longest.
  std::vector<std::set<size_t>> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_BULK_POOL_H_
