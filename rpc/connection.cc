#include "rpc/connection.h"

#include <algorithm>
#include <bit>
#include <utility>

#include "absl/strings/str_cat.h"
#include "rpc/bulk_pool.h"
#include "rpc/handshake.h"
#include "rpc/worker.h"

namespace swirl::internal {
namespace {

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

}  // namespace

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

Liveness::Verdict Liveness::Tick(absl::Time now, const Timeouts& timeouts, bool is_server) {
  if (received_) heard_from_peer_ = true;
  if (is_server && !heard_from_peer_ && timeouts.setup_timeout > absl::ZeroDuration() &&
      now - activated_at_ > timeouts.setup_timeout) {
    return Verdict::kSilentClient;
  }
  if (timeouts.keepalive <= absl::ZeroDuration()) return Verdict::kAlive;
  if (received_) {
    received_ = false;
    last_received_ = now;
    ping_outstanding_ = false;
  } else if (!ping_outstanding_ && now - last_received_ > timeouts.keepalive) {
    ping_outstanding_ = true;
    ping_sent_ = now;
    return Verdict::kSendPing;
  } else if (ping_outstanding_ && now - ping_sent_ > 3 * timeouts.keepalive) {
    return Verdict::kStoppedAnswering;
  }
  return Verdict::kAlive;
}

Connection::Connection(Worker* worker, uint64_t id, std::unique_ptr<verbs::QueuePair> qp,
                       const MethodTable* methods, uint32_t send_queue_depth, Gate* work)
    : worker_(worker),
      id_(id),
      qp_(std::move(qp)),
      qp_num_(qp_->qp_num()),
      methods_(methods) {
  sends_.Init(send_queue_depth);
  credits_.set_gate(work);
  windows_.set_gate(work);
  ops_.set_gate(work);
}

Connection::~Connection() = default;

void Connection::Configure(const control::Negotiated& negotiated, bool is_server,
                           std::string peer, std::string client_name, std::string principal,
                           CreditPool* pool) {
  negotiated_ = negotiated;
  is_server_ = is_server;
  peer_ = std::move(peer);
  principal_ = std::move(principal);
  // Once here, not per message: the per-client budgets look it up by this key.
  client_key_ = LimitKey(principal_, peer_);
  client_name_ = std::move(client_name);
  remote_invalidation_ = negotiated.invalidation() == control::INVALIDATION_REMOTE;
  max_payload_ = negotiated.max_message_size();
  eager_limit_ = worker_->bulk_pool() != nullptr && negotiated.max_bulk_size() > 0
                     ? std::min(max_payload_, negotiated.eager_threshold())
                     : max_payload_;
  // The peer may grant us more receive buffers than our send queue was sized for (it was
  // created before the peer's offer was known): we use no more than the queue holds (the
  // ledger's send_cap). Using fewer credits than granted is always safe.
  const uint32_t peer_grant = is_server ? negotiated.server_credits() : negotiated.client_credits();
  const uint32_t send_cap = std::min<uint32_t>(
      peer_grant, sends_.depth() - Worker::kBulkSqReserve - SendQueue::kSignalInterval);
  const uint32_t local_grant = is_server ? negotiated.client_credits() : negotiated.server_credits();
  credits_.Init({.peer_grant = peer_grant,
                 .peer_initial = is_server ? negotiated.server_initial_credits()
                                           : negotiated.client_initial_credits(),
                 .send_cap = send_cap,
                 .local_grant = local_grant,
                 .local_initial = is_server ? negotiated.client_initial_credits()
                                            : negotiated.server_initial_credits(),
                 .pool = pool});
  // Windows: two per call in flight either way (downloads, mirror requests and replies), plus
  // unused upload grants, window_credits of them per size class the negotiated maximum spans
  // (grants of one class must not leave none for downloads or for another class).
  uint32_t classes = 1;
  for (uint64_t size = BulkPool::kMinClass; size < negotiated.max_bulk_size(); size <<= 1) {
    ++classes;
  }
  windows_.Init(2 * std::max(send_cap, local_grant) + negotiated.window_credits() * classes + 4);
  calls_.Init(std::bit_ceil<uint32_t>(std::max<uint32_t>(send_cap, 1)));
}

std::shared_ptr<CallTarget> Connection::AsCallTarget() {
  return std::make_shared<PeerTarget>(weak_from_this());
}

}  // namespace swirl::internal
