// RAII owners for verbs objects, over any DeviceOps (rdma-core or the soft device).
//
// Ownership: every object keeps its parent alive with a shared_ptr (a QP holds its PD, CQs and
// SRQ; an MR holds its PD; a PD holds its Context), so the release order is always right: a
// parent is released only after its last child, whatever order the caller drops its handles in.
// Destructors release the verbs object; if the device refuses (for example ibv_dereg_mr while a
// memory window is still bound), the error is logged and the handle leaks rather than crash.
// Callers who want the error use the explicit Release()/Deregister() methods.
//
// Factories return absl::StatusOr; a failure names the verbs call and errno text, and leaves
// nothing allocated.
//
// Data path: the objects expose their raw libibverbs pointers (get()); post and poll with the
// ordinary inline ibv_post_send/ibv_post_recv/ibv_poll_cq calls, which dispatch through
// context->ops and so work on every device kind.
//
// Thread safety: creation and destruction are thread-safe as far as the device is. A QP's
// transitions must not race with each other.

#ifndef SWIRL_TRANSPORT_VERBS_VERBS_H_
#define SWIRL_TRANSPORT_VERBS_VERBS_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "transport/verbs/device_ops.h"

namespace swirl::verbs {

// An opened device. Owns the DeviceOps (and through it the ibv_context).
class Context {
 public:
  static std::shared_ptr<Context> Wrap(std::unique_ptr<DeviceOps> ops);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  DeviceOps& ops() { return *ops_; }
  ibv_context* get() { return ops_->context(); }
  const std::string& name() const { return ops_->name(); }
  DeviceKind kind() const { return ops_->kind(); }

  absl::StatusOr<ibv_device_attr_ex> QueryDevice();
  absl::StatusOr<ibv_port_attr> QueryPort(uint8_t port_num);
  absl::StatusOr<ibv_gid> QueryGid(uint8_t port_num, int index);
  // ibv_query_pkey: the P_Key at `index` of the port's table, in host order.
  absl::StatusOr<uint16_t> QueryPkey(uint8_t port_num, int index);
  // The GID table index to use: `requested` itself if 0..255; for kAutoGidIndex the one
  // ChooseGidIndex picks on a RoCE port (0 on InfiniBand, where the LID routes, without looking
  // at the table). Anything else is INVALID_ARGUMENT.
  absl::StatusOr<int> ResolveGidIndex(uint8_t port_num, int requested);
  // DeviceOps::CheckReachable: OK, or FAILED_PRECONDITION with the device's reason.
  absl::Status CheckReachable(const ibv_gid& local, const ibv_gid& remote);
  // DeviceOps::GidAddress: the IPv4 address a link toward `gid` goes to, or NOT_FOUND.
  absl::StatusOr<std::string> GidAddress(const ibv_gid& gid);

  // Waits up to `timeout` for an asynchronous event (IBV_EVENT_*) and acknowledges it.
  // kDeadlineExceeded if none arrived.
  absl::StatusOr<ibv_event_type> WaitAsyncEvent(absl::Duration timeout);
  // The same, with the whole event: its element (qp, cq, srq or port) identifies the object; the
  // event is acknowledged, so its pointers are for comparison only.
  absl::StatusOr<ibv_async_event> NextAsyncEvent(absl::Duration timeout);

 private:
  explicit Context(std::unique_ptr<DeviceOps> ops) : ops_(std::move(ops)) {}
  std::unique_ptr<DeviceOps> ops_;
};

class ProtectionDomain {
 public:
  static absl::StatusOr<std::shared_ptr<ProtectionDomain>> Create(std::shared_ptr<Context> ctx);
  ~ProtectionDomain();
  ProtectionDomain(const ProtectionDomain&) = delete;
  ProtectionDomain& operator=(const ProtectionDomain&) = delete;

  ibv_pd* get() const { return pd_; }
  Context& context() const { return *context_; }
  const std::shared_ptr<Context>& shared_context() const { return context_; }

 private:
  ProtectionDomain(std::shared_ptr<Context> ctx, ibv_pd* pd) : context_(std::move(ctx)), pd_(pd) {}
  std::shared_ptr<Context> context_;
  ibv_pd* pd_;
};

class MemoryRegion {
 public:
  // Registers [addr, addr+length) with `access` (IBV_ACCESS_* flags).
  static absl::StatusOr<std::unique_ptr<MemoryRegion>> Register(
      std::shared_ptr<ProtectionDomain> pd, void* addr, size_t length, int access);
  ~MemoryRegion();
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;

  // Deregisters now and reports the device's answer (EBUSY while memory windows are bound over
  // it). On error the region stays registered and owned.
  absl::Status Deregister();

  // ibv_rereg_mr: IBV_REREG_MR_CHANGE_TRANSLATION (addr, length), _PD (pd, which this region
  // then holds instead of its old one) and _ACCESS (access), as `flags` says. On error the
  // region keeps its old PD here (the device's state is its own: ibv_rereg_mr(3)).
  absl::Status Reregister(int flags, std::shared_ptr<ProtectionDomain> pd, void* addr,
                          size_t length, int access);

  ibv_mr* get() const { return mr_; }
  uint32_t lkey() const { return mr_->lkey; }
  uint32_t rkey() const { return mr_->rkey; }
  void* addr() const { return mr_->addr; }
  size_t length() const { return mr_->length; }
  ProtectionDomain& pd() const { return *pd_; }

 private:
  MemoryRegion(std::shared_ptr<ProtectionDomain> pd, ibv_mr* mr) : pd_(std::move(pd)), mr_(mr) {}
  std::shared_ptr<ProtectionDomain> pd_;
  ibv_mr* mr_;
};

// A memory window. Type 2 windows are bound with IBV_WR_BIND_MW through a QP's send queue and
// invalidated with IBV_WR_LOCAL_INV or by the peer's IBV_WR_SEND_WITH_INV.
class MemoryWindow {
 public:
  static absl::StatusOr<std::unique_ptr<MemoryWindow>> Allocate(
      std::shared_ptr<ProtectionDomain> pd, ibv_mw_type type);
  ~MemoryWindow();
  MemoryWindow(const MemoryWindow&) = delete;
  MemoryWindow& operator=(const MemoryWindow&) = delete;

  ibv_mw* get() const { return mw_; }
  // The rkey as the device last set it in ibv_mw (for type 2, posting a bind does not update it:
  // the consumer tracks the key it asked for).
  uint32_t rkey() const { return mw_->rkey; }
  ibv_mw_type type() const { return mw_->type; }
  // DeviceOps::SetWindowDeadline: UNIMPLEMENTED on a device without window leases (its
  // windows are revoked by their owner, at the lease).
  absl::Status SetDeadline(absl::Time deadline);
  // DeviceOps::FreshWindowRkey: the rkey for this type 2 window's next bind, in a fresh random
  // key slot; UNIMPLEMENTED on a device without them (use ibv_inc_rkey's key byte there),
  // RESOURCE_EXHAUSTED if no slot is free.
  absl::StatusOr<uint32_t> FreshRkey();

 private:
  MemoryWindow(std::shared_ptr<ProtectionDomain> pd, ibv_mw* mw) : pd_(std::move(pd)), mw_(mw) {}
  std::shared_ptr<ProtectionDomain> pd_;
  ibv_mw* mw_;
};

class CompletionChannel {
 public:
  static absl::StatusOr<std::shared_ptr<CompletionChannel>> Create(std::shared_ptr<Context> ctx);
  ~CompletionChannel();
  CompletionChannel(const CompletionChannel&) = delete;
  CompletionChannel& operator=(const CompletionChannel&) = delete;

  ibv_comp_channel* get() const { return channel_; }
  int fd() const { return channel_->fd; }

  // Waits up to `timeout` for an event on this channel; returns the CQ that fired, with its
  // event already acknowledged. kDeadlineExceeded if none.
  absl::StatusOr<ibv_cq*> WaitEvent(absl::Duration timeout);

 private:
  CompletionChannel(std::shared_ptr<Context> ctx, ibv_comp_channel* channel)
      : context_(std::move(ctx)), channel_(channel) {}
  std::shared_ptr<Context> context_;
  ibv_comp_channel* channel_;
};

class CompletionQueue {
 public:
  // `min_cqe` entries at least (the device may round up; see capacity()). `channel` is optional.
  static absl::StatusOr<std::shared_ptr<CompletionQueue>> Create(
      std::shared_ptr<Context> ctx, int min_cqe,
      std::shared_ptr<CompletionChannel> channel = nullptr, void* cq_context = nullptr);
  // An extended CQ (ibv_create_cq_ex: start_poll/next_poll/end_poll and the ibv_wc_read_*
  // accessors for attr.wc_flags). attr.channel is ignored in favour of `channel`.
  static absl::StatusOr<std::shared_ptr<CompletionQueue>> CreateEx(
      std::shared_ptr<Context> ctx, ibv_cq_init_attr_ex attr,
      std::shared_ptr<CompletionChannel> channel = nullptr);
  ~CompletionQueue();
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;

  ibv_cq* get() const { return cq_; }
  // The extended CQ, or nullptr for one made by Create. ibv_poll_cq works on both.
  ibv_cq_ex* ex() const { return ex_; }
  int capacity() const { return cq_->cqe; }
  CompletionChannel* channel() const { return channel_.get(); }

  // ibv_resize_cq: at least `cqe` entries, keeping what is queued (INVALID_ARGUMENT if more is
  // queued than `cqe`). capacity() then reports the new size.
  absl::Status Resize(int cqe);

  // Hot path: straight to the device's poll_cq.
  int Poll(int max, ibv_wc* wc) { return ibv_poll_cq(cq_, max, wc); }

  // Arms the CQ: the next completion (solicited only, if asked) raises an event on the channel.
  absl::Status RequestNotify(bool solicited_only = false);

 private:
  CompletionQueue(std::shared_ptr<Context> ctx, std::shared_ptr<CompletionChannel> channel,
                  ibv_cq* cq, ibv_cq_ex* ex = nullptr)
      : context_(std::move(ctx)), channel_(std::move(channel)), cq_(cq), ex_(ex) {}
  std::shared_ptr<Context> context_;
  std::shared_ptr<CompletionChannel> channel_;
  ibv_cq* cq_;
  ibv_cq_ex* ex_;
};

class SharedReceiveQueue {
 public:
  static absl::StatusOr<std::shared_ptr<SharedReceiveQueue>> Create(
      std::shared_ptr<ProtectionDomain> pd, uint32_t max_wr, uint32_t max_sge);
  ~SharedReceiveQueue();
  SharedReceiveQueue(const SharedReceiveQueue&) = delete;
  SharedReceiveQueue& operator=(const SharedReceiveQueue&) = delete;

  ibv_srq* get() const { return srq_; }
  uint32_t max_wr() const { return max_wr_; }

  // ibv_modify_srq with `mask` (IBV_SRQ_MAX_WR, IBV_SRQ_LIMIT) and ibv_query_srq.
  absl::Status Modify(ibv_srq_attr attr, int mask);
  absl::StatusOr<ibv_srq_attr> Query();

 private:
  SharedReceiveQueue(std::shared_ptr<ProtectionDomain> pd, ibv_srq* srq, uint32_t max_wr)
      : pd_(std::move(pd)), srq_(srq), max_wr_(max_wr) {}
  std::shared_ptr<ProtectionDomain> pd_;
  ibv_srq* srq_;
  uint32_t max_wr_;
};

// What one side of an RC connection tells the other (out of band: gRPC in swirl).
struct PeerAddress {
  ibv_gid gid{};        // all zero: route by LID (InfiniBand); otherwise a GRH is used (RoCE)
  uint16_t lid = 0;
  uint32_t qp_num = 0;
  uint32_t psn = 0;     // the peer's starting send PSN = our expected receive PSN
  ibv_mtu mtu = IBV_MTU_1024;
};

struct QueuePairConfig {
  std::shared_ptr<CompletionQueue> send_cq;
  std::shared_ptr<CompletionQueue> recv_cq;
  std::shared_ptr<SharedReceiveQueue> srq;  // optional; then max_recv_wr is ignored
  uint32_t max_send_wr = 128;
  uint32_t max_recv_wr = 128;
  uint32_t max_send_sge = 1;
  uint32_t max_recv_sge = 1;
  uint32_t max_inline_data = 0;
  bool sq_sig_all = false;
  // Non-zero: the QP is made by ibv_create_qp_ex with these IBV_QP_EX_WITH_* operations, for the
  // ibv_wr_* API (QueuePair::ex()).
  uint64_t send_ops_flags = 0;
};

// A GID index that says "pick one" (ConnectOptions, and swirl's ServerOptions/ChannelOptions).
inline constexpr int kAutoGidIndex = -1;

// The GID table entry a RoCE connection uses when the application names none, as rdma_cm
// picks for an IPv4 address: RoCE v2 with an IPv4-mapped GID (::ffff:a.b.c.d), then RoCE v2 with
// a global IPv6 GID, then any RoCE v2 entry; then RoCE v1 in the same order; then any other
// valid entry. Index 0 is often RoCE v1 or link-local, which routed (RoCE v2) fabrics drop.
// Returns the chosen entry's gid_index, or -1 if `entries` has no usable (non-zero) GID.
int ChooseGidIndex(const std::vector<ibv_gid_entry>& entries);

// RC connection parameters with conventional defaults (perftest's and rdma_cm's).
struct ConnectOptions {
  uint8_t port_num = 1;
  int gid_index = kAutoGidIndex;  // or an index into the port's GID table
  int access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                     IBV_ACCESS_REMOTE_ATOMIC;
  uint8_t timeout = 14;        // local ACK timeout: 4.096 us * 2^14 = 67 ms
  uint8_t retry_cnt = 7;
  uint8_t rnr_retry = 7;       // 7 = retry forever
  uint8_t min_rnr_timer = 12;  // 0.64 ms
  uint8_t max_rd_atomic = 16;
  uint8_t max_dest_rd_atomic = 16;
};

class QueuePair {
 public:
  static absl::StatusOr<std::unique_ptr<QueuePair>> Create(std::shared_ptr<ProtectionDomain> pd,
                                                           const QueuePairConfig& config);
  ~QueuePair();
  QueuePair(const QueuePair&) = delete;
  QueuePair& operator=(const QueuePair&) = delete;

  ibv_qp* get() const { return qp_; }
  // libibverbs' ibv_qp_to_qp_ex: the ibv_wr_* interface of a QP made with send_ops_flags, or
  // nullptr.
  ibv_qp_ex* ex() const { return ibv_qp_to_qp_ex(qp_); }
  uint32_t qp_num() const { return qp_->qp_num; }
  // The capabilities the device granted (may exceed what was asked).
  const ibv_qp_cap& cap() const { return cap_; }
  ProtectionDomain& pd() const { return *pd_; }

  // RESET -> INIT.
  absl::Status ToInit(const ConnectOptions& options);
  // INIT -> RTR, toward `peer`.
  absl::Status ToRtr(const PeerAddress& peer, const ConnectOptions& options);
  // RTR -> RTS, sending from `sq_psn`.
  absl::Status ToRts(uint32_t sq_psn, const ConnectOptions& options);
  // The three above in order.
  absl::Status Connect(const PeerAddress& peer, uint32_t sq_psn, const ConnectOptions& options);
  // Any state -> ERR: outstanding work requests flush.
  absl::Status ToError();
  absl::Status ToReset();

  absl::StatusOr<ibv_qp_state> QueryState();

  // DeviceOps::SetLinkKey, before RTR: UNIMPLEMENTED on a device without link keys (a caller
  // that runs on NICs too takes that as "not supported", not as an error).
  absl::Status SetLinkKey(absl::Span<const uint8_t> key);

  // Our half of the address exchange for `options.port_num`/`gid_index`. An automatic index is
  // resolved here once and kept: ToRtr sends from the entry whose GID was advertised, even if
  // the table changed in between.
  absl::StatusOr<PeerAddress> LocalAddress(uint32_t sq_psn, const ConnectOptions& options);

 private:
  QueuePair(std::shared_ptr<ProtectionDomain> pd, const QueuePairConfig& config, ibv_qp* qp,
            const ibv_qp_cap& cap)
      : pd_(std::move(pd)),
        send_cq_(config.send_cq),
        recv_cq_(config.recv_cq),
        srq_(config.srq),
        qp_(qp),
        cap_(cap) {}
  absl::Status Modify(ibv_qp_attr& attr, int mask, const char* what);
  // The GID table entry for `options`: the one LocalAddress chose, if it did for this port.
  absl::StatusOr<int> GidIndexFor(const ConnectOptions& options);

  std::shared_ptr<ProtectionDomain> pd_;
  std::shared_ptr<CompletionQueue> send_cq_;
  std::shared_ptr<CompletionQueue> recv_cq_;
  std::shared_ptr<SharedReceiveQueue> srq_;
  ibv_qp* qp_;
  ibv_qp_cap cap_;
  int advertised_gid_index_ = -1;  // set by LocalAddress
  uint8_t advertised_port_ = 0;
};

}  // namespace swirl::verbs

#endif  // SWIRL_TRANSPORT_VERBS_VERBS_H_
