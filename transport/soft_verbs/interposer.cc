// libswirl_soft_verbs.so: the soft device for unmodified verbs programs (docs/SOFT_VERBS.md).
//
// Loaded with LD_PRELOAD, it defines libibverbs' exported calls. Each one serves objects of a
// soft device (a soft context, or an object whose `context` is one) from transport/soft and
// passes everything else to the real libibverbs unchanged (real_verbs.h). Device lists get the
// soft devices after the real ones. Only the control path comes here: posting, polling,
// binding windows and the extended API (ibv_create_cq_ex, ibv_wr_*, ...) are libibverbs'
// inline calls through the context's tables, which the soft device fills, so the data path
// costs what it costs in swirl itself.
//
// Conventions are libibverbs' own, call by call: NULL with errno, -1 with errno, a positive
// errno value, or -errno, as its man pages and code say. An object of one kind of device
// handed to a call on another (a soft CQ for a QP on a real PD, say) fails with EINVAL
// instead of reaching a provider that would take it for its own.
//
// The symbols are exported unversioned (exports.lds): programs import versioned references
// (ibv_alloc_pd@IBVERBS_1.1, ibv_query_gid_type@IBVERBS_PRIVATE_34), which an unversioned
// definition satisfies, while a version node of our own would not bind at all.

#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "transport/soft/soft_device.h"
#include "transport/soft_verbs/real_verbs.h"
#include "transport/soft_verbs/registry.h"

// verbs.h makes these macros over inline helpers; this file defines the exported functions.
#undef ibv_reg_mr
#undef ibv_reg_mr_iova
#undef ibv_query_port

namespace swirl::soft_verbs {
namespace {

verbs::DeviceOps* SoftOps(const ibv_context* context) { return Registry::Get().Ops(context); }

template <typename T>
verbs::DeviceOps* SoftOf(const T* object) {
  return object != nullptr ? SoftOps(object->context) : nullptr;
}

// True if `object` is set and its context is not `context`: a mix of devices.
template <typename T>
bool Foreign(const T* object, const ibv_context* context) {
  return object != nullptr && object->context != context;
}

// The pointer result of a call that failed with `err`.
template <typename T>
T* FailNull(int err) {
  errno = err;
  return nullptr;
}

// Calls `real.fn` (null when this libibverbs lacks it) inside an InRealCall.
#define CALL_REAL(fn, fail, ...)                            \
  do {                                                      \
    if (Real().fn == nullptr) {                             \
      errno = EOPNOTSUPP;                                   \
      return fail;                                          \
    }                                                       \
    InRealCall in_real;                                     \
    return Real().fn(__VA_ARGS__);                          \
  } while (0)

#define CALL_REAL_VOID(fn, ...)                             \
  do {                                                      \
    if (Real().fn == nullptr) return;                       \
    InRealCall in_real;                                     \
    Real().fn(__VA_ARGS__);                                 \
    return;                                                 \
  } while (0)

void Created(const ibv_context* context) { Registry::Get().Created(context); }
void Destroyed(const ibv_context* context) { Registry::Get().Destroyed(context); }

// The soft port's GID table entry `index`, or an errno value. The table has gid_tbl_len
// entries, all of them valid: an index past it is EINVAL, as libibverbs answers for an entry
// sysfs does not have (never ENODATA, its answer for an empty entry inside the table).
int SoftGidEntry(verbs::DeviceOps* ops, uint32_t port, uint32_t index, ibv_gid_entry* entry) {
  std::vector<ibv_gid_entry> table;
  if (int err = ops->QueryGidTable(static_cast<uint8_t>(port), &table)) return err;
  if (index >= table.size()) return EINVAL;
  *entry = table[index];
  entry->gid_index = index;
  return 0;
}

}  // namespace
}  // namespace swirl::soft_verbs

using swirl::soft_verbs::Created;
using swirl::soft_verbs::Destroyed;
using swirl::soft_verbs::FailNull;
using swirl::soft_verbs::Foreign;
using swirl::soft_verbs::InRealCall;
using swirl::soft_verbs::Real;
using swirl::soft_verbs::Registry;
using swirl::soft_verbs::SoftGidEntry;
using swirl::soft_verbs::SoftOf;
using swirl::soft_verbs::SoftOps;
using swirl::soft_verbs::ibv_gid_type_sysfs;
namespace verbs = swirl::verbs;

extern "C" {

// ---- Devices ------------------------------------------------------------------------------

ibv_device** ibv_get_device_list(int* num) {
  if (num != nullptr) *num = 0;
  ibv_device** real_list = nullptr;
  int real_count = 0;
  const int saved_errno = errno;
  if (Real().get_device_list != nullptr) {
    InRealCall in_real;
    real_list = Real().get_device_list(&real_count);
  }
  // Called by libibverbs itself (through its PLT): only its own devices, which it takes for
  // its own structures.
  if (InRealCall::Active()) {
    if (num != nullptr) *num = real_count;
    return real_list;
  }
  // No kernel RDMA support: the real call fails (ENOSYS); that hides no soft device.
  if (real_list == nullptr) real_count = 0;
  errno = saved_errno;
  const std::vector<ibv_device*>& soft = Registry::Get().devices();
  const size_t count = static_cast<size_t>(real_count) + soft.size();
  auto** list = static_cast<ibv_device**>(std::calloc(count + 1, sizeof(ibv_device*)));
  if (list == nullptr) {
    if (real_list != nullptr) Real().free_device_list(real_list);
    return FailNull<ibv_device*>(ENOMEM);
  }
  for (int i = 0; i < real_count; ++i) list[i] = real_list[i];
  for (size_t i = 0; i < soft.size(); ++i) list[real_count + i] = soft[i];
  Registry::Get().AddList(list, real_list);
  if (num != nullptr) *num = static_cast<int>(count);
  return list;
}

void ibv_free_device_list(ibv_device** list) {
  ibv_device** real_list = nullptr;
  if (Registry::Get().TakeList(list, &real_list)) {
    if (real_list != nullptr) CALL_REAL_VOID(free_device_list, real_list);
    std::free(list);
    return;
  }
  CALL_REAL_VOID(free_device_list, list);
}

const char* ibv_get_device_name(ibv_device* device) {
  if (const std::string* name = Registry::Get().SoftDeviceName(device)) return name->c_str();
  CALL_REAL(get_device_name, nullptr, device);
}

__be64 ibv_get_device_guid(ibv_device* device) {
  if (Registry::Get().SoftDeviceName(device) != nullptr) {
    // The GUID is the device's (one per device and process); reading it needs a context.
    ibv_context* context = Registry::Get().Open(device);
    if (context == nullptr) return 0;
    ibv_device_attr_ex attr;
    const int err = SoftOps(context)->QueryDevice(&attr);
    Registry::Get().Close(context);
    return err == 0 ? attr.orig_attr.node_guid : 0;
  }
  CALL_REAL(get_device_guid, 0, device);
}

int ibv_get_device_index(ibv_device* device) {
  // No kernel device, so no kernel index: -1, as for a device without one.
  if (Registry::Get().SoftDeviceName(device) != nullptr) return -1;
  CALL_REAL(get_device_index, -1, device);
}

ibv_context* ibv_open_device(ibv_device* device) {
  if (Registry::Get().SoftDeviceName(device) != nullptr) {
    ibv_context* context = Registry::Get().Open(device);
    if (context != nullptr) {
      // libibverbs' default: ibv_get_async_event blocks unless the program sets O_NONBLOCK.
      const int flags = fcntl(context->async_fd, F_GETFL);
      if (flags >= 0) fcntl(context->async_fd, F_SETFL, flags & ~O_NONBLOCK);
    }
    return context;
  }
  CALL_REAL(open_device, nullptr, device);
}

int ibv_close_device(ibv_context* context) {
  if (SoftOps(context) != nullptr) {
    if (int err = Registry::Get().Close(context)) {
      errno = err;
      return -1;
    }
    return 0;
  }
  CALL_REAL(close_device, -1, context);
}

ibv_context* ibv_import_device(int cmd_fd) {
  // A soft context shares nothing through its cmd_fd (it has no kernel objects to share).
  if (Registry::Get().IsSoftCmdFd(cmd_fd)) return FailNull<ibv_context>(EOPNOTSUPP);
  CALL_REAL(import_device, nullptr, cmd_fd);
}

// ---- Queries -------------------------------------------------------------------------------

int ibv_query_device(ibv_context* context, ibv_device_attr* attr) {
  if (verbs::DeviceOps* ops = SoftOps(context)) {
    ibv_device_attr_ex ex;
    if (int err = ops->QueryDevice(&ex)) return err;
    *attr = ex.orig_attr;
    return 0;
  }
  CALL_REAL(query_device, EOPNOTSUPP, context, attr);
}

// The exported form, for programs built against headers before the inline one: the caller's
// struct is the old, shorter ibv_port_attr (up to `flags`).
int ibv_query_port(ibv_context* context, uint8_t port_num, _compat_ibv_port_attr* attr) {
  if (verbs::DeviceOps* ops = SoftOps(context)) {
    ibv_port_attr full;
    if (int err = ops->QueryPort(port_num, &full)) return err;
    std::memcpy(attr, &full, offsetof(ibv_port_attr, port_cap_flags2));
    return 0;
  }
  CALL_REAL(query_port, EOPNOTSUPP, context, port_num, attr);
}

int ibv_query_gid(ibv_context* context, uint8_t port_num, int index, ibv_gid* gid) {
  if (verbs::DeviceOps* ops = SoftOps(context)) {
    ibv_gid_entry entry;
    const int err = index < 0 ? EINVAL : SoftGidEntry(ops, port_num, index, &entry);
    if (err == ENODATA) {  // libibverbs: an empty entry reads as zeros
      std::memset(gid, 0, sizeof(*gid));
      return 0;
    }
    if (err != 0) {
      errno = err;
      return -1;
    }
    *gid = entry.gid;
    return 0;
  }
  CALL_REAL(query_gid, -1, context, port_num, index, gid);
}

int _ibv_query_gid_ex(ibv_context* context, uint32_t port_num, uint32_t gid_index,
                      ibv_gid_entry* entry, uint32_t flags, size_t entry_size) {
  if (verbs::DeviceOps* ops = SoftOps(context)) {
    if (flags != 0) return EOPNOTSUPP;
    ibv_gid_entry found;
    if (int err = SoftGidEntry(ops, port_num, gid_index, &found)) return err;
    std::memset(entry, 0, entry_size);
    std::memcpy(entry, &found, std::min(entry_size, sizeof(found)));
    return 0;
  }
  CALL_REAL(query_gid_ex, EOPNOTSUPP, context, port_num, gid_index, entry, flags, entry_size);
}

ssize_t _ibv_query_gid_table(ibv_context* context, ibv_gid_entry* entries, size_t max_entries,
                             uint32_t flags, size_t entry_size) {
  if (verbs::DeviceOps* ops = SoftOps(context)) {
    if (flags != 0) return -EOPNOTSUPP;
    if (entry_size < sizeof(ibv_gid_entry)) return -EINVAL;
    std::vector<ibv_gid_entry> table;
    if (int err = ops->QueryGidTable(1, &table)) return -err;  // the soft device has port 1
    if (table.size() > max_entries) return -EINVAL;
    for (size_t i = 0; i < table.size(); ++i) {
      char* slot = reinterpret_cast<char*>(entries) + i * entry_size;
      std::memset(slot, 0, entry_size);
      table[i].gid_index = static_cast<uint32_t>(i);
      std::memcpy(slot, &table[i], sizeof(table[i]));
    }
    return static_cast<ssize_t>(table.size());
  }
  if (Real().query_gid_table == nullptr) return -EOPNOTSUPP;
  InRealCall in_real;
  return Real().query_gid_table(context, entries, max_entries, flags, entry_size);
}

int ibv_query_gid_type(ibv_context* context, uint8_t port_num, unsigned int index,
                       ibv_gid_type_sysfs* type) {
  if (verbs::DeviceOps* ops = SoftOps(context)) {
    ibv_gid_entry entry;
    const int err = SoftGidEntry(ops, port_num, index, &entry);
    if (err == ENODATA) {
      *type = swirl::soft_verbs::IBV_GID_TYPE_SYSFS_IB_ROCE_V1;
      return 0;
    }
    if (err != 0) {
      errno = err;
      return -1;
    }
    *type = entry.gid_type == IBV_GID_TYPE_ROCE_V2 ? swirl::soft_verbs::IBV_GID_TYPE_SYSFS_ROCE_V2
                                                   : swirl::soft_verbs::IBV_GID_TYPE_SYSFS_IB_ROCE_V1;
    return 0;
  }
  CALL_REAL(query_gid_type, -1, context, port_num, index, type);
}

int ibv_query_pkey(ibv_context* context, uint8_t port_num, int index, __be16* pkey) {
  if (verbs::DeviceOps* ops = SoftOps(context)) {
    uint16_t value = 0;
    if (int err = ops->QueryPkey(port_num, index, &value)) {
      errno = err;
      return -1;
    }
    *pkey = htobe16(value);
    return 0;
  }
  CALL_REAL(query_pkey, -1, context, port_num, index, pkey);
}

// ---- Protection domains and memory ----------------------------------------------------------

ibv_pd* ibv_alloc_pd(ibv_context* context) {
  if (verbs::DeviceOps* ops = SoftOps(context)) {
    ibv_pd* pd = nullptr;
    if (int err = ops->AllocPd(&pd)) return FailNull<ibv_pd>(err);
    Created(context);
    return pd;
  }
  CALL_REAL(alloc_pd, nullptr, context);
}

int ibv_dealloc_pd(ibv_pd* pd) {
  if (verbs::DeviceOps* ops = SoftOf(pd)) {
    ibv_context* context = pd->context;
    if (int err = ops->DeallocPd(pd)) return err;
    Destroyed(context);
    return 0;
  }
  CALL_REAL(dealloc_pd, EOPNOTSUPP, pd);
}

ibv_pd* ibv_import_pd(ibv_context* context, uint32_t pd_handle) {
  if (SoftOps(context) != nullptr) return FailNull<ibv_pd>(EOPNOTSUPP);  // no kernel objects
  CALL_REAL(import_pd, nullptr, context, pd_handle);
}

void ibv_unimport_pd(ibv_pd* pd) {
  if (SoftOf(pd) != nullptr) return;
  CALL_REAL_VOID(unimport_pd, pd);
}

namespace {

ibv_mr* SoftRegMr(verbs::DeviceOps* ops, ibv_pd* pd, void* addr, size_t length, uint64_t iova,
                  int access) {
  // The soft device's keys address virtual addresses: a region at another IOVA is not offered.
  if (iova != reinterpret_cast<uintptr_t>(addr)) return FailNull<ibv_mr>(EOPNOTSUPP);
  ibv_mr* mr = nullptr;
  if (int err = ops->RegMr(pd, addr, length, access, &mr)) return FailNull<ibv_mr>(err);
  Created(pd->context);
  return mr;
}

}  // namespace

ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t length, int access) {
  if (verbs::DeviceOps* ops = SoftOf(pd)) {
    return SoftRegMr(ops, pd, addr, length, reinterpret_cast<uintptr_t>(addr), access);
  }
  CALL_REAL(reg_mr, nullptr, pd, addr, length, access);
}

ibv_mr* ibv_reg_mr_iova(ibv_pd* pd, void* addr, size_t length, uint64_t iova, int access) {
  if (verbs::DeviceOps* ops = SoftOf(pd)) return SoftRegMr(ops, pd, addr, length, iova, access);
  CALL_REAL(reg_mr_iova, nullptr, pd, addr, length, iova, access);
}

ibv_mr* ibv_reg_mr_iova2(ibv_pd* pd, void* addr, size_t length, uint64_t iova,
                         unsigned int access) {
  if (verbs::DeviceOps* ops = SoftOf(pd)) {
    return SoftRegMr(ops, pd, addr, length, iova, static_cast<int>(access));
  }
  CALL_REAL(reg_mr_iova2, nullptr, pd, addr, length, iova, access);
}

ibv_mr* ibv_reg_dmabuf_mr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                          int access) {
  if (SoftOf(pd) != nullptr) return FailNull<ibv_mr>(EOPNOTSUPP);  // no device memory to map
  CALL_REAL(reg_dmabuf_mr, nullptr, pd, offset, length, iova, fd, access);
}

int ibv_rereg_mr(ibv_mr* mr, int flags, ibv_pd* pd, void* addr, size_t length, int access) {
  if (verbs::DeviceOps* ops = SoftOf(mr)) {
    // libibverbs' own checks, before any provider: bad input is IBV_REREG_MR_ERR_INPUT.
    if ((flags & ~IBV_REREG_MR_FLAGS_SUPPORTED) ||
        ((flags & IBV_REREG_MR_CHANGE_TRANSLATION) && (length == 0 || addr == nullptr)) ||
        (access != 0 && !(flags & IBV_REREG_MR_CHANGE_ACCESS))) {
      errno = EINVAL;
      return IBV_REREG_MR_ERR_INPUT;
    }
    if ((flags & IBV_REREG_MR_CHANGE_PD) && Foreign(pd, mr->context)) {
      errno = EINVAL;
      return IBV_REREG_MR_ERR_INPUT;
    }
    // The device's refusal is IBV_REREG_MR_ERR_CMD, with its reason in errno.
    if (int err = ops->ReregMr(mr, flags, pd, addr, length, access)) {
      errno = err;
      return IBV_REREG_MR_ERR_CMD;
    }
    return 0;
  }
  CALL_REAL(rereg_mr, IBV_REREG_MR_ERR_CMD, mr, flags, pd, addr, length, access);
}

int ibv_dereg_mr(ibv_mr* mr) {
  if (verbs::DeviceOps* ops = SoftOf(mr)) {
    ibv_context* context = mr->context;
    if (int err = ops->DeregMr(mr)) return err;
    Destroyed(context);
    return 0;
  }
  CALL_REAL(dereg_mr, EOPNOTSUPP, mr);
}

ibv_mr* ibv_import_mr(ibv_pd* pd, uint32_t mr_handle) {
  if (SoftOf(pd) != nullptr) return FailNull<ibv_mr>(EOPNOTSUPP);
  CALL_REAL(import_mr, nullptr, pd, mr_handle);
}

void ibv_unimport_mr(ibv_mr* mr) {
  if (SoftOf(mr) != nullptr) return;
  CALL_REAL_VOID(unimport_mr, mr);
}

ibv_dm* ibv_import_dm(ibv_context* context, uint32_t dm_handle) {
  if (SoftOps(context) != nullptr) return FailNull<ibv_dm>(EOPNOTSUPP);
  CALL_REAL(import_dm, nullptr, context, dm_handle);
}

void ibv_unimport_dm(ibv_dm* dm) {
  if (dm != nullptr && SoftOps(dm->context) != nullptr) return;
  CALL_REAL_VOID(unimport_dm, dm);
}

// ---- Completion channels and CQs ---------------------------------------------------------------

ibv_comp_channel* ibv_create_comp_channel(ibv_context* context) {
  if (verbs::DeviceOps* ops = SoftOps(context)) {
    ibv_comp_channel* channel = nullptr;
    if (int err = ops->CreateCompChannel(&channel)) return FailNull<ibv_comp_channel>(err);
    Created(context);
    return channel;
  }
  CALL_REAL(create_comp_channel, nullptr, context);
}

int ibv_destroy_comp_channel(ibv_comp_channel* channel) {
  if (verbs::DeviceOps* ops = SoftOf(channel)) {
    ibv_context* context = channel->context;
    if (int err = ops->DestroyCompChannel(channel)) return err;
    Destroyed(context);
    return 0;
  }
  CALL_REAL(destroy_comp_channel, EOPNOTSUPP, channel);
}

ibv_cq* ibv_create_cq(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel,
                      int comp_vector) {
  if (verbs::DeviceOps* ops = SoftOps(context)) {
    if (Foreign(channel, context)) return FailNull<ibv_cq>(EINVAL);
    ibv_cq* cq = nullptr;
    if (int err = ops->CreateCq(cqe, cq_context, channel, comp_vector, &cq)) {
      return FailNull<ibv_cq>(err);
    }
    Created(context);
    return cq;
  }
  if (SoftOf(channel) != nullptr) return FailNull<ibv_cq>(EINVAL);
  CALL_REAL(create_cq, nullptr, context, cqe, cq_context, channel, comp_vector);
}

int ibv_resize_cq(ibv_cq* cq, int cqe) {
  if (verbs::DeviceOps* ops = SoftOf(cq)) return ops->ResizeCq(cq, cqe);
  CALL_REAL(resize_cq, EOPNOTSUPP, cq, cqe);
}

int ibv_destroy_cq(ibv_cq* cq) {
  if (verbs::DeviceOps* ops = SoftOf(cq)) {
    ibv_context* context = cq->context;
    if (int err = ops->DestroyCq(cq)) return err;
    Destroyed(context);
    return 0;
  }
  CALL_REAL(destroy_cq, EOPNOTSUPP, cq);
}

int ibv_get_cq_event(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) {
  if (verbs::DeviceOps* ops = SoftOf(channel)) {
    if (int err = ops->GetCqEvent(channel, cq, cq_context)) {
      errno = err;
      return -1;
    }
    return 0;
  }
  CALL_REAL(get_cq_event, -1, channel, cq, cq_context);
}

void ibv_ack_cq_events(ibv_cq* cq, unsigned int nevents) {
  if (verbs::DeviceOps* ops = SoftOf(cq)) {
    ops->AckCqEvents(cq, nevents);
    return;
  }
  CALL_REAL_VOID(ack_cq_events, cq, nevents);
}

// ---- Shared receive queues -------------------------------------------------------------------

ibv_srq* ibv_create_srq(ibv_pd* pd, ibv_srq_init_attr* attr) {
  if (verbs::DeviceOps* ops = SoftOf(pd)) {
    ibv_srq* srq = nullptr;
    if (int err = ops->CreateSrq(pd, attr, &srq)) return FailNull<ibv_srq>(err);
    Created(pd->context);
    return srq;
  }
  CALL_REAL(create_srq, nullptr, pd, attr);
}

int ibv_modify_srq(ibv_srq* srq, ibv_srq_attr* attr, int attr_mask) {
  if (verbs::DeviceOps* ops = SoftOf(srq)) return ops->ModifySrq(srq, attr, attr_mask);
  CALL_REAL(modify_srq, EOPNOTSUPP, srq, attr, attr_mask);
}

int ibv_query_srq(ibv_srq* srq, ibv_srq_attr* attr) {
  if (verbs::DeviceOps* ops = SoftOf(srq)) return ops->QuerySrq(srq, attr);
  CALL_REAL(query_srq, EOPNOTSUPP, srq, attr);
}

int ibv_destroy_srq(ibv_srq* srq) {
  if (verbs::DeviceOps* ops = SoftOf(srq)) {
    ibv_context* context = srq->context;
    if (int err = ops->DestroySrq(srq)) return err;
    Destroyed(context);
    return 0;
  }
  CALL_REAL(destroy_srq, EOPNOTSUPP, srq);
}

// ---- Queue pairs -----------------------------------------------------------------------------

ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) {
  if (verbs::DeviceOps* ops = SoftOf(pd)) {
    ibv_qp* qp = nullptr;
    if (int err = ops->CreateQp(pd, attr, &qp)) return FailNull<ibv_qp>(err);  // checks the CQs
    Created(pd->context);
    return qp;
  }
  if (attr != nullptr && (SoftOf(attr->send_cq) != nullptr || SoftOf(attr->recv_cq) != nullptr ||
                          SoftOf(attr->srq) != nullptr)) {
    return FailNull<ibv_qp>(EINVAL);
  }
  CALL_REAL(create_qp, nullptr, pd, attr);
}

ibv_qp_ex* ibv_qp_to_qp_ex(ibv_qp* qp) {
  // Served by libibverbs for soft QPs too: it only reads the QP's layout (verbs_qp's comp_mask),
  // which the soft device's QPs share with every provider's.
  CALL_REAL(qp_to_qp_ex, nullptr, qp);
}

int ibv_query_qp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask, ibv_qp_init_attr* init_attr) {
  if (verbs::DeviceOps* ops = SoftOf(qp)) {
    if (int err = ops->QueryQp(qp, attr, attr_mask, init_attr)) return err;
    if (attr_mask & IBV_QP_STATE) qp->state = attr->qp_state;
    return 0;
  }
  CALL_REAL(query_qp, EOPNOTSUPP, qp, attr, attr_mask, init_attr);
}

int ibv_modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) {
  if (verbs::DeviceOps* ops = SoftOf(qp)) {
    if (int err = ops->ModifyQp(qp, attr, attr_mask)) return err;
    if (attr_mask & IBV_QP_STATE) qp->state = attr->qp_state;
    return 0;
  }
  CALL_REAL(modify_qp, EOPNOTSUPP, qp, attr, attr_mask);
}

int ibv_destroy_qp(ibv_qp* qp) {
  if (verbs::DeviceOps* ops = SoftOf(qp)) {
    ibv_context* context = qp->context;
    if (int err = ops->DestroyQp(qp)) return err;
    Destroyed(context);
    return 0;
  }
  CALL_REAL(destroy_qp, EOPNOTSUPP, qp);
}

int ibv_query_qp_data_in_order(ibv_qp* qp, ibv_wr_opcode op, uint32_t flags) {
  // libibverbs answers 0 ("no guarantee") for a provider that does not say: so do we.
  if (SoftOf(qp) != nullptr) return 0;
  CALL_REAL(query_qp_data_in_order, 0, qp, op, flags);
}

int ibv_query_ece(ibv_qp* qp, ibv_ece* ece) {
  if (SoftOf(qp) != nullptr) return EOPNOTSUPP;
  CALL_REAL(query_ece, EOPNOTSUPP, qp, ece);
}

int ibv_set_ece(ibv_qp* qp, ibv_ece* ece) {
  if (SoftOf(qp) != nullptr) return EOPNOTSUPP;
  CALL_REAL(set_ece, EOPNOTSUPP, qp, ece);
}

// ---- Address handles and multicast: RC only, so none ---------------------------------------

ibv_ah* ibv_create_ah(ibv_pd* pd, ibv_ah_attr* attr) {
  if (SoftOf(pd) != nullptr) return FailNull<ibv_ah>(EOPNOTSUPP);
  CALL_REAL(create_ah, nullptr, pd, attr);
}

int ibv_destroy_ah(ibv_ah* ah) {
  if (SoftOf(ah) != nullptr) return EOPNOTSUPP;  // cannot be: none is ever made
  CALL_REAL(destroy_ah, EOPNOTSUPP, ah);
}

ibv_ah* ibv_create_ah_from_wc(ibv_pd* pd, ibv_wc* wc, ibv_grh* grh, uint8_t port_num) {
  if (SoftOf(pd) != nullptr) return FailNull<ibv_ah>(EOPNOTSUPP);
  CALL_REAL(create_ah_from_wc, nullptr, pd, wc, grh, port_num);
}

int ibv_init_ah_from_wc(ibv_context* context, uint8_t port_num, ibv_wc* wc, ibv_grh* grh,
                        ibv_ah_attr* ah_attr) {
  if (SoftOps(context) != nullptr) {
    errno = EOPNOTSUPP;
    return -1;
  }
  CALL_REAL(init_ah_from_wc, -1, context, port_num, wc, grh, ah_attr);
}

int ibv_attach_mcast(ibv_qp* qp, const ibv_gid* gid, uint16_t lid) {
  if (SoftOf(qp) != nullptr) return EOPNOTSUPP;
  CALL_REAL(attach_mcast, EOPNOTSUPP, qp, gid, lid);
}

int ibv_detach_mcast(ibv_qp* qp, const ibv_gid* gid, uint16_t lid) {
  if (SoftOf(qp) != nullptr) return EOPNOTSUPP;
  CALL_REAL(detach_mcast, EOPNOTSUPP, qp, gid, lid);
}

// ---- Asynchronous events -----------------------------------------------------------------------

int ibv_get_async_event(ibv_context* context, ibv_async_event* event) {
  if (verbs::DeviceOps* ops = SoftOps(context)) {
    for (;;) {
      const int err = ops->GetAsyncEvent(event);  // never blocks
      if (err != EAGAIN) {
        if (err == 0) return 0;
        errno = err;
        return -1;
      }
      // Nothing queued: wait, as libibverbs' read() would, unless the fd is non-blocking.
      const int flags = fcntl(context->async_fd, F_GETFL);
      if (flags < 0 || (flags & O_NONBLOCK)) {
        errno = EAGAIN;
        return -1;
      }
      pollfd ready{context->async_fd, POLLIN, 0};
      if (poll(&ready, 1, -1) < 0) return -1;  // EINTR, as read() would
    }
  }
  CALL_REAL(get_async_event, -1, context, event);
}

void ibv_ack_async_event(ibv_async_event* event) {
  // The soft device does libibverbs' bookkeeping itself (the object's count of acknowledged
  // events, which its destroys wait for: soft::CountAsyncAck, soft::WaitForAsyncAcks).
  ibv_context* context = swirl::soft::AsyncEventContext(*event);  // null: a port or device event
  if (verbs::DeviceOps* ops = SoftOps(context)) {
    ops->AckAsyncEvent(event);
    return;
  }
  CALL_REAL_VOID(ack_async_event, event);
}

}  // extern "C"
