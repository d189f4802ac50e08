// The worker: construction, the control path, submissions, observation (the loop itself is in
// worker_receive.cc, with the receive path it inlines).

#include "rpc/worker.h"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/check.h"
#include "base/log.h"
#include "base/notifier.h"
#include "transport/verbs/status.h"

namespace swirl::internal {
// ---- Construction ------------------------------------------------------------------------------

Worker::Worker(std::shared_ptr<verbs::Context> context, std::shared_ptr<verbs::ProtectionDomain> pd,
               const verbs::Capabilities& caps, const WorkerOptions& options, ThreadPool* pool)
    : context_(std::move(context)),
      pd_(std::move(pd)),
      caps_(caps),
      options_(options),
      pool_(pool),
      submissions_(4096) {}

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(std::shared_ptr<verbs::Context> context,
                                                       std::shared_ptr<verbs::ProtectionDomain> pd,
                                                       const verbs::Capabilities& caps,
                                                       const WorkerOptions& options,
                                                       ThreadPool* pool) {
  std::unique_ptr<Worker> worker(new Worker(std::move(context), std::move(pd), caps, options, pool));
  if (absl::Status s = worker->Init(); !s.ok()) return s;
  return worker;
}

uint32_t Worker::send_queue_depth() const {
  return std::bit_ceil<uint32_t>(options_.credits + kBulkSqReserve + SendQueue::kSignalInterval);
}

absl::Status Worker::FitConnections(uint32_t slack, uint32_t sq_depth) {
  // The shared receive queue must hold every credit that may be granted: each connection's
  // floor and the shared pool. Fewer connections fit a smaller one.
  const uint64_t fixed = uint64_t{shared_credits_} + slack;
  if (caps_.max_srq_wr > 0 &&
      uint64_t{options_.max_connections} * kCreditFloor + fixed > caps_.max_srq_wr) {
    if (caps_.max_srq_wr < fixed + kCreditFloor) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "worker: the device's SRQ (%u) cannot hold one connection and a pool of %u credits",
          caps_.max_srq_wr, shared_credits_));
    }
    const uint32_t fit = static_cast<uint32_t>((caps_.max_srq_wr - fixed) / kCreditFloor);
    SWIRL_LOG(WARNING, "%s: %u connections x %u credits and a pool of %u exceed the device's "
              "SRQ (%u); limiting this worker to %u connections", options_.name,
              options_.max_connections, kCreditFloor, shared_credits_, caps_.max_srq_wr, fit);
    options_.max_connections = fit;
  }
  // The one CQ takes every receive and every connection's sends: fewer connections fit a device
  // whose CQs are smaller (rxe: 32767 entries).
  const uint64_t receives = uint64_t{options_.max_connections} * kCreditFloor + fixed;
  if (caps_.max_cqe > 0 &&
      receives + uint64_t{options_.max_connections} * sq_depth > caps_.max_cqe) {
    const uint64_t per_connection = kCreditFloor + sq_depth;
    if (caps_.max_cqe < per_connection + fixed) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "worker: the device's CQs (%u entries) cannot hold one connection (%u)",
          caps_.max_cqe, per_connection + fixed));
    }
    const uint32_t fit = static_cast<uint32_t>((caps_.max_cqe - fixed) / per_connection);
    SWIRL_LOG(WARNING, "%s: %u connections need %u CQ entries, more than the device's %u; "
              "limiting this worker to %u connections", options_.name, options_.max_connections,
              receives + uint64_t{options_.max_connections} * sq_depth, caps_.max_cqe, fit);
    options_.max_connections = fit;
  }
  return absl::OkStatus();
}

absl::Status Worker::Init() {
  if (options_.buffer_size < kHeader + 64 || options_.credits < 4) {
    return absl::InvalidArgumentError("worker: buffer_size >= 96 and credits >= 4 required");
  }
  // Two connections' worth of slack beyond every credit granted, plus a poll batch: credits go
  // back to peers with our next message, and consumed buffers are re-posted a little later
  // (RunOnce), up to credits - 1 of them plus what one more poll takes in.
  const uint32_t slack = 2 * options_.credits + kPollBatch;
  const uint32_t sq_depth = send_queue_depth();
  shared_credits_ = options_.shared_credits != 0
                        ? options_.shared_credits
                        : std::min<uint32_t>(options_.max_connections, 64) *
                              (options_.credits - kCreditFloor);
  if (absl::Status s = FitConnections(slack, sq_depth); !s.ok()) return s;
  credit_pool_.Init(shared_credits_);
  const uint32_t recv_total = options_.max_connections * kCreditFloor + shared_credits_ + slack;
  if (options_.own_thread && options_.adaptive_idle) {
    auto channel = verbs::CompletionChannel::Create(context_);
    if (!channel.ok()) return channel.status();
    channel_ = *channel;
  }
  auto cq = verbs::CompletionQueue::Create(
      context_, static_cast<int>(recv_total + options_.max_connections * sq_depth), channel_);
  if (!cq.ok()) return cq.status();
  cq_ = *cq;
  auto srq = verbs::SharedReceiveQueue::Create(pd_, recv_total, 1);
  if (!srq.ok()) return srq.status();
  srq_ = *srq;
  auto recv_pool =
      BufferPool::Create(pd_, recv_total, options_.buffer_size, IBV_ACCESS_LOCAL_WRITE);
  if (!recv_pool.ok()) return recv_pool.status();
  recv_pool_ = std::move(*recv_pool);
  // Messages in flight or parked are answers to what peers sent (bounded by the credits we
  // grant) and our own calls (bounded by theirs, and waiting in the backlog for a buffer).
  const uint32_t send_buffers = options_.send_buffers != 0
                                    ? options_.send_buffers
                                    : 2 * (recv_total - slack);
  max_inline_ = std::min<uint32_t>(caps_.max_inline_data, 1024);
  absl::Status outbox = outbox_.Init(
      pd_, {send_buffers, options_.buffer_size, max_inline_, send_buffers / options_.max_connections},
      [this](Connection* c, const absl::Status& why) { FailConnection(c, why); });
  if (!outbox.ok()) return outbox;
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return absl::ResourceExhaustedError("eventfd failed");
  // By default half the pool, so that one client's connections together cannot starve everyone
  // else's bulk transfers on this worker; but never less than one connection may hold on its
  // own, so that a client with a single connection is limited exactly as before.
  bulk_bytes_per_client_ =
      options_.bulk_bytes_per_client != 0
          ? options_.bulk_bytes_per_client
          : std::max<uint64_t>(options_.bulk_pool_bytes / 2,
                               std::max(options_.grant_bytes_per_connection,
                                        options_.mirror_bytes_per_connection) +
                                   options_.download_bytes_per_connection);
  if (options_.bulk_pool_bytes > 0) {
    auto bulk = BulkPool::Create(pd_, options_.bulk_pool_bytes);
    if (!bulk.ok()) return bulk.status();
    bulk_pool_ = std::move(*bulk);
  }
  recv_wrs_.resize(recv_total);
  recv_sges_.resize(recv_total);
  for (uint32_t i = 0; i < recv_total; ++i) {
    recv_sges_[i] = {reinterpret_cast<uint64_t>(recv_pool_->at(i)), recv_pool_->size(),
                     recv_pool_->lkey()};
    recv_wrs_[i] = {};
    recv_wrs_[i].wr_id = kRecvTag | i;
    recv_wrs_[i].sg_list = &recv_sges_[i];
    recv_wrs_[i].num_sge = 1;
  }
  for (uint32_t i = 0; i < recv_total; ++i) repost_.push_back(recv_pool_->Take());
  std::lock_guard<SpinLock> guard(driver_);
  DrivingScope driving(this);
  RepostRecvs();
  return absl::OkStatus();
}

Worker::~Worker() {
  Stop();
  if (wake_fd_ >= 0) close(wake_fd_);
}

void Worker::Start() {
  if (!options_.own_thread || running_.exchange(true)) return;
  thread_ = std::thread([this] { Loop(); });
}

void Worker::Stop() {
  if (running_.exchange(false)) {
    uint64_t one = 1;
    ssize_t ignored = write(wake_fd_, &one, sizeof(one));
    (void)ignored;
    thread_.join();
  }
  // Nobody drives now: close whatever is left and let the flushes come back.
  std::lock_guard<SpinLock> guard(driver_);
  DrivingScope driving(this);
  DrainSubmissions();
  std::vector<Connection*> all;
  for (auto& [id, c] : by_id_) all.push_back(c.get());
  for (Connection* c : all) FailConnection(c, absl::UnavailableError("worker stopped"));
  absl::Time deadline = absl::Now() + absl::Seconds(2);
  while (!closing_.empty() && absl::Now() < deadline) {
    RunOnceCold();
    Timers(absl::Now());
  }
  for (Connection* c : std::vector<Connection*>(closing_)) FinishClose(c);
  closing_.clear();
}

// ---- Control path ------------------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<Connection>> Worker::CreateConnection(
    uint64_t id, const MethodTable* methods, const verbs::ConnectOptions& co) {
  {
    swirl::MutexLock lock(&mu_);
    if (admitted_ >= options_.max_connections) {
      return absl::ResourceExhaustedError(absl::StrCat(
          options_.name, " is full (", options_.max_connections, " connections)"));
    }
    ++admitted_;
  }
  // Its floor is the SRQ's already (Init sized it for max_connections floors); the rest of
  // its first grant is what the pool can spare now, all of `credits` while there is room.
  const uint32_t initial =
      kCreditFloor + credit_pool_.Take(options_.credits - kCreditFloor);
  auto unreserve = [this, initial] {
    credit_pool_.Give(initial - kCreditFloor);
    swirl::MutexLock lock(&mu_);
    --admitted_;
  };
  verbs::QueuePairConfig config;
  config.send_cq = cq_;
  config.recv_cq = cq_;
  config.srq = srq_;
  config.max_send_wr = send_queue_depth();
  config.max_send_sge = 1;
  config.max_inline_data = max_inline_;
  auto qp = verbs::QueuePair::Create(pd_, config);
  if (!qp.ok()) {
    unreserve();
    return qp.status();
  }
  if (absl::Status s = (*qp)->ToInit(co); !s.ok()) {
    unreserve();
    return s;
  }
  auto c = std::make_shared<Connection>(this, id, std::move(*qp), methods, config.max_send_wr,
                                        &work_);
  c->set_initial_grant(initial);
  {
    swirl::MutexLock lock(&mu_);
    registry_[id] = c;
  }
  return c;
}

void Worker::Activate(std::shared_ptr<Connection> connection) {
  WorkItem item;
  item.kind = WorkItem::kActivate;
  item.connection = std::move(connection);
  Submit(std::move(item));
}

void Worker::Abandon(const std::shared_ptr<Connection>& connection) {
  swirl::MutexLock lock(&mu_);
  if (registry_.erase(connection->id()) > 0) {
    --admitted_;
    credit_pool_.Give(connection->initial_grant() - kCreditFloor);
  }
}

void Worker::Close(uint64_t connection_id, absl::Status reason) {
  WorkItem item;
  item.kind = WorkItem::kClose;
  item.connection_id = connection_id;
  item.status = std::move(reason);
  Submit(std::move(item));
}

void Worker::BeginDrain() {
  RunInLoop([this] { draining_ = true; });
}

bool Worker::WaitDrained(absl::Time deadline) {
  return drained_.WaitForNotificationWithDeadline(deadline);
}

void Worker::RunInLoop(absl::AnyInvocable<void()> fn) {
  WorkItem item;
  item.kind = WorkItem::kFunction;
  item.fn = std::move(fn);
  Submit(std::move(item));
}

void Worker::CancelCall(ClientCall* call) {
  WorkItem item;
  item.kind = WorkItem::kCancelCall;
  item.connection_id = call->connection_id_;
  item.call = call;
  Submit(std::move(item));
}

void Worker::FailUnstarted(ClientCall* call, absl::Status status) {
  // A call that waited in its channel (wait_for_ready) has no worker already, and its owner
  // may be reading that field in Wait() on another thread right now: write only if needed.
  if (call->worker_ != nullptr) call->worker_ = nullptr;
  NotifierWord::Reset(call->completion_);
  call->Complete(std::move(status));
}

void Worker::Submit(WorkItem item) {
  submissions_.Push(std::move(item));
  if (options_.own_thread) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_relaxed)) {
      uint64_t one = 1;
      ssize_t ignored = write(wake_fd_, &one, sizeof(one));
      (void)ignored;
    }
  }
}

bool Worker::DrainSubmissionsSlow() {
  bool did = false;
  WorkItem item;
  for (int i = 0; i < 256 && submissions_.TryPop(&item); ++i) {
    HandleItem(item);
    item = WorkItem();
    did = true;
  }
  return did;
}

void Worker::HandleItem(WorkItem& item) {
  switch (item.kind) {
    case WorkItem::kStartCall:
      StartCallOnLoop(FindById(item.connection_id), item.call);
      break;
    case WorkItem::kCancelCall:
      if (Connection* c = FindById(item.connection_id)) CancelOnLoop(c, item.call);
      break;
    case WorkItem::kActivate:
      ActivateOnLoop(std::move(item.connection));
      break;
    case WorkItem::kClose:
      if (Connection* c = FindById(item.connection_id)) FailConnection(c, item.status);
      break;
    case WorkItem::kFunction:
      item.fn();
      break;
    case WorkItem::kNone:
      break;
  }
}

void Worker::ActivateOnLoop(std::shared_ptr<Connection> connection) {
  SWIRL_DCHECK(OnLoopThread());
  Connection* c = connection.get();
  c->liveness.Activate(absl::Now());
  c->set_state(Connection::State::kActive);
  by_qpn_[c->qp_num()] = c;
  by_id_[c->id()] = std::move(connection);
  // The server learns that our side is up (WorkerOptions::setup_timeout).
  if (!c->is_server()) outbox_.SendControl(c, rpc_wire::kPing, 0);
}

void Worker::CancelOnLoop(Connection* c, ClientCall* call) {
  SWIRL_DCHECK(OnLoopThread());
  // The call named may have completed and been started again (or another call may live at its
  // address) since Cancel() queued this: only a round that still asks to be cancelled is.
  // StartCall clears the request for each new round, and a call admitted here is alive.
  CallState* s = c->calls().StateOf(call);
  if (s == nullptr || !call->cancel_requested_.load(std::memory_order_acquire)) return;
  if (s->request_id != 0) {
    GiveUp(c, *s, absl::CancelledError("cancelled by the caller"));
  } else if (c->calls().Remove(*s)) {
    FinishCall(c, *s, absl::CancelledError("cancelled by the caller"));
  }
  // Otherwise it gave its slot up already and only waits for its buffers: it completes then.
}

// ---- Observation -------------------------------------------------------------------------------

WorkerStats Worker::Stats() const {
  WorkerStats stats;
  {
    swirl::MutexLock lock(&mu_);
    stats.connections = registry_.size();
  }
  stats.recv_buffers_posted = recv_posted_snapshot_.load(std::memory_order_relaxed);
  stats.recv_buffers_total = recv_pool_->count();
  stats.protocol_errors = protocol_errors_.load(std::memory_order_relaxed);
  stats.requests = requests_.load(std::memory_order_relaxed);
  stats.stray_completions = stray_.load(std::memory_order_relaxed);
  return stats;
}

uint32_t Worker::free_credits() const {
  swirl::MutexLock lock(&mu_);
  return options_.max_connections - admitted_;
}

std::vector<std::shared_ptr<Connection>> Worker::Connections() const {
  swirl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Connection>> out;
  for (auto& [id, c] : registry_) out.push_back(c);
  return out;
}

std::shared_ptr<Connection> Worker::Find(uint64_t connection_id) const {
  swirl::MutexLock lock(&mu_);
  auto it = registry_.find(connection_id);
  return it == registry_.end() ? nullptr : it->second;
}

}  // namespace swirl::internal
