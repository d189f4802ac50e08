// A tenant's bulk budgets against rpc/testing/test_server in another process, as a tenant with
// its own token would try to take more than its share: bulk memory and memory windows count by
// principal (internal::LimitKey), so connecting from a second source address (IPv6 loopback
// beside IPv4 loopback; across hosts another address) gives it no second share, and another
// tenant's transfers go on. The attacker speaks the data plane by hand (rpc/testing/rogue.h): it
// asks for downloads and never reads or acknowledges them, so each holds its buffer and window.

#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/testing/bulk.h"
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/server_stats.h"
#include "rpc/testing/test_client.h"
#include "rpc/wire.h"
#include "swirl/bulk.h"
#include "swirl/call.h"
#include "swirl/channel.h"

namespace swirl {
namespace {

using testing::MethodOf;

constexpr size_t kMiB = size_t{1} << 20;

// alice and bob are tenants (no auth_token: every client is one of them); the server listens on
// both families, so that alice can come from two addresses. Leases far longer than the test: a
// download alice never acknowledges holds its buffer and window until her connection ends.
std::vector<std::string> TenantServer(std::vector<std::string> more) {
  std::vector<std::string> args = {"--token=", "--principals=alice:alice-token,bob:bob-token",
                                   "--host=[::]", "--window_lease_ms=60000"};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

std::unique_ptr<testing::RogueConnection> AliceFrom(const std::string& host, int port) {
  auto rogue = std::make_unique<testing::RogueConnection>();
  rogue->UseHost(host);
  absl::Status s = rogue->Connect(port, "alice-token");
  EXPECT_TRUE(s.ok()) << "alice from " << host << ": " << s;
  return s.ok() ? std::move(rogue) : nullptr;
}

// Asks for a download of `size` bytes and returns the status the server answered with: OK when
// it exposed the data (which this caller then never reads nor acknowledges).
absl::StatusCode Download(testing::RogueConnection& rogue, size_t size) {
  uint64_t id = 0;
  if (!rogue.Call("/test.E2E/Fill", std::to_string(size), 0, 0, &id).ok()) {
    return absl::StatusCode::kInternal;
  }
  auto response = rogue.Receive(rpc_wire::kResponse);
  if (!response.ok()) return absl::StatusCode::kDeadlineExceeded;
  if (response->header.status != 0) return static_cast<absl::StatusCode>(response->header.status);
  return (response->header.flags & rpc_wire::kFlagBulk) ? absl::StatusCode::kOk
                                                        : absl::StatusCode::kUnknown;
}

absl::StatusOr<std::shared_ptr<Channel>> Bob(int port) {
  ChannelOptions options;
  options.auth_token = "bob-token";
  return Channel::Create(absl::StrCat("127.0.0.1:", port), options);
}

// bob downloads `size` bytes through a window and reads them all (checking the pattern).
void ExpectBobDownloads(Channel& bob, size_t size) {
  auto landing = bob.AllocateBulk(size);
  ASSERT_TRUE(landing.ok()) << landing.status();
  bulk_testing::ExpectFillsInto(bob, "/test.E2E/Fill", *landing, {size});
}

// alice's connections really come from two addresses to the server (per address, each would
// have a share of its own): her own Stats view, which shows her connections only.
void ExpectAliceFromTwoAddresses(int port) {
  ChannelOptions options;
  options.auth_token = "alice-token";
  auto alice = Channel::Create(absl::StrCat("127.0.0.1:", port), options);
  ASSERT_TRUE(alice.ok()) << alice.status();
  // The server lists a connection once its worker has activated it, which may be just after
  // this channel's Connect returned: wait (bounded) for the third.
  auto stats = testing::ServerStatsWhen(
      **alice, [](const StatsReport& s) { return s.connections.size() >= 3; });
  ASSERT_TRUE(stats.ok()) << stats.status();
  std::set<std::string> addresses;
  for (const ConnectionStats& c : stats->connections) {
    addresses.insert(c.peer.substr(0, c.peer.rfind(':')));
  }
  EXPECT_EQ(stats->connections.size(), 3u);  // the two rogue ones and this channel
  EXPECT_EQ(addresses.size(), 2u);
}

// Waits (bounded) until the server has closed `n` (or more) of the connections `before` had
// active.
void AwaitClosed(Channel& observer, const StatsReport& before, uint64_t n) {
  auto now = testing::ServerStatsWhen(observer, [&](const StatsReport& s) {
    return s.server.connections_active + n <= before.server.connections_active;
  });
  ASSERT_TRUE(now.ok()) << "the server never closed them: " << now.status();
}

// alice may hold 40 MiB of bulk memory on the worker. From one address she takes 16 MiB and 16
// MiB; from the other a third 16 MiB is refused (RESOURCE_EXHAUSTED), since her connections
// share one budget wherever they come from; bob downloads 16 MiB meanwhile. Once alice's
// connections end, her budget is hers again.
// A tenant server with `flag`, bob's channel, and alice's two rogue connections, one from each
// address; `before` is the server's view once all three are up.
class TenantBudget : public ::testing::Test {
 protected:
  void Start(const std::string& flag) {
    auto server = testing::SpawnServer(testing::kTestServer, TenantServer({flag}));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::make_unique<testing::ChildProcess>(std::move(server->first));
    port = server->second;
    auto channel = Bob(port);
    ASSERT_TRUE(channel.ok()) << channel.status();
    bob = *channel;
    v4 = AliceFrom("127.0.0.1", port);
    v6 = AliceFrom("[::1]", port);
    ASSERT_TRUE(v4 != nullptr && v6 != nullptr);
    // Before ExpectAliceFromTwoAddresses' channel comes and goes: AwaitClosed then counts the
    // two.
    auto stats = bob->ServerStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    before = *stats;
  }

  std::unique_ptr<testing::ChildProcess> server_;
  int port = 0;
  std::shared_ptr<Channel> bob;
  std::unique_ptr<testing::RogueConnection> v4, v6;
  StatsReport before;
};

TEST_F(TenantBudget, BulkMemoryCountsByPrincipalAcrossAddresses) {
  ASSERT_NO_FATAL_FAILURE(Start(absl::StrCat("--bulk_bytes_per_client=", 40 * kMiB)));
  ASSERT_EQ(Download(*v4, 16 * kMiB), absl::StatusCode::kOk);
  ASSERT_EQ(Download(*v4, 16 * kMiB), absl::StatusCode::kOk);
  // Per address, the IPv6 connection would have 40 MiB of its own.
  EXPECT_EQ(Download(*v6, 16 * kMiB), absl::StatusCode::kResourceExhausted)
      << "alice's connection from a second address got a second share of bulk memory";
  EXPECT_EQ(Download(*v6, 4 * kMiB), absl::StatusCode::kOk) << "within her share, it fits";
  ASSERT_NO_FATAL_FAILURE(ExpectAliceFromTwoAddresses(port));
  ASSERT_NO_FATAL_FAILURE(ExpectBobDownloads(*bob, 16 * kMiB));

  // Gone (the server has closed both), her memory is uncharged: 32 MiB fits again, which it
  // would not beside the 36 MiB they held.
  v4.reset();
  v6.reset();
  ASSERT_NO_FATAL_FAILURE(AwaitClosed(*bob, before, 2));
  auto again = AliceFrom("[::1]", port);
  ASSERT_TRUE(again != nullptr);
  EXPECT_EQ(Download(*again, 16 * kMiB), absl::StatusCode::kOk);
  EXPECT_EQ(Download(*again, 16 * kMiB), absl::StatusCode::kOk);
}

// Memory windows are device objects (65,536 per process on the soft device): one tenant's
// connections together may allocate max_windows_per_client (here 24), however many connections
// and addresses it uses. Small downloads, each holding a window: 16 from one address, and from
// the other only 8 more; bob's download gets a window meanwhile; and the windows come back when
// alice's connections end.
TEST_F(TenantBudget, WindowsCountByPrincipalAcrossAddresses) {
  ASSERT_NO_FATAL_FAILURE(Start("--max_windows_per_client=24"));
  constexpr size_t kSmall = 8192;  // above the eager threshold: a download through a window
  for (int i = 0; i < 16; ++i) ASSERT_EQ(Download(*v4, kSmall), absl::StatusCode::kOk) << i;
  int exposed = 0;
  int refused = 0;
  for (int i = 0; i < 16; ++i) {
    const absl::StatusCode code = Download(*v6, kSmall);
    if (code == absl::StatusCode::kOk) ++exposed;
    if (code == absl::StatusCode::kResourceExhausted) ++refused;
  }
  EXPECT_EQ(exposed, 8) << "alice's second address got more than her principal's windows";
  EXPECT_EQ(refused, 8);
  ASSERT_NO_FATAL_FAILURE(ExpectBobDownloads(*bob, kSmall));
  ASSERT_NO_FATAL_FAILURE(ExpectBobDownloads(*bob, 4 * kMiB));

  ASSERT_NO_FATAL_FAILURE(ExpectAliceFromTwoAddresses(port));
  v4.reset();
  v6.reset();
  ASSERT_NO_FATAL_FAILURE(AwaitClosed(*bob, before, 2));
  auto again = AliceFrom("127.0.0.1", port);
  ASSERT_TRUE(again != nullptr);
  for (int i = 0; i < 24; ++i) {
    ASSERT_EQ(Download(*again, kSmall), absl::StatusCode::kOk)
        << "alice's windows stayed charged after her connections ended (download " << i << ")";
  }
  EXPECT_EQ(Download(*again, kSmall), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace swirl
