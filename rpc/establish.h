// Internal: what a Server and a Channel both do to set up connections, written once so that a
// new transport setting or setup step is added in one place: TransportOptions turned into a
// worker's options and the handshake's local configuration, the device opened and probed, a
// connection taken from QP creation to active (EstablishConnection), the log lines that say what
// was negotiated, and the per-connection counters both report.

#ifndef SWIRL_RPC_ESTABLISH_H_
#define SWIRL_RPC_ESTABLISH_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/control.pb.h"
#include "rpc/handshake.h"
#include "rpc/worker.h"
#include "swirl/transport_options.h"
#include "transport/verbs/capabilities.h"
#include "transport/verbs/verbs.h"

namespace swirl::internal {

// The worker settings `transport` gives (credits, buffers, keepalive, bulk pool, lease); each
// side adds its own (name, core, thread, connection count, server limits, callbacks).
WorkerOptions WorkerOptionsFor(const TransportOptions& transport);

// TransportOptions::ack_timeout as a QP's `timeout` attribute: the smallest n with 4.096 us x
// 2^n >= ack_timeout (at most 31), and 0 (no timer) for zero or less.
uint8_t AckTimeoutExponent(absl::Duration ack_timeout);

// What a side offers in the handshake, from `transport` and its device's `caps`; each side adds
// its own (a server's bulk limits, a client's bulk mode and pool).
LocalConfig LocalConfigFor(const TransportOptions& transport, const verbs::Capabilities& caps);

// `caps` as a side declares them to its peer and negotiates with: without remote invalidation
// under InvalidationPolicy::kLocalOnly.
verbs::Capabilities DeclaredCapabilities(const verbs::Capabilities& caps,
                                         InvalidationPolicy policy);

// The device a side runs on: opened, probed (with the remote-invalidation self-test, on
// transport.port and gid_index) and with a protection domain.
struct OpenedDevice {
  std::shared_ptr<verbs::Context> context;
  std::shared_ptr<verbs::ProtectionDomain> pd;
  verbs::Capabilities caps;
};
enum class Probe {
  kFresh,             // probe now (a server, at Start)
  kOncePerProcess,    // once per device, port and GID per process (channels); a self-test that
                      // could not run (port down) is tried again next time
};
absl::StatusOr<OpenedDevice> OpenTransport(const TransportOptions& transport, Probe probe);

// What the peer answered in the handshake: its QP's address, the settings agreed, and the id
// both sides know the connection by.
struct PeerAnswer {
  verbs::PeerAddress address;
  control::Negotiated negotiated;
  uint64_t connection_id = 0;
  // The connection's link key (kLinkKeyBytes; ConnectResponse.link_key), or empty for a link
  // as unauthenticated as RoCE's (a device on either side without link keys).
  std::string link_key;
};
// Our QP, as the exchange offers it: its address, and whether it takes a link key.
struct LocalQp {
  verbs::PeerAddress address;
  bool link_keys = false;
  verbs::Context* device = nullptr;  // our QP's device, to ask about the peer's GID
  uint32_t initial_credits = 0;      // what our worker grants the peer at first (admission)
};

// Whether a peer's QP at `gid` is where the peer called from (`grpc_peer`) or in one of
// `networks` (CheckPeerAddress), as far as `device` can tell what address the GID names: OK
// for a GID that names none (a fabric within this host, InfiniBand).
absl::Status CheckPeerFabricAddress(verbs::Context& device, const ibv_gid& gid,
                                    absl::string_view grpc_peer,
                                    const std::vector<Ipv4Network>& networks);
// Gets the peer's answer for our QP `local`: a server has it already (and puts `local` in its
// ConnectResponse, with a new link key if both QPs take one); a client asks the server.
using Exchange = absl::FunctionRef<absl::StatusOr<PeerAnswer>(const LocalQp& local)>;

struct ConnectionSetup {
  Worker* worker = nullptr;
  uint64_t id = 0;  // the worker's id for the connection
  const MethodTable* methods = nullptr;
  const TransportOptions* transport = nullptr;
  bool is_server = false;
  std::string peer;         // the other side's address, for logs and Stats
  std::string client_name;  // as the client gave it (untrusted on a server: logged escaped)
  std::string principal;    // server side: who the client authenticated as ("" if no one)
  // Connection::set_on_lost's observer, set before the connection is activated (a channel's
  // reconnector).
  std::function<void(const absl::Status&)> on_lost;
};

// Takes a connection from QP creation to active: creates its QP on setup.worker, passes its
// address to `exchange`, hands the answer's link key to the QP, connects the QP to the
// answer's (RTR, RTS), configures the connection
// with what was negotiated, activates it, and logs the outcome (a fallback in force as a
// WARNING). On failure the connection is abandoned and the error returned.
absl::StatusOr<std::shared_ptr<Connection>> EstablishConnection(const ConnectionSetup& setup,
                                                                Exchange exchange);

// A file's contents (the control plane's TLS PEM files), or NOT_FOUND naming it.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// A connection's counters, as both sides report them (Server::Stats, Channel::LocalStats).
void CopyCounters(const ConnectionCounters& counters, control::ConnectionStats* out);

}  // namespace swirl::internal

#endif  // SWIRL_RPC_ESTABLISH_H_
