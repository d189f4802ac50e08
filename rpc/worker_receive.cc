// The worker's loop and its receive side: a turn of the loop polls the CQ; receive completions
// are validated (header, credits), routed to the message path, the bulk layer or the client
// role, and followed by credit returns; send completions retire the send queue. One file so
// that a turn (TryDrive, Loop) is one function, the receive path inlined into it.

#include <poll.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/check.h"
#include "base/log.h"
#include "base/notifier.h"
#include "rpc/server_context_access.h"
#include "rpc/worker.h"
#include "transport/verbs/status.h"

namespace swirl::internal {
namespace {

using rpc_wire::MessageHeader;

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

// ---- The loop ----------------------------------------------------------------------------------

bool Worker::OnLoopThread() const { return t_driving == this; }

bool Worker::TryDrive() {
  if (!driver_.try_lock()) return false;
  bool did;
  {
    DrivingScope driving(this);
    did = RunOnce();
  }
  driver_.unlock();
  return did;
}

void Worker::Loop() {
  if (options_.core >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(options_.core, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
      SWIRL_LOG(WARNING, "%s: cannot pin to core %d", options_.name, options_.core);
    }
  }
  std::lock_guard<SpinLock> guard(driver_);
  DrivingScope driving(this);
  // Two clocks. Yielding (idle_yield_after) is timed from the first empty poll, by the clock
  // read every 64th empty poll, every 8th with 16 connections or more, every one with 256 or
  // more: the clock costs more than a quiet poll of a few connections (reading it at every
  // empty poll made a request/response round trip 5% longer), and less than one of many on the
  // soft device, whose quiet poll walks up to 1,024 of the CQ's QPs (tens of microseconds with
  // a thousand). Once yielding, at every poll: the yield costs far more. Sleeping (idle_spin)
  // is timed from the first 64th empty poll and decided at every 64th, as it was before the
  // yield: a sleeping worker costs the soft device's thread passes over every QP, and sleeping
  // sooner with thousands of QPs cost more than the spin (docs/RELIABILITY.md "Scale").
  // A worker that never yields reads the clock every 64th empty poll only, as before.
  const absl::Duration yield_after = options_.idle_yield_after.value_or(
      options_.core >= 0 ? absl::InfiniteDuration() : kIdleYieldAfter);
  const bool may_yield = yield_after != absl::InfiniteDuration();
  absl::Time yield_since = absl::InfiniteFuture();
  absl::Time sleep_since = absl::InfiniteFuture();
  uint64_t idle_spins = 0;
  bool yielding = false;
  while (running_.load(std::memory_order_relaxed)) {
    if (RunOnce()) {
      yield_since = sleep_since = absl::InfiniteFuture();
      yielding = false;
      continue;
    }
    ++idle_spins;
    const bool sleep_look = options_.adaptive_idle && (idle_spins & 63) == 0;
    if (yielding) {
      sched_yield();
    } else if (!sleep_look) {
      if (!may_yield) continue;
      const size_t connections = by_id_.size();
      const uint64_t clock_mask = connections >= 256 ? 0 : connections >= 16 ? 7 : 63;
      if ((idle_spins & clock_mask) != 0) continue;
    }
    const absl::Time now = absl::Now();
    if (yielding) {
      // Where another thread wants the core, a yield may not return for a time slice, and 64
      // turns (RunOnce's look at the timers) would take tens of milliseconds: deadlines and
      // keepalives are looked at here, on the clock already read.
      TimersIfDue(now);
      if (!outbox_.idle()) outbox_.FlushAll();
    }
    if (yield_since == absl::InfiniteFuture()) yield_since = now;
    yielding = now - yield_since >= yield_after;
    if (!sleep_look) continue;
    if (sleep_since == absl::InfiniteFuture()) {
      sleep_since = now;
    } else if (now - sleep_since >= options_.idle_spin) {
      SleepUntilWork();
      yield_since = sleep_since = absl::InfiniteFuture();
      yielding = false;
    }
  }
}

void Worker::SleepUntilWork() {
  if (!cq_->RequestNotify(false).ok()) return;
  sleeping_.store(true, std::memory_order_seq_cst);
  // Anything that raced with arming is handled now instead of slept through (out of line:
  // the turn is inlined where it is hot, the loop and TryDrive).
  if (!submissions_.MaybeEmpty() || RunOnceCold()) {
    sleeping_.store(false, std::memory_order_relaxed);
    return;
  }
  pollfd fds[2] = {{channel_->fd(), POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  int timeout_ms = 100;
  if (next_timer_ != absl::InfinitePast()) {
    timeout_ms = static_cast<int>(
        std::clamp<int64_t>(absl::ToInt64Milliseconds(next_timer_ - absl::Now()) + 1, 0, 100));
  }
  ::poll(fds, 2, timeout_ms);
  sleeping_.store(false, std::memory_order_relaxed);
  if (fds[0].revents & POLLIN) (void)channel_->WaitEvent(absl::ZeroDuration());
  uint64_t count;
  while (read(wake_fd_, &count, sizeof(count)) > 0) {
  }
}

// The hot loop.
// Inlined into its hot callers here (the loop, TryDrive), and HandleRecv into it: a turn is the
// loop's whole body, one function. The cold ones call RunOnceCold.
[[gnu::always_inline]] inline bool Worker::RunOnce() {
  SWIRL_DCHECK(OnLoopThread());
  bool did = DrainSubmissions();
  ibv_wc wc[kPollBatch];
  const int n = cq_->Poll(kPollBatch, wc);
  if (n < 0) CompletionQueueFailed();
  for (int i = 0; i < n; ++i) {
    if (wc[i].wr_id & kRecvTag) {
      HandleRecv(wc[i]);
    } else {
      HandleSendCompletion(wc[i]);
    }
  }
  did |= n > 0;
  // Receive buffers go back to the SRQ when the loop comes up empty or a batch has gathered:
  // off the critical path of a request/response exchange, one doorbell per batch under load.
  // The SRQ holds two connections' worth of credits beyond what is granted, more than the
  // batch held back, so a peer within its credits still never meets an empty queue.
  if (!repost_.empty() && (!did || repost_.size() >= options_.credits)) RepostRecvs();
  // Timers need the clock, which costs more than an idle iteration: look every 64th.
  if (--turns_to_timer_look_ == 0) [[unlikely]] {
    turns_to_timer_look_ = kTurnsPerTimerLook;
    TimersIfDue(absl::Now());
  }
  // Last, so that whatever the steps above queued (responses, calls restarted by callbacks,
  // keepalives) leaves with one doorbell per connection.
  if (!outbox_.idle()) outbox_.FlushAll();
  return did;
}

bool Worker::RunOnceCold() { return RunOnce(); }

void Worker::CompletionQueueFailed() {
  SWIRL_LOG(ERROR, "%s: completion queue failed (overflow?); failing every connection",
            options_.name);
  std::vector<Connection*> all;
  for (auto& [id, c] : by_id_) all.push_back(c.get());
  for (Connection* c : all) FailConnection(c, absl::InternalError("completion queue failed"));
}

void Worker::RepostRecvs() {
  SWIRL_DCHECK(OnLoopThread());
  constexpr size_t kChain = 64;
  size_t done = 0;
  while (done < repost_.size()) {
    const size_t n = std::min(kChain, repost_.size() - done);
    const uint32_t* index = &repost_[done];
    for (size_t i = 0; i + 1 < n; ++i) recv_wrs_[index[i]].next = &recv_wrs_[index[i + 1]];
    ibv_recv_wr* const first = &recv_wrs_[index[0]];
    recv_wrs_[index[n - 1]].next = nullptr;
    ibv_recv_wr* bad = nullptr;
    if (int err = ibv_post_srq_recv(srq_->get(), first, &bad); err != 0) {
      SWIRL_LOG(ERROR, "%s: %s", options_.name,
                verbs::VerbsError("ibv_post_srq_recv", err).ToString());
      // Keep the ones that did not make it (from `bad` on) for the next attempt.
      size_t posted = 0;
      for (const ibv_recv_wr* w = first; w != nullptr && w != bad; w = w->next) ++posted;
      repost_.erase(repost_.begin(), repost_.begin() + static_cast<long>(done + posted));
      recv_posted_ += static_cast<uint32_t>(done + posted);
      recv_posted_snapshot_.store(recv_posted_, std::memory_order_relaxed);
      return;
    }
    done += n;
  }
  recv_posted_ += static_cast<uint32_t>(done);
  recv_posted_snapshot_.store(recv_posted_, std::memory_order_relaxed);
  repost_.clear();
}

// ---- Receive completions ---------------------------------------------------------------------

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
  // Bools on the common path: an absl::Status made and checked per message costs more.
  if (!rpc_wire::IsPlainHeader(h, wc.byte_len, {c->max_payload(), c->credits().peer_grant()}))
      [[unlikely]] {
    const rpc_wire::Limits limits{c->max_payload(), c->credits().peer_grant()};
    if (absl::Status valid = rpc_wire::ValidateHeaderSlow(h, wc.byte_len, limits); !valid.ok()) {
      ProtocolError(c, valid);
      return false;
    }
  }
  if (!c->credits().TakeMessage(h.credits)) [[unlikely]] {
    ProtocolError(c, c->credits().Refusal(h.credits));
    return false;
  }
  c->liveness.OnReceive();
  Bump(c->counters().bytes_received, wc.byte_len);
  return true;
}

// A response whose request id names no call in flight. A late answer (the call was cancelled
// or timed out) names its slot's current generation or an older one, and is dropped. A request
// id the table never made names a call we never made: no correct peer sends that, and dropping
// it would hide a peer that makes answers up. True if the connection failed.
bool Worker::ResponseForNoCall(Connection* c, uint64_t request_id) {
  if (!c->calls().NeverMade(request_id)) return false;
  ProtocolError(c, NeverSent(request_id));
  return true;
}

void Worker::SecondResponse(Connection* c, uint64_t request_id) {
  ProtocolError(c, absl::InvalidArgumentError(
                       absl::StrFormat("a second response for request %u", request_id)));
}

// ClientCall::Complete(OkStatus()) without a status to move, inline: the last step of every
// call on the message path.
[[gnu::always_inline]] inline void Worker::CompleteOk(ClientCall* call) {
  if (!call->status_.ok()) [[unlikely]] call->status_ = absl::OkStatus();
  if (call->callback_) return call->CompleteWithCallback();
  call->state_.store(ClientCall::kDone, std::memory_order_release);
  NotifierWord::Notify(call->completion_);  // the owner may reuse or free the call from here on
}

// A request on the message path: inlined into HandleRecv (it is the server's half of every
// call).
[[gnu::always_inline]] inline void Worker::ServeEager(Connection* c, const MessageHeader& h,
                                                      const char* payload) {
  SWIRL_DCHECK(OnLoopThread());
  const ServeState& serving = c->serving;
  // The common case in one pass: a request (not one-way) for the method this connection called
  // last, when that runs inline (inline_invoker). Anything else (a first call, another method,
  // one-way, a blocking method, a drain) takes DispatchCall's full path.
  Service::Invoker* invoker = serving.inline_invoker;
  if (h.type != rpc_wire::kRequest || h.method_id != serving.last_method_id ||
      invoker == nullptr || draining_ || !c->active()) [[unlikely]] {
    ServeEagerSlow(c, h, payload);
    return;
  }
  Bump(c->counters().requests_received);
  Bump(requests_);
  ServerContext ctx = ServerContextAccess::Make(c, nullptr);
  MessageWriter writer(&outbox_, bulk_pool_.get(), c);
  writer.Prepare();
  const absl::string_view request(payload, h.payload_len);
  Service::RawHandler* const raw = serving.inline_raw;
  absl::Status status =
      raw != nullptr ? (*raw)(ctx, request, writer) : invoker->Invoke(ctx, request, writer);
  if (status.ok() && !writer.in_bulk() && !ServerContextAccess::has_response_bulk(ctx) &&
      writer.data() != nullptr) [[likely]] {
    EmitResponse(c, &writer, h.request_id, 0);
    return;
  }
  FinishServed(c, h, payload, std::move(status), &writer,
               ServerContextAccess::response_bulk(ctx));
}

// A response on the message path: inlined into HandleRecv (it is half of every call).
[[gnu::always_inline]] inline void Worker::CompleteCall(Connection* c, const MessageHeader& h,
                                                        const char* payload) {
  SWIRL_DCHECK(OnLoopThread());
  CallTable& calls = c->calls();
  CallState* s = calls.Find(h.request_id);
  if (s == nullptr) [[unlikely]] {
    ResponseForNoCall(c, h.request_id);  // dropped, or the connection fails
    return;
  }
  // The common case in one pass: OK, no RDMA operation or window of the call's (a download's
  // READ, an upload's WRITE, mirror mode's windows to revoke), not given up on; its state goes
  // straight back to the table and the call completes OK (its status is OK unless a previous
  // round of the call failed: nothing to move).
  const bool plain =
      h.status == 0 && (s->read_op & s->request_window & s->reply_window & s->write_op) < 0 &&
      s->abandoned.ok();
  if (!plain && s->read_op >= 0) return SecondResponse(c, h.request_id);
  calls.Release(*s);
  Bump(c->counters().responses_received);
  ClientCall* call = s->call;
  const absl::string_view body(payload, h.payload_len);
  if (plain) [[likely]] {
    absl::Status parsed = ParseResponse(call, body);
    if (parsed.ok()) [[likely]] {
      calls.RetirePlain(*s);  // before the callback, which may start the call again
      CompleteOk(call);
      return;
    }
    CompleteLocally(c, *s, std::move(parsed));
    return;
  }
  absl::Status status = h.status == 0
                            ? ParseResponse(call, body)
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
  if ((!c->calls().backlog_empty() || c->credits().has_parked()) && c->credits().CanSend()) {
    PumpBacklog(c);
  }
}

// Inlined into the loop's turn (RunOnce): every message comes through here.
[[gnu::always_inline]] inline void Worker::HandleRecv(const ibv_wc& wc) {
  SWIRL_DCHECK(OnLoopThread());
  Connection* c = ReceivingConnection(wc);
  if (c == nullptr || c->closing()) return;
  if (wc.status != IBV_WC_SUCCESS) {
    FailConnection(c, CompletionFailed("receive failed: ", wc.status));
    return;
  }
  const char* buffer = recv_pool_->at(static_cast<uint32_t>(wc.wr_id & ~kRecvTag));
  // Read in place: the buffer is this worker's until it is posted again (after this turn).
  // A message shorter than the header leaves older bytes behind it, which nothing reads:
  // AcceptMessage refuses it on its length before any field counts.
  const MessageHeader& h = *reinterpret_cast<const MessageHeader*>(buffer);
  if (!AcceptMessage(c, wc, h)) return;
  // The message path first: a plain response or request (no bulk flags), nothing invalidated;
  // then the other messages without bulk flags, not a bulk ack or grant.
  const uint32_t lead = rpc_wire::LeadOf(h);
  const bool invalidated = (wc.wc_flags & IBV_WC_WITH_INV) != 0;
  if (lead == rpc_wire::kPlainResponse && !invalidated) {
    CompleteCall(c, h, buffer + kHeader);
  } else if (lead == rpc_wire::kPlainRequest && !invalidated) {
    ServeEager(c, h, buffer + kHeader);
  } else if (h.type == rpc_wire::kResponse && c->calls().Find(h.request_id) == nullptr &&
             ResponseForNoCall(c, h.request_id)) {
    return;
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
  if (c->closing()) {
    // The last of a closing connection's sends came back (FailConnection's marker retires the
    // rest): the next look at the timers finishes the close (Timers), within 64 turns instead
    // of the millisecond to the next pass. Not here: the rest of this poll's completions may
    // still name the QP.
    if (c->sends().all_retired()) next_timer_ = absl::InfinitePast();
    return;
  }
  if (wc.status != IBV_WC_SUCCESS) {
    FailConnection(c, CompletionFailed("send failed: ", wc.status));
  }
}

}  // namespace swirl::internal
