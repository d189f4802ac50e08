// Internal: the data-plane event loop shared by servers and channels.
//
// A Worker owns one CQ, one SRQ fed from a registered receive pool, the send side (Outbox: the
// send pool, the inline arena, the doorbells), a bulk pool, and the connections (one RC QP
// each) assigned to it. It is driven either by its own thread (pinned to a core, busy-polling,
// optionally falling back to the CQ's completion channel when idle) or, for caller-driven
// channels, by whichever application thread is waiting for a call.
//
// One loop iteration (RunOnce), all on the driving thread, no locks, no allocation, no syscalls
// in steady state:
//   1. take submitted work (calls, cancellations, new connections, pool-handler responses) from
//      a lock-free MPSC queue;
//   2. poll the CQ: receives are validated and dispatched (handlers run inline), responses
//      complete calls; send completions free send buffers and finish bulk operations;
//   3. re-post consumed receive buffers to the SRQ (one doorbell);
//   4. now and then: deadlines, keepalives, lease expiry;
//   5. ring each connection's doorbell once for everything the steps above queued.
//
// The code, by concern (each file's functions run on the loop thread only, and the entry points
// check it with SWIRL_DCHECK(OnLoopThread())):
//   worker.cc            construction, the control path, submissions, observation
//   worker_receive.cc    the loop (a turn inlines the receive path into one function), receive
//                        completions: validation, credits, routing; send completions
//   worker_serve.cc      the server role: dispatch, handlers inline and on the pool, responses
//   worker_calls.cc      the client role: sending calls, completing them, giving up
//   worker_teardown.cc   protocol errors, failing and closing connections, timers
//   bulk_windows.cc      windows, bulk operations and their completions, acks, grants
//   bulk_upload.cc       calls with bulk data: granted (server-exposed) and mirrored uploads
//   bulk_download.cc     responses with bulk data
// The per-connection state is in the connection's parts (rpc/connection.h).
//
// Flow control (rpc/credit_ledger.h): the SRQ holds a floor of credits for every connection
// the worker may admit plus a shared pool that busy connections grow into (up to `credits`
// each); since it always holds at least the credits granted to all connections, a peer that
// honours its credits never meets an empty receive queue (no RNR).

#ifndef SWIRL_RPC_WORKER_H_
#define SWIRL_RPC_WORKER_H_

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/check.h"
#include "base/copy.h"
#include "base/mpsc_queue.h"
#include "base/mutex.h"
#include "base/spinlock.h"
#include "google/protobuf/message_lite.h"
#include "rpc/buffer_pool.h"
#include "rpc/bulk_pool.h"
#include "rpc/connection.h"
#include "rpc/gate.h"
#include "rpc/outbox.h"
#include "rpc/thread_pool.h"
#include "rpc/wire.h"
#include "rpc/writer.h"
#include "swirl/call.h"
#include "transport/verbs/capabilities.h"
#include "transport/verbs/verbs.h"

namespace swirl::internal {

// Every message starts with its header (rpc/wire.h).
inline constexpr uint32_t kHeader = sizeof(rpc_wire::MessageHeader);
// WorkerOptions::idle_yield_after for a worker not pinned to a core: long enough that a
// request/response exchange (a microsecond or two between messages) never pays a system call
// while it waits.
inline constexpr absl::Duration kIdleYieldAfter = absl::Microseconds(20);
// Completions one poll of the CQ takes at most.
inline constexpr int kPollBatch = 16;
// The wr_id bit of receives; sends use plain sequence numbers.
inline constexpr uint64_t kRecvTag = uint64_t{1} << 63;
// A registered buffer's address as the wire and the verbs carry it.
inline uint64_t Addr(const void* p) { return reinterpret_cast<uint64_t>(p); }


struct WorkerOptions {
  std::string name = "worker";
  int core = -1;               // pin the worker thread to this CPU (-1: don't)
  bool own_thread = true;      // false: caller-driven (no thread)
  bool adaptive_idle = true;   // sleep on the completion channel after idle_spin of nothing
  absl::Duration idle_spin = absl::Microseconds(200);
  // After this long without work the loop gives its core away between polls (sched_yield),
  // adaptive_idle or not. A spinning worker otherwise holds its core until the scheduler
  // preempts it, and where threads outnumber cores (two cores: each side's worker, device
  // thread, gRPC and application threads) every thread it woke, or that sets up a connection,
  // waits behind it: one-at-a-time connection setup ran at half the rate (docs/RELIABILITY.md
  // "Scale"). A message arriving during a yield waits it out: a system call (1.4 us on the
  // 2-core VM) where nothing else wants the core, up to a scheduler time slice where something
  // does. Unset: kIdleYieldAfter for a worker not pinned to a core, never for a pinned one (its
  // core is taken to be its own). InfiniteDuration: never.
  std::optional<absl::Duration> idle_yield_after;
  uint32_t max_connections = 64;
  uint32_t credits = 32;             // receive buffers one connection may be granted at most
  // Receive buffers shared by the connections beyond each one's floor (kCreditFloor), granted
  // to those whose traffic needs them. 0: enough for 64 connections at `credits` each (for
  // at most 64 connections: every one of them at once).
  uint32_t shared_credits = 0;
  uint32_t buffer_size = 4096 + 32;  // receive/send buffer size, header included
  uint32_t send_buffers = 0;         // 0: twice the receive credits (floors and pool)
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
  // Memory windows all of one client's connections may have allocated (bound or not: each
  // connection keeps its windows for reuse until it closes; ServerOptions::
  // max_windows_per_client). Beyond it a download is refused (RESOURCE_EXHAUSTED) and no
  // upload window is granted. 0: no limit but each connection's own.
  uint32_t max_windows_per_client = 0;
  // Mirror mode: pool memory one connection may hold in buffers of its requests being READ and
  // of replies being written into its windows, and how many of those READs may be under way at
  // once (ServerOptions::mirror_bytes_per_connection; beyond: waiting, or RESOURCE_EXHAUSTED).
  uint64_t mirror_bytes_per_connection = 32 << 20;
  uint32_t mirror_reads_per_connection = 16;
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

class Worker;

// The worker whose loop this thread is running right now (it holds that worker's driver_), so
// that calls started from callbacks and handlers go straight to the connection and leave with
// the iteration's doorbell instead of taking a trip through the submission queue. constinit:
// read directly, without a TLS wrapper call (the caller-driven call path reads it each call).
inline constinit thread_local Worker* t_driving = nullptr;

// Marks this thread as the one driving `worker` for the scope (it holds the driver lock).
class DrivingScope {
 public:
  explicit DrivingScope(Worker* worker) : previous_(std::exchange(t_driving, worker)) {}
  ~DrivingScope() { t_driving = previous_; }
  DrivingScope(const DrivingScope&) = delete;
  DrivingScope& operator=(const DrivingScope&) = delete;

 private:
  Worker* previous_;
};

class Worker {
 public:
  // Send-queue entries kept beyond the credits for bulk WRs (binds, invalidations, RDMA).
  static constexpr uint32_t kBulkSqReserve = 64;

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
  // when the worker is full. `methods` may be null for a connection that only makes calls.
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
  // After BeginDrain: waits until the worker's gate is empty (no blocking handler running, no
  // bulk operation or transfer window under way, no message waiting for a credit or a
  // doorbell), or `deadline`. True if it drained.
  bool WaitDrained(absl::Time deadline);

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
  // Room for connections: how many more this worker admits (Server picks the emptiest).
  uint32_t free_credits() const;
  // The shared credits not granted to any connection now.
  uint32_t pool_credits() const { return credit_pool_.available(); }
  CreditPool* credit_pool() { return &credit_pool_; }
  std::vector<std::shared_ptr<Connection>> Connections() const;
  std::shared_ptr<Connection> Find(uint64_t connection_id) const;
  const verbs::Capabilities& capabilities() const { return caps_; }
  const WorkerOptions& options() const { return options_; }
  std::shared_ptr<verbs::ProtectionDomain> pd() const { return pd_; }
  const std::shared_ptr<BulkPool>& bulk_pool() const { return bulk_pool_; }
  // Bulk memory charged to clients' budgets now (ChargeBulk), any thread.
  uint64_t bulk_bytes_charged() const {
    return bulk_bytes_charged_.load(std::memory_order_relaxed);
  }
  ConnectionCounters& totals() { return totals_; }
  uint64_t windows_exposed() const { return windows_exposed_.load(std::memory_order_relaxed); }

  // For thread-pool handlers and internal tasks: runs `fn` on the loop thread.
  void RunInLoop(absl::AnyInvocable<void()> fn);

 private:
  // Everything below runs on the loop thread only: the any-thread entry points above hand their
  // work over (Submit, RunInLoop) to a method named ...OnLoop, and each file's entry points
  // begin with SWIRL_DCHECK(OnLoopThread()).
  struct WorkItem {
    enum Kind : uint8_t { kNone, kStartCall, kCancelCall, kActivate, kClose, kFunction };
    Kind kind = kNone;
    uint64_t connection_id = 0;
    ClientCall* call = nullptr;
    std::shared_ptr<Connection> connection;
    absl::AnyInvocable<void()> fn;
    absl::Status status;
  };

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

  Worker(std::shared_ptr<verbs::Context> context, std::shared_ptr<verbs::ProtectionDomain> pd,
         const verbs::Capabilities& caps, const WorkerOptions& options, ThreadPool* pool);
  absl::Status Init();
  // Fewer connections when the device's SRQ or CQs cannot hold them all.
  absl::Status FitConnections(uint32_t slack, uint32_t sq_depth);
  uint32_t send_queue_depth() const;

  // ---- The loop (worker.cc) ----
  void Submit(WorkItem item);
  void Loop();
  bool RunOnce();
  // RunOnce out of line, for its cold callers (Stop, SleepUntilWork's last look).
  bool RunOnceCold();
  // RunOnce's poll failed (an overflowed CQ): every connection fails. Out of line and cold, so
  // that its logging's buffers keep -fstack-protector off the loop (base/copy.h).
  [[gnu::cold, gnu::noinline]] void CompletionQueueFailed();
  // Timers(now) if a millisecond has passed since they last ran.
  void TimersIfDue(absl::Time now) {
    if (now < next_timer_) return;
    Timers(now);
    next_timer_ = now + absl::Milliseconds(1);
  }
  void SleepUntilWork();
  // Takes what other threads submitted. Inline: nearly always there is nothing, and the loop
  // and every caller-driven call look (the slow half has a WorkItem's frame to set up).
  bool DrainSubmissions() { return !submissions_.MaybeEmpty() && DrainSubmissionsSlow(); }
  bool DrainSubmissionsSlow();
  void HandleItem(WorkItem& item);
  void ActivateOnLoop(std::shared_ptr<Connection> connection);
  void CancelOnLoop(Connection* c, ClientCall* call);
  void RepostRecvs();
  // Completions come in runs from one QP, and a call usually goes to the connection whose
  // completion was handled last: that one, checked first.
  Connection* FindByQpn(uint32_t qpn) {
    if (last_connection_ != nullptr && qpn == last_connection_->qp_num()) return last_connection_;
    auto it = by_qpn_.find(qpn);
    if (it == by_qpn_.end()) return nullptr;
    last_connection_ = it->second;
    return it->second;
  }
  Connection* FindById(uint64_t id) {
    if (last_connection_ != nullptr && last_connection_->id() == id) return last_connection_;
    auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : it->second.get();
  }

  // ---- Receiving (worker_receive.cc) ----
  void HandleRecv(const ibv_wc& wc);
  // The connection a receive completion names (nullptr: a stray, counted).
  Connection* ReceivingConnection(const ibv_wc& wc);
  // Validates the header and takes the credits: false if the connection failed.
  bool AcceptMessage(Connection* c, const ibv_wc& wc, const rpc_wire::MessageHeader& h);
  // Bulk messages and acks, grants, and anything else that invalidated an rkey.
  void RouteBulk(Connection* c, const rpc_wire::MessageHeader& h, const char* payload,
                 const ibv_wc& wc);
  void Dispatch(Connection* c, const rpc_wire::MessageHeader& h, const char* payload);
  // A second response to a call whose response came with bulk data, while the RDMA READ of
  // that data writes into the call's buffer (CallState::read_op): it would complete the call,
  // handing the buffer back under the device, or post another READ into it. A violation.
  void SecondResponse(Connection* c, uint64_t request_id);
  [[gnu::cold, gnu::noinline]] bool ResponseForNoCall(Connection* c, uint64_t request_id);
  // After a message: credits back if half are owed, and what waited for credits.
  void AfterReceive(Connection* c);
  void HandleSendCompletion(const ibv_wc& wc);

  // ---- Serving (worker_serve.cc) ----
  void DispatchCall(Connection* c, Incoming& in);
  // An eager request or one-way call straight from its receive buffer: DispatchCall in one
  // pass for the common case (the connection's last method again, inline). Inlined into the
  // loop's turn (worker_receive.cc); the rest goes to ServeEagerSlow (DispatchCall) and, for a
  // handler's outcome other than a small OK response, FinishServed (SendHandlerResult).
  void ServeEager(Connection* c, const rpc_wire::MessageHeader& h, const char* payload);
  [[gnu::noinline]] void ServeEagerSlow(Connection* c, const rpc_wire::MessageHeader& h,
                                        const char* payload);
  [[gnu::noinline]] void FinishServed(Connection* c, const rpc_wire::MessageHeader& h,
                                      const char* payload, absl::Status status,
                                      MessageWriter* writer, BulkBuffer& attachment);
  // The method a request names (the last one's, most often), or nullptr after answering why.
  const Service::Method* ResolveMethod(Connection* c, const rpc_wire::MessageHeader& h);
  Service::Invoker* InvokerFor(Connection* c, const Service::Method* method);
  // Sends a handler's outcome (inline or pool): the error, the response in `writer` (eagerly or
  // through a window once it outgrew the eager threshold), or the message with `attachment`
  // (taken from the caller's buffer if it is sent).
  void SendHandlerResult(Connection* c, Incoming& in, absl::Status status, MessageWriter* writer,
                         BulkBuffer& attachment);
  // A request for a blocking handler, on its way to the pool and back.
  struct PoolJob {
    std::shared_ptr<Connection> connection;
    const Service::Method* method = nullptr;
    rpc_wire::MessageHeader header{};
    uint64_t held = 0;  // bytes it holds (request and attachment), charged to its client
    std::string request;
    BulkBuffer attachment;
    std::shared_ptr<std::atomic<bool>> cancelled;
    bool has_chunk = false;
    rpc_wire::BulkDescriptor chunk{};
  };
  void RunOnPool(Connection* c, Incoming& in, const Service::Method* method);
  void RunPoolJob(PoolJob job);  // on a pool thread
  void FinishPoolJob(PoolJob& job, absl::Status status, absl::string_view response,
                     BulkBuffer& bulk);
  // Whether one more blocking handler of `c` holding `held` bytes may queue.
  bool PoolHasRoom(const Connection* c, uint64_t held) const;
  void FinishPoolHandler(Connection* c, const rpc_wire::MessageHeader& header, uint64_t held,
                         const std::shared_ptr<std::atomic<bool>>& cancelled);
  void SendResponse(Connection* c, uint64_t request_id, const absl::Status& status,
                    MessageWriter* writer);
  void SendResponseBytes(Connection* c, uint64_t request_id, const absl::Status& status,
                         absl::string_view payload);
  // The response in `writer` (eager, status `code`) queued: the last step of every served call.
  // Inline (below).
  void EmitResponse(Connection* c, MessageWriter* writer, uint64_t request_id, uint32_t code);

  // ---- Calling (worker_calls.cc) ----
  void StartCallOnLoop(Connection* c, ClientCall* call);
  // `ring_now`: a caller-driven StartCall, which rings the doorbell right after; a request
  // that nothing of its connection waits ahead of is then posted at once (Outbox::QueueAndRing)
  // instead of through the doorbell list. On the loop thread, calls join the turn's doorbell.
  void AdmitAndSend(Connection* c, ClientCall* call, bool ring_now = false);
  // Sends `s` now if credits, a slot and buffers allow: false to leave it in the backlog. True
  // also when it completed instead (refused, or one-way).
  bool TrySendCall(Connection* c, CallState& s, bool ring_now = false);
  // Why `s` cannot be sent as it is (then it completes with that), or OK.
  absl::Status CheckCall(Connection* c, const CallState& s, bool message_in_bulk) const;
  // StartCall's hand-off to the loop thread. Out of line: a WorkItem holds a function in a char
  // buffer, for which -fstack-protector would guard every StartCall (base/copy.h).
  [[gnu::noinline]] void SubmitStartCall(uint64_t connection_id, ClientCall* call);
  // Serializes a large request once, straight into registered memory; a retry reuses it.
  absl::Status SerializeIntoBulk(CallState& s, size_t size);
  bool SendEagerCall(Connection* c, CallState& s, size_t size);
  // SendEagerCall for a message known to fit (Connection::eager_limit()).
  bool QueueEagerCall(Connection* c, CallState& s, size_t size, bool ring_now = false);
  void PumpBacklog(Connection* c);
  void CompleteCall(Connection* c, const rpc_wire::MessageHeader& h, const char* payload);
  // `call` completes OK (clearing a previous round's error, which StartCall leaves):
  // ClientCall::Complete, inline.
  static void CompleteOk(ClientCall* call);
  // Fills the call's response from `message` (protobuf or bytes). Inline, the common case of a
  // steady stream of echoes: a reused string of the same length is overwritten in place.
  [[gnu::always_inline]] static absl::Status ParseResponse(const ClientCall* call,
                                                           absl::string_view message) {
    if (google::protobuf::MessageLite* response = call->response_; response != nullptr) {
      if (response->ParseFromArray(message.data(), static_cast<int>(message.size())))
          [[likely]] {
        return absl::OkStatus();
      }
      return ResponseDoesNotParse();
    }
    std::string* out = call->response_bytes_;
    if (out != nullptr && out->size() == message.size()) {
      CopyBytes(out->data(), message.data(), message.size());
      return absl::OkStatus();
    }
    if (out != nullptr) AssignResponse(out, message);
    return absl::OkStatus();
  }
  [[gnu::cold, gnu::noinline]] static absl::Status ResponseDoesNotParse() {
    return absl::DataLossError("response does not parse");
  }
  // Raw bytes of another length than the string holds (out of line: it may allocate).
  [[gnu::noinline]] static void AssignResponse(std::string* out, absl::string_view message) {
    out->assign(message.data(), message.size());
  }
  // Completes `s`, first revoking any window still exposing its buffers (mirror mode).
  void FinishCall(Connection* c, CallState& s, absl::Status status);
  // Completes `s` now: its state is retired, the call told (with the abandoned status, if it
  // gave up earlier).
  // Inline: the last step of every call.
  void CompleteLocally(Connection* c, CallState& s, absl::Status status) {
    SWIRL_DCHECK(OnLoopThread());
    if (!s.abandoned.ok()) [[unlikely]] {
      status = std::move(s.abandoned);  // the caller gave up: that stands
    }
    ClientCall* call = s.call;
    c->calls().Release(s);
    c->calls().Retire(s);  // before the callback, which may start the call again
    call->Complete(std::move(status));
  }
  // A pending call given up on (cancel, deadline): completes it with `status`, or once the
  // device and the server are done with its buffers (the Defer* below), telling the server
  // either way.
  void GiveUp(Connection* c, CallState& s, absl::Status status);
  // A call that gave up while an RDMA READ into its buffer (download) or an RDMA WRITE from it
  // (upload) is in flight: it completes when that is done, never while the device may still
  // use the buffer.
  bool DeferIfReading(Connection* c, CallState& s, absl::Status status);
  // Mirror mode: a call given up on while the server may still READ its request window or
  // WRITE its reply window. Revoking them now would fail the server's access and with it the
  // connection; instead the call stays pending (no deadline) until the server's ack and
  // response, or the windows' lease, end the exposure, and then completes with `status`.
  bool DeferIfExposing(Connection* c, CallState& s, absl::Status status);
  // Completes an abandoned call (above) once none of its windows is left.
  void FinishIfAbandoned(Connection* c, CallState& s);
  void FailPendingCalls(Connection* c, const absl::Status& why);
  void CallTimers(Connection* c, absl::Time now);

  // ---- Failure, teardown, timers (worker_teardown.cc) ----
  void ProtocolError(Connection* c, const absl::Status& why);
  void FailConnection(Connection* c, const absl::Status& why);
  void FinishClose(Connection* c);
  void Timers(absl::Time now);
  void ConnectionTimers(Connection* c, absl::Time now);
  void CheckLiveness(Connection* c, absl::Time now);

  // ---- Bulk: windows, operations, acks, grants (bulk_windows.cc) ----
  // A free window of `c` (allocated on first use), or -1.
  int32_t AcquireWindow(Connection* c);
  // Binds window `w` over [addr, addr+length) of the pool with `access`, for `purpose` on behalf
  // of `request_id` (0 for grants); returns the new rkey. Every purpose but a grant is leased:
  // this side revokes it if no acknowledgement arrives within window_lease, and a device that
  // keeps leases (the soft device) refuses every access after it by itself.
  uint32_t BindWindow(Connection* c, int32_t w, uint64_t addr, uint32_t length, int access,
                      Window::Purpose purpose, uint64_t request_id);
  // Posts a LOCAL_INV of window `w` for operation `op` (emplaced by the caller), and a plain
  // revocation's op.
  void RevokeWindow(Connection* c, int32_t w, int32_t op);
  int32_t NewRevoke(Connection* c, int32_t w, bool lease_expired);
  void FreeWindow(Connection* c, int32_t w);
  void PostRdma(Connection* c, ibv_wr_opcode opcode, const BulkBuffer& local, uint32_t length,
                uint64_t remote_addr, uint32_t rkey, int32_t op);
  // Checks how a message that ends the exposure of our window `rkey` arrived: true if the
  // peer's SEND_WITH_INV revoked it on delivery, false if this side revokes it (the local
  // fallback); a violation (the connection fails) otherwise: a missing, wrong or unexpected
  // invalidation. `what` names the message for the error.
  std::optional<bool> CheckSeal(Connection* c, const ibv_wc& wc, uint32_t rkey,
                                absl::string_view what);
  void SendBulkAck(Connection* c, uint64_t request_id, uint32_t rkey);
  void HandleBulkAck(Connection* c, const rpc_wire::MessageHeader& h, const ibv_wc& wc);
  void HandleWindowGrant(Connection* c, const rpc_wire::MessageHeader& h, const char* payload);
  void HandleWindowRequest(Connection* c, const rpc_wire::MessageHeader& h);
  void GrantWindows(Connection* c, uint32_t count, uint32_t size);
  // One more upload window of `size` (class `class_size`) into `out`; false if none may be.
  bool GrantOne(Connection* c, uint32_t size, uint32_t class_size, rpc_wire::BulkDescriptor* out);
  void SendOwedGrant(Connection* c);
  void HandleBulkOp(Connection* c, int32_t op, const ibv_wc& wc);
  void CompleteDownload(Connection* c, bulk_op::DownloadRead& o, bool ok);
  void CompleteRevoke(Connection* c, int32_t window, bool lease_expired, bool ok);
  void CompleteRevokeThenComplete(Connection* c, bulk_op::RevokeThenComplete& o, bool ok);
  // Dispatches a request whose bulk data is in `bulk` now.
  void DispatchDeferred(Connection* c, bulk_op::Request& request, BulkBuffer bulk);
  // The QP is in ERR: calls waiting on bulk operations complete now.
  void SettleBulkOps(Connection* c);
  void BulkViolation(Connection* c, const std::string& why);
  void BulkTimers(Connection* c, absl::Time now);
  void ReleaseBulk(Connection* c);
  // Bulk memory held through grants and unacknowledged downloads by all of `c`'s client's
  // connections on this worker, and the change of one of `c`'s counters (granted.bytes,
  // download_bytes) by `delta`, kept in step with it.
  uint64_t ClientBulkBytes(const Connection* c) const;
  void ChargeBulk(Connection* c, uint64_t* counter, int64_t delta);
  // Memory windows allocated for all of `c`'s client's connections on this worker (each holds
  // its windows, bound or free, until it closes), and the change of `c`'s by `delta`.
  uint32_t ClientWindows(const Connection* c) const;
  void ChargeWindows(Connection* c, int32_t delta);

  // ---- Bulk: calls with bulk data (bulk_upload.cc) ----
  bool SendBulkCall(Connection* c, CallState& s, size_t message_size, bool message_in_bulk);
  // Granted uploads (server exposes): RDMA WRITE into a window the peer granted.
  bool SendGrantedUpload(Connection* c, CallState& s, const BulkBuffer& data, uint32_t payload,
                         bool message_in_bulk);
  // Mirror: the request (and reply) buffers exposed through our own windows.
  bool SendMirroredUpload(Connection* c, CallState& s, const BulkBuffer& data, uint32_t payload,
                          bool message_in_bulk, bool chunk);
  // Writes the request (header, `count` descriptors, the eager message) into `msg` and queues
  // it, SEND_WITH_INV of `invalidate` if not 0.
  void QueueBulkRequest(Connection* c, CallState& s, char* msg, int32_t buffer, uint32_t payload,
                        bool message_in_bulk, const rpc_wire::BulkDescriptor* descriptors,
                        uint32_t count, uint32_t invalidate);
  void AskForGrants(Connection* c, uint32_t length);
  void HandleBulkRequest(Connection* c, const rpc_wire::MessageHeader& h, const char* payload,
                         const ibv_wc& wc);
  void ReceiveGrantedUpload(Connection* c, Incoming& in, const rpc_wire::BulkDescriptor& d,
                            const ibv_wc& wc);
  // Whether a mirror READ of `bytes` (a buffer's capacity) fits the connection's and its
  // client's budgets now; else RESOURCE_EXHAUSTED saying which.
  absl::Status MirrorBudget(const Connection* c, uint64_t bytes) const;
  void StartMirrorRead(Connection* c, bulk_op::Request request, const rpc_wire::BulkDescriptor& d,
                       BulkBuffer buffer);
  // Starts the READs of waiting requests that fit now (after one of the connection's mirror
  // buffers was given back).
  void PumpMirrorReads(Connection* c);
  void ReceiveMirroredUpload(Connection* c, Incoming& in, const rpc_wire::BulkDescriptor& d,
                             const ibv_wc& wc);

  // ---- Bulk: responses with bulk data (bulk_download.cc) ----
  void SendBulkResponse(Connection* c, const Incoming& request, MessageWriter* writer,
                        BulkBuffer data, bool is_message);
  // The descriptor of `data`, exposed for the caller to READ (or WRITTEN into its reply
  // window); an error to answer with instead.
  absl::Status ExposeResponse(Connection* c, const Incoming& request, BulkBuffer& data,
                              bool is_message, rpc_wire::BulkDescriptor* d, uint32_t* invalidate);
  void HandleBulkResponse(Connection* c, const rpc_wire::MessageHeader& h, const char* payload,
                          const ibv_wc& wc);
  void ReceiveIntoReplyWindow(Connection* c, CallState& s, const rpc_wire::MessageHeader& h,
                              const rpc_wire::BulkDescriptor& d, absl::string_view eager,
                              const ibv_wc& wc);
  void StartDownload(Connection* c, CallState& s, const rpc_wire::MessageHeader& h,
                     const rpc_wire::BulkDescriptor& d, absl::string_view eager);

  std::shared_ptr<verbs::Context> context_;
  std::shared_ptr<verbs::ProtectionDomain> pd_;
  const verbs::Capabilities caps_;
  WorkerOptions options_;  // max_connections may shrink in Init() to fit the device's SRQ
  ThreadPool* const pool_;

  std::shared_ptr<verbs::CompletionChannel> channel_;
  std::shared_ptr<verbs::CompletionQueue> cq_;
  std::shared_ptr<verbs::SharedReceiveQueue> srq_;
  std::unique_ptr<BufferPool> recv_pool_;
  Outbox outbox_;
  std::shared_ptr<BulkPool> bulk_pool_;
  uint32_t max_inline_ = 0;
  absl::BitGen bitgen_;  // loop thread only: rkey key bytes
  ConnectionCounters totals_;  // bulk counters summed over connections, closed ones included
  std::atomic<uint64_t> windows_exposed_{0};  // written by the loop thread only
  // Loop thread: what each client's connections on this worker hold (ClientBulkBytes,
  // ClientWindows), by Connection::client_key(); entries at zero are erased.
  struct ClientHoldings {
    uint64_t bulk_bytes = 0;
    uint32_t windows = 0;
  };
  absl::flat_hash_map<std::string, ClientHoldings> client_holdings_;
  uint64_t bulk_bytes_per_client_ = 0;  // WorkerOptions::bulk_bytes_per_client, resolved
  // The sum of the clients' bulk_bytes: written by the loop thread only, read by Stats.
  std::atomic<uint64_t> bulk_bytes_charged_{0};
  // Beyond RoCE (BindWindow): the device keeps window leases in its key entries, and draws a
  // fresh key slot per bind; each found out from the device at the first window (a NIC: no).
  bool device_leases_ = false;
  bool fresh_rkeys_ = true;

  MpscQueue<WorkItem> submissions_;
  std::atomic<bool> sleeping_{false};
  int wake_fd_ = -1;
  std::atomic<bool> running_{false};
  std::thread thread_;
  SpinLock driver_;  // held by whoever runs RunOnce

  // Loop state (driver only).
  absl::flat_hash_map<uint32_t, Connection*> by_qpn_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Connection>> by_id_;
  Connection* last_connection_ = nullptr;  // FindByQpn, FindById
  std::vector<uint32_t> repost_;
  // One receive WR and its scatter entry per receive buffer, filled in once (Init): a repost
  // only links the ones going back, instead of writing every field of each.
  std::vector<ibv_recv_wr> recv_wrs_;
  std::vector<ibv_sge> recv_sges_;
  uint32_t recv_posted_ = 0;
  // Turns left before RunOnce looks at the timers (every kTurnsPerTimerLook): a countdown,
  // one decrement and a branch per turn.
  static constexpr uint32_t kTurnsPerTimerLook = 64;
  uint32_t turns_to_timer_look_ = kTurnsPerTimerLook;
  absl::Time next_timer_ = absl::InfinitePast();
  bool draining_ = false;
  std::vector<Connection*> closing_;

  // Shared with the control path.
  mutable swirl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Connection>> registry_ ABSL_GUARDED_BY(mu_);
  uint32_t admitted_ ABSL_GUARDED_BY(mu_) = 0;  // connections created and not yet closed
  // Credits beyond the floors, lent to connections as they need them (rpc/credit_ledger.h).
  CreditPool credit_pool_;
  uint32_t shared_credits_ = 0;  // its size
  uint64_t timer_passes_ = 0;  // Timers: which connections this pass looks at
  // Work under way that a drain waits for (rpc/gate.h); loop thread only. Its end, once a drain
  // began, is announced through drained_.
  Gate work_;
  swirl::Notification drained_;
  std::atomic<uint64_t> protocol_errors_{0};
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> stray_{0};  // completions naming no connection we know
  std::atomic<uint32_t> recv_posted_snapshot_{0};
};

[[gnu::always_inline]] inline void Worker::EmitResponse(Connection* c, MessageWriter* writer,
                                                        uint64_t request_id, uint32_t code) {
  *reinterpret_cast<rpc_wire::MessageHeader*>(writer->data()) = rpc_wire::MessageHeader{
      .version = rpc_wire::kProtocolVersion,
      .type = rpc_wire::kResponse,
      .request_id = request_id,
      .status = code,
      .payload_len = writer->length(),
  };
  char* data = writer->data();
  const int32_t buffer = writer->buffer();
  const uint32_t length = kHeader + writer->length();
  writer->Release();
  Bump(c->counters().responses_sent);
  outbox_.Emit(c, data, length, buffer, 0);
}

}  // namespace swirl::internal

#endif  // SWIRL_RPC_WORKER_H_
