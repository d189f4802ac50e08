// Fuzzes the soft device's TCP fabric (transport/soft/tcp_link.cc): the hello and the records a
// peer sends on a link, over a real TCP connection from 127.0.0.1 to a device listening there
// (SWIRL_SOFT_TCP=127.0.0.1, set below before any device opens), as tcp_link_test's hand-written
// peer does.
//
// Each input gets a fresh victim QP on soft0, connected toward a peer GID that this harness
// owns (a port below the kernel's ephemeral range, so the victim's GID sorts after it and the
// victim waits for the peer to open the connection: TcpConnectsFirst), with a receive posted and,
// if the input says so, a SEND outstanding. The harness connects to soft0 and sends a hello,
// then the rest of the input as the link's byte stream (records), then ends its direction. The
// input's first byte chooses how much of the hello is right (HelloBits); the next 112 bytes give
// the hello's fields that are not. The victim is polled (it adopts the link, reads the records,
// answers on the connection, which the harness drains) until soft0 has closed the connection or
// failed the victim's link, for at most two seconds.
//
// Properties, for every input:
// - the victim ends in RTS or ERR, its receive and its SEND complete at most once each, and a
//   receive that succeeds came from the peer's QP and fits its buffer;
// - soft0 ends the connection or fails the link (it never keeps reading a peer that has gone);
// - once the victim is destroyed, every descriptor soft0 opened for it is closed again (a hostile
//   peer cannot make the device leak);
// - a healthy pair on soft0 and soft1 still carries a message.

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "fuzz/fuzz_support.h"
#include "transport/soft/qp_ops.h"
#include "transport/soft/soft_internal.h"
#include "transport/soft/tcp_peer.h"
#include "transport/soft/test_side.h"
#include "transport/verbs/verbs.h"

namespace {

using swirl::fuzz::Input;
namespace soft = swirl::soft;
namespace tcp_peer = swirl::soft::tcp_peer;

constexpr uint32_t kPeerQpn = 0x123, kPeerPsn = 500, kVictimPsn = 100;
constexpr uint64_t kRecvWrId = 9, kSendWrId = 10;
constexpr uint32_t kRecvLength = 4096;

enum HelloBits : uint8_t {
  kRightIdentity = 1 << 0,  // magic, version, QPNs and GID as the victim expects them
  kRightGeometry = 1 << 1,  // the segment's size and rings as tcp_peer::Hello's defaults
  kRightControl = 1 << 2,   // control words: nothing consumed, nothing acknowledged, active
  kVictimSends = 1 << 3,    // the victim has a SEND outstanding
};

struct Fixture {
  int peer_listen_fd = -1;  // owns the peer GID's port
  ibv_gid peer_gid{};
  ibv_gid device_gid{};
  soft::Side healthy_a, healthy_b;
  uint64_t round = 0;
  int baseline_fds = 0;
};
Fixture* fixture = nullptr;

int OpenFds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

// A port below the kernel's ephemeral range (where devices' ports come from), bound and
// listening on 127.0.0.1, so that a GID with it sorts before any device's.
int ListenBelowEphemeral(uint16_t* port_network_order) {
  int low, high;
  tcp_peer::EphemeralPortRange(&low, &high);
  for (int port = low - 1; port > 1024; --port) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = htons(static_cast<uint16_t>(port));
    if (bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0 && listen(fd, 8) == 0) {
      *port_network_order = sa.sin_port;
      return fd;
    }
    close(fd);
  }
  return -1;
}

bool RoundTrip(soft::Side& a, soft::Side& b, uint64_t i) {
  ibv_sge rs{reinterpret_cast<uint64_t>(b.buf.data()), 64, b.mr->lkey()};
  ibv_recv_wr rwr{i, nullptr, &rs, 1};
  ibv_recv_wr* rbad = nullptr;
  if (ibv_post_recv(b.qp->get(), &rwr, &rbad) != 0) return false;
  ibv_send_wr swr{};
  swr.wr_id = i;
  swr.opcode = IBV_WR_SEND_WITH_IMM;
  swr.imm_data = static_cast<uint32_t>(i);
  swr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* sbad = nullptr;
  if (ibv_post_send(a.qp->get(), &swr, &sbad) != 0) return false;
  bool sent = false, received = false;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (!(sent && received) && absl::Now() < deadline) {
    ibv_wc wc;
    if (a.cq->Poll(1, &wc) == 1) sent = wc.status == IBV_WC_SUCCESS && wc.wr_id == i;
    if (b.cq->Poll(1, &wc) == 1) received = wc.status == IBV_WC_SUCCESS && wc.imm_data == i;
  }
  return sent && received;
}

// Sends all of `bytes` while polling the victim (a peer that stops reading must not wedge us),
// for at most a second; false if the connection failed first.
bool SendAll(int fd, const std::string& bytes, soft::Side& victim) {
  size_t at = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(1);
  while (at < bytes.size() && absl::Now() < deadline) {
    const ssize_t n = send(fd, bytes.data() + at, bytes.size() - at, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      at += static_cast<size_t>(n);
    } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return false;
    }
    victim.cq->Poll(0, nullptr);
  }
  return at == bytes.size();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("SWIRL_SOFT_TCP", "127.0.0.1", 1);
  setenv("SWIRL_LOG_LEVEL", "error", 0);
  fixture = new Fixture;
  uint16_t port = 0;
  fixture->peer_listen_fd = ListenBelowEphemeral(&port);
  FUZZ_CHECK(fixture->peer_listen_fd >= 0, "no free port below the ephemeral range");
  fixture->peer_gid = tcp_peer::TcpGid(port);
  fixture->healthy_a = soft::MakeSide("soft0");
  fixture->healthy_b = soft::MakeSide("soft1");
  FUZZ_CHECK(soft::ConnectSides(fixture->healthy_a, fixture->healthy_b).ok());
  fixture->device_gid = *fixture->healthy_a.ctx->QueryGid(1, 0);
  FUZZ_CHECK(std::memcmp(fixture->peer_gid.raw, fixture->device_gid.raw, 16) < 0,
             "the peer's GID must sort first, for the victim to wait for its connection");
  FUZZ_CHECK(RoundTrip(fixture->healthy_a, fixture->healthy_b, ++fixture->round));
  // One victim first, so that whatever the device opens once (its poll set, say) is counted.
  soft::Side warm = soft::MakeSide("soft0");
  fixture->baseline_fds = OpenFds();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const uint8_t how = in.Take<uint8_t>();
  tcp_peer::Hello given = in.Take<tcp_peer::Hello>();  // missing bytes: zeros
  {
    soft::Side victim = soft::MakeSide("soft0");
    FUZZ_CHECK(victim.qp->Connect({fixture->peer_gid, 0, kPeerQpn, kPeerPsn}, kVictimPsn, {})
                   .ok());
    {
      ibv_sge sge{reinterpret_cast<uint64_t>(victim.buf.data()), kRecvLength, victim.mr->lkey()};
      ibv_recv_wr wr{kRecvWrId, nullptr, &sge, 1};
      ibv_recv_wr* bad = nullptr;
      FUZZ_CHECK(ibv_post_recv(victim.qp->get(), &wr, &bad) == 0);
    }
    if (how & kVictimSends) {
      static const char kText[] = "to the peer";
      ibv_sge sge{reinterpret_cast<uint64_t>(kText), sizeof(kText), 0};
      ibv_send_wr wr{};
      wr.wr_id = kSendWrId;
      wr.opcode = IBV_WR_SEND;
      wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      ibv_send_wr* bad = nullptr;
      FUZZ_CHECK(ibv_post_send(victim.qp->get(), &wr, &bad) == 0);
    }

    tcp_peer::Hello hello = given;
    const tcp_peer::Hello right;
    if (how & kRightIdentity) {
      hello.magic = right.magic;
      hello.version = right.version;
      hello.src_qpn = kPeerQpn;
      hello.dst_qpn = victim.qp->qp_num();
      hello.src_gid = fixture->peer_gid;
    }
    if (how & kRightGeometry) {
      hello.segment_size = right.segment_size;
      hello.request_ring_offset = right.request_ring_offset;
      hello.request_ring_size = right.request_ring_size;
      hello.response_ring_offset = right.response_ring_offset;
      hello.response_ring_size = right.response_ring_size;
    }
    if (how & kRightControl) {
      hello.control[0] = hello.control[1] = 0;
      hello.control[2] = kVictimPsn;  // nothing acknowledged yet
      hello.control[3] = swirl::soft::wire::kLinkActive;
    }
    std::string stream(reinterpret_cast<const char*>(&hello), sizeof(hello));
    stream += in.Rest();

    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    std::memcpy(&sa.sin_port, fixture->device_gid.raw + 8, 2);
    std::memcpy(&sa.sin_addr.s_addr, fixture->device_gid.raw + 12, 4);
    FUZZ_CHECK(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0,
               std::strerror(errno));
    SendAll(fd, stream, victim);
    shutdown(fd, SHUT_WR);

    // Until soft0 closes our connection or fails the victim's link on our end of it.
    soft::SoftQp* qp = soft::AsSoft(victim.qp->get());
    std::vector<ibv_wc> wcs;
    bool ended = false;
    const absl::Time deadline = absl::Now() + absl::Seconds(2);
    while (!ended && absl::Now() < deadline) {
      ibv_wc wc[4];
      for (int n = victim.cq->Poll(4, wc); n > 0; n = victim.cq->Poll(4, wc)) {
        wcs.insert(wcs.end(), wc, wc + n);
      }
      char sink[4096];
      const ssize_t n = recv(fd, sink, sizeof(sink), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        ended = true;
      }
      ended = ended || qp->peer_gone.load(std::memory_order_acquire);
    }
    FUZZ_CHECK(ended, "soft0 neither closed the connection nor failed the link");
    ibv_wc wc[4];
    for (int n = victim.cq->Poll(4, wc); n > 0; n = victim.cq->Poll(4, wc)) {
      wcs.insert(wcs.end(), wc, wc + n);
    }

    const absl::StatusOr<ibv_qp_state> state = victim.qp->QueryState();
    FUZZ_CHECK(state.ok() && (*state == IBV_QPS_RTS || *state == IBV_QPS_ERR),
               absl::StrCat("victim in state ", state.ok() ? *state : -1));
    int receives = 0, sends = 0;
    for (const ibv_wc& c : wcs) {
      if (c.wr_id == kRecvWrId) {
        FUZZ_CHECK(++receives == 1, "the receive completed twice");
        if (c.status == IBV_WC_SUCCESS) {
          FUZZ_CHECK(c.byte_len <= kRecvLength, absl::StrCat(c.byte_len, " bytes received"));
          FUZZ_CHECK(c.src_qp == kPeerQpn, absl::StrCat("from QP ", c.src_qp));
        }
      } else {
        FUZZ_CHECK(c.wr_id == kSendWrId && (how & kVictimSends),
                   absl::StrCat("a completion of wr ", c.wr_id));
        FUZZ_CHECK(++sends == 1, "the SEND completed twice");
      }
    }
    close(fd);
  }  // the victim goes

  // Everything soft0 opened for the victim and its link closes (its HCA thread closes some
  // of it on its next rounds: wait for them).
  const absl::Time deadline = absl::Now() + absl::Seconds(3);
  int fds = OpenFds();
  while (fds > fixture->baseline_fds && absl::Now() < deadline) {
    fixture->healthy_a.cq->Poll(0, nullptr);
    absl::SleepFor(absl::Milliseconds(1));
    fds = OpenFds();
  }
  FUZZ_CHECK(fds <= fixture->baseline_fds,
             absl::StrCat(fds - fixture->baseline_fds, " descriptors more than before"));
  FUZZ_CHECK(RoundTrip(fixture->healthy_a, fixture->healthy_b, ++fixture->round),
             "the healthy pair stopped working");
  return 0;
}
