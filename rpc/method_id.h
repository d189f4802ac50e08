// swirl::MethodId: the 32-bit id a method's full name ("/package.Service/Method") travels as on
// the wire (docs/WIRE.md). Both sides compute it, so no method table is exchanged; generated
// stubs carry their ids as compile-time constants.

#ifndef SWIRL_RPC_METHOD_ID_H_
#define SWIRL_RPC_METHOD_ID_H_

#include <cstdint>
#include <string_view>

namespace swirl {

// FNV-1a of the full name. Never 0 (0 marks a message that is not a call).
constexpr uint32_t MethodId(std::string_view full_name) {
  uint32_t hash = 2166136261u;
  for (char c : full_name) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 16777619u;
  }
  return hash == 0 ? 1 : hash;
}

}  // namespace swirl

#endif  // SWIRL_RPC_METHOD_ID_H_
