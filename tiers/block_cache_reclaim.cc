// CacheDisk's side of the disk tier's life cycle (block_cache_disk.h):
// adopting the records the index held at start-up, and answering a
// region's reclaim (drop, or carry a hot block forward) and its carries'
// end. The rest of the disk side is in block_cache_disk.cc.
#include <algorithm>

#include "common/check.h"
#include "tiers/block_cache_disk.h"
#include "tiers/block_cache_policy.h"

namespace kvtier {

uint64_t CacheDisk::AdoptDiskRecords(std::vector<DiskRecord> records) {
  std::sort(records.begin(), records.end(),
            [](const DiskRecord& a, const DiskRecord& b) { return a.location.sequence < b.location.sequence; });
  uint64_t adopted = 0;
  for (const DiskRecord& r : records) {
    const std::optional<TenantId> owner = cache_.policy_->TenantNamed(r.header.owner);
    if (!owner || r.header.owner.empty() ||
        cache_.index_.Find(r.header.key) != nullptr || cache_.disk_only_.Find(r.header.key) != nullptr ||
        r.location.device > UINT8_MAX || r.location.offset % kRecordAlignBytes != 0 ||
        r.location.offset >= DiskOnlyBlock::kOffsetLimitBytes ||
        // Packed records need the codec pool to be read back.
        (r.header.packed() && cache_.options_.codecs == nullptr)) {
      cache_.options_.disk->Forget(r.header.key, r.location);
      continue;
    }
    DiskOnlyBlock b;
    b.key = r.header.key;
    b.set_offset_bytes(r.location.offset);
    b.block_bytes = static_cast<uint32_t>(r.header.payload_bytes);
    b.packed = r.header.packed() ? 1 : 0;
    b.bare = r.location.format == RecordFormat::kBare ? 1 : 0;
    b.checksum = r.location.checksum;
    b.owner = *owner;
    Result<uint32_t> ns = cache_.namespaces_.IdFor(r.header.ns);
    // More layouts on disk than the node may hold now; or a packed record
    // whose format is not its namespace's (the fingerprint fixes both, so
    // only a damaged index can say otherwise).
    const bool format_ok =
        ns && (!r.header.packed() ||
               cache_.namespaces_.SetFormat(*ns, {r.header.raw_bytes, {r.header.codec, r.header.dtype, r.header.group_elems}}));
    if (!format_ok) {
      cache_.options_.disk->Forget(r.header.key, r.location);
      continue;
    }
    b.ns = static_cast<uint16_t>(*ns);
    b.device = static_cast<uint8_t>(r.location.device);
    cache_.disk_only_.Insert(b);
    cache_.Charge(b, +1);
    cache_.CountPresent(Presence::kDisk, true);
    cache_.policy_->LogDiskRecord(b.owner, b.key, r.location);  // oldest first: records is in write order
    ++adopted;
  }
  // A quota lowered across the restart: once, over every adopted record.
  cache_.policy_->EnforceDiskQuotas(static_cast<uint32_t>(std::min<uint64_t>(2 * adopted + 1, UINT32_MAX)));
  return adopted;
}

ReclaimAnswer CacheDisk::ReclaimFromDisk(const StoredKey& key, const DiskLocation& where,
                                          bool may_carry) {
  auto is_here = [&](uint32_t device, uint64_t offset) {
    return device == where.device && offset == where.offset;
  };
  DiskOnlyBlock* b = cache_.disk_only_.Find(key);
  BlockEntry* e = b == nullptr ? cache_.index_.Find(key) : nullptr;
  if (b != nullptr ? !is_here(b->device, b->offset_bytes())
                   : (e == nullptr || !e->on_disk || !is_here(e->disk.device, e->disk.offset))) {
    return {ReclaimAction::kStale};
  }
  // The learned gate learns from its samples as they leave the disk.
  if (cache_.options_.disk_admit_learned) {
    gate_.Learn(b != nullptr ? b->disk_gate : e->disk_gate, (b != nullptr ? b->hits : e->hits) > 0,
                cache_.tier(Tier::kDisk)->blocks);
  }
  if (e != nullptr && e->tier != Tier::kDisk) {
    // Also in memory: only the disk copy goes (the block is dirty again).
    // Where every host block was promised to disk (write-through, or a
    // flush under way), it goes back in line to be written.
    cache_.SetOnDisk(e, false);
    if (e->tier == Tier::kHost && (cache_.options_.disk_write_through || flushing_)) {
      QueueDiskWrite(key, /*keep_in_memory=*/!flushing_);
      cache_.SchedulePump();
    }
    return {ReclaimAction::kDropped};
  }
  if (e != nullptr && (e->moving || e->leases > 0)) {
    // A load's read of it is in flight (the region waits for it; it lands
    // in host), or a load holds it and its last Unlease erases it.
    cache_.SetOnDisk(e, false);
    return {ReclaimAction::kDropped};
  }
  if (b != nullptr && b->hits == 0) {
    cache_.DropDiskOnly(b, /*forget=*/false);
    return {ReclaimAction::kDropped};
  }
  if (e == nullptr) e = cache_.Materialize(key);
  // Hit since it was written: carried forward, while the region's carry
  // budget and the write budget last.
  if (e->hits > 0) {
    // The budget is for the bare record it becomes.
    const uint64_t record = RecordBytes(e->disk_payload_bytes);
    if (may_carry && TakeWriteBudget(record)) {
      e->moving = true;  // until FinishRelocation; loads wait for it there
      cache_.index_.Park(e);
      disk_waiters_.try_emplace(key);
      ++cache_.inflight_copies_;
      ReclaimAnswer carry(ReclaimAction::kCarry);
      carry.header = RecordHeaderOf(e, e->disk_payload_bytes, e->disk.checksum, e->disk.packed);
      carry.format = e->disk.format;
      return carry;
    }
    ++cache_.counters_.disk_reinsertions_dropped;
  }
  cache_.CountEviction(Tier::kDisk, e->owner);
  cache_.Charge(e, -1);
  cache_.SetOnDisk(e, false);  // the reclaim deletes its index entry
  cache_.Erase(e);
  return {ReclaimAction::kDropped};
}

void CacheDisk::FinishRelocation(const StoredKey& key, Result<DiskLocation> now) {
  --cache_.inflight_copies_;
  BlockEntry* e = cache_.index_.Find(key);  // moving entries are never dropped
  KVTIER_CHECK(e != nullptr && e->moving && e->tier == Tier::kDisk);
  e->moving = false;
  cache_.index_.Unpark(e, /*hot=*/true);
  if (!now) RefundWriteBudget(RecordBytes(e->disk_payload_bytes));
  if (now) {
    e->disk = *now;
    cache_.SetOnDisk(e, true);
    e->hits = 0;
    ++cache_.counters_.disk_reinsertions;
    cache_.policy_->LogDiskRecord(e->owner, key, *now);  // written again: the newest now
  } else {
    cache_.SetOnDisk(e, false);  // its old record went with the reclaim: nothing is left
  }
  cache_.SchedulePump();  // a flush may have been waiting for this append
  // Loads that came meanwhile wait in disk_waiters_: read it for them now.
  std::vector<std::function<void(bool)>> waiters = TakeWaiters(key);
  if (waiters.empty()) {
    if (e->on_disk) {
      cache_.Dematerialize(e);
    } else if (e->leases == 0) {
      cache_.Drop(e);
    }
  } else if (e->on_disk) {
    disk_waiters_.emplace(key, std::move(waiters));
    ReadIntoHost(e);
  } else {
    for (const auto& w : waiters) w(false);  // their Unlease erases it
  }
}

}  // namespace kvtier
