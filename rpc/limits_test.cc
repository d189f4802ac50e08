// The server's limits on what one client, or all of them, may hold: connections in total and
// per client address, and the bytes blocking handlers hold while they wait for the handler pool.
// Against rpc/testing/test_server in another process.

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "rpc/handshake.h"
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/server_stats.h"
#include "rpc/testing/test_client.h"
#include "rpc/testing/test_data.h"
#include "swirl/channel.h"

namespace swirl {
namespace {

using testing::ConnectTo;
using testing::Echo;
using testing::MethodOf;
using testing::ServerStatsWhen;

uint64_t ActiveConnections(const StatsReport& stats) {
  return stats.server.connections_active;
}

// `n` channels to the server on `port`, each checked with an echo.
std::vector<std::shared_ptr<Channel>> OpenChannels(int port, int n) {
  std::vector<std::shared_ptr<Channel>> out;
  for (int i = 0; i < n; ++i) {
    auto channel = ConnectTo(port);
    EXPECT_TRUE(channel.ok()) << "connection " << i << ": " << channel.status();
    if (!channel.ok()) break;
    EXPECT_EQ(Echo(**channel, "up"), "up");
    out.push_back(*channel);
  }
  return out;
}

// The connection beyond a cap is refused with RESOURCE_EXHAUSTED naming `limit`; the ones
// admitted keep working; once one of them is closed (and the server has seen it go), a new one
// is admitted again.
void ExpectCapHolds(int port, int cap, const std::string& limit) {
  std::vector<std::shared_ptr<Channel>> channels = OpenChannels(port, cap);
  ASSERT_EQ(channels.size(), static_cast<size_t>(cap));
  Channel& observer = *channels.front();  // stays open throughout; asks the server for stats
  auto before = observer.ServerStats();
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(ActiveConnections(*before), static_cast<uint64_t>(cap));

  auto refused = ConnectTo(port);
  ASSERT_FALSE(refused.ok()) << "connection " << cap + 1 << " was admitted";
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find(limit), absl::string_view::npos)
      << refused.status();
  for (size_t i = 0; i < channels.size(); ++i) {
    EXPECT_EQ(Echo(*channels[i], absl::StrCat("still ", i)), absl::StrCat("still ", i));
  }
  auto after = observer.ServerStats();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->server.connections_refused, before->server.connections_refused + 1);
  EXPECT_EQ(ActiveConnections(*after), static_cast<uint64_t>(cap));

  channels.back()->Close();
  channels.pop_back();
  auto freed = ServerStatsWhen(observer, [cap](const StatsReport& s) {
    return ActiveConnections(s) == static_cast<uint64_t>(cap - 1);
  });
  ASSERT_TRUE(freed.ok()) << freed.status();
  ASSERT_EQ(ActiveConnections(*freed), static_cast<uint64_t>(cap - 1));
  auto admitted = ConnectTo(port);
  ASSERT_TRUE(admitted.ok()) << "a slot was freed, yet: " << admitted.status();
  EXPECT_EQ(Echo(**admitted, "admitted"), "admitted");
  for (auto& channel : channels) EXPECT_EQ(Echo(*channel, "and us"), "and us");
}

TEST(ConnectionLimits, TheServerWideCapRefusesTheConnectionBeyondIt) {
  // Two workers of two connections each could hold four: only the server-wide cap (three)
  // refuses the fourth.
  auto server = testing::SpawnServer(testing::kTestServer,
                                     {"--max_connections=3", "--workers=2"});
  ASSERT_TRUE(server.ok()) << server.status();
  ExpectCapHolds(server->second, 3, "server connection limit reached");
}

TEST(ConnectionLimits, ThePerClientCapRefusesTheClientsConnectionBeyondIt) {
  // Far below the server-wide cap (256): only the per-address count can refuse the third. No
  // token: with one, clients are counted by principal (principals_test), not by address.
  auto server = testing::SpawnServer(testing::kTestServer, {"--max_per_client=2", "--token="});
  ASSERT_TRUE(server.ok()) << server.status();
  ExpectCapHolds(server->second, 2, "connection limit for ipv4:127.0.0.1 reached");
}

// How many blocking handlers have reached the gate on the server behind `channel`.
int GateEntered(Channel& channel) {
  std::string out;
  int n = -1;
  if (!CallRaw(channel, MethodOf("/test.E2E/GateEntered"), "", &out, {}).ok() ||
      !absl::SimpleAtoi(out, &n)) {
    return -1;
  }
  return n;
}

// Blocking handlers waiting for the pool hold their request and attachment, and their caller
// has its credits back at once: besides their number (E2ETest.QueuedBlockingCallsAreBounded-
// PerConnection), the bytes they hold are capped per connection by grant_bytes_per_connection
// (docs/BULK.md). With the pool's four threads held at a shut gate, two uploads of 300,000
// bytes (each held in a 512 KiB pool buffer) fill a 1 MiB cap exactly and wait; the third is
// answered RESOURCE_EXHAUSTED at once (the count cap, 64, is far away), the connection carries
// on, the two queued ones run correctly once the gate opens, and then another is admitted.
TEST(BlockingHandlerLimits, QueuedBlockingCallsAreBoundedInBytesPerConnection) {
  auto server = testing::SpawnServer(testing::kTestServer, {"--grant_bytes=1048576"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = ConnectTo(server->second);
  ASSERT_TRUE(channel.ok()) << channel.status();
  constexpr int kPoolThreads = 4;  // ServerOptions::handler_threads
  for (int i = 0; i < kPoolThreads; ++i) {
    ClientCall gate;
    gate.SetMethod(MethodOf("/test.E2E/Gate"));
    gate.SetOneWay(true);
    (*channel)->Start(&gate);
    ASSERT_TRUE(gate.Wait().ok()) << gate.status();
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (GateEntered(**channel) < kPoolThreads && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(GateEntered(**channel), kPoolThreads) << "the pool's threads are not all held";

  constexpr size_t kSize = 300000;
  constexpr int kCalls = 3;
  std::vector<BulkBuffer> data;
  std::vector<std::string> expected;
  for (int i = 0; i < kCalls + 1; ++i) {
    auto buffer = (*channel)->AllocateBulk(kSize);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    for (size_t j = 0; j < kSize; ++j) buffer->data()[j] = static_cast<char>(j * (i + 3));
    buffer->resize(kSize);
    expected.push_back(absl::StrCat(kSize, ":", testing::Fnv(buffer->view())));
    data.push_back(std::move(*buffer));
  }
  std::vector<ClientCall> calls(kCalls);
  std::vector<std::string> responses(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    CallOptions options;
    options.timeout = absl::Seconds(20);
    options.request_bulk = &data[i];
    calls[i].SetMethod(MethodOf("/test.E2E/GateSum"));
    calls[i].SetResponseBytes(&responses[i]);
    calls[i].SetOptions(options);
    (*channel)->Start(&calls[i]);
  }
  // Calls leave in order: the first two are queued behind the gate, the third is over the cap.
  const absl::Status third = calls[2].Wait();
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  EXPECT_NE(third.message().find("wait for the handler pool"), absl::string_view::npos) << third;
  EXPECT_FALSE(calls[0].done()) << calls[0].status();
  EXPECT_FALSE(calls[1].done()) << calls[1].status();
  EXPECT_EQ(Echo(**channel, "meanwhile"), "meanwhile");

  std::string opened;
  ASSERT_TRUE(CallRaw(**channel, MethodOf("/test.E2E/OpenGate"), "", &opened, {}).ok());
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(calls[i].Wait().ok()) << i << ": " << calls[i].status();
    EXPECT_EQ(responses[i], expected[i]) << i;
  }
  // The queue is empty again: the same upload is admitted now.
  CallOptions options;
  options.timeout = absl::Seconds(20);
  options.request_bulk = &data[kCalls];
  std::string response;
  absl::Status s =
      CallRaw(**channel, MethodOf("/test.E2E/GateSum"), "", &response, options);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(response, expected[kCalls]);
  EXPECT_TRUE((*channel)->connected());
}

// A max_bulk_size between 2 and 4 GiB (with a pool large enough to allow it) once let a client
// that declared as much negotiate it, and a window request that large then spun the server's
// worker forever in GrantWindows' 32-bit size-class loop. Sizes are now capped at
// internal::kMaxBulkSize in negotiation (and at Start), and the loop is 64-bit.
TEST(BulkLimits, AMaxBulkSizeOver2GiBIsCappedAndCannotHangTheWorker) {
  auto server = testing::SpawnServer(
      testing::kTestServer, {"--max_bulk_size=3221225472", "--bulk_pool_bytes=4294971392"});
  ASSERT_TRUE(server.ok()) << server.status();
  testing::RogueConnection rogue;
  rogue.TamperRequest([](control::ConnectRequest& r) {
    r.mutable_capabilities()->set_max_bulk_size(uint64_t{3} << 30);
  });
  ASSERT_TRUE(rogue.Connect(server->second, testing::kTestToken).ok());
  EXPECT_LE(rogue.negotiated().max_bulk_size(), internal::kMaxBulkSize);
  auto grant = rogue.RequestWindows(3u << 30, 1);
  EXPECT_TRUE(!grant.ok() || grant->empty()) << "a 3 GiB window was granted";
  // The worker (the only one) is not stuck: a channel is served.
  auto channel = ConnectTo(server->second);
  ASSERT_TRUE(channel.ok()) << channel.status();
  EXPECT_EQ(Echo(**channel, "still serving"), "still serving");
}

}  // namespace
}  // namespace swirl
