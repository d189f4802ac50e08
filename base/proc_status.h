// A process's resident memory, as /proc/<pid>/status reports it (VmRSS), for the tests and
// benchmarks that measure memory per connection.

#ifndef SWIRL_BASE_PROC_STATUS_H_
#define SWIRL_BASE_PROC_STATUS_H_

#include <sys/types.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

namespace swirl {

// VmRSS of process `pid` (0: this one), in KiB; -1 if it cannot be read (the process is gone).
inline int64_t ResidentKib(pid_t pid) {
  std::ifstream in(pid == 0 ? std::string("/proc/self/status")
                            : "/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtoll(line.c_str() + 6, nullptr, 10);
  }
  return -1;
}

}  // namespace swirl

#endif  // SWIRL_BASE_PROC_STATUS_H_
