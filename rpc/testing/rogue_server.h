// Test helper: a server that answers a swirl Channel's Control.Connect as swirl's own server
// does (the same negotiation, rpc/handshake.h, and a QP of its own moved to RTS), then leaves the
// data plane to the test, which speaks it by hand through a RoguePeer (rogue.h): malformed
// responses, responses for calls never made, more messages than its credits, bulk descriptors
// out of bounds. Answers to Connect can be changed before they leave (absurd negotiated values).

#ifndef SWIRL_RPC_TESTING_ROGUE_SERVER_H_
#define SWIRL_RPC_TESTING_ROGUE_SERVER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "proto/control.pb.h"
#include "rpc/testing/rogue.h"
#include "transport/verbs/capabilities.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace swirl::testing {

class RogueServer {
 public:
  // Called with the answer a correct server would give (on gRPC's thread); may change anything.
  using Tamper = std::function<void(control::ConnectResponse&)>;

  RogueServer();
  ~RogueServer();
  RogueServer(const RogueServer&) = delete;
  RogueServer& operator=(const RogueServer&) = delete;

  // Listens on 127.0.0.1 (a free port).
  absl::Status Start();
  std::string address() const;
  // Applies to the Connect calls answered from now on.
  void set_tamper(Tamper tamper);
  // Link keys (ConnectResponse.link_key), for the Connect calls answered from now on: none
  // declared (the default), or for a client that declares them, a key sent and then used by
  // our QP as well (kHonest) or not (kWithheld: our QP links without it).
  enum class LinkKeys { kNone, kHonest, kWithheld };
  void set_link_keys(LinkKeys mode);

  // Our end of the next connection a Connect set up (in the order they were answered), once
  // its answer is on its way, within `timeout`.
  absl::StatusOr<std::unique_ptr<RoguePeer>> Accept(absl::Duration timeout = absl::Seconds(10));
  // The connection ids clients sent Control.Disconnect for, in order.
  std::vector<uint64_t> disconnected() const;

 private:
  class Control;
  std::unique_ptr<Control> control_;
  std::unique_ptr<grpc::Server> grpc_;
  int port_ = 0;
};

}  // namespace swirl::testing

#endif  // SWIRL_RPC_TESTING_ROGUE_SERVER_H_
