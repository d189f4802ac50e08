// The fabric: how a soft device's QPs reach their peers. Everything that differs between the
// two lies behind this interface:
//
//  * shared memory (ShmFabric; hca.cc): one host. A QP hands its peer a sealed memfd of its
//    segment over an abstract Unix socket named after the GID (the hello), the peer maps it
//    read-only, and a peer whose HCA thread sleeps is woken through its eventfd;
//  * TCP (TcpFabric; tcp_link.cc, SWIRL_SOFT_TCP): across hosts. A QP pair shares one TCP
//    connection over which each side ships its segment frame by frame into a private mirror
//    at the other, which polls read from the socket.
//
// Either way the QP code reads its peer's segment with the same layout (wire.h), so the rest
// of the device does not know which fabric it runs on: it calls the fabric where links are
// made, tended, published to and closed.
//
// One Fabric per HCA, chosen once when the device opens (OpenFabric); every QP and CQ keeps a
// pointer to it. The control path (link setup, the HCA thread's events and deadlines) calls
// virtual functions: it runs a few times per link. The data path must not pay for the seam: a
// publish is per message and a poll's pull per poll, so Publish is an inline member that tests
// the fabric's kind (one predictable branch, as the per-QP flag it replaces) and calls the
// final class's own function directly, and what a poll does first is a function pointer the
// CQ caches at creation (null on shared memory: the test of a null pointer that it replaces
// costs what the flag did).

#ifndef SWIRL_TRANSPORT_SOFT_FABRIC_H_
#define SWIRL_TRANSPORT_SOFT_FABRIC_H_

#include <infiniband/verbs.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <string>

#include "transport/soft/qp_ops.h"
#include "transport/soft/soft_internal.h"

namespace swirl::soft {

class Fabric {
 public:
  enum class Kind : uint8_t { kSharedMemory, kTcp };

  virtual ~Fabric() = default;
  Fabric(const Fabric&) = delete;
  Fabric& operator=(const Fabric&) = delete;

  Kind kind() const { return kind_; }

  // ---- GIDs ----
  // What a GID looks like on each fabric: TCP's are ::ffff:<IPv4> with the port in bytes 8-9
  // (IsTcpFabricGid); shared memory's are random fe80:: ones. A QP links only within its
  // fabric, so which fabric a GID names is all a reachability check needs.
  static Kind KindOfGid(const ibv_gid& gid);
  static const char* Describe(Kind kind);
  // Whether a QP on this fabric can link to one whose device has GID `remote`.
  bool Reaches(const ibv_gid& remote) const { return KindOfGid(remote) == kind_; }
  // DeviceOps::CheckReachable of device `device`: 0 if `local` and `remote` are on the same
  // fabric, else EHOSTUNREACH with what to change in *why.
  static int CheckReachable(const std::string& device, const ibv_gid& local,
                            const ibv_gid& remote, std::string* why);

  // ---- The HCA thread ----
  // Takes the connections waiting on the HCA's listener (hca->listen_fd).
  virtual AcceptResult Accept() = 0;
  // An epoll event on the connection of watch `id`.
  virtual void HandleEvent(uint64_t id, uint32_t events) = 0;
  // Each loop, before the thread waits: TCP decides which links the thread reads and fails
  // those past their deadlines; shared memory has nothing to tend.
  virtual void TendLinks(int64_t now) = 0;
  // Whether the thread must wake for link deadlines even with no CQ to assist (TCP's connect
  // and hello timeouts); otherwise it may sleep until an event.
  virtual bool HasLinkDeadlines() const = 0;
  // Keyed hellos waiting for their QP's key, and proofs overdue (ResumeParked*).
  virtual void ResumeParked() = 0;
  // After the thread's rounds of progress: TCP ships what they published and what a full
  // socket held back; on shared memory the peer already sees it.
  virtual void ShipPending() = 0;
  // Watch `id` is going away (caller holds watch_mu; it closes the fd): frees the fabric's
  // state of the link (TCP: the TcpLink, after a last best-effort ship).
  virtual void CloseLink(uint64_t id, LinkWatch& watch) = 0;

  // ---- A QP's link (the QP's lock held) ----
  // At RTR: starts linking to the peer named by the QP's attributes. Nothing fails here if the
  // peer is absent: as with a real link, requests time out at RTS.
  virtual void OpenLink(SoftQp* qp) = 0;
  // The QP has just adopted the peer's segment that came on watch qp->in_watch: makes sure
  // the peer gets ours too.
  virtual void LinkAdopted(SoftQp* qp) = 0;
  // Unlinked, in slow progress: opens the link again if the fabric does that (TCP's connecting
  // side, after the peer closed). True if it did.
  virtual bool RetryLink(SoftQp* qp) = 0;
  // At RTS: a link whose peer stops acknowledging fails after `timeout_ns`, as an RC
  // requester's retries would. Shared memory learns of a dead peer from its socket's hang-up.
  virtual void SetLinkTimeout(SoftQp* qp, int64_t timeout_ns) = 0;

  // ---- The data path (inline) ----
  // `qp` (linked, its lock held) has just published new frames (`wrote`) or control words into
  // its own segment: gets them to the peer.
  inline void Publish(SoftQp* qp, bool wrote);
  // What a poll does before it makes progress (SoftCq::pull_links caches it): null when the
  // peer's frames arrive by themselves (shared memory).
  using PollHook = bool (*)(Hca*);
  PollHook poll_hook() const { return poll_hook_; }

 protected:
  Fabric(Hca* hca, Kind kind, PollHook poll_hook)
      : hca_(hca), kind_(kind), poll_hook_(poll_hook) {}
  Hca* const hca_;

 private:
  const Kind kind_;
  const PollHook poll_hook_;
};

// Shared memory (hca.cc).
class ShmFabric final : public Fabric {
 public:
  // Listens on the abstract Unix socket named after hca->gid.
  static std::unique_ptr<Fabric> Open(Hca* hca, std::string* error);

  AcceptResult Accept() override;
  void HandleEvent(uint64_t id, uint32_t events) override;
  void TendLinks(int64_t) override {}
  bool HasLinkDeadlines() const override { return false; }
  void ResumeParked() override;
  void ShipPending() override {}
  void CloseLink(uint64_t, LinkWatch&) override {}
  void OpenLink(SoftQp* qp) override;
  void LinkAdopted(SoftQp* qp) override;
  bool RetryLink(SoftQp* qp) override;
  void SetLinkTimeout(SoftQp*, int64_t) override {}

  // Publish's part: the peer reads our segment as we write it; it only has to be woken if its
  // HCA thread sleeps on our QP's behalf (it set `sleeping` in our control block).
  static void Publish(SoftQp* qp) {
    // Pairs with the sleeper's fence between setting `sleeping` and re-checking our rings.
    FullFence();
    if (qp->peer.control()->sleeping.value.load(std::memory_order_relaxed) != 0) {
      uint64_t one = 1;
      ssize_t ignored = write(qp->peer.wake_fd, &one, sizeof(one));
      (void)ignored;
    }
  }

 private:
  explicit ShmFabric(Hca* hca) : Fabric(hca, Kind::kSharedMemory, nullptr) {}
};

// TCP (tcp_link.cc).
class TcpFabric final : public Fabric {
 public:
  // `spec` is SWIRL_SOFT_TCP ("IPv4[:port]"): listens there (softN N ports above a fixed
  // port) and sets hca->gid to the GID that names the listener.
  static std::unique_ptr<Fabric> Open(Hca* hca, const char* spec, std::string* error);
  ~TcpFabric() override;

  AcceptResult Accept() override;
  void HandleEvent(uint64_t id, uint32_t events) override;
  void TendLinks(int64_t now) override;
  bool HasLinkDeadlines() const override { return true; }
  void ResumeParked() override;
  void ShipPending() override;
  void CloseLink(uint64_t id, LinkWatch& watch) override;
  void OpenLink(SoftQp* qp) override;
  void LinkAdopted(SoftQp* qp) override;
  bool RetryLink(SoftQp* qp) override;
  void SetLinkTimeout(SoftQp* qp, int64_t timeout_ns) override;

  // Publish's part: new frames go now, with the control words; control words alone wait for
  // the next frame or poll (out of line: it makes a system call anyway).
  static void Publish(SoftQp* qp, bool wrote);

 private:
  explicit TcpFabric(Hca* hca);
};

// The fabric of a device being created: TCP if SWIRL_SOFT_TCP is set, else shared memory.
// Sets up its listener (hca->listen_fd) and, for TCP, the GID. Null with *error on failure.
std::unique_ptr<Fabric> OpenFabric(Hca* hca, std::string* error);

inline void Fabric::Publish(SoftQp* qp, bool wrote) {
  if (kind_ == Kind::kTcp) {
    TcpFabric::Publish(qp, wrote);
  } else {
    ShmFabric::Publish(qp);
  }
}

}  // namespace swirl::soft

#endif  // SWIRL_TRANSPORT_SOFT_FABRIC_H_
