// Mutex, MutexLock and CondVar: std::mutex with thread-safety annotations, so
// that clang checks GUARDED_BY/REQUIRES on every member they protect.
//
// Thread-safe (that is their purpose). Not recursive.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "common/thread_annotations.h"

namespace kvtier {

class KVTIER_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() KVTIER_ACQUIRE() { mu_.lock(); }
  void Unlock() KVTIER_RELEASE() { mu_.unlock(); }
  bool TryLock() KVTIER_TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Documents (and, for the analysis, asserts) that the caller holds the lock.
  void AssertHeld() const KVTIER_ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex for its scope.
class KVTIER_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) KVTIER_ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() KVTIER_RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable used with a Mutex. The mutex is passed to each wait
// (as in Abseil) so that the thread-safety analysis can check it is held.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Atomically releases *mu, waits for a signal, reacquires *mu. Spurious
  // wake-ups happen: wait in a loop.
  void Wait(Mutex* mu) KVTIER_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // As Wait, for at most `timeout`. Returns false on timeout.
  bool WaitFor(Mutex* mu, std::chrono::nanoseconds timeout) KVTIER_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool signalled = cv_.wait_for(lock, timeout) == std::cv_status::no_timeout;
    lock.release();
    return signalled;
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace kvtier
