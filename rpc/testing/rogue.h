// Test helpers that speak swirl's data-plane protocol by hand over plain verbs, so tests can
// misbehave on purpose: reuse revoked rkeys, guess keys, read out of bounds, never acknowledge,
// acknowledge with the wrong key, send malformed headers.
//   * RoguePeer: one end of a connection (QP, CQ, receive buffers, a scratch for RDMA);
//   * RogueConnection: a client that completes swirl's real handshake with a server first;
//   * RogueServer (rogue_server.h): a server that answers a swirl Channel's handshake.

#ifndef SWIRL_RPC_TESTING_ROGUE_H_
#define SWIRL_RPC_TESTING_ROGUE_H_

#include <infiniband/verbs.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/control.pb.h"
#include "rpc/wire.h"
#include "transport/verbs/verbs.h"

namespace swirl::testing {

struct Received {
  rpc_wire::MessageHeader header;
  std::string payload;
  unsigned int wc_flags = 0;
  uint32_t invalidated_rkey = 0;
};

class RoguePeer {
 public:
  // What our side offers its peer: receive buffers posted (credits) and their size.
  static constexpr int kRecvs = 64;
  static constexpr uint32_t kRecvSize = 8192;
  // The largest RDMA operation through the scratch (and so the largest bulk size we offer).
  static constexpr uint32_t kScratchBytes = 32 << 20;

  // Opens the device; makes the CQ, the QP (in INIT) and our registered buffers; posts the
  // receives.
  absl::Status Open();
  // Our QP's address for the other side (our starting PSN included).
  absl::StatusOr<verbs::PeerAddress> LocalAddress();
  // Moves our QP to RTR and RTS, connected to `peer`, after handing it `link_key` if one is
  // given (verbs::QueuePair::SetLinkKey).
  absl::Status ConnectTo(const verbs::PeerAddress& peer, absl::string_view link_key = {});
  verbs::Context& context() const { return *ctx_; }
  // Our QP (for a fault injected on it: soft::InjectFault).
  ibv_qp* qp() const { return qp_->get(); }

  // Sends one message (inline when small): SEND, or SEND_WITH_INV when invalidate_rkey != 0.
  absl::Status Send(const rpc_wire::MessageHeader& header, absl::string_view payload = {},
                    uint32_t invalidate_rkey = 0);
  // Sends raw bytes as one message.
  absl::Status SendRaw(absl::string_view bytes);
  // A well-formed call (request header for `method`, next request id).
  absl::Status Call(const char* method, absl::string_view payload, uint16_t flags = 0,
                    uint32_t invalidate_rkey = 0, uint64_t* request_id = nullptr);

  // The next message of `type` (others are kept aside for later), within `timeout`.
  absl::StatusOr<Received> Receive(uint8_t type, absl::Duration timeout = absl::Seconds(10));

  // One-sided operations against the server through our registered scratch buffer. They return
  // the completion status (IBV_WC_SUCCESS or the error).
  absl::StatusOr<ibv_wc_status> Read(uint64_t addr, uint32_t rkey, uint32_t length,
                                     std::string* out);
  absl::StatusOr<ibv_wc_status> Write(uint64_t addr, uint32_t rkey, absl::string_view data);

  // Copies `data` into a region of ours the peer may READ (and WRITE) and describes it, as a
  // bulk descriptor of our own (responses to the server's calls, mirror requests).
  rpc_wire::BulkDescriptor Expose(absl::string_view data);
  // The same through a type 2 memory window bound over exactly `data` on our QP, as swirl
  // exposes memory: what the peer's SEND_WITH_INV of its rkey revokes. A zero rkey on failure.
  rpc_wire::BulkDescriptor ExposeWindow(absl::string_view data, int access);

  // Credits the peer returned (the `credits` fields of everything received) since the last
  // call; polls first.
  uint32_t TakeCredits();

  // True once our QP is in the error state (the peer cut us off), within `timeout`. Probes with
  // pings (a server answers them).
  bool CutOff(absl::Duration timeout);

  // Messages received so far (each one a credit the sender used).
  uint32_t messages_received() const { return messages_received_; }

 private:
  absl::StatusOr<ibv_wc> WaitSend(uint64_t wr_id, absl::Duration timeout);
  // One signaled RDMA READ or WRITE between the head of the scratch and the peer's memory.
  absl::StatusOr<ibv_wc_status> Rdma(ibv_wr_opcode opcode, uint64_t addr, uint32_t rkey,
                                     uint32_t length);
  // Posts `bytes` (copied into the scratch's message area) as one signaled SEND, or
  // SEND_WITH_INV when `invalidate_rkey` is set; returns its wr_id without waiting.
  absl::StatusOr<uint64_t> PostMessage(absl::string_view bytes, uint32_t invalidate_rkey);
  // The scratch: RDMA at its head, outgoing messages in its last 64 KiB.
  static constexpr uint32_t kMessageScratch = 65536;
  static constexpr uint32_t kRdmaScratch = kScratchBytes - kMessageScratch;
  void PollOnce();

  std::shared_ptr<verbs::Context> ctx_;
  std::shared_ptr<verbs::ProtectionDomain> pd_;
  std::shared_ptr<verbs::CompletionQueue> cq_;
  std::unique_ptr<verbs::QueuePair> qp_;
  std::string recv_area_;
  std::string scratch_;
  std::unique_ptr<verbs::MemoryRegion> recv_mr_;
  std::unique_ptr<verbs::MemoryRegion> scratch_mr_;
  std::string exposed_;
  std::unique_ptr<verbs::MemoryRegion> exposed_mr_;
  std::vector<std::unique_ptr<verbs::MemoryWindow>> windows_;  // ExposeWindow's, kept bound
  uint32_t credits_received_ = 0;
  uint32_t credits_owed_ = 0;  // receives re-posted since we last returned credits (CutOff)
  uint32_t messages_received_ = 0;
  uint64_t next_request_ = 1;
  uint64_t next_wr_ = 1;
  std::vector<Received> inbox_;
  std::vector<ibv_wc> send_done_;
  absl::flat_hash_set<uint64_t> unwatched_;  // SendRaw's WRs: nobody waits for them
};

class RogueConnection : public RoguePeer {
 public:
  // How many receive credits Connect offers the server (at most the 64 receives we post, which
  // is the default). Fewer bound what the server may send us before we return credits.
  void OfferCredits(uint32_t n) { offered_credits_ = n; }
  // What Connect does about link keys (ConnectResponse.link_key): declare none (the default,
  // so no key is made), or declare them and then use the server's key, none, or another.
  enum class LinkKeyUse { kUndeclared, kAsGiven, kWithout, kWrong };
  void UseLinkKey(LinkKeyUse use) { link_key_use_ = use; }
  // Changes the ConnectRequest before it leaves (a GID of another host, ...).
  void TamperRequest(std::function<void(control::ConnectRequest&)> tamper) {
    tamper_request_ = std::move(tamper);
  }
  // The server's host for Connect (a literal IPv4 address; default 127.0.0.1).
  void UseHost(std::string host) { host_ = std::move(host); }
  // The key the server sent (empty if none).
  const std::string& link_key() const { return link_key_; }
  // Completes Control.Connect with `token` and moves our QP to RTS.
  // `remote_invalidation` is what we declare: false negotiates the explicit local fallback.
  absl::Status Connect(int port, const std::string& token,
                       control::BulkMode bulk_mode = control::BULK_SERVER_EXPOSES,
                       bool remote_invalidation = true);
  const control::Negotiated& negotiated() const { return negotiated_; }

  // Calls `method` with `payload` and returns the bulk descriptor of its response: a download
  // the server exposes, neither read nor acknowledged. An error if the response has no bulk data.
  absl::StatusOr<rpc_wire::BulkDescriptor> CallForDownload(const char* method,
                                                           absl::string_view payload,
                                                           uint64_t* request_id);
  // Asks for `count` upload windows of `size` bytes (a window request) and returns the grant's
  // descriptors: none if the server granted none.
  absl::StatusOr<std::vector<rpc_wire::BulkDescriptor>> RequestWindows(uint32_t size,
                                                                      uint32_t count);

 private:
  uint32_t offered_credits_ = 0;  // 0: as many as we post receives
  LinkKeyUse link_key_use_ = LinkKeyUse::kUndeclared;
  std::function<void(control::ConnectRequest&)> tamper_request_;
  std::string host_ = "127.0.0.1";
  std::string link_key_;
  control::Negotiated negotiated_;
};

}  // namespace swirl::testing

#endif  // SWIRL_RPC_TESTING_ROGUE_H_
