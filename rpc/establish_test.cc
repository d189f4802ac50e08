// EstablishConnection, the one setup path of both sides (rpc/establish.h), on two caller-driven
// workers of this process: a client's setup whose exchange runs the server's, as a Connect does
// across the control plane, a failed exchange, and what the setup logs.

#include "rpc/establish.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "rpc/wire.h"
#include "swirl/call.h"
#include "swirl/service.h"

namespace swirl::internal {
namespace {

class RawEcho final : public Service {
 public:
  RawEcho() : Service("test.Establish") {
    AddRawMethod("Echo", [](ServerContext&, absl::string_view in, ResponseWriter& out) {
      return out.Append(in) ? absl::OkStatus() : absl::ResourceExhaustedError("too big");
    });
  }
};

class EstablishTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto device = OpenTransport(transport_, Probe::kOncePerProcess);
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = *device;
    ASSERT_TRUE(server_methods_.Add(echo_).ok());
    client_ = NewWorker("client");
    server_ = NewWorker("server");
    ASSERT_NE(client_, nullptr);
    ASSERT_NE(server_, nullptr);
  }

  std::unique_ptr<Worker> NewWorker(const char* name) {
    WorkerOptions wo = WorkerOptionsFor(transport_);
    wo.name = name;
    wo.own_thread = false;  // the test drives both
    wo.max_connections = 1;
    auto worker = Worker::Create(device_.context, device_.pd, device_.caps, wo, nullptr);
    EXPECT_TRUE(worker.ok()) << worker.status();
    return worker.ok() ? std::move(*worker) : nullptr;
  }

  // What a server would settle on with a client whose policy is `client_policy`.
  control::Negotiated Negotiated(InvalidationPolicy client_policy) {
    TransportOptions client = transport_;
    client.invalidation = client_policy;
    control::ConnectRequest request;
    request.set_protocol_version(kControlProtocolVersion);
    request.mutable_address()->set_gid(std::string(16, '\0'));
    *request.mutable_capabilities() =
        DescribeLocal(DeclaredCapabilities(device_.caps, client_policy),
                      LocalConfigFor(client, device_.caps));
    auto n = Negotiate(request, device_.caps, LocalConfigFor(transport_, device_.caps),
                       [](const ibv_gid&) { return absl::OkStatus(); });
    EXPECT_TRUE(n.ok()) << n.status();
    return n.ok() ? *n : control::Negotiated();
  }

  ConnectionSetup Setup(Worker* worker, uint64_t id, const MethodTable* methods,
                        const TransportOptions* transport, bool is_server) {
    return ConnectionSetup{.worker = worker,
                           .id = id,
                           .methods = methods,
                           .transport = transport,
                           .is_server = is_server,
                           .peer = is_server ? "the client" : "the server",
                           .client_name = "establish_test"};
  }

  // The client's setup; its exchange runs the server's setup with the client's address, as
  // Channel::Create and Server's Connect do. Both connections, or the first failure.
  absl::Status ConnectPair(const TransportOptions& client_transport,
                           const control::Negotiated& negotiated) {
    client_transport_ = client_transport;
    auto client = EstablishConnection(
        Setup(client_.get(), 1, &client_methods_, &client_transport_, false),
        [&](const LocalQp& client_qp) -> absl::StatusOr<PeerAnswer> {
          verbs::PeerAddress server_address;
          std::string link_key;  // both QPs take one, as a server makes it
          auto server = EstablishConnection(
              Setup(server_.get(), 7, &server_methods_, &transport_, true),
              [&](const LocalQp& ours) -> absl::StatusOr<PeerAnswer> {
                server_address = ours.address;
                if (ours.link_keys && client_qp.link_keys) link_key = NewLinkKey();
                return PeerAnswer{client_qp.address, negotiated, 7, link_key};
              });
          if (!server.ok()) return server.status();
          server_connection_ = *server;
          return PeerAnswer{server_address, negotiated, 7, link_key};
        });
    if (!client.ok()) return client.status();
    client_connection_ = *client;
    return absl::OkStatus();
  }

  // Starts `call` on the client connection and drives both workers until it completes (10 s
  // at most).
  absl::Status Drive(ClientCall& call) {
    client_->StartCall(client_connection_->id(), &call);
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (!call.done() && absl::Now() < deadline) {
      server_->TryDrive();
      client_->TryDrive();
    }
    if (!call.done()) {
      // The call must be done before it goes out of scope: cancelled, and driven to its end.
      call.Cancel();
      const absl::Time drained = absl::Now() + absl::Seconds(10);
      while (!call.done() && absl::Now() < drained) client_->TryDrive();
      EXPECT_TRUE(call.done()) << "a cancelled call did not complete";
      return absl::DeadlineExceededError("no response within 10 s");
    }
    return call.status();
  }

  TransportOptions transport_;         // the server's; soft0 (SWIRL_DEVICE), defaults
  TransportOptions client_transport_;  // the client's, during and after ConnectPair
  OpenedDevice device_;
  RawEcho echo_;
  MethodTable server_methods_, client_methods_;
  std::unique_ptr<Worker> client_, server_;
  std::shared_ptr<Connection> client_connection_, server_connection_;
};

TEST_F(EstablishTest, BothSidesComeUpAndCarryACall) {
  ASSERT_TRUE(ConnectPair(transport_, Negotiated(InvalidationPolicy::kPreferRemote)).ok());
  EXPECT_EQ(client_connection_->negotiated().invalidation(), control::INVALIDATION_REMOTE);
  EXPECT_EQ(server_connection_->peer(), "the client");
  EXPECT_EQ(server_connection_->client_name(), "establish_test");
  ClientCall call;
  std::string response;
  call.SetMethod(rpc_wire::MethodId("/test.Establish/Echo"));
  call.SetRequestBytes("through both setups");
  call.SetResponseBytes(&response);
  ASSERT_TRUE(Drive(call).ok()) << call.status();
  EXPECT_EQ(response, "through both setups");
  EXPECT_EQ(client_connection_->state(), Connection::State::kActive);
  EXPECT_EQ(server_connection_->state(), Connection::State::kActive);
}

// A refused exchange (the server said no, or its answer did not check out) fails the setup with
// the exchange's status and gives back what the connection held on its worker.
TEST_F(EstablishTest, AFailedExchangeAbandonsTheConnection) {
  const uint32_t free_before = client_->free_credits();
  auto refused = EstablishConnection(
      Setup(client_.get(), 1, &client_methods_, &transport_, false),
      [](const LocalQp&) -> absl::StatusOr<PeerAnswer> {
        return absl::PermissionDeniedError("the server refused");
      });
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status(), absl::PermissionDeniedError("the server refused"));
  EXPECT_EQ(client_->free_credits(), free_before);
  // The worker's one connection slot is free again: a setup on it succeeds.
  EXPECT_TRUE(ConnectPair(transport_, Negotiated(InvalidationPolicy::kPreferRemote)).ok());
}

// Each side logs what was settled; a fallback in force is a WARNING on both, saying which side
// asked for it.
TEST_F(EstablishTest, AFallbackInForceIsAWarningOnBothSides) {
  TransportOptions client = transport_;
  client.invalidation = InvalidationPolicy::kLocalOnly;
  ::testing::internal::CaptureStderr();
  absl::Status s = ConnectPair(client, Negotiated(InvalidationPolicy::kLocalOnly));
  const std::string logged = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(s.ok()) << s;
  auto line_with = [&](const std::string& text) {
    const size_t at = logged.find(text);
    if (at == std::string::npos) return std::string();
    const size_t begin = logged.rfind('\n', at);
    const size_t start = begin == std::string::npos ? 0 : begin + 1;
    return logged.substr(start, logged.find('\n', at) - start);
  };
  const std::string ours = line_with(
      "connection 7 to the server: remote invalidation unavailable (this side asked for the "
      "fallback)");
  const std::string theirs = line_with(
      "connection 7 from the client: remote invalidation unavailable (not supported end to "
      "end)");
  ASSERT_FALSE(ours.empty()) << logged;
  ASSERT_FALSE(theirs.empty()) << logged;
  EXPECT_EQ(ours[0], 'W') << ours;
  EXPECT_EQ(theirs[0], 'W') << theirs;
  EXPECT_NE(line_with("connection 7 from the client (establish_test): credits 32/32"), "")
      << logged;
  EXPECT_NE(line_with("invalidation INVALIDATION_LOCAL, bulk BULK_SERVER_EXPOSES"), "") << logged;
}

}  // namespace
}  // namespace swirl::internal
