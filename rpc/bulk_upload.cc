// Calls with bulk data (a request above the eager threshold, or an attachment), both ends. How
// the data travels is the connection's bulk mode, fixed at the handshake:
//   granted (kServerExposes): the server grants upload windows ahead of time; the caller RDMA
//     WRITEs into one and seals it with its request, a SEND_WITH_INV of the window's rkey;
//   mirrored (kMirror): the caller exposes its request (and reply) buffer through windows of
//     its own; the server RDMA READs the request, and its ack is the SEND_WITH_INV.
// The invalidation check itself, and the local-invalidation fallback, are CheckSeal's.

#include <algorithm>
#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/check.h"
#include "google/protobuf/message_lite.h"
#include "rpc/worker.h"

namespace swirl::internal {
namespace {

using rpc_wire::BulkDescriptor;
using rpc_wire::MessageHeader;

}  // namespace

// ---- Client side -------------------------------------------------------------------------------

bool Worker::SendBulkCall(Connection* c, CallState& s, size_t message_size, bool message_in_bulk) {
  const ClientCall* call = s.call;
  const BulkBuffer& data = message_in_bulk ? s.scratch : *call->request_bulk_;
  absl::Status refused;
  if (bulk_pool_ == nullptr || !bulk_pool_->Contains(data.data(), data.size())) {
    refused = absl::InvalidArgumentError("bulk data must be registered: use Channel::AllocateBulk");
  } else if (data.size() > c->negotiated().max_bulk_size()) {
    refused = absl::ResourceExhaustedError(
        absl::StrFormat("bulk request of %u bytes exceeds the negotiated maximum %u", data.size(),
                        c->negotiated().max_bulk_size()));
  }
  const bool mirror = c->negotiated().bulk_mode() == control::BULK_MIRROR;
  const bool chunk = mirror && call->response_bulk_ != nullptr && *call->response_bulk_;
  if (refused.ok() && chunk &&
      !bulk_pool_->Contains(call->response_bulk_->data(), call->response_bulk_->capacity())) {
    refused =
        absl::InvalidArgumentError("response_bulk must be registered: use Channel::AllocateBulk");
  }
  const size_t eager = message_in_bulk ? 0 : message_size;
  const uint32_t payload =
      static_cast<uint32_t>((chunk ? 2 : 1) * sizeof(BulkDescriptor) + eager);
  if (refused.ok() && payload > c->max_payload()) {
    refused = absl::ResourceExhaustedError(
        "the message sent next to bulk data exceeds the maximum message size");
  }
  if (!refused.ok()) {
    FinishCall(c, s, std::move(refused));
    return true;
  }
  return mirror ? SendMirroredUpload(c, s, data, payload, message_in_bulk, chunk)
                : SendGrantedUpload(c, s, data, payload, message_in_bulk);
}

void Worker::AskForGrants(Connection* c, uint32_t length) {
  // No upload window big enough: ask for some (one round trip, only when they run out).
  if (c->grants().requested || !c->credits().CanSendCall()) return;
  int32_t buffer;
  char* msg = outbox_.Alloc(kHeader, &buffer);
  if (msg == nullptr) return;
  *reinterpret_cast<MessageHeader*>(msg) = MessageHeader{
      .version = rpc_wire::kProtocolVersion,
      .type = rpc_wire::kWindowGrant,
      .request_id = length,  // the size wanted
      .aux = c->negotiated().window_credits(),
  };
  outbox_.Queue(c, msg, kHeader, buffer);
  c->grants().requested = true;
}

bool Worker::SendGrantedUpload(Connection* c, CallState& s, const BulkBuffer& data,
                               uint32_t payload, bool message_in_bulk) {
  const uint32_t length = static_cast<uint32_t>(data.size());
  // Resources first; nothing is posted until the call is sure to go.
  const int grant = c->grants().BestFit(length);
  if (grant < 0) {
    AskForGrants(c, length);
    return false;
  }
  int32_t buffer;
  char* msg = outbox_.Alloc(kHeader + payload, &buffer);
  if (msg == nullptr) return false;
  c->calls().Allocate(s);
  // Pending from here: a doorbell rung below whose post fails completes the call (the
  // connection fails), and nothing may mark it pending again after that.
  s.call->state_.store(ClientCall::kPending, std::memory_order_relaxed);
  const BulkDescriptor g = c->grants().Take(grant);
  // The payload goes straight into the server's window; the request that follows seals it.
  // Tracked: a caller that gives up before the response gets its buffer back only once the
  // WRITE is done reading it.
  c->ops().Emplace<bulk_op::UploadWrite>(&s.write_op).call = &s;
  PostRdma(c, IBV_WR_RDMA_WRITE, data, length, g.addr, g.rkey, s.write_op);
  if (c->closing()) {
    outbox_.Give(buffer);
    return true;  // its doorbell failed the connection, which completed the call
  }
  const BulkDescriptor descriptor{g.addr, length, g.rkey};
  QueueBulkRequest(c, s, msg, buffer, payload, message_in_bulk, &descriptor, 1,
                   c->remote_invalidation() ? g.rkey : 0);
  return true;
}

bool Worker::SendMirroredUpload(Connection* c, CallState& s, const BulkBuffer& data,
                                uint32_t payload, bool message_in_bulk, bool chunk) {
  const uint32_t length = static_cast<uint32_t>(data.size());
  // Resources first; nothing is posted until the call is sure to go.
  const int32_t request_window = AcquireWindow(c);
  if (request_window < 0) return false;
  const int32_t reply_window = chunk ? AcquireWindow(c) : -1;
  int32_t buffer = -1;
  char* msg = chunk && reply_window < 0 ? nullptr : outbox_.Alloc(kHeader + payload, &buffer);
  if (msg == nullptr) {
    c->windows().PutBack(request_window);
    if (reply_window >= 0) c->windows().PutBack(reply_window);
    return false;
  }
  const uint64_t request_id = c->calls().Allocate(s);
  s.call->state_.store(ClientCall::kPending, std::memory_order_relaxed);  // as above
  BulkDescriptor descriptors[2];
  descriptors[0] = {Addr(data.data()), length,
                    BindWindow(c, request_window, Addr(data.data()), length,
                               IBV_ACCESS_REMOTE_READ, Window::Purpose::kMirrorRequest,
                               request_id)};
  s.request_window = request_window;
  if (chunk) {
    const BulkBuffer* out = s.call->response_bulk_;
    const uint32_t capacity =
        static_cast<uint32_t>(std::min<size_t>(out->capacity(), c->negotiated().max_bulk_size()));
    descriptors[1] = {Addr(out->data()), capacity,
                      BindWindow(c, reply_window, Addr(out->data()), capacity,
                                 IBV_ACCESS_REMOTE_WRITE, Window::Purpose::kMirrorReply,
                                 request_id)};
    s.reply_window = reply_window;
  }
  QueueBulkRequest(c, s, msg, buffer, payload, message_in_bulk, descriptors, chunk ? 2 : 1, 0);
  return true;
}

void Worker::QueueBulkRequest(Connection* c, CallState& s, char* msg, int32_t buffer,
                              uint32_t payload, bool message_in_bulk,
                              const BulkDescriptor* descriptors, uint32_t count,
                              uint32_t invalidate) {
  const ClientCall* call = s.call;
  *reinterpret_cast<MessageHeader*>(msg) = MessageHeader{
      .version = rpc_wire::kProtocolVersion,
      .type = rpc_wire::kRequest,
      .flags = static_cast<uint16_t>(rpc_wire::kFlagBulk |
                                     (count > 1 ? rpc_wire::kFlagReplyChunk : 0)),
      .method_id = call->method_id_,
      .request_id = s.request_id,
      .payload_len = payload,
      .aux = message_in_bulk ? static_cast<uint32_t>(rpc_wire::kAuxBulkIsMessage) : 0u,
  };
  char* p = msg + kHeader;
  std::memcpy(p, descriptors, count * sizeof(BulkDescriptor));
  p += count * sizeof(BulkDescriptor);
  const size_t eager = payload - count * sizeof(BulkDescriptor);
  if (eager > 0) {
    if (call->request_ != nullptr) {
      call->request_->SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(p));
    } else {
      std::memcpy(p, call->request_bytes_.data(), eager);
    }
  }
  outbox_.Queue(c, msg, kHeader + payload, buffer, invalidate);
  Bump(c->counters().requests_sent);
}

// ---- Server side -------------------------------------------------------------------------------

void Worker::HandleBulkRequest(Connection* c, const MessageHeader& h, const char* payload,
                               const ibv_wc& wc) {
  SWIRL_DCHECK(OnLoopThread());
  // ValidateHeader guarantees the descriptors fit in the payload; checked again here because
  // an underflow would make the eager part span the rest of memory.
  const size_t descriptors =
      ((h.flags & rpc_wire::kFlagReplyChunk) ? 2 : 1) * sizeof(BulkDescriptor);
  if (descriptors > h.payload_len) return BulkViolation(c, "bulk descriptors cut short");
  BulkDescriptor d;
  std::memcpy(&d, payload, sizeof(d));
  Incoming in;
  in.header = h;
  if (h.flags & rpc_wire::kFlagReplyChunk) {
    if (c->negotiated().bulk_mode() != control::BULK_MIRROR) {
      return BulkViolation(c, "a reply window outside mirror mode");
    }
    std::memcpy(&in.chunk, payload + sizeof(d), sizeof(in.chunk));
    in.has_chunk = true;
  }
  in.eager = absl::string_view(payload + descriptors, h.payload_len - descriptors);
  if (d.length == 0 || d.length > c->negotiated().max_bulk_size()) {
    return BulkViolation(c, absl::StrCat("bulk request of ", d.length, " bytes"));
  }
  if (c->negotiated().bulk_mode() == control::BULK_MIRROR) {
    ReceiveMirroredUpload(c, in, d, wc);
  } else {
    ReceiveGrantedUpload(c, in, d, wc);
  }
}

void Worker::ReceiveGrantedUpload(Connection* c, Incoming& in, const BulkDescriptor& d,
                                  const ibv_wc& wc) {
  const MessageHeader& h = in.header;
  int32_t w = c->windows().FindExposed(d.rkey);
  if (w >= 0 && (c->windows().at(w).purpose != Window::Purpose::kGrant ||
                 c->windows().at(w).addr != d.addr || d.length > c->windows().at(w).length)) {
    w = -1;
  }
  if (w < 0) return BulkViolation(c, "upload names no window granted to this connection");
  Window& win = c->windows().at(w);
  const uint32_t grant_size = static_cast<uint32_t>(win.buffer.capacity());
  --c->granted.by_class[grant_size];
  ChargeBulk(c, &c->granted.bytes, -static_cast<int64_t>(grant_size));
  const std::optional<bool> revoked =
      CheckSeal(c, wc, d.rkey, absl::StrFormat("upload for request %u", h.request_id));
  if (!revoked.has_value()) return;
  if (!*revoked) {
    // Explicit fallback: revoke it ourselves and run the handler once the revocation is done.
    int32_t op;
    bulk_op::RevokeThenDispatch& then = c->ops().Emplace<bulk_op::RevokeThenDispatch>(&op);
    then.window = w;
    then.request.header = h;
    then.request.eager.assign(in.eager.data(), in.eager.size());
    then.request.length = d.length;
    then.request.admitted = !draining_;
    RevokeWindow(c, w, op);
    return;
  }
  // The window was revoked as this message arrived; the payload can no longer change.
  Bump(c->counters().windows_remote_invalidated);
  Bump(totals_.windows_remote_invalidated);
  in.bulk = std::move(win.buffer);
  in.bulk.resize(d.length);
  FreeWindow(c, w);
  GrantWindows(c, 1, grant_size);  // replenish: steady state needs no grant round trip
  DispatchCall(c, in);
}

void Worker::ReceiveMirroredUpload(Connection* c, Incoming& in, const BulkDescriptor& d,
                                   const ibv_wc& wc) {
  const MessageHeader& h = in.header;
  if (wc.wc_flags & IBV_WC_WITH_INV) {
    return BulkViolation(c, "SEND_WITH_INV on a mirror-mode request");
  }
  bulk_op::Request request;
  request.header = h;
  request.eager.assign(in.eager.data(), in.eager.size());
  request.has_chunk = in.has_chunk;
  request.chunk = in.chunk;
  request.length = d.length;
  request.admitted = true;  // not draining (below)
  // The READ's buffer is the connection's to hold until the READ completes, which is the client's
  // to delay (it may stop progressing its QP): it counts against the connection's mirror budget
  // and its client's, and so does the number of READs under way. A request beyond them waits,
  // behind those before it, for one of the connection's READs to complete: it holds no pool
  // memory meanwhile (its header and eager bytes), and the call waits rather than fails, as an
  // upload beyond the window credits does in the other mode. It is refused (RESOURCE_EXHAUSTED)
  // when the connection has no READ under way whose completion would make room (the client's
  // other connections, or the pool, hold it), or already has mirror_reads_per_connection
  // requests waiting: waiting ones are the client's to multiply, so they are bounded too.
  const uint64_t bytes = std::bit_ceil(std::max<uint64_t>(d.length, BulkPool::kMinClass));
  absl::Status budget = draining_ ? absl::UnavailableError("server is shutting down")
                                  : MirrorBudget(c, bytes);
  if (!draining_ && (!budget.ok() || !c->mirror_waiting.empty()) && c->mirror_reads > 0 &&
      c->mirror_waiting.size() < options_.mirror_reads_per_connection) {
    c->mirror_waiting.push_back(bulk_op::MirrorWait{std::move(request), d});
    work_.Enter();  // an admitted request: a graceful drain waits for it
    return;
  }
  absl::StatusOr<BulkBuffer> buffer =
      budget.ok() ? bulk_pool_->Allocate(d.length) : absl::StatusOr<BulkBuffer>(budget);
  if (!buffer.ok()) {
    // Refused before its data is read (a drain is not kept busy by new requests), beyond the
    // budget, or no memory for it: release the caller's window at once and answer with the
    // reason.
    SendBulkAck(c, h.request_id, d.rkey);
    SendResponseBytes(c, h.request_id, buffer.status(), {});
    return;
  }
  StartMirrorRead(c, std::move(request), d, std::move(*buffer));
}

absl::Status Worker::MirrorBudget(const Connection* c, uint64_t bytes) const {
  if (c->mirror_reads < options_.mirror_reads_per_connection &&
      c->mirror_bytes + bytes <= options_.mirror_bytes_per_connection &&
      ClientBulkBytes(c) + bytes <= bulk_bytes_per_client_) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrFormat(
      "a %u-byte mirror-mode request would take this connection past its %u READs (%u under "
      "way, %u waiting) or %u bytes (%u held) of mirror-mode buffers, or its client's bulk "
      "memory (%u bytes) past the client's (%u)",
      bytes, options_.mirror_reads_per_connection, c->mirror_reads, c->mirror_waiting.size(),
      options_.mirror_bytes_per_connection, c->mirror_bytes, ClientBulkBytes(c),
      bulk_bytes_per_client_));
}

void Worker::StartMirrorRead(Connection* c, bulk_op::Request request, const BulkDescriptor& d,
                             BulkBuffer buffer) {
  int32_t op;
  bulk_op::MirrorRead& read = c->ops().Emplace<bulk_op::MirrorRead>(&op);
  read.request = std::move(request);
  read.peer_rkey = d.rkey;
  read.buffer = std::move(buffer);
  ChargeBulk(c, &c->mirror_bytes, static_cast<int64_t>(read.buffer.capacity()));
  ++c->mirror_reads;
  PostRdma(c, IBV_WR_RDMA_READ, read.buffer, d.length, d.addr, d.rkey, op);
}

void Worker::PumpMirrorReads(Connection* c) {
  while (!c->mirror_waiting.empty() && !c->closing()) {
    const BulkDescriptor d = c->mirror_waiting.front().data;
    const uint64_t bytes = std::bit_ceil(std::max<uint64_t>(d.length, BulkPool::kMinClass));
    const absl::Status budget = MirrorBudget(c, bytes);
    if (!budget.ok() && c->mirror_reads > 0) return;  // the next completion tries again
    bulk_op::Request request = std::move(c->mirror_waiting.front().request);
    c->mirror_waiting.pop_front();
    work_.Leave();
    absl::StatusOr<BulkBuffer> buffer =
        budget.ok() ? bulk_pool_->Allocate(d.length) : absl::StatusOr<BulkBuffer>(budget);
    if (!buffer.ok()) {
      // Nothing of this connection's left to wait for: refused as on arrival.
      SendBulkAck(c, request.header.request_id, d.rkey);
      SendResponseBytes(c, request.header.request_id, buffer.status(), {});
      continue;
    }
    StartMirrorRead(c, std::move(request), d, std::move(*buffer));
  }
}

}  // namespace swirl::internal
