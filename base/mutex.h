// swirl::Mutex, MutexLock, ReaderMutexLock, CondVar: the part of Abseil's synchronization API
// that swirl uses, with its thread-safety annotations.
//
// Normal builds: exactly absl::Mutex and friends. ThreadSanitizer builds (--config=tsan): a
// std::shared_mutex underneath, because Debian's libabsl is not built with TSan, so TSan cannot
// see absl::Mutex synchronize and would report every access it guards as a race. The TSan
// variant is correct but not fast (Await polls); it exists only to make TSan's verdict mean
// something.

#ifndef SWIRL_BASE_MUTEX_H_
#define SWIRL_BASE_MUTEX_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

#if defined(__SANITIZE_THREAD__)
#include <chrono>
#include <condition_variable>
#include <shared_mutex>

#include "absl/time/time.h"
#endif

namespace swirl {

#if !defined(__SANITIZE_THREAD__)

using Mutex = absl::Mutex;
using MutexLock = absl::MutexLock;
using ReaderMutexLock = absl::ReaderMutexLock;
using CondVar = absl::CondVar;

#else

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    mu_.unlock();
    changed_.notify_all();
  }
  void ReaderLock() ABSL_SHARED_LOCK_FUNCTION() { mu_.lock_shared(); }
  void ReaderUnlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock_shared(); }
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}
  // Blocks (the lock held) until `condition` holds; re-checked whenever the lock is released.
  void Await(const absl::Condition& condition) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    while (!condition.Eval()) {
      std::unique_lock<std::shared_mutex> lock(mu_, std::adopt_lock);
      changed_.wait_for(lock, std::chrono::milliseconds(1));
      lock.release();
    }
  }

  // BasicLockable, for CondVar.
  void lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { Lock(); }
  void unlock() ABSL_UNLOCK_FUNCTION() { Unlock(); }

 private:
  std::shared_mutex mu_;
  std::condition_variable_any changed_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

class ABSL_SCOPED_LOCKABLE ReaderMutexLock {
 public:
  explicit ReaderMutexLock(Mutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->ReaderLock();
  }
  ~ReaderMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->ReaderUnlock(); }
  ReaderMutexLock(const ReaderMutexLock&) = delete;
  ReaderMutexLock& operator=(const ReaderMutexLock&) = delete;

 private:
  Mutex* const mu_;
};

class CondVar {
 public:
  void Wait(Mutex* mu) { cv_.wait(*mu); }
  // As absl::CondVar's: true if `deadline` passed before a signal.
  bool WaitWithDeadline(Mutex* mu, absl::Time deadline) {
    if (deadline == absl::InfiniteFuture()) {
      cv_.wait(*mu);
      return false;
    }
    return cv_.wait_until(*mu, absl::ToChronoTime(deadline)) == std::cv_status::timeout;
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable_any cv_;
};

#endif

}  // namespace swirl

#endif  // SWIRL_BASE_MUTEX_H_
