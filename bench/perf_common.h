// The benchmarks' shared harness (bench/verbs_perf, rpc_perf, grpc_echo_perf, tcp_pingpong): a
// calibrated TSC clock, latency histograms and statistics, CPU pinning, the TCP out-of-band
// channel (perftest-style), child-process spawning, and the flags and reports every tool shares
// (below, "The shared harness").

#ifndef SWIRL_BENCH_PERF_COMMON_H_
#define SWIRL_BENCH_PERF_COMMON_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "base/histogram.h"

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

// A duration in measured time (the sum of the samples a tool reports as "seconds"), so a run
// asked for D seconds reports at least D: the time a tool spends between samples (a histogram
// flush, the loop's own checks) and the rough clock's error do not shorten it.
class MeasuredSpan {
 public:
  explicit MeasuredSpan(double seconds)
      : seconds_(seconds),
        ticks_(static_cast<uint64_t>(seconds * 1e6 * TickClock::RoughTicksPerUs())) {}
  // Has `measured_ticks` of samples covered the span? Cheap until the rough estimate says yes;
  // then the span is re-measured with the precise clock (once) before the answer is yes.
  bool Covered(uint64_t measured_ticks) {
    if (measured_ticks < ticks_) return false;
    if (!precise_) {
      precise_ = true;
      // 0.1% over: the final report re-measures the clock once more, over a slightly longer
      // span, and must not come out a hair short of what was asked.
      ticks_ = static_cast<uint64_t>(seconds_ * 1.001e6 * TickClock::TicksPerUs());
      return measured_ticks >= ticks_;
    }
    return true;
  }

 private:
  double seconds_;
  uint64_t ticks_;
  bool precise_ = false;
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

// Round-trip statistics in microseconds, from a swirl::Histogram of nanoseconds (percentiles
// within Histogram::kMaxRelativeError, 0.39%, of the nearest-rank sample; min, max, mean and
// stdev exact).
struct LatencyStats {
  size_t n = 0;
  double min_us = 0, max_us = 0, p50_us = 0, avg_us = 0, stdev_us = 0, p99_us = 0, p999_us = 0,
         p9999_us = 0;
};
LatencyStats StatsOf(const Histogram& ns);
// The same from samples in ticks (converted with `ticks_per_us`).
LatencyStats ComputeLatency(const std::vector<uint64_t>& ticks, double ticks_per_us);

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


// ---- The shared harness ---------------------------------------------------------------------
//
// verbs_perf, rpc_perf, grpc_echo_perf and tcp_pingpong take the same flags where they mean
// the same, spelled as perftest spells them where perftest has them:
//
//   -s, --size N         message (or transfer) size in bytes
//   -a, --all            sweep sizes 2 B .. 8 MiB in powers of two
//   -n, --iters N        measured iterations per size (0: the tool's automatic count)
//   -D, --duration S     measure for S seconds per size instead of a count (perftest's -D)
//   --warmup N           untimed iterations first (-1: the tool's rule; with -D, 10% of S)
//   --inflight N         calls or messages in flight (0: the tool's default for the test)
//   --threads N          client threads, each with its own connection (rpc_perf, grpc_echo_perf)
//   --client_core C, --server_core C   where the two sides are pinned (-1: not pinned)
//   --json               one JSON object on stdout instead of the table
//   --out_json [--out_json_file F]     also write that JSON to F (perftest's flags; default
//                                      perftest_out.json)
//   --csv                CSV on stdout instead of the table (a header line, then one per size)
//   -H, --histogram      after each row, the whole latency histogram (perftest's -H)
//
// Latency is always measured as a round trip. JSON carries it as rtt_* (round trip, us), with
// perftest's own keys beside (t_min, t_typical, t_avg, t_stdev, t_max, percentile_99,
// percentile_99.9: one-way = RTT/2, as perftest reports, except RDMA READ, whose round trip
// perftest does not halve; MsgSize, n_iterations, BW_average, BW_peak, MsgRate for bandwidth),
// and the histogram itself (nanoseconds, base/histogram.h's buckets: [lower, count] pairs).

// Rewrites perftest's short options (-s N, -a, -n N, -D S, -H, -d DEV) into the long flags,
// then parses the command line with Abseil. Returns the positional arguments.
std::vector<char*> ParseHarnessCommandLine(int argc, char** argv, const char* usage);

// The sizes to run: -a's sweep, or --size.
std::vector<uint64_t> HarnessSizes();
constexpr uint64_t kMaxSweepSize = 8ull << 20;
// --iters, or `automatic` when it is 0.
uint64_t HarnessIters(uint64_t automatic);
// --duration in seconds (0: count mode).
double HarnessDuration();
// The warm-up count: --warmup if >= 0, else max(iters / 10, min(iters, 16)).
uint64_t HarnessWarmup(uint64_t iters);
// --warmup as given (-1: automatic).
int64_t HarnessWarmupFlag();
// --inflight, or `automatic` when it is 0.
int HarnessInflight(int automatic);
int HarnessThreads();
int ClientCore();
int ServerCore();

// Records round-trip samples taken with Ticks() into a Histogram of nanoseconds without
// touching the histogram (or the clock calibration) on the timed path: samples go to a buffer,
// folded in by Flush() when the buffer is full. Add() returns true when it flushed, so the
// caller can restart its clock after the flush instead of counting the flush as latency.
class LatencyRecorder {
 public:
  explicit LatencyRecorder(size_t buffer = 1 << 16);
  bool Add(uint64_t ticks) {
    buffer_[used_++] = ticks;
    if (used_ < buffer_.size()) return false;
    Flush();
    return true;
  }
  void Flush();
  const Histogram& histogram() {
    Flush();
    return ns_;
  }
  // Also writes every sample, in microseconds and in order, to `path` (verbs_perf
  // --samples_out).
  void WriteSamplesTo(const std::string& path);
  ~LatencyRecorder();

 private:
  std::vector<uint64_t> buffer_;
  size_t used_ = 0;
  Histogram ns_;
  FILE* samples_ = nullptr;
};

// One measured size of one test.
struct ResultRow {
  std::string test;
  uint64_t size = 0;
  uint64_t iters = 0;
  uint64_t warmup = 0;
  double seconds = 0;
  // Latency (round trips, ns). one_way_divisor: how perftest derives its one-way t_* columns
  // (2: RTT/2; 1: the round trip itself, as for RDMA READ).
  bool has_latency = false;
  Histogram rtt_ns;
  int one_way_divisor = 2;
  // Rates (negative: not measured).
  double ops_per_s = -1;
  double bytes_per_s = -1;
  double peak_bytes_per_s = -1;
  // The tool's own keys, already formatted as JSON values, and the text lines it wants printed
  // under the row.
  std::vector<std::pair<std::string, std::string>> extra;
  std::vector<std::string> notes;

  void Add(const std::string& key, double v);
  void Add(const std::string& key, const std::string& v);
  void AddInt(const std::string& key, int64_t v);
  void AddBool(const std::string& key, bool v);
};

std::string JsonEscape(const std::string& s);
// A row's JSON object: `context` (key, JSON value) pairs first, then swirl's keys, perftest's
// keys, the tool's own, and the histogram.
std::string RowJson(const ResultRow& row,
                    const std::vector<std::pair<std::string, std::string>>& context);

// Prints rows as the flags ask (table, CSV, JSON; -H; --out_json). For the table, the tool
// prints its own header first (perftest-style) and calls Row() per size.
class Report {
 public:
  explicit Report(std::string tool);
  bool text() const { return !json_ && !csv_; }
  // Context keys (device, cores, ...) that go into every JSON row, as JSON values.
  void SetContext(std::vector<std::pair<std::string, std::string>> context) {
    context_ = std::move(context);
  }
  // Prints the row now (table or CSV) and keeps it for Finish().
  void Row(ResultRow row);
  // JSON on stdout (one object for one row; {"test", "results": [...]} for a sweep) and the
  // --out_json file.
  void Finish();

  // The table's column headers (latency or bandwidth), for the tool's header.
  static void PrintLatencyHeader();
  static void PrintBwHeader();

 private:
  std::string tool_;
  bool json_, csv_, histogram_;
  bool csv_header_done_ = false;
  std::vector<std::pair<std::string, std::string>> context_;
  std::vector<ResultRow> rows_;
};

}  // namespace swirl::bench

#endif  // SWIRL_BENCH_PERF_COMMON_H_
