// Test helper: waiting, with a bound, for a server's control-plane stats to show something.

#ifndef SWIRL_RPC_TESTING_SERVER_STATS_H_
#define SWIRL_RPC_TESTING_SERVER_STATS_H_

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "swirl/channel.h"

namespace swirl::testing {

// The server's control-plane stats (fetched through `channel`) once `done(stats)` holds, or as
// they stand after 10 s; a failed fetch ends the wait with its error.
template <typename Done>
absl::StatusOr<StatsReport> ServerStatsWhen(Channel& channel, Done done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (;;) {
    absl::SleepFor(absl::Milliseconds(5));  // leave the server the CPU
    absl::StatusOr<StatsReport> now = channel.ServerStats();
    if (!now.ok() || done(*now) || absl::Now() >= deadline) return now;
  }
}

}  // namespace swirl::testing

#endif  // SWIRL_RPC_TESTING_SERVER_STATS_H_
