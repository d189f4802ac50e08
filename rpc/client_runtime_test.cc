// ClientRuntime: which channels share a worker, explicitly (rpc/client_runtime.h). Channels
// with equal options share the process default; channels whose options conflict never do; a
// runtime passed in is shared by the channels given it, with its settings, and a channel whose
// own settings conflict with it is refused. One server in this process serves them all.

#include "swirl/client_runtime.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "rpc/wire.h"
#include "swirl/call.h"
#include "swirl/channel.h"
#include "swirl/server.h"
#include "swirl/service.h"

namespace swirl {
namespace {

class RawEcho final : public Service {
 public:
  RawEcho() : Service("test.Runtime") {
    AddRawMethod("Echo", [](ServerContext&, absl::string_view in, ResponseWriter& out) {
      return out.Append(in) ? absl::OkStatus() : absl::ResourceExhaustedError("too big");
    });
  }
};

class ClientRuntimeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    echo_ = new RawEcho();
    ServerOptions options;
    options.address = "127.0.0.1:0";
    server_ = new Server(options);
    ASSERT_TRUE(server_->RegisterService(echo_).ok());
    ASSERT_TRUE(server_->Start().ok());
  }
  static void TearDownTestSuite() {
    delete server_;
    delete echo_;
  }

  static absl::StatusOr<std::shared_ptr<Channel>> Connect(const ChannelOptions& options = {}) {
    return Channel::Create(absl::StrCat("127.0.0.1:", server_->port()), options);
  }

  // An echo through `channel`: its worker runs.
  static void ExpectWorks(Channel& channel) {
    std::string response;
    absl::Status s = CallRaw(channel, rpc_wire::MethodId("/test.Runtime/Echo"), "ping",
                             &response, CallOptions{absl::Seconds(10)});
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(response, "ping");
  }

  static RawEcho* echo_;
  static Server* server_;
};

RawEcho* ClientRuntimeTest::echo_ = nullptr;
Server* ClientRuntimeTest::server_ = nullptr;

TEST_F(ClientRuntimeTest, ChannelsWithEqualOptionsShareTheProcessDefault) {
  auto a = Connect();
  auto b = Connect();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_NE((*a)->runtime(), nullptr);
  EXPECT_EQ((*a)->runtime(), (*b)->runtime());
  auto shared = ClientRuntime::Shared();
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(*shared, (*a)->runtime());
  ExpectWorks(**a);
  ExpectWorks(**b);
}

// The fields the old per-process map left out of its key (keepalive, window lease, worker core:
// the first channel's silently won) and one it had (credits): each keeps channels apart, and
// each channel's runtime has that channel's settings.
TEST_F(ClientRuntimeTest, ChannelsWhoseOptionsConflictNeverShareAWorker) {
  auto plain = Connect();
  ASSERT_TRUE(plain.ok()) << plain.status();
  ChannelOptions keepalive, lease, core, credits;
  keepalive.transport.keepalive = absl::Seconds(1);
  lease.transport.window_lease = absl::Seconds(2);
  core.worker_core = 0;
  credits.transport.credits = 48;
  for (const ChannelOptions* options : {&keepalive, &lease, &core, &credits}) {
    auto other = Connect(*options);
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_NE((*other)->runtime(), (*plain)->runtime());
    EXPECT_EQ((*other)->runtime()->options().transport, options->transport);
    EXPECT_EQ((*other)->runtime()->options().worker_core, options->worker_core);
    ExpectWorks(**other);
  }
  auto other = Connect(credits);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ((*other)->negotiated().server_credits, 48u);  // what the channel offered
}

// A runtime made by the user is shared by the channels given it, which run with its settings.
TEST_F(ClientRuntimeTest, AnExplicitRuntimeIsSharedWithItsSettings) {
  ClientRuntimeOptions runtime_options;
  runtime_options.transport.credits = 40;
  auto runtime = ClientRuntime::Create(runtime_options);
  ASSERT_TRUE(runtime.ok()) << runtime.status();
  ChannelOptions options;
  options.runtime = *runtime;
  auto a = Connect(options);
  auto b = Connect(options);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*a)->runtime(), *runtime);
  EXPECT_EQ((*b)->runtime(), *runtime);
  EXPECT_EQ((*a)->negotiated().server_credits, 40u);
  // Not the process default for the same options: made by the user, shared by whom they give it.
  auto shared = ClientRuntime::Shared(runtime_options);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_NE(*shared, *runtime);
  ExpectWorks(**a);
  ExpectWorks(**b);
}

TEST_F(ClientRuntimeTest, AChannelWhoseSettingsConflictWithItsRuntimeIsRefused) {
  ClientRuntimeOptions runtime_options;
  runtime_options.transport.credits = 40;
  auto runtime = ClientRuntime::Create(runtime_options);
  ASSERT_TRUE(runtime.ok()) << runtime.status();
  ChannelOptions options;
  options.runtime = *runtime;
  options.transport.credits = 64;
  auto refused = Connect(options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  options.transport = runtime_options.transport;  // equal: fine
  EXPECT_TRUE(Connect(options).ok());
  options.worker_core = 1;
  refused = Connect(options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  options.worker_core = -1;
  options.driver = ChannelOptions::Driver::kCaller;  // drives a worker of its own
  refused = Connect(options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
}

TEST_F(ClientRuntimeTest, CallerDrivenAndDedicatedChannelsHaveTheirOwn) {
  ChannelOptions caller, dedicated;
  caller.driver = ChannelOptions::Driver::kCaller;
  dedicated.dedicated_worker = true;
  for (const ChannelOptions* options : {&caller, &dedicated}) {
    auto a = Connect(*options);
    auto b = Connect(*options);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_NE((*a)->runtime(), (*b)->runtime());
    auto shared = ClientRuntime::Shared();
    ASSERT_TRUE(shared.ok()) << shared.status();
    EXPECT_NE((*a)->runtime(), *shared);
    ExpectWorks(**a);
  }
}

// The process default goes with the last channel on it: nothing holds a worker nobody uses.
TEST_F(ClientRuntimeTest, TheDefaultGoesWithItsLastChannel) {
  ChannelOptions options;
  options.transport.keepalive = absl::Seconds(3);  // a runtime no other test uses
  std::weak_ptr<ClientRuntime> runtime;
  {
    auto channel = Connect(options);
    ASSERT_TRUE(channel.ok()) << channel.status();
    runtime = (*channel)->runtime();
    ASSERT_FALSE(runtime.expired());
  }
  EXPECT_TRUE(runtime.expired());
}

}  // namespace
}  // namespace swirl
