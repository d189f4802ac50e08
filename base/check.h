// Invariant checks.
//
//   SWIRL_CHECK(cond)   always on: a broken invariant aborts with file, line and the condition.
//   SWIRL_DCHECK(cond)  on in debug and test builds (no NDEBUG: Bazel's fastbuild and dbg, and
//                       the sanitizer configs), compiled out of optimized builds (-c opt), where
//                       `cond` is not evaluated. For the engine's thread-affinity and
//                       state-machine checks, which are too frequent for a release hot path.
//
// A check is for a bug in swirl, never for what a peer sent: a peer's bad input is an error
// status and a failed connection, not an abort.

#ifndef SWIRL_BASE_CHECK_H_
#define SWIRL_BASE_CHECK_H_

namespace swirl::internal {
[[noreturn]] void CheckFailed(const char* file, int line, const char* condition);
}  // namespace swirl::internal

#define SWIRL_CHECK(cond)                                                     \
  do {                                                                        \
    if (__builtin_expect(!(cond), 0)) {                                       \
      ::swirl::internal::CheckFailed(__FILE__, __LINE__, #cond);              \
    }                                                                         \
  } while (0)

#ifndef NDEBUG
#define SWIRL_DCHECK_IS_ON 1
#define SWIRL_DCHECK(cond) SWIRL_CHECK(cond)
#else
#define SWIRL_DCHECK_IS_ON 0
// Still compiled (so it cannot rot), never evaluated.
#define SWIRL_DCHECK(cond) \
  do {                     \
    if (false) (void)(cond); \
  } while (0)
#endif

#endif  // SWIRL_BASE_CHECK_H_
