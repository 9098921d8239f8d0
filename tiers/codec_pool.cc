#include "tiers/codec_pool.h"

#include <utility>

namespace kvtier {

CodecPool::CodecPool(Options options) : options_(options) {}

Result<std::unique_ptr<CodecPool>> CodecPool::Create(Options options) {
  if (options.threads == 0 || options.max_queued == 0) {
    return Err(InvalidArgument("codec pool: threads and max_queued must be at least 1"));
  }
  std::unique_ptr<CodecPool> pool(new CodecPool(options));
  for (uint32_t i = 0; i < options.threads; ++i) {
    Result<std::unique_ptr<BlockCodec>> codec = BlockCodec::Create();
    if (!codec) return Err(codec.error());
    pool->codecs_.push_back(std::move(*codec));
  }
  for (const auto& codec : pool->codecs_) {
    pool->threads_.emplace_back([p = pool.get(), c = codec.get()] { p->Work(c); });
  }
  return pool;
}

CodecPool::~CodecPool() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  wake_.SignalAll();
  for (std::thread& t : threads_) t.join();
}

bool CodecPool::TryRun(Job job) {
  {
    MutexLock lock(&mu_);
    if (queue_.size() >= options_.max_queued) {
      ++refused_;
      return false;
    }
    queue_.push_back(std::move(job));
  }
  wake_.Signal();
  return true;
}

void CodecPool::Run(Job job) {
  {
    MutexLock lock(&mu_);
    queue_.push_back(std::move(job));
  }
  wake_.Signal();
}

CodecPoolCounters CodecPool::counters() const {
  MutexLock lock(&mu_);
  return {jobs_, refused_, queue_.size()};
}

void CodecPool::Work(BlockCodec* codec) {
  for (;;) {
    Job job;
    {
      MutexLock lock(&mu_);
      while (queue_.empty() && !stopping_) wake_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping, and nothing left to run
      job = std::move(queue_.front());
      queue_.pop_front();
      ++jobs_;
    }
    job(*codec);
  }
}

}  // namespace kvtier
