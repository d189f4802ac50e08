#include "bench/perf_common.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

extern char** environ;

namespace swirl::bench {

void Die(const char* format, ...) {
  char message[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(message, sizeof(message), format, args);
  va_end(args);
  std::fprintf(stderr, "%s[%d]: %s\n", program_invocation_short_name, static_cast<int>(getpid()),
               message);
  std::fflush(stderr);
  std::_Exit(1);
}

int64_t MonoNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// ---- Clock ------------------------------------------------------------------------------------

namespace {
uint64_t g_tick0 = 0;
int64_t g_ns0 = 0;
double g_rough_ticks_per_us = 0;
double g_spin_timeout_s = 60;

double MeasureSinceInit(int64_t min_ns) {
  int64_t ns;
  uint64_t ticks;
  do {
    ns = MonoNs();
    ticks = Ticks();
  } while (ns - g_ns0 < min_ns);
  return static_cast<double>(ticks - g_tick0) * 1000.0 / static_cast<double>(ns - g_ns0);
}
}  // namespace

void TickClock::Init() {
  if (g_ns0 != 0) return;
  g_ns0 = MonoNs();
  g_tick0 = Ticks();
  g_rough_ticks_per_us = MeasureSinceInit(10 * 1000 * 1000);
}

double TickClock::TicksPerUs() {
  if (g_ns0 == 0) Init();
  return MeasureSinceInit(10 * 1000 * 1000);
}

double TickClock::RoughTicksPerUs() {
  if (g_ns0 == 0) Init();
  return g_rough_ticks_per_us;
}

void SetSpinTimeoutSeconds(double seconds) { g_spin_timeout_s = seconds; }

SpinGuard::SpinGuard(const char* what) : what_(what), start_(Ticks()) {}

void SpinGuard::CheckSlow() {
  const double elapsed_us = static_cast<double>(Ticks() - start_) / TickClock::RoughTicksPerUs();
  if (elapsed_us > g_spin_timeout_s * 1e6) {
    Die("timed out after %.0f s waiting for %s", g_spin_timeout_s, what_);
  }
}

// ---- Statistics -------------------------------------------------------------------------------

LatencyStats StatsOf(const Histogram& ns) {
  LatencyStats s;
  s.n = ns.count();
  if (s.n == 0) return s;
  auto us = [](double v) { return v / 1000.0; };
  s.min_us = us(static_cast<double>(ns.min()));
  s.max_us = us(static_cast<double>(ns.max()));
  s.p50_us = us(static_cast<double>(ns.Percentile(0.5)));
  s.p99_us = us(static_cast<double>(ns.Percentile(0.99)));
  s.p999_us = us(static_cast<double>(ns.Percentile(0.999)));
  s.p9999_us = us(static_cast<double>(ns.Percentile(0.9999)));
  s.avg_us = us(ns.mean());
  s.stdev_us = us(ns.stdev());
  return s;
}

LatencyStats ComputeLatency(const std::vector<uint64_t>& ticks, double ticks_per_us) {
  Histogram h;
  const double ns_per_tick = 1000.0 / ticks_per_us;
  for (uint64_t t : ticks) h.Add(static_cast<uint64_t>(std::llround(t * ns_per_tick)));
  return StatsOf(h);
}

// ---- Pinning ----------------------------------------------------------------------------------

bool PinToCore(int core, std::string* error) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (core < 0 || core >= CPU_SETSIZE) {
    *error = "core out of range";
    return false;
  }
  CPU_SET(core, &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    *error = std::strerror(errno);
    return false;
  }
  return true;
}

// ---- TCP --------------------------------------------------------------------------------------

int ListenTcp(const std::string& host, int port, int* bound_port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) Die("socket: %s", std::strerror(errno));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (host.empty() || host == "0.0.0.0") {
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
  } else if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    Die("bad listen address %s", host.c_str());
  }
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    Die("bind %s:%d: %s", host.c_str(), port, std::strerror(errno));
  }
  if (listen(fd, 4) != 0) Die("listen: %s", std::strerror(errno));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *bound_port = ntohs(addr.sin_port);
  return fd;
}

namespace {
void SetNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  fcntl(fd, F_SETFD, FD_CLOEXEC);
}
}  // namespace

int AcceptOne(int listen_fd, int timeout_ms) {
  pollfd p{listen_fd, POLLIN, 0};
  int r;
  do {
    r = poll(&p, 1, timeout_ms);
  } while (r < 0 && errno == EINTR);
  if (r == 0) Die("no client connected within %d ms", timeout_ms);
  if (r < 0) Die("poll: %s", std::strerror(errno));
  int fd = accept(listen_fd, nullptr, nullptr);
  if (fd < 0) Die("accept: %s", std::strerror(errno));
  SetNoDelay(fd);
  return fd;
}

int ConnectTcp(const std::string& host, int port, int timeout_ms) {
  const int64_t deadline = MonoNs() + static_cast<int64_t>(timeout_ms) * 1000000;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string service = std::to_string(port);
  std::string last_error = "no address";
  for (;;) {
    addrinfo* result = nullptr;
    int gai = getaddrinfo(host.c_str(), service.c_str(), &hints, &result);
    if (gai != 0) Die("cannot resolve %s: %s", host.c_str(), gai_strerror(gai));
    for (addrinfo* a = result; a != nullptr; a = a->ai_next) {
      int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
      if (fd < 0) continue;
      if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        freeaddrinfo(result);
        SetNoDelay(fd);
        return fd;
      }
      last_error = std::strerror(errno);
      close(fd);
    }
    freeaddrinfo(result);
    if (MonoNs() > deadline) Die("connect %s:%d: %s", host.c_str(), port, last_error.c_str());
    usleep(50 * 1000);
  }
}

Oob::Oob(int fd, int timeout_ms) : fd_(fd), timeout_ms_(timeout_ms) {}

Oob::~Oob() {
  if (fd_ >= 0) close(fd_);
}

void Oob::Send(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = send(fd_, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) Die("out-of-band send: %s", w < 0 ? std::strerror(errno) : "closed");
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void Oob::Recv(void* data, size_t n) {
  char* p = static_cast<char*>(data);
  size_t have = 0;
  // Bytes TryRecv collected belong to this message.
  if (!partial_.empty()) {
    have = std::min(n, partial_.size());
    std::memcpy(p, partial_.data(), have);
    partial_.erase(partial_.begin(), partial_.begin() + static_cast<ptrdiff_t>(have));
  }
  while (have < n) {
    pollfd pf{fd_, POLLIN, 0};
    int r = poll(&pf, 1, timeout_ms_);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) Die("peer silent for %d ms on the out-of-band channel", timeout_ms_);
    ssize_t got = recv(fd_, p + have, n - have, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) Die("out-of-band recv: %s", got < 0 ? std::strerror(errno) : "peer closed");
    have += static_cast<size_t>(got);
  }
}

bool Oob::TryRecv(void* data, size_t n) {
  if (partial_.size() < n) {
    char buffer[256];
    const size_t want = std::min(sizeof(buffer), n - partial_.size());
    ssize_t got = recv(fd_, buffer, want, MSG_DONTWAIT);
    if (got == 0) Die("out-of-band recv: peer closed");
    if (got < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
      Die("out-of-band recv: %s", std::strerror(errno));
    }
    partial_.insert(partial_.end(), buffer, buffer + got);
  }
  if (partial_.size() < n) return false;
  std::memcpy(data, partial_.data(), n);
  partial_.erase(partial_.begin(), partial_.begin() + static_cast<ptrdiff_t>(n));
  return true;
}

// ---- Processes --------------------------------------------------------------------------------

pid_t SpawnSelf(const std::vector<std::string>& args) {
  std::vector<std::string> all;
  all.push_back("/proc/self/exe");
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid;
  int err = posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), environ);
  if (err != 0) Die("posix_spawn /proc/self/exe: %s", std::strerror(err));
  return pid;
}

int WaitChild(pid_t pid, int timeout_ms) {
  const int64_t deadline = MonoNs() + static_cast<int64_t>(timeout_ms) * 1000000;
  for (;;) {
    int status;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
      return 1;
    }
    if (r < 0) return 1;
    if (MonoNs() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      std::fprintf(stderr, "verbs_perf: child %d did not exit; killed it\n", static_cast<int>(pid));
      return 1;
    }
    usleep(1000);
  }
}

}  // namespace swirl::bench

// ---- The shared harness -------------------------------------------------------------------------

ABSL_FLAG(uint64_t, size, 64, "message (or transfer) size in bytes (perftest: -s)");
ABSL_FLAG(bool, all, false, "sweep sizes 2 B .. 8 MiB in powers of two (perftest: -a)");
ABSL_FLAG(uint64_t, iters, 0,
          "measured iterations per size; 0: the tool's automatic count (perftest: -n)");
ABSL_FLAG(double, duration, 0,
          "measure each size for this many seconds instead of a count (perftest: -D)");
ABSL_FLAG(int64_t, warmup, -1,
          "untimed iterations before each measurement; -1: iters/10 (with --duration: the "
          "first 10% of it)");
ABSL_FLAG(int, inflight, 0,
          "calls or messages kept in flight; 0: the tool's default for the test");
ABSL_FLAG(int, threads, 1, "client threads, each with its own connection");
ABSL_FLAG(int, client_core, 0, "CPU the client is pinned to (-1: not pinned)");
ABSL_FLAG(int, server_core, 1, "CPU the server is pinned to (-1: not pinned)");
ABSL_FLAG(bool, json, false, "print one JSON object on one line instead of the table");
ABSL_FLAG(bool, out_json, false, "also write the JSON report to --out_json_file (perftest's flag)");
ABSL_FLAG(std::string, out_json_file, "perftest_out.json", "where --out_json writes");
ABSL_FLAG(bool, csv, false, "print CSV (a header line, then one line per size) instead of the table");
ABSL_FLAG(bool, histogram, false,
          "after each row of the table, print its whole latency histogram (perftest: -H)");

namespace swirl::bench {

std::vector<char*> ParseHarnessCommandLine(int argc, char** argv, const char* usage) {
  // perftest's short options. Rewritten rather than defined as one-letter flags, so "-s 64"
  // (a separate value, which Abseil would not take for a one-letter flag) works as in perftest.
  static std::vector<std::string> storage;  // argv must outlive the parse
  static const struct {
    const char* short_name;
    const char* long_name;
    bool takes_value;
  } kShort[] = {{"-s", "--size", true},     {"-n", "--iters", true},  {"-D", "--duration", true},
                {"-d", "--device", true},   {"-a", "--all", false},   {"-H", "--histogram", false}};
  storage.clear();
  storage.reserve(static_cast<size_t>(argc) * 2);
  bool positional_only = false;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    bool rewritten = false;
    if (i > 0 && !positional_only) {
      if (arg == "--") positional_only = true;
      for (const auto& s : kShort) {
        const size_t n = std::strlen(s.short_name);
        if (arg.compare(0, n, s.short_name) != 0) continue;
        if (!s.takes_value) {
          if (arg.size() != n) continue;
          storage.push_back(s.long_name);
        } else if (arg.size() > n) {  // -s64
          storage.push_back(std::string(s.long_name) + "=" + arg.substr(n));
        } else if (i + 1 < argc) {  // -s 64
          storage.push_back(std::string(s.long_name) + "=" + argv[++i]);
        } else {
          Die("%s needs a value", s.short_name);
        }
        rewritten = true;
        break;
      }
    }
    if (!rewritten) storage.push_back(arg);
  }
  std::vector<char*> args;
  for (std::string& s : storage) args.push_back(s.data());
  absl::SetProgramUsageMessage(usage);
  std::vector<char*> rest = absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (absl::GetFlag(FLAGS_duration) < 0) Die("--duration must not be negative");
  if (absl::GetFlag(FLAGS_inflight) < 0) Die("--inflight must not be negative");
  if (absl::GetFlag(FLAGS_threads) <= 0) Die("--threads must be positive");
  return rest;
}

std::vector<uint64_t> HarnessSizes() {
  std::vector<uint64_t> sizes;
  if (absl::GetFlag(FLAGS_all)) {
    for (uint64_t s = 2; s <= kMaxSweepSize; s *= 2) sizes.push_back(s);
  } else {
    sizes.push_back(absl::GetFlag(FLAGS_size));
  }
  return sizes;
}

uint64_t HarnessIters(uint64_t automatic) {
  const uint64_t n = absl::GetFlag(FLAGS_iters);
  return n != 0 ? n : automatic;
}

double HarnessDuration() { return absl::GetFlag(FLAGS_duration); }

int64_t HarnessWarmupFlag() { return absl::GetFlag(FLAGS_warmup); }

uint64_t HarnessWarmup(uint64_t iters) {
  const int64_t flag = absl::GetFlag(FLAGS_warmup);
  if (flag >= 0) return static_cast<uint64_t>(flag);
  return std::max<uint64_t>(iters / 10, std::min<uint64_t>(iters, 16));
}

int HarnessInflight(int automatic) {
  const int n = absl::GetFlag(FLAGS_inflight);
  return n > 0 ? n : automatic;
}
int HarnessThreads() { return absl::GetFlag(FLAGS_threads); }
int ClientCore() { return absl::GetFlag(FLAGS_client_core); }
int ServerCore() { return absl::GetFlag(FLAGS_server_core); }

// ---- LatencyRecorder ----------------------------------------------------------------------------

LatencyRecorder::LatencyRecorder(size_t buffer) : buffer_(std::max<size_t>(buffer, 1)) {}

LatencyRecorder::~LatencyRecorder() {
  if (samples_ != nullptr) std::fclose(samples_);
}

void LatencyRecorder::WriteSamplesTo(const std::string& path) {
  if (samples_ != nullptr) std::fclose(samples_);
  samples_ = std::fopen(path.c_str(), "w");
  if (samples_ == nullptr) Die("cannot write %s: %s", path.c_str(), std::strerror(errno));
}

void LatencyRecorder::Flush() {
  if (used_ == 0) return;
  const double ns_per_tick = 1000.0 / TickClock::TicksPerUs();
  for (size_t i = 0; i < used_; ++i) {
    const double ns = static_cast<double>(buffer_[i]) * ns_per_tick;
    ns_.Add(static_cast<uint64_t>(std::llround(ns)));
    if (samples_ != nullptr) std::fprintf(samples_, "%.4f\n", ns / 1000.0);
  }
  used_ = 0;
}

// ---- Rows and reports ----------------------------------------------------------------------------

void ResultRow::Add(const std::string& key, double v) {
  // %.6g keeps small rates nonzero; JSON has no nan or inf.
  extra.push_back({key, std::isfinite(v) ? absl::StrFormat("%.6g", v) : "null"});
}
void ResultRow::Add(const std::string& key, const std::string& v) {
  extra.push_back({key, absl::StrCat("\"", JsonEscape(v), "\"")});
}
void ResultRow::AddInt(const std::string& key, int64_t v) {
  extra.push_back({key, absl::StrCat(v)});
}
void ResultRow::AddBool(const std::string& key, bool v) {
  extra.push_back({key, v ? "true" : "false"});
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppendFormat(&out, "\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out;
}

namespace {

std::string Num(double v) { return std::isfinite(v) ? absl::StrFormat("%.4f", v) : "null"; }

}  // namespace

std::string RowJson(const ResultRow& row,
                    const std::vector<std::pair<std::string, std::string>>& context) {
  std::string out = absl::StrFormat("{\"test\":\"%s\"", JsonEscape(row.test));
  for (const auto& [k, v] : context) absl::StrAppendFormat(&out, ",\"%s\":%s", k, v);
  absl::StrAppendFormat(&out, ",\"size\":%d,\"iters\":%d,\"warmup\":%d,\"seconds\":%s", row.size,
                        row.iters, row.warmup, Num(row.seconds));
  if (row.has_latency) {
    const LatencyStats s = StatsOf(row.rtt_ns);
    absl::StrAppendFormat(&out,
                          ",\"rtt_min_us\":%s,\"rtt_p50_us\":%s,\"rtt_avg_us\":%s,"
                          "\"rtt_p99_us\":%s,\"rtt_p999_us\":%s,\"rtt_p9999_us\":%s,"
                          "\"rtt_max_us\":%s,\"rtt_stdev_us\":%s",
                          Num(s.min_us), Num(s.p50_us), Num(s.avg_us), Num(s.p99_us),
                          Num(s.p999_us), Num(s.p9999_us), Num(s.max_us), Num(s.stdev_us));
    // perftest's keys, with perftest's meaning (one-way = RTT / one_way_divisor).
    const double d = row.one_way_divisor;
    absl::StrAppendFormat(&out,
                          ",\"MsgSize\":%d,\"n_iterations\":%d,\"t_min\":%s,\"t_max\":%s,"
                          "\"t_typical\":%s,\"t_avg\":%s,\"t_stdev\":%s,\"percentile_99\":%s,"
                          "\"percentile_99.9\":%s,\"percentile_99.99\":%s",
                          row.size, row.iters, Num(s.min_us / d), Num(s.max_us / d),
                          Num(s.p50_us / d), Num(s.avg_us / d), Num(s.stdev_us / d),
                          Num(s.p99_us / d), Num(s.p999_us / d), Num(s.p9999_us / d));
  }
  if (row.ops_per_s >= 0) absl::StrAppendFormat(&out, ",\"ops_per_s\":%.6g", row.ops_per_s);
  if (row.bytes_per_s >= 0) {
    absl::StrAppendFormat(&out, ",\"gbytes_per_s\":%.6g,\"bw_avg_mib_per_s\":%.6g",
                          row.bytes_per_s / 1e9, row.bytes_per_s / 1048576.0);
    if (!row.has_latency) {
      absl::StrAppendFormat(&out, ",\"MsgSize\":%d,\"n_iterations\":%d,\"BW_average\":%.2f",
                            row.size, row.iters, row.bytes_per_s / 1048576.0);
      if (row.ops_per_s >= 0) absl::StrAppendFormat(&out, ",\"MsgRate\":%.6f", row.ops_per_s / 1e6);
    }
  }
  if (row.peak_bytes_per_s >= 0) {
    absl::StrAppendFormat(&out, ",\"peak_gbytes_per_s\":%.6g,\"bw_peak_mib_per_s\":%.6g",
                          row.peak_bytes_per_s / 1e9, row.peak_bytes_per_s / 1048576.0);
    if (!row.has_latency) {
      absl::StrAppendFormat(&out, ",\"BW_peak\":%.2f", row.peak_bytes_per_s / 1048576.0);
    }
  }
  for (const auto& [k, v] : row.extra) absl::StrAppendFormat(&out, ",\"%s\":%s", k, v);
  if (row.has_latency) {
    absl::StrAppendFormat(&out,
                          ",\"histogram\":{\"unit\":\"ns\",\"sub_bucket_bits\":%d,"
                          "\"max_relative_error\":%.6f,\"buckets\":[",
                          Histogram::kSubBucketBits, Histogram::kMaxRelativeError);
    bool first = true;
    for (const Histogram::Bucket& b : row.rtt_ns.Buckets()) {
      absl::StrAppendFormat(&out, "%s[%d,%d]", first ? "" : ",", b.lower, b.count);
      first = false;
    }
    absl::StrAppend(&out, "]}");
  }
  return out + "}";
}

Report::Report(std::string tool)
    : tool_(std::move(tool)),
      json_(absl::GetFlag(FLAGS_json)),
      csv_(absl::GetFlag(FLAGS_csv)),
      histogram_(absl::GetFlag(FLAGS_histogram)) {
  if (json_ && csv_) Die("--json and --csv are two ways to print: choose one");
}

void Report::PrintLatencyHeader() {
  std::printf(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]"
              "    t_stdev[usec]   99%% percentile[usec]   99.9%% percentile[usec]   "
              "99.99%% percentile[usec]   |  RTT p50[usec]  RTT p99.99[usec]\n");
}

void Report::PrintBwHeader() {
  std::printf(" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   "
              "MsgRate[Mpps]\n");
}

void Report::Row(ResultRow row) {
  if (csv_) {
    if (!csv_header_done_) {
      std::printf("tool,test,size,iters,warmup,seconds,rtt_min_us,rtt_p50_us,rtt_avg_us,"
                  "rtt_stdev_us,rtt_p99_us,rtt_p999_us,rtt_p9999_us,rtt_max_us,oneway_p50_us,"
                  "oneway_p99_us,oneway_p999_us,oneway_p9999_us,ops_per_s,gbytes_per_s,"
                  "peak_gbytes_per_s\n");
      csv_header_done_ = true;
    }
    std::string line = absl::StrFormat("%s,%s,%d,%d,%d,%.6f", tool_, row.test, row.size, row.iters,
                                       row.warmup, row.seconds);
    if (row.has_latency) {
      const LatencyStats s = StatsOf(row.rtt_ns);
      const double d = row.one_way_divisor;
      absl::StrAppendFormat(&line, ",%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f",
                            s.min_us, s.p50_us, s.avg_us, s.stdev_us, s.p99_us, s.p999_us,
                            s.p9999_us, s.max_us, s.p50_us / d, s.p99_us / d, s.p999_us / d,
                            s.p9999_us / d);
    } else {
      absl::StrAppend(&line, ",,,,,,,,,,,,");
    }
    auto cell = [](double v, double scale) {
      return v >= 0 ? absl::StrFormat(",%.6g", v / scale) : std::string(",");
    };
    absl::StrAppend(&line, cell(row.ops_per_s, 1), cell(row.bytes_per_s, 1e9),
                    cell(row.peak_bytes_per_s, 1e9));
    std::printf("%s\n", line.c_str());
  } else if (!json_) {
    if (row.has_latency) {
      const LatencyStats s = StatsOf(row.rtt_ns);
      const double d = row.one_way_divisor;
      std::printf(" %-7lu %-10lu %-7.2f        %-7.2f      %-7.2f          %-7.2f        %-7.2f"
                  "         %-7.2f                %-7.2f                  %-7.2f              "
                  "|  %-7.3f        %-7.3f\n",
                  static_cast<unsigned long>(row.size), static_cast<unsigned long>(row.iters),
                  s.min_us / d, s.max_us / d, s.p50_us / d, s.avg_us / d, s.stdev_us / d,
                  s.p99_us / d, s.p999_us / d, s.p9999_us / d, s.p50_us, s.p9999_us);
    } else {
      // perftest's MB is 2^20 bytes.
      auto mib = [](double v) { return v >= 0 ? v / 1048576.0 : 0.0; };
      std::printf(" %-7lu    %-10lu       %-10.2f         %-10.2f           %-9.6f\n",
                  static_cast<unsigned long>(row.size), static_cast<unsigned long>(row.iters),
                  mib(row.peak_bytes_per_s >= 0 ? row.peak_bytes_per_s : row.bytes_per_s),
                  mib(row.bytes_per_s), row.ops_per_s >= 0 ? row.ops_per_s / 1e6 : 0.0);
    }
    for (const std::string& note : row.notes) std::printf("   %s\n", note.c_str());
    if (histogram_ && row.has_latency) {
      // HdrHistogram's percentile distribution (.hgrm), round trips in microseconds: each
      // value is the top of its bucket.
      std::printf("       Value     Percentile TotalCount 1/(1-Percentile)   (round trip, usec)\n");
      const double total = static_cast<double>(row.rtt_ns.count());
      uint64_t seen = 0;
      for (const Histogram::Bucket& b : row.rtt_ns.Buckets()) {
        seen += b.count;
        const double q = static_cast<double>(seen) / total;
        const double top = static_cast<double>(std::min(b.lower + b.width - 1, row.rtt_ns.max()));
        if (seen == row.rtt_ns.count()) {
          std::printf("%12.3f %14.12f %10lu\n", top / 1000.0, q, static_cast<unsigned long>(seen));
        } else {
          std::printf("%12.3f %14.12f %10lu %14.2f\n", top / 1000.0, q,
                      static_cast<unsigned long>(seen), 1.0 / (1.0 - q));
        }
      }
      std::printf("#[Mean    = %12.3f, StdDeviation   = %12.3f]\n", row.rtt_ns.mean() / 1000.0,
                  row.rtt_ns.stdev() / 1000.0);
      std::printf("#[Max     = %12.3f, Total count    = %12lu]\n",
                  static_cast<double>(row.rtt_ns.max()) / 1000.0,
                  static_cast<unsigned long>(row.rtt_ns.count()));
      std::printf("#[Buckets = %12zu, SubBuckets     = %12lu]  (base/histogram.h: within %.2f%%)\n",
                  row.rtt_ns.Buckets().size(), static_cast<unsigned long>(Histogram::kSubBuckets),
                  100 * Histogram::kMaxRelativeError);
    }
  }
  std::fflush(stdout);
  rows_.push_back(std::move(row));
}

void Report::Finish() {
  if (rows_.empty()) return;
  std::string out;
  if (rows_.size() == 1) {
    out = RowJson(rows_[0], context_);
  } else {
    out = absl::StrFormat("{\"test\":\"%s\"", JsonEscape(rows_[0].test));
    for (const auto& [k, v] : context_) absl::StrAppendFormat(&out, ",\"%s\":%s", k, v);
    absl::StrAppend(&out, ",\"results\":[");
    for (size_t i = 0; i < rows_.size(); ++i) {
      absl::StrAppend(&out, i ? "," : "", RowJson(rows_[i], context_));
    }
    absl::StrAppend(&out, "]}");
  }
  if (json_) std::printf("%s\n", out.c_str());
  if (absl::GetFlag(FLAGS_out_json)) {
    const std::string path = absl::GetFlag(FLAGS_out_json_file);
    FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) Die("cannot write %s: %s", path.c_str(), std::strerror(errno));
    std::fprintf(f, "%s\n", out.c_str());
    std::fclose(f);
  }
  std::fflush(stdout);
}

}  // namespace swirl::bench
