// A steady-state call allocates nothing: no operator new on the client (from the stub call to
// its returned status) or on the server (from the receive completion to the posted response),
// with raw bytes and with protobuf messages (issue 20: per-call allocation is per-call cost).
//
// A counting global operator new counts this thread's allocations while armed. The engine's
// cases drive a client and a server worker on this thread (rpc/testing/worker_pair.h), so both
// sides' work is counted; the public-API case counts the calling thread of a caller-driven
// channel, which does all of the client's work.

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <string>

#include "examples/echo/echo.pb.h"
#include "examples/echo/echo.swirl.h"
#include "examples/echo/echo_service.h"
#include "rpc/testing/worker_pair.h"
#include "swirl/call.h"
#include "swirl/channel.h"
#include "swirl/method_id.h"
#include "swirl/server.h"
#include "swirl/service.h"

namespace {

thread_local bool t_counting = false;
thread_local uint64_t t_allocations = 0;

void* Allocate(size_t n) {
  if (t_counting) ++t_allocations;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* AllocateAligned(size_t n, std::align_val_t align) {
  if (t_counting) ++t_allocations;
  const size_t a = static_cast<size_t>(align);
  if (void* p = std::aligned_alloc(a, (n + a - 1) / a * a)) return p;
  throw std::bad_alloc();
}

// Counts the allocations of this thread while alive.
class AllocationCounter {
 public:
  AllocationCounter() : before_(t_allocations) { t_counting = true; }
  ~AllocationCounter() { t_counting = false; }
  uint64_t count() const { return t_allocations - before_; }

 private:
  uint64_t before_;
};

}  // namespace

void* operator new(size_t n) { return Allocate(n); }
void* operator new[](size_t n) { return Allocate(n); }
void* operator new(size_t n, std::align_val_t a) { return AllocateAligned(n, a); }
void* operator new[](size_t n, std::align_val_t a) { return AllocateAligned(n, a); }
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  if (t_counting) ++t_allocations;
  return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](size_t n, const std::nothrow_t&) noexcept {
  if (t_counting) ++t_allocations;
  return std::malloc(n == 0 ? 1 : n);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { std::free(p); }

namespace swirl {
namespace {

constexpr int kWarmup = 200;
constexpr int kCalls = 2000;

class RawEcho final : public Service {
 public:
  RawEcho() : Service("test.Steady") {
    AddRawMethod("Echo", [](ServerContext&, absl::string_view in, ResponseWriter& out) {
      return out.Append(in) ? absl::OkStatus() : absl::ResourceExhaustedError("too big");
    });
  }
};

TEST(SteadyState, TheCounterSeesAnAllocation) {
  // The counter must be able to fail the cases below.
  AllocationCounter counter;
  auto* p = new std::string(100, 'x');
  delete p;
  EXPECT_GE(counter.count(), 1u);
}

TEST(SteadyState, ARawCallAllocatesNothingOnEitherSide) {
  RawEcho service;
  auto pair = testing::WorkerPair::Create({&service});
  ASSERT_TRUE(pair.ok()) << pair.status();
  const std::string payload(64, 'r');
  std::string response;
  ClientCall call;
  call.SetMethod(MethodId("/test.Steady/Echo"));
  call.SetRequestBytes(payload);
  call.SetResponseBytes(&response);
  for (int i = 0; i < kWarmup; ++i) ASSERT_TRUE((*pair)->RoundTrip(call).ok());
  uint64_t allocations;
  {
    AllocationCounter counter;
    for (int i = 0; i < kCalls; ++i) {
      absl::Status s = (*pair)->RoundTrip(call);
      if (!s.ok()) FAIL() << s;
    }
    allocations = counter.count();
  }
  EXPECT_EQ(response, payload);
  EXPECT_EQ(allocations, 0u) << "over " << kCalls << " calls";
}

TEST(SteadyState, AProtobufCallAllocatesNothingOnEitherSide) {
  examples::EchoServiceImpl service;
  auto pair = testing::WorkerPair::Create({&service});
  ASSERT_TRUE(pair.ok()) << pair.status();
  examples::EchoRequest request;
  request.set_payload(std::string(64, 'p'));
  examples::EchoResponse response;
  ClientCall call;
  call.SetMethod(MethodId("/swirl.examples.Echo/Echo"));
  call.SetRequest(&request);
  call.SetResponse(&response);
  for (int i = 0; i < kWarmup; ++i) ASSERT_TRUE((*pair)->RoundTrip(call).ok());
  uint64_t allocations;
  {
    AllocationCounter counter;
    for (int i = 0; i < kCalls; ++i) {
      request.set_sequence(i);
      absl::Status s = (*pair)->RoundTrip(call);
      if (!s.ok()) FAIL() << s;
    }
    allocations = counter.count();
  }
  EXPECT_EQ(response.payload(), request.payload());
  EXPECT_EQ(response.sequence(), kCalls - 1);
  EXPECT_EQ(allocations, 0u) << "over " << kCalls << " calls";
}

// The generated stub's blocking call on a caller-driven channel: everything the client does
// runs on this thread.
TEST(SteadyState, AStubCallAllocatesNothingOnTheCallingThread) {
  examples::EchoServiceImpl service;
  ServerOptions server_options;
  server_options.address = "127.0.0.1:0";
  Server server(server_options);
  ASSERT_TRUE(server.RegisterService(&service).ok());
  ASSERT_TRUE(server.Start().ok());
  ChannelOptions options;
  options.driver = ChannelOptions::Driver::kCaller;
  auto channel = Channel::Create(server.address(), options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  examples::EchoStub stub(**channel);
  examples::EchoRequest request;
  request.set_payload(std::string(64, 's'));
  examples::EchoResponse response;
  for (int i = 0; i < kWarmup; ++i) ASSERT_TRUE(stub.Echo(request, &response).ok());
  uint64_t allocations;
  {
    AllocationCounter counter;
    for (int i = 0; i < kCalls; ++i) {
      request.set_sequence(i);
      absl::Status s = stub.Echo(request, &response);
      if (!s.ok()) FAIL() << s;
    }
    allocations = counter.count();
  }
  EXPECT_EQ(response.sequence(), kCalls - 1);
  EXPECT_EQ(allocations, 0u) << "over " << kCalls << " calls";
}

}  // namespace
}  // namespace swirl
