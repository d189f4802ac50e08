#include "rpc/establish.h"

#include <algorithm>
#include <atomic>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/mutex.h"
#include "transport/device.h"

namespace swirl::internal {
namespace {

absl::StatusOr<verbs::Capabilities> ProbeFresh(const std::shared_ptr<verbs::Context>& context,
                                               const TransportOptions& transport) {
  verbs::ProbeOptions probe;
  probe.port_num = transport.port;
  probe.gid_index = transport.gid_index;
  probe.confirm_remote_invalidation = true;
  return verbs::ProbeCapabilities(context, probe);
}

absl::StatusOr<verbs::Capabilities> ProbeOncePerProcess(
    const std::shared_ptr<verbs::Context>& context, const TransportOptions& transport) {
  static swirl::Mutex mu;
  static auto* cache = new std::map<std::string, verbs::Capabilities>();
  // Keyed on the entry "automatic" resolves to, so that -1 and that index share one probe.
  absl::StatusOr<int> gid_index = context->ResolveGidIndex(transport.port, transport.gid_index);
  const std::string key = absl::StrCat(context->name(), "/", transport.port, "/",
                                       gid_index.ok() ? *gid_index : transport.gid_index);
  swirl::MutexLock lock(&mu);
  auto it = cache->find(key);
  if (it != cache->end()) return it->second;
  auto caps = ProbeFresh(context, transport);
  if (!caps.ok()) return caps.status();
  // A self-test that could not run (port down) is tried again next time, not remembered.
  if (caps->remote_invalidation_selftest != verbs::SelfTest::kNotRun) (*cache)[key] = *caps;
  return *caps;
}

verbs::ConnectOptions ConnectOptionsFor(const TransportOptions& transport) {
  verbs::ConnectOptions co;
  // swirl's RPCs never use atomics; a device without them may refuse a QP that asks for them.
  co.access_flags &= ~IBV_ACCESS_REMOTE_ATOMIC;
  co.port_num = transport.port;
  co.gid_index = transport.gid_index;
  co.timeout = AckTimeoutExponent(transport.ack_timeout);
  return co;
}

// Never silently weaker: what was settled, and a fallback in force, said where operators look.
void LogEstablished(const ConnectionSetup& setup, const PeerAnswer& answer) {
  const control::Negotiated& n = answer.negotiated;
  const char* direction = setup.is_server ? "from" : "to";
  SWIRL_LOG(INFO,
            "connection %u %s %s (%s): credits %u/%u, max message %u, invalidation %s, bulk %s",
            answer.connection_id, direction, setup.peer, LoggableName(setup.client_name),
            n.client_credits(), n.server_credits(), n.max_message_size(),
            control::InvalidationMode_Name(n.invalidation()),
            control::BulkMode_Name(n.bulk_mode()));
  if (n.invalidation() == control::INVALIDATION_LOCAL) {
    SWIRL_LOG(WARNING,
              "connection %u %s %s: remote invalidation unavailable (%s); bulk windows are "
              "revoked by explicit LOCAL_INV (counted in windows_locally_invalidated)",
              answer.connection_id, direction, setup.peer,
              setup.transport->invalidation == InvalidationPolicy::kLocalOnly
                  ? "this side asked for the fallback"
                  : "not supported end to end");
  }
}

// A device without link keys (every NIC) is normal, not an error: said once per process, so
// that the log tells why links are only as authenticated as RoCE's.
void LogNoLinkKeysOnce(const absl::Status& why) {
  static std::atomic<bool> logged{false};
  if (logged.exchange(true)) return;
  SWIRL_LOG(INFO,
            "%s: its links are bound to no key (as RoCE's: whoever can reach the fabric and "
            "knows the GIDs and QPNs could take one)",
            why.message());
}

}  // namespace

uint8_t AckTimeoutExponent(absl::Duration ack_timeout) {
  if (ack_timeout <= absl::ZeroDuration()) return 0;
  // 4.096 us x 2^n >= ack_timeout, n in 1..31 (0 is "no timer", which a positive timeout is
  // not, so the shortest is 2^1).
  for (uint8_t n = 1; n < 31; ++n) {
    if (absl::Nanoseconds(4096) * (int64_t{1} << n) >= ack_timeout) return n;
  }
  return 31;
}

WorkerOptions WorkerOptionsFor(const TransportOptions& transport) {
  WorkerOptions wo;
  wo.credits = transport.credits;
  wo.buffer_size = transport.buffer_size;
  wo.keepalive = transport.keepalive;
  wo.bulk_pool_bytes = transport.bulk_pool_bytes;
  wo.window_lease = transport.window_lease;
  return wo;
}

LocalConfig LocalConfigFor(const TransportOptions& transport, const verbs::Capabilities& caps) {
  LocalConfig local;
  local.credits = transport.credits;
  local.buffer_size = transport.buffer_size;
  local.max_inline = std::min<uint32_t>(caps.max_inline_data, 1024);
  local.require_remote_invalidation =
      transport.invalidation == InvalidationPolicy::kRequireRemote;
  local.allow_local_fallback = transport.invalidation != InvalidationPolicy::kRequireRemote;
  return local;
}

verbs::Capabilities DeclaredCapabilities(const verbs::Capabilities& caps,
                                         InvalidationPolicy policy) {
  verbs::Capabilities declared = caps;
  if (policy == InvalidationPolicy::kLocalOnly) declared.remote_invalidation_advertised = false;
  return declared;
}

absl::StatusOr<OpenedDevice> OpenTransport(const TransportOptions& transport, Probe probe) {
  OpenedDevice device;
  auto context = OpenDevice(transport.device);
  if (!context.ok()) return context.status();
  device.context = *context;
  auto caps = probe == Probe::kFresh ? ProbeFresh(device.context, transport)
                                     : ProbeOncePerProcess(device.context, transport);
  if (!caps.ok()) return caps.status();
  device.caps = *caps;
  auto pd = verbs::ProtectionDomain::Create(device.context);
  if (!pd.ok()) return pd.status();
  device.pd = *pd;
  return device;
}

absl::StatusOr<std::shared_ptr<Connection>> EstablishConnection(const ConnectionSetup& setup,
                                                                Exchange exchange) {
  const verbs::ConnectOptions co = ConnectOptionsFor(*setup.transport);
  auto created = setup.worker->CreateConnection(setup.id, setup.methods, co);
  if (!created.ok()) return created.status();
  std::shared_ptr<Connection> c = *created;
  const uint32_t psn = absl::Uniform<uint32_t>(absl::BitGen(), 0, 1u << 24);
  absl::StatusOr<verbs::PeerAddress> local = c->qp().LocalAddress(psn, co);
  auto exchange_local = [&]() -> absl::StatusOr<PeerAnswer> {
    if (!local.ok()) return local.status();
    // An empty key on a fresh QP changes nothing: it asks the device whether it takes keys.
    const absl::Status probe = c->qp().SetLinkKey({});
    if (!probe.ok()) LogNoLinkKeysOnce(probe);
    return exchange(
        LocalQp{*local, probe.ok(), &c->qp().pd().context(), c->initial_grant()});
  };
  absl::StatusOr<PeerAnswer> answer = exchange_local();
  absl::Status s = answer.status();
  if (s.ok() && !answer->link_key.empty()) {
    s = c->qp().SetLinkKey(absl::MakeConstSpan(
        reinterpret_cast<const uint8_t*>(answer->link_key.data()), answer->link_key.size()));
  }
  if (s.ok()) s = c->qp().ToRtr(answer->address, co);
  if (s.ok()) s = c->qp().ToRts(psn, co);
  if (!s.ok()) {
    setup.worker->Abandon(c);
    return s;
  }
  c->Configure(answer->negotiated, setup.is_server, setup.peer, setup.client_name,
               setup.principal, setup.worker->credit_pool());
  if (setup.on_lost) c->set_on_lost(setup.on_lost);
  setup.worker->Activate(c);
  LogEstablished(setup, *answer);
  return c;
}

absl::Status CheckPeerFabricAddress(verbs::Context& device, const ibv_gid& gid,
                                    absl::string_view grpc_peer,
                                    const std::vector<Ipv4Network>& networks) {
  absl::StatusOr<std::string> address = device.GidAddress(gid);
  if (absl::IsNotFound(address.status())) return absl::OkStatus();
  if (!address.ok()) return address.status();
  return CheckPeerAddress(*address, grpc_peer, networks);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void CopyCounters(const ConnectionCounters& k, control::ConnectionStats* out) {
  out->set_requests_received(k.requests_received.load());
  out->set_responses_sent(k.responses_sent.load());
  out->set_requests_sent(k.requests_sent.load());
  out->set_responses_received(k.responses_received.load());
  out->set_bytes_received(k.bytes_received.load());
  out->set_bytes_sent(k.bytes_sent.load());
  out->set_protocol_errors(k.protocol_errors.load());
  out->set_windows_granted(k.windows_granted.load());
  out->set_windows_remote_invalidated(k.windows_remote_invalidated.load());
  out->set_windows_locally_invalidated(k.windows_locally_invalidated.load());
  out->set_windows_lease_expired(k.windows_lease_expired.load());
  out->set_invalidation_violations(k.invalidation_violations.load());
}

}  // namespace swirl::internal
