// swirl::TransportOptions: the RDMA side of connections, which a server and a channel configure
// alike: the device and the GID, credits and message buffers, the bulk pool, how bulk windows
// are revoked, keepalive, the lease of a bulk window and the transport timer.
// ServerOptions::transport and ChannelOptions::transport embed it; what only one side has stays
// beside it.
//
//   swirl::ServerOptions options;
//   options.transport.credits = 64;
//   options.transport.invalidation = swirl::InvalidationPolicy::kRequireRemote;

#ifndef SWIRL_RPC_TRANSPORT_OPTIONS_H_
#define SWIRL_RPC_TRANSPORT_OPTIONS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace swirl {

// How the bulk windows a side exposes are revoked (docs/BULK.md). Never silently weaker: the
// mode in force is in Negotiated and Stats, and a fallback is a WARNING at connect on both sides.
enum class InvalidationPolicy {
  // The peer's SEND_WITH_INV where both devices can do remote invalidation end to end, else
  // the explicit LOCAL_INV fallback.
  kPreferRemote,
  // Remote invalidation or no connection: a peer that cannot do it is refused (and a server
  // whose own device cannot fails to start).
  kRequireRemote,
  // Declare this side unable to do remote invalidation, so that the fallback is used (to test
  // and measure it; never needed otherwise).
  kLocalOnly,
};

struct TransportOptions {
  // RDMA device ("" = automatic: see transport/device.h).
  std::string device;
  // The port and the GID table entry connections use. On RoCE the entry picks the RoCE version
  // and address: index 0 is often a RoCE v1 or link-local GID (`show_gids` lists them), which a
  // routed RoCE v2 fabric drops. The default, -1 (verbs::kAutoGidIndex), picks as rdma_cm does
  // for IPv4: a RoCE v2 entry with an IPv4 address first (verbs::ChooseGidIndex); give an index
  // to override. The soft device has one port and one GID.
  uint8_t port = 1;
  int gid_index = -1;
  // Receive buffers reserved for each connection's peer (what it may send before we answer),
  // and the size of each, message header included.
  uint32_t credits = 32;
  uint32_t buffer_size = 4096 + 32;
  // A connection idle this long is pinged, and fails if the ping goes unanswered for three
  // times as long. Zero: no keepalive (a dead peer is then noticed only when a send fails).
  absl::Duration keepalive = absl::Seconds(5);
  // Registered memory for bulk payloads, per worker (a server has one per worker core, a
  // channel its runtime's). 0: no bulk (large payloads then fail).
  size_t bulk_pool_bytes = 64 << 20;
  InvalidationPolicy invalidation = InvalidationPolicy::kPreferRemote;
  // A window we expose that the peer has not finished with within its lease is revoked by us.
  absl::Duration window_lease = absl::Seconds(5);
  // RC's transport timer: a request the peer's device has not acknowledged within ack_timeout
  // is sent again, 7 times, and then fails (IBV_WC_RETRY_EXC_ERR), and its connection with it:
  // about 8 x ack_timeout after the peer's device stopped answering, so a peer that stops
  // progressing its QP mid-transfer cannot hold our buffers until the keepalive. A QP holds
  // 4.096 us x 2^n (n up to 31); this is rounded up to the next such value. The default, 500 ms,
  // is held as 2^17 (537 ms: about 4.3 s in all), in the range production RDMA libraries use
  // (UCX's UCX_RC_TIMEOUT is 1 s, NCCL_IB_TIMEOUT 18 = 1.07 s), not perftest's 14 (67 ms): on
  // the soft device the peer's acknowledgements come from its host's CPU, which a loaded host
  // can deschedule for hundreds of milliseconds, and 8 x 67 ms failed healthy connections
  // there; a lossless fabric rarely retransmits at all. On a NIC it is the QP's `timeout`
  // attribute; the soft device runs the same timer on every QP. Still far inside the keepalive
  // (5 s idle, then three unanswered pings). Zero: no timer (the IB "infinite" timeout).
  absl::Duration ack_timeout = absl::Milliseconds(500);

  // Every field: what decides whether two channels may share a worker (ClientRuntime).
  bool operator==(const TransportOptions&) const = default;
};

}  // namespace swirl

#endif  // SWIRL_RPC_TRANSPORT_OPTIONS_H_
