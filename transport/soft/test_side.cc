#include "transport/soft/test_side.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "transport/soft/soft_device.h"

namespace swirl::soft {

Side MakeSide(const char* name, const SideOptions& options) {
  Side s;
  s.ctx = verbs::Context::Wrap(*OpenSoftDevice(name));
  s.pd = *verbs::ProtectionDomain::Create(s.ctx);
  s.cq = *verbs::CompletionQueue::Create(s.ctx, options.cq_entries);
  verbs::QueuePairConfig config;
  config.send_cq = s.cq;
  config.recv_cq = s.cq;
  config.max_inline_data = options.max_inline_data;
  config.max_send_wr = options.max_send_wr;
  config.send_ops_flags = options.send_ops_flags;
  s.qp = *verbs::QueuePair::Create(s.pd, config);
  s.buf.resize(options.buffer_size);
  s.mr = *verbs::MemoryRegion::Register(s.pd, s.buf.data(), s.buf.size(), options.mr_access);
  return s;
}

absl::Status ConnectSides(Side& a, Side& b, const verbs::ConnectOptions& options) {
  absl::StatusOr<verbs::PeerAddress> aa = a.qp->LocalAddress(100, options);
  if (!aa.ok()) return aa.status();
  absl::StatusOr<verbs::PeerAddress> ba = b.qp->LocalAddress(200, options);
  if (!ba.ok()) return ba.status();
  if (absl::Status s = a.qp->Connect(*ba, 100, options); !s.ok()) return s;
  return b.qp->Connect(*aa, 200, options);
}

absl::Status PostBufferRecv(Side& s, uint64_t wr_id) {
  ibv_sge sge{reinterpret_cast<uint64_t>(s.buf.data()), 4096, s.mr->lkey()};
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad;
  const int rc = ibv_post_recv(s.qp->get(), &wr, &bad);
  return rc == 0 ? absl::OkStatus() : absl::InternalError(absl::StrCat("ibv_post_recv: ", rc));
}

absl::Status PostInlineSend(Side& s, uint64_t wr_id, const char* text) {
  ibv_sge sge{reinterpret_cast<uint64_t>(text), static_cast<uint32_t>(std::strlen(text) + 1), 0};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_send_wr* bad;
  const int rc = ibv_post_send(s.qp->get(), &wr, &bad);
  return rc == 0 ? absl::OkStatus() : absl::InternalError(absl::StrCat("ibv_post_send: ", rc));
}

}  // namespace swirl::soft
