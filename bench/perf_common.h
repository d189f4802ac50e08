// Helpers for bench/verbs_perf: a calibrated TSC clock, latency statistics, CPU pinning, the
// TCP out-of-band channel (perftest-style) and child-process spawning.

#ifndef SWIRL_BENCH_PERF_COMMON_H_
#define SWIRL_BENCH_PERF_COMMON_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

namespace swirl::bench {

// Prints "verbs_perf: <message>" to stderr and exits with status 1.
[[noreturn]] void Die(const char* format, ...) __attribute__((format(printf, 1, 2)));

int64_t MonoNs();

// The cheap clock for per-iteration timestamps. On x86 the TSC (constant and invariant on any
// machine this runs on; here it ticks in 10 ns steps), elsewhere CLOCK_MONOTONIC in ns.
inline uint64_t Ticks() {
#if defined(__x86_64__) || defined(__i386__)
  return __rdtsc();
#else
  return static_cast<uint64_t>(MonoNs());
#endif
}

// Converts Ticks() to time. Calibrated against CLOCK_MONOTONIC over the span since Init()
// (Init spins 10 ms so early estimates are already good to ~0.1%).
class TickClock {
 public:
  static void Init();
  // Ticks per microsecond, re-measured over everything since Init (at least 10 ms).
  static double TicksPerUs();
  // The estimate from Init alone (cheap; for deadlines and poll intervals).
  static double RoughTicksPerUs();
};

// Aborts with "timed out waiting for <what>" when a spin loop runs longer than the timeout set
// with SetSpinTimeoutSeconds (default 60 s). Cheap: looks at the clock every 64 Ki calls.
void SetSpinTimeoutSeconds(double seconds);
class SpinGuard {
 public:
  explicit SpinGuard(const char* what);
  void Check() {
    if ((++count_ & 0xffff) == 0) CheckSlow();
  }

 private:
  void CheckSlow();
  const char* what_;
  uint64_t start_;
  uint64_t count_ = 0;
};

struct LatencyStats {
  size_t n = 0;
  double min_us = 0, max_us = 0, p50_us = 0, avg_us = 0, stdev_us = 0, p99_us = 0, p999_us = 0;
};
// Statistics of round-trip samples in ticks (the vector is sorted in place). Percentiles are
// nearest-rank: the smallest sample with at least q*n samples at or below it.
LatencyStats ComputeLatency(std::vector<uint64_t>& ticks, double ticks_per_us);

// Pins the calling thread (and threads it creates later) to `core`. Returns false and fills
// `error` if the kernel refuses.
bool PinToCore(int core, std::string* error);

// A TCP listening socket on host:port (port 0: ephemeral); `*bound_port` gets the port. The
// descriptor is NOT close-on-exec, so a spawned child can inherit it.
int ListenTcp(const std::string& host, int port, int* bound_port);
// Accepts one connection, waiting up to `timeout_ms`. Dies on failure.
int AcceptOne(int listen_fd, int timeout_ms);
// Connects to host:port, retrying for up to `timeout_ms` (the server may still be starting).
int ConnectTcp(const std::string& host, int port, int timeout_ms);

// Fixed-size messages over a connected stream socket. Every call dies on error, EOF or timeout,
// so a benchmark whose peer vanished exits instead of hanging.
class Oob {
 public:
  explicit Oob(int fd, int timeout_ms = 120000);
  ~Oob();
  Oob(const Oob&) = delete;
  Oob& operator=(const Oob&) = delete;

  void Send(const void* data, size_t n);
  void Recv(void* data, size_t n);
  // Non-blocking: accumulates bytes of one n-byte message across calls; true when complete.
  bool TryRecv(void* data, size_t n);

  template <typename T>
  void SendMsg(const T& m) {
    Send(&m, sizeof(m));
  }
  template <typename T>
  T RecvMsg() {
    T m;
    Recv(&m, sizeof(m));
    return m;
  }

 private:
  int fd_;
  int timeout_ms_;
  std::vector<char> partial_;
};

// Starts /proc/self/exe with `args` (argv[1..]); the child keeps inherited non-CLOEXEC fds.
pid_t SpawnSelf(const std::vector<std::string>& args);
// Waits for `pid` up to `timeout_ms`, then kills it. Returns its exit status (or 128+signal).
int WaitChild(pid_t pid, int timeout_ms);

}  // namespace swirl::bench

#endif  // SWIRL_BENCH_PERF_COMMON_H_
