// Internal: the bulk operations of one connection that wait for a send completion (an RDMA READ
// or WRITE, a LOCAL_INV), by kind. Loop thread only. Each kind is its own struct holding what
// its completion needs, and an operation is a std::variant of them, kept in a reusable table:
// nothing is allocated per operation beyond what a kind itself holds.

#ifndef SWIRL_RPC_BULK_OPS_H_
#define SWIRL_RPC_BULK_OPS_H_

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "rpc/gate.h"
#include "rpc/wire.h"
#include "swirl/bulk.h"

namespace swirl::internal {

struct CallState;

namespace bulk_op {

// A request whose dispatch waits for the operation (its bulk data is not ours yet).
struct Request {
  rpc_wire::MessageHeader header{};
  std::string eager;  // the message bytes next to the attachment
  bool has_chunk = false;  // mirror: the caller's reply window
  rpc_wire::BulkDescriptor chunk{};
  uint32_t length = 0;  // of the bulk data
  bool admitted = false;  // arrived before a drain began (it is served, not refused)
};

// Client: the RDMA READ of a response's bulk data into the call's buffer.
struct DownloadRead {
  CallState* call = nullptr;  // null once the connection settled it
  uint64_t request_id = 0;
  bool is_message = false;  // the bulk data is the response message
  std::string eager;
  // The caller gave up while the READ writes into its buffer: it completes with `status` once
  // the READ is done.
  bool cancelled = false;
  absl::Status status;
};

// Server: the RDMA READ of a mirror-mode request's bulk data, then its dispatch.
struct MirrorRead {
  Request request;
  uint32_t peer_rkey = 0;  // the caller's window, invalidated by our ack
  BulkBuffer buffer;       // where it lands
};

// Server: a mirror-mode request whose READ waits for one of its connection's to complete (the
// connection's mirror budget is in use). It holds no pool memory: its header and eager bytes.
struct MirrorWait {
  Request request;
  rpc_wire::BulkDescriptor data{};  // the caller's request window
};

// A LOCAL_INV of a window (the local-invalidation fallback, a lease that ran out).
struct Revoke {
  int32_t window = -1;
  bool lease_expired = false;
};

// Client: a LOCAL_INV of a mirror window, after which `call` completes with `status`.
struct RevokeThenComplete {
  int32_t window = -1;
  bool lease_expired = false;
  CallState* call = nullptr;
  absl::Status status;
};

// Server, local-invalidation fallback: the LOCAL_INV of an upload window, then the dispatch.
struct RevokeThenDispatch {
  int32_t window = -1;
  Request request;
};

// Keeps `buffer` until the WR (an RDMA WRITE from it) is done.
struct Hold {
  BulkBuffer buffer;
};

// Client: the RDMA WRITE of an upload, reading the caller's buffer.
struct UploadWrite {
  CallState* call = nullptr;  // null once the call no longer waits for it
  bool cancelled = false;     // the caller gave up: it completes with `status` after the WRITE
  absl::Status status;
};

}  // namespace bulk_op

using BulkOp = std::variant<std::monostate, bulk_op::DownloadRead, bulk_op::MirrorRead,
                            bulk_op::Revoke, bulk_op::RevokeThenComplete,
                            bulk_op::RevokeThenDispatch, bulk_op::Hold, bulk_op::UploadWrite>;

class BulkOpTable {
 public:
  // Operations waiting for their completion hold `gate` (a graceful shutdown waits for them).
  // May be null.
  void set_gate(Gate* gate) { gate_ = gate; }

  // A new operation of kind `Op`, built in its slot (whose index goes to *index) for the
  // caller to fill in.
  template <typename Op>
  Op& Emplace(int32_t* index) {
    if (gate_ != nullptr) gate_->Enter();
    if (free_.empty()) {
      *index = static_cast<int32_t>(ops_.size());
      return ops_.emplace_back().template emplace<Op>();
    }
    *index = free_.back();
    free_.pop_back();
    return ops_[static_cast<size_t>(*index)].template emplace<Op>();
  }
  BulkOp& at(int32_t i) { return ops_[static_cast<size_t>(i)]; }
  // The operation completed: moved out, its slot free.
  BulkOp Take(int32_t i) {
    BulkOp op = std::move(ops_[static_cast<size_t>(i)]);
    ops_[static_cast<size_t>(i)] = std::monostate();
    free_.push_back(i);
    if (gate_ != nullptr) gate_->Leave();
    return op;
  }
  // Operations still waiting for their completion.
  size_t live() const { return ops_.size() - free_.size(); }
  bool empty() const { return live() == 0; }
  std::vector<BulkOp>& all() { return ops_; }  // free slots hold std::monostate
  void Clear() {
    if (gate_ != nullptr) gate_->Leave(live());
    ops_.clear();
    free_.clear();
  }

 private:
  std::vector<BulkOp> ops_;
  std::vector<int32_t> free_;
  Gate* gate_ = nullptr;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_BULK_OPS_H_
