// Unit tests of the handshake's helpers that need no device.

#include "rpc/handshake.h"

#include <gtest/gtest.h>

#include <cstring>

namespace swirl::internal {
namespace {

TEST(DialableAddress, IsTheBoundHostWithThePortItGot) {
  EXPECT_EQ(DialableAddress("127.0.0.1:0", 4242), "127.0.0.1:4242");
  EXPECT_EQ(DialableAddress("127.0.0.7:7100", 7100), "127.0.0.7:7100");
  EXPECT_EQ(DialableAddress("[::1]:0", 4242), "[::1]:4242");
  EXPECT_EQ(DialableAddress("[fe80::1%eth0]:0", 9), "[fe80::1%eth0]:9");
  EXPECT_EQ(DialableAddress("10.1.2.3:0", 80), "10.1.2.3:80");
}

TEST(DialableAddress, AWildcardBindIsDialledOnLoopbackNeverByName) {
  EXPECT_EQ(DialableAddress("0.0.0.0:0", 4242), "127.0.0.1:4242");
  EXPECT_EQ(DialableAddress(":0", 4242), "127.0.0.1:4242");
  EXPECT_EQ(DialableAddress("[::]:0", 4242), "[::1]:4242");
  EXPECT_EQ(DialableAddress("[::0]:7", 7), "[::1]:7");
}

TEST(ClientKey, IsThePeerAddressWithoutItsPort) {
  EXPECT_EQ(ClientKey("ipv4:127.0.0.1:5555"), "ipv4:127.0.0.1");
  EXPECT_EQ(ClientKey("ipv4:127.0.0.1:6666"), "ipv4:127.0.0.1");
  EXPECT_NE(ClientKey("ipv4:127.0.0.1:5555"), ClientKey("ipv4:127.0.0.2:5555"));
  EXPECT_EQ(ClientKey("unix:/tmp/socket"), "unix:/tmp/socket");
}

// The attacker: one host with a /64 to itself, connecting from a fresh address in it each time
// to get a fresh share of the per-address limits. Its addresses are one client.
TEST(ClientKey, AnIpv6ClientVaryingItsLow64BitsIsOneClient) {
  const std::string key = ClientKey("ipv6:[2001:db8:1:2::1]:5555");
  EXPECT_EQ(key, "ipv6:[2001:db8:1:2::]/64");
  for (const char* peer : {"ipv6:[2001:db8:1:2::2]:5555", "ipv6:[2001:db8:1:2:ffff:ffff:ffff:ffff]:1",
                           "ipv6:[2001:db8:1:2:1234:5678:9abc:def0]:40000",
                           "ipv6:%5B2001:db8:1:2:a::b%5D:7"}) {
    EXPECT_EQ(ClientKey(peer), key) << peer;
  }
  // Another /64 is another client, however close.
  EXPECT_NE(ClientKey("ipv6:[2001:db8:1:3::1]:5555"), key);
  EXPECT_NE(ClientKey("ipv6:[2001:db8:1:1:ffff:ffff:ffff:ffff]:5555"), key);
  // Loopback is a /64 of its own.
  EXPECT_EQ(ClientKey("ipv6:[::1]:5555"), "ipv6:[::]/64");
  // A link-local address's zone does not make it another client.
  EXPECT_EQ(ClientKey("ipv6:[fe80::1%eth0]:5555"), ClientKey("ipv6:[fe80::2%eth1]:5555"));
}

TEST(ClientKey, AnIpv4MappedAddressIsItsIpv4Address) {
  EXPECT_EQ(ClientKey("ipv6:[::ffff:10.1.2.3]:5555"), "ipv4:10.1.2.3");
  EXPECT_EQ(ClientKey("ipv6:[::ffff:10.1.2.3]:5555"), ClientKey("ipv4:10.1.2.3:1"));
  EXPECT_NE(ClientKey("ipv6:[::ffff:10.1.2.3]:5555"), ClientKey("ipv6:[::ffff:10.1.2.4]:5555"));
}

TEST(LimitKey, IsThePrincipalWhereThereIsOneElseTheAddress) {
  EXPECT_EQ(LimitKey("alice", "ipv4:127.0.0.1:5555"), LimitKey("alice", "ipv6:[::1]:6"));
  EXPECT_NE(LimitKey("alice", "ipv4:127.0.0.1:5555"), LimitKey("bob", "ipv4:127.0.0.1:5555"));
  EXPECT_EQ(LimitKey("", "ipv4:127.0.0.1:5555"), "ipv4:127.0.0.1");
  // No principal name can pass for an address.
  EXPECT_NE(LimitKey("ipv4:127.0.0.1", "ipv4:10.0.0.1:1"), ClientKey("ipv4:127.0.0.1:1"));
}


// A server's capabilities (soft device, remote invalidation) and a request it accepts from a
// client at GID 2001:db8::7.
verbs::Capabilities ServerCaps() {
  verbs::Capabilities caps;
  caps.kind = verbs::DeviceKind::kSoft;
  caps.mw_type2b = true;
  caps.remote_invalidation_advertised = true;
  return caps;
}

control::ConnectRequest AcceptableRequest(const verbs::Capabilities& client_caps) {
  control::ConnectRequest request;
  request.set_protocol_version(kControlProtocolVersion);
  verbs::PeerAddress address;
  address.gid.raw[0] = 0x20;
  address.gid.raw[1] = 0x01;
  address.gid.raw[2] = 0x0d;
  address.gid.raw[3] = 0xb8;
  address.gid.raw[15] = 7;
  address.qp_num = 0x123;
  *request.mutable_address() = ToProto(address);
  *request.mutable_capabilities() = DescribeLocal(client_caps, LocalConfig());
  return request;
}

// Whether the client can be reached is the server's device's answer, asked with the client's
// GID; a refusal reaches the client with the device's reason.
TEST(Negotiate, AsksTheDeviceWhetherTheClientIsReachable) {
  const control::ConnectRequest request = AcceptableRequest(ServerCaps());
  int asked = 0;
  ibv_gid asked_for{};
  auto refuse = [&](const ibv_gid& client_gid) {
    ++asked;
    asked_for = client_gid;
    return absl::FailedPreconditionError("the peer is on another fabric");
  };
  auto refused = Negotiate(request, ServerCaps(), LocalConfig(), refuse);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("cannot reach the client's: the peer is on another "
                                            "fabric"),
            absl::string_view::npos)
      << refused.status();
  EXPECT_EQ(asked, 1);
  EXPECT_EQ(std::memcmp(asked_for.raw, request.address().gid().data(), sizeof(asked_for.raw)), 0);

  auto accept = [](const ibv_gid&) { return absl::OkStatus(); };
  auto accepted = Negotiate(request, ServerCaps(), LocalConfig(), accept);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_EQ(accepted->invalidation(), control::INVALIDATION_REMOTE);
}

// Another kind of device is refused as such, before the device is asked about addresses it
// could not judge.
TEST(Negotiate, AnotherKindOfDeviceIsRefusedWithoutAskingTheDevice) {
  verbs::Capabilities client_caps = ServerCaps();
  client_caps.kind = verbs::DeviceKind::kRdmaCore;
  int asked = 0;
  auto reachable = [&](const ibv_gid&) {
    ++asked;
    return absl::OkStatus();
  };
  auto refused = Negotiate(AcceptableRequest(client_caps), ServerCaps(), LocalConfig(), reachable);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("same kind of device"), absl::string_view::npos)
      << refused.status();
  EXPECT_EQ(asked, 0);
}

}  // namespace
}  // namespace swirl::internal
