// The data-plane message header: the first 32 bytes of every message on a swirl connection.
// docs/WIRE.md is the readable version; the layout is pinned by the static_asserts below.
//
// Every field is validated on receipt (ValidateHeader): a peer that sends a bad header gets its
// connection failed cleanly; nothing it sends can make the receiver read or write out of bounds.

#ifndef SWIRL_RPC_WIRE_H_
#define SWIRL_RPC_WIRE_H_

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "absl/status/status.h"
#include "swirl/method_id.h"

namespace swirl::rpc_wire {

inline constexpr uint8_t kProtocolVersion = 2;  // 2: kBulkAck names its window's rkey in aux

enum MessageType : uint8_t {
  kRequest = 1,      // a call; expects a kResponse with the same request_id
  kResponse = 2,     // status + payload for request_id
  kOneWay = 3,       // a call with no response
  kCancel = 4,       // the caller gave up on request_id (best effort)
  kCredit = 5,       // carries only a credit return
  kPing = 6,         // keepalive; answered by kPong
  kPong = 7,
  kBulkAck = 8,      // bulk transfer finished (docs/BULK.md); carries no payload
  kWindowGrant = 9,  // fresh upload windows (docs/BULK.md)
  kMaxType = 9,
};

enum MessageFlags : uint16_t {
  kFlagBulk = 1 << 0,        // the payload starts with a BulkDescriptor of the data (docs/BULK.md)
  kFlagReplyChunk = 1 << 1,  // mirror mode: then a BulkDescriptor of the caller's reply window
  kAllFlags = kFlagBulk | kFlagReplyChunk,
};

// aux bits of a request or response with kFlagBulk.
enum BulkAux : uint32_t {
  kAuxBulkIsMessage = 1 << 0,  // the bulk data is the serialized message (no eager part)
};

// Where bulk data is, as the exposing side grants it: exactly one window (or, in the unsafe
// benchmark mode, one range of the static pool).
struct BulkDescriptor {
  uint64_t addr;
  uint32_t length;
  uint32_t rkey;
};
static_assert(sizeof(BulkDescriptor) == 16);

// Little-endian on the wire (swirl runs on little-endian hosts; a big-endian port byte-swaps).
struct MessageHeader {
  uint8_t version;       // kProtocolVersion
  uint8_t type;          // MessageType
  uint16_t flags;        // MessageFlags
  uint32_t method_id;    // kRequest/kOneWay: MethodId(full name); otherwise 0
  uint64_t request_id;   // chosen by the caller; echoed in the response
  uint32_t status;       // kResponse: absl::StatusCode (the gRPC code numbers); otherwise 0
  uint32_t payload_len;  // bytes following the header in this message
  uint32_t credits;      // peer messages the sender received since its last report
  uint32_t aux;          // type specific: kWindowGrant counts, kBulkAck the window's rkey,
                         // BulkAux bits on bulk requests/responses; 0 otherwise
};
static_assert(sizeof(MessageHeader) == 32, "the header is 32 bytes on the wire");
static_assert(offsetof(MessageHeader, method_id) == 4);
static_assert(offsetof(MessageHeader, request_id) == 8);
static_assert(offsetof(MessageHeader, status) == 16);
static_assert(offsetof(MessageHeader, payload_len) == 20);
static_assert(offsetof(MessageHeader, credits) == 24);
static_assert(offsetof(MessageHeader, aux) == 28);

struct Limits {
  uint32_t max_payload;  // negotiated max message size
  uint32_t max_credits;  // credits the peer may return at once (what we granted)
};

// The last status code a response may carry: absl's (and gRPC's) numbering ends there.
inline constexpr uint32_t kMaxStatusCode = static_cast<uint32_t>(absl::StatusCode::kUnauthenticated);
static_assert(kMaxStatusCode == 16);

// Checks a received header against the number of bytes that arrived and the connection's
// limits. OkStatus or an InvalidArgument/DataLoss status saying what was wrong.
// A header's first four bytes (version, type, flags) read as one word: the message path tells a
// plain message (this version, no flags) of each type with one compare.
struct HeaderLead {
  uint8_t version;
  uint8_t type;
  uint16_t flags;
};
constexpr uint32_t PlainLead(MessageType type) {
  return std::bit_cast<uint32_t>(HeaderLead{kProtocolVersion, type, 0});
}
inline constexpr uint32_t kPlainRequest = PlainLead(kRequest);
inline constexpr uint32_t kPlainResponse = PlainLead(kResponse);
inline constexpr uint32_t kPlainOneWay = PlainLead(kOneWay);
inline constexpr uint32_t kPlainCredit = PlainLead(kCredit);
inline uint32_t LeadOf(const MessageHeader& h) {
  static_assert(offsetof(MessageHeader, flags) == 2 && sizeof(HeaderLead) == 4);
  uint32_t lead;
  std::memcpy(&lead, &h, sizeof(lead));
  return lead;
}

absl::Status ValidateHeaderSlow(const MessageHeader& header, size_t received_bytes,
                                const Limits& limits);

// The common case in a few compares: a well-formed plain request, one-way, response or credit
// message. False for anything else, valid or not (ValidateHeaderSlow decides those). A bool,
// not a Status: the receive path asks it of every message. (A message shorter than the header
// fails the payload_len compare: received_bytes - 32 wraps beyond any uint32_t.)
inline bool IsPlainHeader(const MessageHeader& h, size_t received_bytes, Limits limits) {
  if (h.aux != 0 || h.payload_len != received_bytes - sizeof(MessageHeader) ||
      h.payload_len > limits.max_payload || h.credits > limits.max_credits) {
    return false;
  }
  const uint32_t lead = LeadOf(h);
  if (lead == kPlainResponse) return h.method_id == 0 && h.status <= kMaxStatusCode;
  if (lead == kPlainRequest || lead == kPlainOneWay) return h.method_id != 0 && h.status == 0;
  if (lead == kPlainCredit) return h.method_id == 0 && h.status == 0 && h.payload_len == 0;
  return false;
}

inline absl::Status ValidateHeader(const MessageHeader& h, size_t received_bytes,
                                   const Limits& limits) {
  if (IsPlainHeader(h, received_bytes, limits)) return absl::OkStatus();
  return ValidateHeaderSlow(h, received_bytes, limits);
}

// Stable 32-bit id of a method's full name (swirl/method_id.h, public: generated stubs use it).
using ::swirl::MethodId;

}  // namespace swirl::rpc_wire

#endif  // SWIRL_RPC_WIRE_H_
