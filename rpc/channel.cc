#include "swirl/channel.h"

#include <grpcpp/grpcpp.h>

#include <atomic>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "base/mutex.h"
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

class Channel::Impl {
 public:
  ChannelOptions options;
  std::string address;
  std::shared_ptr<grpc::Channel> grpc_channel;
  std::unique_ptr<control::Control::Stub> stub;
  std::shared_ptr<ClientRuntime> runtime;
  internal::MethodTable methods;
  std::shared_ptr<internal::Connection> connection;
  uint64_t connection_id = 0;
  std::string disconnect_secret;  // from the ConnectResponse; Disconnect presents it
  control::Negotiated negotiated;
  NegotiatedSettings settings;  // the same, as Channel::negotiated() returns it
  // `connection` and `runtime` are set before the Channel is handed out and live as long as it
  // does, so any thread may use them; Close() only marks the channel closed and closes the
  // connection. A Close() that finds it closed or closing returns at once; `close_mu` keeps two
  // that start together from both closing it.
  std::atomic<bool> closed{false};
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

  absl::Status Connect() {
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
    grpc::ChannelArguments args;
    if (!options.tls_root_cert_file.empty()) {
      auto root = internal::ReadFile(options.tls_root_cert_file);
      if (!root.ok()) return root.status();
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = *root;
      credentials = grpc::SslCredentials(ssl);
      if (!options.tls_target_name.empty()) {
        args.SetSslTargetNameOverride(options.tls_target_name);
      }
    }
    // Each channel gets its own HTTP/2 connection, so closing one never disturbs another.
    args.SetInt("swirl.channel_id", static_cast<int>(absl::Uniform<uint32_t>(absl::BitGen())));
    grpc_channel = grpc::CreateCustomChannel(address, credentials, args);
    stub = control::Control::NewStub(grpc_channel);

    for (Service* s : options.services) {
      if (absl::Status st = methods.Add(*s); !st.ok()) return st;
    }
    auto rt = RuntimeFor(options);
    if (!rt.ok()) return rt.status();
    runtime = *rt;
    // The runtime's settings are the channel's (equal to its own, or its own left as they are).
    options.transport = runtime->options().transport;
    options.worker_core = runtime->options().worker_core;
    internal::Worker* worker = &runtime->worker();

    internal::LocalConfig local =
        internal::LocalConfigFor(options.transport, runtime->device_capabilities());
    local.bulk_mode = options.bulk_mode == BulkMode::kMirror ? control::BULK_MIRROR
                                                             : control::BULK_SERVER_EXPOSES;
    local.max_bulk_size =
        worker->bulk_pool() == nullptr ? 0 : worker->bulk_pool()->max_allocation();

    const verbs::Capabilities declared = internal::DeclaredCapabilities(
        runtime->device_capabilities(), options.transport.invalidation);
    control::ConnectResponse response;
    auto exchange = [&](const verbs::PeerAddress& ours) -> absl::StatusOr<internal::PeerAnswer> {
      control::ConnectRequest request;
      request.set_protocol_version(internal::kControlProtocolVersion);
      request.set_client_name(options.client_name);
      *request.mutable_address() = internal::ToProto(ours);
      *request.mutable_capabilities() = internal::DescribeLocal(declared, local);
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + options.connect_timeout));
      AddAuth(&ctx);
      absl::Status s = internal::FromGrpc(stub->Connect(&ctx, request, &response));
      if (s.ok()) s = internal::CheckNegotiated(response.negotiated(), local, declared);
      if (!s.ok()) return s;
      auto server_address = internal::FromProto(response.address());
      if (!server_address.ok()) return server_address.status();
      return internal::PeerAnswer{*server_address, response.negotiated(),
                                  response.connection_id()};
    };
    internal::ConnectionSetup setup{.worker = worker,
                                    .id = absl::Uniform<uint64_t>(absl::BitGen()),
                                    .methods = &methods,
                                    .transport = &options.transport,
                                    .is_server = false,
                                    .peer = address,
                                    .client_name = options.client_name};
    auto c = internal::EstablishConnection(setup, exchange);
    if (!c.ok()) {
      // The server may have set its side up already: it is told, instead of waiting for its
      // setup_timeout.
      if (response.connection_id() != 0) {
        SendDisconnect(response.connection_id(), response.disconnect_secret());
      }
      return c.status();
    }
    negotiated = response.negotiated();
    settings = internal::FromProto(negotiated);
    connection_id = response.connection_id();
    disconnect_secret = response.disconnect_secret();
    connection = *c;
    // A caller-driven worker acts only when driven: once now, so that the activation (and the
    // ping that tells the server we are up, ServerOptions::setup_timeout) does not wait for the
    // first call.
    if (worker->caller_driven()) worker->TryDrive();
    return absl::OkStatus();
  }

  void SendDisconnect(uint64_t id, const std::string& secret) {
    control::DisconnectRequest request;
    request.set_connection_id(id);
    request.set_disconnect_secret(secret);
    control::DisconnectResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    AddAuth(&ctx);
    (void)stub->Disconnect(&ctx, request, &response);
  }

  void Close() {
    // Closed already (or closing on another thread): done, without waiting for that thread,
    // which may be waiting for the very worker this call runs on (a callback closing it).
    if (closed.load(std::memory_order_acquire)) return;
    swirl::MutexLock lock(&close_mu);
    if (closed.load(std::memory_order_acquire) || connection == nullptr) return;
    closed.store(true, std::memory_order_release);
    SendDisconnect(connection_id, disconnect_secret);
    internal::Worker* worker = &runtime->worker();
    worker->Close(connection->id(), absl::UnavailableError("channel closed"));
    // Wait for the worker to finish with the connection (driving it ourselves if need be).
    const absl::Time deadline = absl::Now() + absl::Seconds(3);
    while (connection->state() != internal::Connection::State::kClosed &&
           absl::Now() < deadline) {
      if (worker->caller_driven()) {
        worker->TryDrive();
      } else {
        absl::SleepFor(absl::Microseconds(200));
      }
    }
  }
};

absl::StatusOr<std::shared_ptr<Channel>> Channel::Create(const std::string& address,
                                                         const ChannelOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->address = address;
  if (absl::Status s = impl->Connect(); !s.ok()) return s;
  return std::shared_ptr<Channel>(new Channel(std::move(impl)));
}

Channel::Channel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Channel::~Channel() { Close(); }

void Channel::Start(ClientCall* call) {
  if (impl_->closed.load(std::memory_order_acquire) || impl_->connection == nullptr) {
    internal::Worker::FailUnstarted(call, absl::UnavailableError("channel closed"));
    return;
  }
  impl_->runtime->worker().StartCall(impl_->connection->id(), call);
}

bool Channel::Poll() {
  if (impl_->runtime == nullptr || !impl_->runtime->worker().caller_driven()) return false;
  return impl_->runtime->worker().TryDrive();
}

const NegotiatedSettings& Channel::negotiated() const { return impl_->settings; }
uint64_t Channel::connection_id() const { return impl_->connection_id; }

bool Channel::connected() const {
  return !impl_->closed.load(std::memory_order_acquire) && impl_->connection != nullptr &&
         impl_->connection->state() == internal::Connection::State::kActive;
}

absl::StatusOr<StatsReport> Channel::ServerStats() {
  control::StatsRequest request;
  control::StatsResponse response;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  impl_->AddAuth(&ctx);
  absl::Status s = internal::FromGrpc(impl_->stub->Stats(&ctx, request, &response));
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
  out.set_connection_id(impl_->connection_id);
  *out.mutable_negotiated() = impl_->negotiated;
  if (impl_->connection != nullptr) internal::CopyCounters(impl_->connection->counters(), &out);
  return internal::FromProto(out);
}

}  // namespace swirl
