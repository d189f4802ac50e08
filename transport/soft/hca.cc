// The soft HCA: one per device name per process. It owns the GID, the memory-key table, and one
// thread that (1) accepts links from peers over an abstract Unix socket named after the GID and
// validates the shared-memory segments they hand over (or, on the TCP fabric, accepts TCP
// links and keeps their mirrors: tcp_link.cc), (2) notices peers that go away, and (3) makes
// progress for CQs nobody is polling: armed CQs whose owner sleeps on a completion channel, and
// passive targets of one-sided operations.

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

#include "absl/container/flat_hash_map.h"
#include "absl/random/distributions.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/log.h"
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

// What a QP sends when it reaches RTR, with SCM_RIGHTS [segment memfd, HCA wake eventfd].
struct Hello {
  uint64_t magic;
  uint32_t version;
  uint32_t src_qpn;
  uint32_t dst_qpn;
  uint32_t reserved;
  ibv_gid src_gid;
  uint64_t segment_size;
};

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


// Validates and maps a peer's segment. Everything here comes from another process.
bool MapPeerSegment(const Hello& hello, int memfd, PeerSegment* out, std::string* why) {
  int seals = fcntl(memfd, F_GET_SEALS);
  if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
    *why = "segment is not a size-sealed memfd";
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

// Reads the hello on a freshly accepted connection and hands the segment to its QP. Returns
// false if the connection should be dropped.
bool ReceiveHello(Hca* hca, uint64_t watch_id, int fd) {
  Hello hello;
  char control[CMSG_SPACE(2 * sizeof(int))];
  iovec iov{&hello, sizeof(hello)};
  msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;  // not yet
  int fds[2] = {-1, -1};
  int nfds = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      int count = static_cast<int>((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
      for (int i = 0; i < count; ++i) {
        int received;
        std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        if (nfds < 2) {
          fds[nfds++] = received;
        } else {
          close(received);
        }
      }
    }
  }
  std::string why;
  if (n != static_cast<ssize_t>(sizeof(hello)) || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ||
      nfds != 2 || hello.magic != kHelloMagic || hello.version != wire::kWireVersion) {
    why = "malformed hello";
  }
  PeerSegment segment;
  if (why.empty() && !IsEventFd(fds[1])) why = "wake descriptor is not an eventfd";
  if (why.empty() && MapPeerSegment(hello, fds[0], &segment, &why)) {
    close(fds[0]);
    fds[0] = -1;
    // Writing the peer's eventfd must never block us.
    fcntl(fds[1], F_SETFL, fcntl(fds[1], F_GETFL) | O_NONBLOCK);
    segment.wake_fd = fds[1];
    fds[1] = -1;
    segment.watch = watch_id;
    bool offered;
    {
      swirl::ReaderMutexLock lock(&hca->mu);
      swirl::MutexLock watch_lock(&hca->watch_mu);
      offered = OfferSegment(hca, watch_id, hello.dst_qpn, segment, &why);
    }
    if (offered) return true;
    munmap(const_cast<char*>(segment.base), segment.size);
    close(segment.wake_fd);
  }
  CloseFds(fds, 2);
  SWIRL_LOG(WARNING, "soft %s: refused a link to QP 0x%x: %s", hca->name, hello.dst_qpn, why);
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
    // Only processes of the same user may link to our QPs, as with a device node's mode.
    ucred cred;
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
        (cred.uid != getuid() && cred.uid != 0)) {
      close(fd);
      continue;
    }
    hca->Watch(fd, nullptr);
  }
}

void HandleWatchEvent(Hca* hca, uint64_t id, uint32_t events) {
  if (hca->tcp) {
    HandleTcpEvent(hca, id, events);
    return;
  }
  int fd = -1;
  SoftQp* qp = nullptr;
  {
    swirl::MutexLock lock(&hca->watch_mu);
    auto it = hca->watches.find(id);
    if (it == hca->watches.end()) return;
    fd = it->second.fd;
    qp = it->second.qp;
  }
  if (qp == nullptr && (events & EPOLLIN)) {
    if (!ReceiveHello(hca, id, fd)) hca->Unwatch(id);
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
      close(it->second.fd);
      hca->watches.erase(it);
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
  for (auto& [qpn, qp] : hca->qps) {
    if (!qp->lock.try_lock()) continue;
    did |= ProgressLocked(qp);
    qp->lock.unlock();
  }
  return did;
}

bool ProgressAssisted(Hca* hca) {
  bool did = false;
  swirl::ReaderMutexLock lock(&hca->mu);
  for (auto& [qpn, qp] : hca->qps) {
    if (!Assisted(qp) || !qp->lock.try_lock()) continue;
    did |= ProgressLocked(qp);
    qp->lock.unlock();
  }
  return did;
}

void SetSleeping(Hca* hca, uint64_t value) {
  swirl::ReaderMutexLock lock(&hca->mu);
  for (auto& [qpn, qp] : hca->qps) {
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
  for (;;) {
    const int64_t now = NowNs();
    const bool assist = hca->assist && MarkAssistedCqs(hca, now);
    if (hca->tcp) {
      swirl::ReaderMutexLock lock(&hca->mu);
      WatchTcpReceives(hca);
    }
    if (hca->tcp) ExpireTcpLinks(hca, now);
    if (accept_paused_until != 0 && now >= accept_paused_until) {
      accept_paused_until = 0;
      epoll_event ev;
      ev.events = EPOLLIN;
      ev.data.u64 = kListenId;
      epoll_ctl(hca->epoll_fd, EPOLL_CTL_ADD, hca->listen_fd, &ev);
    }
    int timeout_ms;
    {
      // A TCP device keeps time for its links' deadlines (ExpireTcpLinks) even with no CQ.
      swirl::ReaderMutexLock lock(&hca->mu);
      timeout_ms = hca->cqs.empty() && !hca->tcp && accept_paused_until == 0 ? -1 : 10;
    }
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
        const AcceptResult result = hca->tcp ? AcceptTcp(hca) : AcceptAll(hca);
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
        HandleWatchEvent(hca, id, events[i].events);
      }
    }
    if (assist) {
      // A passive target with traffic flowing (RDMA WRITEs into memory nobody polls, a server
      // asleep in ibv_get_cq_event) is served as a NIC would serve it, without a sleep and a
      // wakeup (~10 us here) between frames: only a quiet spell ends the spin.
      const int64_t start = NowNs();
      int64_t quiet_since = start;
      for (int64_t now2 = start; now2 - quiet_since < kAssistQuietNs &&
                                 now2 - start < kAssistSpinMaxNs;
           now2 = NowNs()) {
        if (ProgressAssisted(hca)) {
          quiet_since = now2;
        } else {
          CpuRelax();
        }
      }
    }
    // TCP fabric: what the rounds above published (acks of a sleeping owner's receives), what
    // a full socket held back, and state changes that woke nobody (within the 10 ms timeout).
    if (hca->tcp) ShipTcp(hca);
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
  if (const char* env = std::getenv("SWIRL_SOFT_TCP"); env != nullptr && *env != 0) {
    uint16_t port = 0;
    std::string why;
    if (!ParseTcpFabric(env, &hca->tcp_addr, &port, &why)) {
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
    hca->tcp = true;
    hca->listen_fd = ListenTcp(hca->tcp_addr, port, &hca->gid, &why);
    hca->tcp_poll_fd = epoll_create1(EPOLL_CLOEXEC);
    if (hca->listen_fd < 0 || hca->tcp_poll_fd < 0) {
      *error = absl::StrCat("soft device ", name, ": ", why.empty() ? std::strerror(errno) : why);
      if (hca->listen_fd >= 0) close(hca->listen_fd);
      if (hca->tcp_poll_fd >= 0) close(hca->tcp_poll_fd);
      return nullptr;
    }
  }
  bool listening = hca->tcp;
  if (!hca->tcp) {
    hca->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    socklen_t len;
    sockaddr_un addr = AddressFor(hca->gid, &len);
    listening = hca->listen_fd >= 0 &&
                bind(hca->listen_fd, reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
                listen(hca->listen_fd, 1024) == 0;
  }
  hca->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  hca->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  hca->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  if (!listening || hca->wake_fd < 0 || hca->stop_fd < 0 || hca->epoll_fd < 0) {
    *error = absl::StrCat("soft device ", name, ": ", std::strerror(errno));
    for (int fd : {hca->listen_fd, hca->wake_fd, hca->stop_fd, hca->epoll_fd, hca->tcp_poll_fd}) {
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

uint64_t Hca::Watch(int fd, SoftQp* qp) { return WatchTcp(fd, qp, nullptr, EPOLLIN | EPOLLRDHUP); }

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
  if (it->second.tcp != nullptr) DestroyTcpLink(this, id, it->second);
  close(it->second.fd);
  watches.erase(it);
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
  if (wake_fd >= 0) close(wake_fd);
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
      if (watch.tcp != nullptr) DestroyTcpLink(hca, id, watch);
      close(watch.fd);
    }
    hca->watches.clear();
  }
  for (int fd : {hca->listen_fd, hca->wake_fd, hca->stop_fd, hca->epoll_fd, hca->tcp_poll_fd}) {
    if (fd >= 0) close(fd);
  }
  delete hca;
}

int SendHello(Hca* hca, const ibv_gid& gid, uint32_t src_qpn, uint32_t dst_qpn, int memfd,
              uint64_t segment_size) {
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  socklen_t len;
  sockaddr_un addr = AddressFor(gid, &len);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    int err = errno;
    close(fd);
    return -err;
  }
  Hello hello;
  std::memset(&hello, 0, sizeof(hello));
  hello.magic = kHelloMagic;
  hello.version = wire::kWireVersion;
  hello.src_qpn = src_qpn;
  hello.dst_qpn = dst_qpn;
  hello.src_gid = hca->gid;
  hello.segment_size = segment_size;
  int fds[2] = {memfd, hca->wake_fd};
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
  if (sendmsg(fd, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(hello))) {
    int err = errno;
    close(fd);
    return -err;
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
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

void SoftContext::PurgeAsyncEvents(const void* object) {
  swirl::MutexLock lock(&async.mu);
  for (auto it = async.queue.begin(); it != async.queue.end();) {
    // element is a union of pointers (and a port number): compare the pointer form.
    if (static_cast<const void*>(it->element.qp) == object) {
      it = async.queue.erase(it);
    } else {
      ++it;
    }
  }
  UnsignalIfEmptyLocked();  // poll() on async_fd must not announce events that are gone
}

int SoftContext::TakeAsyncEvent(ibv_async_event* event) {
  swirl::MutexLock lock(&async.mu);
  if (async.queue.empty()) return EAGAIN;
  *event = async.queue.front();
  async.queue.pop_front();
  UnsignalIfEmptyLocked();
  return 0;
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
