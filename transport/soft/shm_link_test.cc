// The soft device's shared-memory fabric against peers that are not the soft device: a
// hand-written peer in this process that speaks the hello protocol (docs/SOFT_WIRE.md), and an
// attacker process of another user (shm_rogue). What it checks: the uid of the other end, on
// both ends of the handshake; that a segment reaches its receiver sealed against writes (and
// one that is not is refused); and link keys: a keyed QP links only with a peer that proves it
// knows the key for the QP's fresh nonce, and proves it back.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <dirent.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "rpc/testing/process.h"
#include "transport/soft/link_auth.h"
#include "transport/soft/qp_ops.h"
#include "transport/soft/soft_device.h"
#include "transport/soft/soft_internal.h"
#include "transport/soft/test_side.h"
#include "transport/soft/wire.h"
#include "transport/verbs/verbs.h"

namespace swirl::soft {
namespace {

// The shared-memory handshake's messages, written from the document.
struct Hello {
  uint64_t magic = 0x4f4c4c4548575331ull;  // "1SWHELLO"
  uint32_t version = 4;
  uint32_t src_qpn = 0;
  uint32_t dst_qpn = 0;
  uint32_t flags = 0;  // 1: keyed
  ibv_gid src_gid{};
  uint64_t segment_size = 0;
  uint8_t nonce[16] = {};
};
static_assert(sizeof(Hello) == 64);
struct Challenge {
  uint64_t magic = 0x4c4c414843575331ull;  // "1SWCHALL"
  uint32_t flags = 0;
  uint32_t reserved = 0;
  uint8_t nonce[16] = {};
  uint8_t mac[32] = {};
};
static_assert(sizeof(Challenge) == 64);
struct Proof {
  uint64_t magic = 0x464f4f5250575331ull;  // "1SWPROOF"
  uint8_t mac[32] = {};
};
static_assert(sizeof(Proof) == 40);

constexpr uint32_t kPeerQpn = 0x321, kPeerPsn = 500, kVictimPsn = 100;
constexpr uid_t kNobody = 65534;

ibv_gid GidOf(Side& side) { return *side.ctx->QueryGid(1, 0); }

std::string Hex(const ibv_gid& gid) {
  std::string out;
  for (unsigned char b : gid.raw) absl::StrAppendFormat(&out, "%02x", b);
  return out;
}

// A GID no device of this process has: where the hand-written peer listens.
ibv_gid FakeGid() {
  ibv_gid gid{};
  gid.raw[0] = 0xfe;
  gid.raw[1] = 0x80;
  RandomBytes(gid.raw + 8, 8);
  return gid;
}

LinkKey KeyFrom(uint8_t seed) {
  LinkKey key;
  for (size_t i = 0; i < key.size(); ++i) key[i] = static_cast<uint8_t>(seed + 5 * i);
  return key;
}

template <typename T>
absl::Span<const uint8_t> BytesOf(const T& value) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(&value), sizeof(value));
}

Mac MacOf(const LinkKey& key, AuthRole role, const Hello& hello, const ibv_gid& accepter,
          const uint8_t (&nonce)[16], uint32_t flags) {
  Nonce n;
  std::memcpy(n.data(), nonce, n.size());
  return HelloMac(key, role, AuthFabric::kShm, BytesOf(hello), accepter, n, flags);
}

sockaddr_un AddressFor(const ibv_gid& gid, socklen_t* len) {
  sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  const std::string name = "swirl-soft1-" + Hex(gid);
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

// A listener at `gid`'s socket name: a peer's HCA, as far as a device can tell.
class FakeHca {
 public:
  FakeHca() : gid_(FakeGid()) {
    listen_fd_ = socket(AF_UNIX, SOCK_SEQPACKET, 0);
    socklen_t len;
    sockaddr_un addr = AddressFor(gid_, &len);
    EXPECT_EQ(bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len), 0);
    EXPECT_EQ(listen(listen_fd_, 8), 0);
  }
  ~FakeHca() { close(listen_fd_); }
  const ibv_gid& gid() const { return gid_; }
  // Whether a device has opened a connection to us that we have not accepted.
  bool Pending() {
    pollfd p{listen_fd_, POLLIN, 0};
    return poll(&p, 1, 0) == 1;
  }
  // The connection a device opened to us (it is in the backlog by now), or -1.
  int Accept() {
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 10000) != 1) return -1;
    return accept(listen_fd_, nullptr, nullptr);
  }

 private:
  ibv_gid gid_;
  int listen_fd_ = -1;
};

// One message and the descriptors it carried (closed by the destructor); length 0 if the
// connection ended, -1 if nothing came within 10 s.
struct Message {
  ssize_t length = -1;
  char bytes[256] = {};
  std::vector<int> fds;
  ~Message() {
    for (int fd : fds) close(fd);
  }
};
void Receive(int fd, Message* m) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, 10000) != 1) return;
  char control[CMSG_SPACE(4 * sizeof(int))];
  iovec iov{m->bytes, sizeof(m->bytes)};
  msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  m->length = recvmsg(fd, &msg, MSG_DONTWAIT);
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); m->length > 0 && c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int received;
      std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      m->fds.push_back(received);
    }
  }
}

// Sends `data` with `fds` attached.
void SendWithFds(int fd, const void* data, size_t length, const std::vector<int>& fds) {
  char control[CMSG_SPACE(4 * sizeof(int))];
  std::memset(control, 0, sizeof(control));
  iovec iov{const_cast<void*>(data), length};
  msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(fds.size() * sizeof(int));
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds.data(), fds.size() * sizeof(int));
  }
  ASSERT_EQ(sendmsg(fd, &msg, MSG_NOSIGNAL), static_cast<ssize_t>(length));
}

// A segment memfd with a valid header for QP `qpn`, sealed with `seals`.
int MakeSegment(uint32_t qpn, int seals, uint64_t* size) {
  const uint64_t ring = wire::kMinRingSize;
  *size = wire::kRingsOffset + 2 * ring;
  int fd = memfd_create("test-peer", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(*size)), 0);
  void* base = mmap(nullptr, *size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  EXPECT_NE(base, MAP_FAILED);
  auto* header = static_cast<wire::SegmentHeader*>(base);
  header->magic = wire::kSegmentMagic;
  header->version = wire::kWireVersion;
  header->qp_num = qpn;
  header->segment_size = *size;
  header->request_ring_offset = wire::kRingsOffset;
  header->request_ring_size = ring;
  header->response_ring_offset = wire::kRingsOffset + ring;
  header->response_ring_size = ring;
  munmap(base, *size);
  EXPECT_EQ(fcntl(fd, F_ADD_SEALS, seals), 0);
  return fd;
}

// A connection to `device`'s HCA, as a peer process of ours would open it.
int ConnectTo(const ibv_gid& device) {
  int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
  socklen_t len;
  sockaddr_un addr = AddressFor(device, &len);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), len), 0) << std::strerror(errno);
  return fd;
}

// True if the device closes `fd` within 10 s (what it sends before, e.g. a challenge, is read).
bool DroppedBy(int fd) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 10) != 1) continue;
    char buf[256];
    const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
  }
  return false;
}

Hello HelloFor(const ibv_gid& from, Side& to, uint64_t segment_size, bool keyed) {
  Hello hello;
  hello.src_qpn = kPeerQpn;
  hello.dst_qpn = to.qp->qp_num();
  hello.src_gid = from;
  hello.segment_size = segment_size;
  if (keyed) {
    hello.flags = 1;
    RandomBytes(hello.nonce, sizeof(hello.nonce));
  }
  return hello;
}

void Connect(Side& victim, const ibv_gid& peer, const LinkKey* key) {
  if (key != nullptr) {
    ASSERT_TRUE(SetLinkKey(victim.qp->get(), *key).ok());
  }
  ASSERT_TRUE(victim.qp->Connect({peer, 0, kPeerQpn, kPeerPsn}, kVictimPsn, {}).ok());
}

void PostRecv(Side& s, uint64_t wr_id) { ASSERT_TRUE(PostBufferRecv(s, wr_id).ok()); }
void PostSend(Side& s, uint64_t wr_id, const char* text) {
  ASSERT_TRUE(PostInlineSend(s, wr_id, text).ok());
}

// The first completion of `side`'s CQ within 10 s, polling `other` meanwhile.
ibv_wc Wait(Side& side, Side* other = nullptr) {
  ibv_wc wc;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    if (side.cq->Poll(1, &wc) == 1) return wc;
    if (other != nullptr) other->cq->Poll(0, nullptr);
  }
  ADD_FAILURE() << "no completion within 10 s";
  std::memset(&wc, 0, sizeof(wc));
  wc.status = IBV_WC_GENERAL_ERR;
  return wc;
}

// ---- Users ------------------------------------------------------------------------------------

// What an attacker process wrote to its report, once it holds `lines` lines (20 s at most).
std::vector<std::string> ReportOf(const std::string& path, size_t lines) {
  std::vector<std::string> out;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    out.clear();
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) out.push_back(line);
    if (out.size() >= lines) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return out;
}

std::string ReportPath(const char* name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name, "-", getpid());
}

// Another user binds the abstract name of the GID a QP was told to link to (it needs no
// permission to: the abstract namespace has none). The QP sees the listener's uid and sends
// nothing: no hello, no segment.
TEST(ShmUsers, AListenerOfAnotherUserGetsNoHello) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the attacker as another uid";
  const ibv_gid claimed = FakeGid();
  const std::string report = ReportPath("listen");
  auto rogue = testing::ChildProcess::Spawn(
      {"transport/soft/shm_rogue", absl::StrCat("--uid=", kNobody), "--report=" + report,
       "--listen=" + Hex(claimed)});
  ASSERT_TRUE(rogue.ok()) << rogue.status();
  ASSERT_EQ(ReportOf(report, 1), std::vector<std::string>{"listening"});
  Side victim = MakeSide("soft0");
  ASSERT_NO_FATAL_FAILURE(Connect(victim, claimed, nullptr));
  const std::vector<std::string> seen = ReportOf(report, 2);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1], "closed") << "the other user's listener got: " << seen[1];
  EXPECT_TRUE(rogue->Wait(absl::Seconds(30)).ok());
}

// Another user connects to our HCA with a well-formed hello from exactly the peer a QP expects
// (its GID and QPN travel in the clear): refused, where it would otherwise be linked.
TEST(ShmUsers, AConnectorOfAnotherUserIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the attacker as another uid";
  Side victim = MakeSide("soft0");
  const ibv_gid peer = FakeGid();
  ASSERT_NO_FATAL_FAILURE(Connect(victim, peer, nullptr));
  const std::string report = ReportPath("connect");
  auto rogue = testing::ChildProcess::Spawn(
      {"transport/soft/shm_rogue", absl::StrCat("--uid=", kNobody), "--report=" + report,
       "--connect=" + Hex(GidOf(victim)), absl::StrCat("--dst_qpn=", victim.qp->qp_num()),
       "--src_gid=" + Hex(peer), absl::StrCat("--src_qpn=", kPeerQpn)});
  ASSERT_TRUE(rogue.ok()) << rogue.status();
  const std::vector<std::string> seen = ReportOf(report, 2);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1], "closed") << "the other user's hello was kept";
  EXPECT_TRUE(rogue->Wait(absl::Seconds(30)).ok());
}

TEST(ShmUsers, TrustedUidsParse) {
  std::vector<uid_t> uids;
  ASSERT_TRUE(ParseTrustedUids("1000, 65534", &uids));
  EXPECT_EQ(uids, (std::vector<uid_t>{1000, 65534}));
  ASSERT_TRUE(ParseTrustedUids("", &uids));
  EXPECT_TRUE(uids.empty());
  EXPECT_FALSE(ParseTrustedUids("1000,root", &uids));
}

// ---- Seals ------------------------------------------------------------------------------------

// The segment a QP hands its peer: the peer (here the hand-written one) can read it but can
// neither map it writable nor write it, whatever it does with the descriptor.
TEST(ShmSeals, TheReceiverOfASegmentCannotWriteIt) {
  FakeHca peer;
  Side victim = MakeSide("soft0");
  ASSERT_NO_FATAL_FAILURE(Connect(victim, peer.gid(), nullptr));
  const int fd = peer.Accept();
  ASSERT_GE(fd, 0);
  Message hello;
  Receive(fd, &hello);
  ASSERT_EQ(hello.length, static_cast<ssize_t>(sizeof(Hello)));
  ASSERT_EQ(hello.fds.size(), 2u);
  const int memfd = hello.fds[0];
  const int seals = fcntl(memfd, F_GET_SEALS);
  EXPECT_TRUE(seals & F_SEAL_FUTURE_WRITE) << seals;
  Hello h;
  std::memcpy(&h, hello.bytes, sizeof(h));
  void* writable = mmap(nullptr, h.segment_size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  EXPECT_EQ(writable, MAP_FAILED) << "the peer mapped our segment writable";
  if (writable != MAP_FAILED) munmap(writable, h.segment_size);
  const char byte = 1;
  EXPECT_EQ(pwrite(memfd, &byte, 1, 4096), -1) << "the peer wrote into our segment";
  void* readable = mmap(nullptr, h.segment_size, PROT_READ, MAP_SHARED, memfd, 0);
  ASSERT_NE(readable, MAP_FAILED);
  EXPECT_EQ(static_cast<wire::SegmentHeader*>(readable)->magic, wire::kSegmentMagic);
  munmap(readable, h.segment_size);
  close(fd);
}

// A peer's segment that its owner's peer could write (no write seal) is refused.
TEST(ShmSeals, ASegmentWithoutTheWriteSealIsRefused) {
  Side victim = MakeSide("soft0");
  FakeHca peer;
  ASSERT_NO_FATAL_FAILURE(Connect(victim, peer.gid(), nullptr));
  uint64_t size;
  const int memfd = MakeSegment(kPeerQpn, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL, &size);
  const int wake = eventfd(0, EFD_CLOEXEC);
  const int fd = ConnectTo(GidOf(victim));
  Hello hello = HelloFor(peer.gid(), victim, size, /*keyed=*/false);
  SendWithFds(fd, &hello, sizeof(hello), {memfd, wake});
  EXPECT_TRUE(DroppedBy(fd)) << "a segment its peer could write was taken";
  close(fd);
  close(memfd);
  close(wake);
}

// ---- Link keys --------------------------------------------------------------------------------

TEST(ShmLinkKey, APairWithTheSameKeyLinks) {
  Side a = MakeSide("soft0");
  Side b = MakeSide("soft1");
  const LinkKey key = KeyFrom(1);
  ASSERT_TRUE(SetLinkKey(a.qp->get(), key).ok());
  ASSERT_TRUE(SetLinkKey(b.qp->get(), key).ok());
  ASSERT_TRUE(ConnectSides(a, b).ok());
  PostRecv(b, 1);
  PostSend(a, 2, "keyed, over shared memory");
  ibv_wc wc = Wait(b, &a);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_STREQ(b.buf.data(), "keyed, over shared memory");
  wc = Wait(a, &b);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
}

TEST(ShmLinkKey, APairWithDifferentKeysNeverLinks) {
  Side a = MakeSide("soft0");
  Side b = MakeSide("soft1");
  const LinkKey key_a = KeyFrom(1), key_b = KeyFrom(2);
  ASSERT_TRUE(SetLinkKey(a.qp->get(), key_a).ok());
  ASSERT_TRUE(SetLinkKey(b.qp->get(), key_b).ok());
  ASSERT_TRUE(ConnectSides(a, b).ok());
  PostRecv(b, 1);
  PostSend(a, 2, "never");
  ibv_wc wc = Wait(a, &b);
  EXPECT_EQ(wc.status, IBV_WC_RETRY_EXC_ERR) << ibv_wc_status_str(wc.status);
  ibv_wc none;
  EXPECT_EQ(b.cq->Poll(1, &none), 0) << "the receive completed without a link";
}

// A keyed QP's hello hands over nothing (no descriptors) before the peer has answered the
// challenge; a challenge made for another nonce gets no proof, and so no segment.
TEST(ShmLinkKey, AKeyedHelloCarriesNothingAndAStaleChallengeGetsNoProof) {
  FakeHca peer;
  Side victim = MakeSide("soft0");
  const LinkKey key = KeyFrom(3);
  ASSERT_NO_FATAL_FAILURE(Connect(victim, peer.gid(), &key));
  const int fd = peer.Accept();
  ASSERT_GE(fd, 0);
  Message hello;
  Receive(fd, &hello);
  ASSERT_EQ(hello.length, static_cast<ssize_t>(sizeof(Hello)));
  EXPECT_TRUE(hello.fds.empty()) << "a keyed hello handed over its segment unchallenged";
  Hello h;
  std::memcpy(&h, hello.bytes, sizeof(h));
  EXPECT_EQ(h.flags, 1u);
  Hello stale = h;
  stale.nonce[0] ^= 1;
  Challenge challenge;
  RandomBytes(challenge.nonce, sizeof(challenge.nonce));
  const Mac mac = MacOf(key, AuthRole::kAccepter, stale, peer.gid(), challenge.nonce, 0);
  std::memcpy(challenge.mac, mac.data(), mac.size());
  SendWithFds(fd, &challenge, sizeof(challenge), {});
  Message proof;
  Receive(fd, &proof);
  EXPECT_LE(proof.length, 0) << "the QP answered a challenge made for another nonce";
  EXPECT_TRUE(proof.fds.empty());
  close(fd);
}

// The right challenge gets the proof, with the segment.
TEST(ShmLinkKey, TheRightChallengeGetsTheProofAndTheSegment) {
  FakeHca peer;
  Side victim = MakeSide("soft0");
  const LinkKey key = KeyFrom(4);
  ASSERT_NO_FATAL_FAILURE(Connect(victim, peer.gid(), &key));
  const int fd = peer.Accept();
  ASSERT_GE(fd, 0);
  Message hello;
  Receive(fd, &hello);
  ASSERT_EQ(hello.length, static_cast<ssize_t>(sizeof(Hello)));
  Hello h;
  std::memcpy(&h, hello.bytes, sizeof(h));
  Challenge challenge;
  RandomBytes(challenge.nonce, sizeof(challenge.nonce));
  const Mac mac = MacOf(key, AuthRole::kAccepter, h, peer.gid(), challenge.nonce, 0);
  std::memcpy(challenge.mac, mac.data(), mac.size());
  SendWithFds(fd, &challenge, sizeof(challenge), {});
  Message proof;
  Receive(fd, &proof);
  ASSERT_EQ(proof.length, static_cast<ssize_t>(sizeof(Proof)));
  EXPECT_EQ(proof.fds.size(), 2u);
  Proof p;
  std::memcpy(&p, proof.bytes, sizeof(p));
  const Mac expected = MacOf(key, AuthRole::kOpener, h, peer.gid(), challenge.nonce, 0);
  EXPECT_EQ(std::memcmp(expected.data(), p.mac, expected.size()), 0);
  close(fd);
}

// Toward a keyed QP: a keyless hello is refused, and so is a proof made with another key, or
// a replayed one, each before the segment it carries is mapped or offered.
TEST(ShmLinkKey, KeylessHellosWrongProofsAndReplaysAreRefused) {
  Side victim = MakeSide("soft0");
  FakeHca peer;
  const LinkKey key = KeyFrom(5), wrong = KeyFrom(6);
  ASSERT_NO_FATAL_FAILURE(Connect(victim, peer.gid(), &key));
  uint64_t size;
  const int memfd = MakeSegment(
      kPeerQpn, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL, &size);
  const int wake = eventfd(0, EFD_CLOEXEC);
  {
    const int fd = ConnectTo(GidOf(victim));
    Hello hello = HelloFor(peer.gid(), victim, size, /*keyed=*/false);
    SendWithFds(fd, &hello, sizeof(hello), {memfd, wake});
    EXPECT_TRUE(DroppedBy(fd)) << "a keyless hello was taken by a keyed QP";
    close(fd);
  }
  Hello hello = HelloFor(peer.gid(), victim, size, /*keyed=*/true);
  Proof recorded;
  for (const LinkKey* proof_key : {&wrong, &key}) {
    const int fd = ConnectTo(GidOf(victim));
    SendWithFds(fd, &hello, sizeof(hello), {});
    Message message;
    Receive(fd, &message);
    ASSERT_EQ(message.length, static_cast<ssize_t>(sizeof(Challenge)));
    Challenge challenge;
    std::memcpy(&challenge, message.bytes, sizeof(challenge));
    Proof proof;
    const Mac mac = MacOf(*proof_key, AuthRole::kOpener, hello, GidOf(victim), challenge.nonce,
                          challenge.flags);
    std::memcpy(proof.mac, mac.data(), mac.size());
    if (proof_key == &key) {
      recorded = proof;  // a genuine proof, for the replay below
      close(fd);
      break;
    }
    SendWithFds(fd, &proof, sizeof(proof), {memfd, wake});
    EXPECT_TRUE(DroppedBy(fd)) << "a proof made with the wrong key was taken";
    close(fd);
  }
  const int fd = ConnectTo(GidOf(victim));
  SendWithFds(fd, &hello, sizeof(hello), {});
  Message fresh;
  Receive(fd, &fresh);
  ASSERT_EQ(fresh.length, static_cast<ssize_t>(sizeof(Challenge)));
  SendWithFds(fd, &recorded, sizeof(recorded), {memfd, wake});
  EXPECT_TRUE(DroppedBy(fd)) << "a replayed proof was taken";
  close(fd);
  close(memfd);
  close(wake);
}


// ---- Replies: one connection per QP pair -------------------------------------------------------

// Whether `side`'s QP holds a peer's hello it has not adopted yet (the HCA thread offered it),
// within 10 s.
bool WaitForCandidate(Side& side) {
  SoftQp* qp = AsSoft(side.qp->get());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    {
      swirl::MutexLock lock(&qp->incoming_mu);
      if (!qp->incoming.empty()) return true;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  return false;
}

int OpenDescriptors() {
  DIR* dir = opendir("/proc/self/fd");
  int n = 0;
  while (dirent* e = readdir(dir)) n += e->d_name[0] != '.';
  closedir(dir);
  return n - 1;  // opendir's own
}

// A QP whose peer's hello is already there when it reaches RTR opens no connection of its own:
// it replies on the peer's, with its segment and wake eventfd.
TEST(ShmReply, AQpWhosePeersHelloCameFirstRepliesOnThatConnection) {
  FakeHca peer;
  Side victim = MakeSide("soft0");
  uint64_t size;
  const int memfd = MakeSegment(
      kPeerQpn, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL, &size);
  const int wake = eventfd(0, EFD_CLOEXEC);
  const int fd = ConnectTo(GidOf(victim));
  Hello hello = HelloFor(peer.gid(), victim, size, /*keyed=*/false);
  SendWithFds(fd, &hello, sizeof(hello), {memfd, wake});
  ASSERT_TRUE(WaitForCandidate(victim)) << "the device never offered the hello to its QP";
  ASSERT_NO_FATAL_FAILURE(Connect(victim, peer.gid(), nullptr));
  Message reply;
  Receive(fd, &reply);
  ASSERT_EQ(reply.length, static_cast<ssize_t>(sizeof(Hello)));
  ASSERT_EQ(reply.fds.size(), 2u);
  Hello h;
  std::memcpy(&h, reply.bytes, sizeof(h));
  EXPECT_EQ(h.magic, hello.magic);
  EXPECT_EQ(h.version, 4u);
  EXPECT_EQ(h.flags, 4u);
  EXPECT_EQ(h.src_qpn, victim.qp->qp_num());
  EXPECT_EQ(h.dst_qpn, kPeerQpn);
  const ibv_gid victim_gid = GidOf(victim);
  EXPECT_EQ(std::memcmp(&h.src_gid, &victim_gid, sizeof(ibv_gid)), 0);
  EXPECT_TRUE(fcntl(reply.fds[0], F_GET_SEALS) & F_SEAL_FUTURE_WRITE);
  // Had it also opened one, the connection would be in our backlog: connect(2) returned
  // before the QP reached RTR, and the reply comes after that.
  EXPECT_FALSE(peer.Pending()) << "the QP opened a connection of its own as well";
  close(fd);
  close(memfd);
  close(wake);
}

// A keyed hello still in its handshake when the QP reaches RTR: the QP opens nothing, and its
// reply goes out as soon as the proof is checked, from the device's own thread (nobody polls
// the QP here: a caller-driven owner may not for a long while).
TEST(ShmReply, AQpWaitingForAKeyedHandshakeRepliesWhenItIsProved) {
  FakeHca peer;
  Side victim = MakeSide("soft0");
  const LinkKey key = KeyFrom(7);
  ASSERT_TRUE(SetLinkKey(victim.qp->get(), key).ok());
  uint64_t size;
  const int memfd = MakeSegment(
      kPeerQpn, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL, &size);
  const int wake = eventfd(0, EFD_CLOEXEC);
  const int fd = ConnectTo(GidOf(victim));
  Hello hello = HelloFor(peer.gid(), victim, size, /*keyed=*/true);
  SendWithFds(fd, &hello, sizeof(hello), {});
  Message message;
  Receive(fd, &message);
  ASSERT_EQ(message.length, static_cast<ssize_t>(sizeof(Challenge)));
  ASSERT_NO_FATAL_FAILURE(Connect(victim, peer.gid(), nullptr));  // (its key is set above)
  EXPECT_FALSE(peer.Pending()) << "the QP opened a connection while a handshake was under way";
  Challenge challenge;
  std::memcpy(&challenge, message.bytes, sizeof(challenge));
  Proof proof;
  const Mac mac = MacOf(key, AuthRole::kOpener, hello, GidOf(victim), challenge.nonce,
                        challenge.flags);
  std::memcpy(proof.mac, mac.data(), mac.size());
  SendWithFds(fd, &proof, sizeof(proof), {memfd, wake});
  Message reply;
  Receive(fd, &reply);
  ASSERT_EQ(reply.length, static_cast<ssize_t>(sizeof(Hello)));
  EXPECT_EQ(reply.fds.size(), 2u);
  Hello h;
  std::memcpy(&h, reply.bytes, sizeof(h));
  EXPECT_EQ(h.flags, 4u);
  EXPECT_EQ(h.dst_qpn, kPeerQpn);
  EXPECT_FALSE(peer.Pending()) << "the QP opened a connection of its own as well";
  close(fd);
  close(memfd);
  close(wake);
}

// If the hello it waited for goes away before the QP can adopt it, the QP opens its own.
TEST(ShmReply, AQpWhoseWaitingHelloDiedOpensItsOwn) {
  FakeHca peer;
  Side victim = MakeSide("soft0");
  uint64_t size;
  const int memfd = MakeSegment(
      kPeerQpn, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL, &size);
  const int wake = eventfd(0, EFD_CLOEXEC);
  const int fd = ConnectTo(GidOf(victim));
  Hello hello = HelloFor(peer.gid(), victim, size, /*keyed=*/false);
  SendWithFds(fd, &hello, sizeof(hello), {memfd, wake});
  ASSERT_TRUE(WaitForCandidate(victim));
  close(fd);
  ASSERT_NO_FATAL_FAILURE(Connect(victim, peer.gid(), nullptr));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!peer.Pending() && absl::Now() < deadline) victim.cq->Poll(0, nullptr);
  const int opened = peer.Accept();
  ASSERT_GE(opened, 0) << "the QP never opened a connection of its own";
  Message own;
  Receive(opened, &own);
  ASSERT_EQ(own.length, static_cast<ssize_t>(sizeof(Hello)));
  Hello h;
  std::memcpy(&h, own.bytes, sizeof(h));
  EXPECT_EQ(h.flags, 0u) << "a hello, not a reply";
  EXPECT_EQ(own.fds.size(), 2u);
  close(opened);
  close(memfd);
  close(wake);
}

// A reply is taken only for the QP whose connection it came on, and only well-formed.
TEST(ShmReply, RepliesForAnotherQpOrMalformedAreRefused) {
  Side victim = MakeSide("soft0");
  Side other = MakeSide("soft0");
  uint64_t size;
  const int memfd = MakeSegment(
      kPeerQpn, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL, &size);
  const int wake = eventfd(0, EFD_CLOEXEC);
  for (int variant = 0; variant < 3; ++variant) {
    FakeHca peer;
    ASSERT_TRUE(victim.qp->ToReset().ok());
    ASSERT_NO_FATAL_FAILURE(Connect(victim, peer.gid(), nullptr));
    const int fd = peer.Accept();
    ASSERT_GE(fd, 0);
    Message hello;
    Receive(fd, &hello);
    ASSERT_EQ(hello.length, static_cast<ssize_t>(sizeof(Hello)));
    Hello reply;
    reply.flags = 4;
    reply.src_qpn = kPeerQpn;
    reply.dst_qpn = victim.qp->qp_num();
    reply.src_gid = peer.gid();
    reply.segment_size = size;
    std::vector<int> fds = {memfd, wake};
    if (variant == 0) reply.dst_qpn = other.qp->qp_num();  // another QP of that device
    if (variant == 1) reply.flags = 4 | 1;                  // a reply is never keyed
    if (variant == 2) fds = {memfd};                        // no wake eventfd
    SendWithFds(fd, &reply, sizeof(reply), fds);
    EXPECT_TRUE(DroppedBy(fd)) << "variant " << variant << " was taken";
    close(fd);
  }
  close(memfd);
  close(wake);
}

// Linked pairs between two devices of this process: each QP holds one descriptor (its end of
// the pair's one connection), and each device one copy of the other's wake eventfd, however
// many QPs; all of them go with the QPs.
TEST(ShmReply, ALinkedQpHoldsOneDescriptor) {
  constexpr int kPairs = 16;
  std::vector<Side> a, b;
  for (int i = 0; i < kPairs; ++i) {
    a.push_back(MakeSide("soft0"));
    b.push_back(MakeSide("soft1"));
  }
  const int base = OpenDescriptors();
  for (int i = 0; i < kPairs; ++i) {
    auto aa = a[i].qp->LocalAddress(100, {});
    auto ba = b[i].qp->LocalAddress(200, {});
    ASSERT_TRUE(aa.ok() && ba.ok());
    ASSERT_TRUE(a[i].qp->Connect(*ba, 100, {}).ok());
    ASSERT_TRUE(WaitForCandidate(b[i])) << "pair " << i;
    ASSERT_TRUE(b[i].qp->Connect(*aa, 200, {}).ok());
  }
  for (int i = 0; i < kPairs; ++i) {
    PostRecv(b[i], 1);
    PostRecv(a[i], 2);
    PostSend(a[i], 3, "to b");
    PostSend(b[i], 4, "to a");
    for (Side* s : {&a[i], &b[i]}) {
      Side* other = s == &a[i] ? &b[i] : &a[i];
      for (int n = 0; n < 2; ++n) {
        ibv_wc wc = Wait(*s, other);
        ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << "pair " << i << ": " << ibv_wc_status_str(wc.status);
      }
    }
  }
  EXPECT_EQ(OpenDescriptors() - base, 2 * kPairs + 2)
      << "descriptors held by " << kPairs << " linked pairs";
  for (int i = 0; i < kPairs; ++i) {
    a[i].qp.reset();
    b[i].qp.reset();
  }
  EXPECT_EQ(OpenDescriptors(), base) << "descriptors left once the QPs are gone";
}

}  // namespace
}  // namespace swirl::soft
