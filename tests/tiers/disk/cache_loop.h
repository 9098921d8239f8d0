// What the tests of a BlockCache over a DiskTier share: the owner thread's
// loop (the cache and the tier post closures; the test thread runs them in
// Drain), and opening the tier with its callbacks wired to the cache.
//
// Thread-safe: Post may be called from any thread; Drain on the test thread.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "tiers/block_cache.h"
#include "tiers/disk/disk_tier.h"

namespace kvtier::tiers_test {

class CacheLoop {
 public:
  // What BlockCache::Options::post and DiskTier::Options::post take. The
  // loop must outlive what it was handed to.
  BlockCache::Post post() {
    return [this](std::function<void()> f) {
      MutexLock lock(&mu_);
      posted_.push_back(std::move(f));
      cv_.SignalAll();
    };
  }

  // Runs posted closures here until `until()` holds; false when nothing was
  // posted for `timeout` and it still does not.
  bool Drain(const std::function<bool()>& until,
             std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!until()) {
      std::deque<std::function<void()>> batch;
      {
        MutexLock lock(&mu_);
        while (posted_.empty()) {
          if (!cv_.WaitFor(&mu_, deadline - std::chrono::steady_clock::now())) return until();
        }
        batch.swap(posted_);
      }
      for (auto& f : batch) f();
    }
    return true;
  }
  bool empty() {
    MutexLock lock(&mu_);
    return posted_.empty();
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> posted_ KVTIER_GUARDED_BY(mu_);
};

// Opens a disk tier over `devices` whose reclaims and relocations go to
// `*cache` (set once the cache exists; a reclaim before that cannot happen,
// since only the cache appends).
inline Result<std::unique_ptr<DiskTier>> OpenDiskUnder(std::unique_ptr<BlockCache>* cache,
                                                        std::vector<BlockDevice*> devices,
                                                        std::string index_path, uint64_t region_bytes,
                                                        BlockCache::Post post) {
  return DiskTier::Open(
      {.devices = std::move(devices),
       .index_path = std::move(index_path),
       .region_bytes = region_bytes,
       .post = std::move(post),
       .reclaim = [cache](const StoredKey& key, const DiskLocation& where,
                          bool may_carry) { return (*cache)->ReclaimFromDisk(key, where, may_carry); },
       .relocated = [cache](const StoredKey& key,
                            Result<DiskLocation> now) { (*cache)->FinishRelocation(key, std::move(now)); }});
}

}  // namespace kvtier::tiers_test
