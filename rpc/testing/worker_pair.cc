#include "rpc/testing/worker_pair.h"

#include <algorithm>
#include <tuple>

#include "rpc/handshake.h"
#include "transport/device.h"
#include "transport/verbs/capabilities.h"

namespace swirl::testing {
namespace {

absl::StatusOr<std::unique_ptr<internal::Worker>> NewWorker(
    const std::shared_ptr<verbs::Context>& context,
    const std::shared_ptr<verbs::ProtectionDomain>& pd, const verbs::Capabilities& caps,
    const char* name) {
  internal::WorkerOptions wo;
  wo.name = name;
  wo.own_thread = false;  // the pair's caller drives both
  wo.max_connections = 1;
  wo.credits = 64;
  wo.keepalive = absl::InfiniteDuration();
  wo.setup_timeout = absl::ZeroDuration();
  return internal::Worker::Create(context, pd, caps, wo, nullptr);
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerPair>> WorkerPair::Create(
    std::initializer_list<Service*> services) {
  std::unique_ptr<WorkerPair> pair(new WorkerPair());
  auto context = OpenDevice("soft0");
  if (!context.ok()) return context.status();
  pair->context_ = *context;
  verbs::ProbeOptions probe;
  probe.confirm_remote_invalidation = false;  // no bulk here
  auto caps = verbs::ProbeCapabilities(pair->context_, probe);
  if (!caps.ok()) return caps.status();
  auto pd = verbs::ProtectionDomain::Create(pair->context_);
  if (!pd.ok()) return pd.status();
  pair->pd_ = *pd;
  for (Service* service : services) {
    if (absl::Status s = pair->server_.methods.Add(*service); !s.ok()) return s;
  }
  auto client = NewWorker(pair->context_, pair->pd_, *caps, "client");
  if (!client.ok()) return client.status();
  pair->client_.worker = std::move(*client);
  auto server = NewWorker(pair->context_, pair->pd_, *caps, "server");
  if (!server.ok()) return server.status();
  pair->server_.worker = std::move(*server);
  if (absl::Status s = pair->Connect(*caps); !s.ok()) return s;
  return pair;
}

// The two halves of what Server and Channel do at Connect, in one process.
absl::Status WorkerPair::Connect(const verbs::Capabilities& caps) {
  verbs::ConnectOptions co;
  co.access_flags &= ~IBV_ACCESS_REMOTE_ATOMIC;
  co.timeout = 0;  // no ACK timeout: under callgrind, linking takes longer than one allows
  auto cc = client_.worker->CreateConnection(1, &client_.methods, co);
  if (!cc.ok()) return cc.status();
  auto sc = server_.worker->CreateConnection(2, &server_.methods, co);
  if (!sc.ok()) return sc.status();
  auto client_address = (*cc)->qp().LocalAddress(11, co);
  if (!client_address.ok()) return client_address.status();
  auto server_address = (*sc)->qp().LocalAddress(22, co);
  if (!server_address.ok()) return server_address.status();
  internal::LocalConfig client_config;
  client_config.credits = 64;
  client_config.buffer_size = 4096 + 32;
  client_config.max_inline = std::min<uint32_t>(caps.max_inline_data, 1024);
  internal::LocalConfig server_config = client_config;
  control::ConnectRequest request;
  request.set_protocol_version(internal::kControlProtocolVersion);
  *request.mutable_address() = internal::ToProto(*client_address);
  *request.mutable_capabilities() = internal::DescribeLocal(caps, client_config);
  // Both ends are this process's soft0: reachable.
  auto negotiated = internal::Negotiate(request, caps, server_config,
                                        [](const ibv_gid&) { return absl::OkStatus(); });
  if (!negotiated.ok()) return negotiated.status();
  if (absl::Status s = internal::CheckNegotiated(*negotiated, client_config, caps); !s.ok()) {
    return s;
  }
  for (auto [c, peer, psn] : {std::tuple{*sc, *client_address, 22u},
                              std::tuple{*cc, *server_address, 11u}}) {
    if (absl::Status s = c->qp().ToRtr(peer, co); !s.ok()) return s;
    if (absl::Status s = c->qp().ToRts(psn, co); !s.ok()) return s;
  }
  (*sc)->Configure(*negotiated, /*is_server=*/true, "client", "worker_pair");
  (*cc)->Configure(*negotiated, /*is_server=*/false, "server", "worker_pair");
  server_.worker->Activate(*sc);
  client_.worker->Activate(*cc);
  server_.connection = *sc;
  client_.connection = *cc;
  for (int i = 0; i < 100; ++i) {  // activations, the client's first ping
    client_.worker->TryDrive();
    server_.worker->TryDrive();
  }
  return absl::OkStatus();
}

absl::Status WorkerPair::RoundTrip(ClientCall& call, absl::Duration timeout) {
  Start(call);
  // The QPs link in the background (the soft device's hello exchange): the first calls may
  // take a few turns more.
  const absl::Time deadline = absl::Now() + timeout;
  while (!call.done() && absl::Now() < deadline) {
    ServerTurn();
    ClientTurn();
  }
  if (!call.done()) return absl::DeadlineExceededError("the call did not complete");
  return call.status();
}

}  // namespace swirl::testing
