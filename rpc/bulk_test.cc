// Bulk transfers end to end against rpc/testing/test_server in another process: negotiation of
// the invalidation and bulk modes, mirror-mode give-ups, window grants of every size, given-up
// uploads, and the per-connection cap on unacknowledged downloads. Every mode's round trips are
// in bulk_modes_test; a misbehaving client's, in bulk_security_test.

#include <gtest/gtest.h>
#include <signal.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "rpc/testing/bulk.h"
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/server_stats.h"
#include "rpc/testing/slowdown.h"
#include "rpc/testing/test_data.h"
#include "rpc/wire.h"
#include "swirl/channel.h"

namespace swirl {
namespace {

using bulk_testing::ConnectTo;
using bulk_testing::ExpectEchoes;
using bulk_testing::ExpectFillsInto;
using bulk_testing::ExpectHealthy;
using bulk_testing::Id;
using bulk_testing::kServer;
using bulk_testing::Payload;
using bulk_testing::ServerStats;
using bulk_testing::Stats;
using rpc_wire::BulkDescriptor;
using rpc_wire::MessageHeader;
using swirl::testing::Fnv;
using swirl::testing::Pattern;
using swirl::testing::ServerStatsWhen;

TEST(BulkNegotiation, FallbackIsRefusedWhenRemoteInvalidationIsRequired) {
  auto server = testing::SpawnServer(kServer, {"--no_local_fallback"});
  ASSERT_TRUE(server.ok()) << server.status();
  ChannelOptions options;
  options.auth_token = "e2e";
  options.transport.invalidation = InvalidationPolicy::kLocalOnly;
  auto channel = Channel::Create(absl::StrCat("127.0.0.1:", server->second), options);
  ASSERT_FALSE(channel.ok());
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(channel.status().message().find("peer's device"), absl::string_view::npos)
      << channel.status();
}

TEST(BulkNegotiation, FallbackInForceIsLoggedAsAWarning) {
  auto server = testing::SpawnServer(kServer, {});
  ASSERT_TRUE(server.ok()) << server.status();
  ChannelOptions options;
  options.auth_token = "e2e";
  options.transport.invalidation = InvalidationPolicy::kLocalOnly;
  ::testing::internal::CaptureStderr();
  auto channel = Channel::Create(absl::StrCat("127.0.0.1:", server->second), options);
  const std::string logged = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(channel.ok()) << channel.status();
  EXPECT_EQ((*channel)->negotiated().invalidation, InvalidationMode::kLocal);
  const size_t at = logged.find("remote invalidation unavailable");
  ASSERT_NE(at, std::string::npos) << logged;
  const size_t line = logged.rfind('\n', at);
  EXPECT_EQ(logged[line == std::string::npos ? 0 : line + 1], 'W') << "not a warning: " << logged;
}

// The static-rkey benchmark mode (one long-lived rkey for a whole pool, no windows) is gone: a
// client that still asks for it (its old enum value, 2) is refused as asking for an unknown
// mode, never served without windows, and the server serves everyone else as before.
TEST(BulkNegotiation, TheRetiredStaticRkeyModeIsRefused) {
  auto server = testing::SpawnServer(kServer, {});
  ASSERT_TRUE(server.ok()) << server.status();
  testing::ChildProcess child = std::move(server->first);
  testing::RogueConnection rogue;
  const absl::Status refused = rogue.Connect(server->second, "e2e", static_cast<control::BulkMode>(2));
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("unknown bulk mode"), absl::string_view::npos) << refused;
  ChannelOptions options;
  options.auth_token = "e2e";
  auto good = Channel::Create(absl::StrCat("127.0.0.1:", server->second), options);
  ASSERT_TRUE(good.ok()) << good.status();
  ExpectHealthy(**good, 13);
}

// ---- Security: what a misbehaving client can and cannot do ------------------------------------

// Downloads a peer leaves unacknowledged hold pool memory every connection of the worker shares:
// past download_bytes_per_connection the server answers RESOURCE_EXHAUSTED instead of exposing
// more, and an acknowledgement makes room again.
TEST(BulkMirror, GivingUpWhileTheServerStillWritesTheReplyKeepsTheConnection) {
  // Mirror mode: the reply window over `landing` is the server's to WRITE until it answers.
  // A deadline passing meanwhile must not revoke it under the server (which would fail the
  // server's WRITE, and with it the connection): the call ends once the server is done.
  auto server = testing::SpawnServer(kServer, {});
  ASSERT_TRUE(server.ok()) << server.status();
  ChannelOptions options;
  options.bulk_mode = BulkMode::kMirror;
  auto channel = ConnectTo(server->second, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto landing = (*channel)->AllocateBulk(100000);
  ASSERT_TRUE(landing.ok()) << landing.status();
  // Bulk data with the request makes it a mirror call, with a reply window over `landing`.
  auto attachment = (*channel)->AllocateBulk(8192);
  ASSERT_TRUE(attachment.ok()) << attachment.status();
  attachment->resize(8192);
  CallOptions call_options;
  call_options.timeout = absl::Milliseconds(50);
  call_options.request_bulk = &*attachment;
  call_options.response_bulk = &*landing;
  std::string response;
  absl::Status s =
      CallRaw(**channel, Id("/test.E2E/SlowFill"), "400 100000", &response, call_options);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE((*channel)->connected());
  EXPECT_EQ((*channel)->LocalStats().windows_remote_invalidated, 2u)
      << "both windows ended by the server's SEND_WITH_INV, none revoked under it";
  // A call that outlasts the first one's handler: had the server's WRITE failed, the
  // connection would fail under it.
  CallOptions again;
  again.response_bulk = &*landing;
  s = CallRaw(**channel, Id("/test.E2E/SlowFill"), "600 100000", &response, again);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(response, "filled");
  ExpectHealthy(**channel, 1);
  ExpectFillsInto(**channel, "/test.E2E/Fill", *landing, {100000});
  EXPECT_EQ(Stats(**channel).violations, 0u);
}

TEST(BulkWindows, UploadGrantsOfEverySizeLeaveWindowsForDownloads) {
  // One upload of each size class collects window_credits (8) unused grants per class; eight
  // downloads at once must still each get a window. Caller-driven: nothing reads (and so
  // releases) a download until all eight have been answered.
  auto server = testing::SpawnServer(kServer, {});
  ASSERT_TRUE(server.ok()) << server.status();
  ChannelOptions options;
  options.driver = ChannelOptions::Driver::kCaller;
  auto channel = ConnectTo(server->second, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  for (size_t size = 4096; size <= (1u << 20); size *= 2) {
    auto data = (*channel)->AllocateBulk(size);
    ASSERT_TRUE(data.ok()) << data.status();
    data->resize(size);
    CallOptions call_options;
    call_options.request_bulk = &*data;
    std::string response;
    absl::Status s = CallRaw(**channel, Id("/test.E2E/Sum"), "", &response, call_options);
    ASSERT_TRUE(s.ok()) << size << ": " << s;
  }
  constexpr int kDownloads = 8;
  std::vector<ClientCall> calls(kDownloads);
  std::vector<BulkBuffer> landings(kDownloads);
  std::vector<std::string> responses(kDownloads);
  const std::string request = "100000";
  for (int i = 0; i < kDownloads; ++i) {
    auto b = (*channel)->AllocateBulk(100000);
    ASSERT_TRUE(b.ok()) << b.status();
    landings[i] = std::move(*b);
    CallOptions call_options;
    call_options.response_bulk = &landings[i];
    calls[i].SetMethod(Id("/test.E2E/Fill"));
    calls[i].SetRequestBytes(request);
    calls[i].SetResponseBytes(&responses[i]);
    calls[i].SetOptions(call_options);
    (*channel)->Start(&calls[i]);
  }
  for (int i = 0; i < kDownloads; ++i) {
    ASSERT_TRUE(calls[i].Wait().ok()) << i << ": " << calls[i].status();
    EXPECT_EQ(responses[i], "filled");
    ASSERT_EQ(landings[i].size(), 100000u);
    EXPECT_EQ(landings[i].data()[4242], testing::Pattern(4242));
  }
}

TEST(BulkWindows, AMaximumBulkSizeThatIsNoPowerOfTwo) {
  // 10 MiB: a 9 MiB upload falls in the 16 MiB size class, but its grant may not exceed 10 MiB.
  auto server = testing::SpawnServer(kServer, {"--max_bulk_size=10485760"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = ConnectTo(server->second);
  ASSERT_TRUE(channel.ok()) << channel.status();
  EXPECT_EQ((*channel)->negotiated().max_bulk_size, 10485760u);
  constexpr size_t kSize = 9 << 20;
  auto data = (*channel)->AllocateBulk(kSize);
  ASSERT_TRUE(data.ok()) << data.status();
  data->resize(kSize);
  for (size_t i = 0; i < kSize; ++i) data->data()[i] = static_cast<char>(i * 31);
  CallOptions call_options;
  call_options.request_bulk = &*data;
  std::string response;
  absl::Status s = CallRaw(**channel, Id("/test.E2E/Sum"), "", &response, call_options);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(response, absl::StrCat(kSize, ":", Fnv(data->view())));
  EXPECT_TRUE((*channel)->connected());
}

TEST(BulkUpload, AGivenUpUploadReturnsItsBufferOnlyOnceTheWriteIsDone) {
  // A 16 MiB upload whose deadline passes while its RDMA WRITE is still reading the buffer:
  // the call may complete only once the WRITE is done, so that overwriting the buffer right
  // after cannot change what the server receives. The WRITE is made slow on purpose, whatever
  // the machine's speed: the server process is stopped (SIGSTOP) while the call runs, and on
  // the soft device the responder that places a WRITE runs in the server's process, so the
  // WRITE cannot finish before SIGCONT.
  // The caller drives the channel, so between calls nobody answers the server's keepalive:
  // filling and summing 16 MiB below on this thread must stay inside it (a ping after 1 s of
  // silence, given up 3 s later, test_server's default), which a sanitizer build's slowdown
  // would not.
  auto server = testing::SpawnServer(
      kServer, {absl::StrCat("--keepalive_ms=", 1000 * testing::kSlowdown)});
  ASSERT_TRUE(server.ok()) << server.status();
  ChannelOptions options;
  options.driver = ChannelOptions::Driver::kCaller;
  auto channel = ConnectTo(server->second, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  constexpr size_t kSize = 16 << 20;
  auto data = (*channel)->AllocateBulk(kSize);
  ASSERT_TRUE(data.ok()) << data.status();
  data->resize(kSize);
  // One upload of the size first, with no deadline: the server's grants for the size class
  // are then in hand, so the one below leaves at once instead of waiting for a grant.
  std::memset(data->data(), 0x5a, kSize);
  CallOptions call_options;
  call_options.request_bulk = &*data;
  std::string response;
  absl::Status s = CallRaw(**channel, Id("/test.E2E/Sum"), "", &response, call_options);
  ASSERT_TRUE(s.ok()) << s;
  for (size_t i = 0; i < kSize; ++i) data->data()[i] = static_cast<char>(i * 7 + 1);
  const std::string expected = absl::StrCat(kSize, ":", Fnv(data->view()));

  ASSERT_TRUE(server->first.StopAndWait().ok());
  call_options.timeout = absl::Milliseconds(20);
  ClientCall call;
  call.SetMethod(Id("/test.E2E/Sum"));
  call.SetRequestBytes("");
  call.SetResponseBytes(&response);
  call.SetOptions(call_options);
  (*channel)->Start(&call);
  // Well past the deadline, with the WRITE held up: the call must still be running.
  const absl::Time until = absl::Now() + absl::Milliseconds(300);
  while (absl::Now() < until && !call.done()) (*channel)->Poll();
  const bool done_while_stopped = call.done();
  server->first.Signal(SIGCONT);
  EXPECT_FALSE(done_while_stopped) << "the call completed while its WRITE could not have";
  EXPECT_EQ(call.Wait().code(), absl::StatusCode::kDeadlineExceeded) << call.status();
  std::memset(data->data(), 0, kSize);  // the caller's buffer is its own again
  // The server saw the whole upload as it was when the call started.
  std::string last;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (last != expected && absl::Now() < deadline) {
    ASSERT_TRUE(CallRaw(**channel, Id("/test.E2E/LastSum"), "", &last, {}).ok());
    if (last != expected) absl::SleepFor(absl::Milliseconds(5));  // leave the server the CPU
  }
  EXPECT_EQ(last, expected);
}

TEST(BulkLimits, UnacknowledgedDownloadsAreCappedPerConnection) {
  auto server = testing::SpawnServer(kServer, {"--download_bytes=262144"});
  ASSERT_TRUE(server.ok()) << server.status();
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(server->second, "e2e").ok());
  auto download = [&](uint64_t* id) -> absl::StatusOr<testing::Received> {
    if (auto s = rogue.Call("/test.E2E/Fill", "65536", 0, 0, id); !s.ok()) return s;
    return rogue.Receive(rpc_wire::kResponse);
  };
  std::vector<std::pair<uint64_t, BulkDescriptor>> held;
  for (int i = 0; i < 4; ++i) {  // 4 x 64 KiB: exactly the budget
    uint64_t id;
    auto r = download(&id);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->header.status, 0u) << i << ": " << r->payload;
    ASSERT_TRUE(r->header.flags & rpc_wire::kFlagBulk);
    BulkDescriptor d;
    std::memcpy(&d, r->payload.data(), sizeof(d));
    held.push_back({id, d});
  }
  uint64_t id;
  auto refused = download(&id);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->header.status, static_cast<uint32_t>(absl::StatusCode::kResourceExhausted))
      << refused->payload;
  EXPECT_FALSE(refused->header.flags & rpc_wire::kFlagBulk);
  // Reading and acknowledging one makes room for one more.
  std::string data;
  auto st = rogue.Read(held[0].second.addr, held[0].second.rkey, held[0].second.length, &data);
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(*st, IBV_WC_SUCCESS);
  MessageHeader ack{.version = rpc_wire::kProtocolVersion,
                    .type = rpc_wire::kBulkAck,
                    .request_id = held[0].first,
                    .aux = held[0].second.rkey};
  ASSERT_TRUE(rogue.Send(ack, {}, held[0].second.rkey).ok());
  // One QP, in order: the server has the acknowledgement before the next call.
  auto again = download(&id);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->header.status, 0u) << again->payload;
  // Other clients never noticed.
  ChannelOptions options;
  options.auth_token = "e2e";
  auto good = Channel::Create(absl::StrCat("127.0.0.1:", server->second), options);
  ASSERT_TRUE(good.ok()) << good.status();
  ExpectHealthy(**good, 13);
}

}  // namespace
}  // namespace swirl
