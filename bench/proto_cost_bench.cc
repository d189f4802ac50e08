// What protobuf itself costs in a 64-byte echo round trip, without any transport: the work
// bench/rpc_perf's protobuf echo does beyond its raw-bytes echo. Per round trip the client
// serializes the request and parses the response, and the server parses the request, runs the
// echo handler and serializes the response; BM_ProtobufPerRoundTrip does exactly those five
// steps on the messages rpc_perf uses. One thread, everything in cache: a lower bound.

#include <benchmark/benchmark.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "examples/echo/echo.pb.h"
#include "examples/echo/echo_service.h"
#include "rpc/server_context_access.h"

namespace swirl {
namespace {

using examples::EchoRequest;
using examples::EchoResponse;

EchoRequest MakeRequest() {
  EchoRequest request;
  request.set_payload(std::string(64, 'x'));
  request.set_sequence(12345);
  return request;
}

// Both sides reuse their message objects and serialize into a buffer they already own, as
// swirl's stubs and TypedInvoker do.
void BM_SerializeRequest(benchmark::State& state) {
  const EchoRequest request = MakeRequest();
  uint8_t buffer[256];
  for (auto _ : state) {
    const size_t size = request.ByteSizeLong();
    request.SerializeWithCachedSizesToArray(buffer);
    benchmark::DoNotOptimize(size);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_SerializeRequest);

void BM_ParseRequest(benchmark::State& state) {
  std::string wire = MakeRequest().SerializeAsString();
  EchoRequest parsed;
  for (auto _ : state) {
    parsed.Clear();
    const bool ok = parsed.ParseFromArray(wire.data(), static_cast<int>(wire.size()));
    benchmark::DoNotOptimize(ok);
  }
}
BENCHMARK(BM_ParseRequest);

void BM_ProtobufPerRoundTrip(benchmark::State& state) {
  const EchoRequest request = MakeRequest();
  EchoRequest server_request;
  EchoResponse server_response, client_response;
  examples::EchoServiceImpl service;
  const std::atomic<bool> not_cancelled{false};
  // The echo handler uses neither the connection nor the flag.
  ServerContext context = internal::ServerContextAccess::Make(nullptr, &not_cancelled);
  uint8_t request_wire[256], response_wire[256];
  for (auto _ : state) {
    // Client: serialize the request.
    const int request_size = static_cast<int>(request.ByteSizeLong());
    request.SerializeWithCachedSizesToArray(request_wire);
    // Server: parse, handle, serialize.
    server_request.Clear();
    if (!server_request.ParseFromArray(request_wire, request_size)) state.SkipWithError("parse");
    server_response.Clear();
    (void)service.Echo(context, server_request, &server_response);
    const int response_size = static_cast<int>(server_response.ByteSizeLong());
    server_response.SerializeWithCachedSizesToArray(response_wire);
    // Client: parse the response.
    client_response.Clear();
    if (!client_response.ParseFromArray(response_wire, response_size)) {
      state.SkipWithError("parse");
    }
    benchmark::DoNotOptimize(client_response.payload().data());
  }
}
BENCHMARK(BM_ProtobufPerRoundTrip);

}  // namespace
}  // namespace swirl

BENCHMARK_MAIN();
