#include "rpc/bulk_pool.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace swirl {

const char* BulkModeName(BulkMode mode) {
  switch (mode) {
    case BulkMode::kServerExposes: return "server-exposes";
    case BulkMode::kMirror: return "mirror";
  }
  return "?";
}

void BulkBuffer::ReleaseSlow() {
  if (data_ != nullptr && pool_ != nullptr) pool_->Free(size_class_, data_);
  pool_.reset();
  data_ = nullptr;
  size_ = capacity_ = 0;
  size_class_ = 0;
}

namespace internal {

absl::StatusOr<std::shared_ptr<BulkPool>> BulkPool::Create(
    std::shared_ptr<verbs::ProtectionDomain> pd, size_t bytes) {
  std::shared_ptr<BulkPool> pool(new BulkPool());
  pool->bytes_ = (bytes + kMinClass - 1) & ~(kMinClass - 1);
  void* memory =
      mmap(nullptr, pool->bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("bulk pool: ", std::strerror(errno)));
  }
  pool->base_ = static_cast<char*>(memory);
  // Remote access only through memory windows: the region's own rkey grants nothing remote.
  auto mr = verbs::MemoryRegion::Register(pd, pool->base_, pool->bytes_,
                                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  if (!mr.ok()) return mr.status();
  pool->mr_ = std::move(*mr);
  swirl::MutexLock lock(&pool->mu_);
  int classes = 0;
  for (size_t c = kMinClass; c <= pool->bytes_; c <<= 1) ++classes;
  pool->free_.resize(classes);
  // The pool as the largest aligned blocks it holds, biggest first (each then starts at a
  // multiple of its size); a block's buddy beyond the pool's end is never free.
  size_t offset = 0;
  for (int c = classes - 1; c >= 0; --c) {
    const size_t block = kMinClass << c;
    if (pool->bytes_ - offset >= block) {
      pool->free_[c].insert(offset);
      offset += block;
    }
  }
  return pool;
}

BulkPool::~BulkPool() {
  mr_.reset();
  if (base_ != nullptr) munmap(base_, bytes_);
}

absl::StatusOr<BulkBuffer> BulkPool::Allocate(size_t size) {
  int size_class = 0;
  size_t class_bytes = kMinClass;
  while (class_bytes < size) {
    class_bytes <<= 1;
    ++size_class;
  }
  swirl::MutexLock lock(&mu_);
  if (static_cast<size_t>(size_class) >= free_.size()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("bulk payload of ", size, " bytes exceeds the ", bytes_, "-byte pool"));
  }
  // The smallest free block that fits, split down to the class asked for (the upper halves
  // freed on the way).
  size_t c = static_cast<size_t>(size_class);
  while (c < free_.size() && free_[c].empty()) ++c;
  if (c == free_.size()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "bulk pool exhausted (", in_use_, " of ", bytes_, " bytes in use)"));
  }
  const size_t offset = *free_[c].begin();
  free_[c].erase(free_[c].begin());
  for (; c > static_cast<size_t>(size_class); --c) {
    free_[c - 1].insert(offset + (kMinClass << (c - 1)));
  }
  char* data = base_ + offset;
  in_use_ += class_bytes;
  BulkBuffer buffer;
  buffer.pool_ = shared_from_this();
  buffer.size_class_ = size_class;
  buffer.data_ = data;
  buffer.size_ = size;
  buffer.capacity_ = class_bytes;
  return buffer;
}

void BulkPool::Free(int size_class, char* data) {
  swirl::MutexLock lock(&mu_);
  in_use_ -= kMinClass << size_class;
  // Merge with the buddy while it is free: the block twice the size is then whole again.
  size_t offset = static_cast<size_t>(data - base_);
  size_t c = static_cast<size_t>(size_class);
  for (; c + 1 < free_.size(); ++c) {
    auto buddy = free_[c].find(offset ^ (kMinClass << c));
    if (buddy == free_[c].end()) break;
    free_[c].erase(buddy);
    offset &= ~(kMinClass << c);
  }
  free_[c].insert(offset);
}

size_t BulkPool::bytes_in_use() const {
  swirl::MutexLock lock(&mu_);
  return in_use_;
}

}  // namespace internal
}  // namespace swirl
