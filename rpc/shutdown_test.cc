// Server::Shutdown against rpc/testing/test_server in another process: the health service's
// answers before and during it, and the drain's wait for bulk transfers of requests it accepted
// that only the client can finish (docs/ARCHITECTURE.md, "Shutdown"; the download case is
// E2EShutdown.DrainWaitsForADownloadTheClientIsStillReading in e2e_test.cc).
//
// This binary runs with SWIRL_SOFT_PROGRESS=off (BUILD): the soft device's thread then makes no
// progress for CQs nobody polls, so a caller-driven channel's side of the connection moves only
// while the test drives it. That is how a transfer is held unfinished on purpose: the server's
// RDMA READ of a mirror-mode request waits for the client's device to answer it, and a fallback
// upload's LOCAL_INV completes only behind the server's earlier SEND, which the client's device
// has not acknowledged. (The test server inherits the setting; its workers poll their CQs
// themselves.)

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/testing/health.grpc.pb.h"
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/server_stats.h"
#include "rpc/testing/test_client.h"
#include "rpc/testing/test_data.h"
#include "rpc/wire.h"
#include "swirl/channel.h"

namespace swirl {
namespace {

using grpc::health::v1::HealthCheckResponse;
using testing::ConnectTo;
using testing::MethodOf;
using testing::ServerStatsWhen;

// Generous keepalive and leases, and no transport timer: a caller-driven client that is not
// driven answers no ping and acknowledges nothing (the server's READ of its data would fail at
// the default ack_timeout's 4.3 s, as a NIC's would), and only the drain is under test. A
// connection whose client says nothing fails a second after it connected (DrainWitness).
std::vector<std::string> PatientServer() {
  return {"--shutdown_ms=20000", "--keepalive_ms=20000", "--window_lease_ms=30000",
          "--setup_timeout_ms=1000", "--ack_timeout_ms=0"};
}

// grpc.health.v1.Health/Check of service "" (the server as a whole) on this host's `port`,
// without a token: the health service is open to probes.
absl::StatusOr<HealthCheckResponse::ServingStatus> Health(int port) {
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  grpc::health::v1::HealthCheckRequest request;
  HealthCheckResponse response;
  grpc::Status s = stub->Check(&ctx, request, &response);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }
  return response.status();
}

// Asks the server to shut down and waits (bounded) until it says so: its health service answers
// NOT_SERVING from the moment Shutdown begins, before the workers start draining.
void BeginShutdown(testing::ChildProcess& process, int port) {
  process.Signal(SIGTERM);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<HealthCheckResponse::ServingStatus> health = Health(port);
  while ((!health.ok() || *health != HealthCheckResponse::NOT_SERVING) &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
    health = Health(port);
  }
  ASSERT_TRUE(health.ok()) << health.status();
  ASSERT_EQ(*health, HealthCheckResponse::NOT_SERVING) << "the shutdown never began";
}

// What the server has received on connection `id` (0 if it does not list it).
uint64_t BytesReceived(const StatsReport& stats, uint64_t id) {
  for (const ConnectionStats& c : stats.connections) {
    if (c.connection_id == id) return c.bytes_received;
  }
  return 0;
}

// Shows that a drain did not end while a transfer was unfinished, without waiting for nothing:
// a connection made just before the shutdown whose client never says a word is failed by the
// server's setup timeout (counted in connections_failed) a second later, from the same worker
// timers that decide whether the drain is done. Had the drain ended meanwhile, it would have
// closed that connection in an orderly way first, which is not counted as a failure.
class DrainWitness {
 public:
  // Before the shutdown begins; `observer` asks the server for its stats.
  void Connect(int port, Channel& observer) {
    auto stats = observer.ServerStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    failed_before_ = stats->server.connections_failed;
    ASSERT_TRUE(silent_.Connect(port, testing::kTestToken).ok());
  }
  // After it began: the server kept draining until it gave up on the silent connection.
  void ExpectDrainOutlived(Channel& observer) {
    auto stats = ServerStatsWhen(observer, [this](const StatsReport& s) {
      return s.server.connections_failed > failed_before_;
    });
    ASSERT_TRUE(stats.ok()) << "the server stopped answering: " << stats.status();
    ASSERT_EQ(stats->server.connections_failed, failed_before_ + 1)
        << "the drain ended (closing the silent connection) with a transfer unfinished";
  }

 private:
  testing::RogueConnection silent_;
  uint64_t failed_before_ = 0;
};

uint64_t Requests(Channel& observer) {
  auto stats = observer.ServerStats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  return stats.ok() ? stats->server.requests : 0;
}

// `size` bytes of registered memory on `channel` with a pattern of `seed`, and the answer
// test.E2E/Sum gives for them.
std::pair<BulkBuffer, std::string> Upload(Channel& channel, size_t size, int seed) {
  auto buffer = channel.AllocateBulk(size);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  if (!buffer.ok()) return {};
  for (size_t i = 0; i < size; ++i) buffer->data()[i] = static_cast<char>(i * seed + 1);
  buffer->resize(size);
  std::string sum = absl::StrCat(size, ":", testing::Fnv(buffer->view()));
  return {std::move(*buffer), std::move(sum)};
}

// Sets `call` up as test.E2E/Sum of `data` into `response`.
void PrepareSum(ClientCall& call, const BulkBuffer& data, std::string* response) {
  CallOptions options;
  options.request_bulk = &data;
  call.SetMethod(MethodOf("/test.E2E/Sum"));
  call.SetResponseBytes(response);
  call.SetOptions(options);
}

// The standard health service answers SERVING while the server runs, without a token, and
// NOT_SERVING once Shutdown has begun, while the server drains (held here by a download the
// caller-driven client has not read yet) and still answers on its control plane.
TEST(E2EHealth, ServingWhileRunningAndNotServingOnceShutdownBegins) {
  auto server = testing::SpawnServer(testing::kTestServer, PatientServer());
  ASSERT_TRUE(server.ok()) << server.status();
  auto& [process, port] = *server;
  auto health = Health(port);
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthCheckResponse::SERVING);

  ChannelOptions options;
  options.driver = ChannelOptions::Driver::kCaller;
  auto channel = ConnectTo(port, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  constexpr size_t kSize = 100000;
  auto landing = (*channel)->AllocateBulk(kSize);
  ASSERT_TRUE(landing.ok()) << landing.status();
  CallOptions call_options;
  call_options.response_bulk = &*landing;
  ClientCall call;
  const std::string request = std::to_string(kSize);
  std::string response;
  call.SetMethod(MethodOf("/test.E2E/Fill"));
  call.SetRequestBytes(request);
  call.SetResponseBytes(&response);
  call.SetOptions(call_options);
  auto before = (*channel)->ServerStats();
  ASSERT_TRUE(before.ok()) << before.status();
  const uint64_t windows = before->server.windows_outstanding;
  (*channel)->Start(&call);
  // Answered: the response's window is bound (and stays so until the client reads it).
  auto answered = ServerStatsWhen(**channel, [windows](const StatsReport& s) {
    return s.server.windows_outstanding > windows;
  });
  ASSERT_TRUE(answered.ok()) << answered.status();
  ASSERT_EQ(answered->server.windows_outstanding, windows + 1);
  ASSERT_EQ(answered->server.requests, before->server.requests + 1);

  ASSERT_NO_FATAL_FAILURE(BeginShutdown(process, port));
  // Draining, not gone: the download is still exposed, and the control plane still answers.
  ASSERT_FALSE(process.Wait(absl::ZeroDuration()).ok()) << "the server exited mid-drain";
  auto draining = (*channel)->ServerStats();
  ASSERT_TRUE(draining.ok()) << draining.status();
  EXPECT_EQ(draining->server.windows_outstanding, windows + 1);
  health = Health(port);
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthCheckResponse::NOT_SERVING);

  ASSERT_TRUE(call.Wait().ok()) << call.status();
  EXPECT_EQ(response, "filled");
  ASSERT_EQ(landing->size(), kSize);
  for (size_t i = 0; i < kSize; i += 997) ASSERT_EQ(landing->data()[i], testing::Pattern(i)) << i;
  auto exit_code = process.Wait(absl::Seconds(20));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

// Mirror mode: the server RDMA READs the request's data from the client's window before the
// handler runs. Its READ is outstanding when the shutdown begins (the caller-driven client's
// device answers it only once the client is driven): the drain must wait for it, and then
// serve the request it had accepted (not refuse it as a new one), so the call ends with the
// right answer and the server exits cleanly.
TEST(E2EShutdown, DrainWaitsForAMirrorRequestTheServerIsStillReading) {
  auto server = testing::SpawnServer(testing::kTestServer, PatientServer());
  ASSERT_TRUE(server.ok()) << server.status();
  auto& [process, port] = *server;
  ChannelOptions options;
  options.driver = ChannelOptions::Driver::kCaller;
  options.bulk_mode = BulkMode::kMirror;
  options.transport.window_lease = absl::Seconds(60);  // ours must outlive the test, not be revoked
  auto channel = ConnectTo(port, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  ASSERT_EQ((*channel)->negotiated().bulk_mode, BulkMode::kMirror);

  constexpr size_t kSize = 200000;
  auto [data, sum] = Upload(**channel, kSize, 7);
  auto before = (*channel)->ServerStats();
  ASSERT_TRUE(before.ok()) << before.status();
  ClientCall call;
  std::string response;
  PrepareSum(call, data, &response);
  (*channel)->Start(&call);  // posts the request; nothing drives the client from here on
  // The server has taken a pool buffer for the request's data: its READ is posted.
  auto reading = ServerStatsWhen(**channel, [&before](const StatsReport& s) {
    return s.server.bulk_bytes_in_use >= before->server.bulk_bytes_in_use + kSize;
  });
  ASSERT_TRUE(reading.ok()) << reading.status();
  ASSERT_GE(reading->server.bulk_bytes_in_use, before->server.bulk_bytes_in_use + kSize);

  DrainWitness witness;
  ASSERT_NO_FATAL_FAILURE(witness.Connect(port, **channel));
  ASSERT_NO_FATAL_FAILURE(BeginShutdown(process, port));
  ASSERT_NO_FATAL_FAILURE(witness.ExpectDrainOutlived(**channel));
  EXPECT_EQ(Requests(**channel), before->server.requests)
      << "the handler ran before the drain began: the READ was not held";

  ASSERT_TRUE(call.Wait().ok()) << call.status();  // drives: the READ is answered now
  EXPECT_EQ(response, sum);
  auto exit_code = process.Wait(absl::Seconds(20));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

// The local-invalidation fallback: an upload's request arrives after its data, and the server
// revokes the window itself (LOCAL_INV) before the handler may see the data. Here the LOCAL_INV
// is still outstanding when the shutdown begins: it completes in send-queue order, behind the
// server's answer to an echo sent just before, which the caller-driven client's device does not
// acknowledge until the client is driven. The drain must wait for the revocation and then serve
// the upload it had accepted.
TEST(E2EShutdown, DrainWaitsForAFallbackUploadWhoseWindowIsStillBeingRevoked) {
  auto server = testing::SpawnServer(testing::kTestServer, PatientServer());
  ASSERT_TRUE(server.ok()) << server.status();
  auto& [process, port] = *server;
  ChannelOptions options;
  options.driver = ChannelOptions::Driver::kCaller;
  options.transport.invalidation = InvalidationPolicy::kLocalOnly;
  auto channel = ConnectTo(port, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  ASSERT_EQ((*channel)->negotiated().invalidation, InvalidationMode::kLocal);

  constexpr size_t kSize = 200000;
  {
    // One upload first, driven to the end: it brings the upload windows the next one uses
    // without a round trip.
    auto [warmup, warmup_sum] = Upload(**channel, kSize, 3);
    ClientCall call;
    std::string response;
    PrepareSum(call, warmup, &response);
    (*channel)->Start(&call);
    ASSERT_TRUE(call.Wait().ok()) << call.status();
    ASSERT_EQ(response, warmup_sum);
  }
  auto [data, sum] = Upload(**channel, kSize, 5);
  auto before = (*channel)->ServerStats();
  ASSERT_TRUE(before.ok()) << before.status();
  const uint64_t locally_invalidated = before->server.windows_locally_invalidated;

  const std::string text(100, 'e');
  std::string echoed;
  ClientCall echo;
  echo.SetMethod(MethodOf("/test.E2E/Echo"));
  echo.SetRequestBytes(text);
  echo.SetResponseBytes(&echoed);
  ClientCall upload;
  std::string response;
  PrepareSum(upload, data, &response);
  (*channel)->Start(&echo);
  (*channel)->Start(&upload);  // the WRITE and the request; nothing drives the client from here
  // Both requests are in: the echo's (a header and its text) and the upload's (a header and
  // its descriptor). The echo ran, its answer is on its way to us; the upload was admitted as it
  // arrived and waits for its window's revocation.
  const uint64_t id = (*channel)->connection_id();
  const uint64_t expected_bytes =
      BytesReceived(*before, id) + (32 + text.size()) + (32 + sizeof(rpc_wire::BulkDescriptor));
  auto received = ServerStatsWhen(**channel, [&](const StatsReport& s) {
    return BytesReceived(s, id) >= expected_bytes;
  });
  ASSERT_TRUE(received.ok()) << received.status();
  ASSERT_EQ(BytesReceived(*received, id), expected_bytes);
  ASSERT_EQ(received->server.requests, before->server.requests + 1);

  DrainWitness witness;
  ASSERT_NO_FATAL_FAILURE(witness.Connect(port, **channel));
  ASSERT_NO_FATAL_FAILURE(BeginShutdown(process, port));
  ASSERT_NO_FATAL_FAILURE(witness.ExpectDrainOutlived(**channel));
  auto draining = (*channel)->ServerStats();
  ASSERT_TRUE(draining.ok()) << draining.status();
  EXPECT_EQ(draining->server.requests, before->server.requests + 1)
      << "the upload's handler ran before the drain began: the LOCAL_INV was not held";
  EXPECT_EQ(draining->server.windows_locally_invalidated, locally_invalidated);

  ASSERT_TRUE(upload.Wait().ok()) << upload.status();  // drives: the echo is acknowledged now
  EXPECT_EQ(response, sum);
  ASSERT_TRUE(echo.Wait().ok()) << echo.status();
  EXPECT_EQ(echoed, text);
  auto exit_code = process.Wait(absl::Seconds(20));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

}  // namespace
}  // namespace swirl
