// swirl::Server: offers services to clients over RC queue pairs, set up through a gRPC control
// plane (proto/control.proto).
//
//   swirl::ServerOptions options;
//   options.address = "0.0.0.0:7100";
//   options.auth_token = "s3cret";
//   options.worker_cores = {1};
//   swirl::Server server(options);
//   MyEchoService echo;                 // generated base class, or raw methods
//   server.RegisterService(&echo);
//   if (auto s = server.Start(); !s.ok()) ...
//   ...
//   server.Shutdown(absl::Seconds(5));  // drains in-flight calls, bulk transfers included
//
// Connection setup: a client calls Control.Connect with its QP address and capabilities. The
// server checks the token and the protocol version and its limits, *then* creates a QP on the
// least loaded worker, moves it to RTS and answers with its own address. Refused clients cost
// nothing but the gRPC call.

#ifndef SWIRL_RPC_SERVER_H_
#define SWIRL_RPC_SERVER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "swirl/service.h"
#include "swirl/stats.h"
#include "swirl/transport_options.h"

namespace swirl {

// A server's transport defaults: those of TransportOptions, with a larger bulk pool (each
// worker's is shared by all of its clients).
inline TransportOptions DefaultServerTransport() {
  TransportOptions transport;
  transport.bulk_pool_bytes = 128 << 20;
  return transport;
}

// A tenant of a Server: who a credential names. Handlers see it (ServerContext::principal()),
// the per-client limits count by it, and Stats shows it only its own connections unless it is
// an admin.
struct Principal {
  // Non-empty and unique among a server's principals ("default" is taken when auth_token is
  // set: that token names it).
  std::string name;
  // Clients present it as "authorization: Bearer <token>" (compared in constant time; never
  // logged). Empty: the principal is not named by a token.
  std::string token;
  // A client certificate's identity (its subject alternative names, else its common name, as
  // verified against ServerOptions::tls_client_ca_file) that names this principal. Empty: not
  // named by a certificate. A principal with both is named only when both match. No two
  // principals share a token or an identity, and credentials that match two principals (one's
  // certificate, another's token) are refused.
  std::string tls_identity;
  // Stats shows an admin every connection; anyone else only the connections of its own
  // principal (the server's totals, counts without ids or names, go to everyone).
  bool admin = false;
  // Its connections at most (0: ServerOptions::max_connections_per_client).
  uint32_t max_connections = 0;
};

struct ServerOptions {
  // gRPC listen address for the control plane ("host:port"; port 0 picks one, see port()).
  std::string address = "0.0.0.0:0";
  // Clients must send "authorization: Bearer <token>" metadata. Empty: no authentication
  // (unless `principals` are given). The same as a principal {"default", auth_token, admin}.
  std::string auth_token;
  // Tenants, each named by its credentials: a client must present those of exactly one of them
  // (or auth_token). Neither principals nor auth_token: no authentication, every client is the
  // anonymous principal "" (sees every connection; limits count by client address).
  std::vector<Principal> principals;
  // TLS for the control plane (PEM file paths). Both empty: plaintext.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Mutual TLS (with tls_cert_file): clients must present a certificate signed by this CA (PEM
  // file). Its identity can name a principal (Principal::tls_identity).
  std::string tls_client_ca_file;
  // Start refuses to listen beyond loopback (any address but a literal loopback one, a Unix
  // socket or "localhost"; 0.0.0.0 and [::] included) with neither auth_token, principals nor
  // TLS: anyone who could reach the port could use every service. True accepts that.
  bool allow_insecure_non_loopback = false;
  // Where clients' QPs may be besides the address each calls from ("10.1.0.0/16", IPv4): a
  // client whose GID names another address (the soft TCP fabric's, RoCE v2's IPv4-mapped
  // GIDs) is refused, so that no client makes the server connect to a third host.
  std::vector<std::string> fabric_networks;

  // The RDMA side of every connection (device, GID, credits, buffers, bulk pool, invalidation,
  // keepalive, window lease; swirl/transport_options.h). The bulk pool is per worker.
  TransportOptions transport = DefaultServerTransport();
  // One worker thread per entry, pinned to that core (-1: not pinned).
  std::vector<int> worker_cores = {-1};
  // Busy-poll, then sleep on the completion channel after this much idleness (0: never sleep).
  absl::Duration idle_spin = absl::Microseconds(200);
  // While spinning, give the core to other threads between polls (sched_yield) after this much
  // idleness, so that a worker sharing its core does not delay the threads it serves (gRPC's,
  // the handlers', connection setup: docs/RELIABILITY.md "Scale"). A message arriving during a
  // yield waits it out: a system call where nothing else wants the core, up to a scheduler time
  // slice where something does. Unset: 20 us for a worker not pinned to a core, never for a
  // pinned one. InfiniteDuration: never.
  std::optional<absl::Duration> idle_yield_after;
  int handler_threads = 4;  // pool for Execution::kThreadPool methods

  uint32_t max_connections = 256;             // in total
  // Per client: per principal where clients authenticate (from however many addresses), else
  // per client address (IPv6 addresses by their /64: one host has a whole /64 to choose from).
  uint32_t max_connections_per_client = 64;
  // A connection whose client sends nothing this long after Connect answered fails, keepalive
  // or not: a client that never completes its side (or gave up on Connect before learning the
  // connection's id) does not hold a connection slot for longer. swirl's channels send a ping
  // as soon as they are connected. Zero: no limit.
  absl::Duration setup_timeout = absl::Seconds(10);

  // Bulk transfers (docs/BULK.md). Payloads above eager_threshold move by RDMA through a
  // memory window made for that one request.
  uint32_t eager_threshold = 2048;
  uint32_t window_credits = 8;           // upload windows granted ahead of need, per size class
                                         // per connection (within grant_bytes_per_connection)
  size_t grant_bytes_per_connection = 32 << 20;  // pool memory one peer may hold in grants
  // ... and in downloads it has not acknowledged yet (beyond: RESOURCE_EXHAUSTED responses).
  size_t download_bytes_per_connection = 64 << 20;
  // Both of those together (and what its queued blocking handlers hold) for all of one client's
  // connections on a worker (clients counted by principal or address, as
  // max_connections_per_client does).
  // 0: half of transport.bulk_pool_bytes, so that no one client can take every other client's
  // bulk memory, or what one connection may hold if that is more (a single connection is
  // limited by the two caps above alone).
  size_t bulk_bytes_per_client = 0;
  // Memory windows all of one client's connections on a worker may have allocated (clients
  // counted as above). A window is a device object (65,536 per process on the soft device, a
  // NIC's max_mw), and each connection keeps the windows it allocated, bound or not, for reuse
  // until it closes, so this bounds what one client can take from everyone else. Beyond it a
  // download is refused with RESOURCE_EXHAUSTED, and so is an upload for which no window is
  // left to grant (while the connection holds none of that size: else it waits for one). 0: no
  // limit but each connection's own (two per call in flight, plus window_credits per size
  // class).
  uint32_t max_windows_per_client = 2048;
  // Mirror mode (the client exposes): the server's buffers for its RDMA READs of a connection's
  // requests and for replies it is writing into the connection's windows count against this
  // (and against bulk_bytes_per_client), and at most mirror_reads_per_connection READs are
  // under way at once, so that a client choosing mirror mode cannot take the pool with a few
  // large requests. A request beyond them waits, holding no pool memory, until one of its
  // connection's READs completes; it is refused with RESOURCE_EXHAUSTED if none is under way
  // or mirror_reads_per_connection requests already wait. A reply beyond the bytes is refused
  // the same way.
  size_t mirror_bytes_per_connection = 32 << 20;
  uint32_t mirror_reads_per_connection = 16;
  size_t max_bulk_size = 16 << 20;       // per transfer
};

class Server {
 public:
  explicit Server(ServerOptions options);
  ~Server();  // Shutdown(0) if still running
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Services must outlive the server. Register before Start.
  absl::Status RegisterService(Service* service);

  absl::Status Start();
  // The control-plane port (after Start).
  int port() const;
  // An address a client on this host can dial (after Start): the host the server bound, as a
  // literal, with the port it got; for a wildcard bind (0.0.0.0, [::], empty host) the
  // loopback address of that family. Never a name: a name needs a resolver (and a hosts file)
  // that a minimal system may not have.
  std::string address() const;

  // Stops accepting connections and new requests (refused with UNAVAILABLE), lets requests
  // already received finish until `deadline`: their handlers, their responses, and their bulk
  // transfers (a download the client is still reading, a mirror-mode request still being
  // read, a fallback-mode upload still being revoked). Then closes every connection. Blocking handlers
  // still running then see ServerContext::IsCancelled() and are waited for; queued ones that
  // never started are dropped.
  void Shutdown(absl::Duration deadline = absl::Seconds(5));

  // Its totals and every connection (what the control plane's Stats answers).
  StatsReport Stats() const;
  // What the device can do (probed at Start, self-test included).
  DeviceInfo capabilities() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace swirl

#endif  // SWIRL_RPC_SERVER_H_
