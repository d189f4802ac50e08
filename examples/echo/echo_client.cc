// An echo client: connects, makes --iterations echo calls of --size bytes, checks every answer,
// and prints latency percentiles.
//
//   echo_client --server=localhost:7100 --token=secret --iterations=100000 --size=64
//   echo_client --server=127.0.0.1:7100 --token=secret --tls_ca=ca.pem
//       (TLS flags: examples/common/tls_flags.h)

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "examples/common/tls_flags.h"
#include "examples/echo/echo.swirl.h"
#include "swirl/channel.h"

ABSL_FLAG(std::string, server, "localhost:7100", "server control-plane address");
ABSL_FLAG(std::string, token, "", "authentication token");
ABSL_FLAG(int, iterations, 10000, "calls to make");
ABSL_FLAG(int, size, 64, "payload bytes per call");
ABSL_FLAG(int, core, 0, "pin the calling thread to this core (-1: don't)");
ABSL_FLAG(std::string, device, "", "RDMA device (default: automatic)");
ABSL_FLAG(bool, caller_driven, true,
          "drive the connection from the calling thread (lowest latency) instead of a worker");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (int core = absl::GetFlag(FLAGS_core); core >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    sched_setaffinity(0, sizeof(set), &set);
  }
  swirl::ChannelOptions options;
  options.auth_token = absl::GetFlag(FLAGS_token);
  options.client_name = "echo_client";
  swirl::examples::ApplyTlsFlags(options);
  options.transport.device = absl::GetFlag(FLAGS_device);
  options.driver = absl::GetFlag(FLAGS_caller_driven) ? swirl::ChannelOptions::Driver::kCaller
                                                      : swirl::ChannelOptions::Driver::kBackgroundThread;
  auto channel = swirl::Channel::Create(absl::GetFlag(FLAGS_server), options);
  if (!channel.ok()) {
    std::fprintf(stderr, "echo_client: %s\n", channel.status().ToString().c_str());
    return 1;
  }
  std::printf("echo_client: connected (connection %llu, %u credits, max message %u, "
              "invalidation %s)\n",
              static_cast<unsigned long long>((*channel)->connection_id()),
              (*channel)->negotiated().client_credits,
              (*channel)->negotiated().max_message_size,
              swirl::ControlPlaneName((*channel)->negotiated().invalidation));
  swirl::examples::EchoStub stub(**channel);
  swirl::examples::EchoRequest request;
  request.set_payload(std::string(absl::GetFlag(FLAGS_size), 'x'));
  swirl::examples::EchoResponse response;
  const int iterations = absl::GetFlag(FLAGS_iterations);
  std::vector<double> latencies_us;
  latencies_us.reserve(iterations);
  int failures = 0;
  for (int i = 0; i < iterations; ++i) {
    request.set_sequence(i);
    const absl::Time start = absl::Now();
    absl::Status s = stub.Echo(request, &response);
    latencies_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
    if (!s.ok() || response.sequence() != static_cast<uint64_t>(i) ||
        response.payload() != request.payload()) {
      if (++failures <= 5) {
        std::fprintf(stderr, "echo_client: call %d: %s\n", i, s.ToString().c_str());
      }
    }
  }
  std::sort(latencies_us.begin(), latencies_us.end());
  auto pct = [&](double p) {
    return latencies_us.empty() ? 0.0 : latencies_us[static_cast<size_t>(p * (latencies_us.size() - 1))];
  };
  std::printf("echo_client: %d calls of %d bytes, %d failed; round trip us: min %.2f p50 %.2f "
              "p90 %.2f p99 %.2f p99.9 %.2f max %.2f\n",
              iterations, absl::GetFlag(FLAGS_size), failures, pct(0), pct(0.5), pct(0.9),
              pct(0.99), pct(0.999), pct(1));
  return failures == 0 ? 0 : 1;
}
