// Responses with bulk data (a response above the eager threshold, or an attachment), both ends.
// The server exposes the data through a download window that the caller RDMA READs and then
// revokes with its ack (a SEND_WITH_INV of the window's rkey); in mirror mode an attachment is
// RDMA WRITTEN into the caller's reply window instead, and the response revokes that window.

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/check.h"
#include "rpc/worker.h"
#include "rpc/writer.h"

namespace swirl::internal {
namespace {

using rpc_wire::BulkDescriptor;
using rpc_wire::MessageHeader;

}  // namespace

// ---- Server side -------------------------------------------------------------------------------

void Worker::SendBulkResponse(Connection* c, const Incoming& request, MessageWriter* writer,
                              BulkBuffer data, bool is_message) {
  const uint64_t request_id = request.header.request_id;
  const uint32_t eager = is_message ? 0 : writer->length();
  const uint32_t payload = static_cast<uint32_t>(sizeof(BulkDescriptor) + eager);
  absl::Status refused;
  if (bulk_pool_ == nullptr || !bulk_pool_->Contains(data.data(), data.size())) {
    refused = absl::InternalError("response bulk data is not in registered memory");
  } else if (data.size() > c->negotiated().max_bulk_size()) {
    refused = absl::ResourceExhaustedError(
        absl::StrFormat("bulk response of %u bytes exceeds the negotiated maximum %u",
                        data.size(), c->negotiated().max_bulk_size()));
  } else if (payload > c->max_payload()) {
    refused = absl::ResourceExhaustedError("response message next to bulk data too big");
  }
  if (!refused.ok()) {
    writer->Abandon();
    SendResponseBytes(c, request_id, refused, {});
    return;
  }
  int32_t buffer;
  char* msg = outbox_.Alloc(kHeader + payload, &buffer);
  if (msg == nullptr) {
    writer->Abandon();
    FailConnection(c, absl::ResourceExhaustedError("send buffers exhausted"));
    return;
  }
  if (eager > 0) {
    std::memcpy(msg + kHeader + sizeof(BulkDescriptor), writer->data() + kHeader, eager);
  }
  writer->Abandon();
  BulkDescriptor d;
  uint32_t invalidate = 0;
  if (absl::Status exposed = ExposeResponse(c, request, data, is_message, &d, &invalidate);
      !exposed.ok()) {
    outbox_.Give(buffer);
    SendResponseBytes(c, request_id, exposed, {});
    return;
  }
  *reinterpret_cast<MessageHeader*>(msg) = MessageHeader{
      .version = rpc_wire::kProtocolVersion,
      .type = rpc_wire::kResponse,
      .flags = rpc_wire::kFlagBulk,
      .request_id = request_id,
      .payload_len = payload,
      .aux = is_message ? static_cast<uint32_t>(rpc_wire::kAuxBulkIsMessage) : 0u,
  };
  std::memcpy(msg + kHeader, &d, sizeof(d));
  Bump(c->counters().responses_sent);
  outbox_.Emit(c, msg, kHeader + payload, buffer, invalidate);
}

absl::Status Worker::ExposeResponse(Connection* c, const Incoming& request, BulkBuffer& data,
                                    bool is_message, BulkDescriptor* d, uint32_t* invalidate) {
  const uint32_t length = static_cast<uint32_t>(data.size());
  // The reply window is for an attachment; a response message carried in bulk is downloaded
  // (the caller's reply window is then revoked by the caller itself when the call completes).
  if (c->negotiated().bulk_mode() == control::BULK_MIRROR && request.has_chunk && !is_message &&
      length <= request.chunk.length) {
    // Mirror: write into the caller's reply window; the response then revokes it. The buffer is
    // held until the WRITE completes, which the caller can delay: it counts against the
    // connection's mirror budget (and its client's), as the READs of its requests do.
    if (c->mirror_bytes + data.capacity() > options_.mirror_bytes_per_connection ||
        ClientBulkBytes(c) + data.capacity() > bulk_bytes_per_client_) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "a %u-byte reply would take this connection's mirror-mode buffers (%u bytes) past "
          "its limit (%u), or its client's bulk memory (%u bytes) past the client's (%u)",
          data.capacity(), c->mirror_bytes, options_.mirror_bytes_per_connection,
          ClientBulkBytes(c), bulk_bytes_per_client_));
    }
    int32_t op;
    bulk_op::Hold& hold = c->ops().Emplace<bulk_op::Hold>(&op);
    hold.buffer = std::move(data);
    ChargeBulk(c, &c->mirror_bytes, static_cast<int64_t>(hold.buffer.capacity()));
    PostRdma(c, IBV_WR_RDMA_WRITE, hold.buffer, length, request.chunk.addr, request.chunk.rkey,
             op);
    *d = {request.chunk.addr, length, request.chunk.rkey};
    *invalidate = c->remote_invalidation() ? request.chunk.rkey : 0;
    return absl::OkStatus();
  }
  // Downloads the peer has not acknowledged keep their buffers out of the worker's pool, which
  // all its connections share: a peer that never acknowledges may hold only so much (and each
  // window only for its lease); the same for all of one client's connections together.
  if (c->download_bytes + data.capacity() > options_.download_bytes_per_connection ||
      ClientBulkBytes(c) + data.capacity() > bulk_bytes_per_client_) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "a %u-byte download would take this connection's unacknowledged downloads (%u bytes) "
        "past its limit (%u), or its client's bulk memory (%u bytes) past the client's (%u)",
        data.capacity(), c->download_bytes, options_.download_bytes_per_connection,
        ClientBulkBytes(c), bulk_bytes_per_client_));
  }
  const int32_t w = AcquireWindow(c);
  if (w < 0) return absl::ResourceExhaustedError("no memory window free for the response");
  const uint32_t rkey = BindWindow(c, w, Addr(data.data()), length, IBV_ACCESS_REMOTE_READ,
                                   Window::Purpose::kDownload, request.header.request_id);
  Window& win = c->windows().at(w);
  *d = {win.addr, length, rkey};
  win.buffer = std::move(data);
  ChargeBulk(c, &c->download_bytes, static_cast<int64_t>(win.buffer.capacity()));
  *invalidate = 0;
  return absl::OkStatus();
}

// ---- Client side -------------------------------------------------------------------------------

void Worker::HandleBulkResponse(Connection* c, const MessageHeader& h, const char* payload,
                                const ibv_wc& wc) {
  SWIRL_DCHECK(OnLoopThread());
  // ValidateHeader guaranteed the descriptor; checked again before reading it all the same.
  if (h.payload_len < sizeof(BulkDescriptor)) return BulkViolation(c, "bulk descriptor cut short");
  BulkDescriptor d;
  std::memcpy(&d, payload, sizeof(d));
  const absl::string_view eager(payload + sizeof(d), h.payload_len - sizeof(d));
  if (d.length == 0 || d.length > c->negotiated().max_bulk_size()) {
    return BulkViolation(c, absl::StrCat("bulk response of ", d.length, " bytes"));
  }
  CallState* s = c->calls().Find(h.request_id);
  if (s != nullptr && s->read_op >= 0) return SecondResponse(c, h.request_id);
  if (s != nullptr && s->reply_window >= 0 && c->windows().at(s->reply_window).rkey == d.rkey) {
    ReceiveIntoReplyWindow(c, *s, h, d, eager, wc);
    return;
  }
  if (wc.wc_flags & IBV_WC_WITH_INV) {
    return BulkViolation(c, "unexpected SEND_WITH_INV on a response");
  }
  if (s == nullptr) {
    // The call was cancelled or timed out: release the server's window without reading.
    SendBulkAck(c, h.request_id, d.rkey);
    return;
  }
  StartDownload(c, *s, h, d, eager);
}

void Worker::ReceiveIntoReplyWindow(Connection* c, CallState& s, const MessageHeader& h,
                                    const BulkDescriptor& d, absl::string_view eager,
                                    const ibv_wc& wc) {
  const Window& win = c->windows().at(s.reply_window);
  if (d.addr != win.addr || d.length > win.length) {
    return BulkViolation(c, "response names our reply window with another range");
  }
  if (h.aux & rpc_wire::kAuxBulkIsMessage) {
    return BulkViolation(c, "a response message written into a reply window");
  }
  // Checked before the slot is released: a violation fails the connection, which completes the
  // call with everything else it had in flight.
  const std::optional<bool> revoked = CheckSeal(
      c, wc, win.rkey, absl::StrFormat("the response to request %u (our reply window)",
                                       h.request_id));
  if (!revoked.has_value()) return;
  c->calls().Release(s);
  s.call->response_bulk_->resize(d.length);
  absl::Status status = ParseResponse(s.call, eager);
  Bump(c->counters().responses_received);
  if (*revoked && win.state == Window::State::kExposed) {
    Bump(c->counters().windows_remote_invalidated);
    Bump(totals_.windows_remote_invalidated);
    FreeWindow(c, s.reply_window);
    s.reply_window = -1;
  }
  // Otherwise our own revocation (the fallback at completion, or a lease that ran out) frees
  // the window, once, and FinishCall completes the call behind it.
  FinishCall(c, s, std::move(status));
}

void Worker::StartDownload(Connection* c, CallState& s, const MessageHeader& h,
                           const BulkDescriptor& d, absl::string_view eager) {
  ClientCall* call = s.call;
  const bool is_message = (h.aux & rpc_wire::kAuxBulkIsMessage) != 0;
  BulkBuffer* dest;
  if (is_message) {
    // Not into the scratch buffer: in mirror mode it may hold the request, exposed through a
    // window until the server's ack is handled (and a malicious server may never send one), so
    // it is neither overwritten nor given back to the pool here. A message response has no
    // attachment, so the call's own attachment buffer is free to hold it.
    dest = &call->owned_response_bulk_;
  } else if (call->response_bulk_ != nullptr && *call->response_bulk_) {
    dest = call->response_bulk_;
  } else {
    dest = &call->owned_response_bulk_;
  }
  if (!*dest || dest->capacity() < d.length) {
    absl::StatusOr<BulkBuffer> fresh =
        bulk_pool_ != nullptr
            ? bulk_pool_->Allocate(d.length)
            : absl::StatusOr<BulkBuffer>(absl::FailedPreconditionError("no bulk pool"));
    if (!fresh.ok() || dest == call->response_bulk_) {
      // The slot first: if the ack fails the connection, the call is completed once, below.
      c->calls().Release(s);
      SendBulkAck(c, h.request_id, d.rkey);
      FinishCall(c, s,
                 fresh.ok() ? absl::ResourceExhaustedError("response_bulk is too small")
                            : fresh.status());
      return;
    }
    *dest = std::move(*fresh);
  }
  dest->resize(d.length);
  bulk_op::DownloadRead& read = c->ops().Emplace<bulk_op::DownloadRead>(&s.read_op);
  read.call = &s;
  read.request_id = h.request_id;
  read.is_message = is_message;
  read.eager.assign(eager.data(), eager.size());
  PostRdma(c, IBV_WR_RDMA_READ, *dest, d.length, d.addr, d.rkey, s.read_op);
  // The acknowledgement travels right behind the READ (fenced) and revokes the window.
  SendBulkAck(c, h.request_id, d.rkey);
}

}  // namespace swirl::internal
