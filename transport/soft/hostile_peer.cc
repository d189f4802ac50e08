#include "transport/soft/hostile_peer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "absl/time/clock.h"
#include "transport/soft/soft_device.h"

namespace swirl::soft::hostile {

using verbs::CompletionQueue;
using verbs::Context;
using verbs::MemoryRegion;
using verbs::MemoryWindow;
using verbs::ProtectionDomain;
using verbs::QueuePair;

int64_t GuardedRegion::FirstGuardWritten() const {
  const size_t lead = FirstMismatch(mem.data(), kGuard, kGuardByte);
  if (lead != kGuard) return static_cast<int64_t>(lead);
  const size_t trail = FirstMismatch(mem.data() + kGuard + kRegion, kGuard, kGuardByte);
  if (trail != kGuard) return static_cast<int64_t>(kGuard + kRegion + trail);
  return -1;
}

bool Linked(SoftQp* qp) {
  std::lock_guard<QpLock> lock(qp->lock);
  return qp->linked;
}

std::unique_ptr<Pair> MakePair(bool post_recvs, const verbs::ConnectOptions& options) {
  auto p = std::make_unique<Pair>();
  p->a_ctx = Context::Wrap(*OpenSoftDevice("soft0"));
  p->b_ctx = Context::Wrap(*OpenSoftDevice("soft1"));
  p->a_pd = *ProtectionDomain::Create(p->a_ctx);
  p->b_pd = *ProtectionDomain::Create(p->b_ctx);
  p->a_cq = *CompletionQueue::Create(p->a_ctx, 64);
  p->b_send_cq = *CompletionQueue::Create(p->b_ctx, 64);
  p->b_recv_cq = *CompletionQueue::Create(p->b_ctx, 64);
  verbs::QueuePairConfig a_config;
  a_config.send_cq = a_config.recv_cq = p->a_cq;
  p->a_qp = *QueuePair::Create(p->a_pd, a_config);
  verbs::QueuePairConfig b_config;
  b_config.send_cq = p->b_send_cq;
  b_config.recv_cq = p->b_recv_cq;
  p->b_qp = *QueuePair::Create(p->b_pd, b_config);
  constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                          IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_MW_BIND;
  for (auto [mem, pd] : {std::pair{&p->a_mem, p->a_pd}, std::pair{&p->b_mem, p->b_pd}}) {
    std::memset(mem->region(), kFillByte, kRegion);
    mem->mr = *MemoryRegion::Register(pd, mem->region(), kRegion, kAccess);
  }

  auto aa = *p->a_qp->LocalAddress(100, options);
  auto ba = *p->b_qp->LocalAddress(200, options);
  if (!p->a_qp->Connect(ba, 100, options).ok() || !p->b_qp->Connect(aa, 200, options).ok()) {
    ADD_FAILURE() << "connect failed";
    return nullptr;
  }
  // The segments are exchanged by the HCA threads; polling adopts them.
  const absl::Time deadline = absl::Now() + absl::Seconds(3);
  while (!(Linked(p->a()) && Linked(p->b()))) {
    if (absl::Now() > deadline) {
      ADD_FAILURE() << "QPs not linked within 3 s";
      return nullptr;
    }
    p->a_cq->Poll(0, nullptr);
    p->b_recv_cq->Poll(0, nullptr);
  }

  if (!post_recvs) return p;
  ibv_sge s1{p->addr(kRecv1Offset), kRecv1Length, p->b_mem.mr->lkey()};
  ibv_sge s2{p->addr(kRecv2Offset), kRecv2Length, p->b_mem.mr->lkey()};
  ibv_recv_wr r2{kRecvWrId2, nullptr, &s2, 1};
  ibv_recv_wr r1{kRecvWrId1, &r2, &s1, 1};
  ibv_recv_wr* bad = nullptr;
  if (ibv_post_recv(p->b_qp->get(), &r1, &bad) != 0) {
    ADD_FAILURE() << "post_recv failed";
    return nullptr;
  }
  return p;
}

uint64_t Inject(SoftQp* qp, const Frame& f, Ring ring) {
  const std::optional<uint64_t> pos = TryInject(qp, f, ring);
  if (!pos) {
    ADD_FAILURE() << "no room for " << (f.reserve != 0 ? f.reserve : wire::FrameBytes(f.op, f.length))
                  << " bytes in the ring";
    return ~uint64_t{0};
  }
  return *pos;
}

std::optional<uint64_t> TryInject(SoftQp* qp, const Frame& f, Ring ring) {
  std::lock_guard<QpLock> lock(qp->lock);
  RingWriter& tx = ring == Ring::kRequest ? qp->req_tx : qp->resp_tx;
  const bool with_ext = f.extension || wire::HasRemoteExtension(f.op);
  const uint64_t bytes = f.reserve != 0 ? f.reserve : wire::FrameBytes(f.op, f.length);
  uint64_t pos = 0;
  char* frame = tx.Reserve(bytes, &pos, qp->expected_msn);
  if (frame == nullptr) return std::nullopt;
  auto* h = reinterpret_cast<wire::FrameHeader*>(frame);
  h->op = f.op;
  h->flags = f.flags;
  h->rnr_retry = ring == Ring::kRequest ? qp->attr.rnr_retry : 0;
  h->reserved = 0;
  h->length = f.length;
  h->msn = f.msn;
  h->ack = f.ack.value_or(qp->expected_msn);
  h->imm_or_inv = f.imm_or_inv;
  h->total_length = f.total_length;
  char* p = frame + sizeof(wire::FrameHeader);
  if (with_ext) {
    std::memcpy(p, &f.ext, sizeof(f.ext));
    p += sizeof(f.ext);
  }
  // The payload, as far as the frame reaches (a frame may claim more than it holds).
  const uint64_t room = bytes - static_cast<uint64_t>(p - frame);
  std::memset(p, f.fill, std::min<uint64_t>(f.length, room));
  tx.Commit(frame, pos, bytes);
  PublishAndWake(qp, true);
  return pos;
}

uint32_t TakeMsn(SoftQp* a) {
  std::lock_guard<QpLock> lock(a->lock);
  const uint32_t msn = a->next_msn;
  a->next_msn = wire::NextMsn(msn);
  return msn;
}

bool RecordOutstanding(SoftQp* a, uint64_t wr_id, uint32_t msn, ibv_wr_opcode opcode,
                       uint32_t length) {
  std::lock_guard<QpLock> lock(a->lock);
  if (a->sq_tail - a->sq_released.load() >= a->max_send_wr) return false;
  SendWqe& w = a->sq[a->sq_tail & a->sq_mask];
  std::memset(&w, 0, sizeof(w));
  w.wr_id = wr_id;
  w.opcode = opcode;
  w.send_flags = IBV_SEND_SIGNALED;
  w.state = SendWqe::kAwaiting;
  w.has_msn = true;
  w.status = IBV_WC_SUCCESS;
  w.msn = msn;
  w.length = length;
  w.sent = length;
  if (opcode == IBV_WR_RDMA_READ || opcode == IBV_WR_ATOMIC_FETCH_AND_ADD ||
      opcode == IBV_WR_ATOMIC_CMP_AND_SWP) {
    ++a->rd_atomic_outstanding;
  }
  a->newest_signaled = a->sq_tail;
  ++a->sq_tail;
  ++a->sq_tx;
  return true;
}

ibv_qp_state State(QueuePair& qp) {
  absl::StatusOr<ibv_qp_state> s = qp.QueryState();
  return s.ok() ? *s : IBV_QPS_UNKNOWN;
}

void PollAll(Pair& p) {
  ibv_wc wc[8];
  for (int n = p.b_recv_cq->Poll(8, wc); n > 0; n = p.b_recv_cq->Poll(8, wc)) {
    p.b_recv_wcs.insert(p.b_recv_wcs.end(), wc, wc + n);
  }
  for (int n = p.b_send_cq->Poll(8, wc); n > 0; n = p.b_send_cq->Poll(8, wc)) {
    p.b_send_wcs.insert(p.b_send_wcs.end(), wc, wc + n);
  }
  for (int n = p.a_cq->Poll(8, wc); n > 0; n = p.a_cq->Poll(8, wc)) {
    p.a_wcs.insert(p.a_wcs.end(), wc, wc + n);
  }
}

void PollA(Pair& p) {
  ibv_wc wc[8];
  for (int n = p.a_cq->Poll(8, wc); n > 0; n = p.a_cq->Poll(8, wc)) {
    p.a_wcs.insert(p.a_wcs.end(), wc, wc + n);
  }
}

bool PostRequest(Pair& p, uint64_t wr_id, ibv_wr_opcode opcode, uint64_t offset,
                 uint32_t length, uint32_t lkey) {
  ibv_sge sge{p.a_addr(static_cast<int64_t>(offset)), length, lkey != 0 ? lkey : p.a_lkey()};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.opcode = opcode;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  if (opcode == IBV_WR_ATOMIC_FETCH_AND_ADD || opcode == IBV_WR_ATOMIC_CMP_AND_SWP) {
    wr.wr.atomic.remote_addr = p.addr(static_cast<int64_t>(offset));
    wr.wr.atomic.rkey = p.rkey();
    wr.wr.atomic.compare_add = 1;
  } else {
    wr.wr.rdma.remote_addr = p.addr(static_cast<int64_t>(offset));
    wr.wr.rdma.rkey = p.rkey();
  }
  ibv_send_wr* bad = nullptr;
  return ibv_post_send(p.a_qp->get(), &wr, &bad) == 0;
}

uint32_t MsnOf(Pair& p, uint64_t wr_id) {
  SoftQp* a = p.a();
  std::lock_guard<QpLock> lock(a->lock);
  for (uint32_t i = a->sq_head; i != a->sq_tail; ++i) {
    const SendWqe& w = a->sq[i & a->sq_mask];
    if (w.wr_id == wr_id && w.has_msn) return w.msn;
  }
  ADD_FAILURE() << "request " << wr_id << " has no MSN";
  return 0;
}

void Publish(Pair& p, wire::Published wire::SegmentControl::*word, uint64_t value) {
  std::lock_guard<QpLock> lock(p.b()->lock);
  wire::SharedRelease();
  (p.b()->own_ctrl->*word).value.store(value, std::memory_order_release);
}

size_t FirstMismatch(const char* p, size_t n, char want) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != want) return i;
  }
  return n;
}

bool BystanderRoundTrip(Pair& by, uint64_t i) {
  ibv_sge rs{by.addr(0), 64, by.b_mem.mr->lkey()};
  ibv_recv_wr rwr{i, nullptr, &rs, 1};
  ibv_recv_wr* rbad = nullptr;
  if (ibv_post_recv(by.b_qp->get(), &rwr, &rbad) != 0) return false;
  ibv_send_wr swr{};  // zero-length, with an immediate
  swr.wr_id = i;
  swr.opcode = IBV_WR_SEND_WITH_IMM;
  swr.imm_data = static_cast<uint32_t>(i);
  swr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* sbad = nullptr;
  if (ibv_post_send(by.a_qp->get(), &swr, &sbad) != 0) return false;
  const absl::Time deadline = absl::Now() + absl::Seconds(3);
  by.a_wcs.clear();
  by.b_recv_wcs.clear();
  while ((by.a_wcs.empty() || by.b_recv_wcs.empty()) && absl::Now() < deadline) PollAll(by);
  return by.a_wcs.size() == 1 && by.a_wcs[0].status == IBV_WC_SUCCESS &&
         by.b_recv_wcs.size() == 1 && by.b_recv_wcs[0].status == IBV_WC_SUCCESS &&
         by.b_recv_wcs[0].wr_id == i && by.b_recv_wcs[0].imm_data == static_cast<uint32_t>(i);
}

bool BindWindow(Pair& p, uint64_t offset, uint64_t length, unsigned int access,
                std::unique_ptr<MemoryWindow>* mw, uint32_t* rkey) {
  auto allocated = MemoryWindow::Allocate(p.b_pd, IBV_MW_TYPE_2);
  if (!allocated.ok()) {
    ADD_FAILURE() << allocated.status();
    return false;
  }
  *mw = std::move(*allocated);
  *rkey = ibv_inc_rkey((*mw)->rkey());
  ibv_send_wr bind{};
  bind.wr_id = 0xb1d;
  bind.opcode = IBV_WR_BIND_MW;
  bind.send_flags = IBV_SEND_SIGNALED;
  bind.bind_mw.mw = (*mw)->get();
  bind.bind_mw.rkey = *rkey;
  bind.bind_mw.bind_info.mr = p.b_mem.mr->get();
  bind.bind_mw.bind_info.addr = p.addr(static_cast<int64_t>(offset));
  bind.bind_mw.bind_info.length = length;
  bind.bind_mw.bind_info.mw_access_flags = access;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(p.b_qp->get(), &bind, &bad) != 0) {
    ADD_FAILURE() << "post of the bind failed";
    return false;
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(3);
  while (p.b_send_wcs.empty() && absl::Now() < deadline) PollAll(p);
  if (p.b_send_wcs.size() != 1 || p.b_send_wcs[0].status != IBV_WC_SUCCESS) {
    ADD_FAILURE() << "the bind did not complete successfully";
    return false;
  }
  p.b_send_wcs.clear();
  return true;
}

}  // namespace swirl::soft::hostile
