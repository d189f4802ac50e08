#include "transport/soft/link_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/kdf.h>
#include <openssl/rand.h>

#include <cstdlib>
#include <cstring>
#include <vector>

namespace swirl::soft {
namespace {

// Domain separation: a MAC made for one role or fabric never verifies as another's.
const char* Label(AuthRole role, AuthFabric fabric) {
  if (fabric == AuthFabric::kShm) {
    return role == AuthRole::kOpener ? "swirl-soft-link-v1 shm opener"
                                     : "swirl-soft-link-v1 shm accepter";
  }
  return role == AuthRole::kOpener ? "swirl-soft-link-v1 tcp opener"
                                   : "swirl-soft-link-v1 tcp accepter";
}

void Iv(uint64_t sequence, uint8_t iv[12]) {
  std::memset(iv, 0, 4);
  for (int i = 0; i < 8; ++i) iv[4 + i] = static_cast<uint8_t>(sequence >> (56 - 8 * i));
}

}  // namespace

void RandomBytes(void* out, size_t length) {
  // A link key's strength is the nonces' too: never fall back to anything weaker.
  if (RAND_bytes(static_cast<unsigned char*>(out), static_cast<int>(length)) != 1) std::abort();
}

Nonce NewNonce() {
  Nonce nonce;
  RandomBytes(nonce.data(), nonce.size());
  return nonce;
}

Mac HelloMac(const LinkKey& key, AuthRole role, AuthFabric fabric,
             absl::Span<const uint8_t> opener_hello, const ibv_gid& accepter_gid,
             const Nonce& accepter_nonce, uint32_t accepter_flags) {
  Mac mac{};
  const char* label = Label(role, fabric);
  uint8_t flags[4];
  for (int i = 0; i < 4; ++i) flags[i] = static_cast<uint8_t>(accepter_flags >> (8 * i));
  const uint64_t hello_length = opener_hello.size();
  uint8_t length_bytes[8];
  for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<uint8_t>(hello_length >> (8 * i));
  // The message, in order (one-shot HMAC: OpenSSL 3 deprecates the incremental HMAC_CTX).
  std::vector<uint8_t> message;
  message.reserve(64 + opener_hello.size());
  message.insert(message.end(), label, label + std::strlen(label) + 1);
  message.insert(message.end(), length_bytes, length_bytes + sizeof(length_bytes));
  message.insert(message.end(), opener_hello.begin(), opener_hello.end());
  message.insert(message.end(), accepter_gid.raw, accepter_gid.raw + sizeof(accepter_gid.raw));
  message.insert(message.end(), accepter_nonce.begin(), accepter_nonce.end());
  message.insert(message.end(), flags, flags + sizeof(flags));
  unsigned int out_length = 0;
  const bool ok = HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), message.data(),
                       message.size(), mac.data(), &out_length) != nullptr &&
                  out_length == mac.size();
  // A MAC that could not be computed is random: it verifies nothing and matches nothing.
  if (!ok) RandomBytes(mac.data(), mac.size());
  return mac;
}

bool MacEqual(const Mac& a, const Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

std::unique_ptr<RecordCipher> RecordCipher::Create(const LinkKey& key, const Nonce& opener_nonce,
                                                   const Nonce& accepter_nonce, bool from_opener,
                                                   bool encrypt) {
  uint8_t salt[2 * kNonceBytes];
  std::memcpy(salt, opener_nonce.data(), kNonceBytes);
  std::memcpy(salt + kNonceBytes, accepter_nonce.data(), kNonceBytes);
  static constexpr char kInfoForward[] = "swirl-soft-tcp-v1 opener->accepter";
  static constexpr char kInfoBack[] = "swirl-soft-tcp-v1 accepter->opener";
  const char* info = from_opener ? kInfoForward : kInfoBack;
  uint8_t direction_key[32];
  size_t key_length = sizeof(direction_key);
  EVP_PKEY_CTX* kdf = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, nullptr);
  const bool derived =
      kdf != nullptr && EVP_PKEY_derive_init(kdf) == 1 &&
      EVP_PKEY_CTX_set_hkdf_md(kdf, EVP_sha256()) == 1 &&
      EVP_PKEY_CTX_set1_hkdf_salt(kdf, salt, sizeof(salt)) == 1 &&
      EVP_PKEY_CTX_set1_hkdf_key(kdf, key.data(), static_cast<int>(key.size())) == 1 &&
      EVP_PKEY_CTX_add1_hkdf_info(kdf, reinterpret_cast<const uint8_t*>(info),
                                  static_cast<int>(std::strlen(info))) == 1 &&
      EVP_PKEY_derive(kdf, direction_key, &key_length) == 1 &&
      key_length == sizeof(direction_key);
  EVP_PKEY_CTX_free(kdf);
  if (!derived) return nullptr;
  std::unique_ptr<RecordCipher> cipher(new RecordCipher);
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  cipher->ctx_ = ctx;
  const bool ok =
      ctx != nullptr &&
      (encrypt ? EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr, direction_key, nullptr)
               : EVP_DecryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr, direction_key, nullptr)) ==
          1;
  OPENSSL_cleanse(direction_key, sizeof(direction_key));
  if (!ok) return nullptr;
  return cipher;
}

RecordCipher::~RecordCipher() { EVP_CIPHER_CTX_free(static_cast<EVP_CIPHER_CTX*>(ctx_)); }

bool RecordCipher::Seal(const void* aad, size_t aad_length, const void* in, size_t length,
                        void* out, uint8_t tag[kTagBytes]) {
  auto* ctx = static_cast<EVP_CIPHER_CTX*>(ctx_);
  uint8_t iv[12];
  Iv(sequence_, iv);
  int n = 0;
  if (EVP_EncryptInit_ex(ctx, nullptr, nullptr, nullptr, iv) != 1 ||
      (aad_length > 0 && EVP_EncryptUpdate(ctx, nullptr, &n, static_cast<const uint8_t*>(aad),
                                           static_cast<int>(aad_length)) != 1) ||
      (length > 0 && EVP_EncryptUpdate(ctx, static_cast<uint8_t*>(out), &n,
                                       static_cast<const uint8_t*>(in),
                                       static_cast<int>(length)) != 1) ||
      EVP_EncryptFinal_ex(ctx, static_cast<uint8_t*>(out) + length, &n) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, kTagBytes, tag) != 1) {
    return false;
  }
  ++sequence_;
  return true;
}

bool RecordCipher::Open(const void* aad, size_t aad_length, void* data, size_t length,
                        const uint8_t tag[kTagBytes]) {
  auto* ctx = static_cast<EVP_CIPHER_CTX*>(ctx_);
  uint8_t iv[12];
  Iv(sequence_, iv);
  uint8_t expected[kTagBytes];
  std::memcpy(expected, tag, kTagBytes);
  int n = 0;
  if (EVP_DecryptInit_ex(ctx, nullptr, nullptr, nullptr, iv) != 1 ||
      (aad_length > 0 && EVP_DecryptUpdate(ctx, nullptr, &n, static_cast<const uint8_t*>(aad),
                                           static_cast<int>(aad_length)) != 1) ||
      (length > 0 &&
       EVP_DecryptUpdate(ctx, static_cast<uint8_t*>(data), &n, static_cast<uint8_t*>(data),
                         static_cast<int>(length)) != 1) ||
      EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, kTagBytes, expected) != 1 ||
      EVP_DecryptFinal_ex(ctx, static_cast<uint8_t*>(data) + length, &n) != 1) {
    return false;
  }
  ++sequence_;
  return true;
}

}  // namespace swirl::soft
