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
#include "absl/functional/function_ref.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"
#include "absl/time/time.h"
#include "base/mpsc_queue.h"
#include "base/spinlock.h"
#include "proto/control.pb.h"
#include "rpc/buffer_pool.h"
#include "rpc/bulk.h"
#include "rpc/bulk_pool.h"
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
  // Bulk windows (docs/BULK.md).
  std::atomic<uint64_t> windows_granted{0};
  std::atomic<uint64_t> windows_remote_invalidated{0};
  std::atomic<uint64_t> windows_locally_invalidated{0};
  std::atomic<uint64_t> windows_lease_expired{0};
  std::atomic<uint64_t> invalidation_violations{0};
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
  // Most requests repeat the previous method: that lookup, checked first (worker only).
  uint32_t last_method_id_ = 0;
  const Service::Method* last_method_ = nullptr;  // most requests repeat the previous method
  // Handlers' reusable state (parsed request, response) per method, for the worker's thread.
  absl::flat_hash_map<const Service::Method*, std::unique_ptr<Service::Invoker>> invokers_;
  Service::Invoker* last_invoker_ = nullptr;  // last_method_'s
  std::atomic<State> state_{State::kNew};
  std::string peer_;
  std::string client_key_;  // internal::ClientKey(peer_): what per-client limits count by
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
  // Everything this side sends that is not a new call waits here, in one queue, so that what
  // was emitted first leaves first (a bulk ack before the response to the same request).
  struct QueuedMessage {
    uint32_t buffer;
    uint32_t length;
    uint32_t invalidate_rkey;
    unsigned int flags;  // extra send flags (IBV_SEND_FENCE for acks behind a READ)
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

  // ---- bulk (rpc/bulk.cc), worker only ----
 public:
  // A type 2 memory window this connection owns. Windows are allocated once and reused: a
  // fresh rkey per bind, never an ibv_alloc_mw per request.
  struct Window {
    std::unique_ptr<verbs::MemoryWindow> mw;
    uint32_t rkey = 0;  // the key of the current (or last) binding
    enum class State : uint8_t { kFree, kExposed, kRevoking } state = State::kFree;
    enum class Purpose : uint8_t { kDownload, kGrant, kMirrorRequest, kMirrorReply } purpose;
    BulkBuffer buffer;  // what it exposes (when we own that memory)
    uint64_t request_id = 0;
    uint64_t addr = 0;
    uint32_t length = 0;
    absl::Time lease = absl::InfiniteFuture();
    int32_t revoke_op = -1;  // kRevoking: the LOCAL_INV op in flight
  };
  std::vector<Window> windows_;
  // A window keeps its rkey's index bits for life (a bind changes only the key byte): they find
  // the window a peer names without scanning.
  absl::flat_hash_map<uint32_t, int32_t> window_by_index_;
  std::vector<uint32_t> free_windows_;
  uint32_t max_windows_ = 0;
  // Upload windows the peer granted us (we are the client in kServerExposes mode).
  std::vector<rpc_wire::BulkDescriptor> grants_;
  bool grant_requested_ = false;
  // Upload windows we granted and the peer has not used yet, per size class (each up to
  // window_credits), and their bytes (capped by WorkerOptions::grant_bytes_per_connection).
  absl::flat_hash_map<uint32_t, uint32_t> grants_by_size_;
  uint64_t granted_bytes_ = 0;
  // A grant that found no send buffer: sent from the timers once one is free.
  bool grant_owed_ = false;
  uint32_t grant_owed_size_ = 0;
  uint32_t grant_owed_count_ = 0;
  // Unsafe benchmark mode: buffers handed out under the static rkey. Upload grants by address,
  // downloads by request id: apart, so that an upload naming a download's buffer (or an ack
  // naming a grant) is refused as naming nothing granted for it.
  absl::flat_hash_map<uint64_t, BulkBuffer> static_granted_;
  absl::flat_hash_map<uint64_t, BulkBuffer> static_download_;
  // Operations waiting on a signaled completion, by send-queue seq.
  struct BulkOp {
    enum class Kind : uint8_t {
      kNone,
      kDownloadRead,    // client: READ of a response's bulk data
      kMirrorRead,      // server: READ of a mirror request's bulk data, then dispatch
      kRevoke,          // LOCAL_INV of a window (fallback, lease expiry)
      kRevokeThenDispatch,  // server: LOCAL_INV of an upload window, then dispatch (fallback)
      kRevokeThenComplete,  // client: LOCAL_INV of a mirror reply window, then complete
      kHold,            // keep `buffer` until this WR is done (RDMA WRITE source)
      kUploadWrite,     // client: RDMA WRITE of an upload, reading the caller's buffer
    } kind = Kind::kNone;
    ClientCall* call = nullptr;
    uint64_t request_id = 0;
    int32_t window = -1;
    bool lease_expired = false;
    BulkBuffer buffer;
    // A request whose dispatch waits for this op.
    rpc_wire::MessageHeader header{};
    std::string eager;
    bool has_chunk = false;
    rpc_wire::BulkDescriptor chunk{};
    uint32_t length = 0;
    uint32_t peer_rkey = 0;  // kMirrorRead: the caller's window to invalidate afterwards
    absl::Status status;     // kRevokeThenComplete, cancelled kDownloadRead: how the call ends
    bool admitted = false;   // the request arrived before a drain began (Incoming::admitted)
    bool cancelled = false;  // kDownloadRead, kUploadWrite: the caller gave up; finish when the
                             // READ or WRITE is done with its buffer
  };

 private:
  std::vector<int32_t> op_at_seq_;  // op index or -1, indexed like sent_buffer_
  std::vector<BulkOp> ops_;
  std::vector<int32_t> free_ops_;
  ClientCall* grant_wait_head_ = nullptr;  // calls waiting for an upload window
  ClientCall* grant_wait_tail_ = nullptr;

  uint32_t peer_available_ = 0;         // credits the peer holds (it may send this many more)
  uint32_t pool_handlers_ = 0;          // blocking handlers still running
  uint64_t pool_bytes_ = 0;             // requests and attachments they hold
  uint64_t download_bytes_ = 0;         // buffers behind download windows not yet acknowledged
  absl::flat_hash_map<uint64_t, std::shared_ptr<std::atomic<bool>>> running_;  // pool handlers
  // One-way pool handlers (no request id to key them by): at most 2 * credits of them.
  std::vector<std::shared_ptr<std::atomic<bool>>> running_one_way_;
  bool received_ = false;               // something arrived since the last timer pass
  bool heard_from_peer_ = false;        // something ever arrived (WorkerOptions::setup_timeout)
  absl::Time last_received_;
  absl::Time activated_at_;
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
  uint32_t send_buffers = 0;         // 0: 2 * max_connections * credits
  absl::Duration keepalive = absl::Seconds(5);
  // Server side: a connection its client has sent nothing on this long after it went active
  // fails (a client that never finished its side of Connect, or gave up before learning the
  // connection's id, would otherwise hold its slot until keepalive, or forever without one).
  // Clients send a ping as soon as they are connected. Zero: no limit.
  absl::Duration setup_timeout = absl::Seconds(10);
  // Bulk (docs/BULK.md).
  size_t bulk_pool_bytes = 0;        // 0: no bulk
  // Pool memory one connection may hold through upload windows granted to its peer and not
  // used yet (a peer cannot pin the whole pool by asking for grants it never uses).
  uint64_t grant_bytes_per_connection = 32 << 20;
  // Pool memory one connection may hold in downloads its peer has not acknowledged.
  uint64_t download_bytes_per_connection = 64 << 20;
  // Both of those together, with what queued blocking handlers hold, for all of one client's
  // connections (by address, as ServerOptions::max_connections_per_client counts them; on a
  // channel's worker the "client" is the server). 0: half the bulk pool, or what one connection
  // may hold (grants + downloads) if that is more.
  uint64_t bulk_bytes_per_client = 0;
  bool unsafe_static_rkey = false;   // also register the pool for remote access (benchmarks)
  absl::Duration window_lease = absl::Seconds(5);
  // Called on the loop thread when a connection is gone for good, with the reason it closed.
  std::function<void(uint64_t connection_id, const absl::Status& why)> on_closed;
  // Called on the loop thread just before a connection's QP is destroyed: destroying a QP
  // drops its undelivered asynchronous events (as the kernel does), so whoever counts them
  // takes them now (a peer's refused request raises one on our QP just before it fails).
  std::function<void()> before_qp_destroy;
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
  // True when no handler is running, nothing is waiting to be sent and no bulk transfer of a
  // request it accepted is under way.
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
  // True on the thread running this worker's loop right now (its handlers and callbacks).
  bool OnLoopThread() const;

  // ---- Observation (any thread) ----
  WorkerStats Stats() const;
  uint32_t free_credits() const;
  std::vector<std::shared_ptr<Connection>> Connections() const;
  std::shared_ptr<Connection> Find(uint64_t connection_id) const;
  const verbs::Capabilities& capabilities() const { return caps_; }
  const WorkerOptions& options() const { return options_; }
  std::shared_ptr<verbs::ProtectionDomain> pd() const { return pd_; }
  const std::shared_ptr<BulkPool>& bulk_pool() const { return bulk_pool_; }
  ConnectionCounters& totals() { return totals_; }
  uint64_t windows_exposed() const { return windows_exposed_.load(std::memory_order_relaxed); }

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
  // A request or response as it reaches the dispatcher: eager bytes plus, for bulk, the data
  // already in registered memory with its window revoked.
  struct Incoming {
    rpc_wire::MessageHeader header;
    absl::string_view eager;   // the message bytes (or the eager part next to an attachment)
    BulkBuffer bulk;           // attachment or the message itself (kAuxBulkIsMessage)
    bool has_chunk = false;    // mirror: the caller's reply window
    rpc_wire::BulkDescriptor chunk{};
    // Arrived before a drain began and then waited for its bulk data (a READ or a LOCAL_INV):
    // it is served, not refused, while the server drains.
    bool admitted = false;
  };
  void Dispatch(Connection* c, const rpc_wire::MessageHeader& h, const char* payload);
  void DispatchCall(Connection* c, Incoming& in);
  // Sends a handler's outcome (inline or pool): the error, the response in `writer` (eagerly or
  // through a window once it outgrew the eager threshold), or the message with `attachment`
  // (taken from the caller's buffer if it is sent).
  void SendHandlerResult(Connection* c, Incoming& in, absl::Status status, Writer* writer,
                         BulkBuffer& attachment);
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
  void RunOnPool(Connection* c, Incoming& in, const Service::Method* method);
  // Space for a message of `length` bytes: the inline arena or a send-pool buffer (then
  // *buffer >= 0). nullptr if the send pool is exhausted.
  char* AllocMessage(Connection* c, uint32_t length, int32_t* buffer);
  void SendControl(Connection* c, rpc_wire::MessageType type, uint64_t request_id);
  // Queues one message (header+payload already written at `data`) for the next doorbell.
  // `buffer` is its send-pool buffer or -1 for the inline arena.
  void QueueWr(Connection* c, const char* data, uint32_t length, int32_t buffer,
               uint32_t invalidate_rkey = 0, unsigned int extra_flags = 0);
  // Queues any work request (its sge, if any, in `sge`) with seq accounting.
  uint64_t QueueRawWr(Connection* c, ibv_send_wr& wr, const ibv_sge* sge, int32_t buffer,
                      int32_t op);
  // Sequence, signaling and batch accounting of the WR just written at the batch's end.
  uint64_t Track(Connection* c, ibv_send_wr& wr, int32_t buffer, int32_t op);
  void FlushSends();
  void FlushConnection(Connection* c);
  void PumpBacklog(Connection* c);
  // Takes the backlog's calls that `drop` selects out of it, leaving the list and its tail
  // whole before any of them completes (their callbacks may start calls that join it).
  std::vector<ClientCall*> UnlinkBacklog(Connection* c,
                                         absl::FunctionRef<bool(const ClientCall*)> drop);
  void FillHeader(Connection* c, rpc_wire::MessageHeader* h);
  char* InlineSlot();

  // Bulk (rpc/bulk.cc).
  bool SendBulkCall(Connection* c, ClientCall* call, size_t message_size, bool message_in_bulk);
  void SendBulkResponse(Connection* c, const Incoming& request, Writer* writer,
                        BulkBuffer data, bool is_message);
  void HandleBulkRequest(Connection* c, const rpc_wire::MessageHeader& h, const char* payload,
                         const ibv_wc& wc);
  void HandleBulkResponse(Connection* c, const rpc_wire::MessageHeader& h, const char* payload,
                          const ibv_wc& wc);
  void HandleBulkAck(Connection* c, const rpc_wire::MessageHeader& h, const ibv_wc& wc);
  void HandleWindowGrant(Connection* c, const rpc_wire::MessageHeader& h, const char* payload);
  void GrantWindows(Connection* c, uint32_t count, uint32_t size);
  void SendOwedGrant(Connection* c);
  void HandleBulkOp(Connection* c, int32_t op, const ibv_wc& wc);
  int32_t AcquireWindow(Connection* c);
  // The exposed window whose current key is `rkey`, or -1.
  int32_t ExposedWindow(const Connection* c, uint32_t rkey) const;
  // Binds window `w` over [addr, addr+length) of the pool with `access`, for `purpose` on behalf
  // of `request_id` (0 for grants); returns the new rkey. Every purpose but a grant is leased:
  // this side revokes it if no acknowledgement arrives within window_lease.
  uint32_t BindWindow(Connection* c, int32_t w, uint64_t addr, uint32_t length, int access,
                      Connection::Window::Purpose purpose, uint64_t request_id);
  // Posts a LOCAL_INV of window `w` and returns the op that completes it.
  int32_t RevokeWindow(Connection* c, int32_t w, Connection::BulkOp::Kind kind,
                       bool lease_expired);
  // Completes `call`, first revoking any window still exposing its buffers (mirror mode).
  void FinishCall(Connection* c, ClientCall* call, absl::Status status);
  // The call waiting for `request_id` (the slot stays taken), or nullptr.
  ClientCall* PendingCall(Connection* c, uint64_t request_id) const;
  // A call that gave up (cancel, deadline) while an RDMA READ into its buffer (download) or an
  // RDMA WRITE from it (upload) is in flight: it completes when that is done, never while the
  // device may still use the buffer.
  bool DeferIfReading(Connection* c, ClientCall* call, absl::Status status);
  // Mirror mode: a call given up on while the server may still READ its request window or
  // WRITE its reply window. Revoking them now would fail the server's access and with it the
  // connection; instead the call stays pending (no deadline) until the server's ack and
  // response, or the windows' lease, end the exposure, and then completes with `status`.
  bool DeferIfExposing(Connection* c, ClientCall* call, absl::Status status);
  // A pending call given up on (cancel, deadline), found in slot `request_id`: completes it
  // with `status`, or once the device and the server are done with its buffers (the Defer*
  // above), telling the server either way.
  void GiveUp(Connection* c, ClientCall* call, uint64_t request_id, absl::Status status);
  // Completes an abandoned call (above) once none of its windows is left.
  void FinishIfAbandoned(Connection* c, ClientCall* call);
  // The QP is in ERR: calls waiting on bulk operations complete now.
  void SettleBulkOps(Connection* c);
  // Sends a message already written at `data` now, or parks it until a credit comes back.
  void EmitMessage(Connection* c, char* data, uint32_t length, int32_t buffer,
                   uint32_t invalidate_rkey, unsigned int flags = 0);
  void FreeWindow(Connection* c, int32_t w);
  // Bulk memory held through grants and unacknowledged downloads by all of `c`'s client's
  // connections on this worker, and the change of one of `c`'s counters (granted_bytes_,
  // download_bytes_) by `delta`, kept in step with it.
  uint64_t ClientBulkBytes(const Connection* c) const;
  void ChargeBulk(Connection* c, uint64_t* counter, int64_t delta);
  // True while a bulk transfer of `c` is under way: a window other than an unused upload grant
  // is exposed or being revoked, or an operation waits for its completion. A drain waits.
  bool BulkInFlight(const Connection* c) const;
  int32_t NewOp(Connection* c);
  void PostRdma(Connection* c, ibv_wr_opcode opcode, const BulkBuffer& local, uint32_t length,
                uint64_t remote_addr, uint32_t rkey, int32_t op);
  void PostLocalInv(Connection* c, uint32_t rkey, int32_t op);
  void SendBulkAck(Connection* c, uint64_t request_id, uint32_t rkey);
  void BulkViolation(Connection* c, const std::string& why);
  void BulkTimers(Connection* c, absl::Time now);
  void ReleaseBulk(Connection* c);
  // Windows of this connection are revoked by the peer's SEND_WITH_INV (false for the local
  // fallback, and for the unsafe static-rkey mode, which has no windows at all).
  bool remote_invalidation(const Connection* c) const {
    return c->negotiated_.invalidation() == control::INVALIDATION_REMOTE &&
           c->negotiated_.bulk_mode() != control::BULK_UNSAFE_STATIC_RKEY_BENCHMARK_ONLY;
  }

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
  WorkerOptions options_;  // max_connections may shrink in Init() to fit the device's SRQ
  ThreadPool* const pool_;

  std::shared_ptr<verbs::CompletionChannel> channel_;
  std::shared_ptr<verbs::CompletionQueue> cq_;
  std::shared_ptr<verbs::SharedReceiveQueue> srq_;
  std::unique_ptr<BufferPool> recv_pool_;
  std::unique_ptr<BufferPool> send_pool_;
  std::shared_ptr<BulkPool> bulk_pool_;
  uint32_t max_inline_ = 0;
  absl::BitGen bitgen_;  // loop thread only: rkey key bytes
  ConnectionCounters totals_;  // bulk counters summed over connections, closed ones included
  std::atomic<uint64_t> windows_exposed_{0};  // written by the loop thread only
  // Loop thread: ClientBulkBytes, by Connection::client_key_ (entries at zero are erased).
  absl::flat_hash_map<std::string, uint64_t> client_bulk_bytes_;
  uint64_t bulk_bytes_per_client_ = 0;  // WorkerOptions::bulk_bytes_per_client, resolved

  MpscQueue<WorkItem> submissions_;
  std::atomic<bool> sleeping_{false};
  int wake_fd_ = -1;
  std::atomic<bool> running_{false};
  std::thread thread_;
  SpinLock driver_;  // held by whoever runs RunOnce

  // Loop state (driver only).
  absl::flat_hash_map<uint32_t, Connection*> by_qpn_;
  // Completions come in runs from one QP: the last lookup, checked first.
  uint32_t last_qpn_ = 0;
  Connection* last_connection_ = nullptr;
  Connection* FindByQpn(uint32_t qpn) {
    if (last_connection_ != nullptr && qpn == last_qpn_) return last_connection_;
    auto it = by_qpn_.find(qpn);
    if (it == by_qpn_.end()) return nullptr;
    last_qpn_ = qpn;
    last_connection_ = it->second;
    return it->second;
  }
  absl::flat_hash_map<uint64_t, std::shared_ptr<Connection>> by_id_;
  // A call usually goes to the connection whose completion was handled last: checked first.
  Connection* FindById(uint64_t id) {
    if (last_connection_ != nullptr && last_connection_->id() == id) return last_connection_;
    auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : it->second.get();
  }
  std::vector<Connection*> dirty_;
  std::vector<uint32_t> repost_;
  std::vector<char> inline_arena_;
  uint32_t inline_used_ = 0;
  uint32_t recv_posted_ = 0;
  uint64_t iterations_ = 0;
  absl::Time next_timer_ = absl::InfinitePast();
  bool draining_ = false;
  std::vector<Connection*> closing_;

  // Shared with the control path.
  mutable swirl::Mutex mu_;
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
  ~ThreadPool();  // Stop()
  // Queues `task`; after Stop() it is dropped instead.
  void Schedule(absl::AnyInvocable<void()> task);
  // Drops the queued tasks and waits for the running ones. Idempotent.
  void Stop();

 private:
  void Run();
  swirl::Mutex mu_;
  std::deque<absl::AnyInvocable<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_WORKER_H_
