// BulkPool's size classes: what max_allocation promises, Allocate keeps.

#include "rpc/bulk_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "transport/device.h"

namespace swirl::internal {
namespace {

std::shared_ptr<BulkPool> MakePool(size_t bytes) {
  auto context = OpenDevice("soft0");
  EXPECT_TRUE(context.ok()) << context.status();
  if (!context.ok()) return nullptr;
  auto pd = verbs::ProtectionDomain::Create(*context);
  EXPECT_TRUE(pd.ok()) << pd.status();
  if (!pd.ok()) return nullptr;
  auto pool = BulkPool::Create(*pd, bytes);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? *pool : nullptr;
}

TEST(BulkPoolTest, MaxAllocationIsTheLargestClassThatFits) {
  // 48 MiB: classes 4 KiB .. 32 MiB. Advertising 48 MiB (the old answer) promised transfers
  // that Allocate then refused.
  auto pool = MakePool(48 << 20);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->max_allocation(), size_t{32} << 20);
  auto biggest = pool->Allocate(pool->max_allocation());
  ASSERT_TRUE(biggest.ok()) << biggest.status();
  EXPECT_EQ(biggest->capacity(), size_t{32} << 20);
  auto too_big = pool->Allocate(pool->max_allocation() + 1);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(BulkPoolTest, APowerOfTwoPoolServesItsWholeSize) {
  auto pool = MakePool(16 << 20);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->max_allocation(), size_t{16} << 20);
  auto all = pool->Allocate(16 << 20);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(pool->bytes_in_use(), size_t{16} << 20);
  EXPECT_FALSE(pool->Allocate(4096).ok()) << "the pool is full";
  all->Release();
  EXPECT_EQ(pool->bytes_in_use(), 0u);
  // The freed 16 MiB block splits to serve a small buffer.
  auto small = pool->Allocate(4096);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->capacity(), 4096u);
}

// Freed buffers coalesce: a pool cut entirely into its smallest buffers (a tenant's many small
// unacknowledged downloads), all freed, serves its largest buffer again, and then every size in
// between. Without merging, the freed 4 KiB buffers could only ever be 4 KiB buffers again.
TEST(BulkPoolTest, ManySmallBuffersFreedLeaveALargeOnePossible) {
  for (size_t bytes : {size_t{1} << 20, size_t{3} << 20}) {  // a power of two, and 2 + 1 MiB
    auto pool = MakePool(bytes);
    ASSERT_NE(pool, nullptr);
    std::vector<BulkBuffer> small;
    for (;;) {
      auto b = pool->Allocate(1);
      if (!b.ok()) break;
      small.push_back(*std::move(b));
    }
    ASSERT_EQ(small.size(), bytes / BulkPool::kMinClass) << "the pool did not serve its all";
    // Freed in an order that leaves no two buddies free together until the second half.
    for (size_t i = 0; i < small.size(); i += 2) small[i] = BulkBuffer();
    EXPECT_FALSE(pool->Allocate(2 * BulkPool::kMinClass).ok()) << "only 4 KiB holes are free";
    for (size_t i = 1; i < small.size(); i += 2) small[i] = BulkBuffer();
    EXPECT_EQ(pool->bytes_in_use(), 0u);
    auto largest = pool->Allocate(pool->max_allocation());
    ASSERT_TRUE(largest.ok()) << bytes << ": " << largest.status();
    // What is left is served whole too.
    auto rest = pool->Allocate(bytes - pool->max_allocation());
    if (bytes != pool->max_allocation()) {
      EXPECT_TRUE(rest.ok()) << rest.status();
    }
  }
}

// Whatever mix of sizes is taken, no two buffers overlap and all lie inside the pool.
TEST(BulkPoolTest, BuffersNeverOverlap) {
  auto pool = MakePool(size_t{6} << 20);
  ASSERT_NE(pool, nullptr);
  std::vector<BulkBuffer> held;
  uint32_t seed = 7;
  for (int round = 0; round < 2000; ++round) {
    seed = seed * 1103515245 + 12345;
    if (!held.empty() && (seed >> 16) % 3 == 0) {
      const size_t i = (seed >> 8) % held.size();
      held[i] = std::move(held.back());
      held.pop_back();
      continue;
    }
    auto b = pool->Allocate(size_t{1} << ((seed >> 20) % 19));  // 1 B .. 256 KiB
    if (b.ok()) held.push_back(*std::move(b));
  }
  std::vector<std::pair<const char*, size_t>> spans;
  for (const BulkBuffer& b : held) {
    EXPECT_TRUE(pool->Contains(b.data(), b.capacity()));
    spans.push_back({b.data(), b.capacity()});
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    EXPECT_LE(spans[i - 1].first + spans[i - 1].second, spans[i].first) << "overlap at " << i;
  }
}

}  // namespace
}  // namespace swirl::internal
