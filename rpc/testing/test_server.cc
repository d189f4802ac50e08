// A server for rpc/e2e_test.cc, run as a separate process. Raw methods of service "test.E2E":
//   Echo      returns the request
//   Sleep     (blocking) sleeps the number of milliseconds in the request, stops early when the
//             caller cancels, returns "done" or "cancelled"
//   Cancelled returns how many Sleep calls saw a cancellation so far
//   Gate      (blocking, one-way) waits until the gate opens (at most 20 s, or until cancelled)
//   GateSum   (blocking) waits at the gate as Gate does, then does what Sum does
//   GateEntered / GatePassed  how many Gate handlers started / got through so far
//   OpenGate / CloseGate      open or shut the gate
//   Fail      fails with the absl::StatusCode number in the request
//   CallBack  (blocking) calls "test.Client/Ping" on the caller's side of the same connection
//             and returns its answer (server-to-client calls)
//   NotifyBack (on the worker) sends N (the request) one-way "test.Client/Note" messages to the
//             caller with CallOneWay, more than the credits allow at once, and returns "sent"
//   Fill      returns a bulk attachment of N bytes (N in the request) of a known pattern
//   SlowFill  (blocking) "<ms> <N>": sleeps ms (ignoring cancellation), then does what Fill does
//   Sum       returns "<bytes>:<FNV-1a hash>" of the request's bulk attachment
//   LastSum   returns what the last Sum computed
//   BulkEcho  returns the request's bulk attachment as the response's, and the eager part
//   Stats     returns "<exposed> <remote> <local> <lease_expired> <violations>" for this server
//   Whoami    returns the caller's principal (ServerContext::principal())
// Prints nothing; writes its port to --port_file. SIGTERM: graceful shutdown, exit 0.

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/mutex.h"
#include "base/stop_signals.h"
#include "proto/control.pb.h"
#include "rpc/testing/test_data.h"
#include "rpc/wire.h"
#include "swirl/call.h"
#include "swirl/server.h"
#include "swirl/service.h"

ABSL_FLAG(std::string, port_file, "", "where to write the control-plane port");
ABSL_FLAG(std::string, host, "127.0.0.1",
          "control-plane address to listen on (\"[::]\": both families; beyond loopback, "
          "plaintext is allowed: for tests in network namespaces and over IPv6)");
ABSL_FLAG(int, port, 0, "control-plane port (0: any free one; a restarted server reuses one)");
ABSL_FLAG(std::string, token, "e2e", "authentication token (principal \"default\", an admin)");
ABSL_FLAG(std::vector<std::string>, principals, {},
          "ServerOptions::principals, comma-separated name:token[:admin][:max_connections]");
ABSL_FLAG(int, max_connections, 256, "ServerOptions::max_connections (in total)");
ABSL_FLAG(int, max_per_client, 64, "connections per client address");
ABSL_FLAG(int, workers, 1, "worker threads (ServerOptions::worker_cores, none pinned)");
ABSL_FLAG(int, shutdown_ms, 3000, "graceful shutdown deadline");
ABSL_FLAG(int, window_lease_ms, 5000, "bulk window lease");
ABSL_FLAG(int, keepalive_ms, 1000, "keepalive interval");
ABSL_FLAG(int, ack_timeout_ms, 500, "TransportOptions::ack_timeout (0: no transport timer)");
ABSL_FLAG(int, setup_timeout_ms, 10000, "ServerOptions::setup_timeout");
ABSL_FLAG(int, credits, 32, "receive credits per connection");
ABSL_FLAG(int64_t, max_bulk_size, 16 << 20, "largest bulk transfer");
ABSL_FLAG(int64_t, download_bytes, 64 << 20, "unacknowledged download bytes per connection");
ABSL_FLAG(int64_t, grant_bytes, 32 << 20,
          "ServerOptions::grant_bytes_per_connection (unused grants, queued blocking handlers)");
ABSL_FLAG(int64_t, bulk_bytes_per_client, 0, "ServerOptions::bulk_bytes_per_client");
ABSL_FLAG(int, max_windows_per_client, 2048, "ServerOptions::max_windows_per_client");
ABSL_FLAG(int64_t, mirror_bytes, 32 << 20, "ServerOptions::mirror_bytes_per_connection");
ABSL_FLAG(int, mirror_reads, 16, "ServerOptions::mirror_reads_per_connection");
ABSL_FLAG(bool, no_local_fallback, false, "refuse clients without remote invalidation");
ABSL_FLAG(bool, local_invalidation_only, false,
          "offer only the LOCAL_INV fallback (InvalidationPolicy::kLocalOnly)");
ABSL_FLAG(std::vector<std::string>, fabric_networks, {},
          "ServerOptions::fabric_networks (comma-separated a.b.c.d/n)");
ABSL_FLAG(std::string, soft_faults, "",
          "SWIRL_SOFT_FAULTS for this server (\"none\": RC's transport timer on every QP and "
          "no fault)");
ABSL_FLAG(int64_t, bulk_pool_bytes, 128 << 20, "TransportOptions::bulk_pool_bytes (per worker)");

namespace {

std::atomic<int> g_cancelled{0};
// Gate: blocking handlers wait for OpenGate (at most 20 s, or until cancelled); GatePassed
// counts those through.
std::atomic<bool> g_gate_open{false};
std::atomic<int> g_gate_entered{0};
std::atomic<int> g_gate_passed{0};
swirl::Server* g_server = nullptr;
// What the last Sum saw (even when its caller had given up by then).
swirl::Mutex g_last_sum_mu;
std::string g_last_sum ABSL_GUARDED_BY(g_last_sum_mu);

using swirl::testing::Fnv;
using swirl::testing::Pattern;

// Holds a blocking handler until the gate opens (at most 20 s, or until its call is cancelled),
// counting it in GateEntered and GatePassed.
void WaitAtGate(const swirl::ServerContext& ctx) {
  g_gate_entered.fetch_add(1);
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (!g_gate_open.load() && !ctx.IsCancelled() && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  g_gate_passed.fetch_add(1);
}

// Sum's answer for the request's bulk attachment, remembered for LastSum.
absl::Status SumAttachment(swirl::ServerContext& ctx, swirl::ResponseWriter& out) {
  swirl::BulkBuffer* in = ctx.request_bulk();
  if (in == nullptr) return absl::InvalidArgumentError("Sum wants bulk data");
  std::string sum = absl::StrCat(in->size(), ":", Fnv(in->view()));
  {
    swirl::MutexLock lock(&g_last_sum_mu);
    g_last_sum = sum;
  }
  out.Append(sum);
  return absl::OkStatus();
}

absl::Status Echo(swirl::ServerContext&, absl::string_view in, swirl::ResponseWriter& out) {
  return out.Append(in) ? absl::OkStatus() : absl::ResourceExhaustedError("too big");
}

// Fill's attachment: `in` (a decimal size) bytes of Pattern(i), zero-copy; its size in *n.
absl::Status FillAttachment(swirl::ServerContext& ctx, absl::string_view in, size_t* n) {
  if (!absl::SimpleAtoi(in, n)) return absl::InvalidArgumentError("Fill wants a size");
  auto bulk = ctx.AllocateResponseBulk(*n);
  if (!bulk.ok()) return bulk.status();
  for (size_t i = 0; i < *n; ++i) (*bulk)->data()[i] = Pattern(i);
  (*bulk)->resize(*n);
  return absl::OkStatus();
}

class E2E : public swirl::Service {
 public:
  E2E() : Service("test.E2E") {
    AddRawMethod("Echo", Echo);
    AddRawMethod(
        "Sleep",
        [](swirl::ServerContext& ctx, absl::string_view in, swirl::ResponseWriter& out) {
          int ms = 0;
          (void)absl::SimpleAtoi(in, &ms);
          const absl::Time until = absl::Now() + absl::Milliseconds(ms);
          while (absl::Now() < until) {
            if (ctx.IsCancelled()) {
              g_cancelled.fetch_add(1);
              out.Append("cancelled");
              return absl::OkStatus();
            }
            absl::SleepFor(absl::Milliseconds(1));
          }
          out.Append("done");
          return absl::OkStatus();
        },
        swirl::MethodOptions{swirl::Execution::kThreadPool, false});
    AddRawMethod(
        "Gate",
        [](swirl::ServerContext& ctx, absl::string_view, swirl::ResponseWriter&) {
          WaitAtGate(ctx);
          return absl::OkStatus();
        },
        swirl::MethodOptions{swirl::Execution::kThreadPool, /*one_way=*/true});
    AddRawMethod(
        "GateSum",
        [](swirl::ServerContext& ctx, absl::string_view, swirl::ResponseWriter& out) {
          WaitAtGate(ctx);
          return SumAttachment(ctx, out);
        },
        swirl::MethodOptions{swirl::Execution::kThreadPool, false});
    AddRawMethod("OpenGate", [](swirl::ServerContext&, absl::string_view, swirl::ResponseWriter&) {
      g_gate_open.store(true);
      return absl::OkStatus();
    });
    AddRawMethod("CloseGate", [](swirl::ServerContext&, absl::string_view, swirl::ResponseWriter&) {
      g_gate_open.store(false);
      return absl::OkStatus();
    });
    AddRawMethod("GatePassed", [](swirl::ServerContext&, absl::string_view,
                                  swirl::ResponseWriter& out) {
      out.Append(std::to_string(g_gate_passed.load()));
      return absl::OkStatus();
    });
    AddRawMethod("GateEntered", [](swirl::ServerContext&, absl::string_view,
                                   swirl::ResponseWriter& out) {
      out.Append(std::to_string(g_gate_entered.load()));
      return absl::OkStatus();
    });
    AddRawMethod("Cancelled", [](swirl::ServerContext&, absl::string_view,
                                 swirl::ResponseWriter& out) {
      out.Append(std::to_string(g_cancelled.load()));
      return absl::OkStatus();
    });
    AddRawMethod("Fail", [](swirl::ServerContext&, absl::string_view in, swirl::ResponseWriter&) {
      int code = 2;
      (void)absl::SimpleAtoi(in, &code);
      return absl::Status(static_cast<absl::StatusCode>(code), "failed as asked");
    });
    AddRawMethod(
        "CallBack",
        [](swirl::ServerContext& ctx, absl::string_view in, swirl::ResponseWriter& out) {
          std::string answer;
          absl::Status s = swirl::CallRaw(*ctx.caller(),
                                          swirl::rpc_wire::MethodId("/test.Client/Ping"), in,
                                          &answer, swirl::CallOptions{absl::Seconds(5)});
          if (!s.ok()) return s;
          out.Append(answer);
          return absl::OkStatus();
        },
        swirl::MethodOptions{swirl::Execution::kThreadPool, false});
    AddRawMethod("NotifyBack", [](swirl::ServerContext& ctx, absl::string_view in,
                                  swirl::ResponseWriter& out) {
      int n = 0;
      if (!absl::SimpleAtoi(in, &n)) return absl::InvalidArgumentError("NotifyBack wants N");
      std::shared_ptr<swirl::CallTarget> caller = ctx.caller();
      for (int i = 0; i < n; ++i) {
        auto note = std::make_unique<swirl::control::DisconnectRequest>();
        note->set_connection_id(static_cast<uint64_t>(i));
        absl::Status s = swirl::CallOneWay(*caller, swirl::rpc_wire::MethodId("/test.Client/Note"),
                                           std::move(note), {});
        if (!s.ok()) return s;
      }
      out.Append("sent");
      return absl::OkStatus();
    });
    AddRawMethod("Fill", [](swirl::ServerContext& ctx, absl::string_view in,
                            swirl::ResponseWriter& out) {
      size_t n = 0;
      if (auto s = FillAttachment(ctx, in, &n); !s.ok()) return s;
      out.Append("filled");
      return absl::OkStatus();
    });
    AddRawMethod(
        "SlowFill",
        [](swirl::ServerContext& ctx, absl::string_view in, swirl::ResponseWriter& out) {
          const size_t space = in.find(' ');
          int ms = 0;
          if (space == absl::string_view::npos || !absl::SimpleAtoi(in.substr(0, space), &ms)) {
            return absl::InvalidArgumentError("SlowFill wants \"<ms> <size>\"");
          }
          absl::SleepFor(absl::Milliseconds(ms));
          size_t n = 0;
          if (auto s = FillAttachment(ctx, in.substr(space + 1), &n); !s.ok()) return s;
          out.Append("filled");
          return absl::OkStatus();
        },
        swirl::MethodOptions{swirl::Execution::kThreadPool, false});
    // The same two on the handler thread pool, whose results take another road to the wire.
    AddRawMethod("PoolEcho", Echo, swirl::MethodOptions{swirl::Execution::kThreadPool, false});
    AddRawMethod(
        "PoolFill",
        [](swirl::ServerContext& ctx, absl::string_view in, swirl::ResponseWriter& out) {
          size_t n = 0;
          if (auto s = FillAttachment(ctx, in, &n); !s.ok()) return s;
          // A message above the eager threshold cannot travel beside an attachment.
          out.Append(n % 2 == 1 ? std::string(10000, 'm') : std::string("filled"));
          return absl::OkStatus();
        },
        swirl::MethodOptions{swirl::Execution::kThreadPool, false});
    AddRawMethod("Sum", [](swirl::ServerContext& ctx, absl::string_view,
                           swirl::ResponseWriter& out) { return SumAttachment(ctx, out); });
    AddRawMethod("LastSum", [](swirl::ServerContext&, absl::string_view,
                               swirl::ResponseWriter& out) {
      swirl::MutexLock lock(&g_last_sum_mu);
      out.Append(g_last_sum);
      return absl::OkStatus();
    });
    AddRawMethod("BulkEcho", [](swirl::ServerContext& ctx, absl::string_view eager,
                                swirl::ResponseWriter& out) {
      swirl::BulkBuffer* in = ctx.request_bulk();
      if (in != nullptr) {
        auto bulk = ctx.AllocateResponseBulk(in->size());
        if (!bulk.ok()) return bulk.status();
        std::memcpy((*bulk)->data(), in->data(), in->size());
        (*bulk)->resize(in->size());
      }
      out.Append(eager);
      return absl::OkStatus();
    });
    AddRawMethod("Whoami", [](swirl::ServerContext& ctx, absl::string_view,
                              swirl::ResponseWriter& out) {
      out.Append(ctx.principal());
      return absl::OkStatus();
    });
    AddRawMethod("Stats", [](swirl::ServerContext&, absl::string_view,
                             swirl::ResponseWriter& out) {
      const auto s = g_server->Stats().server;
      out.Append(absl::StrCat(s.windows_outstanding, " ", s.windows_remote_invalidated, " ",
                              s.windows_locally_invalidated, " ", s.windows_lease_expired,
                              " ", s.invalidation_violations));
      return absl::OkStatus();
    });
  }
};

}  // namespace

int main(int argc, char** argv) {
  swirl::StopSignals stop_signals;  // before any thread starts: none is lost, none kills us
  absl::ParseCommandLine(argc, argv);
  // Read when the process first opens a soft device, below; no other thread runs yet.
  if (const std::string faults = absl::GetFlag(FLAGS_soft_faults); !faults.empty()) {
    setenv("SWIRL_SOFT_FAULTS", faults.c_str(), 1);
  }
  swirl::ServerOptions options;
  options.address = absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_port));
  // Tests that ask for another address (netns_test's private veth link between two
  // namespaces, principals_test's "[::]") are tests: plaintext is allowed there.
  options.allow_insecure_non_loopback = absl::GetFlag(FLAGS_host) != "127.0.0.1";
  options.auth_token = absl::GetFlag(FLAGS_token);
  for (const std::string& entry : absl::GetFlag(FLAGS_principals)) {
    std::vector<std::string> parts = absl::StrSplit(entry, ':');
    if (parts.size() < 2) return 2;
    swirl::Principal p{.name = parts[0], .token = parts[1]};
    for (size_t i = 2; i < parts.size(); ++i) {
      if (parts[i] == "admin") {
        p.admin = true;
      } else if (!absl::SimpleAtoi(parts[i], &p.max_connections)) {
        return 2;
      }
    }
    options.principals.push_back(std::move(p));
  }
  options.max_connections = static_cast<uint32_t>(absl::GetFlag(FLAGS_max_connections));
  options.max_connections_per_client = absl::GetFlag(FLAGS_max_per_client);
  options.worker_cores.assign(static_cast<size_t>(absl::GetFlag(FLAGS_workers)), -1);
  options.transport.keepalive = absl::Milliseconds(absl::GetFlag(FLAGS_keepalive_ms));
  options.setup_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_setup_timeout_ms));
  options.transport.credits = static_cast<uint32_t>(absl::GetFlag(FLAGS_credits));
  options.max_bulk_size = static_cast<size_t>(absl::GetFlag(FLAGS_max_bulk_size));
  options.transport.window_lease = absl::Milliseconds(absl::GetFlag(FLAGS_window_lease_ms));
  options.transport.ack_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_ack_timeout_ms));
  options.download_bytes_per_connection = static_cast<size_t>(absl::GetFlag(FLAGS_download_bytes));
  options.grant_bytes_per_connection = static_cast<size_t>(absl::GetFlag(FLAGS_grant_bytes));
  options.bulk_bytes_per_client = static_cast<size_t>(absl::GetFlag(FLAGS_bulk_bytes_per_client));
  options.max_windows_per_client =
      static_cast<uint32_t>(absl::GetFlag(FLAGS_max_windows_per_client));
  options.mirror_bytes_per_connection = static_cast<size_t>(absl::GetFlag(FLAGS_mirror_bytes));
  options.mirror_reads_per_connection = static_cast<uint32_t>(absl::GetFlag(FLAGS_mirror_reads));
  options.fabric_networks = absl::GetFlag(FLAGS_fabric_networks);
  options.transport.bulk_pool_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_bulk_pool_bytes));
  if (absl::GetFlag(FLAGS_no_local_fallback)) {
    options.transport.invalidation = swirl::InvalidationPolicy::kRequireRemote;
  }
  if (absl::GetFlag(FLAGS_local_invalidation_only)) {
    options.transport.invalidation = swirl::InvalidationPolicy::kLocalOnly;
  }
  E2E service;
  swirl::Server server(options);
  g_server = &server;
  if (!server.RegisterService(&service).ok() || !server.Start().ok()) return 1;
  {
    const std::string path = absl::GetFlag(FLAGS_port_file);
    std::ofstream(path + ".tmp") << server.port() << "\n";
    std::rename((path + ".tmp").c_str(), path.c_str());
  }
  stop_signals.Wait();
  server.Shutdown(absl::Milliseconds(absl::GetFlag(FLAGS_shutdown_ms)));
  return 0;
}
