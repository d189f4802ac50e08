// The soft device's TCP fabric (SWIRL_SOFT_TCP=IPv4[:port]): QPs on different hosts.
// docs/SOFT_WIRE.md ("The TCP fabric") is the readable version; keep them in step.
//
// On one host a QP's peer maps its segment (wire.h) read-only through a shared memfd. Across
// hosts there is no shared memory, so a QP pair shares one TCP connection, and each side keeps
// a private *mirror* of the other's segment with the same layout. The owner ships each frame
// once its stamp is published (as a record) and its control words when they change; the
// receiving side writes the frame into the mirror with the stamp stored last, exactly as the
// owner did, so the QP code that reads a peer's segment is the same on both fabrics.
//
// One connection for both directions, so that TCP's acknowledgements ride on the replies (two
// connections, one per direction, cost 1.6x the round trip: bench/tcp_pingpong). The side
// whose (GID, QPN) is smaller connects at RTR and sends its hello; the other answers on that
// connection with its own hello once its QP has adopted it (at RTR, or on arrival if it is
// already there). Each side also takes a peer segment that arrives on a connection the peer
// opened while it opened one too (its peer follows another rule, or both connected), so the
// worst case is the old layout: one connection per direction.
//
// Wire, each direction of the connection (little-endian, the byte order of every host swirl
// builds for; the port in a GID's bytes 8-9 is network order):
//   TcpHello (the segment's geometry and initial control words), then records:
//   TcpRecord{kRecordFrame, ring, length, position} + `length` bytes: one frame, at `position`
//     (absolute, as the stamp), which must be the ring's next position;
//   TcpRecord{kRecordControl, 0, 32, 0} + request_consumed, response_consumed, acked, state.
// Who moves the bytes: the thread that publishes ships (ShipTcpFor), a poll reads (PullTcp), and
// the HCA thread does both only for links whose CQs nobody polls, plus what a full socket left.
//
// Everything received is untrusted, as a mapped segment is: the hello's geometry is checked
// like a memfd's, every record's ring, position and length against the mirror, and a connection
// that sends anything else is dropped, failing its QP as a vanished peer would.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>

#include <openssl/crypto.h>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/log.h"
#include "transport/soft/fabric.h"
#include "transport/soft/qp_ops.h"
#include "transport/soft/soft_device.h"

namespace swirl::soft {
namespace {

constexpr uint64_t kTcpHelloMagic = 0x3150435457535731ull;  // "1WSWTCP1"
// 4: flags and a nonce (link keys: the challenge and proof below). 3: one connection carries
// both directions (2: a connection per direction, which a version-3 device would answer on).
constexpr uint32_t kTcpVersion = 4;

struct TcpHello {
  uint64_t magic;
  uint32_t version;
  uint32_t src_qpn;
  uint32_t dst_qpn;
  uint32_t flags;  // kHelloKeyed, kHelloCrypt (an answering hello: 0)
  ibv_gid src_gid;
  uint64_t segment_size;
  uint64_t request_ring_offset;
  uint64_t request_ring_size;
  uint64_t response_ring_offset;
  uint64_t response_ring_size;
  uint64_t control[4];  // request_consumed, response_consumed, acked, state
  uint8_t nonce[kNonceBytes];  // keyed: the opener's fresh nonce; else zero
};
static_assert(sizeof(TcpHello) == 128);

// A keyed link's handshake (link_auth.h): the accepter's challenge, then the opener's proof.
constexpr uint64_t kTcpChallengeMagic = 0x4350435457535731ull;  // "1WSWTCPC"
struct TcpChallenge {
  uint64_t magic;
  uint32_t flags;  // the accepter's kHelloCrypt
  uint32_t reserved;
  uint8_t nonce[kNonceBytes];
  uint8_t mac[kMacBytes];  // HelloMac(accepter)
};
static_assert(sizeof(TcpChallenge) == 64);
constexpr uint64_t kTcpProofMagic = 0x5050435457535731ull;  // "1WSWTCPP"
struct TcpProof {
  uint64_t magic;
  uint8_t mac[kMacBytes];  // HelloMac(opener)
};
static_assert(sizeof(TcpProof) == 40);

enum RecordKind : uint8_t { kRecordFrame = 1, kRecordControl = 2 };

struct TcpRecord {
  uint8_t kind;
  uint8_t ring;  // frames: 0 request ring, 1 response ring
  uint16_t reserved;
  uint32_t length;
  uint64_t position;
};
static_assert(sizeof(TcpRecord) == 16);

constexpr size_t kControlWords = 4;
// The largest frame a writer makes (a WRITE chunk with its extension); PAD frames, which fill a
// ring's tail, can be longer and are shipped as their header alone (see Ship).
constexpr uint64_t kMaxFrame = wire::FrameBytes(wire::kOpWrite, wire::kMaxChunk);
constexpr size_t kStaging = 2 * (sizeof(TcpRecord) + kMaxFrame + kTagBytes);
// Connections that have not sent their hello yet (or, keyed, finished their handshake): how
// many in all, and from one source address; a silent one is closed after kHelloTimeoutNs, and
// a keyed hello waits at most kParkedHelloNs for its QP's key and kProofTimeoutNs for its proof.
constexpr int kMaxWaitingHellos = 64;
constexpr int kMaxWaitingPerSource = 8;
constexpr int64_t kHelloTimeoutNs = 250 * 1000 * 1000;
constexpr int64_t kParkedHelloNs = int64_t{30} * 1000 * 1000 * 1000;
constexpr int64_t kProofTimeoutNs = int64_t{5} * 1000 * 1000 * 1000;
// A sealed record's plaintext is at most a frame; each unit sealed for one sendmsg has a slot.
constexpr size_t kSealSlot = kMaxFrame + 64;
// How long an outgoing link may take to connect before its QP fails, until RTS sets the QP's
// own timeout (SetTcpLinkTimeout).
constexpr int64_t kConnectTimeoutNs = int64_t{30} * 1000 * 1000 * 1000;

}  // namespace

// A segment as a link sees it: where it is mapped and the next frame of each ring.
struct LinkSegment {
  char* base = nullptr;
  uint64_t size = 0;
  uint64_t ring_offset[2] = {0, 0};
  uint64_t ring_size[2] = {0, 0};
  uint64_t position[2] = {0, 0};  // next frame to ship / expected next
};

struct TcpLink {
  bool outgoing = false;  // we opened the connection
  // Keyed: the handshake in progress (null once done, or for a keyless link); what follows it
  // (records, an answering hello) flows only once `authenticated`.
  std::unique_ptr<LinkAuth> auth;
  bool authenticated = true;
  uint64_t key_serial = 0;  // we opened it with our QP's key of this serial (0: keyless)
  // Sealed records (a keyed link with crypto on): ours, and the peer's.
  std::unique_ptr<RecordCipher> tx, rx;
  std::unique_ptr<char[]> seal;  // kBatch slots of kSealSlot: sealed bodies awaiting sendmsg
  // A connection a stranger opened: its source (IPv4, network order) and whether it has sent
  // anything yet (the per-source cap closes the oldest silent one first).
  uint32_t source = 0;
  bool heard = false;
  int64_t accepted_ns = 0;
  bool connecting = false;
  bool failed = false;
  // Opened by a stranger, before its hello / ours, while connecting: when to give up
  // (ExpireTcpLinks).
  int64_t deadline_ns = 0;
  // What we ship: our QP's segment, mapped read-only here (the QP may unmap its mapping first).
  // Set when the connection is ours (at RTR) or once our QP adopted it (ReplyOnTcpLink).
  LinkSegment out_seg;
  // What we receive: the mirror of the peer's segment, written only under watch_mu. Set by the
  // peer's hello.
  LinkSegment in_seg;
  bool ships() const { return out_seg.base != nullptr; }

  // Shipping: records queued for one sendmsg (each a header, then a body in the segment, which
  // stays put until the peer has consumed it, so after the shipping) and how much of them went.
  struct Pending {
    char head[sizeof(TcpHello)];
    size_t head_len = 0;
    const char* body = nullptr;
    size_t body_len = 0;
    uint8_t tag[kTagBytes];  // sealed: the body's tag, after it
    size_t tag_len = 0;
  };
  static constexpr int kBatch = 16;
  Pending out[kBatch];
  int out_count = 0;
  size_t out_sent = 0;
  bool waiting_out = false;  // EPOLLOUT armed
  uint64_t shipped_control[kControlWords] = {};
  bool control_shipped = false;

  // Receiving: bytes received and not yet applied.
  std::unique_ptr<char[]> staging;
  size_t staged = 0;
  bool hello_done = false;
  bool watching_in = true;  // EPOLLIN armed: the HCA thread reads (see WatchTcpReceives)
};

namespace {

// The control words a link carries, in record order. Not `sleeping`: a mirror has no eventfd to
// wake, since the publishing thread ships itself.
std::atomic<uint64_t>* ControlWord(const LinkSegment& seg, size_t i) {
  auto* ctrl = reinterpret_cast<wire::SegmentControl*>(seg.base + wire::kControlOffset);
  std::atomic<uint64_t>* words[kControlWords] = {
      &ctrl->request_consumed.value, &ctrl->response_consumed.value, &ctrl->acked.value,
      &ctrl->state.value};
  return words[i];
}

// The HCA thread's interest in a link: its hangup always, its data while it reads for the link
// (WatchTcpReceives), room to send while a flush waits for it or a connect is under way.
void Rearm(Hca* hca, uint64_t id, int fd, const TcpLink& link) {
  epoll_event ev;
  ev.events = EPOLLRDHUP | (link.watching_in ? uint32_t{EPOLLIN} : 0u) |
              (link.waiting_out || link.connecting ? uint32_t{EPOLLOUT} : 0u);
  ev.data.u64 = id;
  epoll_ctl(hca->epoll_fd, EPOLL_CTL_MOD, fd, &ev);
}

void ArmOut(Hca* hca, uint64_t id, int fd, TcpLink& link, bool on) {
  if (link.waiting_out == on) return;
  link.waiting_out = on;
  Rearm(hca, id, fd, link);
}

// Sends the queued records. True when they are all sent; false if the socket is full (EPOLLOUT
// is armed) or failed (link.failed).
bool Flush(Hca* hca, uint64_t id, int fd, TcpLink& link) {
  while (link.out_count > 0) {
    iovec iov[3 * TcpLink::kBatch];
    int n = 0;
    size_t skip = link.out_sent;
    for (int i = 0; i < link.out_count; ++i) {
      const TcpLink::Pending& p = link.out[i];
      const std::pair<const char*, size_t> parts[3] = {
          {p.head, p.head_len},
          {p.body, p.body_len},
          {reinterpret_cast<const char*>(p.tag), p.tag_len}};
      for (const auto& [data, len] : parts) {
        if (skip >= len) {
          skip -= len;
          continue;
        }
        iov[n++] = {const_cast<char*>(data) + skip, len - skip};
        skip = 0;
      }
    }
    msghdr msg;
    std::memset(&msg, 0, sizeof(msg));
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    const ssize_t k = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        ArmOut(hca, id, fd, link, true);
      } else {
        link.failed = true;
      }
      return false;
    }
    link.out_sent += static_cast<size_t>(k);
    size_t total = 0;
    for (int i = 0; i < link.out_count; ++i) {
      total += link.out[i].head_len + link.out[i].body_len + link.out[i].tag_len;
    }
    if (link.out_sent == total) link.out_count = 0, link.out_sent = 0;
  }
  ArmOut(hca, id, fd, link, false);
  return true;
}

// Queues a record; the batch has room (the caller flushed a full one). On a sealed link the
// record's header travels in the clear (authenticated) and the rest (`extra`, then `body`) is
// sealed into the batch slot's buffer, its tag after it. False if sealing failed.
bool QueueRecord(TcpLink& link, const TcpRecord& record, const void* extra, size_t extra_len,
                 const char* body, size_t body_len) {
  const int slot = link.out_count;
  TcpLink::Pending& p = link.out[link.out_count++];
  std::memcpy(p.head, &record, sizeof(record));
  p.tag_len = 0;
  if (link.tx != nullptr) {
    char* sealed = link.seal.get() + slot * kSealSlot;
    // Sealed straight from where it is (the segment, for a frame): no copy before the cipher's.
    const void* plain = body_len == 0 ? extra : body;
    if (extra_len > 0 && body_len > 0) {  // (no record has both; kept general)
      std::memcpy(sealed, extra, extra_len);
      std::memcpy(sealed + extra_len, body, body_len);
      plain = sealed;
    }
    p.head_len = sizeof(record);
    p.body = sealed;
    p.body_len = extra_len + body_len;
    p.tag_len = kTagBytes;
    return link.tx->Seal(&record, sizeof(record), plain, p.body_len, sealed, p.tag);
  }
  if (extra_len > 0) std::memcpy(p.head + sizeof(record), extra, extra_len);
  p.head_len = sizeof(record) + extra_len;
  p.body = body;
  p.body_len = body_len;
  return true;
}

// Queues a unit that is not a record (a hello, a proof): sealed if the link is (an answering
// hello), else as it is. The batch has room.
bool QueueUnit(TcpLink& link, const void* data, size_t length) {
  const int slot = link.out_count;
  TcpLink::Pending& p = link.out[link.out_count++];
  p.tag_len = 0;
  if (link.tx != nullptr) {
    char* sealed = link.seal.get() + slot * kSealSlot;
    p.head_len = 0;
    p.body = sealed;
    p.body_len = length;
    p.tag_len = kTagBytes;
    return link.tx->Seal(nullptr, 0, data, length, sealed, p.tag);
  }
  std::memcpy(p.head, data, length);
  p.head_len = length;
  p.body = nullptr;
  p.body_len = 0;
  return true;
}

// Ships what our QP has published since the last call: frames in order, then the control words
// if they changed. The control words are read *before* the frames, so a state the peer sees
// (an error published after its NAK) never arrives ahead of the frames written before it.
void Ship(Hca* hca, uint64_t id, int fd, TcpLink& link) {
  if (link.failed || link.connecting || !link.ships() || !Flush(hca, id, fd, link)) return;
  // A keyed link ships nothing of its QP's before the handshake (only the hello went).
  if (!link.authenticated) return;
  LinkSegment& seg = link.out_seg;
  uint64_t control[kControlWords];
  for (size_t i = 0; i < kControlWords; ++i) {
    control[i] = ControlWord(seg, i)->load(std::memory_order_acquire);
  }
  wire::SharedAcquire();
  for (int ring = 0; ring < 2; ++ring) {
    for (;;) {
      const uint64_t pos = seg.position[ring];
      const uint64_t offset = pos & (seg.ring_size[ring] - 1);
      const char* frame = seg.base + seg.ring_offset[ring] + offset;
      if (__atomic_load_n(reinterpret_cast<const uint64_t*>(frame), __ATOMIC_ACQUIRE) !=
          (wire::kStampValid | pos)) {
        break;
      }
      wire::SharedAcquire();
      wire::FrameHeader header;
      std::memcpy(&header, frame, sizeof(header));
      const uint64_t room = seg.ring_size[ring] - offset;
      // A PAD frame covers the rest of the ring; its header says all the reader needs.
      const uint64_t consumed =
          header.op == wire::kOpPad ? room : wire::FrameBytes(header.op, header.length);
      const uint64_t bytes = header.op == wire::kOpPad ? wire::kFrameAlign : consumed;
      if (consumed > room || bytes > kMaxFrame) {  // our own QP wrote it: cannot happen
        link.failed = true;
        return;
      }
      if (link.out_count == TcpLink::kBatch && !Flush(hca, id, fd, link)) return;
      TcpRecord record{kRecordFrame, static_cast<uint8_t>(ring), 0,
                       static_cast<uint32_t>(bytes), pos};
      if (!QueueRecord(link, record, nullptr, 0, frame, bytes)) {
        link.failed = true;
        return;
      }
      seg.position[ring] = pos + consumed;
    }
  }
  // The frames and the control words go in one sendmsg (one TCP segment when they fit).
  if (!link.control_shipped ||
      std::memcmp(control, link.shipped_control, sizeof(control)) != 0) {
    if (link.out_count == TcpLink::kBatch && !Flush(hca, id, fd, link)) return;
    TcpRecord record{kRecordControl, 0, 0, static_cast<uint32_t>(sizeof(control)), 0};
    if (!QueueRecord(link, record, control, sizeof(control), nullptr, 0)) {
      link.failed = true;
      return;
    }
    std::memcpy(link.shipped_control, control, sizeof(control));
    link.control_shipped = true;
  }
  Flush(hca, id, fd, link);
}

void ForgetIncoming(Hca* hca, uint64_t id) {
  auto& ids = hca->tcp_incoming;
  ids.erase(std::remove(ids.begin(), ids.end(), id), ids.end());
}

// The link is over: nobody reads or ships it again, and its QP fails if the link was its own.
void MarkGone(Hca* hca, LinkWatch& watch, uint64_t id) {
  epoll_ctl(hca->epoll_fd, EPOLL_CTL_DEL, watch.fd, nullptr);
  if (watch.tcp->hello_done) {  // only then is it in the polls' set
    epoll_ctl(hca->tcp_poll_fd, EPOLL_CTL_DEL, watch.fd, nullptr);
    ForgetIncoming(hca, id);
  }
  watch.tcp->failed = true;
  WatchEnded(watch);
}

// Maps a private mirror of the segment `hello` describes and offers it to its QP: a hello that
// passed (keyless, keyed and proved with the key of serial `auth_serial`, or the answer on a
// connection we opened).
bool OfferMirror(Hca* hca, uint64_t id, LinkWatch& watch, const TcpHello& hello,
                 uint64_t auth_serial, std::string* why) {
  TcpLink& link = *watch.tcp;
  void* base = mmap(nullptr, hello.segment_size, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    *why = absl::StrCat("mmap: ", std::strerror(errno));
    return false;
  }
  LinkSegment& seg = link.in_seg;
  seg.base = static_cast<char*>(base);
  seg.size = hello.segment_size;
  seg.ring_offset[0] = hello.request_ring_offset;
  seg.ring_size[0] = hello.request_ring_size;
  seg.ring_offset[1] = hello.response_ring_offset;
  seg.ring_size[1] = hello.response_ring_size;
  for (size_t i = 0; i < kControlWords; ++i) {
    ControlWord(seg, i)->store(hello.control[i], std::memory_order_relaxed);
  }
  // No wake eventfd and `sleeping` stays 0: a QP never wakes its TCP peer, it ships itself.
  PeerSegment segment;
  segment.base = seg.base;
  segment.size = seg.size;
  segment.request_ring_offset = hello.request_ring_offset;
  segment.request_ring_size = hello.request_ring_size;
  segment.response_ring_offset = hello.response_ring_offset;
  segment.response_ring_size = hello.response_ring_size;
  segment.watch = id;
  segment.gid = hello.src_gid;
  segment.qp_num = hello.src_qpn;
  segment.mirror = true;
  segment.auth_serial = auth_serial;
  if (!OfferSegment(hca, id, hello.dst_qpn, segment, why)) return false;
  epoll_event ev;
  ev.events = EPOLLIN;
  ev.data.u64 = id;
  epoll_ctl(hca->tcp_poll_fd, EPOLL_CTL_ADD, watch.fd, &ev);
  hca->tcp_incoming.push_back(id);
  return true;
}

// The accepter's challenge to a keyed hello, once its QP's key is known (auth.key).
bool SendTcpChallenge(Hca* hca, int fd, TcpLink& link) {
  LinkAuth& auth = *link.auth;
  auth.nonce = NewNonce();
  auth.accepter_gid = hca->gid;
  auth.accepter_flags = hca->tcp_crypt ? kHelloCrypt : 0;
  const Mac mac = HelloMac(auth.key, AuthRole::kAccepter, AuthFabric::kTcp, auth.hello,
                           auth.accepter_gid, auth.nonce, auth.accepter_flags);
  TcpChallenge challenge;
  std::memset(&challenge, 0, sizeof(challenge));
  challenge.magic = kTcpChallengeMagic;
  challenge.flags = auth.accepter_flags;
  std::memcpy(challenge.nonce, auth.nonce.data(), kNonceBytes);
  std::memcpy(challenge.mac, mac.data(), kMacBytes);
  auth.phase = LinkAuth::kAwaitProof;
  link.deadline_ns = NowNs() + kProofTimeoutNs;
  // Nothing else of ours is queued on this connection yet: the challenge goes first.
  return send(fd, &challenge, sizeof(challenge), MSG_NOSIGNAL | MSG_DONTWAIT) ==
         static_cast<ssize_t>(sizeof(challenge));
}

// Both sides, once the handshake has passed: the record ciphers, if either side asked for them.
bool StartSealing(TcpLink& link, const LinkAuth& auth, uint32_t accepter_flags) {
  TcpHello hello;
  std::memcpy(&hello, auth.hello.data(), sizeof(hello));
  if (((hello.flags | accepter_flags) & kHelloCrypt) == 0) return true;
  Nonce opener_nonce;
  std::memcpy(opener_nonce.data(), hello.nonce, kNonceBytes);
  link.tx = RecordCipher::Create(auth.key, opener_nonce, auth.nonce, link.outgoing, true);
  link.rx = RecordCipher::Create(auth.key, opener_nonce, auth.nonce, !link.outgoing, false);
  link.seal = std::make_unique<char[]>(TcpLink::kBatch * kSealSlot);
  return link.tx != nullptr && link.rx != nullptr;
}

// Validates a hello. The opener's (on a connection a peer opened): offered to its QP if keyless,
// else answered with a challenge (or parked until the QP has its key: ResumeParkedTcp);
// nothing is mapped or offered for a keyed hello before its proof. The answer to ours (on a
// connection we opened): offered.
bool AcceptHello(Hca* hca, uint64_t id, LinkWatch& watch, const TcpHello& hello,
                 std::string* why) {
  TcpLink& link = *watch.tcp;
  if (link.outgoing && watch.qp != nullptr && hello.dst_qpn != watch.qp->qp_num) {
    *why = "hello on our connection names another QP";
    return false;
  }
  const uint32_t known_flags = link.outgoing ? 0 : kHelloKeyed | kHelloCrypt;
  if (hello.magic != kTcpHelloMagic || hello.version != kTcpVersion ||
      (hello.flags & ~known_flags) != 0 ||
      !SegmentGeometryOk(hello.segment_size, hello.request_ring_offset, hello.request_ring_size,
                         hello.response_ring_offset, hello.response_ring_size)) {
    *why = "malformed hello";
    return false;
  }
  // The GID must name the address the connection comes from (as RoCE's IP-based GIDs do).
  sockaddr_in peer;
  socklen_t len = sizeof(peer);
  if (getpeername(watch.fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0 ||
      peer.sin_family != AF_INET ||
      std::memcmp(&peer.sin_addr.s_addr, hello.src_gid.raw + 12, 4) != 0) {
    *why = "hello's GID does not match its address";
    return false;
  }
  // The answer on our own connection: that connection passed the handshake (if keyed).
  if (link.outgoing) return OfferMirror(hca, id, watch, hello, link.key_serial, why);
  const bool keyed = (hello.flags & kHelloKeyed) != 0;
  LinkKey key;
  uint64_t serial = 0;
  const QpKeyState state = QpKeyFor(hca, hello.dst_qpn, &key, &serial);
  if (state == QpKeyState::kNoQp) {
    *why = "no such QP";
    return false;
  }
  if (!keyed) {
    if (state == QpKeyState::kKeyed) {
      *why = "keyless hello for a QP with a link key";
      return false;
    }
    return OfferMirror(hca, id, watch, hello, 0, why);
  }
  if (state == QpKeyState::kKeyless) {
    *why = "keyed hello for a QP without a link key";
    return false;
  }
  link.auth = std::make_unique<LinkAuth>();
  link.auth->hello.assign(reinterpret_cast<const uint8_t*>(&hello),
                          reinterpret_cast<const uint8_t*>(&hello) + sizeof(hello));
  link.authenticated = false;
  hca->handshakes_pending.store(true, std::memory_order_release);
  if (state == QpKeyState::kWait) {
    link.auth->phase = LinkAuth::kAwaitKey;
    link.deadline_ns = NowNs() + kParkedHelloNs;
    return true;
  }
  link.auth->key = key;
  link.auth->key_serial = serial;
  if (!SendTcpChallenge(hca, watch.fd, link)) {
    *why = "cannot send the challenge";
    return false;
  }
  return true;
}

// The opener's side: checks the accepter's challenge and queues the proof (before any record).
bool AcceptChallenge(Hca* hca, uint64_t id, LinkWatch& watch, const TcpChallenge& challenge,
                     std::string* why) {
  TcpLink& link = *watch.tcp;
  LinkAuth& auth = *link.auth;
  Nonce nonce;
  Mac mac;
  std::memcpy(nonce.data(), challenge.nonce, kNonceBytes);
  std::memcpy(mac.data(), challenge.mac, kMacBytes);
  if (challenge.magic != kTcpChallengeMagic || (challenge.flags & ~kHelloCrypt) != 0) {
    *why = "malformed challenge";
    return false;
  }
  if (!MacEqual(mac, HelloMac(auth.key, AuthRole::kAccepter, AuthFabric::kTcp, auth.hello,
                              auth.accepter_gid, nonce, challenge.flags))) {
    *why = "challenge does not match the QP's link key";
    return false;
  }
  const Mac proof_mac = HelloMac(auth.key, AuthRole::kOpener, AuthFabric::kTcp, auth.hello,
                                 auth.accepter_gid, nonce, challenge.flags);
  TcpProof proof;
  proof.magic = kTcpProofMagic;
  std::memcpy(proof.mac, proof_mac.data(), kMacBytes);
  if (link.out_count == TcpLink::kBatch && !Flush(hca, id, watch.fd, link)) {
    *why = "cannot send the proof";
    return false;
  }
  QueueUnit(link, &proof, sizeof(proof));  // unsealed: the ciphers start after it
  auth.nonce = nonce;
  if (!StartSealing(link, auth, challenge.flags)) {
    *why = "cannot set up the record ciphers";
    return false;
  }
  link.authenticated = true;
  link.auth.reset();
  return true;
}

// The accepter's side: checks the opener's proof, then offers the hello it proved.
bool AcceptProof(Hca* hca, uint64_t id, LinkWatch& watch, const TcpProof& proof,
                 std::string* why) {
  TcpLink& link = *watch.tcp;
  LinkAuth& auth = *link.auth;
  Mac mac;
  std::memcpy(mac.data(), proof.mac, kMacBytes);
  if (proof.magic != kTcpProofMagic ||
      !MacEqual(mac, HelloMac(auth.key, AuthRole::kOpener, AuthFabric::kTcp, auth.hello,
                              auth.accepter_gid, auth.nonce, auth.accepter_flags))) {
    *why = "proof does not match the QP's link key";
    return false;
  }
  if (!StartSealing(link, auth, auth.accepter_flags)) {
    *why = "cannot set up the record ciphers";
    return false;
  }
  TcpHello hello;
  std::memcpy(&hello, auth.hello.data(), sizeof(hello));
  const uint64_t serial = auth.key_serial;
  link.authenticated = true;
  link.auth.reset();
  return OfferMirror(hca, id, watch, hello, serial, why);
}

// Applies one complete record at `data` (header validated by the caller) to the mirror.
void ApplyFrame(LinkSegment& seg, const TcpRecord& record, const char* data) {
  const int ring = record.ring;
  char* dst = seg.base + seg.ring_offset[ring] + (record.position & (seg.ring_size[ring] - 1));
  // The peer sends a record only into space our consumer released (its index reached the peer
  // over the socket): ordered after the consumer's last reads there, through a socket that
  // ThreadSanitizer does not see, so TSan builds acquire what the consumer's publish released.
  wire::SharedAcquire();
  // Every kFrameAlign-aligned word of ring space is where some frame's stamp may be, and an
  // idle hint that went stale (QpLock::StillIdle, soft_internal.h: a poller that read the hint's
  // pointer, then was held up while the ring lapped) may load it atomically without the QP's
  // lock, at any time. So those words are stored atomically too (relaxed: only the stamp orders
  // anything), and only the bytes between them are copied plainly. The record's length is a
  // multiple of kFrameAlign (checked by the caller) and `dst` starts a frame, so the words are
  // at dst + k * kFrameAlign; this is the HCA thread's receive path, not the poll.
  constexpr size_t kWord = sizeof(uint64_t);
  for (uint64_t at = 0; at < record.length; at += wire::kFrameAlign) {
    if (at != 0) {
      uint64_t word;
      std::memcpy(&word, data + at, kWord);
      __atomic_store_n(reinterpret_cast<uint64_t*>(dst + at), word, __ATOMIC_RELAXED);
    }
    std::memcpy(dst + at + kWord, data + at + kWord, wire::kFrameAlign - kWord);
  }
  uint64_t stamp;
  std::memcpy(&stamp, data, sizeof(stamp));
  wire::SharedRelease();
  __atomic_store_n(reinterpret_cast<uint64_t*>(dst), stamp, __ATOMIC_RELEASE);
}

// The bytes a PAD frame's record advances its ring by: the rest of the ring.
uint64_t Advance(const LinkSegment& seg, const TcpRecord& record, const char* data) {
  wire::FrameHeader header;
  std::memcpy(&header, data, sizeof(header));
  const uint64_t room = seg.ring_size[record.ring] -
                        (record.position & (seg.ring_size[record.ring] - 1));
  return header.op == wire::kOpPad ? room : record.length;
}

// Consumes whole units from the staging buffer. Returns false (with `why`) on a violation.
bool ApplyStaged(Hca* hca, uint64_t id, LinkWatch& watch, std::string* why) {
  TcpLink& link = *watch.tcp;
  size_t at = 0;
  for (;;) {
    char* p = link.staging.get() + at;
    const size_t have = link.staged - at;
    if (!link.hello_done) {
      if (link.auth != nullptr) {
        // A keyed handshake: the accepter's challenge (we opened), or the opener's proof.
        if (link.auth->phase == LinkAuth::kAwaitChallenge) {
          if (have < sizeof(TcpChallenge)) break;
          TcpChallenge challenge;
          std::memcpy(&challenge, p, sizeof(challenge));
          if (!AcceptChallenge(hca, id, watch, challenge, why)) return false;
          at += sizeof(TcpChallenge);
          continue;
        }
        if (link.auth->phase == LinkAuth::kAwaitKey) {
          if (have == 0) break;
          *why = "spoke before its challenge";
          return false;
        }
        if (have < sizeof(TcpProof)) break;
        TcpProof proof;
        std::memcpy(&proof, p, sizeof(proof));
        if (!AcceptProof(hca, id, watch, proof, why)) return false;
        link.hello_done = true;
        at += sizeof(TcpProof);
        continue;
      }
      // A hello: the opener's, or the answer to ours (sealed, on a sealed link).
      const size_t unit = sizeof(TcpHello) + (link.rx != nullptr ? kTagBytes : 0);
      if (have < unit) break;
      if (link.rx != nullptr &&
          !link.rx->Open(nullptr, 0, p, sizeof(TcpHello),
                         reinterpret_cast<const uint8_t*>(p + sizeof(TcpHello)))) {
        *why = "hello failed authentication";
        return false;
      }
      TcpHello hello;
      std::memcpy(&hello, p, sizeof(hello));
      if (!AcceptHello(hca, id, watch, hello, why)) return false;
      link.hello_done = link.auth == nullptr;  // a keyed hello goes on to its handshake
      at += unit;
      continue;
    }
    if (have < sizeof(TcpRecord)) break;
    TcpRecord record;
    std::memcpy(&record, p, sizeof(record));
    if (record.kind == kRecordControl) {
      if (record.length != kControlWords * sizeof(uint64_t)) {
        *why = "bad control record";
        return false;
      }
    } else if (record.kind == kRecordFrame) {
      const uint64_t ring_size = record.ring < 2 ? link.in_seg.ring_size[record.ring] : 0;
      if (record.ring >= 2 || record.position != link.in_seg.position[record.ring] ||
          record.length < sizeof(wire::FrameHeader) || record.length % wire::kFrameAlign != 0 ||
          record.length > kMaxFrame ||
          (record.position & (ring_size - 1)) + record.length > ring_size) {
        *why = "frame record out of bounds";
        return false;
      }
    } else {
      *why = "unknown record";
      return false;
    }
    const size_t tag = link.rx != nullptr ? kTagBytes : 0;
    if (have < sizeof(TcpRecord) + record.length + tag) break;
    char* data = p + sizeof(TcpRecord);
    // A sealed record must be exactly what the peer sealed as the next unit: a tampered,
    // replayed, dropped or reordered one fails here and ends the link, failing its QP.
    if (link.rx != nullptr &&
        !link.rx->Open(&record, sizeof(record), data, record.length,
                       reinterpret_cast<const uint8_t*>(data + record.length))) {
      *why = "record failed authentication";
      return false;
    }
    if (record.kind == kRecordControl) {
      uint64_t words[kControlWords];
      std::memcpy(words, data, sizeof(words));
      wire::SharedRelease();
      for (size_t i = 0; i < kControlWords; ++i) {
        ControlWord(link.in_seg, i)->store(words[i], std::memory_order_release);
      }
    } else {
      ApplyFrame(link.in_seg, record, data);
      link.in_seg.position[record.ring] += Advance(link.in_seg, record, data);
    }
    at += sizeof(TcpRecord) + record.length + tag;
  }
  std::memmove(link.staging.get(), link.staging.get() + at, link.staged - at);
  link.staged -= at;
  return true;
}

// Returns true if anything arrived. Reads at most kReceiveBudget bytes: a peer that ignores
// our consumed counters and never stops must not keep this thread (and watch_mu) forever.
constexpr size_t kReceiveBudget = 256 * 1024;
// A read this large is part of a bulk stream (TCP_QUICKACK below).
constexpr size_t kBulkRead = 16 * 1024;

// `hangup`: the peer closed; read on to the end instead of stopping at a short read.
bool Receive(Hca* hca, uint64_t id, LinkWatch& watch, bool hangup = false) {
  TcpLink& link = *watch.tcp;
  if (link.staging == nullptr) link.staging = std::make_unique<char[]>(kStaging);
  bool arrived = false;
  for (size_t taken = 0; taken < kReceiveBudget;) {
    const size_t room = kStaging - link.staged;
    const ssize_t n = recv(watch.fd, link.staging.get() + link.staged, room, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return arrived;
    std::string why;
    if (n <= 0) {
      why = n == 0 ? "peer closed" : std::strerror(errno);
    } else {
      link.staged += static_cast<size_t>(n);
      taken += static_cast<size_t>(n);
      arrived = true;
      link.heard = true;
      if (static_cast<size_t>(n) >= kBulkRead) {
        // A stream of large frames: acknowledge at once. The connection also carries our own
        // records, which makes the kernel treat it as interactive and hold its ACKs back for
        // them to ride on, throttling the sender. (Not permanent: asked again per large read.)
        int one = 1;
        setsockopt(watch.fd, IPPROTO_TCP, TCP_QUICKACK, &one, sizeof(one));
      }
      // A short read drained the socket (almost surely): the next poll looks again, and this
      // one saves the syscall that would say EAGAIN.
      if (ApplyStaged(hca, id, watch, &why)) {
        if (static_cast<size_t>(n) < room && !hangup) return true;
        continue;
      }
    }
    if (n != 0) SWIRL_LOG_LIMITED(hca->peer_log, WARNING, "soft %s: TCP link dropped: %s", hca->name, why);
    if (watch.qp == nullptr) {
      hca->UnwatchLocked(id);  // never got as far as a QP: nothing else refers to it
    } else {
      MarkGone(hca, watch, id);
    }
    return true;
  }
  return arrived;
}

}  // namespace

bool IsTcpFabricGid(const ibv_gid& gid) {
  static constexpr uint8_t kZero[8] = {};
  return std::memcmp(gid.raw, kZero, sizeof(kZero)) == 0 && gid.raw[10] == 0xff &&
         gid.raw[11] == 0xff;
}

bool ParseTcpFabric(const char* spec, uint32_t* addr, uint16_t* port, std::string* why) {
  std::vector<std::string> parts = absl::StrSplit(spec, ':');
  uint32_t port_value = 0;
  in_addr parsed;
  if (parts.size() > 2 || inet_pton(AF_INET, parts[0].c_str(), &parsed) != 1 ||
      (parts.size() == 2 && (!absl::SimpleAtoi(parts[1], &port_value) || port_value > 65535))) {
    *why = absl::StrCat("'", spec, "' is not IPv4[:port]");
    return false;
  }
  if (parsed.s_addr == htonl(INADDR_ANY)) {
    *why = "the address must be one of this host's (it becomes the device's GID), not 0.0.0.0";
    return false;
  }
  *addr = parsed.s_addr;
  *port = static_cast<uint16_t>(port_value);
  return true;
}

int ListenTcp(uint32_t addr, uint16_t port, ibv_gid* gid, std::string* why) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  sockaddr_in sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = addr;
  sa.sin_port = htons(port);
  int one = 1;
  socklen_t len = sizeof(sa);
  if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
      bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 || listen(fd, 1024) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    char text[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &addr, text, sizeof(text));
    *why = absl::StrCat("TCP listen on ", text, ":", port, ": ", std::strerror(errno));
    if (fd >= 0) close(fd);
    return -1;
  }
  // ::ffff:a.b.c.d, as a RoCE v2 GID for an IPv4 address, with the port in bytes 8-9.
  std::memset(gid->raw, 0, sizeof(gid->raw));
  std::memcpy(gid->raw + 8, &sa.sin_port, 2);
  gid->raw[10] = gid->raw[11] = 0xff;
  std::memcpy(gid->raw + 12, &addr, 4);
  return fd;
}

namespace {

// Maps our QP's segment read-only for `link` and queues our hello, the first thing we send.
// `key` (the opener's, when our QP has one): the hello opens a keyed handshake with the
// accepter at `peer_gid`, and nothing else goes before it has passed. An answering hello
// (key null) is sealed if the link is.
bool StartShipping(Hca* hca, SoftQp* qp, uint32_t dst_qpn, int memfd, uint64_t segment_size,
                   TcpLink& link, const LinkKey* key = nullptr, uint64_t key_serial = 0,
                   const ibv_gid* peer_gid = nullptr) {
  void* base = mmap(nullptr, segment_size, PROT_READ, MAP_SHARED, memfd, 0);
  if (base == MAP_FAILED) return false;
  LinkSegment& seg = link.out_seg;
  seg.base = static_cast<char*>(base);
  seg.size = segment_size;
  const auto* header = static_cast<const wire::SegmentHeader*>(base);
  seg.ring_offset[0] = header->request_ring_offset;
  seg.ring_size[0] = header->request_ring_size;
  seg.ring_offset[1] = header->response_ring_offset;
  seg.ring_size[1] = header->response_ring_size;
  TcpHello hello;
  std::memset(&hello, 0, sizeof(hello));
  hello.magic = kTcpHelloMagic;
  hello.version = kTcpVersion;
  hello.src_qpn = qp->qp_num;
  hello.dst_qpn = dst_qpn;
  hello.src_gid = hca->gid;
  hello.segment_size = segment_size;
  hello.request_ring_offset = seg.ring_offset[0];
  hello.request_ring_size = seg.ring_size[0];
  hello.response_ring_offset = seg.ring_offset[1];
  hello.response_ring_size = seg.ring_size[1];
  for (size_t i = 0; i < kControlWords; ++i) {
    hello.control[i] = ControlWord(seg, i)->load(std::memory_order_acquire);
  }
  if (key != nullptr) {
    hello.flags = kHelloKeyed | (hca->tcp_crypt ? kHelloCrypt : 0);
    const Nonce nonce = NewNonce();
    std::memcpy(hello.nonce, nonce.data(), kNonceBytes);
    link.auth = std::make_unique<LinkAuth>();
    link.auth->phase = LinkAuth::kAwaitChallenge;
    link.auth->key = *key;
    link.auth->key_serial = key_serial;
    link.auth->accepter_gid = *peer_gid;
    link.auth->hello.assign(reinterpret_cast<const uint8_t*>(&hello),
                            reinterpret_cast<const uint8_t*>(&hello) + sizeof(hello));
    link.authenticated = false;
    link.key_serial = key_serial;
  }
  std::memcpy(link.shipped_control, hello.control, sizeof(hello.control));
  link.control_shipped = true;
  return QueueUnit(link, &hello, sizeof(hello));
}

}  // namespace

bool TcpConnectsFirst(const ibv_gid& own_gid, uint32_t own_qpn, const ibv_gid& peer_gid,
                      uint32_t peer_qpn) {
  const int order = std::memcmp(own_gid.raw, peer_gid.raw, sizeof(own_gid.raw));
  return order < 0 || (order == 0 && own_qpn <= peer_qpn);
}

uint64_t ConnectTcpLink(Hca* hca, SoftQp* qp, const ibv_gid& gid, uint32_t dst_qpn, int memfd,
                        uint64_t segment_size, const LinkKey* key, uint64_t key_serial) {
  if (!IsTcpFabricGid(gid)) {
    // The likeliest cause: the peer's soft device is on shared memory (SWIRL_SOFT_TCP unset).
    SWIRL_LOG(WARNING,
              "soft %s: QP 0x%x cannot link to %s: this device is on the TCP fabric "
              "(SWIRL_SOFT_TCP) and that GID is not a TCP one; set SWIRL_SOFT_TCP on both "
              "sides or on neither",
              hca->name, qp->qp_num, GidHex(gid));
    return 0;
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  sockaddr_in local;
  std::memset(&local, 0, sizeof(local));
  local.sin_family = AF_INET;
  local.sin_addr.s_addr = hca->tcp_addr;  // the source address is our GID's (AcceptHello checks)
  sockaddr_in remote;
  std::memset(&remote, 0, sizeof(remote));
  remote.sin_family = AF_INET;
  std::memcpy(&remote.sin_port, gid.raw + 8, 2);
  std::memcpy(&remote.sin_addr.s_addr, gid.raw + 12, 4);
  int one = 1;
  if (fd < 0 || setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0 ||
      bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof(local)) != 0 ||
      (connect(fd, reinterpret_cast<sockaddr*>(&remote), sizeof(remote)) != 0 &&
       errno != EINPROGRESS)) {
    SWIRL_LOG(DEBUG, "soft: QP 0x%x cannot reach %s: %s", qp->qp_num, GidHex(gid),
              std::strerror(errno));
    if (fd >= 0) close(fd);
    return 0;
  }
  auto* link = new TcpLink;
  link->outgoing = true;
  link->connecting = true;
  link->deadline_ns = NowNs() + kConnectTimeoutNs;
  if (!StartShipping(hca, qp, dst_qpn, memfd, segment_size, *link, key, key_serial, &gid)) {
    if (link->out_seg.base != nullptr) munmap(link->out_seg.base, link->out_seg.size);
    close(fd);
    delete link;
    return 0;
  }
  link->waiting_out = true;
  // EPOLLIN too: the peer's hello and segment come back on this connection.
  return hca->WatchTcp(fd, qp, link, EPOLLIN | EPOLLOUT | EPOLLRDHUP);
}

uint64_t ReplyOnTcpLink(Hca* hca, SoftQp* qp, uint64_t watch_id, int memfd,
                        uint64_t segment_size) {
  swirl::MutexLock watch_lock(&hca->watch_mu);
  auto it = hca->watches.find(watch_id);
  if (it == hca->watches.end() || it->second.tcp == nullptr || it->second.tcp->failed) return 0;
  TcpLink& link = *it->second.tcp;
  if (link.ships()) return 0;  // the peer's end of a connection we opened ourselves
  if (!StartShipping(hca, qp, qp->attr.dest_qp_num, memfd, segment_size, link)) return 0;
  Ship(hca, watch_id, it->second.fd, link);
  if (link.failed) {
    MarkGone(hca, it->second, watch_id);
    return 0;
  }
  return watch_id;
}

namespace {

// The connections from `source` that have not finished their hello (or handshake): how many,
// and the oldest one that has sent nothing (0: none).
struct SourceCount {
  int waiting = 0;
  uint64_t oldest_silent = 0;
};
SourceCount CountSource(Hca* hca, uint32_t source) {
  SourceCount count;
  int64_t oldest_ns = INT64_MAX;
  swirl::MutexLock watch_lock(&hca->watch_mu);
  for (const auto& [id, watch] : hca->watches) {
    const TcpLink* other = watch.tcp;
    if (other == nullptr || other->outgoing || other->hello_done || other->failed ||
        other->source != source) {
      continue;
    }
    ++count.waiting;
    if (!other->heard && other->accepted_ns < oldest_ns) {
      oldest_ns = other->accepted_ns;
      count.oldest_silent = id;
    }
  }
  return count;
}

}  // namespace

bool TakeFromSource(Hca* hca, uint32_t source) {
  // One address may hold only a few of the places before authentication: a flood from one
  // host delays that host's own links, not everyone's. Past its share, its oldest connection
  // that has sent nothing makes room; if every one has spoken, the new one is closed. Either
  // way the opener of a connection closed unlinked dials again 10 ms later (RetryTcpLink), so
  // a burst of real peers from one host links all the same, a few of them a redial later.
  const SourceCount count = CountSource(hca, source);
  if (count.waiting < kMaxWaitingPerSource) return true;
  hca->tcp_turned_away.fetch_add(1, std::memory_order_relaxed);
  char text[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &source, text, sizeof(text));
  if (count.oldest_silent == 0) {
    SWIRL_LOG_LIMITED(hca->peer_log, WARNING,
                      "soft %s: refused a TCP connection from %s: %d of its connections have "
                      "not finished their hello",
                      hca->name, text, count.waiting);
    return false;
  }
  // INFO: a burst of real peers from one host does this too (they dial again).
  SWIRL_LOG_LIMITED(hca->peer_log, INFO,
                    "soft %s: closed a silent TCP connection from %s for a newer one: %d of "
                    "its connections have not finished their hello",
                    hca->name, text, count.waiting);
  hca->Unwatch(count.oldest_silent);
  return true;
}

AcceptResult AcceptTcp(Hca* hca) {
  for (;;) {
    // Anyone may connect, so connections that owe a hello are capped; past the cap the rest
    // wait in the kernel's backlog (the listener rests) until hellos arrive or time out.
    int waiting = 0;
    {
      swirl::MutexLock watch_lock(&hca->watch_mu);
      for (const auto& [id, watch] : hca->watches) {
        waiting += watch.tcp != nullptr && !watch.tcp->outgoing && !watch.tcp->hello_done;
      }
    }
    if (waiting >= kMaxWaitingHellos) return AcceptResult::kBusy;
    sockaddr_in from;
    std::memset(&from, 0, sizeof(from));
    socklen_t from_len = sizeof(from);
    int fd = accept4(hca->listen_fd, reinterpret_cast<sockaddr*>(&from), &from_len,
                     SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      return errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM
                 ? AcceptResult::kOutOfResources
                 : AcceptResult::kDone;
    }
    const uint32_t source = from.sin_family == AF_INET ? from.sin_addr.s_addr : 0;
    if (!TakeFromSource(hca, source)) {
      close(fd);
      continue;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto* link = new TcpLink;
    link->source = source;
    link->accepted_ns = NowNs();
    link->deadline_ns = link->accepted_ns + kHelloTimeoutNs;
    hca->WatchTcp(fd, nullptr, link, EPOLLIN | EPOLLRDHUP);
  }
}

void ResumeParkedTcp(Hca* hca) {
  swirl::ReaderMutexLock lock(&hca->mu);
  swirl::MutexLock watch_lock(&hca->watch_mu);
  std::vector<std::pair<uint64_t, const char*>> refused;
  bool pending = false;
  for (auto& [id, watch] : hca->watches) {
    TcpLink* link = watch.tcp;
    if (link == nullptr || link->failed || link->auth == nullptr || link->outgoing) continue;
    pending = true;
    if (link->auth->phase != LinkAuth::kAwaitKey) continue;
    TcpHello hello;
    std::memcpy(&hello, link->auth->hello.data(), sizeof(hello));
    const QpKeyState state =
        QpKeyFor(hca, hello.dst_qpn, &link->auth->key, &link->auth->key_serial);
    if (state == QpKeyState::kKeyed) {
      if (!SendTcpChallenge(hca, watch.fd, *link)) refused.push_back({id, "cannot send challenge"});
    } else if (state == QpKeyState::kNoQp) {
      refused.push_back({id, "its QP is gone"});
    } else if (state == QpKeyState::kKeyless) {
      refused.push_back({id, "keyed hello for a QP without a link key"});
    }  // kWait: until its deadline (ExpireTcpLinks)
  }
  for (const auto& [id, why] : refused) {
    SWIRL_LOG_LIMITED(hca->peer_log, WARNING, "soft %s: refused a keyed TCP link: %s", hca->name,
                      why);
    hca->UnwatchLocked(id);
  }
  // (One that starts after this look sets the flag again.)
  if (!pending) hca->handshakes_pending.store(false, std::memory_order_release);
}

void ExpireTcpLinks(Hca* hca, int64_t now) {
  swirl::MutexLock watch_lock(&hca->watch_mu);
  std::vector<uint64_t> expired;
  for (auto& [id, watch] : hca->watches) {
    if (watch.tcp == nullptr || watch.tcp->failed || now < watch.tcp->deadline_ns) continue;
    if (!watch.tcp->outgoing && !watch.tcp->hello_done) {
      expired.push_back(id);
    } else if (watch.tcp->outgoing && watch.tcp->connecting) {
      SWIRL_LOG(DEBUG, "soft %s: QP 0x%x: TCP connect timed out", hca->name, watch.qp->qp_num);
      MarkGone(hca, watch, id);
    }
  }
  // Owed a hello too long: nothing refers to these yet.
  for (uint64_t id : expired) hca->UnwatchLocked(id);
}

void HandleTcpEvent(Hca* hca, uint64_t id, uint32_t events) {
  // Offering a segment looks up its QP: hca->mu before watch_mu, as everywhere.
  swirl::ReaderMutexLock lock(&hca->mu);
  swirl::MutexLock watch_lock(&hca->watch_mu);
  auto it = hca->watches.find(id);
  if (it == hca->watches.end() || it->second.tcp == nullptr || it->second.tcp->failed) return;
  if (TcpLink& link = *it->second.tcp;
      link.connecting && (events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) {
    int error = 0;
    socklen_t len = sizeof(error);
    if (getsockopt(it->second.fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0 || error != 0) {
      // The QP's frames have no way out: it fails as a requester whose retries ran out.
      SWIRL_LOG(DEBUG, "soft %s: QP 0x%x: TCP connect: %s", hca->name,
                it->second.qp != nullptr ? it->second.qp->qp_num : 0, std::strerror(error));
      MarkGone(hca, it->second, id);
      return;
    }
    link.connecting = false;
    Rearm(hca, id, it->second.fd, link);
  }
  if (!it->second.tcp->connecting && (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR))) {
    // Data first: a peer's last frames may arrive together with its hangup.
    Receive(hca, id, it->second, (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0);
    // A stranger's connection that never got as far as a QP is gone altogether.
    it = hca->watches.find(id);
    if (it == hca->watches.end() || it->second.tcp == nullptr || it->second.tcp->failed) return;
  }
  TcpLink& link = *it->second.tcp;
  if (link.ships()) {
    Ship(hca, id, it->second.fd, link);
    if (link.failed) MarkGone(hca, it->second, id);
  }
}

void ShipTcp(Hca* hca) {
  swirl::MutexLock watch_lock(&hca->watch_mu);
  for (auto& [id, watch] : hca->watches) {
    if (watch.tcp == nullptr || !watch.tcp->ships() || watch.tcp->failed) continue;
    Ship(hca, id, watch.fd, *watch.tcp);
    if (watch.tcp->failed) MarkGone(hca, watch, id);
  }
}

void WatchTcpReceives(Hca* hca) {
  swirl::MutexLock watch_lock(&hca->watch_mu);
  for (auto& [id, watch] : hca->watches) {
    // Before the peer's hello, this thread reads (the hello needs hca->mu, which polls lack).
    if (watch.tcp == nullptr || !watch.tcp->hello_done || watch.qp == nullptr ||
        watch.tcp->failed) {
      continue;
    }
    const bool want = HcaAssists(watch.qp);
    if (want == watch.tcp->watching_in) continue;
    watch.tcp->watching_in = want;
    Rearm(hca, id, watch.fd, *watch.tcp);
  }
}

void ShipTcpFor(SoftQp* qp) {
  if (qp->out_watch == 0) return;
  Hca* hca = qp->hca;
  swirl::MutexLock watch_lock(&hca->watch_mu);
  auto it = hca->watches.find(qp->out_watch);
  if (it == hca->watches.end() || it->second.tcp == nullptr || it->second.tcp->failed) return;
  Ship(hca, it->first, it->second.fd, *it->second.tcp);
  if (it->second.tcp->failed) MarkGone(hca, it->second, it->first);
}

bool PullTcp(Hca* hca) {
  if (!hca->watch_mu.TryLock()) return false;
  // A publisher sets its QP's flag, then the HCA's: taking the HCA's first (a full barrier)
  // means every QP flag set before it is seen below, and any set later raises it again.
  if (hca->tcp_control_due.load(std::memory_order_relaxed) &&
      hca->tcp_control_due.exchange(false, std::memory_order_seq_cst)) {
    for (auto& [id, watch] : hca->watches) {
      if (watch.tcp != nullptr && watch.tcp->ships() && !watch.tcp->failed &&
          watch.qp != nullptr && watch.qp->tcp_control_due.load(std::memory_order_relaxed) &&
          watch.qp->tcp_control_due.exchange(false, std::memory_order_acq_rel)) {
        Ship(hca, id, watch.fd, *watch.tcp);
        if (watch.tcp->failed) MarkGone(hca, watch, id);
      }
    }
  }
  bool arrived = false, kick = false;
  epoll_event ready[16];
  int n;
  if (hca->tcp_incoming.empty()) {
    n = 0;
  } else if (hca->tcp_incoming.size() == 1) {
    ready[0].data.u64 = hca->tcp_incoming[0];
    n = 1;
  } else {
    n = epoll_wait(hca->tcp_poll_fd, ready, 16, 0);
  }
  for (int i = 0; i < n; ++i) {
    // Only links past their hello are in this set: they belong to a QP, and Receive never
    // erases them (hellos are the HCA thread's: they need hca->mu).
    // Copied out first: epoll_event is packed on x86-64, so its u64 sits at offset 4, and
    // find() binds a reference to its argument (a misaligned one is undefined behaviour;
    // clang's UBSan stops on it).
    const uint64_t id = ready[i].data.u64;
    auto it = hca->watches.find(id);
    if (it == hca->watches.end() || it->second.tcp == nullptr || it->second.tcp->failed) continue;
    // A link the HCA thread watches belongs to a QP with an assisted CQ (its owner may sleep on
    // a channel): we took the data from under the thread's wakeup, so wake it ourselves.
    if (Receive(hca, it->first, it->second)) {
      arrived = true;
      kick |= it->second.tcp->watching_in;
    }
  }
  hca->watch_mu.Unlock();
  if (kick) hca->Kick();
  return arrived;
}

void SetTcpLinkTimeout(Hca* hca, uint64_t watch_id, int64_t timeout_ns) {
  swirl::MutexLock watch_lock(&hca->watch_mu);
  auto it = hca->watches.find(watch_id);
  if (it == hca->watches.end()) return;
  if (timeout_ns <= 0) {  // timeout 0: wait forever, as RC does (a refused connect still fails)
    if (it->second.tcp != nullptr) it->second.tcp->deadline_ns = INT64_MAX;
    return;
  }
  const int fd = it->second.fd;
  // A link still connecting now has the QP's own patience, not kConnectTimeoutNs.
  if (it->second.tcp != nullptr) it->second.tcp->deadline_ns = NowNs() + timeout_ns;
  // TCP counts in whole milliseconds and keepalive in seconds; a peer gets at least one of each.
  const unsigned user_timeout_ms =
      static_cast<unsigned>(std::max<int64_t>(timeout_ns / 1000000, 1000));
  const int one = 1, idle = 1, count = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
}

void DestroyTcpLink(Hca* hca, uint64_t id, LinkWatch& watch) {
  TcpLink* link = watch.tcp;
  ForgetIncoming(hca, id);
  // The QP is going: what it published last (its final state among it) goes out if the
  // socket takes it now; a peer that misses it sees the connection close instead.
  if (link->ships() && !link->failed && !link->connecting) {
    Ship(hca, id, watch.fd, *link);
    // End our direction after those records, then take what the peer sent that nobody read:
    // closing a socket with unread input resets the connection, and a reset can make the peer
    // drop our last records unread (its requests we acknowledged would then fail there). The
    // peer's own direction carries its records too since both share the connection.
    shutdown(watch.fd, SHUT_WR);
    char discard[4096];
    for (int i = 0; i < 64 && recv(watch.fd, discard, sizeof(discard), MSG_DONTWAIT) > 0; ++i) {
    }
  }
  for (LinkSegment* seg : {&link->out_seg, &link->in_seg}) {
    if (seg->base != nullptr) munmap(seg->base, seg->size);
  }
  delete link;
  watch.tcp = nullptr;
}

// ---- The TCP fabric (fabric.h) --------------------------------------------------------------

namespace {

// A connection the peer closed before it was linked is opened again this long after.
constexpr int64_t kLinkRetryNs = 10 * 1000 * 1000;

// Opens the connection to our peer (keyed if the QP has a key); its watch id, or 0.
uint64_t ConnectTcpFor(SoftQp* qp) {
  LinkKey key;
  const uint64_t serial = LinkKeyOf(qp, &key);
  const uint64_t watch =
      ConnectTcpLink(qp->hca, qp, qp->attr.ah_attr.grh.dgid, qp->attr.dest_qp_num, qp->memfd,
                     qp->own_size, serial != 0 ? &key : nullptr, serial);
  OPENSSL_cleanse(key.data(), key.size());
  return watch;
}

}  // namespace

TcpFabric::TcpFabric(Hca* hca) : Fabric(hca, Kind::kTcp, &PullTcp) {}

TcpFabric::~TcpFabric() {
  if (hca_->tcp_poll_fd >= 0) close(hca_->tcp_poll_fd);
  hca_->tcp_poll_fd = -1;
}

std::unique_ptr<Fabric> TcpFabric::Open(Hca* hca, const char* spec, std::string* error) {
  std::unique_ptr<Fabric> fabric(new TcpFabric(hca));
  const std::string& name = hca->name;
  uint16_t port = 0;
  std::string why;
  if (!ParseTcpFabric(spec, &hca->tcp_addr, &port, &why)) {
    *error = absl::StrCat("soft device ", name, ": SWIRL_SOFT_TCP: ", why);
    return nullptr;
  }
  // A fixed port is soft0's; softN listens N above it, so a process's devices do not collide.
  if (port != 0) {
    const uint32_t shifted = port + static_cast<uint32_t>(std::atoi(name.c_str() + 4));
    if (shifted > 65535) {
      *error = absl::StrCat("soft device ", name, ": SWIRL_SOFT_TCP port out of range");
      return nullptr;
    }
    port = static_cast<uint16_t>(shifted);
  }
  if (const char* crypt = std::getenv("SWIRL_SOFT_TCP_CRYPT");
      crypt != nullptr && std::strcmp(crypt, "off") == 0) {
    hca->tcp_crypt = false;
    SWIRL_LOG(WARNING,
              "soft device %s: SWIRL_SOFT_TCP_CRYPT=off: TCP records of keyed links travel "
              "unsealed unless the peer asks for sealing (for benchmarks only)",
              name);
  }
  hca->listen_fd = ListenTcp(hca->tcp_addr, port, &hca->gid, &why);
  hca->tcp_poll_fd = epoll_create1(EPOLL_CLOEXEC);
  if (hca->listen_fd < 0 || hca->tcp_poll_fd < 0) {
    *error = absl::StrCat("soft device ", name, ": ", why.empty() ? std::strerror(errno) : why);
    if (hca->listen_fd >= 0) close(hca->listen_fd);
    hca->listen_fd = -1;
    return nullptr;  // (the fabric closes the poll fd)
  }
  return fabric;
}

AcceptResult TcpFabric::Accept() { return AcceptTcp(hca_); }

void TcpFabric::HandleEvent(uint64_t id, uint32_t events) { HandleTcpEvent(hca_, id, events); }

void TcpFabric::TendLinks(int64_t now) {
  {
    swirl::ReaderMutexLock lock(&hca_->mu);
    WatchTcpReceives(hca_);
  }
  ExpireTcpLinks(hca_, now);
}

void TcpFabric::ResumeParked() { ResumeParkedTcp(hca_); }

void TcpFabric::ShipPending() { ShipTcp(hca_); }

void TcpFabric::CloseLink(uint64_t id, LinkWatch& watch) {
  if (watch.tcp != nullptr) DestroyTcpLink(hca_, id, watch);
}

void TcpFabric::OpenLink(SoftQp* qp) {
  // One side of the pair connects (the HCA thread completes it; a refused or timed-out
  // connect fails a linked QP from there, an unlinked one at its link deadline). The other
  // answers on that connection once it has adopted it (LinkAdopted).
  if (TcpConnectsFirst(qp->hca->gid, qp->qp_num, qp->attr.ah_attr.grh.dgid,
                       qp->attr.dest_qp_num)) {
    qp->out_watch = ConnectTcpFor(qp);
  }
}

void TcpFabric::LinkAdopted(SoftQp* qp) {
  if (qp->out_watch != 0) return;  // we opened a connection: our segment goes on it
  // The peer opened the connection: our segment goes back on it.
  qp->out_watch = ReplyOnTcpLink(qp->hca, qp, qp->in_watch, qp->memfd, qp->own_size);
  if (qp->out_watch != 0 && qp->qstate == IBV_QPS_RTS) {
    SetTcpLinkTimeout(qp->hca, qp->out_watch, AckTimeoutNs(qp->attr) * (qp->attr.retry_cnt + 1));
  }
}

// The side of the pair that connects: a connection the peer closed before it was linked (the
// peer was in ERR, about to be reset and connected again) is opened again, 10 ms after it was
// found closed and every 10 ms after that, until the QP links or its link deadline passes: the
// peer never connects itself, so without this the pair could not link. (The wait first leaves
// the HCA thread time to hand over what the peer sent before it closed: a peer that answered,
// acknowledged and hung up is linked to, not dialled again.) On shared memory the peer answers
// our hello with its own instead (ShmFabric::LinkAdopted).
bool TcpFabric::RetryLink(SoftQp* qp) {
  if (qp->out_watch == 0) return false;  // the answering side: the peer connects again
  if (qp->linked || !WatchDead(qp->hca, qp->out_watch)) {
    qp->next_link_attempt_ns = 0;
    return false;
  }
  const int64_t now = NowNs();
  if (qp->next_link_attempt_ns == 0) {
    qp->next_link_attempt_ns = now + kLinkRetryNs;
    return false;
  }
  if (now < qp->next_link_attempt_ns) return false;
  qp->next_link_attempt_ns = now + kLinkRetryNs;
  qp->hca->Unwatch(qp->out_watch);
  // The close marked the peer gone, but it was a refusal of a link never made: not a loss.
  qp->peer_gone.store(false, std::memory_order_release);
  qp->out_watch = ConnectTcpFor(qp);
  if (qp->out_watch != 0 && qp->qstate == IBV_QPS_RTS && qp->link_deadline_ns != 0) {
    SetTcpLinkTimeout(qp->hca, qp->out_watch, std::max<int64_t>(qp->link_deadline_ns - now, 1));
  }
  return qp->out_watch != 0;
}

void TcpFabric::SetLinkTimeout(SoftQp* qp, int64_t timeout_ns) {
  if (qp->out_watch != 0) SetTcpLinkTimeout(qp->hca, qp->out_watch, timeout_ns);
}

void TcpFabric::Publish(SoftQp* qp, bool wrote) {
  // New frames go now, with the control words; a change of control words alone (consumed,
  // acked) rides with the next frame or goes at the next poll, whichever is first, so a
  // request and the acknowledgement of the one before share a segment.
  if (wrote) {
    ShipTcpFor(qp);
  } else {
    // The QP's flag first, then the HCA's (PullTcp takes them in the other order).
    qp->tcp_control_due.store(true, std::memory_order_release);
    qp->hca->tcp_control_due.store(true, std::memory_order_release);
  }
}

}  // namespace swirl::soft
