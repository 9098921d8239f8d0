// SerialExecutor: one thread that runs posted tasks in FIFO order. kvtierd
// maps registered memory on one (slow work the event loop must not wait
// on); the test block devices complete their operations on one, so that
// `done` never runs inside the call that issued the operation (BlockDevice's
// contract) and tests see the same re-entrancy a real device gives them.
//
// Thread-safe. Tasks may post further tasks. Destruction runs everything still
// queued (including what those tasks post), then joins the thread, so every
// `done` runs exactly once.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <utility>

#include "common/mutex.h"

namespace kvtier {

class SerialExecutor {
 public:
  SerialExecutor() : thread_([this] { Loop(); }) {}
  ~SerialExecutor() {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
      work_.Signal();
    }
    thread_.join();
  }
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  void Post(std::function<void()> task) {
    MutexLock lock(&mu_);
    queue_.push_back(std::move(task));
    work_.Signal();
  }

  // Blocks until the queue is empty and no task is running.
  // REQUIRES: not called from a task (it would wait for itself).
  void WaitIdle() {
    MutexLock lock(&mu_);
    while (!queue_.empty() || running_) idle_.Wait(&mu_);
  }

  std::thread::id thread_id() const { return thread_.get_id(); }

 private:
  void Loop() {
    MutexLock lock(&mu_);
    for (;;) {
      while (queue_.empty() && !stopping_) work_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping, and nothing left to complete
      std::function<void()> task = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
      // Unlocked while the task runs: it may post, or a test may inspect the
      // device from another thread.
      mu_.Unlock();
      task();
      mu_.Lock();
      running_ = false;
      if (queue_.empty()) idle_.SignalAll();
    }
  }

  Mutex mu_;
  CondVar work_;
  CondVar idle_;
  std::deque<std::function<void()>> queue_ KVTIER_GUARDED_BY(mu_);
  bool running_ KVTIER_GUARDED_BY(mu_) = false;
  bool stopping_ KVTIER_GUARDED_BY(mu_) = false;
  // Last: started after the members above exist.
  std::thread thread_;
};

}  // namespace kvtier
