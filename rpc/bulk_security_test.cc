// The security properties of per-request windows against rpc/testing/test_server in another
// process, with a client that misbehaves on purpose (rpc/testing/rogue.h): dead keys, sealed
// windows, foreign and guessed keys, bounds, leases, forged acknowledgements and grants, and the
// per-connection and per-client bulk budgets.

#include <gtest/gtest.h>
#include <signal.h>

#include <bit>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "rpc/testing/bulk.h"
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/server_stats.h"
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

class BulkSecurityTest : public ::testing::Test {
 protected:
  virtual std::vector<std::string> ServerFlags() const { return {"--window_lease_ms=400"}; }

  void SetUp() override {
    auto server = testing::SpawnServer(kServer, ServerFlags());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::make_unique<testing::ChildProcess>(std::move(server->first));
    port_ = server->second;
    ChannelOptions options;
    options.auth_token = "e2e";
    auto good = Channel::Create(absl::StrCat("127.0.0.1:", port_), options);
    ASSERT_TRUE(good.ok()) << good.status();
    good_ = *good;
    ExpectHealthy(*good_, 1);
  }

  // Asks for a download of `size` bytes and returns the server's descriptor.
  BulkDescriptor Download(testing::RogueConnection& rogue, size_t size, uint64_t* request_id) {
    auto d = rogue.CallForDownload("/test.E2E/Fill", std::to_string(size), request_id);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return {};
    EXPECT_EQ(d->length, size);
    return *d;
  }

  // A bulk acknowledgement naming the window `named_rkey` (default: the one invalidated) and
  // sent as SEND_WITH_INV of `rkey`.
  absl::Status Ack(testing::RogueConnection& rogue, uint64_t request_id, uint32_t rkey,
                   std::optional<uint32_t> named_rkey = std::nullopt) {
    MessageHeader h{.version = rpc_wire::kProtocolVersion,
                    .type = rpc_wire::kBulkAck,
                    .request_id = request_id,
                    .aux = named_rkey.value_or(rkey)};
    return rogue.Send(h, {}, rkey);
  }

  // Upload windows granted to this rogue.
  std::vector<BulkDescriptor> Grants(testing::RogueConnection& rogue, uint32_t size,
                                     uint32_t count = 2) {
    auto grants = rogue.RequestWindows(size, count);
    EXPECT_TRUE(grants.ok()) << grants.status();
    return grants.ok() ? *std::move(grants) : std::vector<BulkDescriptor>();
  }

  void TearDown() override {
    if (good_ != nullptr) ExpectHealthy(*good_, 99);
  }

  std::unique_ptr<testing::ChildProcess> server_;
  int port_ = 0;
  std::shared_ptr<Channel> good_;
};

TEST_F(BulkSecurityTest, DownloadKeyIsDeadAfterTheAcknowledgement) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  auto before = good_->ServerStats();
  ASSERT_TRUE(before.ok()) << before.status();
  uint64_t id;
  const BulkDescriptor d = Download(rogue, 65536, &id);
  std::string data;
  auto st = rogue.Read(d.addr, d.rkey, d.length, &data);
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(*st, IBV_WC_SUCCESS);
  for (size_t i = 0; i < data.size(); i += 4093) ASSERT_EQ(data[i], Pattern(i));
  ASSERT_TRUE(Ack(rogue, id, d.rkey).ok());
  // The same key, after the SEND_WITH_INV that carried it: refused by the NIC.
  st = rogue.Read(d.addr, d.rkey, d.length, &data);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR);
  // The server's QP that refused it reports that on the device's asynchronous events, which the
  // server counts.
  auto now = ServerStatsWhen(*good_, [&](const StatsReport& st) {
    return st.server.async_qp_errors != before->server.async_qp_errors;
  });
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->server.async_qp_errors, before->server.async_qp_errors + 1);
  EXPECT_EQ(now->server.async_device_events, before->server.async_device_events);
  ExpectHealthy(*good_, 2);
}

TEST_F(BulkSecurityTest, UploadWindowIsSealedBeforeTheHandlerRuns) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  std::vector<BulkDescriptor> grants = Grants(rogue, 8192);
  ASSERT_FALSE(grants.empty());
  const BulkDescriptor g = grants[0];
  const std::string original = Payload(8192, 3);
  auto st = rogue.Write(g.addr, g.rkey, original);
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(*st, IBV_WC_SUCCESS);
  const BulkDescriptor d{g.addr, 8192, g.rkey};
  std::string payload(reinterpret_cast<const char*>(&d), sizeof(d));
  ASSERT_TRUE(rogue.Call("/test.E2E/Sum", payload, rpc_wire::kFlagBulk, g.rkey).ok());
  auto response = rogue.Receive(rpc_wire::kResponse);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->payload, absl::StrCat(original.size(), ":", Fnv(original)));
  // Writing again through the sealed window fails, and changed nothing.
  st = rogue.Write(g.addr, g.rkey, Payload(8192, 4));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR);
  ExpectHealthy(*good_, 3);
}

// The seal is what makes an upload safe to read: the SEND_WITH_INV that carries the request
// revokes the window it names, so the caller can no longer change the data under the handler.
// A request that skips it (a plain SEND, or the key of another of its windows) is a violation,
// and the handler never runs.
TEST_F(BulkSecurityTest, AnUploadNotSealedByItsOwnWindowEndsTheConnection) {
  std::string last_before;
  ASSERT_TRUE(CallRaw(*good_, Id("/test.E2E/LastSum"), "", &last_before, {}).ok());
  for (const bool other_key : {false, true}) {
    SCOPED_TRACE(other_key ? "SEND_WITH_INV of another window" : "plain SEND");
    testing::RogueConnection rogue;
    ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
    const ServerStats before = Stats(*good_);
    std::vector<BulkDescriptor> grants = Grants(rogue, 8192, 2);
    ASSERT_EQ(grants.size(), 2u);
    const BulkDescriptor g = grants[0];
    auto st = rogue.Write(g.addr, g.rkey, Payload(8192, other_key ? 6 : 5));
    ASSERT_TRUE(st.ok());
    ASSERT_EQ(*st, IBV_WC_SUCCESS);
    const BulkDescriptor d{g.addr, 8192, g.rkey};
    const std::string payload(reinterpret_cast<const char*>(&d), sizeof(d));
    ASSERT_TRUE(
        rogue.Call("/test.E2E/Sum", payload, rpc_wire::kFlagBulk, other_key ? grants[1].rkey : 0)
            .ok());
    EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
    EXPECT_EQ(Stats(*good_).violations, before.violations + 1);
  }
  std::string last_after;
  ASSERT_TRUE(CallRaw(*good_, Id("/test.E2E/LastSum"), "", &last_after, {}).ok());
  EXPECT_EQ(last_after, last_before) << "the handler ran on an unsealed upload";
  ExpectHealthy(*good_, 15);
}

TEST_F(BulkSecurityTest, KeysOfAnotherConnectionFail) {
  testing::RogueConnection owner;
  testing::RogueConnection thief;
  ASSERT_TRUE(owner.Connect(port_, "e2e").ok());
  ASSERT_TRUE(thief.Connect(port_, "e2e").ok());
  uint64_t id;
  const BulkDescriptor d = Download(owner, 4096, &id);
  std::string data;
  auto st = thief.Read(d.addr, d.rkey, d.length, &data);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR) << "a type 2 window answers only its own QP";
  // The key itself was good: its owner can still use it.
  st = owner.Read(d.addr, d.rkey, d.length, &data);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(*st, IBV_WC_SUCCESS);
  EXPECT_TRUE(Ack(owner, id, d.rkey).ok());
  ExpectHealthy(*good_, 4);
}

TEST_F(BulkSecurityTest, GuessedKeysFail) {
  // A wrong key byte on a real window address.
  {
    testing::RogueConnection rogue;
    ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
    uint64_t id;
    const BulkDescriptor d = Download(rogue, 4096, &id);
    std::string data;
    auto st = rogue.Read(d.addr, d.rkey ^ 0x5a, d.length, &data);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR);
  }
  // Keys made up wholesale, each on a fresh connection (a failed access ends a connection).
  for (uint32_t guess : {0x100u, 0x1234500u, 0xdeadbeefu, 0x7fffff00u}) {
    testing::RogueConnection rogue;
    ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
    uint64_t id;
    const BulkDescriptor d = Download(rogue, 4096, &id);
    std::string data;
    auto st = rogue.Read(d.addr, guess, 64, &data);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR) << std::hex << guess;
  }
  ExpectHealthy(*good_, 5);
}

TEST_F(BulkSecurityTest, OutOfBoundsAccessFails) {
  for (int which = 0; which < 3; ++which) {
    testing::RogueConnection rogue;
    ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
    uint64_t id;
    const BulkDescriptor d = Download(rogue, 8192, &id);
    std::string data;
    absl::StatusOr<ibv_wc_status> st;
    if (which == 0) st = rogue.Read(d.addr, d.rkey, d.length + 1, &data);
    if (which == 1) st = rogue.Read(d.addr - 64, d.rkey, 64, &data);
    if (which == 2) st = rogue.Write(d.addr, d.rkey, "read-only window");
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR) << "case " << which;
  }
  ExpectHealthy(*good_, 6);
}

// Beyond RoCE: on the soft device each bind of a window draws a fresh random key slot, so the
// rkeys of one window's successive binds differ in about 31 random bits, where a NIC's
// (ibv_inc_rkey) differ only in the 8 of the key byte. Sequential downloads, each acknowledged
// before the next, reuse one window of the server's. Through rdma-core (the *_rdma_core variant:
// the server's device is a NIC to swirl) the window keeps its slot and only the key byte moves,
// never repeating the last one.
TEST_F(BulkSecurityTest, SuccessiveBindsOfOneWindowDrawFreshKeySlots) {
  const char* device = std::getenv("SWIRL_DEVICE");
  const bool fresh_slots = device == nullptr || !absl::StartsWith(device, "rdma-core:");
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  // Fewer than the credits the rogue offers (it returns none).
  constexpr int kBinds = 30;
  std::vector<uint32_t> rkeys;
  for (int i = 0; i < kBinds; ++i) {
    uint64_t id;
    const BulkDescriptor d = Download(rogue, 4096, &id);
    ASSERT_NE(d.rkey, 0u);
    rkeys.push_back(d.rkey);
    ASSERT_TRUE(Ack(rogue, id, d.rkey).ok());
  }
  absl::flat_hash_set<uint32_t> keys(rkeys.begin(), rkeys.end());
  absl::flat_hash_set<uint32_t> slots;
  uint32_t varying = 0;  // the bits in which some rkey differs from the first
  for (uint32_t rkey : rkeys) {
    slots.insert(rkey >> 8);
    varying |= rkey ^ rkeys[0];
  }
  if (fresh_slots) {
    // 30 draws of ~31 random bits: a repeat, fewer than 15 distinct slots of 2^17, or fewer
    // than 24 of the 32 bits ever moving are each far less likely than 2^-50 by chance. With
    // key bytes alone every bind stays in one slot and only 8 bits move.
    EXPECT_EQ(keys.size(), rkeys.size()) << "an rkey came back";
    EXPECT_GE(slots.size(), kBinds / 2u) << "binds stayed in " << slots.size() << " key slots";
    EXPECT_GE(std::popcount(varying), 24) << std::hex << "rkeys vary only in bits 0x" << varying;
  } else {
    EXPECT_EQ(slots.size(), 1u) << "a NIC's window keeps its index";
    for (int i = 1; i < kBinds; ++i) EXPECT_NE(rkeys[i] & 0xff, rkeys[i - 1] & 0xff) << i;
  }
  ExpectHealthy(*good_, 16);
}

TEST_F(BulkSecurityTest, AWindowNeverAcknowledgedIsRevokedAtLeaseExpiry) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  const ServerStats before = Stats(*good_);
  uint64_t id;
  const BulkDescriptor d = Download(rogue, 4096, &id);
  // Never acknowledge. The server revokes it by itself once the 400 ms lease is over.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  ServerStats now = before;
  while (now.lease_expired == before.lease_expired && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));  // leave the server the CPU
    now = Stats(*good_);
  }
  EXPECT_EQ(now.lease_expired, before.lease_expired + 1);
  std::string data;
  auto st = rogue.Read(d.addr, d.rkey, d.length, &data);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR);
  ExpectHealthy(*good_, 7);
}

TEST_F(BulkSecurityTest, AnAcknowledgementInvalidatingTheWrongKeyEndsTheConnection) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  const ServerStats before = Stats(*good_);
  std::vector<BulkDescriptor> grants = Grants(rogue, 4096);
  ASSERT_FALSE(grants.empty());
  uint64_t id;
  const BulkDescriptor d = Download(rogue, 4096, &id);
  // Acknowledge the download, naming its window, but invalidate one of our upload windows
  // instead (a key the NIC accepts: the check that catches it is the server's).
  ASSERT_TRUE(Ack(rogue, id, grants[0].rkey, d.rkey).ok());
  EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
  const ServerStats after = Stats(*good_);
  EXPECT_EQ(after.violations, before.violations + 1);
  // The download window went with the connection.
  testing::RogueConnection other;
  ASSERT_TRUE(other.Connect(port_, "e2e").ok());
  std::string data;
  auto st = other.Read(d.addr, d.rkey, d.length, &data);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR);
  ExpectHealthy(*good_, 8);
}

TEST_F(BulkSecurityTest, AnAcknowledgementForAnotherRequestEndsTheConnection) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  const ServerStats before = Stats(*good_);
  uint64_t first, second;
  const BulkDescriptor a = Download(rogue, 4096, &first);
  const BulkDescriptor b = Download(rogue, 4096, &second);
  ASSERT_NE(a.rkey, b.rkey);
  // Invalidates and names window `a`, but claims the other request's id.
  ASSERT_TRUE(Ack(rogue, second, a.rkey).ok());
  EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
  EXPECT_EQ(Stats(*good_).violations, before.violations + 1);
  ExpectHealthy(*good_, 12);
}

TEST_F(BulkSecurityTest, AReplyChunkWithoutBulkDataEndsOnlyThatConnection) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e", control::BULK_MIRROR).ok());
  // 16 bytes: room for the one descriptor announced, which a lax parser would read past.
  const absl::Status sent =
      rogue.Call("/test.E2E/Echo", std::string(16, 'd'), rpc_wire::kFlagReplyChunk);
  ASSERT_TRUE(sent.ok()) << sent;
  EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
  ExpectHealthy(*good_, 9);
}

TEST_F(BulkSecurityTest, AWindowGrantThatInvalidatesAKeyEndsTheConnection) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  const ServerStats before = Stats(*good_);
  uint64_t id;
  const BulkDescriptor d = Download(rogue, 4096, &id);
  // Revoke the download window with a message that has no business invalidating anything.
  MessageHeader h{.version = rpc_wire::kProtocolVersion,
                  .type = rpc_wire::kWindowGrant,
                  .request_id = 4096,
                  .aux = 1};
  ASSERT_TRUE(rogue.Send(h, {}, d.rkey).ok());
  EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
  EXPECT_EQ(Stats(*good_).violations, before.violations + 1);
  ExpectHealthy(*good_, 10);
}

TEST_F(BulkSecurityTest, UploadGrantsAreCappedPerConnection) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  // Ask for as many of the largest windows as the credits allow, never using them: the server
  // stops at the connection's byte budget instead of handing over its pool...
  const uint32_t size = static_cast<uint32_t>(rogue.negotiated().max_bulk_size());
  uint64_t held = 0;
  for (const BulkDescriptor& d : Grants(rogue, size, 8)) held += d.length;
  EXPECT_GT(held, 0u);
  EXPECT_LE(held, uint64_t{32} << 20) << "granted beyond the per-connection budget";
  // ...and then grants nothing of any other size either, saying so with an empty grant.
  EXPECT_TRUE(Grants(rogue, size / 2, 8).empty());
  // Everyone else still gets their uploads through.
  ExpectHealthy(*good_, 11);
  auto upload = good_->AllocateBulk(1 << 20);
  ASSERT_TRUE(upload.ok());
  upload->resize(1 << 20);
  CallOptions call_options;
  call_options.request_bulk = &*upload;
  std::string response;
  EXPECT_TRUE(CallRaw(*good_, Id("/test.E2E/Sum"), "", &response, call_options).ok());
}

// Per-connection caps alone would let one client take the whole pool with a few connections:
// its connections together may hold bulk_bytes_per_client at most (here 40 MiB; each one 32 MiB
// of grants).
class BulkPerClientTest : public BulkSecurityTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--window_lease_ms=400", absl::StrCat("--bulk_bytes_per_client=", 40 << 20)};
  }
};

TEST_F(BulkPerClientTest, OneClientsConnectionsShareOneBulkBudget) {
  auto first = std::make_unique<testing::RogueConnection>();
  auto second = std::make_unique<testing::RogueConnection>();
  ASSERT_TRUE(first->Connect(port_, "e2e").ok());
  ASSERT_TRUE(second->Connect(port_, "e2e").ok());
  const uint32_t size = static_cast<uint32_t>(first->negotiated().max_bulk_size());
  uint64_t held_first = 0, held_second = 0;
  for (const BulkDescriptor& d : Grants(*first, size, 8)) held_first += d.length;
  for (const BulkDescriptor& d : Grants(*second, size, 8)) held_second += d.length;
  EXPECT_GT(held_first, 0u);
  EXPECT_LE(held_first, uint64_t{32} << 20);
  EXPECT_LE(held_first + held_second, uint64_t{40} << 20)
      << "two connections of one client held " << held_first << " + " << held_second;
  // Downloads count too: past the client's budget, RESOURCE_EXHAUSTED instead of a window.
  uint64_t id;
  ASSERT_TRUE(second->Call("/test.E2E/Fill", std::to_string(16 << 20), 0, 0, &id).ok());
  auto response = second->Receive(rpc_wire::kResponse);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->header.status, static_cast<uint32_t>(absl::StatusCode::kResourceExhausted));
  // Their connections gone (once the server has closed them), the budget is the client's again
  // (good_ shares its address): an upload that would not fit beside what they held goes through.
  auto before = good_->ServerStats();
  ASSERT_TRUE(before.ok()) << before.status();
  first.reset();
  second.reset();
  auto now = ServerStatsWhen(*good_, [&](const StatsReport& st) {
    return st.server.connections_active + 2 <= before->server.connections_active;
  });
  ASSERT_TRUE(now.ok()) << now.status();
  ASSERT_EQ(now->server.connections_active + 2, before->server.connections_active);
  ASSERT_GT(held_first + held_second + (16u << 20), uint64_t{40} << 20)
      << "the upload below must not fit beside what the two held";
  auto upload = good_->AllocateBulk(16 << 20);
  ASSERT_TRUE(upload.ok());
  upload->resize(16 << 20);
  CallOptions call_options;
  call_options.request_bulk = &*upload;
  call_options.timeout = absl::Seconds(20);
  std::string sum;
  EXPECT_TRUE(CallRaw(*good_, Id("/test.E2E/Sum"), "", &sum, call_options).ok());
}

// Server-to-client calls: the rogue is the one answering. A response whose bulk data the server
// is still reading must not be followed by another response for the same call: that one would
// complete the call (with whatever it says) while the RDMA READ still writes into the call's
// buffer, which goes back to the pool and to another call.
TEST_F(BulkSecurityTest, ASecondResponseWhileTheFirstIsBeingReadEndsTheConnection) {
  testing::RogueConnection rogue;
  // The local fallback: the server's ack is a plain SEND, which our memory region can take.
  ASSERT_TRUE(
      rogue.Connect(port_, "e2e", control::BULK_SERVER_EXPOSES, /*remote_invalidation=*/false)
          .ok());
  auto before = good_->ServerStats();
  ASSERT_TRUE(before.ok()) << before.status();
  uint64_t id;
  ASSERT_TRUE(rogue.Call("/test.E2E/CallBack", "hi", 0, 0, &id).ok());
  auto ping = rogue.Receive(rpc_wire::kRequest);
  ASSERT_TRUE(ping.ok()) << ping.status();
  ASSERT_EQ(ping->header.method_id, Id("/test.Client/Ping"));
  // A large download, so that its READ is still running when the second response arrives.
  const std::string data = Payload(8 << 20, 21);
  const BulkDescriptor d = rogue.Expose(data);
  ASSERT_NE(d.rkey, 0u);
  MessageHeader bulk{.version = rpc_wire::kProtocolVersion,
                     .type = rpc_wire::kResponse,
                     .flags = rpc_wire::kFlagBulk,
                     .request_id = ping->header.request_id,
                     .payload_len = static_cast<uint32_t>(sizeof(d))};
  ASSERT_TRUE(
      rogue.Send(bulk, absl::string_view(reinterpret_cast<const char*>(&d), sizeof(d))).ok());
  MessageHeader forged{.version = rpc_wire::kProtocolVersion,
                       .type = rpc_wire::kResponse,
                       .request_id = ping->header.request_id,
                       .payload_len = 6};
  // Posted without waiting for its completion: the server cuts the connection off on reading
  // this message, which may come before it is acknowledged, and then the send completes in
  // error (seen on the TCP fabric under ASan). What counts is the server's answer, below.
  std::string forged_message(reinterpret_cast<const char*>(&forged), sizeof(forged));
  forged_message += "forged";
  ASSERT_TRUE(rogue.SendRaw(forged_message).ok());
  EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
  // The forged answer never completed the server's call: CallBack never answered at all, the
  // connection having failed under it.
  auto answer = rogue.Receive(rpc_wire::kResponse, absl::Milliseconds(200));
  EXPECT_FALSE(answer.ok()) << "CallBack (request " << id << ") answered " << answer->header.status
                            << " " << answer->payload;
  auto after = good_->ServerStats();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->server.protocol_errors, before->server.protocol_errors + 1);
  ExpectHealthy(*good_, 13);
}

// A peer that keeps calling while it returns almost none of the credits the answers need: the
// answers wait in the worker's send buffers, which every connection on that worker shares. One
// connection may park only so many; beyond that it is failed, before the pool runs dry for all.
TEST_F(BulkSecurityTest, APeerThatHoldsBackCreditsCannotParkUnboundedResponses) {
  testing::RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  auto before = good_->ServerStats();
  ASSERT_TRUE(before.ok()) << before.status();
  uint32_t available = rogue.negotiated().client_credits();
  uint64_t request_id = 1000;
  int sent = 0;
  absl::Time progress = absl::Now();
  while (sent < 3000 && absl::Now() - progress < absl::Seconds(2)) {
    available += rogue.TakeCredits();
    if (available == 0) continue;
    // Our last credit carries back a single one of the many we owe.
    MessageHeader h{.version = rpc_wire::kProtocolVersion,
                    .type = rpc_wire::kRequest,
                    .method_id = Id("/test.E2E/Echo"),
                    .request_id = request_id++,
                    .payload_len = 1,
                    .credits = available == 1 ? 1u : 0u};
    if (!rogue.Send(h, "x").ok()) break;
    --available;
    ++sent;
    progress = absl::Now();
  }
  // The server's limit is 4 x 32 parked messages for this connection; without one, this rogue
  // parks a response per call until the worker's 16384 send buffers are gone.
  EXPECT_LT(sent, 1000) << "the server kept parking responses for a peer returning no credits";
  EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
  // The server finishes closing it (and counts it) once the QP has flushed.
  auto after = ServerStatsWhen(*good_, [&](const StatsReport& st) {
    return st.server.connections_closed != before->server.connections_closed;
  });
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->server.connections_closed, before->server.connections_closed + 1);
  EXPECT_EQ(after->server.protocol_errors, before->server.protocol_errors)
      << "a peer slow to return credits is shed, not called a protocol violator";
  ExpectHealthy(*good_, 14);
}

}  // namespace
}  // namespace swirl
