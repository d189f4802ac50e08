#include "base/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace swirl {
namespace {

LogLevel LevelFromEnv() {
  const char* env = std::getenv("SWIRL_LOG_LEVEL");
  if (env == nullptr) return LogLevel::kWarning;
  std::string value = absl::AsciiStrToLower(env);
  if (value == "debug") return LogLevel::kDebug;
  if (value == "info") return LogLevel::kInfo;
  if (value == "error") return LogLevel::kError;
  return LogLevel::kWarning;
}

std::atomic<int>& Threshold() {
  static std::atomic<int> threshold{static_cast<int>(LevelFromEnv())};
  return threshold;
}

const char* LevelLetter(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "D";
    case LogLevel::kInfo: return "I";
    case LogLevel::kWarning: return "W";
    case LogLevel::kError: return "E";
  }
  return "?";
}

}  // namespace

LogLevel CurrentLogLevel() {
  return static_cast<LogLevel>(Threshold().load(std::memory_order_relaxed));
}

void SetLogLevel(LogLevel level) {
  Threshold().store(static_cast<int>(level), std::memory_order_relaxed);
}

void LogLine(LogLevel level, const char* file, int line, absl::string_view message) {
  const char* base = std::strrchr(file, '/');
  std::string text = absl::StrCat(
      LevelLetter(level), absl::FormatTime("%H:%M:%E6S", absl::Now(), absl::LocalTimeZone()), " ",
      getpid(), " ", base ? base + 1 : file, ":", line, "] ", message, "\n");
  // One write so lines from concurrent threads and processes do not interleave.
  ssize_t ignored = write(STDERR_FILENO, text.data(), text.size());
  (void)ignored;
}

}  // namespace swirl
