#include "rpc/worker.h"

#include "rpc/writer.h"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <utility>
#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/log.h"
#include "google/protobuf/message_lite.h"
#include "rpc/handshake.h"
#include "transport/verbs/status.h"

namespace swirl::internal {
namespace {

using rpc_wire::MessageHeader;

constexpr int kPollBatch = 16;
// The worker whose loop this thread is running right now (it holds that worker's driver_), so
// that calls started from callbacks and handlers go straight to the connection and leave with
// the iteration's doorbell instead of taking a trip through the submission queue.
thread_local Worker* t_driving = nullptr;
constexpr uint32_t kSignalInterval = 16;
constexpr uint64_t kRecvTag = uint64_t{1} << 63;  // wr_id of receives; sends use plain seqs
constexpr uint32_t kArenaSlots = 64;
constexpr uint32_t kHeader = sizeof(MessageHeader);
constexpr uint32_t kBulkSqReserve = 64;


// Single-writer counters: a plain load and store, no atomic read-modify-write on the hot path.
inline void Bump(std::atomic<uint64_t>& counter, uint64_t n = 1) {
  counter.store(counter.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
}

// A handle for calling the far side of a connection (server-to-client calls).
class PeerTarget final : public CallTarget {
 public:
  explicit PeerTarget(std::weak_ptr<Connection> connection) : connection_(std::move(connection)) {}
  void Start(ClientCall* call) override {
    std::shared_ptr<Connection> c = connection_.lock();
    if (c == nullptr || c->state() == Connection::State::kClosed) {
      Worker::FailUnstarted(call, absl::UnavailableError("the connection is closed"));
      return;
    }
    c->worker()->StartCall(c->id(), call);
  }

 private:
  std::weak_ptr<Connection> connection_;
};

// Response bytes produced on a pool thread.
class StringWriter final : public ResponseWriter {
 public:
  explicit StringWriter(size_t max) : max_(max) {}
  char* Reserve(size_t size) override {
    if (data_.size() + size > max_) return nullptr;
    reserved_ = data_.size();
    data_.resize(data_.size() + size);
    return data_.data() + reserved_;
  }
  void Commit(size_t size) override { data_.resize(reserved_ + size); }
  std::string Take() { return std::move(data_); }

 private:
  size_t max_;
  size_t reserved_ = 0;
  std::string data_;
};

}  // namespace

// ---- MethodTable -------------------------------------------------------------------------------

absl::Status MethodTable::Add(const Service& service) {
  // All or nothing: a service refused leaves nothing of itself behind (its caller may well
  // destroy it after the error).
  absl::flat_hash_map<uint32_t, const Service::Method*> added;
  for (const auto& m : service.methods()) {
    auto existing = methods_.find(m->id);
    const Service::Method* other = existing != methods_.end() ? existing->second : nullptr;
    if (auto [it, inserted] = added.emplace(m->id, m.get()); !inserted) other = it->second;
    if (other != nullptr) {
      return absl::AlreadyExistsError(absl::StrCat("method ", m->full_name, " collides with ",
                                                   other->full_name, " (same id)"));
    }
  }
  methods_.insert(added.begin(), added.end());
  return absl::OkStatus();
}

// ---- Connection --------------------------------------------------------------------------------

Connection::Connection(Worker* worker, uint64_t id, std::unique_ptr<verbs::QueuePair> qp,
                       const MethodTable* methods)
    : worker_(worker), id_(id), qp_(std::move(qp)), methods_(methods) {}

Connection::~Connection() = default;

void Connection::Configure(const control::Negotiated& negotiated, bool is_server,
                           std::string peer, std::string client_name) {
  negotiated_ = negotiated;
  is_server_ = is_server;
  peer_ = std::move(peer);
  client_key_ = ClientKey(peer_);
  client_name_ = std::move(client_name);
  // The peer may reserve more receive buffers for us than our send queue was sized for (it
  // was created before the peer's offer was known): we use no more than it holds. Using fewer
  // credits than granted is always safe; the peer returns only what we used.
  peer_credits_ = std::min<uint32_t>(
      is_server ? negotiated.server_credits() : negotiated.client_credits(),
      sq_depth_ - kBulkSqReserve - kSignalInterval);
  local_credits_ = is_server ? negotiated.client_credits() : negotiated.server_credits();
  send_credits_ = peer_credits_;
  peer_available_ = local_credits_;
  max_payload_ = negotiated.max_message_size();
  max_inline_ = is_server ? negotiated.server_max_inline() : negotiated.client_max_inline();
  // Windows: two per call in flight either way (downloads, mirror requests and replies), plus
  // unused upload grants, window_credits of them per size class the negotiated maximum spans
  // (grants of one class must not leave none for downloads or for another class).
  uint32_t classes = 1;
  for (uint64_t size = BulkPool::kMinClass; size < negotiated.max_bulk_size(); size <<= 1) {
    ++classes;
  }
  max_windows_ = 2 * std::max(peer_credits_, local_credits_) +
                 negotiated.window_credits() * classes + 4;
  const uint32_t slots = std::bit_ceil<uint32_t>(std::max<uint32_t>(peer_credits_, 1));
  pending_.assign(slots, nullptr);
  generation_.assign(slots, 0);
  free_slots_.clear();
  for (uint32_t i = slots; i > 0; --i) free_slots_.push_back(i - 1);
}

std::shared_ptr<CallTarget> Connection::AsCallTarget() {
  return std::make_shared<PeerTarget>(weak_from_this());
}


// ---- Worker: construction ----------------------------------------------------------------------

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

absl::Status Worker::Init() {
  if (options_.buffer_size < kHeader + 64 || options_.credits < 4) {
    return absl::InvalidArgumentError("worker: buffer_size >= 96 and credits >= 4 required");
  }
  const uint32_t slack = 2 * options_.credits + kPollBatch;  // see recv_total below
  if (caps_.max_srq_wr > 0 &&
      options_.max_connections * options_.credits + slack > caps_.max_srq_wr) {
    // The shared receive queue must hold every credit granted; fewer connections fit.
    if (caps_.max_srq_wr < options_.credits + slack) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "worker: the device's SRQ (%u) cannot hold one connection of %u credits",
          caps_.max_srq_wr, options_.credits));
    }
    const uint32_t fit = (caps_.max_srq_wr - slack) / options_.credits;
    SWIRL_LOG(WARNING, "%s: %u connections x %u credits exceed the device's SRQ (%u); limiting "
              "this worker to %u connections", options_.name, options_.max_connections,
              options_.credits, caps_.max_srq_wr, fit);
    options_.max_connections = fit;
  }
  const uint32_t sq_depth = std::bit_ceil<uint32_t>(options_.credits + kBulkSqReserve + kSignalInterval);
  // The one CQ takes every receive and every connection's sends: fewer connections fit a device
  // whose CQs are smaller (rxe: 32767 entries).
  const uint64_t cqe_per_connection = options_.credits + sq_depth;
  if (caps_.max_cqe > 0 &&
      options_.max_connections * cqe_per_connection + slack > caps_.max_cqe) {
    if (caps_.max_cqe < cqe_per_connection + slack) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "worker: the device's CQs (%u entries) cannot hold one connection (%u)",
          caps_.max_cqe, cqe_per_connection + slack));
    }
    const uint32_t fit = static_cast<uint32_t>((caps_.max_cqe - slack) / cqe_per_connection);
    SWIRL_LOG(WARNING, "%s: %u connections need %u CQ entries, more than the device's %u; "
              "limiting this worker to %u connections", options_.name, options_.max_connections,
              options_.max_connections * cqe_per_connection + slack, caps_.max_cqe, fit);
    options_.max_connections = fit;
  }
  // Two connections' worth of slack beyond every credit granted, plus a poll batch: credits go
  // back to peers with our next message, and consumed buffers are re-posted a little later
  // (RunOnce), up to credits - 1 of them plus what one more poll takes in.
  const uint32_t recv_total = options_.max_connections * options_.credits + slack;
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
  const uint32_t send_count = options_.send_buffers != 0
                                  ? options_.send_buffers
                                  : options_.max_connections * options_.credits * 2;
  auto send_pool = BufferPool::Create(pd_, send_count, options_.buffer_size, 0);
  if (!send_pool.ok()) return send_pool.status();
  send_pool_ = std::move(*send_pool);
  max_inline_ = std::min<uint32_t>(caps_.max_inline_data, 1024);
  inline_arena_.resize(static_cast<size_t>(kArenaSlots) * std::max<uint32_t>(max_inline_, 64));
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return absl::ResourceExhaustedError("eventfd failed");
  // By default half the pool, so that one client's connections together cannot starve everyone
  // else's bulk transfers on this worker; but never less than one connection may hold on its
  // own, so that a client with a single connection is limited exactly as before.
  bulk_bytes_per_client_ =
      options_.bulk_bytes_per_client != 0
          ? options_.bulk_bytes_per_client
          : std::max<uint64_t>(options_.bulk_pool_bytes / 2,
                               options_.grant_bytes_per_connection +
                                   options_.download_bytes_per_connection);
  if (options_.bulk_pool_bytes > 0) {
    auto bulk = BulkPool::Create(pd_, options_.bulk_pool_bytes, options_.unsafe_static_rkey);
    if (!bulk.ok()) return bulk.status();
    bulk_pool_ = std::move(*bulk);
  }
  for (uint32_t i = 0; i < recv_total; ++i) repost_.push_back(recv_pool_->Take());
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
  DrainSubmissions();
  std::vector<Connection*> all;
  for (auto& [id, c] : by_id_) all.push_back(c.get());
  for (Connection* c : all) FailConnection(c, absl::UnavailableError("worker stopped"));
  absl::Time deadline = absl::Now() + absl::Seconds(2);
  while (!closing_.empty() && absl::Now() < deadline) {
    RunOnce();
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
    if (reserved_credits_ + options_.credits > options_.max_connections * options_.credits) {
      return absl::ResourceExhaustedError(absl::StrCat(
          options_.name, " is full (", options_.max_connections, " connections)"));
    }
    reserved_credits_ += options_.credits;
  }
  auto unreserve = [this] {
    swirl::MutexLock lock(&mu_);
    reserved_credits_ -= options_.credits;
  };
  verbs::QueuePairConfig config;
  config.send_cq = cq_;
  config.recv_cq = cq_;
  config.srq = srq_;
  config.max_send_wr = std::bit_ceil<uint32_t>(options_.credits + kBulkSqReserve + kSignalInterval);
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
  auto c = std::make_shared<Connection>(this, id, std::move(*qp), methods);
  c->sq_depth_ = config.max_send_wr;
  c->sent_buffer_.assign(std::bit_ceil<uint32_t>(config.max_send_wr), -1);
  c->op_at_seq_.assign(c->sent_buffer_.size(), -1);
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
  if (registry_.erase(connection->id()) > 0) reserved_credits_ -= options_.credits;
}

void Worker::Close(uint64_t connection_id, absl::Status reason) {
  WorkItem item;
  item.kind = WorkItem::kClose;
  item.connection_id = connection_id;
  item.status = std::move(reason);
  Submit(std::move(item));
}

void Worker::BeginDrain() {
  drained_.store(false, std::memory_order_release);
  RunInLoop([this] { draining_ = true; });
}

void Worker::RunInLoop(absl::AnyInvocable<void()> fn) {
  WorkItem item;
  item.kind = WorkItem::kFunction;
  item.fn = std::move(fn);
  Submit(std::move(item));
}

void Worker::StartCall(uint64_t connection_id, ClientCall* call) {
  call->worker_ = this;
  call->connection_id_ = connection_id;
  call->scratch_.Release();
  call->request_window_ = -1;
  call->reply_window_ = -1;
  call->read_op_ = -1;
  call->write_op_ = -1;
  call->abandoned_status_ = absl::OkStatus();
  call->status_ = absl::OkStatus();
  call->cancel_requested_.store(false, std::memory_order_relaxed);
  call->notifier_.Reset();
  // Release: a Cancel() that sees this round's state also sees its cleared cancel request.
  call->state_.store(ClientCall::kQueued, std::memory_order_release);
  if (t_driving == this) {
    // From a callback or handler on this loop: queue it behind this iteration's doorbell.
    // A connection that is not active goes through the queue, so a callback that restarts a
    // failed call cannot recurse.
    Connection* c = FindById(connection_id);
    if (c != nullptr && c->state_.load(std::memory_order_relaxed) == Connection::State::kActive) {
      StartCallLocked(c, call);
      return;
    }
  } else if (!options_.own_thread && driver_.try_lock()) {
    // Caller-driven and nobody else is driving: post it ourselves, no hand-off.
    t_driving = this;
    DrainSubmissions();
    StartCallLocked(FindById(connection_id), call);
    FlushSends();
    t_driving = nullptr;
    driver_.unlock();
    return;
  }
  WorkItem item;
  item.kind = WorkItem::kStartCall;
  item.connection_id = connection_id;
  item.call = call;
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
  call->worker_ = nullptr;
  call->notifier_.Reset();
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

// ---- The loop ----------------------------------------------------------------------------------

bool Worker::OnLoopThread() const { return t_driving == this; }

bool Worker::TryDrive() {
  if (!driver_.try_lock()) return false;
  t_driving = this;
  bool did = RunOnce();
  t_driving = nullptr;
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
  t_driving = this;
  absl::Time idle_since = absl::InfiniteFuture();
  uint64_t idle_spins = 0;
  while (running_.load(std::memory_order_relaxed)) {
    if (RunOnce()) {
      idle_since = absl::InfiniteFuture();
      continue;
    }
    if (!options_.adaptive_idle || (++idle_spins & 63) != 0) continue;
    absl::Time now = absl::Now();
    if (idle_since == absl::InfiniteFuture()) {
      idle_since = now;
    } else if (now - idle_since >= options_.idle_spin) {
      SleepUntilWork();
      idle_since = absl::InfiniteFuture();
    }
  }
  t_driving = nullptr;
}

void Worker::SleepUntilWork() {
  if (!cq_->RequestNotify(false).ok()) return;
  sleeping_.store(true, std::memory_order_seq_cst);
  // Anything that raced with arming is handled now instead of slept through.
  if (!submissions_.MaybeEmpty() || RunOnce()) {
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

bool Worker::RunOnce() {
  bool did = DrainSubmissions();
  ibv_wc wc[kPollBatch];
  const int n = cq_->Poll(kPollBatch, wc);
  if (n < 0) {
    SWIRL_LOG(ERROR, "%s: completion queue failed (overflow?); failing every connection",
              options_.name);
    std::vector<Connection*> all;
    for (auto& [id, c] : by_id_) all.push_back(c.get());
    for (Connection* c : all) FailConnection(c, absl::InternalError("completion queue failed"));
  }
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
  if ((++iterations_ & 63) == 0) {
    absl::Time now = absl::Now();
    if (now >= next_timer_) {
      Timers(now);
      next_timer_ = now + absl::Milliseconds(1);
    }
  }
  // Last, so that whatever the steps above queued (responses, calls restarted by callbacks,
  // keepalives) leaves with one doorbell per connection.
  if (!dirty_.empty()) FlushSends();
  return did;
}

bool Worker::DrainSubmissions() {
  if (submissions_.MaybeEmpty()) return false;
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
      StartCallLocked(FindById(item.connection_id), item.call);
      break;
    case WorkItem::kCancelCall: {
      Connection* c = FindById(item.connection_id);
      if (c == nullptr) break;
      // The call named may have completed and been started again (or another call may live at
      // its address) since Cancel() queued this: only a round that still asks to be cancelled
      // is. StartCall clears the request for each new round, and a call found pending or
      // queued below is alive.
      auto still_wanted = [](const ClientCall* call) {
        return call->cancel_requested_.load(std::memory_order_acquire);
      };
      for (uint32_t slot = 0; slot < c->pending_.size(); ++slot) {
        if (c->pending_[slot] != item.call) continue;
        if (!still_wanted(item.call)) return;
        const uint64_t request_id = (uint64_t{c->generation_[slot]} << 32) | slot;
        GiveUp(c, item.call, request_id, absl::CancelledError("cancelled by the caller"));
        return;
      }
      for (ClientCall** p = &c->backlog_head_; *p != nullptr; p = &(*p)->next_) {
        if (*p != item.call) continue;
        if (!still_wanted(item.call)) return;
        ClientCall* call = *p;
        *p = call->next_;
        if (c->backlog_tail_ == call) {
          c->backlog_tail_ = nullptr;
          for (ClientCall* q = c->backlog_head_; q != nullptr; q = q->next_) c->backlog_tail_ = q;
        }
        FinishCall(c, call, absl::CancelledError("cancelled by the caller"));
        return;
      }
      break;
    }
    case WorkItem::kActivate: {
      Connection* c = item.connection.get();
      c->last_received_ = c->activated_at_ = absl::Now();
      c->state_.store(Connection::State::kActive, std::memory_order_release);
      by_qpn_[c->qp().qp_num()] = c;
      by_id_[c->id()] = std::move(item.connection);
      // The server learns that our side is up (WorkerOptions::setup_timeout).
      if (!c->is_server_) SendControl(c, rpc_wire::kPing, 0);
      break;
    }
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

// ---- Receive side ------------------------------------------------------------------------------

void Worker::RepostRecvs() {
  constexpr int kChain = 64;
  ibv_recv_wr wrs[kChain];
  ibv_sge sges[kChain];
  size_t done = 0;
  while (done < repost_.size()) {
    const int n = static_cast<int>(std::min<size_t>(kChain, repost_.size() - done));
    for (int i = 0; i < n; ++i) {
      const uint32_t index = repost_[done + i];
      sges[i].addr = reinterpret_cast<uint64_t>(recv_pool_->at(index));
      sges[i].length = recv_pool_->size();
      sges[i].lkey = recv_pool_->lkey();
      wrs[i].wr_id = kRecvTag | index;
      wrs[i].sg_list = &sges[i];
      wrs[i].num_sge = 1;
      wrs[i].next = i + 1 < n ? &wrs[i + 1] : nullptr;
    }
    ibv_recv_wr* bad = nullptr;
    if (int err = ibv_post_srq_recv(srq_->get(), wrs, &bad); err != 0) {
      SWIRL_LOG(ERROR, "%s: %s", options_.name,
                verbs::VerbsError("ibv_post_srq_recv", err).ToString());
      // Keep the ones that did not make it for the next attempt.
      const size_t posted = static_cast<size_t>(bad - wrs);
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

void Worker::HandleRecv(const ibv_wc& wc) {
  const uint32_t index = static_cast<uint32_t>(wc.wr_id & ~kRecvTag);
  if (index >= recv_pool_->count()) {
    Bump(stray_);
    return;
  }
  --recv_posted_;
  repost_.push_back(index);
  Connection* c = FindByQpn(wc.qp_num);
  if (c == nullptr) {
    // A connection activated a moment ago may not be registered yet.
    DrainSubmissions();
    c = FindByQpn(wc.qp_num);
    if (c == nullptr) {
      Bump(stray_);
      return;
    }
  }
  if (c->state_.load(std::memory_order_relaxed) >= Connection::State::kClosing) return;
  if (wc.status != IBV_WC_SUCCESS) {
    FailConnection(c, absl::UnavailableError(
                          absl::StrCat("receive failed: ", verbs::WcStatusName(wc.status))));
    return;
  }
  const char* buffer = recv_pool_->at(index);
  MessageHeader h;
  if (wc.byte_len >= kHeader) {
    std::memcpy(&h, buffer, kHeader);
  } else {
    std::memset(&h, 0, sizeof(h));
  }
  absl::Status valid =
      rpc_wire::ValidateHeader(h, wc.byte_len, {c->max_payload_, c->peer_credits_});
  if (!valid.ok()) {
    ProtocolError(c, valid);
    return;
  }
  if (c->peer_available_ == 0) {
    ProtocolError(c, absl::ResourceExhaustedError("peer sent beyond the credits it was given"));
    return;
  }
  if (c->send_credits_ + h.credits > c->peer_credits_) {
    ProtocolError(c, absl::InvalidArgumentError("peer returned credits it never received"));
    return;
  }
  --c->peer_available_;
  c->send_credits_ += h.credits;
  ++c->credits_to_return_;
  c->received_ = true;
  Bump(c->counters_.bytes_received, wc.byte_len);
  if (h.type == rpc_wire::kResponse) {
    // A late answer (the call was cancelled or timed out) names its slot's current generation
    // or an older one, and is dropped below. A slot beyond our table, or a generation that slot
    // has not reached yet (compared modulo 2^32, as generations wrap), names a call we never
    // made: no correct peer sends that, and dropping it would hide a peer that makes answers up.
    const uint32_t slot = static_cast<uint32_t>(h.request_id);
    if (slot >= c->pending_.size() ||
        static_cast<int32_t>(static_cast<uint32_t>(h.request_id >> 32) - c->generation_[slot]) >
            0) {
      ProtocolError(c, absl::InvalidArgumentError(absl::StrFormat(
                           "a response for request %u, which was never sent", h.request_id)));
      return;
    }
    // A call whose response came with bulk data has an RDMA READ writing into its buffer: a
    // second response, eager or bulk, would complete it (handing that buffer back under the
    // device) or post another READ into it.
    const ClientCall* pending = PendingCall(c, h.request_id);
    if (pending != nullptr && pending->read_op_ >= 0) {
      ProtocolError(c, absl::InvalidArgumentError(
                           absl::StrFormat("a second response for request %u", h.request_id)));
      return;
    }
  }
  const bool bulk = (h.flags & (rpc_wire::kFlagBulk | rpc_wire::kFlagReplyChunk)) != 0;
  if (bulk || h.type == rpc_wire::kBulkAck || h.type == rpc_wire::kWindowGrant) {
    if (bulk && bulk_pool_ == nullptr) {
      ProtocolError(c, absl::FailedPreconditionError("bulk data but no bulk pool here"));
    } else if (h.type == rpc_wire::kBulkAck) {
      HandleBulkAck(c, h, wc);
    } else if (h.type == rpc_wire::kWindowGrant) {
      if (wc.wc_flags & IBV_WC_WITH_INV) {
        BulkViolation(c, "a window grant invalidated an rkey");
      } else {
        HandleWindowGrant(c, h, buffer + kHeader);
      }
    } else if (h.type == rpc_wire::kRequest) {
      HandleBulkRequest(c, h, buffer + kHeader, wc);
    } else {
      HandleBulkResponse(c, h, buffer + kHeader, wc);
    }
  } else if (wc.wc_flags & IBV_WC_WITH_INV) {
    // Only bulk messages may revoke a window; anything else that does is a violation.
    BulkViolation(c, absl::StrFormat("message type %u invalidated rkey 0x%x", h.type,
                                     wc.invalidated_rkey));
  } else {
    Dispatch(c, h, buffer + kHeader);
  }
  if (c->state_.load(std::memory_order_relaxed) >= Connection::State::kClosing) return;
  // Return credits once half are owed and no message of ours has carried them (every message
  // carries all that are owed when it is queued, so queued WRs, which may be only binds,
  // invalidations or RDMA operations, say nothing about the credits owed since).
  if (c->credits_to_return_ >= std::max<uint32_t>(1, c->local_credits_ / 2)) {
    SendControl(c, rpc_wire::kCredit, 0);
  }
  if (c->send_credits_ > 0 && (c->backlog_head_ != nullptr || !c->response_backlog_.empty())) {
    PumpBacklog(c);
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
    case rpc_wire::kResponse:
      CompleteCall(c, h, payload);
      return;
    case rpc_wire::kCancel: {
      auto it = c->running_.find(h.request_id);
      if (it != c->running_.end()) it->second->store(true, std::memory_order_release);
      return;
    }
    case rpc_wire::kPing:
      SendControl(c, rpc_wire::kPong, 0);
      return;
    case rpc_wire::kPong:
      c->ping_outstanding_ = false;
      return;
    default:
      // kCredit: the credits were taken above. Bulk messages are handled by the bulk layer.
      return;
  }
}

void Worker::DispatchCall(Connection* c, Incoming& in) {
  const MessageHeader& h = in.header;
  Bump(c->counters_.requests_received);
  Bump(requests_);
  const bool one_way = h.type == rpc_wire::kOneWay;
  if ((draining_ && !in.admitted) ||
      c->state_.load(std::memory_order_relaxed) != Connection::State::kActive) {
    if (!one_way) {
      SendResponseBytes(c, h.request_id, absl::UnavailableError("server is shutting down"), {});
    }
    return;
  }
  const Service::Method* method = c->last_method_;
  if (h.method_id != c->last_method_id_ || method == nullptr) {
    method = c->methods_ ? c->methods_->Find(h.method_id) : nullptr;
    c->last_method_id_ = h.method_id;
    c->last_method_ = method;
    c->last_invoker_ = nullptr;
  }
  if (method == nullptr) {
    if (!one_way) {
      SendResponseBytes(
          c, h.request_id,
          absl::UnimplementedError(absl::StrFormat("no method with id 0x%08x", h.method_id)), {});
    }
    return;
  }
  if (method->options.one_way && !one_way) {
    // Its handler produces no response, so the caller would wait for nothing.
    SendResponseBytes(c, h.request_id,
                      absl::InvalidArgumentError(absl::StrFormat(
                          "method 0x%08x is one-way: call it without waiting for a response",
                          h.method_id)),
                      {});
    return;
  }
  if (method->options.execution == Execution::kThreadPool && pool_ != nullptr) {
    RunOnPool(c, in, method);
    return;
  }
  // Invokers are the connection's: its method table (and so `method`) outlives it, which a
  // worker shared by channels that come and go could not say of a cache of its own.
  Service::Invoker* invoker = c->last_invoker_;
  if (invoker == nullptr) {
    std::unique_ptr<Service::Invoker>& slot = c->invokers_[method];
    if (slot == nullptr) slot = const_cast<Service::Method*>(method)->new_invoker();
    invoker = c->last_invoker_ = slot.get();
  }
  // A message carried in bulk is parsed straight out of registered memory.
  const bool message_in_bulk = (h.aux & rpc_wire::kAuxBulkIsMessage) != 0;
  BulkBuffer message_holder;
  absl::string_view message = in.eager;
  ServerContext ctx(c, nullptr);
  if (message_in_bulk) {
    message_holder = std::move(in.bulk);
    message = message_holder.view();
  } else if (in.bulk) {
    ctx.mutable_request_bulk() = std::move(in.bulk);
  }
  Writer writer(this, c);
  absl::Status status = invoker->Invoke(ctx, message, writer);
  if (one_way) {
    writer.Abandon();
    return;
  }
  SendHandlerResult(c, in, std::move(status), &writer, ctx.mutable_response_bulk());
}

void Worker::SendHandlerResult(Connection* c, Incoming& in, absl::Status status, Writer* writer,
                               BulkBuffer& attachment) {
  if (attachment && attachment.size() == 0) attachment.Release();  // empty: no attachment
  if (status.ok() && writer->in_bulk() && attachment) {
    // One descriptor per response: the attachment's. The message must then travel eagerly.
    writer->Abandon();
    attachment.Release();
    status = absl::ResourceExhaustedError(absl::StrFormat(
        "a response with a bulk attachment must keep its message within the eager threshold "
        "(%u bytes)",
        c->negotiated_.eager_threshold()));
  }
  if (status.ok() && writer->in_bulk()) {
    SendBulkResponse(c, in, writer, writer->TakeBulk(), /*is_message=*/true);
  } else if (status.ok() && attachment) {
    SendBulkResponse(c, in, writer, std::move(attachment), /*is_message=*/false);
  } else {
    SendResponse(c, in.header.request_id, status, writer);
  }
}

void Worker::CompleteCall(Connection* c, const MessageHeader& h, const char* payload) {
  ClientCall* call = ReleaseSlot(c, h.request_id);
  if (call == nullptr) return;  // cancelled or timed out already; the late response is dropped
  Bump(c->counters_.responses_received);
  absl::Status status;
  if (h.status == 0) {
    if (call->response_ != nullptr) {
      if (!call->response_->ParseFromArray(payload, static_cast<int>(h.payload_len))) {
        status = absl::DataLossError("response does not parse");
      }
    } else if (call->response_bytes_ != nullptr) {
      call->response_bytes_->assign(payload, h.payload_len);
    }
  } else {
    status = absl::Status(static_cast<absl::StatusCode>(h.status),
                          absl::string_view(payload, h.payload_len));
  }
  FinishCall(c, call, std::move(status));
}

void Worker::RunOnPool(Connection* c, Incoming& in, const Service::Method* method) {
  const MessageHeader& h = in.header;
  const bool one_way = h.type == rpc_wire::kOneWay;
  // Queued blocking handlers hold their request and attachment until a pool thread gets to
  // them, and the peer has its credits back at once: without a bound, one peer could queue
  // without end (one-way calls take no call slot) or pin the bulk pool through attachments.
  const uint64_t held = in.eager.size() + in.bulk.capacity();
  if (c->pool_handlers_ >= 2 * c->local_credits_ ||
      (c->pool_handlers_ > 0 && (c->pool_bytes_ + held > options_.grant_bytes_per_connection ||
                                 ClientBulkBytes(c) + held > bulk_bytes_per_client_))) {
    if (!one_way) {
      SendResponseBytes(c, h.request_id,
                        absl::ResourceExhaustedError(absl::StrFormat(
                            "%u blocking calls (%u bytes) of this connection wait for the "
                            "handler pool already",
                            c->pool_handlers_, c->pool_bytes_)),
                        {});
    }
    return;  // the attachment, if any, goes back to the pool with `in`
  }
  ++c->pool_handlers_;
  // Counted against the client too (bulk_bytes_per_client), until the handler is done: even
  // past the connection's end, as the handler still holds the memory.
  ChargeBulk(c, &c->pool_bytes_, static_cast<int64_t>(held));
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  if (one_way) {
    c->running_one_way_.push_back(cancelled);
  } else {
    c->running_[h.request_id] = cancelled;
  }
  const bool message_in_bulk = (h.aux & rpc_wire::kAuxBulkIsMessage) != 0;
  // The pool path copies the (eager) message: blocking handlers are not the zero-copy path.
  std::string request = message_in_bulk ? std::string(in.bulk.view()) : std::string(in.eager);
  BulkBuffer attachment = message_in_bulk ? BulkBuffer() : std::move(in.bulk);
  if (message_in_bulk) in.bulk.Release();
  const bool has_chunk = in.has_chunk;
  const rpc_wire::BulkDescriptor chunk = in.chunk;
  pool_->Schedule([this, connection = c->shared_from_this(), method, header = h, one_way, held,
                   request = std::move(request), attachment = std::move(attachment), cancelled,
                   has_chunk, chunk]() mutable {
    thread_local absl::flat_hash_map<const Service::Method*, std::unique_ptr<Service::Invoker>>
        invokers;
    std::unique_ptr<Service::Invoker>& invoker = invokers[method];
    if (invoker == nullptr) invoker = const_cast<Service::Method*>(method)->new_invoker();
    ServerContext ctx(connection.get(), cancelled.get());
    ctx.mutable_request_bulk() = std::move(attachment);
    StringWriter writer(connection->negotiated().max_bulk_size() > 0
                            ? connection->negotiated().max_bulk_size()
                            : connection->max_payload_);
    absl::Status status = invoker->Invoke(ctx, request, writer);
    RunInLoop([this, connection, header, one_way, held, status = std::move(status),
               response = writer.Take(), bulk = std::move(ctx.mutable_response_bulk()),
               has_chunk, chunk, cancelled]() mutable {
      Connection* c = connection.get();
      --c->pool_handlers_;
      ChargeBulk(c, &c->pool_bytes_, -static_cast<int64_t>(held));
      if (one_way) {
        auto& list = c->running_one_way_;
        if (auto it = std::find(list.begin(), list.end(), cancelled); it != list.end()) {
          list.erase(it);
        }
      } else {
        c->running_.erase(header.request_id);
      }
      if (one_way || c->state_.load() >= Connection::State::kClosing) return;
      Incoming in;
      in.header = header;
      in.has_chunk = has_chunk;
      in.chunk = chunk;
      // From here as an inline handler's result: the writer moves a response above the eager
      // threshold into bulk memory by itself.
      Writer writer(this, c);
      if (status.ok() && !writer.Append(response)) {
        status = absl::ResourceExhaustedError("response exceeds the maximum message size");
      }
      SendHandlerResult(c, in, std::move(status), &writer, bulk);
    });
  });
}

// ---- Send side ---------------------------------------------------------------------------------

char* Worker::InlineSlot() {
  const uint32_t slot_size = std::max<uint32_t>(max_inline_, 64);
  if (inline_used_ == kArenaSlots) FlushSends();
  return inline_arena_.data() + static_cast<size_t>(inline_used_++) * slot_size;
}

char* Worker::AllocMessage(Connection*, uint32_t length, int32_t* buffer) {
  if (length <= max_inline_) {
    *buffer = -1;
    return InlineSlot();
  }
  if (send_pool_->empty() || length > send_pool_->size()) return nullptr;
  uint32_t index = send_pool_->Take();
  *buffer = static_cast<int32_t>(index);
  return send_pool_->at(index);
}

void Worker::FillHeader(Connection* c, MessageHeader* h) {
  h->credits = c->credits_to_return_;
  c->peer_available_ += c->credits_to_return_;
  c->credits_to_return_ = 0;
}

void Worker::SendResponse(Connection* c, uint64_t request_id, const absl::Status& status,
                          Writer* writer) {
  if (!status.ok() || writer->data() == nullptr) {
    writer->Abandon();
    SendResponseBytes(c, request_id, status, {});
    return;
  }
  EmitResponse(c, writer, request_id, 0);
}

void Worker::SendResponseBytes(Connection* c, uint64_t request_id, const absl::Status& status,
                               absl::string_view payload) {
  // An error response carries the status message as its payload.
  absl::string_view body = status.ok() ? payload : status.message();
  const size_t n = std::min<size_t>(body.size(), c->max_payload_);
  Writer writer(this, c);
  char* p = writer.Reserve(n);
  if (p == nullptr) {
    FailConnection(c, absl::ResourceExhaustedError("send buffers exhausted"));
    return;
  }
  if (n > 0) std::memcpy(p, body.data(), n);  // an empty body may have no data() at all
  writer.Commit(n);
  if (status.ok() && n < body.size()) {
    writer.Abandon();
    SendResponseBytes(c, request_id,
                      absl::ResourceExhaustedError("response exceeds the maximum message size"),
                      {});
    return;
  }
  EmitResponse(c, &writer, request_id, static_cast<uint32_t>(status.code()));
}

void Worker::EmitResponse(Connection* c, Writer* writer, uint64_t request_id, uint32_t code) {
  auto* h = reinterpret_cast<MessageHeader*>(writer->data());
  *h = MessageHeader{rpc_wire::kProtocolVersion, rpc_wire::kResponse, 0, 0, request_id, code,
                     writer->length(), 0, 0};
  char* data = writer->data();
  int32_t buffer = writer->buffer();
  const uint32_t length = kHeader + writer->length();
  writer->Release();
  Bump(c->counters_.responses_sent);
  EmitMessage(c, data, length, buffer, 0);
}

void Worker::EmitMessage(Connection* c, char* data, uint32_t length, int32_t buffer,
                         uint32_t invalidate_rkey, unsigned int flags) {
  if (c->state_.load(std::memory_order_relaxed) >= Connection::State::kClosing) {
    // Failed already (possibly by a step of the operation that is emitting this): nothing will
    // send or give back what is parked from now on.
    if (buffer >= 0) send_pool_->Give(static_cast<uint32_t>(buffer));
    return;
  }
  if (c->send_credits_ > 0 && c->response_backlog_.empty()) {
    QueueWr(c, data, length, buffer, invalidate_rkey, flags);
    return;
  }
  // No credit now: park it in a send buffer until the peer returns some. The send pool is the
  // worker's, shared by all its connections, so parking is bounded per connection: its share of
  // the pool, and at least four messages per credit we grant. An honest peer stays far below
  // that: it may send only while we return credits, which travel only on what we send, so while
  // we park it can add at most one credit window of requests, each owed a response and perhaps
  // a grant or an ack (e2e_test: a caller that starts 2,000 calls without polling is slowed,
  // not shed). A peer over the bound is not taking our messages yet keeps finding a way to make
  // more; it is shed, saying why, before the pool runs dry for everyone.
  const size_t max_backlog = std::max<size_t>(4 * size_t{c->local_credits_},
                                              send_pool_->count() / options_.max_connections);
  if (c->response_backlog_.size() >= max_backlog) {
    if (buffer >= 0) send_pool_->Give(static_cast<uint32_t>(buffer));
    SWIRL_LOG(WARNING, "%s: connection %u (%s): %u messages wait for credits the peer does not "
              "return; closing it", options_.name, c->id_, c->peer_, c->response_backlog_.size());
    FailConnection(c, absl::ResourceExhaustedError(absl::StrFormat(
                          "%u messages waited for credits the peer did not return",
                          c->response_backlog_.size())));
    return;
  }
  if (buffer < 0) {
    if (send_pool_->empty()) {
      FailConnection(c, absl::ResourceExhaustedError("send buffers exhausted"));
      return;
    }
    const uint32_t index = send_pool_->Take();
    std::memcpy(send_pool_->at(index), data, length);
    buffer = static_cast<int32_t>(index);
  }
  c->response_backlog_.push_back({static_cast<uint32_t>(buffer), length, invalidate_rkey, flags});
}

void Worker::SendControl(Connection* c, rpc_wire::MessageType type, uint64_t request_id) {
  if (c->send_credits_ == 0) return;  // best effort; credits come back with the next message
  int32_t buffer;
  char* data = AllocMessage(c, kHeader, &buffer);
  if (data == nullptr) return;
  auto* h = reinterpret_cast<MessageHeader*>(data);
  *h = MessageHeader{rpc_wire::kProtocolVersion, static_cast<uint8_t>(type), 0, 0, request_id,
                     0, 0, 0, 0};
  QueueWr(c, data, kHeader, buffer);
}

void Worker::QueueWr(Connection* c, const char* data, uint32_t length, int32_t buffer,
                     uint32_t invalidate_rkey, unsigned int extra_flags) {
  FillHeader(c, reinterpret_cast<MessageHeader*>(const_cast<char*>(data)));
  --c->send_credits_;
  // Built in place in the doorbell batch: the message path is the hot path.
  const int i = c->batch_size_;
  ibv_sge& sge = c->batch_sge_[i];
  sge.addr = reinterpret_cast<uint64_t>(data);
  sge.length = length;
  sge.lkey = buffer >= 0 ? send_pool_->lkey() : 0;
  ibv_send_wr& wr = c->batch_wr_[i];
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = invalidate_rkey != 0 ? IBV_WR_SEND_WITH_INV : IBV_WR_SEND;
  wr.invalidate_rkey = invalidate_rkey;
  wr.send_flags = extra_flags | (buffer < 0 ? IBV_SEND_INLINE : 0);
  Track(c, wr, buffer, -1);
  Bump(c->counters_.bytes_sent, length);
}

uint64_t Worker::QueueRawWr(Connection* c, ibv_send_wr& wr, const ibv_sge* sge, int32_t buffer,
                            int32_t op) {
  const int i = c->batch_size_;
  ibv_send_wr& out = c->batch_wr_[i];
  out = wr;
  if (sge != nullptr) {
    c->batch_sge_[i] = *sge;
    out.sg_list = &c->batch_sge_[i];
    out.num_sge = 1;
  } else {
    out.sg_list = nullptr;
    out.num_sge = 0;
  }
  return Track(c, out, buffer, op);
}

uint64_t Worker::Track(Connection* c, ibv_send_wr& wr, int32_t buffer, int32_t op) {
  const uint64_t seq = c->next_seq_++;
  const uint64_t outstanding = seq - c->completed_seq_;
  // Signal when a resource waits on this WR, and often enough that unsignaled WRs never fill
  // the send queue.
  const bool signal = buffer >= 0 || op >= 0 || ++c->unsignaled_ >= kSignalInterval ||
                      outstanding + kSignalInterval >= c->sq_depth_;
  if (signal) {
    c->unsignaled_ = 0;
    wr.send_flags |= IBV_SEND_SIGNALED;
  }
  const size_t slot = seq & (c->sent_buffer_.size() - 1);
  c->sent_buffer_[slot] = buffer;
  c->op_at_seq_[slot] = op;
  wr.wr_id = seq;
  wr.next = nullptr;
  ++c->batch_size_;
  if (!c->dirty_) {
    c->dirty_ = true;
    dirty_.push_back(c);
  }
  if (c->batch_size_ == Connection::kBatch) FlushConnection(c);
  return seq;
}

void Worker::FlushConnection(Connection* c) {
  if (c->batch_size_ == 0) return;
  for (int i = 0; i + 1 < c->batch_size_; ++i) c->batch_wr_[i].next = &c->batch_wr_[i + 1];
  ibv_send_wr* bad = nullptr;
  const int err = ibv_post_send(c->qp_->get(), c->batch_wr_, &bad);
  c->batch_size_ = 0;
  if (err != 0) {
    FailConnection(c, verbs::VerbsError("ibv_post_send", err));
  }
}

void Worker::FlushSends() {
  for (Connection* c : dirty_) {
    FlushConnection(c);
    c->dirty_ = false;
  }
  dirty_.clear();
  inline_used_ = 0;
}

void Worker::HandleSendCompletion(const ibv_wc& wc) {
  Connection* c = FindByQpn(wc.qp_num);
  if (c == nullptr) {
    Bump(stray_);
    return;
  }
  const uint64_t seq = wc.wr_id;
  if (seq >= c->next_seq_) {
    Bump(stray_);
    return;
  }
  const uint64_t first = c->completed_seq_ + 1;
  if (seq > c->completed_seq_) c->completed_seq_ = seq;
  for (uint64_t s = first; s <= seq; ++s) {
    const size_t slot = s & (c->sent_buffer_.size() - 1);
    int32_t& b = c->sent_buffer_[slot];
    if (b >= 0) send_pool_->Give(static_cast<uint32_t>(b));
    b = -1;
    const int32_t op = c->op_at_seq_[slot];
    c->op_at_seq_[slot] = -1;
    if (op >= 0) {
      ibv_wc status = wc;
      if (s != seq) status.status = IBV_WC_SUCCESS;  // retired by a later success
      HandleBulkOp(c, op, status);
    }
  }
  if (wc.status != IBV_WC_SUCCESS &&
      c->state_.load(std::memory_order_relaxed) < Connection::State::kClosing) {
    FailConnection(c, absl::UnavailableError(
                          absl::StrCat("send failed: ", verbs::WcStatusName(wc.status))));
  }
}

void Worker::StartCallLocked(Connection* c, ClientCall* call) {
  if (c == nullptr || c->state_.load(std::memory_order_relaxed) != Connection::State::kActive) {
    CompleteLocally(call, absl::UnavailableError(
                              c != nullptr && !c->close_reason_.ok()
                                  ? absl::StrCat("connection closed: ", c->close_reason_.message())
                                  : "connection closed"));
    return;
  }
  call->connection_ = c;
  call->next_ = nullptr;
  if (c->backlog_head_ == nullptr && TrySendCall(c, call)) return;
  if (c->backlog_tail_ != nullptr) {
    c->backlog_tail_->next_ = call;
  } else {
    c->backlog_head_ = call;
  }
  c->backlog_tail_ = call;
}

bool Worker::TrySendCall(Connection* c, ClientCall* call) {
  // A new request needs two credits: the last one is kept for returning credits.
  if (c->send_credits_ < 2) return false;
  if (!call->one_way_ && c->free_slots_.empty()) return false;
  const size_t size =
      call->request_ != nullptr ? call->request_->ByteSizeLong() : call->request_bytes_.size();
  const bool message_in_bulk = size > c->negotiated_.eager_threshold() && bulk_pool_ != nullptr &&
                               c->negotiated_.max_bulk_size() > 0;
  if (call->request_bulk_ != nullptr && (message_in_bulk || call->one_way_)) {
    FinishCall(c, call, absl::InvalidArgumentError(
                            call->one_way_
                                ? "one-way calls cannot carry bulk data"
                                : absl::StrFormat("a request with a bulk attachment must keep its "
                                                  "message within the eager threshold (%u bytes)",
                                                  c->negotiated_.eager_threshold())));
    return true;
  }
  if (call->response_bulk_ != nullptr && *call->response_bulk_ &&
      (bulk_pool_ == nullptr ||
       !bulk_pool_->Contains(call->response_bulk_->data(), call->response_bulk_->capacity()))) {
    FinishCall(c, call, absl::InvalidArgumentError(
                            "response_bulk must come from this channel's AllocateBulk"));
    return true;
  }
  if ((message_in_bulk || call->request_bulk_ != nullptr) && !call->one_way_) {
    if (message_in_bulk && !call->scratch_) {
      // Serialize once, straight into registered memory; a retry reuses it.
      auto scratch = bulk_pool_->Allocate(size);
      if (!scratch.ok()) {
        FinishCall(c, call, scratch.status());
        return true;
      }
      call->scratch_ = std::move(*scratch);
      if (call->request_ != nullptr) {
        call->request_->SerializeWithCachedSizesToArray(
            reinterpret_cast<uint8_t*>(call->scratch_.data()));
      } else {
        std::memcpy(call->scratch_.data(), call->request_bytes_.data(), size);
      }
    }
    return SendBulkCall(c, call, size, message_in_bulk);
  }
  if (size > c->max_payload_) {
    FinishCall(c, call, absl::ResourceExhaustedError(absl::StrFormat(
                              "request of %u bytes exceeds the %u-byte maximum message size",
                              size, c->max_payload_)));
    return true;
  }
  int32_t buffer;
  char* data = AllocMessage(c, static_cast<uint32_t>(kHeader + size), &buffer);
  if (data == nullptr) return false;
  const uint64_t request_id = call->one_way_ ? 0 : AllocateSlot(c, call);
  auto* h = reinterpret_cast<MessageHeader*>(data);
  *h = MessageHeader{rpc_wire::kProtocolVersion,
                     static_cast<uint8_t>(call->one_way_ ? rpc_wire::kOneWay : rpc_wire::kRequest),
                     0,
                     call->method_id_,
                     request_id,
                     0,
                     static_cast<uint32_t>(size),
                     0,
                     0};
  if (call->request_ != nullptr) {
    call->request_->SerializeWithCachedSizesToArray(
        reinterpret_cast<uint8_t*>(data + kHeader));
  } else if (size > 0) {
    std::memcpy(data + kHeader, call->request_bytes_.data(), size);
  }
  // Pending before the doorbell: if queueing rings it and the post fails, the connection fails
  // and completes the call, which must not be marked pending after that.
  if (!call->one_way_) call->state_.store(ClientCall::kPending, std::memory_order_relaxed);
  QueueWr(c, data, static_cast<uint32_t>(kHeader + size), buffer);
  Bump(c->counters_.requests_sent);
  if (call->one_way_) {
    CompleteLocally(call, c->state_.load(std::memory_order_relaxed) >= Connection::State::kClosing
                              ? absl::UnavailableError("connection lost")
                              : absl::OkStatus());
  }
  return true;
}

void Worker::PumpBacklog(Connection* c) {
  while (!c->response_backlog_.empty() && c->send_credits_ > 0) {
    const Connection::QueuedMessage m = c->response_backlog_.front();
    c->response_backlog_.pop_front();
    QueueWr(c, send_pool_->at(m.buffer), m.length, static_cast<int32_t>(m.buffer),
            m.invalidate_rkey, m.flags);
  }
  while (c->backlog_head_ != nullptr && c->response_backlog_.empty()) {
    // Unlinked before it is tried: TrySendCall may complete it (a one-way call, a failure),
    // after which its owner may free it, or its callback start calls that join this list.
    ClientCall* call = c->backlog_head_;
    c->backlog_head_ = call->next_;
    if (c->backlog_head_ == nullptr) c->backlog_tail_ = nullptr;
    call->next_ = nullptr;
    if (!TrySendCall(c, call)) {  // not completed: back to the front, and wait for credits
      call->next_ = c->backlog_head_;
      c->backlog_head_ = call;
      if (c->backlog_tail_ == nullptr) c->backlog_tail_ = call;
      break;
    }
  }
}

std::vector<ClientCall*> Worker::UnlinkBacklog(Connection* c,
                                               absl::FunctionRef<bool(const ClientCall*)> drop) {
  std::vector<ClientCall*> out;
  c->backlog_tail_ = nullptr;
  for (ClientCall** p = &c->backlog_head_; *p != nullptr;) {
    ClientCall* call = *p;
    if (drop(call)) {
      *p = call->next_;
      call->next_ = nullptr;
      out.push_back(call);
    } else {
      c->backlog_tail_ = call;
      p = &call->next_;
    }
  }
  return out;
}

uint64_t Worker::AllocateSlot(Connection* c, ClientCall* call) {
  const uint32_t slot = c->free_slots_.back();
  c->free_slots_.pop_back();
  ++c->generation_[slot];
  c->pending_[slot] = call;
  ++c->pending_count_;
  call->request_id_ = (uint64_t{c->generation_[slot]} << 32) | slot;
  return call->request_id_;
}

ClientCall* Worker::ReleaseSlot(Connection* c, uint64_t request_id) {
  const uint32_t slot = static_cast<uint32_t>(request_id);
  if (slot >= c->pending_.size() || c->generation_[slot] != (request_id >> 32)) return nullptr;
  ClientCall* call = c->pending_[slot];
  if (call == nullptr) return nullptr;
  c->pending_[slot] = nullptr;
  c->free_slots_.push_back(slot);
  --c->pending_count_;
  return call;
}

void Worker::GiveUp(Connection* c, ClientCall* call, uint64_t request_id, absl::Status status) {
  if (DeferIfExposing(c, call, status)) {  // mirror: the server still holds our windows
    SendControl(c, rpc_wire::kCancel, request_id);
    return;
  }
  ReleaseSlot(c, request_id);
  const bool downloading = call->read_op_ >= 0;
  if (DeferIfReading(c, call, status)) {
    // A download's response is here already, only its READ is left; an upload's request may
    // still be answered, and the server can stop early.
    if (!downloading) SendControl(c, rpc_wire::kCancel, request_id);
    return;
  }
  SendControl(c, rpc_wire::kCancel, request_id);
  FinishCall(c, call, std::move(status));
}

void Worker::CompleteLocally(ClientCall* call, absl::Status status) {
  if (!call->abandoned_status_.ok()) {  // whatever the server answered, the caller gave up
    status = std::exchange(call->abandoned_status_, absl::OkStatus());
  }
  call->connection_ = nullptr;
  call->Complete(std::move(status));
}

// ---- Failure, teardown, timers -----------------------------------------------------------------

void Worker::ProtocolError(Connection* c, const absl::Status& why) {
  Bump(c->counters_.protocol_errors);
  Bump(protocol_errors_);
  SWIRL_LOG(WARNING, "%s: connection %u (%s): protocol violation: %s; closing it",
            options_.name, c->id_, c->peer_, why.ToString());
  FailConnection(c, absl::Status(why.code(), absl::StrCat("protocol violation by the peer: ",
                                                         why.message())));
}

void Worker::FailPendingCalls(Connection* c, const absl::Status& why) {
  for (uint32_t slot = 0; slot < c->pending_.size(); ++slot) {
    ClientCall* call = c->pending_[slot];
    if (call == nullptr) continue;
    c->pending_[slot] = nullptr;
    c->free_slots_.push_back(slot);
    CompleteLocally(call, why);
  }
  c->pending_count_ = 0;
  while (c->backlog_head_ != nullptr) {
    ClientCall* call = c->backlog_head_;
    c->backlog_head_ = call->next_;
    CompleteLocally(call, why);
  }
  c->backlog_tail_ = nullptr;
}

void Worker::FailConnection(Connection* c, const absl::Status& why) {
  if (c->state_.load(std::memory_order_relaxed) >= Connection::State::kClosing) return;
  c->close_reason_ = why;
  c->state_.store(Connection::State::kClosing, std::memory_order_release);
  SWIRL_LOG(DEBUG, "%s: closing connection %u: %s", options_.name, c->id_, why.ToString());
  // The QP goes to ERR before any call completes: from then on the device places no data for
  // it and no window bound to it can be used, so buffers that READs were filling or windows
  // were exposing can go back to their owners.
  if (absl::Status s = c->qp_->ToError(); !s.ok()) {
    SWIRL_LOG(WARNING, "%s: %s", options_.name, s.ToString());
  }
  SettleBulkOps(c);
  FailPendingCalls(c, absl::UnavailableError(absl::StrCat("connection lost: ", why.message())));
  // Blocking handlers still running for this connection can no longer answer anyone.
  for (auto& [request_id, cancelled] : c->running_) cancelled->store(true, std::memory_order_release);
  for (auto& cancelled : c->running_one_way_) cancelled->store(true, std::memory_order_release);
  for (const auto& m : c->response_backlog_) send_pool_->Give(m.buffer);
  c->response_backlog_.clear();
  // Queued but never posted WRs: their send buffers come back now.
  for (int i = 0; i < c->batch_size_; ++i) {
    const uint64_t seq = c->batch_wr_[i].wr_id;
    int32_t& b = c->sent_buffer_[seq & (c->sent_buffer_.size() - 1)];
    if (b >= 0) send_pool_->Give(static_cast<uint32_t>(b));
    b = -1;
  }
  if (c->batch_size_ > 0) c->next_seq_ = c->batch_wr_[0].wr_id;
  c->batch_size_ = 0;
  // Unsignaled sends that completed before the error never report. A signaled WR posted now is
  // flushed behind them; its completion retires everything before it.
  ibv_send_wr marker{};
  marker.wr_id = c->next_seq_++;
  marker.opcode = IBV_WR_SEND;
  marker.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(c->qp_->get(), &marker, &bad) != 0) --c->next_seq_;
  c->closing_since_ = absl::Now();
  closing_.push_back(c);
}

void Worker::FinishClose(Connection* c) {
  // A batch still waiting for its doorbell is never posted (the QP is in the error state and
  // about to go), and the connection leaves the doorbell list before it is destroyed; its
  // buffers come back with the unposted sequence numbers below.
  if (c->dirty_) {
    dirty_.erase(std::remove(dirty_.begin(), dirty_.end(), c), dirty_.end());
    c->dirty_ = false;
  }
  c->batch_size_ = 0;
  // Send WRs that never completed (the device is gone or slow): take their buffers back.
  for (uint64_t s = c->completed_seq_ + 1; s < c->next_seq_; ++s) {
    int32_t& b = c->sent_buffer_[s & (c->sent_buffer_.size() - 1)];
    if (b >= 0) send_pool_->Give(static_cast<uint32_t>(b));
    b = -1;
  }
  c->completed_seq_ = c->next_seq_ - 1;
  for (const Connection::QueuedMessage& m : c->response_backlog_) send_pool_->Give(m.buffer);
  c->response_backlog_.clear();
  ReleaseBulk(c);  // windows are deallocated (and so revoked) before the QP goes
  // Whatever the connection still held no longer counts against its client.
  ChargeBulk(c, &c->granted_bytes_, -static_cast<int64_t>(c->granted_bytes_));
  ChargeBulk(c, &c->download_bytes_, -static_cast<int64_t>(c->download_bytes_));
  by_qpn_.erase(c->qp_->qp_num());
  last_connection_ = nullptr;
  if (options_.before_qp_destroy) options_.before_qp_destroy();
  c->qp_.reset();  // no completion can name it any more: it is in ERR and fully flushed
  {
    swirl::MutexLock lock(&mu_);
    registry_.erase(c->id_);
    reserved_credits_ -= options_.credits;
  }
  c->state_.store(Connection::State::kClosed, std::memory_order_release);
  const uint64_t id = c->id_;
  const absl::Status reason = c->close_reason_;
  by_id_.erase(id);  // may destroy c
  if (options_.on_closed) options_.on_closed(id, reason);
}

void Worker::Timers(absl::Time now) {
  bool idle = !draining_ || dirty_.empty();
  for (auto& [id, owner] : by_id_) {
    Connection* c = owner.get();
    const Connection::State state = c->state_.load(std::memory_order_relaxed);
    if (state != Connection::State::kActive && state != Connection::State::kDraining) continue;
    if (c->pending_count_ > 0) {
      for (uint32_t slot = 0; slot < c->pending_.size(); ++slot) {
        ClientCall* call = c->pending_[slot];
        if (call == nullptr || call->deadline_ > now) continue;
        const uint64_t request_id = (uint64_t{c->generation_[slot]} << 32) | slot;
        GiveUp(c, call, request_id, absl::DeadlineExceededError("deadline exceeded"));
      }
    }
    if (!c->windows_.empty()) BulkTimers(c, now);
    if (c->grant_owed_) SendOwedGrant(c);
    if (c->backlog_head_ != nullptr) {
      for (ClientCall* call :
           UnlinkBacklog(c, [now](const ClientCall* call) { return call->deadline_ <= now; })) {
        FinishCall(c, call, absl::DeadlineExceededError("deadline exceeded before sending"));
      }
    }
    if (c->received_) c->heard_from_peer_ = true;
    if (c->is_server_ && !c->heard_from_peer_ && options_.setup_timeout > absl::ZeroDuration() &&
        now - c->activated_at_ > options_.setup_timeout) {
      FailConnection(c, absl::DeadlineExceededError(absl::StrCat(
                            "the client sent nothing within ",
                            absl::FormatDuration(options_.setup_timeout), " of connecting")));
      continue;
    }
    if (options_.keepalive > absl::ZeroDuration()) {
      if (c->received_) {
        c->received_ = false;
        c->last_received_ = now;
        c->ping_outstanding_ = false;
      } else if (!c->ping_outstanding_ && now - c->last_received_ > options_.keepalive) {
        SendControl(c, rpc_wire::kPing, 0);
        c->ping_outstanding_ = true;
        c->ping_sent_ = now;
      } else if (c->ping_outstanding_ && now - c->ping_sent_ > 3 * options_.keepalive) {
        FailConnection(c, absl::DeadlineExceededError("the peer stopped answering keepalives"));
      }
    }
    if (c->pool_handlers_ > 0 || !c->response_backlog_.empty() || c->batch_size_ > 0 ||
        (draining_ && idle && BulkInFlight(c))) {
      idle = false;
    }
  }
  for (size_t i = 0; i < closing_.size();) {
    Connection* c = closing_[i];
    if (c->completed_seq_ + 1 >= c->next_seq_ || now - c->closing_since_ > absl::Seconds(2)) {
      closing_[i] = closing_.back();
      closing_.pop_back();
      FinishClose(c);
    } else {
      ++i;
    }
  }
  if (draining_) drained_.store(idle, std::memory_order_release);
  if (!dirty_.empty()) FlushSends();
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
  return options_.max_connections * options_.credits - reserved_credits_;
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

// ---- ThreadPool --------------------------------------------------------------------------------

ThreadPool::ThreadPool(int threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

ThreadPool::~ThreadPool() { Stop(); }

void ThreadPool::Stop() {
  // Tasks not yet started are dropped, not run: their connections are closed by now. Running
  // ones are waited for. The queue is destroyed outside the lock (tasks own buffers and
  // connections).
  std::deque<absl::AnyInvocable<void()>> dropped;
  {
    swirl::MutexLock lock(&mu_);
    stop_ = true;
    dropped.swap(tasks_);
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void ThreadPool::Schedule(absl::AnyInvocable<void()> task) {
  {
    swirl::MutexLock lock(&mu_);
    if (!stop_) {
      tasks_.push_back(std::move(task));
      return;
    }
  }
  // Stopped (a worker still dispatching during shutdown): dropped, outside the lock.
  task = nullptr;
}

void ThreadPool::Run() {
  for (;;) {
    absl::AnyInvocable<void()> task;
    {
      swirl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ThreadPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
            return p->stop_ || !p->tasks_.empty();
          },
          this));
      if (stop_) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace swirl::internal

namespace swirl {

bool ServerContext::IsCancelled() const {
  return cancelled_ != nullptr && cancelled_->load(std::memory_order_acquire);
}
uint64_t ServerContext::connection_id() const { return connection_->id(); }
const std::string& ServerContext::peer() const { return connection_->peer(); }
std::shared_ptr<CallTarget> ServerContext::caller() const { return connection_->AsCallTarget(); }

}  // namespace swirl
