// A log-linear histogram of non-negative integer values (latencies in nanoseconds, usually),
// after HdrHistogram's bucketing. Debian packages no C++ HdrHistogram, so this is one small
// implementation, shared by bench/ (verbs_perf, rpc_perf, grpc_echo_perf) and
// examples/blockstore (blockstore_load). bench/swirl_bench.py merges the histograms the tools
// print with the same scheme (its `bucket_index`), so the two must stay in step.
//
// The scheme, with S = 2^kSubBucketBits = 128:
//   * values below 2S = 256 each have a bucket of their own (exact);
//   * a value v >= 256 with its highest bit at position e (2^e <= v < 2^(e+1)) falls into one of
//     S equal buckets splitting [2^e, 2^(e+1)), each 2^(e - kSubBucketBits) wide: at most 1/128
//     of the bucket's lower edge.
// Index(v) = v for v < 2S, else (e - kSubBucketBits + 1) * S + ((v >> (e - kSubBucketBits)) - S),
// which continues the exact range without a gap.
//
// Stated error: Percentile() returns the midpoint of the bucket holding the nearest-rank sample
// (clamped to [min, max]), so it is within half a bucket of that sample: at most 1/256 (0.39%)
// of its value, and exact below 256. count, min, max and mean are exact; stdev is computed from
// exact sums.
//
// Add() does no allocation (the 7,424 counters are allocated once, 58 KiB); Merge() adds another
// histogram's counts. Not thread-safe: give each thread its own and merge.

#ifndef SWIRL_BASE_HISTOGRAM_H_
#define SWIRL_BASE_HISTOGRAM_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace swirl {

class Histogram {
 public:
  static constexpr int kSubBucketBits = 7;
  static constexpr uint64_t kSubBuckets = uint64_t{1} << kSubBucketBits;
  static constexpr size_t kBuckets = (64 - kSubBucketBits + 1) * kSubBuckets;
  // The largest error of Percentile() relative to the nearest-rank sample's value.
  static constexpr double kMaxRelativeError = 1.0 / (2 * kSubBuckets);

  Histogram() : counts_(kBuckets, 0) {}

  void Add(uint64_t v) { Add(v, 1); }
  void Add(uint64_t v, uint64_t n) {
    if (n == 0) return;
    counts_[Index(v)] += n;
    count_ += n;
    sum_ += static_cast<unsigned __int128>(v) * n;
    sum_squares_ += static_cast<unsigned __int128>(v) * v * n;
    max_ = std::max(max_, v);
    min_ = std::min(min_, v);
  }

  void Merge(const Histogram& other) {
    for (size_t i = 0; i < kBuckets; ++i) counts_[i] += other.counts_[i];
    count_ += other.count_;
    sum_ += other.sum_;
    sum_squares_ += other.sum_squares_;
    max_ = std::max(max_, other.max_);
    min_ = std::min(min_, other.min_);
  }

  void Reset() { *this = Histogram(); }

  uint64_t count() const { return count_; }
  uint64_t min() const { return count_ == 0 ? 0 : min_; }
  uint64_t max() const { return max_; }
  double mean() const {
    return count_ == 0 ? 0 : static_cast<double>(sum_) / static_cast<double>(count_);
  }
  // Population standard deviation.
  double stdev() const {
    if (count_ == 0) return 0;
    const long double n = static_cast<long double>(count_);
    const long double mean = static_cast<long double>(sum_) / n;
    const long double var = static_cast<long double>(sum_squares_) / n - mean * mean;
    return var > 0 ? static_cast<double>(std::sqrt(var)) : 0;
  }

  // The value at quantile q in [0, 1]: nearest rank (the smallest rank r with r >= q * count),
  // reported as its bucket's midpoint and clamped to [min, max]. q >= 1 gives max exactly.
  uint64_t Percentile(double q) const {
    if (count_ == 0) return 0;
    uint64_t rank = static_cast<uint64_t>(std::ceil(q * static_cast<double>(count_)));
    rank = std::clamp<uint64_t>(rank, 1, count_);
    if (rank == count_) return max_;
    uint64_t seen = 0;
    for (size_t i = 0; i < kBuckets; ++i) {
      seen += counts_[i];
      if (seen >= rank) return std::clamp(Lower(i) + (Width(i) - 1) / 2, min(), max_);
    }
    return max_;
  }

  struct Bucket {
    uint64_t lower;  // the smallest value it holds
    uint64_t width;  // it holds [lower, lower + width)
    uint64_t count;
  };
  // The non-empty buckets, in increasing order.
  std::vector<Bucket> Buckets() const {
    std::vector<Bucket> out;
    for (size_t i = 0; i < kBuckets; ++i) {
      if (counts_[i] != 0) out.push_back({Lower(i), Width(i), counts_[i]});
    }
    return out;
  }

  static size_t Index(uint64_t v) {
    if (v < 2 * kSubBuckets) return static_cast<size_t>(v);
    const int e = 63 - __builtin_clzll(v);  // >= kSubBucketBits + 1
    const int shift = e - kSubBucketBits;
    return static_cast<size_t>(static_cast<uint64_t>(shift + 1) * kSubBuckets +
                               ((v >> shift) - kSubBuckets));
  }
  static uint64_t Lower(size_t i) {
    if (i < 2 * kSubBuckets) return i;
    const int shift = static_cast<int>(i / kSubBuckets) - 1;
    return (kSubBuckets + i % kSubBuckets) << shift;
  }
  static uint64_t Width(size_t i) {
    if (i < 2 * kSubBuckets) return 1;
    return uint64_t{1} << (static_cast<int>(i / kSubBuckets) - 1);
  }

 private:
  std::vector<uint64_t> counts_;
  uint64_t count_ = 0;
  unsigned __int128 sum_ = 0;
  unsigned __int128 sum_squares_ = 0;
  uint64_t max_ = 0;
  uint64_t min_ = UINT64_MAX;
};

}  // namespace swirl

#endif  // SWIRL_BASE_HISTOGRAM_H_
