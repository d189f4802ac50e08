// Test helper: one RC QP on a soft device of this process, with the objects around it, for the
// soft device's own tests (smoke_test, queued_bind_test, tcp_link_test).

#ifndef SWIRL_TRANSPORT_SOFT_TEST_SIDE_H_
#define SWIRL_TRANSPORT_SOFT_TEST_SIDE_H_

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "transport/verbs/verbs.h"

namespace swirl::soft {

struct SideOptions {
  size_t buffer_size = 1 << 16;
  int mr_access = IBV_ACCESS_LOCAL_WRITE;
  uint32_t max_inline_data = 256;
  int cq_entries = 256;
  uint32_t max_send_wr = 128;
  // Non-zero: the QP is made by ibv_create_qp_ex with these ibv_wr_* operations.
  uint64_t send_ops_flags = 0;
};

// A context on one soft device, a PD, one CQ for sends and receives, a QP in RESET and a
// registered buffer.
struct Side {
  std::shared_ptr<verbs::Context> ctx;
  std::shared_ptr<verbs::ProtectionDomain> pd;
  std::shared_ptr<verbs::CompletionQueue> cq;
  std::unique_ptr<verbs::QueuePair> qp;
  std::vector<char> buf;
  std::unique_ptr<verbs::MemoryRegion> mr;
};

// Opens `name` (soft0, soft1, ...) and builds a Side on it; aborts the test binary on failure.
Side MakeSide(const char* name, const SideOptions& options = {});

// Connects a (send PSN 100) and b (send PSN 200) to each other: the first failure, or OK.
absl::Status ConnectSides(Side& a, Side& b, const verbs::ConnectOptions& options = {});

// Posts a receive of the first 4096 bytes of `s.buf` with `wr_id`.
absl::Status PostBufferRecv(Side& s, uint64_t wr_id);
// Posts a signaled inline SEND of `text` and its NUL with `wr_id`.
absl::Status PostInlineSend(Side& s, uint64_t wr_id, const char* text);

}  // namespace swirl::soft

#endif  // SWIRL_TRANSPORT_SOFT_TEST_SIDE_H_
