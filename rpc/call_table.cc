#include "rpc/call_table.h"

#include "base/check.h"

namespace swirl::internal {

void CallTable::Init(uint32_t slots) {
  SWIRL_CHECK(slots > 0);
  slot_count_ = slots;
  in_flight_ = 0;
}

size_t CallTable::admitted() const {
  size_t free = 0;
  for (uint32_t i = free_state_; i != CallState::kNone; i = state(i).next) ++free;
  return states_ - free;
}

uint32_t CallTable::Grow() {
  const uint32_t index = states_++;
  if ((index & (kBlock - 1)) == 0) blocks_.push_back(std::make_unique<CallState[]>(kBlock));
  states_at_.push_back(&blocks_.back()[index & (kBlock - 1)]);
  state(index).index = index;
  return index;
}

void CallTable::ForEachInFlight(absl::FunctionRef<void(CallState&)> fn) {
  // The timers walk this every pass: stop after the last call in flight, not at the end of a
  // table that a burst of backlogged calls once grew (the free list hands back the states
  // freed last, so under steady load the same few are in flight). Calls that `fn` starts are
  // not counted: whether the walk reaches them does not matter to the timers.
  uint32_t left = in_flight_;
  for (uint32_t i = 0; i < states_ && left > 0; ++i) {
    CallState& s = state(i);
    if (s.request_id == 0) continue;
    --left;
    fn(s);
  }
}

CallState* CallTable::backlog_front() {
  return backlog_head_ == CallState::kNone ? nullptr : &state(backlog_head_);
}

void CallTable::PushBack(CallState& s) {
  s.next = CallState::kNone;
  if (backlog_tail_ != CallState::kNone) {
    state(backlog_tail_).next = s.index;
  } else {
    backlog_head_ = s.index;
  }
  backlog_tail_ = s.index;
}

void CallTable::PushFront(CallState& s) {
  s.next = backlog_head_;
  backlog_head_ = s.index;
  if (backlog_tail_ == CallState::kNone) backlog_tail_ = s.index;
}

void CallTable::PopFront() {
  CallState& front = state(backlog_head_);
  backlog_head_ = front.next;
  if (backlog_head_ == CallState::kNone) backlog_tail_ = CallState::kNone;
  front.next = CallState::kNone;
}

bool CallTable::Remove(CallState& s) {
  uint32_t prev = CallState::kNone;
  for (uint32_t i = backlog_head_; i != CallState::kNone; prev = i, i = state(i).next) {
    if (i != s.index) continue;
    if (prev == CallState::kNone) {
      backlog_head_ = s.next;
    } else {
      state(prev).next = s.next;
    }
    if (backlog_tail_ == i) backlog_tail_ = prev;
    s.next = CallState::kNone;
    return true;
  }
  return false;
}

std::vector<CallState*> CallTable::Unlink(absl::FunctionRef<bool(const CallState&)> drop) {
  std::vector<CallState*> out;
  uint32_t prev = CallState::kNone;
  for (uint32_t i = backlog_head_; i != CallState::kNone;) {
    CallState& s = state(i);
    const uint32_t next = s.next;
    if (drop(s)) {
      if (prev == CallState::kNone) {
        backlog_head_ = next;
      } else {
        state(prev).next = next;
      }
      s.next = CallState::kNone;
      out.push_back(&s);
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
  ForEachInFlight([&](CallState& s) { out.push_back(&s); });
  for (uint32_t i = backlog_head_; i != CallState::kNone; i = state(i).next) {
    out.push_back(&state(i));
  }
  return out;
}

void CallTable::Clear() {
  ForEachInFlight([&](CallState& s) { Release(s); });
  for (uint32_t i = backlog_head_; i != CallState::kNone;) {
    const uint32_t next = state(i).next;
    state(i).next = CallState::kNone;
    i = next;
  }
  backlog_head_ = backlog_tail_ = CallState::kNone;
}

}  // namespace swirl::internal
