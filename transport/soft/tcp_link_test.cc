// The soft device's TCP fabric (SWIRL_SOFT_TCP, set for this test in BUILD) against a peer that
// is not the soft device: a hand-written TCP client that speaks the link protocol as
// docs/SOFT_WIRE.md describes it, correctly and not. The conformance suite's *_tcp targets cover
// the verbs semantics over this fabric; this test covers what a hostile or foreign peer can do.

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "transport/soft/soft_device.h"
#include "transport/soft/tcp_peer.h"
#include "transport/soft/test_side.h"
#include "transport/soft/wire.h"
#include "transport/verbs/verbs.h"

namespace swirl::soft {
namespace {

using tcp_peer::Hello;
using tcp_peer::Record;
using tcp_peer::TcpGid;

ibv_gid GidOf(Side& side) { return *side.ctx->QueryGid(1, 0); }

void PostRecv(Side& s, uint64_t wr_id) {
  ibv_sge sge{reinterpret_cast<uint64_t>(s.buf.data()), 4096, s.mr->lkey()};
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad;
  ASSERT_EQ(ibv_post_recv(s.qp->get(), &wr, &bad), 0);
}

void PostSend(Side& s, uint64_t wr_id, const char* text) {
  ibv_sge sge{reinterpret_cast<uint64_t>(text), static_cast<uint32_t>(std::strlen(text) + 1), 0};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_send_wr* bad;
  ASSERT_EQ(ibv_post_send(s.qp->get(), &wr, &bad), 0);
}

// Polls `cqs` until the first yields a completion (10 s at most).
ibv_wc Wait(std::vector<Side*> sides) {
  ibv_wc wc;
  ibv_wc ignored[4];
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    if (sides[0]->cq->Poll(1, &wc) == 1) return wc;
    for (size_t i = 1; i < sides.size(); ++i) sides[i]->cq->Poll(0, ignored);
  }
  ADD_FAILURE() << "no completion within 10 s";
  std::memset(&wc, 0, sizeof(wc));
  wc.status = IBV_WC_GENERAL_ERR;
  return wc;
}

// A healthy pair on soft0 and soft1, to show that others keep working.
struct HealthyPair {
  Side a = MakeSide("soft0");
  Side b = MakeSide("soft1");
  explicit HealthyPair(verbs::ConnectOptions options = {}) {
    EXPECT_TRUE(ConnectSides(a, b, options).ok());
  }
  void Check(const char* text) {
    PostRecv(b, 1);
    PostSend(a, 2, text);
    ibv_wc wc = Wait({&b, &a});
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
    EXPECT_STREQ(b.buf.data(), text);
    wc = Wait({&a, &b});
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  }
};

// A TCP peer that is not the soft device. It listens (so a QP's own link toward its GID has
// somewhere to go) and connects to a device to send it whatever a test wants.
// The last port of the kernel's ephemeral range (net.ipv4.ip_local_port_range): connections a
// device opens, and the ports its listeners take, come from that range.
int EphemeralPortEnd() {
  int low, high;
  tcp_peer::EphemeralPortRange(&low, &high);
  return high;
}

class Rogue {
 public:
  // `high`: listen on a port above the ephemeral range, so that a device's GID (whose port is
  // ephemeral) sorts below ours and its QPs open the connection to us (TcpConnectsFirst).
  explicit Rogue(bool high = false) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(sa);
    bool bound = false;
    const int ephemeral_end = EphemeralPortEnd();
    for (int port = 65535; high && !bound && port > ephemeral_end; --port) {
      sa.sin_port = htons(static_cast<uint16_t>(port));
      bound = bind(listen_fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0;
    }
    EXPECT_TRUE(bound || !high) << "no free port above the ephemeral range (ending at "
                                << ephemeral_end << ", net.ipv4.ip_local_port_range)";
    if (!high) {
      EXPECT_EQ(bind(listen_fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    }
    EXPECT_EQ(listen(listen_fd_, 8), 0);
    EXPECT_EQ(getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&sa), &len), 0);
    gid_ = TcpGid(sa.sin_port);
  }
  ~Rogue() {
    if (fd_ >= 0) close(fd_);
    close(listen_fd_);
  }
  const ibv_gid& gid() const { return gid_; }
  // From now on nothing listens at our GID: links toward it are refused.
  void StopListening() {
    close(listen_fd_);
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);  // a fresh fd for the destructor
  }
  void Hangup() {
    close(fd_);
    fd_ = -1;
  }
  // Takes the connection a device opened to our listener (it completed in the backlog), or -1
  // if none came within 10 s.
  int AcceptOne() {
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 10000) != 1) {
      ADD_FAILURE() << "no connection reached the rogue's listener within 10 s";
      return -1;
    }
    return accept(listen_fd_, nullptr, nullptr);
  }

  void ConnectTo(const ibv_gid& device_gid) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    std::memcpy(&sa.sin_port, device_gid.raw + 8, 2);
    std::memcpy(&sa.sin_addr.s_addr, device_gid.raw + 12, 4);
    ASSERT_EQ(connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  }
  void Send(const void* data, size_t len) {
    ASSERT_EQ(send(fd_, data, len, MSG_NOSIGNAL), static_cast<ssize_t>(len));
  }
  // The link's first frame: a whole SEND of `text` (with its NUL) at position 0 of the
  // request ring, with message number `msn`, acknowledging everything before `ack`.
  void SendFirstSend(uint32_t msn, uint32_t ack, const char* text) {
    const size_t length = std::strlen(text) + 1;
    char frame[wire::kFrameAlign] = {};
    ASSERT_LE(sizeof(wire::FrameHeader) + length, sizeof(frame));
    wire::FrameHeader header{};
    header.stamp = wire::kStampValid | 0;
    header.op = wire::kOpSend;
    header.flags = wire::kFlagFirst | wire::kFlagLast;
    header.rnr_retry = 7;
    header.length = static_cast<uint32_t>(length);
    header.msn = msn;
    header.ack = ack;
    header.total_length = static_cast<uint32_t>(length);
    std::memcpy(frame, &header, sizeof(header));
    std::memcpy(frame + sizeof(header), text, length);
    Record record{1, 0, 0, sizeof(frame), 0};
    Send(&record, sizeof(record));
    Send(frame, sizeof(frame));
  }
  // True if the device closes our connection within 10 s while `poll_side` is polled.
  bool DroppedBy(Side* poll_side) {
    absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      if (poll_side != nullptr) poll_side->cq->Poll(0, nullptr);
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 10) == 1) {
        char byte;
        ssize_t n = recv(fd_, &byte, 1, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
      }
    }
    return false;
  }

 private:
  int listen_fd_ = -1;
  int fd_ = -1;
  ibv_gid gid_{};
};

// A hello from `from_gid`'s QP `from_qpn` to `to`'s QP, whose requests before MSN `acked` it
// acknowledges.
Hello HelloFor(const ibv_gid& from_gid, uint32_t from_qpn, Side& to, uint32_t acked = 0) {
  Hello hello;
  hello.src_qpn = from_qpn;
  hello.dst_qpn = to.qp->qp_num();
  hello.src_gid = from_gid;
  hello.control[2] = acked;
  return hello;
}

// True once the device at `device` has handled every connection event before this call: its
// HCA thread takes them in order, so a later garbage connection it drops marks the point.
// `poll_side` (if any) is polled meanwhile.
bool HcaCaughtUp(const ibv_gid& device, Side* poll_side) {
  Rogue sentinel;
  sentinel.ConnectTo(device);
  char garbage[sizeof(Hello)] = {};
  sentinel.Send(garbage, sizeof(garbage));
  return sentinel.DroppedBy(poll_side);
}

// The QP numbers and PSNs of a victim QP linked to a hand-written peer.
constexpr uint32_t kRogueQpn = 0x123, kRoguePsn = 500, kVictimPsn = 100;

// Connects `victim` toward `rogue` (made with high = true, so that the victim's GID sorts first
// and the victim opens the connection).
void ConnectVictimFirst(Side& victim, const Rogue& rogue, const verbs::ConnectOptions& options) {
  ASSERT_LT(std::memcmp(GidOf(victim).raw, rogue.gid().raw, 16), 0)
      << "the victim's GID must sort first, for the victim to open the connection";
  ASSERT_TRUE(
      victim.qp->Connect({rogue.gid(), 0, kRogueQpn, kRoguePsn}, kVictimPsn, options).ok());
}

// Established TCP connections in this process's network namespace with an end at `port`.
int EstablishedAt(uint16_t port) {
  FILE* f = std::fopen("/proc/net/tcp", "r");
  if (f == nullptr) return -1;
  char line[512];
  int count = 0;
  if (std::fgets(line, sizeof(line), f) == nullptr) {  // the header
    std::fclose(f);
    return -1;
  }
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned local_port, remote_port, state;
    if (std::sscanf(line, "%*d: %*8x:%x %*8x:%x %x", &local_port, &remote_port, &state) != 3) {
      continue;
    }
    if (state == 1 && (local_port == port || remote_port == port)) ++count;
  }
  std::fclose(f);
  return count;
}

uint16_t PortOf(const ibv_gid& gid) {
  uint16_t port;
  std::memcpy(&port, gid.raw + 8, 2);
  return ntohs(port);
}

// Both directions of a QP pair share one connection (its two ends, both in this process), so
// TCP's acknowledgements ride on the replies.
TEST(TcpFabric, AQpPairSharesOneConnection) {
  HealthyPair pair;
  pair.Check("there");
  PostRecv(pair.a, 3);
  PostSend(pair.b, 4, "and back");
  ibv_wc wc = Wait({&pair.a, &pair.b});
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_STREQ(pair.a.buf.data(), "and back");
  // The devices listen on ports of their own (a device closed by an earlier test listens
  // elsewhere when opened again), so every connection at them is this pair's. One connection,
  // seen from both ends: two entries, each with the accepting device's port at one end. Two
  // connections would make four.
  const int a = EstablishedAt(PortOf(GidOf(pair.a)));
  const int b = EstablishedAt(PortOf(GidOf(pair.b)));
  ASSERT_GE(a, 0) << "no /proc/net/tcp";
  EXPECT_EQ(a + b, 2) << a << " at soft0's port, " << b << " at soft1's";
}

TEST(TcpFabric, GidsAreIpv4MappedAndTwoDevicesTalk) {
  HealthyPair pair;
  const ibv_gid a = GidOf(pair.a);
  const ibv_gid b = GidOf(pair.b);
  EXPECT_EQ(a.raw[10], 0xff);
  EXPECT_EQ(a.raw[11], 0xff);
  EXPECT_EQ(a.raw[12], 127);
  EXPECT_NE(std::memcmp(&a, &b, sizeof(a)), 0) << "two devices, one GID";
  pair.Check("over tcp");
}

// The environment is read when a device is first opened in the process, so each case below
// uses a device name no other test opens.
class ScopedFabric {
 public:
  explicit ScopedFabric(const std::string& spec) { setenv("SWIRL_SOFT_TCP", spec.c_str(), 1); }
  ~ScopedFabric() { setenv("SWIRL_SOFT_TCP", "127.0.0.1", 1); }
};

TEST(TcpFabric, AFixedPortIsSoft0sAndSoftNListensNAbove) {
  // A port that is free now, and the one 7 above it is very likely free as well.
  int probe = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(sa);
  ASSERT_EQ(bind(probe, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(getsockname(probe, reinterpret_cast<sockaddr*>(&sa), &len), 0);
  close(probe);
  const uint16_t base = ntohs(sa.sin_port) - 7;
  ScopedFabric fabric("127.0.0.1:" + std::to_string(base));
  Side side = MakeSide("soft7");
  const ibv_gid gid = GidOf(side);
  uint16_t port;
  std::memcpy(&port, gid.raw + 8, 2);
  EXPECT_EQ(ntohs(port), base + 7);
}

TEST(TcpFabric, AMalformedSettingFailsTheOpenSayingWhy) {
  for (const char* spec : {"not-an-address", "127.0.0.1:99999", "0.0.0.0", "127.0.0.1:1:2"}) {
    ScopedFabric fabric(spec);
    absl::StatusOr<std::unique_ptr<verbs::DeviceOps>> device = OpenSoftDevice("soft9");
    ASSERT_FALSE(device.ok()) << spec;
    EXPECT_NE(device.status().message().find("SWIRL_SOFT_TCP"), std::string::npos)
        << device.status();
  }
}

TEST(TcpFabric, GarbageHelloIsDropped) {
  HealthyPair pair;
  Rogue rogue;
  rogue.ConnectTo(GidOf(pair.a));
  char garbage[sizeof(Hello)];
  std::memset(garbage, 0x5a, sizeof(garbage));
  rogue.Send(garbage, sizeof(garbage));
  EXPECT_TRUE(rogue.DroppedBy(nullptr));
  pair.Check("still here");
}

TEST(TcpFabric, HelloWhoseGidIsNotItsAddressIsDropped) {
  HealthyPair pair;
  Side victim = MakeSide("soft0");
  Rogue rogue;
  ibv_gid claimed = rogue.gid();
  claimed.raw[15] = 2;  // says 127.0.0.2, comes from 127.0.0.1
  verbs::ConnectOptions options;
  ASSERT_TRUE(victim.qp->Connect({claimed, 0, 0x123, 500}, 100, options).ok());
  rogue.ConnectTo(GidOf(victim));
  Hello hello = HelloFor(claimed, 0x123, victim);
  rogue.Send(&hello, sizeof(hello));
  EXPECT_TRUE(rogue.DroppedBy(&victim));
  pair.Check("still here");
}

// A peer that speaks the protocol: its SEND arrives; then a record outside the mirror's ring
// fails that QP alone (its work completes in error) and the process goes on.
TEST(TcpFabric, ForeignPeerSendsThenViolatesAndOnlyItsQpFails) {
  HealthyPair pair;
  Side victim = MakeSide("soft0");
  Rogue rogue;
  verbs::ConnectOptions options;
  const uint32_t rogue_qpn = 0x123, rogue_psn = 500, victim_psn = 100;
  ASSERT_TRUE(victim.qp->Connect({rogue.gid(), 0, rogue_qpn, rogue_psn}, victim_psn, options).ok());
  PostRecv(victim, 9);
  rogue.ConnectTo(GidOf(victim));
  Hello hello = HelloFor(rogue.gid(), rogue_qpn, victim, victim_psn);  // nothing acked yet
  rogue.Send(&hello, sizeof(hello));

  const char text[] = "from elsewhere";
  rogue.SendFirstSend(rogue_psn, victim_psn, text);
  ibv_wc wc = Wait({&victim});
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.wr_id, 9u);
  EXPECT_EQ(wc.src_qp, rogue_qpn);
  EXPECT_STREQ(victim.buf.data(), text);

  // Now a frame past the end of the ring (position and length both wrong).
  Record bad{1, 0, 0, static_cast<uint32_t>(wire::kMinRingSize), wire::kFrameAlign * 5};
  rogue.Send(&bad, sizeof(bad));
  std::vector<char> filler(wire::kMinRingSize, 0x7f);
  rogue.Send(filler.data(), filler.size());
  PostSend(victim, 10, "into the void");
  wc = Wait({&victim});
  EXPECT_EQ(wc.wr_id, 10u);
  // The link drops the connection that carried the bad record, which fails the QP as a vanished
  // peer does: RETRY_EXC_ERR if the SEND was outstanding then, a flush if the QP was in ERR by
  // the time it was posted.
  EXPECT_TRUE(wc.status == IBV_WC_RETRY_EXC_ERR || wc.status == IBV_WC_WR_FLUSH_ERR)
      << "the QP whose peer broke the protocol must fail: " << ibv_wc_status_str(wc.status);
  EXPECT_EQ(*victim.qp->QueryState(), IBV_QPS_ERR);
  pair.Check("others unaffected");
}

TEST(TcpFabric, AConnectionThatNeverSaysHelloIsDropped) {
  HealthyPair pair;
  Rogue rogue;
  rogue.ConnectTo(GidOf(pair.a));
  EXPECT_TRUE(rogue.DroppedBy(nullptr)) << "a silent connection must not be kept forever";
  pair.Check("still here");
}

// A hello from a stranger that then hangs up, waiting at a QP that has no link yet, must not
// fail the link the QP makes later: only a link the QP adopted may fail it.
TEST(TcpFabric, AStrangersHangupCannotFailTheLinkAQpMakesLater) {
  Side a = MakeSide("soft0");
  Side b = MakeSide("soft1");
  verbs::ConnectOptions options;
  ASSERT_TRUE(a.qp->ToInit(options).ok());
  Rogue rogue;
  rogue.ConnectTo(GidOf(a));
  Hello hello = HelloFor(rogue.gid(), 0x123, a);
  rogue.Send(&hello, sizeof(hello));
  rogue.Hangup();
  ASSERT_TRUE(HcaCaughtUp(GidOf(a), nullptr));  // it has seen the stranger's hello and hangup
  auto aa = *a.qp->LocalAddress(100, options);
  auto ba = *b.qp->LocalAddress(200, options);
  ASSERT_TRUE(a.qp->ToRtr(ba, options).ok());
  ASSERT_TRUE(a.qp->ToRts(100, options).ok());
  ASSERT_TRUE(b.qp->Connect(aa, 200, options).ok());
  for (int i = 0; i < 5; ++i) {
    PostRecv(b, 1);
    PostSend(a, 2, "later link");
    ibv_wc wc = Wait({&b, &a});
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
    wc = Wait({&a, &b});
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
  }
}

// The QP opens the connection (its GID sorts first) and is refused, while a connection the
// peer opened itself delivers the peer's segment: the QP's requests have no way out, so it fails
// instead of waiting forever.
TEST(TcpFabric, AQpWhoseOwnLinkCannotConnectFails) {
  Side victim = MakeSide("soft0");
  Rogue rogue(/*high=*/true);
  rogue.StopListening();
  verbs::ConnectOptions options;
  options.timeout = 0;  // no ACK timeout: only the link's failure can end a wait
  ASSERT_NO_FATAL_FAILURE(ConnectVictimFirst(victim, rogue, options));
  rogue.ConnectTo(GidOf(victim));
  Hello hello = HelloFor(rogue.gid(), kRogueQpn, victim, kVictimPsn);
  rogue.Send(&hello, sizeof(hello));
  PostSend(victim, 11, "nowhere to go");
  ibv_wc wc = Wait({&victim});
  EXPECT_EQ(wc.wr_id, 11u);
  // RETRY_EXC_ERR as for a vanished peer, or a flush if the HCA thread (which assists CQs
  // nobody polls) failed the QP before the SEND was posted.
  EXPECT_TRUE(wc.status == IBV_WC_RETRY_EXC_ERR || wc.status == IBV_WC_WR_FLUSH_ERR)
      << ibv_wc_status_str(wc.status);
}

// Reads what arrives on `fd` for up to 10 s and returns true once `text` has come by.
bool Arrives(int fd, const char* text, Side* poll_side) {
  std::string seen;
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    poll_side->cq->Poll(0, nullptr);
    char buf[4096];
    ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) seen.append(buf, static_cast<size_t>(n));
    if (n == 0) return false;
    if (seen.find(text) != std::string::npos) return true;
  }
  return false;
}

// The QP opened its connection to the peer, then linked with a segment the peer sent on a
// connection of its own. A matching hello that arrives later on the QP's own connection is not
// adopted, and must not cost the QP that connection: its frames still go out on it.
TEST(TcpFabric, AHelloOnOurOwnConnectionThatIsNotAdoptedLeavesItOpen) {
  Side victim = MakeSide("soft0");
  Rogue rogue(/*high=*/true);
  ASSERT_NO_FATAL_FAILURE(ConnectVictimFirst(victim, rogue, {}));
  Hello hello = HelloFor(rogue.gid(), kRogueQpn, victim, kVictimPsn);
  rogue.ConnectTo(GidOf(victim));  // our own connection, with the segment the victim adopts
  rogue.Send(&hello, sizeof(hello));
  PostRecv(victim, 1);
  rogue.SendFirstSend(kRoguePsn, kVictimPsn, "linked");
  ibv_wc wc = Wait({&victim});
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
  // Now the same hello on the connection the victim opened.
  const int theirs = rogue.AcceptOne();
  ASSERT_GE(theirs, 0);
  ASSERT_EQ(send(theirs, &hello, sizeof(hello), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(hello)));
  // Once the HCA thread has taken the hello, a poll lets the QP look at (and turn down) the
  // candidate before it sends.
  ASSERT_TRUE(HcaCaughtUp(GidOf(victim), &victim));
  victim.cq->Poll(0, nullptr);
  PostSend(victim, 2, "still goes out");
  EXPECT_TRUE(Arrives(theirs, "still goes out", &victim))
      << "the victim's frames stopped: its own connection was closed";
  close(theirs);
}

// The peer answers on the QP's own connection, acknowledging the QP's SEND, and hangs up at
// once (it failed right after), all before the QP polls. As on RC, the SEND it acknowledged
// completes successfully; only then does the QP fail, its peer being gone.
TEST(TcpFabric, APeerThatAcknowledgesThenHangsUpCompletesWhatItAcknowledged) {
  Side victim = MakeSide("soft0");
  Rogue rogue(/*high=*/true);
  ASSERT_NO_FATAL_FAILURE(ConnectVictimFirst(victim, rogue, {}));
  PostSend(victim, 7, "taken");
  const int theirs = rogue.AcceptOne();
  ASSERT_GE(theirs, 0);
  Hello hello = HelloFor(rogue.gid(), kRogueQpn, victim, kVictimPsn + 1);  // acks the SEND
  ASSERT_EQ(send(theirs, &hello, sizeof(hello), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(hello)));
  // Read what the victim sent (its hello, then its SEND's record), so that closing sends FIN,
  // not a reset.
  char sink[4096];
  size_t got = 0;
  const size_t expected = sizeof(Hello) + sizeof(Record) + wire::kFrameAlign;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (got < expected && absl::Now() < deadline) {
    const ssize_t n = recv(theirs, sink, sizeof(sink), MSG_DONTWAIT);
    if (n > 0) got += static_cast<size_t>(n);
  }
  ASSERT_GE(got, expected);
  close(theirs);
  ibv_wc wc = Wait({&victim});
  EXPECT_EQ(wc.wr_id, 7u);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
}

// More connections owing their hello than the device takes at once: the rest wait in the
// backlog (they are not closed), so a real peer that connects behind them still links.
TEST(TcpFabric, ABurstOfSilentConnectionsDelaysButDoesNotBreakARealLink) {
  std::vector<std::unique_ptr<Rogue>> silent;
  Side probe = MakeSide("soft0");
  const ibv_gid soft0 = GidOf(probe);
  for (int i = 0; i < 80; ++i) {
    silent.push_back(std::make_unique<Rogue>());
    silent.back()->ConnectTo(soft0);
  }
  // soft1's link into soft0 waits behind the 80 until their hellos are overdue (1 s): longer
  // than the default ACK timeout x retries (0.54 s), so this pair is given more.
  verbs::ConnectOptions patient;
  patient.timeout = 18;  // 1.07 s x 8 tries
  HealthyPair pair(patient);
  pair.Check("behind the crowd");
}

// Two candidates that both name the QP's peer: the first one's connection already ended (a
// stale link, or someone posing as the peer who hung up), the second is live. The QP links
// with the live one.
TEST(TcpFabric, ADeadCandidateIsPassedOverForALiveOne) {
  Side victim = MakeSide("soft0");
  verbs::ConnectOptions options;
  ASSERT_TRUE(victim.qp->ToInit(options).ok());
  Rogue peer;
  const uint32_t peer_qpn = 0x456, peer_psn = 700, victim_psn = 100;
  Hello hello = HelloFor(peer.gid(), peer_qpn, victim, victim_psn);
  {
    Rogue stale;
    stale.ConnectTo(GidOf(victim));
    stale.Send(&hello, sizeof(hello));
    stale.Hangup();
  }
  peer.ConnectTo(GidOf(victim));
  peer.Send(&hello, sizeof(hello));
  ASSERT_TRUE(HcaCaughtUp(GidOf(victim), nullptr));  // both hellos and the hangup taken

  ASSERT_TRUE(victim.qp->ToRtr({peer.gid(), 0, peer_qpn, peer_psn}, options).ok());
  ASSERT_TRUE(victim.qp->ToRts(victim_psn, options).ok());
  PostRecv(victim, 12);
  const char text[] = "live one";
  peer.SendFirstSend(peer_psn, victim_psn, text);
  ibv_wc wc = Wait({&victim});
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.wr_id, 12u);
  EXPECT_STREQ(victim.buf.data(), text);
}

}  // namespace
}  // namespace swirl::soft
