// Memory regions and memory windows.

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

#include "transport/soft/soft_internal.h"

namespace swirl::soft {
namespace {

constexpr int kSupportedAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                 IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |
                                 IBV_ACCESS_MW_BIND | IBV_ACCESS_RELAXED_ORDERING;

// Real providers pin the pages and fail with EFAULT when the range is not mapped; mincore gives
// the same answer without pinning.
bool RangeMapped(void* addr, size_t length) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  uintptr_t start = reinterpret_cast<uintptr_t>(addr) & ~(page - 1);
  uintptr_t end = reinterpret_cast<uintptr_t>(addr) + length;
  unsigned char vec[256];
  while (start < end) {
    size_t pages = (end - start + page - 1) / page;
    if (pages > sizeof(vec)) pages = sizeof(vec);
    if (mincore(reinterpret_cast<void*>(start), pages * page, vec) != 0) return false;
    start += pages * page;
  }
  return true;
}

}  // namespace

int RegMr(SoftContext* sctx, ibv_pd* pd, void* addr, size_t length, int access, ibv_mr** out) {
  if (pd == nullptr || pd->context != &sctx->vctx.context) return EINVAL;
  if (access & ~kSupportedAccess) {
    return (access & (IBV_ACCESS_ON_DEMAND | IBV_ACCESS_ZERO_BASED)) ? EOPNOTSUPP : EINVAL;
  }
  // Remote write and atomics need local write (IB spec C10-10; every provider checks).
  if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
      !(access & IBV_ACCESS_LOCAL_WRITE)) {
    return EINVAL;
  }
  if (length == 0 || length > kMaxMrSize || addr == nullptr) return EINVAL;
  if (reinterpret_cast<uintptr_t>(addr) + length < reinterpret_cast<uintptr_t>(addr)) return EINVAL;
  if (!RangeMapped(addr, length)) return EFAULT;

  // Slot metadata changes under the window lock: a bind queued before a deregistration reads it
  // there to learn whether its region still exists (ExecuteLocalOp).
  swirl::MutexLock lock(&sctx->hca->mw_mu);
  absl::StatusOr<KeyEntry*> entry = sctx->hca->keys.Allocate(KeyKind::kMr);
  if (!entry.ok()) return ENOMEM;
  KeyEntry* e = *entry;
  e->access = access;
  e->addr = reinterpret_cast<uint64_t>(addr);
  e->length = length;
  e->pd = pd;
  auto* mr = new SoftMr{};
  mr->context = pd->context;
  mr->pd = pd;
  mr->addr = addr;
  mr->length = length;
  mr->handle = e->index;
  mr->lkey = mr->rkey = sctx->hca->keys.NewKey(e);
  mr->entry = e;
  KeyTable::Publish(e, mr->lkey);
  static_cast<SoftPd*>(pd)->users.fetch_add(1, std::memory_order_relaxed);
  *out = mr;
  return 0;
}

int DeregMr(ibv_mr* ibmr) {
  auto* mr = static_cast<SoftMr*>(ibmr);
  SoftContext* sctx = ToSoft(mr->context);
  {
    // Under the window lock: a bind either finished before (and is counted) or runs after,
    // and then finds the MR's key revoked.
    swirl::MutexLock lock(&sctx->hca->mw_mu);
    if (std::atomic_ref<uint32_t>(mr->entry->bound_windows).load(std::memory_order_acquire) !=
        0) {
      return EBUSY;  // windows are bound over it (IB spec: deregistration fails)
    }
    sctx->hca->keys.Release(mr->entry);
  }
  static_cast<SoftPd*>(mr->pd)->users.fetch_sub(1, std::memory_order_release);
  delete mr;
  return 0;
}

ibv_mw* AllocMw(ibv_pd* pd, ibv_mw_type type) {
  SoftContext* sctx = ToSoft(pd->context);
  if (type != IBV_MW_TYPE_1 && type != IBV_MW_TYPE_2) {
    errno = EINVAL;
    return nullptr;
  }
  swirl::MutexLock lock(&sctx->hca->mw_mu);  // slot metadata changes under it (see RegMr)
  absl::StatusOr<KeyEntry*> entry =
      sctx->hca->keys.Allocate(type == IBV_MW_TYPE_1 ? KeyKind::kMw1 : KeyKind::kMw2);
  if (!entry.ok()) {
    errno = ENOMEM;
    return nullptr;
  }
  KeyEntry* e = *entry;
  e->pd = pd;
  auto* mw = new SoftMw{};
  mw->context = pd->context;
  mw->pd = pd;
  mw->type = type;
  mw->handle = e->index;
  mw->rkey = sctx->hca->keys.NewKey(e);
  mw->entry = e;
  // A type 1 window starts valid with zero length (no access can succeed); a type 2 window
  // starts free, with no key published until it is bound.
  if (type == IBV_MW_TYPE_1) KeyTable::Publish(e, mw->rkey);
  static_cast<SoftPd*>(pd)->users.fetch_add(1, std::memory_order_relaxed);
  return mw;
}

int DeallocMw(ibv_mw* ibmw) {
  auto* mw = static_cast<SoftMw*>(ibmw);
  SoftContext* sctx = ToSoft(mw->context);
  KeyEntry* e = mw->entry;
  {
    // Under the window lock, like every other change of a window: a remote invalidation of
    // this window racing the dealloc either finished first or finds the key gone.
    swirl::MutexLock lock(&sctx->hca->mw_mu);
    KeyTable::Unbind(e);
    sctx->hca->keys.Release(e);
  }
  static_cast<SoftPd*>(mw->pd)->users.fetch_sub(1, std::memory_order_release);
  delete mw;
  return 0;
}

}  // namespace swirl::soft
