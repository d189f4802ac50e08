#include "rpc/channel.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <map>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "base/mutex.h"
#include "base/log.h"
#include "proto/control.grpc.pb.h"
#include "rpc/establish.h"
#include "rpc/handshake.h"
#include "rpc/worker.h"
#include "transport/device.h"

namespace swirl {
namespace internal {

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// The device, its capabilities and a worker, shared by the channels of a process that use the
// background driver (or owned by one channel).
struct ClientRuntime {
  std::shared_ptr<verbs::Context> context;
  std::shared_ptr<verbs::ProtectionDomain> pd;
  verbs::Capabilities caps;
  std::unique_ptr<Worker> worker;
  ~ClientRuntime() {
    if (worker) worker->Stop();
  }
};

namespace {

swirl::Mutex g_mu;

absl::StatusOr<std::shared_ptr<ClientRuntime>> NewRuntime(const ChannelOptions& options,
                                                          bool shared) {
  auto runtime = std::make_shared<ClientRuntime>();
  auto device = OpenTransport(options.transport, Probe::kOncePerProcess);
  if (!device.ok()) return device.status();
  runtime->context = device->context;
  runtime->pd = device->pd;
  runtime->caps = device->caps;
  WorkerOptions wo = WorkerOptionsFor(options.transport);
  wo.name = shared ? "client-worker" : "channel-worker";
  wo.core = options.worker_core;
  wo.own_thread = options.driver == ChannelOptions::Driver::kBackgroundThread;
  wo.max_connections = shared ? 64 : 1;
  auto worker = Worker::Create(runtime->context, runtime->pd, runtime->caps, wo, nullptr);
  if (!worker.ok()) return worker.status();
  runtime->worker = std::move(*worker);
  runtime->worker->Start();
  return runtime;
}

absl::StatusOr<std::shared_ptr<ClientRuntime>> GetRuntime(const ChannelOptions& options) {
  const bool shared = options.driver == ChannelOptions::Driver::kBackgroundThread &&
                      !options.dedicated_worker;
  if (!shared) return NewRuntime(options, false);
  static auto* runtimes = new std::map<std::string, std::weak_ptr<ClientRuntime>>();
  const TransportOptions& t = options.transport;
  const std::string key = absl::StrCat(t.device, "/", t.port, "/", t.gid_index, "/", t.credits,
                                       "/", t.buffer_size, "/", t.bulk_pool_bytes);
  {
    swirl::MutexLock lock(&g_mu);
    if (auto existing = (*runtimes)[key].lock()) return existing;
  }
  auto runtime = NewRuntime(options, true);
  if (!runtime.ok()) return runtime;
  swirl::MutexLock lock(&g_mu);
  if (auto existing = (*runtimes)[key].lock()) return existing;  // lost a race: use theirs
  (*runtimes)[key] = *runtime;
  return runtime;
}

}  // namespace
}  // namespace internal

class Channel::Impl {
 public:
  ChannelOptions options;
  std::string address;
  std::shared_ptr<grpc::Channel> grpc_channel;
  std::unique_ptr<control::Control::Stub> stub;
  std::shared_ptr<internal::ClientRuntime> runtime;
  internal::MethodTable methods;
  std::shared_ptr<internal::Connection> connection;
  uint64_t connection_id = 0;
  std::string disconnect_secret;  // from the ConnectResponse; Disconnect presents it
  control::Negotiated negotiated;
  // `connection` and `runtime` are set before the Channel is handed out and live as long as it
  // does, so any thread may use them; Close() only marks the channel closed and closes the
  // connection. A Close() that finds it closed or closing returns at once; `close_mu` keeps two
  // that start together from both closing it.
  std::atomic<bool> closed{false};
  swirl::Mutex close_mu;

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
    auto rt = internal::GetRuntime(options);
    if (!rt.ok()) return rt.status();
    runtime = *rt;
    internal::Worker* worker = runtime->worker.get();

    internal::LocalConfig local = internal::LocalConfigFor(options.transport, runtime->caps);
    local.bulk_mode = options.bulk_mode == BulkMode::kMirror ? control::BULK_MIRROR
                                                             : control::BULK_SERVER_EXPOSES;
    local.max_bulk_size = runtime->worker->bulk_pool() == nullptr
                              ? 0
                              : runtime->worker->bulk_pool()->max_allocation();

    const verbs::Capabilities declared =
        internal::DeclaredCapabilities(runtime->caps, options.transport.invalidation);
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
    internal::Worker* worker = runtime->worker.get();
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
  impl_->runtime->worker->StartCall(impl_->connection->id(), call);
}

bool Channel::Poll() {
  if (impl_->runtime == nullptr || !impl_->runtime->worker->caller_driven()) return false;
  return impl_->runtime->worker->TryDrive();
}

const control::Negotiated& Channel::negotiated() const { return impl_->negotiated; }
uint64_t Channel::connection_id() const { return impl_->connection_id; }

bool Channel::connected() const {
  return !impl_->closed.load(std::memory_order_acquire) && impl_->connection != nullptr &&
         impl_->connection->state() == internal::Connection::State::kActive;
}

absl::StatusOr<control::StatsResponse> Channel::ServerStats() {
  control::StatsRequest request;
  control::StatsResponse response;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  impl_->AddAuth(&ctx);
  absl::Status s = internal::FromGrpc(impl_->stub->Stats(&ctx, request, &response));
  if (!s.ok()) return s;
  return response;
}

void Channel::Close() { impl_->Close(); }

absl::StatusOr<BulkBuffer> Channel::AllocateBulk(size_t size) {
  if (impl_->runtime == nullptr || impl_->runtime->worker->bulk_pool() == nullptr) {
    return absl::FailedPreconditionError("this channel has no bulk pool");
  }
  return impl_->runtime->worker->bulk_pool()->Allocate(size);
}

control::ConnectionStats Channel::LocalStats() const {
  control::ConnectionStats out;
  out.set_connection_id(impl_->connection_id);
  *out.mutable_negotiated() = impl_->negotiated;
  if (impl_->connection == nullptr) return out;
  internal::CopyCounters(impl_->connection->counters(), &out);
  return out;
}

}  // namespace swirl
