#include "base/check.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace swirl::internal {

void CheckFailed(const char* file, int line, const char* condition) {
  // One write(2), no allocation beyond the message: the process may be in any state.
  const std::string message = absl::StrCat(file, ":", line, ": check failed: ", condition, "\n");
  ssize_t ignored = write(STDERR_FILENO, message.data(), message.size());
  (void)ignored;
  abort();
}

}  // namespace swirl::internal
