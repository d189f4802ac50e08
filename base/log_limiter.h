// Rate limits for log lines that someone else can cause: a peer that sends bad hellos, or makes
// our QPs fail, must not be able to fill the log (or spend our time writing it).
//
//   static swirl::LogLimiter limiter;  // or one per object
//   SWIRL_LOG_LIMITED(limiter, WARNING, "refused a link: %s", why);
//
// At most `burst` lines per second pass; the next line that passes says how many were held back.

#ifndef SWIRL_BASE_LOG_LIMITER_H_
#define SWIRL_BASE_LOG_LIMITER_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/log.h"
#include "base/mutex.h"

namespace swirl {

class LogLimiter {
 public:
  explicit LogLimiter(int burst = 5) : burst_(burst) {}
  LogLimiter(const LogLimiter&) = delete;
  LogLimiter& operator=(const LogLimiter&) = delete;

  // True if a line may be written now; then *held_back is the number of lines turned down
  // since the last one that passed.
  bool Allow(uint64_t* held_back) {
    const absl::Time now = absl::Now();
    swirl::MutexLock lock(&mu_);
    if (now - window_start_ >= absl::Seconds(1)) {
      window_start_ = now;
      in_window_ = 0;
    }
    if (in_window_ >= burst_) {
      ++held_back_;
      return false;
    }
    ++in_window_;
    *held_back = held_back_;
    held_back_ = 0;
    return true;
  }

  // Lines turned down since the last one that passed (for tests).
  uint64_t held_back() const {
    swirl::MutexLock lock(&mu_);
    return held_back_;
  }

 private:
  const int burst_;
  mutable swirl::Mutex mu_;
  absl::Time window_start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int in_window_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t held_back_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace swirl

// SWIRL_LOG through `limiter` (a swirl::LogLimiter); a line below the log level costs nothing.
#define SWIRL_LOG_LIMITED(limiter, level, ...)                                       \
  do {                                                                               \
    uint64_t swirl_held_back_ = 0;                                                   \
    if (SWIRL_LOG_LEVEL_##level >= ::swirl::CurrentLogLevel() &&                     \
        (limiter).Allow(&swirl_held_back_)) {                                        \
      std::string swirl_line_ = ::absl::StrFormat(__VA_ARGS__);                      \
      if (swirl_held_back_ != 0) {                                                   \
        ::absl::StrAppend(&swirl_line_, " (", swirl_held_back_,                      \
                          " similar lines held back)");                              \
      }                                                                              \
      ::swirl::LogLine(SWIRL_LOG_LEVEL_##level, __FILE__, __LINE__, swirl_line_);    \
    }                                                                                \
  } while (0)

#endif  // SWIRL_BASE_LOG_LIMITER_H_
