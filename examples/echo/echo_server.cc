// An echo server: serves swirl.examples.Echo (and Blob, the bulk service of `./swirl demo`) until
// SIGINT or SIGTERM, then shuts down gracefully and prints what it served.
//
//   echo_server --address=0.0.0.0:7100 --token=secret --cores=1
//   echo_server ... --tls_cert=server.pem --tls_key=server.key  (examples/common/tls_flags.h)

#include <signal.h>

#include <atomic>
#include <cstdio>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "base/stop_signals.h"
#include "examples/common/tls_flags.h"
#include "examples/echo/blob_service.h"
#include "examples/echo/echo.swirl.h"
#include "examples/echo/echo_service.h"
#include "swirl/server.h"

ABSL_FLAG(std::string, address, "0.0.0.0:7100", "control-plane listen address (port 0: pick)");
ABSL_FLAG(std::string, token, "", "clients must present this token (empty: no auth)");
ABSL_FLAG(bool, insecure, false,
          "listen beyond loopback without a token: anyone who can reach the address may call");
ABSL_FLAG(std::string, cores, "1", "comma-separated cores, one pinned worker each (-1: unpinned)");
ABSL_FLAG(std::string, device, "", "RDMA device (default: automatic, soft0 without hardware)");
ABSL_FLAG(std::string, port_file, "", "write the chosen port here once listening");
ABSL_FLAG(bool, busy_poll, false, "never sleep on the completion channel when idle");

namespace {

using EchoImpl = swirl::examples::EchoServiceImpl;

}  // namespace

int main(int argc, char** argv) {
  swirl::StopSignals stop_signals;  // before any thread starts: none is lost, none kills us
  absl::ParseCommandLine(argc, argv);
  swirl::ServerOptions options;
  options.address = absl::GetFlag(FLAGS_address);
  options.auth_token = absl::GetFlag(FLAGS_token);
  options.allow_insecure_non_loopback = absl::GetFlag(FLAGS_insecure);
  swirl::examples::ApplyTlsFlags(options);
  options.transport.device = absl::GetFlag(FLAGS_device);
  options.worker_cores.clear();
  for (absl::string_view core : absl::StrSplit(absl::GetFlag(FLAGS_cores), ',')) {
    int c;
    if (!absl::SimpleAtoi(core, &c)) {
      std::fprintf(stderr, "bad --cores entry '%s'\n", std::string(core).c_str());
      return 2;
    }
    options.worker_cores.push_back(c);
  }
  if (absl::GetFlag(FLAGS_busy_poll)) options.idle_spin = absl::ZeroDuration();

  EchoImpl echo;
  swirl::examples::BlobServiceImpl blob;
  swirl::Server server(options);
  for (swirl::Service* service : {static_cast<swirl::Service*>(&echo),
                                  static_cast<swirl::Service*>(&blob)}) {
    if (absl::Status s = server.RegisterService(service); !s.ok()) {
      std::fprintf(stderr, "echo_server: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  if (absl::Status s = server.Start(); !s.ok()) {
    std::fprintf(stderr, "echo_server: %s\n", s.ToString().c_str());
    return 1;
  }
  const auto& caps = server.capabilities();
  std::printf("echo_server: listening on port %d, device %s (%s), remote invalidation %s\n",
              server.port(), caps.device.c_str(), caps.kind.c_str(),
              caps.remote_invalidation ? "yes" : "no");
  std::fflush(stdout);
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    // Written aside and renamed: whoever waits for the file never reads half of it.
    const std::string path = absl::GetFlag(FLAGS_port_file);
    std::ofstream(path + ".tmp") << server.port() << "\n";
    std::rename((path + ".tmp").c_str(), path.c_str());
  }
  stop_signals.Wait();

  // Taken before the drain: Shutdown ends the workers, and their counters with them.
  const swirl::StatsReport stats = server.Stats();
  server.Shutdown(absl::Seconds(5));
  const swirl::ServerCounters& s = stats.server;
  auto n = [](uint64_t v) { return static_cast<unsigned long long>(v); };
  std::printf("echo_server: served %llu requests on %llu connections (%llu refused), "
              "%llu protocol errors\n",
              n(s.requests), n(s.connections_accepted), n(s.connections_refused),
              n(s.protocol_errors));
  std::printf("echo_server: windows revoked by the peer's SEND_WITH_INV %llu, by LOCAL_INV %llu, "
              "at lease expiry %llu; invalidation violations %llu, refused remote accesses %llu\n",
              n(s.windows_remote_invalidated), n(s.windows_locally_invalidated),
              n(s.windows_lease_expired), n(s.invalidation_violations), n(s.async_qp_errors));
  return 0;
}
