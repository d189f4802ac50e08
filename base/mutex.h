// swirl::Mutex, MutexLock, ReaderMutexLock, CondVar, Notification: the part of Abseil's
// synchronization API that swirl uses, with its thread-safety annotations. swirl's own code
// (tests included) uses these, never absl::Mutex or absl::Notification directly.
//
// Normal builds: exactly absl::Mutex and friends. ThreadSanitizer builds (--config=tsan): a
// std::shared_mutex underneath, because Debian's libabsl is not built with TSan: absl::Mutex's
// lock and unlock (and absl::Notification's Notify and wait, which use one) run inside
// libabsl_synchronization.so, where TSan sees neither the atomics nor the futex they
// synchronize through, so it would report every access they order as a race. The TSan variant
// is correct but not fast (Await polls); it exists only to make TSan's verdict mean something.

#ifndef SWIRL_BASE_MUTEX_H_
#define SWIRL_BASE_MUTEX_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

#if defined(__SANITIZE_THREAD__)
#include <atomic>
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
using Notification = absl::Notification;

#else

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    // Wake Await's pollers before releasing, not after: once released, a thread that takes the
    // lock may destroy this Mutex (the object holding it) before a late notify_all reached it.
    changed_.notify_all();
    mu_.unlock();
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
  // As Await, giving up (false) once `deadline` passes with `condition` still false.
  bool AwaitWithDeadline(const absl::Condition& condition, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    while (!condition.Eval()) {
      if (absl::Now() >= deadline) return false;
      std::unique_lock<std::shared_mutex> lock(mu_, std::adopt_lock);
      changed_.wait_for(lock, std::chrono::milliseconds(1));
      lock.release();
    }
    return true;
  }
  bool AwaitWithTimeout(const absl::Condition& condition, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    return AwaitWithDeadline(condition, absl::Now() + timeout);
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

// As absl::Notification: Notify once; waiters return once it has been (or give up, false, at
// their timeout or deadline). Everything before Notify happens before what follows a wait that
// saw it, as TSan sees.
class Notification {
 public:
  Notification() = default;
  explicit Notification(bool prenotify) : notified_(prenotify) {}
  Notification(const Notification&) = delete;
  Notification& operator=(const Notification&) = delete;

  bool HasBeenNotified() const { return notified_.load(std::memory_order_acquire); }
  void Notify() {
    MutexLock lock(&mu_);
    notified_.store(true, std::memory_order_release);
    cv_.SignalAll();
  }
  void WaitForNotification() const { WaitForNotificationWithDeadline(absl::InfiniteFuture()); }
  bool WaitForNotificationWithTimeout(absl::Duration timeout) const {
    return WaitForNotificationWithDeadline(absl::Now() + timeout);
  }
  bool WaitForNotificationWithDeadline(absl::Time deadline) const {
    MutexLock lock(&mu_);
    while (!HasBeenNotified()) {
      if (cv_.WaitWithDeadline(&mu_, deadline)) return HasBeenNotified();
    }
    return true;
  }

 private:
  mutable Mutex mu_;
  mutable CondVar cv_;
  std::atomic<bool> notified_{false};
};

#endif

}  // namespace swirl

#endif  // SWIRL_BASE_MUTEX_H_
