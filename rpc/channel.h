// swirl::Channel: a client's connection to a swirl::Server (one RC queue pair), set up through
// the server's gRPC control plane.
//
//   swirl::ChannelOptions options;
//   options.auth_token = "s3cret";
//   auto channel = swirl::Channel::Create("localhost:7100", options);
//   EchoStub stub(*channel);
//   EchoResponse resp;
//   absl::Status s = stub.Echo(req, &resp);
//
// Connectivity (as gRPC's channels): a channel whose connection is lost (the server died or
// restarted, the link failed, keepalives went unanswered) reconnects by itself, with
// exponential backoff and jitter (ReconnectOptions; gRPC's defaults), negotiating again. Calls
// in flight when the connection fails complete with UNAVAILABLE (never hang, never run twice:
// swirl does not retry a call). Calls started while it is down fail at once with UNAVAILABLE,
// unless CallOptions::wait_for_ready asks them to wait for a connection within their deadline.
// Bulk buffers (AllocateBulk) and stubs stay valid across a reconnect. A reconnect is never
// silently weaker: a new negotiation that settles on a weaker invalidation mode is logged as a
// WARNING and shown in negotiated() and LocalStats(), and InvalidationPolicy::kRequireRemote
// refuses it (the channel stays in kTransientFailure, last_error() says why, and keeps trying).
// Channel::Create itself fails if the first connection cannot be made.
//
// Threads: a Channel is thread-safe (Close() included: calls started during or after it fail
// with UNAVAILABLE); share one between threads or make one per thread.
//   * Driver::kBackgroundThread (default): a worker thread polls the channel's completion queue;
//     calls from any thread are handed to it through a lock-free queue and callbacks run on it.
//     That worker is a ClientRuntime's (swirl/client_runtime.h): the one in `runtime`, or the
//     process default for the channel's transport options and worker_core, which channels share
//     only if all of those are equal; `dedicated_worker`: one of its own.
//   * Driver::kCaller: no thread; a thread waiting for a call drives the connection itself, and
//     a thread starting a call posts it directly when nobody else is driving. Lowest latency
//     with one thread per channel; callbacks run on whichever thread drives.

#ifndef SWIRL_RPC_CHANNEL_H_
#define SWIRL_RPC_CHANNEL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "swirl/bulk.h"
#include "swirl/call.h"
#include "swirl/client_runtime.h"
#include "swirl/service.h"
#include "swirl/stats.h"
#include "swirl/transport_options.h"

namespace swirl {

// A channel's connectivity state, as gRPC's (grpc_connectivity_state).
enum class ConnectivityState {
  kConnecting,        // a connection attempt is under way
  kReady,             // connected: calls go out
  kTransientFailure,  // the connection was lost or an attempt failed; another is due
  kShutdown,          // closed (Close() or the destructor): final
};
const char* ConnectivityStateName(ConnectivityState state);

// How a channel reconnects (gRPC's connection-backoff algorithm and defaults): the first
// attempt right after the connection is lost, then waits of initial_backoff, growing by
// `multiplier` after each failed attempt up to max_backoff, each wait randomized by +-jitter.
struct ReconnectOptions {
  bool enabled = true;  // false: a lost connection leaves the channel failed for good
  absl::Duration initial_backoff = absl::Seconds(1);
  double multiplier = 1.6;
  double jitter = 0.2;
  absl::Duration max_backoff = absl::Seconds(120);
};

struct ChannelOptions {
  std::string auth_token;
  std::string client_name;
  // TLS for the control plane: the PEM root certificate file; empty: plaintext.
  std::string tls_root_cert_file;
  std::string tls_target_name;  // override the name checked in the server certificate
  // Mutual TLS (with tls_root_cert_file): this channel's certificate and key (PEM files), for a
  // server that asks for one (ServerOptions::tls_client_ca_file). Both empty: none.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Create refuses to send auth_token in plaintext (no TLS) to a server beyond loopback, where
  // anyone on the path could read it and use it. True accepts that.
  bool allow_plaintext_token = false;
  // Where the server's QP may be besides the address Connect reached (as ServerOptions's).
  std::vector<std::string> fabric_networks;

  // The RDMA side (device, GID, credits, buffers, bulk pool, invalidation, keepalive, window
  // lease; swirl/transport_options.h). The bulk pool is the worker's.
  TransportOptions transport;
  enum class Driver { kBackgroundThread, kCaller };
  Driver driver = Driver::kBackgroundThread;
  // Background driver: the runtime (worker) to run on; its transport options and worker core
  // apply (leave `transport` and `worker_core` as they are, or equal to the runtime's). Null:
  // ClientRuntime::Shared for this channel's options, or, with dedicated_worker, a runtime
  // of its own.
  std::shared_ptr<ClientRuntime> runtime;
  bool dedicated_worker = false;
  int worker_core = -1;  // pin the worker thread (-1: not pinned)

  // Each connection attempt (the first, and every reconnect) gives up after this long.
  absl::Duration connect_timeout = absl::Seconds(10);
  ReconnectOptions reconnect;

  // Services this side offers to the server (server-to-client calls). Must outlive the channel.
  std::vector<Service*> services;

  // Bulk transfers (docs/BULK.md): who exposes the buffers.
  BulkMode bulk_mode = BulkMode::kServerExposes;
};

class Channel : public CallTarget {
 public:
  static absl::StatusOr<std::shared_ptr<Channel>> Create(const std::string& address,
                                                         const ChannelOptions& options = {});
  ~Channel() override;

  void Start(ClientCall* call) override;

  // Caller-driven channels: makes progress once without waiting (completions, callbacks), for
  // a thread that keeps many asynchronous calls in flight. Returns true if anything happened.
  // A no-op returning false on background-driven channels.
  bool Poll();

  // What the current (or last) connection's handshake settled on.
  NegotiatedSettings negotiated() const;
  // The server's id of the current (or last) connection.
  uint64_t connection_id() const;
  // state() == kReady.
  bool connected() const;

  ConnectivityState state() const;
  // Waits until the state differs from `from`, or `deadline`; true if it changed.
  bool WaitForStateChange(ConnectivityState from, absl::Time deadline);
  // Waits until kReady (true), or kShutdown or `deadline` (false).
  bool WaitForReady(absl::Time deadline);
  // Why the last connection was lost or the last attempt failed (OK if neither happened).
  absl::Status last_error() const;
  // Connections made after the first one.
  uint64_t reconnects() const;

  // The server's view, through the control plane. A connection appears in it once the
  // server's worker has activated it, which may be just after the client's Connect returned.
  absl::StatusOr<StatsReport> ServerStats();
  // This side's view of the connection (counters, bulk window accounting).
  ConnectionStats LocalStats() const;

  // Registered memory for zero-copy bulk payloads on this channel.
  absl::StatusOr<BulkBuffer> AllocateBulk(size_t size);

  // The runtime this channel runs on (a caller-driven or dedicated_worker channel's own).
  const std::shared_ptr<ClientRuntime>& runtime() const;

  // Disconnects now (also done by the destructor). Pending calls fail with UNAVAILABLE.
  void Close();

  class Impl;

 private:
  explicit Channel(std::unique_ptr<Impl> impl);
  void StartWhileDown(ClientCall* call);  // Start's slow path: no connection
  std::unique_ptr<Impl> impl_;
};

}  // namespace swirl

#endif  // SWIRL_RPC_CHANNEL_H_
