// The test side of the two-process tests: spawns conformance_peer (posix_spawn, never a bare
// fork: the soft device runs threads) and talks to it over a socketpair (peer_protocol.h).

#ifndef SWIRL_TRANSPORT_CONFORMANCE_PEER_PROCESS_H_
#define SWIRL_TRANSPORT_CONFORMANCE_PEER_PROCESS_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/conformance/peer_protocol.h"
#include "transport/verbs/verbs.h"

namespace swirl::conformance {

// Where the conformance_peer binary is: in the test's runfiles under Bazel, else beside the
// running binary.
std::string PeerBinaryPath();

class PeerProcess {
 public:
  // Starts a peer on `device` and reads its hello.
  static absl::StatusOr<std::unique_ptr<PeerProcess>> Spawn(const std::string& device,
                                                            absl::Duration timeout);
  // Closes the socket (the peer exits on end of file); kills it if it has not exited soon.
  ~PeerProcess();
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  const PeerHello& hello() const { return hello_; }
  pid_t pid() const { return pid_; }

  // Sends our address and waits until the peer's QP is connected to it.
  absl::Status Connect(const verbs::PeerAddress& ours, absl::Duration timeout);
  // One command, one reply (its value). Progresses the tracked CQs while waiting.
  absl::StatusOr<uint64_t> Call(const PeerCommand& command, absl::Duration timeout);
  // Asks the peer to exit and returns its wait status.
  absl::StatusOr<int> Exit(absl::Duration timeout);
  // SIGKILL, then reap.
  absl::Status Kill();

 private:
  PeerProcess(pid_t pid, int fd) : pid_(pid), fd_(fd) {}
  absl::Status ReadFully(void* data, size_t length, absl::Time deadline);
  absl::Status WriteFully(const void* data, size_t length);
  void Reap(absl::Duration grace);

  pid_t pid_;
  int fd_;
  PeerHello hello_{};
};

}  // namespace swirl::conformance

#endif  // SWIRL_TRANSPORT_CONFORMANCE_PEER_PROCESS_H_
