// Fuzzes the control plane's connection negotiation (rpc/handshake.h): a client's
// ConnectRequest as the server decodes it from gRPC (internal::Negotiate, internal::FromProto on
// its queue pair address), and the server's answer as the client checks it
// (internal::CheckNegotiated). Absurd sizes, credits, versions and capabilities included.
//
// Input: one byte choosing the server's side of the negotiation (its device, fabric and
// configuration: a few realistic ones), then a serialized control::ConnectRequest. Bytes that
// do not parse are what gRPC would refuse before the handler runs: skipped.
//
// Properties, for every request:
// - Negotiate refuses with FailedPrecondition (incompatible) or InvalidArgument (nonsense) and
//   a message, or agrees to settings that stay inside both sides' limits: credits within
//   kMinCredits..kMaxCredits, the server's credits exactly the client's offer, a message size
//   at least kMinMessage that fits both sides' receive buffers, an eager threshold within it,
//   window credits and bulk size within both sides' offers, the bulk mode asked for, and an
//   invalidation mode both devices can do (remote only if both can; never the local fallback
//   when either side requires remote invalidation or the server forbids the fallback);
// - whatever the server agrees to, the client that sent that request accepts:
//   CheckNegotiated on the answer with the client configuration the request describes is OK
//   (a server that agreed to something its own client code refuses would fail every
//   connection after allocating for it);
// - FromProto of the request's address fails, or gives a QP number 1..2^24-1, a PSN below 2^24,
//   a 16-bit LID and an MTU of 256..4096, and ToProto gives the same fields back;
// - LoggableName of the client's name is at most 64 bytes escaped (4 characters each) plus a
//   length note, with no control characters, so a peer can neither flood nor forge log lines.

#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_support.h"
#include "google/protobuf/stubs/logging.h"
#include "proto/control.pb.h"
#include "rpc/handshake.h"
#include "rpc/wire.h"
#include "transport/soft/soft_device.h"
#include "transport/verbs/capabilities.h"

namespace {

using swirl::fuzz::Input;
namespace internal = swirl::internal;
namespace control = swirl::control;
namespace verbs = swirl::verbs;

struct ServerSide {
  verbs::Capabilities caps;
  internal::LocalConfig config;
  // Whether the server's device can link to the client's GID (the device's answer, which the
  // handshake takes as given): chosen by the input too.
  bool reachable = true;
};

// The server's device and configuration, chosen by the input's first byte: soft or NIC,
// shared memory or TCP (for soft), remote invalidation or not, strict or not, bulk or not, the
// client reachable or not.
ServerSide MakeServer(uint8_t choice) {
  ServerSide s;
  s.caps.device = "soft0";
  s.caps.kind = (choice & 1) ? verbs::DeviceKind::kRdmaCore : verbs::DeviceKind::kSoft;
  s.caps.mw_type2b = true;
  s.caps.remote_invalidation_advertised = (choice & 2) == 0;
  if (choice & 4) {  // a soft device on the TCP fabric: ::ffff:127.0.0.1, port 4791
    s.caps.gid.raw[8] = 0x12;
    s.caps.gid.raw[9] = 0xb7;
    s.caps.gid.raw[10] = s.caps.gid.raw[11] = 0xff;
    s.caps.gid.raw[12] = 127;
    s.caps.gid.raw[15] = 1;
  } else {
    s.caps.gid.raw[0] = 0xfe;
    s.caps.gid.raw[1] = 0x80;
  }
  internal::LocalConfig& c = s.config;
  c.require_remote_invalidation = (choice & 8) != 0;
  c.allow_local_fallback = (choice & 16) == 0;
  c.max_bulk_size = (choice & 32) ? 0 : uint64_t{16} << 20;
  s.reachable = (choice & 64) == 0;
  if (choice & 128) {  // small buffers and few credits
    c.credits = internal::kMinCredits;
    c.buffer_size = 512;
    c.eager_threshold = 128;
    c.window_credits = 1;
  }
  return s;
}

void CheckAddress(const control::QueuePairAddress& address) {
  absl::StatusOr<verbs::PeerAddress> parsed = internal::FromProto(address);
  if (!parsed.ok()) {
    FUZZ_CHECK(parsed.status().code() == absl::StatusCode::kInvalidArgument,
               parsed.status().ToString());
    return;
  }
  FUZZ_CHECK(parsed->qp_num >= 1 && parsed->qp_num <= 0xffffff);
  FUZZ_CHECK(parsed->psn <= 0xffffff);
  FUZZ_CHECK(parsed->mtu >= IBV_MTU_256 && parsed->mtu <= IBV_MTU_4096);
  const control::QueuePairAddress back = internal::ToProto(*parsed);
  FUZZ_CHECK(back.gid() == address.gid());
  FUZZ_CHECK(back.lid() == address.lid() && back.qp_num() == address.qp_num() &&
             back.psn() == address.psn() && back.mtu() == address.mtu());
}

void CheckLoggable(const std::string& name) {
  const std::string shown = internal::LoggableName(name);
  // 64 bytes escaped (at most 4 characters each), then "...(N bytes)".
  FUZZ_CHECK(shown.size() <= 64 * 4 + 32, absl::StrCat(shown.size(), " characters"));
  for (char c : shown) {
    FUZZ_CHECK(std::isprint(static_cast<unsigned char>(c)), absl::StrCat("character ", int{c}));
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Strings with invalid UTF-8 are refused by ParseFromString, which also logs each one.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const ServerSide server = MakeServer(in.Take<uint8_t>());
  control::ConnectRequest request;
  const std::string bytes = in.Rest();
  if (!request.ParseFromString(bytes)) return 0;

  CheckAddress(request.address());
  CheckLoggable(request.client_name());
  CheckLoggable(request.capabilities().device_kind());

  absl::StatusOr<control::Negotiated> negotiated =
      internal::Negotiate(request, server.caps, server.config, [&](const ibv_gid&) {
        return server.reachable ? absl::OkStatus()
                                : absl::FailedPreconditionError("the device cannot reach it");
      });
  if (!negotiated.ok()) {
    FUZZ_CHECK(negotiated.status().code() == absl::StatusCode::kFailedPrecondition ||
                   negotiated.status().code() == absl::StatusCode::kInvalidArgument,
               negotiated.status().ToString());
    FUZZ_CHECK(!negotiated.status().message().empty());
    return 0;
  }
  const control::Negotiated& n = *negotiated;
  const control::Capabilities& client = request.capabilities();
  constexpr uint32_t kHeader = sizeof(swirl::rpc_wire::MessageHeader);
  FUZZ_CHECK(n.protocol_version() == internal::kControlProtocolVersion);
  FUZZ_CHECK(n.client_credits() == server.config.credits);
  FUZZ_CHECK(n.server_credits() == client.recv_credits());
  FUZZ_CHECK(n.server_credits() >= internal::kMinCredits &&
             n.server_credits() <= internal::kMaxCredits);
  FUZZ_CHECK(n.max_message_size() >= internal::kMinMessage);
  FUZZ_CHECK(uint64_t{n.max_message_size()} + kHeader <= server.config.buffer_size);
  FUZZ_CHECK(uint64_t{n.max_message_size()} + kHeader <= client.recv_buffer_size());
  FUZZ_CHECK(n.eager_threshold() <= n.max_message_size());
  FUZZ_CHECK(n.window_credits() <= server.config.window_credits);
  FUZZ_CHECK(n.window_credits() <= client.window_credits());
  FUZZ_CHECK(n.max_bulk_size() <= server.config.max_bulk_size);
  FUZZ_CHECK(n.max_bulk_size() <= client.max_bulk_size());
  FUZZ_CHECK(n.bulk_mode() == client.bulk_mode());
  // Only the two modes that expose memory through per-request windows (2, the retired
  // static-rkey mode, is refused).
  FUZZ_CHECK(n.bulk_mode() == control::BULK_SERVER_EXPOSES ||
             n.bulk_mode() == control::BULK_MIRROR);
  FUZZ_CHECK(n.client_max_inline() <= 1024);
  const bool both_can = server.caps.remote_invalidation() && client.remote_invalidation();
  if (n.invalidation() == control::INVALIDATION_REMOTE) {
    FUZZ_CHECK(both_can);
  } else {
    FUZZ_CHECK(n.invalidation() == control::INVALIDATION_LOCAL);
    FUZZ_CHECK(!both_can, "the local fallback where both sides can invalidate remotely");
    FUZZ_CHECK(!server.config.require_remote_invalidation &&
               !client.require_remote_invalidation() && server.config.allow_local_fallback);
  }

  // The client that sent this request takes the answer.
  internal::LocalConfig client_config;
  client_config.credits = client.recv_credits();
  client_config.buffer_size = client.recv_buffer_size();
  client_config.max_inline = client.max_inline();
  client_config.eager_threshold = client.eager_threshold();
  client_config.window_credits = client.window_credits();
  client_config.require_remote_invalidation = client.require_remote_invalidation();
  client_config.bulk_mode = client.bulk_mode();
  client_config.max_bulk_size = client.max_bulk_size();
  verbs::Capabilities client_caps;
  client_caps.remote_invalidation_advertised = client.remote_invalidation();
  const absl::Status accepted = internal::CheckNegotiated(n, client_config, client_caps);
  FUZZ_CHECK(accepted.ok(), absl::StrCat("the client refuses what the server agreed to: ",
                                         accepted.ToString(), "; ", n.ShortDebugString(),
                                         " for ", request.ShortDebugString()));
  return 0;
}
