#include "transport/verbs/status.h"

#include <gtest/gtest.h>

#include <cerrno>

namespace swirl::verbs {
namespace {

TEST(VerbsError, NamesTheCallAndTheErrnoText) {
  absl::Status s = VerbsError("ibv_reg_mr", ENOMEM);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "ibv_reg_mr: Cannot allocate memory (errno 12)");
}

TEST(VerbsError, DetailGoesInParentheses) {
  absl::Status s = VerbsError("ibv_modify_qp", "RTR", EINVAL);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "ibv_modify_qp(RTR): Invalid argument (errno 22)");
}

TEST(VerbsError, ZeroErrnoIsUnknownNotOk) {
  // Some providers return NULL without setting errno; that must still be an error.
  absl::Status s = VerbsError("ibv_create_qp", 0);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnknown);
}

TEST(ErrnoToStatusCode, MapsTheCommonVerbsErrors) {
  EXPECT_EQ(ErrnoToStatusCode(EINVAL), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ErrnoToStatusCode(ENOMEM), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoToStatusCode(EPERM), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoToStatusCode(EACCES), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoToStatusCode(ENODEV), absl::StatusCode::kNotFound);
  EXPECT_EQ(ErrnoToStatusCode(EOPNOTSUPP), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(ErrnoToStatusCode(EBUSY), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ErrnoToStatusCode(ETIMEDOUT), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(ErrnoToStatusCode(ECONNRESET), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ErrnoToStatusCode(12345), absl::StatusCode::kInternal);
}

TEST(WorkCompletionError, SuccessIsOk) {
  ibv_wc wc{};
  wc.status = IBV_WC_SUCCESS;
  EXPECT_TRUE(WorkCompletionError(wc).ok());
}

TEST(WorkCompletionError, RemoteAccessErrorSaysWhatAndWhich) {
  ibv_wc wc{};
  wc.status = IBV_WC_REM_ACCESS_ERR;
  wc.opcode = IBV_WC_RDMA_READ;
  wc.wr_id = 42;
  absl::Status s = WorkCompletionError(wc);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(), "RDMA_READ completion: remote access error (wr_id 42, vendor_err 0x0)");
}

TEST(WorkCompletionError, FlushDoesNotTrustTheOpcode) {
  ibv_wc wc{};
  wc.status = IBV_WC_WR_FLUSH_ERR;
  wc.opcode = static_cast<ibv_wc_opcode>(0x7f);  // undefined for flushed completions
  absl::Status s = WorkCompletionError(wc);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "flushed completion: work request flushed (wr_id 0, vendor_err 0x0)");
}

TEST(Names, EveryWcStatusHasAName) {
  for (int st = IBV_WC_SUCCESS; st <= IBV_WC_TM_RNDV_INCOMPLETE; ++st) {
    EXPECT_STRNE(WcStatusName(static_cast<ibv_wc_status>(st)), "unknown completion status") << st;
  }
  EXPECT_STREQ(WcStatusName(static_cast<ibv_wc_status>(999)), "unknown completion status");
  EXPECT_STREQ(QpStateName(IBV_QPS_RTS), "RTS");
  EXPECT_STREQ(WcOpcodeName(IBV_WC_RECV_RDMA_WITH_IMM), "RECV_RDMA_WITH_IMM");
}

}  // namespace
}  // namespace swirl::verbs
