// memcpy for the sizes of small messages, inline. A call into libc (and its _FORTIFY_SOURCE
// check) costs more instructions than copying 64 bytes: the message path copies a payload on
// each side of every call, and the soft device copies it again into its ring.

#ifndef SWIRL_BASE_COPY_H_
#define SWIRL_BASE_COPY_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace swirl {

// A register-sized chunk of kN bytes (4, 8 or 16). A vector or integer, not a char array:
// -fstack-protector (Bazel's default) guards every function holding a char array of 8 bytes or
// more, and with this copy inlined into the message path that was every function on it, each
// paying for the canary and for the bytes going through the stack. (No 32-byte vector either:
// without AVX it is two registers, spilled through a 32-byte-aligned stack slot.)
template <size_t kN>
struct Chunk {
  using Type [[gnu::vector_size(kN), gnu::aligned(1), gnu::may_alias]] = char;
};
template <>
struct Chunk<4> {
  using Type = uint32_t;
};
template <>
struct Chunk<8> {
  using Type = uint64_t;
};

// Copies n bytes, kN <= n <= 2 * kN, as the first and the last kN bytes (overlapping), each
// in chunks of at most 16: every length in the class without a loop.
template <size_t kN>
[[gnu::always_inline]] inline void CopyOverlapping(char* d, const char* s, size_t n) {
  constexpr size_t kChunk = kN < 16 ? kN : 16;
  constexpr size_t kChunks = kN / kChunk;
  typename Chunk<kChunk>::Type first[kChunks], last[kChunks];
  for (size_t i = 0; i < kChunks; ++i) {
    __builtin_memcpy(&first[i], s + i * kChunk, kChunk);
    __builtin_memcpy(&last[i], s + n - kN + i * kChunk, kChunk);
  }
  for (size_t i = 0; i < kChunks; ++i) {
    __builtin_memcpy(d + i * kChunk, &first[i], kChunk);
    __builtin_memcpy(d + n - kN + i * kChunk, &last[i], kChunk);
  }
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
