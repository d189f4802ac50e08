// End-to-end tests of the RPC engine over the soft device with the server in a separate process
// (rpc/testing/test_server).

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
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/test_data.h"
#include "rpc/wire.h"
#include "swirl/channel.h"
#include "transport/device.h"
#include "transport/verbs/verbs.h"

namespace swirl {
namespace {

constexpr char kServer[] = "rpc/testing/test_server";
constexpr size_t kMaxClientNameForTest = internal::kMaxClientName;

uint32_t Id(const char* method) { return rpc_wire::MethodId(method); }

absl::StatusOr<std::shared_ptr<Channel>> Connect(int port, const std::string& token = "e2e",
                                                 ChannelOptions options = {}) {
  options.auth_token = token;
  options.client_name = "e2e_test";
  return Channel::Create(absl::StrCat("127.0.0.1:", port), options);
}

std::string Echo(Channel& channel, const std::string& request) {
  std::string response;
  absl::Status s = CallRaw(channel, Id("/test.E2E/Echo"), request, &response, {});
  return s.ok() ? response : s.ToString();
}

// A stub of the Control service of the server on this host's `port`.
std::unique_ptr<control::Control::Stub> ControlStub(int port) {
  return control::Control::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                                       grpc::InsecureChannelCredentials()));
}

absl::StatusOr<control::StatsResponse> Stats(int port, const std::string& token = "e2e") {
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
uint64_t ServerRequestsReaching(int port, uint64_t n) {
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
    auto server = testing::SpawnServer(kServer, {});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = new testing::ChildProcess(std::move(server->first));
    port_ = server->second;
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static testing::ChildProcess* server_;
  static int port_;
};
testing::ChildProcess* E2ETest::server_ = nullptr;
int E2ETest::port_ = 0;

TEST_F(E2ETest, ManyConcurrentCallsFromSeveralThreads) {
  for (auto driver : {ChannelOptions::Driver::kBackgroundThread, ChannelOptions::Driver::kCaller}) {
    ChannelOptions options;
    options.driver = driver;
    auto channel = Connect(port_, "e2e", options);
    ASSERT_TRUE(channel.ok()) << channel.status();
    std::atomic<int> good{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < 400; ++i) {
          const std::string request = absl::StrCat("t", t, "#", i);
          if (Echo(**channel, request) == request) good.fetch_add(1);
        }
      });
    }
    // Meanwhile, pipelined asynchronous calls with callbacks from this thread.
    constexpr int kAsync = 256;
    std::vector<ClientCall> calls(kAsync);
    std::vector<std::string> responses(kAsync);
    std::atomic<int> async_good{0};
    for (int i = 0; i < kAsync; ++i) {
      calls[i].SetMethod(Id("/test.E2E/Echo"));
      static std::vector<std::string>* requests = new std::vector<std::string>(kAsync);
      (*requests)[i] = absl::StrCat("async", i);
      calls[i].SetRequestBytes((*requests)[i]);
      calls[i].SetResponseBytes(&responses[i]);
      calls[i].SetCallback([&, i](absl::Status s) {
        if (s.ok() && responses[i] == absl::StrCat("async", i)) async_good.fetch_add(1);
      });
      (*channel)->Start(&calls[i]);
    }
    for (auto& call : calls) EXPECT_TRUE(call.Wait().ok()) << call.status();
    for (auto& th : threads) th.join();
    EXPECT_EQ(good.load(), 1600);
    EXPECT_EQ(async_good.load(), kAsync);
  }
}

// A caller-driven client that starts far more calls than it has credits, without polling in
// between, is held back by its own send credits (the server returns them only with answers the
// client has not read yet), so the server never parks more than a credit window of answers for
// it: every call completes, none is shed, and the connection stays up.
TEST_F(E2ETest, ACallerThatDoesNotPollIsSlowedNotShed) {
  ChannelOptions options;
  options.driver = ChannelOptions::Driver::kCaller;
  auto channel = Connect(port_, "e2e", options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  constexpr int kCalls = 2000;  // many credit windows' worth
  std::vector<ClientCall> calls(kCalls);
  std::vector<std::string> requests(kCalls), responses(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    requests[i] = absl::StrCat("burst", i);
    calls[i].SetMethod(Id("/test.E2E/Echo"));
    calls[i].SetRequestBytes(requests[i]);
    calls[i].SetResponseBytes(&responses[i]);
    (*channel)->Start(&calls[i]);  // nobody polls until the waits below
  }
  int good = 0;
  for (int i = 0; i < kCalls; ++i) {
    absl::Status s = calls[i].Wait();
    if (s.ok() && responses[i] == requests[i]) {
      ++good;
    } else if (good + 10 > i) {
      ADD_FAILURE() << "call " << i << ": " << s;
    }
  }
  EXPECT_EQ(good, kCalls);
  EXPECT_EQ(Echo(**channel, "still up"), "still up");
}

TEST_F(E2ETest, ErrorsCarryCodeAndMessage) {
  auto channel = Connect(port_);
  ASSERT_TRUE(channel.ok()) << channel.status();
  std::string response;
  absl::Status s = CallRaw(**channel, Id("/test.E2E/Fail"), "5", &response, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "failed as asked");
  s = CallRaw(**channel, Id("/test.E2E/NoSuchMethod"), "", &response, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  // Larger than one message: it travels as bulk data, both ways.
  std::string large(3 * (*channel)->negotiated().max_message_size + 17, 'L');
  s = CallRaw(**channel, Id("/test.E2E/Echo"), large, &response, {});
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(response, large);
  // Larger than the negotiated bulk maximum: refused locally, connection unharmed.
  std::string huge((*channel)->negotiated().max_bulk_size + 1, 'x');
  s = CallRaw(**channel, Id("/test.E2E/Echo"), huge, &response, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(Echo(**channel, "still fine"), "still fine");
}

TEST_F(E2ETest, ARequestToAOneWayMethodIsRefusedWithoutRunningIt) {
  auto channel = Connect(port_);
  ASSERT_TRUE(channel.ok()) << channel.status();
  std::string before;
  ASSERT_TRUE(CallRaw(**channel, Id("/test.E2E/GateEntered"), "", &before, {}).ok());
  std::string response;
  absl::Status s = CallRaw(**channel, Id("/test.E2E/Gate"), "", &response,
                           CallOptions{absl::Seconds(5)});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("one-way"), absl::string_view::npos) << s;
  // Had the handler been queued anyway, its pool thread would enter it within this window.
  const absl::Time until = absl::Now() + absl::Milliseconds(300);
  do {
    std::string entered;
    ASSERT_TRUE(CallRaw(**channel, Id("/test.E2E/GateEntered"), "", &entered, {}).ok());
    ASSERT_EQ(entered, before) << "the one-way handler ran";
    absl::SleepFor(absl::Milliseconds(20));
  } while (absl::Now() < until);
  EXPECT_EQ(Echo(**channel, "still here"), "still here");
}

// Whether `call` completes within `limit` (it is cancelled and waited for if not, so it never
// outlives the test's buffers).
bool CompletesWithin(ClientCall& call, absl::Duration limit) {
  const absl::Time deadline = absl::Now() + limit;
  while (!call.done() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  if (call.done()) return true;
  call.Cancel();
  (void)call.Wait();
  return false;
}

// The handler sleeps for a minute unless cancelled: a call that ends at its 100 ms deadline
// did not wait for it (the 10 s below only bounds the wait), and the server hears of it.
TEST_F(E2ETest, DeadlineExceededAndTheServerHearsOfIt) {
  auto channel = Connect(port_);
  ASSERT_TRUE(channel.ok()) << channel.status();
  std::string response;
  std::string count;
  ASSERT_TRUE(CallRaw(**channel, Id("/test.E2E/Cancelled"), "", &count, {}).ok());
  int before = 0;
  ASSERT_TRUE(absl::SimpleAtoi(count, &before));
  ClientCall call;
  call.SetMethod(Id("/test.E2E/Sleep"));
  call.SetRequestBytes("60000");
  call.SetResponseBytes(&response);
  CallOptions options;
  options.timeout = absl::Milliseconds(100);
  call.SetOptions(options);
  (*channel)->Start(&call);
  ASSERT_TRUE(CompletesWithin(call, absl::Seconds(10))) << "the call outlived its deadline";
  EXPECT_EQ(call.status().code(), absl::StatusCode::kDeadlineExceeded) << call.status();
  // The caller told the server; its handler stops early and counts it.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  int cancelled = before;
  while (cancelled == before && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    ASSERT_TRUE(CallRaw(**channel, Id("/test.E2E/Cancelled"), "", &count, {}).ok());
    ASSERT_TRUE(absl::SimpleAtoi(count, &cancelled));
  }
  EXPECT_GT(cancelled, before);
  EXPECT_EQ(Echo(**channel, "after"), "after");
}

// As above: the handler would run for a minute, the cancelled call ends at once.
TEST_F(E2ETest, CancelCompletesACallInFlight) {
  auto channel = Connect(port_);
  ASSERT_TRUE(channel.ok()) << channel.status();
  ClientCall call;
  std::string response;
  call.SetMethod(Id("/test.E2E/Sleep"));
  call.SetRequestBytes("60000");
  call.SetResponseBytes(&response);
  (*channel)->Start(&call);
  call.Cancel();
  ASSERT_TRUE(CompletesWithin(call, absl::Seconds(10))) << "a cancelled call waited for its handler";
  EXPECT_EQ(call.status().code(), absl::StatusCode::kCancelled) << call.status();
  EXPECT_EQ(Echo(**channel, "next"), "next");
}

TEST_F(E2ETest, ServerCallsTheClientBackOverTheSameConnection) {
  class ClientService : public Service {
   public:
    ClientService() : Service("test.Client") {
      AddRawMethod("Ping", [](ServerContext&, absl::string_view in, ResponseWriter& out) {
        out.Append(absl::StrCat("pong:", in));
        return absl::OkStatus();
      });
    }
  } client_service;
  ChannelOptions options;
  options.services = {&client_service};
  auto channel = Connect(port_, "e2e", options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  std::string response;
  absl::Status s = CallRaw(**channel, Id("/test.E2E/CallBack"), "hi", &response, {});
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(response, "pong:hi");
}

TEST_F(E2ETest, AHandlerSendsOneWayMessagesBeyondItsCreditsWithoutWaiting) {
  // NotifyBack runs on the server's worker and sends 200 one-way messages back over the same
  // connection: more than its credits, so most wait behind them. Waiting for any of them on
  // the worker's own thread would wait forever; CallOneWay queues them and returns.
  class ClientService : public Service {
   public:
    ClientService() : Service("test.Client") {
      AddRawMethod(
          "Note",
          [this](ServerContext&, absl::string_view in, ResponseWriter&) {
            control::DisconnectRequest note;
            if (note.ParseFromArray(in.data(), static_cast<int>(in.size())) &&
                note.connection_id() == static_cast<uint64_t>(received.load())) {
              received.fetch_add(1);
            }
            return absl::OkStatus();
          },
          MethodOptions{Execution::kWorker, /*one_way=*/true});
    }
    std::atomic<int> received{0};
  } client_service;
  ChannelOptions options;
  options.services = {&client_service};
  auto channel = Connect(port_, "e2e", options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  std::string response;
  absl::Status s = CallRaw(**channel, Id("/test.E2E/NotifyBack"), "200", &response,
                           CallOptions{absl::Seconds(10)});
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(response, "sent");
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (client_service.received.load() < 200 && absl::Now() < deadline) {
    std::this_thread::yield();
  }
  EXPECT_EQ(client_service.received.load(), 200) << "all in order, none lost";
  EXPECT_EQ(Echo(**channel, "after"), "after");
}

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

// Capabilities a raw Connect declares: a `kind` device with the channel defaults' credits and
// sizes, able to invalidate remotely.
// The kind of device this test's processes use (SWIRL_DEVICE: soft0, or rdma-core:soft0 in
// e2e_test_rdma_core), as a client declares it.
std::string OwnDeviceKind() {
  auto ctx = swirl::OpenDevice("");
  return ctx.ok() ? verbs::DeviceKindName((*ctx)->kind()) : "unknown";
}

void DeclareCapabilities(control::Capabilities* caps, const std::string& kind = OwnDeviceKind()) {
  caps->set_device_kind(kind);
  caps->set_recv_credits(32);
  caps->set_recv_buffer_size(4096);
  caps->set_max_message_size(4096 - 32);
  caps->set_remote_invalidation(true);
}

// Sends `request` to the server's Connect as it is, with the test token.
grpc::Status ConnectRaw(int port, const control::ConnectRequest& request,
                        control::ConnectResponse* response) {
  auto stub = ControlStub(port);
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer e2e");
  return stub->Connect(&ctx, request, response);
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

// Blocking handlers wait in a queue for the pool, holding what they were sent, and the peer has
// its credits back at once: one connection may have only 2 x its credits queued. One-way calls
// (no call slot bounds them) to a handler that blocks until the gate opens: exactly that many
// get through, the rest are dropped, and the server answers everyone throughout.
TEST_F(E2ETest, QueuedBlockingCallsAreBoundedPerConnection) {
  auto flood = Connect(port_);
  ASSERT_TRUE(flood.ok()) << flood.status();
  std::string passed_before;
  ASSERT_TRUE(CallRaw(**flood, Id("/test.E2E/CloseGate"), "", &passed_before, {}).ok());
  ASSERT_TRUE(CallRaw(**flood, Id("/test.E2E/GatePassed"), "", &passed_before, {}).ok());
  int base = 0;
  ASSERT_TRUE(absl::SimpleAtoi(passed_before, &base));
  const auto passed_since = [&base](const std::string& passed) {
    int n = 0;
    return absl::SimpleAtoi(passed, &n) ? std::to_string(n - base) : passed;
  };
  const int limit = 2 * static_cast<int>((*flood)->negotiated().client_credits);
  for (int i = 0; i < 3 * limit; ++i) {
    ClientCall call;
    call.SetMethod(Id("/test.E2E/Gate"));
    call.SetOneWay(true);
    (*flood)->Start(&call);
    ASSERT_TRUE(call.Wait().ok()) << i << ": " << call.status();
  }
  auto other = Connect(port_);
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_EQ(Echo(**other, "meanwhile"), "meanwhile");
  ASSERT_EQ(Echo(**flood, "meanwhile"), "meanwhile");
  std::string passed;
  ASSERT_TRUE(CallRaw(**other, Id("/test.E2E/GatePassed"), "", &passed, {}).ok());
  EXPECT_EQ(passed_since(passed), "0") << "the gate is shut: nothing got through yet";
  ASSERT_TRUE(CallRaw(**other, Id("/test.E2E/OpenGate"), "", &passed, {}).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  do {
    absl::SleepFor(absl::Milliseconds(10));
    ASSERT_TRUE(CallRaw(**other, Id("/test.E2E/GatePassed"), "", &passed, {}).ok());
  } while (passed_since(passed) != std::to_string(limit) && absl::Now() < deadline);
  EXPECT_EQ(passed_since(passed), std::to_string(limit));
  // Nothing beyond the limit was queued to run later.
  ASSERT_EQ(Echo(**flood, "after"), "after");
  ASSERT_TRUE(CallRaw(**other, Id("/test.E2E/GatePassed"), "", &passed, {}).ok());
  EXPECT_EQ(passed_since(passed), std::to_string(limit));
}

// A hand-rolled client that completes the real handshake and then puts garbage on the wire.
class RogueClient {
 public:
  absl::Status Connect(int port) {
    auto ctx = OpenDevice("");
    if (!ctx.ok()) return ctx.status();
    ctx_ = *ctx;
    pd_ = *verbs::ProtectionDomain::Create(ctx_);
    cq_ = *verbs::CompletionQueue::Create(ctx_, 256);
    verbs::QueuePairConfig config;
    config.send_cq = cq_;
    config.recv_cq = cq_;
    config.max_send_wr = 64;
    config.max_recv_wr = 64;
    config.max_inline_data = 256;
    qp_ = *verbs::QueuePair::Create(pd_, config);
    buffer_.resize(64 * 4096);
    mr_ = *verbs::MemoryRegion::Register(pd_, buffer_.data(), buffer_.size(),
                                         IBV_ACCESS_LOCAL_WRITE);
    for (int i = 0; i < 32; ++i) {
      ibv_sge sge{reinterpret_cast<uint64_t>(buffer_.data() + i * 4096), 4096, mr_->lkey()};
      ibv_recv_wr wr{};
      wr.wr_id = i;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      ibv_recv_wr* bad;
      ibv_post_recv(qp_->get(), &wr, &bad);
    }
    verbs::ConnectOptions co;
    auto local = qp_->LocalAddress(7, co);
    if (!local.ok()) return local.status();
    auto stub = ControlStub(port);
    grpc::ClientContext gctx;
    gctx.AddMetadata("authorization", "Bearer e2e");
    control::ConnectRequest request;
    request.set_protocol_version(internal::kControlProtocolVersion);
    *request.mutable_address() = internal::ToProto(*local);
    DeclareCapabilities(request.mutable_capabilities());
    control::ConnectResponse response;
    grpc::Status s = stub->Connect(&gctx, request, &response);
    if (!s.ok()) return absl::UnavailableError(s.error_message());
    auto server = internal::FromProto(response.address());
    if (!server.ok()) return server.status();
    if (auto st = qp_->Connect(*server, 7, co); !st.ok()) return st;
    return absl::OkStatus();
  }

  // Sends `bytes` as one message (inline).
  void Send(const std::string& bytes) {
    ibv_sge sge{reinterpret_cast<uint64_t>(bytes.data()), static_cast<uint32_t>(bytes.size()), 0};
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_send_wr* bad;
    ibv_post_send(qp_->get(), &wr, &bad);
  }

  // Waits until `n` of our sends have completed (taken by the server's device, or failed):
  // each message has then been handed to the server, or never will be. False at the deadline.
  bool WaitForSends(int n, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    ibv_wc wc[8];
    while (sends_done_ < n) {
      if (absl::Now() > deadline) return false;
      const int got = cq_->Poll(8, wc);
      for (int i = 0; i < got; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS || !(wc[i].opcode & IBV_WC_RECV)) ++sends_done_;
      }
    }
    return true;
  }

 private:
  std::shared_ptr<verbs::Context> ctx_;
  std::shared_ptr<verbs::ProtectionDomain> pd_;
  std::shared_ptr<verbs::CompletionQueue> cq_;
  std::unique_ptr<verbs::QueuePair> qp_;
  std::string buffer_;
  std::unique_ptr<verbs::MemoryRegion> mr_;
  int sends_done_ = 0;
};

std::string Header(rpc_wire::MessageHeader h, const std::string& payload = "") {
  std::string out(reinterpret_cast<const char*>(&h), sizeof(h));
  return out + payload;
}

// Each attack is a well-formed request but for the one field it names, from a rogue that
// speaks the protocol correctly otherwise (its probe for being cut off is a valid ping that
// returns the credits it owes), so the cut-off can only come from the check the attack is named
// for. The first "attack" is a well-formed call: it must be answered and cost nothing.
TEST_F(E2ETest, MalformedHeadersFailOnlyTheirOwnConnection) {
  auto good = Connect(port_);
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_EQ(Echo(**good, "before"), "before");
  auto before = Stats(port_);
  ASSERT_TRUE(before.ok());

  const uint32_t echo = Id("/test.E2E/Echo");
  constexpr uint8_t v = rpc_wire::kProtocolVersion;
  const auto request = [&](rpc_wire::MessageHeader h) {
    h.method_id = echo;
    h.request_id = 1;
    return h;
  };
  rpc_wire::MessageHeader well_formed{.version = v, .type = rpc_wire::kRequest};
  struct Attack {
    const char* name;
    std::string bytes;
  };
  auto with = [&](auto&& mutate, const std::string& payload = "") {
    rpc_wire::MessageHeader h = request(well_formed);
    h.payload_len = static_cast<uint32_t>(payload.size());
    mutate(h);
    return Header(h, payload);
  };
  const std::vector<Attack> attacks = {
      {"short message", std::string(7, 'x')},
      {"other protocol version", with([](auto& h) { h.version = v + 1; })},
      {"unknown type", with([](auto& h) { h.type = rpc_wire::kMaxType + 1; })},
      {"payload_len lies", with([](auto& h) { h.payload_len = 4000; }, "abc")},
      {"credits from nowhere", with([](auto& h) { h.credits = 100000; })},
      {"unknown flags", with([](auto& h) { h.flags = 0x80; })},
      {"status on a request", with([](auto& h) { h.status = 3; })},
      {"request without a method", with([](auto& h) { h.method_id = 0; })},
      {"bulk flag without a descriptor", with([](auto& h) { h.flags = rpc_wire::kFlagBulk; })},
      {"unknown aux bits", with([](auto& h) { h.aux = 0x100; })},
  };
  {
    SCOPED_TRACE("well-formed control");
    testing::RogueConnection rogue;
    ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
    ASSERT_TRUE(rogue.SendRaw(with([](auto&) {}, "ok")).ok());
    auto response = rogue.Receive(rpc_wire::kResponse);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->payload, "ok");
    EXPECT_FALSE(rogue.CutOff(absl::Milliseconds(300))) << "a correct client was cut off";
  }
  for (const auto& [name, bytes] : attacks) {
    SCOPED_TRACE(name);
    testing::RogueConnection rogue;
    ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
    ASSERT_TRUE(rogue.SendRaw(bytes).ok());
    EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
    EXPECT_EQ(Echo(**good, name), name) << "another client's connection must be unaffected";
  }
  auto after = Stats(port_);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->server().protocol_errors(),
            before->server().protocol_errors() + attacks.size());
  EXPECT_EQ(Echo(**good, "after"), "after");
}

// Random messages from rogue clients, biased toward the edges ValidateHeader guards (versions,
// types, flags, lengths that lie, credits, statuses, bulk descriptors pointing anywhere), mixed
// with well-formed calls. Whatever each rogue sends, the server must keep answering another
// client correctly: it may cut the rogue off, never crash or stall. Seeds are the iteration
// index; SWIRL_FUZZ_ITERATIONS runs more.
TEST_F(E2ETest, RandomMessagesFailOnlyTheirOwnConnection) {
  int iterations = 12;
  if (const char* env = std::getenv("SWIRL_FUZZ_ITERATIONS")) iterations = std::atoi(env);
  auto good = Connect(port_);
  ASSERT_TRUE(good.ok()) << good.status();
  const std::vector<uint32_t> methods = {Id("/test.E2E/Echo"), Id("/test.E2E/Fail"),
                                         Id("/test.E2E/PoolEcho"), Id("/test.E2E/Fill")};
  auto before = Stats(port_);
  ASSERT_TRUE(before.ok()) << before.status();
  for (int seed = 0; seed < iterations; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937_64 rng(static_cast<uint64_t>(seed));
    auto pick = [&](std::initializer_list<uint64_t> values) {
      return values.begin()[rng() % values.size()];
    };
    // Even seeds: mostly hostile fields; odd seeds: mostly well-formed calls.
    const uint64_t odds = seed % 2 == 0 ? 3 : 20;
    auto hostile = [&] { return rng() % odds == 0; };
    RogueClient rogue;
    ASSERT_TRUE(rogue.Connect(port_).ok());
    const int messages = 1 + static_cast<int>(rng() % 4);
    for (int m = 0; m < messages; ++m) {
      std::string payload(rng() % 160, '\0');
      for (char& c : payload) c = static_cast<char>(rng());
      rpc_wire::MessageHeader h{};
      h.version = hostile() ? static_cast<uint8_t>(rng()) : rpc_wire::kProtocolVersion;
      h.type = static_cast<uint8_t>(hostile() ? rng() % 12 : pick({rpc_wire::kRequest,
                                                                   rpc_wire::kRequest,
                                                                   rpc_wire::kOneWay}));
      h.flags = static_cast<uint16_t>(
          hostile() ? pick({rpc_wire::kFlagBulk, rpc_wire::kFlagReplyChunk,
                            rpc_wire::kFlagBulk | rpc_wire::kFlagReplyChunk, rng()})
                    : 0);
      h.method_id = hostile() ? static_cast<uint32_t>(rng()) : methods[rng() % methods.size()];
      h.request_id = hostile() ? rng() : static_cast<uint64_t>(m + 1);
      h.status = hostile() ? static_cast<uint32_t>(rng() % 20) : 0;
      h.payload_len = static_cast<uint32_t>(
          hostile() ? pick({payload.size() + 1, payload.size() - 1, 4096, rng()})
                    : payload.size());
      h.credits = hostile() ? static_cast<uint32_t>(pick({1, 32, 1000, rng()})) : 0;
      h.aux = hostile() ? static_cast<uint32_t>(rng()) : 0;
      if (h.flags & rpc_wire::kFlagBulk) {
        // A descriptor of memory the rogue never exposed.
        rpc_wire::BulkDescriptor d{rng(), static_cast<uint32_t>(rng() % (1 << 20)),
                                   static_cast<uint32_t>(rng())};
        payload.replace(0, std::min(payload.size(), sizeof(d)),
                        reinterpret_cast<const char*>(&d), sizeof(d));
      }
      rogue.Send(Header(h, payload));
    }
    ASSERT_TRUE(rogue.WaitForSends(messages, absl::Seconds(10)));
    const std::string probe = absl::StrCat("after seed ", seed);
    ASSERT_EQ(Echo(**good, probe), probe) << "another client's connection must be unaffected";
  }
  // The server must have found protocol errors (most seeds send something invalid), but not on
  // every rogue: some sent only well-formed calls. A rogue is cut off at its first violation, so
  // it counts once at most.
  EXPECT_EQ(Echo(**good, "end"), "end");
  auto after = Stats(port_);
  ASSERT_TRUE(after.ok()) << after.status();
  const uint64_t errors = after->server().protocol_errors() - before->server().protocol_errors();
  EXPECT_GT(errors, 0u);
  EXPECT_LT(errors, static_cast<uint64_t>(iterations));
  std::printf("%d rogue clients: %lu protocol errors\n", iterations,
              static_cast<unsigned long>(errors));
}

TEST(E2EShutdown, GracefulShutdownLetsAcceptedCallsFinish) {
  auto server = testing::SpawnServer(kServer, {"--shutdown_ms=5000"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto& [process, port] = *server;
  auto channel = Connect(port);
  ASSERT_TRUE(channel.ok()) << channel.status();
  constexpr int kCalls = 4;
  std::vector<ClientCall> calls(kCalls);
  std::vector<std::string> responses(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    calls[i].SetMethod(Id("/test.E2E/Sleep"));
    calls[i].SetRequestBytes("400");
    calls[i].SetResponseBytes(&responses[i]);
    (*channel)->Start(&calls[i]);
  }
  // Wait until the server has them all, then ask it to stop.
  const uint64_t seen = ServerRequestsReaching(port, kCalls);
  ASSERT_GE(seen, static_cast<uint64_t>(kCalls));
  process.Signal(SIGTERM);
  for (int i = 0; i < kCalls; ++i) {
    EXPECT_TRUE(calls[i].Wait().ok()) << calls[i].status();
    EXPECT_EQ(responses[i], "done");
  }
  auto exit_code = process.Wait(absl::Seconds(20));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
  // After the server is gone, calls fail cleanly instead of hanging.
  std::string response;
  CallOptions options;
  options.timeout = absl::Seconds(10);
  absl::Status s = CallRaw(**channel, Id("/test.E2E/Echo"), "x", &response, options);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST(E2EShutdown, BlockingHandlersPastTheDeadlineAreCancelledAndWaitedFor) {
  // Four pool threads run handlers that would last 20 s (two one-way Gates) and 10 minutes
  // (two Sleeps); six more Sleeps wait in the pool's queue. A 100 ms deadline must end the
  // server well within the 15 s it is given (so before any handler could end by itself): the
  // running handlers see
  // IsCancelled() once their connection is closed, one-way ones included, the queued ones are
  // dropped, and nothing reaches a worker after it is gone (which ASan would report).
  auto server = testing::SpawnServer(kServer, {"--shutdown_ms=100"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto& [process, port] = *server;
  auto channel = Connect(port);
  ASSERT_TRUE(channel.ok()) << channel.status();
  constexpr int kOneWay = 2;
  for (int i = 0; i < kOneWay; ++i) {
    ClientCall gate;
    gate.SetMethod(Id("/test.E2E/Gate"));
    gate.SetOneWay(true);
    (*channel)->Start(&gate);
    ASSERT_TRUE(gate.Wait().ok()) << gate.status();
  }
  constexpr int kCalls = 8;
  std::vector<ClientCall> calls(kCalls);
  std::vector<std::string> responses(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    calls[i].SetMethod(Id("/test.E2E/Sleep"));
    calls[i].SetRequestBytes("600000");
    calls[i].SetResponseBytes(&responses[i]);
    (*channel)->Start(&calls[i]);
  }
  const uint64_t seen = ServerRequestsReaching(port, kCalls + kOneWay);
  ASSERT_GE(seen, static_cast<uint64_t>(kCalls + kOneWay));
  auto exit_code = process.Stop(absl::Seconds(15));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status() << ": the handlers were not cancelled";
  EXPECT_EQ(*exit_code, 0);
  for (int i = 0; i < kCalls; ++i) {
    EXPECT_EQ(calls[i].Wait().code(), absl::StatusCode::kUnavailable) << calls[i].status();
  }
}

TEST(E2EShutdown, DrainWaitsForADownloadTheClientIsStillReading) {
  // The caller-driven client below answers no keepalive and acknowledges its download only
  // when it drives: keepalive and lease are generous, so that only the drain is tested.
  auto server = testing::SpawnServer(
      kServer, {"--shutdown_ms=20000", "--keepalive_ms=20000", "--window_lease_ms=30000"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto& [process, port] = *server;
  // Caller-driven: the response (a window over 200,000 bytes) arrives while nobody drives, so
  // the client's READ of it waits until this thread calls Wait().
  ChannelOptions options;
  options.driver = ChannelOptions::Driver::kCaller;
  auto channel = Connect(port, "e2e", options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  constexpr size_t kSize = 200000;
  auto landing = (*channel)->AllocateBulk(kSize);
  ASSERT_TRUE(landing.ok()) << landing.status();
  ClientCall call;
  const std::string request = std::to_string(kSize);
  std::string response;
  CallOptions call_options;
  call_options.response_bulk = &*landing;
  call.SetMethod(Id("/test.E2E/Fill"));
  call.SetRequestBytes(request);
  call.SetResponseBytes(&response);
  call.SetOptions(call_options);
  (*channel)->Start(&call);
  const uint64_t seen = ServerRequestsReaching(port, 1);
  ASSERT_EQ(seen, 1u);
  process.Signal(SIGTERM);
  // The drain has begun once new connections are refused.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  bool refused = false;
  while (!refused && absl::Now() < deadline) {
    ChannelOptions probe;
    probe.connect_timeout = absl::Seconds(2);
    refused = !Connect(port, "e2e", probe).ok();
  }
  ASSERT_TRUE(refused);
  ASSERT_TRUE(call.Wait().ok()) << call.status();
  EXPECT_EQ(response, "filled");
  ASSERT_EQ(landing->size(), kSize);
  for (size_t i = 0; i < kSize; i += 997) ASSERT_EQ(landing->data()[i], testing::Pattern(i)) << i;
  auto exit_code = process.Wait(absl::Seconds(20));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

TEST(E2EChannel, CloseWhileOtherThreadsCall) {
  auto server = testing::SpawnServer(kServer, {});
  ASSERT_TRUE(server.ok()) << server.status();
  for (auto driver : {ChannelOptions::Driver::kBackgroundThread, ChannelOptions::Driver::kCaller}) {
    ChannelOptions options;
    options.driver = driver;
    auto channel = Connect(server->second, "e2e", options);
    ASSERT_TRUE(channel.ok()) << channel.status();
    std::atomic<int> ok{0}, unavailable{0}, other{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        const absl::Time until = absl::Now() + absl::Seconds(20);
        for (int i = 0; absl::Now() < until; ++i) {
          const std::string request = absl::StrCat("t", t, "#", i);
          std::string response;
          absl::Status s = CallRaw(**channel, Id("/test.E2E/Echo"), request, &response,
                                   CallOptions{absl::Seconds(5)});
          if (s.ok() && response == request) {
            ok.fetch_add(1);
          } else if (s.code() == absl::StatusCode::kUnavailable) {
            unavailable.fetch_add(1);
            return;
          } else {
            other.fetch_add(1);
            return;
          }
        }
      });
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (ok.load() < 200 && absl::Now() < deadline) std::this_thread::yield();
    // No ASSERT before the joins: a test returning with the callers still running would end
    // the whole binary in std::terminate. Close ends them either way.
    EXPECT_GE(ok.load(), 200);
    std::thread second_closer([&] { (*channel)->Close(); });
    (*channel)->Close();
    second_closer.join();
    for (auto& t : threads) t.join();
    EXPECT_EQ(other.load(), 0);
    EXPECT_EQ(unavailable.load(), 4) << "every caller ends on UNAVAILABLE after Close";
    EXPECT_FALSE((*channel)->connected());
  }
}

TEST(E2ECredits, APeerGrantingMoreCreditsThanOurSendQueueHolds) {
  // The server reserves 256 receive buffers for each client; this client's send queue was
  // sized for its own 32 credits before it heard that. 200 calls started at once must all
  // complete on one connection, which stays healthy.
  auto server = testing::SpawnServer(kServer, {"--credits=256"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = Connect(server->second);
  ASSERT_TRUE(channel.ok()) << channel.status();
  EXPECT_EQ((*channel)->negotiated().client_credits, 256u);  // what the server grants us
  constexpr int kCalls = 200;
  std::vector<ClientCall> calls(kCalls);
  std::vector<std::string> requests(kCalls), responses(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    requests[i] = absl::StrCat("call ", i);
    calls[i].SetMethod(Id("/test.E2E/Echo"));
    calls[i].SetRequestBytes(requests[i]);
    calls[i].SetResponseBytes(&responses[i]);
    (*channel)->Start(&calls[i]);
  }
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_TRUE(calls[i].Wait().ok()) << i << ": " << calls[i].status();
    EXPECT_EQ(responses[i], requests[i]);
  }
  EXPECT_TRUE((*channel)->connected());
  EXPECT_EQ(Echo(**channel, "after"), "after");
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

TEST(E2EChurn, ThousandsOfConnectsDoNotLeak) {
#if defined(__SANITIZE_ADDRESS__)
  // ASan holds freed memory in quarantine (256 MiB by default), which would read as growth
  // here. Without quarantine the RSS check means the same as in a normal build; LeakSanitizer
  // checks the server again when it exits.
  const char* inherited = std::getenv("ASAN_OPTIONS");
  const std::string asan_options =
      absl::StrCat(inherited != nullptr ? inherited : "", ":quarantine_size_mb=0");
  setenv("ASAN_OPTIONS", asan_options.c_str(), 1);
#endif
  auto server = testing::SpawnServer(kServer, {"--max_per_client=8"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto& [process, port] = *server;
  constexpr int kWarmup = 200;
  constexpr int kTotal = 2000;
  int64_t rss_after_warmup = 0;
  int fds_after_warmup = 0;
  for (int i = 0; i < kTotal; ++i) {
    {
      auto channel = Connect(port);
      ASSERT_TRUE(channel.ok()) << "connect " << i << ": " << channel.status();
      ASSERT_EQ(Echo(**channel, "x"), "x") << "connect " << i;
    }
    if (i + 1 == kWarmup) {
      // The baseline is taken once the server has torn every connection down.
      const absl::Time settled = absl::Now() + absl::Seconds(10);
      absl::StatusOr<control::StatsResponse> now;
      do {
        absl::SleepFor(absl::Milliseconds(10));
        now = Stats(port);
      } while ((!now.ok() || now->server().connections_active() != 0) && absl::Now() < settled);
      ASSERT_TRUE(now.ok()) << now.status();
      ASSERT_EQ(now->server().connections_active(), 0u) << "warm-up connections still open";
      rss_after_warmup = process.RssKb();
      fds_after_warmup = process.OpenFds();
    }
  }
  // Every connection must be gone on the server side, its buffers back in the pool.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<control::StatsResponse> stats;
  do {
    stats = Stats(port);
    if (!stats.ok() || stats->server().connections_active() != 0) {
      absl::SleepFor(absl::Milliseconds(10));
    }
  } while ((!stats.ok() || stats->server().connections_active() != 0) && absl::Now() < deadline);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->server().connections_active(), 0u);
  EXPECT_EQ(stats->server().queue_pairs_live(), 0u);
  EXPECT_EQ(stats->server().connections_accepted(), static_cast<uint64_t>(kTotal));
  EXPECT_EQ(stats->server().connections_closed(), static_cast<uint64_t>(kTotal));
  EXPECT_EQ(stats->server().recv_buffers_free(), 0u) << "receive buffers not all re-posted";
  const int64_t rss = process.RssKb();
  const int fds = process.OpenFds();
#if defined(__SANITIZE_THREAD__)
  // TSan's shadow memory grows with every heap address ever used, so RSS says nothing here;
  // the counters above and the descriptor count below still do.
  std::printf("note: RSS check not applied under ThreadSanitizer (grew %ld KiB)\n",
              static_cast<long>(rss - rss_after_warmup));
#else
  EXPECT_LT(rss - rss_after_warmup, 16 * 1024) << "RSS grew from " << rss_after_warmup << " KiB";
#endif
  EXPECT_LE(fds, fds_after_warmup + 4) << "descriptors leak";
}

}  // namespace
}  // namespace swirl
