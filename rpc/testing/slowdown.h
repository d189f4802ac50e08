// How much slower than an ordinary build a sanitizer build runs, for tests whose timeouts must
// stay longer than the machine's own pauses: a keepalive that a test's long computation on a
// caller-driven channel, or a process the test holds stopped, must not outlast. Such a test
// multiplies those durations (and the bounds derived from them) by kSlowdown; what it asserts
// stays the same, and on an ordinary build kSlowdown is 1, so nothing there changes.
//
// ThreadSanitizer: 5. Measured 2026-12-02 on this 2-core machine under other builds' load: the
// stops of rpc/process_faults_test's catch loop and rpc/bulk_test's 16 MiB fill and checksum
// on the caller's thread outlasted 3 keepalives of 200 ms and 1 s. AddressSanitizer: 1 (the
// suite passes under it with the ordinary timing).

#ifndef SWIRL_RPC_TESTING_SLOWDOWN_H_
#define SWIRL_RPC_TESTING_SLOWDOWN_H_

#include <cstdint>

namespace swirl::testing {

#if defined(__SANITIZE_THREAD__)
inline constexpr int64_t kSlowdown = 5;
#else
inline constexpr int64_t kSlowdown = 1;
#endif

}  // namespace swirl::testing

#endif  // SWIRL_RPC_TESTING_SLOWDOWN_H_
