// Which libibverbs objects are the soft device's, for the interposer.
//
// Soft devices are presented after the real ones in every device list, one zeroed 4 KiB
// ibv_device block per name, created once and never freed (programs may keep them). A context
// opened on one is the soft device's own (transport/soft), owned here until ibv_close_device;
// every other object a program holds names its context, so "is this soft?" is always "is its
// context one of ours?". Everything here is the control path: a mutex and a hash lookup per
// call. The data path (post, poll, bind) never comes here: it is libibverbs' inline dispatch
// through the context's tables, which the soft device fills.

#ifndef SWIRL_TRANSPORT_SOFT_VERBS_REGISTRY_H_
#define SWIRL_TRANSPORT_SOFT_VERBS_REGISTRY_H_

#include <infiniband/verbs.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "base/mutex.h"
#include "transport/verbs/device_ops.h"

namespace swirl::soft_verbs {

class Registry {
 public:
  static Registry& Get();

  // The soft devices this process presents: SWIRL_SOFT_VERBS_DEVICES (comma-separated names,
  // soft0 .. soft9999; malformed names are left out with a warning), or soft0.
  const std::vector<ibv_device*>& devices() const { return devices_; }
  // The soft device's name, or null for any other device.
  const std::string* SoftDeviceName(const ibv_device* device) const;

  // A context on soft device `device` (one of devices()), or null with errno set.
  ibv_context* Open(ibv_device* device);
  // Closes a soft context (0), as libibverbs always does. With objects made on it still alive
  // (programs often exit without destroying everything), the context stays open, unreachable
  // by a program that follows the API, until the last of them is destroyed: freeing it under
  // them would turn a sloppy program's later destroy into a use after free.
  int Close(ibv_context* context);

  // The soft device behind `context`, or null if it is not a soft context.
  verbs::DeviceOps* Ops(const ibv_context* context) const;

  // Whether `fd` is (a duplicate of) a soft context's cmd_fd. A kernel context's cmd_fd is its
  // uverbs file; a soft context has none, so it gets an eventfd of its own, which programs may
  // dup and hand to ibv_import_device (rdma-core's shared-PD tests do) to be told EOPNOTSUPP.
  bool IsSoftCmdFd(int fd) const;

  // Objects alive on a soft context (PDs, MRs, CQs, QPs, SRQs, channels), for Close.
  void Created(const ibv_context* context);
  void Destroyed(const ibv_context* context);

  // The device lists handed out: ours, with the real list they extend (null if none).
  void AddList(ibv_device** ours, ibv_device** real);
  // Forgets `ours`; true and the real list if it was one of ours.
  bool TakeList(ibv_device** ours, ibv_device*** real);

 private:
  Registry();

  struct OpenContext {
    std::unique_ptr<verbs::DeviceOps> ops;
    // The device's own extended-create entries, which the context's verbs_context now routes
    // through Registry (so that what libibverbs' inline ibv_create_cq_ex/ibv_create_qp_ex make
    // counts as alive, like what the exported calls make).
    decltype(verbs_context::create_cq_ex) create_cq_ex = nullptr;
    decltype(verbs_context::create_qp_ex) create_qp_ex = nullptr;
    int cmd_fd = -1;  // ours, closed with the context
    int live_objects = 0;
    bool closed = false;  // ibv_close_device ran; freed once live_objects reaches 0
  };

  static ibv_cq_ex* CreateCqEx(ibv_context* context, ibv_cq_init_attr_ex* attr);
  static ibv_qp* CreateQpEx(ibv_context* context, ibv_qp_init_attr_ex* attr);

  // Drops a context's cmd_fd (closing it, forgetting its file).
  void ForgetLocked(OpenContext& open) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::vector<ibv_device*> devices_;  // fixed after construction
  std::vector<std::string> names_;    // devices_[i]'s name
  mutable swirl::Mutex mu_;
  absl::flat_hash_map<const ibv_context*, OpenContext> contexts_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<ibv_device**, ibv_device**> lists_ ABSL_GUARDED_BY(mu_);
  // (st_dev, st_ino) of each open soft context's cmd_fd.
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, int> cmd_fd_files_ ABSL_GUARDED_BY(mu_);
};

}  // namespace swirl::soft_verbs

#endif  // SWIRL_TRANSPORT_SOFT_VERBS_REGISTRY_H_
