// What swirl reports about its connections and servers, as plain structs: the settings a
// connection's handshake agreed on, a connection's counters, a server's totals, and what a device
// can do. Channel::negotiated(), Channel::LocalStats(), Channel::ServerStats(), Server::Stats()
// and Server::capabilities() return them (the control plane carries the same facts as
// proto/control.proto's messages; swirl converts, so users need no generated code for them).

#ifndef SWIRL_RPC_STATS_H_
#define SWIRL_RPC_STATS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "swirl/bulk.h"

namespace swirl {

// How a connection's bulk windows are revoked (docs/BULK.md).
enum class InvalidationMode {
  kNone,    // not settled (no connection)
  kRemote,  // the last message is SEND_WITH_INV carrying the window's rkey
  kLocal,   // explicit fallback: plain acknowledgement, then LOCAL_INV by the exposer
};
const char* InvalidationModeName(InvalidationMode mode);  // "remote", "local", "none"

// The names of proto/control.proto's enums for these, as the control plane shows them (and
// swirl's tools print them): "INVALIDATION_REMOTE", "BULK_SERVER_EXPOSES", ...
const char* ControlPlaneName(InvalidationMode mode);
const char* ControlPlaneName(BulkMode mode);

// What both sides of a connection agreed on at connect; the same on both sides.
struct NegotiatedSettings {
  uint32_t protocol_version = 0;
  uint32_t client_credits = 0;  // messages the client may have in flight to the server
  uint32_t server_credits = 0;  // messages the server may have in flight to the client
  uint32_t max_message_size = 0;
  uint32_t client_max_inline = 0;
  uint32_t server_max_inline = 0;
  InvalidationMode invalidation = InvalidationMode::kNone;
  uint32_t eager_threshold = 0;
  uint32_t window_credits = 0;
  BulkMode bulk_mode = BulkMode::kServerExposes;
  uint64_t max_bulk_size = 0;  // per transfer, both ways

  bool operator==(const NegotiatedSettings&) const = default;
};

// One connection, as one side sees it.
struct ConnectionStats {
  uint64_t connection_id = 0;
  std::string client_name;  // server side
  std::string peer;         // server side: the client's control-plane address
  NegotiatedSettings negotiated;
  uint64_t requests_received = 0;
  uint64_t responses_sent = 0;
  uint64_t requests_sent = 0;
  uint64_t responses_received = 0;
  uint64_t bytes_received = 0;
  uint64_t bytes_sent = 0;
  uint64_t protocol_errors = 0;
  // Bulk windows (docs/BULK.md).
  uint64_t windows_granted = 0;
  uint64_t windows_remote_invalidated = 0;
  uint64_t windows_locally_invalidated = 0;
  uint64_t windows_lease_expired = 0;
  uint64_t invalidation_violations = 0;
  uint32_t worker = 0;  // server side: the worker serving it
  std::string state;    // server side: "active", "closing", ...
  std::string principal;  // server side: who the client authenticated as ("" for no one)

  bool operator==(const ConnectionStats&) const = default;
};

// A server's totals.
struct ServerCounters {
  uint64_t connections_accepted = 0;
  uint64_t connections_refused = 0;
  uint64_t connections_active = 0;
  uint64_t connections_closed = 0;
  uint64_t connections_failed = 0;
  uint64_t requests = 0;
  uint64_t protocol_errors = 0;
  uint64_t queue_pairs_live = 0;
  uint64_t recv_buffers_free = 0;
  uint64_t recv_buffers_total = 0;
  uint64_t windows_remote_invalidated = 0;
  uint64_t windows_locally_invalidated = 0;
  uint64_t windows_lease_expired = 0;
  uint64_t invalidation_violations = 0;
  uint64_t windows_outstanding = 0;  // exposed right now
  uint64_t bulk_bytes_in_use = 0;
  // Asynchronous events from the device: errors a QP raised because no completion could report
  // them (a peer's request it refused), and events about the device itself (CQ overflow, port
  // and device errors, port changes).
  uint64_t async_qp_errors = 0;
  uint64_t async_device_events = 0;
  // Bulk memory charged to clients' budgets right now (grants, unacknowledged downloads, queued
  // blocking handlers, mirror-mode READs and replies being written): 0 once nothing holds any.
  uint64_t bulk_bytes_charged = 0;

  bool operator==(const ServerCounters&) const = default;
};

// What a ClientRuntime's worker holds right now (ClientRuntime::Counters()), the fields of
// ServerCounters a client needs to see that a lost connection left nothing behind: its QPs,
// its receive buffers, the windows it exposes and the bulk pool memory in use.
struct RuntimeCounters {
  uint64_t queue_pairs_live = 0;  // connections on the worker, set up or being torn down
  uint64_t recv_buffers_free = 0;
  uint64_t recv_buffers_total = 0;
  uint64_t windows_outstanding = 0;  // exposed right now
  uint64_t bulk_bytes_in_use = 0;

  bool operator==(const RuntimeCounters&) const = default;
};

// What a side declares to its peers at connect about its device and configuration.
struct DeclaredCapabilities {
  std::string device_name;
  std::string device_kind;  // "soft" or "rdma-core"
  bool remote_invalidation = false;
  bool mw_type2 = false;
  uint32_t max_inline = 0;
  uint32_t recv_credits = 0;
  uint32_t recv_buffer_size = 0;  // header included
  uint32_t max_message_size = 0;
  uint32_t eager_threshold = 0;
  uint32_t window_credits = 0;
  bool require_remote_invalidation = false;
  BulkMode bulk_mode = BulkMode::kServerExposes;
  uint64_t max_bulk_size = 0;

  bool operator==(const DeclaredCapabilities&) const = default;
};

// A server's stats: its totals and its connections (all, or the one asked for).
struct StatsReport {
  ServerCounters server;
  std::vector<ConnectionStats> connections;
  std::string device;
  DeclaredCapabilities capabilities;

  bool operator==(const StatsReport&) const = default;
};

// What a device can do, as swirl probed it (its remote-invalidation self-test included).
struct DeviceInfo {
  std::string device;  // its name
  std::string kind;    // "soft" or "rdma-core"
  // Type 2 memory windows and SEND_WITH_INV, advertised and confirmed by the self-test.
  bool remote_invalidation = false;
  uint32_t max_inline_data = 0;
  uint8_t port = 1;
  int gid_index = 0;  // the GID table entry connections use (resolved)

  bool operator==(const DeviceInfo&) const = default;
};

}  // namespace swirl

#endif  // SWIRL_RPC_STATS_H_
