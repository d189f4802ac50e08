// Bulk transfers through per-request memory windows, revoked by the peer's SEND_WITH_INV
// (docs/BULK.md describes the protocol). This file keeps the windows, the bulk operations and
// their completions, acknowledgements and upload grants; bulk_upload.cc and bulk_download.cc
// move the data.
//
// Invariants worth keeping in mind while reading:
//   * every window is type 2, bound to this connection's QP, over exactly one buffer, with a
//     fresh random key byte per binding (a fresh random key slot where the device draws one);
//     a pool MR's own rkey never grants remote access;
//   * a SEND_WITH_INV is only ever expected on (a) an upload request naming its grant, (b) a
//     bulk ack naming a download window, (c) a mirror-mode response naming the caller's reply
//     window. Any other invalidation, or a missing one, is a protocol violation and ends the
//     connection (as iSER does). CheckSeal is the one place that decides;
//   * memory a window exposed is reused only after the window is revoked: by the peer's
//     SEND_WITH_INV (checked against the key we granted), by our LOCAL_INV's completion, or by
//     deallocating the window when the connection is gone.

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/check.h"
#include "base/log.h"
#include "rpc/handshake.h"
#include "rpc/worker.h"

namespace swirl::internal {
namespace {

using rpc_wire::BulkDescriptor;
using rpc_wire::MessageHeader;

void Decrement(std::atomic<uint64_t>& counter, uint64_t n = 1) {
  counter.store(counter.load(std::memory_order_relaxed) - n, std::memory_order_relaxed);
}

}  // namespace

// ---- Windows -----------------------------------------------------------------------------------

int32_t Worker::AcquireWindow(Connection* c) {
  WindowTable& windows = c->windows();
  const int32_t w = windows.TakeFree();
  if (w >= 0 || !windows.can_grow()) return w;
  // A window is a device object (the soft device has 65,536 per process, a NIC its max_mw):
  // one client's connections together may hold only so many, whatever each may on its own.
  if (options_.max_windows_per_client != 0 &&
      ClientWindows(c) >= options_.max_windows_per_client) {
    return -1;
  }
  // Windows are allocated once per connection and reused (ydb's lesson: ibv_alloc_mw per
  // request is far too slow); each reuse gets a fresh key.
  auto mw = verbs::MemoryWindow::Allocate(pd_, IBV_MW_TYPE_2);
  if (!mw.ok()) {
    SWIRL_LOG(WARNING, "%s: %s", options_.name, mw.status().ToString());
    return -1;
  }
  const uint32_t rkey = (*mw)->rkey();
  // Whether the device keeps window leases itself (the soft device; a NIC does not): every
  // window of the device answers the same.
  device_leases_ = (*mw)->SetDeadline(absl::InfiniteFuture()).ok();
  ChargeWindows(c, 1);  // until the connection closes (FinishClose)
  return windows.Add(std::move(*mw), rkey);
}

uint32_t Worker::BindWindow(Connection* c, int32_t w, uint64_t addr, uint32_t length, int access,
                            Window::Purpose purpose, uint64_t request_id) {
  SWIRL_DCHECK(OnLoopThread());
  WindowTable& windows = c->windows();
  verbs::MemoryWindow& mw = *windows.at(w).mw;
  // Beyond RoCE, where the device can: a fresh random key slot per bind (about 31 random bits
  // of rkey, not the 8 of a key byte), and the lease in the device's key entry, so that its
  // responder itself refuses an access after it, whenever our LOCAL_INV gets there. A NIC has
  // neither (Unimplemented): the key byte changes and our timer's LOCAL_INV ends the lease.
  uint32_t rkey = 0;
  if (fresh_rkeys_) {
    absl::StatusOr<uint32_t> fresh = mw.FreshRkey();
    if (fresh.ok()) {
      rkey = *fresh;
    } else if (absl::IsUnimplemented(fresh.status())) {
      fresh_rkeys_ = false;
    }  // else no slot free: this bind stays in the window's slot
  }
  if (rkey == 0) rkey = windows.NextRkey(w, bitgen_);
  const absl::Time lease = purpose == Window::Purpose::kGrant
                               ? absl::InfiniteFuture()
                               : absl::Now() + options_.window_lease;
  // Before the bind is posted: the lease belongs to the window and holds for its next binds
  // (a grant's "none" included) until changed.
  if (device_leases_) {
    if (absl::Status s = mw.SetDeadline(lease); !s.ok()) {
      SWIRL_LOG(WARNING, "%s: %s", options_.name, s.ToString());
    }
  }
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_BIND_MW;
  wr.bind_mw.mw = mw.get();
  wr.bind_mw.rkey = rkey;
  wr.bind_mw.bind_info.mr = bulk_pool_->mr();
  wr.bind_mw.bind_info.addr = addr;
  wr.bind_mw.bind_info.length = length;
  wr.bind_mw.bind_info.mw_access_flags = static_cast<unsigned int>(access);
  outbox_.QueueRaw(c, wr, nullptr, -1);
  windows.Expose(w, rkey, addr, length, purpose, request_id, lease);
  Bump(windows_exposed_);
  return rkey;
}

void Worker::RevokeWindow(Connection* c, int32_t w, int32_t index) {
  c->windows().BeginRevoke(w, index);
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_LOCAL_INV;
  wr.invalidate_rkey = c->windows().at(w).rkey;
  outbox_.QueueRaw(c, wr, nullptr, index);
}

int32_t Worker::NewRevoke(Connection* c, int32_t w, bool lease_expired) {
  int32_t index;
  bulk_op::Revoke& revoke = c->ops().Emplace<bulk_op::Revoke>(&index);
  revoke.window = w;
  revoke.lease_expired = lease_expired;
  return index;
}

void Worker::FreeWindow(Connection* c, int32_t w) {
  Window& window = c->windows().at(w);
  if (window.purpose == Window::Purpose::kDownload) {
    ChargeBulk(c, &c->download_bytes, -static_cast<int64_t>(window.buffer.capacity()));
  }
  c->windows().Free(w);
  Decrement(windows_exposed_);
}

void Worker::PostRdma(Connection* c, ibv_wr_opcode opcode, const BulkBuffer& local,
                      uint32_t length, uint64_t remote_addr, uint32_t rkey, int32_t op) {
  ibv_sge sge{Addr(local.data()), length, bulk_pool_->lkey()};
  ibv_send_wr wr{};
  wr.opcode = opcode;
  wr.wr.rdma.remote_addr = remote_addr;
  wr.wr.rdma.rkey = rkey;
  outbox_.QueueRaw(c, wr, &sge, op);
}

std::optional<bool> Worker::CheckSeal(Connection* c, const ibv_wc& wc, uint32_t rkey,
                                      absl::string_view what) {
  const bool with_inv = (wc.wc_flags & IBV_WC_WITH_INV) != 0;
  if (c->remote_invalidation()) {
    // iSER's rule: the invalidated key must be exactly the one granted for this request.
    if (with_inv && wc.invalidated_rkey == rkey) return true;
    BulkViolation(c, absl::StrFormat(
                         "%s invalidated %s instead of rkey 0x%x", what,
                         with_inv ? absl::StrFormat("rkey 0x%x", wc.invalidated_rkey) : "nothing",
                         rkey));
    return std::nullopt;
  }
  if (with_inv) {
    BulkViolation(c, absl::StrCat(what, ": SEND_WITH_INV outside remote invalidation mode"));
    return std::nullopt;
  }
  return false;  // the local fallback: this side revokes the window
}

void Worker::BulkViolation(Connection* c, const std::string& why) {
  Bump(c->counters().invalidation_violations);
  Bump(totals_.invalidation_violations);
  ProtocolError(c, absl::PermissionDeniedError(why));
}

uint64_t Worker::ClientBulkBytes(const Connection* c) const {
  auto it = client_holdings_.find(c->client_key());
  return it == client_holdings_.end() ? 0 : it->second.bulk_bytes;
}

uint32_t Worker::ClientWindows(const Connection* c) const {
  auto it = client_holdings_.find(c->client_key());
  return it == client_holdings_.end() ? 0 : it->second.windows;
}

void Worker::ChargeBulk(Connection* c, uint64_t* counter, int64_t delta) {
  *counter += static_cast<uint64_t>(delta);
  if (delta == 0) return;
  auto it = client_holdings_.try_emplace(c->client_key()).first;
  it->second.bulk_bytes += static_cast<uint64_t>(delta);
  if (it->second.bulk_bytes == 0 && it->second.windows == 0) client_holdings_.erase(it);
  bulk_bytes_charged_.store(bulk_bytes_charged_.load(std::memory_order_relaxed) +
                                static_cast<uint64_t>(delta),
                            std::memory_order_relaxed);
}

void Worker::ChargeWindows(Connection* c, int32_t delta) {
  if (delta == 0) return;
  auto it = client_holdings_.try_emplace(c->client_key()).first;
  it->second.windows += static_cast<uint32_t>(delta);
  if (it->second.bulk_bytes == 0 && it->second.windows == 0) client_holdings_.erase(it);
}

void Worker::BulkTimers(Connection* c, absl::Time now) {
  c->windows().ForEachExpired(now, [&](int32_t w) {
    // Not acknowledged in time: the exposing side revokes it itself.
    SWIRL_LOG(INFO, "%s: connection %u: window for request %u not acknowledged in %s; revoking",
              options_.name, c->id(), c->windows().at(w).request_id,
              absl::FormatDuration(options_.window_lease));
    RevokeWindow(c, w, NewRevoke(c, w, /*lease_expired=*/true));
  });
}

void Worker::ReleaseBulk(Connection* c) {
  // The connection is gone: deallocating a window revokes it, whatever state it was in.
  const uint32_t live = c->windows().Clear();
  Bump(c->counters().windows_locally_invalidated, live);
  Bump(totals_.windows_locally_invalidated, live);
  Decrement(windows_exposed_, live);
  c->ops().Clear();
  c->grants().Clear();
  // Mirror-mode requests that waited for a READ will never get one (nor an answer).
  work_.Leave(static_cast<uint32_t>(c->mirror_waiting.size()));
  c->mirror_waiting.clear();
}

// ---- Acknowledgements --------------------------------------------------------------------------

void Worker::SendBulkAck(Connection* c, uint64_t request_id, uint32_t rkey) {
  int32_t buffer;
  char* data = outbox_.Alloc(kHeader, &buffer);
  if (data == nullptr) {
    FailConnection(c, absl::ResourceExhaustedError("send buffers exhausted"));
    return;
  }
  *reinterpret_cast<MessageHeader*>(data) = MessageHeader{
      .version = rpc_wire::kProtocolVersion,
      .type = rpc_wire::kBulkAck,
      .request_id = request_id,
      .aux = rkey,
  };
  // Fenced: an RDMA READ just posted on this QP finishes before the window goes away. Through
  // Emit, so that without a credit it waits in line, ahead of the response to the same request
  // that the peer must not see first.
  outbox_.Emit(c, data, kHeader, buffer, c->remote_invalidation() ? rkey : 0, IBV_SEND_FENCE);
}

void Worker::HandleBulkAck(Connection* c, const MessageHeader& h, const ibv_wc& wc) {
  // The rkey names the window; the request id alone would not, since a download window serves
  // one of the peer's calls and a mirror request window one of ours, and the two sides number
  // their calls independently (with calls both ways, the same id can name one of each).
  int32_t w = c->windows().FindExposed(h.aux);
  if (w >= 0 && c->windows().at(w).purpose != Window::Purpose::kDownload &&
      c->windows().at(w).purpose != Window::Purpose::kMirrorRequest) {
    w = -1;
  }
  if (w < 0 || c->windows().at(w).request_id != h.request_id) {
    return BulkViolation(c, absl::StrFormat("bulk ack for request %u names no window exposed "
                                            "for it (rkey 0x%x)",
                                            h.request_id, h.aux));
  }
  const Window& win = c->windows().at(w);
  const std::optional<bool> revoked =
      CheckSeal(c, wc, win.rkey, absl::StrFormat("bulk ack for request %u", h.request_id));
  if (!revoked.has_value()) return;
  if (!*revoked) {
    // Fallback: revoke it ourselves. A mirror request window stays attached to its call until
    // the LOCAL_INV completes, so the call cannot complete (and hand its buffer back) before.
    RevokeWindow(c, w, NewRevoke(c, w, /*lease_expired=*/false));
    return;
  }
  Bump(c->counters().windows_remote_invalidated);
  Bump(totals_.windows_remote_invalidated);
  CallState* s = nullptr;
  if (win.purpose == Window::Purpose::kMirrorRequest) {
    // The caller's request buffer is ours again.
    s = c->calls().Find(win.request_id);
    if (s != nullptr && s->request_window == w) s->request_window = -1;
  }
  FreeWindow(c, w);
  if (s != nullptr) FinishIfAbandoned(c, *s);
}

// ---- Upload grants -----------------------------------------------------------------------------

bool Worker::GrantOne(Connection* c, uint32_t size, uint32_t class_size, BulkDescriptor* out) {
  if (c->granted.bytes + class_size > options_.grant_bytes_per_connection ||
      ClientBulkBytes(c) + class_size > bulk_bytes_per_client_) {
    return false;
  }
  auto pooled = bulk_pool_->Allocate(size);
  if (!pooled.ok()) return false;
  const int32_t w = AcquireWindow(c);
  if (w < 0) return false;
  // The whole class buffer, but never more than the negotiated maximum (which need not be a
  // power of two): the peer refuses a grant above it.
  const uint32_t length = static_cast<uint32_t>(
      std::min<uint64_t>(pooled->capacity(), c->negotiated().max_bulk_size()));
  const uint64_t addr = Addr(pooled->data());
  const uint32_t rkey =
      BindWindow(c, w, addr, length, IBV_ACCESS_REMOTE_WRITE, Window::Purpose::kGrant, 0);
  c->windows().at(w).buffer = std::move(*pooled);
  ChargeBulk(c, &c->granted.bytes, class_size);  // given back as the buffer's capacity
  *out = BulkDescriptor{addr, length, rkey};
  Bump(c->counters().windows_granted);
  Bump(totals_.windows_granted);
  return true;
}

void Worker::GrantWindows(Connection* c, uint32_t count, uint32_t size) {
  SWIRL_DCHECK(OnLoopThread());
  if (bulk_pool_ == nullptr) return;
  size = std::min<uint32_t>(size, static_cast<uint32_t>(c->negotiated().max_bulk_size()));
  count = std::min<uint32_t>({count, c->negotiated().window_credits(),
                              c->max_payload() / static_cast<uint32_t>(sizeof(BulkDescriptor))});
  // The message first: windows are bound only once the grant is sure to leave. Without a send
  // buffer now, the grant is owed and the timers send it (the peer's calls wait, not fail).
  int32_t buffer;
  char* msg = outbox_.Alloc(kHeader + count * sizeof(BulkDescriptor), &buffer);
  if (msg == nullptr) {
    c->granted.owed = true;
    c->granted.owed_size = std::max(c->granted.owed_size, size);
    c->granted.owed_count = std::max(c->granted.owed_count, count);
    return;
  }
  // Windows are granted per size class (the pool's), window_credits of each at most, and
  // within the connection's byte budget.
  // 64-bit, so that no size can wrap it to zero (negotiation caps sizes at kMaxBulkSize).
  uint64_t class_size = BulkPool::kMinClass;
  while (class_size < size) class_size <<= 1;
  if (class_size > kMaxBulkSize) return outbox_.Give(buffer);
  uint32_t& outstanding = c->granted.by_class[static_cast<uint32_t>(class_size)];
  uint32_t n = 0;
  BulkDescriptor d;
  while (n < count && size > 0 && outstanding < c->negotiated().window_credits() &&
         GrantOne(c, size, static_cast<uint32_t>(class_size), &d)) {
    std::memcpy(msg + kHeader + n * sizeof(d), &d, sizeof(d));
    ++outstanding;
    ++n;
  }
  if (n == 0 && outstanding > 0) {
    // Every window of this class is in the peer's hands: since it asked, they are in flight
    // (it would have used an idle one), and each arriving upload brings a replacement. An
    // empty grant now would tell it to give up on calls that only have to wait.
    outbox_.Give(buffer);
    return;
  }
  const uint32_t payload = static_cast<uint32_t>(n * sizeof(BulkDescriptor));
  *reinterpret_cast<MessageHeader*>(msg) = MessageHeader{
      .version = rpc_wire::kProtocolVersion,
      .type = rpc_wire::kWindowGrant,
      .payload_len = payload,
      .aux = n,
  };
  outbox_.Emit(c, msg, kHeader + payload, buffer, 0);
}

// A grant owed for want of a send buffer (GrantWindows), retried from the timers.
void Worker::SendOwedGrant(Connection* c) {
  const uint32_t size = c->granted.owed_size;
  const uint32_t count = c->granted.owed_count;
  c->granted.owed = false;
  c->granted.owed_size = c->granted.owed_count = 0;
  GrantWindows(c, count, size);
}

void Worker::HandleWindowRequest(Connection* c, const MessageHeader& h) {
  // Either side may ask (whoever makes calls with bulk data: server-to-client calls too). A
  // request names the size it needs in request_id.
  if (h.payload_len != 0 || h.request_id > c->negotiated().max_bulk_size()) {
    return BulkViolation(c, "malformed window request");
  }
  if (c->negotiated().bulk_mode() == control::BULK_MIRROR) {
    return BulkViolation(c, "window request in mirror mode");
  }
  // Upload windows are for calls with bulk requests to this side's services: a channel that
  // offers none has nothing to grant them for, and would only let a server pin its pool.
  if (!c->is_server() && (c->methods() == nullptr || c->methods()->empty())) {
    return BulkViolation(c, "window request to a channel that offers no services");
  }
  GrantWindows(c, std::min<uint32_t>(h.aux, c->negotiated().window_credits()),
               static_cast<uint32_t>(h.request_id));
}

void Worker::HandleWindowGrant(Connection* c, const MessageHeader& h, const char* payload) {
  if (h.request_id != 0) return HandleWindowRequest(c, h);
  // A server may grant window_credits windows of each size class; more is a violation.
  const size_t limit = static_cast<size_t>(c->negotiated().window_credits()) * 32;
  if (h.payload_len != h.aux * sizeof(BulkDescriptor) || c->grants().size() + h.aux > limit) {
    return BulkViolation(c, "malformed or excessive window grant");
  }
  for (uint32_t i = 0; i < h.aux; ++i) {
    BulkDescriptor d;
    std::memcpy(&d, payload + i * sizeof(d), sizeof(d));
    if (d.length == 0 || d.length > c->negotiated().max_bulk_size()) {
      return BulkViolation(c, "window grant of a bad size");
    }
    c->grants().Add(d);
  }
  c->grants().requested = false;
  if (h.aux == 0) {
    // The server could not grant anything: calls waiting for a window fail rather than hang.
    for (CallState* s : c->calls().Unlink([](const CallState& s) {
           return s.call->request_bulk_ != nullptr || static_cast<bool>(s.scratch);
         })) {
      FinishCall(c, *s, absl::ResourceExhaustedError("the peer has no upload window to grant"));
    }
  }
  PumpBacklog(c);
}

// ---- Completions of bulk operations ------------------------------------------------------------

void Worker::HandleBulkOp(Connection* c, int32_t index, const ibv_wc& wc) {
  BulkOp op = c->ops().Take(index);
  // A failed WR means the QP is in (or going to) ERR: no data moves any more and no window bound
  // to it can be used, so calls waiting on this op may complete; the rest is for the teardown.
  const bool ok = wc.status == IBV_WC_SUCCESS;
  if (auto* o = std::get_if<bulk_op::DownloadRead>(&op)) {
    CompleteDownload(c, *o, ok);
  } else if (auto* o = std::get_if<bulk_op::MirrorRead>(&op)) {
    // The READ is over either way: its buffer leaves the mirror budget (the handler's now).
    ChargeBulk(c, &c->mirror_bytes, -static_cast<int64_t>(o->buffer.capacity()));
    --c->mirror_reads;
    if (!ok) return;
    SendBulkAck(c, o->request.header.request_id, o->peer_rkey);
    DispatchDeferred(c, o->request, std::move(o->buffer));
    PumpMirrorReads(c);
  } else if (auto* o = std::get_if<bulk_op::Revoke>(&op)) {
    CompleteRevoke(c, o->window, o->lease_expired, ok);
  } else if (auto* o = std::get_if<bulk_op::RevokeThenComplete>(&op)) {
    CompleteRevokeThenComplete(c, *o, ok);
  } else if (auto* o = std::get_if<bulk_op::RevokeThenDispatch>(&op)) {
    if (!ok) return;
    Bump(c->counters().windows_locally_invalidated);
    Bump(totals_.windows_locally_invalidated);
    Window& win = c->windows().at(o->window);
    const uint32_t grant_size = static_cast<uint32_t>(win.buffer.capacity());
    BulkBuffer bulk = std::move(win.buffer);
    FreeWindow(c, o->window);
    GrantWindows(c, 1, grant_size);
    DispatchDeferred(c, o->request, std::move(bulk));
  } else if (auto* o = std::get_if<bulk_op::UploadWrite>(&op)) {
    if (o->call == nullptr) return;
    o->call->write_op = -1;
    // The caller gave up meanwhile (its slot is gone): its buffer is free now.
    if (o->cancelled) FinishCall(c, *o->call, std::move(o->status));
  } else if (auto* o = std::get_if<bulk_op::Hold>(&op)) {
    // A reply written into a mirror-mode caller's window: its buffer goes back to the pool now
    // and leaves the connection's mirror budget, which may let a waiting request's READ start.
    ChargeBulk(c, &c->mirror_bytes, -static_cast<int64_t>(o->buffer.capacity()));
    o->buffer.Release();
    if (ok) PumpMirrorReads(c);
  }
}

void Worker::CompleteDownload(Connection* c, bulk_op::DownloadRead& o, bool ok) {
  if (o.call == nullptr) return;  // settled with the connection
  CallState& s = *o.call;
  s.read_op = -1;
  ClientCall* call = s.call;
  if (o.cancelled) {
    // The caller gave up while the READ was writing into its buffer; now it may have it.
    if (o.is_message) call->owned_response_bulk_.Release();
    FinishCall(c, s, std::move(o.status));
    return;
  }
  if (!ok) return;  // its slot is failed with the connection
  c->calls().Release(s);
  Bump(c->counters().responses_received);
  absl::Status status =
      ParseResponse(call, o.is_message ? call->owned_response_bulk_.view() : o.eager);
  if (o.is_message) call->owned_response_bulk_.Release();
  FinishCall(c, s, std::move(status));
}

void Worker::CompleteRevoke(Connection* c, int32_t window, bool lease_expired, bool ok) {
  if (ok) {
    Bump(lease_expired ? c->counters().windows_lease_expired
                       : c->counters().windows_locally_invalidated);
    Bump(lease_expired ? totals_.windows_lease_expired : totals_.windows_locally_invalidated);
  }
  const Window& win = c->windows().at(window);
  if (win.purpose != Window::Purpose::kMirrorRequest &&
      win.purpose != Window::Purpose::kMirrorReply) {
    FreeWindow(c, window);
    return;
  }
  // A mirror window revoked under a call still waiting for its response (fallback ack, lease
  // expiry): the call must forget it before the window serves another call.
  CallState* owner = c->calls().Find(win.request_id);
  if (owner != nullptr && owner->request_window == window) owner->request_window = -1;
  if (owner != nullptr && owner->reply_window == window) owner->reply_window = -1;
  FreeWindow(c, window);
  if (owner != nullptr) FinishIfAbandoned(c, *owner);
}

void Worker::CompleteRevokeThenComplete(Connection* c, bulk_op::RevokeThenComplete& o, bool ok) {
  if (ok) {
    Bump(o.lease_expired ? c->counters().windows_lease_expired
                         : c->counters().windows_locally_invalidated);
    Bump(o.lease_expired ? totals_.windows_lease_expired : totals_.windows_locally_invalidated);
  }
  FreeWindow(c, o.window);
  if (o.call == nullptr) return;
  CallState& s = *o.call;
  if (s.request_window == o.window) s.request_window = -1;
  if (s.reply_window == o.window) s.reply_window = -1;
  if (s.request_window < 0 && s.reply_window < 0) CompleteLocally(c, s, std::move(o.status));
}

void Worker::DispatchDeferred(Connection* c, bulk_op::Request& request, BulkBuffer bulk) {
  Incoming in;
  in.header = request.header;
  in.eager = request.eager;
  in.bulk = std::move(bulk);
  in.bulk.resize(request.length);
  in.has_chunk = request.has_chunk;
  in.chunk = request.chunk;
  in.admitted = request.admitted;
  DispatchCall(c, in);
}

void Worker::SettleBulkOps(Connection* c) {
  // Runs before pending calls are failed: calls that still hold a slot are left to that, calls
  // that already gave theirs up (waiting on a revocation or a cancelled READ or WRITE)
  // complete here.
  std::vector<std::pair<CallState*, absl::Status>> settle;
  auto add = [&](CallState* s, absl::Status& status) {
    for (auto& [other, ignored] : settle) {
      if (other == s) return;
    }
    settle.emplace_back(s, std::move(status));
  };
  for (BulkOp& op : c->ops().all()) {
    if (auto* o = std::get_if<bulk_op::DownloadRead>(&op); o != nullptr && o->call != nullptr) {
      o->call->read_op = -1;
      if (o->cancelled) add(o->call, o->status);
    } else if (auto* o = std::get_if<bulk_op::UploadWrite>(&op); o != nullptr && o->call) {
      o->call->write_op = -1;
      if (o->cancelled) add(o->call, o->status);
    } else if (auto* o = std::get_if<bulk_op::RevokeThenComplete>(&op); o && o->call) {
      add(o->call, o->status);
    } else {
      continue;
    }
    op = std::monostate();  // its flushed completion, if any, finds nothing to do
  }
  for (auto& [s, status] : settle) {
    s->request_window = s->reply_window = -1;
    CompleteLocally(c, *s, std::move(status));
  }
}

}  // namespace swirl::internal
