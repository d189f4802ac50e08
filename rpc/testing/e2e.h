// Shared by the end-to-end tests of the RPC engine against rpc/testing/test_server in another
// process (e2e_test, e2e_setup_test, e2e_hostile_test): connecting, echoing, the control plane
// as a raw gRPC client (stats, Connect), and the fixture that runs one server per suite.

#ifndef SWIRL_RPC_TESTING_E2E_H_
#define SWIRL_RPC_TESTING_E2E_H_

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/control.grpc.pb.h"
#include "rpc/handshake.h"
#include "rpc/testing/process.h"
#include "rpc/wire.h"
#include "swirl/channel.h"
#include "transport/device.h"
#include "transport/verbs/device_ops.h"

namespace swirl::testing {

inline constexpr char kServer[] = "rpc/testing/test_server";
inline constexpr size_t kMaxClientNameForTest = internal::kMaxClientName;

inline uint32_t Id(const char* method) { return rpc_wire::MethodId(method); }

inline absl::StatusOr<std::shared_ptr<Channel>> Connect(int port, const std::string& token = "e2e",
                                                        ChannelOptions options = {}) {
  options.auth_token = token;
  options.client_name = "e2e_test";
  return Channel::Create(absl::StrCat("127.0.0.1:", port), options);
}

inline std::string Echo(Channel& channel, const std::string& request) {
  std::string response;
  absl::Status s = CallRaw(channel, Id("/test.E2E/Echo"), request, &response, {});
  return s.ok() ? response : s.ToString();
}

// A stub of the Control service of the server on this host's `port`.
inline std::unique_ptr<control::Control::Stub> ControlStub(int port) {
  return control::Control::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
}

inline absl::StatusOr<control::StatsResponse> Stats(int port, const std::string& token = "e2e") {
  auto stub = ControlStub(port);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  if (!token.empty()) ctx.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  control::StatsRequest request;
  control::StatsResponse response;
  grpc::Status s = stub->Stats(&ctx, request, &response);
  if (!s.ok()) return absl::UnavailableError(s.error_message());
  return response;
}

// The server's request count once it reaches `n`, or as it stands after 10 s.
inline uint64_t ServerRequestsReaching(int port, uint64_t n) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  uint64_t seen = 0;
  while (seen < n && absl::Now() < deadline) {
    auto stats = Stats(port);
    if (stats.ok()) seen = stats->server().requests();
    if (seen < n) absl::SleepFor(absl::Milliseconds(10));  // the server needs the CPU more
  }
  return seen;
}

class E2ETest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = SpawnServer(kServer, {});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = new ChildProcess(std::move(server->first));
    port_ = server->second;
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static inline ChildProcess* server_ = nullptr;
  static inline int port_ = 0;
};

// Capabilities a raw Connect declares: a `kind` device with the channel defaults' credits and
// sizes, able to invalidate remotely.
// The kind of device this test's processes use (SWIRL_DEVICE: soft0, or rdma-core:soft0 in
// e2e_test_rdma_core), as a client declares it.
inline std::string OwnDeviceKind() {
  auto ctx = swirl::OpenDevice("");
  return ctx.ok() ? verbs::DeviceKindName((*ctx)->kind()) : "unknown";
}

inline void DeclareCapabilities(control::Capabilities* caps,
                                const std::string& kind = OwnDeviceKind()) {
  caps->set_device_kind(kind);
  caps->set_recv_credits(32);
  caps->set_recv_buffer_size(4096);
  caps->set_max_message_size(4096 - 32);
  caps->set_remote_invalidation(true);
}

// Sends `request` to the server's Connect as it is, with the test token.
inline grpc::Status ConnectRaw(int port, const control::ConnectRequest& request,
                               control::ConnectResponse* response) {
  auto stub = ControlStub(port);
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer e2e");
  return stub->Connect(&ctx, request, response);
}

}  // namespace swirl::testing

#endif  // SWIRL_RPC_TESTING_E2E_H_
