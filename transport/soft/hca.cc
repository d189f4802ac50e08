// The soft HCA: one per device name per process. It owns the GID, the memory-key table, its
// fabric (fabric.h), and one thread that (1) accepts links from peers and serves their
// handshakes through the fabric, (2) notices peers that go away, and (3) makes progress for CQs
// nobody is polling: armed CQs whose owner sleeps on a completion channel, and passive targets
// of one-sided operations.
//
// Also here: the shared-memory fabric (ShmFabric), whose links are hellos over an abstract Unix
// socket named after the GID that hand over sealed memfd segments, which it validates and maps.
// The TCP fabric is tcp_link.cc.

#include <endian.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

#include <openssl/crypto.h>

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/random/distributions.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/log.h"
#include "base/log_limiter.h"
#include "transport/soft/fabric.h"
#include "transport/soft/soft_device.h"
#include "transport/soft/qp_ops.h"

namespace swirl::soft {

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

std::string GidHex(const ibv_gid& gid) {
  std::string out;
  for (unsigned char b : gid.raw) absl::StrAppendFormat(&out, "%02x", b);
  return out;
}

namespace {

constexpr uint64_t kListenId = ~uint64_t{0};
constexpr uint64_t kWakeId = ~uint64_t{0} - 1;
constexpr uint64_t kStopId = ~uint64_t{0} - 2;
constexpr uint64_t kHelloMagic = 0x4f4c4c4548575331ull;  // "1SWHELLO"
constexpr int64_t kStaleNs = 10 * 1000 * 1000;            // a CQ unpolled for 10 ms needs help
// While it makes progress for CQs nobody polls, the HCA thread keeps at it without sleeping
// until it has found nothing to do for this long (then sleeps, asking peers to kick it), and
// goes back to its loop at least this often to see to everything else.
constexpr int64_t kAssistQuietNs = 100 * 1000;
constexpr int64_t kAssistSpinMaxNs = 2 * 1000 * 1000;
constexpr int64_t kAssistYieldAfterNs = 20 * 1000;

// What a QP sends when it reaches RTR: without a link key, with SCM_RIGHTS [segment memfd,
// HCA wake eventfd]; with one (kHelloKeyed), nothing attached: the accepter answers with a
// Challenge, and the opener's Proof carries the descriptors (docs/SOFT_WIRE.md, "Link keys").
// A QP whose peer's hello came first answers on that connection with a reply (kHelloReply,
// with its descriptors) instead of opening one: one connection per QP pair, not two.
// 4: replies (3: flags and a nonce; 2: neither; its version was the segment's).
constexpr uint32_t kHelloVersion = 4;
struct Hello {
  uint64_t magic;
  uint32_t version;
  uint32_t src_qpn;
  uint32_t dst_qpn;
  uint32_t flags;  // kHelloKeyed
  ibv_gid src_gid;
  uint64_t segment_size;
  uint8_t nonce[kNonceBytes];  // keyed: the opener's fresh nonce; else zero
};
static_assert(sizeof(Hello) == 64);

constexpr uint64_t kChallengeMagic = 0x4c4c414843575331ull;  // "1SWCHALL"
struct Challenge {
  uint64_t magic;
  uint32_t flags;  // the accepter's (none defined on shared memory)
  uint32_t reserved;
  uint8_t nonce[kNonceBytes];  // the accepter's fresh nonce
  uint8_t mac[kMacBytes];      // HelloMac(accepter)
};
static_assert(sizeof(Challenge) == 64);

constexpr uint64_t kProofMagic = 0x464f4f5250575331ull;  // "1SWPROOF"
struct Proof {  // with SCM_RIGHTS [segment memfd, HCA wake eventfd]
  uint64_t magic;
  uint8_t mac[kMacBytes];  // HelloMac(opener)
};
static_assert(sizeof(Proof) == 40);

// How long a keyed hello may wait for its QP's key (SetLinkKey before RTR), and how long an
// accepter waits for the proof once it has sent its challenge.
constexpr int64_t kParkedHelloNs = int64_t{30} * 1000 * 1000 * 1000;
constexpr int64_t kProofTimeoutNs = int64_t{5} * 1000 * 1000 * 1000;
// A QP that waited for the peer's hello to reply on, and lost it, opens its own after this.
constexpr int64_t kReopenAfterNs = 50 * 1000 * 1000;

sockaddr_un AddressFor(const ibv_gid& gid, socklen_t* len) {
  sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  std::string name = "swirl-soft1-" + GidHex(gid);
  // Abstract namespace: sun_path[0] == 0; no file to clean up, gone when the process is.
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

swirl::Mutex g_registry_mu;
std::map<std::string, Hca*>& Registry() {
  static auto* registry = new std::map<std::string, Hca*>();
  return *registry;
}

bool IsEventFd(int fd) {
  char link[64];
  std::string path = absl::StrCat("/proc/self/fd/", fd);
  ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
  if (n <= 0) return false;
  link[n] = 0;
  return std::strcmp(link, "anon_inode:[eventfd]") == 0;
}


// Sends one handshake message (SOCK_SEQPACKET: whole or not at all) with `fds` attached
// (SCM_RIGHTS; none if `nfds` is 0). True if all of it went.
bool SendMessage(int fd, const void* data, size_t length, const int* fds, int nfds, int flags) {
  char control[CMSG_SPACE(2 * sizeof(int))];
  std::memset(control, 0, sizeof(control));
  iovec iov{const_cast<void*>(data), length};
  msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (nfds > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
  }
  return sendmsg(fd, &msg, flags) == static_cast<ssize_t>(length);
}

// Validates and maps a peer's segment. Everything here comes from another process.
bool MapPeerSegment(const Hello& hello, int memfd, PeerSegment* out, std::string* why) {
  // What we rely on: its size never changes under our mapping (a shrunk file would fault our
  // reads), and nobody but its owner writes it (the owner's mapping predates the seal).
  constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE;
  int seals = fcntl(memfd, F_GET_SEALS);
  if (seals < 0 || (seals & kSeals) != kSeals) {
    *why = "segment is not a memfd sealed against resizing and writes";
    return false;
  }
  struct stat st;
  if (fstat(memfd, &st) != 0 || static_cast<uint64_t>(st.st_size) != hello.segment_size ||
      hello.segment_size < wire::kRingsOffset + 2 * wire::kMinRingSize ||
      hello.segment_size > wire::kMaxSegmentSize) {
    *why = "segment size out of bounds";
    return false;
  }
  void* base = mmap(nullptr, hello.segment_size, PROT_READ, MAP_SHARED, memfd, 0);
  if (base == MAP_FAILED) {
    *why = absl::StrCat("mmap: ", std::strerror(errno));
    return false;
  }
  wire::SegmentHeader header;
  std::memcpy(&header, base, sizeof(header));
  bool ok = header.magic == wire::kSegmentMagic && header.version == wire::kWireVersion &&
            header.qp_num == hello.src_qpn && header.segment_size == hello.segment_size &&
            SegmentGeometryOk(hello.segment_size, header.request_ring_offset,
                              header.request_ring_size, header.response_ring_offset,
                              header.response_ring_size);
  if (!ok) {
    munmap(base, hello.segment_size);
    *why = "segment header invalid";
    return false;
  }
  out->base = static_cast<const char*>(base);
  out->size = hello.segment_size;
  out->request_ring_offset = header.request_ring_offset;
  out->request_ring_size = header.request_ring_size;
  out->response_ring_offset = header.response_ring_offset;
  out->response_ring_size = header.response_ring_size;
  out->gid = hello.src_gid;
  out->qp_num = hello.src_qpn;
  return true;
}

}  // namespace

LinkAuth::~LinkAuth() {
  if (toward_hca != nullptr) toward_hca->CountHandshakeToward(toward_qpn, -1);
  if (memfd >= 0) close(memfd);
  OPENSSL_cleanse(key.data(), key.size());
}

bool ParseTrustedUids(const char* text, std::vector<uid_t>* uids) {
  uids->clear();
  if (text == nullptr || *text == 0) return true;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    uint32_t uid;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &uid)) return false;
    uids->push_back(static_cast<uid_t>(uid));
  }
  return true;
}

bool UidTrusted(uid_t uid) {
  if (uid == getuid()) return true;
  // Read once: the trust of a process does not change under its links.
  static const std::vector<uid_t>* trusted = [] {
    auto* list = new std::vector<uid_t>();
    if (!ParseTrustedUids(std::getenv("SWIRL_SOFT_TRUSTED_UIDS"), list)) {
      SWIRL_LOG(ERROR, "soft: SWIRL_SOFT_TRUSTED_UIDS='%s' is not a list of uids: trusting none",
                std::getenv("SWIRL_SOFT_TRUSTED_UIDS"));
      list->clear();
    }
    return list;
  }();
  return std::find(trusted->begin(), trusted->end(), uid) != trusted->end();
}

QpKeyState QpKeyFor(Hca* hca, uint32_t qpn, LinkKey* key, uint64_t* serial) {
  auto it = hca->qps.find(qpn);
  if (it == hca->qps.end()) return QpKeyState::kNoQp;
  SoftQp* qp = it->second;
  swirl::MutexLock lock(&qp->key_mu);
  if (qp->key_serial != 0) {
    *key = qp->link_key;
    *serial = qp->key_serial;
    return QpKeyState::kKeyed;
  }
  return qp->key_final ? QpKeyState::kKeyless : QpKeyState::kWait;
}

bool SegmentGeometryOk(uint64_t segment_size, uint64_t request_ring_offset,
                       uint64_t request_ring_size, uint64_t response_ring_offset,
                       uint64_t response_ring_size) {
  if (segment_size < wire::kRingsOffset + 2 * wire::kMinRingSize ||
      segment_size > wire::kMaxSegmentSize) {
    return false;
  }
  auto ring_ok = [&](uint64_t offset, uint64_t size) {
    return std::has_single_bit(size) && size >= wire::kMinRingSize && size <= wire::kMaxRingSize &&
           offset >= wire::kRingsOffset && offset % 4096 == 0 && offset <= segment_size &&
           size <= segment_size - offset;
  };
  return ring_ok(request_ring_offset, request_ring_size) &&
         ring_ok(response_ring_offset, response_ring_size) &&
         (request_ring_offset + request_ring_size <= response_ring_offset ||
          response_ring_offset + response_ring_size <= request_ring_offset);
}

namespace {

// `qp`'s reply on connection `fd` (the one its peer's hello came on): our segment back, with
// [memfd, HCA wake eventfd]. On a keyed link that connection is the one the peer proved the key
// on, so the reply needs no MAC of its own. The caller holds watch_mu (the watch, and so `fd`,
// stay) and qp->incoming_mu (the memfd stays). False if it could not be sent.
bool SendReplyOn(int fd, SoftQp* qp) {
  Hca* hca = qp->hca;
  if (qp->memfd < 0) return false;
  Hello hello;
  std::memset(&hello, 0, sizeof(hello));
  hello.magic = kHelloMagic;
  hello.version = kHelloVersion;
  hello.src_qpn = qp->qp_num;
  hello.dst_qpn = qp->attr.dest_qp_num;
  hello.flags = kHelloReply;
  hello.src_gid = hca->gid;
  hello.segment_size = qp->own_size;
  const int fds[2] = {qp->memfd, hca->wake_fd};
  return SendMessage(fd, &hello, sizeof(hello), fds, 2, MSG_NOSIGNAL | MSG_DONTWAIT);
}

}  // namespace

bool OfferSegment(Hca* hca, uint64_t watch_id, uint32_t dst_qpn, const PeerSegment& segment,
                  std::string* why) {
  auto qp = hca->qps.find(dst_qpn);
  auto watch = hca->watches.find(watch_id);
  if (qp == hca->qps.end() || watch == hca->watches.end()) {
    *why = "no such QP";
    return false;
  }
  {
    swirl::MutexLock incoming(&qp->second->incoming_mu);
    if (qp->second->incoming.size() >= 4) {
      *why = "too many pending links";
      return false;
    }
    qp->second->incoming.push_back(segment);
    SoftQp* target = qp->second;
    if (target->want_reply && watch->second.tcp == nullptr && IsExpectedPeer(target, segment) &&
        SendReplyOn(watch->second.fd, target)) {
      // Sent now, not when the QP adopts the hello: its owner may not drive it for a while
      // (a caller-driven channel), and the peer needs our segment to read what we send.
      target->want_reply = false;
      target->replied_watch = watch_id;
    }
  }
  watch->second.qp = qp->second;
  // The QP picks it up at its next progress.
  qp->second->link_event.store(true, std::memory_order_release);
  return true;
}

namespace {

void CloseFds(int* fds, int n) {
  for (int i = 0; i < n; ++i) {
    if (fds[i] >= 0) close(fds[i]);
  }
}

// One message of a shared-memory handshake (SOCK_SEQPACKET keeps them whole), with the
// descriptors it carries (at most two kept; any more are closed). Returns its length, -1 if
// none is there yet, or 0 if the peer closed or sent something no message is (truncated).
ssize_t ReceiveMessage(int fd, void* buffer, size_t capacity, int fds[2], int* nfds) {
  char control[CMSG_SPACE(2 * sizeof(int))];
  iovec iov{buffer, capacity};
  msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  fds[0] = fds[1] = -1;
  *nfds = 0;
  ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return -1;  // not yet
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); n >= 0 && c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      int count = static_cast<int>((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
      for (int i = 0; i < count; ++i) {
        int received;
        std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        if (*nfds < 2) {
          fds[(*nfds)++] = received;
        } else {
          close(received);
        }
      }
    }
  }
  if (n <= 0 || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
    CloseFds(fds, 2);
    *nfds = 0;
    return 0;
  }
  return n;
}

// The accepter's challenge for a keyed hello, once its QP's key is known.
bool SendChallenge(Hca* hca, int fd, LinkAuth& auth) {
  auth.nonce = NewNonce();
  auth.accepter_flags = 0;
  auth.accepter_gid = hca->gid;
  const Mac mac = HelloMac(auth.key, AuthRole::kAccepter, AuthFabric::kShm, auth.hello,
                           auth.accepter_gid, auth.nonce, auth.accepter_flags);
  Challenge challenge;
  std::memset(&challenge, 0, sizeof(challenge));
  challenge.magic = kChallengeMagic;
  challenge.flags = auth.accepter_flags;
  std::memcpy(challenge.nonce, auth.nonce.data(), kNonceBytes);
  std::memcpy(challenge.mac, mac.data(), kMacBytes);
  auth.phase = LinkAuth::kAwaitProof;
  auth.deadline_ns = NowNs() + kProofTimeoutNs;
  return send(fd, &challenge, sizeof(challenge), MSG_NOSIGNAL | MSG_DONTWAIT) ==
         static_cast<ssize_t>(sizeof(challenge));
}

// Validates and maps the segment of a hello that passed (keyless, or keyed and proved) and
// offers it to its QP. Consumes `fds` (memfd, wake eventfd) either way.
bool OfferHello(Hca* hca, uint64_t watch_id, const Hello& hello, int fds[2],
                uint64_t auth_serial, pid_t peer_pid, std::string* why) {
  PeerSegment segment;
  if (!IsEventFd(fds[1])) {
    *why = "wake descriptor is not an eventfd";
  } else if (MapPeerSegment(hello, fds[0], &segment, why)) {
    close(fds[0]);
    fds[0] = -1;
    // Writing the peer's eventfd must never block us.
    fcntl(fds[1], F_SETFL, fcntl(fds[1], F_GETFL) | O_NONBLOCK);
    segment.wake_fd = hca->SharePeerWake(peer_pid, hello.src_gid, fds[1]);
    segment.wake_pid = peer_pid;
    fds[1] = -1;
    segment.watch = watch_id;
    segment.auth_serial = auth_serial;
    bool offered;
    {
      swirl::ReaderMutexLock lock(&hca->mu);
      swirl::MutexLock watch_lock(&hca->watch_mu);
      offered = OfferSegment(hca, watch_id, hello.dst_qpn, segment, why);
    }
    if (offered) return true;
    munmap(const_cast<char*>(segment.base), segment.size);
    hca->ReleasePeerWake(segment.wake_pid, segment.gid, segment.wake_fd);
  }
  CloseFds(fds, 2);
  return false;
}

// A message on a connection a peer opened to us: its hello, or (keyed) its proof. Returns
// false if the connection should be dropped. Only this thread touches such a connection's
// watch until it is offered to a QP, so its handshake state is read without watch_mu.
bool ReceiveHello(Hca* hca, uint64_t watch_id, int fd, LinkAuth* auth, pid_t peer_pid) {
  union {
    Hello hello;
    Proof proof;
    char bytes[128];
  } message;
  int fds[2];
  int nfds;
  const ssize_t n = ReceiveMessage(fd, &message, sizeof(message), fds, &nfds);
  if (n < 0) return true;  // not yet
  if (n == 0) return false;  // closed (or sent what no message is)
  std::string why;
  uint32_t dst_qpn = 0;
  if (auth != nullptr) {
    Hello hello;
    std::memcpy(&hello, auth->hello.data(), sizeof(hello));
    dst_qpn = hello.dst_qpn;
    if (auth->phase != LinkAuth::kAwaitProof) {
      why = "spoke before its challenge";
    } else if (n != static_cast<ssize_t>(sizeof(Proof)) || message.proof.magic != kProofMagic ||
               nfds != 2) {
      why = "malformed proof";
    } else {
      Mac mac;
      std::memcpy(mac.data(), message.proof.mac, kMacBytes);
      if (!MacEqual(mac, HelloMac(auth->key, AuthRole::kOpener, AuthFabric::kShm, auth->hello,
                                  auth->accepter_gid, auth->nonce, auth->accepter_flags))) {
        why = "proof does not match the QP's link key";
      } else if (OfferHello(hca, watch_id, hello, fds, auth->key_serial, peer_pid, &why)) {
        swirl::MutexLock watch_lock(&hca->watch_mu);
        auto it = hca->watches.find(watch_id);
        if (it != hca->watches.end()) it->second.auth.reset();
        return true;
      }
    }
  } else {
    const Hello& hello = message.hello;
    dst_qpn = hello.dst_qpn;
    const bool keyed = (hello.flags & kHelloKeyed) != 0;
    if (n != static_cast<ssize_t>(sizeof(hello)) || hello.magic != kHelloMagic ||
        hello.version != kHelloVersion || (hello.flags & ~kHelloKeyed) != 0 ||
        nfds != (keyed ? 0 : 2)) {
      why = "malformed hello";
    } else {
      LinkKey key;
      uint64_t serial = 0;
      QpKeyState state;
      {
        swirl::ReaderMutexLock lock(&hca->mu);
        state = QpKeyFor(hca, hello.dst_qpn, &key, &serial);
      }
      if (state == QpKeyState::kNoQp) {
        why = "no such QP";
      } else if (!keyed && state == QpKeyState::kKeyed) {
        why = "keyless hello for a QP with a link key";
      } else if (keyed && state == QpKeyState::kKeyless) {
        why = "keyed hello for a QP without a link key";
      } else if (!keyed) {
        if (OfferHello(hca, watch_id, hello, fds, 0, peer_pid, &why)) return true;
      } else {
        // Nothing is mapped or offered before the proof: a hello costs this state only.
        auto fresh = std::make_unique<LinkAuth>();
        fresh->hello.assign(reinterpret_cast<const uint8_t*>(&hello),
                            reinterpret_cast<const uint8_t*>(&hello) + sizeof(hello));
        fresh->key = key;
        fresh->key_serial = serial;
        fresh->toward_hca = hca;
        fresh->toward_qpn = hello.dst_qpn;
        hca->CountHandshakeToward(hello.dst_qpn, 1);
        bool ok = true;
        if (state == QpKeyState::kWait) {
          fresh->phase = LinkAuth::kAwaitKey;  // ResumeParkedShm answers once the key is set
          fresh->deadline_ns = NowNs() + kParkedHelloNs;
        } else {
          ok = SendChallenge(hca, fd, *fresh);
          if (!ok) why = "cannot send the challenge";
        }
        if (ok) {
          hca->handshakes_pending.store(true, std::memory_order_release);
          swirl::MutexLock watch_lock(&hca->watch_mu);
          auto it = hca->watches.find(watch_id);
          if (it != hca->watches.end()) it->second.auth = std::move(fresh);
          return true;
        }
      }
    }
  }
  CloseFds(fds, 2);
  SWIRL_LOG_LIMITED(hca->peer_log, WARNING, "soft %s: refused a link to QP 0x%x: %s", hca->name,
                    dst_qpn, why);
  return false;
}

// The opener's side of a keyed handshake (watch_mu held: the QP may drop the watch at any
// time): checks the accepter's challenge and answers it with the proof and our descriptors.
// False if the connection is to be treated as refused.
bool ReceiveChallenge(Hca* hca, LinkWatch& watch) {
  LinkAuth& auth = *watch.auth;
  union {
    Challenge challenge;
    char bytes[128];
  } message;
  int fds[2];
  int nfds;
  const ssize_t n = ReceiveMessage(watch.fd, &message, sizeof(message), fds, &nfds);
  if (n < 0) return true;
  CloseFds(fds, 2);
  std::string why;
  if (n != static_cast<ssize_t>(sizeof(Challenge)) || message.challenge.magic != kChallengeMagic ||
      nfds != 0 || message.challenge.flags != 0) {
    why = n == 0 ? "closed" : "malformed challenge";
  } else {
    Nonce nonce;
    Mac mac;
    std::memcpy(nonce.data(), message.challenge.nonce, kNonceBytes);
    std::memcpy(mac.data(), message.challenge.mac, kMacBytes);
    if (!MacEqual(mac, HelloMac(auth.key, AuthRole::kAccepter, AuthFabric::kShm, auth.hello,
                                auth.accepter_gid, nonce, message.challenge.flags))) {
      why = "challenge does not match the QP's link key";
    } else {
      const Mac proof_mac = HelloMac(auth.key, AuthRole::kOpener, AuthFabric::kShm, auth.hello,
                                     auth.accepter_gid, nonce, message.challenge.flags);
      Proof proof;
      proof.magic = kProofMagic;
      std::memcpy(proof.mac, proof_mac.data(), kMacBytes);
      const int send_fds[2] = {auth.memfd, hca->wake_fd};
      if (SendMessage(watch.fd, &proof, sizeof(proof), send_fds, 2,
                      MSG_NOSIGNAL | MSG_DONTWAIT)) {
        watch.auth.reset();  // closes our copy of the memfd
        return true;
      }
      why = absl::StrCat("cannot send the proof: ", std::strerror(errno));
    }
  }
  if (n != 0) {
    SWIRL_LOG_LIMITED(hca->peer_log, WARNING, "soft %s: QP 0x%x refused its peer's answer: %s",
                      hca->name, watch.qp != nullptr ? watch.qp->qp_num : 0, why);
  }
  return false;
}

// The peer's reply on the connection our QP opened (watch_mu held, as the QP may drop the
// watch at any time): its segment, sent back on our connection because our hello reached it
// first. Taken once; the rest of the checks are OfferHello's and the QP's (IsExpectedPeer).
// False if the connection is to be treated as refused. Leaves what it received in *reply,
// `fds` and *serial for the caller to offer once watch_mu is released.
bool ReceiveReply(Hca* hca, LinkWatch& watch, Hello* reply, int fds[2], uint64_t* serial) {
  union {
    Hello hello;
    char bytes[128];
  } message;
  int nfds;
  const ssize_t n = ReceiveMessage(watch.fd, &message, sizeof(message), fds, &nfds);
  if (n < 0) return true;
  std::string why;
  const Hello& hello = message.hello;
  if (n == 0) {
    why = "closed";
  } else if (n != static_cast<ssize_t>(sizeof(Hello)) || hello.magic != kHelloMagic ||
             hello.version != kHelloVersion || hello.flags != kHelloReply || nfds != 2) {
    why = "malformed reply";
  } else if (hello.dst_qpn != watch.qp->qp_num) {
    why = "reply for another QP";  // it would move our watch to that QP
  } else {
    watch.reply_allowed = false;
    *reply = hello;
    *serial = watch.hello_serial;
    return true;
  }
  CloseFds(fds, 2);
  if (n != 0) {
    SWIRL_LOG_LIMITED(hca->peer_log, WARNING, "soft %s: QP 0x%x refused its peer's reply: %s",
                      hca->name, watch.qp->qp_num, why);
  }
  return false;
}

AcceptResult AcceptAll(Hca* hca) {
  for (;;) {
    int fd = accept4(hca->listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      return errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM
                 ? AcceptResult::kOutOfResources
                 : AcceptResult::kDone;
    }
    // Only processes of users we trust may link to our QPs, as with a device node's mode.
    ucred cred;
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || !UidTrusted(cred.uid)) {
      SWIRL_LOG_LIMITED(hca->peer_log, WARNING,
                        "soft %s: refused a link from uid %d (not ours, nor in "
                        "SWIRL_SOFT_TRUSTED_UIDS)",
                        hca->name, static_cast<int>(cred.uid));
      close(fd);
      continue;
    }
    hca->Watch(fd, nullptr, nullptr, cred.pid);
  }
}

// An event on a shared-memory link's connection: a hello, a keyed handshake's next message,
// or its end.
void HandleShmEvent(Hca* hca, uint64_t id, uint32_t events) {
  int fd = -1;
  SoftQp* qp = nullptr;
  LinkAuth* auth = nullptr;
  pid_t peer_pid = 0;
  Hello reply;
  int reply_fds[2] = {-1, -1};
  uint64_t reply_serial = 0;
  {
    swirl::MutexLock lock(&hca->watch_mu);
    auto it = hca->watches.find(id);
    if (it == hca->watches.end()) return;
    fd = it->second.fd;
    qp = it->second.qp;
    auth = it->second.auth.get();
    peer_pid = it->second.peer_pid;
    if (qp != nullptr && (events & EPOLLIN) && (auth != nullptr || it->second.reply_allowed)) {
      // Our keyed hello's answer, or the peer's reply. Under watch_mu: the QP may drop this
      // watch at any time.
      const bool ok = auth != nullptr
                          ? ReceiveChallenge(hca, it->second)
                          : ReceiveReply(hca, it->second, &reply, reply_fds, &reply_serial);
      if (!ok) {
        epoll_ctl(hca->epoll_fd, EPOLL_CTL_DEL, it->second.fd, nullptr);
        WatchEnded(it->second);  // as if the accepter had refused the hello
        // A bad reply is the peer's last word: it sees the connection end (the QP keeps the
        // descriptor until it lets go of the watch).
        if (auth == nullptr) shutdown(it->second.fd, SHUT_RDWR);
        return;
      }
      if (reply_fds[0] < 0) return;  // (a challenge answered, or nothing there yet)
    }
  }
  if (reply_fds[0] >= 0) {
    // Mapped and offered as a hello would be, to the QP whose connection it came on.
    std::string why;
    if (!OfferHello(hca, id, reply, reply_fds, reply_serial, peer_pid, &why)) {
      SWIRL_LOG_LIMITED(hca->peer_log, WARNING, "soft %s: refused a reply to QP 0x%x: %s",
                        hca->name, reply.dst_qpn, why);
      swirl::MutexLock lock(&hca->watch_mu);
      auto it = hca->watches.find(id);
      if (it != hca->watches.end()) {
        epoll_ctl(hca->epoll_fd, EPOLL_CTL_DEL, it->second.fd, nullptr);
        WatchEnded(it->second);
        shutdown(it->second.fd, SHUT_RDWR);
      }
    }
    return;
  }
  if (qp == nullptr && (events & EPOLLIN)) {
    if (!ReceiveHello(hca, id, fd, auth, peer_pid)) hca->Unwatch(id);
    return;
  }
  if (events & (EPOLLHUP | EPOLLRDHUP | EPOLLERR)) {
    swirl::MutexLock lock(&hca->watch_mu);
    auto it = hca->watches.find(id);
    if (it == hca->watches.end()) return;
    epoll_ctl(hca->epoll_fd, EPOLL_CTL_DEL, it->second.fd, nullptr);
    if (it->second.qp != nullptr) {
      WatchEnded(it->second);
    } else {
      hca->UnwatchLocked(id);
    }
  } else if (events & EPOLLIN) {
    // Nothing is expected after the hello; a peer that keeps talking is dropped.
    char sink[64];
    if (recv(fd, sink, sizeof(sink), MSG_DONTWAIT) > 0) {
      swirl::MutexLock lock(&hca->watch_mu);
      auto it = hca->watches.find(id);
      if (it != hca->watches.end() && it->second.qp != nullptr) {
        WatchEnded(it->second);
        epoll_ctl(hca->epoll_fd, EPOLL_CTL_DEL, it->second.fd, nullptr);
      }
    }
  }
}

// Decides which CQs need the HCA thread: armed ones (their owner sleeps in ibv_get_cq_event) and
// ones nobody has polled for a while (passive targets, idle servers). Returns true if any.
bool MarkAssistedCqs(Hca* hca, int64_t now) {
  bool any = false;
  swirl::ReaderMutexLock lock(&hca->mu);
  for (SoftCq* cq : hca->cqs) {
    const uint64_t polls = cq->polls.load(std::memory_order_relaxed);
    if (polls != cq->last_polls_seen) {
      cq->last_polls_seen = polls;
      cq->last_change_ns = now;
    }
    const bool attached = cq->attached.load(std::memory_order_relaxed) > 0;
    cq->assist_armed = attached && cq->armed.load(std::memory_order_relaxed) != 0;
    cq->assist_stale = attached && now - cq->last_change_ns >= kStaleNs;
    any |= cq->assist_armed || cq->assist_stale;
  }
  return any;
}

bool Assisted(const SoftQp* qp) { return HcaAssists(qp); }

// One round of progress for every QP its owner is not busy with (a requester was stalled on
// one of them: KickPeerHca). Returns true if anything moved.
bool ProgressAll(Hca* hca) {
  bool did = false;
  swirl::ReaderMutexLock lock(&hca->mu);
  const std::vector<SoftQp*>& qps = hca->qp_list;
  WalkPrefetched(qps.size(), [&](size_t k) { return qps[k]; }, [&](SoftQp* qp) {
    // The CQ poll's own test (ProgressAssisted): a QP idle under its hint, with nothing arrived
    // since, has nothing to progress, and a kick for one stalled request must not cost a
    // server with 10,000 quiet connections a round of progress on each.
    if (IdleWithoutLock(qp) || !qp->lock.try_lock()) return;
    did |= ProgressLocked(qp);
    qp->lock.unlock();
  });
  return did;
}

bool ProgressAssisted(Hca* hca) {
  bool did = false;
  swirl::ReaderMutexLock lock(&hca->mu);
  const std::vector<SoftQp*>& qps = hca->qp_list;
  WalkPrefetched(qps.size(), [&](size_t k) { return qps[k]; }, [&](SoftQp* qp) {
    // An idle QP with nothing arrived since (the CQ poll's own test) has nothing to progress:
    // without the test, a server holding thousands of quiet connections had its HCA thread
    // run every one of them through progress on every round while its worker slept.
    if (IdleWithoutLock(qp) || !Assisted(qp) || !qp->lock.try_lock()) return;
    did |= ProgressLocked(qp);
    qp->lock.unlock();
  });
  return did;
}

void SetSleeping(Hca* hca, uint64_t value) {
  swirl::ReaderMutexLock lock(&hca->mu);
  for (SoftQp* qp : hca->qp_list) {
    if (value != 0 && !Assisted(qp)) continue;
    if (wire::SegmentControl* ctrl = qp->ctrl_for_hca.load(std::memory_order_acquire)) {
      ctrl->sleeping.value.store(value, std::memory_order_relaxed);
    }
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

void HcaLoop(Hca* hca) {
  // The thread was created by whichever application thread opened the device first, and would
  // inherit its pinning: it must not compete with that thread for its core. It takes the
  // process's CPUs instead, as the main thread has them (`taskset -c 1 server` keeps its HCA
  // thread on core 1, off a client pinned to core 0), or every CPU if that cannot be read.
  cpu_set_t cpus;
  if (sched_getaffinity(getpid(), sizeof(cpus), &cpus) != 0) {
    CPU_ZERO(&cpus);
    for (int cpu = 0; cpu < CPU_SETSIZE && cpu < sysconf(_SC_NPROCESSORS_ONLN); ++cpu) {
      CPU_SET(cpu, &cpus);
    }
  }
  sched_setaffinity(0, sizeof(cpus), &cpus);
  epoll_event events[64];
  int64_t accept_paused_until = 0;  // out of descriptors: the listener rests, or it would spin
  int64_t next_resume_ns = 0;
  for (;;) {
    const int64_t now = NowNs();
    const bool assist = hca->assist && MarkAssistedCqs(hca, now);
    hca->fabric->TendLinks(now);
    // Keyed hellos that wait for their QP's key: at once when one was set, else every 10 ms
    // (for their deadlines).
    if (hca->keys_changed.exchange(false, std::memory_order_acq_rel) ||
        (now >= next_resume_ns && hca->handshakes_pending.load(std::memory_order_acquire))) {
      next_resume_ns = now + 10 * 1000 * 1000;
      hca->fabric->ResumeParked();
    }
    if (accept_paused_until != 0 && now >= accept_paused_until) {
      accept_paused_until = 0;
      epoll_event ev;
      ev.events = EPOLLIN;
      ev.data.u64 = kListenId;
      epoll_ctl(hca->epoll_fd, EPOLL_CTL_ADD, hca->listen_fd, &ev);
    }
    int timeout_ms;
    {
      // A fabric with link deadlines (TCP: ExpireTcpLinks) keeps time for them even with no CQ.
      swirl::ReaderMutexLock lock(&hca->mu);
      timeout_ms = hca->cqs.empty() && !hca->fabric->HasLinkDeadlines() &&
                           accept_paused_until == 0
                       ? -1
                       : 10;
    }
    const bool waited_for = hca->pass_waiters.load(std::memory_order_acquire) > 0;
    if (waited_for) timeout_ms = 0;
    if (assist) {
      // Ask peers to kick our eventfd, then look once more: a frame published before a peer
      // saw the flag is found here instead of being slept through.
      SetSleeping(hca, 1);
      if (ProgressAssisted(hca)) timeout_ms = 0;
    }
    int n = epoll_wait(hca->epoll_fd, events, 64, timeout_ms);
    if (assist) SetSleeping(hca, 0);
    for (int i = 0; i < n; ++i) {
      const uint64_t id = events[i].data.u64;
      if (id == kStopId) return;
      if (id == kListenId) {
        const AcceptResult result = hca->fabric->Accept();
        if (result != AcceptResult::kDone) {
          if (result == AcceptResult::kOutOfResources) {
            SWIRL_LOG(WARNING, "soft %s: cannot accept links: %s; retrying in 100 ms",
                      hca->name, std::strerror(errno));
          }
          // The listener rests (level-triggered, it would wake us again at once).
          epoll_ctl(hca->epoll_fd, EPOLL_CTL_DEL, hca->listen_fd, nullptr);
          accept_paused_until =
              NowNs() + (result == AcceptResult::kBusy ? 10 : 100) * 1000 * 1000;
        }
      } else if (id == kWakeId) {
        uint64_t count;
        while (read(hca->wake_fd, &count, sizeof(count)) > 0) {
        }
        // A peer kicked us: because we slept while assisting (the rounds below serve it), or
        // because one of its requests to a QP here stalled, which this round serves. Not with
        // SWIRL_SOFT_PROGRESS=off: then only a QP's owner moves it, which is what tests that
        // hold a transfer unfinished on purpose (and instruction counts) rely on.
        if (hca->assist) ProgressAll(hca);
      } else {
        hca->fabric->HandleEvent(id, events[i].events);
      }
    }
    if (waited_for) {
      swirl::MutexLock lock(&hca->pass_mu);
      ++hca->passes;
      hca->pass_cv.SignalAll();
    }
    if (assist && !waited_for) {
      // A passive target with traffic flowing (RDMA WRITEs into memory nobody polls, a server
      // asleep in ibv_get_cq_event) is served as a NIC would serve it, without a sleep and a
      // wakeup (~10 us here) between frames: only a quiet spell ends the spin. Once quiet for
      // kAssistYieldAfterNs, a round that found nothing gives the core away until the next
      // (sched_yield): with more busy threads than cores, the spin otherwise holds the core
      // that the threads it serves (the sleeping owner once woken, a connection being set up)
      // wait for. Not sooner: a yield costs a system call (1.4 us here) that a frame arriving
      // meanwhile waits out, and a passive target's ping-pong (ib_write_lat) has quiet rounds
      // between every two frames.
      const int64_t start = NowNs();
      int64_t quiet_since = start;
      for (int64_t now2 = start; now2 - quiet_since < kAssistQuietNs &&
                                 now2 - start < kAssistSpinMaxNs;
           now2 = NowNs()) {
        if (ProgressAssisted(hca)) {
          quiet_since = now2;
        } else if (now2 - quiet_since >= kAssistYieldAfterNs) {
          sched_yield();
        } else {
          CpuRelax();
        }
      }
    }
    // TCP fabric: what the rounds above published (acks of a sleeping owner's receives), what
    // a full socket held back, and state changes that woke nobody (within the 10 ms timeout).
    hca->fabric->ShipPending();
  }
}

// A device's GUID names it for the life of the process, as a NIC's does, even when the
// device is closed and opened again (ibv_get_device_guid opens it to read the GUID, and the
// program opens it afterwards): drawn once per name.
uint64_t DeviceGuid(const std::string& name) {
  static swirl::Mutex mu;
  static auto* guids = new absl::flat_hash_map<std::string, uint64_t>();
  swirl::MutexLock lock(&mu);
  auto [it, inserted] = guids->try_emplace(name, 0);
  if (inserted) {
    absl::BitGen gen;
    while (it->second == 0) it->second = absl::Uniform<uint64_t>(gen);
  }
  return it->second;
}

Hca* CreateHca(const std::string& name, std::string* error) {
  auto hca = std::make_unique<Hca>();
  hca->name = name;
  {
    absl::BitGen gen;
    hca->gid.raw[0] = 0xfe;
    hca->gid.raw[1] = 0x80;
    for (int i = 8; i < 16; ++i) hca->gid.raw[i] = absl::Uniform<uint8_t>(gen);
    hca->guid = DeviceGuid(name);
  }
  if (const char* env = std::getenv("SWIRL_SOFT_PROGRESS")) {
    hca->assist = std::strcmp(env, "off") != 0;
  }
  hca->fabric = OpenFabric(hca.get(), error);
  if (hca->fabric == nullptr) return nullptr;
  hca->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  hca->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  hca->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  if (hca->wake_fd < 0 || hca->stop_fd < 0 || hca->epoll_fd < 0) {
    *error = absl::StrCat("soft device ", name, ": ", std::strerror(errno));
    for (int fd : {hca->listen_fd, hca->wake_fd, hca->stop_fd, hca->epoll_fd}) {
      if (fd >= 0) close(fd);
    }
    return nullptr;
  }
  epoll_event ev;
  ev.events = EPOLLIN;
  ev.data.u64 = kListenId;
  epoll_ctl(hca->epoll_fd, EPOLL_CTL_ADD, hca->listen_fd, &ev);
  ev.data.u64 = kWakeId;
  epoll_ctl(hca->epoll_fd, EPOLL_CTL_ADD, hca->wake_fd, &ev);
  ev.data.u64 = kStopId;
  epoll_ctl(hca->epoll_fd, EPOLL_CTL_ADD, hca->stop_fd, &ev);
  Hca* raw = hca.release();
  raw->thread = std::thread(HcaLoop, raw);
  return raw;
}

}  // namespace

void ResumeParkedShm(Hca* hca) {
  swirl::ReaderMutexLock lock(&hca->mu);
  swirl::MutexLock watch_lock(&hca->watch_mu);
  const int64_t now = NowNs();
  std::vector<std::pair<uint64_t, const char*>> refused;
  bool pending = false;
  for (auto& [id, watch] : hca->watches) {
    LinkAuth* auth = watch.auth.get();
    if (auth == nullptr || watch.qp != nullptr) continue;  // only a peer's connections wait
    pending = true;
    if (auth->phase == LinkAuth::kAwaitKey) {
      Hello hello;
      std::memcpy(&hello, auth->hello.data(), sizeof(hello));
      const QpKeyState state = QpKeyFor(hca, hello.dst_qpn, &auth->key, &auth->key_serial);
      if (state == QpKeyState::kKeyed) {
        if (!SendChallenge(hca, watch.fd, *auth)) refused.push_back({id, "cannot send challenge"});
      } else if (state == QpKeyState::kNoQp) {
        refused.push_back({id, "its QP is gone"});
      } else if (state == QpKeyState::kKeyless) {
        refused.push_back({id, "keyed hello for a QP without a link key"});
      } else if (now >= auth->deadline_ns) {
        refused.push_back({id, "its QP was given no link key in time"});
      }
    } else if (auth->phase == LinkAuth::kAwaitProof && now >= auth->deadline_ns) {
      refused.push_back({id, "no proof in time"});
    }
  }
  for (const auto& [id, why] : refused) {
    SWIRL_LOG_LIMITED(hca->peer_log, WARNING, "soft %s: refused a keyed link: %s", hca->name,
                      why);
    hca->UnwatchLocked(id);
  }
  // (One that starts after this look sets the flag again.)
  if (!pending) hca->handshakes_pending.store(false, std::memory_order_release);
}

// ---- The shared-memory fabric (fabric.h) ----------------------------------------------------

namespace {

// Our hello to the peer (keyed if the QP has a key), watched for the peer's answer and
// hang-up. -errno if it could not be sent.
int SendHelloFor(SoftQp* qp) {
  LinkKey key;
  const uint64_t serial = LinkKeyOf(qp, &key);
  std::unique_ptr<LinkAuth> auth;
  pid_t peer_pid = 0;
  const int fd =
      SendHello(qp->hca, qp->attr.ah_attr.grh.dgid, qp->qp_num, qp->attr.dest_qp_num, qp->memfd,
                qp->own_size, serial != 0 ? &key : nullptr, serial, &auth, &peer_pid);
  OPENSSL_cleanse(key.data(), key.size());
  if (fd < 0) return fd;
  qp->out_socket = fd;
  // The peer may reply before Watch returns: the watch says so from the start.
  qp->out_watch = qp->hca->Watch(fd, qp, std::move(auth), peer_pid, serial);
  return fd;
}

// `qp`'s reply on watch `id`'s connection; false if there is none or it could not be sent.
bool SendReply(SoftQp* qp, uint64_t id) {
  swirl::MutexLock lock(&qp->hca->watch_mu);
  auto it = qp->hca->watches.find(id);
  if (it == qp->hca->watches.end() || it->second.dead) return false;
  swirl::MutexLock incoming(&qp->incoming_mu);
  if (!SendReplyOn(it->second.fd, qp)) return false;
  qp->replied_watch = id;
  return true;
}

enum class AtRtr { kReplied, kAwaitingHandshake, kNothing };

// At RTR: if the hello of the peer `qp` expects is already here (the peer reached RTR first),
// the QP replies on its connection and opens none of its own; if a keyed hello's handshake
// toward it is under way (from its peer, presumably: a stranger's fails, and RetryLink opens
// a connection of ours after all), it replies when that hello is offered.
AtRtr ReplyAtRtr(SoftQp* qp) {
  Hca* hca = qp->hca;
  {
    swirl::MutexLock lock(&hca->watch_mu);
    swirl::MutexLock incoming(&qp->incoming_mu);
    for (const PeerSegment& c : qp->incoming) {
      if (!IsExpectedPeer(qp, c)) continue;
      auto it = hca->watches.find(c.watch);
      if (it == hca->watches.end() || it->second.dead) continue;
      if (SendReplyOn(it->second.fd, qp)) {
        qp->replied_watch = c.watch;
        return AtRtr::kReplied;
      }
    }
  }
  if (!hca->HandshakeToward(qp->qp_num)) return AtRtr::kNothing;
  swirl::MutexLock incoming(&qp->incoming_mu);
  qp->want_reply = true;
  return AtRtr::kAwaitingHandshake;
}

}  // namespace

std::unique_ptr<Fabric> ShmFabric::Open(Hca* hca, std::string* error) {
  std::unique_ptr<Fabric> fabric(new ShmFabric(hca));
  hca->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  socklen_t len;
  sockaddr_un addr = AddressFor(hca->gid, &len);
  if (hca->listen_fd < 0 || bind(hca->listen_fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      listen(hca->listen_fd, 1024) != 0) {
    *error = absl::StrCat("soft device ", hca->name, ": ", std::strerror(errno));
    if (hca->listen_fd >= 0) close(hca->listen_fd);
    hca->listen_fd = -1;
    return nullptr;
  }
  return fabric;
}

AcceptResult ShmFabric::Accept() { return AcceptAll(hca_); }

void ShmFabric::HandleEvent(uint64_t id, uint32_t events) { HandleShmEvent(hca_, id, events); }

void ShmFabric::ResumeParked() { ResumeParkedShm(hca_); }

namespace {

// Waits until the HCA thread has completed `n` passes of its loop (kicked at once, and not
// sleeping meanwhile), or `timeout`. Never on the HCA thread itself.
void WaitForHcaPasses(Hca* hca, int n, absl::Duration timeout) {
  if (std::this_thread::get_id() == hca->thread.get_id()) return;
  const absl::Time deadline = absl::Now() + timeout;
  swirl::MutexLock lock(&hca->pass_mu);
  const uint64_t target = hca->passes + n;
  hca->pass_waiters.fetch_add(1, std::memory_order_acq_rel);
  hca->Kick();
  while (hca->passes < target) {
    if (hca->pass_cv.WaitWithDeadline(&hca->pass_mu, deadline)) break;
  }
  hca->pass_waiters.fetch_sub(1, std::memory_order_acq_rel);
}

}  // namespace

void ShmFabric::OpenLink(SoftQp* qp) {
  switch (ReplyAtRtr(qp)) {
    case AtRtr::kReplied:
      return;  // the QP adopts that hello at its next progress (this RTR's, normally)
    case AtRtr::kAwaitingHandshake:
      // Should the handshake fail or the hello not come, RetryLink opens a connection of ours.
      qp->next_link_attempt_ns = NowNs() + kReopenAfterNs;
      return;
    case AtRtr::kNothing:
      break;
  }
  // The peer's hello may be in our listener's backlog already, not yet accepted and read by
  // the HCA thread (a busy one takes a while: at thousands of QPs it lagged behind a client's
  // RTR for about half the connections). Two passes of its loop accept it and read it; we
  // wait for three rather than open a second connection for the pair: 10 ms at most, which
  // only an overloaded HCA thread takes, and then a second connection is more work for it
  // still (64 setups at once up to 10,000 held: 1.59-1.72 descriptors per connection and
  // 1,512-1,635 setups/s with 2 ms at most, 1.17 and 1,888/s with 10).
  pollfd backlog{qp->hca->listen_fd, POLLIN, 0};
  if (poll(&backlog, 1, 0) == 1) {
    WaitForHcaPasses(qp->hca, 3, absl::Milliseconds(10));
    switch (ReplyAtRtr(qp)) {
      case AtRtr::kReplied:
        return;
      case AtRtr::kAwaitingHandshake:
        qp->next_link_attempt_ns = NowNs() + kReopenAfterNs;
        return;
      case AtRtr::kNothing:
        break;
    }
  }
  const int fd = SendHelloFor(qp);
  if (fd >= 0) return;
  // Like a real link to an absent peer: nothing fails now; requests time out at RTS.
  if (!Reaches(qp->attr.ah_attr.grh.dgid)) {
    SWIRL_LOG(WARNING,
              "soft %s: QP 0x%x cannot link to %s: that GID is on the TCP fabric "
              "(SWIRL_SOFT_TCP) and this device is not; set SWIRL_SOFT_TCP on both sides "
              "or on neither",
              qp->hca->name, qp->qp_num, GidHex(qp->attr.ah_attr.grh.dgid));
  } else {
    SWIRL_LOG(DEBUG, "soft: QP 0x%x cannot reach %s: %s", qp->qp_num,
              GidHex(qp->attr.ah_attr.grh.dgid), std::strerror(-fd));
  }
}

void ShmFabric::LinkAdopted(SoftQp* qp) {
  uint64_t replied;
  {
    swirl::MutexLock incoming(&qp->incoming_mu);
    replied = qp->replied_watch;
    qp->want_reply = false;
  }
  if (replied != 0 && replied == qp->in_watch && qp->out_watch == 0) {
    qp->out_watch = qp->in_watch;  // our reply went on it: one connection both ways
  } else if (replied == qp->in_watch && replied != 0) {
    // (We replied, and opened one of our own as well: RetryLink gave up waiting first.)
  } else if (qp->out_watch != qp->in_watch && WatchDead(qp->hca, qp->out_watch)) {
    // The peer has our segment, or will, unless this branch: it replied on our connection,
    // or our hello's connection lives (the peer takes it at its RTR, or both hellos crossed).
    // Either we sent nothing (the peer's hello was here first), or our hello reached the
    // peer when it could not take it (in ERR, about to be reset and connected again, as
    // rdma-core's tests restate their QPs) and was closed: the peer is back, and without our
    // segment could never link. It gets it as a reply on its own connection, or, if that
    // cannot be sent, a hello on one of ours. The refusal's close marked the peer gone (a
    // hello's hang-up is how a linked peer's death shows), but the live link just adopted
    // answers it: the peer is not gone.
    if (qp->out_watch != 0) {
      qp->hca->Unwatch(qp->out_watch);
      qp->out_watch = 0;
      qp->peer_gone.store(false, std::memory_order_release);
    }
    if (SendReply(qp, qp->in_watch)) {
      qp->out_watch = qp->in_watch;  // one connection both ways: it goes with the peer segment
    } else {
      SendHelloFor(qp);
    }
  }
  // Whatever happens next, nothing sends this segment again: a new link (after RESET) makes
  // a new one. Mapped, it lives on without its descriptor, one fewer per QP.
  swirl::MutexLock incoming(&qp->incoming_mu);
  if (qp->memfd >= 0) close(qp->memfd);
  qp->memfd = -1;
}

bool ShmFabric::RetryLink(SoftQp* qp) {
  // Only a QP that skipped its hello for a waiting candidate or handshake (OpenLink) and is
  // still unlinked a while later (the candidate's connection ended, the handshake failed or
  // is slow) needs one: it opens its own, once. A candidate that has arrived meanwhile is
  // adopted first (HandleLinkEvent runs before this).
  if (qp->next_link_attempt_ns == 0 || qp->out_watch != 0 || qp->memfd < 0 ||
      (qp->qstate != IBV_QPS_RTR && qp->qstate != IBV_QPS_RTS) ||
      NowNs() < qp->next_link_attempt_ns) {
    return false;
  }
  qp->next_link_attempt_ns = 0;
  {
    swirl::MutexLock incoming(&qp->incoming_mu);
    qp->want_reply = false;
  }
  return SendHelloFor(qp) >= 0;
}

uint64_t Hca::Watch(int fd, SoftQp* qp, std::unique_ptr<LinkAuth> auth, pid_t peer_pid,
                    std::optional<uint64_t> reply_serial) {
  uint64_t id;
  {
    swirl::MutexLock lock(&watch_mu);
    id = next_watch++;
    LinkWatch& watch = watches[id];
    watch = LinkWatch{qp, fd, nullptr, /*adopted=*/qp != nullptr};
    watch.auth = std::move(auth);
    watch.peer_pid = peer_pid;
    watch.reply_allowed = reply_serial.has_value();
    watch.hello_serial = reply_serial.value_or(0);
  }
  epoll_event ev;
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = id;
  epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev);
  return id;
}

uint64_t Hca::WatchTcp(int fd, SoftQp* qp, TcpLink* link, uint32_t events) {
  uint64_t id;
  {
    swirl::MutexLock lock(&watch_mu);
    id = next_watch++;
    watches[id] = LinkWatch{qp, fd, link, /*adopted=*/qp != nullptr};
  }
  epoll_event ev;
  ev.events = events;
  ev.data.u64 = id;
  epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev);
  return id;
}

void Hca::Unwatch(uint64_t id) {
  swirl::MutexLock lock(&watch_mu);
  UnwatchLocked(id);
}

void Hca::UnwatchLocked(uint64_t id) {
  auto it = watches.find(id);
  if (it == watches.end()) return;
  epoll_ctl(epoll_fd, EPOLL_CTL_DEL, it->second.fd, nullptr);
  fabric->CloseLink(id, it->second);
  close(it->second.fd);
  watches.erase(it);
}

void Hca::CountHandshakeToward(uint32_t qpn, int delta) {
  swirl::MutexLock lock(&toward_mu);
  int& count = handshakes_toward[qpn];
  count += delta;
  if (count <= 0) handshakes_toward.erase(qpn);
}

bool Hca::HandshakeToward(uint32_t qpn) {
  swirl::MutexLock lock(&toward_mu);
  return handshakes_toward.contains(qpn);
}

int Hca::SharePeerWake(pid_t pid, const ibv_gid& gid, int received) {
  if (pid <= 0) return received;
  swirl::MutexLock lock(&peer_wake_mu);
  PeerWake& wake = peer_wakes[{pid, std::string(reinterpret_cast<const char*>(gid.raw), 16)}];
  if (wake.refs++ == 0) {
    wake.fd = received;
  } else {
    close(received);
  }
  return wake.fd;
}

void Hca::ReleasePeerWake(pid_t pid, const ibv_gid& gid, int fd) {
  if (pid <= 0) {
    close(fd);
    return;
  }
  swirl::MutexLock lock(&peer_wake_mu);
  auto it = peer_wakes.find({pid, std::string(reinterpret_cast<const char*>(gid.raw), 16)});
  if (it == peer_wakes.end() || it->second.fd != fd) {
    close(fd);  // (not shared after all: cannot happen, but never leak it)
    return;
  }
  if (--it->second.refs == 0) {
    close(it->second.fd);
    peer_wakes.erase(it);
  }
}

void Hca::Kick() {
  uint64_t one = 1;
  ssize_t ignored = write(wake_fd, &one, sizeof(one));
  (void)ignored;
}

bool AdoptWatch(Hca* hca, uint64_t id) {
  swirl::MutexLock lock(&hca->watch_mu);
  auto it = hca->watches.find(id);
  if (it == hca->watches.end() || it->second.dead) return false;
  it->second.adopted = true;
  return true;
}

bool WatchDead(Hca* hca, uint64_t id) {
  if (id == 0) return true;
  swirl::MutexLock lock(&hca->watch_mu);
  auto it = hca->watches.find(id);
  return it == hca->watches.end() || it->second.dead;
}

void ShutdownWatch(Hca* hca, uint64_t id) {
  swirl::MutexLock lock(&hca->watch_mu);
  auto it = hca->watches.find(id);
  if (it != hca->watches.end()) shutdown(it->second.fd, SHUT_RDWR);
}

void ForEachQp(const std::function<void(SoftQp*)>& fn) {
  swirl::MutexLock registry_lock(&g_registry_mu);
  for (auto& [name, hca] : Registry()) {
    swirl::ReaderMutexLock lock(&hca->mu);
    for (auto& [qpn, qp] : hca->qps) fn(qp);
  }
}

void WatchEnded(LinkWatch& watch) {
  watch.dead = true;
  if (watch.adopted && watch.qp != nullptr) {
    watch.qp->peer_gone.store(true, std::memory_order_release);
    watch.qp->link_event.store(true, std::memory_order_release);
  }
}

void PeerSegment::Close(Hca* hca) {
  if (base != nullptr && !mirror) munmap(const_cast<char*>(base), size);
  if (wake_fd >= 0) hca->ReleasePeerWake(wake_pid, gid, wake_fd);
  if (watch != 0) hca->Unwatch(watch);
  base = nullptr;
  wake_fd = -1;
  watch = 0;
}

Hca* AcquireHca(const std::string& name, std::string* error) {
  swirl::MutexLock lock(&g_registry_mu);
  auto& registry = Registry();
  auto it = registry.find(name);
  if (it != registry.end()) {
    ++it->second->refs;
    return it->second;
  }
  Hca* hca = CreateHca(name, error);
  if (hca == nullptr) return nullptr;
  hca->refs = 1;
  registry[name] = hca;
  return hca;
}

void ReleaseHca(Hca* hca) {
  {
    swirl::MutexLock lock(&g_registry_mu);
    if (--hca->refs > 0) return;
    Registry().erase(hca->name);
  }
  uint64_t one = 1;
  ssize_t ignored = write(hca->stop_fd, &one, sizeof(one));
  (void)ignored;
  hca->thread.join();
  {
    swirl::MutexLock lock(&hca->watch_mu);
    for (auto& [id, watch] : hca->watches) {
      hca->fabric->CloseLink(id, watch);
      close(watch.fd);
    }
    hca->watches.clear();
  }
  for (int fd : {hca->listen_fd, hca->wake_fd, hca->stop_fd, hca->epoll_fd}) {
    if (fd >= 0) close(fd);
  }
  delete hca;  // and its fabric, which closes what is its own
}

int SendHello(Hca* hca, const ibv_gid& gid, uint32_t src_qpn, uint32_t dst_qpn, int memfd,
              uint64_t segment_size, const LinkKey* key, uint64_t key_serial,
              std::unique_ptr<LinkAuth>* auth, pid_t* peer_pid) {
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  socklen_t len;
  sockaddr_un addr = AddressFor(gid, &len);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    int err = errno;
    close(fd);
    return -err;
  }
  // Anyone can bind an abstract name: the listener must be a process we would accept a link
  // from, or our segment (and what our QP sends) would go to whoever claimed the peer's GID.
  ucred cred;
  socklen_t cred_len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0 || !UidTrusted(cred.uid)) {
    SWIRL_LOG_LIMITED(hca->peer_log, WARNING,
                      "soft %s: QP 0x%x does not link to %s: its listener is uid %d (not ours, "
                      "nor in SWIRL_SOFT_TRUSTED_UIDS)",
                      hca->name, src_qpn, GidHex(gid), static_cast<int>(cred.uid));
    close(fd);
    return -EPERM;
  }
  Hello hello;
  std::memset(&hello, 0, sizeof(hello));
  hello.magic = kHelloMagic;
  hello.version = kHelloVersion;
  hello.src_qpn = src_qpn;
  hello.dst_qpn = dst_qpn;
  hello.src_gid = hca->gid;
  hello.segment_size = segment_size;
  std::unique_ptr<LinkAuth> pending;
  if (key != nullptr) {
    hello.flags = kHelloKeyed;
    const Nonce nonce = NewNonce();
    std::memcpy(hello.nonce, nonce.data(), kNonceBytes);
    pending = std::make_unique<LinkAuth>();
    pending->phase = LinkAuth::kAwaitChallenge;
    pending->key = *key;
    pending->key_serial = key_serial;
    pending->accepter_gid = gid;
    pending->hello.assign(reinterpret_cast<const uint8_t*>(&hello),
                          reinterpret_cast<const uint8_t*>(&hello) + sizeof(hello));
    // The proof carries the segment later, when the QP's own descriptor may be gone.
    pending->memfd = fcntl(memfd, F_DUPFD_CLOEXEC, 0);
    if (pending->memfd < 0) {
      int err = errno;
      close(fd);
      return -err;
    }
  }
  const int fds[2] = {memfd, hca->wake_fd};
  // Keyed: nothing goes before the peer has proved itself.
  if (!SendMessage(fd, &hello, sizeof(hello), fds, key == nullptr ? 2 : 0, MSG_NOSIGNAL)) {
    int err = errno;
    close(fd);
    return -err;
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  if (auth != nullptr) *auth = std::move(pending);
  if (peer_pid != nullptr) *peer_pid = cred.pid;
  return fd;
}

void SoftChannel::Notify(SoftCq* cq) {
  {
    swirl::MutexLock lock(&mu);
    events.push_back(cq);
  }
  uint64_t one = 1;
  ssize_t ignored = write(fd, &one, sizeof(one));
  (void)ignored;
}

int QueryPkey(uint8_t port_num, int index, __be16* pkey) {
  if (port_num != 1 || index != 0) return EINVAL;  // pkey_tbl_len is 1
  *pkey = htobe16(0xffff);
  return 0;
}

namespace {

// What kind of object an event names: the one list of event types the queue, the destroys,
// the acknowledgement and the interposer all go by.
enum class EventObjectKind { kNone, kCq, kQp, kSrq };

EventObjectKind KindOf(ibv_event_type type) {
  switch (type) {
    case IBV_EVENT_CQ_ERR:
      return EventObjectKind::kCq;
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_COMM_EST:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_PATH_MIG_ERR:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
      return EventObjectKind::kQp;
    case IBV_EVENT_SRQ_ERR:
    case IBV_EVENT_SRQ_LIMIT_REACHED:
      return EventObjectKind::kSrq;
    default:
      return EventObjectKind::kNone;  // port and device events
  }
}

// The object an event names, or null for port and device events.
const void* EventObject(const ibv_async_event& event) {
  switch (KindOf(event.event_type)) {
    case EventObjectKind::kCq:
      return event.element.cq;
    case EventObjectKind::kQp:
      return event.element.qp;
    case EventObjectKind::kSrq:
      return event.element.srq;
    case EventObjectKind::kNone:
      break;
  }
  return nullptr;
}

constexpr absl::Duration kAsyncAckWait = absl::Seconds(10);

}  // namespace

uint32_t SoftContext::EndAsyncEvents(const void* object) {
  swirl::MutexLock lock(&async.mu);
  for (auto it = async.queue.begin(); it != async.queue.end();) {
    if (EventObject(*it) == object) {
      it = async.queue.erase(it);
    } else {
      ++it;
    }
  }
  UnsignalIfEmptyLocked();  // poll() on async_fd must not announce events that are gone
  auto it = async.delivered.find(object);
  if (it == async.delivered.end()) return 0;
  const uint32_t delivered = it->second;
  async.delivered.erase(it);
  return delivered;
}

int SoftContext::TakeAsyncEvent(ibv_async_event* event) {
  swirl::MutexLock lock(&async.mu);
  if (async.queue.empty()) return EAGAIN;
  *event = async.queue.front();
  async.queue.pop_front();
  if (const void* object = EventObject(*event)) ++async.delivered[object];
  UnsignalIfEmptyLocked();
  return 0;
}

bool WaitForAsyncAcks(pthread_mutex_t* mutex, pthread_cond_t* cond, const uint32_t* completed,
                      uint32_t delivered, const char* what) {
  if (delivered == 0) return true;
  const absl::Time deadline = absl::Now() + kAsyncAckWait;
  const timespec until = absl::ToTimespec(deadline);
  bool acked = true;
  pthread_mutex_lock(mutex);
  while (*completed < delivered) {
    if (pthread_cond_timedwait(cond, mutex, &until) == ETIMEDOUT && *completed < delivered) {
      SWIRL_LOG(ERROR,
                "soft: destroying a %s whose %u asynchronous event(s) handed out were not all "
                "acknowledged (%u) within %s: ibv_ack_async_event must come before the destroy; "
                "its memory is left allocated for the late acknowledgement",
                what, delivered, *completed, absl::FormatDuration(kAsyncAckWait));
      acked = false;
      break;
    }
  }
  pthread_mutex_unlock(mutex);
  return acked;
}

ibv_context* AsyncEventContext(const ibv_async_event& event) {
  switch (KindOf(event.event_type)) {
    case EventObjectKind::kCq:
      return event.element.cq->context;
    case EventObjectKind::kQp:
      return event.element.qp->context;
    case EventObjectKind::kSrq:
      return event.element.srq->context;
    case EventObjectKind::kNone:
      break;
  }
  return nullptr;
}

void CountAsyncAck(const ibv_async_event& event) {
  pthread_mutex_t* mutex = nullptr;
  pthread_cond_t* cond = nullptr;
  uint32_t* counter = nullptr;
  switch (KindOf(event.event_type)) {
    case EventObjectKind::kCq:
      mutex = &event.element.cq->mutex;
      cond = &event.element.cq->cond;
      counter = &event.element.cq->async_events_completed;
      break;
    case EventObjectKind::kQp:
      mutex = &event.element.qp->mutex;
      cond = &event.element.qp->cond;
      counter = &event.element.qp->events_completed;
      break;
    case EventObjectKind::kSrq:
      mutex = &event.element.srq->mutex;
      cond = &event.element.srq->cond;
      counter = &event.element.srq->events_completed;
      break;
    case EventObjectKind::kNone:
      return;  // port and device events: nothing to count
  }
  pthread_mutex_lock(mutex);
  ++*counter;
  pthread_cond_signal(cond);
  pthread_mutex_unlock(mutex);
}

void SoftContext::UnsignalIfEmptyLocked() {
  if (!async.queue.empty() || !async.signalled) return;
  // The fd holds the 1 RaiseAsyncEvent wrote, unless the application read it itself (it has
  // no reason to): look before reading, so a blocking fd never blocks us under the lock.
  pollfd ready{vctx.context.async_fd, POLLIN, 0};
  uint64_t value;
  if (poll(&ready, 1, 0) == 1) {
    ssize_t ignored = read(vctx.context.async_fd, &value, sizeof(value));
    (void)ignored;
  }
  async.signalled = false;
}

void SoftContext::RaiseQpEvent(ibv_event_type type, ibv_qp* qp) {
  ibv_async_event event;
  std::memset(&event, 0, sizeof(event));
  event.event_type = type;
  event.element.qp = qp;
  RaiseAsyncEvent(event);
}

void SoftContext::RaiseAsyncEvent(const ibv_async_event& event) {
  swirl::MutexLock lock(&async.mu);
  async.queue.push_back(event);
  if (async.signalled) return;
  uint64_t one = 1;
  ssize_t ignored = write(vctx.context.async_fd, &one, sizeof(one));
  (void)ignored;
  async.signalled = true;
}

}  // namespace swirl::soft
