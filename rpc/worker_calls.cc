// The worker's client role: calls are admitted to their connection's call table, sent when a
// credit and a slot allow (else they wait in its backlog, in order), completed by their
// response, and given up on (cancel, deadline) only once neither the device nor the server
// uses their buffers any more.

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/check.h"
#include "base/copy.h"
#include "base/notifier.h"
#include "google/protobuf/message_lite.h"
#include "rpc/worker.h"

namespace swirl::internal {
namespace {

using rpc_wire::MessageHeader;

// The refusals on the caller's path are built out of line: formatting holds char buffers, for
// which -fstack-protector would guard StartCall itself (base/copy.h says why that matters).
[[gnu::cold, gnu::noinline]] absl::Status ConnectionClosed(const Connection* c) {
  return absl::UnavailableError(
      c != nullptr && !c->close_reason().ok()
          ? absl::StrCat("connection closed: ", c->close_reason().message())
          : "connection closed");
}

[[gnu::cold, gnu::noinline]] absl::Status BulkRefused(bool one_way, uint32_t eager_threshold) {
  return absl::InvalidArgumentError(
      one_way ? "one-way calls cannot carry bulk data"
              : absl::StrFormat("a request with a bulk attachment must keep its message "
                                "within the eager threshold (%u bytes)",
                                eager_threshold));
}

[[gnu::cold, gnu::noinline]] absl::Status RequestTooLarge(size_t size, uint32_t max_payload) {
  return absl::ResourceExhaustedError(absl::StrFormat(
      "request of %u bytes exceeds the %u-byte maximum message size", size, max_payload));
}

}  // namespace

// Inlined into StartCall: the caller's half of a call is one function.
[[gnu::always_inline]] inline void Worker::AdmitAndSend(Connection* c, ClientCall* call,
                                                        bool ring_now) {
  SWIRL_DCHECK(OnLoopThread());
  if (c == nullptr || !c->active()) {
    call->Complete(ConnectionClosed(c));
    return;
  }
  CallState& s = c->calls().Admit(call);
  if (c->calls().backlog_empty() && TrySendCall(c, s, ring_now)) return;
  c->calls().PushBack(s);
}

[[gnu::always_inline]] inline absl::Status Worker::CheckCall(Connection* c, const CallState& s,
                                                             bool message_in_bulk) const {
  const ClientCall* call = s.call;
  if (call->request_bulk_ != nullptr && (message_in_bulk || call->one_way_)) {
    return BulkRefused(call->one_way_, c->negotiated().eager_threshold());
  }
  const BulkBuffer* out = call->response_bulk_;
  if (out != nullptr && *out &&
      (bulk_pool_ == nullptr || !bulk_pool_->Contains(out->data(), out->capacity()))) {
    return absl::InvalidArgumentError("response_bulk must come from this channel's AllocateBulk");
  }
  return absl::OkStatus();
}

absl::Status Worker::SerializeIntoBulk(CallState& s, size_t size) {
  if (s.scratch) return absl::OkStatus();  // a retry: serialized already
  auto scratch = bulk_pool_->Allocate(size);
  if (!scratch.ok()) return scratch.status();
  s.scratch = std::move(*scratch);
  const ClientCall* call = s.call;
  if (call->request_ != nullptr) {
    call->request_->SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(s.scratch.data()));
  } else {
    std::memcpy(s.scratch.data(), call->request_bytes_.data(), size);
  }
  return absl::OkStatus();
}

[[gnu::always_inline]] inline bool Worker::SendEagerCall(Connection* c, CallState& s,
                                                        size_t size) {
  if (size > c->max_payload()) {
    FinishCall(c, s, RequestTooLarge(size, c->max_payload()));
    return true;
  }
  return QueueEagerCall(c, s, size);
}

[[gnu::always_inline]] inline bool Worker::QueueEagerCall(Connection* c, CallState& s,
                                                         size_t size, bool ring_now) {
  ClientCall* call = s.call;
  int32_t buffer;
  char* data = outbox_.Alloc(static_cast<uint32_t>(kHeader + size), &buffer);
  if (data == nullptr) return false;
  const bool one_way = call->one_way_;
  // Field by field, every field once (credits: Queue), instead of zeroing the header first.
  auto* header = reinterpret_cast<MessageHeader*>(data);
  header->version = rpc_wire::kProtocolVersion;
  header->type = static_cast<uint8_t>(one_way ? rpc_wire::kOneWay : rpc_wire::kRequest);
  header->flags = 0;
  header->method_id = call->method_id_;
  header->request_id = one_way ? 0 : c->calls().Allocate(s);
  header->status = 0;
  header->payload_len = static_cast<uint32_t>(size);
  header->aux = 0;
  if (call->request_ != nullptr) {
    call->request_->SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(data + kHeader));
  } else {
    CopyBytes(data + kHeader, call->request_bytes_.data(), size);
  }
  // Pending before the doorbell: if queueing rings it and the post fails, the connection fails
  // and completes the call, which must not be marked pending after that.
  if (!one_way) call->state_.store(ClientCall::kPending, std::memory_order_relaxed);
  if (ring_now) {
    outbox_.QueueAndRing(c, data, static_cast<uint32_t>(kHeader + size), buffer);
  } else {
    outbox_.Queue(c, data, static_cast<uint32_t>(kHeader + size), buffer);
  }
  Bump(c->counters().requests_sent);
  if (one_way) {
    CompleteLocally(c, s, c->closing() ? absl::UnavailableError("connection lost")
                                       : absl::OkStatus());
  }
  return true;
}

// Inlined into its two callers (the caller's half of a call, and the backlog pump): the
// call's own prologue and epilogue were a tenth of the client's RPC instructions.
[[gnu::always_inline]] inline bool Worker::TrySendCall(Connection* c, CallState& s,
                                                      bool ring_now) {
  if (!c->credits().CanSendCall()) return false;
  const ClientCall* call = s.call;
  if (!call->one_way_ && c->calls().full()) return false;
  const size_t size =
      call->request_ != nullptr ? call->request_->ByteSizeLong() : call->request_bytes_.size();
  // The common case in one test: no bulk buffer of the caller's, and a message that travels
  // eagerly (within the eager threshold where bulk is possible, else the message size limit).
  if (call->request_bulk_ == nullptr && call->response_bulk_ == nullptr &&
      size <= c->eager_limit()) [[likely]] {
    return QueueEagerCall(c, s, size, ring_now);
  }
  const bool message_in_bulk = size > c->negotiated().eager_threshold() &&
                               bulk_pool_ != nullptr && c->negotiated().max_bulk_size() > 0;
  if (absl::Status refused = CheckCall(c, s, message_in_bulk); !refused.ok()) {
    FinishCall(c, s, std::move(refused));
    return true;
  }
  if ((message_in_bulk || call->request_bulk_ != nullptr) && !call->one_way_) {
    if (message_in_bulk) {
      if (absl::Status serialized = SerializeIntoBulk(s, size); !serialized.ok()) {
        FinishCall(c, s, std::move(serialized));
        return true;
      }
    }
    return SendBulkCall(c, s, size, message_in_bulk);
  }
  return SendEagerCall(c, s, size);
}


void Worker::StartCallOnLoop(Connection* c, ClientCall* call) { AdmitAndSend(c, call); }

void Worker::StartCall(uint64_t connection_id, ClientCall* call) {
  call->worker_ = this;
  call->connection_id_ = connection_id;
  // status_ is left as it is: valid only once done() (call.h), and every completion sets it
  // (Complete assigns it, CompleteOk clears a previous round's error).
  call->cancel_requested_.store(false, std::memory_order_relaxed);
  NotifierWord::Reset(call->completion_);
  // Release: a Cancel() that sees this round's state also sees its cleared cancel request.
  call->state_.store(ClientCall::kQueued, std::memory_order_release);
  if (t_driving == this) {
    // From a callback or handler on this loop: queue it behind this iteration's doorbell.
    // A connection that is not active goes through the queue, so a callback that restarts a
    // failed call cannot recurse.
    Connection* c = FindById(connection_id);
    if (c != nullptr && c->active()) {
      AdmitAndSend(c, call);
      return;
    }
  } else if (!options_.own_thread && driver_.try_lock()) {
    // Caller-driven and nobody else is driving: post it ourselves, no hand-off.
    {
      DrivingScope driving(this);
      DrainSubmissions();
      AdmitAndSend(FindById(connection_id), call, /*ring_now=*/true);
      outbox_.FlushAll();  // whatever draining the submissions queued
    }
    driver_.unlock();
    return;
  }
  SubmitStartCall(connection_id, call);
}

void Worker::SubmitStartCall(uint64_t connection_id, ClientCall* call) {
  WorkItem item;
  item.kind = WorkItem::kStartCall;
  item.connection_id = connection_id;
  item.call = call;
  Submit(std::move(item));
}

void Worker::PumpBacklog(Connection* c) {
  // What waited for credits first (responses, acks, grants), in order; then new calls.
  if (!outbox_.Unpark(c)) return;
  CallTable& calls = c->calls();
  while (CallState* s = calls.backlog_front()) {
    if (c->credits().parked() > 0) break;
    // Unlinked before it is tried: TrySendCall may complete it (a one-way call, a failure),
    // whose callback may start calls that join the backlog.
    calls.PopFront();
    if (!TrySendCall(c, *s)) {  // not completed: back to the front, and wait for credits
      calls.PushFront(*s);
      break;
    }
  }
}


void Worker::FinishCall(Connection* c, CallState& s, absl::Status status) {
  if ((s.request_window & s.reply_window & s.write_op) < 0) {  // all -1: nothing to wait for
    CompleteLocally(c, s, std::move(status));
    return;
  }
  if (s.write_op >= 0) {
    // Answered (or failed) with its upload WRITE's completion not yet seen: the server placed
    // the data before it saw the request, so the WRITE is done with the buffer.
    if (auto* o = std::get_if<bulk_op::UploadWrite>(&c->ops().at(s.write_op))) o->call = nullptr;
    s.write_op = -1;
  }
  // Mirror mode: buffers still exposed are revoked before the caller gets them back (and the
  // scratch buffer, which a request window may expose, is kept until then). Once the QP is in
  // ERR its windows are unusable, and nothing waits on a revocation.
  bool revoking = false;
  for (int32_t w : {s.request_window, s.reply_window}) {
    if (w < 0 || c->closing()) continue;
    const Window& win = c->windows().at(w);
    if (win.state == Window::State::kExposed) {
      int32_t op;
      bulk_op::RevokeThenComplete& then = c->ops().Emplace<bulk_op::RevokeThenComplete>(&op);
      then.window = w;
      then.call = &s;
      then.status = status;
      RevokeWindow(c, w, op);
      revoking = true;
    } else if (win.state == Window::State::kRevoking && win.revoke_op >= 0) {
      // A revocation is on its way already (fallback ack, lease): complete behind it.
      BulkOp& op = c->ops().at(win.revoke_op);
      if (auto* r = std::get_if<bulk_op::Revoke>(&op)) {
        const bool lease_expired = r->lease_expired;
        bulk_op::RevokeThenComplete& then = op.emplace<bulk_op::RevokeThenComplete>();
        then.window = w;
        then.lease_expired = lease_expired;
        then.call = &s;
        then.status = status;
      } else if (auto* rc = std::get_if<bulk_op::RevokeThenComplete>(&op)) {
        rc->call = &s;
        rc->status = status;
      }
      revoking = true;
    }
  }
  if (!revoking) CompleteLocally(c, s, std::move(status));
}

void Worker::GiveUp(Connection* c, CallState& s, absl::Status status) {
  const uint64_t request_id = s.request_id;
  if (DeferIfExposing(c, s, status)) {  // mirror: the server still holds our windows
    outbox_.SendControl(c, rpc_wire::kCancel, request_id);
    return;
  }
  c->calls().Release(s);
  const bool downloading = s.read_op >= 0;
  if (DeferIfReading(c, s, status)) {
    // A download's response is here already, only its READ is left; an upload's request may
    // still be answered, and the server can stop early.
    if (!downloading) outbox_.SendControl(c, rpc_wire::kCancel, request_id);
    return;
  }
  outbox_.SendControl(c, rpc_wire::kCancel, request_id);
  FinishCall(c, s, std::move(status));
}

bool Worker::DeferIfReading(Connection* c, CallState& s, absl::Status status) {
  if (s.read_op >= 0) {
    auto& o = std::get<bulk_op::DownloadRead>(c->ops().at(s.read_op));
    o.cancelled = true;
    o.status = std::move(status);
    return true;
  }
  if (s.write_op >= 0) {
    auto& o = std::get<bulk_op::UploadWrite>(c->ops().at(s.write_op));
    o.call = &s;
    o.cancelled = true;
    o.status = std::move(status);
    return true;
  }
  return false;
}

bool Worker::DeferIfExposing(Connection* c, CallState& s, absl::Status status) {
  if (!s.abandoned.ok()) return true;  // given up on already
  bool exposed = false;
  for (int32_t w : {s.request_window, s.reply_window}) {
    if (w >= 0 && c->windows().at(w).state == Window::State::kExposed) exposed = true;
  }
  if (!exposed) return false;
  s.abandoned = std::move(status);  // never OK: a cancel or a deadline
  s.deadline = absl::InfiniteFuture();
  return true;
}

void Worker::FinishIfAbandoned(Connection* c, CallState& s) {
  if (s.abandoned.ok() || s.request_window >= 0 || s.reply_window >= 0) return;
  // The server is done with our memory; a response still on its way finds no call.
  CompleteLocally(c, s, absl::OkStatus());  // completes with the abandoned status
}

void Worker::FailPendingCalls(Connection* c, const absl::Status& why) {
  CallTable& calls = c->calls();
  std::vector<CallState*> all = calls.All();
  calls.Clear();
  for (CallState* s : all) CompleteLocally(c, *s, why);
}

void Worker::CallTimers(Connection* c, absl::Time now) {
  CallTable& calls = c->calls();
  calls.ForEachInFlight([&](CallState& s) {
    if (s.deadline <= now) GiveUp(c, s, absl::DeadlineExceededError("deadline exceeded"));
  });
  if (calls.backlog_empty()) return;
  for (CallState* s : calls.Unlink([now](const CallState& s) { return s.deadline <= now; })) {
    FinishCall(c, *s, absl::DeadlineExceededError("deadline exceeded before sending"));
  }
}

}  // namespace swirl::internal
