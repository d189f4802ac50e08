// An idle worker that spins gives its core to the other threads on it between polls
// (ServerOptions::idle_yield_after, docs/RELIABILITY.md "Scale"); one told never to yield, or
// pinned to the core (whose default is never), keeps its share. Everything here runs on one
// CPU: the test thread pins itself before it starts the server, whose (unpinned) worker thread
// inherits that CPU, and so does a competing thread that only spins. The competitor's CPU time
// over a window, against what it gets alone on that CPU in the same round, is what the worker
// left it: nearly all of it when the worker yields, about half when it does not (two threads
// that never block share a CPU evenly).

#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "swirl/server.h"

namespace swirl {
namespace {

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// The CPU time per second of wall time a thread that only spins gets over `window`.
double SpinnerShare(absl::Duration window) {
  double share = -1;
  std::thread spinner([&] {
    const double cpu0 = ThreadCpuSeconds();
    const absl::Time start = absl::Now();
    while (absl::Now() - start < window) {
    }
    share = (ThreadCpuSeconds() - cpu0) / absl::ToDoubleSeconds(absl::Now() - start);
  });
  spinner.join();
  return share;
}

// SpinnerShare beside a server whose one worker busy-polls (idle_spin 0: it never sleeps) with
// `yield_after`, pinned to `core` (-1: not pinned, on the CPU it inherits).
double CompetitorShare(std::optional<absl::Duration> yield_after, int core,
                       absl::Duration window) {
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.worker_cores = {core};
  options.idle_spin = absl::ZeroDuration();
  options.idle_yield_after = yield_after;
  auto server = std::make_unique<Server>(options);
  absl::Status started = server->Start();
  EXPECT_TRUE(started.ok()) << started;
  if (!started.ok()) return -1;
  const double share = SpinnerShare(window);
  server->Shutdown(absl::ZeroDuration());
  return share;
}

TEST(IdleYieldTest, AnIdleUnpinnedWorkerGivesItsCoreAwayAPinnedOrOneToldNeverToDoesNot) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  int cpu = 0;
  while (cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &allowed)) ++cpu;
  ASSERT_LT(cpu, CPU_SETSIZE);
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  ASSERT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(one), &one), 0);

  // Alternating rounds, each share against the spinner alone on the CPU in the same round (a
  // CPU quota or another process on that CPU lowers both alike), medians compared.
  constexpr int kRounds = 3;
  const absl::Duration window = absl::Milliseconds(300);
  std::vector<double> alone, yielding, spinning, pinned;
  for (int round = 0; round < kRounds; ++round) {
    const double base = SpinnerShare(window);
    alone.push_back(base);
    yielding.push_back(CompetitorShare(std::nullopt, -1, window) / base);  // default: 20 us
    spinning.push_back(CompetitorShare(absl::InfiniteDuration(), -1, window) / base);
    pinned.push_back(CompetitorShare(std::nullopt, cpu, window) / base);  // pinned: never
  }
  for (auto* shares : {&alone, &yielding, &spinning, &pinned}) {
    std::sort(shares->begin(), shares->end());
  }
  std::printf("a spinning thread's CPU share alone: %.2f %.2f %.2f; beside a busy-polling "
              "worker, relative to that: unpinned %.2f %.2f %.2f, unpinned never yielding "
              "%.2f %.2f %.2f, pinned %.2f %.2f %.2f\n",
              alone[0], alone[1], alone[2], yielding[0], yielding[1], yielding[2], spinning[0],
              spinning[1], spinning[2], pinned[0], pinned[1], pinned[2]);
  if (alone[kRounds / 2] < 0.5) {
    GTEST_SKIP() << "a thread alone on CPU " << cpu << " gets " << alone[kRounds / 2]
                 << " of it (a CPU quota, or other load on that CPU): too little to tell a "
                    "worker that yields from one that does not";
  }
  const double yielding_median = yielding[kRounds / 2];
  const double spinning_median = spinning[kRounds / 2];
  const double pinned_median = pinned[kRounds / 2];
  EXPECT_GE(yielding_median, 0.8);
  EXPECT_LE(spinning_median, 0.7);
  EXPECT_LE(pinned_median, 0.7);
  EXPECT_GE(yielding_median, spinning_median + 0.2);
}

}  // namespace
}  // namespace swirl
