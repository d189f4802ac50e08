#include "swirl/server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <bit>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/mutex.h"
#include "proto/control.grpc.pb.h"
#include "rpc/establish.h"
#include "rpc/handshake.h"
#include "rpc/stats_convert.h"
#include "rpc/worker.h"

namespace swirl {
namespace {

// Why a connection closed, when that is orderly (OnClosed counts every other reason as a
// failure).
constexpr absl::string_view kClientDisconnected = "client disconnected";
constexpr absl::string_view kServerShutDown = "server shut down";
constexpr int kMaxControlMessage = 64 << 10;

// At most kBurst log lines per second; counts what it turned down.
class LogLimiter {
 public:
  bool Allow(absl::Time now, uint64_t* unlogged) {
    swirl::MutexLock lock(&mu_);
    if (now - window_start_ >= absl::Seconds(1)) {
      window_start_ = now;
      in_window_ = 0;
    }
    if (in_window_ >= kBurst) {
      ++suppressed_;
      return false;
    }
    ++in_window_;
    *unlogged = suppressed_;
    suppressed_ = 0;
    return true;
  }
  // Passes through the lock once: whatever gRPC's (uninstrumented) threads did under it
  // happens before what follows, for ThreadSanitizer too. After gRPC's Shutdown.
  void Quiesce() { swirl::MutexLock lock(&mu_); }

 private:
  static constexpr int kBurst = 5;
  swirl::Mutex mu_;
  absl::Time window_start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int in_window_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

grpc::Status ToGrpc(const absl::Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

const char* StateName(internal::Connection::State s) {
  switch (s) {
    case internal::Connection::State::kNew: return "new";
    case internal::Connection::State::kActive: return "active";
    case internal::Connection::State::kDraining: return "draining";
    case internal::Connection::State::kClosing: return "closing";
    case internal::Connection::State::kClosed: return "closed";
  }
  return "?";
}

}  // namespace

class Server::Impl final : public control::Control::Service {
 public:
  explicit Impl(ServerOptions options) : options_(std::move(options)) {}
  ~Impl() override { Shutdown(absl::ZeroDuration()); }

  absl::Status RegisterService(::swirl::Service* service) {
    if (started_) return absl::FailedPreconditionError("register services before Start");
    return methods_.Add(*service);
  }

  absl::Status Start() {
    if (started_) return absl::FailedPreconditionError("already started");
    if (absl::Status s = ResolvePrincipals(); !s.ok()) return s;
    // Secure by default: beyond loopback, someone must be asked for something.
    if (principals_.empty() && options_.tls_cert_file.empty() &&
        !options_.allow_insecure_non_loopback && !internal::IsLoopbackOnly(options_.address)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "refusing to listen on ", options_.address,
          " (beyond loopback) without authentication: set ServerOptions::auth_token or TLS, "
          "or allow_insecure_non_loopback to accept that anyone who reaches it may call "
          "every service"));
    }
    auto networks = internal::ParseFabricNetworks(options_.fabric_networks);
    if (!networks.ok()) return networks.status();
    fabric_networks_ = *std::move(networks);
    auto device = internal::OpenTransport(options_.transport, internal::Probe::kFresh);
    if (!device.ok()) return device.status();
    context_ = device->context;
    pd_ = device->pd;
    caps_ = device->caps;
    if (options_.transport.invalidation == InvalidationPolicy::kRequireRemote &&
        !caps_.remote_invalidation()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "remote invalidation is required but ", caps_.device,
          " cannot do remote invalidation (", caps_.selftest_detail, ")"));
    }
    declared_ = internal::DeclaredCapabilities(caps_, options_.transport.invalidation);
    pool_ = std::make_unique<internal::ThreadPool>(options_.handler_threads);
    const uint32_t per_worker = std::max<uint32_t>(
        1, (options_.max_connections + options_.worker_cores.size() - 1) /
               options_.worker_cores.size());
    for (size_t i = 0; i < options_.worker_cores.size(); ++i) {
      internal::WorkerOptions wo = internal::WorkerOptionsFor(options_.transport);
      wo.name = absl::StrCat("server-worker-", i);
      wo.core = options_.worker_cores[i];
      wo.own_thread = true;
      wo.adaptive_idle = options_.idle_spin > absl::ZeroDuration();
      wo.idle_spin = options_.idle_spin;
      wo.idle_yield_after = options_.idle_yield_after;
      wo.max_connections = per_worker;
      wo.setup_timeout = options_.setup_timeout;
      wo.grant_bytes_per_connection = options_.grant_bytes_per_connection;
      wo.download_bytes_per_connection = options_.download_bytes_per_connection;
      wo.bulk_bytes_per_client = options_.bulk_bytes_per_client;
      wo.max_windows_per_client = options_.max_windows_per_client;
      wo.mirror_bytes_per_connection = options_.mirror_bytes_per_connection;
      wo.mirror_reads_per_connection = options_.mirror_reads_per_connection;
      wo.on_closed = [this](uint64_t id, const absl::Status& why) {
        OnClosed(id, /*was_accepted=*/true, why);
      };
      wo.before_qp_destroy = [this] { DrainAsyncEvents(); };
      auto worker = internal::Worker::Create(context_, pd_, caps_, wo, pool_.get());
      if (!worker.ok()) return worker.status();
      workers_.push_back(std::move(*worker));
      workers_.back()->Start();
    }

    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
    if (!options_.tls_cert_file.empty() || !options_.tls_key_file.empty()) {
      auto cert = internal::ReadFile(options_.tls_cert_file);
      if (!cert.ok()) return cert.status();
      auto key = internal::ReadFile(options_.tls_key_file);
      if (!key.ok()) return key.status();
      grpc::SslServerCredentialsOptions ssl;
      ssl.pem_key_cert_pairs.push_back({*key, *cert});
      if (!options_.tls_client_ca_file.empty()) {
        auto ca = internal::ReadFile(options_.tls_client_ca_file);
        if (!ca.ok()) return ca.status();
        ssl.pem_root_certs = *ca;
        ssl.client_certificate_request =
            GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
      }
      credentials = grpc::SslServerCredentials(ssl);
    }
    builder.AddListeningPort(options_.address, credentials, &port_);
    // Control requests are small; gRPC's default (4 MiB) would let anyone, token or not, make
    // the server read and parse megabytes per call before the token is even looked at.
    builder.SetMaxReceiveMessageSize(kMaxControlMessage);
    builder.RegisterService(this);
    grpc_ = builder.BuildAndStart();
    if (grpc_ == nullptr || port_ == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.address));
    }
    accepting_.store(true);
    started_ = true;
    async_watcher_ = std::thread([this] { WatchAsyncEvents(); });
    SWIRL_LOG(INFO, "swirl server on port %d, device %s, %u worker(s), remote invalidation %s",
              port_, caps_.device, workers_.size(),
              caps_.remote_invalidation() ? "available" : "unavailable");
    return absl::OkStatus();
  }

  void Shutdown(absl::Duration deadline) {
    if (!started_ || stopped_) return;
    stopped_ = true;
    accepting_.store(false);
    if (auto* health = grpc_->GetHealthCheckService()) health->SetServingStatus(false);
    const absl::Time until = absl::Now() + deadline;
    for (auto& w : workers_) w->BeginDrain();
    for (auto& w : workers_) w->WaitDrained(until);
    // Each worker closes its connections in its loop; the barrier after them means that
    // blocking handlers still running have been told (IsCancelled()) before the pool waits
    // for them. (Bounded: a worker that does not get there in time is not waited for.)
    std::vector<std::shared_ptr<swirl::Notification>> closed;
    for (auto& w : workers_) {
      for (auto& c : w->Connections()) {
        w->Close(c->id(), absl::UnavailableError(std::string(kServerShutDown)));
      }
      auto done = std::make_shared<swirl::Notification>();
      w->RunInLoop([done] { done->Notify(); });
      closed.push_back(std::move(done));
    }
    for (auto& done : closed) done->WaitForNotificationWithTimeout(absl::Seconds(2));
    grpc_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Milliseconds(200)));
    // gRPC's Shutdown returns once its handlers have, through gRPC's own (uninstrumented)
    // synchronization; taking mu_ once orders their last use of what it guards (owners_, which
    // the destructor frees) before what follows, where ThreadSanitizer can see it too.
    { swirl::MutexLock lock(&mu_); }
    refusal_log_.Quiesce();
    // The pool stops before the workers do: a blocking handler hands its result to its worker
    // when it returns, so none may still run once a worker is gone. Queued handlers are
    // dropped; the pool object itself outlives the workers, which may still try to schedule.
    pool_->Stop();
    {
      // gRPC may still be running a control handler that reached for a worker.
      swirl::MutexLock lock(&workers_mu_);
      for (auto& w : workers_) w->Stop();
      workers_.clear();
    }
    pool_.reset();
    watcher_stop_.store(true, std::memory_order_release);
    if (async_watcher_.joinable()) async_watcher_.join();
  }

  // Reads the device's asynchronous events until Shutdown, counts them, and logs those that
  // mean something (rate-limited: a peer can make our QPs raise errors as often as it likes).
  // Only the event's type is used: the QP or CQ it names may already be destroyed.
  void WatchAsyncEvents() {
    while (!watcher_stop_.load(std::memory_order_acquire)) {
      absl::StatusOr<ibv_async_event> event = context_->NextAsyncEvent(absl::Milliseconds(100));
      if (!event.ok()) {
        if (!absl::IsDeadlineExceeded(event.status())) {
          SWIRL_LOG(WARNING, "swirl server: asynchronous events: %s", event.status().ToString());
          absl::SleepFor(absl::Milliseconds(100));
        }
        continue;
      }
      CountAsyncEvent(event->event_type);
    }
  }

  // Takes the events already queued, without waiting (a worker, about to destroy a QP whose
  // undelivered events the destroy would drop).
  void DrainAsyncEvents() {
    for (;;) {
      absl::StatusOr<ibv_async_event> event = context_->NextAsyncEvent(absl::ZeroDuration());
      if (!event.ok()) return;
      CountAsyncEvent(event->event_type);
    }
  }

  void CountAsyncEvent(ibv_event_type type) {
    switch (type) {
      case IBV_EVENT_QP_LAST_WQE_REACHED:
      case IBV_EVENT_COMM_EST:
      case IBV_EVENT_SQ_DRAINED:
      case IBV_EVENT_SRQ_LIMIT_REACHED:
        return;  // routine
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
      case IBV_EVENT_PATH_MIG_ERR:
        async_qp_errors_.fetch_add(1, std::memory_order_relaxed);
        break;
      default:
        async_device_events_.fetch_add(1, std::memory_order_relaxed);
        break;
    }
    uint64_t unlogged = 0;
    if (async_log_.Allow(absl::Now(), &unlogged)) {
      SWIRL_LOG(WARNING, "swirl server: device %s: asynchronous event %s%s", caps_.device,
                ibv_event_type_str(type),
                unlogged > 0 ? absl::StrCat(" (", unlogged, " more not logged)") : "");
    }
  }

  // ---- Control service ----

  grpc::Status Connect(grpc::ServerContext* context, const control::ConnectRequest* request,
                       control::ConnectResponse* response) override {
    bool established = false;
    absl::Status s = DoConnect(context, *request, response, &established);
    if (!s.ok() && !established) {
      refused_.fetch_add(1, std::memory_order_relaxed);
      // Anyone can be refused, as often as they like: the log says so a few times a second at
      // most, and how many it left out.
      uint64_t unlogged = 0;
      if (refusal_log_.Allow(absl::Now(), &unlogged)) {
        SWIRL_LOG(INFO, "refused connection from %s (%s): %s%s", context->peer(),
                  internal::LoggableName(request->client_name()), s.ToString(),
                  unlogged == 0 ? ""
                                : absl::StrCat(" (", unlogged, " earlier refusals not logged)"));
      }
    }
    return ToGrpc(s);
  }

  absl::Status DoConnect(grpc::ServerContext* context, const control::ConnectRequest& request,
                         control::ConnectResponse* response, bool* established) {
    // Everything is checked before any QP or buffer is committed to this client.
    if (!accepting_.load()) return absl::UnavailableError("server is shutting down");
    const Principal* principal = Authenticate(context);
    if (principal == nullptr) {
      return absl::UnauthenticatedError("missing or wrong token or client certificate");
    }
    // The version first: an incompatible client is told so before anything else is parsed.
    internal::LocalConfig local = LocalConfig();
    auto negotiated = internal::Negotiate(request, declared_, local, [this](const ibv_gid& client) {
      return context_->CheckReachable(caps_.gid, client);
    });
    if (!negotiated.ok()) return negotiated.status();
    auto client_address = internal::FromProto(request.address());
    if (!client_address.ok()) return client_address.status();
    // The server links (and on a TCP fabric, connects) to where the client's GID says: only
    // where the client itself is.
    if (absl::Status s = internal::CheckPeerFabricAddress(*context_, client_address->gid,
                                                          context->peer(), fabric_networks_);
        !s.ok()) {
      return s;
    }
    // A tenant is one client however many addresses it connects from; without principals, an
    // address (an IPv6 /64) is.
    const std::string client_key = internal::LimitKey(principal->name, context->peer());
    const uint32_t per_client_cap = principal->max_connections != 0
                                        ? principal->max_connections
                                        : options_.max_connections_per_client;
    uint64_t id;
    {
      swirl::MutexLock lock(&mu_);
      if (active_ >= options_.max_connections) {
        return absl::ResourceExhaustedError("server connection limit reached");
      }
      if (per_client_[client_key] >= per_client_cap) {
        return absl::ResourceExhaustedError(
            absl::StrCat("connection limit for ", client_key, " reached"));
      }
      do {
        id = absl::Uniform<uint64_t>(bitgen_);
      } while (id == 0 || owners_.contains(id));
      ++active_;
      ++per_client_[client_key];
      owners_[id] = Owner{client_key, internal::NewDisconnectSecret()};
      response->set_disconnect_secret(owners_[id].disconnect_secret);
    }
    absl::Status s = Establish(id, request, *client_address, *negotiated, context->peer(),
                               principal->name, response);
    if (!s.ok()) {
      OnClosed(id, /*was_accepted=*/false);
      return s;
    }
    *established = true;
    // The client gave up (its deadline passed) while the QP was set up: it never learns the id,
    // so it could never disconnect. And a Shutdown that began meanwhile has already closed every
    // connection it could see. Either way this one goes now instead of lingering.
    if (context->IsCancelled() || !accepting_.load()) {
      // Both orderly ends (OnClosed): the client's own doing, or the shutdown's.
      const absl::Status why = context->IsCancelled()
                                   ? absl::CancelledError(std::string(kClientDisconnected))
                                   : absl::UnavailableError(std::string(kServerShutDown));
      CloseConnection(id, why);
      return why;
    }
    return absl::OkStatus();
  }

  // Asks the worker that owns connection `id` to close it (after its activation: both are
  // queued to the worker in order).
  bool CloseConnection(uint64_t id, const absl::Status& why) {
    swirl::ReaderMutexLock lock(&workers_mu_);
    for (auto& w : workers_) {
      if (w->Find(id) != nullptr) {
        w->Close(id, why);
        return true;
      }
    }
    return false;
  }

  // principals_ from the options (auth_token as "default"), checked: every principal named,
  // once, by a credential no other principal has.
  absl::Status ResolvePrincipals() {
    principals_ = options_.principals;
    if (!options_.auth_token.empty()) {
      principals_.push_back(Principal{.name = "default", .token = options_.auth_token,
                                      .admin = true});
    }
    if (!options_.tls_client_ca_file.empty() && options_.tls_cert_file.empty()) {
      // Else the server would listen in plaintext and no client certificate would ever be seen.
      return absl::InvalidArgumentError("tls_client_ca_file needs tls_cert_file and tls_key_file");
    }
    absl::flat_hash_set<std::string> names, tokens, identities;
    for (const Principal& p : principals_) {
      // Errors name the principal, never its token.
      if (p.name.empty()) return absl::InvalidArgumentError("a principal without a name");
      if (!names.insert(p.name).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "principal '", p.name, "' given twice (auth_token is principal 'default')"));
      }
      if (p.token.empty() && p.tls_identity.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("principal '", p.name, "' has neither token nor tls_identity"));
      }
      if (!p.tls_identity.empty() && options_.tls_client_ca_file.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "principal '", p.name, "' is named by a client certificate, but there is no "
            "tls_client_ca_file to verify one"));
      }
      // One credential, one principal: else which one a client is would be a matter of order.
      if (!p.token.empty() && !tokens.insert(p.token).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("principal '", p.name, "' has another principal's token"));
      }
      if (!p.tls_identity.empty() && !identities.insert(p.tls_identity).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("principal '", p.name, "' has another principal's tls_identity"));
      }
    }
    return absl::OkStatus();
  }

  // Who the caller is: the one principal whose credentials it presented, the anonymous one
  // when the server authenticates no one, or nullptr (refused: no match, or credentials that
  // name two principals).
  const Principal* Authenticate(const grpc::ServerContext* context) const {
    if (principals_.empty()) return &anonymous_;
    auto it = context->client_metadata().find("authorization");
    absl::string_view presented = it == context->client_metadata().end()
                                      ? absl::string_view()
                                      : absl::string_view(it->second.data(), it->second.size());
    std::vector<grpc::string_ref> identities;
    if (!options_.tls_client_ca_file.empty()) {
      std::shared_ptr<const grpc::AuthContext> auth = context->auth_context();
      // gRPC verified the certificate against tls_client_ca_file before the call got here.
      if (auth != nullptr && auth->IsPeerAuthenticated()) identities = auth->GetPeerIdentity();
    }
    const Principal* found = nullptr;
    bool ambiguous = false;
    for (const Principal& p : principals_) {
      // Every token is compared (in constant time), whichever matches: the time taken tells
      // nothing about which principal's token it was, or how close it came.
      const bool token_ok = p.token.empty() || internal::TokenMatches(presented, p.token);
      bool identity_ok = p.tls_identity.empty();
      for (const grpc::string_ref& id : identities) {
        if (absl::string_view(id.data(), id.size()) == p.tls_identity) identity_ok = true;
      }
      if (token_ok && identity_ok) {
        ambiguous = ambiguous || found != nullptr;
        found = &p;
      }
    }
    return ambiguous ? nullptr : found;
  }

  absl::Status Establish(uint64_t id, const control::ConnectRequest& request,
                         const verbs::PeerAddress& client_address,
                         const control::Negotiated& negotiated, const std::string& peer,
                         const std::string& principal, control::ConnectResponse* response) {
    swirl::ReaderMutexLock lock(&workers_mu_);
    internal::Worker* worker = nullptr;
    uint32_t best = 0;
    for (auto& w : workers_) {
      if (w->free_credits() > best) {
        best = w->free_credits();
        worker = w.get();
      }
    }
    if (worker == nullptr) return absl::ResourceExhaustedError("every worker is full");
    internal::ConnectionSetup setup{.worker = worker,
                                    .id = id,
                                    .methods = &methods_,
                                    .transport = &options_.transport,
                                    .is_server = true,
                                    .peer = peer,
                                    .client_name = request.client_name(),
                                    .principal = principal};
    bool link_keys = false;
    auto connection = internal::EstablishConnection(
        setup, [&](const internal::LocalQp& local) -> absl::StatusOr<internal::PeerAnswer> {
          *response->mutable_address() = internal::ToProto(local.address);
          internal::PeerAnswer answer{client_address, negotiated, id};
          // What the client holds at first is what our worker could grant it at admission.
          answer.negotiated.set_client_initial_credits(local.initial_credits);
          *response->mutable_negotiated() = answer.negotiated;
          // Both QPs take a key: the pair links only with this Connect's caller, who alone
          // learns it (over TLS when TLS is on), not with whoever else knows the GIDs and QPNs.
          link_keys = local.link_keys;
          if (link_keys && request.capabilities().link_keys()) {
            answer.link_key = internal::NewLinkKey();
            response->set_link_key(answer.link_key);
          }
          return answer;
        });
    if (!connection.ok()) return connection.status();
    accepted_.fetch_add(1, std::memory_order_relaxed);
    response->set_connection_id(id);
    *response->mutable_capabilities() = internal::DescribeLocal(declared_, LocalConfig());
    response->mutable_capabilities()->set_link_keys(link_keys);
    return absl::OkStatus();
  }

  grpc::Status Disconnect(grpc::ServerContext* context, const control::DisconnectRequest* request,
                          control::DisconnectResponse*) override {
    // Connection ids are no secret (Stats lists them to admins, and to the principal that made
    // them): ending a connection takes that principal's credentials (or without principals, the
    // address the connection was made from) and the secret only its Connect's caller was
    // given. Every mismatch reads the same.
    const Principal* principal = Authenticate(context);
    if (principal == nullptr) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "missing or wrong token or client certificate");
    }
    {
      swirl::MutexLock lock(&mu_);
      auto it = owners_.find(request->connection_id());
      const bool secret_ok =
          it != owners_.end() &&
          internal::SecretMatches(request->disconnect_secret(), it->second.disconnect_secret);
      if (!secret_ok ||
          it->second.client_key != internal::LimitKey(principal->name, context->peer())) {
        return grpc::Status(grpc::StatusCode::NOT_FOUND, "no such connection");
      }
    }
    // Whoever holds the secret had the ConnectResponse, which is sent after the connection's
    // activation was queued to its worker: a close queued now follows it, even if the worker
    // has not got to the activation yet.
    if (CloseConnection(request->connection_id(),
                        absl::CancelledError(std::string(kClientDisconnected)))) {
      return grpc::Status::OK;
    }
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "no such connection");
  }

  grpc::Status Stats(grpc::ServerContext* context, const control::StatsRequest* request,
                     control::StatsResponse* response) override {
    // Connection ids, client names and traffic are the server's business: credentials, as for
    // Connect. (The gRPC health service stays open for probes.)
    const Principal* principal = Authenticate(context);
    if (principal == nullptr) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "missing or wrong token or client certificate");
    }
    *response = CollectStats(request->connection_id(), principal);
    return grpc::Status::OK;
  }

  // The server's totals, and its connections: all of them for `viewer` null (the application's
  // own Server::Stats) or an admin, else only those of the viewer's principal (a tenant does
  // not learn another's connection ids, client names, addresses or traffic).
  control::StatsResponse CollectStats(uint64_t only, const Principal* viewer) const {
    const bool sees_all = viewer == nullptr || viewer->admin;
    control::StatsResponse out;
    out.set_device(caps_.device);
    *out.mutable_capabilities() = internal::DescribeLocal(declared_, LocalConfig());
    control::ServerStats* s = out.mutable_server();
    s->set_connections_accepted(accepted_.load());
    s->set_connections_refused(refused_.load());
    s->set_connections_closed(closed_.load());
    s->set_connections_failed(failed_.load());
    s->set_async_qp_errors(async_qp_errors_.load(std::memory_order_relaxed));
    s->set_async_device_events(async_device_events_.load(std::memory_order_relaxed));
    uint64_t live = 0;
    swirl::ReaderMutexLock lock(&workers_mu_);
    for (auto& w : workers_) {
      internal::WorkerStats ws = w->Stats();
      s->set_requests(s->requests() + ws.requests);
      s->set_protocol_errors(s->protocol_errors() + ws.protocol_errors);
      s->set_recv_buffers_free(s->recv_buffers_free() + ws.recv_buffers_total -
                               ws.recv_buffers_posted);
      s->set_recv_buffers_total(s->recv_buffers_total() + ws.recv_buffers_total);
      internal::ConnectionCounters& t = w->totals();
      s->set_windows_remote_invalidated(s->windows_remote_invalidated() +
                                        t.windows_remote_invalidated.load());
      s->set_windows_locally_invalidated(s->windows_locally_invalidated() +
                                         t.windows_locally_invalidated.load());
      s->set_windows_lease_expired(s->windows_lease_expired() + t.windows_lease_expired.load());
      s->set_invalidation_violations(s->invalidation_violations() +
                                     t.invalidation_violations.load());
      s->set_windows_outstanding(s->windows_outstanding() + w->windows_exposed());
      if (w->bulk_pool() != nullptr) {
        s->set_bulk_bytes_in_use(s->bulk_bytes_in_use() + w->bulk_pool()->bytes_in_use());
      }
      s->set_bulk_bytes_charged(s->bulk_bytes_charged() + w->bulk_bytes_charged());
      for (auto& c : w->Connections()) {
        // A connection still being set up is being configured by its Connect right now.
        if (c->state() == internal::Connection::State::kNew) continue;
        ++live;
        if (only != 0 && c->id() != only) continue;
        if (!sees_all && c->principal() != viewer->name) continue;
        control::ConnectionStats* cs = out.add_connections();
        cs->set_connection_id(c->id());
        cs->set_client_name(c->client_name());
        cs->set_peer(c->peer());
        *cs->mutable_negotiated() = c->negotiated();
        internal::CopyCounters(c->counters(), cs);
        cs->set_state(StateName(c->state()));
        cs->set_principal(c->principal());
      }
    }
    s->set_queue_pairs_live(live);
    {
      swirl::MutexLock lock(&mu_);
      s->set_connections_active(active_);
    }
    return out;
  }

  // `was_accepted`: false for a Connect that failed while setting up (counted as refused).
  // `why`: the reason the connection ended; anything but the client's Disconnect or this
  // server's shutdown counts as a failure.
  void OnClosed(uint64_t id, bool was_accepted, const absl::Status& why = absl::OkStatus()) {
    swirl::MutexLock lock(&mu_);
    auto it = owners_.find(id);
    if (it == owners_.end()) return;
    if (--per_client_[it->second.client_key] == 0) per_client_.erase(it->second.client_key);
    owners_.erase(it);
    --active_;
    if (!was_accepted) return;
    closed_.fetch_add(1, std::memory_order_relaxed);
    const bool orderly = why.ok() ||
                         (why.code() == absl::StatusCode::kCancelled &&
                          why.message() == kClientDisconnected) ||
                         (why.code() == absl::StatusCode::kUnavailable &&
                          why.message() == kServerShutDown);
    if (!orderly) failed_.fetch_add(1, std::memory_order_relaxed);
  }

  internal::LocalConfig LocalConfig() const {
    internal::LocalConfig local = internal::LocalConfigFor(options_.transport, caps_);
    local.eager_threshold = options_.eager_threshold;
    local.window_credits = options_.window_credits;
    // A worker's pool serves buffers of power-of-two size classes up to bit_floor(pool).
    local.max_bulk_size = options_.transport.bulk_pool_bytes == 0
                              ? 0
                              : std::min<uint64_t>({options_.max_bulk_size,
                                                    std::bit_floor(options_.transport.bulk_pool_bytes),
                                                    internal::kMaxBulkSize});
    return local;
  }

  int port() const { return port_; }
  const std::string& listen_address() const { return options_.address; }
  const verbs::Capabilities& caps() const { return caps_; }

 private:
  const ServerOptions options_;
  internal::MethodTable methods_;
  std::shared_ptr<verbs::Context> context_;
  std::shared_ptr<verbs::ProtectionDomain> pd_;
  verbs::Capabilities caps_;
  std::vector<internal::Ipv4Network> fabric_networks_;  // options_.fabric_networks
  // options_.principals and auth_token's "default" (set at Start, then read-only); empty:
  // no authentication, every client is anonymous_ (who sees every connection, as the
  // application does: there are no tenants to keep apart).
  std::vector<Principal> principals_;
  const Principal anonymous_{.admin = true};
  // caps_ as this server negotiates with and tells clients (InvalidationPolicy::kLocalOnly).
  verbs::Capabilities declared_;
  std::unique_ptr<internal::ThreadPool> pool_;
  // Control handlers run on gRPC's threads, which can outlive grpc::Server::Shutdown's
  // deadline: they read workers_ under this lock, and Shutdown destroys the workers under it.
  mutable swirl::Mutex workers_mu_;
  std::vector<std::unique_ptr<internal::Worker>> workers_;
  std::unique_ptr<grpc::Server> grpc_;
  int port_ = 0;
  bool started_ = false;
  bool stopped_ = false;
  std::atomic<bool> accepting_{false};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> closed_{0};
  std::atomic<uint64_t> failed_{0};
  LogLimiter refusal_log_;
  // WatchAsyncEvents reads the device's asynchronous events; DrainAsyncEvents takes those queued
  // before a worker destroys a QP (which would drop them).
  std::thread async_watcher_;
  std::atomic<bool> watcher_stop_{false};
  std::atomic<uint64_t> async_qp_errors_{0};
  std::atomic<uint64_t> async_device_events_{0};
  LogLimiter async_log_;

  mutable swirl::Mutex mu_;
  uint64_t active_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, uint32_t> per_client_ ABSL_GUARDED_BY(mu_);
  struct Owner {
    std::string client_key;         // LimitKey() of its principal and address
    std::string disconnect_secret;  // NewDisconnectSecret(), told only to its Connect's caller
  };
  absl::flat_hash_map<uint64_t, Owner> owners_ ABSL_GUARDED_BY(mu_);
  absl::BitGen bitgen_ ABSL_GUARDED_BY(mu_);
};

Server::Server(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Server::~Server() = default;
absl::Status Server::RegisterService(Service* service) { return impl_->RegisterService(service); }
absl::Status Server::Start() { return impl_->Start(); }
int Server::port() const { return impl_->port(); }
std::string Server::address() const {
  return internal::DialableAddress(impl_->listen_address(), impl_->port());
}
void Server::Shutdown(absl::Duration deadline) { impl_->Shutdown(deadline); }
StatsReport Server::Stats() const {
  return internal::FromProto(impl_->CollectStats(0, /*viewer=*/nullptr));
}
DeviceInfo Server::capabilities() const { return internal::DescribeDevice(impl_->caps()); }

}  // namespace swirl
