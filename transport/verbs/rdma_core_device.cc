#include "transport/verbs/rdma_core_device.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "transport/verbs/status.h"

namespace swirl::verbs {

const char* DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kRdmaCore: return "rdma-core";
    case DeviceKind::kSoft: return "soft";
  }
  return "unknown";
}

namespace {

// errno for calls that return NULL; some providers forget to set it.
int LastErrno() { return errno != 0 ? errno : EIO; }

class RdmaCoreDeviceOps final : public DeviceOps {
 public:
  RdmaCoreDeviceOps(std::string name, ibv_context* context)
      : name_(std::move(name)), context_(context) {}
  ~RdmaCoreDeviceOps() override { ibv_close_device(context_); }

  DeviceKind kind() const override { return DeviceKind::kRdmaCore; }
  const std::string& name() const override { return name_; }
  ibv_context* context() override { return context_; }

  int QueryDevice(ibv_device_attr_ex* attr) override {
    return ibv_query_device_ex(context_, nullptr, attr);
  }
  int QueryPort(uint8_t port_num, ibv_port_attr* attr) override {
    return ibv_query_port(context_, port_num, attr);
  }
  int QueryGid(uint8_t port_num, int index, ibv_gid* gid) override {
    return ibv_query_gid(context_, port_num, index, gid) == 0 ? 0 : LastErrno();
  }
  int QueryGidTable(uint8_t port_num, std::vector<ibv_gid_entry>* entries) override {
    // ibv_query_gid_table returns every port's valid entries: room for all of them.
    ibv_device_attr device;
    if (ibv_query_device(context_, &device) != 0) return LastErrno();
    size_t room = 0;
    for (uint8_t p = 1; p <= device.phys_port_cnt; ++p) {
      ibv_port_attr port;
      if (ibv_query_port(context_, p, &port) == 0) room += static_cast<size_t>(port.gid_tbl_len);
    }
    std::vector<ibv_gid_entry> all(std::max<size_t>(room, 1));
    const ssize_t n = ibv_query_gid_table(context_, all.data(), all.size(), 0);
    if (n < 0) return static_cast<int>(-n);
    entries->clear();
    for (ssize_t i = 0; i < n; ++i) {
      if (all[i].port_num == port_num) entries->push_back(all[i]);
    }
    return 0;
  }
  int QueryPkey(uint8_t port_num, int index, uint16_t* pkey) override {
    errno = 0;
    return ibv_query_pkey(context_, port_num, index, pkey) == 0 ? 0 : LastErrno();
  }
  int AllocPd(ibv_pd** pd) override {
    errno = 0;
    *pd = ibv_alloc_pd(context_);
    return *pd ? 0 : LastErrno();
  }
  int DeallocPd(ibv_pd* pd) override { return ibv_dealloc_pd(pd); }
  int RegMr(ibv_pd* pd, void* addr, size_t length, int access, ibv_mr** mr) override {
    errno = 0;
    *mr = ibv_reg_mr(pd, addr, length, access);
    return *mr ? 0 : LastErrno();
  }
  int DeregMr(ibv_mr* mr) override { return ibv_dereg_mr(mr); }
  int ReregMr(ibv_mr* mr, int flags, ibv_pd* pd, void* addr, size_t length,
              int access) override {
    // ibv_rereg_mr returns an IBV_REREG_MR_ERR_* code and leaves the reason in errno.
    errno = 0;
    return ibv_rereg_mr(mr, flags, pd, addr, length, access) == 0 ? 0 : LastErrno();
  }
  int CreateCompChannel(ibv_comp_channel** channel) override {
    errno = 0;
    *channel = ibv_create_comp_channel(context_);
    return *channel ? 0 : LastErrno();
  }
  int DestroyCompChannel(ibv_comp_channel* channel) override {
    return ibv_destroy_comp_channel(channel);
  }
  int CreateCq(int min_cqe, void* cq_context, ibv_comp_channel* channel, int comp_vector,
               ibv_cq** cq) override {
    errno = 0;
    *cq = ibv_create_cq(context_, min_cqe, cq_context, channel, comp_vector);
    return *cq ? 0 : LastErrno();
  }
  int DestroyCq(ibv_cq* cq) override { return ibv_destroy_cq(cq); }
  int ResizeCq(ibv_cq* cq, int cqe) override { return ibv_resize_cq(cq, cqe); }
  int GetCqEvent(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) override {
    errno = 0;
    return ibv_get_cq_event(channel, cq, cq_context) == 0 ? 0 : LastErrno();
  }
  void AckCqEvents(ibv_cq* cq, unsigned int count) override { ibv_ack_cq_events(cq, count); }
  int CreateSrq(ibv_pd* pd, ibv_srq_init_attr* attr, ibv_srq** srq) override {
    errno = 0;
    *srq = ibv_create_srq(pd, attr);
    return *srq ? 0 : LastErrno();
  }
  int DestroySrq(ibv_srq* srq) override { return ibv_destroy_srq(srq); }
  int ModifySrq(ibv_srq* srq, ibv_srq_attr* attr, int attr_mask) override {
    return ibv_modify_srq(srq, attr, attr_mask);
  }
  int QuerySrq(ibv_srq* srq, ibv_srq_attr* attr) override { return ibv_query_srq(srq, attr); }
  int CreateQp(ibv_pd* pd, ibv_qp_init_attr* attr, ibv_qp** qp) override {
    errno = 0;
    *qp = ibv_create_qp(pd, attr);
    return *qp ? 0 : LastErrno();
  }
  int ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) override {
    return ibv_modify_qp(qp, attr, attr_mask);
  }
  int QueryQp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask,
              ibv_qp_init_attr* init_attr) override {
    return ibv_query_qp(qp, attr, attr_mask, init_attr);
  }
  int DestroyQp(ibv_qp* qp) override { return ibv_destroy_qp(qp); }
  int GetAsyncEvent(ibv_async_event* event) override {
    errno = 0;
    return ibv_get_async_event(context_, event) == 0 ? 0 : LastErrno();
  }
  void AckAsyncEvent(ibv_async_event* event) override { ibv_ack_async_event(event); }

 private:
  const std::string name_;
  ibv_context* const context_;
};

struct DeviceListDeleter {
  void operator()(ibv_device** list) const { ibv_free_device_list(list); }
};

absl::StatusOr<std::unique_ptr<ibv_device*, DeviceListDeleter>> GetDeviceList(int* count) {
  errno = 0;
  ibv_device** list = ibv_get_device_list(count);
  if (list == nullptr) {
    // ENOSYS: the kernel has no RDMA subsystem (containers, most VMs). That is "no devices".
    if (errno == ENOSYS || errno == ENOENT || errno == ENODEV) {
      *count = 0;
      return std::unique_ptr<ibv_device*, DeviceListDeleter>(nullptr);
    }
    return VerbsError("ibv_get_device_list", LastErrno());
  }
  return std::unique_ptr<ibv_device*, DeviceListDeleter>(list);
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ListRdmaCoreDevices() {
  int count = 0;
  auto list = GetDeviceList(&count);
  if (!list.ok()) return list.status();
  std::vector<std::string> names;
  for (int i = 0; i < count; ++i) names.emplace_back(ibv_get_device_name(list->get()[i]));
  return names;
}

absl::StatusOr<std::unique_ptr<DeviceOps>> OpenRdmaCoreDevice(absl::string_view name) {
  int count = 0;
  auto list = GetDeviceList(&count);
  if (!list.ok()) return list.status();
  for (int i = 0; i < count; ++i) {
    ibv_device* device = list->get()[i];
    if (name != ibv_get_device_name(device)) continue;
    if (device->transport_type == IBV_TRANSPORT_IWARP) {
      // An iWARP QP reaches RTS only through rdma_cm (MPA over TCP: siw, for one, refuses the
      // transition without a socket), and swirl connects QPs with plain ibv_modify_qp.
      return absl::FailedPreconditionError(absl::StrCat(
          "'", name, "' is an iWARP device, whose connections only rdma_cm can set up; swirl "
          "supports InfiniBand and RoCE devices (and its own soft device)"));
    }
    errno = 0;
    ibv_context* context = ibv_open_device(device);
    if (context == nullptr) return VerbsError("ibv_open_device", name, LastErrno());
    // DeviceOps::GetAsyncEvent never blocks: callers poll async_fd (ibv_get_async_event(3)
    // allows changing its flags for exactly this).
    const int flags = fcntl(context->async_fd, F_GETFL);
    if (flags < 0 || fcntl(context->async_fd, F_SETFL, flags | O_NONBLOCK) != 0) {
      const int err = errno;
      ibv_close_device(context);
      return VerbsError("fcntl(async_fd, O_NONBLOCK)", name, err);
    }
    return std::unique_ptr<DeviceOps>(new RdmaCoreDeviceOps(std::string(name), context));
  }
  return absl::NotFoundError(absl::StrCat("no rdma-core device named '", name, "'"));
}

}  // namespace swirl::verbs
