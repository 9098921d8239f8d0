// CodecPool: the threads that encode blocks on their way down to the disk
// tier and decode them on their way back up (issue 18), each with its own
// BlockCodec (zstd contexts, scratch), off the event loop.
//
// Bounded: at most `max_queued` jobs wait. An encode is offered with TryRun
// and refused when the queue is full: the caller stores the block raw and
// counts it, so a store or a write-back never waits for the pool. A decode
// (a block read back for a load) has nowhere else to go and is queued with
// Run, past the bound; reads in flight are bounded by the cache already.
//
// Thread-safe. Jobs run on the pool's threads; what they post back is the
// caller's business. The destructor runs the jobs still queued, then joins.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "kernels/codec.h"

namespace kvtier {

struct CodecPoolCounters {
  uint64_t jobs = 0;     // run
  uint64_t refused = 0;  // TryRun found the queue full
  uint64_t queued = 0;   // waiting now
};

class CodecPool {
 public:
  using Job = std::function<void(BlockCodec&)>;

  struct Options {
    uint32_t threads = 2;      // >= 1
    uint32_t max_queued = 64;  // >= 1: TryRun refuses past it
  };

  // Errors: kInvalidArgument for zero threads or queue; kResourceExhausted
  // when a codec cannot be made.
  static Result<std::unique_ptr<CodecPool>> Create(Options options);
  ~CodecPool();
  CodecPool(const CodecPool&) = delete;
  CodecPool& operator=(const CodecPool&) = delete;

  // Queues `job` unless `max_queued` jobs wait already; returns whether it
  // was queued.
  bool TryRun(Job job);
  // Queues `job` whatever the queue holds.
  void Run(Job job);

  uint32_t threads() const { return static_cast<uint32_t>(threads_.size()); }
  uint32_t max_queued() const { return options_.max_queued; }
  CodecPoolCounters counters() const;

 private:
  explicit CodecPool(Options options);
  void Work(BlockCodec* codec);

  const Options options_;
  mutable Mutex mu_;
  CondVar wake_;
  std::deque<Job> queue_ KVTIER_GUARDED_BY(mu_);
  bool stopping_ KVTIER_GUARDED_BY(mu_) = false;
  uint64_t jobs_ KVTIER_GUARDED_BY(mu_) = 0;
  uint64_t refused_ KVTIER_GUARDED_BY(mu_) = 0;
  std::vector<std::unique_ptr<BlockCodec>> codecs_;  // one per thread
  std::vector<std::thread> threads_;
};

}  // namespace kvtier
