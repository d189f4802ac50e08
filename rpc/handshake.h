// Internal: the connection handshake's pure logic, kept apart from gRPC and verbs so it can be
// tested on its own. Everything that arrives from the other side is validated here.

#ifndef SWIRL_RPC_HANDSHAKE_H_
#define SWIRL_RPC_HANDSHAKE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/control.pb.h"
#include "transport/verbs/capabilities.h"
#include "transport/verbs/verbs.h"

namespace swirl::internal {

// 3: Disconnect needs the ConnectResponse's disconnect_secret, and clients ping once connected
// (ServerOptions::setup_timeout). A version-2 client would be refused every Disconnect.
// 4: credits are granted as traffic needs them (Negotiated.*_initial_credits): a version-3
// peer would take the whole grant as its own at once and send beyond what it holds.
inline constexpr uint32_t kControlProtocolVersion = 4;
inline constexpr uint32_t kMinCredits = 4;
inline constexpr uint32_t kMaxCredits = 4096;
// A client's name is kept per connection and shown in Stats and logs: bounded.
inline constexpr size_t kMaxClientName = 256;

// `name` (from a peer) as it may appear in a log line: at most 64 bytes, escaped, so that a
// peer can neither flood the log nor forge lines in it.
std::string LoggableName(absl::string_view name);
inline constexpr uint32_t kMinMessage = 64;
// The largest bulk transfer either side may negotiate: bulk descriptors' lengths are 32-bit,
// and the pool's size classes up to it stay within them.
inline constexpr uint64_t kMaxBulkSize = uint64_t{1} << 31;
// The eager threshold a client may negotiate down to (unless the server's own is lower).
inline constexpr uint32_t kMinEagerThreshold = 256;

struct LocalConfig {
  uint32_t credits = 32;        // receive buffers we may grant the peer (its ceiling)
  uint32_t initial_credits = 0;  // of them, what the peer holds at first (0: all)
  uint32_t buffer_size = 4128;  // per receive buffer, header included
  uint32_t max_inline = 0;      // our QP's inline limit
  uint32_t eager_threshold = 2048;
  uint32_t window_credits = 8;
  bool require_remote_invalidation = false;
  bool allow_local_fallback = true;
  control::BulkMode bulk_mode = control::BULK_SERVER_EXPOSES;  // client: requested
  uint64_t max_bulk_size = 0;                                   // 0: no bulk pool
  bool link_keys = false;  // our QPs take a link key (verbs::QueuePair::SetLinkKey)
};

control::Capabilities DescribeLocal(const verbs::Capabilities& caps, const LocalConfig& config);

control::QueuePairAddress ToProto(const verbs::PeerAddress& address);
absl::StatusOr<verbs::PeerAddress> FromProto(const control::QueuePairAddress& address);

// Whether the server's device can link to a client QP at `client_gid` (a device of the same
// kind): OK, or why not. The device answers (verbs::Context::CheckReachable): the handshake
// knows no device's fabrics.
using ReachabilityCheck = absl::FunctionRef<absl::Status(const ibv_gid& client_gid)>;

// Server side: what to agree to, or why not (FAILED_PRECONDITION for an incompatible client,
// INVALID_ARGUMENT for nonsense).
absl::StatusOr<control::Negotiated> Negotiate(const control::ConnectRequest& request,
                                              const verbs::Capabilities& server_caps,
                                              const LocalConfig& server,
                                              ReachabilityCheck reachable);

// Client side: checks the server's answer against what we offered.
absl::Status CheckNegotiated(const control::Negotiated& negotiated, const LocalConfig& client,
                             const verbs::Capabilities& client_caps);

// Client side: the link key of the server's answer, given whether we declared link keys: empty
// when either side takes none; INVALID_ARGUMENT for a key of another size, or one we did not
// declare we take; FAILED_PRECONDITION when both declared link keys and the server sent none
// (the link would be unauthenticated though both ends could bind it).
absl::StatusOr<std::string> CheckLinkKey(const control::ConnectResponse& response,
                                         bool we_take_keys);

// "authorization: Bearer <token>", compared in constant time.
bool TokenMatches(absl::string_view presented_header, absl::string_view token);

// A connection's disconnect secret: 16 bytes from the kernel's random source.
std::string NewDisconnectSecret();
// A connection's link key (ConnectResponse.link_key): kLinkKeyBytes from the same source.
inline constexpr size_t kLinkKeyBytes = 32;
std::string NewLinkKey();
// Whether `presented` is `secret` (never true for an empty secret), in time that depends only on
// the length presented. TokenMatches is this with "Bearer <token>".
bool SecretMatches(absl::string_view presented, absl::string_view secret);

// The client identity address-keyed limits are counted by: the peer address without its port;
// an IPv6 address by its /64 ("ipv6:[2001:db8:1:2::]/64"), since a host is commonly given a
// whole /64 and can take any address in it (an IPv4-mapped one counts as its IPv4 address).
std::string ClientKey(absl::string_view grpc_peer);
// What per-client limits count by: the principal where the client authenticated as one, else
// ClientKey(grpc_peer). The two never collide ("principal:<name>" is no address).
std::string LimitKey(absl::string_view principal, absl::string_view grpc_peer);

// What Server::address() returns for a server listening on `listen_address` ("host:port",
// "[v6]:port") that got `port`: that host with `port`, or for a wildcard host (empty, 0.0.0.0,
// [::]) the loopback literal of its family.
std::string DialableAddress(absl::string_view listen_address, int port);

// An IPv4 network a side's options allow peers' fabric addresses in ("10.1.0.0/16").
struct Ipv4Network {
  uint32_t base = 0;  // host order, masked
  uint32_t mask = 0;
};
// ServerOptions/ChannelOptions::fabric_networks parsed; INVALID_ARGUMENT naming a bad entry.
absl::StatusOr<std::vector<Ipv4Network>> ParseFabricNetworks(
    const std::vector<std::string>& cidrs);
// Whether a peer whose GID sends our links to `gid_address` (dotted IPv4, as the device reads
// the GID: verbs::Context::GidAddress) is where it called from: `grpc_peer`'s address (as
// grpc::ServerContext::peer() or ClientContext::peer() give it: "ipv4:a.b.c.d:port",
// "ipv6:[::ffff:a.b.c.d]:port") or in one of `networks`. OK, or PERMISSION_DENIED saying
// both: else a peer could make this side open connections to any host and port it names.
absl::Status CheckPeerAddress(absl::string_view gid_address, absl::string_view grpc_peer,
                              const std::vector<Ipv4Network>& networks);

// Whether gRPC address `address` ("host:port", "[v6]:port", "ipv4:"/"ipv6:"/"dns:///"
// forms, "unix:...") stays on this host: a Unix socket, "localhost", or a literal loopback
// address. A wildcard (empty host, 0.0.0.0, [::]) and every other name are beyond loopback.
bool IsLoopbackOnly(absl::string_view address);

}  // namespace swirl::internal

#endif  // SWIRL_RPC_HANDSHAKE_H_
