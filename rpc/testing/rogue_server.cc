#include "rpc/testing/rogue_server.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/control.grpc.pb.h"
#include "rpc/handshake.h"
#include "transport/device.h"

namespace swirl::testing {
namespace {

grpc::Status ToGrpc(const absl::Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// What we offer, as swirl's server would describe it: our RoguePeer's receive buffers, and bulk
// transfers up to 1 MiB (so that a descriptor beyond the negotiated maximum fits our scratch).
internal::LocalConfig OurConfig() {
  internal::LocalConfig local;
  local.credits = RoguePeer::kRecvs;
  local.buffer_size = RoguePeer::kRecvSize;
  local.max_inline = 256;
  local.max_bulk_size = 1 << 20;
  return local;
}

}  // namespace

class RogueServer::Control final : public control::Control::Service {
 public:
  absl::Status Init() {
    auto ctx = OpenDevice("");
    if (!ctx.ok()) return ctx.status();
    verbs::ProbeOptions probe;
    probe.confirm_remote_invalidation = true;
    auto caps = verbs::ProbeCapabilities(*ctx, probe);
    if (!caps.ok()) return caps.status();
    caps_ = *caps;
    context_ = *ctx;
    return absl::OkStatus();
  }

  void set_tamper(Tamper tamper) {
    swirl::MutexLock lock(&mu_);
    tamper_ = std::move(tamper);
  }
  void set_link_keys(LinkKeys mode) { link_keys_.store(mode); }

  // swirl's server: negotiate (refusing what it would refuse), make a QP, move it to RTS
  // toward the client's, answer with its address.
  grpc::Status Connect(grpc::ServerContext*, const control::ConnectRequest* request,
                       control::ConnectResponse* response) override {
    const internal::LocalConfig local = OurConfig();
    auto negotiated = internal::Negotiate(*request, caps_, local, [this](const ibv_gid& client) {
      return context_->CheckReachable(caps_.gid, client);
    });
    if (!negotiated.ok()) return ToGrpc(negotiated.status());
    auto client = internal::FromProto(request->address());
    if (!client.ok()) return ToGrpc(client.status());
    const LinkKeys link_keys = link_keys_.load();
    const bool keyed = link_keys != LinkKeys::kNone && request->capabilities().link_keys();
    const std::string key = keyed ? internal::NewLinkKey() : std::string();
    auto peer = std::make_unique<RoguePeer>();
    absl::Status s = peer->Open();
    absl::StatusOr<verbs::PeerAddress> ours = s.ok() ? peer->LocalAddress() : s;
    if (s.ok()) s = ours.status();
    if (s.ok()) s = peer->ConnectTo(*client, link_keys == LinkKeys::kHonest ? key : "");
    if (!s.ok()) return ToGrpc(s);
    response->set_connection_id(next_id_.fetch_add(1));
    *response->mutable_address() = internal::ToProto(*ours);
    *response->mutable_capabilities() = internal::DescribeLocal(caps_, local);
    response->mutable_capabilities()->set_link_keys(link_keys != LinkKeys::kNone);
    response->set_link_key(key);
    *response->mutable_negotiated() = *negotiated;
    response->set_disconnect_secret(std::string(16, 'r'));
    swirl::MutexLock lock(&mu_);
    if (tamper_) tamper_(*response);
    accepted_.push_back(std::move(peer));
    return grpc::Status::OK;
  }

  grpc::Status Disconnect(grpc::ServerContext*, const control::DisconnectRequest* request,
                          control::DisconnectResponse*) override {
    swirl::MutexLock lock(&mu_);
    disconnected_.push_back(request->connection_id());
    return grpc::Status::OK;
  }

  absl::StatusOr<std::unique_ptr<RoguePeer>> Accept(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      {
        swirl::MutexLock lock(&mu_);
        if (!accepted_.empty()) {
          std::unique_ptr<RoguePeer> peer = std::move(accepted_.front());
          accepted_.pop_front();
          return peer;
        }
      }
      if (absl::Now() >= deadline) return absl::DeadlineExceededError("no connection to accept");
      absl::SleepFor(absl::Milliseconds(1));
    }
  }

  std::vector<uint64_t> disconnected() const {
    swirl::MutexLock lock(&mu_);
    return disconnected_;
  }

 private:
  std::shared_ptr<verbs::Context> context_;
  verbs::Capabilities caps_;
  std::atomic<uint64_t> next_id_{1};
  std::atomic<LinkKeys> link_keys_{LinkKeys::kNone};
  mutable swirl::Mutex mu_;
  Tamper tamper_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<RoguePeer>> accepted_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> disconnected_ ABSL_GUARDED_BY(mu_);
};

RogueServer::RogueServer() : control_(std::make_unique<Control>()) {}

RogueServer::~RogueServer() {
  if (grpc_ != nullptr) grpc_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
}

absl::Status RogueServer::Start() {
  if (absl::Status s = control_->Init(); !s.ok()) return s;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
  builder.RegisterService(control_.get());
  grpc_ = builder.BuildAndStart();
  if (grpc_ == nullptr || port_ == 0) return absl::UnavailableError("cannot listen");
  return absl::OkStatus();
}

std::string RogueServer::address() const { return absl::StrCat("127.0.0.1:", port_); }

void RogueServer::set_tamper(Tamper tamper) { control_->set_tamper(std::move(tamper)); }

void RogueServer::set_link_keys(LinkKeys mode) { control_->set_link_keys(mode); }

absl::StatusOr<std::unique_ptr<RoguePeer>> RogueServer::Accept(absl::Duration timeout) {
  return control_->Accept(timeout);
}

std::vector<uint64_t> RogueServer::disconnected() const { return control_->disconnected(); }

}  // namespace swirl::testing
