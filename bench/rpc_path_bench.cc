// The RPC layer's own cost per call, on one thread: a client worker and a server worker, both
// driven by this thread in turn, connected over soft0, exchange 64-byte echoes (raw bytes or
// protobuf). Nothing spins while waiting for the other side: each step does the work of one
// side of one call, so instruction counts (callgrind) are exact and stable.
//
//   rpc_path_bench [--encoding raw|proto] [--size 64] [--calls N]
//
// bench/rpc_cost.sh runs it under callgrind, collecting inside ClientStart/ClientFinish (the
// caller's side: from starting the call to its completion) and ServerTurn (the server: from
// the receive completion to the posted response) separately, and splits each by source folder.
// With --calls 0 it only sets up (the cost of setup, to subtract).

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "examples/echo/echo.pb.h"
#include "examples/echo/echo_service.h"
#include "rpc/handshake.h"
#include "rpc/wire.h"
#include "rpc/worker.h"
#include "swirl/service.h"
#include "transport/device.h"
#include "transport/verbs/capabilities.h"

ABSL_FLAG(std::string, encoding, "raw", "raw (bytes) or proto (EchoRequest/EchoResponse)");
ABSL_FLAG(int, size, 64, "echo payload bytes");
ABSL_FLAG(int, calls, 100000, "calls to make");

namespace {

using swirl::internal::Connection;
using swirl::internal::Worker;

[[noreturn]] void Fail(const std::string& why) {
  std::fprintf(stderr, "rpc_path_bench: %s\n", why.c_str());
  std::exit(1);
}

class RawEcho final : public swirl::Service {
 public:
  RawEcho() : Service("bench.Path") {
    AddRawMethod("Echo", [](swirl::ServerContext&, absl::string_view in,
                            swirl::ResponseWriter& out) {
      return out.Append(in) ? absl::OkStatus() : absl::ResourceExhaustedError("too big");
    });
  }
};

struct Side {
  std::unique_ptr<Worker> worker;
  std::shared_ptr<Connection> connection;
  swirl::internal::MethodTable methods;
};

std::unique_ptr<Worker> NewWorker(const std::shared_ptr<swirl::verbs::Context>& context,
                                  const std::shared_ptr<swirl::verbs::ProtectionDomain>& pd,
                                  const swirl::verbs::Capabilities& caps, const char* name) {
  swirl::internal::WorkerOptions wo;
  wo.name = name;
  wo.own_thread = false;  // this thread drives both
  wo.max_connections = 1;
  wo.credits = 64;
  wo.keepalive = absl::InfiniteDuration();
  wo.setup_timeout = absl::ZeroDuration();
  auto worker = Worker::Create(context, pd, caps, wo, nullptr);
  if (!worker.ok()) Fail(worker.status().ToString());
  return std::move(*worker);
}

// The two halves of what Server and Channel do at Connect, in one process.
void ConnectPair(Side& client, Side& server, const swirl::verbs::Capabilities& caps) {
  swirl::verbs::ConnectOptions co;
  co.access_flags &= ~IBV_ACCESS_REMOTE_ATOMIC;
  co.timeout = 0;  // no ACK timeout: under callgrind, linking takes longer than one allows
  auto cc = client.worker->CreateConnection(1, &client.methods, co);
  auto sc = server.worker->CreateConnection(2, &server.methods, co);
  if (!cc.ok() || !sc.ok()) Fail("CreateConnection failed");
  auto client_address = (*cc)->qp().LocalAddress(11, co);
  auto server_address = (*sc)->qp().LocalAddress(22, co);
  if (!client_address.ok() || !server_address.ok()) Fail("LocalAddress failed");
  swirl::internal::LocalConfig client_config;
  client_config.credits = 64;
  client_config.buffer_size = 4096 + 32;
  client_config.max_inline = std::min<uint32_t>(caps.max_inline_data, 1024);
  swirl::internal::LocalConfig server_config = client_config;
  swirl::control::ConnectRequest request;
  request.set_protocol_version(swirl::internal::kControlProtocolVersion);
  *request.mutable_address() = swirl::internal::ToProto(*client_address);
  *request.mutable_capabilities() = swirl::internal::DescribeLocal(caps, client_config);
  // Both ends are this process's soft0: reachable.
  auto negotiated = swirl::internal::Negotiate(request, caps, server_config,
                                               [](const ibv_gid&) { return absl::OkStatus(); });
  if (!negotiated.ok()) Fail(negotiated.status().ToString());
  if (auto s = swirl::internal::CheckNegotiated(*negotiated, client_config, caps); !s.ok()) {
    Fail(s.ToString());
  }
  for (auto [c, peer, psn] : {std::tuple{*sc, *client_address, 22u},
                              std::tuple{*cc, *server_address, 11u}}) {
    if (auto s = c->qp().ToRtr(peer, co); !s.ok()) Fail(s.ToString());
    if (auto s = c->qp().ToRts(psn, co); !s.ok()) Fail(s.ToString());
  }
  (*sc)->Configure(*negotiated, /*is_server=*/true, "client", "rpc_path_bench");
  (*cc)->Configure(*negotiated, /*is_server=*/false, "server", "rpc_path_bench");
  server.worker->Activate(*sc);
  client.worker->Activate(*cc);
  server.connection = *sc;
  client.connection = *cc;
  for (int i = 0; i < 100; ++i) {  // activations, the client's first ping
    client.worker->TryDrive();
    server.worker->TryDrive();
  }
}

// The measured steps, kept out of line so that callgrind can collect inside each alone (noipa:
// ServerTurn and ClientFinish have the same body, and identical-code folding would merge them).
[[gnu::noipa]] void ClientStart(Side& client, swirl::ClientCall& call) {
  client.worker->StartCall(client.connection->id(), &call);
}
[[gnu::noipa]] bool ServerTurn(Side& server) { return server.worker->TryDrive(); }
[[gnu::noipa]] bool ClientFinish(Side& client) { return client.worker->TryDrive(); }

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const bool proto = absl::GetFlag(FLAGS_encoding) == "proto";
  if (!proto && absl::GetFlag(FLAGS_encoding) != "raw") Fail("--encoding is raw or proto");
  auto context = swirl::OpenDevice("soft0");
  if (!context.ok()) Fail(context.status().ToString());
  swirl::verbs::ProbeOptions probe;
  probe.confirm_remote_invalidation = false;  // no bulk here
  auto caps = swirl::verbs::ProbeCapabilities(*context, probe);
  if (!caps.ok()) Fail(caps.status().ToString());
  auto pd = swirl::verbs::ProtectionDomain::Create(*context);
  if (!pd.ok()) Fail(pd.status().ToString());

  RawEcho raw_echo;
  swirl::examples::EchoServiceImpl proto_echo;
  Side client, server;
  if (auto s = server.methods.Add(raw_echo); !s.ok()) Fail(s.ToString());
  if (auto s = server.methods.Add(proto_echo); !s.ok()) Fail(s.ToString());
  client.worker = NewWorker(*context, *pd, *caps, "client");
  server.worker = NewWorker(*context, *pd, *caps, "server");
  ConnectPair(client, server, *caps);

  const std::string payload(absl::GetFlag(FLAGS_size), 'x');
  swirl::examples::EchoRequest request;
  request.set_payload(payload);
  swirl::examples::EchoResponse response;
  std::string raw_response;
  swirl::ClientCall call;
  if (proto) {
    call.SetMethod(swirl::rpc_wire::MethodId("/swirl.examples.Echo/Echo"));
    call.SetRequest(&request);
    call.SetResponse(&response);
  } else {
    call.SetMethod(swirl::rpc_wire::MethodId("/bench.Path/Echo"));
    call.SetRequestBytes(payload);
    call.SetResponseBytes(&raw_response);
  }
  // Warm-up, outside the measured steps: the QPs link (the soft device's hello exchange takes
  // its HCA threads a while, longer under callgrind), pools and caches are touched.
  for (int i = 0; i < 1000; ++i) {
    client.worker->StartCall(client.connection->id(), &call);
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (!call.done() && absl::Now() < deadline) {
      server.worker->TryDrive();
      client.worker->TryDrive();
    }
    if (!call.done() || !call.status().ok()) Fail("warm-up call failed");
  }
  const int calls = absl::GetFlag(FLAGS_calls);
  uint64_t server_turns = 0, client_turns = 0;
  for (int i = 0; i < calls; ++i) {
    ClientStart(client, call);
    // One server turn takes the request and posts the response; then the client's turn takes
    // it. Anything left over (a credit return, a send completion) is done by the next turns:
    // count them, so that an extra empty turn shows.
    while (!call.done()) {
      server_turns += ServerTurn(server);
      client_turns += ClientFinish(client);
    }
    if (!call.status().ok()) Fail(call.status().ToString());
  }
  const bool echoed = proto ? response.payload() == payload : raw_response == payload;
  if (calls > 0 && !echoed) Fail("the echo came back wrong");
  std::printf("{\"encoding\":\"%s\",\"size\":%zu,\"calls\":%d,\"server_turns_with_work\":%llu,"
              "\"client_turns_with_work\":%llu}\n",
              proto ? "proto" : "raw", payload.size(), calls,
              static_cast<unsigned long long>(server_turns),
              static_cast<unsigned long long>(client_turns));
  return 0;
}
