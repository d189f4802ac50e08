// Bulk transfers end to end, against rpc/testing/test_server in another process: every mode
// moves data correctly and is counted; and the security properties of per-request windows hold
// against a client that misbehaves on purpose (rpc/testing/rogue.h).

#include <gtest/gtest.h>
#include <signal.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/server_stats.h"
#include "rpc/testing/test_data.h"
#include "rpc/wire.h"
#include "swirl/channel.h"

namespace swirl {
namespace {

constexpr char kServer[] = "rpc/testing/test_server";
using rpc_wire::BulkDescriptor;
using rpc_wire::MessageHeader;

uint32_t Id(const char* m) { return rpc_wire::MethodId(m); }

using swirl::testing::Fnv;
using swirl::testing::Pattern;
using swirl::testing::ServerStatsWhen;

std::string Payload(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 7 + seed * 13) & 0xff);
  return s;
}

struct ServerStats {
  uint64_t exposed, remote, local, lease_expired, violations;
};

ServerStats Stats(Channel& channel) {
  std::string out;
  EXPECT_TRUE(CallRaw(channel, Id("/test.E2E/Stats"), "", &out, {}).ok());
  std::vector<std::string> parts = absl::StrSplit(out, ' ');
  ServerStats s{};
  if (parts.size() == 5) {
    EXPECT_TRUE(absl::SimpleAtoi(parts[0], &s.exposed) && absl::SimpleAtoi(parts[1], &s.remote) &&
                absl::SimpleAtoi(parts[2], &s.local) &&
                absl::SimpleAtoi(parts[3], &s.lease_expired) &&
                absl::SimpleAtoi(parts[4], &s.violations));
  }
  return s;
}

// A verified bulk round trip: the check that "the server keeps serving its other clients and
// loses no data".
void ExpectHealthy(Channel& channel, int seed) {
  std::string request = Payload(100000 + seed, seed);
  std::string response;
  absl::Status s = CallRaw(channel, Id("/test.E2E/Echo"), request, &response, {});
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(response == request) << "echo of " << request.size() << " bytes came back wrong";
}

// Each size's payload comes back whole from `method` (an echo).
void ExpectEchoes(Channel& channel, const char* method, std::initializer_list<size_t> sizes) {
  for (size_t size : sizes) {
    std::string request = Payload(size, static_cast<int>(size));
    std::string response;
    absl::Status s = CallRaw(channel, Id(method), request, &response, {});
    ASSERT_TRUE(s.ok()) << size << ": " << s;
    ASSERT_TRUE(response == request) << size;
  }
}

// `method` (a Fill) lands each size's pattern in `landing`, zero-copy, beside "filled".
void ExpectFillsInto(Channel& channel, const char* method, BulkBuffer& landing,
                     std::initializer_list<size_t> sizes) {
  for (size_t size : sizes) {
    CallOptions call_options;
    call_options.response_bulk = &landing;
    std::string response;
    absl::Status s =
        CallRaw(channel, Id(method), std::to_string(size), &response, call_options);
    ASSERT_TRUE(s.ok()) << size << ": " << s;
    EXPECT_EQ(response, "filled");
    ASSERT_EQ(landing.size(), size);
    for (size_t i = 0; i < size; i += 997) ASSERT_EQ(landing.data()[i], Pattern(i)) << i;
  }
}

// A channel to the test server on `port`, with its token.
absl::StatusOr<std::shared_ptr<Channel>> ConnectTo(int port, ChannelOptions options = {}) {
  options.auth_token = "e2e";
  return Channel::Create(absl::StrCat("127.0.0.1:", port), options);
}

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

TEST(BulkNegotiation, FallbackIsRefusedWhenRemoteInvalidationIsRequired) {
  auto server = testing::SpawnServer(kServer, {"--no_local_fallback"});
  ASSERT_TRUE(server.ok()) << server.status();
  ChannelOptions options;
  options.auth_token = "e2e";
  options.transport.invalidation = InvalidationPolicy::kLocalOnly;
  auto channel = Channel::Create(absl::StrCat("127.0.0.1:", server->second), options);
  ASSERT_FALSE(channel.ok());
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(channel.status().message().find("peer's device"), absl::string_view::npos)
      << channel.status();
}

TEST(BulkNegotiation, FallbackInForceIsLoggedAsAWarning) {
  auto server = testing::SpawnServer(kServer, {});
  ASSERT_TRUE(server.ok()) << server.status();
  ChannelOptions options;
  options.auth_token = "e2e";
  options.transport.invalidation = InvalidationPolicy::kLocalOnly;
  ::testing::internal::CaptureStderr();
  auto channel = Channel::Create(absl::StrCat("127.0.0.1:", server->second), options);
  const std::string logged = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(channel.ok()) << channel.status();
  EXPECT_EQ((*channel)->negotiated().invalidation, InvalidationMode::kLocal);
  const size_t at = logged.find("remote invalidation unavailable");
  ASSERT_NE(at, std::string::npos) << logged;
  const size_t line = logged.rfind('\n', at);
  EXPECT_EQ(logged[line == std::string::npos ? 0 : line + 1], 'W') << "not a warning: " << logged;
}

// The static-rkey benchmark mode (one long-lived rkey for a whole pool, no windows) is gone: a
// client that still asks for it (its old enum value, 2) is refused as asking for an unknown
// mode, never served without windows, and the server serves everyone else as before.
TEST(BulkNegotiation, TheRetiredStaticRkeyModeIsRefused) {
  auto server = testing::SpawnServer(kServer, {});
  ASSERT_TRUE(server.ok()) << server.status();
  testing::ChildProcess child = std::move(server->first);
  testing::RogueConnection rogue;
  const absl::Status refused = rogue.Connect(server->second, "e2e", static_cast<control::BulkMode>(2));
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("unknown bulk mode"), absl::string_view::npos) << refused;
  ChannelOptions options;
  options.auth_token = "e2e";
  auto good = Channel::Create(absl::StrCat("127.0.0.1:", server->second), options);
  ASSERT_TRUE(good.ok()) << good.status();
  ExpectHealthy(**good, 13);
}

// ---- Security: what a misbehaving client can and cannot do ------------------------------------

// Downloads a peer leaves unacknowledged hold pool memory every connection of the worker shares:
// past download_bytes_per_connection the server answers RESOURCE_EXHAUSTED instead of exposing
// more, and an acknowledgement makes room again.
TEST(BulkMirror, GivingUpWhileTheServerStillWritesTheReplyKeepsTheConnection) {
  // Mirror mode: the reply window over `landing` is the server's to WRITE until it answers.
  // A deadline passing meanwhile must not revoke it under the server (which would fail the
  // server's WRITE, and with it the connection): the call ends once the server is done.
  auto server = testing::SpawnServer(kServer, {});
  ASSERT_TRUE(server.ok()) << server.status();
  ChannelOptions options;
  options.bulk_mode = BulkMode::kMirror;
  auto channel = ConnectTo(server->second, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto landing = (*channel)->AllocateBulk(100000);
  ASSERT_TRUE(landing.ok()) << landing.status();
  // Bulk data with the request makes it a mirror call, with a reply window over `landing`.
  auto attachment = (*channel)->AllocateBulk(8192);
  ASSERT_TRUE(attachment.ok()) << attachment.status();
  attachment->resize(8192);
  CallOptions call_options;
  call_options.timeout = absl::Milliseconds(50);
  call_options.request_bulk = &*attachment;
  call_options.response_bulk = &*landing;
  std::string response;
  absl::Status s =
      CallRaw(**channel, Id("/test.E2E/SlowFill"), "400 100000", &response, call_options);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE((*channel)->connected());
  EXPECT_EQ((*channel)->LocalStats().windows_remote_invalidated, 2u)
      << "both windows ended by the server's SEND_WITH_INV, none revoked under it";
  // A call that outlasts the first one's handler: had the server's WRITE failed, the
  // connection would fail under it.
  CallOptions again;
  again.response_bulk = &*landing;
  s = CallRaw(**channel, Id("/test.E2E/SlowFill"), "600 100000", &response, again);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(response, "filled");
  ExpectHealthy(**channel, 1);
  ExpectFillsInto(**channel, "/test.E2E/Fill", *landing, {100000});
  EXPECT_EQ(Stats(**channel).violations, 0u);
}

TEST(BulkWindows, UploadGrantsOfEverySizeLeaveWindowsForDownloads) {
  // One upload of each size class collects window_credits (8) unused grants per class; eight
  // downloads at once must still each get a window. Caller-driven: nothing reads (and so
  // releases) a download until all eight have been answered.
  auto server = testing::SpawnServer(kServer, {});
  ASSERT_TRUE(server.ok()) << server.status();
  ChannelOptions options;
  options.driver = ChannelOptions::Driver::kCaller;
  auto channel = ConnectTo(server->second, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  for (size_t size = 4096; size <= (1u << 20); size *= 2) {
    auto data = (*channel)->AllocateBulk(size);
    ASSERT_TRUE(data.ok()) << data.status();
    data->resize(size);
    CallOptions call_options;
    call_options.request_bulk = &*data;
    std::string response;
    absl::Status s = CallRaw(**channel, Id("/test.E2E/Sum"), "", &response, call_options);
    ASSERT_TRUE(s.ok()) << size << ": " << s;
  }
  constexpr int kDownloads = 8;
  std::vector<ClientCall> calls(kDownloads);
  std::vector<BulkBuffer> landings(kDownloads);
  std::vector<std::string> responses(kDownloads);
  const std::string request = "100000";
  for (int i = 0; i < kDownloads; ++i) {
    auto b = (*channel)->AllocateBulk(100000);
    ASSERT_TRUE(b.ok()) << b.status();
    landings[i] = std::move(*b);
    CallOptions call_options;
    call_options.response_bulk = &landings[i];
    calls[i].SetMethod(Id("/test.E2E/Fill"));
    calls[i].SetRequestBytes(request);
    calls[i].SetResponseBytes(&responses[i]);
    calls[i].SetOptions(call_options);
    (*channel)->Start(&calls[i]);
  }
  for (int i = 0; i < kDownloads; ++i) {
    ASSERT_TRUE(calls[i].Wait().ok()) << i << ": " << calls[i].status();
    EXPECT_EQ(responses[i], "filled");
    ASSERT_EQ(landings[i].size(), 100000u);
    EXPECT_EQ(landings[i].data()[4242], testing::Pattern(4242));
  }
}

TEST(BulkWindows, AMaximumBulkSizeThatIsNoPowerOfTwo) {
  // 10 MiB: a 9 MiB upload falls in the 16 MiB size class, but its grant may not exceed 10 MiB.
  auto server = testing::SpawnServer(kServer, {"--max_bulk_size=10485760"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = ConnectTo(server->second);
  ASSERT_TRUE(channel.ok()) << channel.status();
  EXPECT_EQ((*channel)->negotiated().max_bulk_size, 10485760u);
  constexpr size_t kSize = 9 << 20;
  auto data = (*channel)->AllocateBulk(kSize);
  ASSERT_TRUE(data.ok()) << data.status();
  data->resize(kSize);
  for (size_t i = 0; i < kSize; ++i) data->data()[i] = static_cast<char>(i * 31);
  CallOptions call_options;
  call_options.request_bulk = &*data;
  std::string response;
  absl::Status s = CallRaw(**channel, Id("/test.E2E/Sum"), "", &response, call_options);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(response, absl::StrCat(kSize, ":", Fnv(data->view())));
  EXPECT_TRUE((*channel)->connected());
}

TEST(BulkUpload, AGivenUpUploadReturnsItsBufferOnlyOnceTheWriteIsDone) {
  // A 16 MiB upload whose deadline passes while its RDMA WRITE is still reading the buffer:
  // the call may complete only once the WRITE is done, so that overwriting the buffer right
  // after cannot change what the server receives. The WRITE is made slow on purpose, whatever
  // the machine's speed: the server process is stopped (SIGSTOP) while the call runs, and on
  // the soft device the responder that places a WRITE runs in the server's process, so the
  // WRITE cannot finish before SIGCONT.
  auto server = testing::SpawnServer(kServer, {});
  ASSERT_TRUE(server.ok()) << server.status();
  ChannelOptions options;
  options.driver = ChannelOptions::Driver::kCaller;
  auto channel = ConnectTo(server->second, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  constexpr size_t kSize = 16 << 20;
  auto data = (*channel)->AllocateBulk(kSize);
  ASSERT_TRUE(data.ok()) << data.status();
  data->resize(kSize);
  // One upload of the size first, with no deadline: the server's grants for the size class
  // are then in hand, so the one below leaves at once instead of waiting for a grant.
  std::memset(data->data(), 0x5a, kSize);
  CallOptions call_options;
  call_options.request_bulk = &*data;
  std::string response;
  absl::Status s = CallRaw(**channel, Id("/test.E2E/Sum"), "", &response, call_options);
  ASSERT_TRUE(s.ok()) << s;
  for (size_t i = 0; i < kSize; ++i) data->data()[i] = static_cast<char>(i * 7 + 1);
  const std::string expected = absl::StrCat(kSize, ":", Fnv(data->view()));

  ASSERT_TRUE(server->first.StopAndWait().ok());
  call_options.timeout = absl::Milliseconds(20);
  ClientCall call;
  call.SetMethod(Id("/test.E2E/Sum"));
  call.SetRequestBytes("");
  call.SetResponseBytes(&response);
  call.SetOptions(call_options);
  (*channel)->Start(&call);
  // Well past the deadline, with the WRITE held up: the call must still be running.
  const absl::Time until = absl::Now() + absl::Milliseconds(300);
  while (absl::Now() < until && !call.done()) (*channel)->Poll();
  const bool done_while_stopped = call.done();
  server->first.Signal(SIGCONT);
  EXPECT_FALSE(done_while_stopped) << "the call completed while its WRITE could not have";
  EXPECT_EQ(call.Wait().code(), absl::StatusCode::kDeadlineExceeded) << call.status();
  std::memset(data->data(), 0, kSize);  // the caller's buffer is its own again
  // The server saw the whole upload as it was when the call started.
  std::string last;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (last != expected && absl::Now() < deadline) {
    ASSERT_TRUE(CallRaw(**channel, Id("/test.E2E/LastSum"), "", &last, {}).ok());
    if (last != expected) absl::SleepFor(absl::Milliseconds(5));  // leave the server the CPU
  }
  EXPECT_EQ(last, expected);
}

TEST(BulkLimits, UnacknowledgedDownloadsAreCappedPerConnection) {
  auto server = testing::SpawnServer(kServer, {"--download_bytes=262144"});
  ASSERT_TRUE(server.ok()) << server.status();
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(server->second, "e2e").ok());
  auto download = [&](uint64_t* id) -> absl::StatusOr<testing::Received> {
    if (auto s = rogue.Call("/test.E2E/Fill", "65536", 0, 0, id); !s.ok()) return s;
    return rogue.Receive(rpc_wire::kResponse);
  };
  std::vector<std::pair<uint64_t, BulkDescriptor>> held;
  for (int i = 0; i < 4; ++i) {  // 4 x 64 KiB: exactly the budget
    uint64_t id;
    auto r = download(&id);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->header.status, 0u) << i << ": " << r->payload;
    ASSERT_TRUE(r->header.flags & rpc_wire::kFlagBulk);
    BulkDescriptor d;
    std::memcpy(&d, r->payload.data(), sizeof(d));
    held.push_back({id, d});
  }
  uint64_t id;
  auto refused = download(&id);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->header.status, static_cast<uint32_t>(absl::StatusCode::kResourceExhausted))
      << refused->payload;
  EXPECT_FALSE(refused->header.flags & rpc_wire::kFlagBulk);
  // Reading and acknowledging one makes room for one more.
  std::string data;
  auto st = rogue.Read(held[0].second.addr, held[0].second.rkey, held[0].second.length, &data);
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(*st, IBV_WC_SUCCESS);
  MessageHeader ack{.version = rpc_wire::kProtocolVersion,
                    .type = rpc_wire::kBulkAck,
                    .request_id = held[0].first,
                    .aux = held[0].second.rkey};
  ASSERT_TRUE(rogue.Send(ack, {}, held[0].second.rkey).ok());
  // One QP, in order: the server has the acknowledgement before the next call.
  auto again = download(&id);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->header.status, 0u) << again->payload;
  // Other clients never noticed.
  ChannelOptions options;
  options.auth_token = "e2e";
  auto good = Channel::Create(absl::StrCat("127.0.0.1:", server->second), options);
  ASSERT_TRUE(good.ok()) << good.status();
  ExpectHealthy(**good, 13);
}



class BulkSecurityTest : public ::testing::Test {
 protected:
  virtual std::vector<std::string> ServerFlags() const { return {"--window_lease_ms=400"}; }

  void SetUp() override {
    auto server = testing::SpawnServer(kServer, ServerFlags());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::make_unique<testing::ChildProcess>(std::move(server->first));
    port_ = server->second;
    ChannelOptions options;
    options.auth_token = "e2e";
    auto good = Channel::Create(absl::StrCat("127.0.0.1:", port_), options);
    ASSERT_TRUE(good.ok()) << good.status();
    good_ = *good;
    ExpectHealthy(*good_, 1);
  }

  // Asks for a download of `size` bytes and returns the server's descriptor.
  BulkDescriptor Download(testing::RogueConnection& rogue, size_t size, uint64_t* request_id) {
    auto d = rogue.CallForDownload("/test.E2E/Fill", std::to_string(size), request_id);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return {};
    EXPECT_EQ(d->length, size);
    return *d;
  }

  // A bulk acknowledgement naming the window `named_rkey` (default: the one invalidated) and
  // sent as SEND_WITH_INV of `rkey`.
  absl::Status Ack(testing::RogueConnection& rogue, uint64_t request_id, uint32_t rkey,
                   std::optional<uint32_t> named_rkey = std::nullopt) {
    MessageHeader h{.version = rpc_wire::kProtocolVersion,
                    .type = rpc_wire::kBulkAck,
                    .request_id = request_id,
                    .aux = named_rkey.value_or(rkey)};
    return rogue.Send(h, {}, rkey);
  }

  // Upload windows granted to this rogue.
  std::vector<BulkDescriptor> Grants(testing::RogueConnection& rogue, uint32_t size,
                                     uint32_t count = 2) {
    auto grants = rogue.RequestWindows(size, count);
    EXPECT_TRUE(grants.ok()) << grants.status();
    return grants.ok() ? *std::move(grants) : std::vector<BulkDescriptor>();
  }

  void TearDown() override {
    if (good_ != nullptr) ExpectHealthy(*good_, 99);
  }

  std::unique_ptr<testing::ChildProcess> server_;
  int port_ = 0;
  std::shared_ptr<Channel> good_;
};

TEST_F(BulkSecurityTest, DownloadKeyIsDeadAfterTheAcknowledgement) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  auto before = good_->ServerStats();
  ASSERT_TRUE(before.ok()) << before.status();
  uint64_t id;
  const BulkDescriptor d = Download(rogue, 65536, &id);
  std::string data;
  auto st = rogue.Read(d.addr, d.rkey, d.length, &data);
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(*st, IBV_WC_SUCCESS);
  for (size_t i = 0; i < data.size(); i += 4093) ASSERT_EQ(data[i], Pattern(i));
  ASSERT_TRUE(Ack(rogue, id, d.rkey).ok());
  // The same key, after the SEND_WITH_INV that carried it: refused by the NIC.
  st = rogue.Read(d.addr, d.rkey, d.length, &data);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR);
  // The server's QP that refused it reports that on the device's asynchronous events, which the
  // server counts.
  auto now = ServerStatsWhen(*good_, [&](const StatsReport& st) {
    return st.server.async_qp_errors != before->server.async_qp_errors;
  });
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->server.async_qp_errors, before->server.async_qp_errors + 1);
  EXPECT_EQ(now->server.async_device_events, before->server.async_device_events);
  ExpectHealthy(*good_, 2);
}

TEST_F(BulkSecurityTest, UploadWindowIsSealedBeforeTheHandlerRuns) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  std::vector<BulkDescriptor> grants = Grants(rogue, 8192);
  ASSERT_FALSE(grants.empty());
  const BulkDescriptor g = grants[0];
  const std::string original = Payload(8192, 3);
  auto st = rogue.Write(g.addr, g.rkey, original);
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(*st, IBV_WC_SUCCESS);
  const BulkDescriptor d{g.addr, 8192, g.rkey};
  std::string payload(reinterpret_cast<const char*>(&d), sizeof(d));
  ASSERT_TRUE(rogue.Call("/test.E2E/Sum", payload, rpc_wire::kFlagBulk, g.rkey).ok());
  auto response = rogue.Receive(rpc_wire::kResponse);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->payload, absl::StrCat(original.size(), ":", Fnv(original)));
  // Writing again through the sealed window fails, and changed nothing.
  st = rogue.Write(g.addr, g.rkey, Payload(8192, 4));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR);
  ExpectHealthy(*good_, 3);
}

// The seal is what makes an upload safe to read: the SEND_WITH_INV that carries the request
// revokes the window it names, so the caller can no longer change the data under the handler.
// A request that skips it (a plain SEND, or the key of another of its windows) is a violation,
// and the handler never runs.
TEST_F(BulkSecurityTest, AnUploadNotSealedByItsOwnWindowEndsTheConnection) {
  std::string last_before;
  ASSERT_TRUE(CallRaw(*good_, Id("/test.E2E/LastSum"), "", &last_before, {}).ok());
  for (const bool other_key : {false, true}) {
    SCOPED_TRACE(other_key ? "SEND_WITH_INV of another window" : "plain SEND");
    testing::RogueConnection rogue;
    ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
    const ServerStats before = Stats(*good_);
    std::vector<BulkDescriptor> grants = Grants(rogue, 8192, 2);
    ASSERT_EQ(grants.size(), 2u);
    const BulkDescriptor g = grants[0];
    auto st = rogue.Write(g.addr, g.rkey, Payload(8192, other_key ? 6 : 5));
    ASSERT_TRUE(st.ok());
    ASSERT_EQ(*st, IBV_WC_SUCCESS);
    const BulkDescriptor d{g.addr, 8192, g.rkey};
    const std::string payload(reinterpret_cast<const char*>(&d), sizeof(d));
    ASSERT_TRUE(
        rogue.Call("/test.E2E/Sum", payload, rpc_wire::kFlagBulk, other_key ? grants[1].rkey : 0)
            .ok());
    EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
    EXPECT_EQ(Stats(*good_).violations, before.violations + 1);
  }
  std::string last_after;
  ASSERT_TRUE(CallRaw(*good_, Id("/test.E2E/LastSum"), "", &last_after, {}).ok());
  EXPECT_EQ(last_after, last_before) << "the handler ran on an unsealed upload";
  ExpectHealthy(*good_, 15);
}

TEST_F(BulkSecurityTest, KeysOfAnotherConnectionFail) {
  testing::RogueConnection owner;
  testing::RogueConnection thief;
  ASSERT_TRUE(owner.Connect(port_, "e2e").ok());
  ASSERT_TRUE(thief.Connect(port_, "e2e").ok());
  uint64_t id;
  const BulkDescriptor d = Download(owner, 4096, &id);
  std::string data;
  auto st = thief.Read(d.addr, d.rkey, d.length, &data);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR) << "a type 2 window answers only its own QP";
  // The key itself was good: its owner can still use it.
  st = owner.Read(d.addr, d.rkey, d.length, &data);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(*st, IBV_WC_SUCCESS);
  EXPECT_TRUE(Ack(owner, id, d.rkey).ok());
  ExpectHealthy(*good_, 4);
}

TEST_F(BulkSecurityTest, GuessedKeysFail) {
  // A wrong key byte on a real window address.
  {
    testing::RogueConnection rogue;
    ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
    uint64_t id;
    const BulkDescriptor d = Download(rogue, 4096, &id);
    std::string data;
    auto st = rogue.Read(d.addr, d.rkey ^ 0x5a, d.length, &data);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR);
  }
  // Keys made up wholesale, each on a fresh connection (a failed access ends a connection).
  for (uint32_t guess : {0x100u, 0x1234500u, 0xdeadbeefu, 0x7fffff00u}) {
    testing::RogueConnection rogue;
    ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
    uint64_t id;
    const BulkDescriptor d = Download(rogue, 4096, &id);
    std::string data;
    auto st = rogue.Read(d.addr, guess, 64, &data);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR) << std::hex << guess;
  }
  ExpectHealthy(*good_, 5);
}

TEST_F(BulkSecurityTest, OutOfBoundsAccessFails) {
  for (int which = 0; which < 3; ++which) {
    testing::RogueConnection rogue;
    ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
    uint64_t id;
    const BulkDescriptor d = Download(rogue, 8192, &id);
    std::string data;
    absl::StatusOr<ibv_wc_status> st;
    if (which == 0) st = rogue.Read(d.addr, d.rkey, d.length + 1, &data);
    if (which == 1) st = rogue.Read(d.addr - 64, d.rkey, 64, &data);
    if (which == 2) st = rogue.Write(d.addr, d.rkey, "read-only window");
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR) << "case " << which;
  }
  ExpectHealthy(*good_, 6);
}

TEST_F(BulkSecurityTest, AWindowNeverAcknowledgedIsRevokedAtLeaseExpiry) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  const ServerStats before = Stats(*good_);
  uint64_t id;
  const BulkDescriptor d = Download(rogue, 4096, &id);
  // Never acknowledge. The server revokes it by itself once the 400 ms lease is over.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  ServerStats now = before;
  while (now.lease_expired == before.lease_expired && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));  // leave the server the CPU
    now = Stats(*good_);
  }
  EXPECT_EQ(now.lease_expired, before.lease_expired + 1);
  std::string data;
  auto st = rogue.Read(d.addr, d.rkey, d.length, &data);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR);
  ExpectHealthy(*good_, 7);
}

TEST_F(BulkSecurityTest, AnAcknowledgementInvalidatingTheWrongKeyEndsTheConnection) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  const ServerStats before = Stats(*good_);
  std::vector<BulkDescriptor> grants = Grants(rogue, 4096);
  ASSERT_FALSE(grants.empty());
  uint64_t id;
  const BulkDescriptor d = Download(rogue, 4096, &id);
  // Acknowledge the download, naming its window, but invalidate one of our upload windows
  // instead (a key the NIC accepts: the check that catches it is the server's).
  ASSERT_TRUE(Ack(rogue, id, grants[0].rkey, d.rkey).ok());
  EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
  const ServerStats after = Stats(*good_);
  EXPECT_EQ(after.violations, before.violations + 1);
  // The download window went with the connection.
  testing::RogueConnection other;
  ASSERT_TRUE(other.Connect(port_, "e2e").ok());
  std::string data;
  auto st = other.Read(d.addr, d.rkey, d.length, &data);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR);
  ExpectHealthy(*good_, 8);
}

TEST_F(BulkSecurityTest, AnAcknowledgementForAnotherRequestEndsTheConnection) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  const ServerStats before = Stats(*good_);
  uint64_t first, second;
  const BulkDescriptor a = Download(rogue, 4096, &first);
  const BulkDescriptor b = Download(rogue, 4096, &second);
  ASSERT_NE(a.rkey, b.rkey);
  // Invalidates and names window `a`, but claims the other request's id.
  ASSERT_TRUE(Ack(rogue, second, a.rkey).ok());
  EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
  EXPECT_EQ(Stats(*good_).violations, before.violations + 1);
  ExpectHealthy(*good_, 12);
}

TEST_F(BulkSecurityTest, AReplyChunkWithoutBulkDataEndsOnlyThatConnection) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e", control::BULK_MIRROR).ok());
  // 16 bytes: room for the one descriptor announced, which a lax parser would read past.
  const absl::Status sent =
      rogue.Call("/test.E2E/Echo", std::string(16, 'd'), rpc_wire::kFlagReplyChunk);
  ASSERT_TRUE(sent.ok()) << sent;
  EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
  ExpectHealthy(*good_, 9);
}

TEST_F(BulkSecurityTest, AWindowGrantThatInvalidatesAKeyEndsTheConnection) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  const ServerStats before = Stats(*good_);
  uint64_t id;
  const BulkDescriptor d = Download(rogue, 4096, &id);
  // Revoke the download window with a message that has no business invalidating anything.
  MessageHeader h{.version = rpc_wire::kProtocolVersion,
                  .type = rpc_wire::kWindowGrant,
                  .request_id = 4096,
                  .aux = 1};
  ASSERT_TRUE(rogue.Send(h, {}, d.rkey).ok());
  EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
  EXPECT_EQ(Stats(*good_).violations, before.violations + 1);
  ExpectHealthy(*good_, 10);
}

TEST_F(BulkSecurityTest, UploadGrantsAreCappedPerConnection) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  // Ask for as many of the largest windows as the credits allow, never using them: the server
  // stops at the connection's byte budget instead of handing over its pool...
  const uint32_t size = static_cast<uint32_t>(rogue.negotiated().max_bulk_size());
  uint64_t held = 0;
  for (const BulkDescriptor& d : Grants(rogue, size, 8)) held += d.length;
  EXPECT_GT(held, 0u);
  EXPECT_LE(held, uint64_t{32} << 20) << "granted beyond the per-connection budget";
  // ...and then grants nothing of any other size either, saying so with an empty grant.
  EXPECT_TRUE(Grants(rogue, size / 2, 8).empty());
  // Everyone else still gets their uploads through.
  ExpectHealthy(*good_, 11);
  auto upload = good_->AllocateBulk(1 << 20);
  ASSERT_TRUE(upload.ok());
  upload->resize(1 << 20);
  CallOptions call_options;
  call_options.request_bulk = &*upload;
  std::string response;
  EXPECT_TRUE(CallRaw(*good_, Id("/test.E2E/Sum"), "", &response, call_options).ok());
}

// Per-connection caps alone would let one client take the whole pool with a few connections:
// its connections together may hold bulk_bytes_per_client at most (here 40 MiB; each one 32 MiB
// of grants).
class BulkPerClientTest : public BulkSecurityTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--window_lease_ms=400", absl::StrCat("--bulk_bytes_per_client=", 40 << 20)};
  }
};

TEST_F(BulkPerClientTest, OneClientsConnectionsShareOneBulkBudget) {
  auto first = std::make_unique<testing::RogueConnection>();
  auto second = std::make_unique<testing::RogueConnection>();
  ASSERT_TRUE(first->Connect(port_, "e2e").ok());
  ASSERT_TRUE(second->Connect(port_, "e2e").ok());
  const uint32_t size = static_cast<uint32_t>(first->negotiated().max_bulk_size());
  uint64_t held_first = 0, held_second = 0;
  for (const BulkDescriptor& d : Grants(*first, size, 8)) held_first += d.length;
  for (const BulkDescriptor& d : Grants(*second, size, 8)) held_second += d.length;
  EXPECT_GT(held_first, 0u);
  EXPECT_LE(held_first, uint64_t{32} << 20);
  EXPECT_LE(held_first + held_second, uint64_t{40} << 20)
      << "two connections of one client held " << held_first << " + " << held_second;
  // Downloads count too: past the client's budget, RESOURCE_EXHAUSTED instead of a window.
  uint64_t id;
  ASSERT_TRUE(second->Call("/test.E2E/Fill", std::to_string(16 << 20), 0, 0, &id).ok());
  auto response = second->Receive(rpc_wire::kResponse);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->header.status, static_cast<uint32_t>(absl::StatusCode::kResourceExhausted));
  // Their connections gone (once the server has closed them), the budget is the client's again
  // (good_ shares its address): an upload that would not fit beside what they held goes through.
  auto before = good_->ServerStats();
  ASSERT_TRUE(before.ok()) << before.status();
  first.reset();
  second.reset();
  auto now = ServerStatsWhen(*good_, [&](const StatsReport& st) {
    return st.server.connections_active + 2 <= before->server.connections_active;
  });
  ASSERT_TRUE(now.ok()) << now.status();
  ASSERT_EQ(now->server.connections_active + 2, before->server.connections_active);
  ASSERT_GT(held_first + held_second + (16u << 20), uint64_t{40} << 20)
      << "the upload below must not fit beside what the two held";
  auto upload = good_->AllocateBulk(16 << 20);
  ASSERT_TRUE(upload.ok());
  upload->resize(16 << 20);
  CallOptions call_options;
  call_options.request_bulk = &*upload;
  call_options.timeout = absl::Seconds(20);
  std::string sum;
  EXPECT_TRUE(CallRaw(*good_, Id("/test.E2E/Sum"), "", &sum, call_options).ok());
}

// Server-to-client calls: the rogue is the one answering. A response whose bulk data the server
// is still reading must not be followed by another response for the same call: that one would
// complete the call (with whatever it says) while the RDMA READ still writes into the call's
// buffer, which goes back to the pool and to another call.
TEST_F(BulkSecurityTest, ASecondResponseWhileTheFirstIsBeingReadEndsTheConnection) {
  testing::RogueConnection rogue;
  // The local fallback: the server's ack is a plain SEND, which our memory region can take.
  ASSERT_TRUE(
      rogue.Connect(port_, "e2e", control::BULK_SERVER_EXPOSES, /*remote_invalidation=*/false)
          .ok());
  auto before = good_->ServerStats();
  ASSERT_TRUE(before.ok()) << before.status();
  uint64_t id;
  ASSERT_TRUE(rogue.Call("/test.E2E/CallBack", "hi", 0, 0, &id).ok());
  auto ping = rogue.Receive(rpc_wire::kRequest);
  ASSERT_TRUE(ping.ok()) << ping.status();
  ASSERT_EQ(ping->header.method_id, Id("/test.Client/Ping"));
  // A large download, so that its READ is still running when the second response arrives.
  const std::string data = Payload(8 << 20, 21);
  const BulkDescriptor d = rogue.Expose(data);
  ASSERT_NE(d.rkey, 0u);
  MessageHeader bulk{.version = rpc_wire::kProtocolVersion,
                     .type = rpc_wire::kResponse,
                     .flags = rpc_wire::kFlagBulk,
                     .request_id = ping->header.request_id,
                     .payload_len = static_cast<uint32_t>(sizeof(d))};
  ASSERT_TRUE(
      rogue.Send(bulk, absl::string_view(reinterpret_cast<const char*>(&d), sizeof(d))).ok());
  MessageHeader forged{.version = rpc_wire::kProtocolVersion,
                       .type = rpc_wire::kResponse,
                       .request_id = ping->header.request_id,
                       .payload_len = 6};
  ASSERT_TRUE(rogue.Send(forged, "forged").ok());
  EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
  // The forged answer never completed the server's call: CallBack never answered at all, the
  // connection having failed under it.
  auto answer = rogue.Receive(rpc_wire::kResponse, absl::Milliseconds(200));
  EXPECT_FALSE(answer.ok()) << "CallBack (request " << id << ") answered " << answer->header.status
                            << " " << answer->payload;
  auto after = good_->ServerStats();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->server.protocol_errors, before->server.protocol_errors + 1);
  ExpectHealthy(*good_, 13);
}

// A peer that keeps calling while it returns almost none of the credits the answers need: the
// answers wait in the worker's send buffers, which every connection on that worker shares. One
// connection may park only so many; beyond that it is failed, before the pool runs dry for all.
TEST_F(BulkSecurityTest, APeerThatHoldsBackCreditsCannotParkUnboundedResponses) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  auto before = good_->ServerStats();
  ASSERT_TRUE(before.ok()) << before.status();
  uint32_t available = rogue.negotiated().client_credits();
  uint64_t request_id = 1000;
  int sent = 0;
  absl::Time progress = absl::Now();
  while (sent < 3000 && absl::Now() - progress < absl::Seconds(2)) {
    available += rogue.TakeCredits();
    if (available == 0) continue;
    // Our last credit carries back a single one of the many we owe.
    MessageHeader h{.version = rpc_wire::kProtocolVersion,
                    .type = rpc_wire::kRequest,
                    .method_id = Id("/test.E2E/Echo"),
                    .request_id = request_id++,
                    .payload_len = 1,
                    .credits = available == 1 ? 1u : 0u};
    if (!rogue.Send(h, "x").ok()) break;
    --available;
    ++sent;
    progress = absl::Now();
  }
  // The server's limit is 4 x 32 parked messages for this connection; without one, this rogue
  // parks a response per call until the worker's 16384 send buffers are gone.
  EXPECT_LT(sent, 1000) << "the server kept parking responses for a peer returning no credits";
  EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
  // The server finishes closing it (and counts it) once the QP has flushed.
  auto after = ServerStatsWhen(*good_, [&](const StatsReport& st) {
    return st.server.connections_closed != before->server.connections_closed;
  });
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->server.connections_closed, before->server.connections_closed + 1);
  EXPECT_EQ(after->server.protocol_errors, before->server.protocol_errors)
      << "a peer slow to return credits is shed, not called a protocol violator";
  ExpectHealthy(*good_, 14);
}

}  // namespace
}  // namespace swirl
