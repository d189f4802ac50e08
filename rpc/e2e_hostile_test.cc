// End-to-end tests against rpc/testing/test_server in another process with a hand-rolled client
// that completes the real handshake and then sends malformed or random messages: only its own
// connection fails.

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

}  // namespace
}  // namespace swirl
