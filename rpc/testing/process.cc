#include "rpc/testing/process.h"

#include <dirent.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>

#include "gtest/gtest.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/proc_status.h"
#include "absl/time/clock.h"

extern char** environ;

namespace swirl::testing {

absl::StatusOr<ChildProcess> ChildProcess::Spawn(const std::vector<std::string>& args,
                                                 const std::vector<std::string>& env) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  for (char** e = environ; *e != nullptr; ++e) {
    const absl::string_view var(*e);
    const absl::string_view name = var.substr(0, var.find('='));
    bool replaced = false;
    for (const auto& mine : env) replaced |= absl::StartsWith(mine, absl::StrCat(name, "="));
    if (!replaced) envp.push_back(*e);
  }
  envp.push_back(nullptr);
  pid_t pid;
  if (int err = posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data());
      err != 0) {
    return absl::InternalError(absl::StrCat("posix_spawn ", args[0], ": errno ", err));
  }
  return ChildProcess(pid, args[0]);
}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  std::swap(pid_, other.pid_);
  std::swap(name_, other.name_);
  std::swap(stop_timeout_, other.stop_timeout_);
  return *this;
}

ChildProcess::~ChildProcess() {
  if (pid_ <= 0) return;
  const pid_t pid = pid_;
  absl::StatusOr<int> exit_code = Stop(stop_timeout_);
  if (!exit_code.ok()) {
    ADD_FAILURE() << name_ << " (pid " << pid << ") did not exit within "
                  << absl::FormatDuration(stop_timeout_) << " of SIGTERM and was killed";
  } else if (*exit_code != 0) {
    ADD_FAILURE() << name_ << " (pid " << pid << ") ended abnormally: "
                  << (*exit_code > 128 ? absl::StrCat("signal ", *exit_code - 128)
                                       : absl::StrCat("exit status ", *exit_code))
                  << " (its output is in this test's log)";
  }
}

absl::StatusOr<int> ChildProcess::Stop(absl::Duration timeout) {
  if (pid_ <= 0) return absl::FailedPreconditionError("no child");
  kill(pid_, SIGTERM);
  absl::StatusOr<int> exit_code = Wait(timeout);
  if (!exit_code.ok()) Kill();
  return exit_code;
}

void ChildProcess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
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

absl::Status ChildProcess::StopAndWait(absl::Duration timeout) {
  Signal(SIGSTOP);
  const absl::Time deadline = absl::Now() + timeout;
  const std::string tasks = absl::StrCat("/proc/", pid_, "/task");
  for (;;) {
    bool all_stopped = true;
    int seen = 0;
    if (DIR* dir = opendir(tasks.c_str()); dir != nullptr) {
      while (dirent* entry = readdir(dir)) {
        if (entry->d_name[0] == '.') continue;
        std::ifstream in(absl::StrCat(tasks, "/", entry->d_name, "/stat"));
        std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        // "pid (comm) S ...": the state follows the last ')' (comm may hold anything).
        const size_t paren = stat.rfind(')');
        if (paren == std::string::npos || paren + 2 >= stat.size()) continue;
        ++seen;
        const char state = stat[paren + 2];
        if (state != 'T' && state != 't') all_stopped = false;
      }
      closedir(dir);
    }
    if (seen > 0 && all_stopped) return absl::OkStatus();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(name_, " did not stop"));
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
}

int64_t ChildProcess::RssKb() const { return ResidentKib(pid_); }

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
                                                        absl::Duration timeout,
                                                        const std::vector<std::string>& env) {
  return SpawnServerVia({}, binary, std::move(args), timeout, env);
}

absl::StatusOr<std::pair<ChildProcess, int>> SpawnServerVia(
    const std::vector<std::string>& launcher, const std::string& binary,
    std::vector<std::string> args, absl::Duration timeout, const std::vector<std::string>& env) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string port_file =
      absl::StrCat(tmp ? tmp : "/tmp", "/port-", getpid(), "-", absl::ToUnixNanos(absl::Now()));
  std::vector<std::string> argv = launcher;
  argv.push_back(binary);
  argv.push_back("--port_file=" + port_file);
  argv.insert(argv.end(), args.begin(), args.end());
  auto child = ChildProcess::Spawn(argv, env);
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
