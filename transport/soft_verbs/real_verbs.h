// The real libibverbs, reached past the interposer.
//
// Why not dlsym(RTLD_NEXT): Python loads pyverbs with RTLD_LOCAL, so from a preloaded library
// RTLD_NEXT finds no libibverbs at all in that process. The interposer links libibverbs.so.1
// (it is always there, as the soft device's own dependency) and looks each function up in that
// library's handle, which finds libibverbs' definition and never ours.

#ifndef SWIRL_TRANSPORT_SOFT_VERBS_REAL_VERBS_H_
#define SWIRL_TRANSPORT_SOFT_VERBS_REAL_VERBS_H_

#include <infiniband/verbs.h>

namespace swirl::soft_verbs {

// libibverbs' private ibv_query_gid_type (IBVERBS_PRIVATE_*), which ibv_devinfo and pyverbs
// import; its type is not in any installed header.
enum ibv_gid_type_sysfs {
  IBV_GID_TYPE_SYSFS_IB_ROCE_V1,
  IBV_GID_TYPE_SYSFS_ROCE_V2,
};

// One pointer per libibverbs function the interposer serves; each is null if this libibverbs
// lacks it (then real devices answer EOPNOTSUPP for it). Filled once, on first use.
struct RealVerbs {
  decltype(&::ibv_get_device_list) get_device_list;
  decltype(&::ibv_free_device_list) free_device_list;
  decltype(&::ibv_get_device_name) get_device_name;
  decltype(&::ibv_get_device_guid) get_device_guid;
  decltype(&::ibv_get_device_index) get_device_index;
  decltype(&::ibv_open_device) open_device;
  decltype(&::ibv_close_device) close_device;
  decltype(&::ibv_import_device) import_device;
  decltype(&::ibv_query_device) query_device;
  int (*query_port)(ibv_context*, uint8_t, _compat_ibv_port_attr*);
  decltype(&::ibv_query_gid) query_gid;
  decltype(&::_ibv_query_gid_ex) query_gid_ex;
  decltype(&::_ibv_query_gid_table) query_gid_table;
  int (*query_gid_type)(ibv_context*, uint8_t, unsigned int, ibv_gid_type_sysfs*);
  decltype(&::ibv_query_pkey) query_pkey;
  decltype(&::ibv_alloc_pd) alloc_pd;
  decltype(&::ibv_dealloc_pd) dealloc_pd;
  decltype(&::ibv_import_pd) import_pd;
  decltype(&::ibv_unimport_pd) unimport_pd;
  ibv_mr* (*reg_mr)(ibv_pd*, void*, size_t, int);
  ibv_mr* (*reg_mr_iova)(ibv_pd*, void*, size_t, uint64_t, int);
  decltype(&::ibv_reg_mr_iova2) reg_mr_iova2;
  decltype(&::ibv_reg_dmabuf_mr) reg_dmabuf_mr;
  decltype(&::ibv_rereg_mr) rereg_mr;
  decltype(&::ibv_dereg_mr) dereg_mr;
  decltype(&::ibv_import_mr) import_mr;
  decltype(&::ibv_unimport_mr) unimport_mr;
  decltype(&::ibv_import_dm) import_dm;
  decltype(&::ibv_unimport_dm) unimport_dm;
  decltype(&::ibv_create_comp_channel) create_comp_channel;
  decltype(&::ibv_destroy_comp_channel) destroy_comp_channel;
  decltype(&::ibv_create_cq) create_cq;
  decltype(&::ibv_resize_cq) resize_cq;
  decltype(&::ibv_destroy_cq) destroy_cq;
  decltype(&::ibv_get_cq_event) get_cq_event;
  decltype(&::ibv_ack_cq_events) ack_cq_events;
  decltype(&::ibv_create_srq) create_srq;
  decltype(&::ibv_modify_srq) modify_srq;
  decltype(&::ibv_query_srq) query_srq;
  decltype(&::ibv_destroy_srq) destroy_srq;
  decltype(&::ibv_create_qp) create_qp;
  decltype(&::ibv_qp_to_qp_ex) qp_to_qp_ex;
  decltype(&::ibv_query_qp) query_qp;
  decltype(&::ibv_modify_qp) modify_qp;
  decltype(&::ibv_destroy_qp) destroy_qp;
  decltype(&::ibv_query_qp_data_in_order) query_qp_data_in_order;
  decltype(&::ibv_query_ece) query_ece;
  decltype(&::ibv_set_ece) set_ece;
  decltype(&::ibv_create_ah) create_ah;
  decltype(&::ibv_destroy_ah) destroy_ah;
  decltype(&::ibv_create_ah_from_wc) create_ah_from_wc;
  decltype(&::ibv_init_ah_from_wc) init_ah_from_wc;
  decltype(&::ibv_attach_mcast) attach_mcast;
  decltype(&::ibv_detach_mcast) detach_mcast;
  decltype(&::ibv_get_async_event) get_async_event;
  decltype(&::ibv_ack_async_event) ack_async_event;
};

const RealVerbs& Real();

// Set while a real libibverbs function runs on this thread. libibverbs calls its own exports
// through the PLT, so those calls reach the interposer: inside one, ibv_get_device_list must
// list only real devices (the real ibv_import_device, for one, walks that list as its own
// verbs_device structures).
class InRealCall {
 public:
  InRealCall() { ++depth_; }
  ~InRealCall() { --depth_; }
  InRealCall(const InRealCall&) = delete;
  InRealCall& operator=(const InRealCall&) = delete;
  static bool Active() { return depth_ > 0; }

 private:
  static thread_local int depth_;
};

}  // namespace swirl::soft_verbs

#endif  // SWIRL_TRANSPORT_SOFT_VERBS_REAL_VERBS_H_
