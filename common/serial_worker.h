// SerialWorker: one thread that runs closures in the order they were given,
// for slow work an event loop must not wait on (kvtierd maps registered
// memory on one). Results go back however the closure chooses (kvtierd:
// Server::Post).
//
// Thread-safe. Destruction runs what is queued, then joins the thread.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <utility>

#include "common/mutex.h"

namespace kvtier {

class SerialWorker {
 public:
  SerialWorker() : thread_([this] { Loop(); }) {}
  ~SerialWorker() {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    cv_.Signal();
    thread_.join();
  }
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  void Run(std::function<void()> fn) {
    {
      MutexLock lock(&mu_);
      queue_.push_back(std::move(fn));
    }
    cv_.Signal();
  }

 private:
  void Loop() {
    while (true) {
      std::function<void()> fn;
      {
        MutexLock lock(&mu_);
        while (queue_.empty() && !stopping_) cv_.Wait(&mu_);
        if (queue_.empty()) return;  // stopping, and drained
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      fn();
    }
  }

  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> queue_ KVTIER_GUARDED_BY(mu_);
  bool stopping_ KVTIER_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace kvtier
