#include "rpc/stats_convert.h"

#include "transport/verbs/device_ops.h"

namespace swirl {

const char* InvalidationModeName(InvalidationMode mode) {
  switch (mode) {
    case InvalidationMode::kNone: return "none";
    case InvalidationMode::kRemote: return "remote";
    case InvalidationMode::kLocal: return "local";
  }
  return "unknown";
}

const char* ControlPlaneName(InvalidationMode mode) {
  switch (mode) {
    case InvalidationMode::kNone: return "INVALIDATION_NONE";
    case InvalidationMode::kRemote: return "INVALIDATION_REMOTE";
    case InvalidationMode::kLocal: return "INVALIDATION_LOCAL";
  }
  return "unknown";
}

const char* ControlPlaneName(BulkMode mode) {
  switch (mode) {
    case BulkMode::kServerExposes: return "BULK_SERVER_EXPOSES";
    case BulkMode::kMirror: return "BULK_MIRROR";
  }
  return "unknown";
}

namespace internal {
namespace {

InvalidationMode FromProto(control::InvalidationMode mode) {
  switch (mode) {
    case control::INVALIDATION_REMOTE: return InvalidationMode::kRemote;
    case control::INVALIDATION_LOCAL: return InvalidationMode::kLocal;
    default: return InvalidationMode::kNone;
  }
}

BulkMode FromProto(control::BulkMode mode) {
  return mode == control::BULK_MIRROR ? BulkMode::kMirror : BulkMode::kServerExposes;
}

DeclaredCapabilities FromProto(const control::Capabilities& c) {
  return DeclaredCapabilities{
      .device_name = c.device_name(),
      .device_kind = c.device_kind(),
      .remote_invalidation = c.remote_invalidation(),
      .mw_type2 = c.mw_type2(),
      .max_inline = c.max_inline(),
      .recv_credits = c.recv_credits(),
      .recv_buffer_size = c.recv_buffer_size(),
      .max_message_size = c.max_message_size(),
      .eager_threshold = c.eager_threshold(),
      .window_credits = c.window_credits(),
      .require_remote_invalidation = c.require_remote_invalidation(),
      .bulk_mode = FromProto(c.bulk_mode()),
      .max_bulk_size = c.max_bulk_size(),
  };
}

ServerCounters FromProto(const control::ServerStats& s) {
  return ServerCounters{
      .connections_accepted = s.connections_accepted(),
      .connections_refused = s.connections_refused(),
      .connections_active = s.connections_active(),
      .connections_closed = s.connections_closed(),
      .connections_failed = s.connections_failed(),
      .requests = s.requests(),
      .protocol_errors = s.protocol_errors(),
      .queue_pairs_live = s.queue_pairs_live(),
      .recv_buffers_free = s.recv_buffers_free(),
      .recv_buffers_total = s.recv_buffers_total(),
      .windows_remote_invalidated = s.windows_remote_invalidated(),
      .windows_locally_invalidated = s.windows_locally_invalidated(),
      .windows_lease_expired = s.windows_lease_expired(),
      .invalidation_violations = s.invalidation_violations(),
      .windows_outstanding = s.windows_outstanding(),
      .bulk_bytes_in_use = s.bulk_bytes_in_use(),
      .async_qp_errors = s.async_qp_errors(),
      .async_device_events = s.async_device_events(),
      .bulk_bytes_charged = s.bulk_bytes_charged(),
  };
}

}  // namespace

NegotiatedSettings FromProto(const control::Negotiated& n) {
  return NegotiatedSettings{
      .protocol_version = n.protocol_version(),
      .client_credits = n.client_credits(),
      .server_credits = n.server_credits(),
      .max_message_size = n.max_message_size(),
      .client_max_inline = n.client_max_inline(),
      .server_max_inline = n.server_max_inline(),
      .invalidation = FromProto(n.invalidation()),
      .eager_threshold = n.eager_threshold(),
      .window_credits = n.window_credits(),
      .bulk_mode = FromProto(n.bulk_mode()),
      .max_bulk_size = n.max_bulk_size(),
  };
}

ConnectionStats FromProto(const control::ConnectionStats& c) {
  return ConnectionStats{
      .connection_id = c.connection_id(),
      .client_name = c.client_name(),
      .peer = c.peer(),
      .negotiated = FromProto(c.negotiated()),
      .requests_received = c.requests_received(),
      .responses_sent = c.responses_sent(),
      .requests_sent = c.requests_sent(),
      .responses_received = c.responses_received(),
      .bytes_received = c.bytes_received(),
      .bytes_sent = c.bytes_sent(),
      .protocol_errors = c.protocol_errors(),
      .windows_granted = c.windows_granted(),
      .windows_remote_invalidated = c.windows_remote_invalidated(),
      .windows_locally_invalidated = c.windows_locally_invalidated(),
      .windows_lease_expired = c.windows_lease_expired(),
      .invalidation_violations = c.invalidation_violations(),
      .worker = c.worker(),
      .state = c.state(),
      .principal = c.principal(),
  };
}

StatsReport FromProto(const control::StatsResponse& r) {
  StatsReport out{.server = FromProto(r.server()),
                  .connections = {},
                  .device = r.device(),
                  .capabilities = FromProto(r.capabilities())};
  out.connections.reserve(r.connections_size());
  for (const control::ConnectionStats& c : r.connections()) out.connections.push_back(FromProto(c));
  return out;
}

DeviceInfo DescribeDevice(const verbs::Capabilities& caps) {
  return DeviceInfo{
      .device = caps.device,
      .kind = verbs::DeviceKindName(caps.kind),
      .remote_invalidation = caps.remote_invalidation(),
      .max_inline_data = caps.max_inline_data,
      .port = caps.port_num,
      .gid_index = caps.gid_index,
  };
}

}  // namespace internal
}  // namespace swirl
