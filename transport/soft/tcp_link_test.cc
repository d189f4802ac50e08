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
#include "base/log.h"
#include "transport/soft/link_auth.h"
#include "transport/soft/soft_device.h"
#include "transport/soft/soft_internal.h"
#include "transport/soft/tcp_peer.h"
#include "transport/soft/test_side.h"
#include "transport/soft/wire.h"
#include "transport/verbs/verbs.h"

namespace swirl::soft {
namespace {

using tcp_peer::Hello;
using tcp_peer::Record;
using tcp_peer::TcpGid;

// A keyed link's handshake (docs/SOFT_WIRE.md, "Link keys").
struct Challenge {
  uint64_t magic = 0x4350435457535731ull;  // "1WSWTCPC"
  uint32_t flags = 0;                      // 2: seal records
  uint32_t reserved = 0;
  uint8_t nonce[16] = {};
  uint8_t mac[32] = {};
};
static_assert(sizeof(Challenge) == 64);
struct Proof {
  uint64_t magic = 0x5050435457535731ull;  // "1WSWTCPP"
  uint8_t mac[32] = {};
};
static_assert(sizeof(Proof) == 40);
constexpr uint32_t kKeyed = 1, kSeal = 2;

ibv_gid GidOf(Side& side) { return *side.ctx->QueryGid(1, 0); }

LinkKey KeyFrom(uint8_t seed) {
  LinkKey key;
  for (size_t i = 0; i < key.size(); ++i) key[i] = static_cast<uint8_t>(seed + 7 * i);
  return key;
}

// Reads exactly `n` bytes from `fd` within 10 s, polling `poll_side` (if any) meanwhile; false
// if the connection ends or nothing more comes.
bool ReadExact(int fd, void* out, size_t n, Side* poll_side) {
  size_t got = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (got < n && absl::Now() < deadline) {
    if (poll_side != nullptr) poll_side->cq->Poll(0, nullptr);
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 1) != 1) continue;
    const ssize_t k = recv(fd, static_cast<char*>(out) + got, n - got, MSG_DONTWAIT);
    if (k == 0) return false;
    if (k > 0) got += static_cast<size_t>(k);
  }
  return got == n;
}

void SendAll(int fd, const void* data, size_t length) {
  ASSERT_EQ(send(fd, data, length, MSG_NOSIGNAL), static_cast<ssize_t>(length));
}

template <typename T>
absl::Span<const uint8_t> BytesOf(const T& value) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(&value), sizeof(value));
}

// A link's first frame: a whole SEND of `text` (with its NUL) at position `position` of the
// request ring, with message number `msn`, acknowledging everything before `ack`.
void FirstSendFrame(uint32_t msn, uint32_t ack, const char* text, char (&frame)[wire::kFrameAlign],
                    uint64_t position = 0) {
  const size_t length = std::strlen(text) + 1;
  std::memset(frame, 0, sizeof(frame));
  ASSERT_LE(sizeof(wire::FrameHeader) + length, sizeof(frame));
  wire::FrameHeader header{};
  header.stamp = wire::kStampValid | position;
  header.op = wire::kOpSend;
  header.flags = wire::kFlagFirst | wire::kFlagLast;
  header.rnr_retry = 7;
  header.length = static_cast<uint32_t>(length);
  header.msn = msn;
  header.ack = ack;
  header.total_length = static_cast<uint32_t>(length);
  std::memcpy(frame, &header, sizeof(header));
  std::memcpy(frame + sizeof(header), text, length);
}

void PostRecv(Side& s, uint64_t wr_id) { ASSERT_TRUE(PostBufferRecv(s, wr_id).ok()); }
void PostSend(Side& s, uint64_t wr_id, const char* text) {
  ASSERT_TRUE(PostInlineSend(s, wr_id, text).ok());
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

// A healthy pair on soft0 and soft1, to show that others keep working (keyed: both QPs get
// `key`, or a key each).
struct HealthyPair {
  Side a = MakeSide("soft0");
  Side b = MakeSide("soft1");
  explicit HealthyPair(verbs::ConnectOptions options = {}, const LinkKey* key_a = nullptr,
                       const LinkKey* key_b = nullptr) {
    if (key_a != nullptr) {
      EXPECT_TRUE(SetLinkKey(a.qp->get(), *key_a).ok());
    }
    if (key_b != nullptr) {
      EXPECT_TRUE(SetLinkKey(b.qp->get(), *key_b).ok());
    }
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
  int fd() const { return fd_; }
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
    char frame[wire::kFrameAlign];
    FirstSendFrame(msn, ack, text, frame);
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


// ---- Link keys (SetLinkKey): the hand-written peer plays the handshake as docs/SOFT_WIRE.md
// describes it, with MACs and ciphers from link_auth.h's primitives.

// A keyed hello from `from_gid`'s QP `from_qpn` to `to`'s QP, with a fresh nonce.
Hello KeyedHelloFor(const ibv_gid& from_gid, uint32_t from_qpn, Side& to, uint32_t acked = 0,
                    uint32_t flags = kKeyed | kSeal) {
  Hello hello = HelloFor(from_gid, from_qpn, to, acked);
  hello.flags = flags;
  RandomBytes(hello.nonce, sizeof(hello.nonce));
  return hello;
}

Mac MacOf(const LinkKey& key, AuthRole role, const Hello& opener_hello, const ibv_gid& accepter,
          const uint8_t (&nonce)[16], uint32_t flags) {
  Nonce n;
  std::memcpy(n.data(), nonce, n.size());
  return HelloMac(key, role, AuthFabric::kTcp, BytesOf(opener_hello), accepter, n, flags);
}

// The record ciphers of a handshake: ours (the peer's), sealing toward the device and opening
// what it sends. `we_opened`: the hand-written peer opened the connection.
struct Ciphers {
  std::unique_ptr<RecordCipher> out, in;
};
Ciphers CiphersOf(const LinkKey& key, const Hello& opener_hello, const Challenge& challenge,
                  bool we_opened) {
  Nonce opener, accepter;
  std::memcpy(opener.data(), opener_hello.nonce, opener.size());
  std::memcpy(accepter.data(), challenge.nonce, accepter.size());
  return {RecordCipher::Create(key, opener, accepter, we_opened, true),
          RecordCipher::Create(key, opener, accepter, !we_opened, false)};
}

// The opener's part, played on `fd` toward `device`: sends `hello`, reads the device's
// challenge into *challenge (false if the device closed instead), and answers it with a proof
// made with `proof_key`.
bool OpenKeyed(int fd, const Hello& hello, const ibv_gid& device, const LinkKey& proof_key,
               Challenge* challenge, Side* poll_side) {
  SendAll(fd, &hello, sizeof(hello));
  if (!ReadExact(fd, challenge, sizeof(*challenge), poll_side)) return false;
  Proof proof;
  const Mac mac = MacOf(proof_key, AuthRole::kOpener, hello, device, challenge->nonce,
                        challenge->flags);
  std::memcpy(proof.mac, mac.data(), mac.size());
  SendAll(fd, &proof, sizeof(proof));
  return true;
}

// A sealed record: header in the clear (authenticated), body sealed, its tag after it.
std::string SealedRecord(RecordCipher& out, const Record& record, const void* body) {
  std::string unit(sizeof(record) + record.length + kTagBytes, 0);
  std::memcpy(unit.data(), &record, sizeof(record));
  uint8_t tag[kTagBytes];
  EXPECT_TRUE(out.Seal(&record, sizeof(record), body, record.length,
                       unit.data() + sizeof(record), tag));
  std::memcpy(unit.data() + sizeof(record) + record.length, tag, kTagBytes);
  return unit;
}

std::string SealedFirstSend(RecordCipher& out, uint32_t msn, uint32_t ack, const char* text) {
  char frame[wire::kFrameAlign];
  FirstSendFrame(msn, ack, text, frame);
  return SealedRecord(out, Record{1, 0, 0, sizeof(frame), 0}, frame);
}

// The victim's link failed as a vanished peer's does: its next request fails (RETRY_EXC_ERR,
// or a flush if the QP was in ERR by the time it was posted), and nothing else completed
// (a receive the peer's bad record was for stays posted, as on a NIC).
void ExpectLinkFailed(Side& victim, const char* what) {
  PostSend(victim, 99, "after the failure");
  for (int i = 0; i < 8; ++i) {
    ibv_wc wc = Wait({&victim});
    if (wc.wr_id != 99) {  // a receive, flushed as the QP enters ERR: never delivered
      EXPECT_NE(wc.status, IBV_WC_SUCCESS) << what << ": wr " << wc.wr_id << " completed";
      continue;
    }
    EXPECT_TRUE(wc.status == IBV_WC_RETRY_EXC_ERR || wc.status == IBV_WC_WR_FLUSH_ERR)
        << what << ": " << ibv_wc_status_str(wc.status);
    EXPECT_EQ(*victim.qp->QueryState(), IBV_QPS_ERR) << what;
    return;
  }
  ADD_FAILURE() << what << ": the request after the failure never completed";
}

// The victim QP (keyed with `key`, or not) at RTS toward a hand-written peer at `rogue`.
void ConnectVictim(Side& victim, const Rogue& rogue, const LinkKey* key) {
  if (key != nullptr) {
    ASSERT_TRUE(SetLinkKey(victim.qp->get(), *key).ok());
  }
  ASSERT_TRUE(victim.qp->Connect({rogue.gid(), 0, kRogueQpn, kRoguePsn}, kVictimPsn, {}).ok());
}

TEST(TcpLinkKey, APairWithTheSameKeyLinks) {
  const LinkKey key = KeyFrom(1);
  HealthyPair pair({}, &key, &key);
  pair.Check("keyed");
  PostRecv(pair.a, 3);
  PostSend(pair.b, 4, "and back, sealed");
  ibv_wc wc = Wait({&pair.a, &pair.b});
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_STREQ(pair.a.buf.data(), "and back, sealed");
}

// Two QPs given different keys never link: the requester fails as toward an absent peer.
TEST(TcpLinkKey, APairWithDifferentKeysNeverLinks) {
  const LinkKey key_a = KeyFrom(1), key_b = KeyFrom(2);
  HealthyPair pair({}, &key_a, &key_b);
  PostRecv(pair.b, 1);
  PostSend(pair.a, 2, "never");
  ibv_wc wc = Wait({&pair.a, &pair.b});
  EXPECT_EQ(wc.wr_id, 2u);
  EXPECT_EQ(wc.status, IBV_WC_RETRY_EXC_ERR) << ibv_wc_status_str(wc.status);
  ibv_wc none;
  EXPECT_EQ(pair.b.cq->Poll(1, &none), 0) << "the receive completed without a link";
}

TEST(TcpLinkKey, AKeyedQpRefusesAKeylessHello) {
  Side victim = MakeSide("soft0");
  Rogue rogue;
  const LinkKey key = KeyFrom(3);
  ASSERT_NO_FATAL_FAILURE(ConnectVictim(victim, rogue, &key));
  PostRecv(victim, 1);
  rogue.ConnectTo(GidOf(victim));
  Hello hello = HelloFor(rogue.gid(), kRogueQpn, victim, kVictimPsn);
  rogue.Send(&hello, sizeof(hello));
  rogue.SendFirstSend(kRoguePsn, kVictimPsn, "no key");
  EXPECT_TRUE(rogue.DroppedBy(&victim));
  ibv_wc wc;
  EXPECT_EQ(victim.cq->Poll(1, &wc), 0) << "a keyless peer delivered a SEND to a keyed QP";
}

TEST(TcpLinkKey, AKeylessQpRefusesAKeyedHello) {
  Side victim = MakeSide("soft0");
  Rogue rogue;
  ASSERT_NO_FATAL_FAILURE(ConnectVictim(victim, rogue, nullptr));
  rogue.ConnectTo(GidOf(victim));
  Hello hello = KeyedHelloFor(rogue.gid(), kRogueQpn, victim, kVictimPsn);
  rogue.Send(&hello, sizeof(hello));
  Challenge challenge;
  EXPECT_FALSE(ReadExact(rogue.fd(), &challenge, sizeof(challenge), &victim))
      << "a QP without a key challenged a keyed hello instead of refusing it";
  EXPECT_TRUE(rogue.DroppedBy(&victim));
}

// The accepter's challenge proves the device knows the key for our nonce; a proof made with
// another key is refused before the QP is offered anything: five of them (more than the four
// candidates a QP holds) at a QP still in INIT, then the real peer links.
TEST(TcpLinkKey, AWrongProofIsRefusedBeforeItTakesASlot) {
  Side victim = MakeSide("soft0");
  const LinkKey key = KeyFrom(4), wrong = KeyFrom(5);
  ASSERT_TRUE(SetLinkKey(victim.qp->get(), key).ok());
  verbs::ConnectOptions options;
  ASSERT_TRUE(victim.qp->ToInit(options).ok());
  Rogue peer;
  for (int i = 0; i < 5; ++i) {
    Rogue impostor;
    impostor.ConnectTo(GidOf(victim));
    Hello hello = KeyedHelloFor(peer.gid(), kRogueQpn, victim, kVictimPsn);
    Challenge challenge;
    ASSERT_TRUE(OpenKeyed(impostor.fd(), hello, GidOf(victim), wrong, &challenge, nullptr));
    // The challenge itself was made with the QP's key, for the impostor's nonce.
    const Mac mac = MacOf(key, AuthRole::kAccepter, hello, GidOf(victim), challenge.nonce,
                          challenge.flags);
    EXPECT_EQ(std::memcmp(mac.data(), challenge.mac, mac.size()), 0);
    EXPECT_TRUE(impostor.DroppedBy(nullptr)) << "a proof made with the wrong key was taken";
  }
  peer.ConnectTo(GidOf(victim));
  Hello hello = KeyedHelloFor(peer.gid(), kRogueQpn, victim, kVictimPsn);
  Challenge challenge;
  ASSERT_TRUE(OpenKeyed(peer.fd(), hello, GidOf(victim), key, &challenge, nullptr));
  ASSERT_TRUE(victim.qp->ToRtr({peer.gid(), 0, kRogueQpn, kRoguePsn}, options).ok());
  ASSERT_TRUE(victim.qp->ToRts(kVictimPsn, options).ok());
  PostRecv(victim, 12);
  Ciphers ciphers = CiphersOf(key, hello, challenge, /*we_opened=*/true);
  ASSERT_NE(ciphers.out, nullptr);
  const std::string send = SealedFirstSend(*ciphers.out, kRoguePsn, kVictimPsn, "the real one");
  SendAll(peer.fd(), send.data(), send.size());
  ibv_wc wc = Wait({&victim});
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_STREQ(victim.buf.data(), "the real one");
}

// Whoever recorded a peer's hello and proof cannot replay them: the device challenges each
// connection with a fresh nonce.
TEST(TcpLinkKey, AReplayedHelloAndProofAreRefused) {
  Side victim = MakeSide("soft0");
  const LinkKey key = KeyFrom(6);
  ASSERT_TRUE(SetLinkKey(victim.qp->get(), key).ok());
  ASSERT_TRUE(victim.qp->ToInit({}).ok());
  Rogue peer;
  Hello hello = KeyedHelloFor(peer.gid(), kRogueQpn, victim, kVictimPsn);
  Proof recorded;
  {
    Rogue first;
    first.ConnectTo(GidOf(victim));
    Challenge challenge;
    ASSERT_TRUE(OpenKeyed(first.fd(), hello, GidOf(victim), key, &challenge, nullptr));
    const Mac mac = MacOf(key, AuthRole::kOpener, hello, GidOf(victim), challenge.nonce,
                          challenge.flags);
    std::memcpy(recorded.mac, mac.data(), mac.size());
    ASSERT_TRUE(HcaCaughtUp(GidOf(victim), nullptr));  // the genuine proof was taken
  }
  Rogue replayer;
  replayer.ConnectTo(GidOf(victim));
  replayer.Send(&hello, sizeof(hello));
  Challenge fresh;
  ASSERT_TRUE(ReadExact(replayer.fd(), &fresh, sizeof(fresh), nullptr));
  replayer.Send(&recorded, sizeof(recorded));
  EXPECT_TRUE(replayer.DroppedBy(nullptr)) << "a replayed proof was taken";
}

// The other direction: the device opens the connection (its GID sorts first) and must get a
// challenge made for its own fresh nonce; one made for another hello's nonce is refused.
TEST(TcpLinkKey, AChallengeForAnotherNonceIsRefused) {
  Side victim = MakeSide("soft0");
  Rogue rogue(/*high=*/true);
  const LinkKey key = KeyFrom(7);
  ASSERT_TRUE(SetLinkKey(victim.qp->get(), key).ok());
  ASSERT_NO_FATAL_FAILURE(ConnectVictimFirst(victim, rogue, {}));
  const int theirs = rogue.AcceptOne();
  ASSERT_GE(theirs, 0);
  Hello hello;
  ASSERT_TRUE(ReadExact(theirs, &hello, sizeof(hello), &victim));
  EXPECT_EQ(hello.flags, kKeyed | kSeal) << "a keyed QP's hello, asking for sealed records";
  Hello stale = hello;
  stale.nonce[0] ^= 1;  // the nonce of an earlier hello, say
  Challenge challenge;
  RandomBytes(challenge.nonce, sizeof(challenge.nonce));
  const Mac mac = MacOf(key, AuthRole::kAccepter, stale, rogue.gid(), challenge.nonce, 0);
  std::memcpy(challenge.mac, mac.data(), mac.size());
  SendAll(theirs, &challenge, sizeof(challenge));
  Proof proof;
  EXPECT_FALSE(ReadExact(theirs, &proof, sizeof(proof), &victim))
      << "the device answered a challenge that was not made for its nonce";
  close(theirs);
}

// The device opens; the hand-written peer answers the challenge rightly. The device's proof is
// made with the key, and its records are sealed under the keys derived from it: the SEND's
// text is not on the wire, and it opens with the peer's cipher.
TEST(TcpLinkKey, TheDevicesRecordsAreSealedUnderTheLinkKey) {
  Side victim = MakeSide("soft0");
  Rogue rogue(/*high=*/true);
  const LinkKey key = KeyFrom(8);
  ASSERT_TRUE(SetLinkKey(victim.qp->get(), key).ok());
  ASSERT_NO_FATAL_FAILURE(ConnectVictimFirst(victim, rogue, {}));
  const int theirs = rogue.AcceptOne();
  ASSERT_GE(theirs, 0);
  Hello hello;
  ASSERT_TRUE(ReadExact(theirs, &hello, sizeof(hello), &victim));
  Challenge challenge;
  RandomBytes(challenge.nonce, sizeof(challenge.nonce));
  const Mac mac = MacOf(key, AuthRole::kAccepter, hello, rogue.gid(), challenge.nonce, 0);
  std::memcpy(challenge.mac, mac.data(), mac.size());
  SendAll(theirs, &challenge, sizeof(challenge));
  Proof proof;
  ASSERT_TRUE(ReadExact(theirs, &proof, sizeof(proof), &victim));
  const Mac expected = MacOf(key, AuthRole::kOpener, hello, rogue.gid(), challenge.nonce, 0);
  EXPECT_EQ(std::memcmp(expected.data(), proof.mac, expected.size()), 0);
  const char secret[] = "a secret text";
  PostSend(victim, 5, secret);
  Record record;
  ASSERT_TRUE(ReadExact(theirs, &record, sizeof(record), &victim));
  ASSERT_EQ(record.kind, 1) << "a frame record first (the SEND)";
  std::string body(record.length + kTagBytes, 0);
  ASSERT_TRUE(ReadExact(theirs, body.data(), body.size(), &victim));
  EXPECT_EQ(body.find(secret), std::string::npos) << "the SEND's text travelled in the clear";
  Ciphers ciphers = CiphersOf(key, hello, challenge, /*we_opened=*/false);
  ASSERT_NE(ciphers.in, nullptr);
  ASSERT_TRUE(ciphers.in->Open(&record, sizeof(record), body.data(), record.length,
                               reinterpret_cast<const uint8_t*>(body.data() + record.length)));
  EXPECT_NE(body.find(secret), std::string::npos);
  close(theirs);
}

// After the handshake, sealed records from the peer: a valid SEND arrives; one whose text was
// changed on the way fails its tag, and the link (and with it the QP) fails.
TEST(TcpLinkKey, ATamperedRecordFailsTheLink) {
  Side victim = MakeSide("soft0");
  Rogue rogue;
  const LinkKey key = KeyFrom(9);
  ASSERT_NO_FATAL_FAILURE(ConnectVictim(victim, rogue, &key));
  PostRecv(victim, 1);
  PostRecv(victim, 2);
  rogue.ConnectTo(GidOf(victim));
  Hello hello = KeyedHelloFor(rogue.gid(), kRogueQpn, victim, kVictimPsn);
  Challenge challenge;
  ASSERT_TRUE(OpenKeyed(rogue.fd(), hello, GidOf(victim), key, &challenge, &victim));
  Ciphers ciphers = CiphersOf(key, hello, challenge, /*we_opened=*/true);
  ASSERT_NE(ciphers.out, nullptr);
  const std::string first = SealedFirstSend(*ciphers.out, kRoguePsn, kVictimPsn, "genuine");
  rogue.Send(first.data(), first.size());
  ibv_wc wc = Wait({&victim});
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_STREQ(victim.buf.data(), "genuine");
  char frame[wire::kFrameAlign];
  FirstSendFrame(kRoguePsn + 1, kVictimPsn, "changed", frame, wire::kFrameAlign);
  std::string second = SealedRecord(*ciphers.out, Record{1, 0, 0, sizeof(frame), wire::kFrameAlign}, frame);
  second[sizeof(Record) + sizeof(wire::FrameHeader)] ^= 0x20;  // one bit of the text
  rogue.Send(second.data(), second.size());
  ExpectLinkFailed(victim, "a tampered record was taken");
}

// A sealed record counts as the next unit of its direction: the same bytes again (a control
// record, which no ring position would catch) fail.
TEST(TcpLinkKey, AReplayedRecordFailsTheLink) {
  Side victim = MakeSide("soft0");
  Rogue rogue;
  const LinkKey key = KeyFrom(10);
  ASSERT_NO_FATAL_FAILURE(ConnectVictim(victim, rogue, &key));
  rogue.ConnectTo(GidOf(victim));
  Hello hello = KeyedHelloFor(rogue.gid(), kRogueQpn, victim, kVictimPsn);
  Challenge challenge;
  ASSERT_TRUE(OpenKeyed(rogue.fd(), hello, GidOf(victim), key, &challenge, &victim));
  Ciphers ciphers = CiphersOf(key, hello, challenge, /*we_opened=*/true);
  ASSERT_NE(ciphers.out, nullptr);
  const uint64_t control[4] = {0, 0, kVictimPsn, wire::kLinkActive};
  const std::string record = SealedRecord(*ciphers.out, Record{2, 0, 0, sizeof(control), 0}, control);
  rogue.Send(record.data(), record.size());
  ASSERT_TRUE(HcaCaughtUp(GidOf(victim), &victim));
  victim.cq->Poll(0, nullptr);
  // The genuine record was taken: the connection is still open (what the device sent on it,
  // its answering hello, is read away).
  char sink[4096];
  ssize_t n;
  while ((n = recv(rogue.fd(), sink, sizeof(sink), MSG_DONTWAIT)) > 0) {
  }
  ASSERT_TRUE(n < 0 && errno == EAGAIN) << "the device closed on the genuine record";
  rogue.Send(record.data(), record.size());
  ExpectLinkFailed(victim, "a replayed record was taken");
}

// The peer's hello arrives before the QP has its key (the control plane's answer is still on
// its way): it waits, and is challenged once the key is set.
TEST(TcpLinkKey, AHelloBeforeTheKeyWaitsForIt) {
  Side victim = MakeSide("soft0");
  Rogue rogue;
  rogue.ConnectTo(GidOf(victim));
  Hello hello = KeyedHelloFor(rogue.gid(), kRogueQpn, victim, kVictimPsn);
  rogue.Send(&hello, sizeof(hello));
  ASSERT_TRUE(HcaCaughtUp(GidOf(victim), nullptr));  // the hello was taken, and waits
  const LinkKey key = KeyFrom(11);
  ASSERT_NO_FATAL_FAILURE(ConnectVictim(victim, rogue, &key));
  PostRecv(victim, 1);
  Challenge challenge;
  ASSERT_TRUE(ReadExact(rogue.fd(), &challenge, sizeof(challenge), &victim))
      << "no challenge once the QP had its key";
  Proof proof;
  const Mac mac = MacOf(key, AuthRole::kOpener, hello, GidOf(victim), challenge.nonce,
                        challenge.flags);
  std::memcpy(proof.mac, mac.data(), mac.size());
  rogue.Send(&proof, sizeof(proof));
  Ciphers ciphers = CiphersOf(key, hello, challenge, /*we_opened=*/true);
  ASSERT_NE(ciphers.out, nullptr);
  const std::string send = SealedFirstSend(*ciphers.out, kRoguePsn, kVictimPsn, "waited");
  rogue.Send(send.data(), send.size());
  ibv_wc wc = Wait({&victim});
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_STREQ(victim.buf.data(), "waited");
}

TEST(TcpLinkKey, SetLinkKeyChecksItsArguments) {
  Side side = MakeSide("soft0");
  const uint8_t short_key[16] = {};
  EXPECT_EQ(SetLinkKey(side.qp->get(), short_key).code(), absl::StatusCode::kInvalidArgument);
  Rogue rogue;
  ASSERT_TRUE(side.qp->Connect({rogue.gid(), 0, kRogueQpn, kRoguePsn}, kVictimPsn, {}).ok());
  const LinkKey key = KeyFrom(12);
  EXPECT_EQ(SetLinkKey(side.qp->get(), key).code(), absl::StatusCode::kFailedPrecondition)
      << "a key set after RTR";
  EXPECT_TRUE(IsSoftQp(side.qp->get()));
}


// ---- Before authentication: what a stranger's connections may hold.

// A connection to `device` from `source` (127.0.0.x: the whole loopback range is this host).
int ConnectFrom(const char* source, const ibv_gid& device) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in from{};
  from.sin_family = AF_INET;
  inet_pton(AF_INET, source, &from.sin_addr);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)), 0) << std::strerror(errno);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  std::memcpy(&to.sin_port, device.raw + 8, 2);
  std::memcpy(&to.sin_addr.s_addr, device.raw + 12, 4);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0) << std::strerror(errno);
  return fd;
}

// 70 connections from one address, each with a keyed hello for a real keyed QP (its GID and
// QPN travel in the clear) that never answers the challenge: each could hold a place for the
// proof's 5 s. One address gets 8 places, the rest are refused at once (with a few log lines,
// not 62), so a pair on another address links within its default timeout.
TEST(TcpFabric, OneAddressCannotHoldEveryPlaceBeforeAuthentication) {
  Side decoy = MakeSide("soft0");
  const LinkKey key = KeyFrom(20);
  ASSERT_TRUE(SetLinkKey(decoy.qp->get(), key).ok());
  ASSERT_TRUE(decoy.qp->ToInit({}).ok());
  ibv_gid attacker = TcpGid(htons(40000));
  attacker.raw[15] = 2;  // 127.0.0.2
  // Every line the crowd causes counts, those at INFO (a silent connection closed for room)
  // too: at that level a stranger must not be able to fill the log either.
  const LogLevel level = CurrentLogLevel();
  SetLogLevel(LogLevel::kInfo);
  ::testing::internal::CaptureStderr();
  std::vector<int> crowd;
  for (int i = 0; i < 70; ++i) {
    crowd.push_back(ConnectFrom("127.0.0.2", GidOf(decoy)));
    Hello hello = KeyedHelloFor(attacker, 0x400 + i, decoy);
    SendAll(crowd.back(), &hello, sizeof(hello));
  }
  // The device has taken the crowd's connections (each challenged or refused) once it answers
  // a sentinel's connection behind them.
  ASSERT_TRUE(HcaCaughtUp(GidOf(decoy), nullptr));
  int refused = 0;
  for (int fd : crowd) {
    char buf[sizeof(Challenge)];
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 0) != 1) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), MSG_PEEK | MSG_DONTWAIT);
    refused += n == 0 || (n < 0 && errno == ECONNRESET);  // closed (with our hello unread)
  }
  EXPECT_GE(refused, 70 - 8) << "one address held more than its share of the places";
  HealthyPair pair;  // default options: links within 0.54 s or fails
  pair.Check("past the crowd");
  const std::string log = ::testing::internal::GetCapturedStderr();
  SetLogLevel(level);
  int lines = 0;
  for (size_t at = log.find("TCP connection from 127.0.0.2"); at != std::string::npos;
       at = log.find("TCP connection from 127.0.0.2", at + 1)) {
    ++lines;
  }
  EXPECT_GE(lines, 1);
  EXPECT_LE(lines, 10) << "every refusal was logged: a stranger can fill the log";
  for (int fd : crowd) close(fd);
}


// Real peers come in bursts too: 24 QPs of one device open their links to another at once,
// three times one address's share of places. Those turned away (closed while their hello was
// still on its way) dial again, so every pair links within its default timeout.
TEST(TcpFabric, ABurstOfRealPeersFromOneAddressAllLink) {
  constexpr int kPairs = 24;
  std::vector<Side> a, b;
  for (int i = 0; i < kPairs; ++i) {
    a.push_back(MakeSide("soft0"));
    b.push_back(MakeSide("soft1"));
  }
  // Make soft0's QPs the openers (their GID sorts first), all of them before soft1 reads any.
  const bool soft0_first = std::memcmp(GidOf(a[0]).raw, GidOf(b[0]).raw, 16) < 0;
  std::vector<Side>& openers = soft0_first ? a : b;
  std::vector<Side>& accepters = soft0_first ? b : a;
  ::testing::internal::CaptureStderr();  // (the few turned away are logged)
  const uint64_t turned_away_before = ToSoft(accepters[0].ctx->get())->hca->tcp_turned_away.load();
  verbs::ConnectOptions options;
  for (int i = 0; i < kPairs; ++i) {
    auto addr = *accepters[i].qp->LocalAddress(200, options);
    ASSERT_TRUE(openers[i].qp->Connect(addr, 100, options).ok());
  }
  for (int i = 0; i < kPairs; ++i) {
    auto addr = *openers[i].qp->LocalAddress(100, options);
    ASSERT_TRUE(accepters[i].qp->Connect(addr, 200, options).ok());
  }
  for (int i = 0; i < kPairs; ++i) {
    PostRecv(accepters[i], 1);
    PostSend(openers[i], 2, "one of many");
    ibv_wc wc = Wait({&accepters[i], &openers[i]});
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << "pair " << i << ": " << ibv_wc_status_str(wc.status);
    wc = Wait({&openers[i], &accepters[i]});
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << "pair " << i;
  }
  ::testing::internal::GetCapturedStderr();
  // Not a check (it depends on timing): how many dialled again, for the log.
  const uint64_t turned_away =
      ToSoft(accepters[0].ctx->get())->hca->tcp_turned_away.load() - turned_away_before;
  RecordProperty("turned_away", static_cast<int>(turned_away));
}

}  // namespace
}  // namespace swirl::soft
