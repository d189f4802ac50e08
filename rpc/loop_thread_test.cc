// ClientCall::Wait() on the thread running the call's worker loop (from a callback or a handler)
// could never complete: that thread is the one that would complete it. The process aborts with
// a message instead of hanging (rpc/call.h). Death tests, with a server and channel in-process:
// each statement runs in a child process of its own ("threadsafe" style re-executes this binary
// for it), which either aborts as it must or, if it hangs, is ended by a watchdog with another
// exit, so that a missing check fails the test instead of hanging it.

#include <gtest/gtest.h>
#include <signal.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "rpc/wire.h"
#include "swirl/call.h"
#include "swirl/channel.h"
#include "swirl/server.h"
#include "swirl/service.h"

namespace swirl {
namespace {

constexpr char kAbortMessage[] =
    "ClientCall::Wait\\(\\) on the thread running its worker's loop .* could never complete";
constexpr char kToken[] = "loop";

uint32_t Id(const char* name) { return rpc_wire::MethodId(name); }

class LoopService : public Service {
 public:
  LoopService() : Service("test.Loop") {
    AddRawMethod("Echo", [](ServerContext&, absl::string_view in, ResponseWriter& out) {
      return out.Append(in) ? absl::OkStatus() : absl::ResourceExhaustedError("too big");
    });
    // An inline handler (the server's worker thread) that calls its caller back and waits.
    AddRawMethod("CallBackAndWait",
                 [](ServerContext& ctx, absl::string_view in, ResponseWriter& out) {
                   std::string answer;
                   absl::Status s = CallRaw(*ctx.caller(), Id("/test.Client/Echo"), in,
                                            &answer, CallOptions{absl::Seconds(5)});
                   out.Append(answer);
                   return s;
                 });
  }
};

class ClientService : public Service {
 public:
  ClientService() : Service("test.Client") {
    AddRawMethod("Echo", [](ServerContext&, absl::string_view in, ResponseWriter& out) {
      return out.Append(in) ? absl::OkStatus() : absl::ResourceExhaustedError("too big");
    });
  }
};

// A server and a channel to it, in this process. Made in the death test's child and never
// destroyed: the child ends with the abort (or the watchdog), with threads blocked for good.
struct World {
  LoopService service;
  ClientService client_service;
  std::unique_ptr<Server> server;
  std::shared_ptr<Channel> channel;

  explicit World(ChannelOptions::Driver driver) {
    ServerOptions options;
    options.address = "127.0.0.1:0";
    options.auth_token = kToken;
    server = std::make_unique<Server>(options);
    if (!server->RegisterService(&service).ok() || !server->Start().ok()) std::_Exit(2);
    ChannelOptions channel_options;
    channel_options.auth_token = kToken;
    channel_options.driver = driver;
    channel_options.services = {&client_service};
    auto created = Channel::Create(absl::StrCat("127.0.0.1:", server->port()), channel_options);
    if (!created.ok()) std::_Exit(2);
    channel = *created;
  }
};

// A bound on a hang: ends the process with exit code 3 (not SIGABRT) after 30 s.
void StartWatchdog() {
  std::thread([] {
    absl::SleepFor(absl::Seconds(30));
    std::_Exit(3);
  }).detach();
}

// The statement's thread has nothing more to do: the abort, or the watchdog, ends the process.
[[noreturn]] void AwaitTheEnd() {
  for (;;) absl::SleepFor(absl::Hours(1));
}

// Starts an echo on `world`'s channel whose callback (on the loop thread: the channel's worker,
// or the thread driving a caller-driven channel) calls `in_callback`.
void FromACallback(World* world, absl::AnyInvocable<void()> in_callback) {
  auto* call = new ClientCall;  // outlives this function: the process ends first
  call->SetMethod(Id("/test.Loop/Echo"));
  call->SetRequestBytes("first");
  call->SetCallback(
      [in_callback = std::move(in_callback)](absl::Status) mutable { in_callback(); });
  world->channel->Start(call);
  (void)call->Wait();  // caller-driven: drives, and runs the callback
  AwaitTheEnd();
}

// A callback that starts a second call on the same channel and waits for it.
void WaitForACallFromACallback(ChannelOptions::Driver driver) {
  StartWatchdog();
  auto* world = new World(driver);
  FromACallback(world, [world] {
    auto* second = new ClientCall;
    second->SetMethod(Id("/test.Loop/Echo"));
    second->SetRequestBytes("second");
    world->channel->Start(second);
    (void)second->Wait();
  });
}

TEST(LoopThreadDeathTest, ACallbackOnTheChannelsWorkerThatWaitsAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(WaitForACallFromACallback(ChannelOptions::Driver::kBackgroundThread),
              ::testing::KilledBySignal(SIGABRT), kAbortMessage);
}

TEST(LoopThreadDeathTest, ACallbackOnTheDrivingThreadOfACallerDrivenChannelThatWaitsAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(WaitForACallFromACallback(ChannelOptions::Driver::kCaller),
              ::testing::KilledBySignal(SIGABRT), kAbortMessage);
}

// ~ClientCall of a call in flight waits for it (rpc/call.h): on the loop thread, the same abort.
TEST(LoopThreadDeathTest, ACallbackThatDestroysACallInFlightAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        StartWatchdog();
        auto* world = new World(ChannelOptions::Driver::kBackgroundThread);
        FromACallback(world, [world] {
          ClientCall second;
          second.SetMethod(Id("/test.Loop/Echo"));
          second.SetRequestBytes("second");
          world->channel->Start(&second);
        });
      },
      ::testing::KilledBySignal(SIGABRT), kAbortMessage);
}

// A server's inline handler runs on its worker's loop thread: a call back to its caller that it
// waits for aborts the same way.
TEST(LoopThreadDeathTest, AnInlineHandlerThatWaitsForACallBackAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        StartWatchdog();
        auto* world = new World(ChannelOptions::Driver::kBackgroundThread);
        auto* response = new std::string;
        (void)CallRaw(*world->channel, Id("/test.Loop/CallBackAndWait"), "x", response,
                      CallOptions{absl::Seconds(20)});
        AwaitTheEnd();
      },
      ::testing::KilledBySignal(SIGABRT), kAbortMessage);
}

}  // namespace
}  // namespace swirl
