// Injected faults (soft_device.h, "Injected faults"; docs/SOFT_WIRE.md): what a link or a
// peer's device does to an RC connection, on demand; and RC's transport timer, which every QP
// runs (docs/SOFT_WIRE.md, "The transport timer"): a QP with faults armed at every progress,
// any other from its stalled polls (qp.cc, ProgressNormal).
//
// Cost when off: nothing in this file runs. A QP gets a QpFaults only in an armed process; a
// QP that has none takes the same paths as before (Normal() reads the null pointer among its
// other fields, and RingWriter::Commit tests a null hook). A QP that has one always takes the
// general paths (ProgressSlow), which are where the faults act:
//
// * at its N-th outgoing frame (RingWriter's CommitHook, before the stamp) a fault fires;
//   corrupt changes that frame, stall and drop freeze the QP and hold the frame's stamp back
//   (a reader follows stamps in ring order, so nothing written after it shows either, on shared
//   memory or TCP, which ships by the same stamps), fail and err hold it and act at the QP's
//   next progress (the frame is lost with the link, or with the QP);
// * ProgressSlow asks FaultsBeforeProgress first: a frozen QP does nothing else (it reads no
//   frame, consumes and acknowledges nothing), a stall that is over releases the held stamp, a
//   pending fail shuts the link's sockets down (both ends' HCA threads then see the hang-up, as
//   for a vanished peer), a pending err kills the QP;
// * noack skips the responder (ProcessRequests) from then on;
// * drop also points the QP's control block at a private one, so the peer sees none of what it
//   publishes from then on (acks, consumer indices, its error state);
// * RunTransportTimer, after the progress: a request outstanding with nothing from the peer
//   moving (no ack, no response frame, nothing retired) for ACK timeout x (retry_cnt + 1) fails
//   with IBV_WC_RETRY_EXC_ERR, as RC's retries run out. The same function is the timer of
//   every QP without faults, called every kTimerEveryStalledPolls polls that find its requests
//   outstanding and nothing moving (qp.cc): its state is the QP's (SoftQp::timer), not here.

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/log.h"
#include "transport/soft/qp_ops.h"

namespace swirl::soft {
namespace {

// Armed: every QP of the process gets a QpFaults (the transport timer at least).
std::atomic<bool> g_armed{false};

// SWIRL_SOFT_FAULTS, parsed once.
struct Environment {
  bool set = false;
  absl::Status status;
  std::vector<FaultRule> rules;
};
const Environment& Env() {
  static const Environment* env = [] {
    auto* e = new Environment;
    const char* text = std::getenv("SWIRL_SOFT_FAULTS");
    if (text == nullptr || *text == '\0') return e;
    e->set = true;
    absl::StatusOr<std::vector<FaultRule>> rules = ParseFaultRules(text);
    if (rules.ok()) {
      e->rules = *std::move(rules);
    } else {
      e->status = absl::InvalidArgumentError(
          absl::StrCat("SWIRL_SOFT_FAULTS: ", rules.status().message()));
    }
    return e;
  }();
  return *env;
}

bool Matches(const FaultRule& rule, const SoftQp* qp, uint64_t ordinal) {
  switch (rule.match) {
    case FaultRule::Match::kAny:
      return true;
    case FaultRule::Match::kQpNum:
      return qp->qp_num == rule.value;
    case FaultRule::Match::kOrdinal:
      return ordinal == rule.value;
  }
  return false;
}

// Arms `spec` on `f` (QP lock held, or the QP not yet published).
void Arm(QpFaults* f, const FaultSpec& spec) {
  f->armed = true;
  f->spec = spec;
  f->frames_out = 0;
  f->fired = false;
  f->silent = false;
  if (spec.action == FaultSpec::Action::kCorrupt && spec.at_frame == 0) f->spec.at_frame = 1;
  f->qp->req_tx.SetCommitHook(f);
  f->qp->resp_tx.SetCommitHook(f);
}

QpFaults* EnsureFaults(SoftQp* qp) {
  QpFaults* f = qp->faults.load(std::memory_order_acquire);
  if (f != nullptr) return f;
  auto* fresh = new QpFaults(qp);
  if (qp->faults.compare_exchange_strong(f, fresh, std::memory_order_acq_rel)) return fresh;
  delete fresh;  // another thread attached one first
  return f;
}

void ArmProcess() {
  if (g_armed.exchange(true, std::memory_order_acq_rel)) return;
  SWIRL_LOG(INFO, "soft: faults armed: RC's transport timer runs on every QP of this process");
  ForEachQp([](SoftQp* qp) { EnsureFaults(qp); });
}

// The stall or drop begins (QP lock held).
void Freeze(QpFaults* f) {
  f->frozen = true;
  f->frozen_until_ns = f->spec.action == FaultSpec::Action::kStall
                           ? NowNs() + int64_t{f->spec.stall_ms} * 1000 * 1000
                           : std::numeric_limits<int64_t>::max();
  if (f->spec.action == FaultSpec::Action::kDrop && f->qp->own_ctrl != nullptr &&
      f->qp->own_ctrl != &f->blackhole) {
    // From now on the QP publishes into a block nobody reads; it starts as the real one was, so
    // the QP's own view of what it published stays consistent.
    for (auto [from, to] : {std::pair{&f->qp->own_ctrl->request_consumed, &f->blackhole.request_consumed},
                            std::pair{&f->qp->own_ctrl->response_consumed, &f->blackhole.response_consumed},
                            std::pair{&f->qp->own_ctrl->acked, &f->blackhole.acked},
                            std::pair{&f->qp->own_ctrl->state, &f->blackhole.state}}) {
      to->value.store(from->value.load(std::memory_order_relaxed), std::memory_order_relaxed);
    }
    f->qp->own_ctrl = &f->blackhole;
  }
  SWIRL_LOG(INFO, "soft: QP 0x%x: injected fault: %s", f->qp->qp_num,
            f->spec.action == FaultSpec::Action::kStall
                ? absl::StrCat("stalled for ", f->spec.stall_ms, " ms")
                : std::string("link dropped"));
}

// The fault fires now, outside a frame (at_frame 0), or its action was left for the progress.
void Act(SoftQp* qp, QpFaults* f) {
  f->pending = false;
  switch (f->spec.action) {
    case FaultSpec::Action::kStall:
    case FaultSpec::Action::kDrop:
      Freeze(f);
      break;
    case FaultSpec::Action::kNoAck:
      SWIRL_LOG(INFO, "soft: QP 0x%x: injected fault: stops acknowledging", qp->qp_num);
      f->silent = true;
      break;
    case FaultSpec::Action::kFail:
      SWIRL_LOG(INFO, "soft: QP 0x%x: injected fault: link failed", qp->qp_num);
      // Both ends' HCA threads see the hang-up and fail whichever QP adopted each socket; ours
      // is marked gone now, so that its next progress sees it without waiting for that.
      for (uint64_t watch : {qp->out_watch, qp->in_watch}) {
        if (watch != 0) ShutdownWatch(qp->hca, watch);
      }
      qp->peer_gone.store(true, std::memory_order_release);
      f->held_ring = nullptr;  // the frame it fired at went with the link
      break;
    case FaultSpec::Action::kErr:
      SWIRL_LOG(INFO, "soft: QP 0x%x: injected fault: QP killed", qp->qp_num);
      f->held_ring = nullptr;  // the frame it fired at dies with the QP
      EnterError(qp);
      CompleteSq(qp);
      qp->sctx->RaiseQpEvent(IBV_EVENT_QP_FATAL, qp);
      break;
    case FaultSpec::Action::kCorrupt:
      break;  // BeforeStamp does it
  }
}

}  // namespace

absl::StatusOr<std::vector<FaultRule>> ParseFaultRules(absl::string_view text) {
  std::vector<FaultRule> rules;
  if (text == "none") return rules;
  for (absl::string_view part : absl::StrSplit(text, ';', absl::SkipWhitespace())) {
    FaultRule rule;
    bool have_action = false;
    for (absl::string_view item : absl::StrSplit(part, ',', absl::SkipWhitespace())) {
      std::vector<absl::string_view> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
      const absl::string_view key = absl::StripAsciiWhitespace(kv[0]);
      absl::string_view value = kv.size() == 2 ? absl::StripAsciiWhitespace(kv[1]) : "";
      if (kv.size() != 2 || value.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("'", item, "' is not key=value"));
      }
      if (key == "qp") {
        if (value == "*") {
          rule.match = FaultRule::Match::kAny;
        } else if (absl::ConsumePrefix(&value, "#")) {
          rule.match = FaultRule::Match::kOrdinal;
          if (!absl::SimpleAtoi(value, &rule.value) || rule.value == 0) {
            return absl::InvalidArgumentError(absl::StrCat("qp=#", value, ": K counts from 1"));
          }
        } else {
          rule.match = FaultRule::Match::kQpNum;
          absl::string_view digits = value;
          const bool hex = absl::ConsumePrefix(&digits, "0x");
          if (!(hex ? absl::SimpleHexAtoi(digits, &rule.value)
                    : absl::SimpleAtoi(digits, &rule.value)) ||
              rule.value == 0 || rule.value > wire::kMsnMask) {
            return absl::InvalidArgumentError(absl::StrCat("qp=", value, " is not a QP number"));
          }
        }
      } else if (key == "at_frame") {
        if (!absl::SimpleAtoi(value, &rule.spec.at_frame)) {
          return absl::InvalidArgumentError(absl::StrCat("at_frame=", value));
        }
      } else if (key == "action") {
        have_action = true;
        absl::string_view action = value;
        using A = FaultSpec::Action;
        if (absl::ConsumePrefix(&action, "stall:")) {
          rule.spec.action = A::kStall;
          if (!absl::SimpleAtoi(action, &rule.spec.stall_ms)) {
            return absl::InvalidArgumentError(absl::StrCat("action=", value, ": stall:<ms>"));
          }
        } else if (action == "drop") {
          rule.spec.action = A::kDrop;
        } else if (action == "fail") {
          rule.spec.action = A::kFail;
        } else if (action == "err") {
          rule.spec.action = A::kErr;
        } else if (action == "noack") {
          rule.spec.action = A::kNoAck;
        } else if (action == "corrupt") {
          rule.spec.action = A::kCorrupt;
        } else {
          return absl::InvalidArgumentError(absl::StrCat(
              "action=", value, ": one of drop, fail, stall:<ms>, err, noack, corrupt"));
        }
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("unknown key '", key, "' (qp, at_frame, action)"));
      }
    }
    if (!have_action) {
      return absl::InvalidArgumentError(absl::StrCat("'", part, "' has no action="));
    }
    rules.push_back(rule);
  }
  if (rules.empty()) return absl::InvalidArgumentError("no rule (none: armed, no fault)");
  return rules;
}

absl::Status CheckFaultEnvironment() { return Env().status; }

void AttachFaults(SoftQp* qp, uint64_t ordinal) {
  const Environment& env = Env();
  if (env.set && env.status.ok()) g_armed.store(true, std::memory_order_release);
  if (!g_armed.load(std::memory_order_acquire)) return;
  QpFaults* f = EnsureFaults(qp);
  std::lock_guard<QpLock> lock(qp->lock);  // the HCA thread may already see the QP
  for (const FaultRule& rule : env.rules) {
    if (Matches(rule, qp, ordinal)) Arm(f, rule.spec);  // the last matching rule wins
  }
}

absl::Status InjectFault(ibv_qp* ibqp, const FaultSpec& spec) {
  if (ibqp == nullptr || ibqp->qp_type != IBV_QPT_RC || ibqp->context->device == nullptr ||
      !IsSoftDeviceName(ibqp->context->device->name)) {
    return absl::InvalidArgumentError("InjectFault: not an RC QP of a soft device");
  }
  ArmProcess();
  SoftQp* qp = AsSoft(ibqp);
  std::lock_guard<QpLock> lock(qp->lock);
  QpFaults* f = EnsureFaults(qp);
  if (f->frozen || f->pending) {
    return absl::FailedPreconditionError(
        "InjectFault: a fault is in progress on this QP (a stall or a drop: reset the QP)");
  }
  Arm(f, spec);
  return absl::OkStatus();
}

bool QpFaults::BeforeStamp(RingWriter& ring, char* frame, uint64_t pos) {
  auto hold = [&] {
    if (held_ring != nullptr) return true;  // behind a held frame, it cannot show anyway
    held_ring = &ring;
    held_frame = frame;
    held_pos = pos;
    return false;
  };
  if (frozen || pending) return hold();
  if (!armed || fired || spec.at_frame == 0 || ++frames_out < spec.at_frame) return true;
  fired = true;
  switch (spec.action) {
    case FaultSpec::Action::kCorrupt:
      // A flag bit no frame may carry: the reader's validation refuses the frame (the rest
      // of the header, and so the ring's layout, stays intact, on either fabric).
      reinterpret_cast<wire::FrameHeader*>(frame)->flags |= 0x80;
      armed = false;
      SWIRL_LOG(INFO, "soft: QP 0x%x: injected fault: frame at %llu corrupted", qp->qp_num,
                static_cast<unsigned long long>(pos));
      return true;
    case FaultSpec::Action::kNoAck:
      silent = true;  // this frame goes out; nothing it receives is acknowledged from now on
      SWIRL_LOG(INFO, "soft: QP 0x%x: injected fault: stops acknowledging", qp->qp_num);
      return true;
    case FaultSpec::Action::kStall:
    case FaultSpec::Action::kDrop:
      Freeze(this);
      return hold();
    case FaultSpec::Action::kFail:
    case FaultSpec::Action::kErr:
      pending = true;  // acts at the next progress: the caller is in the middle of a post
      return hold();
  }
  return true;
}

bool FaultsBeforeProgress(SoftQp* qp, QpFaults* f) {
  if (f->armed && !f->fired && f->spec.at_frame == 0 && qp->linked) {
    f->fired = true;
    Act(qp, f);
  } else if (f->pending) {
    Act(qp, f);
  }
  if (!f->frozen) return false;
  if (NowNs() < f->frozen_until_ns) {
    // A dropped link still times out at this end (nothing it sent was seen).
    if (f->spec.action == FaultSpec::Action::kDrop) RunTransportTimer(qp);
    return true;
  }
  // The stall is over: what was written meanwhile shows, and the QP goes on.
  f->frozen = false;
  f->armed = false;
  qp->timer.waiting_since_ns = 0;  // the peer had nothing to acknowledge while we held it back
  if (f->held_ring != nullptr) {
    f->held_ring->StampHeld(f->held_frame, f->held_pos);
    f->held_ring = nullptr;
  }
  SWIRL_LOG(INFO, "soft: QP 0x%x: injected stall over", qp->qp_num);
  PublishAndWake(qp, true);
  return false;
}

bool RunTransportTimer(SoftQp* qp) {
  auto& t = qp->timer;
  const int64_t timeout = AckTimeoutNs(qp->attr);
  if (!qp->linked || qp->qstate != IBV_QPS_RTS || timeout == 0) {
    t.waiting_since_ns = 0;
    return false;
  }
  // A SEND or WRITE the peer has acknowledged is not outstanding, retired or not: an unsignaled
  // one waits for a piggybacked ack (CompleteSq reads the peer's ack word only when a completion
  // is wanted), so on a link gone quiet it stays kAwaiting long after the peer took it, and
  // without this the timer failed healthy idle connections about ACK timeout x (retry_cnt + 1)
  // after their last message. The word is read here as CompleteSq would read it.
  NoteAck(qp, static_cast<uint32_t>(
                  qp->peer.control()->acked.value.load(std::memory_order_acquire)));
  wire::SharedAcquire();
  if (qp->qstate != IBV_QPS_RTS) {  // the ack was impossible: the QP failed
    CompleteSq(qp);
    return true;
  }
  // The oldest request transmitted, wholly or in part, and not yet answered.
  uint32_t oldest = qp->sq_head;
  while (oldest != qp->sq_tx) {
    const SendWqe& w = qp->sq[oldest & qp->sq_mask];
    if (w.state == SendWqe::kAwaiting &&
        !(IsSendOrWrite(w.opcode) && wire::MsnBefore(w.msn, qp->peer_acked))) {
      break;
    }
    ++oldest;
  }
  if (oldest == qp->sq_tx &&
      (oldest == qp->sq_tail || qp->sq[oldest & qp->sq_mask].sent == 0)) {
    t.waiting_since_ns = 0;
    return false;
  }
  // What the peer does for our requests: acknowledges them, answers them, or (a long WRITE
  // streaming) takes their frames.
  const uint64_t consumed = qp->peer.control()->request_consumed.value.load(std::memory_order_acquire);
  const int64_t now = NowNs();
  if (t.waiting_since_ns == 0 || qp->sq_head != t.seen_sq_head ||
      qp->peer_acked != t.seen_peer_acked || qp->resp_rx.tail() != t.seen_resp_tail ||
      consumed != t.seen_req_consumed) {
    t.waiting_since_ns = now;
    t.seen_sq_head = qp->sq_head;
    t.seen_peer_acked = qp->peer_acked;
    t.seen_resp_tail = qp->resp_rx.tail();
    t.seen_req_consumed = consumed;
    return false;
  }
  if (now - t.waiting_since_ns <= timeout * (qp->attr.retry_cnt + 1)) return false;
  SWIRL_LOG(DEBUG, "soft: QP 0x%x: no acknowledgement from QP 0x%x within the transport timer",
            qp->qp_num, qp->attr.dest_qp_num);
  FailWqe(qp, qp->sq[oldest & qp->sq_mask], IBV_WC_RETRY_EXC_ERR);
  t.waiting_since_ns = 0;
  EnterError(qp);
  CompleteSq(qp);
  return true;
}

void ResetFaults(QpFaults* f) {
  f->held_ring = nullptr;  // the segment it pointed into is gone
  f->frozen = false;
  f->pending = false;
  f->silent = false;
  if (f->fired) f->armed = false;
  // A drop's private control block is left by TeardownLink, which clears own_ctrl.
}

}  // namespace swirl::soft
