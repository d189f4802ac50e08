#include "rpc/testing/rogue.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/control.grpc.pb.h"
#include "rpc/handshake.h"
#include "transport/device.h"

namespace swirl::testing {
namespace {

constexpr uint64_t kRecvTag = uint64_t{1} << 62;
constexpr uint32_t kPsn = 77;

}  // namespace

absl::Status RoguePeer::Open() {
  auto ctx = OpenDevice("");
  if (!ctx.ok()) return ctx.status();
  ctx_ = *ctx;
  auto pd = verbs::ProtectionDomain::Create(ctx_);
  if (!pd.ok()) return pd.status();
  pd_ = *pd;
  auto cq = verbs::CompletionQueue::Create(ctx_, 512);
  if (!cq.ok()) return cq.status();
  cq_ = *cq;
  verbs::QueuePairConfig config;
  config.send_cq = cq_;
  config.recv_cq = cq_;
  config.max_send_wr = 128;
  config.max_recv_wr = kRecvs;
  config.max_inline_data = 256;
  auto qp = verbs::QueuePair::Create(pd_, config);
  if (!qp.ok()) return qp.status();
  qp_ = std::move(*qp);
  recv_area_.assign(kRecvs * kRecvSize, '\0');
  scratch_.assign(kScratchBytes, '\0');
  auto recv_mr = verbs::MemoryRegion::Register(pd_, recv_area_.data(), recv_area_.size(),
                                               IBV_ACCESS_LOCAL_WRITE);
  if (!recv_mr.ok()) return recv_mr.status();
  recv_mr_ = std::move(*recv_mr);
  auto scratch_mr = verbs::MemoryRegion::Register(pd_, scratch_.data(), scratch_.size(),
                                                  IBV_ACCESS_LOCAL_WRITE);
  if (!scratch_mr.ok()) return scratch_mr.status();
  scratch_mr_ = std::move(*scratch_mr);
  verbs::ConnectOptions co;
  if (auto s = qp_->ToInit(co); !s.ok()) return s;
  for (int i = 0; i < kRecvs; ++i) {
    ibv_sge sge{reinterpret_cast<uint64_t>(recv_area_.data() + i * kRecvSize), kRecvSize,
                recv_mr_->lkey()};
    ibv_recv_wr wr{};
    wr.wr_id = kRecvTag | i;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad;
    if (int err = ibv_post_recv(qp_->get(), &wr, &bad); err != 0) {
      return absl::InternalError("ibv_post_recv");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<verbs::PeerAddress> RoguePeer::LocalAddress() {
  return qp_->LocalAddress(kPsn, verbs::ConnectOptions());
}

absl::Status RoguePeer::ConnectTo(const verbs::PeerAddress& peer, absl::string_view link_key) {
  if (!link_key.empty()) {
    if (auto s = qp_->SetLinkKey(absl::MakeConstSpan(
            reinterpret_cast<const uint8_t*>(link_key.data()), link_key.size()));
        !s.ok()) {
      return s;
    }
  }
  verbs::ConnectOptions co;
  if (auto s = qp_->ToRtr(peer, co); !s.ok()) return s;
  return qp_->ToRts(kPsn, co);
}

absl::Status RogueConnection::Connect(int port, const std::string& token,
                                      control::BulkMode bulk_mode, bool remote_invalidation) {
  if (auto s = Open(); !s.ok()) return s;
  auto local = LocalAddress();
  if (!local.ok()) return local.status();
  auto channel = grpc::CreateChannel(absl::StrCat(host_, ":", port),
                                     grpc::InsecureChannelCredentials());
  auto stub = control::Control::NewStub(channel);
  grpc::ClientContext gctx;
  gctx.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  gctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  control::ConnectRequest request;
  request.set_protocol_version(internal::kControlProtocolVersion);
  request.set_client_name("rogue");
  *request.mutable_address() = internal::ToProto(*local);
  control::Capabilities* caps = request.mutable_capabilities();
  caps->set_device_kind(verbs::DeviceKindName(context().kind()));
  caps->set_recv_credits(offered_credits_ != 0 ? std::min<uint32_t>(offered_credits_, kRecvs)
                                               : kRecvs);
  caps->set_recv_buffer_size(kRecvSize);
  caps->set_max_message_size(kRecvSize - sizeof(rpc_wire::MessageHeader));
  caps->set_remote_invalidation(remote_invalidation);
  caps->set_mw_type2(true);
  caps->set_eager_threshold(2048);
  caps->set_window_credits(8);
  caps->set_bulk_mode(bulk_mode);
  caps->set_max_bulk_size(kScratchBytes);
  caps->set_link_keys(link_key_use_ != LinkKeyUse::kUndeclared);
  if (tamper_request_) tamper_request_(request);
  control::ConnectResponse response;
  grpc::Status s = stub->Connect(&gctx, request, &response);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }
  negotiated_ = response.negotiated();
  auto server = internal::FromProto(response.address());
  if (!server.ok()) return server.status();
  link_key_ = response.link_key();
  switch (link_key_use_) {
    case LinkKeyUse::kUndeclared:
    case LinkKeyUse::kAsGiven:
      return ConnectTo(*server, link_key_);
    case LinkKeyUse::kWithout:
      return ConnectTo(*server);
    case LinkKeyUse::kWrong: {
      std::string wrong = link_key_;
      for (char& c : wrong) c = static_cast<char>(~c);
      return ConnectTo(*server, wrong.empty() ? std::string(internal::kLinkKeyBytes, 'w') : wrong);
    }
  }
  return absl::InternalError("unknown LinkKeyUse");
}

absl::StatusOr<uint64_t> RoguePeer::PostMessage(absl::string_view bytes,
                                                uint32_t invalidate_rkey) {
  if (bytes.size() > kMessageScratch) return absl::InvalidArgumentError("message too large");
  char* area = scratch_.data() + kRdmaScratch;
  std::memcpy(area, bytes.data(), bytes.size());
  ibv_sge sge{reinterpret_cast<uint64_t>(area), static_cast<uint32_t>(bytes.size()),
              scratch_mr_->lkey()};
  ibv_send_wr wr{};
  wr.wr_id = next_wr_++;
  wr.opcode = invalidate_rkey != 0 ? IBV_WR_SEND_WITH_INV : IBV_WR_SEND;
  wr.invalidate_rkey = invalidate_rkey;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_send_wr* bad;
  if (int err = ibv_post_send(qp_->get(), &wr, &bad); err != 0) {
    return absl::InternalError(absl::StrCat("ibv_post_send: ", err));
  }
  return wr.wr_id;
}

absl::Status RoguePeer::Send(const rpc_wire::MessageHeader& header,
                             absl::string_view payload, uint32_t invalidate_rkey) {
  std::string bytes(reinterpret_cast<const char*>(&header), sizeof(header));
  bytes.append(payload.data(), payload.size());
  auto wr_id = PostMessage(bytes, invalidate_rkey);
  if (!wr_id.ok()) return wr_id.status();
  auto wc = WaitSend(*wr_id, absl::Seconds(10));
  if (!wc.ok()) return wc.status();
  if (wc->status != IBV_WC_SUCCESS) {
    return absl::UnavailableError(
        absl::StrCat("send failed: ", ibv_wc_status_str(wc->status)));
  }
  return absl::OkStatus();
}

absl::Status RoguePeer::SendRaw(absl::string_view bytes) {
  auto wr_id = PostMessage(bytes, 0);
  if (!wr_id.ok()) return wr_id.status();
  unwatched_.insert(*wr_id);
  return absl::OkStatus();
}

absl::Status RoguePeer::Call(const char* method, absl::string_view payload, uint16_t flags,
                             uint32_t invalidate_rkey, uint64_t* request_id) {
  const uint64_t id = next_request_++;
  if (request_id != nullptr) *request_id = id;
  rpc_wire::MessageHeader h{.version = rpc_wire::kProtocolVersion,
                            .type = rpc_wire::kRequest,
                            .flags = flags,
                            .method_id = rpc_wire::MethodId(method),
                            .request_id = id,
                            .payload_len = static_cast<uint32_t>(payload.size())};
  return Send(h, payload, invalidate_rkey);
}

void RoguePeer::PollOnce() {
  ibv_wc wc[16];
  int n = cq_->Poll(16, wc);
  for (int i = 0; i < n; ++i) {
    if (wc[i].wr_id & kRecvTag) {
      const uint32_t index = static_cast<uint32_t>(wc[i].wr_id & ~kRecvTag);
      if (wc[i].status == IBV_WC_SUCCESS && wc[i].byte_len >= sizeof(rpc_wire::MessageHeader)) {
        Received r;
        const char* buffer = recv_area_.data() + index * kRecvSize;
        std::memcpy(&r.header, buffer, sizeof(r.header));
        r.payload.assign(buffer + sizeof(r.header), wc[i].byte_len - sizeof(r.header));
        r.wc_flags = wc[i].wc_flags;
        credits_received_ += r.header.credits;
        ++messages_received_;
        r.invalidated_rkey = wc[i].invalidated_rkey;
        inbox_.push_back(std::move(r));
        ibv_sge sge{reinterpret_cast<uint64_t>(buffer), kRecvSize, recv_mr_->lkey()};
        ibv_recv_wr wr{};
        wr.wr_id = wc[i].wr_id;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        ibv_recv_wr* bad;
        if (ibv_post_recv(qp_->get(), &wr, &bad) == 0) ++credits_owed_;
      }
    } else if (unwatched_.erase(wc[i].wr_id) == 0) {
      send_done_.push_back(wc[i]);
    }
  }
}

absl::StatusOr<ibv_wc> RoguePeer::WaitSend(uint64_t wr_id, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    PollOnce();
    for (size_t i = 0; i < send_done_.size(); ++i) {
      if (send_done_[i].wr_id == wr_id) {
        ibv_wc wc = send_done_[i];
        send_done_.erase(send_done_.begin() + i);
        return wc;
      }
    }
  }
  return absl::DeadlineExceededError("no completion");
}

absl::StatusOr<Received> RoguePeer::Receive(uint8_t type, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    PollOnce();
    for (size_t i = 0; i < inbox_.size(); ++i) {
      if (inbox_[i].header.type == type) {
        Received r = std::move(inbox_[i]);
        inbox_.erase(inbox_.begin() + i);
        return r;
      }
    }
  }
  return absl::DeadlineExceededError(absl::StrCat("no message of type ", type));
}

absl::StatusOr<rpc_wire::BulkDescriptor> RogueConnection::CallForDownload(
    const char* method, absl::string_view payload, uint64_t* request_id) {
  if (auto s = Call(method, payload, 0, 0, request_id); !s.ok()) return s;
  auto response = Receive(rpc_wire::kResponse);
  if (!response.ok()) return response.status();
  rpc_wire::BulkDescriptor d;
  if (!(response->header.flags & rpc_wire::kFlagBulk) || response->payload.size() < sizeof(d)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the response (status ", response->header.status, ") has no bulk data: ",
        response->payload));
  }
  std::memcpy(&d, response->payload.data(), sizeof(d));
  return d;
}

absl::StatusOr<std::vector<rpc_wire::BulkDescriptor>> RogueConnection::RequestWindows(
    uint32_t size, uint32_t count) {
  const rpc_wire::MessageHeader request{.version = rpc_wire::kProtocolVersion,
                                        .type = rpc_wire::kWindowGrant,
                                        .request_id = size,
                                        .aux = count};
  if (auto s = Send(request); !s.ok()) return s;
  auto grant = Receive(rpc_wire::kWindowGrant);
  if (!grant.ok()) return grant.status();
  std::vector<rpc_wire::BulkDescriptor> out(grant->payload.size() /
                                            sizeof(rpc_wire::BulkDescriptor));
  if (!out.empty()) std::memcpy(out.data(), grant->payload.data(), out.size() * sizeof(out[0]));
  return out;
}

absl::StatusOr<ibv_wc_status> RoguePeer::Read(uint64_t addr, uint32_t rkey, uint32_t length,
                                              std::string* out) {
  auto status = Rdma(IBV_WR_RDMA_READ, addr, rkey, length);
  if (status.ok() && *status == IBV_WC_SUCCESS && out != nullptr) {
    out->assign(scratch_.data(), length);
  }
  return status;
}

absl::StatusOr<ibv_wc_status> RoguePeer::Write(uint64_t addr, uint32_t rkey,
                                               absl::string_view data) {
  if (data.size() > kRdmaScratch) return absl::InvalidArgumentError("larger than the scratch");
  std::memcpy(scratch_.data(), data.data(), data.size());
  return Rdma(IBV_WR_RDMA_WRITE, addr, rkey, static_cast<uint32_t>(data.size()));
}

absl::StatusOr<ibv_wc_status> RoguePeer::Rdma(ibv_wr_opcode opcode, uint64_t addr,
                                              uint32_t rkey, uint32_t length) {
  if (length > kRdmaScratch) return absl::InvalidArgumentError("larger than the scratch");
  ibv_sge sge{reinterpret_cast<uint64_t>(scratch_.data()), length, scratch_mr_->lkey()};
  ibv_send_wr wr{};
  wr.wr_id = next_wr_++;
  wr.opcode = opcode;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.rdma.remote_addr = addr;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad;
  if (ibv_post_send(qp_->get(), &wr, &bad) != 0) return absl::InternalError("ibv_post_send");
  auto wc = WaitSend(wr.wr_id, absl::Seconds(10));
  if (!wc.ok()) return wc.status();
  return wc->status;
}

rpc_wire::BulkDescriptor RoguePeer::Expose(absl::string_view data) {
  if (exposed_mr_ == nullptr || exposed_.size() < data.size()) {
    windows_.clear();  // bound over the memory about to go
    exposed_mr_.reset();
    exposed_.assign(std::max<size_t>(data.size(), 4096), '\0');
    auto mr = verbs::MemoryRegion::Register(pd_, exposed_.data(), exposed_.size(),
                                            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
                                                IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_MW_BIND);
    if (!mr.ok()) return {};
    exposed_mr_ = std::move(*mr);
  }
  std::memcpy(exposed_.data(), data.data(), data.size());
  return {reinterpret_cast<uint64_t>(exposed_.data()), static_cast<uint32_t>(data.size()),
          exposed_mr_->rkey()};
}

rpc_wire::BulkDescriptor RoguePeer::ExposeWindow(absl::string_view data, int access) {
  rpc_wire::BulkDescriptor d = Expose(data);
  if (d.rkey == 0) return d;
  auto mw = verbs::MemoryWindow::Allocate(pd_, IBV_MW_TYPE_2);
  if (!mw.ok()) return {};
  const uint32_t rkey = ((*mw)->rkey() & ~0xffu) | (((*mw)->rkey() + 1) & 0xff);
  ibv_send_wr wr{};
  wr.wr_id = next_wr_++;
  wr.opcode = IBV_WR_BIND_MW;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.bind_mw.mw = (*mw)->get();
  wr.bind_mw.rkey = rkey;
  wr.bind_mw.bind_info.mr = exposed_mr_->get();
  wr.bind_mw.bind_info.addr = d.addr;
  wr.bind_mw.bind_info.length = d.length;
  wr.bind_mw.bind_info.mw_access_flags = static_cast<unsigned int>(access);
  ibv_send_wr* bad;
  if (ibv_post_send(qp_->get(), &wr, &bad) != 0) return {};
  auto wc = WaitSend(wr.wr_id, absl::Seconds(10));
  if (!wc.ok() || wc->status != IBV_WC_SUCCESS) return {};
  windows_.push_back(std::move(*mw));
  d.rkey = rkey;
  return d;
}

uint32_t RoguePeer::TakeCredits() {
  PollOnce();
  const uint32_t n = credits_received_;
  credits_received_ = 0;
  return n;
}

bool RoguePeer::CutOff(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Time ping_sent = absl::InfinitePast();
  bool ping_out = false;
  while (absl::Now() < deadline) {
    PollOnce();
    auto state = qp_->QueryState();
    if (state.ok() && *state == IBV_QPS_ERR) return true;
    for (size_t i = 0; i < inbox_.size(); ++i) {
      if (inbox_[i].header.type == rpc_wire::kPong) {
        inbox_.erase(inbox_.begin() + static_cast<long>(i));
        ping_out = false;
        break;
      }
    }
    // A link the server dropped shows only when we next send: poke it. One ping at a time,
    // returning the credits we owe, so that the poke itself never breaks flow control (the
    // server would cut us off for that, whatever the test was about); a pong that does not come
    // within 100 ms is no proof of anything, so then poke again.
    if (!ping_out || absl::Now() - ping_sent > absl::Milliseconds(100)) {
      rpc_wire::MessageHeader ping{
          .version = rpc_wire::kProtocolVersion, .type = rpc_wire::kPing, .credits = credits_owed_};
      std::string bytes(reinterpret_cast<const char*>(&ping), sizeof(ping));
      if (SendRaw(bytes).ok()) credits_owed_ = 0;
      ping_out = true;
      ping_sent = absl::Now();
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  return false;
}

}  // namespace swirl::testing
