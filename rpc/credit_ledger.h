// Internal: one connection's flow control. Loop thread only; plain numbers, no device
// (credit_ledger_test drives it).
//
// Each side reserves receive buffers for the other (its grant). A message costs the sender one
// credit; the receiver gives credits back in the header of its own messages (every message
// carries all it owes) or, once half are owed with nothing to carry them, in a kCredit message.
// A sender that spends only what it holds never meets an empty receive queue (no RNR), so what
// a peer could not have sent while honouring its credits is a protocol violation, and said so.
//
// Messages that find no credit are parked (in send buffers, by the worker) and leave in order,
// before any new call, once credits come back.

#ifndef SWIRL_RPC_CREDIT_LEDGER_H_
#define SWIRL_RPC_CREDIT_LEDGER_H_

#include <algorithm>
#include <cstdint>
#include <deque>
#include <utility>

#include "absl/status/status.h"
#include "rpc/gate.h"

namespace swirl::internal {

// A message waiting for a credit, already written into a send-pool buffer.
struct ParkedMessage {
  uint32_t buffer;           // its send-pool buffer
  uint32_t length;           // header included
  uint32_t invalidate_rkey;  // SEND_WITH_INV of this rkey, or 0 for a plain SEND
  unsigned int flags;        // extra send flags (IBV_SEND_FENCE for acks behind a READ)
};

class CreditLedger {
 public:
  // `peer_grant`: receive buffers the peer reserved for us (what we may send ahead of its
  // returns); `local_grant`: what we reserved for the peer.
  // Parked messages hold `gate` (a graceful shutdown waits for them to leave); may be null.
  void set_gate(Gate* gate) { gate_ = gate; }
  void Init(uint32_t peer_grant, uint32_t local_grant) {
    peer_grant_ = peer_grant;
    local_grant_ = local_grant;
    send_ = peer_grant;
    peer_holds_ = local_grant;
    owed_ = 0;
  }

  // ---- Receiving ----
  // Accounts one message from the peer that gives back `returned` of our credits. An error if a
  // peer honouring its credits could not have sent it: it had none left, or it returns credits
  // we never spent.
  absl::Status OnReceive(uint32_t returned) {
    if (peer_holds_ == 0) {
      return absl::ResourceExhaustedError("peer sent beyond the credits it was given");
    }
    if (send_ + returned > peer_grant_) {
      return absl::InvalidArgumentError("peer returned credits it never received");
    }
    --peer_holds_;
    send_ += returned;
    ++owed_;
    return absl::OkStatus();
  }
  // Enough is owed back that a credit message should go now: half the peer's grant (with
  // nothing else of ours to carry it, the peer would stall on the other half).
  bool ShouldReturn() const { return owed_ >= std::max<uint32_t>(1, local_grant_ / 2); }

  // ---- Sending ----
  bool CanSend() const { return send_ > 0; }
  // A new call needs two credits: the last one is kept for returning the peer's credits, or
  // both sides could hold none with nothing left to carry a return.
  bool CanSendCall() const { return send_ >= 2; }
  // Spends a credit on one message and returns what it gives back (all that is owed).
  uint32_t Spend() {
    --send_;
    const uint32_t returned = owed_;
    peer_holds_ += owed_;
    owed_ = 0;
    return returned;
  }

  // ---- Parking ----
  // A message emitted now must wait: no credit, or older messages wait already.
  bool MustPark() const { return send_ == 0 || !parked_.empty(); }
  void Park(const ParkedMessage& m) {
    parked_.push_back(m);
    if (gate_ != nullptr) gate_->Enter();
  }
  size_t parked() const { return parked_.size(); }
  // The oldest parked message, if a credit is free for it.
  bool Unpark(ParkedMessage* m) {
    if (parked_.empty() || send_ == 0) return false;
    *m = parked_.front();
    parked_.pop_front();
    if (gate_ != nullptr) gate_->Leave();
    return true;
  }
  // Everything parked, to give its buffers back (the connection failed).
  std::deque<ParkedMessage> TakeParked() {
    if (gate_ != nullptr) gate_->Leave(parked_.size());
    return std::exchange(parked_, {});
  }

  uint32_t send_credits() const { return send_; }
  uint32_t peer_grant() const { return peer_grant_; }
  uint32_t local_grant() const { return local_grant_; }
  uint32_t owed() const { return owed_; }

 private:
  uint32_t peer_grant_ = 0;  // what the peer reserved for us: the cap on send_
  uint32_t local_grant_ = 0;  // what we reserved for the peer
  uint32_t send_ = 0;         // messages we may still send
  uint32_t peer_holds_ = 0;   // credits the peer holds: it may send this many more
  uint32_t owed_ = 0;         // received since our last return
  std::deque<ParkedMessage> parked_;
  Gate* gate_ = nullptr;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_CREDIT_LEDGER_H_
