// The worker's failure path and timers: a protocol violation or a device error fails the
// connection (its QP to ERR, every call completed, every buffer given back once the device is
// done with it); timers run deadlines, leases, keepalives and the drain.

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/check.h"
#include "base/log.h"
#include "rpc/worker.h"

namespace swirl::internal {

void Worker::ProtocolError(Connection* c, const absl::Status& why) {
  Bump(c->counters().protocol_errors);
  Bump(protocol_errors_);
  SWIRL_LOG(WARNING, "%s: connection %u (%s): protocol violation: %s; closing it",
            options_.name, c->id(), c->peer(), why.ToString());
  FailConnection(c, absl::Status(why.code(), absl::StrCat("protocol violation by the peer: ",
                                                         why.message())));
}

void Worker::FailConnection(Connection* c, const absl::Status& why) {
  SWIRL_DCHECK(OnLoopThread());
  if (c->closing()) return;
  c->set_close_reason(why);
  c->set_state(Connection::State::kClosing);
  SWIRL_LOG(DEBUG, "%s: closing connection %u: %s", options_.name, c->id(), why.ToString());
  // The QP goes to ERR before any call completes: from then on the device places no data for
  // it and no window bound to it can be used, so buffers that READs were filling or windows
  // were exposing can go back to their owners.
  if (absl::Status s = c->qp().ToError(); !s.ok()) {
    SWIRL_LOG(WARNING, "%s: %s", options_.name, s.ToString());
  }
  SettleBulkOps(c);
  // Whoever watches the connection (a channel) learns it is lost before its calls fail, so a
  // caller that sees its call fail also sees the channel down.
  if (auto lost = c->TakeOnLost()) lost(why);
  FailPendingCalls(c, absl::UnavailableError(absl::StrCat("connection lost: ", why.message())));
  // Blocking handlers still running for this connection can no longer answer anyone.
  for (auto& [request_id, cancelled] : c->serving.running) {
    cancelled->store(true, std::memory_order_release);
  }
  for (auto& cancelled : c->serving.running_one_way) {
    cancelled->store(true, std::memory_order_release);
  }
  outbox_.DropUnsent(c);
  // Unsignaled sends that completed before the error never report. A signaled WR posted now is
  // flushed behind them; its completion retires everything before it.
  ibv_send_wr marker{};
  marker.wr_id = c->sends().TakeSeq();
  marker.opcode = IBV_WR_SEND;
  marker.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(c->qp().get(), &marker, &bad) != 0) c->sends().UntakeSeq();
  c->closing_since = absl::Now();
  closing_.push_back(c);
}

void Worker::FinishClose(Connection* c) {
  SWIRL_DCHECK(OnLoopThread());
  // A batch still waiting for its doorbell is never posted (the QP is in the error state and
  // about to go), and WRs that never completed (the device is gone or slow) give their buffers
  // back: the connection leaves the doorbell list before it is destroyed.
  outbox_.Forget(c);
  ChargeWindows(c, -static_cast<int32_t>(c->windows().allocated()));
  ReleaseBulk(c);  // windows are deallocated (and so revoked) before the QP goes
  // Whatever the connection still held no longer counts against its client.
  ChargeBulk(c, &c->granted.bytes, -static_cast<int64_t>(c->granted.bytes));
  ChargeBulk(c, &c->download_bytes, -static_cast<int64_t>(c->download_bytes));
  ChargeBulk(c, &c->mirror_bytes, -static_cast<int64_t>(c->mirror_bytes));  // READs never done
  c->mirror_reads = 0;
  by_qpn_.erase(c->qp_num());
  last_connection_ = nullptr;
  if (options_.before_qp_destroy) options_.before_qp_destroy();
  c->DestroyQp();  // no completion can name it any more: it is in ERR and fully flushed
  {
    swirl::MutexLock lock(&mu_);
    registry_.erase(c->id());
    --admitted_;
  }
  // What it was lent goes back to the pool: its peer can send nothing more.
  credit_pool_.Give(c->credits().borrowed());
  c->set_state(Connection::State::kClosed);
  const uint64_t id = c->id();
  const absl::Status reason = c->close_reason();
  by_id_.erase(id);  // may destroy c
  if (options_.on_closed) options_.on_closed(id, reason);
}

void Worker::CheckLiveness(Connection* c, absl::Time now) {
  switch (c->liveness.Tick(now, {options_.keepalive, options_.setup_timeout}, c->is_server())) {
    case Liveness::Verdict::kAlive:
      return;
    case Liveness::Verdict::kSendPing:
      outbox_.SendControl(c, rpc_wire::kPing, 0);
      return;
    case Liveness::Verdict::kSilentClient:
      FailConnection(c, absl::DeadlineExceededError(absl::StrCat(
                            "the client sent nothing within ",
                            absl::FormatDuration(options_.setup_timeout), " of connecting")));
      return;
    case Liveness::Verdict::kStoppedAnswering:
      FailConnection(c, absl::DeadlineExceededError("the peer stopped answering keepalives"));
      return;
  }
}

void Worker::ConnectionTimers(Connection* c, absl::Time now) {
  const Connection::State state = c->state();
  if (state != Connection::State::kActive && state != Connection::State::kDraining) return;
  CallTimers(c, now);
  if (!c->windows().empty()) BulkTimers(c, now);
  if (c->granted.owed) SendOwedGrant(c);
  CheckLiveness(c, now);
}

void Worker::Timers(absl::Time now) {
  SWIRL_DCHECK(OnLoopThread());
  // Each pass looks at every connection while there are at most 256; beyond, at one in
  // `stride` of them in turn (picked by id, which reads only the map, not the connections), so
  // that a worker holding 10,000 connections does not spend its loop walking them every
  // millisecond: deadlines and keepalives are then enforced within `stride` ms.
  const uint64_t pass = ++timer_passes_;
  const uint64_t stride = by_id_.size() / 256 + 1;
  // While the shared credits run short (a busy connection could not grow to its full grant),
  // quiet connections give back what they were lent, at every 64th look at each (about 64 ms
  // apart): a connection is quiet if it received less than a quarter of its allotment since.
  const bool reclaim =
      credit_pool_.available() < options_.credits && ((pass / stride) & 63) == 0;
  for (auto& [id, owner] : by_id_) {
    if (stride > 1 && (id + pass) % stride != 0) continue;
    ConnectionTimers(owner.get(), now);
    if (reclaim) owner->credits().Reclaim();
  }
  for (size_t i = 0; i < closing_.size();) {
    Connection* c = closing_[i];
    if (c->sends().all_retired() || now - c->closing_since > absl::Seconds(2)) {
      closing_[i] = closing_.back();
      closing_.pop_back();
      FinishClose(c);
    } else {
      ++i;
    }
  }
  if (!outbox_.idle()) outbox_.FlushAll();
  // Checked after the doorbells: what they sent is on its way, and what waits for a send
  // completion (a bulk operation, a window) holds the gate.
  if (draining_ && work_.count() == 0 && !drained_.HasBeenNotified()) drained_.Notify();
}

}  // namespace swirl::internal
