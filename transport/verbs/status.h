// Conversions from verbs error conventions to absl::Status.
//
// libibverbs reports failure three ways: a returned errno value (ibv_modify_qp, ibv_post_send),
// NULL with errno set (ibv_reg_mr, ibv_create_qp), or a work completion status. Every swirl API
// turns the first two into an absl::Status that names the verbs call and the errno text, so a
// log line says exactly which call failed and why.

#ifndef SWIRL_TRANSPORT_VERBS_STATUS_H_
#define SWIRL_TRANSPORT_VERBS_STATUS_H_

#include <infiniband/verbs.h>

#include "absl/strings/string_view.h"

#include "absl/status/status.h"

namespace swirl::verbs {

// Maps an errno value to the closest absl::StatusCode (ENOMEM -> kResourceExhausted, EINVAL ->
// kInvalidArgument, EPERM/EACCES -> kPermissionDenied, ENODEV/ENOENT -> kNotFound, ...).
absl::StatusCode ErrnoToStatusCode(int err);

// "ibv_reg_mr: Cannot allocate memory (errno 12)" with the mapped code. `err` == 0 is treated as
// an unknown failure (some providers return NULL without setting errno): kUnknown.
absl::Status VerbsError(absl::string_view call, int err);

// Like VerbsError, adding context: "ibv_modify_qp(RTR): Invalid argument (errno 22)".
absl::Status VerbsError(absl::string_view call, absl::string_view detail, int err);

// Status for a failed work completion: "RDMA_READ completion: remote access error (wr_id 7,
// vendor_err 0x0)". Success maps to OkStatus.
absl::Status WorkCompletionError(const ibv_wc& wc);

// Stable short names, as in ibv_wc_status_str() but without needing libibverbs at runtime.
const char* WcStatusName(ibv_wc_status status);
const char* WcOpcodeName(ibv_wc_opcode opcode);
const char* QpStateName(ibv_qp_state state);

}  // namespace swirl::verbs

#endif  // SWIRL_TRANSPORT_VERBS_STATUS_H_
