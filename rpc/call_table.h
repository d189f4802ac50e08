// Internal: the calls one connection is making, and the worker's state for each (eRPC's
// sslots). Loop thread only; no device involved (call_table_test drives it with plain calls).
//
// A call admitted to a connection gets a CallState, kept until it completes: what the worker
// needs of it (its request serialized into registered memory, the windows and RDMA operations
// using its buffers, how it gave up) lives here, not in the caller's ClientCall. One table:
// a state is also the call's slot once it is sent. Its request id is (generation << 32) |
// index, and the state's generation moves on each time it is sent, so a late answer for an
// earlier use of the state (a call that gave up) names a generation the state has left behind
// and is dropped, and an id whose generation is ahead of its state's, or whose index is beyond
// the table, names a call never made (a peer that invents answers). At most `slots` calls are
// in flight; admitted calls beyond that, or without credits, wait in the backlog, in order.

#ifndef SWIRL_RPC_CALL_TABLE_H_
#define SWIRL_RPC_CALL_TABLE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "base/check.h"
#include "swirl/bulk.h"
#include "swirl/call.h"

namespace swirl::internal {

// The worker's side of one call, from admission to completion.
struct CallState {
  ClientCall* call = nullptr;  // null: this state is free
  uint64_t request_id = 0;     // 0 until it holds a slot (one-way calls never do)
  BulkBuffer scratch;          // a large request serialized into registered memory, once
  int32_t request_window = -1;  // mirror mode: the window exposing the request
  int32_t reply_window = -1;    // mirror mode: the window exposing the response buffer
  int32_t read_op = -1;         // download: the RDMA READ into the call's buffer
  int32_t write_op = -1;        // upload: the RDMA WRITE from the call's buffer
  // The caller gave up (cancel, deadline) while the device or the server still used the call's
  // buffers: it completes with this once they are done. OK: it did not give up.
  absl::Status abandoned;
  absl::Time deadline = absl::InfiniteFuture();  // the call's, until it abandons (then none)
  uint32_t next = kNone;  // backlog link
  uint32_t index = 0;     // its place in the table, for the life of the table
  uint32_t generation = 0;  // of its last request id (never 0 once sent: ids are never 0)
  static constexpr uint32_t kNone = ~uint32_t{0};
};

class CallTable {
 public:
  // Room for `slots` calls in flight.
  void Init(uint32_t slots);

  // ---- Admission: every call this connection is making has a state ----
  // A state for `call` (which remembers its index), with the call's deadline.
  CallState& Admit(ClientCall* call) {
    uint32_t index = free_state_;
    if (index != CallState::kNone) {
      free_state_ = state(index).next;  // free states are linked through `next`
    } else {
      index = Grow();
    }
    CallState& s = state(index);
    s.next = CallState::kNone;
    s.call = call;
    s.deadline = call->deadline_;
    call->state_index_ = index;
    return s;
  }
  // The state of admitted `call`, or nullptr if it is not admitted here (a stale cancel).
  CallState* StateOf(const ClientCall* call) {
    const uint32_t index = call->state_index_;
    if (index >= states_ || state(index).call != call) return nullptr;
    return &state(index);
  }
  // Frees `state` (its call completes): its scratch buffer goes back to the pool. It must hold
  // no slot and be out of the backlog.
  void Retire(CallState& s) {
    SWIRL_DCHECK(s.call != nullptr && s.request_id == 0 && s.next == CallState::kNone);
    // Field by field (not `s = CallState()`): this runs once per call.
    s.call = nullptr;
    s.scratch.Release();
    s.request_window = s.reply_window = s.read_op = s.write_op = -1;
    if (!s.abandoned.ok()) s.abandoned = absl::OkStatus();
    s.next = free_state_;
    free_state_ = s.index;
  }
  // Retire for a state that the message path used alone: no window, RDMA operation or
  // abandoned status was ever set on it (they are as Retire leaves them).
  void RetirePlain(CallState& s) {
    SWIRL_DCHECK(s.call != nullptr && s.request_id == 0 && s.next == CallState::kNone);
    SWIRL_DCHECK((s.request_window & s.reply_window & s.read_op & s.write_op) == -1 &&
                 s.abandoned.ok());
    s.call = nullptr;
    s.scratch.Release();
    s.next = free_state_;
    free_state_ = s.index;
  }
  // Admitted calls (for tests: it walks the free list).
  size_t admitted() const;

  // ---- Slots: calls in flight ----
  bool full() const { return in_flight_ >= slot_count_; }
  uint32_t slots() const { return slot_count_; }
  uint32_t in_flight() const { return in_flight_; }
  // Gives `state` a request id (it is in flight from now on). !full().
  uint64_t Allocate(CallState& s) {
    SWIRL_DCHECK(!full() && s.request_id == 0);
    if (++s.generation == 0) [[unlikely]] s.generation = 1;  // an id is never 0
    ++in_flight_;
    s.request_id = (uint64_t{s.generation} << 32) | s.index;
    return s.request_id;
  }
  // The state in flight under `request_id`, or nullptr (a late answer to a call given up, or a
  // request id of an earlier generation of its state).
  CallState* Find(uint64_t request_id) {
    const uint32_t index = static_cast<uint32_t>(request_id);
    if (index >= states_) return nullptr;
    CallState& s = state(index);
    return s.request_id == request_id && request_id != 0 ? &s : nullptr;
  }
  // Takes `state` out of flight, if it is in flight.
  void Release(CallState& s) {
    if (s.request_id == 0) return;
    --in_flight_;
    s.request_id = 0;
  }
  // Whether `request_id` names a call this table never made: an index beyond it, or a
  // generation its state has not reached yet (compared modulo 2^32: generations wrap).
  bool NeverMade(uint64_t request_id) {
    const uint32_t index = static_cast<uint32_t>(request_id);
    return index >= states_ ||
           static_cast<int32_t>(static_cast<uint32_t>(request_id >> 32) -
                                state(index).generation) > 0;
  }
  // Calls `fn` for each state in flight, in index order; `fn` may release it.
  void ForEachInFlight(absl::FunctionRef<void(CallState&)> fn);

  // ---- Backlog: admitted calls waiting to be sent ----
  bool backlog_empty() const { return backlog_head_ == CallState::kNone; }
  CallState* backlog_front();
  void PushBack(CallState& state);
  void PushFront(CallState& state);
  void PopFront();
  // Takes `state` out of the backlog; false if it is not there.
  bool Remove(CallState& state);
  // Takes the states `drop` selects out, leaving the backlog whole before any of their calls
  // completes (their callbacks may start calls that join it).
  std::vector<CallState*> Unlink(absl::FunctionRef<bool(const CallState&)> drop);

  // Everything admitted, in flight first (slot order), then the backlog: for failing them all.
  std::vector<CallState*> All();
  // Frees every slot and empties the backlog (their states stay admitted until retired).
  void Clear();

 private:
  // Admitted calls, in blocks that never move: references to states stay valid while more are
  // admitted (a callback may start calls while the worker holds its call's state), and finding
  // one by index is two loads.
  uint32_t Grow();  // a new state's index
  static constexpr uint32_t kBlockBits = 6;
  static constexpr uint32_t kBlock = 1u << kBlockBits;
  // By index: one load through states_at_ (blocks_ alone took two loads and a multiply, on
  // every admission and every response).
  CallState& state(uint32_t index) { return *states_at_[index]; }
  const CallState& state(uint32_t index) const { return *states_at_[index]; }
  std::vector<std::unique_ptr<CallState[]>> blocks_;
  std::vector<CallState*> states_at_;  // &state(i) for every i < states_
  uint32_t states_ = 0;  // made so far (all blocks but the last are full)
  uint32_t free_state_ = CallState::kNone;  // free states, linked through CallState::next
  uint32_t slot_count_ = 0;  // calls in flight at most
  uint32_t in_flight_ = 0;
  uint32_t backlog_head_ = CallState::kNone;
  uint32_t backlog_tail_ = CallState::kNone;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_CALL_TABLE_H_
