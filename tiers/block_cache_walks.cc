// CacheWalks: BlockCache's operator calls that walk the cache
// (block_cache_walks.h): Evict and VerifyDisk, in bounded steps.
#include "tiers/block_cache_walks.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <optional>

#include "common/check.h"

namespace kvtier {

struct CacheWalks::Verification {
  std::shared_ptr<VerifyProgress> progress = std::make_shared<VerifyProgress>();
  DiskWalk walk;
  bool cancelled = false;
  // Scratch payload buffers, 4 KiB aligned (the disk tier reads with
  // O_DIRECT), of the largest block size seen; one per read in flight.
  std::vector<std::unique_ptr<uint8_t, decltype(&std::free)>> buffers;
  std::vector<size_t> free_buffers;
  uint32_t max_inflight = 8;
  uint64_t buffer_bytes = 0;
};

namespace {

bool SameRecord(const DiskLocation& a, const DiskLocation& b) { return a.device == b.device && a.offset == b.offset; }

// Regions whose records PumpVerify lists per call at most (each listing is
// O(records in the region)).
constexpr uint32_t kVerifyRegionsPerStep = 4;
// What one step of an Evict looks at, at most: a chunk of the block index
// (a few thousand entries), or this many disk records and one listing.
constexpr uint32_t kEvictRecordsPerStep = 4096;

}  // namespace

const DiskTier::RegionRecord* CacheWalks::DiskWalk::At(const DiskTier& disk, uint32_t& listings) {
  while (next == records.size()) {
    if (device >= disk.num_devices() || listings == 0) return nullptr;
    --listings;
    records = disk.RecordsIn(device, region);
    next = 0;
    if (++region == disk.num_regions(device)) {
      region = 0;
      ++device;
    }
  }
  return &records[next];
}

void CacheWalks::Evict(EvictFilter filter, std::function<void(uint64_t)> done) {
  auto job = std::make_unique<Eviction>();
  if (filter.layout) {
    job->ns = cache_.namespaces_.Find(*filter.layout);
    if (!job->ns) {  // nothing is stored under that layout
      cache_.options_.post([done = std::move(done)] { done(0); });
      return;
    }
    cache_.namespaces_.Pin(*job->ns);  // so the id names the same layout until the end
  }
  if (cache_.options_.disk == nullptr || (filter.tier && *filter.tier != Tier::kDisk)) job->disk.Stop();
  job->filter = std::move(filter);
  job->done = std::move(done);
  evicts_.push_back(std::move(job));
  if (evicts_.size() == 1) PumpEvict();
}

bool CacheWalks::EvictMatches(const Eviction& job, TenantId owner, uint32_t ns) const {
  const EvictFilter& f = job.filter;
  if (f.owners && std::find(f.owners->begin(), f.owners->end(), owner) == f.owners->end()) return false;
  return !job.ns || ns == *job.ns;
}

void CacheWalks::PumpEvict() {
  if (evicts_.empty()) return;
  Eviction& job = *evicts_.front();
  const std::optional<Tier> t = job.filter.tier;
  if (job.chunk < cache_.index_.chunks()) {
    std::vector<StoredKey> victims;
    cache_.index_.ForEachInChunk(job.chunk++, [&](BlockEntry* e) {
      if (e->leases != 0 || e->moving || e->state != EntryState::kReady) return;
      if ((t && e->tier != *t) || !EvictMatches(job, e->owner, e->ns)) return;
      victims.push_back(e->key);
    });
    for (const StoredKey& key : victims) {
      BlockEntry* e = cache_.index_.Find(key);
      if (e == nullptr) continue;
      ++job.evicted;
      // Evicting from host a block that is also on disk leaves it on disk.
      if (t == Tier::kHost && cache_.BackToDisk(e)) continue;
      cache_.Drop(e);
    }
  } else if (cache_.options_.disk != nullptr && !job.disk.Finished(*cache_.options_.disk)) {
    // Blocks only on disk, by their records: a record that is still its
    // block's (blocks in memory were the memory walk's).
    uint32_t listings = 1;
    for (uint32_t n = 0; n < kEvictRecordsPerStep; ++n) {
      const DiskTier::RegionRecord* r = job.disk.At(*cache_.options_.disk, listings);
      if (r == nullptr) break;
      ++job.disk.next;
      DiskOnlyBlock* b = cache_.disk_only_.Find(r->key);
      if (b == nullptr || b->device != r->location.device ||
          b->offset_bytes() != r->location.offset ||
          !EvictMatches(job, b->owner, b->ns)) {
        continue;
      }
      cache_.DropDiskOnly(b);
      ++job.evicted;
    }
  } else {
    std::unique_ptr<Eviction> finished = std::move(evicts_.front());
    evicts_.pop_front();
    if (finished->ns) cache_.namespaces_.Unpin(*finished->ns);
    finished->done(finished->evicted);
    if (evicts_.empty()) return;
  }
  cache_.options_.post([this, self = std::weak_ptr<BlockCache*>(cache_.self_)] {
    if (self.lock()) PumpEvict();
  });
}

std::shared_ptr<const VerifyProgress> CacheWalks::VerifyDisk(uint32_t max_inflight) {
  if (verification_ && !verification_->progress->done) return verification_->progress;
  auto v = std::make_shared<Verification>();
  verification_ = v;
  if (cache_.options_.disk == nullptr) {
    v->progress->done = true;
    return v->progress;
  }
  v->progress->total = cache_.options_.disk->live_records();
  v->max_inflight = std::max(1u, max_inflight);
  PumpVerify();
  return v->progress;
}

void CacheWalks::CancelVerify() {
  if (!verification_ || verification_->progress->done) return;
  verification_->cancelled = true;
  verification_->walk.Stop();
  if (verification_->free_buffers.size() == verification_->buffers.size())
    verification_->progress->done = true;
}

void CacheWalks::PumpVerify() {
  // Held: a read's completion may start the next verification.
  const std::shared_ptr<Verification> held = verification_;
  Verification& v = *held;
  DiskTier& disk = *cache_.options_.disk;
  uint32_t listings = kVerifyRegionsPerStep;
  bool paused = false;
  while (!v.cancelled) {
    const DiskTier::RegionRecord* at = v.walk.At(disk, listings);
    if (at == nullptr) {
      paused = !v.walk.Finished(disk);  // goes on at the next read's completion, or on a later turn
      break;
    }
    const DiskTier::RegionRecord& item = *at;
    // Still that block's record? Records left behind by blocks that moved
    // or left are no records to check.
    uint32_t block_bytes = 0;
    // Its record, as its owner knows it (payload: the block's bytes, or a
    // codec's when packed).
    std::optional<DiskLocation> where;
    if (const DiskOnlyBlock* b = cache_.disk_only_.Find(item.key); b != nullptr) {
      if (b->device == item.location.device && b->offset_bytes() == item.location.offset) {
        where = cache_.options_.disk->LocationOf(cache_.RecordRefOf(*b));
        block_bytes = b->block_bytes;
      }
    } else if (const BlockEntry* e = cache_.index_.Find(item.key);
               e != nullptr && e->on_disk && !e->moving && SameRecord(e->disk, item.location)) {
      // (A moving block on disk is being read, or carried forward by a
      // reclaim, whose region may already hold other records.)
      where = e->disk;
      block_bytes = e->disk_payload_bytes;
    }
    if (block_bytes == 0) {
      ++v.walk.next;
      continue;
    }
    const uint64_t need = SlotPool::StrideFor(block_bytes);
    if (need > v.buffer_bytes) {
      // A larger block than any before: the buffers grow once it is their
      // turn (none in flight); until then, wait.
      if (v.free_buffers.size() != v.buffers.size()) break;
      v.buffers.clear();
      v.free_buffers.clear();
      v.buffer_bytes = need;
    }
    if (v.free_buffers.empty()) {
      if (v.buffers.size() == v.max_inflight) break;
      void* p = nullptr;
      if (::posix_memalign(&p, kRecordAlignBytes, v.buffer_bytes) != 0) break;
      v.buffers.emplace_back(static_cast<uint8_t*>(p), &std::free);
      v.free_buffers.push_back(v.buffers.size() - 1);
    }
    const size_t buffer = v.free_buffers.back();
    v.free_buffers.pop_back();
    ++v.walk.next;
    ++cache_.inflight_copies_;
    cache_.options_.disk->Read(
        item.key, *where, block_bytes, v.buffers[buffer].get(),
        [this, held, buffer, key = item.key, where = *where](Status st, uint64_t /*checksum*/) {
          FinishVerifyRead(held, buffer, key, where, std::move(st));
        });
  }
  const bool idle = v.free_buffers.size() == v.buffers.size();
  const bool walked = v.cancelled || v.walk.Finished(disk);
  if (walked && idle) v.progress->done = true;
  if (paused && idle) {
    cache_.options_.post([this, held, self = std::weak_ptr<BlockCache*>(cache_.self_)] {
      if (self.lock() && held == verification_) PumpVerify();
    });
  }
}

void CacheWalks::FinishVerifyRead(const std::shared_ptr<Verification>& held, size_t buffer,
                                  const StoredKey& key, const DiskLocation& where, Status status) {
  --cache_.inflight_copies_;
  Verification& v = *held;
  v.free_buffers.push_back(buffer);
  ++v.progress->checked;
  if (!status.ok()) {
    ++v.progress->bad;
    ++cache_.counters_.disk_read_failures;
    // Dropped as a load would drop it, if the record is still the block's
    // and nothing is reading it right now (a load that is reads it and
    // finds the same fault itself).
    if (DiskOnlyBlock* b = cache_.disk_only_.Find(key); b != nullptr) {
      if (b->device == where.device && b->offset_bytes() == where.offset) {
        cache_.DropDiskOnly(b);
      }
    } else if (BlockEntry* e = cache_.index_.Find(key); e != nullptr && e->on_disk && SameRecord(e->disk, where) &&
                                                 !e->moving && e->leases == 0) {
      if (e->tier == Tier::kDisk) {
        cache_.Drop(e);
      } else {  // the copy in memory is good; only the disk copy goes
        cache_.options_.disk->Forget(key, e->disk);
        cache_.SetOnDisk(e, false);
      }
    }
  }
  if (held == verification_) {
    PumpVerify();
  } else if (v.free_buffers.size() == v.buffers.size()) {
    v.progress->done = true;  // a cancelled one, replaced by a newer
  }
}

}  // namespace kvtier
