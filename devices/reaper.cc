#include "devices/reaper.h"

#include <utility>

namespace kvtier {

Reaper::Reaper(size_t max_backlog) : max_backlog_(max_backlog), thread_([this] { Loop(); }) {}

Reaper::~Reaper() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  thread_.join();
  // Nothing is queued after the thread left: Loop drains before it returns.
}

void Reaper::Run(std::function<void()> work, size_t weight) {
  {
    MutexLock lock(&mu_);
    if (!stopping_ && waiting_ + weight <= max_backlog_) {
      queue_.emplace_back(std::move(work), weight);
      waiting_ += weight;
      cv_.SignalAll();
      return;
    }
  }
  work();
}

void Reaper::Drain() {
  MutexLock lock(&mu_);
  while (!queue_.empty() || running_ != 0) cv_.Wait(&mu_);
}

void Reaper::Loop() {
  while (true) {
    std::function<void()> work;
    {
      MutexLock lock(&mu_);
      while (queue_.empty() && !stopping_) cv_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping, and drained
      work = std::move(queue_.front().first);
      waiting_ -= queue_.front().second;
      queue_.pop_front();
      ++running_;
    }
    work();
    work = nullptr;  // what it held goes before the count says it is done
    MutexLock lock(&mu_);
    --running_;
    cv_.SignalAll();
  }
}

}  // namespace kvtier
