// A client of rpc/testing/test_server, run as a separate process by tests that kill or stop it
// in the middle of its work (rpc/process_faults_test.cc). It connects to --server and then, one
// call after another until it is killed or a call fails:
//   --mode=upload    test.E2E/Sum of a --size bulk attachment (checked against the answer)
//   --mode=download  test.E2E/Fill of --size bytes (checked against the pattern)
//   --mode=echo      test.E2E/Echo of a short message
// Where it is, for a test that has stopped it (SIGSTOP) and wants to know whether a call was
// in flight: --state_file holds "<phase> <calls done>", phase 1 from just before a call starts
// until it has completed, else 0 (rewritten in place; read it only while the client is stopped).
// Exit: 2 if a call fails or its answer is wrong (with a message on stderr), 3 if it cannot
// connect.

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "rpc/testing/test_data.h"
#include "rpc/wire.h"
#include "swirl/call.h"
#include "swirl/channel.h"

ABSL_FLAG(std::string, server, "", "the test server's control-plane address (host:port)");
ABSL_FLAG(std::string, token, "e2e", "authentication token");
ABSL_FLAG(std::string, mode, "upload", "upload, download or echo");
ABSL_FLAG(int64_t, size, 8 << 20, "bytes per bulk transfer");
ABSL_FLAG(std::string, state_file, "", "where to write \"<phase> <calls done>\"");
ABSL_FLAG(int, keepalive_ms, 200, "TransportOptions::keepalive");

namespace {

using swirl::testing::Fnv;
using swirl::testing::Pattern;

// Rewrites the state file in place (one fixed-width record, so a reader never sees a mix).
class StateFile {
 public:
  explicit StateFile(const std::string& path)
      : fd_(path.empty() ? -1 : open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)) {}
  ~StateFile() {
    if (fd_ >= 0) close(fd_);
  }
  void Write(int phase, uint64_t done) {
    if (fd_ < 0) return;
    const std::string record = absl::StrFormat("%d %020u\n", phase, done);
    (void)!pwrite(fd_, record.data(), record.size(), 0);
  }

 private:
  const int fd_;
};

int Fail(const std::string& what) {
  std::fprintf(stderr, "load_client: %s\n", what.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  swirl::ChannelOptions options;
  options.auth_token = absl::GetFlag(FLAGS_token);
  options.allow_plaintext_token = true;  // a test's private link (netns_test's veth pair)
  options.transport.keepalive = absl::Milliseconds(absl::GetFlag(FLAGS_keepalive_ms));
  options.reconnect.enabled = false;  // a lost connection ends this client: the test kills it
  auto channel = swirl::Channel::Create(absl::GetFlag(FLAGS_server), options);
  if (!channel.ok()) {
    std::fprintf(stderr, "load_client: %s\n", channel.status().ToString().c_str());
    return 3;
  }
  const std::string mode = absl::GetFlag(FLAGS_mode);
  const size_t size = static_cast<size_t>(absl::GetFlag(FLAGS_size));
  auto bulk = (*channel)->AllocateBulk(size);
  if (!bulk.ok()) return Fail(bulk.status().ToString());
  for (size_t i = 0; i < size; ++i) bulk->data()[i] = Pattern(i);
  bulk->resize(size);
  const std::string expected_sum = absl::StrCat(size, ":", Fnv(bulk->view()));

  StateFile state(absl::GetFlag(FLAGS_state_file));
  swirl::CallOptions call_options;
  call_options.timeout = absl::Seconds(30);
  for (uint64_t done = 0;; ++done) {
    std::string out;
    state.Write(1, done);
    absl::Status s;
    if (mode == "upload") {
      call_options.request_bulk = &*bulk;
      s = swirl::CallRaw(**channel, swirl::rpc_wire::MethodId("/test.E2E/Sum"), "", &out,
                         call_options);
      if (s.ok() && out != expected_sum) return Fail(absl::StrCat("Sum said ", out));
    } else if (mode == "download") {
      call_options.response_bulk = &*bulk;
      s = swirl::CallRaw(**channel, swirl::rpc_wire::MethodId("/test.E2E/Fill"),
                         std::to_string(size), &out, call_options);
      if (s.ok()) {
        if (bulk->size() != size) return Fail(absl::StrCat("Fill returned ", bulk->size()));
        for (size_t i = 0; i < size; ++i) {
          if (bulk->data()[i] != Pattern(i)) return Fail(absl::StrCat("Fill byte ", i, " wrong"));
        }
      }
    } else if (mode == "echo") {
      s = swirl::CallRaw(**channel, swirl::rpc_wire::MethodId("/test.E2E/Echo"), "ping", &out,
                         call_options);
      if (s.ok() && out != "ping") return Fail(absl::StrCat("Echo said ", out));
    } else {
      return Fail(absl::StrCat("unknown --mode ", mode));
    }
    if (!s.ok()) return Fail(s.ToString());
    state.Write(0, done + 1);
  }
}
