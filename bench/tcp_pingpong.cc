// The floor under the soft device's TCP fabric: two processes ping-ponging a message over plain
// TCP loopback sockets, busy-polling non-blocking receives as the fabric's polls do, pinned to
// cores 0 and 1. `--connections 2` sends each direction on its own connection, as the fabric
// does today (one connection per QP per direction); `--connections 1` uses one connection both
// ways, so the kernel's acknowledgements ride on the replies. The difference between the two is
// what the fabric's connection layout costs (docs/BENCHMARKS.md, "Soft device over TCP").
//
//   bazel-bin/bench/tcp_pingpong --connections 2 --json
//   B=bazel-bin/bench; python3 bench/side_by_side.py --pairs 9 --
//       $B/tcp_pingpong --connections 1 --json -- $B/tcp_pingpong --connections 2 --json

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/perf_common.h"

// -s, -n (default 20000), cores, --json, --csv, -H: the shared harness (bench/perf_common.h).
ABSL_FLAG(int, connections, 2, "1: one connection both ways; 2: one per direction");
ABSL_FLAG(bool, echo_child, false, "internal: run as the echoing side");
ABSL_FLAG(int, port, 0, "internal: the port to connect to");

namespace swirl::bench {
namespace {

void NoDelay(int fd) {
  int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
    Die("TCP_NODELAY: %s", std::strerror(errno));
  }
}

void Pin(int core) {
  if (core < 0) return;
  std::string error;
  if (!PinToCore(core, &error)) Die("cannot pin to core %d: %s", core, error.c_str());
}

// Receives exactly n bytes, spinning on non-blocking reads.
void Receive(int fd, char* buf, size_t n) {
  size_t got = 0;
  SpinGuard guard("the peer's message");
  while (got < n) {
    const ssize_t r = recv(fd, buf + got, n - got, MSG_DONTWAIT);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r == 0) {
      Die("the peer closed the connection");
    } else if (errno != EAGAIN && errno != EINTR) {
      Die("recv: %s", std::strerror(errno));
    }
    guard.Check();
  }
}

void SendAll(int fd, const char* buf, size_t n) {
  size_t sent = 0;
  while (sent < n) {
    const ssize_t r = send(fd, buf + sent, n - sent, MSG_NOSIGNAL);
    if (r < 0 && errno != EINTR && errno != EAGAIN) Die("send: %s", std::strerror(errno));
    if (r > 0) sent += static_cast<size_t>(r);
  }
}

// The echoing side: connects (once or twice) and sends back whatever arrives.
int RunEcho() {
  Pin(ServerCore());
  const int connections = absl::GetFlag(FLAGS_connections);
  const int in = ConnectTcp("127.0.0.1", absl::GetFlag(FLAGS_port), 10000);
  NoDelay(in);
  int out = in;
  if (connections == 2) {
    out = ConnectTcp("127.0.0.1", absl::GetFlag(FLAGS_port), 10000);
    NoDelay(out);
  }
  std::vector<char> buf(HarnessSizes()[0]);
  for (;;) {
    size_t got = 0;
    while (got < buf.size()) {
      const ssize_t r = recv(in, buf.data() + got, buf.size() - got, MSG_DONTWAIT);
      if (r == 0) return 0;  // the measuring side is done
      if (r > 0) got += static_cast<size_t>(r);
      if (r < 0 && errno != EAGAIN && errno != EINTR) Die("recv: %s", std::strerror(errno));
    }
    SendAll(out, buf.data(), buf.size());
  }
}

int Run() {
  const int connections = absl::GetFlag(FLAGS_connections);
  if (connections != 1 && connections != 2) Die("--connections must be 1 or 2");
  const std::vector<uint64_t> sizes = HarnessSizes();
  if (sizes.size() != 1) Die("-a: tcp_pingpong runs one size");
  const uint64_t size = sizes[0];
  if (size == 0 || size > (1u << 20)) Die("--size must be 1 .. 1048576");
  TickClock::Init();
  int port = 0;
  const int listener = ListenTcp("127.0.0.1", 0, &port);
  const pid_t child = SpawnSelf({"--echo_child", absl::StrCat("--port=", port),
                                 absl::StrCat("--connections=", connections),
                                 absl::StrCat("--size=", size),
                                 absl::StrCat("--server_core=", ServerCore())});
  const int client_core = ClientCore();
  Pin(client_core);
  // With two connections the echo side connects `in` first: ours to send on, then ours to
  // receive on.
  const int send_fd = AcceptOne(listener, 10000);
  const int recv_fd = connections == 2 ? AcceptOne(listener, 10000) : send_fd;
  NoDelay(send_fd);
  NoDelay(recv_fd);
  close(listener);

  const uint64_t iters = HarnessIters(20000);
  const uint64_t warmup = HarnessWarmupFlag() >= 0 ? HarnessWarmup(iters)
                                                   : std::max<uint64_t>(iters / 10, 100);
  std::vector<char> buf(size, 'x');
  LatencyRecorder recorder;
  uint64_t timed = 0;
  for (uint64_t i = 0; i < warmup + iters; ++i) {
    const uint64_t start = Ticks();
    SendAll(send_fd, buf.data(), size);
    Receive(recv_fd, buf.data(), size);
    if (i >= warmup) {
      const uint64_t t = Ticks() - start;
      timed += t;
      recorder.Add(t);
    }
  }
  close(send_fd);
  if (recv_fd != send_fd) close(recv_fd);
  const int child_rc = WaitChild(child, 10000);
  if (child_rc != 0) Die("the echo side exited with status %d", child_rc);

  ResultRow row;
  row.test = "tcp_pingpong";
  row.size = size;
  row.iters = iters;
  row.warmup = warmup;
  row.seconds = static_cast<double>(timed) / TickClock::TicksPerUs() / 1e6;
  row.has_latency = true;
  row.rtt_ns = recorder.histogram();
  row.ops_per_s = row.seconds > 0 ? static_cast<double>(iters) / row.seconds : 0;
  row.AddInt("connections", connections);
  Report report("tcp_pingpong");
  report.SetContext({{"client_core", absl::StrCat(client_core)},
                     {"server_core", absl::StrCat(ServerCore())}});
  if (report.text()) {
    std::printf("TCP loopback ping-pong, %lu B, %d connection%s\n", static_cast<unsigned long>(size),
                connections, connections == 1 ? "" : "s");
    Report::PrintLatencyHeader();
  }
  report.Row(std::move(row));
  report.Finish();
  return 0;
}

}  // namespace
}  // namespace swirl::bench

int main(int argc, char** argv) {
  swirl::bench::ParseHarnessCommandLine(argc, argv,
                                        "tcp_pingpong [--connections 1|2] [-s N] [-n N] [--json]");
  if (absl::GetFlag(FLAGS_echo_child)) return swirl::bench::RunEcho();
  return swirl::bench::Run();
}
