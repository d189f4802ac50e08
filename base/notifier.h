// A one-shot completion flag that a waiter can spin on cheaply and then sleep on (futex), and
// that the completing thread signals with one atomic exchange plus, only if someone sleeps, one
// FUTEX_WAKE. Used for RPC call completion: the common case (spin, then done) has no syscall.

#ifndef SWIRL_BASE_NOTIFIER_H_
#define SWIRL_BASE_NOTIFIER_H_

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <ctime>

#include "base/spinlock.h"

namespace swirl {

class Notifier {
 public:
  // Arms the notifier for a new round (not thread-safe with Notify).
  void Reset() { state_.store(kPending, std::memory_order_relaxed); }
  bool HasBeenNotified() const { return state_.load(std::memory_order_acquire) == kDone; }

  void Notify() {
    if (state_.exchange(kDone, std::memory_order_acq_rel) == kSleeping) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&state_), FUTEX_WAKE_PRIVATE, 1, nullptr,
              nullptr, 0);
    }
  }

  // Spins for `spins` iterations, then sleeps until notified.
  void Wait(int spins = 4000) {
    for (int i = 0; i < spins; ++i) {
      if (HasBeenNotified()) return;
      CpuRelax();
    }
    uint32_t expected = kPending;
    while (state_.load(std::memory_order_acquire) != kDone) {
      if (state_.compare_exchange_weak(expected, kSleeping, std::memory_order_acq_rel) ||
          expected == kSleeping) {
        timespec timeout{0, 10 * 1000 * 1000};  // re-check at least every 10 ms
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&state_), FUTEX_WAIT_PRIVATE, kSleeping,
                &timeout, nullptr, 0);
      }
      expected = kPending;
    }
  }

 private:
  static constexpr uint32_t kPending = 0;
  static constexpr uint32_t kSleeping = 1;
  static constexpr uint32_t kDone = 2;
  std::atomic<uint32_t> state_{kPending};
};

}  // namespace swirl

#endif  // SWIRL_BASE_NOTIFIER_H_
