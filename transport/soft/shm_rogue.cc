// An attacker process for shm_link_test: another user on the host. It drops to the uid it is
// given, then either listens at a soft device's abstract socket name (posing as a peer's HCA)
// or connects to one with a well-formed hello, and writes what happened to a report file
// (opened before dropping privileges). Exits 0 whatever it saw: the test judges the report.
//
//   shm_rogue --uid=65534 --report=FILE --listen=GIDHEX
//       "listening", then "hello BYTES FDS" (what the first message carried) or "closed"
//   shm_rogue --uid=65534 --report=FILE --connect=GIDHEX --dst_qpn=N --src_gid=GIDHEX
//       --src_qpn=N: a hello from the peer the QP expects (its GID and QPN);
//       "sent", then "closed" (the device dropped us) or "open" (10 s passed)

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "transport/soft/wire.h"

namespace {

FILE* report = nullptr;

void Report(const std::string& line) {
  std::fprintf(report, "%s\n", line.c_str());
  std::fflush(report);
}

std::string Flag(int argc, char** argv, const char* name) {
  const std::string prefix = std::string("--") + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0) return argv[i] + prefix.size();
  }
  return "";
}

sockaddr_un AddressFor(const std::string& gid_hex, socklen_t* len) {
  sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  const std::string name = "swirl-soft1-" + gid_hex;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

// The shared-memory hello (docs/SOFT_WIRE.md), keyless.
struct Hello {
  uint64_t magic = 0x4f4c4c4548575331ull;
  uint32_t version = 4;
  uint32_t src_qpn = 0x321;
  uint32_t dst_qpn = 0;
  uint32_t flags = 0;
  uint8_t src_gid[16] = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8};
  uint64_t segment_size = 0;
  uint8_t nonce[16] = {};
};

int Listen(const std::string& gid_hex) {
  int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
  socklen_t len;
  sockaddr_un addr = AddressFor(gid_hex, &len);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, 8) != 0) {
    Report(std::string("cannot listen: ") + std::strerror(errno));
    return 0;
  }
  Report("listening");
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, 20000) != 1) {
    Report("nobody came");
    return 0;
  }
  int conn = accept(fd, nullptr, nullptr);
  char buf[256];
  char control[CMSG_SPACE(4 * sizeof(int))];
  iovec iov{buf, sizeof(buf)};
  msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  pollfd q{conn, POLLIN, 0};
  poll(&q, 1, 10000);
  const ssize_t n = recvmsg(conn, &msg, MSG_DONTWAIT);
  int fds = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); n > 0 && c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      fds += static_cast<int>((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
    }
  }
  Report(n > 0 ? "hello " + std::to_string(n) + " " + std::to_string(fds) : "closed");
  return 0;
}

int Connect(const std::string& gid_hex, uint32_t dst_qpn, const std::string& src_gid,
            uint32_t src_qpn) {
  // A segment as the protocol wants it (sealed, valid header): only the uid is wrong.
  const uint64_t ring = swirl::soft::wire::kMinRingSize;
  const uint64_t size = swirl::soft::wire::kRingsOffset + 2 * ring;
  int memfd = memfd_create("rogue", MFD_ALLOW_SEALING);
  if (memfd < 0 || ftruncate(memfd, static_cast<off_t>(size)) != 0) return 0;
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  auto* header = static_cast<swirl::soft::wire::SegmentHeader*>(base);
  header->magic = swirl::soft::wire::kSegmentMagic;
  header->version = swirl::soft::wire::kWireVersion;
  header->qp_num = src_qpn;
  header->segment_size = size;
  header->request_ring_offset = swirl::soft::wire::kRingsOffset;
  header->request_ring_size = ring;
  header->response_ring_offset = swirl::soft::wire::kRingsOffset + ring;
  header->response_ring_size = ring;
  fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL);
  int wake = eventfd(0, 0);
  int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
  socklen_t len;
  sockaddr_un addr = AddressFor(gid_hex, &len);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    Report(std::string("cannot connect: ") + std::strerror(errno));
    return 0;
  }
  Hello hello;
  hello.dst_qpn = dst_qpn;
  hello.src_qpn = src_qpn;
  for (size_t i = 0; i < 16 && 2 * i + 1 < src_gid.size(); ++i) {
    hello.src_gid[i] = static_cast<uint8_t>(std::stoul(src_gid.substr(2 * i, 2), nullptr, 16));
  }
  hello.segment_size = size;
  int fds[2] = {memfd, wake};
  char control[CMSG_SPACE(sizeof(fds))];
  std::memset(control, 0, sizeof(control));
  iovec iov{&hello, sizeof(hello)};
  msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(fds));
  std::memcpy(CMSG_DATA(c), fds, sizeof(fds));
  // The device may have closed already (it checks the uid at accept): then the send fails.
  const bool sent = sendmsg(fd, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof(hello));
  Report(sent ? "sent" : "refused before the hello");
  pollfd p{fd, POLLIN, 0};
  char byte;
  const bool closed = !sent || (poll(&p, 1, 10000) == 1 && recv(fd, &byte, 1, 0) <= 0);
  Report(closed ? "closed" : "open");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  report = std::fopen(Flag(argc, argv, "report").c_str(), "w");
  if (report == nullptr) return 2;
  const uid_t uid = static_cast<uid_t>(std::atoi(Flag(argc, argv, "uid").c_str()));
  // The raw system calls: this process has one thread, and glibc's wrappers would try to
  // change the ids of every thread.
  if (syscall(SYS_setgroups, 0, nullptr) != 0 || syscall(SYS_setgid, uid) != 0 ||
      syscall(SYS_setuid, uid) != 0 || getuid() != uid) {
    Report(std::string("cannot become uid ") + std::to_string(uid) + ": " + std::strerror(errno));
    return 0;
  }
  if (!Flag(argc, argv, "listen").empty()) return Listen(Flag(argc, argv, "listen"));
  return Connect(Flag(argc, argv, "connect"),
                 static_cast<uint32_t>(std::strtoul(Flag(argc, argv, "dst_qpn").c_str(), nullptr, 0)),
                 Flag(argc, argv, "src_gid"),
                 static_cast<uint32_t>(std::strtoul(Flag(argc, argv, "src_qpn").c_str(), nullptr, 0)));
}
