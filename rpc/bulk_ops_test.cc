#include "rpc/bulk_ops.h"

#include "gtest/gtest.h"

namespace swirl::internal {
namespace {

TEST(BulkOpTableTest, OperationsAreBuiltInPlaceAndTheirSlotsReused) {
  BulkOpTable ops;
  int32_t a;
  bulk_op::Revoke& revoke = ops.Emplace<bulk_op::Revoke>(&a);
  revoke.window = 7;
  int32_t b;
  ops.Emplace<bulk_op::UploadWrite>(&b).cancelled = true;
  EXPECT_NE(a, b);
  EXPECT_EQ(ops.live(), 2u);
  BulkOp taken = ops.Take(a);
  ASSERT_TRUE(std::holds_alternative<bulk_op::Revoke>(taken));
  EXPECT_EQ(std::get<bulk_op::Revoke>(taken).window, 7);
  EXPECT_TRUE(std::holds_alternative<std::monostate>(ops.at(a))) << "a taken slot holds nothing";
  int32_t c;
  ops.Emplace<bulk_op::Hold>(&c);
  EXPECT_EQ(c, a) << "the freed slot is used again";
  EXPECT_TRUE(std::holds_alternative<bulk_op::UploadWrite>(ops.at(b)));
  EXPECT_TRUE(std::get<bulk_op::UploadWrite>(ops.at(b)).cancelled);
}

TEST(BulkOpTableTest, OperationsHoldTheGateUntilTakenOrCleared) {
  Gate gate;
  BulkOpTable ops;
  ops.set_gate(&gate);
  int32_t a, b, c;
  ops.Emplace<bulk_op::DownloadRead>(&a);
  ops.Emplace<bulk_op::MirrorRead>(&b);
  ops.Emplace<bulk_op::RevokeThenDispatch>(&c);
  EXPECT_EQ(gate.count(), 3u);
  ops.Take(b);
  EXPECT_EQ(gate.count(), 2u);
  // Settled with a failed connection (monostate in place) still holds it: its flushed
  // completion is yet to come.
  ops.at(a) = std::monostate();
  EXPECT_EQ(gate.count(), 2u);
  ops.Clear();
  EXPECT_EQ(gate.count(), 0u);
  EXPECT_TRUE(ops.empty());
}

}  // namespace
}  // namespace swirl::internal
