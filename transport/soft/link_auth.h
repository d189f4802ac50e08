// Link keys: what authenticates a soft QP pair's link (both fabrics) and protects its TCP
// records (docs/SOFT_WIRE.md, "Link keys"). The control plane hands both QPs the same random
// 32-byte key (SetLinkKey, soft_device.h) before RTR; the device then links them only with a
// peer that proves it knows that key for a nonce this side has just drawn.
//
// The hello exchange on a keyed link (both fabrics), opener = the side that connects:
//   opener -> accepter  hello: GIDs/QPNs as before, a fresh nonce N_o, flags (keyed, crypt)
//   accepter -> opener  challenge: a fresh nonce N_a, its flags, MAC(accepter label, ...)
//   opener -> accepter  proof: MAC(opener label, ...) (and, on shared memory, the descriptors)
// Both MACs are HMAC-SHA256 under the link key over: a label naming the role and the fabric,
// the opener's hello as sent (source GID and QPN, destination QPN, N_o, flags), the accepter's
// GID, N_a and the accepter's flags. So each side proves knowledge of the key for the other's
// fresh nonce: a recorded hello, challenge or proof replayed later meets a new nonce and fails,
// and one role's MAC never passes for the other's (the labels differ).
//
// TCP records after a keyed handshake are sealed with AES-256-GCM under a key per direction,
// HKDF-SHA256(link key, salt = N_o || N_a, info = direction label); the nonce is the unit's
// sequence number in its direction (a replayed, dropped or reordered record fails its tag).

#ifndef SWIRL_TRANSPORT_SOFT_LINK_AUTH_H_
#define SWIRL_TRANSPORT_SOFT_LINK_AUTH_H_

#include <infiniband/verbs.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/types/span.h"

namespace swirl::soft {

inline constexpr size_t kLinkKeyBytes = 32;
inline constexpr size_t kNonceBytes = 16;
inline constexpr size_t kMacBytes = 32;
inline constexpr size_t kTagBytes = 16;

using LinkKey = std::array<uint8_t, kLinkKeyBytes>;
using Nonce = std::array<uint8_t, kNonceBytes>;
using Mac = std::array<uint8_t, kMacBytes>;

// Hello flags (both fabrics).
inline constexpr uint32_t kHelloKeyed = 1;  // the opener's QP has a link key: challenge it
inline constexpr uint32_t kHelloCrypt = 2;  // TCP: seal records (either side asking is enough)
// Shared memory: a reply, the accepter's own segment sent back on the opener's connection.
inline constexpr uint32_t kHelloReply = 4;

enum class AuthRole : uint8_t { kAccepter, kOpener };
enum class AuthFabric : uint8_t { kShm, kTcp };

// Cryptographically random bytes (OpenSSL's RAND_bytes; aborts only if the system has none).
void RandomBytes(void* out, size_t length);
Nonce NewNonce();

// The MAC `role` sends (see the header comment). `opener_hello` is the opener's hello exactly
// as it travelled.
Mac HelloMac(const LinkKey& key, AuthRole role, AuthFabric fabric,
             absl::Span<const uint8_t> opener_hello, const ibv_gid& accepter_gid,
             const Nonce& accepter_nonce, uint32_t accepter_flags);
// Constant time.
bool MacEqual(const Mac& a, const Mac& b);

// One direction's record protection (TCP): AES-256-GCM, nonce = 4 zero bytes || the unit's
// 64-bit sequence number (big-endian), counted from 0 per direction.
class RecordCipher {
 public:
  // The key of direction opener->accepter (`from_opener`) or back, from the link key and both
  // nonces (HKDF-SHA256). Null if libcrypto fails (out of memory).
  static std::unique_ptr<RecordCipher> Create(const LinkKey& key, const Nonce& opener_nonce,
                                              const Nonce& accepter_nonce, bool from_opener,
                                              bool encrypt);
  ~RecordCipher();
  RecordCipher(const RecordCipher&) = delete;
  RecordCipher& operator=(const RecordCipher&) = delete;

  // Seals the next unit: `in` (length bytes) to `out` (may equal `in`), `aad` authenticated
  // too, the tag to `tag`. False on a libcrypto failure.
  bool Seal(const void* aad, size_t aad_length, const void* in, size_t length, void* out,
            uint8_t tag[kTagBytes]);
  // Opens the next unit in place; false if it fails authentication (tampered, replayed,
  // reordered, or sealed under another key).
  bool Open(const void* aad, size_t aad_length, void* data, size_t length,
            const uint8_t tag[kTagBytes]);
  uint64_t sequence() const { return sequence_; }

 private:
  RecordCipher() = default;
  void* ctx_ = nullptr;  // EVP_CIPHER_CTX
  uint64_t sequence_ = 0;
};

}  // namespace swirl::soft

#endif  // SWIRL_TRANSPORT_SOFT_LINK_AUTH_H_
