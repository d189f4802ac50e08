// The worker's receive side: receive completions are validated (header, credits), routed to the
// message path, the bulk layer or the client role, and followed by credit returns; send
// completions retire the send queue.

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/check.h"
#include "rpc/worker.h"
#include "transport/verbs/status.h"

namespace swirl::internal {
namespace {

using rpc_wire::MessageHeader;

constexpr uint64_t kRecvTag = uint64_t{1} << 63;

// The error statuses of the message path are built out of line: formatting holds char buffers,
// for which -fstack-protector would guard the message path itself (base/copy.h says why that
// matters).
[[gnu::cold, gnu::noinline]] absl::Status CompletionFailed(const char* what,
                                                           ibv_wc_status status) {
  return absl::UnavailableError(absl::StrCat(what, verbs::WcStatusName(status)));
}

[[gnu::cold, gnu::noinline]] absl::Status NeverSent(uint64_t request_id) {
  return absl::InvalidArgumentError(
      absl::StrFormat("a response for request %u, which was never sent", request_id));
}
}  // namespace

// The steps of HandleRecv, inlined into it: this is the per-message path.
[[gnu::always_inline]] inline Connection* Worker::ReceivingConnection(const ibv_wc& wc) {
  const uint32_t index = static_cast<uint32_t>(wc.wr_id & ~kRecvTag);
  if (index >= recv_pool_->count()) {
    Bump(stray_);
    return nullptr;
  }
  --recv_posted_;
  repost_.push_back(index);
  Connection* c = FindByQpn(wc.qp_num);
  if (c == nullptr) {
    // A connection activated a moment ago may not be registered yet.
    DrainSubmissions();
    c = FindByQpn(wc.qp_num);
    if (c == nullptr) Bump(stray_);
  }
  return c;
}


[[gnu::always_inline]] inline bool Worker::AcceptMessage(Connection* c, const ibv_wc& wc,
                                                         const MessageHeader& h) {
  if (absl::Status valid = rpc_wire::ValidateHeader(
          h, wc.byte_len, {c->max_payload(), c->credits().peer_grant()});
      !valid.ok()) {
    ProtocolError(c, valid);
    return false;
  }
  if (absl::Status honest = c->credits().OnReceive(h.credits); !honest.ok()) {
    ProtocolError(c, honest);
    return false;
  }
  c->liveness.OnReceive();
  Bump(c->counters().bytes_received, wc.byte_len);
  if (h.type != rpc_wire::kResponse) return true;
  // A late answer (the call was cancelled or timed out) names its slot's current generation or
  // an older one, and is dropped later. A request id the table never made names a call we
  // never made: no correct peer sends that, and dropping it would hide a peer that makes
  // answers up.
  if (c->calls().NeverMade(h.request_id)) {
    ProtocolError(c, NeverSent(h.request_id));
    return false;
  }
  return true;
}

void Worker::SecondResponse(Connection* c, uint64_t request_id) {
  ProtocolError(c, absl::InvalidArgumentError(
                       absl::StrFormat("a second response for request %u", request_id)));
}

// A response on the message path: inlined into HandleRecv (it is half of every call).
[[gnu::always_inline]] inline void Worker::CompleteCall(Connection* c, const MessageHeader& h,
                                                        const char* payload) {
  SWIRL_DCHECK(OnLoopThread());
  CallState* s = c->calls().Find(h.request_id);
  if (s == nullptr) return;  // cancelled or timed out already; the late response is dropped
  if (s->read_op >= 0) return SecondResponse(c, h.request_id);
  c->calls().Release(*s);
  Bump(c->counters().responses_received);
  const absl::string_view body(payload, h.payload_len);
  absl::Status status =
      h.status == 0 ? ParseResponse(s->call, body)
                    : absl::Status(static_cast<absl::StatusCode>(h.status), body);
  if ((s->request_window & s->reply_window & s->write_op) < 0) {  // no bulk: nothing to revoke
    CompleteLocally(c, *s, std::move(status));
  } else {
    FinishCall(c, *s, std::move(status));
  }
}

void Worker::RouteBulk(Connection* c, const MessageHeader& h, const char* payload,
                       const ibv_wc& wc) {
  const bool bulk = (h.flags & (rpc_wire::kFlagBulk | rpc_wire::kFlagReplyChunk)) != 0;
  if (!bulk && h.type != rpc_wire::kBulkAck && h.type != rpc_wire::kWindowGrant) {
    // Only bulk messages may revoke a window; anything else that does is a violation.
    BulkViolation(c, absl::StrFormat("message type %u invalidated rkey 0x%x", h.type,
                                     wc.invalidated_rkey));
    return;
  }
  if (bulk && bulk_pool_ == nullptr) {
    ProtocolError(c, absl::FailedPreconditionError("bulk data but no bulk pool here"));
  } else if (h.type == rpc_wire::kBulkAck) {
    HandleBulkAck(c, h, wc);
  } else if (h.type == rpc_wire::kWindowGrant) {
    if (wc.wc_flags & IBV_WC_WITH_INV) {
      BulkViolation(c, "a window grant invalidated an rkey");
    } else {
      HandleWindowGrant(c, h, payload);
    }
  } else if (h.type == rpc_wire::kRequest) {
    HandleBulkRequest(c, h, payload, wc);
  } else {
    HandleBulkResponse(c, h, payload, wc);
  }
}

void Worker::Dispatch(Connection* c, const MessageHeader& h, const char* payload) {
  switch (h.type) {
    case rpc_wire::kRequest:
    case rpc_wire::kOneWay: {
      Incoming in;
      in.header = h;
      in.eager = absl::string_view(payload, h.payload_len);
      DispatchCall(c, in);
      return;
    }
    case rpc_wire::kResponse:  // HandleRecv takes plain responses itself
      CompleteCall(c, h, payload);
      return;
    case rpc_wire::kCancel: {
      auto it = c->serving.running.find(h.request_id);
      if (it != c->serving.running.end()) it->second->store(true, std::memory_order_release);
      return;
    }
    case rpc_wire::kPing:
      outbox_.SendControl(c, rpc_wire::kPong, 0);
      return;
    case rpc_wire::kPong:
      c->liveness.OnPong();
      return;
    default:
      // kCredit: the credits were taken on arrival. Bulk messages went to the bulk layer.
      return;
  }
}

[[gnu::always_inline]] inline void Worker::AfterReceive(Connection* c) {
  // Return credits once half are owed and no message of ours has carried them (every message
  // carries all that are owed when it is queued, so queued WRs, which may be only binds,
  // invalidations or RDMA operations, say nothing about the credits owed since).
  if (c->credits().ShouldReturn()) outbox_.SendControl(c, rpc_wire::kCredit, 0);
  if (c->credits().CanSend() && (!c->calls().backlog_empty() || c->credits().has_parked())) {
    PumpBacklog(c);
  }
}

void Worker::HandleRecv(const ibv_wc& wc) {
  SWIRL_DCHECK(OnLoopThread());
  Connection* c = ReceivingConnection(wc);
  if (c == nullptr || c->closing()) return;
  if (wc.status != IBV_WC_SUCCESS) {
    FailConnection(c, CompletionFailed("receive failed: ", wc.status));
    return;
  }
  const char* buffer = recv_pool_->at(static_cast<uint32_t>(wc.wr_id & ~kRecvTag));
  MessageHeader h;
  if (wc.byte_len >= kHeader) {
    std::memcpy(&h, buffer, kHeader);
  } else {
    std::memset(&h, 0, sizeof(h));
  }
  if (!AcceptMessage(c, wc, h)) return;
  // The message path first: a plain response or request (no bulk flags), nothing invalidated;
  // then the other messages without bulk flags, not a bulk ack or grant.
  const uint32_t lead = rpc_wire::LeadOf(h);
  const bool invalidated = (wc.wc_flags & IBV_WC_WITH_INV) != 0;
  if (lead == rpc_wire::kPlainResponse && !invalidated) {
    CompleteCall(c, h, buffer + kHeader);
  } else if (lead == rpc_wire::kPlainRequest && !invalidated) {
    ServeEager(c, h, buffer + kHeader);
  } else if (h.flags == 0 && h.type != rpc_wire::kBulkAck && h.type != rpc_wire::kWindowGrant &&
             !invalidated) {
    Dispatch(c, h, buffer + kHeader);
  } else {
    RouteBulk(c, h, buffer + kHeader, wc);
  }
  if (!c->closing()) AfterReceive(c);
}

void Worker::HandleSendCompletion(const ibv_wc& wc) {
  SWIRL_DCHECK(OnLoopThread());
  Connection* c = FindByQpn(wc.qp_num);
  const uint64_t seq = wc.wr_id;
  const bool known = c != nullptr && c->sends().Retire(seq, [&](uint64_t s, int32_t buffer,
                                                                int32_t op) {
    outbox_.Give(buffer);
    if (op < 0) return;
    ibv_wc status = wc;
    if (s != seq) status.status = IBV_WC_SUCCESS;  // retired by a later success
    HandleBulkOp(c, op, status);
  });
  if (!known) {
    Bump(stray_);
    return;
  }
  if (wc.status != IBV_WC_SUCCESS && !c->closing()) {
    FailConnection(c, CompletionFailed("send failed: ", wc.status));
  }
}

}  // namespace swirl::internal
