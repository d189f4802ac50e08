// Bulk transfers end to end in every mode (server-exposed or mirror, remote invalidation or the
// local fallback), against rpc/testing/test_server in another process: data moves correctly both
// ways and every window is accounted for.

#include <gtest/gtest.h>
#include <signal.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "rpc/testing/bulk.h"
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/server_stats.h"
#include "rpc/testing/test_data.h"
#include "rpc/wire.h"
#include "swirl/channel.h"

namespace swirl {
namespace {

using bulk_testing::ConnectTo;
using bulk_testing::ExpectEchoes;
using bulk_testing::ExpectFillsInto;
using bulk_testing::ExpectHealthy;
using bulk_testing::Id;
using bulk_testing::kServer;
using bulk_testing::Payload;
using bulk_testing::ServerStats;
using bulk_testing::Stats;
using rpc_wire::BulkDescriptor;
using rpc_wire::MessageHeader;
using swirl::testing::Fnv;
using swirl::testing::Pattern;
using swirl::testing::ServerStatsWhen;

struct Mode {
  const char* name;
  BulkMode bulk;
  bool local_only;
};

class BulkModesTest : public ::testing::TestWithParam<Mode> {
 protected:
  static void SetUpTestSuite() {
    auto server = testing::SpawnServer(kServer, {});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = new testing::ChildProcess(std::move(server->first));
    port_ = server->second;
  }
  static void TearDownTestSuite() { delete server_; }

  // A channel to the suite's server in this test's bulk mode.
  static absl::StatusOr<std::shared_ptr<Channel>> ConnectInMode(ChannelOptions options = {}) {
    options.auth_token = "e2e";
    options.bulk_mode = GetParam().bulk;
    if (GetParam().local_only) options.transport.invalidation = InvalidationPolicy::kLocalOnly;
    return Channel::Create(absl::StrCat("127.0.0.1:", port_), options);
  }

  static testing::ChildProcess* server_;
  static int port_;
};
testing::ChildProcess* BulkModesTest::server_ = nullptr;
int BulkModesTest::port_ = 0;

TEST_P(BulkModesTest, LargePayloadsMoveCorrectlyAndEveryWindowIsAccountedFor) {
  const Mode mode = GetParam();
  auto channel = ConnectInMode();
  ASSERT_TRUE(channel.ok()) << channel.status();
  EXPECT_EQ((*channel)->negotiated().invalidation,
            mode.local_only ? InvalidationMode::kLocal : InvalidationMode::kRemote);
  const ServerStats before = Stats(**channel);

  // Large messages (serialized into registered memory) both ways.
  ASSERT_NO_FATAL_FAILURE(
      ExpectEchoes(**channel, "/test.E2E/Echo", {3000, 65536, (1 << 20) + 13}));
  // Zero-copy download into a buffer we chose, and into one the call allocates.
  auto landing = (*channel)->AllocateBulk(1 << 20);
  ASSERT_TRUE(landing.ok());
  ASSERT_NO_FATAL_FAILURE(
      ExpectFillsInto(**channel, "/test.E2E/Fill", *landing, {4096, 500000}));
  for (size_t size : {4096, 500000}) {
    std::string response;
    ClientCall call;
    call.SetMethod(Id("/test.E2E/Fill"));
    std::string request = std::to_string(size);
    call.SetRequestBytes(request);
    call.SetResponseBytes(&response);
    (*channel)->Start(&call);
    ASSERT_TRUE(call.Wait().ok()) << call.status();
    ASSERT_EQ(call.response_bulk().size(), size);
    EXPECT_EQ(call.response_bulk().data()[size - 1], Pattern(size - 1));
  }
  // Zero-copy upload.
  auto upload = (*channel)->AllocateBulk(300000);
  ASSERT_TRUE(upload.ok());
  const std::string data = Payload(300000, 5);
  std::memcpy(upload->data(), data.data(), data.size());
  upload->resize(data.size());
  for (int i = 0; i < 3; ++i) {
    CallOptions call_options;
    call_options.request_bulk = &*upload;
    std::string response;
    ASSERT_TRUE(CallRaw(**channel, Id("/test.E2E/Sum"), "", &response, call_options).ok());
    EXPECT_EQ(response, absl::StrCat(data.size(), ":", Fnv(data)));
  }
  // Both directions in one call, with a small eager message alongside.
  CallOptions both;
  both.request_bulk = &*upload;
  both.response_bulk = &*landing;
  std::string eager;
  ASSERT_TRUE(CallRaw(**channel, Id("/test.E2E/BulkEcho"), "side note", &eager, both).ok());
  EXPECT_EQ(eager, "side note");
  EXPECT_TRUE(landing->view() == data);

  // The bookkeeping: nothing left exposed, each path counted where it belongs.
  const ServerStats after = Stats(**channel);
  const ConnectionStats mine = (*channel)->LocalStats();
  EXPECT_EQ(mine.invalidation_violations, 0u);
  EXPECT_EQ(after.violations, before.violations);
  if (mode.local_only) {
    EXPECT_EQ(after.remote + mine.windows_remote_invalidated, before.remote);
    EXPECT_GT(after.local + mine.windows_locally_invalidated, before.local);
  } else {
    EXPECT_GT(after.remote + mine.windows_remote_invalidated, before.remote);
    EXPECT_EQ(after.local, before.local) << "remote invalidation must not fall back silently";
  }
}

// The client's service for server-to-client calls (test_server's CallBack calls Ping).
class ClientSide : public Service {
 public:
  ClientSide() : Service("test.Client") {
    AddRawMethod("Ping", [](ServerContext&, absl::string_view in, ResponseWriter& out) {
      return out.Append(in) ? absl::OkStatus() : absl::ResourceExhaustedError("too big");
    });
  }
};

TEST_P(BulkModesTest, ServerToClientCallsCarryLargePayloadsBothWays) {
  ClientSide client_side;
  ChannelOptions options;
  options.services = {&client_side};
  auto channel = ConnectInMode(options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  // The server calls us with the payload (bulk, server to client), we answer it (bulk again),
  // and its answer to our call carries it back (bulk, server to client).
  for (size_t size : {3000, 200000}) {
    const std::string request = Payload(size, 3);
    std::string response;
    absl::Status s = CallRaw(**channel, Id("/test.E2E/CallBack"), request, &response, {});
    ASSERT_TRUE(s.ok()) << size << ": " << s;
    EXPECT_TRUE(response == request) << size;
  }
  ExpectHealthy(**channel, 6);
  EXPECT_EQ((*channel)->LocalStats().invalidation_violations, 0u);
}

TEST_P(BulkModesTest, ALargeResponseMessageArrivesWholeWhenAReplyWindowWasOffered) {
  auto channel = ConnectInMode();
  ASSERT_TRUE(channel.ok()) << channel.status();
  // A response buffer is offered (mirror mode exposes it as a reply window), but the response
  // has no attachment: its message, above the eager threshold, must still arrive whole.
  auto landing = (*channel)->AllocateBulk(1 << 16);
  ASSERT_TRUE(landing.ok());
  CallOptions call_options;
  call_options.response_bulk = &*landing;
  const std::string request = Payload(5000, 9);
  std::string response;
  absl::Status s = CallRaw(**channel, Id("/test.E2E/Echo"), request, &response, call_options);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(response == request) << response.size() << " bytes came back";
  ExpectHealthy(**channel, 4);
}

TEST_P(BulkModesTest, MoreUploadsInFlightThanWindowCreditsWaitInsteadOfFailing) {
  auto channel = ConnectInMode();
  ASSERT_TRUE(channel.ok()) << channel.status();
  // Three times the window credits of one size class, all at once: those beyond the credits
  // wait for the windows the server grants as the first ones arrive.
  constexpr int kCalls = 24;
  std::vector<BulkBuffer> buffers;
  std::vector<std::string> expected(kCalls), responses(kCalls);
  std::vector<ClientCall> calls(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    auto b = (*channel)->AllocateBulk(65536);
    ASSERT_TRUE(b.ok()) << b.status();
    const std::string data = Payload(65536, i);
    std::memcpy(b->data(), data.data(), data.size());
    b->resize(data.size());
    expected[i] = absl::StrCat(data.size(), ":", Fnv(data));
    buffers.push_back(std::move(*b));
  }
  for (int i = 0; i < kCalls; ++i) {
    CallOptions call_options;
    call_options.request_bulk = &buffers[i];
    calls[i].SetMethod(Id("/test.E2E/Sum"));
    calls[i].SetRequestBytes("");
    calls[i].SetResponseBytes(&responses[i]);
    calls[i].SetOptions(call_options);
    (*channel)->Start(&calls[i]);
  }
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_TRUE(calls[i].Wait().ok()) << i << ": " << calls[i].status();
    EXPECT_EQ(responses[i], expected[i]) << i;
  }
}

TEST_P(BulkModesTest, PoolHandlersSendLargeMessagesAndAttachments) {
  auto channel = ConnectInMode();
  ASSERT_TRUE(channel.ok()) << channel.status();
  ASSERT_NO_FATAL_FAILURE(
      ExpectEchoes(**channel, "/test.E2E/PoolEcho", {100, 3000, 65536, (1 << 20) + 13}));
  auto landing = (*channel)->AllocateBulk(1 << 20);
  ASSERT_TRUE(landing.ok());
  ASSERT_NO_FATAL_FAILURE(
      ExpectFillsInto(**channel, "/test.E2E/PoolFill", *landing, {4096, 500000}));
  // An odd size makes the handler answer a 10000-byte message beside its attachment.
  std::string response;
  absl::Status s = CallRaw(**channel, Id("/test.E2E/PoolFill"), "4097", &response, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  ExpectHealthy(**channel, 7);
}

TEST_P(BulkModesTest, AnAttachmentNeedsAnEagerMessage) {
  auto channel = ConnectInMode();
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto upload = (*channel)->AllocateBulk(8192);
  ASSERT_TRUE(upload.ok());
  upload->resize(8192);
  CallOptions call_options;
  call_options.request_bulk = &*upload;
  std::string response;
  // One descriptor per message: a request message above the eager threshold cannot travel
  // next to an attachment, and the caller is told so instead of losing either.
  absl::Status s = CallRaw(**channel, Id("/test.E2E/Sum"), std::string(10000, 'm'), &response,
                           call_options);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  ExpectHealthy(**channel, 5);
}

INSTANTIATE_TEST_SUITE_P(
    AllModes, BulkModesTest,
    ::testing::Values(Mode{"ServerExposesRemote", BulkMode::kServerExposes, false},
                      Mode{"ServerExposesLocalFallback", BulkMode::kServerExposes, true},
                      Mode{"MirrorRemote", BulkMode::kMirror, false},
                      Mode{"MirrorLocalFallback", BulkMode::kMirror, true}),
    [](const ::testing::TestParamInfo<Mode>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace swirl
