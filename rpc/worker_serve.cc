// The worker's server role: requests are dispatched to their method's handler, inline on the
// loop thread or on the blocking pool, and its outcome is sent back (eagerly, or through a
// window for a response above the eager threshold or with an attachment).

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/check.h"
#include "rpc/server_context_access.h"
#include "rpc/worker.h"
#include "rpc/writer.h"

namespace swirl::internal {
namespace {

using rpc_wire::MessageHeader;


// Response bytes produced on a pool thread.
// Response bytes produced on a pool thread. No inline space (room_ stays 0): every Reserve and
// Commit comes here.
class StringWriter final : public ResponseWriter {
 public:
  explicit StringWriter(size_t max) : max_(max) {}
  std::string Take() { return std::move(data_); }

 private:
  char* ReserveSlow(size_t size) override {
    if (data_.size() + size > max_) return nullptr;
    reserved_ = data_.size();
    data_.resize(data_.size() + size);
    return data_.data() + reserved_;
  }
  void CommitSlow(size_t size) override {
    data_.resize(std::min(reserved_ + size, data_.size()));  // never more than reserved
  }

  size_t max_;
  size_t reserved_ = 0;
  std::string data_;
};

}  // namespace

const Service::Method* Worker::ResolveMethod(Connection* c, const MessageHeader& h) {
  ServeState& serving = c->serving;
  const Service::Method* method = serving.last_method;
  if (h.method_id != serving.last_method_id || method == nullptr) {
    method = c->methods() ? c->methods()->Find(h.method_id) : nullptr;
    serving.last_method_id = h.method_id;
    serving.last_method = method;
    serving.last_invoker = nullptr;
    serving.inline_invoker = nullptr;
    serving.inline_raw = nullptr;
  }
  const bool one_way = h.type == rpc_wire::kOneWay;
  if (method == nullptr) {
    if (!one_way) {
      SendResponseBytes(
          c, h.request_id,
          absl::UnimplementedError(absl::StrFormat("no method with id 0x%08x", h.method_id)), {});
    }
    return nullptr;
  }
  if (method->options.one_way && !one_way) {
    // Its handler produces no response, so the caller would wait for nothing.
    SendResponseBytes(c, h.request_id,
                      absl::InvalidArgumentError(absl::StrFormat(
                          "method 0x%08x is one-way: call it without waiting for a response",
                          h.method_id)),
                      {});
    return nullptr;
  }
  return method;
}

Service::Invoker* Worker::InvokerFor(Connection* c, const Service::Method* method) {
  ServeState& serving = c->serving;
  if (serving.last_invoker == nullptr) {
    std::unique_ptr<Service::Invoker>& slot = serving.invokers[method];
    if (slot == nullptr) slot = const_cast<Service::Method*>(method)->new_invoker();
    serving.last_invoker = slot.get();
    // InvokerFor runs for methods on the worker only (pool methods have their threads' own).
    serving.inline_invoker = method->options.one_way ? nullptr : serving.last_invoker;
    serving.inline_raw =
        serving.inline_invoker != nullptr ? serving.inline_invoker->raw_handler() : nullptr;
  }
  return serving.last_invoker;
}

void Worker::DispatchCall(Connection* c, Incoming& in) {
  SWIRL_DCHECK(OnLoopThread());
  const MessageHeader& h = in.header;
  Bump(c->counters().requests_received);
  Bump(requests_);
  const bool one_way = h.type == rpc_wire::kOneWay;
  if ((draining_ && !in.admitted) || !c->active()) {
    if (!one_way) {
      SendResponseBytes(c, h.request_id, absl::UnavailableError("server is shutting down"), {});
    }
    return;
  }
  const Service::Method* method = ResolveMethod(c, h);
  if (method == nullptr) return;
  if (method->options.execution == Execution::kThreadPool && pool_ != nullptr) {
    RunOnPool(c, in, method);
    return;
  }
  Service::Invoker* invoker = InvokerFor(c, method);
  // A message carried in bulk is parsed straight out of registered memory.
  BulkBuffer message_holder;
  absl::string_view message = in.eager;
  ServerContext ctx = ServerContextAccess::Make(c, nullptr);
  if (h.aux & rpc_wire::kAuxBulkIsMessage) {
    message_holder = std::move(in.bulk);
    message = message_holder.view();
  } else if (in.bulk) {
    ServerContextAccess::request_bulk(ctx) = std::move(in.bulk);
  }
  MessageWriter writer(&outbox_, bulk_pool_.get(), c);
  absl::Status status = invoker->Invoke(ctx, message, writer);
  if (one_way) {
    writer.Abandon();
    return;
  }
  SendHandlerResult(c, in, std::move(status), &writer, ServerContextAccess::response_bulk(ctx));
}

void Worker::ServeEagerSlow(Connection* c, const MessageHeader& h, const char* payload) {
  Incoming in;
  in.header = h;
  in.eager = absl::string_view(payload, h.payload_len);
  DispatchCall(c, in);
}

void Worker::FinishServed(Connection* c, const MessageHeader& h, const char* payload,
                          absl::Status status, MessageWriter* writer, BulkBuffer& attachment) {
  Incoming in;
  in.header = h;
  in.eager = absl::string_view(payload, h.payload_len);
  SendHandlerResult(c, in, std::move(status), writer, attachment);
}

void Worker::SendHandlerResult(Connection* c, Incoming& in, absl::Status status,
                               MessageWriter* writer, BulkBuffer& attachment) {
  if (attachment && attachment.size() == 0) attachment.Release();  // empty: no attachment
  if (status.ok() && writer->in_bulk() && attachment) {
    // One descriptor per response: the attachment's. The message must then travel eagerly.
    writer->Abandon();
    attachment.Release();
    status = absl::ResourceExhaustedError(absl::StrFormat(
        "a response with a bulk attachment must keep its message within the eager threshold "
        "(%u bytes)",
        c->negotiated().eager_threshold()));
  }
  if (status.ok() && writer->in_bulk()) {
    SendBulkResponse(c, in, writer, writer->TakeBulk(), /*is_message=*/true);
  } else if (status.ok() && attachment) {
    SendBulkResponse(c, in, writer, std::move(attachment), /*is_message=*/false);
  } else {
    SendResponse(c, in.header.request_id, status, writer);
  }
}

bool Worker::PoolHasRoom(const Connection* c, uint64_t held) const {
  // Queued blocking handlers hold their request and attachment until a pool thread gets to
  // them, and the peer has its credits back at once: without a bound, one peer could queue
  // without end (one-way calls take no call slot) or pin the bulk pool through attachments.
  const ServeState& serving = c->serving;
  if (serving.pool_handlers >= 2 * c->credits().local_grant()) return false;
  return serving.pool_handlers == 0 ||
         (serving.pool_bytes + held <= options_.grant_bytes_per_connection &&
          ClientBulkBytes(c) + held <= bulk_bytes_per_client_);
}

void Worker::RunOnPool(Connection* c, Incoming& in, const Service::Method* method) {
  const MessageHeader& h = in.header;
  const bool one_way = h.type == rpc_wire::kOneWay;
  const uint64_t held = in.eager.size() + in.bulk.capacity();
  if (!PoolHasRoom(c, held)) {
    if (!one_way) {
      SendResponseBytes(c, h.request_id,
                        absl::ResourceExhaustedError(absl::StrFormat(
                            "%u blocking calls (%u bytes) of this connection wait for the "
                            "handler pool already",
                            c->serving.pool_handlers, c->serving.pool_bytes)),
                        {});
    }
    return;  // the attachment, if any, goes back to the pool with `in`
  }
  ++c->serving.pool_handlers;
  work_.Enter();  // a drain waits for it
  // Counted against the client too (bulk_bytes_per_client), until the handler is done: even
  // past the connection's end, as the handler still holds the memory.
  ChargeBulk(c, &c->serving.pool_bytes, static_cast<int64_t>(held));
  PoolJob job{c->shared_from_this(), method, h, held};
  job.cancelled = std::make_shared<std::atomic<bool>>(false);
  if (one_way) {
    c->serving.running_one_way.push_back(job.cancelled);
  } else {
    c->serving.running[h.request_id] = job.cancelled;
  }
  // The pool path copies the (eager) message: blocking handlers are not the zero-copy path.
  if (h.aux & rpc_wire::kAuxBulkIsMessage) {
    job.request = std::string(in.bulk.view());
    in.bulk.Release();
  } else {
    job.request = std::string(in.eager);
    job.attachment = std::move(in.bulk);
  }
  job.has_chunk = in.has_chunk;
  job.chunk = in.chunk;
  pool_->Schedule([this, job = std::move(job)]() mutable { RunPoolJob(std::move(job)); });
}

void Worker::RunPoolJob(PoolJob job) {
  // On a pool thread: each has its own invokers.
  thread_local absl::flat_hash_map<const Service::Method*, std::unique_ptr<Service::Invoker>>
      invokers;
  std::unique_ptr<Service::Invoker>& invoker = invokers[job.method];
  if (invoker == nullptr) invoker = const_cast<Service::Method*>(job.method)->new_invoker();
  Connection* c = job.connection.get();
  ServerContext ctx = ServerContextAccess::Make(c, job.cancelled.get());
  ServerContextAccess::request_bulk(ctx) = std::move(job.attachment);
  StringWriter writer(c->negotiated().max_bulk_size() > 0 ? c->negotiated().max_bulk_size()
                                                          : c->max_payload());
  absl::Status status = invoker->Invoke(ctx, job.request, writer);
  RunInLoop([this, job = std::move(job), status = std::move(status), response = writer.Take(),
             bulk = std::move(ServerContextAccess::response_bulk(ctx))]() mutable {
    FinishPoolJob(job, std::move(status), response, bulk);
  });
}

void Worker::FinishPoolJob(PoolJob& job, absl::Status status, absl::string_view response,
                           BulkBuffer& bulk) {
  SWIRL_DCHECK(OnLoopThread());
  Connection* c = job.connection.get();
  FinishPoolHandler(c, job.header, job.held, job.cancelled);
  if (job.header.type == rpc_wire::kOneWay || c->closing()) return;
  Incoming in;
  in.header = job.header;
  in.has_chunk = job.has_chunk;
  in.chunk = job.chunk;
  // From here as an inline handler's result: the writer moves a response above the eager
  // threshold into bulk memory by itself.
  MessageWriter writer(&outbox_, bulk_pool_.get(), c);
  if (status.ok() && !writer.Append(response)) {
    status = absl::ResourceExhaustedError("response exceeds the maximum message size");
  }
  SendHandlerResult(c, in, std::move(status), &writer, bulk);
}

void Worker::FinishPoolHandler(Connection* c, const MessageHeader& header, uint64_t held,
                               const std::shared_ptr<std::atomic<bool>>& cancelled) {
  SWIRL_DCHECK(OnLoopThread());
  ServeState& serving = c->serving;
  --serving.pool_handlers;
  work_.Leave();
  ChargeBulk(c, &serving.pool_bytes, -static_cast<int64_t>(held));
  if (header.type == rpc_wire::kOneWay) {
    auto& list = serving.running_one_way;
    if (auto it = std::find(list.begin(), list.end(), cancelled); it != list.end()) {
      list.erase(it);
    }
  } else {
    serving.running.erase(header.request_id);
  }
}

void Worker::SendResponse(Connection* c, uint64_t request_id, const absl::Status& status,
                          MessageWriter* writer) {
  if (!status.ok() || writer->data() == nullptr) {
    writer->Abandon();
    SendResponseBytes(c, request_id, status, {});
    return;
  }
  EmitResponse(c, writer, request_id, 0);
}

void Worker::SendResponseBytes(Connection* c, uint64_t request_id, const absl::Status& status,
                               absl::string_view payload) {
  // An error response carries the status message as its payload.
  absl::string_view body = status.ok() ? payload : status.message();
  const size_t n = std::min<size_t>(body.size(), c->max_payload());
  MessageWriter writer(&outbox_, bulk_pool_.get(), c);
  char* p = writer.Reserve(n);
  if (p == nullptr) {
    FailConnection(c, absl::ResourceExhaustedError("send buffers exhausted"));
    return;
  }
  if (n > 0) std::memcpy(p, body.data(), n);  // an empty body may have no data() at all
  writer.Commit(n);
  if (status.ok() && n < body.size()) {
    writer.Abandon();
    SendResponseBytes(c, request_id,
                      absl::ResourceExhaustedError("response exceeds the maximum message size"),
                      {});
    return;
  }
  EmitResponse(c, &writer, request_id, static_cast<uint32_t>(status.code()));
}

}  // namespace swirl::internal

namespace swirl {

bool ServerContext::IsCancelled() const {
  return cancelled_ != nullptr && cancelled_->load(std::memory_order_acquire);
}
uint64_t ServerContext::connection_id() const { return connection_->id(); }
const std::string& ServerContext::peer() const { return connection_->peer(); }
const std::string& ServerContext::principal() const {
  static const std::string* const kNone = new std::string();
  return connection_ == nullptr ? *kNone : connection_->principal();
}
std::shared_ptr<CallTarget> ServerContext::caller() const { return connection_->AsCallTarget(); }

absl::StatusOr<BulkBuffer*> ServerContext::AllocateResponseBulk(size_t size) {
  const std::shared_ptr<internal::BulkPool>& pool = connection_->worker()->bulk_pool();
  if (pool == nullptr) return absl::FailedPreconditionError("this server has no bulk pool");
  if (size > connection_->negotiated().max_bulk_size()) {
    return absl::ResourceExhaustedError(absl::StrCat("bulk response of ", size,
                                                     " bytes exceeds the negotiated maximum ",
                                                     connection_->negotiated().max_bulk_size()));
  }
  auto buffer = pool->Allocate(size);
  if (!buffer.ok()) return buffer.status();
  response_bulk_ = std::move(*buffer);
  return &*response_bulk_;
}

}  // namespace swirl
