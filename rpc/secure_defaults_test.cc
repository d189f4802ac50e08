// Secure by default (issue 19): a Server refuses to listen beyond loopback with no
// authentication, and a Channel refuses to send its token in plaintext beyond loopback, unless
// told to accept that. Both checks come before any listening or dialling, so the addresses
// beyond loopback here (0.0.0.0, and 192.0.2.1 of TEST-NET-1) need not be reachable.

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "swirl/channel.h"
#include "rpc/handshake.h"
#include "swirl/server.h"

namespace swirl {
namespace {

absl::Status StartServer(const std::string& address, const std::string& token, bool insecure) {
  ServerOptions options;
  options.address = address;
  options.auth_token = token;
  options.allow_insecure_non_loopback = insecure;
  Server server(options);
  absl::Status s = server.Start();
  server.Shutdown(absl::ZeroDuration());
  return s;
}

TEST(SecureDefaults, AServerWithoutAuthenticationRefusesToListenBeyondLoopback) {
  for (const char* address : {"0.0.0.0:0", "[::]:0", ":0", "192.0.2.1:0"}) {
    const absl::Status s = StartServer(address, "", false);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << address << ": " << s;
    EXPECT_NE(s.message().find("without authentication"), absl::string_view::npos) << s;
  }
}

// The refusal above is for want of authentication alone: loopback, a token, or the explicit
// insecure option each let the same server start.
TEST(SecureDefaults, AServerListensOnLoopbackWithATokenOrWhenToldToAcceptIt) {
  EXPECT_TRUE(StartServer("127.0.0.1:0", "", false).ok());
  EXPECT_TRUE(StartServer("0.0.0.0:0", "s3cret", false).ok());
  EXPECT_TRUE(StartServer("0.0.0.0:0", "", true).ok());
}

TEST(SecureDefaults, AChannelRefusesToSendItsTokenInPlaintextBeyondLoopback) {
  ChannelOptions options;
  options.auth_token = "s3cret";
  options.connect_timeout = absl::Milliseconds(300);
  auto channel = Channel::Create("192.0.2.1:7100", options);
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kFailedPrecondition) << channel.status();
  EXPECT_NE(channel.status().message().find("plaintext"), absl::string_view::npos);
}

// Told to accept it, the channel dials (and, nobody being there, fails otherwise).
TEST(SecureDefaults, AChannelToldToSendItsTokenInPlaintextDials) {
  ChannelOptions options;
  options.auth_token = "s3cret";
  options.allow_plaintext_token = true;
  options.connect_timeout = absl::Milliseconds(300);
  auto channel = Channel::Create("192.0.2.1:7100", options);
  EXPECT_FALSE(channel.ok());
  EXPECT_NE(channel.status().code(), absl::StatusCode::kFailedPrecondition) << channel.status();
}

TEST(SecureDefaults, LoopbackIsALiteralLoopbackAddressLocalhostOrAUnixSocket) {
  for (const char* a : {"127.0.0.1:1", "127.3.4.5:1", "[::1]:1", "localhost:1", "unix:/tmp/s",
                        "ipv4:127.0.0.1:1", "ipv6:[::1]:1", "dns:///localhost:1"}) {
    EXPECT_TRUE(internal::IsLoopbackOnly(a)) << a;
  }
  for (const char* a : {"0.0.0.0:1", "[::]:1", ":1", "10.0.0.1:1", "example.com:1",
                        "127.example.com:1", "ipv4:10.1.1.1:1", "[::ffff:10.0.0.1]:1"}) {
    EXPECT_FALSE(internal::IsLoopbackOnly(a)) << a;
  }
}

}  // namespace
}  // namespace swirl
