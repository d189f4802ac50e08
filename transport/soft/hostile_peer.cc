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

std::unique_ptr<Pair> MakePair(bool post_recvs) {
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

  verbs::ConnectOptions options;
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
  std::lock_guard<QpLock> lock(qp->lock);
  RingWriter& tx = ring == Ring::kRequest ? qp->req_tx : qp->resp_tx;
  const bool with_ext = f.extension || wire::HasRemoteExtension(f.op);
  const uint64_t bytes = f.reserve != 0 ? f.reserve : wire::FrameBytes(f.op, f.length);
  uint64_t pos = 0;
  char* frame = tx.Reserve(bytes, &pos, qp->expected_msn);
  if (frame == nullptr) {
    ADD_FAILURE() << "no room for " << bytes << " bytes in the ring";
    return ~uint64_t{0};
  }
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

}  // namespace swirl::soft::hostile
