// BlockCache's entries and what every side shares through them: their
// presence (each change told to the listener), their accounting per tier,
// namespace and tenant, leases and retired slots, the disk-only table, and
// the ways a block leaves (Drop, DropDiskOnly, BackToDisk).
#include <algorithm>

#include "common/check.h"
#include "tiers/block_cache.h"
#include "tiers/block_cache_policy.h"
#include "tiers/block_cache_remote.h"
#include "tiers/disk_gate.h"

namespace kvtier {

void RequestCounters::Add(const RequestCounters& o) {
  lookups += o.lookups;
  lookup_keys += o.lookup_keys;
  misses += o.misses;
  stores += o.stores;
  already_stored += o.already_stored;
  store_rejected += o.store_rejected;
  stores_discarded += o.stores_discarded;
  loads += o.loads;
  bytes_engine_to_cache += o.bytes_engine_to_cache;
  bytes_cache_to_engine += o.bytes_cache_to_engine;
  for (size_t t = 0; t < kNumTiers; ++t) {
    hits[t] += o.hits[t];
    evictions[t] += o.evictions[t];
  }
}

uint64_t BlockCache::TenantUsedBytes(TenantId tenant, Tier t) const {
  return tenant < tenant_shares_.size() ? tenant_shares_[tenant].used_bytes[static_cast<size_t>(t)]
                                        : 0;
}

uint64_t BlockCache::TenantBlocks(TenantId tenant) const {
  const TenantShare s = ShareOf(tenant);
  return s.blocks[0] + s.blocks[1] + s.blocks[2];
}

TenantShare BlockCache::ShareOf(TenantId tenant) const {
  return tenant < tenant_shares_.size() ? tenant_shares_[tenant] : TenantShare{};
}

TenantShare& BlockCache::Counted(TenantId tenant) {
  if (tenant_shares_.size() <= tenant) tenant_shares_.resize(size_t{tenant} + 1);
  return tenant_shares_[tenant];
}

void BlockCache::CountEviction(Tier t, TenantId owner) { ++Counted(owner).evictions[static_cast<size_t>(t)]; }

CacheCounters BlockCache::counters() const {
  CacheCounters c = counters_;
  for (const TenantShare& share : tenant_shares_) c.Add(share);
  return c;
}

void BlockCache::CountLookup(TenantId tenant, std::span<const Tier> hit_tiers, size_t num_keys) {
  TenantShare& mine = Counted(tenant);
  for (Tier t : hit_tiers) ++mine.hits[static_cast<size_t>(t)];
  ++mine.lookups;
  mine.lookup_keys += num_keys;
  mine.misses += num_keys - hit_tiers.size();
}

void BlockCache::Charge(BlockEntry* e, int sign) { Charge(e->tier, e->owner, e->ns, ChargedBytes(e), sign); }

LayoutFingerprint BlockCache::NamespaceOf(const Layout& layout, const CodecParams& codec) {
  return CodedFingerprint(layout.fingerprint(), codec);
}

NamespaceFormat BlockCache::FormatFor(const Layout& layout, const CodecParams& codec) {
  // A layout's own namespace holds raw and lossless blocks alike.
  if (codec.kind == CodecKind::kFp8) return {layout.block_bytes(), codec};
  return {layout.block_bytes(), {.kind = CodecKind::kLossless, .dtype = layout.spec().dtype, .group_elems = 0}};
}

void BlockCache::Charge(const DiskOnlyBlock& b, int sign) {
  Charge(Tier::kDisk, b.owner, b.ns, b.block_bytes, sign);
}

void BlockCache::Charge(Tier tier_id, TenantId owner, uint32_t ns, uint64_t bytes, int sign) {
  namespaces_.Charge(ns, owner, tier_id, bytes, sign);
  const size_t t = static_cast<size_t>(tier_id);
  TenantShare& mine = Counted(owner);
  if (sign > 0) {
    tiers_[t]->blocks += 1;
    tiers_[t]->used_bytes += bytes;
    mine.used_bytes[t] += bytes;
    mine.blocks[t] += 1;
  } else {
    tiers_[t]->blocks -= 1;
    tiers_[t]->used_bytes -= bytes;
    mine.used_bytes[t] -= bytes;
    mine.blocks[t] -= 1;
  }
}

BlockEntry* BlockCache::InsertFilling(const StoredKey& key, const StoredKey* parent, Tier t, uint8_t* slot,
                                      uint64_t bytes, uint32_t ns, TenantId tenant, uint64_t coded_bytes) {
  BlockEntry* e = index_.Insert(key, t, parent);
  e->slot = slot;
  tier(t)->pool->SetOwner(slot, e);
  e->block_bytes = static_cast<uint32_t>(bytes);
  e->coded_bytes = static_cast<uint32_t>(coded_bytes);
  e->ns = ns;
  e->owner = tenant;
  e->state = EntryState::kFilling;
  Lease(e, tenant);
  Charge(e, +1);
  return e;
}

void BlockCache::MakeReady(BlockEntry* e) {
  e->state = EntryState::kReady;
  if (e->tier != Tier::kDisk) Tell(true, e, e->tier);  // a disk entry is present by its record
}

void BlockCache::MoveToTier(BlockEntry* e, Tier to) {
  const Tier from = e->tier;
  index_.ChangeTier(e, to);
  if (e->state != EntryState::kReady || from == to) return;
  // Present in the new tier first: a consumer never sees the block held
  // nowhere in between (nor does the listener drop what it keeps of it).
  if (to != Tier::kDisk) Tell(true, e, to);
  if (from != Tier::kDisk) Tell(false, e, from);
}

void BlockCache::SetOnDisk(BlockEntry* e, bool on_disk) {
  if (e->on_disk == on_disk) return;
  e->on_disk = on_disk;
  MarkClean(e);
  if (e->state == EntryState::kReady) Tell(on_disk, e, Tier::kDisk);
}

Result<BlockCache::OrderCounts> BlockCache::CheckOrders() {
  OrderCounts counts;
  Status first;
  index_.ForEach([&](BlockEntry* e) {
    if (!first.ok()) return;
    const bool clean = options_.disk != nullptr ? e->on_disk : e->on_remote;
    if (EvictionOrder::Held(e) && !BlockIndex::HasChildrenAtOrAbove(e, e->tier)) {
      first = Status(StatusCode::kInternal, "block " + e->key.ToHex() + " in " + TierName(e->tier) +
                                                 " is held by children it no longer has there");
    } else if (EvictionOrder::Marked(e) != clean) {
      first = Status(StatusCode::kInternal, "block " + e->key.ToHex() + " in " + TierName(e->tier) + " is marked " +
                                                 (clean ? "dirty" : "clean") + " but is " + (clean ? "clean" : "dirty"));
    }
    counts.held += EvictionOrder::Held(e) ? 1 : 0;
    counts.marked += EvictionOrder::Marked(e) ? 1 : 0;
  });
  if (!first.ok()) return Err(std::move(first));
  return counts;
}

void BlockCache::SetOnRemote(BlockEntry* e) {
  e->on_remote = true;
  MarkClean(e);
}

void BlockCache::SetRemotePresent(BlockEntry* e, bool present) {
  if (e->remote_present == present) return;
  e->remote_present = present;
  Tell(present, e, Presence::kRemote);
}

void BlockCache::Erase(BlockEntry* e) {
  SetRemotePresent(e, false);
  index_.Erase(e);
}

void BlockCache::ForEachPresent(const std::function<void(const StoredKey&, TenantId, uint32_t, Presence)>& fn) {
  index_.ForEach([&](const BlockEntry* e) {
    if (e->remote_present) fn(e->key, e->owner, e->ns, Presence::kRemote);
    if (e->state != EntryState::kReady) return;
    if (e->tier != Tier::kDisk) fn(e->key, e->owner, e->ns, PresenceOf(e->tier));
    if (e->on_disk) fn(e->key, e->owner, e->ns, Presence::kDisk);
  });
  disk_only_.ForEach([&](const DiskOnlyBlock& b) { fn(b.key, b.owner, b.ns, Presence::kDisk); });
}

void BlockCache::Lease(BlockEntry* e, TenantId tenant) {
  index_.AddLease(e);
  ++Counted(tenant).leases;
}

void BlockCache::Unlease(BlockEntry* e, TenantId tenant) {
  --Counted(tenant).leases;
  index_.ReleaseLease(e);
  if (e->leases == 0 && e->retired_slot != nullptr) {
    tier(e->retired_tier)->pool->Free(e->retired_slot, e->retired_bytes);
    e->retired_slot = nullptr;
  }
  if (e->leases == 0) Dematerialize(e);  // a load that could not read it up
}

void BlockCache::Drop(BlockEntry* e) {
  KVTIER_CHECK(e->leases == 0 && !e->moving && e->retired_slot == nullptr);
  if (e->state == EntryState::kReady) {
    CountEviction(e->tier, e->owner);
    if (e->tier != Tier::kDisk) Tell(false, e, e->tier);
    if (e->on_disk) Tell(false, e, Tier::kDisk);
  }
  if (!e->on_disk && remote_->WantsRemotePut(e, Options::RemoteWrite::kOnDemote)) {
    ++counters_.remote_demotions_missed;
  }
  Charge(e, -1);
  if (e->on_disk) options_.disk->Forget(e->key, e->disk);
  if (e->tier != Tier::kDisk) tier(e->tier)->pool->Free(e->slot, SlotBytes(e));
  Erase(e);
}

void BlockCache::RetireSlot(BlockEntry* e, Tier from, uint8_t* old, uint64_t old_bytes) {
  if (e->leases == 0) {
    tier(from)->pool->Free(old, old_bytes);
    return;
  }
  // Loads that leased the block before still read the old slot.
  KVTIER_CHECK(e->retired_slot == nullptr);
  e->retired_slot = old;
  e->retired_tier = from;
  e->retired_bytes = static_cast<uint32_t>(old_bytes);
}

void BlockCache::DropDiskOnly(DiskOnlyBlock* b, bool forget) {
  if (forget) {
    options_.disk->Forget(b->key, options_.disk->LocationOf(RecordRefOf(*b)));
  }
  CountEviction(Tier::kDisk, b->owner);
  Charge(*b, -1);
  CountPresent(Presence::kDisk, false);
  if (options_.listener != nullptr) options_.listener->OnBlockGone(b->key, b->owner, b->ns, Presence::kDisk);
  disk_only_.Erase(b);
}

void BlockCache::Touch(BlockEntry* e) { index_.Touch(e); }

bool BlockCache::BackToDisk(BlockEntry* e) {
  if (!e->on_disk || e->tier != Tier::kHost || e->leases != 0 || e->moving || e->retired_slot != nullptr) {
    return false;
  }
  uint8_t* slot = e->slot;
  const uint64_t slot_bytes = SlotBytes(e);
  Charge(e, -1);
  MoveToTier(e, Tier::kDisk);
  e->slot = nullptr;
  e->coded_bytes = 0;
  Charge(e, +1);
  tier(Tier::kHost)->pool->Free(slot, slot_bytes);
  ++counters_.disk_returns;
  const TenantId owner = e->owner;
  const StoredKey key = e->key;
  Dematerialize(e);
  policy_->DiskGrew(owner, key);
  return true;
}

bool BlockCache::LeaveHostHeldBelow(BlockEntry* e) {
  if (BackToDisk(e)) return true;
  // With a disk tier, host's blocks are held below by their disk record
  // only (as for RoomGate's clean victims): the cluster may let go of a
  // value at any time.
  if (options_.disk != nullptr || !e->on_remote || e->tier != Tier::kHost || e->leases != 0 || e->moving ||
      e->state != EntryState::kReady || e->retired_slot != nullptr) {
    return false;
  }
  Drop(e);
  return true;
}

BlockEntry* BlockCache::Materialize(const StoredKey& key) {
  DiskOnlyBlock* b = disk_only_.Find(key);
  if (b == nullptr) return nullptr;
  const DiskOnlyBlock copy = *b;
  disk_only_.Erase(b);
  // Same tier, owner and record: the accounting does not change.
  BlockEntry* e = index_.Insert(key, Tier::kDisk, nullptr);
  const NamespaceFormat& format = namespaces_.FormatOf(copy.ns);
  e->block_bytes = copy.packed ? static_cast<uint32_t>(format.block_bytes) : copy.block_bytes;
  e->ns = copy.ns;
  e->owner = copy.owner;
  e->hits = copy.hits;
  e->disk_gate = copy.disk_gate;
  e->state = EntryState::kReady;
  e->on_disk = true;
  MarkClean(e);
  e->disk = options_.disk->LocationOf(RecordRefOf(copy));
  e->disk_payload_bytes = copy.block_bytes;
  // Written again (its record lost) as it was, or coded when its namespace
  // is fp8's (a block stored raw there had a NaN or met a busy pool).
  e->compress = copy.packed || format.codec.kind == CodecKind::kFp8;
  return e;  // its checksum comes with the read (has_checksum stays false until then)
}

DiskTier::RecordRef BlockCache::RecordRefOf(const DiskOnlyBlock& b) {
  return {.device = b.device,
          .offset = b.offset_bytes(),
          .payload_bytes = b.block_bytes,
          .packed = b.packed != 0,
          .format = b.bare != 0 ? RecordFormat::kBare : LegacyFormat(b.packed != 0),
          .checksum = b.checksum};
}

void BlockCache::Dematerialize(BlockEntry* e) {
  if (e->tier != Tier::kDisk || e->state != EntryState::kReady || e->moving || e->leases != 0 ||
      e->retired_slot != nullptr) {
    return;
  }
  if (!e->on_disk) {
    // Its record went with a reclaim while a load held it: nothing is left.
    CountEviction(Tier::kDisk, e->owner);
    Charge(e, -1);
    Erase(e);
    return;
  }
  // The tier's devices are at most kMaxDiskPathBytes (DiskTier::Open): every
  // offset fits (set_offset_bytes checks it).
  KVTIER_CHECK(e->disk.device <= UINT8_MAX && e->ns <= UINT16_MAX);
  DiskOnlyBlock b;
  b.key = e->key;
  b.set_offset_bytes(e->disk.offset);
  b.block_bytes = e->disk_payload_bytes;
  b.packed = e->disk.packed ? 1 : 0;
  b.bare = e->disk.format == RecordFormat::kBare ? 1 : 0;
  b.checksum = e->disk.checksum;
  b.owner = e->owner;
  b.ns = static_cast<uint16_t>(e->ns);
  b.hits = std::min(e->hits, DiskOnlyBlock::kMaxHits);
  b.device = static_cast<uint8_t>(e->disk.device);
  b.disk_gate = e->disk_gate & DiskGate::kTagMask;
  Erase(e);
  disk_only_.Insert(b);
}

}  // namespace kvtier
