// A test-and-test-and-set spin lock for critical sections of a few dozen instructions on the data
// path (a QP's send queue, a CQ's ring). Uncontended, lock+unlock is one atomic exchange and one
// store; contended, waiters spin on a plain load with PAUSE so they do not steal the line.
// Not for sections that block or allocate: use absl::Mutex there. Waiters never yield: a call on
// the slow path (sched_yield) made every inlined lock() save registers, +10 instructions per
// CQ push (measured with soft_path_bench); code that may wait behind a long holder uses try_lock
// and moves on instead.

#ifndef SWIRL_BASE_SPINLOCK_H_
#define SWIRL_BASE_SPINLOCK_H_

#include <atomic>

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
      while (locked_.load(std::memory_order_relaxed)) CpuRelax();
    }
  }
  bool try_lock() {
    return !locked_.load(std::memory_order_relaxed) &&
           !locked_.exchange(true, std::memory_order_acquire);
  }
  void unlock() { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

}  // namespace swirl

#endif  // SWIRL_BASE_SPINLOCK_H_
