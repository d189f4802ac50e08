#include "transport/conformance/peer_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "transport/conformance/conformance.h"

extern char** environ;

namespace swirl::conformance {
namespace {

absl::Status ErrnoStatus(const char* what, int err) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(err)));
}

// Waits up to `timeout` for `pid` to exit; true if it did (and was reaped, status in *status).
bool WaitExit(pid_t pid, absl::Duration timeout, int* status) {
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd >= 0) {
    pollfd pfd{pidfd, POLLIN, 0};
    int ms = static_cast<int>(absl::ToInt64Milliseconds(timeout));
    int n;
    do {
      n = ::poll(&pfd, 1, ms);
    } while (n < 0 && errno == EINTR);
    close(pidfd);
    if (n <= 0) return false;
  }
  return waitpid(pid, status, 0) == pid;
}

}  // namespace

std::string PeerBinaryPath() {
  const std::string relative = "transport/conformance/conformance_peer";
  for (const char* root_var : {"TEST_SRCDIR", "RUNFILES_DIR"}) {
    const char* root = std::getenv(root_var);
    if (root == nullptr) continue;
    const char* workspace = std::getenv("TEST_WORKSPACE");
    std::string path = absl::StrCat(root, "/", workspace ? workspace : "swirl", "/", relative);
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    std::string dir(self, static_cast<size_t>(n));
    dir.resize(dir.rfind('/'));
    return dir + "/conformance_peer";
  }
  return "conformance_peer";
}

absl::StatusOr<std::unique_ptr<PeerProcess>> PeerProcess::Spawn(const std::string& device,
                                                                absl::Duration timeout) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return ErrnoStatus("socketpair", errno);
  }
  // The child's end at a fixed descriptor, without close-on-exec (dup2 clears it).
  const int child_fd = sv[1] == 100 ? 101 : 100;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, sv[1], child_fd);
  const std::string path = PeerBinaryPath();
  const std::string fd_arg = std::to_string(child_fd);
  std::vector<char*> argv = {const_cast<char*>(path.c_str()), const_cast<char*>(device.c_str()),
                             const_cast<char*>(fd_arg.c_str()), nullptr};
  pid_t pid = -1;
  int err = posix_spawn(&pid, path.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(sv[1]);
  if (err != 0) {
    close(sv[0]);
    return absl::InternalError(absl::StrCat("posix_spawn ", path, ": ", std::strerror(err)));
  }
  std::unique_ptr<PeerProcess> peer(new PeerProcess(pid, sv[0]));
  if (absl::Status s = peer->ReadFully(&peer->hello_, sizeof(peer->hello_), absl::Now() + timeout);
      !s.ok()) {
    return s;
  }
  if (peer->hello_.magic != kPeerMagic) return absl::DataLossError("peer hello: bad magic");
  return peer;
}

PeerProcess::~PeerProcess() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  Reap(absl::Seconds(5));
}

void PeerProcess::Reap(absl::Duration grace) {
  if (pid_ <= 0) return;
  int status;
  if (!WaitExit(pid_, grace, &status)) {
    kill(pid_, SIGKILL);
    waitpid(pid_, &status, 0);
  }
  pid_ = -1;
}

absl::Status PeerProcess::ReadFully(void* data, size_t length, absl::Time deadline) {
  char* p = static_cast<char*>(data);
  size_t got = 0;
  while (got < length) {
    pollfd pfd{fd_, POLLIN, 0};
    int n = ::poll(&pfd, 1, 0);
    if (n < 0 && errno != EINTR) return ErrnoStatus("poll(peer socket)", errno);
    if (n > 0) {
      ssize_t r = read(fd_, p + got, length - got);
      if (r == 0) return absl::UnavailableError("the peer closed its socket");
      if (r < 0 && errno != EINTR && errno != EAGAIN) return ErrnoStatus("read(peer)", errno);
      if (r > 0) got += static_cast<size_t>(r);
      continue;
    }
    if (absl::Now() >= deadline) return absl::DeadlineExceededError("the peer did not answer");
    ProgressAll();
  }
  return absl::OkStatus();
}

absl::Status PeerProcess::WriteFully(const void* data, size_t length) {
  const char* p = static_cast<const char*>(data);
  while (length > 0) {
    ssize_t n = send(fd_, p, length, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return ErrnoStatus("send(peer)", errno);
    p += n;
    length -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status PeerProcess::Connect(const verbs::PeerAddress& ours, absl::Duration timeout) {
  if (absl::Status s = WriteFully(&ours, sizeof(ours)); !s.ok()) return s;
  char ready = 0;
  if (absl::Status s = ReadFully(&ready, 1, absl::Now() + timeout); !s.ok()) return s;
  return ready == 1 ? absl::OkStatus() : absl::DataLossError("peer: bad ready byte");
}

absl::StatusOr<uint64_t> PeerProcess::Call(const PeerCommand& command, absl::Duration timeout) {
  if (absl::Status s = WriteFully(&command, sizeof(command)); !s.ok()) return s;
  PeerReply reply{};
  if (absl::Status s = ReadFully(&reply, sizeof(reply), absl::Now() + timeout); !s.ok()) return s;
  if (reply.status != 0) {
    return absl::InternalError(
        absl::StrCat("peer command failed: ", std::strerror(static_cast<int>(reply.status))));
  }
  return reply.value;
}

absl::StatusOr<int> PeerProcess::Exit(absl::Duration timeout) {
  PeerCommand command{};
  command.op = PeerOp::kExit;
  absl::StatusOr<uint64_t> reply = Call(command, timeout);
  if (!reply.ok()) return reply.status();
  int status = 0;
  if (!WaitExit(pid_, timeout, &status)) return absl::DeadlineExceededError("peer did not exit");
  pid_ = -1;
  return status;
}

absl::Status PeerProcess::Kill() {
  if (pid_ <= 0) return absl::FailedPreconditionError("no peer process");
  if (kill(pid_, SIGKILL) != 0) return ErrnoStatus("kill", errno);
  int status;
  if (waitpid(pid_, &status, 0) != pid_) return ErrnoStatus("waitpid", errno);
  pid_ = -1;
  if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL) {
    return absl::InternalError("peer did not die of SIGKILL");
  }
  return absl::OkStatus();
}

}  // namespace swirl::conformance
