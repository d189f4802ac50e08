#include "swirl/channel.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/mutex.h"
#include "base/notifier.h"
#include "proto/control.grpc.pb.h"
#include "rpc/establish.h"
#include "rpc/handshake.h"
#include "rpc/stats_convert.h"
#include "rpc/worker.h"

namespace swirl {
namespace internal {

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace internal

const char* ConnectivityStateName(ConnectivityState state) {
  switch (state) {
    case ConnectivityState::kConnecting: return "CONNECTING";
    case ConnectivityState::kReady: return "READY";
    case ConnectivityState::kTransientFailure: return "TRANSIENT_FAILURE";
    case ConnectivityState::kShutdown: return "SHUTDOWN";
  }
  return "?";
}

class Channel::Impl {
 public:
  ChannelOptions options;
  std::string address;
  std::shared_ptr<ClientRuntime> runtime;  // set before the channel is handed out; never changes
  internal::MethodTable methods;
  // Where a server's fabric address may be besides the address dialled (fabric_networks).
  std::vector<internal::Ipv4Network> networks;
  // Invalidation mode of the first connection: a reconnect that settles on a weaker one says so.
  control::InvalidationMode first_invalidation = control::INVALIDATION_REMOTE;

  // The worker's id of the ready connection, 0 while there is none: all Start() reads.
  std::atomic<uint64_t> live_id{0};
  std::atomic<bool> closed{false};

  // Everything about the current connection, for any thread but the hot path. The connection
  // lost callback (on the worker's loop thread) only takes `mu` to mark the loss.
  mutable swirl::Mutex mu;
  swirl::CondVar changed;  // state, loss, a new waiting call, Close
  ConnectivityState state ABSL_GUARDED_BY(mu) = ConnectivityState::kConnecting;
  absl::Status last_error ABSL_GUARDED_BY(mu);
  bool lost ABSL_GUARDED_BY(mu) = false;  // the current connection is gone
  std::shared_ptr<internal::Connection> connection ABSL_GUARDED_BY(mu);
  uint64_t connection_id ABSL_GUARDED_BY(mu) = 0;  // the server's id
  std::string disconnect_secret ABSL_GUARDED_BY(mu);  // Disconnect presents it
  control::Negotiated negotiated ABSL_GUARDED_BY(mu);
  std::shared_ptr<control::Control::Stub> stub ABSL_GUARDED_BY(mu);
  uint64_t reconnects ABSL_GUARDED_BY(mu) = 0;
  // Background-driven channels: calls waiting for a connection (CallOptions::wait_for_ready).
  std::vector<ClientCall*> waiting ABSL_GUARDED_BY(mu);
  // The Connect RPC under way, for Close() to cancel (a reconnect to an unreachable host would
  // otherwise hold Close() for connect_timeout).
  grpc::ClientContext* attempt ABSL_GUARDED_BY(mu) = nullptr;
  std::thread reconnector ABSL_GUARDED_BY(mu);  // from the first loss, if the channel reconnects
  // Close() in one thread at a time; `closed` makes later ones return at once.
  swirl::Mutex close_mu;

  // The runtime a channel with `options` runs on (rpc/client_runtime.h, the contract).
  static absl::StatusOr<std::shared_ptr<ClientRuntime>> RuntimeFor(const ChannelOptions& options) {
    const ClientRuntimeOptions own{.transport = options.transport,
                                   .worker_core = options.worker_core};
    const bool caller_driven = options.driver == ChannelOptions::Driver::kCaller;
    if (options.runtime == nullptr) {
      if (caller_driven || options.dedicated_worker) {
        return ClientRuntime::Make({.transport = own.transport,
                                    .worker_core = own.worker_core,
                                    .max_channels = 1},
                                   "channel-worker", /*own_thread=*/!caller_driven);
      }
      return ClientRuntime::Shared(own);
    }
    if (caller_driven || options.dedicated_worker) {
      return absl::InvalidArgumentError(
          "ChannelOptions::runtime is for background-driven channels that share a worker; a "
          "caller-driven or dedicated_worker channel has one of its own");
    }
    // Nothing silently overridden: the channel's own settings are the defaults it was made
    // with, or the runtime's.
    const ChannelOptions defaults;
    const ClientRuntimeOptions& theirs = options.runtime->options();
    if (options.transport != defaults.transport && options.transport != theirs.transport) {
      return absl::InvalidArgumentError(
          "ChannelOptions::transport differs from the transport options of the runtime it "
          "names, whose worker the channel would use: leave it as it is or set it equal");
    }
    if (options.worker_core != defaults.worker_core &&
        options.worker_core != theirs.worker_core) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ChannelOptions::worker_core is ", options.worker_core, ", but the runtime it names "
          "pins its worker to ", theirs.worker_core));
    }
    return options.runtime;
  }

  void AddAuth(grpc::ClientContext* ctx) const {
    if (!options.auth_token.empty()) {
      ctx->AddMetadata("authorization", absl::StrCat("Bearer ", options.auth_token));
    }
  }

  std::shared_ptr<control::Control::Stub> Stub() const {
    swirl::MutexLock lock(&mu);
    return stub;
  }

  // A control-plane stub. A channel's first connection uses the gRPC channel that channels to
  // the same server (same address and TLS settings) share while any of them holds it: an
  // HTTP/2 connection per Channel cost both sides about 100 KiB and each setup a TCP and HTTP/2
  // handshake. Closing a Channel only drops its reference, so it never disturbs another.
  // Reconnect attempts (`shared` false) each get a fresh gRPC channel of their own, so that
  // gRPC's reconnect backoff on a shared one never delays ours.
  absl::StatusOr<std::shared_ptr<control::Control::Stub>> NewStub(bool shared) const {
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
    grpc::ChannelArguments args;
    if (!options.tls_root_cert_file.empty()) {
      auto root = internal::ReadFile(options.tls_root_cert_file);
      if (!root.ok()) return root.status();
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = *root;
      if (!options.tls_cert_file.empty() || !options.tls_key_file.empty()) {
        auto cert = internal::ReadFile(options.tls_cert_file);
        if (!cert.ok()) return cert.status();
        auto key = internal::ReadFile(options.tls_key_file);
        if (!key.ok()) return key.status();
        ssl.pem_cert_chain = *cert;
        ssl.pem_private_key = *key;
      }
      credentials = grpc::SslCredentials(ssl);
      if (!options.tls_target_name.empty()) {
        args.SetSslTargetNameOverride(options.tls_target_name);
      }
    }
    if (!shared) {
      // A channel argument of its own keeps gRPC from reusing a pooled subchannel.
      args.SetInt("swirl.channel_id", static_cast<int>(absl::Uniform<uint32_t>(absl::BitGen())));
      return std::shared_ptr<control::Control::Stub>(
          control::Control::NewStub(grpc::CreateCustomChannel(address, credentials, args)));
    }
    static auto* cache_mu = new swirl::Mutex();  // never destroyed: channels may outlive main
    static auto* cache = new absl::flat_hash_map<std::string, std::weak_ptr<grpc::Channel>>();
    const std::string key = absl::StrCat(address, "\n", options.tls_root_cert_file, "\n",
                                         options.tls_target_name);
    swirl::MutexLock lock(cache_mu);
    std::shared_ptr<grpc::Channel> grpc_channel = (*cache)[key].lock();
    if (grpc_channel == nullptr ||
        grpc_channel->GetState(false) == GRPC_CHANNEL_TRANSIENT_FAILURE ||
        grpc_channel->GetState(false) == GRPC_CHANNEL_SHUTDOWN) {
      grpc_channel = grpc::CreateCustomChannel(address, credentials, args);
      (*cache)[key] = grpc_channel;
    }
    // Entries whose channels are gone are dropped as others are added, so the map stays as
    // large as the set of servers in use.
    if (cache->size() > 64) {
      absl::erase_if(*cache, [](const auto& entry) { return entry.second.expired(); });
    }
    return std::shared_ptr<control::Control::Stub>(control::Control::NewStub(grpc_channel));
  }

  // Once per channel: checks, services, runtime.
  absl::Status Init() {
    // Checked before dialling: a token in plaintext beyond loopback is anyone's on the path.
    if (!options.auth_token.empty() && options.tls_root_cert_file.empty() &&
        !options.allow_plaintext_token && !internal::IsLoopbackOnly(address)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "refusing to send the token in plaintext to ", address,
          " (beyond loopback): use TLS (tls_root_cert_file), or set allow_plaintext_token"));
    }
    auto parsed = internal::ParseFabricNetworks(options.fabric_networks);
    if (!parsed.ok()) return parsed.status();
    networks = *std::move(parsed);
    for (Service* s : options.services) {
      if (absl::Status st = methods.Add(*s); !st.ok()) return st;
    }
    auto rt = RuntimeFor(options);
    if (!rt.ok()) return rt.status();
    runtime = *rt;
    // The runtime's settings are the channel's (equal to its own, or its own left as they are).
    options.transport = runtime->options().transport;
    options.worker_core = runtime->options().worker_core;
    return absl::OkStatus();
  }

  // One connection attempt: a Connect exchange and a new connection on the runtime's worker.
  // On success the channel is kReady on it.
  absl::Status Connect() {
    bool first;
    {
      swirl::MutexLock lock(&mu);
      first = connection == nullptr;
    }
    auto new_stub = NewStub(/*shared=*/first);
    if (!new_stub.ok()) return new_stub.status();
    std::shared_ptr<control::Control::Stub> attempt_stub = *new_stub;
    internal::Worker* worker = &runtime->worker();
    internal::LocalConfig local =
        internal::LocalConfigFor(options.transport, runtime->device_capabilities());
    local.bulk_mode = options.bulk_mode == BulkMode::kMirror ? control::BULK_MIRROR
                                                             : control::BULK_SERVER_EXPOSES;
    local.max_bulk_size = worker->bulk_pool() == nullptr
                              ? 0
                              : std::min<uint64_t>(worker->bulk_pool()->max_allocation(),
                                                   internal::kMaxBulkSize);

    const verbs::Capabilities declared = internal::DeclaredCapabilities(
        runtime->device_capabilities(), options.transport.invalidation);
    control::ConnectResponse response;
    auto exchange = [&](const internal::LocalQp& ours) -> absl::StatusOr<internal::PeerAnswer> {
      control::ConnectRequest request;
      request.set_protocol_version(internal::kControlProtocolVersion);
      request.set_client_name(options.client_name);
      *request.mutable_address() = internal::ToProto(ours.address);
      *request.mutable_capabilities() = internal::DescribeLocal(declared, local);
      request.mutable_capabilities()->set_link_keys(ours.link_keys);
      request.mutable_capabilities()->set_initial_credits(ours.initial_credits);
      local.initial_credits = ours.initial_credits;  // what CheckNegotiated expects back
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + options.connect_timeout));
      AddAuth(&ctx);
      {
        swirl::MutexLock lock(&mu);
        if (closed.load(std::memory_order_acquire)) return absl::CancelledError("channel closed");
        attempt = &ctx;
      }
      absl::Status s = internal::FromGrpc(attempt_stub->Connect(&ctx, request, &response));
      {
        swirl::MutexLock lock(&mu);
        attempt = nullptr;
      }
      if (s.ok()) s = internal::CheckNegotiated(response.negotiated(), local, declared);
      if (!s.ok()) return s;
      auto server_address = internal::FromProto(response.address());
      if (!server_address.ok()) return server_address.status();
      // Our QP links to where the server's GID says: only where the server we reached is.
      if (ours.device != nullptr) {
        s = internal::CheckPeerFabricAddress(*ours.device, server_address->gid, ctx.peer(),
                                             networks);
        if (!s.ok()) return s;
      }
      absl::StatusOr<std::string> link_key = internal::CheckLinkKey(response, ours.link_keys);
      if (!link_key.ok()) return link_key.status();
      return internal::PeerAnswer{*server_address, response.negotiated(),
                                  response.connection_id(), *std::move(link_key)};
    };
    const uint64_t id = absl::Uniform<uint64_t>(absl::BitGen());
    internal::ConnectionSetup setup{.worker = worker,
                                    .id = id,
                                    .methods = &methods,
                                    .transport = &options.transport,
                                    .is_server = false,
                                    .peer = address,
                                    .client_name = options.client_name,
                                    .on_lost = [this, id](const absl::Status& why) {
                                      ConnectionLost(id, why);
                                    }};
    auto c = internal::EstablishConnection(setup, exchange);
    if (!c.ok()) {
      // The server may have set its side up already: it is told, instead of waiting for its
      // setup_timeout.
      if (response.connection_id() != 0) {
        SendDisconnect(*attempt_stub, response.connection_id(), response.disconnect_secret());
      }
      return c.status();
    }
    {
      swirl::MutexLock lock(&mu);
      if (connection != nullptr) {  // a reconnect
        ++reconnects;
        if (first_invalidation == control::INVALIDATION_REMOTE &&
            response.negotiated().invalidation() != control::INVALIDATION_REMOTE) {
          SWIRL_LOG(WARNING,
                    "channel to %s reconnected with a weaker invalidation mode than its first "
                    "connection: %s (bulk windows are revoked by explicit LOCAL_INV)",
                    address, control::InvalidationMode_Name(response.negotiated().invalidation()));
        }
      } else {
        first_invalidation = response.negotiated().invalidation();
      }
      negotiated = response.negotiated();
      connection_id = response.connection_id();
      disconnect_secret = response.disconnect_secret();
      connection = *c;
      stub = attempt_stub;
      lost = false;
      state = ConnectivityState::kReady;
      live_id.store(id, std::memory_order_release);
      changed.SignalAll();
    }
    // A caller-driven worker acts only when driven: once now, so that the activation (and the
    // ping that tells the server we are up, ServerOptions::setup_timeout) does not wait for the
    // first call.
    if (worker->caller_driven()) worker->TryDrive();
    return absl::OkStatus();
  }

  // On the worker's loop thread, when connection `id` is gone: must not block.
  void ConnectionLost(uint64_t id, const absl::Status& why) {
    swirl::MutexLock lock(&mu);
    if (live_id.load(std::memory_order_relaxed) != id) return;  // an older one, or Close()
    live_id.store(0, std::memory_order_release);
    lost = true;
    last_error = why;
    if (state != ConnectivityState::kShutdown) state = ConnectivityState::kTransientFailure;
    changed.SignalAll();
    // The reconnector starts with the first loss: a healthy channel has no thread of its own.
    if (options.reconnect.enabled && !reconnector.joinable() &&
        !closed.load(std::memory_order_acquire)) {
      SWIRL_LOG(WARNING, "channel to %s: connection lost (%s); reconnecting", address,
                why.ToString());
      reconnector = std::thread([this] { ReconnectLoop(); });
    }
  }

  void SendDisconnect(control::Control::Stub& via, uint64_t id, const std::string& secret) {
    control::DisconnectRequest request;
    request.set_connection_id(id);
    request.set_disconnect_secret(secret);
    control::DisconnectResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    AddAuth(&ctx);
    (void)via.Disconnect(&ctx, request, &response);
  }

  // ---- Waiting for a connection (CallOptions::wait_for_ready) ----

  // Completes a waiting call on the worker's loop thread, where callbacks of a background-driven
  // channel run: never on the reconnector (a callback may close or destroy the channel) and
  // never under `mu` (it may call into the channel).
  void FailOnLoop(ClientCall* call, absl::Status status) {
    runtime->worker().RunInLoop([call, status = std::move(status)]() mutable {
      internal::Worker::FailUnstarted(call, std::move(status));
    });
  }

  // Fails the waiting calls whose deadline has passed. Returns the earliest deadline left.
  absl::Time ExpireWaiting(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    absl::Time earliest = absl::InfiniteFuture();
    std::erase_if(waiting, [&](ClientCall* call) {
      if (call->deadline_ <= now) {
        FailOnLoop(call, absl::DeadlineExceededError(
                             absl::StrCat("deadline exceeded waiting for the channel to connect: ",
                                          last_error.ToString())));
        return true;
      }
      earliest = std::min(earliest, call->deadline_);
      return false;
    });
    return earliest;
  }

  // Ready again: the waiting calls start (a cancelled one completes CANCELLED).
  void StartWaiting() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const uint64_t id = live_id.load(std::memory_order_relaxed);
    for (ClientCall* call : waiting) {
      if (call->cancel_requested_.load(std::memory_order_acquire)) {
        FailOnLoop(call, absl::CancelledError("cancelled"));
      } else {
        runtime->worker().StartCall(id, call);
      }
    }
    waiting.clear();
  }

  // Waits (the lock held) until `deadline` or a change; expires waiting calls meanwhile.
  void WaitUntil(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const absl::Time next = std::min(deadline, ExpireWaiting(absl::Now()));
    changed.WaitWithDeadline(&mu, next);
    ExpireWaiting(absl::Now());
  }

  // The reconnector thread: gRPC's connection backoff
  // (github.com/grpc/grpc/blob/master/doc/connection-backoff.md).
  void ReconnectLoop() {
    const ReconnectOptions& r = options.reconnect;
    absl::BitGen random;
    swirl::MutexLock lock(&mu);
    while (!closed.load(std::memory_order_acquire)) {
      if (!lost) {
        WaitUntil(absl::InfiniteFuture());
        continue;
      }
      // The old connection is gone on our side; the server, if it lives, is told.
      if (stub != nullptr && connection_id != 0) {
        std::shared_ptr<control::Control::Stub> old = stub;
        const uint64_t old_id = connection_id;
        const std::string secret = disconnect_secret;
        mu.Unlock();
        SendDisconnect(*old, old_id, secret);
        mu.Lock();
      }
      absl::Duration backoff = r.initial_backoff;
      while (lost && !closed.load(std::memory_order_acquire)) {
        state = ConnectivityState::kConnecting;
        changed.SignalAll();
        const absl::Time attempt_start = absl::Now();
        mu.Unlock();
        absl::Status s = Connect();
        mu.Lock();
        if (s.ok()) {
          if (closed.load(std::memory_order_acquire)) break;  // Close() takes it down
          SWIRL_LOG(INFO, "channel to %s: reconnected (connection %u)", address, connection_id);
          StartWaiting();
          break;
        }
        last_error = s;
        if (closed.load(std::memory_order_acquire)) break;
        state = ConnectivityState::kTransientFailure;
        changed.SignalAll();
        const double factor = 1 + r.jitter * absl::Uniform<double>(random, -1.0, 1.0);
        const absl::Time next = attempt_start + backoff * factor;
        SWIRL_LOG(WARNING, "channel to %s: reconnect failed (%s); next attempt in %s", address,
                  s.ToString(), absl::FormatDuration(next - absl::Now()));
        while (absl::Now() < next && !closed.load(std::memory_order_acquire)) WaitUntil(next);
        backoff = std::min(r.max_backoff, backoff * r.multiplier);
      }
    }
  }

  void Close() {
    // Closed already (or closing on another thread): done, without waiting for that thread,
    // which may be waiting for the very worker this call runs on (a callback closing it).
    if (closed.load(std::memory_order_acquire)) return;
    swirl::MutexLock close_lock(&close_mu);
    if (closed.load(std::memory_order_acquire)) return;
    std::shared_ptr<internal::Connection> c;
    std::shared_ptr<control::Control::Stub> via;
    uint64_t server_id = 0;
    std::string secret;
    std::vector<ClientCall*> never_started;
    {
      swirl::MutexLock lock(&mu);
      closed.store(true, std::memory_order_release);
      live_id.store(0, std::memory_order_release);
      state = ConnectivityState::kShutdown;
      never_started.swap(waiting);
      if (attempt != nullptr) attempt->TryCancel();  // a connection attempt under way ends now
      changed.SignalAll();
      c = connection;
      via = stub;
      server_id = connection_id;
      secret = disconnect_secret;
    }
    for (ClientCall* call : never_started) {
      internal::Worker::FailUnstarted(call, absl::UnavailableError("channel closed"));
    }
    std::thread reconnecting;
    {
      swirl::MutexLock lock(&mu);
      reconnecting.swap(reconnector);
    }
    if (reconnecting.joinable()) {
      // Its attempt, if any, was cancelled above; it sees `closed` next.
      reconnecting.join();
      swirl::MutexLock lock(&mu);  // the attempt may have made a connection after all
      c = connection;
      via = stub;
      server_id = connection_id;
      secret = disconnect_secret;
    }
    if (c == nullptr) return;
    if (via != nullptr) SendDisconnect(*via, server_id, secret);
    internal::Worker* worker = &runtime->worker();
    worker->Close(c->id(), absl::UnavailableError("channel closed"));
    // Wait for the worker to finish with the connection (driving it ourselves if need be).
    const absl::Time deadline = absl::Now() + absl::Seconds(3);
    if (!worker->caller_driven()) {
      c->WaitClosed(deadline);
      return;
    }
    while (c->state() != internal::Connection::State::kClosed && absl::Now() < deadline) {
      worker->TryDrive();
    }
  }
};

absl::StatusOr<std::shared_ptr<Channel>> Channel::Create(const std::string& address,
                                                         const ChannelOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->address = address;
  if (absl::Status s = impl->Init(); !s.ok()) return s;
  if (absl::Status s = impl->Connect(); !s.ok()) return s;
  return std::shared_ptr<Channel>(new Channel(std::move(impl)));
}

Channel::Channel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Channel::~Channel() { Close(); }

void Channel::Start(ClientCall* call) {
  const uint64_t id = impl_->live_id.load(std::memory_order_acquire);
  if (id != 0) [[likely]] {
    impl_->runtime->worker().StartCall(id, call);
    return;
  }
  StartWhileDown(call);
}

void Channel::StartWhileDown(ClientCall* call) {
  Impl& impl = *impl_;
  internal::Worker& worker = impl.runtime->worker();
  uint64_t id = 0;
  absl::Status failed;
  {
    swirl::MutexLock lock(&impl.mu);
    const bool wait = call->wait_for_ready_ && impl.options.reconnect.enabled;
    if (wait && worker.caller_driven() && !worker.OnLoopThread()) {
      // This thread waits: a caller-driven channel has no thread of its own to wait on.
      while (impl.live_id.load(std::memory_order_acquire) == 0 &&
             impl.state != ConnectivityState::kShutdown && absl::Now() < call->deadline_) {
        impl.changed.WaitWithDeadline(&impl.mu, call->deadline_);
      }
    }
    id = impl.live_id.load(std::memory_order_acquire);  // connected meanwhile?
    if (id == 0) {
      if (impl.state == ConnectivityState::kShutdown) {
        failed = absl::UnavailableError("channel closed");
      } else if (!wait) {
        failed = absl::UnavailableError(absl::StrCat("channel not connected (",
                                                     ConnectivityStateName(impl.state),
                                                     "): ", impl.last_error.ToString()));
      } else if (worker.caller_driven() && worker.OnLoopThread()) {
        failed = absl::UnavailableError(
            "the channel is not connected, and wait_for_ready cannot wait on the loop thread "
            "of a caller-driven channel");
      } else if (worker.caller_driven() || absl::Now() >= call->deadline_) {
        failed = absl::DeadlineExceededError(absl::StrCat(
            "deadline exceeded waiting for the channel to connect: ",
            impl.last_error.ToString()));
      } else {
        // Waits in the channel until it is ready (the reconnector starts it) or its deadline.
        call->worker_ = nullptr;
        call->status_ = absl::OkStatus();
        call->cancel_requested_.store(false, std::memory_order_relaxed);
        NotifierWord::Reset(call->completion_);
        call->state_.store(ClientCall::kQueued, std::memory_order_release);
        impl.waiting.push_back(call);
        impl.changed.SignalAll();  // the reconnector's next wake-up may be this deadline
        return;
      }
    }
  }
  if (id != 0) {
    worker.StartCall(id, call);
  } else {
    internal::Worker::FailUnstarted(call, std::move(failed));
  }
}

bool Channel::Poll() {
  if (impl_->runtime == nullptr || !impl_->runtime->worker().caller_driven()) return false;
  return impl_->runtime->worker().TryDrive();
}

NegotiatedSettings Channel::negotiated() const {
  swirl::MutexLock lock(&impl_->mu);
  return internal::FromProto(impl_->negotiated);
}

uint64_t Channel::connection_id() const {
  swirl::MutexLock lock(&impl_->mu);
  return impl_->connection_id;
}

bool Channel::connected() const { return state() == ConnectivityState::kReady; }

ConnectivityState Channel::state() const {
  swirl::MutexLock lock(&impl_->mu);
  return impl_->state;
}

bool Channel::WaitForStateChange(ConnectivityState from, absl::Time deadline) {
  swirl::MutexLock lock(&impl_->mu);
  while (impl_->state == from) {
    if (impl_->changed.WaitWithDeadline(&impl_->mu, deadline)) return impl_->state != from;
  }
  return true;
}

bool Channel::WaitForReady(absl::Time deadline) {
  swirl::MutexLock lock(&impl_->mu);
  while (impl_->state != ConnectivityState::kReady &&
         impl_->state != ConnectivityState::kShutdown) {
    if (impl_->changed.WaitWithDeadline(&impl_->mu, deadline)) break;
  }
  return impl_->state == ConnectivityState::kReady;
}

absl::Status Channel::last_error() const {
  swirl::MutexLock lock(&impl_->mu);
  return impl_->last_error;
}

uint64_t Channel::reconnects() const {
  swirl::MutexLock lock(&impl_->mu);
  return impl_->reconnects;
}

absl::StatusOr<StatsReport> Channel::ServerStats() {
  control::StatsRequest request;
  control::StatsResponse response;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  impl_->AddAuth(&ctx);
  std::shared_ptr<control::Control::Stub> stub = impl_->Stub();
  absl::Status s = internal::FromGrpc(stub->Stats(&ctx, request, &response));
  if (!s.ok()) return s;
  return internal::FromProto(response);
}

void Channel::Close() { impl_->Close(); }

absl::StatusOr<BulkBuffer> Channel::AllocateBulk(size_t size) {
  if (impl_->runtime == nullptr || impl_->runtime->worker().bulk_pool() == nullptr) {
    return absl::FailedPreconditionError("this channel has no bulk pool");
  }
  return impl_->runtime->worker().bulk_pool()->Allocate(size);
}

const std::shared_ptr<ClientRuntime>& Channel::runtime() const { return impl_->runtime; }

ConnectionStats Channel::LocalStats() const {
  control::ConnectionStats out;
  std::shared_ptr<internal::Connection> c;
  {
    swirl::MutexLock lock(&impl_->mu);
    out.set_connection_id(impl_->connection_id);
    *out.mutable_negotiated() = impl_->negotiated;
    c = impl_->connection;
  }
  if (c != nullptr) internal::CopyCounters(c->counters(), &out);
  return internal::FromProto(out);
}

}  // namespace swirl
