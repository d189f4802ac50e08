// ValidateHeader: every field of a received header is checked before anything uses it.

#include "rpc/wire.h"

#include <gtest/gtest.h>

#include <random>

namespace swirl::rpc_wire {
namespace {

constexpr Limits kLimits{/*max_payload=*/4064, /*max_credits=*/32};
constexpr size_t kHeader = sizeof(MessageHeader);

MessageHeader Request(uint32_t payload_len) {
  return MessageHeader{.version = kProtocolVersion,
                       .type = kRequest,
                       .method_id = MethodId("/a.B/C"),
                       .request_id = 7,
                       .payload_len = payload_len};
}

absl::StatusCode Check(const MessageHeader& h) {
  return ValidateHeader(h, kHeader + h.payload_len, kLimits).code();
}

TEST(ValidateHeader, AcceptsWellFormedMessages) {
  EXPECT_EQ(Check(Request(10)), absl::StatusCode::kOk);
  MessageHeader response{.version = kProtocolVersion,
                         .type = kResponse,
                         .request_id = 7,
                         .status = 5,
                         .payload_len = 3,
                         .credits = 2};
  EXPECT_EQ(Check(response), absl::StatusCode::kOk);
  MessageHeader bulk = Request(sizeof(BulkDescriptor) + 4);
  bulk.flags = kFlagBulk;
  EXPECT_EQ(Check(bulk), absl::StatusCode::kOk);
  MessageHeader mirror = Request(2 * sizeof(BulkDescriptor));
  mirror.flags = kFlagBulk | kFlagReplyChunk;
  EXPECT_EQ(Check(mirror), absl::StatusCode::kOk);
  MessageHeader credit{.version = kProtocolVersion, .type = kCredit, .credits = 32};
  EXPECT_EQ(Check(credit), absl::StatusCode::kOk);
  // A bulk acknowledgement names its window's rkey in aux: any 32-bit value.
  MessageHeader ack{
      .version = kProtocolVersion, .type = kBulkAck, .request_id = 7, .aux = 0xdeadbe07};
  EXPECT_EQ(Check(ack), absl::StatusCode::kOk);
}

TEST(ValidateHeader, RejectsShortOrMismatchedLengths) {
  MessageHeader h = Request(10);
  EXPECT_EQ(ValidateHeader(h, kHeader - 1, kLimits).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ValidateHeader(h, kHeader + 9, kLimits).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ValidateHeader(h, kHeader + 11, kLimits).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(Check(Request(kLimits.max_payload + 1)), absl::StatusCode::kInvalidArgument);
}

// Each field's check, and only it, refuses the header: the code is InvalidArgument and the
// message names what was wrong.
void ExpectRefusedFor(const MessageHeader& h, const char* what) {
  const absl::Status s = ValidateHeader(h, kHeader + h.payload_len, kLimits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what << ": " << s;
  EXPECT_NE(s.message().find(what), absl::string_view::npos) << s;
}

TEST(ValidateHeader, RejectsBadFields) {
  MessageHeader h = Request(0);
  h.version = kProtocolVersion + 1;
  ExpectRefusedFor(h, "protocol version");
  h.version = kProtocolVersion - 1;
  ExpectRefusedFor(h, "protocol version");
  h = Request(0);
  h.type = 0;
  ExpectRefusedFor(h, "message type");
  h.type = kMaxType + 1;
  ExpectRefusedFor(h, "message type");
  h = Request(0);
  h.flags = 1 << 7;
  ExpectRefusedFor(h, "unknown flags");
  h = Request(0);
  h.method_id = 0;  // a call must name its method
  ExpectRefusedFor(h, "method_id");
  h = Request(0);
  h.status = 3;  // only responses carry a status
  ExpectRefusedFor(h, "status set on a non-response");
  MessageHeader response{
      .version = kProtocolVersion, .type = kResponse, .request_id = 7, .status = 17};
  ExpectRefusedFor(response, "status code 17");  // no such status code
  h = Request(0);
  h.credits = kLimits.max_credits + 1;
  ExpectRefusedFor(h, "credits, more than");
  MessageHeader ping{.version = kProtocolVersion, .type = kPing, .payload_len = 4};
  ExpectRefusedFor(ping, "control message with a payload");
  h = Request(0);
  h.aux = 1 << 5;
  ExpectRefusedFor(h, "unknown aux bits");
}

TEST(ValidateHeader, RejectsBulkLayoutsThatDoNotAddUp) {
  MessageHeader h = Request(sizeof(BulkDescriptor) - 1);
  h.flags = kFlagBulk;
  EXPECT_EQ(Check(h), absl::StatusCode::kDataLoss);
  // Two descriptors announced, room for one.
  h = Request(sizeof(BulkDescriptor) + 8);
  h.flags = kFlagBulk | kFlagReplyChunk;
  EXPECT_EQ(Check(h), absl::StatusCode::kDataLoss);
  // A reply chunk without the bulk descriptor before it: no layout to parse it by.
  h = Request(sizeof(BulkDescriptor));
  h.flags = kFlagReplyChunk;
  EXPECT_EQ(Check(h), absl::StatusCode::kInvalidArgument);
  // Reply chunks belong to requests only.
  MessageHeader response{.version = kProtocolVersion,
                         .type = kResponse,
                         .flags = kFlagBulk | kFlagReplyChunk,
                         .request_id = 7,
                         .payload_len = 2 * sizeof(BulkDescriptor)};
  EXPECT_EQ(Check(response), absl::StatusCode::kInvalidArgument);
  // A message carried in bulk has no eager bytes next to its descriptor.
  h = Request(sizeof(BulkDescriptor) + 1);
  h.flags = kFlagBulk;
  h.aux = kAuxBulkIsMessage;
  EXPECT_EQ(Check(h), absl::StatusCode::kInvalidArgument);
  h = Request(0);
  h.aux = kAuxBulkIsMessage;
  EXPECT_EQ(Check(h), absl::StatusCode::kInvalidArgument);
  MessageHeader ack{
      .version = kProtocolVersion, .type = kBulkAck, .flags = kFlagBulk, .request_id = 7};
  EXPECT_EQ(Check(ack), absl::StatusCode::kInvalidArgument);
}

TEST(ValidateHeader, TheFastPathAgreesWithTheFullCheck) {
  // Random headers biased toward almost-valid ones: the inline fast path may only accept what
  // the full check accepts, and must not change the verdict.
  std::mt19937 rng(1234);
  auto pick = [&](std::initializer_list<uint32_t> values) {
    return *(values.begin() + rng() % values.size());
  };
  int accepted = 0;
  for (int i = 0; i < 200000; ++i) {
    MessageHeader h{};
    h.version = static_cast<uint8_t>(
        pick({kProtocolVersion, kProtocolVersion, 0, kProtocolVersion + 1u}));
    h.type = static_cast<uint8_t>(rng() % (kMaxType + 2));
    h.flags = static_cast<uint16_t>(pick({0, 0, 0, kFlagBulk, kFlagReplyChunk, 4}));
    h.method_id = pick({0, 0, MethodId("/a.B/C")});
    h.request_id = rng();
    h.status = pick({0, 0, 0, 5, 16, 17});
    h.payload_len = pick({0, 0, 16, 32, 100, kLimits.max_payload, kLimits.max_payload + 1});
    h.credits = pick({0, 1, kLimits.max_credits, kLimits.max_credits + 1});
    h.aux = pick({0, 0, 0, kAuxBulkIsMessage, 2});
    // Now and then a message shorter than the header (the length compare must refuse it).
    const size_t received =
        rng() % 16 == 0
            ? rng() % kHeader
            : kHeader + h.payload_len + pick({0, 0, 0, 1}) -
                  (h.payload_len > 0 ? pick({0, 0, 1}) : 0);
    const bool fast = ValidateHeader(h, received, kLimits).ok();
    const bool full = ValidateHeaderSlow(h, received, kLimits).ok();
    ASSERT_EQ(fast, full) << "type " << int{h.type} << " flags " << h.flags << " status "
                          << h.status << " len " << h.payload_len << " received " << received;
    // The receive path asks IsPlainHeader alone (the full check only when it says no).
    if (IsPlainHeader(h, received, kLimits)) {
      ASSERT_TRUE(full) << "type " << int{h.type} << " flags " << h.flags << " status "
                        << h.status << " len " << h.payload_len << " received " << received;
    }
    accepted += fast;
  }
  EXPECT_GT(accepted, 1000);  // the sample did exercise the accepting path
}

TEST(MethodId, IsStableAndNeverZero) {
  EXPECT_EQ(MethodId("/a.B/C"), MethodId("/a.B/C"));
  EXPECT_NE(MethodId("/a.B/C"), MethodId("/a.B/D"));
  EXPECT_NE(MethodId(""), 0u);
  // FNV-1a's published test vector, and the same value from the compiler.
  EXPECT_EQ(MethodId("a"), 0xe40c292cu);
  static_assert(MethodId("a") == 0xe40c292cu);
}

}  // namespace
}  // namespace swirl::rpc_wire
