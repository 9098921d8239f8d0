// Reaper: teardown work (unmapping an engine's memory) on a thread of its
// own, in order, so that whoever drops the last reference to a big resource
// does not pay for it. The event loop does, when a session closes: unmapping
// a populated 256 MiB engine cache took 65 ms there, and an engine's cache
// is often tens of GiB.
//
// Each piece of work has a weight (the maps it unmaps), and at most
// `max_backlog` of weight waits; past that, Run runs the work on the caller,
// so that a tenant closing sessions faster than they unmap cannot pile up
// the node's map count past kvtierd's headroom (its budget is given back as
// the session closes). Work still queued when the reaper is destroyed runs
// before its destructor returns.
//
// Thread-safe; owned through shared_ptr by the backend and by what it hands
// out (whatever outlives the backend still reaps through it).
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <utility>

#include "common/mutex.h"

namespace kvtier {

class Reaper {
 public:
  explicit Reaper(size_t max_backlog);
  ~Reaper();
  Reaper(const Reaper&) = delete;
  Reaper& operator=(const Reaper&) = delete;

  // Runs `work` on the reaper's thread, or here when its weight would take
  // what waits past max_backlog.
  void Run(std::function<void()> work, size_t weight = 1);
  // Returns once everything queued before the call has run (tests).
  void Drain();

 private:
  void Loop();

  const size_t max_backlog_;
  Mutex mu_;
  CondVar cv_;
  std::deque<std::pair<std::function<void()>, size_t>> queue_ KVTIER_GUARDED_BY(mu_);
  size_t waiting_ KVTIER_GUARDED_BY(mu_) = 0;  // the weight in queue_
  size_t running_ KVTIER_GUARDED_BY(mu_) = 0;  // pieces taken off the queue, not done
  bool stopping_ KVTIER_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the rest is built
};

}  // namespace kvtier
