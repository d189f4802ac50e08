// Test helpers for playing a foreign peer against the soft device's TCP fabric: the link
// protocol's structures as docs/SOFT_WIRE.md ("The TCP fabric") describes them, written from
// the document and deliberately not shared with tcp_link.cc, so that a test of one against the
// other checks both. Used by tcp_link_test and fuzz/tcp_link_fuzzer.

#ifndef SWIRL_TRANSPORT_SOFT_TCP_PEER_H_
#define SWIRL_TRANSPORT_SOFT_TCP_PEER_H_

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "transport/soft/wire.h"

namespace swirl::soft::tcp_peer {

struct Hello {
  uint64_t magic = 0x3150435457535731ull;
  uint32_t version = 4;  // flags and a nonce (3: one connection for both directions)
  uint32_t src_qpn = 0;
  uint32_t dst_qpn = 0;
  uint32_t flags = 0;  // 1 keyed, 2 seal records
  ibv_gid src_gid{};
  uint64_t segment_size = wire::kRingsOffset + 2 * wire::kMinRingSize;
  uint64_t request_ring_offset = wire::kRingsOffset;
  uint64_t request_ring_size = wire::kMinRingSize;
  uint64_t response_ring_offset = wire::kRingsOffset + wire::kMinRingSize;
  uint64_t response_ring_size = wire::kMinRingSize;
  uint64_t control[4] = {0, 0, 0, wire::kLinkActive};
  uint8_t nonce[16] = {};
};
static_assert(sizeof(Hello) == 128);

struct Record {
  uint8_t kind;  // 1 frame, 2 control
  uint8_t ring;
  uint16_t reserved;
  uint32_t length;
  uint64_t position;
};
static_assert(sizeof(Record) == 16);

// The GID of a TCP fabric device at 127.0.0.1 and `port_network_order`.
inline ibv_gid TcpGid(uint16_t port_network_order) {
  ibv_gid gid{};
  std::memcpy(gid.raw + 8, &port_network_order, 2);
  gid.raw[10] = gid.raw[11] = 0xff;
  const uint32_t loopback = htonl(INADDR_LOOPBACK);
  std::memcpy(gid.raw + 12, &loopback, 4);
  return gid;
}

// The first and last ports of the kernel's ephemeral range (net.ipv4.ip_local_port_range):
// connections a device opens, and the ports its listeners take, come from that range.
inline void EphemeralPortRange(int* low, int* high) {
  *low = 32768;
  *high = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d %d", low, high) != 2) *low = 32768, *high = 60999;
    std::fclose(f);
  }
}

}  // namespace swirl::soft::tcp_peer

#endif  // SWIRL_TRANSPORT_SOFT_TCP_PEER_H_
