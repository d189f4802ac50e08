// Internal: a worker's send side. Every message is written in place, in an inline slot of the
// arena (up to the device's inline limit: the NIC copies it at post time) or in a send-pool
// buffer; queued on its connection's send queue carrying every credit owed to the peer; and
// sent with one doorbell per connection at the end of the loop iteration (FlushAll). A message
// that finds no credit is parked in a send buffer until one comes back. Loop thread only.
//
// A failed post, or a peer that lets too many messages park, fails its connection through the
// function the worker gives at Init (Worker::FailConnection).

#ifndef SWIRL_RPC_OUTBOX_H_
#define SWIRL_RPC_OUTBOX_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "rpc/buffer_pool.h"
#include "rpc/connection.h"
#include "rpc/wire.h"

namespace swirl::internal {

class Outbox {
 public:
  struct Config {
    uint32_t send_buffers;  // in the send pool
    uint32_t buffer_size;   // header included
    uint32_t max_inline;    // the device's inline limit (0: none)
    // Messages one connection may park: at least this many (the worker's share per connection
    // of the send pool), and at least four per credit it grants.
    uint32_t park_share;
  };
  absl::Status Init(const std::shared_ptr<verbs::ProtectionDomain>& pd, const Config& config,
                    absl::AnyInvocable<void(Connection*, const absl::Status&)> fail);

  // ---- Writing messages ----
  // Space for a message of `length` bytes: an inline slot, or a send buffer (then *buffer >= 0).
  // nullptr if the send pool is exhausted. Never rings a doorbell.
  char* Alloc(uint32_t length, int32_t* buffer) {
    // An inline slot while the arena has one: the NIC copies inline data at post time, so the
    // slots are free again after the doorbells (FlushAll). Past kArenaSlots messages in one
    // iteration, send buffers: never a doorbell from here, which would fail connections under
    // the caller's feet.
    if (length <= max_inline_ && arena_used_ < kArenaSlots) {
      *buffer = -1;
      return arena_.data() + static_cast<size_t>(arena_used_++) * slot_size_;
    }
    if (pool_->empty() || length > pool_->size()) return nullptr;
    const uint32_t index = pool_->Take();
    *buffer = static_cast<int32_t>(index);
    return pool_->at(index);
  }
  // Gives back the send buffer of a message not sent (-1: none).
  void Give(int32_t buffer) {
    if (buffer >= 0) pool_->Give(static_cast<uint32_t>(buffer));
  }
  BufferPool& pool() { return *pool_; }
  uint32_t max_inline() const { return max_inline_; }

  // ---- Queueing ----
  // Queues the message at `data` on `c`, spending a credit (c->credits().CanSend()) and filling
  // in the credits its header returns. SEND_WITH_INV of `invalidate_rkey` if not 0.
  void Queue(Connection* c, char* data, uint32_t length, int32_t buffer,
             uint32_t invalidate_rkey = 0, unsigned int flags = 0) {
    Fill(c, data, length, buffer, invalidate_rkey, flags);
    Commit(c, buffer, -1);
  }
  // Queue for a message whose doorbell rings right after (a caller-driven call): posted at
  // once when nothing of `c` waits for a doorbell (no order to keep, no doorbell list to keep),
  // else queued behind what waits, to leave with FlushAll.
  void QueueAndRing(Connection* c, char* data, uint32_t length, int32_t buffer) {
    if (c->in_doorbell_list) {
      Queue(c, data, length, buffer);
      return;
    }
    Fill(c, data, length, buffer, 0, 0);
    c->sends().Commit(buffer, -1);
    Flush(c);
  }
  // Queues any other WR (a bind, a LOCAL_INV, an RDMA READ or WRITE) for bulk operation `op`
  // (or -1); `sge` may be null.
  uint64_t QueueRaw(Connection* c, const ibv_send_wr& wr, const ibv_sge* sge, int32_t op);
  // Queues the message now, or parks it until a credit comes back (in order behind anything
  // parked). A connection that parks more than its share fails; so does one closing already,
  // whose messages are dropped.
  // Inline: every response leaves through it (the rest is EmitSlow's).
  void Emit(Connection* c, char* data, uint32_t length, int32_t buffer, uint32_t invalidate_rkey,
            unsigned int flags = 0) {
    if (!c->closing() && !c->credits().MustPark()) [[likely]] {
      Queue(c, data, length, buffer, invalidate_rkey, flags);
      return;
    }
    EmitSlow(c, data, length, buffer, invalidate_rkey, flags);
  }
  // A header-only control message (ping, pong, credit return, cancel), best effort: only if a
  // credit is free now (credits come back with the next message anyway).
  void SendControl(Connection* c, rpc_wire::MessageType type, uint64_t request_id);
  // Queues parked messages while credits last; true if none is left parked.
  bool Unpark(Connection* c);

  // ---- Doorbells ----
  // Rings the doorbell of every connection with queued WRs. Inline: the end of every loop turn
  // and of every caller-driven call. Popped one at a time: a failed post fails its connection,
  // whose calls' callbacks may queue (and even flush) more.
  void FlushAll() {
    while (!doorbells_.empty()) {
      Connection* c = doorbells_.back();
      doorbells_.pop_back();
      c->in_doorbell_list = false;
      Flush(c);
    }
    arena_used_ = 0;
  }
  bool idle() const { return doorbells_.empty(); }

  // ---- Teardown ----
  // The connection failed: its parked and queued-but-unposted messages give their buffers back.
  void DropUnsent(Connection* c);
  // The connection is going: it leaves the doorbell list, and the buffers of WRs that will
  // never complete come back.
  void Forget(Connection* c);

 private:
  // Emit for a closing connection or one without a credit (the message is parked). Out of
  // line: its logging's buffers would make -fstack-protector guard every Emit (base/copy.h).
  [[gnu::noinline]] void EmitSlow(Connection* c, char* data, uint32_t length, int32_t buffer,
                                  uint32_t invalidate_rkey, unsigned int flags);
  void Flush(Connection* c) {
    const int err = c->sends().Flush([c](ibv_send_wr* first) {
      ibv_send_wr* bad = nullptr;
      return ibv_post_send(c->qp().get(), first, &bad);
    });
    if (err != 0) [[unlikely]] PostFailed(c, err);
  }
  [[gnu::noinline, gnu::cold]] void PostFailed(Connection* c, int err);
  // Writes the message's WR at the end of c's batch (not yet numbered: Commit), spending a
  // credit and filling in the credits its header returns.
  void Fill(Connection* c, char* data, uint32_t length, int32_t buffer, uint32_t invalidate_rkey,
            unsigned int flags) {
    reinterpret_cast<rpc_wire::MessageHeader*>(data)->credits = c->credits().Spend();
    // Built in place in the doorbell batch: the message path is the hot path.
    SendQueue& sends = c->sends();
    ibv_sge& sge = sends.next_sge();
    sge.addr = reinterpret_cast<uint64_t>(data);
    sge.length = length;
    sge.lkey = pool_lkey_;  // an inline send's lkey is not looked at
    ibv_send_wr& wr = sends.next_wr();
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = invalidate_rkey != 0 ? IBV_WR_SEND_WITH_INV : IBV_WR_SEND;
    wr.invalidate_rkey = invalidate_rkey;
    wr.send_flags = flags | (buffer < 0 ? IBV_SEND_INLINE : 0);
    Bump(c->counters().bytes_sent, length);
  }
  // Numbers the WR just written at the end of c's batch, and rings the doorbell if it is full.
  uint64_t Commit(Connection* c, int32_t buffer, int32_t op) {
    const uint64_t seq = c->sends().Commit(buffer, op);
    if (!c->in_doorbell_list) {
      c->in_doorbell_list = true;
      doorbells_.push_back(c);
    }
    if (c->sends().full()) Flush(c);
    return seq;
  }

  static constexpr uint32_t kArenaSlots = 64;

  std::unique_ptr<BufferPool> pool_;
  uint32_t pool_lkey_ = 0;  // pool_->lkey(), once
  uint32_t max_inline_ = 0;
  uint32_t slot_size_ = 64;  // of an inline slot: max(max_inline_, 64)
  uint32_t park_share_ = 0;
  std::vector<char> arena_;  // inline slots: what the NIC copies at post time
  uint32_t arena_used_ = 0;
  std::vector<Connection*> doorbells_;
  absl::AnyInvocable<void(Connection*, const absl::Status&)> fail_;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_OUTBOX_H_
