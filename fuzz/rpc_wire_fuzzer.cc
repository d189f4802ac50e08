// Fuzzes the RPC data plane's message header check (rpc/wire.h): what a worker runs on every
// message a peer sends before it reads anything else of it.
//
// Input: a 32-byte MessageHeader, then the connection's limits (max_payload, max_credits: u32
// each), then the message's payload; the message is the header and the payload, as a receive
// buffer holds it (received bytes = 32 + the payload's length). Missing bytes read as zeros.
//
// Properties, for every input:
// - ValidateHeader (the inline common case) and ValidateHeaderSlow (the full check) agree: the
//   fast path may only accept what the full check accepts, and they give the same answer;
// - an accepted header keeps every promise the handlers rely on without checking again
//   (worker.cc, bulk.cc): a known version, type and flags; payload_len exactly the bytes that
//   arrived and within the negotiated limit; credits within what was granted; a method id exactly
//   on calls; a status only on responses and within absl's codes; no payload on control
//   messages; its bulk descriptors inside the payload (read here as bulk.cc reads them, so ASan
//   sees any read past the message); a message carried in bulk with no eager part.
// - a refusal is InvalidArgument or DataLoss with a message.
//
// What this does not reach: the checks bulk.cc makes of the descriptors' values (sizes against
// the negotiated maximum, window grants against the grant budget, rkeys against exposed
// windows) run inside Worker on a live connection (Worker::HandleBulkRequest and friends), with
// no entry point apart from it; rpc/bulk_test.cc's rogue-peer cases cover those.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_support.h"
#include "rpc/wire.h"

using swirl::fuzz::Input;
namespace rw = swirl::rpc_wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const auto header = in.Take<rw::MessageHeader>();
  rw::Limits limits;
  limits.max_payload = in.Take<uint32_t>();
  limits.max_credits = in.Take<uint32_t>();
  // The message as it sits in a receive buffer: the header, then exactly the payload bytes
  // that arrived (a buffer of their size, so ASan catches any read beyond them).
  const std::string payload = in.Rest();
  std::string message(reinterpret_cast<const char*>(&header), sizeof(header));
  message += payload;
  const size_t received = message.size();

  const absl::Status fast = rw::ValidateHeader(header, received, limits);
  const absl::Status full = rw::ValidateHeaderSlow(header, received, limits);
  FUZZ_CHECK(fast.ok() == full.ok(),
             absl::StrCat("inline: ", fast.ToString(), "; full: ", full.ToString()));
  if (!full.ok()) {
    FUZZ_CHECK(full.code() == absl::StatusCode::kInvalidArgument ||
                   full.code() == absl::StatusCode::kDataLoss,
               full.ToString());
    FUZZ_CHECK(!full.message().empty());
    return 0;
  }
  const rw::MessageHeader& h = header;
  FUZZ_CHECK(h.version == rw::kProtocolVersion);
  FUZZ_CHECK(h.type >= rw::kRequest && h.type <= rw::kMaxType);
  FUZZ_CHECK((h.flags & ~rw::kAllFlags) == 0);
  FUZZ_CHECK(h.payload_len == received - sizeof(rw::MessageHeader));
  FUZZ_CHECK(h.payload_len <= limits.max_payload);
  FUZZ_CHECK(h.credits <= limits.max_credits);
  const bool is_call = h.type == rw::kRequest || h.type == rw::kOneWay;
  FUZZ_CHECK(is_call == (h.method_id != 0));
  FUZZ_CHECK(h.type == rw::kResponse || h.status == 0);
  FUZZ_CHECK(h.status <= rw::kMaxStatusCode);
  if (h.type == rw::kCredit || h.type == rw::kPing || h.type == rw::kPong ||
      h.type == rw::kCancel || h.type == rw::kBulkAck) {
    FUZZ_CHECK(h.payload_len == 0);
  }
  if (h.flags != 0) FUZZ_CHECK(h.type == rw::kRequest || h.type == rw::kResponse);
  if (h.flags & rw::kFlagReplyChunk) {
    FUZZ_CHECK(h.type == rw::kRequest);
    FUZZ_CHECK(h.flags & rw::kFlagBulk);
  }
  // The descriptors, read as bulk.cc reads them: straight after the header, one after another.
  const size_t descriptors =
      ((h.flags & rw::kFlagBulk) ? 1 : 0) + ((h.flags & rw::kFlagReplyChunk) ? 1 : 0);
  FUZZ_CHECK(descriptors * sizeof(rw::BulkDescriptor) <= h.payload_len);
  const char* p = message.data() + sizeof(rw::MessageHeader);
  rw::BulkDescriptor d[2];
  for (size_t i = 0; i < descriptors; ++i) std::memcpy(&d[i], p + i * sizeof(d[i]), sizeof(d[i]));
  const bool aux_is_value = h.type == rw::kWindowGrant || h.type == rw::kBulkAck;
  if (!aux_is_value) {
    FUZZ_CHECK((h.aux & ~rw::kAuxBulkIsMessage) == 0);
    if (h.aux & rw::kAuxBulkIsMessage) {
      FUZZ_CHECK(h.flags & rw::kFlagBulk);
      FUZZ_CHECK(h.payload_len == descriptors * sizeof(rw::BulkDescriptor));
    }
  }
  return 0;
}
