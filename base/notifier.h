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

// The protocol, on a 32-bit word that the caller owns (0 = pending): ClientCall keeps its word in
// the public header (swirl/call.h), which cannot include this one.
struct NotifierWord {
  static constexpr uint32_t kPending = 0;
  static constexpr uint32_t kSleeping = 1;
  static constexpr uint32_t kDone = 2;

  // Arms the word for a new round (not thread-safe with Notify).
  static void Reset(std::atomic<uint32_t>& state) {
    state.store(kPending, std::memory_order_relaxed);
  }
  static bool HasBeenNotified(const std::atomic<uint32_t>& state) {
    return state.load(std::memory_order_acquire) == kDone;
  }

  static void Notify(std::atomic<uint32_t>& state) {
    if (state.exchange(kDone, std::memory_order_acq_rel) == kSleeping) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&state), FUTEX_WAKE_PRIVATE, 1, nullptr,
              nullptr, 0);
    }
  }

  // Spins for `spins` iterations, then sleeps until notified.
  static void Wait(std::atomic<uint32_t>& state, int spins = 4000) {
    for (int i = 0; i < spins; ++i) {
      if (HasBeenNotified(state)) return;
      CpuRelax();
    }
    uint32_t expected = kPending;
    while (state.load(std::memory_order_acquire) != kDone) {
      if (state.compare_exchange_weak(expected, kSleeping, std::memory_order_acq_rel) ||
          expected == kSleeping) {
        timespec timeout{0, 10 * 1000 * 1000};  // re-check at least every 10 ms
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&state), FUTEX_WAIT_PRIVATE, kSleeping,
                &timeout, nullptr, 0);
      }
      expected = kPending;
    }
  }
};

// The same with its own word.
class Notifier {
 public:
  void Reset() { NotifierWord::Reset(state_); }
  bool HasBeenNotified() const { return NotifierWord::HasBeenNotified(state_); }
  void Notify() { NotifierWord::Notify(state_); }
  void Wait(int spins = 4000) { NotifierWord::Wait(state_, spins); }

 private:
  std::atomic<uint32_t> state_{NotifierWord::kPending};
};

}  // namespace swirl

#endif  // SWIRL_BASE_NOTIFIER_H_
