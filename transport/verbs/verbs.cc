#include "transport/verbs/verbs.h"

#include <endian.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "transport/verbs/status.h"

namespace swirl::verbs {
namespace {

// poll(2) on `fd` for readability; returns 0 when readable, ETIMEDOUT, or an errno.
int WaitReadable(int fd, absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms < 0) ms = 0;
    pollfd pfd{fd, POLLIN, 0};
    int n = ::poll(&pfd, 1, static_cast<int>(ms));
    if (n > 0) return 0;
    if (n == 0) return ETIMEDOUT;
    if (errno != EINTR) return errno;
  }
}

}  // namespace

// ---- Context ----------------------------------------------------------------------------------

std::shared_ptr<Context> Context::Wrap(std::unique_ptr<DeviceOps> ops) {
  return std::shared_ptr<Context>(new Context(std::move(ops)));
}

Context::~Context() = default;  // ~DeviceOps closes the device.

absl::StatusOr<ibv_device_attr_ex> Context::QueryDevice() {
  ibv_device_attr_ex attr;
  std::memset(&attr, 0, sizeof(attr));
  if (int err = ops_->QueryDevice(&attr); err != 0) return VerbsError("ibv_query_device_ex", err);
  return attr;
}

absl::StatusOr<ibv_port_attr> Context::QueryPort(uint8_t port_num) {
  ibv_port_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  if (int err = ops_->QueryPort(port_num, &attr); err != 0) {
    return VerbsError("ibv_query_port", absl::StrCat("port ", port_num), err);
  }
  return attr;
}

absl::StatusOr<ibv_gid> Context::QueryGid(uint8_t port_num, int index) {
  ibv_gid gid;
  std::memset(&gid, 0, sizeof(gid));
  if (int err = ops_->QueryGid(port_num, index, &gid); err != 0) {
    return VerbsError("ibv_query_gid", absl::StrCat("port ", port_num, " index ", index), err);
  }
  return gid;
}

absl::StatusOr<uint16_t> Context::QueryPkey(uint8_t port_num, int index) {
  uint16_t pkey = 0;
  if (int err = ops_->QueryPkey(port_num, index, &pkey); err != 0) {
    return VerbsError("ibv_query_pkey", absl::StrCat("port ", port_num, " index ", index), err);
  }
  return be16toh(pkey);
}

int ChooseGidIndex(const std::vector<ibv_gid_entry>& entries) {
  static const ibv_gid kZero{};
  auto rank = [](const ibv_gid_entry& e) {
    const uint8_t* g = e.gid.raw;
    static const uint8_t kMappedPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    const bool ipv4 = std::memcmp(g, kMappedPrefix, sizeof(kMappedPrefix)) == 0;
    const bool link_local = g[0] == 0xfe && (g[1] & 0xc0) == 0x80;
    const int address = ipv4 ? 0 : link_local ? 2 : 1;
    const int type = e.gid_type == IBV_GID_TYPE_ROCE_V2   ? 0
                     : e.gid_type == IBV_GID_TYPE_ROCE_V1 ? 1
                                                          : 2;
    return type * 3 + address;  // lower is better
  };
  int best = -1, best_rank = 0;
  for (const ibv_gid_entry& e : entries) {
    if (std::memcmp(&e.gid, &kZero, sizeof(kZero)) == 0) continue;
    const int r = rank(e);
    if (best < 0 || r < best_rank) {
      best = static_cast<int>(e.gid_index);
      best_rank = r;
    }
  }
  return best;
}

absl::StatusOr<int> Context::ResolveGidIndex(uint8_t port_num, int requested) {
  if (requested > 255 || requested < kAutoGidIndex) {
    return absl::InvalidArgumentError(absl::StrCat("GID index ", requested, " out of range"));
  }
  if (requested >= 0) return requested;
  absl::StatusOr<ibv_port_attr> port = QueryPort(port_num);
  if (!port.ok()) return port.status();
  if (port->link_layer != IBV_LINK_LAYER_ETHERNET) return 0;
  std::vector<ibv_gid_entry> entries;
  if (int err = ops_->QueryGidTable(port_num, &entries); err != 0) {
    return VerbsError("ibv_query_gid_table", absl::StrCat("port ", port_num), err);
  }
  const int chosen = ChooseGidIndex(entries);
  if (chosen < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        name(), " port ", port_num, ": no usable GID (is an IP address configured on it?)"));
  }
  return chosen;
}

absl::StatusOr<std::string> Context::GidAddress(const ibv_gid& gid) {
  std::string address;
  if (int err = ops_->GidAddress(gid, &address); err != 0) {
    if (err == ENOENT) return absl::NotFoundError("the GID names no IPv4 address");
    return VerbsError("gid address", err);
  }
  return address;
}

absl::Status Context::CheckReachable(const ibv_gid& local, const ibv_gid& remote) {
  std::string why;
  if (ops_->CheckReachable(local, remote, &why) == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(why.empty() ? absl::StrCat(name(), " cannot reach the peer")
                                                   : why);
}

absl::StatusOr<ibv_event_type> Context::WaitAsyncEvent(absl::Duration timeout) {
  absl::StatusOr<ibv_async_event> event = NextAsyncEvent(timeout);
  if (!event.ok()) return event.status();
  return event->event_type;
}

absl::StatusOr<ibv_async_event> Context::NextAsyncEvent(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    if (int err = WaitReadable(get()->async_fd, std::max(deadline - absl::Now(),
                                                         absl::ZeroDuration()));
        err != 0) {
      if (err == ETIMEDOUT) return absl::DeadlineExceededError("no asynchronous event");
      return VerbsError("poll(async_fd)", err);
    }
    ibv_async_event event;
    const int err = ops_->GetAsyncEvent(&event);
    // EAGAIN: readable, but another reader took the event (or it went with its object).
    if (err == EAGAIN) {
      if (absl::Now() >= deadline) return absl::DeadlineExceededError("no asynchronous event");
      continue;
    }
    if (err != 0) return VerbsError("ibv_get_async_event", err);
    ibv_async_event copy = event;
    ops_->AckAsyncEvent(&event);
    return copy;
  }
}

// ---- ProtectionDomain -------------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<ProtectionDomain>> ProtectionDomain::Create(
    std::shared_ptr<Context> ctx) {
  ibv_pd* pd = nullptr;
  if (int err = ctx->ops().AllocPd(&pd); err != 0) return VerbsError("ibv_alloc_pd", err);
  return std::shared_ptr<ProtectionDomain>(new ProtectionDomain(std::move(ctx), pd));
}

ProtectionDomain::~ProtectionDomain() {
  if (int err = context_->ops().DeallocPd(pd_); err != 0) {
    SWIRL_LOG(ERROR, "%s", VerbsError("ibv_dealloc_pd", err).ToString());
  }
}

// ---- MemoryRegion -----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<MemoryRegion>> MemoryRegion::Register(
    std::shared_ptr<ProtectionDomain> pd, void* addr, size_t length, int access) {
  ibv_mr* mr = nullptr;
  if (int err = pd->context().ops().RegMr(pd->get(), addr, length, access, &mr); err != 0) {
    return VerbsError("ibv_reg_mr", absl::StrCat(length, " bytes"), err);
  }
  return std::unique_ptr<MemoryRegion>(new MemoryRegion(std::move(pd), mr));
}

absl::Status MemoryRegion::Deregister() {
  if (mr_ == nullptr) return absl::OkStatus();
  if (int err = pd_->context().ops().DeregMr(mr_); err != 0) {
    return VerbsError("ibv_dereg_mr", err);
  }
  mr_ = nullptr;
  return absl::OkStatus();
}

absl::Status MemoryRegion::Reregister(int flags, std::shared_ptr<ProtectionDomain> pd,
                                      void* addr, size_t length, int access) {
  ibv_pd* new_pd = (flags & IBV_REREG_MR_CHANGE_PD) && pd ? pd->get() : nullptr;
  if (int err = pd_->context().ops().ReregMr(mr_, flags, new_pd, addr, length, access);
      err != 0) {
    return VerbsError("ibv_rereg_mr", absl::StrCat("flags 0x", absl::Hex(flags)), err);
  }
  if (flags & IBV_REREG_MR_CHANGE_PD) pd_ = std::move(pd);
  return absl::OkStatus();
}

MemoryRegion::~MemoryRegion() {
  if (absl::Status s = Deregister(); !s.ok()) {
    SWIRL_LOG(ERROR, "%s (memory region leaked)", s.ToString());
  }
}

// ---- MemoryWindow -----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<MemoryWindow>> MemoryWindow::Allocate(
    std::shared_ptr<ProtectionDomain> pd, ibv_mw_type type) {
  errno = 0;
  ibv_mw* mw = ibv_alloc_mw(pd->get(), type);
  if (mw == nullptr) {
    return VerbsError("ibv_alloc_mw", type == IBV_MW_TYPE_1 ? "type 1" : "type 2",
                      errno != 0 ? errno : EOPNOTSUPP);
  }
  return std::unique_ptr<MemoryWindow>(new MemoryWindow(std::move(pd), mw));
}

absl::Status MemoryWindow::SetDeadline(absl::Time deadline) {
  const int err = pd_->context().ops().SetWindowDeadline(mw_, deadline);
  if (err == EOPNOTSUPP) {
    return absl::UnimplementedError(
        absl::StrCat("device ", pd_->context().name(), " keeps no window leases"));
  }
  if (err != 0) return VerbsError("set window deadline", err);
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> MemoryWindow::FreshRkey() {
  uint32_t rkey = 0;
  const int err = pd_->context().ops().FreshWindowRkey(mw_, &rkey);
  if (err == EOPNOTSUPP) {
    return absl::UnimplementedError(
        absl::StrCat("device ", pd_->context().name(), " draws no fresh window slots"));
  }
  if (err == ENOSPC) return absl::ResourceExhaustedError("no free memory key slot");
  if (err != 0) return VerbsError("fresh window rkey", err);
  return rkey;
}

MemoryWindow::~MemoryWindow() {
  if (int err = ibv_dealloc_mw(mw_); err != 0) {
    SWIRL_LOG(ERROR, "%s", VerbsError("ibv_dealloc_mw", err).ToString());
  }
}

// ---- CompletionChannel ------------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<CompletionChannel>> CompletionChannel::Create(
    std::shared_ptr<Context> ctx) {
  ibv_comp_channel* channel = nullptr;
  if (int err = ctx->ops().CreateCompChannel(&channel); err != 0) {
    return VerbsError("ibv_create_comp_channel", err);
  }
  return std::shared_ptr<CompletionChannel>(new CompletionChannel(std::move(ctx), channel));
}

CompletionChannel::~CompletionChannel() {
  if (int err = context_->ops().DestroyCompChannel(channel_); err != 0) {
    SWIRL_LOG(ERROR, "%s", VerbsError("ibv_destroy_comp_channel", err).ToString());
  }
}

absl::StatusOr<ibv_cq*> CompletionChannel::WaitEvent(absl::Duration timeout) {
  if (int err = WaitReadable(channel_->fd, timeout); err != 0) {
    if (err == ETIMEDOUT) return absl::DeadlineExceededError("no completion event");
    return VerbsError("poll(comp_channel)", err);
  }
  ibv_cq* cq = nullptr;
  void* cq_context = nullptr;
  if (int err = context_->ops().GetCqEvent(channel_, &cq, &cq_context); err != 0) {
    return VerbsError("ibv_get_cq_event", err);
  }
  context_->ops().AckCqEvents(cq, 1);
  return cq;
}

// ---- CompletionQueue --------------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<CompletionQueue>> CompletionQueue::Create(
    std::shared_ptr<Context> ctx, int min_cqe, std::shared_ptr<CompletionChannel> channel,
    void* cq_context) {
  ibv_cq* cq = nullptr;
  if (int err = ctx->ops().CreateCq(min_cqe, cq_context, channel ? channel->get() : nullptr, 0, &cq);
      err != 0) {
    return VerbsError("ibv_create_cq", absl::StrCat(min_cqe, " entries"), err);
  }
  return std::shared_ptr<CompletionQueue>(
      new CompletionQueue(std::move(ctx), std::move(channel), cq));
}

absl::StatusOr<std::shared_ptr<CompletionQueue>> CompletionQueue::CreateEx(
    std::shared_ptr<Context> ctx, ibv_cq_init_attr_ex attr,
    std::shared_ptr<CompletionChannel> channel) {
  attr.channel = channel ? channel->get() : nullptr;
  // Inline in libibverbs: it dispatches through the context's verbs_context on every device.
  errno = 0;
  ibv_cq_ex* ex = ibv_create_cq_ex(ctx->get(), &attr);
  if (ex == nullptr) {
    return VerbsError("ibv_create_cq_ex", absl::StrCat(attr.cqe, " entries"),
                      errno != 0 ? errno : EOPNOTSUPP);
  }
  return std::shared_ptr<CompletionQueue>(
      new CompletionQueue(std::move(ctx), std::move(channel), ibv_cq_ex_to_cq(ex), ex));
}

CompletionQueue::~CompletionQueue() {
  if (int err = context_->ops().DestroyCq(cq_); err != 0) {
    SWIRL_LOG(ERROR, "%s", VerbsError("ibv_destroy_cq", err).ToString());
  }
}

absl::Status CompletionQueue::Resize(int cqe) {
  if (int err = context_->ops().ResizeCq(cq_, cqe); err != 0) {
    return VerbsError("ibv_resize_cq", absl::StrCat(cqe, " entries"), err);
  }
  return absl::OkStatus();
}

absl::Status CompletionQueue::RequestNotify(bool solicited_only) {
  if (int err = ibv_req_notify_cq(cq_, solicited_only ? 1 : 0); err != 0) {
    return VerbsError("ibv_req_notify_cq", err);
  }
  return absl::OkStatus();
}

// ---- SharedReceiveQueue -----------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<SharedReceiveQueue>> SharedReceiveQueue::Create(
    std::shared_ptr<ProtectionDomain> pd, uint32_t max_wr, uint32_t max_sge) {
  ibv_srq_init_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.attr.max_wr = max_wr;
  attr.attr.max_sge = max_sge;
  ibv_srq* srq = nullptr;
  if (int err = pd->context().ops().CreateSrq(pd->get(), &attr, &srq); err != 0) {
    return VerbsError("ibv_create_srq", absl::StrCat(max_wr, " entries"), err);
  }
  return std::shared_ptr<SharedReceiveQueue>(
      new SharedReceiveQueue(std::move(pd), srq, attr.attr.max_wr));
}

absl::Status SharedReceiveQueue::Modify(ibv_srq_attr attr, int mask) {
  if (int err = pd_->context().ops().ModifySrq(srq_, &attr, mask); err != 0) {
    return VerbsError("ibv_modify_srq", absl::StrCat("mask 0x", absl::Hex(mask)), err);
  }
  if (mask & IBV_SRQ_MAX_WR) max_wr_ = attr.max_wr;
  return absl::OkStatus();
}

absl::StatusOr<ibv_srq_attr> SharedReceiveQueue::Query() {
  ibv_srq_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  if (int err = pd_->context().ops().QuerySrq(srq_, &attr); err != 0) {
    return VerbsError("ibv_query_srq", err);
  }
  return attr;
}

SharedReceiveQueue::~SharedReceiveQueue() {
  if (int err = pd_->context().ops().DestroySrq(srq_); err != 0) {
    SWIRL_LOG(ERROR, "%s", VerbsError("ibv_destroy_srq", err).ToString());
  }
}

// ---- QueuePair --------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<QueuePair>> QueuePair::Create(std::shared_ptr<ProtectionDomain> pd,
                                                             const QueuePairConfig& config) {
  if (!config.send_cq || !config.recv_cq) {
    return absl::InvalidArgumentError("QueuePair::Create: send_cq and recv_cq are required");
  }
  ibv_qp_init_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.qp_type = IBV_QPT_RC;
  attr.send_cq = config.send_cq->get();
  attr.recv_cq = config.recv_cq->get();
  attr.srq = config.srq ? config.srq->get() : nullptr;
  attr.cap.max_send_wr = config.max_send_wr;
  attr.cap.max_recv_wr = config.srq ? 0 : config.max_recv_wr;
  attr.cap.max_send_sge = config.max_send_sge;
  attr.cap.max_recv_sge = config.srq ? 0 : config.max_recv_sge;
  attr.cap.max_inline_data = config.max_inline_data;
  attr.sq_sig_all = config.sq_sig_all ? 1 : 0;
  ibv_qp* qp = nullptr;
  if (config.send_ops_flags != 0) {
    ibv_qp_init_attr_ex ex;
    std::memset(&ex, 0, sizeof(ex));
    ex.send_cq = attr.send_cq;
    ex.recv_cq = attr.recv_cq;
    ex.srq = attr.srq;
    ex.cap = attr.cap;
    ex.qp_type = attr.qp_type;
    ex.sq_sig_all = attr.sq_sig_all;
    ex.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    ex.pd = pd->get();
    ex.send_ops_flags = config.send_ops_flags;
    // Inline in libibverbs, dispatching through the verbs_context on every device.
    errno = 0;
    qp = ibv_create_qp_ex(pd->context().get(), &ex);
    if (qp == nullptr) {
      return VerbsError("ibv_create_qp_ex",
                        absl::StrCat("RC, send_ops_flags 0x", absl::Hex(config.send_ops_flags)),
                        errno != 0 ? errno : EOPNOTSUPP);
    }
    attr.cap = ex.cap;
  } else if (int err = pd->context().ops().CreateQp(pd->get(), &attr, &qp); err != 0) {
    return VerbsError("ibv_create_qp",
                      absl::StrCat("RC, ", config.max_send_wr, " send WRs, inline ",
                                   config.max_inline_data),
                      err);
  }
  return std::unique_ptr<QueuePair>(new QueuePair(std::move(pd), config, qp, attr.cap));
}

QueuePair::~QueuePair() {
  if (int err = pd_->context().ops().DestroyQp(qp_); err != 0) {
    SWIRL_LOG(ERROR, "%s", VerbsError("ibv_destroy_qp", err).ToString());
  }
}

absl::Status QueuePair::Modify(ibv_qp_attr& attr, int mask, const char* what) {
  if (int err = pd_->context().ops().ModifyQp(qp_, &attr, mask); err != 0) {
    return VerbsError("ibv_modify_qp", what, err);
  }
  return absl::OkStatus();
}

absl::Status QueuePair::ToInit(const ConnectOptions& options) {
  ibv_qp_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = options.port_num;
  attr.qp_access_flags = options.access_flags;
  return Modify(attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
                "INIT");
}

absl::Status QueuePair::SetLinkKey(absl::Span<const uint8_t> key) {
  const int err = pd_->context().ops().SetLinkKey(qp_, key.data(), key.size());
  if (err == EOPNOTSUPP) {
    return absl::UnimplementedError(
        absl::StrCat("device ", pd_->context().name(), " takes no link keys"));
  }
  if (err != 0) return VerbsError("set link key", err);
  return absl::OkStatus();
}

absl::Status QueuePair::ToRtr(const PeerAddress& peer, const ConnectOptions& options) {
  // Both ends must use one path MTU (a responder checks every packet against its own): the
  // smaller of the two ports'. And no more READ/atomic responder resources than the device has
  // (providers reject the modify otherwise).
  absl::StatusOr<ibv_port_attr> port = pd_->context().QueryPort(options.port_num);
  if (!port.ok()) return port.status();
  absl::StatusOr<ibv_device_attr_ex> device = pd_->context().QueryDevice();
  if (!device.ok()) return device.status();
  ibv_qp_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = std::min(peer.mtu, port->active_mtu);
  attr.dest_qp_num = peer.qp_num;
  attr.rq_psn = peer.psn;
  attr.max_dest_rd_atomic = static_cast<uint8_t>(std::min<int>(
      options.max_dest_rd_atomic, std::max(1, device->orig_attr.max_qp_rd_atom)));
  attr.min_rnr_timer = options.min_rnr_timer;
  attr.ah_attr.dlid = peer.lid;
  attr.ah_attr.port_num = options.port_num;
  static const ibv_gid kZeroGid{};
  if (std::memcmp(&peer.gid, &kZeroGid, sizeof(ibv_gid)) != 0) {
    attr.ah_attr.is_global = 1;
    attr.ah_attr.grh.dgid = peer.gid;
    absl::StatusOr<int> gid_index = GidIndexFor(options);
    if (!gid_index.ok()) return gid_index.status();
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(*gid_index);
    attr.ah_attr.grh.hop_limit = 64;
  }
  return Modify(attr,
                IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                    IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
                "RTR");
}

absl::Status QueuePair::ToRts(uint32_t sq_psn, const ConnectOptions& options) {
  ibv_qp_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.qp_state = IBV_QPS_RTS;
  attr.sq_psn = sq_psn;
  attr.timeout = options.timeout;
  attr.retry_cnt = options.retry_cnt;
  attr.rnr_retry = options.rnr_retry;
  absl::StatusOr<ibv_device_attr_ex> device = pd_->context().QueryDevice();
  if (!device.ok()) return device.status();
  attr.max_rd_atomic = static_cast<uint8_t>(std::min<int>(
      options.max_rd_atomic, std::max(1, device->orig_attr.max_qp_init_rd_atom)));
  return Modify(attr,
                IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                    IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC,
                "RTS");
}

absl::Status QueuePair::Connect(const PeerAddress& peer, uint32_t sq_psn,
                                const ConnectOptions& options) {
  if (absl::Status s = ToInit(options); !s.ok()) return s;
  if (absl::Status s = ToRtr(peer, options); !s.ok()) return s;
  return ToRts(sq_psn, options);
}

absl::Status QueuePair::ToError() {
  ibv_qp_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.qp_state = IBV_QPS_ERR;
  return Modify(attr, IBV_QP_STATE, "ERR");
}

absl::Status QueuePair::ToReset() {
  ibv_qp_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.qp_state = IBV_QPS_RESET;
  return Modify(attr, IBV_QP_STATE, "RESET");
}

absl::StatusOr<ibv_qp_state> QueuePair::QueryState() {
  ibv_qp_attr attr;
  ibv_qp_init_attr init;
  std::memset(&attr, 0, sizeof(attr));
  std::memset(&init, 0, sizeof(init));
  if (int err = pd_->context().ops().QueryQp(qp_, &attr, IBV_QP_STATE, &init); err != 0) {
    return VerbsError("ibv_query_qp", err);
  }
  return attr.qp_state;
}

absl::StatusOr<int> QueuePair::GidIndexFor(const ConnectOptions& options) {
  if (options.gid_index == kAutoGidIndex && advertised_gid_index_ >= 0 &&
      advertised_port_ == options.port_num) {
    return advertised_gid_index_;
  }
  return pd_->context().ResolveGidIndex(options.port_num, options.gid_index);
}

absl::StatusOr<PeerAddress> QueuePair::LocalAddress(uint32_t sq_psn,
                                                    const ConnectOptions& options) {
  Context& ctx = pd_->context();
  absl::StatusOr<ibv_port_attr> port = ctx.QueryPort(options.port_num);
  if (!port.ok()) return port.status();
  PeerAddress address;
  address.lid = port->lid;
  address.qp_num = qp_->qp_num;
  address.psn = sq_psn;
  address.mtu = port->active_mtu;
  if (port->link_layer == IBV_LINK_LAYER_ETHERNET || port->lid == 0) {
    absl::StatusOr<int> gid_index = ctx.ResolveGidIndex(options.port_num, options.gid_index);
    if (!gid_index.ok()) return gid_index.status();
    absl::StatusOr<ibv_gid> gid = ctx.QueryGid(options.port_num, *gid_index);
    if (!gid.ok()) return gid.status();
    // libibverbs reads an empty entry of the table as zeros, successfully: a peer would then
    // be given a GID nothing answers to, and the connection would fail far from its cause.
    static const ibv_gid kZeroGid{};
    if (std::memcmp(gid->raw, kZeroGid.raw, sizeof(kZeroGid.raw)) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(ctx.name(), " port ", options.port_num,
                                                        ": GID index ", *gid_index,
                                                        " is empty"));
    }
    advertised_gid_index_ = *gid_index;
    advertised_port_ = options.port_num;
    address.gid = *gid;
  }
  return address;
}

}  // namespace swirl::verbs
