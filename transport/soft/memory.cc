// Memory regions and memory windows.

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

#include <algorithm>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "transport/soft/soft_device.h"
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

int ReregMr(ibv_mr* ibmr, int flags, ibv_pd* pd, void* addr, size_t length, int access) {
  auto* mr = static_cast<SoftMr*>(ibmr);
  SoftContext* sctx = ToSoft(mr->context);
  // libibverbs' checks (ibv_rereg_mr, verbs.c) and the kernel's (ib_uverbs_rereg_mr), which no
  // provider ever sees fail: something to change, known flags, a translation with an address and
  // a length, access flags only with CHANGE_ACCESS.
  const bool translation = flags & IBV_REREG_MR_CHANGE_TRANSLATION;
  const bool new_pd = flags & IBV_REREG_MR_CHANGE_PD;
  const bool new_access = flags & IBV_REREG_MR_CHANGE_ACCESS;
  if (flags == 0 || (flags & ~IBV_REREG_MR_FLAGS_SUPPORTED) ||
      (translation && (addr == nullptr || length == 0)) || (access != 0 && !new_access)) {
    return EINVAL;
  }
  if (new_pd && (pd == nullptr || pd->context != mr->context)) return EINVAL;
  if (new_access && (access & ~kSupportedAccess)) {
    return (access & (IBV_ACCESS_ON_DEMAND | IBV_ACCESS_ZERO_BASED)) ? EOPNOTSUPP : EINVAL;
  }
  const int final_access = new_access ? access : mr->entry->access;
  if ((final_access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
      !(final_access & IBV_ACCESS_LOCAL_WRITE)) {
    return EINVAL;  // as at registration (IB spec C10-10)
  }
  if (translation) {
    if (length > kMaxMrSize ||
        reinterpret_cast<uintptr_t>(addr) + length < reinterpret_cast<uintptr_t>(addr)) {
      return EINVAL;
    }
    if (!RangeMapped(addr, length)) return EFAULT;
  }
  ibv_pd* const old_pd = mr->pd;
  // The new PD counts the region from before it is moved in, so it cannot be freed under it.
  if (new_pd) static_cast<SoftPd*>(pd)->users.fetch_add(1, std::memory_order_relaxed);
  {
    swirl::MutexLock lock(&sctx->hca->mw_mu);  // slot metadata changes under it (see RegMr)
    KeyEntry* e = mr->entry;
    // Conceptually a deregistration and a registration (ibv_rereg_mr(3)), so it fails where
    // deregistration does: a window bound over the region keeps its own range and would go on
    // granting access to memory the region no longer covers, or in another PD.
    if (std::atomic_ref<uint32_t>(e->bound_windows).load(std::memory_order_acquire) != 0) {
      if (new_pd) static_cast<SoftPd*>(pd)->users.fetch_sub(1, std::memory_order_release);
      return EBUSY;
    }
    // The keys stay (as mlx5 keeps its mkey): the entry is unpublished, which waits out every
    // access in flight under the old attributes, changed, and published again.
    const uint32_t key = KeyTable::PublishedKey(e);
    KeyTable::Revoke(e);
    if (translation) {
      e->addr = reinterpret_cast<uint64_t>(addr);
      e->length = length;
    }
    if (new_pd) e->pd = pd;
    e->access = final_access;
    KeyTable::Publish(e, key);
  }
  if (new_pd) static_cast<SoftPd*>(old_pd)->users.fetch_sub(1, std::memory_order_release);
  // What libibverbs' wrapper updates after a provider succeeds.
  if (new_pd) mr->pd = pd;
  if (translation) {
    mr->addr = addr;
    mr->length = length;
  }
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
    if (mw->next != nullptr) sctx->hca->keys.Release(mw->next);
    // Slots it moved out of that still hold a binding of it: that binding dies with it.
    for (const auto& [slot, generation] : mw->left) {
      if (sctx->hca->keys.Extra(slot).generation != generation || slot->kind != KeyKind::kMw2) {
        continue;
      }
      KeyTable::Unbind(slot);
      sctx->hca->keys.Release(slot);
    }
  }
  static_cast<SoftPd*>(mw->pd)->users.fetch_sub(1, std::memory_order_release);
  delete mw;
  return 0;
}

// A fresh random slot per bind. A type 2 window's rkey is index | key byte, the index naming
// its slot in the key table, and libibverbs' convention (ibv_inc_rkey, as the kernel's
// ib_inc_rkey and every provider) lets the application choose only the key byte, in the slot
// the window was given at allocation: 8 random bits per rebind of one window. mw->rkey cannot
// carry more: a NIC never changes it for a type 2 bind, and programs (and the conformance
// suite) rely on that. So the extra bits come through FreshWindowRkey (soft_device.h): a free
// slot drawn at random and reserved for the window's next bind, whose rkey the application
// passes to that bind as it would pass ibv_inc_rkey's; the window moves there with the bind
// (about 31 random bits per bind: 17 of slot, 7 of the index's random high bits, 8 of key
// byte less the one value 0 would give a key of 0). A bind with an rkey of the window's own
// slot (ibv_inc_rkey) binds in place, as on any device. The slot left is released as soon as
// nothing is bound in it. Under mw_mu: binds, invalidations and deallocation of windows all
// change slots under it.
void PrepareType2Bind(SoftMw* mw, uint32_t rkey, SendWqe& w) {
  Hca* hca = ToSoft(mw->context)->hca;
  swirl::MutexLock lock(&hca->mw_mu);
  KeyTable& keys = hca->keys;
  std::erase_if(mw->left, [&keys](const std::pair<KeyEntry*, uint64_t>& slot) {
    return keys.Extra(slot.first).generation != slot.second || slot.first->kind != KeyKind::kMw2;
  });
  w.bind_from = nullptr;
  w.bind_from_generation = 0;
  if (mw->next != nullptr && (rkey >> 8) == mw->next->index) {
    KeyEntry* old = mw->entry;
    KeySlotExtra& left = keys.Extra(old);
    left.retired = true;
    mw->left.emplace_back(old, left.generation);
    w.bind_from = old;
    w.bind_from_generation = left.generation;
    // The lease belongs to the window, not to the slot.
    std::atomic_ref<int64_t>(keys.Extra(mw->next).deadline_ns)
        .store(std::atomic_ref<int64_t>(left.deadline_ns).load(std::memory_order_relaxed),
               std::memory_order_relaxed);
    mw->entry = mw->next;
    mw->next = nullptr;
  }
  w.bind_mw_entry = mw->entry;
  w.bind_mw_index = mw->entry->index;
}

absl::StatusOr<uint32_t> FreshWindowRkey(ibv_mw* ibmw) {
  if (ibmw == nullptr || !IsSoftContext(ibmw->context)) {
    return absl::UnimplementedError(
        "fresh window slots are a soft-device extension: use ibv_inc_rkey on this device");
  }
  auto* mw = static_cast<SoftMw*>(ibmw);
  if (mw->type != IBV_MW_TYPE_2) {
    return absl::InvalidArgumentError("only a type 2 window is bound with an rkey of its caller's");
  }
  Hca* hca = ToSoft(mw->context)->hca;
  swirl::MutexLock lock(&hca->mw_mu);
  // One reservation at a time: a newer one replaces it.
  if (mw->next != nullptr) hca->keys.Release(mw->next);
  mw->next = nullptr;
  absl::StatusOr<KeyEntry*> fresh = hca->keys.Allocate(KeyKind::kMw2);
  if (!fresh.ok()) return fresh.status();
  (*fresh)->pd = mw->pd;
  mw->next = *fresh;
  return hca->keys.NewKey(*fresh);
}

void ReleaseIfRetired(KeyTable& keys, KeyEntry* e) {
  if (keys.Extra(e).retired && e->kind == KeyKind::kMw2) keys.Release(e);
}

absl::Status SetWindowDeadline(ibv_mw* ibmw, absl::Time deadline) {
  if (ibmw == nullptr || !IsSoftContext(ibmw->context)) {
    return absl::UnimplementedError(
        "window leases are a soft-device extension: this window's device ignores them");
  }
  auto* mw = static_cast<SoftMw*>(ibmw);
  int64_t at = 0;  // InfiniteFuture: none
  if (deadline != absl::InfiniteFuture()) {
    // The device keeps time by CLOCK_MONOTONIC: the lease is the time left, from now.
    const absl::Duration left = deadline - absl::Now();
    at = left <= absl::ZeroDuration() ? 1 : NowNs() + std::max<int64_t>(absl::ToInt64Nanoseconds(left), 1);
  }
  SoftContext* sctx = ToSoft(mw->context);
  swirl::MutexLock lock(&sctx->hca->mw_mu);  // the window's slot may move under a bind (memory.cc)
  std::atomic_ref<int64_t>(sctx->hca->keys.Extra(mw->entry).deadline_ns)
      .store(at, std::memory_order_relaxed);
  return absl::OkStatus();
}

}  // namespace swirl::soft
