// A test-and-test-and-set spin lock for critical sections of a few dozen instructions on the data
// path (a QP's send queue, a CQ's ring). Uncontended, lock+unlock is one atomic exchange and one
// store; contended, waiters spin on a plain load with PAUSE so they do not steal the line, and
// after a few microseconds yield the CPU: on a machine with fewer cores than busy threads the
// holder may be the thread waiting for this core.
// Not for sections that block or allocate: use absl::Mutex there.

#ifndef SWIRL_BASE_SPINLOCK_H_
#define SWIRL_BASE_SPINLOCK_H_

#include <atomic>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace swirl {

inline void CpuRelax() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class SpinLock {
 public:
  void lock() {
    while (locked_.exchange(true, std::memory_order_acquire)) {
      for (int spins = 0; locked_.load(std::memory_order_relaxed); ++spins) {
        if (spins < kSpinsBeforeYield) {
          CpuRelax();
        } else {
          std::this_thread::yield();
        }
      }
    }
  }
  bool try_lock() {
    return !locked_.load(std::memory_order_relaxed) &&
           !locked_.exchange(true, std::memory_order_acquire);
  }
  void unlock() { locked_.store(false, std::memory_order_release); }

 private:
  static constexpr int kSpinsBeforeYield = 1024;  // PAUSE is 40-140 cycles: ~10-50 us
  std::atomic<bool> locked_{false};
};

}  // namespace swirl

#endif  // SWIRL_BASE_SPINLOCK_H_
