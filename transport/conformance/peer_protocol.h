// What the two-process tests and conformance_peer say to each other over their socketpair.
//
// The peer owns one RC QP and one registered buffer laid out as kPeerDataOffset (the target of
// the test's RDMA WRITEs and READs), kPeerRecvOffset (receive slots) and kPeerSendOffset (the
// echo's send slots). After the handshake (PeerHello from the peer, the test's PeerAddress back,
// one ready byte from the peer) the peer busy-polls its CQ and the socket: every receive that
// completes is echoed back as a SEND of the same bytes, and each PeerCommand gets one PeerReply.

#ifndef SWIRL_TRANSPORT_CONFORMANCE_PEER_PROTOCOL_H_
#define SWIRL_TRANSPORT_CONFORMANCE_PEER_PROTOCOL_H_

#include <cstdint>
#include <type_traits>

#include "transport/verbs/verbs.h"

namespace swirl::conformance {

inline constexpr uint32_t kPeerMagic = 0x53575052;  // "SWPR"
inline constexpr uint64_t kPeerBufferSize = 8 << 20;
inline constexpr uint64_t kPeerDataOffset = 0;
inline constexpr uint64_t kPeerDataSize = 4 << 20;
inline constexpr uint64_t kPeerRecvOffset = 4 << 20;
inline constexpr uint64_t kPeerSendOffset = 6 << 20;
inline constexpr uint64_t kPeerSlotSize = 4096;
inline constexpr uint32_t kPeerSlots = 256;
inline constexpr uint32_t kPeerPsn = 0x0c0ffe;

struct PeerHello {
  uint32_t magic;
  uint32_t rkey;
  uint64_t buffer_addr;
  uint64_t buffer_size;
  verbs::PeerAddress address;  // for sq_psn kPeerPsn
};
static_assert(std::is_trivially_copyable_v<PeerHello>);

enum class PeerOp : uint32_t {
  kPostReceives = 1,  // post `count` receives (slots 0..count-1) and echo what arrives
  kChecksum = 2,      // reply with PeerChecksum(buffer + offset, length)
  kFill = 3,          // fill [offset, offset+length) with pattern `seed`; reply 0
  kExit = 4,          // reply 0, then exit(0)
};

struct PeerCommand {
  PeerOp op;
  uint32_t count;
  uint64_t offset;
  uint64_t length;
  uint64_t seed;
};
static_assert(std::is_trivially_copyable_v<PeerCommand>);

struct PeerReply {
  int64_t status;  // 0, or an errno value
  uint64_t value;
};
static_assert(std::is_trivially_copyable_v<PeerReply>);

// A deterministic byte pattern: byte i of pattern `seed`.
inline uint8_t PatternByte(uint64_t seed, uint64_t i) {
  return static_cast<uint8_t>((i * 131 + (i >> 8) * 7 + seed * 29 + 1) & 0xff);
}

// FNV-1a over `length` bytes.
inline uint64_t PeerChecksum(const void* data, uint64_t length) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t hash = 0xcbf29ce484222325ull;
  for (uint64_t i = 0; i < length; ++i) {
    hash ^= p[i];
    hash *= 0x100000001b3ull;
  }
  return hash;
}

}  // namespace swirl::conformance

#endif  // SWIRL_TRANSPORT_CONFORMANCE_PEER_PROTOCOL_H_
