#include "rpc/window_table.h"

#include "absl/random/distributions.h"
#include "base/check.h"

namespace swirl::internal {

int32_t WindowTable::TakeFree() {
  if (free_.empty()) return -1;
  const int32_t w = static_cast<int32_t>(free_.back());
  free_.pop_back();
  SWIRL_DCHECK(at(w).state == Window::State::kFree);
  return w;
}

int32_t WindowTable::Add(std::unique_ptr<verbs::MemoryWindow> mw, uint32_t rkey) {
  SWIRL_DCHECK(can_grow());
  const auto w = static_cast<int32_t>(windows_.size());
  Window& window = windows_.emplace_back();
  window.mw = std::move(mw);
  window.rkey = rkey;
  by_index_[rkey >> 8] = w;
  return w;
}

void WindowTable::PutBack(int32_t w) {
  SWIRL_DCHECK(at(w).state == Window::State::kFree);
  free_.push_back(static_cast<uint32_t>(w));
}

uint32_t WindowTable::NextRkey(int32_t w, absl::BitGenRef gen) const {
  const uint32_t last = at(w).rkey;
  uint8_t key;
  do {
    key = absl::Uniform<uint8_t>(gen);
  } while (key == (last & 0xff));
  return (last & ~0xffu) | key;
}

void WindowTable::Expose(int32_t w, uint32_t rkey, uint64_t addr, uint32_t length,
                         Window::Purpose purpose, uint64_t request_id, absl::Time lease) {
  Window& window = at(w);
  SWIRL_DCHECK(window.state == Window::State::kFree);
  if ((rkey >> 8) != (window.rkey >> 8)) {
    // Bound in a fresh key slot (a device's FreshWindowRkey): the window answers to its new
    // index from now on, and its old one may go to another window.
    auto old = by_index_.find(window.rkey >> 8);
    if (old != by_index_.end() && old->second == w) by_index_.erase(old);
    by_index_[rkey >> 8] = w;
  }
  window.rkey = rkey;
  window.state = Window::State::kExposed;
  window.purpose = purpose;
  window.addr = addr;
  window.length = length;
  window.request_id = request_id;
  window.lease = lease;
  ++live_;
  if (purpose != Window::Purpose::kGrant) {
    ++transfers_;
    if (gate_ != nullptr) gate_->Enter();
  }
}

void WindowTable::BeginRevoke(int32_t w, int32_t op) {
  Window& window = at(w);
  SWIRL_DCHECK(window.state == Window::State::kExposed);
  window.state = Window::State::kRevoking;
  window.revoke_op = op;
}

void WindowTable::Free(int32_t w) {
  Window& window = at(w);
  SWIRL_DCHECK(window.state != Window::State::kFree);
  if (window.purpose != Window::Purpose::kGrant) {
    --transfers_;
    if (gate_ != nullptr) gate_->Leave();
  }
  window.state = Window::State::kFree;
  window.buffer.Release();
  window.request_id = 0;
  window.lease = absl::InfiniteFuture();
  window.revoke_op = -1;
  --live_;
  free_.push_back(static_cast<uint32_t>(w));
}

int32_t WindowTable::FindExposed(uint32_t rkey) const {
  auto it = by_index_.find(rkey >> 8);
  if (it == by_index_.end()) return -1;
  const Window& window = at(it->second);
  return window.rkey == rkey && window.state == Window::State::kExposed ? it->second : -1;
}

void WindowTable::ForEachExpired(absl::Time now, absl::FunctionRef<void(int32_t)> fn) const {
  for (size_t i = 0; i < windows_.size(); ++i) {
    const Window& window = windows_[i];
    if (window.state == Window::State::kExposed && window.lease <= now) {
      fn(static_cast<int32_t>(i));
    }
  }
}

uint32_t WindowTable::Clear() {
  const uint32_t live = live_;
  if (gate_ != nullptr) gate_->Leave(transfers_);
  transfers_ = 0;
  windows_.clear();
  by_index_.clear();
  free_.clear();
  live_ = 0;
  return live;
}

int UploadGrants::BestFit(uint32_t length) const {
  int best = -1;
  for (size_t i = 0; i < grants_.size(); ++i) {
    if (grants_[i].length >= length &&
        (best < 0 || grants_[i].length < grants_[static_cast<size_t>(best)].length)) {
      best = static_cast<int>(i);
    }
  }
  return best;
}

rpc_wire::BulkDescriptor UploadGrants::Take(int i) {
  const rpc_wire::BulkDescriptor d = grants_[static_cast<size_t>(i)];
  grants_.erase(grants_.begin() + i);
  return d;
}

}  // namespace swirl::internal
