// A latency histogram for blockstore_load: log-linear buckets (128 per power of two, so any
// percentile is within 1% of the true value), exact min/max/mean, no allocation when recording.

#ifndef SWIRL_EXAMPLES_BLOCKSTORE_HISTOGRAM_H_
#define SWIRL_EXAMPLES_BLOCKSTORE_HISTOGRAM_H_

#include <cmath>
#include <cstdint>
#include <vector>

namespace swirl::blockstore {

class LatencyHistogram {
 public:
  LatencyHistogram() : buckets_(kBuckets, 0) {}

  void Add(uint64_t ns) {
    ++buckets_[Index(ns)];
    ++count_;
    sum_ += ns;
    if (ns > max_) max_ = ns;
    if (ns < min_) min_ = ns;
  }
  void Merge(const LatencyHistogram& other) {
    for (size_t i = 0; i < buckets_.size(); ++i) buckets_[i] += other.buckets_[i];
    count_ += other.count_;
    sum_ += other.sum_;
    if (other.max_ > max_) max_ = other.max_;
    if (other.min_ < min_) min_ = other.min_;
  }

  uint64_t count() const { return count_; }
  uint64_t max() const { return max_; }
  uint64_t min() const { return count_ == 0 ? 0 : min_; }
  double mean() const { return count_ == 0 ? 0 : static_cast<double>(sum_) / count_; }
  // The value at quantile q in [0, 1] (the nearest-rank sample's bucket midpoint, capped at max).
  uint64_t Percentile(double q) const {
    if (count_ == 0) return 0;
    // Nearest rank: the smallest rank whose share reaches q (ceil(q * n)).
    uint64_t rank = static_cast<uint64_t>(std::ceil(q * static_cast<double>(count_)));
    if (rank < 1) rank = 1;
    if (rank >= count_) return max_;
    uint64_t seen = 0;
    for (size_t i = 0; i < buckets_.size(); ++i) {
      seen += buckets_[i];
      if (seen >= rank) {
        const uint64_t mid = Lower(i) + (Width(i) - 1) / 2;
        return mid > max_ ? max_ : (mid < min_ ? min_ : mid);
      }
    }
    return max_;
  }

 private:
  static constexpr int kSubBits = 7;
  static constexpr uint64_t kSub = 1u << kSubBits;
  static constexpr size_t kBuckets = (64 - kSubBits + 1) * kSub;

  static size_t Index(uint64_t v) {
    if (v < kSub) return static_cast<size_t>(v);
    const int e = 63 - __builtin_clzll(v);  // >= kSubBits
    return static_cast<size_t>((e - kSubBits + 1) * kSub + ((v >> (e - kSubBits)) & (kSub - 1)));
  }
  static uint64_t Lower(size_t i) {
    if (i < kSub) return i;
    const int e = static_cast<int>(i / kSub) + kSubBits - 1;
    return (uint64_t{1} << e) | (static_cast<uint64_t>(i % kSub) << (e - kSubBits));
  }
  static uint64_t Width(size_t i) {
    if (i < kSub) return 1;
    const int e = static_cast<int>(i / kSub) + kSubBits - 1;
    return uint64_t{1} << (e - kSubBits);
  }

  std::vector<uint64_t> buckets_;
  uint64_t count_ = 0;
  uint64_t sum_ = 0;
  uint64_t max_ = 0;
  uint64_t min_ = UINT64_MAX;
};

}  // namespace swirl::blockstore

#endif  // SWIRL_EXAMPLES_BLOCKSTORE_HISTOGRAM_H_
