// swirl::Histogram: the bucketing scheme (no gaps, no overlaps), the stated error bound of
// Percentile() against exact nearest-rank percentiles, exact statistics, merging.

#include "base/histogram.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace swirl {
namespace {

// The nearest-rank sample of sorted `v` (what Percentile() approximates).
uint64_t NearestRank(const std::vector<uint64_t>& sorted, double q) {
  const uint64_t n = sorted.size();
  uint64_t rank = static_cast<uint64_t>(std::ceil(q * static_cast<double>(n)));
  rank = std::clamp<uint64_t>(rank, 1, n);
  return sorted[rank - 1];
}

TEST(HistogramTest, BucketsTileTheValuesWithoutGapsAndAreNarrowEnough) {
  // Consecutive buckets touch, each value falls in the bucket Index names, and every bucket
  // above the exact range is at most 1/128 of its lower edge wide.
  uint64_t next = 0;
  for (size_t i = 0; i < Histogram::kBuckets; ++i) {
    const uint64_t lower = Histogram::Lower(i), width = Histogram::Width(i);
    ASSERT_EQ(lower, next) << "bucket " << i;
    ASSERT_EQ(Histogram::Index(lower), i);
    ASSERT_EQ(Histogram::Index(lower + (width - 1)), i);
    if (lower >= 256) {
      ASSERT_LE(width * Histogram::kSubBuckets, lower) << "bucket " << i;
    } else {
      ASSERT_EQ(width, 1u) << "bucket " << i;
    }
    next = lower + width;  // wraps to 0 after the last bucket
  }
  EXPECT_EQ(next, 0u);
  EXPECT_EQ(Histogram::Index(UINT64_MAX), Histogram::kBuckets - 1);
}

TEST(HistogramTest, PercentilesWithinTheStatedErrorOfNearestRank) {
  std::mt19937_64 rng(12345);
  // Latency-like: a body around 300 ns and a long tail up to milliseconds.
  std::lognormal_distribution<double> body(std::log(300.0), 0.3);
  std::exponential_distribution<double> tail(1.0 / 50000);
  std::vector<uint64_t> values;
  Histogram h;
  for (int i = 0; i < 200000; ++i) {
    const double x = (i % 100 == 0) ? 1000 + tail(rng) : body(rng);
    const uint64_t v = static_cast<uint64_t>(x);
    values.push_back(v);
    h.Add(v);
  }
  std::sort(values.begin(), values.end());
  for (double q : {0.0, 0.001, 0.1, 0.5, 0.9, 0.99, 0.999, 0.9999, 0.99999, 1.0}) {
    const double exact = static_cast<double>(NearestRank(values, q));
    const double got = static_cast<double>(h.Percentile(q));
    EXPECT_LE(std::abs(got - exact), exact * Histogram::kMaxRelativeError) << "q=" << q;
  }
  EXPECT_EQ(h.min(), values.front());
  EXPECT_EQ(h.max(), values.back());
  EXPECT_EQ(h.Percentile(1.0), values.back());
}

TEST(HistogramTest, ExactBelow256AndExactStatistics) {
  Histogram h;
  EXPECT_EQ(h.count(), 0u);
  EXPECT_EQ(h.Percentile(0.5), 0u);
  EXPECT_EQ(h.min(), 0u);
  for (uint64_t v : {3, 5, 7, 255}) h.Add(v);
  EXPECT_EQ(h.Percentile(0.5), 5u);
  EXPECT_EQ(h.Percentile(0.75), 7u);
  EXPECT_EQ(h.Percentile(0.76), 255u);
  EXPECT_EQ(h.count(), 4u);
  EXPECT_DOUBLE_EQ(h.mean(), 67.5);
  // Population standard deviation of {3, 5, 7, 255}.
  const double mean = 67.5;
  const double var = ((3 - mean) * (3 - mean) + (5 - mean) * (5 - mean) +
                      (7 - mean) * (7 - mean) + (255 - mean) * (255 - mean)) / 4;
  EXPECT_NEAR(h.stdev(), std::sqrt(var), 1e-9);
  h.Add(1000, 3);  // a repeated value counts n times
  EXPECT_EQ(h.count(), 7u);
  EXPECT_EQ(h.max(), 1000u);
  // Rank 5 of 7 is in 1000's bucket [1000, 1004), whose midpoint 1001 is clamped to the max.
  EXPECT_EQ(h.Percentile(0.6), 1000u);
}

TEST(HistogramTest, MergeAddsCountsAndKeepsExtremes) {
  Histogram a, b;
  for (uint64_t v = 1; v <= 1000; ++v) a.Add(v * 100);
  for (uint64_t v : {2, 20000000}) b.Add(v);
  a.Merge(b);
  EXPECT_EQ(a.count(), 1002u);
  EXPECT_EQ(a.min(), 2u);
  EXPECT_EQ(a.max(), 20000000u);
  uint64_t total = 0;
  uint64_t previous_end = 0;
  for (const Histogram::Bucket& bucket : a.Buckets()) {
    EXPECT_GE(bucket.lower, previous_end);  // increasing, non-overlapping
    EXPECT_GT(bucket.count, 0u);
    previous_end = bucket.lower + bucket.width;
    total += bucket.count;
  }
  EXPECT_EQ(total, 1002u);
  a.Reset();
  EXPECT_EQ(a.count(), 0u);
  EXPECT_TRUE(a.Buckets().empty());
}

}  // namespace
}  // namespace swirl
