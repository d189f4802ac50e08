#include "rpc/buffer_pool.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace swirl::internal {

absl::StatusOr<std::unique_ptr<BufferPool>> BufferPool::Create(
    std::shared_ptr<verbs::ProtectionDomain> pd, uint32_t count, uint32_t size, int access) {
  std::unique_ptr<BufferPool> pool(new BufferPool());
  pool->size_ = (size + 63) & ~63u;
  pool->count_ = count;
  pool->bytes_ = static_cast<size_t>(pool->size_) * count;
  void* memory = mmap(nullptr, pool->bytes_, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (memory == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("buffer pool of ", pool->bytes_, " bytes: ", std::strerror(errno)));
  }
  pool->base_ = static_cast<char*>(memory);
  auto mr = verbs::MemoryRegion::Register(std::move(pd), pool->base_, pool->bytes_, access);
  if (!mr.ok()) {
    munmap(pool->base_, pool->bytes_);
    pool->base_ = nullptr;
    return mr.status();
  }
  pool->mr_ = std::move(*mr);
  pool->free_.reserve(count);
  for (uint32_t i = count; i > 0; --i) pool->free_.push_back(i - 1);
  return pool;
}

BufferPool::~BufferPool() {
  mr_.reset();  // deregister before the memory goes
  if (base_ != nullptr) munmap(base_, bytes_);
}

int64_t BufferPool::IndexOf(const void* p) const {
  const char* c = static_cast<const char*>(p);
  if (c < base_ || c >= base_ + bytes_) return -1;
  return (c - base_) / size_;
}

}  // namespace swirl::internal
