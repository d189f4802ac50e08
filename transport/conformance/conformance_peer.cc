// The other process of the two-process conformance tests (see peer_protocol.h).
//
//   conformance_peer <device> <socket fd>
//
// Exits 0 when told to or when the socket closes; 1 on any setup or protocol failure (with a
// line on stderr). It busy-polls, like the tests: on the soft device that is what moves data.

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/numbers.h"
#include "transport/conformance/peer_protocol.h"
#include "transport/device.h"
#include "transport/verbs/verbs.h"

namespace swirl::conformance {
namespace {

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "conformance_peer[%d]: %s\n", static_cast<int>(getpid()), what.c_str());
  std::exit(1);
}

void WriteAll(int fd, const void* data, size_t length) {
  const char* p = static_cast<const char*>(data);
  while (length > 0) {
    ssize_t n = write(fd, p, length);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) Die(std::string("write: ") + std::strerror(errno));
    p += n;
    length -= static_cast<size_t>(n);
  }
}

// False on a clean end of file before any byte.
bool ReadAll(int fd, void* data, size_t length) {
  char* p = static_cast<char*>(data);
  size_t got = 0;
  while (got < length) {
    ssize_t n = read(fd, p + got, length - got);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 && got == 0) return false;
    if (n <= 0) Die(std::string("read: ") + std::strerror(errno));
    got += static_cast<size_t>(n);
  }
  return true;
}

template <typename T>
T Check(absl::StatusOr<T> value, const char* what) {
  if (!value.ok()) Die(std::string(what) + ": " + value.status().ToString());
  return std::move(*value);
}

class Peer {
 public:
  Peer(const std::string& device, int fd) : fd_(fd) {
    ctx_ = Check(OpenDevice(device), "OpenDevice");
    pd_ = Check(verbs::ProtectionDomain::Create(ctx_), "ProtectionDomain::Create");
    cq_ = Check(verbs::CompletionQueue::Create(ctx_, 1024), "CompletionQueue::Create");
    verbs::QueuePairConfig config;
    config.send_cq = cq_;
    config.recv_cq = cq_;
    config.max_send_wr = kPeerSlots;
    config.max_recv_wr = kPeerSlots;
    qp_ = Check(verbs::QueuePair::Create(pd_, config), "QueuePair::Create");
    buffer_ = static_cast<char*>(std::aligned_alloc(4096, kPeerBufferSize));
    std::memset(buffer_, 0, kPeerBufferSize);
    mr_ =
        Check(verbs::MemoryRegion::Register(pd_, buffer_, kPeerBufferSize,
                                            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                                IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC),
              "MemoryRegion::Register");
  }

  ~Peer() {
    qp_.reset();
    mr_.reset();
    std::free(buffer_);
  }

  void Handshake(const verbs::ConnectOptions& options) {
    PeerHello hello{};
    hello.magic = kPeerMagic;
    hello.rkey = mr_->rkey();
    hello.buffer_addr = reinterpret_cast<uint64_t>(buffer_);
    hello.buffer_size = kPeerBufferSize;
    hello.address = Check(qp_->LocalAddress(kPeerPsn, options), "LocalAddress");
    WriteAll(fd_, &hello, sizeof(hello));
    verbs::PeerAddress test_address;
    if (!ReadAll(fd_, &test_address, sizeof(test_address))) Die("socket closed in handshake");
    if (absl::Status s = qp_->Connect(test_address, kPeerPsn, options); !s.ok()) {
      Die("Connect: " + s.ToString());
    }
    const char ready = 1;
    WriteAll(fd_, &ready, 1);
  }

  // Returns at exit or end of file.
  void Serve() {
    for (;;) {
      PollCompletions();
      pollfd pfd{fd_, POLLIN, 0};
      int n = ::poll(&pfd, 1, 0);
      if (n < 0 && errno != EINTR) Die(std::string("poll: ") + std::strerror(errno));
      if (n <= 0) continue;
      PeerCommand command;
      if (!ReadAll(fd_, &command, sizeof(command))) return;
      PeerReply reply{0, 0};
      bool exit_after = false;
      switch (command.op) {
        case PeerOp::kPostReceives:
          for (uint32_t i = 0; i < command.count && i < kPeerSlots && reply.status == 0; ++i) {
            reply.status = PostRecv(i);
          }
          break;
        case PeerOp::kChecksum:
          if (!InBounds(command)) {
            reply.status = EINVAL;
          } else {
            reply.value = PeerChecksum(buffer_ + command.offset, command.length);
          }
          break;
        case PeerOp::kFill:
          if (!InBounds(command)) {
            reply.status = EINVAL;
          } else {
            for (uint64_t i = 0; i < command.length; ++i) {
              buffer_[command.offset + i] = static_cast<char>(PatternByte(command.seed, i));
            }
          }
          break;
        case PeerOp::kExit:
          exit_after = true;
          break;
        default:
          reply.status = EINVAL;
          break;
      }
      WriteAll(fd_, &reply, sizeof(reply));
      if (exit_after) return;
    }
  }

 private:
  static bool InBounds(const PeerCommand& command) {
    return command.offset <= kPeerBufferSize && command.length <= kPeerBufferSize - command.offset;
  }

  int PostRecv(uint32_t slot) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buffer_ + kPeerRecvOffset + slot * kPeerSlotSize),
                static_cast<uint32_t>(kPeerSlotSize), mr_->lkey()};
    ibv_recv_wr wr{};
    wr.wr_id = slot;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    return ibv_post_recv(qp_->get(), &wr, &bad);
  }

  // Echoes every completed receive back as a SEND and reposts it.
  void PollCompletions() {
    ibv_wc wc[16];
    int n = cq_->Poll(16, wc);
    if (n < 0) Die("ibv_poll_cq failed");
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) {
        std::fprintf(stderr, "conformance_peer: completion wr_id %lu status %d (%s)\n",
                     static_cast<unsigned long>(wc[i].wr_id), wc[i].status,
                     ibv_wc_status_str(wc[i].status));
        continue;
      }
      if (wc[i].opcode != IBV_WC_RECV) continue;
      const uint32_t slot = static_cast<uint32_t>(wc[i].wr_id);
      char* tx = buffer_ + kPeerSendOffset + slot * kPeerSlotSize;
      std::memcpy(tx, buffer_ + kPeerRecvOffset + slot * kPeerSlotSize, wc[i].byte_len);
      ibv_sge sge{reinterpret_cast<uint64_t>(tx), wc[i].byte_len, mr_->lkey()};
      ibv_send_wr wr{};
      wr.wr_id = slot;
      wr.opcode = IBV_WR_SEND;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      ibv_send_wr* bad = nullptr;
      if (int rc = ibv_post_send(qp_->get(), &wr, &bad); rc != 0) {
        Die(std::string("ibv_post_send(echo): ") + std::strerror(rc));
      }
      if (int rc = PostRecv(slot); rc != 0) {
        Die(std::string("ibv_post_recv: ") + std::strerror(rc));
      }
    }
  }

  int fd_;
  std::shared_ptr<verbs::Context> ctx_;
  std::shared_ptr<verbs::ProtectionDomain> pd_;
  std::shared_ptr<verbs::CompletionQueue> cq_;
  std::unique_ptr<verbs::QueuePair> qp_;
  char* buffer_ = nullptr;
  std::unique_ptr<verbs::MemoryRegion> mr_;
};

}  // namespace
}  // namespace swirl::conformance

int main(int argc, char** argv) {
  using swirl::conformance::Die;
  if (argc != 3) Die("usage: conformance_peer <device> <socket fd>");
  int fd;
  if (!absl::SimpleAtoi(argv[2], &fd) || fd < 0) Die("bad socket fd");
  swirl::verbs::ConnectOptions options;
  if (const char* env = std::getenv("SWIRL_CONFORMANCE_GID_INDEX")) {
    int index;
    if (absl::SimpleAtoi(env, &index)) options.gid_index = index;
  }
  swirl::conformance::Peer peer(argv[1], fd);
  peer.Handshake(options);
  peer.Serve();
  return 0;
}
