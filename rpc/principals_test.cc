// Tenants of one server (ServerOptions::principals), as a tenant holding its own token would try
// to get past the others: what its handlers see it as, what Stats shows it, and whose share of
// the per-client limits its connections take. Against rpc/testing/test_server in another
// process.

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/testing/process.h"
#include "rpc/testing/test_client.h"
#include "swirl/call.h"
#include "swirl/channel.h"
#include "swirl/server.h"

namespace swirl {
namespace {

using testing::Echo;
using testing::MethodOf;

// alice and bob are tenants; root is an admin. No auth_token: every client is one of them.
const std::vector<std::string> kPrincipals = {"--token=",
                                              "--principals=alice:alice-token,bob:bob-token,"
                                              "root:root-token:admin"};

absl::StatusOr<std::shared_ptr<Channel>> ConnectAs(const std::string& host, int port,
                                                   const std::string& token) {
  ChannelOptions options;
  options.auth_token = token;
  options.client_name = absl::StrCat("principals_test with ", token);
  return Channel::Create(absl::StrCat(host, ":", port), options);
}

std::string Whoami(Channel& channel) {
  std::string response;
  absl::Status s = CallRaw(channel, MethodOf("/test.E2E/Whoami"), "", &response,
                           CallOptions{absl::Seconds(10)});
  return s.ok() ? response : s.ToString();
}

std::set<uint64_t> ConnectionIds(const StatsReport& stats) {
  std::set<uint64_t> ids;
  for (const ConnectionStats& c : stats.connections) ids.insert(c.connection_id);
  return ids;
}

// The server's id for the connection of the client that named itself `client_name`, as the
// admin's Stats lists it (0: none).
uint64_t IdOf(const StatsReport& admin_view, const std::string& client_name) {
  for (const ConnectionStats& c : admin_view.connections) {
    if (c.client_name == client_name) return c.connection_id;
  }
  return 0;
}

TEST(Principals, AHandlerSeesThePrincipalTheCallersTokenNames) {
  auto server = testing::SpawnServer(testing::kTestServer, kPrincipals);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = server->second;
  for (const auto& [token, name] :
       std::vector<std::pair<std::string, std::string>>{{"alice-token", "alice"},
                                                        {"bob-token", "bob"},
                                                        {"root-token", "root"}}) {
    auto channel = ConnectAs("127.0.0.1", port, token);
    ASSERT_TRUE(channel.ok()) << name << ": " << channel.status();
    EXPECT_EQ(Whoami(**channel), name);
  }
  // A token no principal has, and none at all, name no one.
  for (const std::string& token : {std::string("carol-token"), std::string("alice-token2"),
                                   std::string()}) {
    auto refused = ConnectAs("127.0.0.1", port, token);
    ASSERT_FALSE(refused.ok()) << "connected with '" << token << "'";
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  }
}

// The attacker: bob, with his own token, asks Stats for the connections of the server, to learn
// alice's connection ids, client names, addresses and traffic.
TEST(Principals, ATenantSeesOnlyItsOwnConnectionsInStats) {
  auto server = testing::SpawnServer(testing::kTestServer, kPrincipals);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = server->second;
  auto alice = ConnectAs("127.0.0.1", port, "alice-token");
  ASSERT_TRUE(alice.ok()) << alice.status();
  auto bob1 = ConnectAs("127.0.0.1", port, "bob-token");
  ASSERT_TRUE(bob1.ok()) << bob1.status();
  auto bob2 = ConnectAs("127.0.0.1", port, "bob-token");
  ASSERT_TRUE(bob2.ok()) << bob2.status();
  auto root = ConnectAs("127.0.0.1", port, "root-token");
  ASSERT_TRUE(root.ok()) << root.status();
  for (Channel* c : {alice->get(), bob1->get(), bob2->get(), root->get()}) {
    ASSERT_EQ(Echo(*c, "up"), "up");
  }

  // The admin sees all four, each with its principal.
  auto all = (*root)->ServerStats();
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->connections.size(), 4u);
  const uint64_t alice_id = IdOf(*all, "principals_test with alice-token");
  ASSERT_NE(alice_id, 0u);
  for (const ConnectionStats& c : all->connections) {
    EXPECT_EQ(c.client_name, absl::StrCat("principals_test with ", c.principal, "-token"));
  }

  auto bobs_view = (*bob1)->ServerStats();
  ASSERT_TRUE(bobs_view.ok()) << bobs_view.status();
  ASSERT_EQ(bobs_view->connections.size(), 2u);
  for (const ConnectionStats& c : bobs_view->connections) {
    EXPECT_EQ(c.principal, "bob");
    EXPECT_EQ(c.client_name, "principals_test with bob-token");
  }
  EXPECT_EQ(ConnectionIds(*bobs_view).count(alice_id), 0u);

  auto alices_view = (*alice)->ServerStats();
  ASSERT_TRUE(alices_view.ok()) << alices_view.status();
  ASSERT_EQ(alices_view->connections.size(), 1u);
  EXPECT_EQ(alices_view->connections[0].connection_id, alice_id);
  EXPECT_EQ(alices_view->connections[0].principal, "alice");
}

// The attacker: alice, capped at 2 connections, connects from a second source address (here
// IPv6 loopback beside IPv4 loopback; across hosts, another machine or address) to get a second
// share. Her principal is one client whatever the address; bob's share is his own.
TEST(Principals, ATenantCannotExceedItsConnectionLimitFromSeveralAddresses) {
  std::vector<std::string> args = kPrincipals;
  args.push_back("--host=[::]");  // both families, so that clients can come from two addresses
  args.push_back("--max_per_client=2");
  auto server = testing::SpawnServer(testing::kTestServer, args);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = server->second;

  auto over_v4 = ConnectAs("127.0.0.1", port, "alice-token");
  ASSERT_TRUE(over_v4.ok()) << over_v4.status();
  auto over_v6 = ConnectAs("[::1]", port, "alice-token");
  ASSERT_TRUE(over_v6.ok()) << over_v6.status();
  ASSERT_EQ(Echo(**over_v4, "v4"), "v4");
  ASSERT_EQ(Echo(**over_v6, "v6"), "v6");

  // The two really are two addresses to the server, each with one of alice's connections: per
  // address, each would have room for another.
  auto seen = (*over_v4)->ServerStats();
  ASSERT_TRUE(seen.ok()) << seen.status();
  ASSERT_EQ(seen->connections.size(), 2u);
  std::set<std::string> addresses;
  for (const ConnectionStats& c : seen->connections) {
    addresses.insert(c.peer.substr(0, c.peer.rfind(':')));
  }
  ASSERT_EQ(addresses.size(), 2u) << seen->connections[0].peer << " "
                                  << seen->connections[1].peer;

  for (const char* host : {"127.0.0.1", "[::1]"}) {
    auto third = ConnectAs(host, port, "alice-token");
    ASSERT_FALSE(third.ok()) << "alice's third connection, from " << host << ", was admitted";
    EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
    EXPECT_NE(third.status().message().find("principal:alice"), absl::string_view::npos)
        << third.status();
  }
  // bob, from the same addresses, has his own share.
  auto bob_v4 = ConnectAs("127.0.0.1", port, "bob-token");
  ASSERT_TRUE(bob_v4.ok()) << bob_v4.status();
  auto bob_v6 = ConnectAs("[::1]", port, "bob-token");
  ASSERT_TRUE(bob_v6.ok()) << bob_v6.status();
  EXPECT_EQ(Echo(**bob_v6, "bob"), "bob");
  EXPECT_EQ(Echo(**over_v4, "still"), "still");
}

// A principal's own max_connections is its cap instead of the server's per-client one.
TEST(Principals, APrincipalsOwnCapIsItsLimit) {
  auto server = testing::SpawnServer(
      testing::kTestServer,
      {"--token=", "--principals=alice:alice-token:1,bob:bob-token", "--max_per_client=3"});
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = server->second;
  auto first = ConnectAs("127.0.0.1", port, "alice-token");
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = ConnectAs("127.0.0.1", port, "alice-token");
  ASSERT_FALSE(second.ok()) << "alice's second connection was admitted";
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted) << second.status();
  std::vector<std::shared_ptr<Channel>> bobs;
  for (int i = 0; i < 3; ++i) {
    auto bob = ConnectAs("127.0.0.1", port, "bob-token");
    ASSERT_TRUE(bob.ok()) << "bob's connection " << i << ": " << bob.status();
    bobs.push_back(*bob);
  }
  EXPECT_FALSE(ConnectAs("127.0.0.1", port, "bob-token").ok());
}

// Principals the server could not tell apart, or that no credential could name, are a
// configuration error at Start, not a server that picks one by order. (In-process: Start fails
// before it listens.)
TEST(Principals, StartRefusesPrincipalsThatDoNotEachNameOneClient) {
  auto start = [](ServerOptions options) {
    options.address = "127.0.0.1:0";
    Server server(options);
    absl::Status s = server.Start();
    server.Shutdown(absl::ZeroDuration());
    return s;
  };
  const Principal alice{.name = "alice", .token = "alice-token"};
  struct Case {
    const char* why;
    ServerOptions options;
  };
  std::vector<Case> cases;
  cases.push_back({"two principals named alice", {}});
  cases.back().options.principals = {alice, Principal{.name = "alice", .token = "other"}};
  cases.push_back({"two principals with one token", {}});
  cases.back().options.principals = {alice, Principal{.name = "bob", .token = "alice-token"}};
  cases.push_back({"auth_token's principal 'default' given again", {}});
  cases.back().options.auth_token = "t";
  cases.back().options.principals = {Principal{.name = "default", .token = "u"}};
  cases.push_back({"two principals with one certificate identity", {}});
  cases.back().options.tls_cert_file = "/nonexistent/server.pem";
  cases.back().options.tls_client_ca_file = "/nonexistent/ca.pem";
  cases.back().options.principals = {
      Principal{.name = "carol", .token = "carol-token", .tls_identity = "carol"},
      Principal{.name = "dave", .tls_identity = "carol"}};
  cases.push_back({"a principal without a name", {}});
  cases.back().options.principals = {Principal{.token = "t"}};
  cases.push_back({"a principal without credentials", {}});
  cases.back().options.principals = {Principal{.name = "nobody"}};
  cases.push_back({"a certificate identity with no CA to verify it", {}});
  cases.back().options.principals = {Principal{.name = "carol", .tls_identity = "carol"}};
  cases.push_back({"a client CA without TLS", {}});
  cases.back().options.tls_client_ca_file = "/nonexistent/ca.pem";
  for (Case& c : cases) {
    const absl::Status s = start(std::move(c.options));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.why << ": " << s;
    // Errors name principals, never their tokens.
    EXPECT_EQ(s.message().find("alice-token"), absl::string_view::npos) << s;
  }
  // Principals are authentication: beyond loopback they let a server start.
  ServerOptions beyond;
  beyond.principals = {alice};
  beyond.address = "0.0.0.0:0";
  Server server(beyond);
  EXPECT_TRUE(server.Start().ok());
  server.Shutdown(absl::ZeroDuration());
}

}  // namespace
}  // namespace swirl
