// Link keys on a real swirl server (rpc/testing/test_server, another process): every
// connection's QP is bound to a random key that only its Connect's caller learns
// (ConnectResponse.link_key). A QP at exactly the address the server links to (the GID and QPN
// the client declared, which anyone on a plaintext control plane sees) but without that key
// cannot take the link, and the server's other connections carry on. The device side of the
// handshake is checked in transport/soft (tcp_link_test TcpLinkKey.*, shm_link_test
// ShmLinkKey.*); the channel's side in hostile_server_test (HostileServerTest.*LinkKey*).

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>

#include "swirl/channel.h"
#include "rpc/handshake.h"
#include "rpc/testing/process.h"
#include "rpc/testing/rogue.h"
#include "rpc/testing/test_client.h"
#include "rpc/wire.h"

namespace swirl {
namespace {

using testing::RogueConnection;
using LinkKeyUse = testing::RogueConnection::LinkKeyUse;

class LinkKeyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = testing::SpawnServer(testing::kTestServer, {});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::make_unique<testing::ChildProcess>(std::move(server->first));
    port_ = server->second;
    auto good = testing::ConnectTo(port_);
    ASSERT_TRUE(good.ok()) << good.status();
    good_ = *good;
  }
  void TearDown() override {
    ASSERT_NE(good_, nullptr);
    EXPECT_EQ(testing::Echo(*good_, "unharmed"), "unharmed");
  }

  // A rogue client that completed Connect declaring link keys, then used the server's key as
  // `use` says.
  std::unique_ptr<RogueConnection> Rogue(LinkKeyUse use) {
    auto rogue = std::make_unique<RogueConnection>();
    rogue->UseLinkKey(use);
    const absl::Status s = rogue->Connect(port_, testing::kTestToken);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(rogue->link_key().size(), internal::kLinkKeyBytes)
        << "the server made no link key for a client that takes one";
    return rogue;
  }

  // `rogue`'s call never reaches the server: its SEND fails (the link never forms), instead
  // of the server answering.
  static void ExpectNoLink(RogueConnection& rogue) {
    const absl::Status s = rogue.Call("/test.E2E/Echo", "let me in");
    EXPECT_FALSE(s.ok()) << "a QP without the connection's key took the server's link";
    auto response = rogue.Receive(rpc_wire::kResponse, absl::Milliseconds(100));
    EXPECT_FALSE(response.ok()) << "the server answered a QP without the key";
  }

  std::unique_ptr<testing::ChildProcess> server_;
  int port_ = 0;
  std::shared_ptr<Channel> good_;
};

TEST_F(LinkKeyTest, AQpWithoutTheKeyCannotTakeTheServersLink) {
  auto rogue = Rogue(LinkKeyUse::kWithout);
  ASSERT_NO_FATAL_FAILURE(ExpectNoLink(*rogue));
}

TEST_F(LinkKeyTest, AQpWithAnotherKeyCannotTakeTheServersLink) {
  auto rogue = Rogue(LinkKeyUse::kWrong);
  ASSERT_NO_FATAL_FAILURE(ExpectNoLink(*rogue));
}

// The same QP with the key it was given links and is answered: the two above failed for want
// of the key alone.
TEST_F(LinkKeyTest, TheQpGivenTheKeyLinks) {
  auto rogue = Rogue(LinkKeyUse::kAsGiven);
  uint64_t id = 0;
  ASSERT_TRUE(rogue->Call("/test.E2E/Echo", "keyed", 0, 0, &id).ok());
  auto response = rogue->Receive(rpc_wire::kResponse);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->header.request_id, id);
  EXPECT_EQ(response->payload, "keyed");
}

// A client that declares no link keys (a NIC's QP cannot take one) gets none, and links as a
// RoCE QP does.
TEST_F(LinkKeyTest, AClientThatTakesNoKeysGetsNone) {
  RogueConnection rogue;
  ASSERT_TRUE(rogue.Connect(port_, testing::kTestToken).ok());
  EXPECT_TRUE(rogue.link_key().empty());
  ASSERT_TRUE(rogue.Call("/test.E2E/Echo", "keyless").ok());
  EXPECT_TRUE(rogue.Receive(rpc_wire::kResponse).ok());
}

}  // namespace
}  // namespace swirl
