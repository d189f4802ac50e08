// Internal: the data-plane event loop shared by servers and channels.
//
// A Worker owns one CQ, one SRQ fed from a registered receive pool, a registered send pool, and
// the connections (one RC QP each) assigned to it. It is driven either by its own thread (pinned
// to a core, busy-polling, optionally falling back to the CQ's completion channel when idle) or,
// for caller-driven channels, by whichever application thread is waiting for a call.
//
// One loop iteration (RunOnce), all on the driving thread, no locks, no allocation, no syscalls
// in steady state:
//   1. take submitted work (calls, cancellations, new connections, pool-handler responses) from
//      a lock-free MPSC queue;
//   2. poll the CQ: receives are validated and dispatched (handlers run inline), responses
//      complete calls; send completions free send buffers;
//   3. re-post consumed receive buffers to the SRQ (one doorbell);
//   4. post each connection's queued sends (one doorbell per connection), with credits
//      returned piggybacked on every message;
//   5. now and then: deadlines, keepalives, lease expiry.
//
// Flow control: each side reserves `credits` receive buffers for the other. A message costs one
// credit; credits come back in the header of the peer's messages (or a kCredit message when
// there is nothing to piggyback on). Since the SRQ always holds at least the credits granted to
// all connections, a peer that honours its credits never meets an empty receive queue (no RNR).

#ifndef SWIRL_RPC_WORKER_H_
#define SWIRL_RPC_WORKER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/mpsc_queue.h"
#include "base/spinlock.h"
#include "proto/control.pb.h"
#include "rpc/buffer_pool.h"
#include "rpc/call.h"
#include "rpc/service.h"
#include "rpc/wire.h"
#include "transport/verbs/capabilities.h"
#include "transport/verbs/verbs.h"

namespace swirl::internal {

class ThreadPool;
class Worker;

// Method id -> method, for one side's services.
class MethodTable {
 public:
  // Fails on a method id collision.
  absl::Status Add(const Service& service);
  const Service::Method* Find(uint32_t id) const {
    auto it = methods_.find(id);
    return it == methods_.end() ? nullptr : it->second;
  }
  bool empty() const { return methods_.empty(); }

 private:
  absl::flat_hash_map<uint32_t, const Service::Method*> methods_;
};

struct ConnectionCounters {
  std::atomic<uint64_t> requests_received{0};
  std::atomic<uint64_t> responses_sent{0};
  std::atomic<uint64_t> requests_sent{0};
  std::atomic<uint64_t> responses_received{0};
  std::atomic<uint64_t> bytes_received{0};
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> protocol_errors{0};
};

// One RC connection. Fields below "worker only" are touched by the driving thread alone.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  enum class State : int { kNew, kActive, kDraining, kClosing, kClosed };

  Connection(Worker* worker, uint64_t id, std::unique_ptr<verbs::QueuePair> qp,
             const MethodTable* methods);
  ~Connection();

  uint64_t id() const { return id_; }
  Worker* worker() const { return worker_; }
  verbs::QueuePair& qp() { return *qp_; }
  State state() const { return state_.load(std::memory_order_acquire); }
  const std::string& peer() const { return peer_; }
  const std::string& client_name() const { return client_name_; }
  const control::Negotiated& negotiated() const { return negotiated_; }
  ConnectionCounters& counters() { return counters_; }
  const absl::Status& close_reason() const { return close_reason_; }

  // Set on the control path before activation.
  void Configure(const control::Negotiated& negotiated, bool is_server, std::string peer,
                 std::string client_name);

  // A handle for calling the other side over this connection.
  std::shared_ptr<CallTarget> AsCallTarget();

 private:
  friend class Worker;

  Worker* const worker_;
  const uint64_t id_;
  std::unique_ptr<verbs::QueuePair> qp_;
  const MethodTable* methods_;
  std::atomic<State> state_{State::kNew};
  std::string peer_;
  std::string client_name_;
  control::Negotiated negotiated_;
  bool is_server_ = false;
  ConnectionCounters counters_;
  absl::Status close_reason_;  // written before state becomes kClosed

  // ---- worker only ----
  uint32_t send_credits_ = 0;     // messages we may still send
  uint32_t peer_credits_ = 0;     // what the peer reserved for us (the cap on send_credits_)
  uint32_t local_credits_ = 0;    // what we reserved for the peer
  uint32_t credits_to_return_ = 0;
  uint32_t max_payload_ = 0;      // negotiated max message payload
  uint32_t max_inline_ = 0;       // our QP's inline limit

  // Outstanding calls we made: slot table indexed by request_id's low bits.
  std::vector<ClientCall*> pending_;
  std::vector<uint32_t> generation_;
  std::vector<uint32_t> free_slots_;
  uint32_t pending_count_ = 0;
  ClientCall* backlog_head_ = nullptr;  // calls waiting for a credit or a slot
  ClientCall* backlog_tail_ = nullptr;

  // Responses ready but without a credit, in send-pool buffers.
  struct QueuedMessage {
    uint32_t buffer;
    uint32_t length;
  };
  std::deque<QueuedMessage> response_backlog_;

  // Send queue accounting: seq of every posted WR; a signaled completion for seq S retires all
  // WRs up to S. sent_buffer_[seq & mask] is the send-pool buffer a WR used, or -1.
  uint64_t next_seq_ = 1;
  uint64_t completed_seq_ = 0;
  uint32_t unsignaled_ = 0;
  uint32_t sq_depth_ = 0;
  std::vector<int32_t> sent_buffer_;

  // WRs queued for the next doorbell.
  static constexpr int kBatch = 32;
  ibv_send_wr batch_wr_[kBatch];
  ibv_sge batch_sge_[kBatch];
  int batch_size_ = 0;
  bool dirty_ = false;

  uint32_t peer_available_ = 0;         // credits the peer holds (it may send this many more)
  uint32_t pool_handlers_ = 0;          // blocking handlers still running
  absl::flat_hash_map<uint64_t, std::shared_ptr<std::atomic<bool>>> running_;  // pool handlers
  bool received_ = false;               // something arrived since the last timer pass
  absl::Time last_received_;
  bool ping_outstanding_ = false;
  absl::Time ping_sent_;
  absl::Time closing_since_;
};

struct WorkerOptions {
  std::string name = "worker";
  int core = -1;               // pin the worker thread to this CPU (-1: don't)
  bool own_thread = true;      // false: caller-driven (no thread)
  bool adaptive_idle = true;   // sleep on the completion channel after idle_spin of nothing
  absl::Duration idle_spin = absl::Microseconds(200);
  uint32_t max_connections = 64;
  uint32_t credits = 32;             // receive buffers reserved per connection
  uint32_t buffer_size = 4096 + 32;  // receive/send buffer size, header included
  uint32_t send_buffers = 0;         // 0: max_connections * credits
  absl::Duration keepalive = absl::Seconds(5);
  // Called on the loop thread when a connection is gone for good.
  std::function<void(uint64_t connection_id)> on_closed;
};

struct WorkerStats {
  uint64_t connections = 0;
  uint64_t recv_buffers_posted = 0;
  uint64_t recv_buffers_total = 0;
  uint64_t protocol_errors = 0;
  uint64_t requests = 0;
  uint64_t stray_completions = 0;
};

class Worker {
 public:
  // `methods` may be null for a worker that only makes calls; per-connection tables override.
  static absl::StatusOr<std::unique_ptr<Worker>> Create(std::shared_ptr<verbs::Context> context,
                                                        std::shared_ptr<verbs::ProtectionDomain> pd,
                                                        const verbs::Capabilities& caps,
                                                        const WorkerOptions& options,
                                                        ThreadPool* pool);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void Start();  // own_thread: starts the loop thread
  void Stop();   // closes every connection and joins the thread

  // ---- Control path (any thread) ----
  // Reserves receive credits and creates a QP in INIT for a new connection. RESOURCE_EXHAUSTED
  // when the worker is full.
  absl::StatusOr<std::shared_ptr<Connection>> CreateConnection(uint64_t id,
                                                               const MethodTable* methods,
                                                               const verbs::ConnectOptions& co);
  // Hands an RTS connection to the loop.
  void Activate(std::shared_ptr<Connection> connection);
  // Forgets a connection that was created but never activated (its setup failed).
  void Abandon(const std::shared_ptr<Connection>& connection);
  // Fails pending calls with `reason` and tears the connection down (asynchronous).
  void Close(uint64_t connection_id, absl::Status reason);
  // Stops accepting new requests on every connection; in-flight ones finish.
  void BeginDrain();
  // True when no handler is running and nothing is waiting to be sent.
  bool Drained() const { return drained_.load(std::memory_order_acquire); }

  // ---- Calls (any thread) ----
  void StartCall(uint64_t connection_id, ClientCall* call);
  void CancelCall(ClientCall* call);
  // Completes a call that never reached a worker.
  static void FailUnstarted(ClientCall* call, absl::Status status);

  // ---- Driving ----
  // One iteration if no other thread is driving; returns true if there was work.
  bool TryDrive();
  bool caller_driven() const { return !options_.own_thread; }

  // ---- Observation (any thread) ----
  WorkerStats Stats() const;
  uint32_t free_credits() const;
  std::vector<std::shared_ptr<Connection>> Connections() const;
  std::shared_ptr<Connection> Find(uint64_t connection_id) const;
  const verbs::Capabilities& capabilities() const { return caps_; }
  const WorkerOptions& options() const { return options_; }
  std::shared_ptr<verbs::ProtectionDomain> pd() const { return pd_; }

  // For thread-pool handlers and internal tasks: runs `fn` on the loop thread.
  void RunInLoop(absl::AnyInvocable<void()> fn);

 private:
  struct WorkItem {
    enum Kind : uint8_t { kNone, kStartCall, kCancelCall, kActivate, kClose, kFunction };
    Kind kind = kNone;
    uint64_t connection_id = 0;
    ClientCall* call = nullptr;
    std::shared_ptr<Connection> connection;
    absl::AnyInvocable<void()> fn;
    absl::Status status;
  };

  class Writer;  // ResponseWriter into the inline arena or a send buffer
  friend class Writer;

  Worker(std::shared_ptr<verbs::Context> context, std::shared_ptr<verbs::ProtectionDomain> pd,
         const verbs::Capabilities& caps, const WorkerOptions& options, ThreadPool* pool);
  absl::Status Init();

  void Submit(WorkItem item);
  void Loop();
  bool RunOnce();
  void SleepUntilWork();
  bool DrainSubmissions();
  void HandleItem(WorkItem& item);

  // Receive side.
  void HandleRecv(const ibv_wc& wc);
  void HandleSendCompletion(const ibv_wc& wc);
  void Dispatch(Connection* c, const rpc_wire::MessageHeader& h, const char* payload);
  void CompleteCall(Connection* c, const rpc_wire::MessageHeader& h, const char* payload);
  void RepostRecvs();

  // Send side.
  void StartCallLocked(Connection* c, ClientCall* call);
  bool TrySendCall(Connection* c, ClientCall* call);
  void SendResponse(Connection* c, uint64_t request_id, const absl::Status& status,
                    Writer* writer);
  void SendResponseBytes(Connection* c, uint64_t request_id, const absl::Status& status,
                         absl::string_view payload);
  void EmitResponse(Connection* c, Writer* writer, uint64_t request_id, uint32_t code);
  void RunOnPool(Connection* c, const rpc_wire::MessageHeader& h, const char* payload,
                 const Service::Method* method);
  // Space for a message of `length` bytes: the inline arena or a send-pool buffer (then
  // *buffer >= 0). nullptr if the send pool is exhausted.
  char* AllocMessage(Connection* c, uint32_t length, int32_t* buffer);
  void SendControl(Connection* c, rpc_wire::MessageType type, uint64_t request_id);
  // Queues one message (header+payload already written at `data`) for the next doorbell.
  // `buffer` is its send-pool buffer or -1 for the inline arena.
  void QueueWr(Connection* c, const char* data, uint32_t length, int32_t buffer);
  void FlushSends();
  void FlushConnection(Connection* c);
  void PumpBacklog(Connection* c);
  void FillHeader(Connection* c, rpc_wire::MessageHeader* h);
  char* InlineSlot();

  // Failure and teardown.
  void ProtocolError(Connection* c, const absl::Status& why);
  void FailConnection(Connection* c, const absl::Status& why);
  void FinishClose(Connection* c);
  void Timers(absl::Time now);
  void FailPendingCalls(Connection* c, const absl::Status& why);
  uint64_t AllocateSlot(Connection* c, ClientCall* call);
  ClientCall* ReleaseSlot(Connection* c, uint64_t request_id);
  void CompleteLocally(ClientCall* call, absl::Status status);


  std::shared_ptr<verbs::Context> context_;
  std::shared_ptr<verbs::ProtectionDomain> pd_;
  const verbs::Capabilities caps_;
  const WorkerOptions options_;
  ThreadPool* const pool_;

  std::shared_ptr<verbs::CompletionChannel> channel_;
  std::shared_ptr<verbs::CompletionQueue> cq_;
  std::shared_ptr<verbs::SharedReceiveQueue> srq_;
  std::unique_ptr<BufferPool> recv_pool_;
  std::unique_ptr<BufferPool> send_pool_;
  uint32_t max_inline_ = 0;

  MpscQueue<WorkItem> submissions_;
  std::atomic<bool> sleeping_{false};
  int wake_fd_ = -1;
  std::atomic<bool> running_{false};
  std::thread thread_;
  SpinLock driver_;  // held by whoever runs RunOnce

  // Loop state (driver only).
  absl::flat_hash_map<uint32_t, Connection*> by_qpn_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Connection>> by_id_;
  std::vector<Connection*> dirty_;
  std::vector<uint32_t> repost_;
  std::vector<char> inline_arena_;
  uint32_t inline_used_ = 0;
  uint32_t recv_posted_ = 0;
  uint64_t iterations_ = 0;
  absl::Time next_timer_ = absl::InfinitePast();
  bool draining_ = false;
  absl::flat_hash_map<const Service::Method*, std::unique_ptr<Service::Invoker>> invokers_;
  std::vector<Connection*> closing_;

  // Shared with the control path.
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Connection>> registry_ ABSL_GUARDED_BY(mu_);
  uint32_t reserved_credits_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<bool> drained_{true};
  std::atomic<uint64_t> protocol_errors_{0};
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> stray_{0};  // completions naming no connection we know
  std::atomic<uint32_t> recv_posted_snapshot_{0};
};

// Fixed-size pool for blocking handlers (Execution::kThreadPool).
class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  void Schedule(absl::AnyInvocable<void()> task);

 private:
  void Run();
  absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_WORKER_H_
