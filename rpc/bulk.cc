// Bulk transfers through per-request memory windows, revoked by the peer's SEND_WITH_INV.
// docs/BULK.md describes the protocol; this file is the worker's half of it.
//
// Invariants worth keeping in mind while reading:
//   * every window is type 2, bound to this connection's QP, over exactly one buffer, with a
//     fresh random key byte per binding; a pool MR's own rkey never grants remote access;
//   * a SEND_WITH_INV is only ever expected on (a) an upload request naming its grant, (b) a
//     bulk ack naming a download window, (c) a mirror-mode response naming the caller's reply
//     window. Any other invalidation, or a missing one, is a protocol violation and ends the
//     connection (as iSER does);
//   * memory a window exposed is reused only after the window is revoked: by the peer's
//     SEND_WITH_INV (checked against the key we granted), by our LOCAL_INV's completion, or by
//     deallocating the window when the connection is gone.

#include <cstring>

#include "absl/random/distributions.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/log.h"
#include "google/protobuf/message_lite.h"
#include "rpc/worker.h"
#include "rpc/writer.h"

namespace swirl {

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
  return &response_bulk_;
}

namespace internal {
namespace {

using rpc_wire::BulkDescriptor;
using rpc_wire::MessageHeader;
using Window = Connection::Window;
using BulkOp = Connection::BulkOp;

constexpr uint32_t kHeader = sizeof(MessageHeader);

inline void Bump(std::atomic<uint64_t>& counter, uint64_t n = 1) {
  counter.store(counter.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
}

uint64_t Addr(const void* p) { return reinterpret_cast<uint64_t>(p); }

bool InvalidatedBy(const ibv_wc& wc, uint32_t rkey) {
  return (wc.wc_flags & IBV_WC_WITH_INV) != 0 && wc.invalidated_rkey == rkey;
}

}  // namespace

// ---- Windows and operations --------------------------------------------------------------------

int32_t Worker::NewOp(Connection* c) {
  if (!c->free_ops_.empty()) {
    int32_t index = c->free_ops_.back();
    c->free_ops_.pop_back();
    return index;
  }
  c->ops_.emplace_back();
  return static_cast<int32_t>(c->ops_.size() - 1);
}

int32_t Worker::AcquireWindow(Connection* c) {
  if (!c->free_windows_.empty()) {
    int32_t w = static_cast<int32_t>(c->free_windows_.back());
    c->free_windows_.pop_back();
    return w;
  }
  if (c->windows_.size() >= c->max_windows_) return -1;
  // Windows are allocated once per connection and reused (ydb's lesson: ibv_alloc_mw per
  // request is far too slow); each reuse gets a fresh key.
  auto mw = verbs::MemoryWindow::Allocate(pd_, IBV_MW_TYPE_2);
  if (!mw.ok()) {
    SWIRL_LOG(WARNING, "%s: %s", options_.name, mw.status().ToString());
    return -1;
  }
  Window window;
  window.rkey = (*mw)->rkey();
  window.mw = std::move(*mw);
  const auto w = static_cast<int32_t>(c->windows_.size());
  c->window_by_index_[window.rkey >> 8] = w;
  c->windows_.push_back(std::move(window));
  return w;
}

int32_t Worker::ExposedWindow(const Connection* c, uint32_t rkey) const {
  auto it = c->window_by_index_.find(rkey >> 8);
  if (it == c->window_by_index_.end()) return -1;
  const Window& win = c->windows_[it->second];
  return win.rkey == rkey && win.state == Window::State::kExposed ? it->second : -1;
}

uint32_t Worker::BindWindow(Connection* c, int32_t w, uint64_t addr, uint32_t length, int access,
                            Window::Purpose purpose, uint64_t request_id) {
  Window& window = c->windows_[w];
  uint8_t key;
  do {
    key = absl::Uniform<uint8_t>(bitgen_);
  } while (key == (window.rkey & 0xff));
  const uint32_t rkey = (window.rkey & ~0xffu) | key;
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_BIND_MW;
  wr.bind_mw.mw = window.mw->get();
  wr.bind_mw.rkey = rkey;
  wr.bind_mw.bind_info.mr = bulk_pool_->mr();
  wr.bind_mw.bind_info.addr = addr;
  wr.bind_mw.bind_info.length = length;
  wr.bind_mw.bind_info.mw_access_flags = static_cast<unsigned int>(access);
  QueueRawWr(c, wr, nullptr, -1, -1);
  window.rkey = rkey;
  if (window.state == Window::State::kFree) Bump(windows_exposed_);
  window.state = Window::State::kExposed;
  window.addr = addr;
  window.length = length;
  window.purpose = purpose;
  window.request_id = request_id;
  window.lease = purpose == Window::Purpose::kGrant ? absl::InfiniteFuture()
                                                    : absl::Now() + options_.window_lease;
  return rkey;
}

bool Worker::BulkInFlight(const Connection* c) const {
  if (c->ops_.size() != c->free_ops_.size() || !c->static_download_.empty()) return true;
  for (const Connection::Window& w : c->windows_) {
    if (w.state == Connection::Window::State::kRevoking ||
        (w.state == Connection::Window::State::kExposed &&
         w.purpose != Connection::Window::Purpose::kGrant)) {
      return true;
    }
  }
  return false;
}

uint64_t Worker::ClientBulkBytes(const Connection* c) const {
  auto it = client_bulk_bytes_.find(c->client_key_);
  return it == client_bulk_bytes_.end() ? 0 : it->second;
}

void Worker::ChargeBulk(Connection* c, uint64_t* counter, int64_t delta) {
  *counter += static_cast<uint64_t>(delta);
  uint64_t& total = client_bulk_bytes_[c->client_key_];
  total += static_cast<uint64_t>(delta);
  if (total == 0) client_bulk_bytes_.erase(c->client_key_);
}

void Worker::FreeWindow(Connection* c, int32_t w) {
  Window& window = c->windows_[w];
  if (window.purpose == Window::Purpose::kDownload) {
    ChargeBulk(c, &c->download_bytes_, -static_cast<int64_t>(window.buffer.capacity()));
  }
  if (window.state != Window::State::kFree) {
    windows_exposed_.store(windows_exposed_.load(std::memory_order_relaxed) - 1,
                           std::memory_order_relaxed);
  }
  window.state = Window::State::kFree;
  window.buffer.Release();
  window.request_id = 0;
  window.lease = absl::InfiniteFuture();
  window.revoke_op = -1;
  c->free_windows_.push_back(static_cast<uint32_t>(w));
}

void Worker::PostLocalInv(Connection* c, uint32_t rkey, int32_t op) {
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_LOCAL_INV;
  wr.invalidate_rkey = rkey;
  QueueRawWr(c, wr, nullptr, -1, op);
}

int32_t Worker::RevokeWindow(Connection* c, int32_t w, BulkOp::Kind kind, bool lease_expired) {
  Window& window = c->windows_[w];
  window.state = Window::State::kRevoking;
  const int32_t op = NewOp(c);
  c->ops_[op].kind = kind;
  c->ops_[op].window = w;
  c->ops_[op].lease_expired = lease_expired;
  window.revoke_op = op;
  PostLocalInv(c, window.rkey, op);
  return op;
}

void Worker::PostRdma(Connection* c, ibv_wr_opcode opcode, const BulkBuffer& local, uint32_t length,
                      uint64_t remote_addr, uint32_t rkey, int32_t op) {
  ibv_sge sge{Addr(local.data()), length, bulk_pool_->lkey()};
  ibv_send_wr wr{};
  wr.opcode = opcode;
  wr.wr.rdma.remote_addr = remote_addr;
  wr.wr.rdma.rkey = rkey;
  QueueRawWr(c, wr, &sge, -1, op);
}

void Worker::SendBulkAck(Connection* c, uint64_t request_id, uint32_t rkey) {
  int32_t buffer;
  char* data = AllocMessage(c, kHeader, &buffer);
  if (data == nullptr) {
    FailConnection(c, absl::ResourceExhaustedError("send buffers exhausted"));
    return;
  }
  *reinterpret_cast<MessageHeader*>(data) = MessageHeader{
      rpc_wire::kProtocolVersion, rpc_wire::kBulkAck, 0, 0, request_id, 0, 0, 0, rkey};
  // Fenced: an RDMA READ just posted on this QP finishes before the window goes away. Through
  // EmitMessage, so that without a credit it waits in line, ahead of the response to the same
  // request that the peer must not see first.
  EmitMessage(c, data, kHeader, buffer, remote_invalidation(c) ? rkey : 0, IBV_SEND_FENCE);
}

void Worker::BulkViolation(Connection* c, const std::string& why) {
  Bump(c->counters_.invalidation_violations);
  Bump(totals_.invalidation_violations);
  ProtocolError(c, absl::PermissionDeniedError(why));
}

// ---- Client side: sending a call with bulk data ----------------------------------------------

bool Worker::SendBulkCall(Connection* c, ClientCall* call, size_t message_size,
                          bool message_in_bulk) {
  const BulkBuffer* data = message_in_bulk ? &call->scratch_ : call->request_bulk_;
  if (bulk_pool_ == nullptr || !bulk_pool_->Contains(data->data(), data->size())) {
    FinishCall(
        c, call,
        absl::InvalidArgumentError("bulk data must be registered: use Channel::AllocateBulk"));
    return true;
  }
  if (data->size() > c->negotiated_.max_bulk_size()) {
    FinishCall(c, call,
               absl::ResourceExhaustedError(
                   absl::StrFormat("bulk request of %u bytes exceeds the negotiated maximum %u",
                                   data->size(), c->negotiated_.max_bulk_size())));
    return true;
  }
  const control::BulkMode mode = c->negotiated_.bulk_mode();
  const bool chunk =
      mode == control::BULK_MIRROR && call->response_bulk_ != nullptr && *call->response_bulk_;
  if (chunk &&
      !bulk_pool_->Contains(call->response_bulk_->data(), call->response_bulk_->capacity())) {
    FinishCall(
        c, call,
        absl::InvalidArgumentError("response_bulk must be registered: use Channel::AllocateBulk"));
    return true;
  }
  const size_t eager = message_in_bulk ? 0 : message_size;
  const uint32_t descriptors = chunk ? 2 : 1;
  const uint32_t payload = static_cast<uint32_t>(descriptors * sizeof(BulkDescriptor) + eager);
  if (payload > c->max_payload_) {
    FinishCall(c, call,
               absl::ResourceExhaustedError(
                   "the message sent next to bulk data exceeds the maximum message "
                   "size"));
    return true;
  }
  const uint32_t length = static_cast<uint32_t>(data->size());
  // Resources first; nothing is posted until the call is sure to go.
  int32_t grant = -1;
  int32_t request_window = -1;
  int32_t reply_window = -1;
  if (mode == control::BULK_MIRROR) {
    request_window = AcquireWindow(c);
    if (request_window < 0) return false;
    if (chunk) {
      reply_window = AcquireWindow(c);
      if (reply_window < 0) {
        c->free_windows_.push_back(static_cast<uint32_t>(request_window));
        return false;
      }
    }
  } else {
    for (size_t i = 0; i < c->grants_.size(); ++i) {
      if (c->grants_[i].length >= length &&
          (grant < 0 || c->grants_[i].length < c->grants_[grant].length)) {
        grant = static_cast<int32_t>(i);
      }
    }
    if (grant < 0) {
      // No upload window big enough: ask for some (one round trip, only when they run out).
      if (!c->grant_requested_ && c->send_credits_ >= 2) {
        int32_t buffer;
        char* msg = AllocMessage(c, kHeader, &buffer);
        if (msg != nullptr) {
          const uint32_t want = c->negotiated_.window_credits();
          *reinterpret_cast<MessageHeader*>(msg) = MessageHeader{
              rpc_wire::kProtocolVersion, rpc_wire::kWindowGrant, 0, 0, length, 0, 0, 0, want};
          QueueWr(c, msg, kHeader, buffer);
          c->grant_requested_ = true;
        }
      }
      return false;
    }
  }
  int32_t buffer;
  char* msg = AllocMessage(c, kHeader + payload, &buffer);
  if (msg == nullptr) {
    if (request_window >= 0) c->free_windows_.push_back(static_cast<uint32_t>(request_window));
    if (reply_window >= 0) c->free_windows_.push_back(static_cast<uint32_t>(reply_window));
    return false;
  }
  const uint64_t request_id = AllocateSlot(c, call);
  // Pending from here: a doorbell rung below whose post fails completes the call (the
  // connection fails), and nothing may mark it pending again after that.
  call->state_.store(ClientCall::kPending, std::memory_order_relaxed);
  BulkDescriptor descriptor{};
  uint32_t invalidate = 0;
  if (mode == control::BULK_MIRROR) {
    const uint32_t rkey =
        BindWindow(c, request_window, Addr(data->data()), length, IBV_ACCESS_REMOTE_READ,
                   Window::Purpose::kMirrorRequest, request_id);
    call->request_window_ = request_window;
    descriptor = {Addr(data->data()), length, rkey};
  } else {
    const BulkDescriptor g = c->grants_[grant];
    c->grants_.erase(c->grants_.begin() + grant);
    // The payload goes straight into the server's window; the request that follows seals it.
    // Tracked: a caller that gives up before the response gets its buffer back only once the
    // WRITE is done reading it.
    const int32_t op = NewOp(c);
    c->ops_[op].kind = BulkOp::Kind::kUploadWrite;
    c->ops_[op].call = call;
    call->write_op_ = op;
    PostRdma(c, IBV_WR_RDMA_WRITE, *data, length, g.addr, g.rkey, op);
    if (c->state_.load(std::memory_order_relaxed) >= Connection::State::kClosing) {
      if (buffer >= 0) send_pool_->Give(static_cast<uint32_t>(buffer));
      return true;  // its doorbell failed the connection, which completed the call
    }
    descriptor = {g.addr, length, g.rkey};
    if (mode == control::BULK_SERVER_EXPOSES && remote_invalidation(c)) invalidate = g.rkey;
  }
  auto* h = reinterpret_cast<MessageHeader*>(msg);
  *h = MessageHeader{
      rpc_wire::kProtocolVersion,
      rpc_wire::kRequest,
      static_cast<uint16_t>(rpc_wire::kFlagBulk | (chunk ? rpc_wire::kFlagReplyChunk : 0)),
      call->method_id_,
      request_id,
      0,
      payload,
      0,
      message_in_bulk ? static_cast<uint32_t>(rpc_wire::kAuxBulkIsMessage) : 0u};
  char* p = msg + kHeader;
  std::memcpy(p, &descriptor, sizeof(descriptor));
  p += sizeof(descriptor);
  if (chunk) {
    BulkBuffer* out = call->response_bulk_;
    const uint32_t capacity =
        static_cast<uint32_t>(std::min<size_t>(out->capacity(), c->negotiated_.max_bulk_size()));
    const uint32_t rkey =
        BindWindow(c, reply_window, Addr(out->data()), capacity, IBV_ACCESS_REMOTE_WRITE,
                   Window::Purpose::kMirrorReply, request_id);
    call->reply_window_ = reply_window;
    const BulkDescriptor reply{Addr(out->data()), capacity, rkey};
    std::memcpy(p, &reply, sizeof(reply));
    p += sizeof(reply);
  }
  if (!message_in_bulk && eager > 0) {
    if (call->request_ != nullptr) {
      call->request_->SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(p));
    } else {
      std::memcpy(p, call->request_bytes_.data(), eager);
    }
  }
  QueueWr(c, msg, kHeader + payload, buffer, invalidate);
  Bump(c->counters_.requests_sent);
  return true;
}

// ---- Server side: a request that arrived with bulk data ---------------------------------------

void Worker::HandleBulkRequest(Connection* c, const MessageHeader& h, const char* payload,
                               const ibv_wc& wc) {
  BulkDescriptor d;
  std::memcpy(&d, payload, sizeof(d));
  const char* p = payload + sizeof(d);
  Incoming in;
  in.header = h;
  if (h.flags & rpc_wire::kFlagReplyChunk) {
    std::memcpy(&in.chunk, p, sizeof(in.chunk));
    p += sizeof(in.chunk);
    in.has_chunk = true;
    if (c->negotiated_.bulk_mode() != control::BULK_MIRROR) {
      return BulkViolation(c, "a reply window outside mirror mode");
    }
  }
  // ValidateHeader guarantees the descriptors fit in the payload; checked again here because
  // an underflow would make the eager part span the rest of memory.
  const size_t consumed = static_cast<size_t>(p - payload);
  if (consumed > h.payload_len) return BulkViolation(c, "bulk descriptors cut short");
  in.eager = absl::string_view(p, h.payload_len - consumed);
  if (d.length == 0 || d.length > c->negotiated_.max_bulk_size()) {
    return BulkViolation(c, absl::StrCat("bulk request of ", d.length, " bytes"));
  }
  const bool with_inv = (wc.wc_flags & IBV_WC_WITH_INV) != 0;
  switch (c->negotiated_.bulk_mode()) {
    case control::BULK_SERVER_EXPOSES: {
      int32_t w = ExposedWindow(c, d.rkey);
      if (w >= 0 && (c->windows_[w].purpose != Window::Purpose::kGrant ||
                     c->windows_[w].addr != d.addr)) {
        w = -1;
      }
      if (w < 0 || d.length > c->windows_[w].length) {
        return BulkViolation(c, "upload names no window granted to this connection");
      }
      Window& win = c->windows_[w];
      const uint32_t grant_size = static_cast<uint32_t>(win.buffer.capacity());
      --c->grants_by_size_[grant_size];
      ChargeBulk(c, &c->granted_bytes_, -static_cast<int64_t>(grant_size));
      if (remote_invalidation(c)) {
        // The window was revoked as this message arrived; the payload can no longer change.
        if (!InvalidatedBy(wc, d.rkey)) {
          return BulkViolation(
              c, absl::StrFormat("upload for request %u was not sealed by SEND_WITH_INV "
                                 "of its window",
                                 h.request_id));
        }
        Bump(c->counters_.windows_remote_invalidated);
        Bump(totals_.windows_remote_invalidated);
        in.bulk = std::move(win.buffer);
        in.bulk.resize(d.length);
        FreeWindow(c, w);
        GrantWindows(c, 1, grant_size);  // replenish: steady state needs no grant round trip
        DispatchCall(c, in);
        return;
      }
      if (with_inv) return BulkViolation(c, "SEND_WITH_INV outside remote invalidation mode");
      // Explicit fallback: revoke it ourselves and run the handler once the revocation is done.
      const int32_t op = NewOp(c);
      BulkOp& o = c->ops_[op];
      o.kind = BulkOp::Kind::kRevokeThenDispatch;
      o.window = w;
      o.admitted = !draining_;
      o.header = h;
      o.eager.assign(in.eager.data(), in.eager.size());
      o.has_chunk = false;
      o.length = d.length;
      win.state = Window::State::kRevoking;
      PostLocalInv(c, win.rkey, op);
      return;
    }
    case control::BULK_UNSAFE_STATIC_RKEY_BENCHMARK_ONLY: {
      if (with_inv) return BulkViolation(c, "SEND_WITH_INV in the static-rkey mode");
      auto it = c->static_granted_.find(d.addr);
      if (it == c->static_granted_.end() || d.length > it->second.capacity() ||
          d.rkey != bulk_pool_->unsafe_rkey()) {
        return BulkViolation(c, "upload names no range granted to this connection");
      }
      const uint32_t grant_size = static_cast<uint32_t>(it->second.capacity());
      in.bulk = std::move(it->second);
      in.bulk.resize(d.length);
      c->static_granted_.erase(it);
      --c->grants_by_size_[grant_size];
      ChargeBulk(c, &c->granted_bytes_, -static_cast<int64_t>(grant_size));
      GrantWindows(c, 1, grant_size);
      DispatchCall(c, in);
      return;
    }
    case control::BULK_MIRROR: {
      if (with_inv) return BulkViolation(c, "SEND_WITH_INV on a mirror-mode request");
      if (draining_) {
        // Refused before its data is read, so that a drain is not kept busy by new requests.
        SendBulkAck(c, h.request_id, d.rkey);
        SendResponseBytes(c, h.request_id, absl::UnavailableError("server is shutting down"), {});
        return;
      }
      auto buffer = bulk_pool_->Allocate(d.length);
      if (!buffer.ok()) {
        // Release the caller's window at once and answer with the reason.
        SendBulkAck(c, h.request_id, d.rkey);
        SendResponseBytes(c, h.request_id, buffer.status(), {});
        return;
      }
      const int32_t op = NewOp(c);
      BulkOp& o = c->ops_[op];
      o.kind = BulkOp::Kind::kMirrorRead;
      o.admitted = true;  // not draining (above)
      o.request_id = h.request_id;
      o.header = h;
      o.eager.assign(in.eager.data(), in.eager.size());
      o.has_chunk = in.has_chunk;
      o.chunk = in.chunk;
      o.length = d.length;
      o.peer_rkey = d.rkey;
      o.buffer = std::move(*buffer);
      PostRdma(c, IBV_WR_RDMA_READ, o.buffer, d.length, d.addr, d.rkey, op);
      return;
    }
    default:
      return BulkViolation(c, "unknown bulk mode");
  }
}

// ---- Server side: answering with bulk data ---------------------------------------------------

void Worker::SendBulkResponse(Connection* c, const Incoming& request, Writer* writer,
                              BulkBuffer data, bool is_message) {
  const uint64_t request_id = request.header.request_id;
  if (bulk_pool_ == nullptr || !bulk_pool_->Contains(data.data(), data.size())) {
    writer->Abandon();
    SendResponseBytes(c, request_id,
                      absl::InternalError("response bulk data is not in registered memory"), {});
    return;
  }
  if (data.size() > c->negotiated_.max_bulk_size()) {
    writer->Abandon();
    SendResponseBytes(c, request_id,
                      absl::ResourceExhaustedError(absl::StrFormat(
                          "bulk response of %u bytes exceeds the negotiated maximum %u",
                          data.size(), c->negotiated_.max_bulk_size())),
                      {});
    return;
  }
  const uint32_t eager = is_message ? 0 : writer->length();
  const uint32_t payload = static_cast<uint32_t>(sizeof(BulkDescriptor) + eager);
  if (payload > c->max_payload_) {
    writer->Abandon();
    SendResponseBytes(c, request_id,
                      absl::ResourceExhaustedError("response message next to bulk data too big"),
                      {});
    return;
  }
  int32_t buffer;
  char* msg = AllocMessage(c, kHeader + payload, &buffer);
  if (msg == nullptr) {
    writer->Abandon();
    FailConnection(c, absl::ResourceExhaustedError("send buffers exhausted"));
    return;
  }
  if (eager > 0) {
    std::memcpy(msg + kHeader + sizeof(BulkDescriptor), writer->data() + kHeader, eager);
  }
  writer->Abandon();
  const uint32_t length = static_cast<uint32_t>(data.size());
  BulkDescriptor d{};
  uint32_t invalidate = 0;
  const control::BulkMode mode = c->negotiated_.bulk_mode();
  // The reply window is for an attachment; a response message carried in bulk is downloaded
  // (the caller's reply window is then revoked by the caller itself when the call completes).
  if (mode == control::BULK_MIRROR && request.has_chunk && !is_message &&
      length <= request.chunk.length) {
    // Mirror: write into the caller's reply window; the response then revokes it.
    const int32_t op = NewOp(c);
    c->ops_[op].kind = BulkOp::Kind::kHold;
    c->ops_[op].buffer = std::move(data);
    PostRdma(c, IBV_WR_RDMA_WRITE, c->ops_[op].buffer, length, request.chunk.addr,
             request.chunk.rkey, op);
    d = {request.chunk.addr, length, request.chunk.rkey};
    if (remote_invalidation(c)) invalidate = request.chunk.rkey;
  } else if (mode == control::BULK_UNSAFE_STATIC_RKEY_BENCHMARK_ONLY) {
    if (bulk_pool_->unsafe_rkey() == 0) {
      if (buffer >= 0) send_pool_->Give(static_cast<uint32_t>(buffer));
      SendResponseBytes(c, request_id,
                        absl::FailedPreconditionError(
                            "the unsafe static-rkey mode exposes only the server's pool"),
                        {});
      return;
    }
    d = {Addr(data.data()), length, bulk_pool_->unsafe_rkey()};
    c->static_download_[request_id] = std::move(data);
  } else {
    // Downloads the peer has not acknowledged keep their buffers out of the worker's pool, which
    // all its connections share: a peer that never acknowledges may hold only so much (and each
    // window only for its lease).
    // The same for all of one client's connections together (bulk_bytes_per_client).
    if (c->download_bytes_ + data.capacity() > options_.download_bytes_per_connection ||
        ClientBulkBytes(c) + data.capacity() > bulk_bytes_per_client_) {
      if (buffer >= 0) send_pool_->Give(static_cast<uint32_t>(buffer));
      SendResponseBytes(c, request_id,
                        absl::ResourceExhaustedError(absl::StrFormat(
                            "a %u-byte download would take this connection's unacknowledged "
                            "downloads (%u bytes) past its limit (%u), or its client's bulk "
                            "memory (%u bytes) past the client's (%u)",
                            data.capacity(), c->download_bytes_,
                            options_.download_bytes_per_connection, ClientBulkBytes(c),
                            bulk_bytes_per_client_)),
                        {});
      return;
    }
    const int32_t w = AcquireWindow(c);
    if (w < 0) {
      if (buffer >= 0) send_pool_->Give(static_cast<uint32_t>(buffer));
      SendResponseBytes(c, request_id,
                        absl::ResourceExhaustedError("no memory window free for the response"), {});
      return;
    }
    const uint32_t rkey = BindWindow(c, w, Addr(data.data()), length, IBV_ACCESS_REMOTE_READ,
                                     Window::Purpose::kDownload, request_id);
    Window& win = c->windows_[w];
    d = {win.addr, length, rkey};
    win.buffer = std::move(data);
    ChargeBulk(c, &c->download_bytes_, static_cast<int64_t>(win.buffer.capacity()));
  }
  *reinterpret_cast<MessageHeader*>(msg) =
      MessageHeader{rpc_wire::kProtocolVersion,
                    rpc_wire::kResponse,
                    rpc_wire::kFlagBulk,
                    0,
                    request_id,
                    0,
                    payload,
                    0,
                    is_message ? static_cast<uint32_t>(rpc_wire::kAuxBulkIsMessage) : 0u};
  std::memcpy(msg + kHeader, &d, sizeof(d));
  Bump(c->counters_.responses_sent);
  EmitMessage(c, msg, kHeader + payload, buffer, invalidate);
}

// ---- Client side: a response with bulk data ----------------------------------------------------

void Worker::HandleBulkResponse(Connection* c, const MessageHeader& h, const char* payload,
                                const ibv_wc& wc) {
  // ValidateHeader guaranteed the descriptor; checked again before reading it all the same.
  if (h.payload_len < sizeof(BulkDescriptor)) return BulkViolation(c, "bulk descriptor cut short");
  BulkDescriptor d;
  std::memcpy(&d, payload, sizeof(d));
  const absl::string_view eager(payload + sizeof(d), h.payload_len - sizeof(d));
  const bool is_message = (h.aux & rpc_wire::kAuxBulkIsMessage) != 0;
  ClientCall* call = PendingCall(c, h.request_id);  // HandleRecv refused a second response
  const bool with_inv = (wc.wc_flags & IBV_WC_WITH_INV) != 0;
  if (d.length == 0 || d.length > c->negotiated_.max_bulk_size()) {
    return BulkViolation(c, absl::StrCat("bulk response of ", d.length, " bytes"));
  }
  // Mirror mode, response written into our reply window.
  if (call != nullptr && call->reply_window_ >= 0 &&
      c->windows_[call->reply_window_].rkey == d.rkey) {
    Window& win = c->windows_[call->reply_window_];
    if (d.addr != win.addr || d.length > win.length) {
      return BulkViolation(c, "response names our reply window with another range");
    }
    if (is_message) return BulkViolation(c, "a response message written into a reply window");
    if (!remote_invalidation(c) && with_inv) {
      // Checked before the slot is released: a violation after that would leave the call with
      // no slot for the connection failure to complete, and its caller waiting forever.
      return BulkViolation(c, "SEND_WITH_INV outside remote invalidation mode");
    }
    ReleaseSlot(c, h.request_id);
    call->response_bulk_->resize(d.length);
    absl::Status status;
    if (call->response_ != nullptr &&
        !call->response_->ParseFromArray(eager.data(), static_cast<int>(eager.size()))) {
      status = absl::DataLossError("response does not parse");
    } else if (call->response_bytes_ != nullptr) {
      call->response_bytes_->assign(eager.data(), eager.size());
    }
    Bump(c->counters_.responses_received);
    if (remote_invalidation(c)) {
      if (!InvalidatedBy(wc, win.rkey)) {
        FinishCall(c, call, absl::DataLossError("the server did not revoke our reply window"));
        return BulkViolation(c, "mirror response did not invalidate the reply window");
      }
      if (win.state == Window::State::kExposed) {
        Bump(c->counters_.windows_remote_invalidated);
        Bump(totals_.windows_remote_invalidated);
        FreeWindow(c, call->reply_window_);
        call->reply_window_ = -1;
      }
      // Otherwise our own revocation (its lease ran out) is under way: the window is freed,
      // once, when it completes, and FinishCall completes the call behind it.
    }
    FinishCall(c, call, std::move(status));
    return;
  }
  if (with_inv) return BulkViolation(c, "unexpected SEND_WITH_INV on a response");
  if (call == nullptr) {
    // The call was cancelled or timed out: release the server's window without reading.
    SendBulkAck(c, h.request_id, d.rkey);
    return;
  }
  BulkBuffer* dest;
  if (is_message) {
    // Not into `scratch_`: in mirror mode it may hold the request, exposed through a window
    // until the server's ack is handled (and a malicious server may never send one), so it
    // is neither overwritten nor given back to the pool here. A message response has no
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
      ReleaseSlot(c, h.request_id);
      SendBulkAck(c, h.request_id, d.rkey);
      FinishCall(
          c, call,
          fresh.ok() ? absl::ResourceExhaustedError("response_bulk is too small") : fresh.status());
      return;
    }
    *dest = std::move(*fresh);
  }
  dest->resize(d.length);
  const int32_t op = NewOp(c);
  BulkOp& o = c->ops_[op];
  o.kind = BulkOp::Kind::kDownloadRead;
  o.call = call;
  o.request_id = h.request_id;
  o.header = h;
  o.eager.assign(eager.data(), eager.size());
  o.length = d.length;
  call->read_op_ = op;
  PostRdma(c, IBV_WR_RDMA_READ, *dest, d.length, d.addr, d.rkey, op);
  // The acknowledgement travels right behind the READ (fenced) and revokes the window.
  SendBulkAck(c, h.request_id, d.rkey);
}

// ---- Either side: acknowledgements and grants -------------------------------------------------

void Worker::HandleBulkAck(Connection* c, const MessageHeader& h, const ibv_wc& wc) {
  if (c->negotiated_.bulk_mode() == control::BULK_UNSAFE_STATIC_RKEY_BENCHMARK_ONLY) {
    if (wc.wc_flags & IBV_WC_WITH_INV) {
      return BulkViolation(c, "SEND_WITH_INV in the static-rkey mode");
    }
    auto it = c->static_download_.find(h.request_id);
    if (it == c->static_download_.end()) return BulkViolation(c, "ack for no download");
    c->static_download_.erase(it);
    return;
  }
  // The rkey names the window; the request id alone would not, since a download window serves
  // one of the peer's calls and a mirror request window one of ours, and the two sides number
  // their calls independently (with calls both ways, the same id can name one of each).
  int32_t w = ExposedWindow(c, h.aux);
  if (w >= 0 && c->windows_[w].purpose != Window::Purpose::kDownload &&
      c->windows_[w].purpose != Window::Purpose::kMirrorRequest) {
    w = -1;
  }
  if (w < 0 || c->windows_[w].request_id != h.request_id) {
    return BulkViolation(c, absl::StrFormat("bulk ack for request %u names no window exposed "
                                            "for it (rkey 0x%x)",
                                            h.request_id, h.aux));
  }
  Window& win = c->windows_[w];
  if (remote_invalidation(c)) {
    // iSER's rule: the invalidated key must be exactly the one granted for this request.
    if (!InvalidatedBy(wc, win.rkey)) {
      return BulkViolation(
          c, absl::StrFormat(
                 "bulk ack for request %u invalidated %s instead of rkey 0x%x", h.request_id,
                 (wc.wc_flags & IBV_WC_WITH_INV) ? absl::StrFormat("rkey 0x%x", wc.invalidated_rkey)
                                                 : std::string("nothing"),
                 win.rkey));
    }
    Bump(c->counters_.windows_remote_invalidated);
    Bump(totals_.windows_remote_invalidated);
    ClientCall* call = nullptr;
    if (win.purpose == Window::Purpose::kMirrorRequest) {
      // The caller's request buffer is ours again.
      call = PendingCall(c, win.request_id);
      if (call != nullptr && call->request_window_ == w) call->request_window_ = -1;
    }
    FreeWindow(c, w);
    if (call != nullptr) FinishIfAbandoned(c, call);
    return;
  }
  if (wc.wc_flags & IBV_WC_WITH_INV) {
    return BulkViolation(c, "SEND_WITH_INV outside remote invalidation mode");
  }
  // Fallback: revoke it ourselves. A mirror request window stays attached to its call until
  // the LOCAL_INV completes, so the call cannot complete (and hand its buffer back) before.
  RevokeWindow(c, w, BulkOp::Kind::kRevoke, false);
}

void Worker::GrantWindows(Connection* c, uint32_t count, uint32_t size) {
  if (bulk_pool_ == nullptr) return;
  const bool unsafe = c->negotiated_.bulk_mode() == control::BULK_UNSAFE_STATIC_RKEY_BENCHMARK_ONLY;
  size = std::min<uint32_t>(size, static_cast<uint32_t>(c->negotiated_.max_bulk_size()));
  count = std::min<uint32_t>({count, c->negotiated_.window_credits(),
                              c->max_payload_ / static_cast<uint32_t>(sizeof(BulkDescriptor))});
  // The message first: windows are bound only once the grant is sure to leave. Without a send
  // buffer now, the grant is owed and the timers send it (the peer's calls wait, not fail).
  int32_t buffer;
  char* msg = AllocMessage(c, kHeader + count * sizeof(BulkDescriptor), &buffer);
  if (msg == nullptr) {
    c->grant_owed_ = true;
    c->grant_owed_size_ = std::max(c->grant_owed_size_, size);
    c->grant_owed_count_ = std::max(c->grant_owed_count_, count);
    return;
  }
  char* descriptors = msg + kHeader;
  uint32_t n = 0;
  // Windows are granted per size class (the pool's), window_credits of each at most, and
  // within the connection's byte budget.
  uint32_t class_size = BulkPool::kMinClass;
  while (class_size < size) class_size <<= 1;
  uint32_t& outstanding = c->grants_by_size_[class_size];
  // The unsafe mode exposes only a pool registered for it (the server's, when it opted in).
  const bool can_expose = !unsafe || bulk_pool_->unsafe_rkey() != 0;
  while (can_expose && n < count && size > 0 && outstanding < c->negotiated_.window_credits() &&
         c->granted_bytes_ + class_size <= options_.grant_bytes_per_connection &&
         ClientBulkBytes(c) + class_size <= bulk_bytes_per_client_) {
    auto pooled = bulk_pool_->Allocate(size);
    if (!pooled.ok()) break;
    // The whole class buffer, but never more than the negotiated maximum (which need not be a
    // power of two): the peer refuses a grant above it.
    BulkDescriptor d{Addr(pooled->data()),
                     static_cast<uint32_t>(std::min<uint64_t>(pooled->capacity(),
                                                              c->negotiated_.max_bulk_size())),
                     0};
    if (unsafe) {
      d.rkey = bulk_pool_->unsafe_rkey();
      c->static_granted_[d.addr] = std::move(*pooled);
    } else {
      const int32_t w = AcquireWindow(c);
      if (w < 0) break;
      d.rkey =
          BindWindow(c, w, d.addr, d.length, IBV_ACCESS_REMOTE_WRITE, Window::Purpose::kGrant, 0);
      c->windows_[w].buffer = std::move(*pooled);
    }
    ++outstanding;
    ChargeBulk(c, &c->granted_bytes_, class_size);  // given back as the buffer's capacity
    std::memcpy(descriptors + n * sizeof(d), &d, sizeof(d));
    ++n;
    Bump(c->counters_.windows_granted);
    Bump(totals_.windows_granted);
  }
  if (n == 0 && outstanding > 0) {
    // Every window of this class is in the peer's hands: since it asked, they are in flight
    // (it would have used an idle one), and each arriving upload brings a replacement. An
    // empty grant now would tell it to give up on calls that only have to wait.
    if (buffer >= 0) send_pool_->Give(static_cast<uint32_t>(buffer));
    return;
  }
  const uint32_t payload = static_cast<uint32_t>(n * sizeof(BulkDescriptor));
  *reinterpret_cast<MessageHeader*>(msg) =
      MessageHeader{rpc_wire::kProtocolVersion, rpc_wire::kWindowGrant, 0, 0, 0, 0, payload, 0, n};
  EmitMessage(c, msg, kHeader + payload, buffer, 0);
}

// A grant owed for want of a send buffer (GrantWindows), retried from the timers.
void Worker::SendOwedGrant(Connection* c) {
  const uint32_t size = c->grant_owed_size_;
  const uint32_t count = c->grant_owed_count_;
  c->grant_owed_ = false;
  c->grant_owed_size_ = c->grant_owed_count_ = 0;
  GrantWindows(c, count, size);
}

void Worker::HandleWindowGrant(Connection* c, const MessageHeader& h, const char* payload) {
  // Either side may ask (whoever makes calls with bulk data: server-to-client calls too). A
  // request names the size it needs in request_id; a grant has request_id 0.
  if (h.request_id != 0) {
    if (h.payload_len != 0 || h.request_id > c->negotiated_.max_bulk_size()) {
      return BulkViolation(c, "malformed window request");
    }
    if (c->negotiated_.bulk_mode() == control::BULK_MIRROR) {
      return BulkViolation(c, "window request in mirror mode");
    }
    GrantWindows(c, std::min<uint32_t>(h.aux, c->negotiated_.window_credits()),
                 static_cast<uint32_t>(h.request_id));
    return;
  }
  // A server may grant window_credits windows of each size class; more is a violation.
  const size_t limit = static_cast<size_t>(c->negotiated_.window_credits()) * 32;
  if (h.payload_len != h.aux * sizeof(BulkDescriptor) || c->grants_.size() + h.aux > limit) {
    return BulkViolation(c, "malformed or excessive window grant");
  }
  for (uint32_t i = 0; i < h.aux; ++i) {
    BulkDescriptor d;
    std::memcpy(&d, payload + i * sizeof(d), sizeof(d));
    if (d.length == 0 || d.length > c->negotiated_.max_bulk_size()) {
      return BulkViolation(c, "window grant of a bad size");
    }
    c->grants_.push_back(d);
  }
  c->grant_requested_ = false;
  if (h.aux == 0) {
    // The server could not grant anything: calls waiting for a window fail rather than hang.
    for (ClientCall* call : UnlinkBacklog(c, [](const ClientCall* call) {
           return call->request_bulk_ != nullptr || call->scratch_;
         })) {
      FinishCall(c, call, absl::ResourceExhaustedError("the peer has no upload window to grant"));
    }
  }
  PumpBacklog(c);
}

// ---- Completions of bulk operations -------------------------------------------------------------

void Worker::HandleBulkOp(Connection* c, int32_t op, const ibv_wc& wc) {
  BulkOp o = std::move(c->ops_[op]);
  c->ops_[op] = BulkOp();
  c->free_ops_.push_back(op);
  // A failed WR means the QP is in (or going to) ERR: no data moves any more and no window bound
  // to it can be used, so calls waiting on this op may complete; the rest is for the teardown.
  const bool ok = wc.status == IBV_WC_SUCCESS;
  switch (o.kind) {
    case BulkOp::Kind::kDownloadRead: {
      if (o.cancelled) {
        // The caller gave up while the READ was writing into its buffer; now it may have it.
        o.call->read_op_ = -1;
        if (o.header.aux & rpc_wire::kAuxBulkIsMessage) o.call->owned_response_bulk_.Release();
        FinishCall(c, o.call, std::move(o.status));
        return;
      }
      if (!ok) {
        if (o.call != nullptr) o.call->read_op_ = -1;  // its slot is failed with the connection
        return;
      }
      ClientCall* call = ReleaseSlot(c, o.request_id);
      if (call == nullptr) return;
      call->read_op_ = -1;
      Bump(c->counters_.responses_received);
      absl::Status status;
      const bool is_message = (o.header.aux & rpc_wire::kAuxBulkIsMessage) != 0;
      absl::string_view message =
          is_message ? call->owned_response_bulk_.view() : absl::string_view(o.eager);
      if (call->response_ != nullptr &&
          !call->response_->ParseFromArray(message.data(), static_cast<int>(message.size()))) {
        status = absl::DataLossError("response does not parse");
      } else if (call->response_bytes_ != nullptr) {
        call->response_bytes_->assign(message.data(), message.size());
      }
      if (is_message) call->owned_response_bulk_.Release();
      FinishCall(c, call, std::move(status));
      return;
    }
    case BulkOp::Kind::kMirrorRead: {
      if (!ok) return;
      SendBulkAck(c, o.request_id, o.peer_rkey);
      Incoming in;
      in.header = o.header;
      in.eager = o.eager;
      in.bulk = std::move(o.buffer);
      in.bulk.resize(o.length);
      in.has_chunk = o.has_chunk;
      in.chunk = o.chunk;
      in.admitted = o.admitted;
      DispatchCall(c, in);
      return;
    }
    case BulkOp::Kind::kRevoke:
    case BulkOp::Kind::kRevokeThenComplete: {
      if (ok) {
        Bump(o.lease_expired ? c->counters_.windows_lease_expired
                             : c->counters_.windows_locally_invalidated);
        Bump(o.lease_expired ? totals_.windows_lease_expired : totals_.windows_locally_invalidated);
      }
      ClientCall* call = o.call;
      if (o.kind == BulkOp::Kind::kRevoke) {
        // A mirror window revoked under a call still waiting for its response (fallback ack,
        // lease expiry): the call must forget it before the window serves another call.
        const Window& win = c->windows_[o.window];
        if (win.purpose == Window::Purpose::kMirrorRequest ||
            win.purpose == Window::Purpose::kMirrorReply) {
          ClientCall* owner = PendingCall(c, win.request_id);
          if (owner != nullptr && owner->request_window_ == o.window) owner->request_window_ = -1;
          if (owner != nullptr && owner->reply_window_ == o.window) owner->reply_window_ = -1;
          FreeWindow(c, o.window);
          if (owner != nullptr) FinishIfAbandoned(c, owner);
          return;
        }
      }
      FreeWindow(c, o.window);
      if (o.kind == BulkOp::Kind::kRevokeThenComplete && call != nullptr) {
        if (call->request_window_ == o.window) call->request_window_ = -1;
        if (call->reply_window_ == o.window) call->reply_window_ = -1;
        if (call->request_window_ < 0 && call->reply_window_ < 0) {
          call->scratch_.Release();
          CompleteLocally(call, std::move(o.status));
        }
      }
      return;
    }
    case BulkOp::Kind::kRevokeThenDispatch: {
      if (!ok) return;
      Bump(c->counters_.windows_locally_invalidated);
      Bump(totals_.windows_locally_invalidated);
      Window& win = c->windows_[o.window];
      const uint32_t grant_size = static_cast<uint32_t>(win.buffer.capacity());
      Incoming in;
      in.header = o.header;
      in.eager = o.eager;
      in.bulk = std::move(win.buffer);
      in.bulk.resize(o.length);
      FreeWindow(c, o.window);
      GrantWindows(c, 1, grant_size);
      in.admitted = o.admitted;
      DispatchCall(c, in);
      return;
    }
    case BulkOp::Kind::kUploadWrite:
      if (o.call != nullptr) {
        o.call->write_op_ = -1;
        // The caller gave up meanwhile (its slot is gone): its buffer is free now.
        if (o.cancelled) FinishCall(c, o.call, std::move(o.status));
      }
      return;
    case BulkOp::Kind::kHold:
    case BulkOp::Kind::kNone:
      return;
  }
}

void Worker::FinishCall(Connection* c, ClientCall* call, absl::Status status) {
  if (call->write_op_ >= 0) {
    // Answered (or failed) with its upload WRITE's completion not yet seen: the server placed
    // the data before it saw the request, so the WRITE is done with the buffer.
    c->ops_[call->write_op_].call = nullptr;
    call->write_op_ = -1;
  }
  if (c->state_.load(std::memory_order_relaxed) >= Connection::State::kClosing) {
    // The QP is in ERR: its windows are unusable, nothing waits on a revocation.
    call->scratch_.Release();
    call->request_window_ = call->reply_window_ = -1;
    CompleteLocally(call, std::move(status));
    return;
  }
  // Mirror mode: buffers still exposed are revoked before the caller gets them back (and
  // `scratch_`, which a request window may expose, is kept until then).
  const int32_t windows[2] = {call->request_window_, call->reply_window_};
  bool pending = false;
  for (int32_t w : windows) {
    if (w < 0) continue;
    Window& win = c->windows_[w];
    if (win.state == Window::State::kExposed) {
      const int32_t op = RevokeWindow(c, w, BulkOp::Kind::kRevokeThenComplete, false);
      BulkOp& o = c->ops_[op];
      o.call = call;
      o.status = status;
      pending = true;
    } else if (win.state == Window::State::kRevoking && win.revoke_op >= 0) {
      // A revocation is already on its way (fallback ack, lease): complete behind it.
      BulkOp& o = c->ops_[win.revoke_op];
      o.kind = BulkOp::Kind::kRevokeThenComplete;
      o.call = call;
      o.status = status;
      pending = true;
    }
  }
  if (!pending) {
    call->scratch_.Release();
    call->request_window_ = -1;
    call->reply_window_ = -1;
    CompleteLocally(call, std::move(status));
  }
}

ClientCall* Worker::PendingCall(Connection* c, uint64_t request_id) const {
  const uint32_t slot = static_cast<uint32_t>(request_id);
  if (slot >= c->pending_.size() || c->generation_[slot] != (request_id >> 32)) return nullptr;
  return c->pending_[slot];
}

bool Worker::DeferIfReading(Connection* c, ClientCall* call, absl::Status status) {
  const int32_t op = call->read_op_ >= 0 ? call->read_op_ : call->write_op_;
  if (op < 0) return false;
  BulkOp& o = c->ops_[op];
  o.cancelled = true;
  o.call = call;
  o.status = std::move(status);
  return true;
}

bool Worker::DeferIfExposing(Connection* c, ClientCall* call, absl::Status status) {
  if (!call->abandoned_status_.ok()) return true;  // given up on already
  bool exposed = false;
  for (int32_t w : {call->request_window_, call->reply_window_}) {
    if (w >= 0 && c->windows_[w].state == Window::State::kExposed) exposed = true;
  }
  if (!exposed) return false;
  call->abandoned_status_ = std::move(status);  // never OK: a cancel or a deadline
  call->deadline_ = absl::InfiniteFuture();
  return true;
}

void Worker::FinishIfAbandoned(Connection* c, ClientCall* call) {
  if (call->abandoned_status_.ok() || call->request_window_ >= 0 || call->reply_window_ >= 0) {
    return;
  }
  // The server is done with our memory; a response still on its way finds no call.
  ReleaseSlot(c, call->request_id_);
  call->scratch_.Release();
  CompleteLocally(call, absl::OkStatus());  // completes with the abandoned status
}

void Worker::SettleBulkOps(Connection* c) {
  // Runs before pending calls are failed: calls that still hold a slot are left to that, calls
  // that already gave theirs up (waiting on a revocation or a cancelled READ) complete here.
  std::vector<std::pair<ClientCall*, absl::Status>> settle;
  for (BulkOp& o : c->ops_) {
    if (o.call == nullptr) continue;
    ClientCall* call = o.call;
    const bool gave_up_slot = o.kind == BulkOp::Kind::kRevokeThenComplete || o.cancelled;
    if (o.kind == BulkOp::Kind::kDownloadRead) call->read_op_ = -1;
    if (o.kind == BulkOp::Kind::kUploadWrite) call->write_op_ = -1;
    if (gave_up_slot) {
      bool seen = false;
      for (auto& [other, s] : settle) seen |= other == call;
      if (!seen) settle.emplace_back(call, std::move(o.status));
    }
    o.kind = BulkOp::Kind::kNone;  // its flushed completion, if any, finds nothing to do
    o.call = nullptr;
  }
  for (auto& [call, status] : settle) {
    call->scratch_.Release();
    call->request_window_ = call->reply_window_ = -1;
    CompleteLocally(call, std::move(status));
  }
}

void Worker::BulkTimers(Connection* c, absl::Time now) {
  for (size_t i = 0; i < c->windows_.size(); ++i) {
    Window& win = c->windows_[i];
    if (win.state != Window::State::kExposed || win.lease > now) continue;
    // Not acknowledged in time: the exposing side revokes it itself.
    SWIRL_LOG(INFO, "%s: connection %u: window for request %u not acknowledged in %s; revoking",
              options_.name, c->id_, win.request_id, absl::FormatDuration(options_.window_lease));
    RevokeWindow(c, static_cast<int32_t>(i), BulkOp::Kind::kRevoke, true);
  }
}

void Worker::ReleaseBulk(Connection* c) {
  // The connection is gone: deallocating a window revokes it, whatever state it was in.
  for (Window& win : c->windows_) {
    if (win.state != Window::State::kFree) {
      Bump(c->counters_.windows_locally_invalidated);
      Bump(totals_.windows_locally_invalidated);
      windows_exposed_.store(windows_exposed_.load(std::memory_order_relaxed) - 1,
                             std::memory_order_relaxed);
    }
  }
  c->windows_.clear();
  c->window_by_index_.clear();
  c->free_windows_.clear();
  c->ops_.clear();
  c->free_ops_.clear();
  c->static_granted_.clear();
  c->static_download_.clear();
  c->grants_.clear();
}

}  // namespace internal
}  // namespace swirl
