// blockstore_load's latency histogram: swirl::Histogram (base/histogram.h), the log-linear
// histogram bench/ uses too (128 buckets per power of two; percentiles within 0.39% of the
// nearest-rank sample, exact below 256 ns; exact min, max and mean).

#ifndef SWIRL_EXAMPLES_BLOCKSTORE_HISTOGRAM_H_
#define SWIRL_EXAMPLES_BLOCKSTORE_HISTOGRAM_H_

#include "base/histogram.h"

namespace swirl::blockstore {

using LatencyHistogram = ::swirl::Histogram;

}  // namespace swirl::blockstore

#endif  // SWIRL_EXAMPLES_BLOCKSTORE_HISTOGRAM_H_
