// Completion queues and completion channels.

#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <vector>

#include "transport/soft/fabric.h"
#include "transport/soft/qp_ops.h"

namespace swirl::soft {
namespace {

// Progress for every QP completing into `cq`, so that polling a CQ is what moves its traffic.
// A QP another thread is working on right now is skipped, and so is the whole list while another
// poller walks it: that thread makes the progress. A QP whose idle hint still holds (QpLock) is
// skipped without taking its lock. Progress can block for a while (a peer's
// death unmaps and closes its link), and pollers of a shared CQ must not spin behind it.
// The fabric's share of a poll (SoftCq::pull_links; TCP: read the links). Out of line, so that
// the poll's test of the hook stays one compare with memory, as the flag it replaced was; the
// read it makes is a system call anyway.
[[gnu::noinline, gnu::cold]] void PullLinks(SoftCq* cq) { cq->pull_links(cq->sctx->hca); }

// Moves QPs that AttachQp left pending into cq->qps. attach_lock held.
// A new QP is about to link and carry its first messages: it joins the hot ones (newest first),
// or the walk would reach it only after every QP attached before it.
[[gnu::noinline]] void TakePendingAttach(SoftCq* cq) {
  std::lock_guard<SpinLock> guard(cq->pending_lock);
  cq->qps.insert(cq->qps.end(), cq->pending_attach.begin(), cq->pending_attach.end());
  SoftQp* hot[SoftCq::kHot];
  uint64_t seen[SoftCq::kHot];
  size_t count = 0;
  for (auto it = cq->pending_attach.rbegin();
       it != cq->pending_attach.rend() && count < SoftCq::kHot; ++it) {
    hot[count] = *it;
    seen[count++] = cq->walk_serial;
  }
  for (size_t i = 0; i < SoftCq::kHot && count < SoftCq::kHot; ++i) {
    if (cq->hot[i] == nullptr) continue;
    hot[count] = cq->hot[i];
    seen[count++] = cq->hot_seen[i];
  }
  std::fill(std::begin(cq->hot), std::end(cq->hot), nullptr);
  std::copy(hot, hot + count, cq->hot);
  std::copy(seen, seen + count, cq->hot_seen);
  cq->pending_attach.clear();
  cq->attach_pending.store(false, std::memory_order_relaxed);
}

void ProgressAttached(SoftCq* cq, PollSink* sink) {
  if (cq->attach_waiting.load(std::memory_order_relaxed) != 0) [[unlikely]] return;
  std::unique_lock<SpinLock> lock(cq->attach_lock, std::try_to_lock);
  if (!lock.owns_lock()) return;
  if (cq->attach_pending.load(std::memory_order_acquire)) [[unlikely]] TakePendingAttach(cq);
  const size_t n = cq->qps.size();
  if (n <= SoftCq::kPollWalk) [[likely]] {
    for (SoftQp* qp : cq->qps) {
      if (IdleWithoutLock(qp) || !qp->lock.try_lock()) continue;
      ProgressLocked(qp, sink);
      qp->lock.unlock();
    }
    return;
  }
  // Many QPs: the hot ones, then the next slice in turn (SoftCq::kPollWalk, or kPollWalkIdle
  // after polls that found nothing). A QP with work joins the hot ones at the front; one that
  // has had none for kHotPolls polls falls out of them.
  auto progress = [&](SoftQp* qp) {
    if (IdleWithoutLock(qp) || !qp->lock.try_lock()) return false;
    const bool did = ProgressLocked(qp, sink);
    qp->lock.unlock();
    return did;
  };
  const uint64_t serial = ++cq->walk_serial;
  SoftQp* busy[SoftCq::kHot];
  size_t busy_count = 0;
  SoftQp* warm[SoftCq::kHot];  // hot ones without work this time, still within kHotPolls
  uint64_t warm_seen[SoftCq::kHot];
  size_t warm_count = 0;
  for (size_t i = 0; i < SoftCq::kHot; ++i) {
    SoftQp* const qp = cq->hot[i];
    if (qp == nullptr) continue;
    cq->hot[i] = nullptr;
    if (progress(qp)) {
      busy[busy_count++] = qp;
    } else if (serial - cq->hot_seen[i] < SoftCq::kHotPolls) {
      warm_seen[warm_count] = cq->hot_seen[i];
      warm[warm_count++] = qp;
    }
  }
  const size_t walk = std::min(
      n, cq->idle_streak >= SoftCq::kIdleStreak ? SoftCq::kPollWalkIdle : SoftCq::kPollWalk);
  const size_t start = cq->walk_next >= n ? 0 : cq->walk_next;
  WalkPrefetched(
      walk,
      [&](size_t k) {
        const size_t j = start + k;  // walk <= n: laps at most once
        return cq->qps[j >= n ? j - n : j];
      },
      [&](SoftQp* qp) {
        if (progress(qp) && busy_count < SoftCq::kHot &&
            std::find(busy, busy + busy_count, qp) == busy + busy_count) {
          busy[busy_count++] = qp;
        }
      });
  cq->walk_next = start + walk >= n ? start + walk - n : start + walk;
  cq->idle_streak = busy_count > 0 ? 0 : cq->idle_streak + 1;
  // The busy ones (most recent first), then the warm ones the busy left room for; a QP both
  // busy and warm (the walk reached a warm one) is kept once.
  size_t out = 0;
  for (size_t i = 0; i < busy_count; ++i) {
    cq->hot[out] = busy[i];
    cq->hot_seen[out++] = serial;
  }
  for (size_t i = 0; i < warm_count && out < SoftCq::kHot; ++i) {
    if (std::find(busy, busy + busy_count, warm[i]) != busy + busy_count) continue;
    cq->hot[out] = warm[i];
    cq->hot_seen[out++] = warm_seen[i];
  }
}

}  // namespace

bool SoftCq::OverflowLocked() {
  if (overflowed.load(std::memory_order_relaxed)) return false;
  // Overflow: the CQ is in error from now on (IB spec 11.4.2.1), and the owner hears of it
  // asynchronously, as from a real device.
  overflowed.store(true, std::memory_order_relaxed);
  ibv_async_event event;
  std::memset(&event, 0, sizeof(event));
  event.event_type = IBV_EVENT_CQ_ERR;
  event.element.cq = ibv();
  sctx->RaiseAsyncEvent(event);
  return false;
}

void SoftCq::ReleaseSendSlots(SoftQp* qp, uint32_t sq_release) {
  qp->sq_released.store(sq_release, std::memory_order_release);
}

void SoftCq::NotifyIfArmed(bool solicited, ibv_wc_status status) {
  const int mode = armed.load(std::memory_order_acquire);
  if (mode != 0 && (mode == 2 || solicited || status != IBV_WC_SUCCESS)) {
    if (armed.exchange(0, std::memory_order_acq_rel) != 0 && sc != nullptr) sc->Notify(this);
  }
}

int CreateCq(SoftContext* sctx, int cqe, void* cq_context, ibv_comp_channel* channel,
             ibv_cq** out) {
  if (cqe <= 0 || static_cast<uint32_t>(cqe) > kMaxCqe) return EINVAL;
  if (channel != nullptr && channel->context != &sctx->vctx.context) return EINVAL;
  auto* cq = new SoftCq();
  cq->sctx = sctx;
  cq->sc = static_cast<SoftChannel*>(channel);
  cq->pull_links = sctx->hca->fabric->poll_hook();
  // Like mlx5: the ring is a power of two and the CQ holds one less than that.
  const uint32_t slots = std::bit_ceil<uint32_t>(static_cast<uint32_t>(cqe) + 1);
  cq->ring.resize(slots);
  cq->ring_mask = slots - 1;
  cq->context = &sctx->vctx.context;
  cq->channel = channel;
  cq->cq_context = cq_context;
  cq->cqe = static_cast<int>(slots - 1);
  cq->comp_events_completed = 0;
  cq->async_events_completed = 0;
  pthread_mutex_init(&cq->mutex, nullptr);
  pthread_cond_init(&cq->cond, nullptr);
  {
    swirl::MutexLock lock(&sctx->hca->mu);
    sctx->hca->cqs.push_back(cq);
  }
  if (channel != nullptr) channel->refcnt++;
  *out = cq->ibv();
  return 0;
}

int ResizeCq(ibv_cq* ibcq, int cqe) {
  SoftCq* cq = AsSoft(ibcq);
  if (cqe <= 0 || static_cast<uint32_t>(cqe) > kMaxCqe) return EINVAL;
  const uint32_t slots = std::bit_ceil<uint32_t>(static_cast<uint32_t>(cqe) + 1);
  CqeRing ring(slots);  // allocated before taking the spin lock every poll takes
  std::lock_guard<SpinLock> guard(cq->lock);
  const uint32_t queued = cq->tail - cq->head;
  // ibv_resize_cq(3): the new size must hold every completion not yet polled.
  if (static_cast<uint32_t>(cqe) < queued) return EINVAL;
  for (uint32_t i = 0; i < queued; ++i) ring[i] = cq->ring[(cq->head + i) & cq->ring_mask];
  cq->ring.swap(ring);
  cq->ring_mask = slots - 1;
  cq->head = 0;
  cq->tail = queued;
  cq->cqe = static_cast<int>(slots - 1);  // the overflow bound Push checks, under this lock
  return 0;
}

int DestroyCq(ibv_cq* ibcq) {
  SoftCq* cq = AsSoft(ibcq);
  if (cq->attached.load() != 0) return EBUSY;
  const bool acked = WaitForAsyncAcks(&cq->mutex, &cq->cond, &cq->async_events_completed,
                                      cq->sctx->EndAsyncEvents(cq), "CQ");
  {
    swirl::MutexLock lock(&cq->sctx->hca->mu);
    auto& cqs = cq->sctx->hca->cqs;
    cqs.erase(std::remove(cqs.begin(), cqs.end(), cq), cqs.end());
  }
  if (cq->sc != nullptr) {
    swirl::MutexLock lock(&cq->sc->mu);
    auto& events = cq->sc->events;
    events.erase(std::remove(events.begin(), events.end(), cq), events.end());
  }
  {
    // Like libibverbs: wait until every event handed out has been acknowledged.
    swirl::MutexLock lock(&cq->events_mu);
    while (cq->events_acked < cq->events_delivered) cq->events_cv.Wait(&cq->events_mu);
  }
  if (cq->sc != nullptr) cq->sc->refcnt--;
  if (!acked) return 0;  // left allocated: a late acknowledgement locks its mutex
  pthread_mutex_destroy(&cq->mutex);
  pthread_cond_destroy(&cq->cond);
  delete cq;
  return 0;
}

int PollCq(ibv_cq* ibcq, int n, ibv_wc* wc) {
  SoftCq* cq = AsSoft(ibcq);
  cq->polls.store(cq->polls.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  if (n < 0) return 0;
  // Progress first unless enough is already queued; ibv_poll_cq(cq, 0, ...) only progresses.
  // Receive completions that progress produces while the ring is empty come straight into
  // `wc` (they are the oldest there are); anything found in the ring is newer and follows.
  PollSink sink{cq, wc, static_cast<uint32_t>(n), 0};
  if (cq->pull_links != nullptr) PullLinks(cq);
  if (cq->depth.load(std::memory_order_relaxed) < static_cast<uint32_t>(n) || n == 0) {
    ProgressAttached(cq, &sink);
  }
  // Nothing queued, or the caller's array is full: done without the lock (a completion pushed
  // meanwhile is the next poll's, as it would be had it arrived a moment later).
  if ((sink.count > 0 && sink.count == static_cast<uint32_t>(n)) ||
      (cq->depth.load(std::memory_order_relaxed) == 0 &&
       !cq->overflowed.load(std::memory_order_relaxed))) {
    return static_cast<int>(sink.count);
  }
  std::lock_guard<SpinLock> guard(cq->lock);
  if (cq->overflowed.load(std::memory_order_relaxed)) {
    // Completions this poll already holds are returned; the error is the next poll's (an
    // overflowed CQ stays in error).
    if (sink.count > 0) return static_cast<int>(sink.count);
    errno = EOVERFLOW;
    return -1;
  }
  const uint32_t count =
      std::min<uint32_t>(static_cast<uint32_t>(n) - sink.count, cq->tail - cq->head);
  const uint32_t mask = cq->ring_mask;
  for (uint32_t i = 0; i < count; ++i) {
    const Cqe& e = cq->ring[(cq->head + i) & mask];
    wc[sink.count + i] = e.wc;
    if (e.qp != nullptr) SoftCq::ReleaseSendSlots(e.qp, e.sq_release);
  }
  cq->head += count;
  cq->depth.store(cq->tail - cq->head, std::memory_order_relaxed);
  return static_cast<int>(sink.count + count);
}

int ReqNotifyCq(ibv_cq* ibcq, int solicited_only) {
  SoftCq* cq = AsSoft(ibcq);
  cq->armed.store(solicited_only ? 1 : 2, std::memory_order_release);
  // The HCA thread now makes progress for this CQ until it fires.
  cq->sctx->hca->Kick();
  return 0;
}

int CreateChannel(SoftContext* sctx, ibv_comp_channel** out) {
  int fd = eventfd(0, EFD_SEMAPHORE | EFD_CLOEXEC);
  if (fd < 0) return errno;
  auto* channel = new SoftChannel();
  channel->context = &sctx->vctx.context;
  channel->fd = fd;
  channel->refcnt = 0;
  *out = channel;
  return 0;
}

int DestroyChannel(ibv_comp_channel* ibchannel) {
  auto* channel = static_cast<SoftChannel*>(ibchannel);
  if (channel->refcnt != 0) return EBUSY;
  close(channel->fd);
  delete channel;
  return 0;
}

int GetCqEvent(ibv_comp_channel* ibchannel, ibv_cq** out, void** cq_context) {
  auto* channel = static_cast<SoftChannel*>(ibchannel);
  for (;;) {
    uint64_t count;
    if (read(channel->fd, &count, sizeof(count)) != sizeof(count)) {
      return errno == 0 ? EIO : errno;
    }
    SoftCq* cq = nullptr;
    {
      swirl::MutexLock lock(&channel->mu);
      if (channel->events.empty()) continue;  // an event of a CQ destroyed since
      cq = channel->events.front();
      channel->events.pop_front();
    }
    {
      swirl::MutexLock lock(&cq->events_mu);
      ++cq->events_delivered;
    }
    *out = cq->ibv();
    *cq_context = cq->cq_context;
    return 0;
  }
}

void AckCqEvents(ibv_cq* ibcq, unsigned int count) {
  SoftCq* cq = AsSoft(ibcq);
  swirl::MutexLock lock(&cq->events_mu);
  cq->events_acked += count;
  cq->comp_events_completed += count;
  cq->events_cv.SignalAll();
}

namespace {

// Takes `cq`'s attach lock for a QP detaching. Pollers leave the lock to a waiter
// (attach_waiting), but one may be in the middle of a walk, or descheduled holding it: the
// waiter yields instead of spinning through its time slice. (Attaching never takes it:
// AttachQp leaves the QP pending for the next poll.)
void LockForAttach(SoftCq* cq) {
  cq->attach_waiting.fetch_add(1, std::memory_order_relaxed);
  for (int tries = 0; !cq->attach_lock.try_lock(); ++tries) {
    if (tries < 64) {
      CpuRelax();
    } else {
      sched_yield();
    }
  }
  cq->attach_waiting.fetch_sub(1, std::memory_order_relaxed);
}

}  // namespace

void AttachQp(SoftCq* cq, SoftQp* qp) {
  {
    std::lock_guard<SpinLock> guard(cq->pending_lock);
    cq->pending_attach.push_back(qp);
    cq->attach_pending.store(true, std::memory_order_release);
  }
  cq->attached.fetch_add(1);
}

void DetachQp(SoftCq* cq, SoftQp* qp) {
  LockForAttach(cq);
  std::lock_guard<SpinLock> lock(cq->attach_lock, std::adopt_lock);
  if (cq->attach_pending.load(std::memory_order_acquire)) TakePendingAttach(cq);
  cq->qps.erase(std::remove(cq->qps.begin(), cq->qps.end(), qp), cq->qps.end());
  std::replace(std::begin(cq->hot), std::end(cq->hot), qp, static_cast<SoftQp*>(nullptr));
  cq->attached.fetch_sub(1);
}

void PurgeQp(SoftCq* cq, SoftQp* qp) {
  std::lock_guard<SpinLock> guard(cq->lock);
  const uint32_t mask = cq->ring_mask;
  uint32_t kept = cq->head;
  for (uint32_t i = cq->head; i != cq->tail; ++i) {
    const Cqe& e = cq->ring[i & mask];
    if (e.qp == qp || e.wc.qp_num == qp->qp_num) continue;
    cq->ring[kept++ & mask] = e;
  }
  cq->tail = kept;
  cq->depth.store(cq->tail - cq->head, std::memory_order_relaxed);
}

}  // namespace swirl::soft
