// Internal: the calls one connection is making, and the worker's state for each (eRPC's
// sslots). Loop thread only; no device involved (call_table_test drives it with plain calls).
//
// A call admitted to a connection gets a CallState, kept until it completes: what the worker
// needs of it (its request serialized into registered memory, the windows and RDMA operations
// using its buffers, how it gave up) lives here, not in the caller's ClientCall. A call in
// flight also holds a slot; its request id is (generation << 32) | slot, and the slot's
// generation moves on each time it is taken, so a late answer for an earlier use of the slot
// (a call that gave up) names a generation the slot has left behind and is dropped, and an id
// whose generation is ahead of its slot's names a call never made (a peer that invents
// answers). Admitted calls without a slot or credits wait in the backlog, in order.

#ifndef SWIRL_RPC_CALL_TABLE_H_
#define SWIRL_RPC_CALL_TABLE_H_

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "rpc/bulk.h"
#include "rpc/call.h"

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
  static constexpr uint32_t kNone = ~uint32_t{0};
};

class CallTable {
 public:
  // Room for `slots` calls in flight (a power of two: request ids index by their low bits).
  void Init(uint32_t slots);

  // ---- Admission: every call this connection is making has a state ----
  // A state for `call` (which remembers its index), with the call's deadline.
  CallState& Admit(ClientCall* call);
  // The state of admitted `call`, or nullptr if it is not admitted here (a stale cancel).
  CallState* StateOf(const ClientCall* call);
  // Frees `state` (its call completes): its scratch buffer goes back to the pool. It must hold
  // no slot and be out of the backlog.
  void Retire(CallState& state);
  // Admitted calls (for tests and teardown checks).
  size_t admitted() const { return states_.size() - free_states_.size(); }

  // ---- Slots: calls in flight ----
  bool full() const { return free_slots_.empty(); }
  uint32_t in_flight() const { return in_flight_; }
  // Takes a slot for `state` and returns its request id. !full().
  uint64_t Allocate(CallState& state);
  // The state in flight under `request_id`, or nullptr (a late answer to a call given up, or a
  // request id of an earlier generation of its slot). The slot stays taken.
  CallState* Find(uint64_t request_id);
  // Frees `state`'s slot, if it holds one.
  void Release(CallState& state);
  // Whether `request_id` names a call this table never made: a slot beyond it, or a generation
  // its slot has not reached yet (compared modulo 2^32: generations wrap).
  bool NeverMade(uint64_t request_id) const;
  // Calls `fn` for each state holding a slot; `fn` may release it.
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
  // Admitted calls. A deque: references to states stay valid while more are admitted (a
  // callback may start calls while the worker holds its call's state).
  std::deque<CallState> states_;
  std::vector<uint32_t> free_states_;
  std::vector<uint32_t> slot_state_;     // by slot: the state holding it, or kNone
  std::vector<uint32_t> generations_;    // by slot
  std::vector<uint32_t> free_slots_;     // the next one taken last
  uint32_t in_flight_ = 0;
  uint32_t backlog_head_ = CallState::kNone;
  uint32_t backlog_tail_ = CallState::kNone;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_CALL_TABLE_H_
