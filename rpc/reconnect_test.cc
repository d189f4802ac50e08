// Channels that reconnect (rpc/channel.h, "Connectivity"): a server process killed with
// SIGKILL and started again on the same port, calls in flight and calls started while the
// channel is down, wait_for_ready, the backoff, Close() during a reconnect, and a reconnect
// that would be weaker than the channel's policy allows.

#include <signal.h>

#include <atomic>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/mutex.h"
#include "gtest/gtest.h"
#include "swirl/channel.h"
#include "rpc/testing/process.h"
#include "rpc/testing/test_client.h"

namespace swirl {
namespace {

using testing::ChildProcess;
using testing::MethodOf;

// A test_server on `port` (0: any), with `extra` flags.
std::pair<ChildProcess, int> StartServer(int port, std::vector<std::string> extra = {}) {
  extra.push_back(absl::StrCat("--port=", port));
  auto server = testing::SpawnServer(testing::kTestServer, extra);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) std::abort();
  return std::move(*server);
}

// Backoff short enough for a test, long enough that its lower bounds mean something.
ChannelOptions FastReconnect() {
  ChannelOptions options;
  options.reconnect.initial_backoff = absl::Milliseconds(200);
  options.reconnect.multiplier = 2;
  options.reconnect.jitter = 0;
  options.reconnect.max_backoff = absl::Seconds(1);
  options.transport.keepalive = absl::Milliseconds(200);
  return options;
}

absl::Status Call(Channel& channel, const char* method, const std::string& in, std::string* out,
                  CallOptions options = {}) {
  ClientCall call;
  call.SetMethod(MethodOf(method));
  call.SetRequestBytes(in);
  call.SetResponseBytes(out);
  call.SetOptions(options);
  channel.Start(&call);
  return call.Wait();
}

// Until the channel leaves kReady (the kill is seen: the QP fails, or keepalives stop).
void WaitUntilNotReady(Channel& channel) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (channel.state() == ConnectivityState::kReady && absl::Now() < deadline) {
    channel.WaitForStateChange(ConnectivityState::kReady, deadline);
  }
  ASSERT_NE(channel.state(), ConnectivityState::kReady) << "the server's death went unnoticed";
}

TEST(Reconnect, AKilledAndRestartedServerIsReachedAgainOnTheSameChannel) {
  auto [server, port] = StartServer(0);
  auto channel = testing::ConnectTo(port, FastReconnect());
  ASSERT_TRUE(channel.ok()) << channel.status();
  Channel& ch = **channel;
  EXPECT_EQ(testing::Echo(ch, "before"), "before");
  const uint64_t first_connection = ch.connection_id();
  EXPECT_EQ(ch.state(), ConnectivityState::kReady);

  server.Kill();
  WaitUntilNotReady(ch);
  // Down: a call fails at once with UNAVAILABLE (it does not wait for the reconnect).
  std::string out;
  const absl::Time started = absl::Now();
  absl::Status down = Call(ch, "/test.E2E/Echo", "while down", &out);
  EXPECT_EQ(down.code(), absl::StatusCode::kUnavailable) << down;
  EXPECT_LT(absl::Now() - started, absl::Seconds(5)) << "a call on a down channel waited";
  EXPECT_FALSE(ch.last_error().ok());

  auto restarted = StartServer(port);
  ASSERT_TRUE(ch.WaitForReady(absl::Now() + absl::Seconds(30))) << ch.last_error();
  EXPECT_EQ(testing::Echo(ch, "after"), "after");
  EXPECT_EQ(ch.reconnects(), 1u);
  EXPECT_NE(ch.connection_id(), first_connection) << "a new server, a new connection";
  EXPECT_EQ(ch.LocalStats().connection_id, ch.connection_id());
}

TEST(Reconnect, ACallInFlightWhenTheServerDiesCompletesUnavailableAndOnlyOnce) {
  auto [server, port] = StartServer(0);
  auto channel = testing::ConnectTo(port, FastReconnect());
  ASSERT_TRUE(channel.ok()) << channel.status();
  ClientCall call;
  std::string out;
  std::atomic<int> completions{0};
  swirl::Notification done;
  // A blocking handler held at the test server's gate (for up to 20 s): the call is in the
  // server's hands when the server dies.
  call.SetMethod(MethodOf("/test.E2E/GateSum"));
  call.SetRequestBytes("");
  call.SetResponseBytes(&out);
  call.SetCallback([&](absl::Status) {
    completions.fetch_add(1);
    done.Notify();
  });
  (*channel)->Start(&call);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  std::string entered;
  while (entered != "1" && absl::Now() < deadline) {
    ASSERT_TRUE(Call(**channel, "/test.E2E/GateEntered", "", &entered).ok());
  }
  ASSERT_EQ(entered, "1") << "the call never reached the server's handler";
  EXPECT_FALSE(call.done());
  server.Kill();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(20)))
      << "a call in flight on a dead connection hung";
  EXPECT_EQ(call.status().code(), absl::StatusCode::kUnavailable) << call.status();
  // The channel reconnects to the restarted server, and the old call is not run again there,
  // nor completed again here.
  auto restarted = StartServer(port);
  ASSERT_TRUE((*channel)->WaitForReady(absl::Now() + absl::Seconds(30)))
      << (*channel)->last_error();
  EXPECT_EQ(testing::Echo(**channel, "fresh"), "fresh");
  EXPECT_EQ(completions.load(), 1);
}

TEST(Reconnect, AWaitForReadyCallWaitsForTheReconnectAndSucceeds) {
  auto [server, port] = StartServer(0);
  auto channel = testing::ConnectTo(port, FastReconnect());
  ASSERT_TRUE(channel.ok()) << channel.status();
  server.Kill();
  WaitUntilNotReady(**channel);

  ClientCall call;
  std::string out;
  swirl::Notification done;
  CallOptions options;
  options.wait_for_ready = true;
  options.timeout = absl::Seconds(60);
  call.SetMethod(MethodOf("/test.E2E/Echo"));
  call.SetRequestBytes("waited");
  call.SetResponseBytes(&out);
  call.SetOptions(options);
  call.SetCallback([&](absl::Status) { done.Notify(); });
  (*channel)->Start(&call);
  EXPECT_FALSE(call.done()) << "a wait_for_ready call on a down channel completed: "
                            << call.status();
  auto restarted = StartServer(port);
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_TRUE(call.status().ok()) << call.status();
  EXPECT_EQ(out, "waited");
}

TEST(Reconnect, AWaitForReadyCallFailsAtItsDeadlineIfNoConnectionComes) {
  auto [server, port] = StartServer(0);
  auto channel = testing::ConnectTo(port, FastReconnect());
  ASSERT_TRUE(channel.ok()) << channel.status();
  server.Kill();
  WaitUntilNotReady(**channel);
  std::string out;
  CallOptions options;
  options.wait_for_ready = true;
  options.timeout = absl::Milliseconds(300);
  const absl::Time started = absl::Now();
  absl::Status s = Call(**channel, "/test.E2E/Echo", "never", &out, options);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_GE(absl::Now() - started, absl::Milliseconds(300)) << "it did not wait";
  EXPECT_LT(absl::Now() - started, absl::Seconds(20)) << "it waited far past its deadline";
}

TEST(Reconnect, AttemptsBackOffAndTheStatesFollowGrpcs) {
  auto [server, port] = StartServer(0);
  auto channel = testing::ConnectTo(port, FastReconnect());
  ASSERT_TRUE(channel.ok()) << channel.status();
  Channel& ch = **channel;
  server.Kill();
  WaitUntilNotReady(ch);
  // Record when each attempt starts (kConnecting) over the first four attempts: the waits
  // between them are at least 200, 400 and 800 ms (jitter 0; a loaded machine only adds).
  std::vector<absl::Time> attempts;
  ConnectivityState last = ch.state();
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (attempts.size() < 4 && absl::Now() < deadline) {
    ch.WaitForStateChange(last, deadline);
    last = ch.state();
    ASSERT_NE(last, ConnectivityState::kReady) << "connected to a dead server";
    ASSERT_NE(last, ConnectivityState::kShutdown);
    if (last == ConnectivityState::kConnecting) attempts.push_back(absl::Now());
  }
  ASSERT_EQ(attempts.size(), 4u) << "the channel stopped trying";
  EXPECT_GE(attempts[2] - attempts[1], absl::Milliseconds(190));
  EXPECT_GE(attempts[3] - attempts[2], absl::Milliseconds(390));
  EXPECT_EQ(ch.last_error().code(), absl::StatusCode::kUnavailable) << ch.last_error();
}

TEST(Reconnect, CloseDuringReconnectEndsPromptlyInShutdown) {
  auto [server, port] = StartServer(0);
  ChannelOptions options = FastReconnect();
  options.reconnect.initial_backoff = absl::Seconds(30);  // it would wait that long to retry
  options.reconnect.max_backoff = absl::Seconds(30);
  auto channel = testing::ConnectTo(port, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  server.Kill();
  WaitUntilNotReady(**channel);
  // A wait_for_ready call waiting in the channel completes when it closes.
  ClientCall call;
  std::string out;
  CallOptions wait;
  wait.wait_for_ready = true;
  call.SetMethod(MethodOf("/test.E2E/Echo"));
  call.SetRequestBytes("x");
  call.SetResponseBytes(&out);
  call.SetOptions(wait);
  (*channel)->Start(&call);
  const absl::Time started = absl::Now();
  (*channel)->Close();
  EXPECT_LT(absl::Now() - started, absl::Seconds(10)) << "Close waited for the backoff";
  EXPECT_EQ((*channel)->state(), ConnectivityState::kShutdown);
  ASSERT_TRUE(call.done());
  EXPECT_EQ(call.status().code(), absl::StatusCode::kUnavailable) << call.status();
  EXPECT_EQ(Call(**channel, "/test.E2E/Echo", "closed", &out).code(), absl::StatusCode::kUnavailable);
}

TEST(Reconnect, WithReconnectDisabledALostChannelStaysDown) {
  auto [server, port] = StartServer(0);
  ChannelOptions options = FastReconnect();
  options.reconnect.enabled = false;
  auto channel = testing::ConnectTo(port, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  server.Kill();
  WaitUntilNotReady(**channel);
  auto restarted = StartServer(port);
  // Ten times the backoff a reconnecting channel would wait: no attempt is made.
  EXPECT_FALSE((*channel)->WaitForStateChange(ConnectivityState::kTransientFailure,
                                              absl::Now() + absl::Seconds(2)))
      << ConnectivityStateName((*channel)->state());
  EXPECT_EQ((*channel)->reconnects(), 0u);
}

// Never silently weaker: a server that comes back able to offer only the local-invalidation
// fallback gets a reconnect from a channel that prefers remote invalidation, and the channel
// says so (negotiated() and LocalStats() show the fallback; a WARNING is logged)...
TEST(Reconnect, AReconnectToAWeakerServerShowsTheFallback) {
  auto [server, port] = StartServer(0);
  auto channel = testing::ConnectTo(port, FastReconnect());
  ASSERT_TRUE(channel.ok()) << channel.status();
  ASSERT_EQ((*channel)->negotiated().invalidation, InvalidationMode::kRemote);
  server.Kill();
  WaitUntilNotReady(**channel);
  auto restarted = StartServer(port, {"--local_invalidation_only"});
  ASSERT_TRUE((*channel)->WaitForReady(absl::Now() + absl::Seconds(30)))
      << (*channel)->last_error();
  EXPECT_EQ((*channel)->negotiated().invalidation, InvalidationMode::kLocal);
  EXPECT_EQ((*channel)->LocalStats().negotiated.invalidation, InvalidationMode::kLocal);
  EXPECT_EQ(testing::Echo(**channel, "weaker"), "weaker");
}

// ... and a channel that requires remote invalidation refuses it: it stays down, says why,
// and keeps trying.
TEST(Reconnect, AReconnectWeakerThanThePolicyAllowsIsRefused) {
  auto [server, port] = StartServer(0);
  ChannelOptions options = FastReconnect();
  options.transport.invalidation = InvalidationPolicy::kRequireRemote;
  auto channel = testing::ConnectTo(port, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  server.Kill();
  WaitUntilNotReady(**channel);
  auto restarted = StartServer(port, {"--local_invalidation_only"});
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline &&
         (*channel)->last_error().code() != absl::StatusCode::kFailedPrecondition) {
    (*channel)->WaitForStateChange((*channel)->state(), deadline);
  }
  EXPECT_EQ((*channel)->last_error().code(), absl::StatusCode::kFailedPrecondition)
      << (*channel)->last_error();
  EXPECT_NE((*channel)->state(), ConnectivityState::kReady);
  EXPECT_EQ((*channel)->reconnects(), 0u);
}

// A restarted server that refuses the channel (another token): the channel reports the
// server's reason and never reaches kReady.
TEST(Reconnect, ARefusedReconnectReportsTheServersReason) {
  auto [server, port] = StartServer(0);
  auto channel = testing::ConnectTo(port, FastReconnect());
  ASSERT_TRUE(channel.ok()) << channel.status();
  server.Kill();
  WaitUntilNotReady(**channel);
  auto restarted = StartServer(port, {"--token=other"});
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline &&
         (*channel)->last_error().code() != absl::StatusCode::kUnauthenticated) {
    (*channel)->WaitForStateChange((*channel)->state(), deadline);
  }
  EXPECT_EQ((*channel)->last_error().code(), absl::StatusCode::kUnauthenticated)
      << (*channel)->last_error();
  EXPECT_NE((*channel)->state(), ConnectivityState::kReady);
}

}  // namespace
}  // namespace swirl
