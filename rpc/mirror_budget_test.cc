// Mirror mode (the client exposes, the server RDMA READs its requests) against a client that
// stops answering mid-READ, with rpc/testing/test_server in another process:
//   * the server's buffers for those READs, and for replies it writes into the client's windows,
//     are charged to the connection's mirror budget (ServerOptions::mirror_bytes_per_connection,
//     mirror_reads_per_connection) and its client's: one client cannot take the pool with a
//     few large requests, and other clients' bulk calls go on;
//   * on a live link, a READ the client never answers fails at the soft device's transport
//     timer (ACK timeout x (retry_cnt + 1), as a NIC's would), long before the keepalive, and
//     the server fails that connection and frees what it held.
// The rogue client stops answering by an injected fault on its own QP (soft::InjectFault, noack:
// its responder executes nothing more, its own sends still go out), which arms this test
// process; hence a binary of its own.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/testing/bulk.h"
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/server_stats.h"
#include "rpc/testing/test_data.h"
#include "rpc/wire.h"
#include "swirl/channel.h"
#include "transport/soft/soft_device.h"

namespace swirl {
namespace {

using bulk_testing::ConnectTo;
using bulk_testing::Id;
using bulk_testing::kServer;
using bulk_testing::Payload;
using rpc_wire::BulkDescriptor;
using swirl::testing::Fnv;
using swirl::testing::ServerStatsWhen;

constexpr uint32_t kMiB = 1 << 20;

class MirrorTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> flags) {
    auto server = testing::SpawnServer(kServer, std::move(flags));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::make_unique<testing::ChildProcess>(std::move(server->first));
    port_ = server->second;
    // The good client is in mirror mode too: it holds no grants, so that once nothing is under
    // way the server's bulk budgets are back to zero, which the tests check.
    ChannelOptions options;
    options.bulk_mode = BulkMode::kMirror;
    auto good = ConnectTo(port_, options);
    ASSERT_TRUE(good.ok()) << good.status();
    good_ = *good;
  }

  // A mirror-mode upload of `size` bytes by the good client; checks the server summed it all.
  void ExpectSum(size_t size, int seed) {
    auto data = good_->AllocateBulk(size);
    ASSERT_TRUE(data.ok()) << data.status();
    const std::string payload = Payload(size, seed);
    std::memcpy(data->data(), payload.data(), size);
    data->resize(size);
    CallOptions options;
    options.request_bulk = &*data;
    options.timeout = absl::Seconds(20);
    std::string sum;
    const absl::Status s = CallRaw(*good_, Id("/test.E2E/Sum"), "", &sum, options);
    ASSERT_TRUE(s.ok()) << size << ": " << s;
    EXPECT_EQ(sum, absl::StrCat(size, ":", Fnv(payload)));
  }

  // A reply written into the good client's reply window (the server holds its buffer while
  // the WRITE runs): BulkEcho's attachment comes back whole.
  void ExpectBulkEcho(size_t size, int seed) {
    auto data = good_->AllocateBulk(size);
    auto landing = good_->AllocateBulk(size);
    ASSERT_TRUE(data.ok() && landing.ok());
    const std::string payload = Payload(size, seed);
    std::memcpy(data->data(), payload.data(), size);
    data->resize(size);
    CallOptions options;
    options.request_bulk = &*data;
    options.response_bulk = &*landing;
    options.timeout = absl::Seconds(20);
    std::string eager;
    const absl::Status s = CallRaw(*good_, Id("/test.E2E/BulkEcho"), "e", &eager, options);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(landing->size(), size);
    EXPECT_TRUE(landing->view() == payload) << "the echoed attachment came back wrong";
  }

  // The rogue, connected in mirror mode, with `size` bytes exposed through a window of its QP
  // and its QP then answering nothing (its requests still go out).
  BulkDescriptor SilentMirrorClient(testing::RogueConnection& rogue, uint32_t size) {
    const absl::Status connected = rogue.Connect(port_, "e2e", control::BULK_MIRROR);
    EXPECT_TRUE(connected.ok()) << connected;
    if (!connected.ok()) return {};
    EXPECT_GE(rogue.negotiated().max_bulk_size(), size);
    const BulkDescriptor d = rogue.ExposeWindow(Payload(size, 7), IBV_ACCESS_REMOTE_READ);
    EXPECT_NE(d.rkey, 0u);
    soft::FaultSpec silent;
    silent.action = soft::FaultSpec::Action::kNoAck;
    const absl::Status injected = soft::InjectFault(rogue.qp(), silent);
    EXPECT_TRUE(injected.ok()) << injected;
    return d;
  }

  // Sends a mirror-mode Sum naming `d` (the server READs it, or refuses the request).
  static void MirrorRequest(testing::RogueConnection& rogue, const BulkDescriptor& d) {
    const std::string payload(reinterpret_cast<const char*>(&d), sizeof(d));
    const absl::Status sent = rogue.Call("/test.E2E/Sum", payload, rpc_wire::kFlagBulk);
    ASSERT_TRUE(sent.ok()) << sent;
  }

  // Responses the server sent the rogue, which has made no call it could answer but those
  // refused before their READ (a request is counted received only once it is dispatched, and
  // the good client has made none yet): the most any connection was sent.
  static uint64_t RefusedByTheServer(const StatsReport& s) {
    uint64_t most = 0;
    for (const ConnectionStats& c : s.connections) most = std::max(most, c.responses_sent);
    return most;
  }

  std::unique_ptr<testing::ChildProcess> server_;
  int port_ = 0;
  std::shared_ptr<Channel> good_;
};

// A 64 MiB pool, requests of up to 8 MiB, 16 MiB of mirror-mode buffers per connection. The
// keepalive (60 s) and the lease never act within the test: the rogue's READs stay under way.
class MirrorBudgetTest : public MirrorTest {
 protected:
  void SetUp() override {
    Start({absl::StrCat("--bulk_pool_bytes=", 64 * kMiB),
           absl::StrCat("--max_bulk_size=", 8 * kMiB), absl::StrCat("--mirror_bytes=", 16 * kMiB),
           "--keepalive_ms=60000", "--window_lease_ms=60000"});
  }
};

TEST_F(MirrorBudgetTest, ATenantInMirrorModeCannotTakeThePoolWithLargeRequests) {
  auto before = good_->ServerStats();
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(before->server.bulk_bytes_in_use, 0u);
  ASSERT_EQ(before->server.bulk_bytes_charged, 0u);
  auto rogue = std::make_unique<testing::RogueConnection>();
  const BulkDescriptor d = SilentMirrorClient(*rogue, 8 * kMiB);
  ASSERT_FALSE(HasFatalFailure());
  // Twenty requests of 8 MiB: the whole pool twice over, if the server READ them all at once.
  constexpr int kRequests = 20;
  for (int i = 0; i < kRequests; ++i) ASSERT_NO_FATAL_FAILURE(MirrorRequest(*rogue, d));
  // It READs two (the connection's 16 MiB), which the rogue never answers; 16 more wait for
  // them (mirror_reads_per_connection, holding no pool memory), and the last two are refused
  // at once with a response (RESOURCE_EXHAUSTED; the rogue, answering nothing, never takes it).
  auto held = ServerStatsWhen(*good_, [&](const StatsReport& s) {
    return RefusedByTheServer(s) >= 2 && s.server.bulk_bytes_in_use >= 16 * kMiB;
  });
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(RefusedByTheServer(*held), 2u) << "the requests beyond the budget and the wait";
  EXPECT_EQ(held->server.bulk_bytes_in_use, 16 * kMiB) << "READ buffers beyond the budget";
  EXPECT_EQ(held->server.bulk_bytes_charged, 16 * kMiB);
  // Another client's bulk calls go on, through the pool the rogue did not get: uploads the
  // server READs, and replies it writes into the client's window.
  ASSERT_NO_FATAL_FAILURE(ExpectSum(8 * kMiB, 1));
  ASSERT_NO_FATAL_FAILURE(ExpectSum(100000, 2));
  ASSERT_NO_FATAL_FAILURE(ExpectBulkEcho(4 * kMiB, 3));
  // The rogue gone (its QP destroyed: the server's READs fail, and so does its connection),
  // nothing is held or charged any more.
  rogue.reset();
  auto after = ServerStatsWhen(*good_, [&](const StatsReport& s) {
    return s.server.connections_active == before->server.connections_active &&
           s.server.bulk_bytes_in_use == 0 && s.server.bulk_bytes_charged == 0;
  });
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->server.connections_active, before->server.connections_active);
  EXPECT_EQ(after->server.bulk_bytes_in_use, 0u);
  EXPECT_EQ(after->server.bulk_bytes_charged, 0u);
  ASSERT_NO_FATAL_FAILURE(ExpectSum(8 * kMiB, 4));
}

// The count cap: past mirror_reads_per_connection READs under way (here 3, of 64 KiB each, far
// below the bytes), requests wait for one of them to complete (3 at most), and beyond that are
// refused before anything is read. A client that answers its READs sees its calls wait, not
// fail.
class MirrorReadCountTest : public MirrorTest {
 protected:
  void SetUp() override { Start({"--mirror_reads=3", "--keepalive_ms=60000"}); }
};

TEST_F(MirrorReadCountTest, ReadsBeyondTheCountAreRefused) {
  auto rogue = std::make_unique<testing::RogueConnection>();
  const BulkDescriptor d = SilentMirrorClient(*rogue, 65536);
  ASSERT_FALSE(HasFatalFailure());
  constexpr int kRequests = 10;
  for (int i = 0; i < kRequests; ++i) ASSERT_NO_FATAL_FAILURE(MirrorRequest(*rogue, d));
  auto held = ServerStatsWhen(*good_, [&](const StatsReport& s) {
    return RefusedByTheServer(s) >= kRequests - 6 && s.server.bulk_bytes_in_use >= 3u * 65536;
  });
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(RefusedByTheServer(*held), kRequests - 6u) << "3 READ and 3 waiting, the rest not";
  EXPECT_EQ(held->server.bulk_bytes_in_use, 3u * 65536);
  EXPECT_EQ(held->server.bulk_bytes_charged, 3u * 65536);
  // The good client starts 6 uploads at once: beyond its 3 READs 3 wait, and all succeed.
  constexpr int kCalls = 6;
  std::vector<BulkBuffer> buffers;
  std::vector<std::string> expected(kCalls), sums(kCalls);
  std::vector<ClientCall> calls(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    auto b = good_->AllocateBulk(65536);
    ASSERT_TRUE(b.ok()) << b.status();
    const std::string data = Payload(65536, 40 + i);
    std::memcpy(b->data(), data.data(), data.size());
    b->resize(data.size());
    expected[i] = absl::StrCat(data.size(), ":", Fnv(data));
    buffers.push_back(std::move(*b));
  }
  for (int i = 0; i < kCalls; ++i) {
    CallOptions options;
    options.request_bulk = &buffers[i];
    options.timeout = absl::Seconds(20);
    calls[i].SetMethod(Id("/test.E2E/Sum"));
    calls[i].SetRequestBytes("");
    calls[i].SetResponseBytes(&sums[i]);
    calls[i].SetOptions(options);
    good_->Start(&calls[i]);
  }
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_TRUE(calls[i].Wait().ok()) << i << ": " << calls[i].status();
    EXPECT_EQ(sums[i], expected[i]) << i;
  }
}

// The server's soft device is not armed (no --soft_faults): its QPs run RC's transport timer
// as every QP does (a request its peer does not answer fails at ACK timeout x (retry_cnt + 1),
// about 4.3 s for swirl's QPs by default), and a keepalive of 60 s never acts within the test.
class MirrorReadTimeoutTest : public MirrorTest {
 protected:
  void SetUp() override { Start({"--keepalive_ms=60000"}); }
};

TEST_F(MirrorReadTimeoutTest, AClientThatStopsAnsweringMidReadIsCutOffAtTheTransportTimeout) {
  auto before = good_->ServerStats();
  ASSERT_TRUE(before.ok()) << before.status();
  testing::RogueConnection rogue;
  const BulkDescriptor d = SilentMirrorClient(rogue, 8 * kMiB);
  ASSERT_FALSE(HasFatalFailure());
  auto connected = good_->ServerStats();
  ASSERT_TRUE(connected.ok()) << connected.status();
  ASSERT_EQ(connected->server.connections_active, before->server.connections_active + 1);
  ASSERT_NO_FATAL_FAILURE(MirrorRequest(rogue, d));
  // The rogue's QP is alive (nothing tells the server otherwise) and never answers the READ:
  // the server's QP gives up on it at its transport timer, and the server fails the connection
  // and gives back the READ's buffer, within 10 s (ServerStatsWhen's bound), where the
  // keepalive would take over a minute.
  auto after = ServerStatsWhen(*good_, [&](const StatsReport& s) {
    return s.server.connections_failed > before->server.connections_failed &&
           s.server.connections_active == before->server.connections_active &&
           s.server.bulk_bytes_in_use == 0 && s.server.bulk_bytes_charged == 0;
  });
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->server.connections_failed, before->server.connections_failed + 1)
      << "the silent client's connection did not fail";
  EXPECT_EQ(after->server.connections_active, before->server.connections_active);
  EXPECT_EQ(after->server.bulk_bytes_in_use, 0u) << "the READ's buffer was kept";
  EXPECT_EQ(after->server.bulk_bytes_charged, 0u);
  // Only that connection: the good client's calls go on.
  ASSERT_NO_FATAL_FAILURE(ExpectSum(1 * kMiB, 6));
}

}  // namespace
}  // namespace swirl
