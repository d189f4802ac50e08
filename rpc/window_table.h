// Internal: one connection's memory windows (docs/BULK.md), and the upload windows its peer
// granted it. Loop thread only. The table keeps the windows' states and checks (in debug
// builds) that every transition is a legal one; binding and revoking on the device is the
// worker's. window_table_test drives it with windows that have no device behind them.
//
//   kFree --Expose--> kExposed --BeginRevoke--> kRevoking --Free--> kFree
//                         \------------------Free--------------------/
//   (Free from kExposed: the peer's SEND_WITH_INV revoked it on delivery.)
//
// A window is allocated once per connection and reused with a fresh key per binding: on a NIC its
// rkey's index bits stay and the low byte is drawn anew each time (never repeating the previous
// one); on a device that draws a fresh key slot per bind (the soft device's FreshWindowRkey) the
// index changes too, and the table follows it. Either way the index finds the window without a
// scan.

#ifndef SWIRL_RPC_WINDOW_TABLE_H_
#define SWIRL_RPC_WINDOW_TABLE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/random/bit_gen_ref.h"
#include "absl/time/time.h"
#include "rpc/gate.h"
#include "rpc/wire.h"
#include "swirl/bulk.h"
#include "transport/verbs/verbs.h"

namespace swirl::internal {

struct Window {
  enum class State : uint8_t { kFree, kExposed, kRevoking };
  enum class Purpose : uint8_t { kDownload, kGrant, kMirrorRequest, kMirrorReply };

  std::unique_ptr<verbs::MemoryWindow> mw;  // null only in tests
  uint32_t rkey = 0;  // the key of the current (or last) binding
  State state = State::kFree;
  Purpose purpose = Purpose::kDownload;
  BulkBuffer buffer;        // what it exposes, when this side owns that memory
  uint64_t request_id = 0;  // the call it serves (0: a grant)
  uint64_t addr = 0;
  uint32_t length = 0;
  absl::Time lease = absl::InfiniteFuture();  // revoked by this side if not acknowledged by then
  int32_t revoke_op = -1;  // kRevoking: the LOCAL_INV in flight
};

class WindowTable {
 public:
  // At most `max_windows` windows.
  void Init(uint32_t max_windows) { max_windows_ = max_windows; }
  // Windows exposing a transfer's buffer (every purpose but an unused grant) hold `gate`: a
  // graceful shutdown waits for them. May be null.
  void set_gate(Gate* gate) { gate_ = gate; }

  // ---- Taking windows ----
  // A free window, or -1 if none is (then Add one, if can_grow()).
  int32_t TakeFree();
  bool can_grow() const { return windows_.size() < max_windows_; }
  // A new window (free, taken) with the key the device gave it.
  int32_t Add(std::unique_ptr<verbs::MemoryWindow> mw, uint32_t rkey);
  // Gives back a window taken and never bound.
  void PutBack(int32_t w);

  // ---- States ----
  Window& at(int32_t w) { return windows_[static_cast<size_t>(w)]; }
  const Window& at(int32_t w) const { return windows_[static_cast<size_t>(w)]; }
  // The key for the next binding of `w`: its index bits and a fresh key byte.
  uint32_t NextRkey(int32_t w, absl::BitGenRef gen) const;
  // kFree -> kExposed: bound under `rkey` over [addr, addr + length). `rkey` is NextRkey's, or
  // one in another key slot (its index then names the window from now on).
  void Expose(int32_t w, uint32_t rkey, uint64_t addr, uint32_t length, Window::Purpose purpose,
              uint64_t request_id, absl::Time lease);
  // kExposed -> kRevoking: our LOCAL_INV `op` is on its way.
  void BeginRevoke(int32_t w, int32_t op);
  // kExposed or kRevoking -> kFree: revoked. Its buffer goes back to the pool.
  void Free(int32_t w);
  // The exposed window whose current key is `rkey`, or -1.
  int32_t FindExposed(uint32_t rkey) const;

  // ---- Whole table ----
  // Exposed windows whose lease ended by `now`, in order.
  void ForEachExpired(absl::Time now, absl::FunctionRef<void(int32_t)> fn) const;
  // Windows other than grants, exposed or being revoked: transfers under way.
  uint32_t transfers() const { return transfers_; }
  // Windows not free now.
  uint32_t live() const { return live_; }
  bool empty() const { return windows_.empty(); }
  // Windows allocated (free or not).
  uint32_t allocated() const { return static_cast<uint32_t>(windows_.size()); }
  // Forgets every window (deallocating them revokes them: the connection is gone). Returns how
  // many were live.
  uint32_t Clear();

 private:
  std::vector<Window> windows_;
  absl::flat_hash_map<uint32_t, int32_t> by_index_;  // rkey >> 8 -> window
  std::vector<uint32_t> free_;
  uint32_t max_windows_ = 0;
  uint32_t live_ = 0;
  uint32_t transfers_ = 0;
  Gate* gate_ = nullptr;
};

// Upload windows the peer granted us, until we use them.
class UploadGrants {
 public:
  size_t size() const { return grants_.size(); }
  void Add(const rpc_wire::BulkDescriptor& d) { grants_.push_back(d); }
  // The smallest grant that holds `length` bytes, or -1.
  int BestFit(uint32_t length) const;
  // Uses grant `i` (from BestFit).
  rpc_wire::BulkDescriptor Take(int i);
  void Clear() { grants_.clear(); }
  // A request for more is on its way (one round trip, only when they run out).
  bool requested = false;

 private:
  std::vector<rpc_wire::BulkDescriptor> grants_;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_WINDOW_TABLE_H_
