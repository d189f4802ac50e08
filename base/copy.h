// memcpy for the sizes of small messages, inline. A call into libc (and its _FORTIFY_SOURCE
// check) costs more instructions than copying 64 bytes: the message path copies a payload on
// each side of every call, and the soft device copies it again into its ring.

#ifndef SWIRL_BASE_COPY_H_
#define SWIRL_BASE_COPY_H_

#include <cstddef>
#include <cstring>

namespace swirl {

// Copies n bytes, kN <= n <= 2 * kN, as the first and the last kN bytes (overlapping): every
// length in the class without a loop.
template <size_t kN>
[[gnu::always_inline]] inline void CopyOverlapping(char* d, const char* s, size_t n) {
  char first[kN], last[kN];
  __builtin_memcpy(first, s, kN);
  __builtin_memcpy(last, s + n - kN, kN);
  __builtin_memcpy(d, first, kN);
  __builtin_memcpy(d + n - kN, last, kN);
}

// memcpy(dst, src, n) for non-overlapping ranges; inline up to 64 bytes.
[[gnu::always_inline]] inline void CopyBytes(void* dst, const void* src, size_t n) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  if (n > 64) {
    std::memcpy(d, s, n);
  } else if (n > 32) {
    CopyOverlapping<32>(d, s, n);
  } else if (n > 16) {
    CopyOverlapping<16>(d, s, n);
  } else if (n >= 8) {
    CopyOverlapping<8>(d, s, n);
  } else if (n >= 4) {
    CopyOverlapping<4>(d, s, n);
  } else {
    for (size_t i = 0; i < n; ++i) d[i] = s[i];
  }
}

}  // namespace swirl

#endif  // SWIRL_BASE_COPY_H_
