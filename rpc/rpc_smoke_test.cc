// In-process checks of the RPC engine over the soft device (the multi-process end-to-end suite
// is rpc/e2e_test.cc).

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "rpc/channel.h"
#include "rpc/server.h"
#include "rpc/service.h"
#include "rpc/wire.h"

namespace swirl {
namespace {

class EchoRaw : public Service {
 public:
  EchoRaw() : Service("test.Raw") {
    AddRawMethod("Echo", [](ServerContext&, absl::string_view request, ResponseWriter& out) {
      return out.Append(request) ? absl::OkStatus()
                                 : absl::ResourceExhaustedError("too big");
    });
    AddRawMethod("Fail", [](ServerContext&, absl::string_view, ResponseWriter&) {
      return absl::NotFoundError("nothing here");
    });
    AddRawMethod(
        "Slow",
        [](ServerContext& ctx, absl::string_view request, ResponseWriter& out) {
          const absl::Time until = absl::Now() + absl::Milliseconds(300);
          while (absl::Now() < until && !ctx.IsCancelled()) absl::SleepFor(absl::Milliseconds(1));
          out.Append(request);
          return absl::OkStatus();
        },
        MethodOptions{Execution::kThreadPool, false});
  }
};

uint32_t Id(const char* name) { return rpc_wire::MethodId(name); }

struct Fixture {
  EchoRaw service;
  std::unique_ptr<Server> server;
  Fixture() {
    ServerOptions options;
    options.address = "127.0.0.1:0";
    options.auth_token = "t0ken";
    server = std::make_unique<Server>(options);
    EXPECT_TRUE(server->RegisterService(&service).ok());
    absl::Status s = server->Start();
    EXPECT_TRUE(s.ok()) << s;
  }
};

TEST(RpcSmoke, RawEchoBothDrivers) {
  Fixture f;
  for (auto driver : {ChannelOptions::Driver::kCaller, ChannelOptions::Driver::kBackgroundThread}) {
    ChannelOptions options;
    options.auth_token = "t0ken";
    options.driver = driver;
    auto channel = Channel::Create(f.server->address(), options);
    ASSERT_TRUE(channel.ok()) << channel.status();
    for (int i = 0; i < 1000; ++i) {
      std::string request = "hello " + std::to_string(i);
      std::string response;
      absl::Status s = CallRaw(**channel, Id("/test.Raw/Echo"), request, &response, {});
      ASSERT_TRUE(s.ok()) << s;
      ASSERT_EQ(response, request);
    }
    std::string response;
    absl::Status s = CallRaw(**channel, Id("/test.Raw/Fail"), "x", &response, {});
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(s.message(), "nothing here");
    s = CallRaw(**channel, Id("/test.Raw/Missing"), "x", &response, {});
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
    CallOptions short_deadline;
    short_deadline.timeout = absl::Milliseconds(50);
    s = CallRaw(**channel, Id("/test.Raw/Slow"), "x", &response, short_deadline);
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
    s = CallRaw(**channel, Id("/test.Raw/Slow"), "slow", &response, {});
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(response, "slow");
  }
}

TEST(RpcSmoke, WrongTokenIsRefusedBeforeAnyQueuePair) {
  Fixture f;
  ChannelOptions options;
  options.auth_token = "wrong";
  auto channel = Channel::Create(f.server->address(), options);
  ASSERT_FALSE(channel.ok());
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kUnauthenticated);
  control::StatsResponse stats = f.server->Stats();
  EXPECT_EQ(stats.server().connections_refused(), 1u);
  EXPECT_EQ(stats.server().connections_accepted(), 0u);
  EXPECT_EQ(stats.connections_size(), 0);
}

TEST(RpcSmoke, ManyThreadsShareOneChannel) {
  Fixture f;
  ChannelOptions options;
  options.auth_token = "t0ken";
  auto channel = Channel::Create(f.server->address(), options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        std::string request = std::to_string(t) + ":" + std::to_string(i);
        std::string response;
        if (CallRaw(**channel, Id("/test.Raw/Echo"), request, &response, {}).ok() &&
            response == request) {
          ok.fetch_add(1);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 2000);
}

}  // namespace
}  // namespace swirl
