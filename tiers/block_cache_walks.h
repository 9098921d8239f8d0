// CacheWalks: BlockCache's operator calls that walk the whole cache (issue
// 34): Evict (kvtierctl evict) and VerifyDisk (kvtierctl verify), which
// reads back every disk record and checks it. Both walk in bounded steps,
// one per turn of the loop: memory a chunk of the index at a time, disk a
// region's listing at a time.
//
// It owns the Evicts waiting or running and the running (or last)
// verification. Its promises:
//   - A walk's step is bounded whatever the cache's size.
//   - It drops only unleased, settled blocks (Evict), or records that
//     failed their checks and are still their block's (VerifyDisk), as a
//     load would; a block in memory keeps its copy there.
//   - One Evict runs at a time, in the order asked; one verification.
//
// Who may call: BlockCache (its Evict, pending_evicts, VerifyDisk and
// CancelVerify), on the owner thread.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "tiers/block_cache.h"

namespace kvtier {

class CacheWalks {
 public:
  explicit CacheWalks(BlockCache& cache) : cache_(cache) {}
  CacheWalks(const CacheWalks&) = delete;
  CacheWalks& operator=(const CacheWalks&) = delete;

  // BlockCache's calls of the same names.
  void Evict(EvictFilter filter, std::function<void(uint64_t)> done);
  size_t pending_evicts() const { return evicts_.size(); }
  std::shared_ptr<const VerifyProgress> VerifyDisk(uint32_t max_inflight);
  void CancelVerify();

 private:
  // A walk over the disk tier's records a region at a time (Evict,
  // VerifyDisk): each listing is O(records in the region).
  struct DiskWalk {
    uint32_t device = 0;
    uint32_t region = 0;
    std::vector<DiskTier::RegionRecord> records;
    size_t next = 0;
    // The record the walk is at, listing the next region when this one is
    // done while `listings` last (each takes one); nullptr at the end, or
    // when out of listings.
    const DiskTier::RegionRecord* At(const DiskTier& disk, uint32_t& listings);
    bool Finished(const DiskTier& disk) const {
      return device >= disk.num_devices() && next == records.size();
    }
    void Stop() {
      records.clear();
      next = 0;
      device = UINT32_MAX;
    }
  };
  // An Evict: its filter, where its walk is, what it dropped so far.
  struct Eviction {
    EvictFilter filter;
    std::optional<uint32_t> ns;  // the filter's layout's id, pinned until the end
    std::function<void(uint64_t)> done;
    size_t chunk = 0;  // the memory walk's next chunk of the index
    DiskWalk disk;
    uint64_t evicted = 0;
  };
  // Evict's steps: the running one goes on for a bounded step.
  void PumpEvict();
  bool EvictMatches(const Eviction& job, TenantId owner, uint32_t ns) const;
  // VerifyDisk's steps: keep reads in flight; judge one read.
  struct Verification;
  void PumpVerify();
  void FinishVerifyRead(const std::shared_ptr<Verification>& held, size_t buffer,
                        const StoredKey& key, const DiskLocation& where, Status status);

  BlockCache& cache_;
  std::shared_ptr<Verification> verification_;  // the running or last VerifyDisk
  std::deque<std::unique_ptr<Eviction>> evicts_;  // the front one runs (a step posted)
};

}  // namespace kvtier
