// A bounded multi-producer single-consumer queue (Vyukov's bounded MPMC algorithm, used with one
// consumer). Push and Pop are lock-free: one CAS on the producer side, no atomic RMW on the
// consumer side. Elements are constructed in preallocated cells: no allocation after creation.

#ifndef SWIRL_BASE_MPSC_QUEUE_H_
#define SWIRL_BASE_MPSC_QUEUE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "base/spinlock.h"

namespace swirl {

template <typename T>
class MpscQueue {
 public:
  // `capacity` is rounded up to a power of two.
  explicit MpscQueue(size_t capacity) {
    size_t n = 2;
    while (n < capacity) n <<= 1;
    mask_ = n - 1;
    cells_ = std::make_unique<Cell[]>(n);
    for (size_t i = 0; i < n; ++i) cells_[i].sequence.store(i, std::memory_order_relaxed);
  }

  // False if full (then `value` is left untouched).
  bool TryPush(T&& value) {
    size_t pos = tail_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& cell = cells_[pos & mask_];
      size_t seq = cell.sequence.load(std::memory_order_acquire);
      intptr_t diff = static_cast<intptr_t>(seq) - static_cast<intptr_t>(pos);
      if (diff == 0) {
        if (tail_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          cell.value = std::move(value);
          cell.sequence.store(pos + 1, std::memory_order_release);
          return true;
        }
      } else if (diff < 0) {
        return false;
      } else {
        pos = tail_.load(std::memory_order_relaxed);
      }
    }
  }

  // Spins while full (the consumer is behind): producers feel back-pressure, nothing is lost.
  void Push(T value) {
    while (!TryPush(std::move(value))) CpuRelax();
  }

  // Single consumer only.
  bool TryPop(T* out) {
    Cell& cell = cells_[head_ & mask_];
    size_t seq = cell.sequence.load(std::memory_order_acquire);
    if (static_cast<intptr_t>(seq) - static_cast<intptr_t>(head_ + 1) < 0) return false;
    *out = std::move(cell.value);
    cell.sequence.store(head_ + mask_ + 1, std::memory_order_release);
    ++head_;
    return true;
  }

  // True if nothing was pushed that was not popped: producers' claims are compared with the
  // consumer's position, two loads (the head cell's sequence costs an index computation too,
  // and a worker asks this every loop turn and every caller-driven call). A claim whose value
  // is still being written reads as not empty; TryPop then finds nothing yet.
  // Single consumer only.
  bool MaybeEmpty() const { return tail_.load(std::memory_order_acquire) == head_; }

 private:
  struct Cell {
    std::atomic<size_t> sequence;
    T value;
  };
  std::unique_ptr<Cell[]> cells_;
  size_t mask_ = 0;
  alignas(64) std::atomic<size_t> tail_{0};
  alignas(64) size_t head_ = 0;
};

}  // namespace swirl

#endif  // SWIRL_BASE_MPSC_QUEUE_H_
