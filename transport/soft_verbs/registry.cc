#include "transport/soft_verbs/registry.h"

#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "transport/soft/soft_device.h"

namespace swirl::soft_verbs {

Registry& Registry::Get() {
  static Registry* registry = new Registry();  // never destroyed: programs exit holding objects
  return *registry;
}

Registry::Registry() {
  const char* env = std::getenv("SWIRL_SOFT_VERBS_DEVICES");
  std::vector<std::string> wanted;
  if (env != nullptr && *env != '\0') {
    for (absl::string_view name : absl::StrSplit(env, ',', absl::SkipWhitespace())) {
      name = absl::StripAsciiWhitespace(name);
      if (!soft::IsSoftDeviceName(name)) {
        std::fprintf(stderr, "swirl soft verbs: SWIRL_SOFT_VERBS_DEVICES: '%.*s' is not a soft "
                     "device name (soft0, soft1, ...); left out\n",
                     static_cast<int>(name.size()), name.data());
        continue;
      }
      bool seen = false;
      for (const std::string& w : wanted) seen |= w == name;
      if (!seen) wanted.emplace_back(name);
    }
  } else {
    wanted.emplace_back(soft::kDefaultSoftDeviceName);
  }
  for (const std::string& name : wanted) {
    ibv_device* device = soft::NewSoftDeviceBlock(name);
    if (device == nullptr) continue;
    devices_.push_back(device);
    names_.push_back(name);
  }
}

const std::string* Registry::SoftDeviceName(const ibv_device* device) const {
  for (size_t i = 0; i < devices_.size(); ++i) {
    if (devices_[i] == device) return &names_[i];
  }
  return nullptr;
}

ibv_context* Registry::Open(ibv_device* device) {
  const std::string* name = SoftDeviceName(device);
  if (name == nullptr) {
    errno = ENODEV;
    return nullptr;
  }
  auto ops = soft::OpenSoftDeviceAs(*name, device);
  if (!ops.ok()) {
    std::fprintf(stderr, "swirl soft verbs: cannot open %s: %s\n", name->c_str(),
                 std::string(ops.status().message()).c_str());
    errno = ops.status().code() == absl::StatusCode::kResourceExhausted ? ENOMEM : ENODEV;
    return nullptr;
  }
  ibv_context* context = (*ops)->context();
  const int cmd_fd = eventfd(0, EFD_CLOEXEC);
  struct stat st;
  if (cmd_fd < 0 || fstat(cmd_fd, &st) != 0) {
    if (cmd_fd >= 0) close(cmd_fd);
    errno = EMFILE;
    return nullptr;
  }
  context->cmd_fd = cmd_fd;
  verbs_context* vctx = verbs_get_ctx(context);
  swirl::MutexLock lock(&mu_);
  OpenContext& open = contexts_[context];
  open.ops = std::move(*ops);
  open.create_cq_ex = vctx->create_cq_ex;
  open.create_qp_ex = vctx->create_qp_ex;
  if (open.create_cq_ex != nullptr) vctx->create_cq_ex = &Registry::CreateCqEx;
  if (open.create_qp_ex != nullptr) vctx->create_qp_ex = &Registry::CreateQpEx;
  open.cmd_fd = cmd_fd;
  cmd_fd_files_[{st.st_dev, st.st_ino}] = cmd_fd;
  return context;
}

ibv_cq_ex* Registry::CreateCqEx(ibv_context* context, ibv_cq_init_attr_ex* attr) {
  Registry& r = Get();
  decltype(verbs_context::create_cq_ex) create = nullptr;
  {
    swirl::ReaderMutexLock lock(&r.mu_);
    auto it = r.contexts_.find(context);
    if (it != r.contexts_.end()) create = it->second.create_cq_ex;
  }
  if (create == nullptr) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  ibv_cq_ex* cq = create(context, attr);
  if (cq != nullptr) r.Created(context);
  return cq;
}

ibv_qp* Registry::CreateQpEx(ibv_context* context, ibv_qp_init_attr_ex* attr) {
  Registry& r = Get();
  decltype(verbs_context::create_qp_ex) create = nullptr;
  {
    swirl::ReaderMutexLock lock(&r.mu_);
    auto it = r.contexts_.find(context);
    if (it != r.contexts_.end()) create = it->second.create_qp_ex;
  }
  if (create == nullptr) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  ibv_qp* qp = create(context, attr);
  if (qp != nullptr) r.Created(context);
  return qp;
}

bool Registry::IsSoftCmdFd(int fd) const {
  struct stat st;
  if (fstat(fd, &st) != 0) return false;
  swirl::ReaderMutexLock lock(&mu_);
  return cmd_fd_files_.contains({st.st_dev, st.st_ino});
}

void Registry::ForgetLocked(OpenContext& open) {
  struct stat st;
  if (open.cmd_fd >= 0 && fstat(open.cmd_fd, &st) == 0) cmd_fd_files_.erase({st.st_dev, st.st_ino});
  if (open.cmd_fd >= 0) close(open.cmd_fd);
  open.cmd_fd = -1;
}

int Registry::Close(ibv_context* context) {
  std::unique_ptr<verbs::DeviceOps> ops;
  {
    swirl::MutexLock lock(&mu_);
    auto it = contexts_.find(context);
    if (it == contexts_.end() || it->second.closed) return ENODEV;
    if (it->second.live_objects > 0) {
      it->second.closed = true;
      return 0;
    }
    ForgetLocked(it->second);
    ops = std::move(it->second.ops);
    contexts_.erase(it);
  }
  return 0;  // ops closes the context here, outside the lock
}

verbs::DeviceOps* Registry::Ops(const ibv_context* context) const {
  if (context == nullptr) return nullptr;
  swirl::ReaderMutexLock lock(&mu_);
  auto it = contexts_.find(context);
  return it == contexts_.end() ? nullptr : it->second.ops.get();
}

void Registry::Created(const ibv_context* context) {
  swirl::MutexLock lock(&mu_);
  auto it = contexts_.find(context);
  if (it != contexts_.end()) ++it->second.live_objects;
}

void Registry::Destroyed(const ibv_context* context) {
  std::unique_ptr<verbs::DeviceOps> ops;
  {
    swirl::MutexLock lock(&mu_);
    auto it = contexts_.find(context);
    if (it == contexts_.end()) return;
    if (--it->second.live_objects > 0 || !it->second.closed) return;
    ForgetLocked(it->second);
    ops = std::move(it->second.ops);  // the last object of a closed context
    contexts_.erase(it);
  }
}

void Registry::AddList(ibv_device** ours, ibv_device** real) {
  swirl::MutexLock lock(&mu_);
  lists_[ours] = real;
}

bool Registry::TakeList(ibv_device** ours, ibv_device*** real) {
  swirl::MutexLock lock(&mu_);
  auto it = lists_.find(ours);
  if (it == lists_.end()) return false;
  *real = it->second;
  lists_.erase(it);
  return true;
}

}  // namespace swirl::soft_verbs
