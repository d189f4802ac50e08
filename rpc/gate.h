// Internal: the count of work a worker has under way that a graceful shutdown waits for (after
// Seastar's seastar::gate): blocking handlers running, bulk operations waiting for their
// completion, windows exposing a transfer's buffer, messages parked for a credit. Each holder
// enters when the work begins and leaves when it ends, so "drained" is a look at one number,
// not a scan of every connection, window and operation. Loop thread only; the parts that hold
// work (WindowTable, BulkOpTable, CreditLedger) keep it in step themselves.

#ifndef SWIRL_RPC_GATE_H_
#define SWIRL_RPC_GATE_H_

#include <cstdint>

#include "base/check.h"

namespace swirl::internal {

class Gate {
 public:
  void Enter(uint64_t n = 1) { count_ += n; }
  void Leave(uint64_t n = 1) {
    SWIRL_DCHECK(count_ >= n);
    count_ -= n;
  }
  uint64_t count() const { return count_; }

 private:
  uint64_t count_ = 0;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_GATE_H_
