// hostile_client: the attacker of `./swirl demo`, part 3. It speaks swirl's data-plane protocol
// by hand (rpc/testing/rogue.h) so that it can do what swirl's own Channel never does: keep the
// rkey of a download window after revoking it, and use it again.
//
//   hostile_client --port=PORT --token=TOKEN --expect_fnv1a=HEX
//
// 1. Connects (the real handshake) and calls Blob.Get: the server binds a type 2 window over a
//    copy of its blob for this one request and sends its address and rkey.
// 2. READs the data through the window, as it may (checked against --expect_fnv1a), and
//    acknowledges the download the way the protocol says: a SEND_WITH_INV carrying that rkey,
//    which makes the server's device revoke the window on delivery.
// 3. Keeps the rkey and READs through it again.
//
// Exit status: 0 when the device refused the second READ with a remote access error
// (IBV_WC_REM_ACCESS_ERR), 3 when it succeeded (the attack worked), 1 on anything else.

#include <infiniband/verbs.h>

#include <cinttypes>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "examples/echo/blob_service.h"
#include "proto/control.pb.h"
#include "rpc/testing/rogue.h"
#include "rpc/wire.h"

ABSL_FLAG(int, port, 0, "the server's control-plane port on 127.0.0.1");
ABSL_FLAG(std::string, token, "", "authentication token");
ABSL_FLAG(std::string, expect_fnv1a, "", "FNV-1a 64 (hex) of the blob the server holds");

namespace {

int Fail(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "hostile_client: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  uint64_t expected = 0;
  if (!absl::SimpleHexAtoi(absl::GetFlag(FLAGS_expect_fnv1a), &expected)) {
    std::fprintf(stderr, "hostile_client: --expect_fnv1a wants a hex number\n");
    return 1;
  }
  swirl::testing::RogueConnection rogue;
  if (absl::Status s = rogue.Connect(absl::GetFlag(FLAGS_port), absl::GetFlag(FLAGS_token));
      !s.ok()) {
    return Fail("connect", s);
  }
  if (rogue.negotiated().invalidation() != swirl::control::INVALIDATION_REMOTE) {
    std::fprintf(stderr, "hostile_client: the server negotiated %s, not remote invalidation\n",
                 swirl::control::InvalidationMode_Name(rogue.negotiated().invalidation()).c_str());
    return 1;
  }
  uint64_t request_id = 0;
  auto window = rogue.CallForDownload("/swirl.examples.Blob/Get", "", &request_id);
  if (!window.ok()) return Fail("Blob.Get", window.status());
  const swirl::rpc_wire::BulkDescriptor d = *window;

  std::string data;
  auto first = rogue.Read(d.addr, d.rkey, d.length, &data);
  if (!first.ok()) return Fail("first READ", first.status());
  if (*first != IBV_WC_SUCCESS || swirl::examples::Fnv1a(data) != expected) {
    std::fprintf(stderr, "hostile_client: the granted READ failed (%s) or read the wrong data\n",
                 ibv_wc_status_str(*first));
    return 1;
  }
  std::printf("hostile_client: granted window rkey 0x%08x over %u bytes; READ it (fnv1a %016" PRIx64
              "), then SEND_WITH_INV 0x%08x\n",
              d.rkey, d.length, expected, d.rkey);
  // The acknowledgement exactly as swirl's Channel sends it (docs/BULK.md): a kBulkAck naming
  // the window, carried by SEND_WITH_INV of its rkey. The QP delivers it before the READ below.
  const swirl::rpc_wire::MessageHeader ack{swirl::rpc_wire::kProtocolVersion,
                                           swirl::rpc_wire::kBulkAck, 0, 0, request_id, 0, 0, 0,
                                           d.rkey};
  if (absl::Status s = rogue.Send(ack, {}, d.rkey); !s.ok()) return Fail("SEND_WITH_INV", s);

  // The attack: the same address, length and rkey, after the invalidation.
  std::string stolen;
  auto again = rogue.Read(d.addr, d.rkey, d.length, &stolen);
  if (!again.ok()) return Fail("second READ", again.status());
  if (*again == IBV_WC_SUCCESS) {
    std::printf("hostile_client: ATTACK SUCCEEDED: READ with the revoked rkey returned %u bytes\n",
                d.length);
    return 3;
  }
  std::printf("hostile_client: READ again with the revoked rkey: %s (%s)\n",
              ibv_wc_status_str(*again),
              *again == IBV_WC_REM_ACCESS_ERR ? "IBV_WC_REM_ACCESS_ERR" : "unexpected status");
  return *again == IBV_WC_REM_ACCESS_ERR ? 0 : 1;
}
