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

// A child process whose end is part of the test: a server that crashed after the test's last
// check (a segfault in a rogue client's teardown, an ASan or LeakSanitizer report at exit) must
// fail the test, so a child is never ended by SIGKILL unless the test means to kill it.
class ChildProcess {
 public:
  // How long the destructor and Stop() wait for a child to exit after SIGTERM (sanitizer
  // builds check for leaks at exit, which takes a while).
  static constexpr absl::Duration kStopTimeout = absl::Seconds(60);

  // `env`: "NAME=VALUE" entries added to this process's environment for the child (replacing
  // a variable of the same name), e.g. SWIRL_SOFT_FAULTS for a child that misbehaves.
  static absl::StatusOr<ChildProcess> Spawn(const std::vector<std::string>& argv,
                                            const std::vector<std::string>& env = {});
  ChildProcess(ChildProcess&& other) noexcept
      : pid_(other.pid_), name_(std::move(other.name_)), stop_timeout_(other.stop_timeout_) {
    other.pid_ = -1;
  }
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  // A child still running is stopped as Stop() does, and the current test fails
  // (ADD_FAILURE) unless it exited with status 0: killed by a signal, a non-zero status, or no
  // exit within the stop timeout (then it is SIGKILLed). A child the test already reaped with
  // Wait(), Stop() or Kill() is the test's to judge.
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  // How long the destructor waits after SIGTERM (kStopTimeout unless set).
  void set_stop_timeout(absl::Duration timeout) { stop_timeout_ = timeout; }
  void Signal(int signal);
  // SIGSTOP, then waits (bounded) until every thread of the child is stopped: kill() returns
  // before the stop takes effect, and on a busy machine a child can run on for a while.
  absl::Status StopAndWait(absl::Duration timeout = absl::Seconds(10));
  // Exit code (128+signal if killed), or DeadlineExceeded (the child is still running).
  absl::StatusOr<int> Wait(absl::Duration timeout);
  // SIGTERM, then waits up to `timeout`: the exit code, or DeadlineExceeded (the child was
  // then SIGKILLed and reaped).
  absl::StatusOr<int> Stop(absl::Duration timeout = kStopTimeout);
  // For tests that mean to kill: SIGKILL and reap, whatever the child was doing.
  void Kill();
  // Resident set size in KiB, from /proc.
  int64_t RssKb() const;
  int OpenFds() const;

 private:
  ChildProcess(pid_t pid, std::string name) : pid_(pid), name_(std::move(name)) {}
  pid_t pid_ = -1;
  std::string name_;  // argv[0], for messages
  absl::Duration stop_timeout_ = kStopTimeout;
};

// Starts `binary` with `args` plus --port_file, and waits (bounded) for the port; `env` as
// ChildProcess::Spawn's.
absl::StatusOr<std::pair<ChildProcess, int>> SpawnServer(const std::string& binary,
                                                        std::vector<std::string> args,
                                                        absl::Duration timeout = absl::Seconds(30),
                                                        const std::vector<std::string>& env = {});
// The same, run through `launcher` (a command that runs the rest of its arguments, e.g.
// {"/usr/sbin/ip", "netns", "exec", NAME}: the server in a network namespace). The launcher
// must exec the server, so that the child is the server.
absl::StatusOr<std::pair<ChildProcess, int>> SpawnServerVia(
    const std::vector<std::string>& launcher, const std::string& binary,
    std::vector<std::string> args, absl::Duration timeout = absl::Seconds(30),
    const std::vector<std::string>& env = {});

}  // namespace swirl::testing

#endif  // SWIRL_RPC_TESTING_PROCESS_H_
