// BulkPool's size classes: what max_allocation promises, Allocate keeps.

#include "rpc/bulk_pool.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace swirl::internal
