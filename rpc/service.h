// Server-side API: services and their methods, as the generated code and embedders see them.
//
// A Service is a named set of methods. Generated code (protoc-gen-swirl) derives from it and
// registers typed unary methods; embedders with their own encoding add raw-bytes methods. The
// same Service can be offered by a Server to its clients, or by a Channel to the server at the
// other end (server-to-client calls).
//
// Where handlers run: on the connection's worker thread by default (run to completion, so keep
// them short and never block), or, on a Server, on its handler thread pool for methods marked
// Execution::kThreadPool (proto option `(swirl.blocking) = true`). A Channel has no handler
// pool: every method of a service it offers runs on its worker, so such services must not block.

#ifndef SWIRL_RPC_SERVICE_H_
#define SWIRL_RPC_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "swirl/bulk.h"
#include "swirl/call.h"

namespace google::protobuf {
class MessageLite;
}  // namespace google::protobuf

namespace swirl {

namespace internal {
class Connection;
class Worker;
class MethodTable;
struct ServerContextAccess;
}  // namespace internal

enum class Execution { kWorker, kThreadPool };

struct MethodOptions {
  Execution execution = Execution::kWorker;
  // The handler's result is never sent. A caller that waits for a response (a request instead
  // of a one-way message) gets INVALID_ARGUMENT without the handler running.
  bool one_way = false;
};

// Per-call context for handlers.
class ServerContext {
 public:
  // True once the caller cancelled or gave up (deadline), as far as this side has heard, or the
  // connection is gone (failed, closed, or the server shut down): nobody will get the result.
  bool IsCancelled() const;
  uint64_t connection_id() const;
  const std::string& peer() const;
  // Who the caller authenticated as: the name of the ServerOptions::principals entry its
  // credentials matched when it connected ("default" for ServerOptions::auth_token), or "" when
  // the server authenticates no one, and on a Channel's side of a connection (a server is not a
  // principal). Fixed for the connection's life: settled at Connect, not per call, so a handler
  // can authorise with it (compare it; never parse it for rights).
  const std::string& principal() const;
  // The other end of this call's connection, to call it back over the same connection.
  // Calls fail with UNAVAILABLE once the connection is gone.
  std::shared_ptr<CallTarget> caller() const;

  // Bulk data that came with the request (already in registered memory, its window already
  // revoked), or nullptr. Valid during the handler; a handler may move it out.
  BulkBuffer* request_bulk() {
    return request_bulk_.has_value() && request_bulk_->data() ? &*request_bulk_ : nullptr;
  }
  // Registered memory for bulk data to send with the response (zero copy: fill it directly).
  // It goes out if the handler returns OK. At most one per call.
  absl::StatusOr<BulkBuffer*> AllocateResponseBulk(size_t size);

 private:
  // Made by the worker that runs the handler (rpc/server_context_access.h).
  friend struct internal::ServerContextAccess;
  ServerContext(internal::Connection* connection, const std::atomic<bool>* cancelled)
      : connection_(connection), cancelled_(cancelled) {}

  internal::Connection* connection_;
  const std::atomic<bool>* cancelled_;
  // Made only when there is one: most calls carry no bulk data, and an empty BulkBuffer made
  // and destroyed for each of them costs more than a flag.
  std::optional<BulkBuffer> request_bulk_;
  std::optional<BulkBuffer> response_bulk_;
};

// Where a handler writes its response bytes: straight into the message that will be sent.
// Reserve and Commit are inline while the bytes fit the space at hand (every small response);
// the writer's ReserveSlow and CommitSlow take the rest.
class ResponseWriter {
 public:
  virtual ~ResponseWriter() = default;
  // Contiguous space for `size` bytes, or nullptr if the response would exceed the largest
  // response the connection can carry: the negotiated maximum bulk size when the connection has
  // bulk transfers (a response above the eager threshold leaves through a window), else the
  // negotiated maximum message size. Call Commit afterwards with the bytes actually written,
  // at most `size`.
  char* Reserve(size_t size) {
    if (size < room_) [[likely]] return cursor_;
    return ReserveSlow(size);
  }
  void Commit(size_t size) {
    if (size < room_) [[likely]] {
      cursor_ += size;
      room_ -= size;
      return;
    }
    CommitSlow(size);
  }
  // Convenience: Reserve + copy + Commit. False if too large. Inline: a raw handler's whole
  // response is usually one Append.
  bool Append(absl::string_view bytes) {
    char* p = Reserve(bytes.size());
    if (p == nullptr) return false;
    if (!bytes.empty()) std::memcpy(p, bytes.data(), bytes.size());
    Commit(bytes.size());
    return true;
  }

 protected:
  // The space at hand: the next byte goes to cursor_, and room_ is one more than the bytes that
  // fit there (0 while there is none, so that even Reserve(0) takes ReserveSlow then).
  char* cursor_ = nullptr;
  size_t room_ = 0;

 private:
  virtual char* ReserveSlow(size_t size) = 0;
  // A Commit of `size` >= room_: of more than the last Reserve gave, or with nothing reserved.
  virtual void CommitSlow(size_t size) = 0;
};

class Service {
 public:
  // A raw method: request bytes in, response bytes out through `response`.
  using RawHandler =
      absl::AnyInvocable<absl::Status(ServerContext&, absl::string_view, ResponseWriter&)>;

  // `full_name` is the fully qualified service name, e.g. "swirl.examples.Echo".
  explicit Service(std::string full_name);
  virtual ~Service();
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  const std::string& full_name() const { return full_name_; }

  // Adds a raw-bytes method. Its wire name is "/<service>/<method_name>".
  void AddRawMethod(const std::string& method_name, RawHandler handler,
                    MethodOptions options = {});
  // Moves a method to the thread pool (or back) before the service is registered.
  void SetExecution(const std::string& method_name, Execution execution);

  // ---- For generated code ---------------------------------------------------------------------
  // A reusable invocation context (request/response objects) so that steady state allocates
  // nothing: one per connection on a worker, one per pool thread for blocking methods.
  class Invoker {
   public:
    virtual ~Invoker() = default;
    virtual absl::Status Invoke(ServerContext& ctx, absl::string_view request,
                                ResponseWriter& response) = 0;
    // A raw method's handler, which a worker may call directly instead of Invoke (one
    // indirect call per request instead of two); null for any other invoker. Asked once per
    // method a connection calls, not per request.
    virtual RawHandler* raw_handler() { return nullptr; }
  };
  struct Method {
    std::string full_name;  // "/pkg.Service/Method"
    uint32_t id = 0;
    MethodOptions options;
    // Makes a fresh Invoker (one per connection / pool thread).
    absl::AnyInvocable<std::unique_ptr<Invoker>()> new_invoker;
  };
  void AddMethod(const std::string& method_name, MethodOptions options,
                 absl::AnyInvocable<std::unique_ptr<Invoker>()> new_invoker);
  const std::vector<std::unique_ptr<Method>>& methods() const { return methods_; }

  // Typed unary method on protobuf messages: parse, call, serialize, reusing the request and
  // response objects (per connection, or per pool thread).
  template <typename Request, typename Response, typename Handler>
  void AddUnaryMethod(const std::string& method_name, Handler handler,
                      MethodOptions options = {}) {
    auto shared = std::make_shared<Handler>(std::move(handler));
    AddMethod(method_name, options, [shared]() -> std::unique_ptr<Invoker> {
      return std::make_unique<TypedInvoker<Request, Response, Handler>>(shared);
    });
  }

 private:
  template <typename Request, typename Response, typename Handler>
  class TypedInvoker final : public Invoker {
   public:
    explicit TypedInvoker(std::shared_ptr<Handler> handler) : handler_(std::move(handler)) {}
    absl::Status Invoke(ServerContext& ctx, absl::string_view request,
                        ResponseWriter& writer) override {
      // ParseFromArray clears the message first.
      if (!request_.ParseFromArray(request.data(), static_cast<int>(request.size()))) {
        return absl::InvalidArgumentError("request does not parse");
      }
      response_.Clear();
      absl::Status status = (*handler_)(ctx, request_, &response_);
      if (!status.ok()) return status;
      // Here, not through a MessageLite&: on the generated (final) class, ByteSizeLong is a
      // direct call.
      const size_t size = response_.ByteSizeLong();
      char* p = writer.Reserve(size);
      if (p == nullptr) return ResponseTooLarge(size);
      response_.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(p));
      writer.Commit(size);
      return absl::OkStatus();
    }

   private:
    std::shared_ptr<Handler> handler_;
    Request request_;
    Response response_;
  };

  // A response beyond the message size limit (out of line and cold: formatting holds char
  // buffers, for which -fstack-protector would guard every Invoke; base/copy.h says why).
  [[gnu::cold, gnu::noinline]] static absl::Status ResponseTooLarge(size_t size);

  std::string full_name_;
  std::vector<std::unique_ptr<Method>> methods_;
};

}  // namespace swirl

#endif  // SWIRL_RPC_SERVICE_H_
