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
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "examples/echo/echo.pb.h"
#include "examples/echo/echo_service.h"
#include "rpc/testing/worker_pair.h"
#include "swirl/method_id.h"
#include "swirl/service.h"

ABSL_FLAG(std::string, encoding, "raw", "raw (bytes) or proto (EchoRequest/EchoResponse)");
ABSL_FLAG(int, size, 64, "echo payload bytes");
ABSL_FLAG(int, calls, 100000, "calls to make");

namespace {

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

using swirl::testing::WorkerPair;

// The measured steps, kept out of line so that callgrind can collect inside each alone (noipa:
// ServerTurn and ClientFinish have the same body, and identical-code folding would merge them).
[[gnu::noipa]] void ClientStart(WorkerPair& pair, swirl::ClientCall& call) { pair.Start(call); }
[[gnu::noipa]] bool ServerTurn(WorkerPair& pair) { return pair.ServerTurn(); }
[[gnu::noipa]] bool ClientFinish(WorkerPair& pair) { return pair.ClientTurn(); }

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const bool proto = absl::GetFlag(FLAGS_encoding) == "proto";
  if (!proto && absl::GetFlag(FLAGS_encoding) != "raw") Fail("--encoding is raw or proto");
  RawEcho raw_echo;
  swirl::examples::EchoServiceImpl proto_echo;
  auto pair = WorkerPair::Create({&raw_echo, &proto_echo});
  if (!pair.ok()) Fail(pair.status().ToString());

  const std::string payload(absl::GetFlag(FLAGS_size), 'x');
  swirl::examples::EchoRequest request;
  request.set_payload(payload);
  swirl::examples::EchoResponse response;
  std::string raw_response;
  swirl::ClientCall call;
  if (proto) {
    call.SetMethod(swirl::MethodId("/swirl.examples.Echo/Echo"));
    call.SetRequest(&request);
    call.SetResponse(&response);
  } else {
    call.SetMethod(swirl::MethodId("/bench.Path/Echo"));
    call.SetRequestBytes(payload);
    call.SetResponseBytes(&raw_response);
  }
  // Warm-up, outside the measured steps: the QPs link (the soft device's hello exchange takes
  // its HCA threads a while, longer under callgrind), pools and caches are touched.
  for (int i = 0; i < 1000; ++i) {
    if (absl::Status s = (*pair)->RoundTrip(call); !s.ok()) Fail("warm-up call: " + s.ToString());
  }
  const int calls = absl::GetFlag(FLAGS_calls);
  uint64_t server_turns = 0, client_turns = 0;
  for (int i = 0; i < calls; ++i) {
    ClientStart(**pair, call);
    // One server turn takes the request and posts the response; then the client's turn takes
    // it. Anything left over (a credit return, a send completion) is done by the next turns:
    // count them, so that an extra empty turn shows.
    while (!call.done()) {
      server_turns += ServerTurn(**pair);
      client_turns += ClientFinish(**pair);
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
