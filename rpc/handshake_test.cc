// Unit tests of the handshake's helpers that need no device.

#include "rpc/handshake.h"

#include <gtest/gtest.h>

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
  EXPECT_EQ(ClientKey("ipv6:[::1]:5555"), "ipv6:[::1]");
  EXPECT_EQ(ClientKey("unix:/tmp/socket"), "unix:/tmp/socket");
}

}  // namespace
}  // namespace swirl::internal
