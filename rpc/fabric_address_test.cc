// The server links only where the client is, and the client only where the server is (issue
// 19): on the soft device's TCP fabric (SWIRL_SOFT_TCP=127.0.0.1 for this target) a GID names
// an IPv4 address and port that the side linking to it connects to, so a peer declaring
// another host's GID could make this side open TCP connections anywhere. A GID must name the
// address the peer called from (or one in a configured fabric network).

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>

#include "swirl/channel.h"
#include "rpc/handshake.h"
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/rogue_server.h"
#include "rpc/testing/test_client.h"

namespace swirl {
namespace {

using testing::RogueConnection;

// `gid` (a TCP fabric GID, ::ffff:<IPv4> with the port in bytes 8-9) moved to 10.9.9.9.
void MoveToAnotherHost(std::string* gid) {
  ASSERT_EQ(gid->size(), 16u);
  ASSERT_EQ(static_cast<uint8_t>((*gid)[10]), 0xff) << "not a TCP fabric GID: is SWIRL_SOFT_TCP set?";
  (*gid)[12] = 10;
  (*gid)[13] = 9;
  (*gid)[14] = 9;
  (*gid)[15] = 9;
}

absl::Status ConnectDeclaringAnotherHost(int port) {
  RogueConnection rogue;
  rogue.TamperRequest([](control::ConnectRequest& r) {
    MoveToAnotherHost(r.mutable_address()->mutable_gid());
  });
  return rogue.Connect(port, testing::kTestToken);
}

TEST(FabricAddress, AClientDeclaringAnotherHostsGidIsRefused) {
  auto server = testing::SpawnServer(testing::kTestServer, {});
  ASSERT_TRUE(server.ok()) << server.status();
  const absl::Status s = ConnectDeclaringAnotherHost(server->second);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("10.9.9.9"), absl::string_view::npos) << s;
  // The refusal was for the GID alone: the same rogue declaring its own is taken, and so is a
  // channel.
  RogueConnection honest;
  EXPECT_TRUE(honest.Connect(server->second, testing::kTestToken).ok());
  auto channel = testing::ConnectTo(server->second);
  ASSERT_TRUE(channel.ok()) << channel.status();
  EXPECT_EQ(testing::Echo(**channel, "served"), "served");
}

TEST(FabricAddress, AClientInAConfiguredFabricNetworkIsTaken) {
  auto server =
      testing::SpawnServer(testing::kTestServer, {"--fabric_networks=10.9.9.0/24"});
  ASSERT_TRUE(server.ok()) << server.status();
  const absl::Status s = ConnectDeclaringAnotherHost(server->second);
  EXPECT_TRUE(s.ok()) << s;
}

TEST(FabricAddress, AChannelRefusesAServerDeclaringAnotherHostsGid) {
  testing::RogueServer rogue;
  ASSERT_TRUE(rogue.Start().ok());
  rogue.set_tamper([](control::ConnectResponse& r) {
    MoveToAnotherHost(r.mutable_address()->mutable_gid());
  });
  auto channel = Channel::Create(rogue.address(), {});
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kPermissionDenied) << channel.status();
  ChannelOptions allowed;
  allowed.fabric_networks = {"10.9.9.9/32"};
  auto taken = Channel::Create(rogue.address(), allowed);
  EXPECT_TRUE(taken.ok()) << taken.status();
}

TEST(FabricAddress, TheGidsAddressMustBeThePeersOrInANetwork) {
  using internal::CheckPeerAddress;
  auto nets = internal::ParseFabricNetworks({"10.1.0.0/16", "192.0.2.7"});
  ASSERT_TRUE(nets.ok()) << nets.status();
  EXPECT_TRUE(CheckPeerAddress("127.0.0.1", "ipv4:127.0.0.1:4000", {}).ok());
  EXPECT_TRUE(CheckPeerAddress("10.0.0.5", "ipv6:[::ffff:10.0.0.5]:4000", {}).ok());
  EXPECT_TRUE(CheckPeerAddress("10.0.0.5", "ipv6:%5B::ffff:10.0.0.5%5D:4000", {}).ok());
  EXPECT_FALSE(CheckPeerAddress("10.0.0.6", "ipv4:10.0.0.5:4000", {}).ok());
  EXPECT_FALSE(CheckPeerAddress("169.254.169.254", "ipv4:10.0.0.5:4000", *nets).ok());
  EXPECT_TRUE(CheckPeerAddress("10.1.200.3", "ipv4:10.0.0.5:4000", *nets).ok());
  EXPECT_TRUE(CheckPeerAddress("192.0.2.7", "ipv4:10.0.0.5:4000", *nets).ok());
  EXPECT_FALSE(CheckPeerAddress("192.0.2.8", "ipv4:10.0.0.5:4000", *nets).ok());
  EXPECT_FALSE(CheckPeerAddress("10.0.0.5", "unix:/tmp/s", {}).ok());
  for (const char* bad : {"10.0.0.0/33", "10.0.0/8", "host/8", "10.0.0.0/x"}) {
    EXPECT_FALSE(internal::ParseFabricNetworks({bad}).ok()) << bad;
  }
}

}  // namespace
}  // namespace swirl
