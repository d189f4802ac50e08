// Internal: one connection's flow control, and the worker's pool it grants from. Loop thread
// only (but CreditPool, which admission also takes from); plain numbers, no device
// (credit_ledger_test drives it).
//
// Each side grants receive buffers to the other. A message costs the sender one credit; the
// receiver gives credits back in the header of its own messages (every message carries all it
// owes) or, once half are owed with nothing to carry them, in a kCredit message. A sender that
// spends only what it holds never meets an empty receive queue (no RNR), so what a peer could
// not have sent while honouring its credits is a protocol violation, and said so.
//
// Grants follow the traffic (docs/WIRE.md "Flow control"). A worker's SRQ holds a floor of
// kMinCredits for every connection it admits (reserved at admission, never lent), plus a shared
// part, the CreditPool. A connection's allotment (what its peer holds plus what is owed back to
// it) starts at the floor plus what the pool could spare (the whole negotiated grant while
// there is room), grows from the pool, doubling up to the negotiated grant, when the peer runs
// low (it has fewer than half its allotment left: it is pipelining), and, while the pool is
// short, shrinks back to the floor once the connection goes quiet: the credits it is owed are
// withheld instead of returned, and given back to the pool. The returns themselves say nothing
// new on the wire: `credits` may return more than the peer spent, up to the negotiated grant,
// which the peer checks exactly as before. A peer that floods gets at most its negotiated grant
// and can never take the floors of others, so every connection can always make a call.
// The per-message cost is two compares beyond what fixed grants cost; the pool is touched
// (one atomic) only when an allotment changes.
//
// Messages that find no credit are parked (in send buffers, by the worker) and leave in order,
// before any new call, once credits come back.

#ifndef SWIRL_RPC_CREDIT_LEDGER_H_
#define SWIRL_RPC_CREDIT_LEDGER_H_

#include <algorithm>
#include <atomic>
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

// What every connection is granted at least, reserved for it at admission: a call needs two
// credits with one kept back for returns, and half of four owed is a return of two, so a
// credit message never provokes another one (handshake.h's kMinCredits is the same floor).
inline constexpr uint32_t kCreditFloor = 4;

// The shared part of a worker's receive buffers: credits granted beyond the floors. Taken by
// admission (any thread) and by the loop (growth); one atomic, touched only when an
// allotment changes, never per message.
class CreditPool {
 public:
  void Init(uint32_t credits) { free_.store(credits, std::memory_order_relaxed); }
  // Takes up to `want` credits; returns how many it took.
  uint32_t Take(uint32_t want) {
    uint32_t free = free_.load(std::memory_order_relaxed);
    while (true) {
      const uint32_t take = std::min(want, free);
      if (take == 0) return 0;
      if (free_.compare_exchange_weak(free, free - take, std::memory_order_relaxed)) return take;
    }
  }
  void Give(uint32_t n) { free_.fetch_add(n, std::memory_order_relaxed); }
  uint32_t available() const { return free_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint32_t> free_{0};
};

class CreditLedger {
 public:
  // Parked messages hold `gate` (a graceful shutdown waits for them to leave); may be null.
  void set_gate(Gate* gate) { gate_ = gate; }
  // Fixed grants (no pool): what a peer that grants everything at once gets.
  void Init(uint32_t peer_grant, uint32_t local_grant) {
    Init({.peer_grant = peer_grant, .local_grant = local_grant});
  }
  struct Grants {
    uint32_t peer_grant = 0;     // negotiated: what the peer may grant us at most
    uint32_t peer_initial = 0;   // what it granted us at first (0: all of peer_grant)
    uint32_t send_cap = 0;       // what our send queue lets us have in flight (0: peer_grant)
    uint32_t local_grant = 0;    // negotiated: what we may grant the peer at most
    uint32_t local_initial = 0;  // what we granted it at first (0: all of local_grant)
    CreditPool* pool = nullptr;  // where our grants beyond local_initial come from (or none)
  };
  void Init(const Grants& g) {
    peer_grant_ = g.peer_grant;
    send_cap_ = g.send_cap != 0 ? std::min(g.send_cap, g.peer_grant) : g.peer_grant;
    const uint32_t peer_initial = g.peer_initial != 0 ? g.peer_initial : g.peer_grant;
    send_ = std::min(peer_initial, send_cap_);
    unusable_ = peer_initial - send_;
    local_grant_ = g.local_grant;
    allotted_ = g.local_initial != 0 ? g.local_initial : g.local_grant;
    floor_ = std::min(kCreditFloor, allotted_);
    target_ = allotted_;
    peer_holds_ = allotted_;
    owed_ = 0;
    received_ = 0;
    pool_ = g.pool;
    Retune();
  }

  // ---- Receiving ----
  // Accounts one message from the peer that gives back `returned` of our credits. An error if a
  // peer honouring its credits could not have sent it: it had none left, or it returns credits
  // we never spent.
  absl::Status OnReceive(uint32_t returned) {
    if (TakeMessage(returned)) return absl::OkStatus();
    return Refusal(returned);
  }
  // OnReceive as a bool, for the receive path: true if the message was accounted; false,
  // changing nothing, if Refusal(returned) says why not.
  bool TakeMessage(uint32_t returned) {
    if (peer_holds_ == 0 || send_ + unusable_ + returned > peer_grant_) [[unlikely]] {
      return false;
    }
    --peer_holds_;
    send_ += returned;
    if (send_ > send_cap_) [[unlikely]] {
      // A peer whose grant outgrew our send queue: the excess stays with us, unused.
      unusable_ += send_ - send_cap_;
      send_ = send_cap_;
    }
    ++owed_;
    ++received_;
    if (peer_holds_ < adjust_below_) [[unlikely]] Adjust();
    return true;
  }
  // Why TakeMessage(returned) refuses the message (OK if it would not).
  absl::Status Refusal(uint32_t returned) const {
    if (peer_holds_ == 0) {
      return absl::ResourceExhaustedError("peer sent beyond the credits it was given");
    }
    if (send_ + unusable_ + returned > peer_grant_) {
      return absl::InvalidArgumentError("peer returned credits it never received");
    }
    return absl::OkStatus();
  }
  // Enough is owed back that a credit message should go now: half the peer's allotment (with
  // nothing else of ours to carry it, the peer would stall on the other half).
  bool ShouldReturn() const { return owed_ >= return_at_; }

  // ---- The pool ----
  // While the pool is short: a connection that received less than a quarter of its allotment
  // since the last call (it is quiet) is brought back to the floor, what it is owed given back
  // to the pool now and what its peer holds as it comes back. Returns credits given back.
  uint32_t Reclaim() {
    const uint32_t received = std::exchange(received_, 0);
    if (pool_ == nullptr || allotted_ <= floor_ || received >= allotted_ / 4) return 0;
    target_ = floor_;
    const uint32_t withheld = std::min(owed_, allotted_ - target_);
    owed_ -= withheld;
    allotted_ -= withheld;
    if (withheld > 0) pool_->Give(withheld);
    Retune();
    return withheld;
  }
  // What this connection holds beyond its floor (the pool's, given back when it closes).
  uint32_t borrowed() const { return allotted_ - floor_; }

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
  // parked() > 0 without a deque's size arithmetic: AfterReceive asks it of every message.
  bool has_parked() const { return !parked_.empty(); }
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
  uint32_t allotted() const { return allotted_; }
  uint32_t peer_holds() const { return peer_holds_; }

 private:
  // The unlikely part of OnReceive: grow a peer that runs low, withhold from one above target.
  void Adjust() {
    if (allotted_ > target_) {
      // Shrinking: this message's credit is not returned but goes back to the pool.
      --owed_;
      --allotted_;
      pool_->Give(1);
    } else if (pool_ != nullptr) {
      const uint32_t got = pool_->Take(std::min(allotted_, local_grant_ - allotted_));
      allotted_ += got;
      owed_ += got;  // granted with the next message (or a credit message: ShouldReturn)
      target_ = allotted_;
    }
    Retune();
  }
  void Retune() {
    // Above target, every message adjusts (gives one back); else one that leaves the peer
    // holding fewer than half of what it is allotted grows it, while the pool may.
    adjust_below_ = allotted_ > target_ ? ~uint32_t{0}
                    : pool_ != nullptr && allotted_ < local_grant_ ? allotted_ / 2
                                                                    : 0;
    return_at_ = std::max<uint32_t>(1, allotted_ / 2);
  }

  uint32_t peer_grant_ = 0;   // negotiated: the most the peer may grant us
  uint32_t send_cap_ = 0;     // the most of it our send queue can use
  uint32_t send_ = 0;         // messages we may still send
  uint32_t unusable_ = 0;     // granted beyond send_cap_: held, never spent
  uint32_t local_grant_ = 0;  // negotiated: the most we may grant the peer
  uint32_t allotted_ = 0;     // what we grant the peer now: peer_holds_ + owed_
  uint32_t floor_ = 0;        // never less (reserved for us at admission)
  uint32_t target_ = 0;       // what allotted_ shrinks toward (withholding returns)
  // The peer holding fewer than this, a message adjusts allotted_ (Adjust): all of them while
  // allotted_ is above target_, else below half of it while the pool may grow it (0: never).
  uint32_t adjust_below_ = 0;
  uint32_t return_at_ = 1;    // owed this many, a credit message is due
  uint32_t peer_holds_ = 0;   // credits the peer holds: it may send this many more
  uint32_t owed_ = 0;         // received (or newly granted) since our last return
  uint32_t received_ = 0;     // messages since the last Reclaim
  CreditPool* pool_ = nullptr;
  std::deque<ParkedMessage> parked_;
  Gate* gate_ = nullptr;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_CREDIT_LEDGER_H_
