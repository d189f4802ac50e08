// Minimal leveled logging to stderr (Abseil 20220623, the Debian 12 version, has no absl/log).
//
//   SWIRL_LOG(INFO, "connected %s qpn=%u", peer, qpn);
//
// Levels: DEBUG < INFO < WARNING < ERROR. The threshold comes from SWIRL_LOG_LEVEL (debug, info,
// warning, error; default warning) and can be changed with SetLogLevel. Logging is never on a hot
// path; each line is formatted with absl::StrFormat and written with one write(2).

#ifndef SWIRL_BASE_LOG_H_
#define SWIRL_BASE_LOG_H_

#include "absl/strings/string_view.h"

#include "absl/strings/str_format.h"

namespace swirl {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

LogLevel CurrentLogLevel();
void SetLogLevel(LogLevel level);
void LogLine(LogLevel level, const char* file, int line, absl::string_view message);

}  // namespace swirl

#define SWIRL_LOG_LEVEL_DEBUG ::swirl::LogLevel::kDebug
#define SWIRL_LOG_LEVEL_INFO ::swirl::LogLevel::kInfo
#define SWIRL_LOG_LEVEL_WARNING ::swirl::LogLevel::kWarning
#define SWIRL_LOG_LEVEL_ERROR ::swirl::LogLevel::kError

#define SWIRL_LOG(level, ...)                                                      \
  do {                                                                             \
    if (SWIRL_LOG_LEVEL_##level >= ::swirl::CurrentLogLevel()) {                   \
      ::swirl::LogLine(SWIRL_LOG_LEVEL_##level, __FILE__, __LINE__,                \
                       ::absl::StrFormat(__VA_ARGS__));                            \
    }                                                                              \
  } while (0)

#endif  // SWIRL_BASE_LOG_H_
