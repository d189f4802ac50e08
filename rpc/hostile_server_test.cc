// A real swirl Channel against a hostile server: rpc/testing/rogue_server.h answers Connect as
// swirl's server would (or with absurd values), then speaks the data plane by hand. Whatever it
// sends, the channel must refuse it: the connection ends, its pending calls complete at once
// with UNAVAILABLE saying why (well within their deadlines), nothing crashes, and another
// channel, to a good server (rpc/testing/test_server) on the same client worker, carries on.

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/handshake.h"
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/rogue_server.h"
#include "rpc/testing/test_client.h"
#include "rpc/wire.h"
#include "swirl/channel.h"

namespace swirl {
namespace {

using rpc_wire::BulkDescriptor;
using rpc_wire::MessageHeader;
using testing::Received;
using testing::RoguePeer;

constexpr uint8_t kVersion = rpc_wire::kProtocolVersion;
constexpr absl::Duration kCallTimeout = absl::Seconds(10);

std::string Bytes(const MessageHeader& h, absl::string_view payload = {}) {
  std::string out(reinterpret_cast<const char*>(&h), sizeof(h));
  out.append(payload.data(), payload.size());
  return out;
}

absl::string_view AsBytes(const BulkDescriptor& d) {
  return absl::string_view(reinterpret_cast<const char*>(&d), sizeof(d));
}

std::string Data(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i * 13 + seed);
  return s;
}

// A call in flight on a victim channel, and its request as the rogue server received it.
struct Pending {
  ClientCall call;
  std::string response;
  Received request;
  uint64_t id() const { return request.header.request_id; }
};

class HostileServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = testing::SpawnServer(testing::kTestServer, {});
    ASSERT_TRUE(server.ok()) << server.status();
    good_server_ = new testing::ChildProcess(std::move(server->first));
    auto good = testing::ConnectTo(server->second);
    ASSERT_TRUE(good.ok()) << good.status();
    good_ = new std::shared_ptr<Channel>(*good);
  }
  static void TearDownTestSuite() {
    delete good_;
    delete good_server_;
  }

  void SetUp() override { ASSERT_TRUE(rogue_.Start().ok()); }
  void TearDown() override {
    ASSERT_NE(good_, nullptr);
    EXPECT_EQ(testing::Echo(**good_, "unharmed"), "unharmed");
    EXPECT_TRUE((*good_)->connected());
  }

  // A channel to the rogue server (victim_) and the rogue's end of its connection (peer_).
  void ConnectVictim(ChannelOptions options = {}) {
    victim_.reset();
    peer_.reset();
    // These tests judge how one connection ends; a reconnect would dial the rogue again (and
    // take a connection meant for the next test). Reconnecting is reconnect_test's.
    options.reconnect.enabled = false;
    auto channel = Channel::Create(rogue_.address(), options);
    ASSERT_TRUE(channel.ok()) << channel.status();
    auto peer = rogue_.Accept();
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = std::move(*peer);
    victim_ = *channel;
  }

  // Starts a call of `request` on the victim; returns it once the rogue has its request. The
  // response goes into `message` if given, else into Pending::response as raw bytes.
  std::unique_ptr<Pending> Start(const std::string& request, CallOptions options = {},
                                 google::protobuf::MessageLite* message = nullptr) {
    auto p = std::make_unique<Pending>();
    if (options.timeout == absl::InfiniteDuration()) options.timeout = kCallTimeout;
    p->call.SetMethod(rpc_wire::MethodId("/test.Hostile/Echo"));
    p->call.SetRequestBytes(request);
    if (message != nullptr) {
      p->call.SetResponse(message);
    } else {
      p->call.SetResponseBytes(&p->response);
    }
    p->call.SetOptions(options);
    victim_->Start(&p->call);
    auto received = peer_->Receive(rpc_wire::kRequest);
    EXPECT_TRUE(received.ok()) << received.status();
    if (received.ok()) p->request = std::move(*received);
    return p;
  }

  // A well-formed response header for `p`'s request, `payload_len` bytes of payload to follow.
  static MessageHeader ResponseTo(const Pending& p, uint32_t payload_len = 0) {
    return MessageHeader{.version = kVersion,
                         .type = rpc_wire::kResponse,
                         .request_id = p.id(),
                         .payload_len = payload_len};
  }

  // `p` ended with the victim's connection, which ended saying `why`: UNAVAILABLE, at once
  // rather than at its deadline; and the channel refuses calls from then on.
  void ExpectConnectionLost(Pending& p, absl::string_view why) {
    const absl::Status s = p.call.Wait();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("connection lost"), absl::string_view::npos) << s;
    EXPECT_NE(s.message().find(why), absl::string_view::npos) << s;
    EXPECT_FALSE(victim_->connected());
    std::string response;
    EXPECT_EQ(CallRaw(*victim_, 1, "", &response, CallOptions{kCallTimeout}).code(),
              absl::StatusCode::kUnavailable);
  }

  testing::RogueServer rogue_;
  std::unique_ptr<RoguePeer> peer_;
  std::shared_ptr<Channel> victim_;
  static testing::ChildProcess* good_server_;
  static std::shared_ptr<Channel>* good_;
};
testing::ChildProcess* HostileServerTest::good_server_ = nullptr;
std::shared_ptr<Channel>* HostileServerTest::good_ = nullptr;

// The rogue's plumbing, checked: correct answers, eager and through a type 2 window the client
// READs and then revokes with its acknowledgement's SEND_WITH_INV, are taken and cost nothing.
TEST_F(HostileServerTest, WellFormedAnswersAreTaken) {
  ASSERT_NO_FATAL_FAILURE(ConnectVictim());
  auto eager = Start("hello");
  EXPECT_EQ(eager->request.payload, "hello");
  ASSERT_TRUE(peer_->Send(ResponseTo(*eager, 5), "olleh").ok());
  ASSERT_TRUE(eager->call.Wait().ok()) << eager->call.status();
  EXPECT_EQ(eager->response, "olleh");

  auto bulk = Start("bulk");
  const std::string data = Data(100000, 1);
  const BulkDescriptor d = peer_->ExposeWindow(data, IBV_ACCESS_REMOTE_READ);
  ASSERT_NE(d.rkey, 0u);
  MessageHeader h = ResponseTo(*bulk, sizeof(d));
  h.flags = rpc_wire::kFlagBulk;
  ASSERT_TRUE(peer_->Send(h, AsBytes(d)).ok());
  auto ack = peer_->Receive(rpc_wire::kBulkAck);
  ASSERT_TRUE(ack.ok()) << ack.status();
  EXPECT_EQ(ack->header.request_id, bulk->id());
  EXPECT_EQ(ack->header.aux, d.rkey);
  EXPECT_TRUE(ack->wc_flags & IBV_WC_WITH_INV);
  EXPECT_EQ(ack->invalidated_rkey, d.rkey);
  ASSERT_TRUE(bulk->call.Wait().ok()) << bulk->call.status();
  EXPECT_TRUE(bulk->call.response_bulk().view() == data);
  EXPECT_TRUE(victim_->connected());
}

// Link keys, the channel's side (the server's: link_key_test): a server that declares link keys
// and sends one, and then links its own QP without it, never gets the link: the channel's QP
// took the key. The same server using its key is answered.
TEST_F(HostileServerTest, AServerQpWithoutTheLinkKeyNeverGetsTheChannelsLink) {
  rogue_.set_link_keys(testing::RogueServer::LinkKeys::kWithheld);
  ASSERT_NO_FATAL_FAILURE(ConnectVictim());
  std::string response;
  const absl::Status s =
      CallRaw(*victim_, rpc_wire::MethodId("/test.Hostile/Echo"), "for a keyless peer",
              &response, CallOptions{kCallTimeout});
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_FALSE(peer_->Receive(rpc_wire::kRequest, absl::Milliseconds(100)).ok())
      << "a server QP without the key received the channel's request";
}

TEST_F(HostileServerTest, AServerQpWithTheLinkKeyGetsTheChannelsLink) {
  rogue_.set_link_keys(testing::RogueServer::LinkKeys::kHonest);
  ASSERT_NO_FATAL_FAILURE(ConnectVictim());
  auto p = Start("keyed");
  EXPECT_EQ(p->request.payload, "keyed");
  ASSERT_TRUE(peer_->Send(ResponseTo(*p, 5), "deyek").ok());
  ASSERT_TRUE(p->call.Wait().ok()) << p->call.status();
  EXPECT_EQ(p->response, "deyek");
}

// A server that declares link keys but withholds the key would leave a link both ends could
// have bound unauthenticated: the channel refuses it at Connect.
TEST_F(HostileServerTest, AServerThatDeclaresLinkKeysButSendsNoneIsRefused) {
  rogue_.set_link_keys(testing::RogueServer::LinkKeys::kHonest);
  rogue_.set_tamper([](control::ConnectResponse& r) { r.clear_link_key(); });
  auto channel = Channel::Create(rogue_.address(), {});
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kFailedPrecondition) << channel.status();
}

// A channel that offers no services has no use for upload windows: a server asking it for some
// (to pin up to grant_bytes of the client's shared pool per connection) is a violation, and
// gets none.
TEST_F(HostileServerTest, AWindowRequestToAChannelWithoutServicesEndsTheConnection) {
  ASSERT_NO_FATAL_FAILURE(ConnectVictim());
  auto p = Start("pending");
  const MessageHeader request{kVersion, rpc_wire::kWindowGrant, 0, 0,
                              /*request_id=size*/ 65536, 0, 0, 0, /*aux=count*/ 8};
  ASSERT_TRUE(peer_->Send(request).ok());
  ExpectConnectionLost(*p, "offers no services");
  EXPECT_FALSE(peer_->Receive(rpc_wire::kWindowGrant, absl::Milliseconds(100)).ok())
      << "the channel granted windows to a server it offers nothing";
}

// One malformed message per rule, each on a connection of its own: a response to the call in
// flight but for the one field the attack is named for (or a control message with what it must
// not carry).
TEST_F(HostileServerTest, MalformedMessagesEndTheConnection) {
  struct Attack {
    const char* name;
    // The bytes to send, given a well-formed answer to the call in flight.
    std::function<std::string(MessageHeader, const RoguePeer&)> bytes;
    const char* why;
    testing::RogueServer::Tamper tamper = nullptr;  // how the rogue answers Connect first
  };
  const auto with = [](auto mutate, std::string payload = "") {
    return [mutate, payload](MessageHeader h, const RoguePeer& peer) {
      h.payload_len = static_cast<uint32_t>(payload.size());
      mutate(h, peer);
      return Bytes(h, payload);
    };
  };
  const auto control = [&](uint8_t type) {
    return with(
        [type](MessageHeader& h, const RoguePeer&) {
          h.type = type;
          h.request_id = 0;
        },
        "four");
  };
  const std::vector<Attack> attacks = {
      {"short message", [](MessageHeader, const RoguePeer&) { return std::string(7, 'x'); },
       "shorter than the header"},
      {"other protocol version",
       with([](MessageHeader& h, const RoguePeer&) { h.version = kVersion + 1; }),
       "protocol version"},
      {"unknown type",
       with([](MessageHeader& h, const RoguePeer&) { h.type = rpc_wire::kMaxType + 1; }),
       "message type"},
      {"payload_len lies",
       [](MessageHeader h, const RoguePeer&) {
         h.payload_len = 4000;
         return Bytes(h, "abc");
       },
       "payload_len 4000 but 3 payload bytes arrived"},
      {"unknown flags", with([](MessageHeader& h, const RoguePeer&) { h.flags = 0x80; }),
       "unknown flags"},
      {"status beyond the last code",
       with([](MessageHeader& h, const RoguePeer&) { h.status = rpc_wire::kMaxStatusCode + 1; }),
       "status code 17"},
      {"method id on a response",
       with([](MessageHeader& h, const RoguePeer&) { h.method_id = 5; }),
       "method_id must be set exactly on calls"},
      {"credits beyond those granted",
       with([](MessageHeader& h, const RoguePeer&) { h.credits = 100000; }), "more than the"},
      {"credits for messages never sent",
       with([](MessageHeader& h, const RoguePeer& peer) {
         h.credits = peer.messages_received() + 1;  // its ping and its request: 2 were used
       }),
       "returned credits it never received"},
      {"bulk flag without a descriptor",
       with([](MessageHeader& h, const RoguePeer&) { h.flags = rpc_wire::kFlagBulk; }),
       "bulk descriptors cut short"},
      {"reply chunk on a response",
       with([](MessageHeader& h,
               const RoguePeer&) { h.flags = rpc_wire::kFlagBulk | rpc_wire::kFlagReplyChunk; },
            std::string(2 * sizeof(BulkDescriptor), '\0')),
       "a reply chunk on a non-request"},
      {"a payload beyond the negotiated maximum",
       with([](MessageHeader&, const RoguePeer&) {}, std::string(2000, 'p')),
       "payload of 2000 bytes exceeds 1000",
       [](control::ConnectResponse& r) {
         r.mutable_negotiated()->set_max_message_size(1000);  // legal, if small
         r.mutable_negotiated()->set_eager_threshold(1000);
       }},
      {"a message longer than the receive buffer",
       with([](MessageHeader&, const RoguePeer&) {}, std::string(5000, 'p')), "receive failed"},
      {"unknown aux bits", with([](MessageHeader& h, const RoguePeer&) { h.aux = 0x100; }),
       "unknown aux bits"},
      {"a message in bulk with an eager part",
       with(
           [](MessageHeader& h, const RoguePeer&) {
             h.flags = rpc_wire::kFlagBulk;
             h.aux = rpc_wire::kAuxBulkIsMessage;
           },
           std::string(sizeof(BulkDescriptor) + 4, '\0')),
       "a message carried in bulk has no eager part"},
      {"a call with a reply chunk but no bulk data",
       with(
           [](MessageHeader& h, const RoguePeer&) {
             h.type = rpc_wire::kRequest;
             h.method_id = rpc_wire::MethodId("/test.Client/Any");
             h.flags = rpc_wire::kFlagReplyChunk;
           },
           std::string(sizeof(BulkDescriptor), '\0')),
       "a reply chunk without bulk data"},
      {"bulk message flag without bulk data",
       with([](MessageHeader& h, const RoguePeer&) { h.aux = rpc_wire::kAuxBulkIsMessage; }),
       "bulk message flag without bulk data"},
      {"status on a pong",
       with([](MessageHeader& h, const RoguePeer&) {
         h.type = rpc_wire::kPong;
         h.request_id = 0;
         h.status = 3;
       }),
       "status set on a non-response"},
      {"bulk flags on a pong",
       with([](MessageHeader& h, const RoguePeer&) {
         h.type = rpc_wire::kPong;
         h.request_id = 0;
         h.flags = rpc_wire::kFlagBulk;
       }),
       "bulk flags on a message that carries no data"},
      {"payload on a cancel", control(rpc_wire::kCancel), "control message with a payload"},
      {"payload on a credit", control(rpc_wire::kCredit), "control message with a payload"},
      {"payload on a ping", control(rpc_wire::kPing), "control message with a payload"},
      {"payload on a pong", control(rpc_wire::kPong), "control message with a payload"},
      {"payload on a bulk ack", control(rpc_wire::kBulkAck), "control message with a payload"},
      {"a response for a slot beyond the call table",
       with([](MessageHeader& h, const RoguePeer&) {
         h.request_id = (h.request_id & ~uint64_t{0xffffffff}) | 100000;
       }),
       "which was never sent"},
      {"a response for a generation of the slot not issued yet",
       with([](MessageHeader& h, const RoguePeer&) { h.request_id += uint64_t{1} << 32; }),
       "which was never sent"},
  };
  for (const Attack& attack : attacks) {
    SCOPED_TRACE(attack.name);
    rogue_.set_tamper(attack.tamper);
    ASSERT_NO_FATAL_FAILURE(ConnectVictim());
    auto p = Start("victim");
    ASSERT_TRUE(peer_->SendRaw(attack.bytes(ResponseTo(*p), *peer_)).ok());
    ExpectConnectionLost(*p, attack.why);
    EXPECT_EQ(testing::Echo(**good_, attack.name), attack.name);
  }
}

// A cancelled call's late answer is no violation (the server had not heard of the cancel yet),
// but it must not complete the call that reuses the slot: the slot's generation tells them
// apart, and the late answer is dropped.
TEST_F(HostileServerTest, AnAnswerForAStaleGenerationOfItsSlotIsDroppedNotTaken) {
  ASSERT_NO_FATAL_FAILURE(ConnectVictim());
  auto first = Start("first");
  first->call.Cancel();
  EXPECT_EQ(first->call.Wait().code(), absl::StatusCode::kCancelled);
  auto cancel = peer_->Receive(rpc_wire::kCancel);
  ASSERT_TRUE(cancel.ok()) << cancel.status();
  EXPECT_EQ(cancel->header.request_id, first->id());
  auto second = Start("second");
  ASSERT_EQ(static_cast<uint32_t>(second->id()), static_cast<uint32_t>(first->id()))
      << "the second call was to reuse the first one's slot";
  ASSERT_EQ(second->id() >> 32, (first->id() >> 32) + 1);
  ASSERT_TRUE(peer_->Send(ResponseTo(*first, 5), "stale").ok());
  ASSERT_TRUE(peer_->Send(ResponseTo(*second, 5), "fresh").ok());
  ASSERT_TRUE(second->call.Wait().ok()) << second->call.status();
  EXPECT_EQ(second->response, "fresh");
  EXPECT_EQ(first->response, "");
  EXPECT_TRUE(victim_->connected());
}

// A response whose payload does not parse as the call's message fails that call with DATA_LOSS,
// and only it: the message was within the protocol (what its bytes mean is the application's),
// so the connection goes on.
TEST_F(HostileServerTest, AResponseThatDoesNotParseFailsOnlyItsCall) {
  ASSERT_NO_FATAL_FAILURE(ConnectVictim());
  control::Negotiated message;
  auto garbled = Start("garbled", {}, &message);
  // Field 1, length-delimited, 127 bytes long, and 3 of them: a truncated message.
  const std::string truncated = "\x0a\x7f" "abc";
  ASSERT_TRUE(peer_->Send(ResponseTo(*garbled, truncated.size()), truncated).ok());
  const absl::Status status = garbled->call.Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  auto next = Start("next");
  ASSERT_TRUE(peer_->Send(ResponseTo(*next, 4), "txen").ok());
  ASSERT_TRUE(next->call.Wait().ok()) << next->call.status();
  EXPECT_EQ(next->response, "txen");
  EXPECT_TRUE(victim_->connected());
}

// The channel reserves `server_credits` receive buffers for the server and returns their credits
// (16 at a time) only on messages of its own, which need credits the server granted it. Granted
// only 4 (its ping and two requests take 3, a credit return the last), the channel can return
// one batch: the server may send 32 + 16 messages, and the one after them ends the connection.
TEST_F(HostileServerTest, MoreMessagesThanTheCreditsGrantedEndTheConnection) {
  rogue_.set_tamper([](control::ConnectResponse& r) {
    r.mutable_negotiated()->set_client_credits(internal::kMinCredits);
  });
  ASSERT_NO_FATAL_FAILURE(ConnectVictim());
  ASSERT_EQ(victim_->negotiated().client_credits, internal::kMinCredits);
  const uint32_t granted = victim_->negotiated().server_credits;
  auto first = Start("first");
  auto second = Start("second");
  const MessageHeader pong{.version = kVersion, .type = rpc_wire::kPong};
  for (uint32_t sent = 0; sent + 1 < granted + granted / 2; ++sent) {
    ASSERT_TRUE(peer_->Send(pong).ok()) << sent;
  }
  ASSERT_TRUE(peer_->Send(ResponseTo(*first, 2), "ok").ok());
  ASSERT_TRUE(first->call.Wait().ok()) << "within its credits: " << first->call.status();
  EXPECT_EQ(first->response, "ok");
  auto credit = peer_->Receive(rpc_wire::kCredit);
  ASSERT_TRUE(credit.ok()) << credit.status();
  EXPECT_EQ(credit->header.credits, granted / 2);
  EXPECT_EQ(peer_->messages_received(), 4u) << "ping, two requests, one credit return";
  ASSERT_TRUE(peer_->SendRaw(Bytes(pong)).ok());
  ExpectConnectionLost(*second, "peer sent beyond the credits it was given");
}

// Descriptors of bulk responses are checked before anything is read.
TEST_F(HostileServerTest, ABulkResponseBeyondTheNegotiatedMaximumEndsTheConnection) {
  ASSERT_NO_FATAL_FAILURE(ConnectVictim());
  auto p = Start("big");
  const BulkDescriptor d = peer_->ExposeWindow(Data(4096, 2), IBV_ACCESS_REMOTE_READ);
  const uint64_t max = victim_->negotiated().max_bulk_size;
  const BulkDescriptor beyond{d.addr, static_cast<uint32_t>(max + 1), d.rkey};
  MessageHeader h = ResponseTo(*p, sizeof(beyond));
  h.flags = rpc_wire::kFlagBulk;
  ASSERT_TRUE(peer_->SendRaw(Bytes(h, AsBytes(beyond))).ok());
  ExpectConnectionLost(*p, absl::StrCat("bulk response of ", max + 1, " bytes"));
}

// A descriptor past the window it names: the channel's READ fails on the server's device, which
// fails the connection (and the buffer it was reading into is the call's no longer).
TEST_F(HostileServerTest, ABulkResponseOutOfItsWindowsBoundsEndsTheConnection) {
  ASSERT_NO_FATAL_FAILURE(ConnectVictim());
  auto p = Start("out of bounds");
  const BulkDescriptor d = peer_->ExposeWindow(Data(4096, 3), IBV_ACCESS_REMOTE_READ);
  const BulkDescriptor past{d.addr, 2 * d.length, d.rkey};
  MessageHeader h = ResponseTo(*p, sizeof(past));
  h.flags = rpc_wire::kFlagBulk;
  ASSERT_TRUE(peer_->SendRaw(Bytes(h, AsBytes(past))).ok());
  ExpectConnectionLost(*p, "send failed");
}

// Mirror mode: the server writes into the caller's reply window and names it in its response;
// a response naming it with a longer range than the caller exposed is a violation.
TEST_F(HostileServerTest, AMirrorResponseClaimingMoreThanTheReplyWindowEndsTheConnection) {
  ChannelOptions options;
  options.bulk_mode = BulkMode::kMirror;
  ASSERT_NO_FATAL_FAILURE(ConnectVictim(options));
  auto attachment = victim_->AllocateBulk(8192);
  ASSERT_TRUE(attachment.ok()) << attachment.status();
  attachment->resize(8192);
  auto landing = victim_->AllocateBulk(65536);
  ASSERT_TRUE(landing.ok()) << landing.status();
  CallOptions call_options;
  call_options.request_bulk = &*attachment;
  call_options.response_bulk = &*landing;
  auto p = Start("mirror", call_options);
  ASSERT_EQ(p->request.header.flags, rpc_wire::kFlagBulk | rpc_wire::kFlagReplyChunk);
  ASSERT_GE(p->request.payload.size(), 2 * sizeof(BulkDescriptor));
  BulkDescriptor reply;
  std::memcpy(&reply, p->request.payload.data() + sizeof(BulkDescriptor), sizeof(reply));
  ASSERT_EQ(reply.length, 65536u);
  const BulkDescriptor longer{reply.addr, reply.length + 1, reply.rkey};
  MessageHeader h = ResponseTo(*p, sizeof(longer));
  h.flags = rpc_wire::kFlagBulk;
  ASSERT_TRUE(peer_->Send(h, AsBytes(longer), /*invalidate_rkey=*/reply.rkey).ok());
  ExpectConnectionLost(*p, "response names our reply window with another range");
}

// Beyond RoCE: a window's lease lives in the soft device's key entry, so the device's responder
// itself refuses an access after it. Here the channel is caller-driven and nobody drives it
// after the call is sent, so its own timer, which would post the LOCAL_INV at the lease, never
// runs (its device's thread answers the READs for it): the rogue server's READ of the request
// window succeeds within the lease and is refused after it all the same.
TEST_F(HostileServerTest, AWindowReadAfterItsLeaseIsRefusedByTheDeviceWithoutItsOwnersTimer) {
  constexpr absl::Duration kLease = absl::Seconds(3);
  ChannelOptions options;
  options.bulk_mode = BulkMode::kMirror;
  options.driver = ChannelOptions::Driver::kCaller;
  options.transport.window_lease = kLease;
  ASSERT_NO_FATAL_FAILURE(ConnectVictim(options));
  const std::string data = Data(65536, 5);
  auto attachment = victim_->AllocateBulk(data.size());
  ASSERT_TRUE(attachment.ok()) << attachment.status();
  std::memcpy(attachment->data(), data.data(), data.size());
  attachment->resize(data.size());
  CallOptions call_options;
  call_options.request_bulk = &*attachment;
  call_options.timeout = absl::Seconds(15);
  auto p = Start("leased", call_options);
  // The window was bound (and its lease begun) before its request arrived here.
  const absl::Time lease_over_by = absl::Now() + kLease;
  ASSERT_EQ(p->request.header.flags, rpc_wire::kFlagBulk);
  ASSERT_GE(p->request.payload.size(), sizeof(BulkDescriptor));
  BulkDescriptor d;
  std::memcpy(&d, p->request.payload.data(), sizeof(d));
  ASSERT_EQ(d.length, data.size());
  std::string read;
  auto st = peer_->Read(d.addr, d.rkey, d.length, &read);
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(*st, IBV_WC_SUCCESS) << "the window's key and range are right within its lease";
  EXPECT_TRUE(read == data);
  // Past the lease (a wait for a time, not for an event), with the owner still not driven.
  while (absl::Now() < lease_over_by + absl::Milliseconds(100)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  st = peer_->Read(d.addr, d.rkey, d.length, &read);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(*st, IBV_WC_REM_ACCESS_ERR) << "a READ after the lease got through";
  // The caller drives again, so that its call ends (with the connection the refused access
  // ended, or at its deadline) before the channel goes.
  (void)p->call.Wait();
}

// Server-exposes mode: the server cannot know the size of the caller's response_bulk, so a
// longer response is no violation, but it must not be read into that buffer: the call fails
// RESOURCE_EXHAUSTED with the buffer untouched, the server's window is released (the ack
// revokes it), and the connection carries on.
TEST_F(HostileServerTest, ABulkResponseLongerThanTheCallersBufferFailsOnlyThatCall) {
  ASSERT_NO_FATAL_FAILURE(ConnectVictim());
  auto landing = victim_->AllocateBulk(4096);
  ASSERT_TRUE(landing.ok()) << landing.status();
  const size_t capacity = landing->capacity();
  std::memset(landing->data(), 'L', capacity);
  CallOptions call_options;
  call_options.response_bulk = &*landing;
  auto p = Start("too long", call_options);
  const BulkDescriptor d = peer_->ExposeWindow(Data(2 * capacity, 4), IBV_ACCESS_REMOTE_READ);
  ASSERT_NE(d.rkey, 0u);
  MessageHeader h = ResponseTo(*p, sizeof(d));
  h.flags = rpc_wire::kFlagBulk;
  ASSERT_TRUE(peer_->Send(h, AsBytes(d)).ok());
  const absl::Status s = p->call.Wait();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("response_bulk is too small"), absl::string_view::npos) << s;
  EXPECT_EQ(std::string(landing->data(), capacity), std::string(capacity, 'L'));
  auto ack = peer_->Receive(rpc_wire::kBulkAck);
  ASSERT_TRUE(ack.ok()) << ack.status();
  EXPECT_EQ(ack->invalidated_rkey, d.rkey);
  auto next = Start("next");
  ASSERT_TRUE(peer_->Send(ResponseTo(*next, 2), "ok").ok());
  ASSERT_TRUE(next->call.Wait().ok()) << next->call.status();
  EXPECT_EQ(next->response, "ok");
  EXPECT_TRUE(victim_->connected());
}

// Connect answers the client cannot live with are refused before its QP leaves INIT: Create
// fails saying why, and the client tells the server it will not use the connection.
TEST_F(HostileServerTest, AbsurdConnectAnswersAreRefused) {
  struct Case {
    const char* name;
    std::function<void(ChannelOptions&)> options;
    std::function<void(control::ConnectResponse&)> tamper;
    absl::StatusCode code;
    const char* why;
  };
  const auto any = [](ChannelOptions&) {};
  const auto local_only = [](ChannelOptions& o) {
    o.transport.invalidation = InvalidationPolicy::kLocalOnly;
  };
  const auto require_remote = [](ChannelOptions& o) {
    o.transport.invalidation = InvalidationPolicy::kRequireRemote;
  };
  const auto negotiated = [](auto change) {
    return [change](control::ConnectResponse& r) { change(*r.mutable_negotiated()); };
  };
  using control::Negotiated;
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  constexpr auto kPrecondition = absl::StatusCode::kFailedPrecondition;
  const std::vector<Case> cases = {
      {"no credits for us", any, negotiated([](Negotiated& n) { n.set_client_credits(0); }),
       kInvalid, "invalid number of credits"},
      {"more credits than any queue holds", any,
       negotiated([](Negotiated& n) { n.set_client_credits(1 << 20); }), kInvalid,
       "invalid number of credits"},
      {"credits we did not offer", any,
       negotiated([](Negotiated& n) { n.set_server_credits(n.server_credits() - 1); }), kInvalid,
       "credits we did not offer"},
      {"a message size beyond what we offered", any,
       negotiated([](Negotiated& n) { n.set_max_message_size(n.max_message_size() + 1); }),
       kInvalid, "does not fit our buffers"},
      {"a message size below the minimum", any,
       negotiated([](Negotiated& n) { n.set_max_message_size(internal::kMinMessage - 1); }),
       kInvalid, "does not fit our buffers"},
      {"remote invalidation, which we said we cannot do", local_only,
       negotiated([](Negotiated& n) { n.set_invalidation(control::INVALIDATION_REMOTE); }),
       kPrecondition, "which this device cannot do"},
      {"the fallback, when we require remote invalidation", require_remote,
       negotiated([](Negotiated& n) { n.set_invalidation(control::INVALIDATION_LOCAL); }),
       kPrecondition, "remote invalidation required"},
      {"no invalidation mode", any,
       negotiated([](Negotiated& n) { n.set_invalidation(control::INVALIDATION_NONE); }),
       kInvalid, "no invalidation mode"},
      {"another bulk mode", any,
       negotiated([](Negotiated& n) { n.set_bulk_mode(control::BULK_MIRROR); }), kInvalid,
       "changed the bulk mode"},
      {"bulk transfers beyond our pool", any,
       negotiated([](Negotiated& n) { n.set_max_bulk_size(uint64_t{1} << 40); }), kInvalid,
       "bulk parameters are out of range"},
      {"an eager threshold above the message size", any,
       negotiated([](Negotiated& n) { n.set_eager_threshold(n.max_message_size() + 1); }),
       kInvalid, "bulk parameters are out of range"},
      {"window credits beyond any queue", any,
       negotiated([](Negotiated& n) { n.set_window_credits(internal::kMaxCredits + 1); }),
       kInvalid, "bulk parameters are out of range"},
      {"another control protocol version", any,
       negotiated([](Negotiated& n) { n.set_protocol_version(n.protocol_version() + 1); }),
       kPrecondition, "another protocol version"},
      {"a GID of the wrong length", any,
       [](control::ConnectResponse& r) { r.mutable_address()->set_gid("gid"); }, kInvalid,
       "GID of 3 bytes"},
      {"a queue pair number out of range", any,
       [](control::ConnectResponse& r) { r.mutable_address()->set_qp_num(1 << 24); }, kInvalid,
       "queue pair address out of range"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    uint64_t id = 0;
    rogue_.set_tamper([&c, &id](control::ConnectResponse& r) {
      c.tamper(r);
      id = r.connection_id();
    });
    ChannelOptions options;
    c.options(options);
    auto refused = Channel::Create(rogue_.address(), options);
    ASSERT_FALSE(refused.ok()) << "connected despite " << c.name;
    EXPECT_EQ(refused.status().code(), c.code) << refused.status();
    EXPECT_NE(refused.status().message().find(c.why), absl::string_view::npos)
        << refused.status();
    ASSERT_TRUE(rogue_.Accept().ok());  // the rogue's end of it, unused
    ASSERT_FALSE(rogue_.disconnected().empty());
    EXPECT_EQ(rogue_.disconnected().back(), id) << "the client did not give the connection up";
  }
  rogue_.set_tamper(nullptr);
  ASSERT_NO_FATAL_FAILURE(ConnectVictim());
  auto p = Start("untampered");
  ASSERT_TRUE(peer_->Send(ResponseTo(*p, 2), "ok").ok());
  ASSERT_TRUE(p->call.Wait().ok()) << p->call.status();
}

}  // namespace
}  // namespace swirl
