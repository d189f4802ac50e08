#include "transport/verbs/status.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace swirl::verbs {

absl::StatusCode ErrnoToStatusCode(int err) {
  switch (err) {
    case 0:
      return absl::StatusCode::kUnknown;
    case EINVAL:
    case E2BIG:
    case EFAULT:
      return absl::StatusCode::kInvalidArgument;
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
    case EAGAIN:
      return absl::StatusCode::kResourceExhausted;
    case EPERM:
    case EACCES:
      return absl::StatusCode::kPermissionDenied;
    case ENODEV:
    case ENOENT:
    case ENXIO:
      return absl::StatusCode::kNotFound;
    case EOPNOTSUPP:
    case ENOSYS:
    case EPROTONOSUPPORT:
      return absl::StatusCode::kUnimplemented;
    case EBUSY:
    case EEXIST:
      return absl::StatusCode::kFailedPrecondition;
    case ETIMEDOUT:
      return absl::StatusCode::kDeadlineExceeded;
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
    case ENOTCONN:
    case EHOSTUNREACH:
      return absl::StatusCode::kUnavailable;
    case EOVERFLOW:
    case ERANGE:
      return absl::StatusCode::kOutOfRange;
    case EIO:
    case EPROTO:
      return absl::StatusCode::kDataLoss;
    default:
      return absl::StatusCode::kInternal;
  }
}

namespace {
std::string ErrnoText(int err) {
  if (err == 0) return "failed without setting errno";
  char buf[128];
  // GNU strerror_r returns a pointer that may or may not be `buf`.
  const char* text = strerror_r(err, buf, sizeof(buf));
  return absl::StrCat(text, " (errno ", err, ")");
}
}  // namespace

absl::Status VerbsError(absl::string_view call, int err) {
  return absl::Status(ErrnoToStatusCode(err), absl::StrCat(call, ": ", ErrnoText(err)));
}

absl::Status VerbsError(absl::string_view call, absl::string_view detail, int err) {
  return absl::Status(ErrnoToStatusCode(err),
                      absl::StrCat(call, "(", detail, "): ", ErrnoText(err)));
}

const char* WcStatusName(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_LOC_LEN_ERR: return "local length error";
    case IBV_WC_LOC_QP_OP_ERR: return "local QP operation error";
    case IBV_WC_LOC_EEC_OP_ERR: return "local EE context operation error";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "work request flushed";
    case IBV_WC_MW_BIND_ERR: return "memory window bind error";
    case IBV_WC_BAD_RESP_ERR: return "bad response error";
    case IBV_WC_LOC_ACCESS_ERR: return "local access error";
    case IBV_WC_REM_INV_REQ_ERR: return "remote invalid request error";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error";
    case IBV_WC_REM_OP_ERR: return "remote operation error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    case IBV_WC_LOC_RDD_VIOL_ERR: return "local RDD violation error";
    case IBV_WC_REM_INV_RD_REQ_ERR: return "remote invalid RD request";
    case IBV_WC_REM_ABORT_ERR: return "aborted error";
    case IBV_WC_INV_EECN_ERR: return "invalid EE context number";
    case IBV_WC_INV_EEC_STATE_ERR: return "invalid EE context state";
    case IBV_WC_FATAL_ERR: return "fatal error";
    case IBV_WC_RESP_TIMEOUT_ERR: return "response timeout error";
    case IBV_WC_GENERAL_ERR: return "general error";
    case IBV_WC_TM_ERR: return "tag matching error";
    case IBV_WC_TM_RNDV_INCOMPLETE: return "tag matching rendezvous incomplete";
  }
  return "unknown completion status";
}

const char* WcOpcodeName(ibv_wc_opcode opcode) {
  switch (opcode) {
    case IBV_WC_SEND: return "SEND";
    case IBV_WC_RDMA_WRITE: return "RDMA_WRITE";
    case IBV_WC_RDMA_READ: return "RDMA_READ";
    case IBV_WC_COMP_SWAP: return "COMP_SWAP";
    case IBV_WC_FETCH_ADD: return "FETCH_ADD";
    case IBV_WC_BIND_MW: return "BIND_MW";
    case IBV_WC_LOCAL_INV: return "LOCAL_INV";
    case IBV_WC_RECV: return "RECV";
    case IBV_WC_RECV_RDMA_WITH_IMM: return "RECV_RDMA_WITH_IMM";
    default: return "OTHER";
  }
}

const char* QpStateName(ibv_qp_state state) {
  switch (state) {
    case IBV_QPS_RESET: return "RESET";
    case IBV_QPS_INIT: return "INIT";
    case IBV_QPS_RTR: return "RTR";
    case IBV_QPS_RTS: return "RTS";
    case IBV_QPS_SQD: return "SQD";
    case IBV_QPS_SQE: return "SQE";
    case IBV_QPS_ERR: return "ERR";
    case IBV_QPS_UNKNOWN: return "UNKNOWN";
  }
  return "INVALID";
}

absl::Status WorkCompletionError(const ibv_wc& wc) {
  if (wc.status == IBV_WC_SUCCESS) return absl::OkStatus();
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (wc.status) {
    case IBV_WC_WR_FLUSH_ERR:
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
      code = absl::StatusCode::kUnavailable;
      break;
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_ACCESS_ERR:
      code = absl::StatusCode::kPermissionDenied;
      break;
    case IBV_WC_LOC_LEN_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_MW_BIND_ERR:
      code = absl::StatusCode::kInvalidArgument;
      break;
    default:
      break;
  }
  // Flushed completions carry only wr_id and status; the opcode field is undefined for them.
  const char* op = wc.status == IBV_WC_WR_FLUSH_ERR ? "flushed" : WcOpcodeName(wc.opcode);
  return absl::Status(code, absl::StrFormat("%s completion: %s (wr_id %u, vendor_err 0x%x)", op,
                                            WcStatusName(wc.status), wc.wr_id, wc.vendor_err));
}

}  // namespace swirl::verbs
