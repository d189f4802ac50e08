// Test helper: a child process (posix_spawn, no fork-without-exec) and a server child that
// reports its port through a file.

#ifndef SWIRL_RPC_TESTING_PROCESS_H_
#define SWIRL_RPC_TESTING_PROCESS_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace swirl::testing {

class ChildProcess {
 public:
  static absl::StatusOr<ChildProcess> Spawn(const std::vector<std::string>& argv);
  ChildProcess(ChildProcess&& other) noexcept : pid_(other.pid_) { other.pid_ = -1; }
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ~ChildProcess();  // SIGKILL + reap if still running

  pid_t pid() const { return pid_; }
  void Signal(int signal);
  // Exit code (128+signal if killed), or DeadlineExceeded.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  // Resident set size in KiB, from /proc.
  int64_t RssKb() const;
  int OpenFds() const;

 private:
  explicit ChildProcess(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
};

// Starts `binary` with `args` plus --port_file, and waits (bounded) for the port.
absl::StatusOr<std::pair<ChildProcess, int>> SpawnServer(const std::string& binary,
                                                        std::vector<std::string> args,
                                                        absl::Duration timeout = absl::Seconds(30));

}  // namespace swirl::testing

#endif  // SWIRL_RPC_TESTING_PROCESS_H_
