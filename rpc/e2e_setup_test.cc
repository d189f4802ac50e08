// End-to-end tests of connection setup against rpc/testing/test_server in another process: the
// control plane refuses what it must (tokens, versions, fabrics, secrets, oversized requests,
// overlong names) before any queue pair, and reaps a client that never comes up.

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <thread>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "proto/control.grpc.pb.h"
#include "rpc/handshake.h"
#include "rpc/testing/e2e.h"
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/test_data.h"
#include "rpc/wire.h"
#include "swirl/channel.h"
#include "transport/device.h"
#include "transport/verbs/verbs.h"

namespace swirl {
namespace {

using testing::Connect;
using testing::ConnectRaw;
using testing::ControlStub;
using testing::DeclareCapabilities;
using testing::E2ETest;
using testing::Echo;
using testing::Id;
using testing::kMaxClientNameForTest;
using testing::kServer;
using testing::OwnDeviceKind;
using testing::ServerRequestsReaching;
using testing::Stats;

TEST_F(E2ETest, AuthenticationFailuresAreRefusedBeforeAnyQueuePair) {
  auto before = Stats(port_);
  ASSERT_TRUE(before.ok()) << before.status();
  for (const char* token : {"wrong", ""}) {
    auto channel = Connect(port_, token);
    ASSERT_FALSE(channel.ok());
    EXPECT_EQ(channel.status().code(), absl::StatusCode::kUnauthenticated) << channel.status();
  }
  auto after = Stats(port_);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->server().connections_accepted(), before->server().connections_accepted());
  EXPECT_EQ(after->server().connections_refused(), before->server().connections_refused() + 2);
}

TEST_F(E2ETest, ProtocolVersionMismatchIsRefused) {
  control::ConnectRequest request;
  request.set_protocol_version(99);
  control::ConnectResponse response;
  grpc::Status s = ConnectRaw(port_, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("version 99"), std::string::npos) << s.error_message();
}

// A client whose device cannot reach the server's is told so at Connect, before any QP exists:
// another kind of device, or a soft device on the other fabric (shared memory vs TCP). (The
// fabric check is the soft device's: through rdma-core, in e2e_test_rdma_core, only the kind is
// judged, as for any rdma-core device.)
TEST_F(E2ETest, AClientOnAnotherFabricIsRefusedSayingWhy) {
  auto device = swirl::OpenDevice("");
  ASSERT_TRUE(device.ok()) << device.status();
  const bool soft_kind = (*device)->kind() == verbs::DeviceKind::kSoft;
  absl::StatusOr<ibv_gid> own = (*device)->QueryGid(1, 0);
  ASSERT_TRUE(own.ok()) << own.status();
  const bool own_tcp = own->raw[10] == 0xff && own->raw[11] == 0xff;
  ibv_gid other{};  // the same process's devices share a fabric: make up the other one's GID
  if (own_tcp) {
    other.raw[0] = 0xfe;
    other.raw[1] = 0x80;
    other.raw[15] = 1;
  } else {
    other.raw[10] = other.raw[11] = 0xff;
    other.raw[12] = 127;
    other.raw[15] = 1;
  }
  struct Case {
    const char* kind;
    ibv_gid gid;
    const char* says;
  };
  std::vector<Case> cases = {Case{soft_kind ? "rdma-core" : "soft", *own, "same kind of device"}};
  if (soft_kind) cases.push_back(Case{"soft", other, "SWIRL_SOFT_TCP"});
  for (const Case& c : cases) {
    control::ConnectRequest request;
    request.set_protocol_version(internal::kControlProtocolVersion);
    verbs::PeerAddress address;
    address.gid = c.gid;
    address.qp_num = 0x123;
    *request.mutable_address() = internal::ToProto(address);
    DeclareCapabilities(request.mutable_capabilities(), c.kind);
    control::ConnectResponse response;
    grpc::Status s = ConnectRaw(port_, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << c.kind;
    EXPECT_NE(s.error_message().find(c.says), std::string::npos) << s.error_message();
  }
}

// A Connect request that the server accepts, for a QP that does not exist: the client side of
// such a connection never comes up.
control::ConnectRequest RequestForAbsentQp() {
  control::ConnectRequest request;
  request.set_protocol_version(internal::kControlProtocolVersion);
  auto device = swirl::OpenDevice("");
  verbs::PeerAddress address;
  if (device.ok()) {
    absl::StatusOr<ibv_gid> gid = (*device)->QueryGid(1, 0);
    if (gid.ok()) address.gid = *gid;
  }
  address.qp_num = 0x123;
  *request.mutable_address() = internal::ToProto(address);
  DeclareCapabilities(request.mutable_capabilities());
  return request;
}

grpc::Status DisconnectRaw(int port, uint64_t id, const std::string& secret) {
  auto stub = ControlStub(port);
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer e2e");
  control::DisconnectRequest request;
  request.set_connection_id(id);
  request.set_disconnect_secret(secret);
  control::DisconnectResponse response;
  return stub->Disconnect(&ctx, request, &response);
}

// Stats of `port` once `done(stats)` holds, or the last ones after 10 s.
template <typename Done>
control::StatsResponse StatsWhen(int port, Done done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  control::StatsResponse last;
  for (;;) {
    auto stats = Stats(port);
    if (stats.ok()) last = *stats;
    if ((stats.ok() && done(last)) || absl::Now() > deadline) return last;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// A token holder knows every connection's id from Stats; ending one takes the secret that only
// its Connect's caller was given. A wrong or missing secret reads as "no such connection".
TEST_F(E2ETest, DisconnectTakesTheSecretOnlyTheConnectingClientWasGiven) {
  auto good = Connect(port_);
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_EQ(Echo(**good, "before"), "before");
  for (const std::string& secret : {std::string(), std::string(16, '\0'), std::string("x")}) {
    grpc::Status s = DisconnectRaw(port_, (*good)->connection_id(), secret);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  }
  // Our own connection, with the secret its Connect gave us: ended at once.
  control::ConnectResponse response;
  ASSERT_TRUE(ConnectRaw(port_, RequestForAbsentQp(), &response).ok());
  EXPECT_EQ(response.disconnect_secret().size(), 16u);
  grpc::Status s = DisconnectRaw(port_, response.connection_id(), response.disconnect_secret());
  EXPECT_TRUE(s.ok()) << s.error_message();
  const control::StatsResponse after = StatsWhen(port_, [&](const control::StatsResponse& st) {
    for (const auto& c : st.connections()) {
      if (c.connection_id() == response.connection_id()) return false;
    }
    return true;
  });
  for (const auto& c : after.connections()) EXPECT_NE(c.connection_id(), response.connection_id());
  EXPECT_EQ(Echo(**good, "after"), "after");
  EXPECT_TRUE((*good)->connected());
}

// A client may lower the eager threshold for its connection, but not below a floor: every small
// response would otherwise cost the server a pool buffer, a window and a lease.
TEST_F(E2ETest, AClientCannotNegotiateTheEagerThresholdAway) {
  control::ConnectRequest request = RequestForAbsentQp();
  request.mutable_capabilities()->set_eager_threshold(0);
  control::ConnectResponse response;
  grpc::Status s = ConnectRaw(port_, request, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.negotiated().eager_threshold(), internal::kMinEagerThreshold);
  EXPECT_TRUE(DisconnectRaw(port_, response.connection_id(), response.disconnect_secret()).ok());
}

// Control requests are small: one of a megabyte is refused by gRPC before the server parses it
// (or looks at its token), and the server goes on serving.
TEST_F(E2ETest, AnOversizedControlRequestIsRefusedUnread) {
  control::ConnectRequest request = RequestForAbsentQp();
  request.set_client_name(std::string(1 << 20, 'n'));
  control::ConnectResponse response;
  grpc::Status s = ConnectRaw(port_, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  auto good = Connect(port_);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(Echo(**good, "fine"), "fine");
}

// A client that never completes its side of Connect (or gave up before it learned the id) does
// not hold its connection slot for long, even with keepalive off; a real client that connects
// and then stays idle keeps its connection.
TEST(E2ESetup, AConnectionWhoseClientNeverComesUpIsReaped) {
  auto server = testing::SpawnServer(kServer, {"--keepalive_ms=0", "--setup_timeout_ms=300"});
  ASSERT_TRUE(server.ok()) << server.status();
  testing::ChildProcess child = std::move(server->first);
  const int port = server->second;
  auto idle = Connect(port);
  ASSERT_TRUE(idle.ok()) << idle.status();
  // A caller-driven channel is driven only by its caller's calls: it too says it is up at once.
  ChannelOptions caller_driven;
  caller_driven.driver = ChannelOptions::Driver::kCaller;
  auto idle_caller = Connect(port, "e2e", caller_driven);
  ASSERT_TRUE(idle_caller.ok()) << idle_caller.status();
  control::ConnectResponse response;
  ASSERT_TRUE(ConnectRaw(port, RequestForAbsentQp(), &response).ok());
  const control::StatsResponse after = StatsWhen(port, [](const control::StatsResponse& st) {
    return st.server().connections_failed() >= 1;
  });
  EXPECT_EQ(after.server().connections_failed(), 1u);
  EXPECT_EQ(after.server().connections_active(), 2u);
  ASSERT_EQ(after.connections_size(), 2);
  for (const auto& c : after.connections()) {
    EXPECT_NE(c.connection_id(), response.connection_id()) << "the absent client's is gone";
  }
  EXPECT_EQ(Echo(**idle, "still here"), "still here");
  EXPECT_EQ(Echo(**idle_caller, "me too"), "me too");
}

// Connection ids are no secret to a client holding the token (Stats lists them); Disconnect must
// not take such an id from a caller without the token, or anyone could cut every client off.
// Stats itself wants the token too.
TEST_F(E2ETest, DisconnectWithoutTheTokenIsRefused) {
  EXPECT_FALSE(Stats(port_, "").ok());
  EXPECT_FALSE(Stats(port_, "wrong").ok());
  auto good = Connect(port_);
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_EQ(Echo(**good, "before"), "before");
  auto stats = Stats(port_);
  ASSERT_TRUE(stats.ok()) << stats.status();
  bool listed = false;
  for (const auto& c : stats->connections()) listed |= c.connection_id() == (*good)->connection_id();
  ASSERT_TRUE(listed);
  for (const char* token : {"", "wrong"}) {
    SCOPED_TRACE(token);
    auto stub = ControlStub(port_);
    grpc::ClientContext ctx;
    if (*token != '\0') ctx.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    control::DisconnectRequest request;
    request.set_connection_id((*good)->connection_id());
    control::DisconnectResponse response;
    grpc::Status s = stub->Disconnect(&ctx, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  }
  // A close, had there been one, would show within this window: the server would stop listing
  // the connection.
  absl::SleepFor(absl::Milliseconds(100));
  auto after = Stats(port_);
  ASSERT_TRUE(after.ok()) << after.status();
  listed = false;
  for (const auto& c : after->connections()) listed |= c.connection_id() == (*good)->connection_id();
  EXPECT_TRUE(listed) << "the connection was closed";
  std::string response;
  CallOptions options;
  options.timeout = absl::Seconds(5);
  absl::Status s = CallRaw(**good, Id("/test.E2E/Echo"), "after", &response, options);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(response, "after");
  EXPECT_TRUE((*good)->connected());
}

TEST(E2EHandshake, OverlongClientNamesAreRefused) {
  auto server = testing::SpawnServer(kServer, {});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = absl::StrCat("127.0.0.1:", server->second);
  ChannelOptions options;
  options.auth_token = "e2e";
  // Past kMaxClientName, within the control plane's message limit (AnOversizedControlRequest...).
  options.client_name = std::string(4000, '\n');
  auto refused = Channel::Create(address, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  options.client_name = std::string(kMaxClientNameForTest, 'n');
  auto accepted = Channel::Create(address, options);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_EQ(Echo(**accepted, "named"), "named");
}

TEST(E2EHandshake, TheGidIndexReachesTheDevice) {
  // The soft device has one GID: a channel asking for entry 1 must fail, saying so, rather
  // than connect with entry 0.
  auto server = testing::SpawnServer(kServer, {});
  ASSERT_TRUE(server.ok()) << server.status();
  ChannelOptions options;
  options.transport.gid_index = 1;
  auto refused = Connect(server->second, "e2e", options);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(absl::AsciiStrToLower(refused.status().message()).find("gid"), std::string::npos)
      << refused.status();
  options.transport.gid_index = 0;
  auto accepted = Connect(server->second, "e2e", options);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_EQ(Echo(**accepted, "gid 0"), "gid 0");
}

}  // namespace
}  // namespace swirl
