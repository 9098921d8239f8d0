// BlockCache's disk side: write-back to the disk tier, reads back up to
// host (shared between loads), recovery, reclaim with hot-block
// reinsertion, the write budget. The class is declared in block_cache.h; this
// file only keeps block_cache.cc to the memory tiers.
#include <algorithm>

#include "common/check.h"
#include "tiers/block_cache.h"

namespace kvtier {

bool BlockCache::BackToDisk(BlockEntry* e) {
  if (!e->on_disk || e->tier != Tier::kHost || e->leases != 0 || e->moving || e->retired_slot != nullptr) {
    return false;
  }
  uint8_t* slot = e->slot;
  Charge(e, -1);
  index_.ChangeTier(e, Tier::kDisk);
  e->slot = nullptr;
  Charge(e, +1);
  tier(Tier::kHost)->pool->Free(slot, e->block_bytes);
  ++counters_.disk_returns;
  Dematerialize(e);
  return true;
}

BlockEntry* BlockCache::Materialize(const StoredKey& key) {
  DiskOnlyBlock* b = disk_only_.Find(key);
  if (b == nullptr) return nullptr;
  const DiskOnlyBlock copy = *b;
  disk_only_.Erase(b);
  // Same tier, owner and size: the accounting does not change.
  BlockEntry* e = index_.Insert(key, Tier::kDisk, nullptr);
  e->block_bytes = copy.block_bytes;
  e->ns = copy.ns;
  e->owner = copy.owner;
  e->hits = copy.hits;
  e->state = EntryState::kReady;
  e->on_disk = true;
  e->disk = options_.disk->LocationOf(copy.device, uint64_t{copy.offset_pages} * kRecordAlignBytes, copy.block_bytes);
  return e;  // its checksum comes with the read (has_checksum stays false until then)
}

void BlockCache::Dematerialize(BlockEntry* e) {
  if (e->tier != Tier::kDisk || !e->on_disk || e->state != EntryState::kReady || e->moving || e->leases != 0 ||
      e->retired_slot != nullptr) {
    return;
  }
  KVTIER_CHECK(e->disk.offset % kRecordAlignBytes == 0 && e->disk.device <= UINT8_MAX &&
               e->disk.offset / kRecordAlignBytes <= UINT32_MAX && e->ns <= UINT16_MAX);
  DiskOnlyBlock b;
  b.key = e->key;
  b.offset_pages = static_cast<uint32_t>(e->disk.offset / kRecordAlignBytes);
  b.block_bytes = e->block_bytes;
  b.owner = e->owner;
  b.ns = static_cast<uint16_t>(e->ns);
  b.hits = e->hits;
  b.device = static_cast<uint8_t>(e->disk.device);
  index_.Erase(e);
  disk_only_.Insert(b);
}

std::vector<StoredKey> BlockCache::ResidentOnDisk(uint32_t device, uint32_t region) {
  std::vector<StoredKey> keys;
  disk_only_.ForEach([&](const DiskOnlyBlock& b) {
    if (b.device != device) return;
    if (options_.disk->LocationOf(b.device, uint64_t{b.offset_pages} * kRecordAlignBytes, b.block_bytes).region ==
        region) {
      keys.push_back(b.key);
    }
  });
  index_.ForEach([&](BlockEntry* e) {
    if (e->on_disk && e->disk.device == device && e->disk.region == region) keys.push_back(e->key);
  });
  return keys;
}

void BlockCache::PromoteFromDisk(BlockEntry* e, std::function<void(bool)> then) {
  auto [it, first] = disk_waiters_.try_emplace(e->key);
  if (then) it->second.push_back(std::move(then));
  if (!first) return;  // a read of this block is already in flight: share it
  uint8_t* dst = AllocateSlot(Tier::kHost, e->block_bytes, /*may_drop=*/true);
  if (dst == nullptr) {
    // Host is all leased: the block stays on disk and this load misses it.
    auto waiters = std::move(it->second);
    disk_waiters_.erase(it);
    options_.post([waiters = std::move(waiters)] {
      for (const auto& w : waiters) w(false);
    });
    return;
  }
  e->moving = true;
  ++inflight_copies_;
  options_.disk->Read(e->key, e->disk, e->block_bytes, dst,
                      [this, key = e->key, dst, start = std::chrono::steady_clock::now()](Status st, uint64_t checksum) {
                        counters_.disk_read_latency.RecordSince(start);
                        FinishDiskRead(key, dst, std::move(st), checksum);
                      });
}

void BlockCache::FinishDiskRead(const StoredKey& key, uint8_t* dst, Status status, uint64_t checksum) {
  --inflight_copies_;
  BlockEntry* e = index_.Find(key);  // moving entries are never dropped
  KVTIER_CHECK(e != nullptr && e->moving && e->tier == Tier::kDisk);
  e->moving = false;
  const bool ok = status.ok();
  if (ok) {
    Charge(e, -1);
    index_.ChangeTier(e, Tier::kHost);
    e->slot = dst;
    e->checksum = checksum;
    e->has_checksum = true;
    Charge(e, +1);
    ++counters_.disk_promotions;
    counters_.bytes_disk_to_host += e->block_bytes;
  } else {
    tier(Tier::kHost)->pool->Free(dst, e->block_bytes);
    ++counters_.disk_read_failures;
    // The record is bad: it is no disk copy any more (and the block must not
    // go back to the disk-only table when the loads below let go of it).
    options_.disk->Forget(e->key, e->disk);
    e->on_disk = false;
  }
  auto it = disk_waiters_.find(key);
  std::vector<std::function<void(bool)>> waiters;
  if (it != disk_waiters_.end()) {
    waiters = std::move(it->second);
    disk_waiters_.erase(it);
  }
  for (const auto& w : waiters) w(ok);  // loads release their leases of a failed block here
  if (!ok) {
    e = index_.Find(key);
    // Never served: a record that failed its checks (or its read) is dropped.
    if (e != nullptr && e->leases == 0 && !e->moving) Drop(e);
  }
  MaybeDemote();
}

void BlockCache::StartDiskWrite(BlockEntry* e, bool keep_in_memory) {
  e->moving = true;
  // A write-through copy leaves nothing in host: no space is on its way out.
  const uint64_t stride = keep_in_memory ? 0 : SlotPool::StrideFor(e->block_bytes);
  tier(Tier::kHost)->moving_out_bytes += stride;
  ++inflight_copies_;
  RecordHeader h;
  h.key = e->key;
  h.ns = namespace_fingerprints_.at(e->ns);
  h.payload_bytes = e->block_bytes;
  h.payload_checksum = e->checksum;
  if (e->owner < tenant_names_.size()) h.owner = tenant_names_[e->owner];
  options_.disk->Append(std::move(h), e->slot,
                        [this, key = e->key, stride, keep_in_memory,
                         start = std::chrono::steady_clock::now()](Result<DiskLocation> where) {
                          counters_.disk_write_latency.RecordSince(start);
                          FinishDiskWrite(key, stride, keep_in_memory, std::move(where));
                        });
}

void BlockCache::FinishDiskWrite(const StoredKey& key, uint64_t stride, bool keep_in_memory,
                                 Result<DiskLocation> where) {
  --inflight_copies_;
  tier(Tier::kHost)->moving_out_bytes -= stride;
  BlockEntry* e = index_.Find(key);
  KVTIER_CHECK(e != nullptr && e->moving && e->tier == Tier::kHost);
  e->moving = false;
  if (!where) {
    ++counters_.disk_write_failures;  // it stays in host; the next pass may drop it
    MaybeDemote();
    return;
  }
  ++counters_.disk_demotions;
  counters_.bytes_host_to_disk += e->block_bytes;
  if (keep_in_memory) {  // write-through: now clean, still served from memory
    e->disk = *where;
    e->on_disk = true;
    MaybeDemote();
    return;
  }
  uint8_t* old = e->slot;
  Charge(e, -1);
  index_.ChangeTier(e, Tier::kDisk);
  e->slot = nullptr;
  e->disk = *where;
  e->on_disk = true;
  Charge(e, +1);
  if (e->leases > 0) {
    KVTIER_CHECK(e->retired_slot == nullptr);
    e->retired_slot = old;  // loads that leased it before still read the host slot
    e->retired_tier = Tier::kHost;
  } else {
    tier(Tier::kHost)->pool->Free(old, e->block_bytes);
    Dematerialize(e);
  }
  MaybeDemote();
}

uint64_t BlockCache::AdoptDiskRecords(std::vector<DiskRecord> records) {
  std::sort(records.begin(), records.end(),
            [](const DiskRecord& a, const DiskRecord& b) { return a.location.sequence < b.location.sequence; });
  uint64_t adopted = 0;
  for (const DiskRecord& r : records) {
    auto owner = std::find(tenant_names_.begin(), tenant_names_.end(), r.header.owner);
    if (owner == tenant_names_.end() || r.header.owner.empty() || index_.Find(r.header.key) != nullptr ||
        disk_only_.Find(r.header.key) != nullptr || r.location.device > UINT8_MAX) {
      options_.disk->Forget(r.header.key, r.location);
      continue;
    }
    DiskOnlyBlock b;
    b.key = r.header.key;
    b.offset_pages = static_cast<uint32_t>(r.location.offset / kRecordAlignBytes);
    b.block_bytes = static_cast<uint32_t>(r.header.payload_bytes);
    b.owner = static_cast<TenantId>(owner - tenant_names_.begin());
    b.ns = static_cast<uint16_t>(NamespaceId(r.header.ns));
    b.device = static_cast<uint8_t>(r.location.device);
    disk_only_.Insert(b);
    Charge(Tier::kDisk, b.owner, b.block_bytes, +1);
    ++adopted;
  }
  return adopted;
}

// Blocks with at least this many hits are reinserted when their disk region
// is reclaimed, instead of dropped.
constexpr uint16_t kHotHits = 2;

bool BlockCache::ReclaimFromDisk(const StoredKey& key, bool commit) {
  // The disk tier asks only about keys whose current record is in the region.
  if (DiskOnlyBlock* b = disk_only_.Find(key); b != nullptr) {
    if (!commit && b->hits >= kHotHits) {
      ++counters_.disk_reinsertions;  // as below, for a block only on disk
      PromoteFromDisk(Materialize(key), nullptr);
      return false;
    }
    if (commit) {
      CountEviction(Tier::kDisk, b->owner);
      Charge(Tier::kDisk, b->owner, b->block_bytes, -1);
      disk_only_.Erase(b);
    }
    return true;
  }
  BlockEntry* e = index_.Find(key);
  if (e == nullptr || !e->on_disk) return true;
  if (e->tier != Tier::kDisk) {
    // Also in host: only the disk copy goes (unless a read of it is running).
    if (e->moving) return false;
    if (commit) e->on_disk = false;
    return true;
  }
  if (e->leases > 0 || e->moving) return false;
  if (!commit && e->hits >= kHotHits) {
    // A hot block is not lost with its region: read it up to host (its
    // region waits for that read; a colder host block makes room), from
    // where it is written to a new region when host lets it go.
    ++counters_.disk_reinsertions;
    PromoteFromDisk(e, nullptr);
    return false;
  }
  if (commit) {
    CountEviction(Tier::kDisk, e->owner);
    Charge(e, -1);
    e->on_disk = false;  // the disk tier already deleted its index entry
    index_.Erase(e);
  }
  return true;
}

bool BlockCache::TakeWriteBudget(uint64_t bytes) {
  const uint64_t per_day = options_.disk_write_budget_bytes_per_day;
  if (per_day == 0) return true;
  const auto now = options_.clock();
  const double elapsed_s = std::chrono::duration<double>(now - budget_refilled_).count();
  budget_refilled_ = now;
  budget_tokens_ = std::min(static_cast<double>(per_day),
                            budget_tokens_ + elapsed_s * static_cast<double>(per_day) / 86400.0);
  if (budget_tokens_ < static_cast<double>(bytes)) return false;
  budget_tokens_ -= static_cast<double>(bytes);
  return true;
}

uint64_t BlockCache::FlushToDisk() {
  if (options_.disk == nullptr) return 0;
  auto dirty = [](const BlockEntry* e) {
    return e->tier == Tier::kHost && e->state == EntryState::kReady && !e->on_disk && !e->moving &&
           e->has_checksum;
  };
  std::vector<StoredKey> keys;
  index_.ForEach([&](BlockEntry* e) {
    if (dirty(e)) keys.push_back(e->key);
  });
  // By key, not by pointer: starting one write can reclaim a region, whose
  // hot blocks then take host slots from colder ones (maybe later ones here).
  uint64_t started = 0;
  for (const StoredKey& key : keys) {
    BlockEntry* e = index_.Find(key);
    if (e == nullptr || !dirty(e)) continue;
    StartDiskWrite(e);
    ++started;
  }
  return started;
}

}  // namespace kvtier
