// The soft device's DeviceOps and its libibverbs dispatch tables.

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/ascii.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "transport/soft/fabric.h"
#include "transport/soft/qp_ops.h"
#include "transport/soft/soft_device.h"

namespace swirl::soft {
namespace {

// ---- Table entries (C calling convention, reached through ibv_context) ------------------------

ibv_mw* OpAllocMw(ibv_pd* pd, ibv_mw_type type) { return AllocMw(pd, type); }
int OpDeallocMw(ibv_mw* mw) { return DeallocMw(mw); }
int OpBindMw(ibv_qp* qp, ibv_mw* mw, ibv_mw_bind* bind) { return BindMw(qp, mw, bind); }
int OpPollCq(ibv_cq* cq, int n, ibv_wc* wc) { return PollCq(cq, n, wc); }
int OpReqNotifyCq(ibv_cq* cq, int solicited_only) { return ReqNotifyCq(cq, solicited_only); }
int OpPostSend(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) { return PostSend(qp, wr, bad); }
int OpPostRecv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) { return PostRecv(qp, wr, bad); }
int OpPostSrqRecv(ibv_srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  return PostSrqRecv(srq, wr, bad);
}

void FillDeviceAttr(const Hca* hca, ibv_device_attr_ex* attr) {
  std::memset(attr, 0, sizeof(*attr));
  ibv_device_attr& a = attr->orig_attr;
  std::snprintf(a.fw_ver, sizeof(a.fw_ver), "swirl-soft %u", wire::kWireVersion);
  a.node_guid = hca->guid;
  a.sys_image_guid = hca->guid;
  a.max_mr_size = kMaxMrSize;
  a.page_size_cap = 4096;
  a.vendor_id = kSoftVendorId;
  a.vendor_part_id = kSoftVendorPartId;
  a.hw_ver = 1;
  a.max_qp = kMaxQp;
  a.max_qp_wr = kMaxQpWr;
  a.device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN | IBV_DEVICE_CURR_QP_STATE_MOD |
                       IBV_DEVICE_SYS_IMAGE_GUID | IBV_DEVICE_MEM_WINDOW |
                       IBV_DEVICE_MEM_MGT_EXTENSIONS | IBV_DEVICE_MEM_WINDOW_TYPE_2B |
                       IBV_DEVICE_SRQ_RESIZE;
  a.max_sge = kMaxSge;
  a.max_sge_rd = kMaxSge;
  a.max_cq = kMaxCq;
  a.max_cqe = kMaxCqe;
  a.max_mr = kMaxMr;
  a.max_pd = kMaxPd;
  a.max_qp_rd_atom = kMaxRdAtomic;
  a.max_ee_rd_atom = 0;
  a.max_res_rd_atom = kMaxRdAtomic * 1024;
  a.max_qp_init_rd_atom = kMaxRdAtomic;
  a.max_ee_init_rd_atom = 0;
  a.atomic_cap = IBV_ATOMIC_HCA;
  a.max_mw = kMaxMw;
  a.max_srq = kMaxSrq;
  a.max_srq_wr = kMaxSrqWr;
  a.max_srq_sge = kMaxSge;
  a.max_pkeys = 1;
  a.local_ca_ack_delay = 0;
  a.phys_port_cnt = 1;
  attr->device_cap_flags_ex = a.device_cap_flags;
  attr->phys_port_cnt_ex = a.phys_port_cnt;
}

void FillPortAttr(ibv_port_attr* attr) {
  std::memset(attr, 0, sizeof(*attr));
  attr->state = IBV_PORT_ACTIVE;
  attr->max_mtu = IBV_MTU_4096;
  attr->active_mtu = IBV_MTU_4096;
  attr->gid_tbl_len = 1;
  attr->max_msg_sz = static_cast<uint32_t>(kMaxMsgSize);
  attr->pkey_tbl_len = 1;
  attr->lid = 0;  // RoCE: routed by GID
  attr->max_vl_num = 1;
  attr->active_width = 2;   // 4x
  attr->active_speed = 32;  // EDR
  attr->phys_state = 5;     // LinkUp
  attr->link_layer = IBV_LINK_LAYER_ETHERNET;
}

// A caller's struct may be older (smaller) or newer (larger) than ours: `size` is the caller's
// sizeof. Fill ours, copy what fits and zero the rest, as libibverbs does, so a program built
// against an older header is not overrun.
void CopySized(void* dst, size_t size, const void* src, size_t ours) {
  std::memcpy(dst, src, std::min(size, ours));
  if (size > ours) std::memset(static_cast<char*>(dst) + ours, 0, size - ours);
}

int OpQueryPort(ibv_context*, uint8_t port, ibv_port_attr* attr, size_t port_attr_len) {
  if (port != 1) return EINVAL;
  ibv_port_attr full;
  FillPortAttr(&full);
  CopySized(attr, port_attr_len, &full, sizeof(full));
  return 0;
}

int OpQueryDeviceEx(ibv_context* ctx, const ibv_query_device_ex_input* input,
                    ibv_device_attr_ex* attr, size_t attr_size) {
  // libibverbs' checks (ibv_cmd_query_device_any): no input fields are defined, and every
  // caller's struct has at least the ibv_device_attr it starts with.
  if ((input != nullptr && input->comp_mask != 0) || attr_size < sizeof(attr->orig_attr)) {
    return EINVAL;
  }
  ibv_device_attr_ex full;
  FillDeviceAttr(ToSoft(ctx)->hca, &full);
  CopySized(attr, attr_size, &full, sizeof(full));
  return 0;
}

class SoftDeviceOps final : public verbs::DeviceOps {
 public:
  SoftDeviceOps(std::string name, SoftContext* sctx, bool owns_device)
      : name_(std::move(name)), sctx_(sctx), owns_device_(owns_device) {}
  ~SoftDeviceOps() override {
    close(sctx_->vctx.context.async_fd);
    pthread_mutex_destroy(&sctx_->vctx.context.mutex);
    ReleaseHca(sctx_->hca);
    if (owns_device_) FreeSoftDeviceBlock(sctx_->device);
    delete sctx_;
  }

  verbs::DeviceKind kind() const override { return verbs::DeviceKind::kSoft; }
  const std::string& name() const override { return name_; }
  ibv_context* context() override { return &sctx_->vctx.context; }

  int QueryDevice(ibv_device_attr_ex* attr) override {
    FillDeviceAttr(sctx_->hca, attr);
    return 0;
  }
  int QueryPort(uint8_t port_num, ibv_port_attr* attr) override {
    return OpQueryPort(context(), port_num, attr, sizeof(*attr));
  }
  int QueryGid(uint8_t port_num, int index, ibv_gid* gid) override {
    if (port_num != 1 || index != 0) return EINVAL;
    *gid = sctx_->hca->gid;
    return 0;
  }
  int QueryPkey(uint8_t port_num, int index, uint16_t* pkey) override {
    return soft::QueryPkey(port_num, index, pkey);
  }
  int QueryGidTable(uint8_t port_num, std::vector<ibv_gid_entry>* entries) override {
    if (port_num != 1) return EINVAL;
    ibv_gid_entry entry;
    std::memset(&entry, 0, sizeof(entry));
    entry.gid = sctx_->hca->gid;
    entry.port_num = 1;
    entry.gid_type = IBV_GID_TYPE_ROCE_V2;  // one entry, RoCE as the port says
    entries->assign(1, entry);
    return 0;
  }
  int AllocPd(ibv_pd** out) override {
    auto* pd = new SoftPd();
    pd->context = context();
    pd->handle = 0;
    pd->sctx = sctx_;
    *out = pd;
    return 0;
  }
  int DeallocPd(ibv_pd* pd) override {
    auto* spd = static_cast<SoftPd*>(pd);
    if (spd->users.load(std::memory_order_acquire) != 0) return EBUSY;
    delete spd;
    return 0;
  }
  int RegMr(ibv_pd* pd, void* addr, size_t length, int access, ibv_mr** mr) override {
    return soft::RegMr(sctx_, pd, addr, length, access, mr);
  }
  int DeregMr(ibv_mr* mr) override { return soft::DeregMr(mr); }
  int ReregMr(ibv_mr* mr, int flags, ibv_pd* pd, void* addr, size_t length,
              int access) override {
    return soft::ReregMr(mr, flags, pd, addr, length, access);
  }
  int CreateCompChannel(ibv_comp_channel** channel) override {
    return CreateChannel(sctx_, channel);
  }
  int DestroyCompChannel(ibv_comp_channel* channel) override { return DestroyChannel(channel); }
  int CreateCq(int min_cqe, void* cq_context, ibv_comp_channel* channel, int comp_vector,
               ibv_cq** cq) override {
    if (comp_vector != 0) return EINVAL;
    return soft::CreateCq(sctx_, min_cqe, cq_context, channel, cq);
  }
  int DestroyCq(ibv_cq* cq) override { return soft::DestroyCq(cq); }
  int ResizeCq(ibv_cq* cq, int cqe) override { return soft::ResizeCq(cq, cqe); }
  int GetCqEvent(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) override {
    return soft::GetCqEvent(channel, cq, cq_context);
  }
  void AckCqEvents(ibv_cq* cq, unsigned int count) override { soft::AckCqEvents(cq, count); }
  int CreateSrq(ibv_pd* pd, ibv_srq_init_attr* attr, ibv_srq** out) override {
    if (pd == nullptr || pd->context != context()) return EINVAL;
    if (attr->attr.max_wr == 0 || attr->attr.max_wr > kMaxSrqWr || attr->attr.max_sge == 0 ||
        attr->attr.max_sge > kMaxSge) {
      return EINVAL;
    }
    auto* srq = new SoftSrq();
    srq->context = context();
    srq->srq_context = attr->srq_context;
    srq->pd = pd;
    srq->sctx = sctx_;
    srq->spd = static_cast<SoftPd*>(pd);
    srq->events_completed = 0;
    pthread_mutex_init(&srq->mutex, nullptr);
    pthread_cond_init(&srq->cond, nullptr);
    srq->rq.Init(attr->attr.max_wr, attr->attr.max_sge);
    srq->spd->users.fetch_add(1, std::memory_order_relaxed);
    *out = srq;
    return 0;
  }
  int DestroySrq(ibv_srq* ibsrq) override {
    auto* srq = static_cast<SoftSrq*>(ibsrq);
    if (srq->qp_count.load() != 0) return EBUSY;
    // Its undelivered IBV_EVENT_SRQ_LIMIT_REACHED go; those handed out must be acknowledged.
    const bool acked = WaitForAsyncAcks(&srq->mutex, &srq->cond, &srq->events_completed,
                                        sctx_->EndAsyncEvents(srq), "SRQ");
    srq->spd->users.fetch_sub(1, std::memory_order_release);
    if (!acked) return 0;  // left allocated: a late acknowledgement locks its mutex
    pthread_mutex_destroy(&srq->mutex);
    pthread_cond_destroy(&srq->cond);
    delete srq;
    return 0;
  }
  int ModifySrq(ibv_srq* srq, ibv_srq_attr* attr, int attr_mask) override {
    return soft::ModifySrq(srq, attr, attr_mask);
  }
  int QuerySrq(ibv_srq* srq, ibv_srq_attr* attr) override { return soft::QuerySrq(srq, attr); }
  int CreateQp(ibv_pd* pd, ibv_qp_init_attr* attr, ibv_qp** qp) override {
    return soft::CreateQp(sctx_, pd, attr, qp);
  }
  int ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) override {
    return soft::ModifyQp(qp, attr, attr_mask);
  }
  int QueryQp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask, ibv_qp_init_attr* init) override {
    return soft::QueryQp(qp, attr, attr_mask, init);
  }
  int DestroyQp(ibv_qp* qp) override { return soft::DestroyQp(qp); }
  int GetAsyncEvent(ibv_async_event* event) override { return sctx_->TakeAsyncEvent(event); }
  void AckAsyncEvent(ibv_async_event* event) override { CountAsyncAck(*event); }
  // A QP links only within one fabric: shared memory (fe80:: GIDs) or TCP (::ffff:<IPv4>).
  int CheckReachable(const ibv_gid& local, const ibv_gid& remote, std::string* why) override {
    return Fabric::CheckReachable(name_, local, remote, why);
  }
  // A TCP fabric GID is ::ffff:<IPv4> with the port in bytes 8-9; shared memory stays on
  // this host.
  int GidAddress(const ibv_gid& gid, std::string* address) override {
    if (!IsTcpFabricGid(gid)) return ENOENT;
    *address = absl::StrCat(gid.raw[12], ".", gid.raw[13], ".", gid.raw[14], ".", gid.raw[15]);
    return 0;
  }
  int SetLinkKey(ibv_qp* qp, const uint8_t* key, size_t length) override {
    const absl::Status s = soft::SetLinkKey(qp, absl::MakeConstSpan(key, length));
    switch (s.code()) {
      case absl::StatusCode::kOk: return 0;
      case absl::StatusCode::kUnimplemented: return EOPNOTSUPP;
      case absl::StatusCode::kFailedPrecondition: return EBUSY;  // after RTR
      default: return EINVAL;
    }
  }
  int SetWindowDeadline(ibv_mw* mw, absl::Time deadline) override {
    const absl::Status s = soft::SetWindowDeadline(mw, deadline);
    return s.ok() ? 0 : absl::IsUnimplemented(s) ? EOPNOTSUPP : EINVAL;
  }
  int FreshWindowRkey(ibv_mw* mw, uint32_t* rkey) override {
    const absl::StatusOr<uint32_t> fresh = soft::FreshWindowRkey(mw);
    if (fresh.ok()) {
      *rkey = *fresh;
      return 0;
    }
    switch (fresh.status().code()) {
      case absl::StatusCode::kUnimplemented: return EOPNOTSUPP;
      case absl::StatusCode::kResourceExhausted: return ENOSPC;
      default: return EINVAL;
    }
  }

 private:
  const std::string name_;
  SoftContext* const sctx_;
  const bool owns_device_;
};

constexpr size_t kDeviceBlockBytes = 4096;

}  // namespace

bool IsSoftDeviceName(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, "soft") || name.empty() || name.size() > 4) return false;
  for (char c : name) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

ibv_device* NewSoftDeviceBlock(absl::string_view name) {
  static_assert(sizeof(ibv_device) < kDeviceBlockBytes);
  void* block = std::calloc(1, kDeviceBlockBytes);
  if (block == nullptr) return nullptr;
  auto* device = new (block) ibv_device;
  device->node_type = IBV_NODE_CA;
  device->transport_type = IBV_TRANSPORT_IB;
  const std::string n(name);
  std::snprintf(device->name, sizeof(device->name), "%s", n.c_str());
  std::snprintf(device->dev_name, sizeof(device->dev_name), "%s", n.c_str());
  // Paths where sysfs would have them, though nothing is there: a program reading files below
  // them (ibv_devinfo's board_id) finds none, as for a device without those attributes.
  std::snprintf(device->dev_path, sizeof(device->dev_path), "/sys/class/infiniband_verbs/%s",
                n.c_str());
  std::snprintf(device->ibdev_path, sizeof(device->ibdev_path), "/sys/class/infiniband/%s",
                n.c_str());
  return device;
}

void FreeSoftDeviceBlock(ibv_device* device) {
  if (device == nullptr) return;
  device->~ibv_device();
  std::free(device);
}

absl::StatusOr<std::unique_ptr<verbs::DeviceOps>> OpenSoftDevice(absl::string_view name) {
  return OpenSoftDeviceAs(name, nullptr);
}

absl::StatusOr<std::unique_ptr<verbs::DeviceOps>> OpenSoftDeviceAs(absl::string_view name,
                                                                   ibv_device* device) {
  if (!IsSoftDeviceName(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", name, "' is not a soft device name (soft0, soft1, ...)"));
  }
  if (absl::Status faults = CheckFaultEnvironment(); !faults.ok()) return faults;
  std::string error;
  Hca* hca = AcquireHca(std::string(name), &error);
  if (hca == nullptr) return absl::UnavailableError(error);
  // Non-blocking, as DeviceOps::GetAsyncEvent documents: callers poll it to wait.
  int async_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (async_fd < 0) {
    ReleaseHca(hca);
    return absl::ResourceExhaustedError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  const bool owns_device = device == nullptr;
  if (owns_device) device = NewSoftDeviceBlock(name);
  if (device == nullptr) {
    close(async_fd);
    ReleaseHca(hca);
    return absl::ResourceExhaustedError("out of memory for the device");
  }
  auto* sctx = new SoftContext();
  sctx->hca = hca;
  sctx->device = device;

  verbs_context& v = sctx->vctx;
  std::memset(&v, 0, sizeof(v));
  v.sz = sizeof(verbs_context);
  v.query_port = OpQueryPort;
  v.query_device_ex = OpQueryDeviceEx;
  v.create_cq_ex = CreateCqEx;
  v.create_qp_ex = CreateQpEx;
  ibv_context& c = v.context;
  c.device = sctx->device;
  c.cmd_fd = -1;
  c.async_fd = async_fd;
  c.num_comp_vectors = 1;
  c.abi_compat = __VERBS_ABI_IS_EXTENDED;
  pthread_mutex_init(&c.mutex, nullptr);
  c.ops.alloc_mw = OpAllocMw;
  c.ops.dealloc_mw = OpDeallocMw;
  c.ops.bind_mw = OpBindMw;
  c.ops.poll_cq = OpPollCq;
  c.ops.req_notify_cq = OpReqNotifyCq;
  c.ops.post_send = OpPostSend;
  c.ops.post_recv = OpPostRecv;
  c.ops.post_srq_recv = OpPostSrqRecv;
  return std::unique_ptr<verbs::DeviceOps>(
      new SoftDeviceOps(std::string(name), sctx, owns_device));
}

bool IsSoftContext(const ibv_context* context) {
  // Every soft context, however it was opened (OpenSoftDevice, the interposer), has our
  // post_send in its ops; no other provider's can.
  return context != nullptr && context->ops.post_send == OpPostSend;
}

}  // namespace swirl::soft
