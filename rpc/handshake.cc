#include "rpc/handshake.h"

#include <arpa/inet.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "absl/random/random.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "rpc/wire.h"

namespace swirl::internal {

control::Capabilities DescribeLocal(const verbs::Capabilities& caps, const LocalConfig& config) {
  control::Capabilities out;
  out.set_device_name(caps.device);
  out.set_device_kind(verbs::DeviceKindName(caps.kind));
  out.set_remote_invalidation(caps.remote_invalidation());
  out.set_mw_type2(caps.mw_type2a || caps.mw_type2b);
  out.set_max_inline(config.max_inline);
  out.set_recv_credits(config.credits);
  out.set_initial_credits(config.initial_credits);
  out.set_recv_buffer_size(config.buffer_size);
  out.set_max_message_size(config.buffer_size - sizeof(rpc_wire::MessageHeader));
  out.set_eager_threshold(config.eager_threshold);
  out.set_window_credits(config.window_credits);
  out.set_require_remote_invalidation(config.require_remote_invalidation);
  out.set_bulk_mode(config.bulk_mode);
  out.set_max_bulk_size(config.max_bulk_size);
  out.set_link_keys(config.link_keys);
  return out;
}

control::QueuePairAddress ToProto(const verbs::PeerAddress& address) {
  control::QueuePairAddress out;
  out.set_gid(std::string(reinterpret_cast<const char*>(address.gid.raw), sizeof(address.gid.raw)));
  out.set_lid(address.lid);
  out.set_qp_num(address.qp_num);
  out.set_psn(address.psn);
  out.set_mtu(address.mtu);
  return out;
}

absl::StatusOr<verbs::PeerAddress> FromProto(const control::QueuePairAddress& address) {
  verbs::PeerAddress out;
  if (address.gid().size() != sizeof(out.gid.raw)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GID of %u bytes (16 expected)", address.gid().size()));
  }
  if (address.qp_num() == 0 || address.qp_num() > 0xffffff || address.psn() > 0xffffff ||
      address.lid() > 0xffff || address.mtu() < IBV_MTU_256 || address.mtu() > IBV_MTU_4096) {
    return absl::InvalidArgumentError("queue pair address out of range");
  }
  std::memcpy(out.gid.raw, address.gid().data(), sizeof(out.gid.raw));
  out.lid = static_cast<uint16_t>(address.lid());
  out.qp_num = address.qp_num();
  out.psn = address.psn();
  out.mtu = static_cast<ibv_mtu>(address.mtu());
  return out;
}

std::string LoggableName(absl::string_view name) {
  constexpr size_t kShown = 64;
  std::string out = absl::CHexEscape(name.substr(0, kShown));
  if (name.size() > kShown) absl::StrAppend(&out, "...(", name.size(), " bytes)");
  return out;
}

absl::StatusOr<control::Negotiated> Negotiate(const control::ConnectRequest& request,
                                              const verbs::Capabilities& server_caps,
                                              const LocalConfig& server,
                                              ReachabilityCheck reachable) {
  if (request.protocol_version() != kControlProtocolVersion) {
    return absl::FailedPreconditionError(
        absl::StrFormat("client speaks protocol version %u; this server speaks %u",
                        request.protocol_version(), kControlProtocolVersion));
  }
  if (request.client_name().size() > kMaxClientName) {
    return absl::InvalidArgumentError(absl::StrFormat("client name of %u bytes (at most %u)",
                                                      request.client_name().size(),
                                                      kMaxClientName));
  }
  const control::Capabilities& client = request.capabilities();
  // A QP can only reach a peer on the same fabric: a soft device cannot link to a NIC, and
  // the device itself knows what else it cannot link to (a soft device on shared memory to one
  // on TCP). Said now, instead of a link that never forms.
  const std::string server_kind = verbs::DeviceKindName(server_caps.kind);
  if (client.device_kind() != server_kind) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "client's device is %s, this server's is %s: both ends need the same kind of device",
        internal::LoggableName(client.device_kind()), server_kind));
  }
  if (request.address().gid().size() == sizeof(ibv_gid::raw)) {
    ibv_gid client_gid;
    std::memcpy(client_gid.raw, request.address().gid().data(), sizeof(client_gid.raw));
    if (absl::Status s = reachable(client_gid); !s.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "this server's device cannot reach the client's: ", s.message()));
    }
  }
  if (client.recv_credits() < kMinCredits || client.recv_credits() > kMaxCredits) {
    return absl::InvalidArgumentError(absl::StrFormat("client offers %u receive credits (%u..%u)",
                                                      client.recv_credits(), kMinCredits,
                                                      kMaxCredits));
  }
  // What the server holds at first: at least what a call needs with a return kept back (the
  // same floor as the grant itself), at most the grant; 0 is all of it.
  if (client.initial_credits() != 0 &&
      (client.initial_credits() < kMinCredits || client.initial_credits() > client.recv_credits())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "client grants %u initial credits of %u (%u..%u)", client.initial_credits(),
        client.recv_credits(), kMinCredits, client.recv_credits()));
  }
  if (client.max_message_size() < kMinMessage ||
      client.recv_buffer_size() < client.max_message_size() + sizeof(rpc_wire::MessageHeader)) {
    return absl::InvalidArgumentError("client message size and buffer size disagree");
  }
  control::Negotiated n;
  n.set_protocol_version(kControlProtocolVersion);
  n.set_client_credits(server.credits);
  n.set_server_credits(client.recv_credits());
  n.set_server_initial_credits(client.initial_credits());
  // client_initial_credits is the server's worker's to say once it has admitted the connection
  // (Worker::CreateConnection); 0 (all) until then.
  n.set_max_message_size(std::min<uint32_t>(
      client.max_message_size(), server.buffer_size - sizeof(rpc_wire::MessageHeader)));
  n.set_client_max_inline(std::min<uint32_t>(client.max_inline(), 1024));
  n.set_server_max_inline(server.max_inline);
  // A client cannot push the threshold to nothing: every small response would then cost a pool
  // buffer, a window and a lease on the server.
  n.set_eager_threshold(std::max(std::min(server.eager_threshold, client.eager_threshold()),
                                 std::min(server.eager_threshold, kMinEagerThreshold)));
  n.set_window_credits(std::min(server.window_credits, client.window_credits()));

  // Never silently weaker: remote invalidation only when both devices can; otherwise the
  // explicit local fallback if both sides allow it, else a refusal that says who lacks what.
  const bool require = server.require_remote_invalidation || client.require_remote_invalidation();
  auto mode = verbs::SelectInvalidationMode(
      server_caps.remote_invalidation(), client.remote_invalidation(),
      require || !server.allow_local_fallback ? verbs::InvalidationPolicy::kRequireRemote
                                              : verbs::InvalidationPolicy::kAllowLocalFallback);
  if (!mode.ok()) return mode.status();
  n.set_invalidation(*mode == verbs::InvalidationMode::kRemote ? control::INVALIDATION_REMOTE
                                                               : control::INVALIDATION_LOCAL);
  if (!control::BulkMode_IsValid(client.bulk_mode())) {
    return absl::InvalidArgumentError("unknown bulk mode");
  }
  n.set_bulk_mode(client.bulk_mode());
  n.set_max_bulk_size(std::min<uint64_t>({server.max_bulk_size, client.max_bulk_size(),
                                          kMaxBulkSize}));
  if (n.eager_threshold() > n.max_message_size()) n.set_eager_threshold(n.max_message_size());
  return n;
}

absl::Status CheckNegotiated(const control::Negotiated& n, const LocalConfig& client,
                             const verbs::Capabilities& client_caps) {
  if (n.protocol_version() != kControlProtocolVersion) {
    return absl::FailedPreconditionError("server answered with another protocol version");
  }
  if (n.server_credits() != client.credits) {
    return absl::InvalidArgumentError("server claims credits we did not offer");
  }
  if (n.client_credits() < kMinCredits || n.client_credits() > kMaxCredits) {
    return absl::InvalidArgumentError("server grants an invalid number of credits");
  }
  if (n.server_initial_credits() != client.initial_credits) {
    return absl::InvalidArgumentError("server claims initial credits we did not grant");
  }
  if (n.client_initial_credits() != 0 && (n.client_initial_credits() < kMinCredits ||
                                          n.client_initial_credits() > n.client_credits())) {
    return absl::InvalidArgumentError("server grants an invalid number of initial credits");
  }
  if (n.max_message_size() < kMinMessage ||
      n.max_message_size() + sizeof(rpc_wire::MessageHeader) > client.buffer_size) {
    return absl::InvalidArgumentError("server's maximum message size does not fit our buffers");
  }
  if (n.invalidation() == control::INVALIDATION_REMOTE && !client_caps.remote_invalidation()) {
    return absl::FailedPreconditionError(
        "server chose remote invalidation, which this device cannot do");
  }
  if (n.invalidation() == control::INVALIDATION_LOCAL && client.require_remote_invalidation) {
    return absl::FailedPreconditionError(
        "remote invalidation required, but the server offers only the local fallback");
  }
  if (n.invalidation() != control::INVALIDATION_REMOTE &&
      n.invalidation() != control::INVALIDATION_LOCAL) {
    return absl::InvalidArgumentError("server chose no invalidation mode");
  }
  if (n.bulk_mode() != client.bulk_mode) {
    return absl::InvalidArgumentError("server changed the bulk mode we asked for");
  }
  if (n.max_bulk_size() > client.max_bulk_size || n.eager_threshold() > n.max_message_size() ||
      n.window_credits() > kMaxCredits) {
    return absl::InvalidArgumentError("server's bulk parameters are out of range");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> CheckLinkKey(const control::ConnectResponse& response,
                                         bool we_take_keys) {
  const std::string& key = response.link_key();
  if (key.empty()) {
    if (we_take_keys && response.capabilities().link_keys()) {
      return absl::FailedPreconditionError(
          "the server declares link keys but sent none for this connection");
    }
    return std::string();
  }
  if (!we_take_keys) {
    return absl::InvalidArgumentError("the server sent a link key this client did not ask for");
  }
  if (key.size() != kLinkKeyBytes) {
    return absl::InvalidArgumentError(absl::StrFormat("link key of %u bytes (%u expected)",
                                                      key.size(), kLinkKeyBytes));
  }
  return key;
}

bool TokenMatches(absl::string_view presented, absl::string_view token) {
  return SecretMatches(presented, absl::StrCat("Bearer ", token));
}

namespace {

std::string RandomBytes(size_t size) {
  std::string secret(size, '\0');
  size_t got = 0;
  while (got < secret.size()) {
    const ssize_t n = getrandom(secret.data() + got, secret.size() - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (errno != EINTR) {
      // No kernel randomness (a seccomp filter?): Abseil's generator, seeded from the OS.
      absl::BitGen bitgen;
      for (char& c : secret) c = static_cast<char>(absl::Uniform<uint8_t>(bitgen));
      break;
    }
  }
  return secret;
}

}  // namespace

std::string NewDisconnectSecret() { return RandomBytes(16); }

std::string NewLinkKey() { return RandomBytes(kLinkKeyBytes); }

bool SecretMatches(absl::string_view presented, absl::string_view secret) {
  // Constant time in the length of what was presented, so timing tells nothing about the secret.
  unsigned char diff = presented.size() == secret.size() && !secret.empty() ? 0 : 1;
  for (size_t i = 0; i < presented.size(); ++i) {
    diff |= static_cast<unsigned char>(presented[i]) ^
            static_cast<unsigned char>(i < secret.size() ? secret[i] : 0);
  }
  return diff == 0;
}

std::string ClientKey(absl::string_view peer) {
  if (peer.rfind("ipv4:", 0) == 0) {
    size_t colon = peer.rfind(':');
    if (colon != absl::string_view::npos && colon > 5) return std::string(peer.substr(0, colon));
    return std::string(peer);
  }
  // gRPC may write the brackets percent-encoded.
  std::string p = absl::StrReplaceAll(peer, {{"%5B", "["}, {"%5D", "]"}});
  absl::string_view rest = p;
  if (!absl::ConsumePrefix(&rest, "ipv6:")) return std::string(peer);
  absl::string_view host = rest;
  if (size_t close = host.rfind(']'); host.size() >= 2 && host.front() == '[' &&
                                      close != absl::string_view::npos) {
    host = host.substr(1, close - 1);
  }
  host = host.substr(0, host.find('%'));  // a link-local address's zone
  in6_addr a;
  if (inet_pton(AF_INET6, std::string(host).c_str(), &a) != 1) return std::string(peer);
  char text[INET6_ADDRSTRLEN];
  if (IN6_IS_ADDR_V4MAPPED(&a)) {
    inet_ntop(AF_INET, &a.s6_addr[12], text, sizeof(text));
    return absl::StrCat("ipv4:", text);
  }
  // One key for the /64: a client varying the low 64 bits (its interface identifier, which
  // SLAAC privacy addresses change anyway) is still one client.
  std::memset(&a.s6_addr[8], 0, 8);
  inet_ntop(AF_INET6, &a, text, sizeof(text));
  return absl::StrCat("ipv6:[", text, "]/64");
}

std::string LimitKey(absl::string_view principal, absl::string_view grpc_peer) {
  if (!principal.empty()) return absl::StrCat("principal:", principal);
  return ClientKey(grpc_peer);
}

std::string DialableAddress(absl::string_view listen_address, int port) {
  absl::string_view host = listen_address;
  if (size_t colon = host.rfind(':'); colon != absl::string_view::npos &&
                                      host.find(']', colon) == absl::string_view::npos) {
    host = host.substr(0, colon);  // the port (an IPv6 literal keeps its colons inside [])
  }
  if (host.empty() || host == "0.0.0.0") return absl::StrCat("127.0.0.1:", port);
  if (host == "[::]" || host == "[::0]" || host == "[0:0:0:0:0:0:0:0]") {
    return absl::StrCat("[::1]:", port);
  }
  return absl::StrCat(host, ":", port);
}

bool IsLoopbackOnly(absl::string_view address) {
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) {
    return true;
  }
  for (absl::string_view scheme : {"ipv4:", "ipv6:", "dns:///", "dns:"}) {
    if (absl::ConsumePrefix(&address, scheme)) break;
  }
  const size_t colon = address.rfind(':');
  absl::string_view host = colon == absl::string_view::npos ? address : address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != absl::string_view::npos) {
    host = address;  // a bare IPv6 literal without a port
  }
  if (host == "localhost") return true;
  const std::string h(host);
  in_addr v4;
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  return inet_pton(AF_INET6, h.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

namespace {

// The IPv4 address of a gRPC peer string, IPv4-mapped IPv6 included; false for anything else.
bool PeerIpv4(absl::string_view peer, in_addr* out) {
  std::string p = absl::StrReplaceAll(peer, {{"%5B", "["}, {"%5D", "]"}});
  absl::string_view rest = p;
  if (!absl::ConsumePrefix(&rest, "ipv4:") && !absl::ConsumePrefix(&rest, "ipv6:")) return false;
  const size_t colon = rest.rfind(':');
  if (colon == absl::string_view::npos) return false;
  absl::string_view host = rest.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const std::string h(host);
  if (inet_pton(AF_INET, h.c_str(), out) == 1) return true;
  in6_addr v6;
  if (inet_pton(AF_INET6, h.c_str(), &v6) != 1 || !IN6_IS_ADDR_V4MAPPED(&v6)) return false;
  std::memcpy(&out->s_addr, &v6.s6_addr[12], 4);
  return true;
}

}  // namespace

absl::StatusOr<std::vector<Ipv4Network>> ParseFabricNetworks(
    const std::vector<std::string>& cidrs) {
  std::vector<Ipv4Network> out;
  for (const std::string& cidr : cidrs) {
    const size_t slash = cidr.find('/');
    const std::string ip = cidr.substr(0, slash);
    int bits = 32;
    in_addr a;
    const bool bits_ok =
        slash == std::string::npos ||
        (absl::SimpleAtoi(cidr.substr(slash + 1), &bits) && bits >= 0 && bits <= 32);
    if (!bits_ok || inet_pton(AF_INET, ip.c_str(), &a) != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fabric network \"", LoggableName(cidr), "\" is not an IPv4 network (a.b.c.d/n)"));
    }
    const uint32_t mask = bits == 0 ? 0 : ~uint32_t{0} << (32 - bits);
    out.push_back({ntohl(a.s_addr) & mask, mask});
  }
  return out;
}

absl::Status CheckPeerAddress(absl::string_view gid_address, absl::string_view grpc_peer,
                              const std::vector<Ipv4Network>& networks) {
  in_addr gid;
  const std::string g(gid_address);
  if (inet_pton(AF_INET, g.c_str(), &gid) != 1) {
    return absl::PermissionDeniedError(absl::StrCat("the peer's GID names no IPv4 address (",
                                                    LoggableName(gid_address), ")"));
  }
  in_addr peer;
  if (PeerIpv4(grpc_peer, &peer) && peer.s_addr == gid.s_addr) return absl::OkStatus();
  for (const Ipv4Network& n : networks) {
    if ((ntohl(gid.s_addr) & n.mask) == n.base) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "the peer's GID names ", gid_address, ", which is neither the address it called from (",
      LoggableName(grpc_peer), ") nor in a configured fabric network (fabric_networks)"));
}

}  // namespace swirl::internal
