// Client-side calls: options, the call object, and the CallTarget interface that both a Channel
// (client to server) and a server's handle on a client (server to client) implement.
//
// The ways to call, from the generated stubs or the raw API:
//   * synchronous: Status Method(req, &resp, options) blocks the calling thread;
//   * asynchronous with a callback: the callback runs on the connection's worker thread (or on
//     whichever thread drives a caller-driven channel) once the call completes; a call started
//     on a channel or connection that is already closed completes at once, its callback (with
//     UNAVAILABLE) running on the starting thread;
//   * one-way messages (no response): CallOneWay, never waiting, safe from handlers.
// The allocation-free form takes a caller-owned ClientCall that can be reused call after call.
//
// Lifetimes: the request, the response and the ClientCall must stay valid until the call
// completes (the callback has run, or Wait() returned).

#ifndef SWIRL_RPC_CALL_H_
#define SWIRL_RPC_CALL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "swirl/bulk.h"

namespace google::protobuf {
class MessageLite;
}  // namespace google::protobuf

namespace swirl {

class Channel;

namespace internal {
class Worker;
class CallTable;
}  // namespace internal

struct CallOptions {
  // The call fails with DEADLINE_EXCEEDED if no response arrived by then (whichever of the two
  // is earlier). The server is told, best effort, that the caller gave up. While the device or
  // the server still uses the call's buffers (an upload's RDMA WRITE, a download's READ, mirror
  // windows the server has not released), the call completes only once they are done.
  absl::Duration timeout = absl::InfiniteDuration();
  absl::Time deadline = absl::InfiniteFuture();

  // Zero-copy bulk (docs/BULK.md). `request_bulk`: data sent by RDMA alongside the request
  // (from Channel::AllocateBulk; must outlive the call). `response_bulk`: where the response's
  // bulk data lands (capacity must suffice); if unset, the call allocates one (response_bulk()).
  const BulkBuffer* request_bulk = nullptr;
  BulkBuffer* response_bulk = nullptr;

  // Started while the channel has no connection (it is reconnecting): false, the call fails at
  // once with UNAVAILABLE; true, it waits for the connection, failing with DEADLINE_EXCEEDED
  // if its deadline passes first (gRPC's wait-for-ready). A call already sent when the
  // connection fails gets UNAVAILABLE either way (it may have run on the server). On a
  // caller-driven channel the starting thread waits (never on its worker's loop thread: that
  // call fails with UNAVAILABLE); on a background-driven one the call waits asynchronously.
  // Cancel() of a waiting call takes effect when it would start, or at its deadline.
  bool wait_for_ready = false;

  absl::Time EffectiveDeadline() const;
};

// One call. Caller-owned, reusable once done().
class ClientCall {
 public:
  ClientCall() = default;
  ~ClientCall();
  ClientCall(const ClientCall&) = delete;
  ClientCall& operator=(const ClientCall&) = delete;

  // Blocks until the call completes and returns its status. On a caller-driven channel the
  // waiting thread drives the connection's worker meanwhile. Must not be called (nor may a
  // call still in flight be destroyed) on the thread running that worker's loop, i.e. from a
  // handler or callback of the same worker: the call could never complete, so the process
  // aborts with a message rather than hang. Use the asynchronous forms there.
  absl::Status Wait();
  bool done() const;
  // Valid once done().
  const absl::Status& status() const { return status_; }

  // Completes the call with CANCELLED if it has not completed yet (thread-safe, best effort
  // toward the server: a response that arrives later is dropped). As with deadlines, the call
  // completes only once the device and the server are done with its buffers.
  void Cancel();

  // ---- Set up by stubs (or by hand for the raw API) before CallTarget::Start ------------------
  void SetMethod(uint32_t method_id) { method_id_ = method_id; }
  void SetRequest(const google::protobuf::MessageLite* request) { request_ = request; }
  void SetRequestBytes(absl::string_view bytes) {
    request_ = nullptr;
    request_bytes_ = bytes;
  }
  // Where the response goes: a message to parse into, or a string for raw bytes (or neither:
  // the payload is ignored).
  void SetResponse(google::protobuf::MessageLite* response) { response_ = response; }
  void SetResponseBytes(std::string* bytes) { response_bytes_ = bytes; }
  void SetOneWay(bool one_way) { one_way_ = one_way; }
  void SetOptions(const CallOptions& options) {
    deadline_ = options.EffectiveDeadline();
    request_bulk_ = options.request_bulk;
    response_bulk_ = options.response_bulk;
    wait_for_ready_ = options.wait_for_ready;
  }
  // The response's bulk data when CallOptions::response_bulk was not given (else empty).
  BulkBuffer& response_bulk() { return owned_response_bulk_; }
  // Runs on completion (on the worker thread; see the top of this file). Optional.
  void SetCallback(absl::AnyInvocable<void(absl::Status)> callback) {
    callback_ = std::move(callback);
  }

 private:
  friend class internal::Worker;
  friend class internal::CallTable;
  friend class Channel;  // parks calls that wait for a connection (CallOptions::wait_for_ready)

  enum State : int { kIdle = 0, kQueued, kPending, kDone };

  // Called by the worker exactly once per round.
  void Complete(absl::Status status);
  [[gnu::noinline]] void CompleteWithCallback();  // Complete's path for a call with a callback

  uint32_t method_id_ = 0;
  const google::protobuf::MessageLite* request_ = nullptr;
  absl::string_view request_bytes_;
  google::protobuf::MessageLite* response_ = nullptr;
  std::string* response_bytes_ = nullptr;
  bool one_way_ = false;
  absl::Time deadline_ = absl::InfiniteFuture();
  absl::AnyInvocable<void(absl::Status)> callback_;

  std::atomic<int> state_{kIdle};
  std::atomic<bool> cancel_requested_{false};
  absl::Status status_;
  // Completion, for Wait(): a NotifierWord (base/notifier.h), armed by the worker each round.
  std::atomic<uint32_t> completion_{0};
  const BulkBuffer* request_bulk_ = nullptr;
  BulkBuffer* response_bulk_ = nullptr;
  bool wait_for_ready_ = false;
  BulkBuffer owned_response_bulk_;
  // Where the call was started. What the worker keeps of it while it runs lives in the
  // connection's call table (rpc/call_table.h), at state_index_.
  internal::Worker* worker_ = nullptr;
  uint64_t connection_id_ = 0;
  uint32_t state_index_ = 0;
};

// Something calls can be started on.
class CallTarget {
 public:
  virtual ~CallTarget() = default;
  // Starts `call`. Completion (success or failure, e.g. UNAVAILABLE on a dead connection) is
  // always reported through the call; Start itself never fails.
  virtual void Start(ClientCall* call) = 0;
};

// Synchronous helpers used by generated stubs and the raw API.
absl::Status CallUnary(CallTarget& target, uint32_t method_id,
                       const google::protobuf::MessageLite& request,
                       google::protobuf::MessageLite* response, const CallOptions& options);
absl::Status CallRaw(CallTarget& target, uint32_t method_id, absl::string_view request,
                     std::string* response, const CallOptions& options);
// A one-way message that never waits: safe from a handler or a callback on the connection's
// own worker thread (ServerContext::caller()), where waiting would wait for itself. The call
// owns `request` until the message is sent. Returns the call's status if it settled during
// this function (sent, or refused: UNAVAILABLE, RESOURCE_EXHAUSTED), else OK (it is queued
// behind credits and goes out, or fails, later).
absl::Status CallOneWay(CallTarget& target, uint32_t method_id,
                        std::unique_ptr<const google::protobuf::MessageLite> request,
                        const CallOptions& options);

}  // namespace swirl

#endif  // SWIRL_RPC_CALL_H_
