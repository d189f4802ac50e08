#include "rpc/call_table.h"

#include "base/check.h"

namespace swirl::internal {

void CallTable::Init(uint32_t slots) {
  SWIRL_CHECK(slots > 0 && (slots & (slots - 1)) == 0);
  slot_state_.assign(slots, CallState::kNone);
  generations_.assign(slots, 0);
  free_slots_.clear();
  for (uint32_t i = slots; i > 0; --i) free_slots_.push_back(i - 1);
  in_flight_ = 0;
}

CallState& CallTable::Admit(ClientCall* call) {
  uint32_t index;
  if (!free_states_.empty()) {
    index = free_states_.back();
    free_states_.pop_back();
  } else {
    index = static_cast<uint32_t>(states_.size());
    states_.emplace_back();
    states_.back().index = index;
  }
  CallState& state = states_[index];
  state.call = call;
  state.deadline = call->deadline_;
  call->state_index_ = index;
  return state;
}

CallState* CallTable::StateOf(const ClientCall* call) {
  const uint32_t index = call->state_index_;
  if (index >= states_.size() || states_[index].call != call) return nullptr;
  return &states_[index];
}

void CallTable::Retire(CallState& state) {
  SWIRL_DCHECK(state.call != nullptr && state.request_id == 0 && state.next == CallState::kNone);
  // Field by field (not `state = CallState()`): this runs once per call.
  state.call = nullptr;
  state.scratch.Release();
  state.request_window = state.reply_window = state.read_op = state.write_op = -1;
  if (!state.abandoned.ok()) state.abandoned = absl::OkStatus();
  free_states_.push_back(state.index);
}

uint64_t CallTable::Allocate(CallState& state) {
  SWIRL_DCHECK(!free_slots_.empty() && state.request_id == 0);
  const uint32_t slot = free_slots_.back();
  free_slots_.pop_back();
  ++generations_[slot];
  slot_state_[slot] = state.index;
  ++in_flight_;
  state.request_id = (uint64_t{generations_[slot]} << 32) | slot;
  return state.request_id;
}

CallState* CallTable::Find(uint64_t request_id) {
  const uint32_t slot = static_cast<uint32_t>(request_id);
  if (slot >= slot_state_.size() || generations_[slot] != (request_id >> 32)) return nullptr;
  const uint32_t index = slot_state_[slot];
  return index == CallState::kNone ? nullptr : &states_[index];
}

void CallTable::Release(CallState& state) {
  if (state.request_id == 0) return;
  const uint32_t slot = static_cast<uint32_t>(state.request_id);
  slot_state_[slot] = CallState::kNone;
  free_slots_.push_back(slot);
  --in_flight_;
  state.request_id = 0;
}

bool CallTable::NeverMade(uint64_t request_id) const {
  const uint32_t slot = static_cast<uint32_t>(request_id);
  return slot >= slot_state_.size() ||
         static_cast<int32_t>(static_cast<uint32_t>(request_id >> 32) - generations_[slot]) > 0;
}

void CallTable::ForEachInFlight(absl::FunctionRef<void(CallState&)> fn) {
  if (in_flight_ == 0) return;
  for (uint32_t slot = 0; slot < slot_state_.size(); ++slot) {
    const uint32_t index = slot_state_[slot];
    if (index != CallState::kNone) fn(states_[index]);
  }
}

CallState* CallTable::backlog_front() {
  return backlog_head_ == CallState::kNone ? nullptr : &states_[backlog_head_];
}

void CallTable::PushBack(CallState& state) {
  state.next = CallState::kNone;
  if (backlog_tail_ != CallState::kNone) {
    states_[backlog_tail_].next = state.index;
  } else {
    backlog_head_ = state.index;
  }
  backlog_tail_ = state.index;
}

void CallTable::PushFront(CallState& state) {
  state.next = backlog_head_;
  backlog_head_ = state.index;
  if (backlog_tail_ == CallState::kNone) backlog_tail_ = state.index;
}

void CallTable::PopFront() {
  CallState& front = states_[backlog_head_];
  backlog_head_ = front.next;
  if (backlog_head_ == CallState::kNone) backlog_tail_ = CallState::kNone;
  front.next = CallState::kNone;
}

bool CallTable::Remove(CallState& state) {
  uint32_t prev = CallState::kNone;
  for (uint32_t i = backlog_head_; i != CallState::kNone; prev = i, i = states_[i].next) {
    if (i != state.index) continue;
    if (prev == CallState::kNone) {
      backlog_head_ = state.next;
    } else {
      states_[prev].next = state.next;
    }
    if (backlog_tail_ == i) backlog_tail_ = prev;
    state.next = CallState::kNone;
    return true;
  }
  return false;
}

std::vector<CallState*> CallTable::Unlink(absl::FunctionRef<bool(const CallState&)> drop) {
  std::vector<CallState*> out;
  uint32_t prev = CallState::kNone;
  for (uint32_t i = backlog_head_; i != CallState::kNone;) {
    CallState& state = states_[i];
    const uint32_t next = state.next;
    if (drop(state)) {
      if (prev == CallState::kNone) {
        backlog_head_ = next;
      } else {
        states_[prev].next = next;
      }
      state.next = CallState::kNone;
      out.push_back(&state);
    } else {
      prev = i;
    }
    i = next;
  }
  backlog_tail_ = prev;
  return out;
}

std::vector<CallState*> CallTable::All() {
  std::vector<CallState*> out;
  ForEachInFlight([&](CallState& state) { out.push_back(&state); });
  for (uint32_t i = backlog_head_; i != CallState::kNone; i = states_[i].next) {
    out.push_back(&states_[i]);
  }
  return out;
}

void CallTable::Clear() {
  ForEachInFlight([&](CallState& state) { Release(state); });
  for (uint32_t i = backlog_head_; i != CallState::kNone;) {
    const uint32_t next = states_[i].next;
    states_[i].next = CallState::kNone;
    i = next;
  }
  backlog_head_ = backlog_tail_ = CallState::kNone;
}

}  // namespace swirl::internal
