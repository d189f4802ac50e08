// `./swirl demo`: what swirl does, shown between processes over the default device (the soft
// device on machines without RDMA hardware), each step checked:
//   1. small calls: echo_server (its own process) answers this process's 64-byte echo calls;
//      their latency beside gRPC's for the same call (bench/grpc_echo_perf: the same .proto over
//      TCP loopback, a client and a server process of its own);
//   2. a 1 MiB upload and a 1 MiB download, each through a memory window the server binds for
//      that one request and that the peer's SEND_WITH_INV revokes, with the server's counters;
//   3. a hostile client (hostile_client, a process of its own) that keeps a revoked window's rkey
//      and READs through it again: the device refuses it, the server's data is unchanged and this
//      process's calls go on;
//   4. a client with a wrong token, refused before any QP exists;
//   5. SIGTERM: the server drains, prints its counts and exits 0.
// Exits 1 if any step does not happen as described; the last line says which did.
//
//   demo [--calls=20000] [--grpc_calls=5000]

#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "examples/echo/blob.swirl.h"
#include "examples/echo/blob_service.h"
#include "examples/echo/echo.swirl.h"
#include "swirl/channel.h"

ABSL_FLAG(int, calls, 20000, "64-byte echo calls timed over swirl (after 500 untimed)");
ABSL_FLAG(int, grpc_calls, 5000, "64-byte echo calls timed over gRPC (after 500 untimed)");

extern char** environ;

namespace {

constexpr size_t kBlobBytes = 1 << 20;
constexpr int kPayload = 64;

std::string SelfDir() {
  char path[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return ".";
  path[n] = 0;
  std::string s(path);
  return s.substr(0, s.rfind('/'));
}

// Starts `args` (argv[0] a path); its stdout goes to `stdout_fd` if >= 0, else ours.
pid_t Spawn(const std::vector<std::string>& args, int stdout_fd = -1) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (stdout_fd >= 0) posix_spawn_file_actions_adddup2(&actions, stdout_fd, STDOUT_FILENO);
  pid_t pid;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    std::fprintf(stderr, "demo: cannot start %s\n", args[0].c_str());
    return -1;
  }
  return pid;
}

// The child's exit status (128 + N for signal N); a child still running after `timeout` is
// killed and counts as failed.
int WaitExit(pid_t pid, absl::Duration timeout = absl::Seconds(60)) {
  if (pid < 0) return 127;
  const absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (absl::Now() >= deadline) {
      std::fprintf(stderr, "demo: pid %d did not exit in time; killing it\n", pid);
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return 128 + SIGKILL;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Runs `args` to its end with its stdout captured; its exit status.
int RunCaptured(const std::vector<std::string>& args, std::string* out) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return 127;
  const pid_t pid = Spawn(args, fds[1]);
  close(fds[1]);
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof(buf))) > 0) out->append(buf, static_cast<size_t>(n));
  close(fds[0]);
  return WaitExit(pid);
}

// The number after "key": in a one-line JSON object, if there is one.
std::optional<double> JsonNumber(const std::string& json, const std::string& key) {
  const std::string quoted = absl::StrCat("\"", key, "\":");
  const size_t at = json.find(quoted);
  if (at == std::string::npos) return std::nullopt;
  const char* begin = json.c_str() + at + quoted.size();
  char* end = nullptr;
  const double v = std::strtod(begin, &end);
  if (end == begin) return std::nullopt;
  return v;
}

void PinTo(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  sched_setaffinity(0, sizeof(set), &set);
}

void Say(const char* format, ...) ABSL_PRINTF_ATTRIBUTE(1, 2);
void Say(const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::vprintf(format, args);
  va_end(args);
  std::fflush(stdout);
}

// What the server's control plane (Control.Stats) says about our connection.
struct ServerView {
  swirl::ConnectionStats connection;
  swirl::ServerCounters server;
};

std::optional<ServerView> ServerSees(swirl::Channel& channel) {
  auto stats = channel.ServerStats();
  if (!stats.ok()) {
    std::fprintf(stderr, "demo: Control.Stats: %s\n", stats.status().ToString().c_str());
    return std::nullopt;
  }
  for (const auto& c : stats->connections) {
    if (c.connection_id == channel.connection_id()) return ServerView{c, stats->server};
  }
  std::fprintf(stderr, "demo: the server does not list our connection\n");
  return std::nullopt;
}

// ServerSees once `done` holds, or as it stands after 10 s (a READ's acknowledgement reaches the
// server after the call returned, so its counters move a little later).
std::optional<ServerView> ServerSeesWhen(swirl::Channel& channel,
                                         const std::function<bool(const ServerView&)>& done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (;;) {
    std::optional<ServerView> v = ServerSees(channel);
    if (!v.has_value() || done(*v) || absl::Now() >= deadline) return v;
    absl::SleepFor(absl::Milliseconds(5));  // leave the server the CPU
  }
}

double Percentile(std::vector<double>& sorted, double p) {
  return sorted.empty() ? 0.0 : sorted[static_cast<size_t>(p * (sorted.size() - 1))];
}

struct Latency {
  double p50 = 0, p99 = 0;
};

// `timed` 64-byte echo calls after 500 untimed ones; false if any failed or came back wrong.
bool EchoCalls(swirl::examples::EchoStub& stub, int timed, Latency* latency) {
  swirl::examples::EchoRequest request;
  request.set_payload(std::string(kPayload, 'x'));
  swirl::examples::EchoResponse response;
  swirl::CallOptions options;
  options.timeout = absl::Seconds(10);
  std::vector<double> us;
  us.reserve(static_cast<size_t>(timed));
  for (int i = 0; i < 500 + timed; ++i) {
    request.set_sequence(static_cast<uint64_t>(i));
    const absl::Time start = absl::Now();
    absl::Status s = stub.Echo(request, &response, options);
    if (i >= 500) us.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
    if (!s.ok() || response.sequence() != static_cast<uint64_t>(i) ||
        response.payload() != request.payload()) {
      std::fprintf(stderr, "demo: echo call %d: %s\n", i,
                   s.ok() ? "wrong answer" : s.ToString().c_str());
      return false;
    }
  }
  std::sort(us.begin(), us.end());
  if (latency != nullptr) *latency = {Percentile(us, 0.5), Percentile(us, 0.99)};
  return true;
}

using Counters = swirl::ConnectionStats;

std::string Deltas(const Counters& before, const Counters& after) {
  auto d = [](uint64_t a, uint64_t b) { return static_cast<long long>(b - a); };
  return absl::StrFormat(
      "windows_granted +%d, windows_remote_invalidated +%d, windows_locally_invalidated +%d",
      d(before.windows_granted, after.windows_granted),
      d(before.windows_remote_invalidated, after.windows_remote_invalidated),
      d(before.windows_locally_invalidated, after.windows_locally_invalidated));
}

class Demo {
 public:
  int Run();

 private:
  bool StartServer();
  bool SmallCalls();
  bool Bulk();
  bool Hostile();
  bool WrongToken();
  bool Shutdown();

  // One Get of the blob into `landing`; true if it has kBlobBytes whose checksum is `fnv` (and
  // the server says the same).
  bool GetBlob(swirl::BulkBuffer& landing, uint64_t fnv);

  const std::string dir_ = SelfDir();
  const std::string token_ =
      absl::StrFormat("demo-%016x", absl::Uniform<uint64_t>(absl::BitGen()));
  pid_t server_ = -1;
  int port_ = 0;
  std::shared_ptr<swirl::Channel> channel_;
  std::unique_ptr<swirl::examples::EchoStub> echo_;
  std::unique_ptr<swirl::examples::BlobStub> blob_;
  uint64_t blob_fnv_ = 0;
  std::string transport_;  // what carries swirl's calls, said beside their latency
  std::vector<std::string> done_;  // what succeeded, for the last line
};

bool Demo::StartServer() {
  const std::string port_file = absl::StrCat("/tmp/swirl-demo-port-", getpid());
  std::remove(port_file.c_str());
  Say("-- starting echo_server, a process of its own (worker pinned to core 1)\n");
  server_ = Spawn({dir_ + "/echo_server", "--address=127.0.0.1:0", "--token=" + token_,
                   "--cores=1", "--port_file=" + port_file});
  if (server_ < 0) return false;
  PinTo(0);  // after the spawn (children inherit it): our calling thread drives the connection
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (port_ == 0 && absl::Now() < deadline) {
    std::ifstream in(port_file);
    if (!(in >> port_)) port_ = 0;
    if (port_ == 0) absl::SleepFor(absl::Milliseconds(10));
  }
  std::remove(port_file.c_str());
  if (port_ == 0) {
    std::fprintf(stderr, "demo: echo_server did not come up\n");
    return false;
  }
  swirl::ChannelOptions options;
  options.auth_token = token_;
  options.client_name = "demo";
  // The calling thread drives the connection itself: no thread hand-off, the lowest latency.
  options.driver = swirl::ChannelOptions::Driver::kCaller;
  auto channel = swirl::Channel::Create(absl::StrCat("127.0.0.1:", port_), options);
  if (!channel.ok()) {
    std::fprintf(stderr, "demo: %s\n", channel.status().ToString().c_str());
    return false;
  }
  channel_ = *channel;
  echo_ = std::make_unique<swirl::examples::EchoStub>(*channel_);
  blob_ = std::make_unique<swirl::examples::BlobStub>(*channel_);
  const auto& n = channel_->negotiated();
  Say("   connected: one RC queue pair each side, %u credits, invalidation mode %s\n",
      n.client_credits, swirl::ControlPlaneName(n.invalidation));
  // What carries swirl's calls, for the latency table's label.
  auto stats = channel_->ServerStats();
  if (!stats.ok()) {
    std::fprintf(stderr, "demo: Control.Stats: %s\n", stats.status().ToString().c_str());
    return false;
  }
  if (stats->capabilities.device_kind != "soft") {
    transport_ = absl::StrCat("device ", stats->device);
  } else if (std::getenv("SWIRL_SOFT_TCP") != nullptr) {
    transport_ = "soft device on its TCP fabric";
  } else {
    transport_ = "soft device: shared memory between the processes";
  }
  return true;
}

bool Demo::SmallCalls() {
  const int calls = absl::GetFlag(FLAGS_calls);
  const int grpc_calls = absl::GetFlag(FLAGS_grpc_calls);
  Say("\n[1] small calls: %d echo calls of %d bytes, one at a time (this process on core 0)\n",
      calls, kPayload);
  Latency swirl;
  if (!EchoCalls(*echo_, calls, &swirl)) return false;
  Say("   the same call over gRPC (bench/grpc_echo_perf: same .proto, TCP loopback, %d calls)\n",
      grpc_calls);
  std::string json;
  const int rc = RunCaptured({dir_ + "/../../bench/grpc_echo_perf", "--size=64",
                              absl::StrCat("--iters=", grpc_calls), "--warmup=500", "--json",
                              "--client_core=0", "--server_core=1"},
                             &json);
  const std::optional<double> g50 = JsonNumber(json, "rtt_p50_us");
  const std::optional<double> g99 = JsonNumber(json, "rtt_p99_us");
  if (rc != 0 || !g50.has_value() || !g99.has_value()) {
    std::fprintf(stderr, "demo: grpc_echo_perf exited %d: %s\n", rc, json.c_str());
    return false;
  }
  Say("   round trip, us      p50       p99\n");
  Say("   swirl          %8.1f  %8.1f   (%s)\n", swirl.p50, swirl.p99, transport_.c_str());
  Say("   gRPC           %8.1f  %8.1f   (TCP loopback, protobuf over HTTP/2)\n", *g50, *g99);
  Say("ok [1] small calls: swirl p50 %.1f us, gRPC p50 %.1f us (gRPC/swirl %.1fx)\n",
      swirl.p50, *g50, swirl.p50 > 0 ? *g50 / swirl.p50 : 0.0);
  done_.push_back("small calls");
  return true;
}

bool Demo::GetBlob(swirl::BulkBuffer& landing, uint64_t fnv) {
  swirl::examples::GetResponse response;
  swirl::CallOptions options;
  options.timeout = absl::Seconds(10);
  landing.resize(0);  // so that a response without data cannot pass for one with it
  options.response_bulk = &landing;
  absl::Status s = blob_->Get(swirl::examples::GetRequest(), &response, options);
  if (!s.ok()) {
    std::fprintf(stderr, "demo: Blob.Get: %s\n", s.ToString().c_str());
    return false;
  }
  const uint64_t got = swirl::examples::Fnv1a(landing.view());
  if (landing.size() != kBlobBytes || got != fnv || response.fnv1a() != fnv) {
    std::fprintf(stderr,
                 "demo: Blob.Get brought %zu bytes with fnv1a %016" PRIx64 " (server: %016" PRIx64
                 "), expected %zu with %016" PRIx64 "\n",
                 landing.size(), got, response.fnv1a(), kBlobBytes, fnv);
    return false;
  }
  return true;
}

bool Demo::Bulk() {
  Say("\n[2] bulk: 1 MiB up and 1 MiB down, zero-copy, each through a memory window bound for\n"
      "    that one request; the peer's last message for it is a SEND_WITH_INV of the window's\n"
      "    rkey, so the receiving device revokes the window as it delivers the message\n");
  std::optional<ServerView> start = ServerSees(*channel_);
  if (!start.has_value()) return false;
  const auto mode = start->connection.negotiated.invalidation;
  Say("   the server's side of our connection: invalidation mode %s\n",
      swirl::ControlPlaneName(mode));
  if (mode != swirl::InvalidationMode::kRemote) {
    std::fprintf(stderr, "demo: this device pair negotiated no remote invalidation; the demo "
                         "shows SEND_WITH_INV\n");
    return false;
  }

  // Upload: the server grants windows over its registered memory; we RDMA WRITE into one, and
  // the request itself is the SEND_WITH_INV that revokes it before the handler runs.
  auto up = channel_->AllocateBulk(kBlobBytes);
  if (!up.ok()) {
    std::fprintf(stderr, "demo: %s\n", up.status().ToString().c_str());
    return false;
  }
  absl::BitGen gen;
  for (size_t i = 0; i < kBlobBytes; ++i) up->data()[i] = static_cast<char>(absl::Uniform<uint8_t>(gen));
  up->resize(kBlobBytes);
  blob_fnv_ = swirl::examples::Fnv1a(up->view());
  swirl::examples::PutResponse put;
  swirl::CallOptions options;
  options.timeout = absl::Seconds(10);
  options.request_bulk = &*up;
  if (absl::Status s = blob_->Put(swirl::examples::PutRequest(), &put, options); !s.ok()) {
    std::fprintf(stderr, "demo: Blob.Put: %s\n", s.ToString().c_str());
    return false;
  }
  if (put.size() != kBlobBytes || put.fnv1a() != blob_fnv_) {
    std::fprintf(stderr, "demo: the server stored %" PRIu64 " bytes with fnv1a %016" PRIx64
                 ", we sent %zu with %016" PRIx64 "\n", put.size(), put.fnv1a(), kBlobBytes,
                 blob_fnv_);
    return false;
  }
  const Counters& c0 = start->connection;
  std::optional<ServerView> uploaded = ServerSees(*channel_);
  if (!uploaded.has_value()) return false;
  const Counters& c1 = uploaded->connection;
  Say("   upload:   1 MiB random bytes, fnv1a %016" PRIx64 " here and at the server\n", blob_fnv_);
  Say("             server: %s\n", Deltas(c0, c1).c_str());
  Say("             (grants come ahead of need: the spare ones stay bound for later uploads and\n"
      "             are revoked by the server's own LOCAL_INV when the connection closes)\n");
  if (c1.windows_granted <= c0.windows_granted ||
      c1.windows_remote_invalidated != c0.windows_remote_invalidated + 1 ||
      c1.windows_locally_invalidated != c0.windows_locally_invalidated) {
    std::fprintf(stderr, "demo: the upload's window was not granted and revoked by our "
                         "SEND_WITH_INV\n");
    return false;
  }

  // Download: the server binds a read-only window over the response's data for this request;
  // we RDMA READ it and acknowledge with SEND_WITH_INV of its rkey.
  auto down = channel_->AllocateBulk(kBlobBytes);
  if (!down.ok()) {
    std::fprintf(stderr, "demo: %s\n", down.status().ToString().c_str());
    return false;
  }
  if (!GetBlob(*down, blob_fnv_)) return false;
  std::optional<ServerView> downloaded = ServerSeesWhen(*channel_, [&](const ServerView& v) {
    return v.connection.windows_remote_invalidated > c1.windows_remote_invalidated;
  });
  if (!downloaded.has_value()) return false;
  const Counters& c2 = downloaded->connection;
  Say("   download: 1 MiB, fnv1a %016" PRIx64 " (the same bytes came back)\n", blob_fnv_);
  Say("             server: %s\n", Deltas(c1, c2).c_str());
  if (c2.windows_remote_invalidated != c1.windows_remote_invalidated + 1 ||
      c2.windows_locally_invalidated != c1.windows_locally_invalidated ||
      c2.invalidation_violations != 0) {
    std::fprintf(stderr, "demo: the download's window was not revoked by our SEND_WITH_INV\n");
    return false;
  }
  Say("ok [2] bulk: 1 MiB each way, checksums match, each window revoked by SEND_WITH_INV "
      "(mode %s)\n", swirl::ControlPlaneName(mode));
  done_.push_back("1 MiB up and down through per-request windows");
  return true;
}

bool Demo::Hostile() {
  Say("\n[3] a hostile client (hostile_client, another process) gets a download window, READs\n"
      "    it, revokes it with SEND_WITH_INV as the protocol says, keeps the rkey and READs again\n");
  std::optional<ServerView> before = ServerSees(*channel_);
  if (!before.has_value()) return false;
  const int rc = WaitExit(Spawn({dir_ + "/hostile_client", absl::StrCat("--port=", port_),
                                 "--token=" + token_,
                                 absl::StrFormat("--expect_fnv1a=%016x", blob_fnv_)}));
  if (rc != 0) {
    std::fprintf(stderr, "demo: hostile_client exited %d: %s\n", rc,
                 rc == 3 ? "the READ through the revoked rkey SUCCEEDED" : "it went wrong");
    return false;
  }
  // The server's QP that refused the READ says so on the device's asynchronous events.
  std::optional<ServerView> after = ServerSeesWhen(*channel_, [&](const ServerView& v) {
    return v.server.async_qp_errors > before->server.async_qp_errors;
  });
  if (!after.has_value()) return false;
  if (after->server.async_qp_errors != before->server.async_qp_errors + 1) {
    std::fprintf(stderr, "demo: the server's device did not report the refused access\n");
    return false;
  }
  Say("   server: its device refused the access (async QP errors +1); that connection is over\n");
  // Our connection was never touched: the blob is as we put it, and calls go on.
  auto landing = channel_->AllocateBulk(kBlobBytes);
  if (!landing.ok() || !GetBlob(*landing, blob_fnv_)) {
    std::fprintf(stderr, "demo: the blob changed or our connection broke\n");
    return false;
  }
  if (!EchoCalls(*echo_, 500, nullptr)) return false;
  Say("   this process, same connection: the blob still has fnv1a %016" PRIx64
      ", 1000 more echo calls ok\n", blob_fnv_);
  Say("ok [3] hostile client: READ with a revoked rkey refused (IBV_WC_REM_ACCESS_ERR), data "
      "unchanged, good client still served\n");
  done_.push_back("revoked rkey refused by the device");
  return true;
}

bool Demo::WrongToken() {
  Say("\n[4] echo_client with a wrong token (must be refused before any QP exists)\n");
  const std::string address = absl::StrCat("127.0.0.1:", port_);
  const int rc = WaitExit(Spawn({dir_ + "/echo_client", "--server=" + address, "--token=wrong",
                                 "--iterations=1", "--core=-1"}));
  if (rc == 0) {
    std::fprintf(stderr, "demo: a client with a wrong token was served\n");
    return false;
  }
  Say("ok [4] wrong token refused\n");
  done_.push_back("wrong token refused");
  return true;
}

bool Demo::Shutdown() {
  Say("\n[5] SIGTERM to echo_server: it drains its connections, prints its counts, exits 0\n");
  echo_.reset();
  blob_.reset();
  channel_->Close();
  channel_.reset();
  kill(server_, SIGTERM);
  const int rc = WaitExit(server_, absl::Seconds(20));
  server_ = -1;
  if (rc != 0) {
    std::fprintf(stderr, "demo: echo_server exited %d\n", rc);
    return false;
  }
  Say("ok [5] clean shutdown: server exit 0\n");
  done_.push_back("clean shutdown");
  return true;
}

int Demo::Run() {
  Say("== swirl demo: an RPC server and client over RDMA verbs (soft0 without a NIC) ==\n");
  const bool ok = StartServer() && SmallCalls() && Bulk() && Hostile() && WrongToken() &&
                  Shutdown();
  if (server_ > 0) {  // a step failed while the server ran
    channel_.reset();
    kill(server_, SIGTERM);
    WaitExit(server_, absl::Seconds(20));
  }
  if (ok) {
    Say("\n== demo succeeded: %s ==\n", absl::StrJoin(done_, ", ").c_str());
  } else {
    Say("\n== demo FAILED after %d of 5 steps%s%s ==\n", static_cast<int>(done_.size()),
        done_.empty() ? "" : ": ", absl::StrJoin(done_, ", ").c_str());
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return Demo().Run();
}
