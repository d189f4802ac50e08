// Internal: one RC connection of a worker, and the parts that keep its state (kernel rxe's
// rxe_qp keeps req, comp and resp apart in the same way):
//
//   calls()    the calls this side makes: slots, generations, backlog     rpc/call_table.h
//   credits()  flow control both ways, and messages parked for a credit   rpc/credit_ledger.h
//   sends()    the send queue: batch, sequence numbers, signaling         rpc/send_queue.h
//   windows()  memory windows and their states; grants()  upload windows  rpc/window_table.h
//   ops()      bulk operations waiting for a completion                   rpc/bulk_ops.h
//   serving    what the server role keeps: method cache, blocking handlers
//   granted    upload windows we granted, and their byte budget
//   liveness   keepalive and setup timeout
//
// The accessors marked "any thread" may be used anywhere; everything else belongs to the thread
// running the worker's loop (Worker::OnLoopThread()), which alone drives the connection once it
// is active.

#ifndef SWIRL_RPC_CONNECTION_H_
#define SWIRL_RPC_CONNECTION_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "proto/control.pb.h"
#include "rpc/bulk_ops.h"
#include "rpc/call_table.h"
#include "rpc/credit_ledger.h"
#include "rpc/send_queue.h"
#include "rpc/window_table.h"
#include "swirl/call.h"
#include "swirl/service.h"
#include "transport/verbs/verbs.h"

namespace swirl::internal {

class Worker;

// Method id -> method, for one side's services.
class MethodTable {
 public:
  // Fails on a method id collision; all or nothing.
  absl::Status Add(const Service& service);
  const Service::Method* Find(uint32_t id) const {
    auto it = methods_.find(id);
    return it == methods_.end() ? nullptr : it->second;
  }
  bool empty() const { return methods_.empty(); }

 private:
  absl::flat_hash_map<uint32_t, const Service::Method*> methods_;
};

// Written by the loop thread only (a plain load and store: Bump), read from any thread.
struct ConnectionCounters {
  std::atomic<uint64_t> requests_received{0};
  std::atomic<uint64_t> responses_sent{0};
  std::atomic<uint64_t> requests_sent{0};
  std::atomic<uint64_t> responses_received{0};
  std::atomic<uint64_t> bytes_received{0};
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> protocol_errors{0};
  // Bulk windows (docs/BULK.md).
  std::atomic<uint64_t> windows_granted{0};
  std::atomic<uint64_t> windows_remote_invalidated{0};
  std::atomic<uint64_t> windows_locally_invalidated{0};
  std::atomic<uint64_t> windows_lease_expired{0};
  std::atomic<uint64_t> invalidation_violations{0};
};

// Single-writer counters: a plain load and store, no atomic read-modify-write on the hot path.
inline void Bump(std::atomic<uint64_t>& counter, uint64_t n = 1) {
  counter.store(counter.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
}

// Whether the peer is still there: keepalives, and (server side) whether a client ever spoke.
class Liveness {
 public:
  struct Timeouts {
    absl::Duration keepalive;      // ping after this long without a word; zero: never
    absl::Duration setup_timeout;  // server: the client must speak within this; zero: no limit
  };
  enum class Verdict { kAlive, kSendPing, kSilentClient, kStoppedAnswering };

  void Activate(absl::Time now) { last_received_ = activated_at_ = now; }
  void OnReceive() { received_ = true; }
  void OnPong() { ping_outstanding_ = false; }
  // Called now and then (the worker's timers); says what to do.
  Verdict Tick(absl::Time now, const Timeouts& timeouts, bool is_server);

 private:
  bool received_ = false;         // something arrived since the last tick
  bool heard_from_peer_ = false;  // something ever arrived
  absl::Time last_received_;
  absl::Time activated_at_;
  bool ping_outstanding_ = false;
  absl::Time ping_sent_;
};

// The server role's state: which method the last request named, blocking handlers in flight.
struct ServeState {
  // Most requests repeat the previous method: that lookup, checked first.
  uint32_t last_method_id = 0;
  const Service::Method* last_method = nullptr;
  Service::Invoker* last_invoker = nullptr;
  // last_invoker when a request for last_method may run inline on the worker (the method is
  // not one-way and runs on the worker): ServeEager's one test for its fast path.
  Service::Invoker* inline_invoker = nullptr;
  // inline_invoker->raw_handler(): a raw method's handler, called directly (ServeEager).
  Service::RawHandler* inline_raw = nullptr;
  // Invokers are the connection's: its method table outlives it, which a worker shared by
  // channels that come and go could not say of a cache of its own.
  absl::flat_hash_map<const Service::Method*, std::unique_ptr<Service::Invoker>> invokers;
  uint32_t pool_handlers = 0;  // blocking handlers still running
  uint64_t pool_bytes = 0;     // requests and attachments they hold
  // Their cancellation flags, by request id; one-way ones (no id), at most 2 * credits.
  absl::flat_hash_map<uint64_t, std::shared_ptr<std::atomic<bool>>> running;
  std::vector<std::shared_ptr<std::atomic<bool>>> running_one_way;
};

// Upload windows this side granted and the peer has not used yet.
struct GrantsGiven {
  // Per size class (each up to window_credits), and their bytes (capped by
  // WorkerOptions::grant_bytes_per_connection).
  absl::flat_hash_map<uint32_t, uint32_t> by_class;
  uint64_t bytes = 0;
  // A grant that found no send buffer: sent from the timers once one is free.
  bool owed = false;
  uint32_t owed_size = 0;
  uint32_t owed_count = 0;
};

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  enum class State : int { kNew, kActive, kDraining, kClosing, kClosed };

  // `work`: the worker's gate, held by the parts' work under way (rpc/gate.h).
  Connection(Worker* worker, uint64_t id, std::unique_ptr<verbs::QueuePair> qp,
             const MethodTable* methods, uint32_t send_queue_depth, Gate* work);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // ---- Any thread ----
  uint64_t id() const { return id_; }
  Worker* worker() const { return worker_; }
  State state() const { return state_.load(std::memory_order_acquire); }
  // Waits until the worker is done with the connection (kClosed) or `deadline`; true if it is.
  // For a channel closing its connection on a worker with a thread of its own.
  bool WaitClosed(absl::Time deadline) const {
    return closed_notice_.WaitForNotificationWithDeadline(deadline);
  }
  const std::string& peer() const { return peer_; }
  // Server side: the principal the client authenticated as at Connect ("" if none).
  const std::string& principal() const { return principal_; }
  const std::string& client_name() const { return client_name_; }
  const control::Negotiated& negotiated() const { return negotiated_; }
  ConnectionCounters& counters() { return counters_; }
  // Why it closed: written before the state becomes kClosed.
  const absl::Status& close_reason() const { return close_reason_; }
  // A handle for calling the other side over this connection.
  std::shared_ptr<CallTarget> AsCallTarget();

  // Control path, before the connection is activated: what the handshake settled, and on a
  // server who the client authenticated as (its principal, "" for none). Our grants beyond
  // the peer's initial ones come from `pool` (the worker's shared credits).
  void Configure(const control::Negotiated& negotiated, bool is_server, std::string peer,
                 std::string client_name, std::string principal = "",
                 CreditPool* pool = nullptr);
  // Set at admission (Worker::CreateConnection): the credits our worker grants the peer at
  // first, the floor plus what its pool could spare; the handshake tells the peer.
  uint32_t initial_grant() const { return initial_grant_; }
  void set_initial_grant(uint32_t n) { initial_grant_ = n; }
  // Control path, before the connection is activated: called once on the loop thread when the
  // connection starts closing (its QP in ERR, before its pending calls fail), with why. It
  // must not block (a channel only marks itself down and wakes its reconnector).
  void set_on_lost(std::function<void(const absl::Status&)> fn) { on_lost_ = std::move(fn); }
  std::function<void(const absl::Status&)> TakeOnLost() { return std::move(on_lost_); }

  // ---- Loop thread ----
  verbs::QueuePair& qp() { return *qp_; }
  uint32_t qp_num() const { return qp_num_; }
  // Destroys the QP (teardown: it is in ERR and fully flushed).
  void DestroyQp() { qp_.reset(); }
  void set_state(State state) {
    state_.store(state, std::memory_order_release);
    if (state == State::kClosed) closed_notice_.Notify();
  }
  // kClosing or kClosed: the QP is in ERR or gone; nothing is sent any more.
  bool closing() const { return state_.load(std::memory_order_relaxed) >= State::kClosing; }
  bool active() const { return state_.load(std::memory_order_relaxed) == State::kActive; }
  void set_close_reason(absl::Status why) { close_reason_ = std::move(why); }

  bool is_server() const { return is_server_; }
  const MethodTable* methods() const { return methods_; }
  // internal::LimitKey(principal(), peer()): what per-client limits count by.
  const std::string& client_key() const { return client_key_; }
  uint32_t max_payload() const { return max_payload_; }
  // The largest message that travels eagerly: the eager threshold where this side can move
  // bulk data (a bulk pool here, a bulk size negotiated), else max_payload().
  uint32_t eager_limit() const { return eager_limit_; }
  // The peer revokes our windows with SEND_WITH_INV (else: our own LOCAL_INV).
  bool remote_invalidation() const { return remote_invalidation_; }

  CallTable& calls() { return calls_; }
  CreditLedger& credits() { return credits_; }
  const CreditLedger& credits() const { return credits_; }
  SendQueue& sends() { return sends_; }
  WindowTable& windows() { return windows_; }
  const WindowTable& windows() const { return windows_; }
  UploadGrants& grants() { return grants_; }
  BulkOpTable& ops() { return ops_; }
  const BulkOpTable& ops() const { return ops_; }

  ServeState serving;
  GrantsGiven granted;
  uint64_t download_bytes = 0;  // buffers behind download windows not yet acknowledged
  // Mirror mode, server side: buffers of our RDMA READs of its requests and of replies we are
  // writing into its windows, and how many of those READs are under way.
  uint64_t mirror_bytes = 0;
  uint32_t mirror_reads = 0;
  // Requests waiting for room in that budget, in arrival order (each holds the worker's gate).
  std::deque<bulk_op::MirrorWait> mirror_waiting;
  Liveness liveness;
  bool in_doorbell_list = false;  // the worker rings its doorbell at the end of the iteration
  absl::Time closing_since;

 private:
  Worker* const worker_;
  const uint64_t id_;
  std::unique_ptr<verbs::QueuePair> qp_;
  const uint32_t qp_num_;
  const MethodTable* const methods_;
  std::atomic<State> state_{State::kNew};
  swirl::Notification closed_notice_;  // notified when state_ becomes kClosed

  // Set by Configure, before activation.
  std::string peer_;
  std::string principal_;
  std::string client_key_;
  std::string client_name_;
  control::Negotiated negotiated_;
  uint32_t initial_grant_ = 0;
  bool is_server_ = false;
  bool remote_invalidation_ = false;
  uint32_t max_payload_ = 0;
  uint32_t eager_limit_ = 0;
  ConnectionCounters counters_;
  absl::Status close_reason_;
  std::function<void(const absl::Status&)> on_lost_;

  CallTable calls_;
  CreditLedger credits_;
  SendQueue sends_;
  WindowTable windows_;
  UploadGrants grants_;
  BulkOpTable ops_;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_CONNECTION_H_
