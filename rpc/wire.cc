#include "rpc/wire.h"

#include "absl/strings/str_format.h"

namespace swirl::rpc_wire {

absl::Status ValidateHeaderSlow(const MessageHeader& h, size_t received_bytes,
                                const Limits& limits) {
  if (received_bytes < sizeof(MessageHeader)) {
    return absl::DataLossError(
        absl::StrFormat("message of %u bytes is shorter than the header", received_bytes));
  }
  if (h.version != kProtocolVersion) {
    return absl::InvalidArgumentError(absl::StrFormat("protocol version %u", h.version));
  }
  if (h.type == 0 || h.type > kMaxType) {
    return absl::InvalidArgumentError(absl::StrFormat("message type %u", h.type));
  }
  if (h.flags & ~kAllFlags) {
    return absl::InvalidArgumentError(absl::StrFormat("unknown flags 0x%x", h.flags));
  }
  if (h.payload_len != received_bytes - sizeof(MessageHeader)) {
    return absl::DataLossError(absl::StrFormat("payload_len %u but %u payload bytes arrived",
                                               h.payload_len,
                                               received_bytes - sizeof(MessageHeader)));
  }
  if (h.payload_len > limits.max_payload) {
    return absl::InvalidArgumentError(
        absl::StrFormat("payload of %u bytes exceeds %u", h.payload_len, limits.max_payload));
  }
  if (h.credits > limits.max_credits) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "returns %u credits, more than the %u granted", h.credits, limits.max_credits));
  }
  const bool is_call = h.type == kRequest || h.type == kOneWay;
  if (is_call != (h.method_id != 0)) {
    return absl::InvalidArgumentError("method_id must be set exactly on calls");
  }
  if (h.type != kResponse && h.status != 0) {
    return absl::InvalidArgumentError("status set on a non-response");
  }
  if (h.status > kMaxStatusCode) {
    return absl::InvalidArgumentError(absl::StrFormat("status code %u", h.status));
  }
  if ((h.type == kCredit || h.type == kPing || h.type == kPong || h.type == kCancel ||
       h.type == kBulkAck) &&
      h.payload_len != 0) {
    return absl::InvalidArgumentError("control message with a payload");
  }
  if (h.flags != 0 && h.type != kRequest && h.type != kResponse) {
    return absl::InvalidArgumentError("bulk flags on a message that carries no data");
  }
  if ((h.flags & kFlagReplyChunk) && h.type != kRequest) {
    return absl::InvalidArgumentError("a reply chunk on a non-request");
  }
  if ((h.flags & kFlagReplyChunk) && !(h.flags & kFlagBulk)) {
    // The reply chunk's descriptor follows the bulk data's: one without the other has no layout.
    return absl::InvalidArgumentError("a reply chunk without bulk data");
  }
  const size_t descriptors =
      ((h.flags & kFlagBulk) ? 1 : 0) + ((h.flags & kFlagReplyChunk) ? 1 : 0);
  if (h.payload_len < descriptors * sizeof(BulkDescriptor)) {
    return absl::DataLossError("bulk descriptors cut short");
  }
  // Window grants (a count) and bulk acks (an rkey) carry a value in aux; the rest flag bits.
  const bool aux_is_value = h.type == kWindowGrant || h.type == kBulkAck;
  if ((h.aux & ~kAuxBulkIsMessage) != 0 && !aux_is_value) {
    return absl::InvalidArgumentError("unknown aux bits");
  }
  if ((h.aux & kAuxBulkIsMessage) && !(h.flags & kFlagBulk) && !aux_is_value) {
    return absl::InvalidArgumentError("bulk message flag without bulk data");
  }
  if ((h.aux & kAuxBulkIsMessage) && (h.flags & kFlagBulk) &&
      h.payload_len != descriptors * sizeof(BulkDescriptor)) {
    return absl::InvalidArgumentError("a message carried in bulk has no eager part");
  }
  return absl::OkStatus();
}

}  // namespace swirl::rpc_wire
