// Two hosts without a NIC (issue 21, docs/RELIABILITY.md): two network namespaces joined by a
// veth pair, test_server in one ("host A", 10.99.0.1) and clients in the other ("host B",
// 10.99.0.2), the soft device on its TCP fabric between them. The addresses exist only inside
// the namespaces; their names carry this process's id, so parallel runs do not collide, and
// they are deleted when the test ends, failed or not (the veth pair goes with them).
//
// The test binary plays three parts, chosen by its environment:
//   * the test itself (no SWIRL_NETNS_* variable): makes the namespaces, starts the server in A,
//     a watcher of the server's counters in A, and this binary again in B as the client;
//   * the client (SWIRL_NETNS_SERVER=host:port, in B): the InNamespace cases below, registered
//     only then: calls, uploads and downloads in both bulk modes, a download window used after
//     its revocation refused, and a load through which the test sets the link down and up again
//     (files in SWIRL_NETNS_DIR say where each side is);
//   * the watcher (SWIRL_NETNS_WATCH=port, in A): writes the server's counters to a file every
//     20 ms, through the control plane on A's loopback, which the link's state does not touch.
// Needs root and `ip netns`; skips saying why where it cannot make namespaces.

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "rpc/testing/bulk.h"
#include "rpc/testing/e2e.h"
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/slowdown.h"
#include "rpc/testing/test_data.h"
#include "rpc/wire.h"
#include "swirl/channel.h"
#include "swirl/client_runtime.h"

namespace swirl {
namespace {

using testing::ChildProcess;

constexpr char kHostA[] = "10.99.0.1";
constexpr char kHostB[] = "10.99.0.2";
// Every side's keepalive. Under load from three threads, a sanitizer build's worker can take
// longer than three 200 ms keepalives to answer, and a healthy link is given up before it goes
// down: scaled by the slowdown (and with it the bound below).
constexpr absl::Duration kKeepalive = absl::Milliseconds(200 * testing::kSlowdown);
// How long either side may take to see the link gone: the liveness check fails a silent peer
// after three keepalives; the rest is room for a loaded machine.
constexpr absl::Duration kNoticeBound = absl::Seconds(10 * testing::kSlowdown);

// ---- Files the parts share -------------------------------------------------------------------

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path + ".tmp") << text;
  std::rename((path + ".tmp").c_str(), path.c_str());
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

bool Exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

// Until `path` exists (true) or `timeout` passes.
bool WaitForFile(const std::string& path, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!Exists(path)) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// ---- The client, in namespace B ---------------------------------------------------------------

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

ChannelOptions ClientOptions() {
  ChannelOptions options;
  options.auth_token = "e2e";
  options.allow_plaintext_token = true;  // the test's own veth link
  options.transport.keepalive = kKeepalive;
  options.reconnect.initial_backoff = absl::Milliseconds(100);
  options.reconnect.max_backoff = absl::Milliseconds(500);
  options.connect_timeout = absl::Seconds(2);
  return options;
}

std::shared_ptr<Channel> Connect(ChannelOptions options = ClientOptions()) {
  auto channel = Channel::Create(Env("SWIRL_NETNS_SERVER"), options);
  EXPECT_TRUE(channel.ok()) << channel.status();
  return channel.ok() ? *channel : nullptr;
}

// An upload (Sum) of each size, checked against the server's checksum.
void ExpectUploads(Channel& channel, std::initializer_list<size_t> sizes) {
  for (size_t n : sizes) {
    auto out = channel.AllocateBulk(n);
    ASSERT_TRUE(out.ok()) << out.status();
    const std::string payload = bulk_testing::Payload(n, static_cast<int>(n));
    std::memcpy(out->data(), payload.data(), n);
    out->resize(n);
    CallOptions options{absl::Seconds(20)};
    options.request_bulk = &*out;
    std::string sum;
    absl::Status s = CallRaw(channel, bulk_testing::Id("/test.E2E/Sum"), "", &sum, options);
    ASSERT_TRUE(s.ok()) << n << ": " << s;
    EXPECT_EQ(sum, absl::StrCat(n, ":", testing::Fnv(payload))) << n;
  }
}

void ExpectCallsAndTransfers(Channel& channel) {
  EXPECT_EQ(channel.negotiated().invalidation, InvalidationMode::kRemote);
  bulk_testing::ExpectHealthy(channel, 1);
  bulk_testing::ExpectEchoes(channel, "/test.E2E/Echo", {0, 1, 100, 4000, 100000});
  std::string out;
  absl::Status failed = CallRaw(channel, bulk_testing::Id("/test.E2E/Fail"), "5", &out, {});
  EXPECT_EQ(failed.code(), absl::StatusCode::kNotFound) << failed;
  EXPECT_EQ(failed.message(), "failed as asked");
  // From several threads at once.
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        const std::string request = absl::StrCat("thread ", t, " call ", i);
        std::string response;
        if (!CallRaw(channel, bulk_testing::Id("/test.E2E/Echo"), request, &response, {}).ok() ||
            response != request) {
          wrong.fetch_add(1);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  ExpectUploads(channel, {4096, 1 << 20, 8 << 20});
  auto landing = channel.AllocateBulk(8 << 20);
  ASSERT_TRUE(landing.ok()) << landing.status();
  bulk_testing::ExpectFillsInto(channel, "/test.E2E/Fill", *landing, {4096, 1 << 20, 8 << 20});
}

void CallsAndBulkTransfersCrossTheLink() {
  auto channel = Connect();
  ASSERT_NE(channel, nullptr);
  ExpectCallsAndTransfers(*channel);
  ChannelOptions mirror = ClientOptions();
  mirror.bulk_mode = BulkMode::kMirror;
  auto mirrored = Connect(mirror);
  ASSERT_NE(mirrored, nullptr);
  EXPECT_EQ(mirrored->negotiated().bulk_mode, BulkMode::kMirror);
  ExpectCallsAndTransfers(*mirrored);
}

// bulk_security_test's DownloadKeyIsDeadAfterTheAcknowledgement, across the link.
void AWindowUsedAfterItsRevocationIsRefused() {
  auto good = Connect();
  ASSERT_NE(good, nullptr);
  const std::string server = Env("SWIRL_NETNS_SERVER");
  const size_t colon = server.rfind(':');
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(server.substr(colon + 1), &port)) << server;
  testing::RogueConnection rogue;
  rogue.UseHost(server.substr(0, colon));
  ASSERT_TRUE(rogue.Connect(port, "e2e").ok());
  uint64_t id = 0;
  auto d = rogue.CallForDownload("/test.E2E/Fill", "65536", &id);
  ASSERT_TRUE(d.ok()) << d.status();
  std::string data;
  auto st = rogue.Read(d->addr, d->rkey, d->length, &data);
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(*st, IBV_WC_SUCCESS);
  for (size_t i = 0; i < data.size(); i += 4093) ASSERT_EQ(data[i], testing::Pattern(i));
  rpc_wire::MessageHeader ack{.version = rpc_wire::kProtocolVersion,
                              .type = rpc_wire::kBulkAck,
                              .request_id = id,
                              .aux = d->rkey};
  ASSERT_TRUE(rogue.Send(ack, {}, d->rkey).ok());
  st = rogue.Read(d->addr, d->rkey, d->length, &data);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR) << "a revoked window answered";
  bulk_testing::ExpectHealthy(*good, 2);
}

// Load from several threads (calls, uploads, downloads) on one reconnecting channel while the
// test sets the link down ("down" in SWIRL_NETNS_DIR) and up again ("up").
void TheLinkGoesDownMidLoadAndComesBack() {
  const std::string dir = Env("SWIRL_NETNS_DIR");
  ClientRuntimeOptions runtime_options;
  runtime_options.transport.keepalive = kKeepalive;
  auto runtime = ClientRuntime::Create(runtime_options);
  ASSERT_TRUE(runtime.ok()) << runtime.status();
  ChannelOptions options = ClientOptions();
  options.runtime = *runtime;
  auto channel = Connect(options);
  ASSERT_NE(channel, nullptr);
  bulk_testing::ExpectHealthy(*channel, 3);
  const RuntimeCounters base = (*runtime)->Counters();

  std::atomic<bool> stop{false};
  std::atomic<int64_t> ok_calls{0};
  std::atomic<int64_t> first_error_ns{0};  // Unix nanoseconds of the first failed call
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      auto buffer = channel->AllocateBulk(1 << 20);
      if (!buffer.ok()) {
        wrong.fetch_add(1);
        return;
      }
      for (size_t i = 0; i < (1u << 20); ++i) buffer->data()[i] = testing::Pattern(i);
      buffer->resize(1 << 20);
      const std::string sum = absl::StrCat(1 << 20, ":", testing::Fnv(buffer->view()));
      while (!stop.load()) {
        std::string out;
        CallOptions options{absl::Seconds(5)};
        absl::Status s;
        if (t == 0) {
          s = CallRaw(*channel, bulk_testing::Id("/test.E2E/Echo"), "load", &out, options);
          if (s.ok() && out != "load") wrong.fetch_add(1);
        } else if (t == 1) {
          options.request_bulk = &*buffer;
          s = CallRaw(*channel, bulk_testing::Id("/test.E2E/Sum"), "", &out, options);
          if (s.ok() && out != sum) wrong.fetch_add(1);
        } else {
          std::memset(buffer->data(), 0, 1 << 20);  // what Fill lands must be Fill's
          options.response_bulk = &*buffer;
          s = CallRaw(*channel, bulk_testing::Id("/test.E2E/Fill"), "1048576", &out, options);
          if (s.ok() && (buffer->size() != (1u << 20) ||
                         buffer->data()[4093] != testing::Pattern(4093) ||
                         buffer->data()[(1 << 20) - 1] != testing::Pattern((1 << 20) - 1))) {
            wrong.fetch_add(1);
          }
        }
        if (s.ok()) {
          ok_calls.fetch_add(1);
        } else {
          int64_t none = 0;
          first_error_ns.compare_exchange_strong(none, absl::ToUnixNanos(absl::Now()));
          absl::SleepFor(absl::Milliseconds(20));  // the channel is down: do not spin
        }
      }
    });
  }
  // A failed ASSERT below returns early: the load stops and its threads end first (a joinable
  // std::thread destroyed would abort the process instead of failing the case).
  absl::Cleanup join = [&] {
    stop.store(true);
    for (auto& t : threads) {
      if (t.joinable()) t.join();
    }
  };
  const absl::Time loading_by = absl::Now() + absl::Seconds(30);
  while (ok_calls.load() < 30 && absl::Now() < loading_by) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_GE(ok_calls.load(), 30) << "the load never got going";
  ASSERT_EQ(first_error_ns.load(), 0) << "a call failed before the link went down";
  WriteFile(dir + "/loading", "");

  ASSERT_TRUE(WaitForFile(dir + "/down", absl::Seconds(60))) << "the test never set the link down";
  const absl::Time down = absl::FromUnixNanos(std::stoll(ReadFile(dir + "/down")));
  // The calls fail (within their 5 s deadline: no call hangs), the channel gives the
  // connection up, and everything it held for it is released.
  const absl::Time noticed_by = down + kNoticeBound;
  while (channel->state() == ConnectivityState::kReady && absl::Now() < noticed_by) {
    channel->WaitForStateChange(ConnectivityState::kReady, noticed_by);
  }
  EXPECT_NE(channel->state(), ConnectivityState::kReady) << "the lost link went unnoticed";
  // The calls in flight complete (their callbacks run) just after the connection is failed.
  while (first_error_ns.load() == 0 && absl::Now() < noticed_by) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_NE(first_error_ns.load(), 0) << "no call failed with the link down";
  EXPECT_LT(absl::FromUnixNanos(first_error_ns.load()) - down, kNoticeBound);
  const uint64_t held_by_threads = base.bulk_bytes_in_use + 3 * (1 << 20);  // their buffers
  const absl::Time clean_by = absl::Now() + kNoticeBound;
  RuntimeCounters now = (*runtime)->Counters();
  while ((now.queue_pairs_live != 0 || now.windows_outstanding != 0 ||
          now.bulk_bytes_in_use != held_by_threads) &&
         absl::Now() < clean_by) {
    absl::SleepFor(absl::Milliseconds(10));
    now = (*runtime)->Counters();
  }
  EXPECT_EQ(now.queue_pairs_live, 0u);
  EXPECT_EQ(now.windows_outstanding, 0u);
  EXPECT_EQ(now.bulk_bytes_in_use, held_by_threads);
  WriteFile(dir + "/client-noticed", "");

  ASSERT_TRUE(WaitForFile(dir + "/up", absl::Seconds(60))) << "the test never set the link up";
  ASSERT_TRUE(channel->WaitForReady(absl::Now() + absl::Seconds(60))) << channel->last_error();
  const int64_t before = ok_calls.load();
  const absl::Time working_by = absl::Now() + absl::Seconds(30);
  while (ok_calls.load() < before + 30 && absl::Now() < working_by) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_GE(ok_calls.load(), before + 30) << "calls did not work again after the reconnect";
  std::move(join).Invoke();
  EXPECT_EQ(wrong.load(), 0) << "a call that succeeded returned wrong data";
  EXPECT_GE(channel->reconnects(), 1u);
  bulk_testing::ExpectHealthy(*channel, 4);
  EXPECT_EQ((*runtime)->Counters().windows_outstanding, 0u);
  EXPECT_EQ((*runtime)->Counters().bulk_bytes_in_use, base.bulk_bytes_in_use);
}

class InNamespace : public ::testing::Test {};

template <void (*kBody)()>
class Case : public InNamespace {
 public:
  void TestBody() override { kBody(); }
};

void RegisterClientCases() {
  auto add = [](const char* name, InNamespace* (*factory)()) {
    ::testing::RegisterTest("InNamespace", name, nullptr, nullptr, __FILE__, __LINE__, factory);
  };
  add("CallsAndBulkTransfersCrossTheLink",
      [] { return static_cast<InNamespace*>(new Case<CallsAndBulkTransfersCrossTheLink>); });
  add("AWindowUsedAfterItsRevocationIsRefused",
      [] { return static_cast<InNamespace*>(new Case<AWindowUsedAfterItsRevocationIsRefused>); });
  add("TheLinkGoesDownMidLoadAndComesBack",
      [] { return static_cast<InNamespace*>(new Case<TheLinkGoesDownMidLoadAndComesBack>); });
}

// ---- The watcher, in namespace A --------------------------------------------------------------

// "<queue_pairs_live> <windows_outstanding> <bulk_bytes_in_use> <connections_failed>
//  <recv_buffers_free>" every 20 ms into SWIRL_NETNS_WATCH_FILE, until SIGTERM.
int Watch() {
  int port = 0;
  if (!absl::SimpleAtoi(Env("SWIRL_NETNS_WATCH"), &port)) return 2;
  const std::string file = Env("SWIRL_NETNS_WATCH_FILE");
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  sigprocmask(SIG_BLOCK, &term, nullptr);
  for (;;) {
    timespec none{};
    if (sigtimedwait(&term, nullptr, &none) == SIGTERM) return 0;
    auto stats = testing::Stats(port);
    if (stats.ok()) {
      const auto& s = stats->server();
      WriteFile(file, absl::StrCat(s.queue_pairs_live(), " ", s.windows_outstanding(), " ",
                                   s.bulk_bytes_in_use(), " ", s.connections_failed(), " ",
                                   s.recv_buffers_free()));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// ---- The test, in the initial namespace -------------------------------------------------------

std::string IpBinary() {
  for (const char* path : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (access(path, X_OK) == 0) return path;
  }
  return "";
}

// Runs `argv` to its end (bounded); OK if it exited 0.
absl::Status RunCommand(const std::vector<std::string>& argv) {
  auto child = ChildProcess::Spawn(argv);
  if (!child.ok()) return child.status();
  absl::StatusOr<int> code = child->Wait(absl::Seconds(30));
  if (!code.ok()) return code.status();
  if (*code != 0) return absl::InternalError(absl::StrCat(absl::StrJoin(argv, " "), ": exit ", *code));
  return absl::OkStatus();
}

// Two namespaces and a veth pair between them, gone with this object.
class TwoHosts {
 public:
  // Why not, where they cannot be made.
  static absl::StatusOr<std::unique_ptr<TwoHosts>> Create() {
    if (geteuid() != 0) return absl::FailedPreconditionError("not root: ip netns needs root");
    std::string ip = IpBinary();
    if (ip.empty()) return absl::FailedPreconditionError("no ip(8) (package iproute2)");
    static std::atomic<int> made{0};
    std::unique_ptr<TwoHosts> hosts(new TwoHosts(ip, made.fetch_add(1)));
    // The first step says whether this machine lets us make namespaces at all.
    if (absl::Status s = RunCommand({ip, "netns", "add", hosts->a_}); !s.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("cannot create a network namespace: ",
                                                        s.message()));
    }
    hosts->made_a_ = true;
    if (absl::Status s = RunCommand({ip, "netns", "add", hosts->b_}); !s.ok()) return s;
    hosts->made_b_ = true;
    const std::vector<std::vector<std::string>> steps = {
        {ip, "link", "add", hosts->veth_a_, "netns", hosts->a_, "type", "veth", "peer", "name",
         hosts->veth_b_, "netns", hosts->b_},
        {ip, "-n", hosts->a_, "addr", "add", absl::StrCat(kHostA, "/24"), "dev", hosts->veth_a_},
        {ip, "-n", hosts->b_, "addr", "add", absl::StrCat(kHostB, "/24"), "dev", hosts->veth_b_},
        {ip, "-n", hosts->a_, "link", "set", "lo", "up"},
        {ip, "-n", hosts->b_, "link", "set", "lo", "up"},
        {ip, "-n", hosts->a_, "link", "set", hosts->veth_a_, "up"},
        {ip, "-n", hosts->b_, "link", "set", hosts->veth_b_, "up"},
    };
    for (const auto& step : steps) {
      if (absl::Status s = RunCommand(step); !s.ok()) return s;
    }
    return hosts;
  }

  ~TwoHosts() {
    // Deleting a namespace deletes the veth end in it, and with it its peer.
    if (made_a_) {
      EXPECT_TRUE(RunCommand({ip_, "netns", "del", a_}).ok()) << a_ << " left behind";
    }
    if (made_b_) {
      EXPECT_TRUE(RunCommand({ip_, "netns", "del", b_}).ok()) << b_ << " left behind";
    }
  }

  // Both ends down (a cable pulled: nothing gets through, no FIN, no RST) or up.
  absl::Status SetLink(bool up) {
    const char* state = up ? "up" : "down";
    if (absl::Status s = RunCommand({ip_, "-n", a_, "link", "set", veth_a_, state}); !s.ok()) return s;
    return RunCommand({ip_, "-n", b_, "link", "set", veth_b_, state});
  }

  // A command line that runs the rest in namespace `ns`.
  std::vector<std::string> In(const std::string& ns) const { return {ip_, "netns", "exec", ns}; }
  const std::string& a() const { return a_; }
  const std::string& b() const { return b_; }

 private:
  // Names with this process's id and `n`: unique on the machine. (The veth ends are made in
  // their namespaces, where no other run's names are; interface names have 15 characters.)
  TwoHosts(std::string ip, int n)
      : ip_(std::move(ip)),
        a_(absl::StrCat("swirl-", getpid(), "-", n, "-a")),
        b_(absl::StrCat("swirl-", getpid(), "-", n, "-b")),
        veth_a_(absl::StrCat("sw", getpid() % 1000000, "-", n % 100, "a")),
        veth_b_(absl::StrCat("sw", getpid() % 1000000, "-", n % 100, "b")) {}

  const std::string ip_, a_, b_, veth_a_, veth_b_;
  bool made_a_ = false, made_b_ = false;
};

std::string Absolute(const std::string& path) {
  char* real = realpath(path.c_str(), nullptr);
  std::string out = real != nullptr ? real : path;
  std::free(real);
  return out;
}

std::string SelfBinary() { return Absolute("/proc/self/exe"); }

// What the watcher saw last: {qps, windows, bulk bytes, connections failed, recv free}.
std::vector<uint64_t> Watched(const std::string& file) {
  std::vector<uint64_t> out;
  for (absl::string_view part : absl::StrSplit(ReadFile(file), ' ', absl::SkipEmpty())) {
    uint64_t v = 0;
    if (absl::SimpleAtoi(part, &v)) out.push_back(v);
  }
  return out;
}

// Environment variables of Bazel's test runner that the child runs of this binary must not
// see (they would write this test's XML report, or its shard status).
const std::vector<std::string> kUnsetForChildren = {
    "-u", "XML_OUTPUT_FILE",   "-u", "GTEST_OUTPUT",       "-u", "TEST_PREMATURE_EXIT_FILE",
    "-u", "GTEST_SHARD_STATUS_FILE", "-u", "TEST_SHARD_INDEX", "-u", "TEST_TOTAL_SHARDS"};

TEST(NetnsTwoHosts, E2eAndBulkSecurityAcrossTheLinkThenItFailsAndComesBack) {
  auto hosts = TwoHosts::Create();
  if (!hosts.ok() && absl::IsFailedPrecondition(hosts.status())) {
    GTEST_SKIP() << "two network namespaces cannot be made here: " << hosts.status().message();
  }
  ASSERT_TRUE(hosts.ok()) << hosts.status();
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = Absolute(absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/netns-",
                                                getpid(), "-", absl::ToUnixNanos(absl::Now())));
  ASSERT_TRUE(RunCommand({"/bin/mkdir", "-p", dir}).ok());

  // The server in A, on every address there (A's loopback for the watcher, the veth for B).
  auto server = testing::SpawnServerVia(
      (*hosts)->In((*hosts)->a()), Absolute(bulk_testing::kServer),
      {"--host=0.0.0.0", absl::StrCat("--keepalive_ms=", absl::ToInt64Milliseconds(kKeepalive))},
      absl::Seconds(30), {absl::StrCat("SWIRL_SOFT_TCP=", kHostA)});
  ASSERT_TRUE(server.ok()) << server.status();
  auto& [server_process, port] = *server;
  const std::string watch_file = dir + "/server-counters";
  std::vector<std::string> watch_argv = (*hosts)->In((*hosts)->a());
  watch_argv.push_back("/usr/bin/env");
  watch_argv.insert(watch_argv.end(), kUnsetForChildren.begin(), kUnsetForChildren.end());
  watch_argv.push_back(SelfBinary());
  auto watcher = ChildProcess::Spawn(
      watch_argv, {absl::StrCat("SWIRL_NETNS_WATCH=", port),
                   absl::StrCat("SWIRL_NETNS_WATCH_FILE=", watch_file)});
  ASSERT_TRUE(watcher.ok()) << watcher.status();
  ASSERT_TRUE(WaitForFile(watch_file, absl::Seconds(30))) << "the watcher never reported";
  const std::vector<uint64_t> base = Watched(watch_file);
  ASSERT_EQ(base.size(), 5u);
  ASSERT_EQ(base[0], 0u) << "connections before any client";

  // The client in B.
  std::vector<std::string> client_argv = (*hosts)->In((*hosts)->b());
  client_argv.push_back("/usr/bin/env");
  client_argv.insert(client_argv.end(), kUnsetForChildren.begin(), kUnsetForChildren.end());
  client_argv.push_back(SelfBinary());
  auto client = ChildProcess::Spawn(
      client_argv, {absl::StrCat("SWIRL_NETNS_SERVER=", kHostA, ":", port),
                    absl::StrCat("SWIRL_SOFT_TCP=", kHostB), absl::StrCat("SWIRL_NETNS_DIR=", dir)});
  ASSERT_TRUE(client.ok()) << client.status();

  // Mid-load, the link goes down: the server gives the client's connection up within the
  // bound and keeps nothing for it (the client checks its own side).
  bool loading = false;
  const absl::Time loading_by = absl::Now() + absl::Seconds(120);
  while (!(loading = Exists(dir + "/loading")) && absl::Now() < loading_by) {
    ASSERT_FALSE(client->Wait(absl::ZeroDuration()).ok()) << "the client ended early";
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(loading) << "the client's load never started";
  const uint64_t failed_before = Watched(watch_file)[3];
  ASSERT_TRUE((*hosts)->SetLink(false).ok());
  const absl::Time down = absl::Now();
  WriteFile(dir + "/down", std::to_string(absl::ToUnixNanos(down)));
  std::vector<uint64_t> now = Watched(watch_file);
  while ((now.size() != 5 || now[0] != base[0] || now[1] != base[1] || now[2] != base[2] ||
          now[4] != base[4]) &&
         absl::Now() < down + kNoticeBound) {
    absl::SleepFor(absl::Milliseconds(20));
    now = Watched(watch_file);
  }
  ASSERT_EQ(now.size(), 5u);
  EXPECT_EQ(now[0], base[0]) << "queue_pairs_live: the server kept the lost connection";
  EXPECT_EQ(now[1], base[1]) << "windows_outstanding";
  EXPECT_EQ(now[2], base[2]) << "bulk_bytes_in_use";
  EXPECT_EQ(now[4], base[4]) << "recv_buffers_free";
  EXPECT_GT(now[3], failed_before) << "the server did not count the connection as failed";
  EXPECT_TRUE(WaitForFile(dir + "/client-noticed", kNoticeBound + absl::Seconds(10)))
      << "the client did not notice the lost link";

  // Up again: the client's channel reconnects and its calls work (it checks), then it ends.
  ASSERT_TRUE((*hosts)->SetLink(true).ok());
  WriteFile(dir + "/up", "");
  absl::StatusOr<int> exit_code = client->Wait(absl::Seconds(180));
  ASSERT_TRUE(exit_code.ok()) << "the client in B did not finish";
  EXPECT_EQ(*exit_code, 0) << "a case failed in namespace B (its output is above)";
  // The server holds nothing once the client is gone.
  now = Watched(watch_file);
  const absl::Time clean_by = absl::Now() + kNoticeBound;
  while ((now.size() != 5 || now[0] != base[0] || now[1] != base[1] || now[2] != base[2]) &&
         absl::Now() < clean_by) {
    absl::SleepFor(absl::Milliseconds(20));
    now = Watched(watch_file);
  }
  EXPECT_EQ(now, std::vector<uint64_t>({base[0], base[1], base[2], now[3], base[4]}));
  // (The watcher and the server are stopped by their destructors, before the namespaces go.)
}

}  // namespace
}  // namespace swirl

int main(int argc, char** argv) {
  if (!swirl::Env("SWIRL_NETNS_WATCH").empty()) return swirl::Watch();
  ::testing::InitGoogleTest(&argc, argv);
  if (!swirl::Env("SWIRL_NETNS_SERVER").empty()) {
    swirl::RegisterClientCases();
    GTEST_FLAG_SET(filter, "InNamespace.*");
  }
  return RUN_ALL_TESTS();
}
