// Server-side protocol checks of docs/WIRE.md and docs/BULK.md that a correct peer never trips,
// against rpc/testing/test_server in another process. In each test a rogue client
// (rpc/testing/rogue.h) breaks one rule and is otherwise correct; that connection alone is
// failed, the server counts it where the docs say, and a well-behaved channel keeps getting
// answers. Where a boundary exists, the same rogue (or a twin) stays just inside it first, so
// that the cut-off can only come from the rule the test is named for.

#include <gtest/gtest.h>

#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/server_stats.h"
#include "rpc/testing/test_data.h"
#include "rpc/wire.h"
#include "swirl/channel.h"

namespace swirl {
namespace {

constexpr char kServer[] = "rpc/testing/test_server";
using rpc_wire::BulkDescriptor;
using rpc_wire::MessageHeader;
using testing::Fnv;
using testing::Received;
using testing::RogueConnection;
using testing::ServerStatsWhen;

uint32_t Id(const char* method) { return rpc_wire::MethodId(method); }

// A message of `type` with no method, status or payload: every control message looks so.
MessageHeader Control(uint8_t type, uint64_t request_id = 0, uint32_t aux = 0,
                      uint32_t credits = 0) {
  return MessageHeader{.version = rpc_wire::kProtocolVersion,
                       .type = type,
                       .request_id = request_id,
                       .credits = credits,
                       .aux = aux};
}

std::string Bytes(const BulkDescriptor& d) {
  return std::string(reinterpret_cast<const char*>(&d), sizeof(d));
}

// `channel` gets its echo back: the server serves it.
void ExpectServes(Channel& channel, const std::string& what) {
  std::string response;
  const absl::Status s = CallRaw(channel, Id("/test.E2E/Echo"), what, &response, {});
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(response, what);
}

// `rogue`'s connection still answers a call: whatever it sent before was accepted.
void ExpectAnswered(RogueConnection& rogue, const std::string& what) {
  uint64_t id;
  ASSERT_TRUE(rogue.Call("/test.E2E/Echo", what, 0, 0, &id).ok());
  auto response = rogue.Receive(rpc_wire::kResponse);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->header.request_id, id);
  EXPECT_EQ(response->payload, what);
}

// Answers the server's call `request_id` (a server-to-client call) with `payload`.
absl::Status Respond(RogueConnection& rogue, uint64_t request_id, absl::string_view payload) {
  MessageHeader h = Control(rpc_wire::kResponse, request_id);
  h.payload_len = static_cast<uint32_t>(payload.size());
  return rogue.Send(h, payload);
}

class ViolationTest : public ::testing::Test {
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
    ExpectServes(*good_, "before");
  }

  void TearDown() override {
    if (good_ != nullptr) ExpectServes(*good_, "after");
  }

  // The server's counters, now.
  ServerCounters Stats() {
    auto stats = good_->ServerStats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? stats->server : ServerCounters();
  }

  // `rogue` is cut off; since `before` the server counted one protocol error, of which
  // `violations` (0 or 1) an invalidation violation (docs/BULK.md); the good channel is served.
  void ExpectCutOffFor(RogueConnection& rogue, const ServerCounters& before,
                       uint64_t violations) {
    EXPECT_TRUE(rogue.CutOff(absl::Seconds(10))) << "the server kept the connection";
    auto after = ServerStatsWhen(*good_, [&](const StatsReport& s) {
      return s.server.protocol_errors != before.protocol_errors;
    });
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_EQ(after->server.protocol_errors, before.protocol_errors + 1);
    EXPECT_EQ(after->server.invalidation_violations,
              before.invalidation_violations + violations);
    ExpectServes(*good_, "meanwhile");
  }

  // What test.E2E/LastSum says: what the last upload handler saw.
  std::string LastSum() {
    std::string sum;
    const absl::Status s = CallRaw(*good_, Id("/test.E2E/LastSum"), "", &sum, {});
    EXPECT_TRUE(s.ok()) << s;
    return sum;
  }

  // One rogue, two upload windows of 4096 bytes, each upload sealed as it should be (SEND_WITH_INV
  // of its window): `fine` bytes through the first are summed by the handler, `refused` bytes
  // through the second end the connection, and the handler never sees them.
  void ExpectUploadLengthRefused(uint32_t fine, uint32_t refused) {
    RogueConnection rogue;
    ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
    auto grants = rogue.RequestWindows(4096, 2);
    ASSERT_TRUE(grants.ok()) << grants.status();
    ASSERT_EQ(grants->size(), 2u);
    char fill = 'a';  // each window's own, so that a sum tells which one a handler read
    for (const BulkDescriptor& g : *grants) {
      ASSERT_EQ(g.length, 4096u);
      auto written = rogue.Write(g.addr, g.rkey, std::string(4096, fill++));
      ASSERT_TRUE(written.ok()) << written.status();
      ASSERT_EQ(*written, IBV_WC_SUCCESS);
    }
    const BulkDescriptor& first = (*grants)[0];
    ASSERT_TRUE(rogue
                    .Call("/test.E2E/Sum", Bytes({first.addr, fine, first.rkey}),
                          rpc_wire::kFlagBulk, first.rkey)
                    .ok());
    auto response = rogue.Receive(rpc_wire::kResponse);
    ASSERT_TRUE(response.ok()) << response.status();
    const std::string sum = absl::StrCat(fine, ":", Fnv(std::string(fine, 'a')));
    ASSERT_EQ(response->payload, sum);
    const ServerCounters before = Stats();
    const BulkDescriptor& second = (*grants)[1];
    ASSERT_TRUE(rogue
                    .Call("/test.E2E/Sum", Bytes({second.addr, refused, second.rkey}),
                          rpc_wire::kFlagBulk, second.rkey)
                    .ok());
    ExpectCutOffFor(rogue, before, 1);
    EXPECT_EQ(LastSum(), sum) << "the handler ran on the refused upload";
  }

  std::unique_ptr<testing::ChildProcess> server_;
  int port_ = 0;
  std::shared_ptr<Channel> good_;
};

// ---- Credits (docs/WIRE.md, "Flow control") ----------------------------------------------------

// What these rogues offer the server: the least the handshake allows, so that they know exactly
// when it has spent them all.
constexpr uint32_t kServerCredits = 4;

// No keepalive: a ping would spend a credit these tests count.
class CreditViolationTest : public ViolationTest {
 protected:
  std::vector<std::string> ServerFlags() const override { return {"--keepalive_ms=0"}; }

  void ConnectCounting(RogueConnection& rogue) {
    rogue.OfferCredits(kServerCredits);
    ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
    ASSERT_EQ(rogue.negotiated().server_credits(), kServerCredits);
  }

  // Makes the server spend every credit `rogue` gave it (kServerCredits calls, answered, never
  // credited back). From then on it can send nothing, not even a credit return, so what the
  // rogue may still send is exactly what its own ledger says: returns that.
  uint32_t SpendTheServersCredits(RogueConnection& rogue) {
    uint32_t available = rogue.negotiated().client_credits();
    for (uint32_t i = 0; i < kServerCredits; ++i) {
      uint64_t id;
      EXPECT_TRUE(rogue.Call("/test.E2E/Echo", "spend", 0, 0, &id).ok());
      --available;
      auto response = rogue.Receive(rpc_wire::kResponse);
      EXPECT_TRUE(response.ok()) << response.status();
      EXPECT_EQ(response.ok() ? response->header.request_id : 0, id);
    }
    return available + rogue.TakeCredits();
  }
};

TEST_F(CreditViolationTest, APeerSendingBeyondItsCreditsIsCutOff) {
  const std::string note = "note";
  const MessageHeader one_way{.version = rpc_wire::kProtocolVersion,
                              .type = rpc_wire::kOneWay,
                              .method_id = Id("/test.E2E/Echo"),
                              .payload_len = static_cast<uint32_t>(note.size())};
  {
    SCOPED_TRACE("every credit, the last one returning the server's");
    RogueConnection rogue;
    ASSERT_NO_FATAL_FAILURE(ConnectCounting(rogue));
    const uint32_t available = SpendTheServersCredits(rogue);
    ASSERT_GT(available, 1u);
    for (uint32_t i = 0; i + 1 < available; ++i) ASSERT_TRUE(rogue.Send(one_way, note).ok());
    ASSERT_TRUE(rogue.Send(Control(rpc_wire::kCredit, 0, 0, kServerCredits)).ok());
    auto credit = rogue.Receive(rpc_wire::kCredit);  // the server can return ours again
    ASSERT_TRUE(credit.ok()) << credit.status();
    ASSERT_NO_FATAL_FAILURE(ExpectAnswered(rogue, "within its credits"));
  }
  SCOPED_TRACE("one message more");
  RogueConnection rogue;
  ASSERT_NO_FATAL_FAILURE(ConnectCounting(rogue));
  const ServerCounters before = Stats();
  const uint32_t available = SpendTheServersCredits(rogue);
  for (uint32_t i = 0; i < available; ++i) ASSERT_TRUE(rogue.Send(one_way, note).ok());
  ASSERT_TRUE(rogue.Send(one_way, note).ok());
  ExpectCutOffFor(rogue, before, 0);
}

TEST_F(CreditViolationTest, APeerReturningCreditsItNeverReceivedIsCutOff) {
  RogueConnection rogue;
  ASSERT_NO_FATAL_FAILURE(ConnectCounting(rogue));
  const ServerCounters before = Stats();
  // The server spends one credit on each answer: returning that one is right...
  ASSERT_NO_FATAL_FAILURE(ExpectAnswered(rogue, "one"));
  ASSERT_TRUE(rogue.Send(Control(rpc_wire::kCredit, 0, 0, 1)).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectAnswered(rogue, "two"));
  // ...returning one more than it spent is not (and within what ValidateHeader lets through).
  ASSERT_TRUE(rogue.Send(Control(rpc_wire::kCredit, 0, 0, 2)).ok());
  ExpectCutOffFor(rogue, before, 0);
}

// ---- Calls and keepalive (docs/WIRE.md, "Calls") -----------------------------------------------

// A response whose id names a slot of an older generation is dropped, never matched to the call
// now in that slot. The server is the caller here (test.E2E/CallBack calls test.Client/Ping on
// its caller's connection), so the rogue is the side that answers, late on purpose.
TEST_F(ViolationTest, ResponsesOfAnOlderGenerationAreDropped) {
  RogueConnection rogue;
  // The local fallback: the server's ack of the stale bulk response below is then a plain SEND,
  // which our memory region can take (a SEND_WITH_INV of a region's rkey would fail).
  ASSERT_TRUE(
      rogue.Connect(port_, "e2e", control::BULK_SERVER_EXPOSES, /*remote_invalidation=*/false)
          .ok());
  const ServerCounters before = Stats();
  // The server's Ping for a CallBack of ours.
  auto call_back = [&](const std::string& what, uint64_t* id) -> absl::StatusOr<Received> {
    if (auto s = rogue.Call("/test.E2E/CallBack", what, 0, 0, id); !s.ok()) return s;
    return rogue.Receive(rpc_wire::kRequest);
  };
  uint64_t first_id, second_id;
  auto first = call_back("first", &first_id);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->header.method_id, Id("/test.Client/Ping"));
  ASSERT_TRUE(Respond(rogue, first->header.request_id, "first").ok());
  auto answer = rogue.Receive(rpc_wire::kResponse);
  ASSERT_TRUE(answer.ok()) << answer.status();
  ASSERT_EQ(answer->header.request_id, first_id);
  ASSERT_EQ(answer->payload, "first");

  auto second = call_back("second", &second_id);
  ASSERT_TRUE(second.ok()) << second.status();
  const uint64_t old_id = first->header.request_id;
  const uint64_t new_id = second->header.request_id;
  ASSERT_EQ(static_cast<uint32_t>(new_id), static_cast<uint32_t>(old_id))
      << "the second call must reuse the first one's slot, or nothing here tests generations";
  ASSERT_NE(new_id >> 32, old_id >> 32);
  // Late answers to the first call, eager and with bulk data: dropped; the bulk one is acked at
  // once, unread, so that our window goes away (docs/BULK.md, "Download").
  ASSERT_TRUE(Respond(rogue, old_id, "stale").ok());
  const BulkDescriptor d = rogue.Expose("stale bulk data");
  ASSERT_NE(d.rkey, 0u);
  MessageHeader bulk = Control(rpc_wire::kResponse, old_id);
  bulk.flags = rpc_wire::kFlagBulk;
  bulk.payload_len = sizeof(d);
  ASSERT_TRUE(rogue.Send(bulk, Bytes(d)).ok());
  auto ack = rogue.Receive(rpc_wire::kBulkAck);
  ASSERT_TRUE(ack.ok()) << ack.status();
  EXPECT_EQ(ack->header.request_id, old_id);
  EXPECT_EQ(ack->header.aux, d.rkey);
  // The call in the slot now gets the answer meant for it.
  ASSERT_TRUE(Respond(rogue, new_id, "second").ok());
  answer = rogue.Receive(rpc_wire::kResponse);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->header.request_id, second_id);
  EXPECT_EQ(answer->payload, "second") << "a stale response completed the server's call";
  EXPECT_EQ(Stats().protocol_errors, before.protocol_errors) << "dropped, not a violation";
}

constexpr int kKeepaliveMs = 300;

class KeepaliveViolationTest : public ViolationTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {absl::StrCat("--keepalive_ms=", kKeepaliveMs)};
  }
};

// A peer that stops answering is dropped once a ping has gone unanswered for three keepalive
// intervals; a peer that answers (the good channel, as idle on the data plane meanwhile) stays.
TEST_F(KeepaliveViolationTest, APeerThatNeverAnswersPingsIsDropped) {
  const absl::Duration interval = absl::Milliseconds(kKeepaliveMs);
  RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  const ServerCounters before = Stats();
  // It speaks once, as a channel does as soon as it is up (or the setup timeout would be what
  // drops it), and never again.
  const absl::Time last_spoke = absl::Now();
  ASSERT_TRUE(rogue.Send(Control(rpc_wire::kPing)).ok());
  ASSERT_TRUE(rogue.Receive(rpc_wire::kPong).ok());
  auto ping = rogue.Receive(rpc_wire::kPing);  // the server asks; nothing answers
  ASSERT_TRUE(ping.ok()) << ping.status();
  auto after = ServerStatsWhen(*good_, [&](const StatsReport& s) {
    return s.server.connections_failed != before.connections_failed;
  });
  const absl::Duration silence = absl::Now() - last_spoke;
  ASSERT_TRUE(after.ok()) << after.status();
  ASSERT_EQ(after->server.connections_failed, before.connections_failed + 1)
      << "still connected after " << silence << " of silence";
  // Pinged after one interval of silence, then three more: dropped no sooner.
  EXPECT_GE(silence, 3 * interval) << "dropped after " << silence;
  EXPECT_EQ(after->server.protocol_errors, before.protocol_errors);
  EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
  EXPECT_TRUE(good_->connected());
}

// ---- Control messages carry no payload (docs/WIRE.md, "Validation on receipt") ------------------

TEST_F(ViolationTest, ControlMessagesWithAPayloadEndTheConnection) {
  const std::initializer_list<std::pair<const char*, uint8_t>> types = {
      {"cancel", rpc_wire::kCancel},
      {"credit", rpc_wire::kCredit},
      {"ping", rpc_wire::kPing},
      {"pong", rpc_wire::kPong},
      {"bulk ack", rpc_wire::kBulkAck}};
  for (const auto& [name, type] : types) {
    for (const bool with_payload : {false, true}) {
      SCOPED_TRACE(absl::StrCat(name, with_payload ? " with a payload" : " without"));
      RogueConnection rogue;
      ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
      const ServerCounters before = Stats();
      MessageHeader h = Control(type, type == rpc_wire::kCancel ? 12345 : 0);
      uint32_t invalidate = 0;
      if (type == rpc_wire::kBulkAck) {  // a correct ack of a real download, but for its payload
        uint64_t id;
        auto d = rogue.CallForDownload("/test.E2E/Fill", "4096", &id);
        ASSERT_TRUE(d.ok()) << d.status();
        h = Control(type, id, d->rkey);
        invalidate = d->rkey;
      }
      const std::string payload = with_payload ? "junk" : "";
      h.payload_len = static_cast<uint32_t>(payload.size());
      ASSERT_TRUE(rogue.Send(h, payload, invalidate).ok());
      if (with_payload) {
        ExpectCutOffFor(rogue, before, 0);
      } else {
        ASSERT_NO_FATAL_FAILURE(ExpectAnswered(rogue, name));
        EXPECT_EQ(Stats().protocol_errors, before.protocol_errors);
      }
    }
  }
}

// ---- Bulk violations (docs/BULK.md, "Leases and failures") -------------------------------------

// An ack for a window that is gone, after its lease or after an ack that revoked it already,
// names no window exposed: a violation. Under the local fallback, where acks are plain SENDs
// and reach that check (under remote invalidation, the test after this one).
TEST_F(ViolationTest, ALateBulkAckEndsTheConnection) {
  for (const bool after_lease : {true, false}) {
    SCOPED_TRACE(after_lease ? "after the lease" : "after an ack");
    RogueConnection rogue;
    ASSERT_TRUE(
        rogue.Connect(port_, "e2e", control::BULK_SERVER_EXPOSES, /*remote_invalidation=*/false)
            .ok());
    const ServerCounters before = Stats();
    uint64_t id;
    auto d = rogue.CallForDownload("/test.E2E/Fill", "4096", &id);
    ASSERT_TRUE(d.ok()) << d.status();
    const MessageHeader ack = Control(rpc_wire::kBulkAck, id, d->rkey);
    if (!after_lease) {
      ASSERT_TRUE(rogue.Send(ack).ok());  // in time: accepted
    }
    // Either way the server revokes the window itself (LOCAL_INV) and counts it.
    auto revoked = ServerStatsWhen(*good_, [&](const StatsReport& s) {
      return s.server.windows_lease_expired + s.server.windows_locally_invalidated !=
             before.windows_lease_expired + before.windows_locally_invalidated;
    });
    ASSERT_TRUE(revoked.ok()) << revoked.status();
    ASSERT_EQ(revoked->server.windows_lease_expired,
              before.windows_lease_expired + (after_lease ? 1 : 0));
    ASSERT_EQ(revoked->server.windows_locally_invalidated,
              before.windows_locally_invalidated + (after_lease ? 0 : 1));
    ASSERT_EQ(revoked->server.protocol_errors, before.protocol_errors);
    ASSERT_TRUE(rogue.Send(ack).ok());
    ExpectCutOffFor(rogue, before, 1);
  }
}

// Under remote invalidation a late ack is a SEND_WITH_INV of a key that is dead by then: the
// server's NIC refuses it (REM_INV_REQ_ERR) before the server could see it, and the QP error
// ends the connection; it is counted as a QP error, not as a protocol error.
TEST_F(ViolationTest, ALateBulkAckUnderRemoteInvalidationIsRefusedByTheNic) {
  RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
  const ServerCounters before = Stats();
  uint64_t id;
  auto d = rogue.CallForDownload("/test.E2E/Fill", "4096", &id);
  ASSERT_TRUE(d.ok()) << d.status();
  auto expired = ServerStatsWhen(*good_, [&](const StatsReport& s) {
    return s.server.windows_lease_expired != before.windows_lease_expired;
  });
  ASSERT_TRUE(expired.ok()) << expired.status();
  ASSERT_EQ(expired->server.windows_lease_expired, before.windows_lease_expired + 1);
  const absl::Status sent = rogue.Send(Control(rpc_wire::kBulkAck, id, d->rkey), {}, d->rkey);
  EXPECT_NE(sent.message().find(ibv_wc_status_str(IBV_WC_REM_INV_REQ_ERR)),
            absl::string_view::npos)
      << sent;
  EXPECT_TRUE(rogue.CutOff(absl::Seconds(10)));
  auto after = ServerStatsWhen(*good_, [&](const StatsReport& s) {
    return s.server.connections_failed != before.connections_failed &&
           s.server.async_qp_errors != before.async_qp_errors;
  });
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->server.connections_failed, before.connections_failed + 1);
  EXPECT_EQ(after->server.async_qp_errors, before.async_qp_errors + 1);
  EXPECT_EQ(after->server.protocol_errors, before.protocol_errors);
}

TEST_F(ViolationTest, ABulkRequestOfZeroBytesEndsTheConnection) {
  ExpectUploadLengthRefused(1, 0);
}

TEST_F(ViolationTest, AnUploadLongerThanItsWindowEndsTheConnection) {
  ExpectUploadLengthRefused(4096, 4097);
}

// In mirror mode the client exposes its own memory; a server has no upload windows for it, and
// the request for some that a server-exposes client may send is a violation.
TEST_F(ViolationTest, AWindowRequestInMirrorModeEndsTheConnection) {
  {
    SCOPED_TRACE("server exposes: granted");
    RogueConnection rogue;
    ASSERT_TRUE(rogue.Connect(port_, "e2e").ok());
    auto grants = rogue.RequestWindows(4096, 2);
    ASSERT_TRUE(grants.ok()) << grants.status();
    EXPECT_EQ(grants->size(), 2u);
  }
  RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, "e2e", control::BULK_MIRROR).ok());
  ASSERT_EQ(rogue.negotiated().bulk_mode(), control::BULK_MIRROR);
  const ServerCounters before = Stats();
  ASSERT_TRUE(rogue.Send(Control(rpc_wire::kWindowGrant, /*request_id=size*/ 4096, 2)).ok());
  ExpectCutOffFor(rogue, before, 1);
}

// Under the explicit fallback the exposing side revokes every window itself; a SEND_WITH_INV
// that would revoke one under it, on an upload or on an ack, is a violation. The NIC carries it
// out (the window dies); the server's check is what refuses the message.
TEST_F(ViolationTest, SendWithInvalidateUnderTheLocalFallbackEndsTheConnection) {
  const std::string last_before = LastSum();
  for (const bool upload : {true, false}) {
    SCOPED_TRACE(upload ? "on an upload" : "on an ack");
    RogueConnection rogue;
    ASSERT_TRUE(
        rogue.Connect(port_, "e2e", control::BULK_SERVER_EXPOSES, /*remote_invalidation=*/false)
            .ok());
    ASSERT_EQ(rogue.negotiated().invalidation(), control::INVALIDATION_LOCAL);
    const ServerCounters before = Stats();
    if (upload) {
      auto grants = rogue.RequestWindows(4096, 1);
      ASSERT_TRUE(grants.ok()) << grants.status();
      ASSERT_EQ(grants->size(), 1u);
      const BulkDescriptor g = (*grants)[0];
      auto written = rogue.Write(g.addr, g.rkey, std::string(4096, 'f'));
      ASSERT_TRUE(written.ok()) << written.status();
      ASSERT_EQ(*written, IBV_WC_SUCCESS);
      ASSERT_TRUE(
          rogue.Call("/test.E2E/Sum", Bytes({g.addr, 4096, g.rkey}), rpc_wire::kFlagBulk, g.rkey)
              .ok());
    } else {
      uint64_t id;
      auto d = rogue.CallForDownload("/test.E2E/Fill", "4096", &id);
      ASSERT_TRUE(d.ok()) << d.status();
      ASSERT_TRUE(rogue.Send(Control(rpc_wire::kBulkAck, id, d->rkey), {}, d->rkey).ok());
    }
    ExpectCutOffFor(rogue, before, 1);
  }
  EXPECT_EQ(LastSum(), last_before) << "the handler ran on an upload sealed the wrong way";
}

}  // namespace
}  // namespace swirl
