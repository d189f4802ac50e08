// The data test_server and the tests that drive it agree on: the byte pattern the server's
// Fill methods produce and the checksum its Sum methods return. One definition, so the two
// sides cannot drift apart.

#ifndef SWIRL_RPC_TESTING_TEST_DATA_H_
#define SWIRL_RPC_TESTING_TEST_DATA_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace swirl::testing {

// Byte i of a fill of any length.
inline char Pattern(size_t i) { return static_cast<char>((i * 131 + 7) & 0xff); }

// 64-bit FNV-1a.
inline uint64_t Fnv(absl::string_view data) {
  uint64_t h = 14695981039346656037ull;  // the 64-bit offset basis
  for (unsigned char c : data) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace swirl::testing

#endif  // SWIRL_RPC_TESTING_TEST_DATA_H_
