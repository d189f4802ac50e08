#include "rpc/testing/process.h"

#include <dirent.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace swirl::testing {

absl::StatusOr<ChildProcess> ChildProcess::Spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid;
  if (int err = posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ); err != 0) {
    return absl::InternalError(absl::StrCat("posix_spawn ", args[0], ": errno ", err));
  }
  return ChildProcess(pid);
}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  std::swap(pid_, other.pid_);
  return *this;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

void ChildProcess::Signal(int signal) {
  if (pid_ > 0) kill(pid_, signal);
}

absl::StatusOr<int> ChildProcess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    int status = 0;
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (absl::Now() >= deadline) return absl::DeadlineExceededError("child still running");
    absl::SleepFor(absl::Milliseconds(2));
  }
}

int64_t ChildProcess::RssKb() const {
  std::ifstream in(absl::StrCat("/proc/", pid_, "/status"));
  std::string key;
  while (in >> key) {
    if (key == "VmRSS:") {
      int64_t kb;
      in >> kb;
      return kb;
    }
  }
  return -1;
}

int ChildProcess::OpenFds() const {
  DIR* dir = opendir(absl::StrCat("/proc/", pid_, "/fd").c_str());
  if (dir == nullptr) return -1;
  int n = 0;
  while (readdir(dir) != nullptr) ++n;
  closedir(dir);
  return n - 2;
}

absl::StatusOr<std::pair<ChildProcess, int>> SpawnServer(const std::string& binary,
                                                        std::vector<std::string> args,
                                                        absl::Duration timeout) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string port_file =
      absl::StrCat(tmp ? tmp : "/tmp", "/port-", getpid(), "-", absl::ToUnixNanos(absl::Now()));
  std::vector<std::string> argv = {binary, "--port_file=" + port_file};
  argv.insert(argv.end(), args.begin(), args.end());
  auto child = ChildProcess::Spawn(argv);
  if (!child.ok()) return child.status();
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    std::ifstream in(port_file);
    int port = 0;
    if (in >> port && port > 0) {
      std::remove(port_file.c_str());
      return std::make_pair(std::move(*child), port);
    }
    auto exited = child->Wait(absl::ZeroDuration());
    if (exited.ok()) return absl::InternalError(absl::StrCat(binary, " exited with ", *exited));
    absl::SleepFor(absl::Milliseconds(5));
  }
  return absl::DeadlineExceededError(absl::StrCat(binary, " did not report its port"));
}

}  // namespace swirl::testing
