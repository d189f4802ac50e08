// The control path of one opened RDMA device, as an interface.
//
// Why an interface: libibverbs' inline data-path calls (ibv_post_send, ibv_post_recv,
// ibv_post_srq_recv, ibv_poll_cq, ibv_req_notify_cq, ibv_alloc_mw, ibv_dealloc_mw, ibv_bind_mw,
// ibv_query_device_ex, ibv_query_port, ibv_create_cq_ex and ibv_create_qp_ex, and the functions
// the objects those two return carry: ibv_start_poll, ibv_wr_*) dispatch through
// `context->ops`, the verbs_context or the object itself, so they run unchanged on any device
// that fills those tables, including swirl's userspace soft device. The control-path calls
// (ibv_alloc_pd, ibv_reg_mr, ibv_create_qp, ibv_rereg_mr, ...) live inside libibverbs.so and
// dispatch through its private provider table, which only rdma-core's own providers can fill.
// swirl therefore routes every control-path call through DeviceOps: one implementation forwards
// to libibverbs (rdma_core_device.h), another is the soft device.
//
// Conventions: every method returns 0 or a positive errno value (never -1), and fills its out
// parameter only on success. Objects returned are ordinary libibverbs structures; their
// `context` field points at context(). The RAII owners in verbs.h are the normal way to use this.

#ifndef SWIRL_TRANSPORT_VERBS_DEVICE_OPS_H_
#define SWIRL_TRANSPORT_VERBS_DEVICE_OPS_H_

#include <infiniband/verbs.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace swirl::verbs {

enum class DeviceKind {
  kRdmaCore,  // a device driven by an rdma-core provider (mlx5, rxe, ...; not iWARP)
  kSoft,      // swirl's userspace soft device (transport/soft)
};

const char* DeviceKindName(DeviceKind kind);

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;

  virtual DeviceKind kind() const = 0;
  virtual const std::string& name() const = 0;
  virtual ibv_context* context() = 0;

  virtual int QueryDevice(ibv_device_attr_ex* attr) = 0;
  virtual int QueryPort(uint8_t port_num, ibv_port_attr* attr) = 0;
  virtual int QueryGid(uint8_t port_num, int index, ibv_gid* gid) = 0;
  // The valid entries of port `port_num`'s GID table, with their types (RoCE v1/v2, IB).
  virtual int QueryGidTable(uint8_t port_num, std::vector<ibv_gid_entry>* entries) = 0;
  // ibv_query_pkey: entry `index` of the port's P_Key table, in network order.
  virtual int QueryPkey(uint8_t port_num, int index, uint16_t* pkey) = 0;

  virtual int AllocPd(ibv_pd** pd) = 0;
  virtual int DeallocPd(ibv_pd* pd) = 0;

  virtual int RegMr(ibv_pd* pd, void* addr, size_t length, int access, ibv_mr** mr) = 0;
  virtual int DeregMr(ibv_mr* mr) = 0;
  // ibv_rereg_mr with IBV_REREG_MR_CHANGE_* `flags`; on success `mr` (pd, addr, length, keys)
  // describes the new registration. EBUSY while memory windows are bound over it.
  virtual int ReregMr(ibv_mr* mr, int flags, ibv_pd* pd, void* addr, size_t length,
                      int access) = 0;

  virtual int CreateCompChannel(ibv_comp_channel** channel) = 0;
  virtual int DestroyCompChannel(ibv_comp_channel* channel) = 0;
  virtual int CreateCq(int min_cqe, void* cq_context, ibv_comp_channel* channel, int comp_vector,
                       ibv_cq** cq) = 0;
  virtual int DestroyCq(ibv_cq* cq) = 0;
  // ibv_resize_cq: at least `cqe` entries (cq->cqe then reports the size), keeping what is
  // queued; EINVAL if more than `cqe` completions are queued.
  virtual int ResizeCq(ibv_cq* cq, int cqe) = 0;
  // Blocks (unless channel->fd is non-blocking) until a CQ armed with ibv_req_notify_cq on this
  // channel has a new completion. Returns EAGAIN for a non-blocking fd with nothing pending.
  virtual int GetCqEvent(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) = 0;
  virtual void AckCqEvents(ibv_cq* cq, unsigned int count) = 0;

  virtual int CreateSrq(ibv_pd* pd, ibv_srq_init_attr* attr, ibv_srq** srq) = 0;
  virtual int DestroySrq(ibv_srq* srq) = 0;
  // ibv_modify_srq (IBV_SRQ_MAX_WR, IBV_SRQ_LIMIT) and ibv_query_srq.
  virtual int ModifySrq(ibv_srq* srq, ibv_srq_attr* attr, int attr_mask) = 0;
  virtual int QuerySrq(ibv_srq* srq, ibv_srq_attr* attr) = 0;

  virtual int CreateQp(ibv_pd* pd, ibv_qp_init_attr* attr, ibv_qp** qp) = 0;
  virtual int ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) = 0;
  virtual int QueryQp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask,
                      ibv_qp_init_attr* init_attr) = 0;
  virtual int DestroyQp(ibv_qp* qp) = 0;

  // Asynchronous events (port changes, CQ overflow, QP errors). Never blocks: EAGAIN when none
  // is queued; poll context()->async_fd to wait (both devices open it non-blocking).
  virtual int GetAsyncEvent(ibv_async_event* event) = 0;
  virtual void AckAsyncEvent(ibv_async_event* event) = 0;

  // Whether a QP of this device using GID `local` could link to a peer QP at GID `remote` (of
  // a device of the same kind), as far as the device can tell without trying: 0 if it can, or
  // if the device cannot tell (a NIC leaves that to the network, which is why this is the
  // default); else EHOSTUNREACH, with *why saying what differs (for the peer's error message).
  // The soft device cannot link its shared-memory fabric to its TCP fabric.
  virtual int CheckReachable(const ibv_gid& /*local*/, const ibv_gid& /*remote*/,
                             std::string* /*why*/) {
    return 0;
  }

  // Beyond RoCE (the soft device's SetLinkKey, transport/soft/soft_device.h): binds `qp`'s link
  // to whoever knows `key` (`length` bytes, the same on both QPs of the pair, handed over by
  // the control plane), set before RTR. EOPNOTSUPP on a device that has no such thing, which is
  // the default: a NIC's RC link is as RoCE makes it. An empty key removes one (and so tells,
  // on a fresh QP, whether the device takes keys at all).
  virtual int SetLinkKey(ibv_qp* /*qp*/, const uint8_t* /*key*/, size_t /*length*/) {
    return EOPNOTSUPP;
  }

  // Beyond RoCE (the soft device's SetWindowDeadline): from `deadline` on, the responder itself
  // refuses every remote access through window `mw`, whatever its owner still has to do to
  // revoke it (absl::InfiniteFuture(): none). It belongs to the window and holds for its next
  // binds until changed. EOPNOTSUPP on a device without it, the default: a NIC's window is valid
  // until invalidated, so its owner must revoke it at the lease itself.
  virtual int SetWindowDeadline(ibv_mw* /*mw*/, absl::Time /*deadline*/) { return EOPNOTSUPP; }
  // Beyond RoCE (the soft device's FreshWindowRkey): in *rkey, the rkey for type 2 window `mw`'s
  // next bind, in a key slot drawn at random and reserved for it (about 31 random bits per bind,
  // where ibv_inc_rkey varies the 8 of the key byte). EOPNOTSUPP on a device without it, the
  // default (ibv_inc_rkey's key byte there); ENOSPC if no slot is free.
  virtual int FreshWindowRkey(ibv_mw* /*mw*/, uint32_t* /*rkey*/) { return EOPNOTSUPP; }

  // The IPv4 address a QP of this device linking to a peer at `gid` sends to, dotted, in
  // *address: what a control plane compares with the address the peer itself called from, so
  // that no peer makes this side connect to a third host. ENOENT if the GID names no such
  // address (a fabric within this host, InfiniBand's LID routing). The default reads a RoCE v2
  // IPv4-mapped GID (::ffff:a.b.c.d); the soft device its TCP fabric's GIDs.
  virtual int GidAddress(const ibv_gid& gid, std::string* address) {
    static constexpr uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    for (int i = 0; i < 12; ++i) {
      if (gid.raw[i] != kMapped[i]) return ENOENT;
    }
    *address = std::to_string(gid.raw[12]) + "." + std::to_string(gid.raw[13]) + "." +
               std::to_string(gid.raw[14]) + "." + std::to_string(gid.raw[15]);
    return 0;
  }
};

}  // namespace swirl::verbs

#endif  // SWIRL_TRANSPORT_VERBS_DEVICE_OPS_H_
