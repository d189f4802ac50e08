#include "transport/soft_verbs/real_verbs.h"

#include <dlfcn.h>

#include <mutex>

namespace swirl::soft_verbs {

thread_local int InRealCall::depth_ = 0;

namespace {

template <typename F>
void Load(void* handle, const char* name, F* out) {
  *out = handle != nullptr ? reinterpret_cast<F>(dlsym(handle, name)) : nullptr;
}

RealVerbs LoadReal() {
  RealVerbs r{};
  // Already loaded (the interposer depends on it); RTLD_NOLOAD first so a process that has it
  // under another path keeps the one it has.
  void* h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
  Load(h, "ibv_get_device_list", &r.get_device_list);
  Load(h, "ibv_free_device_list", &r.free_device_list);
  Load(h, "ibv_get_device_name", &r.get_device_name);
  Load(h, "ibv_get_device_guid", &r.get_device_guid);
  Load(h, "ibv_get_device_index", &r.get_device_index);
  Load(h, "ibv_open_device", &r.open_device);
  Load(h, "ibv_close_device", &r.close_device);
  Load(h, "ibv_import_device", &r.import_device);
  Load(h, "ibv_query_device", &r.query_device);
  Load(h, "ibv_query_port", &r.query_port);
  Load(h, "ibv_query_gid", &r.query_gid);
  Load(h, "_ibv_query_gid_ex", &r.query_gid_ex);
  Load(h, "_ibv_query_gid_table", &r.query_gid_table);
  Load(h, "ibv_query_gid_type", &r.query_gid_type);
  Load(h, "ibv_query_pkey", &r.query_pkey);
  Load(h, "ibv_alloc_pd", &r.alloc_pd);
  Load(h, "ibv_dealloc_pd", &r.dealloc_pd);
  Load(h, "ibv_import_pd", &r.import_pd);
  Load(h, "ibv_unimport_pd", &r.unimport_pd);
  Load(h, "ibv_reg_mr", &r.reg_mr);
  Load(h, "ibv_reg_mr_iova", &r.reg_mr_iova);
  Load(h, "ibv_reg_mr_iova2", &r.reg_mr_iova2);
  Load(h, "ibv_reg_dmabuf_mr", &r.reg_dmabuf_mr);
  Load(h, "ibv_rereg_mr", &r.rereg_mr);
  Load(h, "ibv_dereg_mr", &r.dereg_mr);
  Load(h, "ibv_import_mr", &r.import_mr);
  Load(h, "ibv_unimport_mr", &r.unimport_mr);
  Load(h, "ibv_import_dm", &r.import_dm);
  Load(h, "ibv_unimport_dm", &r.unimport_dm);
  Load(h, "ibv_create_comp_channel", &r.create_comp_channel);
  Load(h, "ibv_destroy_comp_channel", &r.destroy_comp_channel);
  Load(h, "ibv_create_cq", &r.create_cq);
  Load(h, "ibv_resize_cq", &r.resize_cq);
  Load(h, "ibv_destroy_cq", &r.destroy_cq);
  Load(h, "ibv_get_cq_event", &r.get_cq_event);
  Load(h, "ibv_ack_cq_events", &r.ack_cq_events);
  Load(h, "ibv_create_srq", &r.create_srq);
  Load(h, "ibv_modify_srq", &r.modify_srq);
  Load(h, "ibv_query_srq", &r.query_srq);
  Load(h, "ibv_destroy_srq", &r.destroy_srq);
  Load(h, "ibv_create_qp", &r.create_qp);
  Load(h, "ibv_qp_to_qp_ex", &r.qp_to_qp_ex);
  Load(h, "ibv_query_qp", &r.query_qp);
  Load(h, "ibv_modify_qp", &r.modify_qp);
  Load(h, "ibv_destroy_qp", &r.destroy_qp);
  Load(h, "ibv_query_qp_data_in_order", &r.query_qp_data_in_order);
  Load(h, "ibv_query_ece", &r.query_ece);
  Load(h, "ibv_set_ece", &r.set_ece);
  Load(h, "ibv_create_ah", &r.create_ah);
  Load(h, "ibv_destroy_ah", &r.destroy_ah);
  Load(h, "ibv_create_ah_from_wc", &r.create_ah_from_wc);
  Load(h, "ibv_init_ah_from_wc", &r.init_ah_from_wc);
  Load(h, "ibv_attach_mcast", &r.attach_mcast);
  Load(h, "ibv_detach_mcast", &r.detach_mcast);
  Load(h, "ibv_get_async_event", &r.get_async_event);
  Load(h, "ibv_ack_async_event", &r.ack_async_event);
  return r;
}

}  // namespace

const RealVerbs& Real() {
  static const RealVerbs* real = new RealVerbs(LoadReal());
  return *real;
}

}  // namespace swirl::soft_verbs
