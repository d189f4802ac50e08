// `./swirl demo`: an echo server and client in two processes over the default device (the soft
// device on machines without RDMA hardware), then a client with a wrong token, then a graceful
// server shutdown. Prints what happened at each step.

#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

extern char** environ;

namespace {

std::string SelfDir() {
  char path[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return ".";
  path[n] = 0;
  std::string s(path);
  return s.substr(0, s.rfind('/'));
}

pid_t Spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return -1;
  return pid;
}

int WaitExit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

int main() {
  const std::string dir = SelfDir();
  const std::string token = absl::StrFormat("demo-%016x", absl::Uniform<uint64_t>(absl::BitGen()));
  const std::string port_file = absl::StrCat("/tmp/swirl-demo-port-", getpid());
  std::remove(port_file.c_str());

  std::printf("== swirl demo: echo server and client in two processes ==\n");
  std::printf("-- starting echo_server (worker pinned to core 1)\n");
  std::fflush(stdout);
  pid_t server = Spawn({dir + "/echo_server", "--address=127.0.0.1:0", "--token=" + token,
                        "--cores=1", "--port_file=" + port_file});
  if (server < 0) {
    std::fprintf(stderr, "demo: cannot start %s/echo_server\n", dir.c_str());
    return 1;
  }
  int port = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (port == 0 && absl::Now() < deadline) {
    std::ifstream in(port_file);
    if (!(in >> port)) port = 0;
    if (port == 0) absl::SleepFor(absl::Milliseconds(10));
  }
  std::remove(port_file.c_str());
  if (port == 0) {
    std::fprintf(stderr, "demo: echo_server did not come up\n");
    kill(server, SIGKILL);
    WaitExit(server);
    return 1;
  }
  const std::string address = absl::StrCat("127.0.0.1:", port);

  std::printf("-- echo_client: 20000 calls of 64 bytes, calling thread pinned to core 0\n");
  std::fflush(stdout);
  int client_rc = WaitExit(Spawn({dir + "/echo_client", "--server=" + address,
                                  "--token=" + token, "--iterations=20000", "--size=64",
                                  "--core=0"}));

  std::printf("-- echo_client with a wrong token (must be refused before any QP exists)\n");
  std::fflush(stdout);
  int refused_rc = WaitExit(Spawn({dir + "/echo_client", "--server=" + address,
                                   "--token=wrong", "--iterations=1"}));

  std::printf("-- stopping echo_server (SIGTERM: graceful shutdown)\n");
  std::fflush(stdout);
  kill(server, SIGTERM);
  int server_rc = WaitExit(server);

  const bool ok = client_rc == 0 && refused_rc != 0 && server_rc == 0;
  std::printf("== demo %s: client %s, wrong-token client %s, server exit %d ==\n",
              ok ? "succeeded" : "FAILED", client_rc == 0 ? "ok" : "failed",
              refused_rc != 0 ? "refused" : "NOT refused", server_rc);
  return ok ? 0 : 1;
}
