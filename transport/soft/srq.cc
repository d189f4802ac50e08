// Shared receive queues: ibv_modify_srq (resizing, the limit event) and ibv_query_srq.

#include <cerrno>
#include <cstring>
#include <mutex>

#include "transport/soft/soft_internal.h"

namespace swirl::soft {

int ModifySrq(ibv_srq* ibsrq, ibv_srq_attr* attr, int mask) {
  auto* srq = static_cast<SoftSrq*>(ibsrq);
  if (mask & ~(IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT)) return EINVAL;
  const bool resize = mask & IBV_SRQ_MAX_WR;
  const bool arm = mask & IBV_SRQ_LIMIT;
  if (resize && (attr->max_wr == 0 || attr->max_wr > kMaxSrqWr)) return EINVAL;
  // The new queue is allocated before taking the spin lock that receives take. max_sge never
  // changes (ibv_modify_srq(3): it is irrelevant here).
  RecvQueue resized;
  if (resize) resized.Init(attr->max_wr, srq->rq.max_sge);
  std::lock_guard<SpinLock> lock(srq->lock);
  RecvQueue& rq = srq->rq;
  const uint32_t max_wr = resize ? attr->max_wr : rq.capacity;
  // ibv_modify_srq(3): if any attribute is invalid, none is changed. The receives posted must
  // fit, and a limit (new or armed) cannot exceed the queue.
  if (rq.size() > max_wr || (arm && attr->srq_limit > max_wr) ||
      (!arm && srq->limit > max_wr)) {
    return EINVAL;
  }
  if (resize) {
    const uint32_t queued = rq.size();
    for (uint32_t i = 0; i < queued; ++i) {
      const uint32_t from = (rq.head + i) & rq.mask;
      resized.wr_id[i] = rq.wr_id[from];
      resized.num_sge[i] = rq.num_sge[from];
      std::memcpy(&resized.sge[static_cast<size_t>(i) * rq.max_sge],
                  &rq.sge[static_cast<size_t>(from) * rq.max_sge], rq.max_sge * sizeof(ibv_sge));
    }
    resized.tail = queued;
    std::swap(rq, resized);
  }
  // Arms (or, with 0, disarms) the low-watermark event: raised once, when a receive taken from
  // the queue leaves fewer than srq_limit (SoftSrq::CrossedLimit).
  if (arm) srq->limit = attr->srq_limit;
  return 0;
}

int QuerySrq(ibv_srq* ibsrq, ibv_srq_attr* attr) {
  auto* srq = static_cast<SoftSrq*>(ibsrq);
  std::lock_guard<SpinLock> lock(srq->lock);
  attr->max_wr = srq->rq.capacity;
  attr->max_sge = srq->rq.max_sge;
  attr->srq_limit = srq->limit;  // 0 once the event fired (ibv_query_srq(3))
  return 0;
}

void RaiseSrqLimitReached(SoftSrq* srq) {
  ibv_async_event event;
  std::memset(&event, 0, sizeof(event));
  event.event_type = IBV_EVENT_SRQ_LIMIT_REACHED;
  event.element.srq = srq;
  srq->sctx->RaiseAsyncEvent(event);
}

}  // namespace swirl::soft
