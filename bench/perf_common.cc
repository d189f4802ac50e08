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

extern char** environ;

namespace swirl::bench {

void Die(const char* format, ...) {
  char message[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(message, sizeof(message), format, args);
  va_end(args);
  std::fprintf(stderr, "verbs_perf[%d]: %s\n", static_cast<int>(getpid()), message);
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

LatencyStats ComputeLatency(std::vector<uint64_t>& ticks, double ticks_per_us) {
  LatencyStats s;
  s.n = ticks.size();
  if (s.n == 0) return s;
  std::sort(ticks.begin(), ticks.end());
  auto us = [&](uint64_t t) { return static_cast<double>(t) / ticks_per_us; };
  auto rank = [&](double q) {
    size_t r = static_cast<size_t>(std::ceil(q * static_cast<double>(s.n)));
    return ticks[std::clamp<size_t>(r, 1, s.n) - 1];
  };
  s.min_us = us(ticks.front());
  s.max_us = us(ticks.back());
  s.p50_us = us(rank(0.5));
  s.p99_us = us(rank(0.99));
  s.p999_us = us(rank(0.999));
  long double sum = 0;
  for (uint64_t t : ticks) sum += t;
  const long double mean = sum / s.n;
  long double var = 0;
  for (uint64_t t : ticks) var += (t - mean) * (t - mean);
  var /= s.n;
  s.avg_us = static_cast<double>(mean) / ticks_per_us;
  s.stdev_us = std::sqrt(static_cast<double>(var)) / ticks_per_us;
  return s;
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
