// Process death and link faults at the RPC level (issue 21, docs/RELIABILITY.md), each side in
// its own process: a client killed (SIGKILL) in the middle of an upload and of a download; a
// server killed with calls and bulk transfers in flight; a server that stops acknowledging
// (SWIRL_SOFT_FAULTS noack); a half-open link (SWIRL_SOFT_FAULTS drop: nothing arrives, no
// FIN, no RST); a peer stalled (SIGSTOP) past the keepalive, then resumed. In every case the
// survivor's callers get a clear status within their deadline, its QPs, receive buffers,
// windows and bulk memory return to what they were before (ServerCounters through the control
// plane for a server, ClientRuntime::Counters() for a client: nothing leaked, no window left
// exposed), and a new connection then works. process_faults_test runs this on shared memory,
// process_faults_test_tcp on the soft device's TCP fabric.

#include <signal.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/mutex.h"
#include "gtest/gtest.h"
#include "rpc/testing/process.h"
#include "rpc/testing/slowdown.h"
#include "rpc/testing/test_client.h"
#include "rpc/testing/test_data.h"
#include "swirl/call.h"
#include "swirl/channel.h"
#include "swirl/client_runtime.h"

namespace swirl {
namespace {

using testing::ChildProcess;
using testing::MethodOf;

constexpr char kLoadClient[] = "rpc/testing/load_client";
// Every side's keepalive (servers, channels, load_client). A stop of the catch loop below
// (SIGSTOP, read the state file, ask the server) must stay well inside three of them, or the
// resumed client rightly gives up its server; sanitizer builds scale it (and the bounds below
// that follow from it) by their slowdown.
constexpr absl::Duration kKeepalive = absl::Milliseconds(200 * testing::kSlowdown);
// How long a survivor may take to see a loss and clean up after it: a few keepalives (the
// liveness check fails a silent peer after three), with room for a loaded machine.
constexpr absl::Duration kNoticeBound = absl::Seconds(15 * testing::kSlowdown);
// A call to a server stalled past the keepalive: long enough that it fails when the keepalive
// finds the server silent, not at its deadline.
constexpr absl::Duration kStalledCallTimeout = absl::Seconds(10 * testing::kSlowdown);

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name, "-",
                      absl::ToUnixNanos(absl::Now()));
}

// A test_server with a short keepalive, on `port` (0: any), with `extra` flags and `env`.
std::pair<ChildProcess, int> StartServer(int port = 0, std::vector<std::string> extra = {},
                                         const std::vector<std::string>& env = {}) {
  extra.push_back(absl::StrCat("--port=", port));
  extra.push_back(absl::StrCat("--keepalive_ms=", absl::ToInt64Milliseconds(kKeepalive)));
  auto server = testing::SpawnServer(testing::kTestServer, extra, absl::Seconds(30), env);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) std::abort();
  return std::move(*server);
}

ChannelOptions Fast() {
  ChannelOptions options;
  options.transport.keepalive = kKeepalive;
  options.reconnect.initial_backoff = absl::Milliseconds(100);
  options.reconnect.multiplier = 2;
  options.reconnect.max_backoff = absl::Milliseconds(500);
  options.connect_timeout = absl::Seconds(2);
  return options;
}

// The counters that say what a side holds; "" when `now` holds what `base` did.
template <typename Counters>
std::string Leftovers(const Counters& now, const Counters& base) {
  std::string out;
  auto check = [&](const char* name, uint64_t a, uint64_t b) {
    if (a != b) absl::StrAppend(&out, name, "=", a, " (baseline ", b, ") ");
  };
  check("queue_pairs_live", now.queue_pairs_live, base.queue_pairs_live);
  check("recv_buffers_free", now.recv_buffers_free, base.recv_buffers_free);
  check("recv_buffers_total", now.recv_buffers_total, base.recv_buffers_total);
  check("windows_outstanding", now.windows_outstanding, base.windows_outstanding);
  check("bulk_bytes_in_use", now.bulk_bytes_in_use, base.bulk_bytes_in_use);
  return out;
}

ServerCounters ServerNow(Channel& observer) {
  absl::StatusOr<StatsReport> stats = observer.ServerStats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  return stats.ok() ? stats->server : ServerCounters{};
}

// Waits (bounded) until `now()` holds what `base` did; what is left over if it never does.
template <typename Now, typename Counters>
std::string WaitForBaseline(Now now, const Counters& base, absl::Duration bound = kNoticeBound) {
  const absl::Time deadline = absl::Now() + bound;
  for (;;) {
    std::string left = Leftovers(now(), base);
    if (left.empty() || absl::Now() >= deadline) return left;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

absl::Status Call(Channel& channel, const char* method, const std::string& in, std::string* out,
                  absl::Duration timeout = absl::Seconds(10)) {
  return CallRaw(channel, MethodOf(method), in, out, CallOptions{timeout});
}

// An upload and a download of `n` bytes through `channel`, checked.
void ExpectBulkRoundTrip(Channel& channel, size_t n) {
  auto out = channel.AllocateBulk(n);
  ASSERT_TRUE(out.ok()) << out.status();
  for (size_t i = 0; i < n; ++i) out->data()[i] = testing::Pattern(i);
  out->resize(n);
  CallOptions options{absl::Seconds(10)};
  options.request_bulk = &*out;
  std::string sum;
  ASSERT_TRUE(CallRaw(channel, MethodOf("/test.E2E/Sum"), "", &sum, options).ok());
  EXPECT_EQ(sum, absl::StrCat(n, ":", testing::Fnv(out->view())));
  auto in = channel.AllocateBulk(n);
  ASSERT_TRUE(in.ok()) << in.status();
  CallOptions fill{absl::Seconds(10)};
  fill.response_bulk = &*in;
  std::string filled;
  ASSERT_TRUE(CallRaw(channel, MethodOf("/test.E2E/Fill"), std::to_string(n), &filled, fill).ok());
  ASSERT_EQ(in->size(), n);
  for (size_t i = 0; i < n; i += 4093) ASSERT_EQ(in->data()[i], testing::Pattern(i)) << i;
}

// A channel on a runtime of its own, so that its counters are this test's alone.
struct OwnChannel {
  std::shared_ptr<ClientRuntime> runtime;
  std::shared_ptr<Channel> channel;
};
OwnChannel ConnectOwn(int port, ChannelOptions options = Fast()) {
  ClientRuntimeOptions runtime_options;
  runtime_options.transport = options.transport;
  auto runtime = ClientRuntime::Create(runtime_options);
  EXPECT_TRUE(runtime.ok()) << runtime.status();
  if (!runtime.ok()) std::abort();
  options.runtime = *runtime;
  auto channel = testing::ConnectTo(port, options);
  EXPECT_TRUE(channel.ok()) << channel.status();
  if (!channel.ok()) std::abort();
  return {*runtime, *channel};
}

// "<phase> <calls done>" from load_client's state file.
std::pair<int, uint64_t> ReadState(const std::string& path) {
  std::ifstream in(path);
  int phase = -1;
  uint64_t done = 0;
  in >> phase >> done;
  return {phase, done};
}

// ---- A client killed mid-transfer: the server survives ----------------------------------------

// Runs load_client in `mode`, catches it stopped (SIGSTOP) while a transfer is in flight and
// the server holds a window for it, kills it (SIGKILL), and checks the server: its counters
// back to the baseline, its other clients served throughout, a new connection's transfers.
void KillTheClientMidTransfer(const char* mode) {
  auto [server, port] = StartServer();
  auto observer = testing::ConnectTo(port, Fast());
  ASSERT_TRUE(observer.ok()) << observer.status();
  ASSERT_EQ(testing::Echo(**observer, "hello"), "hello");
  const ServerCounters base = ServerNow(**observer);
  ASSERT_EQ(base.queue_pairs_live, 1u);
  ASSERT_EQ(base.windows_outstanding, 0u);

  const std::string state = TempPath("load-state");
  auto client = ChildProcess::Spawn({kLoadClient, absl::StrCat("--server=127.0.0.1:", port),
                                     absl::StrCat("--mode=", mode), "--size=8388608",
                                     absl::StrCat("--state_file=", state),
                                     absl::StrCat("--keepalive_ms=",
                                                  absl::ToInt64Milliseconds(kKeepalive))});
  ASSERT_TRUE(client.ok()) << client.status();
  // Stopped, the client is frozen where it was: it counts as caught if a transfer of its (not
  // its first: it is under way for real) is in flight and the server has a window out.
  absl::BitGen bitgen;
  bool caught = false;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (!caught && absl::Now() < deadline) {
    ASSERT_TRUE(client->StopAndWait().ok());
    const auto [phase, done] = ReadState(state);
    const ServerCounters now = ServerNow(**observer);
    caught = phase == 1 && done >= 1 && now.windows_outstanding > 0;
    if (!caught) {
      ASSERT_FALSE(client->Wait(absl::ZeroDuration()).ok()) << "load_client ended by itself";
      client->Signal(SIGCONT);
      absl::SleepFor(absl::Milliseconds(absl::Uniform(bitgen, 1, 30)));
    }
  }
  ASSERT_TRUE(caught) << "never caught load_client in the middle of a " << mode;
  const uint64_t failed_before = ServerNow(**observer).connections_failed;
  client->Kill();

  EXPECT_EQ(WaitForBaseline([&] { return ServerNow(**observer); }, base), "")
      << "the server kept what the killed client had";
  EXPECT_EQ(ServerNow(**observer).connections_failed, failed_before + 1);
  EXPECT_EQ(testing::Echo(**observer, "still here"), "still here");
  // A new connection works, transfers included, and leaves nothing behind either.
  {
    auto fresh = testing::ConnectTo(port, Fast());
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    ExpectBulkRoundTrip(**fresh, 1 << 20);
  }
  EXPECT_EQ(WaitForBaseline([&] { return ServerNow(**observer); }, base), "");
  std::remove(state.c_str());
}

TEST(ProcessFaults, AClientKilledMidUploadLeavesTheServerNothingExposed) {
  KillTheClientMidTransfer("upload");
}

TEST(ProcessFaults, AClientKilledMidDownloadLeavesTheServerNothingExposed) {
  KillTheClientMidTransfer("download");
}

// ---- A server killed with calls and transfers in flight: the client survives -------------------

TEST(ProcessFaults, AServerKilledWithCallsAndTransfersInFlightFailsThemAndTheClientKeepsNothing) {
  auto [server, port] = StartServer();
  // Mirror mode: the client exposes its buffers (request and reply windows) for as long as the
  // server has not answered, so the transfers in flight are the client's windows.
  ChannelOptions options = Fast();
  options.bulk_mode = BulkMode::kMirror;
  OwnChannel own = ConnectOwn(port, options);
  Channel& ch = *own.channel;
  ASSERT_EQ(ch.negotiated().bulk_mode, BulkMode::kMirror);
  // The server's four handler threads: two uploads held at its gate, one download whose
  // handler sleeps before it fills, one plain call that sleeps.
  constexpr int kUploads = 2;
  constexpr int kCalls = kUploads + 2;
  constexpr size_t kSize = 1 << 20;
  std::vector<BulkBuffer> uploads, landings;
  for (int i = 0; i < kUploads; ++i) {
    auto up = ch.AllocateBulk(kSize);
    auto land = ch.AllocateBulk(kSize);
    ASSERT_TRUE(up.ok() && land.ok());
    up->resize(kSize);
    uploads.push_back(std::move(*up));
    landings.push_back(std::move(*land));
  }
  ASSERT_EQ(testing::Echo(ch, "hello"), "hello");
  const RuntimeCounters base = own.runtime->Counters();
  ASSERT_EQ(base.queue_pairs_live, 1u);
  ASSERT_EQ(base.windows_outstanding, 0u);

  // In flight when the server dies, all with a 20 s deadline: the uploads (each with a reply
  // window of the client's, exposed until the server answers), the download, the call.
  constexpr absl::Duration kDeadline = absl::Seconds(20);
  std::vector<std::unique_ptr<ClientCall>> calls;
  std::vector<std::string> ins(kCalls), outs(kCalls);  // the calls point into them
  std::vector<absl::Time> completed(kCalls);
  std::vector<swirl::Notification> done(kCalls);
  // An early return (a failed ASSERT) closes the channel first: its calls complete while what
  // their callbacks touch is still there.
  absl::Cleanup close = [&] { ch.Close(); };
  auto start = [&](const char* method, const std::string& in, const BulkBuffer* request_bulk,
                   BulkBuffer* response_bulk) {
    const size_t i = calls.size();
    ins[i] = in;
    calls.push_back(std::make_unique<ClientCall>());
    CallOptions call_options{kDeadline};
    call_options.request_bulk = request_bulk;
    call_options.response_bulk = response_bulk;
    calls[i]->SetMethod(MethodOf(method));
    calls[i]->SetRequestBytes(ins[i]);
    calls[i]->SetResponseBytes(&outs[i]);
    calls[i]->SetOptions(call_options);
    calls[i]->SetCallback([&, i](absl::Status) {
      completed[i] = absl::Now();
      done[i].Notify();
    });
    ch.Start(calls[i].get());
  };
  for (int i = 0; i < kUploads; ++i) start("/test.E2E/GateSum", "", &uploads[i], &landings[i]);
  // Until the uploads are at the gate (their data read) with their reply windows out.
  const absl::Time ready_by = absl::Now() + absl::Seconds(20);
  std::string entered;
  while (absl::Now() < ready_by &&
         (entered != std::to_string(kUploads) ||
          own.runtime->Counters().windows_outstanding < static_cast<uint64_t>(kUploads))) {
    ASSERT_TRUE(Call(ch, "/test.E2E/GateEntered", "", &entered).ok());
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(entered, std::to_string(kUploads)) << "the uploads never reached their handlers";
  ASSERT_GE(own.runtime->Counters().windows_outstanding, static_cast<uint64_t>(kUploads));
  // Counted before they start: either may leave for the server at once.
  const uint64_t sent_before = ch.LocalStats().requests_sent;
  start("/test.E2E/SlowFill", absl::StrCat(20000, " ", kSize), nullptr, nullptr);
  start("/test.E2E/Sleep", "20000", nullptr, nullptr);
  // Until both have left for the server.
  const absl::Time sent_by = absl::Now() + absl::Seconds(5);
  while (ch.LocalStats().requests_sent < sent_before + 2 && absl::Now() < sent_by) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_GE(ch.LocalStats().requests_sent, sent_before + 2);
  for (auto& call : calls) ASSERT_FALSE(call->done()) << call->status();

  const absl::Time killed = absl::Now();
  server.Kill();
  for (size_t i = 0; i < calls.size(); ++i) {
    ASSERT_TRUE(done[i].WaitForNotificationWithTimeout(kDeadline + absl::Seconds(10)))
        << "call " << i << " hung";
    EXPECT_EQ(calls[i]->status().code(), absl::StatusCode::kUnavailable)
        << "call " << i << ": " << calls[i]->status();
    EXPECT_LT(completed[i] - killed, kNoticeBound) << "call " << i << " learnt late";
  }
  // Nothing held for the dead connection: no QP, no window exposed, the pool as before.
  RuntimeCounters lost = base;
  lost.queue_pairs_live = 0;
  lost.recv_buffers_free = own.runtime->Counters().recv_buffers_free;  // as the SRQ has them
  EXPECT_EQ(WaitForBaseline([&] { return own.runtime->Counters(); }, lost), "");

  // The server again on its port: the channel reconnects, calls and transfers work, and the
  // counters are what they were with one connection.
  auto restarted = StartServer(port);
  ASSERT_TRUE(ch.WaitForReady(absl::Now() + absl::Seconds(30))) << ch.last_error();
  EXPECT_EQ(testing::Echo(ch, "again"), "again");
  ExpectBulkRoundTrip(ch, kSize);
  EXPECT_EQ(WaitForBaseline([&] { return own.runtime->Counters(); }, base), "");
}

// ---- A server whose link goes wrong: the client survives --------------------------------------

// Against a server whose QPs all get `fault` (SWIRL_SOFT_FAULTS) at their `at_frame`-th frame:
// bulk echoes (mirror mode: each call has the client's request and reply windows out until the
// server answers) go until the fault fires; the one that fails fails within its deadline with a
// clear status, the client's counters (its windows included) go back to the baseline, and the
// channel reconnects (a new QP, whose own frames are far from the fault) and works.
void ExpectTheClientSurvivesAServerFault(const char* fault, int at_frame) {
  auto [server, port] = StartServer(
      0, {}, {absl::StrCat("SWIRL_SOFT_FAULTS=qp=*,at_frame=", at_frame, ",action=", fault)});
  ChannelOptions options = Fast();
  options.bulk_mode = BulkMode::kMirror;
  OwnChannel own = ConnectOwn(port, options);
  Channel& ch = *own.channel;
  ASSERT_EQ(testing::Echo(ch, "hello"), "hello");
  constexpr size_t kSize = 65536;
  auto out_bulk = ch.AllocateBulk(kSize);
  auto in_bulk = ch.AllocateBulk(kSize);
  ASSERT_TRUE(out_bulk.ok() && in_bulk.ok());
  for (size_t i = 0; i < kSize; ++i) out_bulk->data()[i] = testing::Pattern(i);
  out_bulk->resize(kSize);
  const RuntimeCounters base = own.runtime->Counters();
  const uint64_t first_connection = ch.connection_id();

  constexpr absl::Duration kTimeout = absl::Seconds(10);
  absl::Status failed;
  absl::Duration took;
  int ok_calls = 0;
  for (int i = 0; i < 10 * at_frame && failed.ok(); ++i) {
    std::string out;
    CallOptions call_options{kTimeout};
    call_options.request_bulk = &*out_bulk;
    call_options.response_bulk = &*in_bulk;
    const absl::Time started = absl::Now();
    failed = CallRaw(ch, MethodOf("/test.E2E/BulkEcho"), "x", &out, call_options);
    took = absl::Now() - started;
    if (failed.ok()) {
      ++ok_calls;
      ASSERT_EQ(in_bulk->view(), out_bulk->view()) << "call " << i;
    }
  }
  ASSERT_FALSE(failed.ok()) << "the fault never showed after " << ok_calls << " calls";
  EXPECT_GT(ok_calls, 0);
  EXPECT_TRUE(failed.code() == absl::StatusCode::kUnavailable ||
              failed.code() == absl::StatusCode::kDeadlineExceeded)
      << failed;
  EXPECT_LT(took, kTimeout + absl::Seconds(2)) << "the call outlived its deadline";
  // The connection is given up, and the channel connects again.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (ch.connection_id() == first_connection && absl::Now() < deadline) {
    ch.WaitForStateChange(ch.state(), absl::Now() + absl::Milliseconds(100));
  }
  ASSERT_NE(ch.connection_id(), first_connection) << "the channel never gave up the link";
  ASSERT_TRUE(ch.WaitForReady(absl::Now() + absl::Seconds(30))) << ch.last_error();
  EXPECT_EQ(testing::Echo(ch, "again"), "again");
  EXPECT_EQ(WaitForBaseline([&] { return own.runtime->Counters(); }, base), "");
  // The server, too, let the old connection go: only the new one is left, no window out.
  const absl::Time server_deadline = absl::Now() + kNoticeBound;
  ServerCounters s = ServerNow(ch);
  while ((s.queue_pairs_live != 1 || s.windows_outstanding != 0) &&
         absl::Now() < server_deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    s = ServerNow(ch);
  }
  EXPECT_EQ(s.queue_pairs_live, 1u);
  EXPECT_EQ(s.windows_outstanding, 0u);
}

TEST(ProcessFaults, AServerThatStopsAcknowledgingFailsTheCallsWithinTheirDeadline) {
  ExpectTheClientSurvivesAServerFault("noack", 40);
}

// A link that goes silent both ways (a cut cable, a peer gone without FIN or RST: on the TCP
// fabric the socket stays open and nothing arrives). As on a NIC, the request nobody
// acknowledges fails at the QP's ACK timeout (RETRY_EXC_ERR; the TCP fabric times its links);
// an idle connection's silence is the keepalive's to find (the stalled-peer cases below).
TEST(ProcessFaults, AHalfOpenLinkFailsTheCallInFlightAndTheChannelRecovers) {
  ExpectTheClientSurvivesAServerFault("drop", 40);
}

// ---- A peer stalled past the keepalive, then resumed --------------------------------------------

TEST(ProcessFaults, AServerStalledPastTheKeepaliveFailsTheCallsAndIsReachedAgainWhenItResumes) {
  auto [server, port] = StartServer();
  OwnChannel own = ConnectOwn(port);
  Channel& ch = *own.channel;
  ASSERT_EQ(testing::Echo(ch, "hello"), "hello");
  const RuntimeCounters base = own.runtime->Counters();
  const uint64_t first_connection = ch.connection_id();

  ASSERT_TRUE(server.StopAndWait().ok());
  std::string out;
  const absl::Time started = absl::Now();
  absl::Status s = Call(ch, "/test.E2E/Echo", "stalled", &out, kStalledCallTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_LT(absl::Now() - started, kStalledCallTimeout) << "found only at the call's deadline";
  RuntimeCounters lost = base;
  lost.queue_pairs_live = 0;
  lost.recv_buffers_free = own.runtime->Counters().recv_buffers_free;
  EXPECT_EQ(WaitForBaseline([&] { return own.runtime->Counters(); }, lost), "");

  server.Signal(SIGCONT);
  ASSERT_TRUE(ch.WaitForReady(absl::Now() + absl::Seconds(30))) << ch.last_error();
  EXPECT_NE(ch.connection_id(), first_connection);
  EXPECT_EQ(testing::Echo(ch, "resumed"), "resumed");
  EXPECT_EQ(WaitForBaseline([&] { return own.runtime->Counters(); }, base), "");
  // The resumed server let the stale connection go.
  const absl::Time deadline = absl::Now() + kNoticeBound;
  ServerCounters sc = ServerNow(ch);
  while ((sc.queue_pairs_live != 1 || sc.windows_outstanding != 0) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    sc = ServerNow(ch);
  }
  EXPECT_EQ(sc.queue_pairs_live, 1u);
  EXPECT_EQ(sc.windows_outstanding, 0u);
}

TEST(ProcessFaults, AClientStalledPastTheKeepaliveIsLetGoAndLearnsOfItWhenItResumes) {
  auto [server, port] = StartServer();
  auto observer = testing::ConnectTo(port, Fast());
  ASSERT_TRUE(observer.ok()) << observer.status();
  ASSERT_EQ(testing::Echo(**observer, "hello"), "hello");
  const ServerCounters base = ServerNow(**observer);

  const std::string state = TempPath("load-state");
  auto client = ChildProcess::Spawn({kLoadClient, absl::StrCat("--server=127.0.0.1:", port),
                                     "--mode=download", "--size=1048576",
                                     absl::StrCat("--state_file=", state),
                                     absl::StrCat("--keepalive_ms=",
                                                  absl::ToInt64Milliseconds(kKeepalive))});
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::Time loading_by = absl::Now() + absl::Seconds(30);
  while (ReadState(state).second < 3 && absl::Now() < loading_by) {
    ASSERT_FALSE(client->Wait(absl::ZeroDuration()).ok()) << "load_client ended by itself";
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_GE(ReadState(state).second, 3u) << "load_client never got going";
  ASSERT_TRUE(client->StopAndWait().ok());
  // The server gives the silent client up: everything it held for it is released (a download
  // window it had out included), and its other clients are served meanwhile.
  EXPECT_EQ(WaitForBaseline([&] { return ServerNow(**observer); }, base), "");
  EXPECT_EQ(testing::Echo(**observer, "still here"), "still here");
  // Resumed, the client finds its connection gone: its call fails, and it says so (exit 2)
  // instead of hanging.
  client->Signal(SIGCONT);
  absl::StatusOr<int> exit_code = client->Wait(absl::Seconds(30));
  ASSERT_TRUE(exit_code.ok()) << "the resumed client hung on its dead connection";
  EXPECT_EQ(*exit_code, 2);
  EXPECT_EQ(WaitForBaseline([&] { return ServerNow(**observer); }, base), "");
  std::remove(state.c_str());
}

}  // namespace
}  // namespace swirl
