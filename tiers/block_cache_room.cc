// RoomGate: how BlockCache's parts get a slot in a memory tier
// (block_cache_room.h).
#include "tiers/block_cache_room.h"

#include <optional>
#include <span>
#include <vector>

#include "tiers/block_cache_disk.h"
#include "tiers/block_cache_policy.h"
#include "tiers/block_cache_remote.h"

namespace kvtier {

uint8_t* RoomGate::ForStore(Tier t, uint64_t bytes) {
  return AllocateSlot(t, bytes, t == Tier::kHbm ? Room::kNothing : Room::kAny);
}

uint8_t* RoomGate::ForRead(uint64_t bytes, TenantId quota_of, bool for_load) {
  // The block read is safe below host already; the one it would replace
  // might not be.
  if (QuotaRoom(quota_of, bytes, /*clean_only=*/true)) return AllocateSlot(Tier::kHost, bytes, Room::kCleanOnly);
  // Past the quota: served from room nobody uses, not kept (no one else's
  // block goes for it).
  if (!for_load) return nullptr;
  uint8_t* slot = AllocateSlot(Tier::kHost, bytes, Room::kNothing);
  if (slot != nullptr) ++cache_.counters_.reads_past_quota;
  return slot;
}

bool RoomGate::QuotaRoom(TenantId tenant, uint64_t bytes, bool clean_only) {
  while (!cache_.policy_->QuotaAllows(tenant, Tier::kHost, bytes)) {
    if (clean_only) {
      // A block held below host goes: back to disk, or dropped where the
      // cluster holds it. Else, with a disk tier, a dirty one is written
      // back (it counts as leaving, and leaves once written), never dropped.
      if (BlockEntry* held = PickVictim(Tier::kHost, 0, tenant, /*clean_only=*/true); held != nullptr) {
        if (!cache_.BackToDisk(held)) cache_.Drop(held);
        continue;
      }
      BlockEntry* dirty = cache_.options_.disk != nullptr ? PickVictim(Tier::kHost, 0, tenant) : nullptr;
      if (dirty == nullptr || !cache_.disk_->WriteBack(dirty)) return false;
      continue;
    }
    BlockEntry* own = PickVictim(Tier::kHost, 0, tenant);
    if (own == nullptr) return false;
    if (cache_.options_.disk == nullptr) {
      cache_.Drop(own);
    } else {
      cache_.disk_->DemoteFromHost(own);
    }
  }
  return true;
}

uint8_t* RoomGate::ForDemotion(uint64_t bytes) {
  return AllocateSlot(Tier::kHost, bytes, cache_.options_.disk == nullptr ? Room::kAny : Room::kNothing);
}

uint8_t* RoomGate::ForPromotion(uint64_t bytes) { return AllocateSlot(Tier::kHbm, bytes, Room::kNothing); }

uint8_t* RoomGate::ForCompaction(uint64_t bytes) {
  const bool write_back = cache_.options_.disk != nullptr || cache_.remote_->RemoteWriteBack();
  return AllocateSlot(Tier::kHost, bytes, write_back ? Room::kNothing : Room::kAny);
}

namespace {

// Children of a block looked at, at most, to see whether they all leave.
constexpr int kLeavingChildrenChecked = 8;

// Whether every child of `e` in tier `t` or above is on its way below `t`
// (a demotion in flight): then `e` is as good as a leaf of `t` for another
// demotion (PickVictim's moves_down). False past kLeavingChildrenChecked
// children.
bool ChildrenLeaving(const BlockEntry* e, Tier t) {
  int seen = 0;
  for (const BlockEntry* c = e->first_child; c != nullptr; c = c->next_sibling) {
    if (c->tier > t) continue;  // below t: no child of t's
    if (c->tier != t || !c->leaving || ++seen > kLeavingChildrenChecked) return false;
  }
  return true;
}

// Extents one EmptyExtent looks at, at most.
constexpr size_t kExtentCandidates = 4;

}  // namespace

BlockEntry* RoomGate::PickVictim(Tier t, uint64_t block_bytes, std::optional<TenantId> owner, bool clean_only,
                                   bool moves_down) {
  bool last_resort = false;
  cache_.index_.order(t).Expire(cache_.NowMs());
  BlockEntry* victim = cache_.index_.order(t).PickVictim(
      cache_.options_.eviction_scan_limit,
      [&](const BlockEntry* e) {
        ++cache_.counters_.victim_scan_blocks;
        if (e->leases != 0 || e->state != EntryState::kReady || e->moving) return Candidate::kSkip;
        if (block_bytes != 0 && SlotPool::StrideFor(cache_.SlotBytes(e)) != SlotPool::StrideFor(block_bytes)) {
          return Candidate::kSkip;
        }
        if (owner && e->owner != *owner) return Candidate::kSkip;
        if (clean_only && !(cache_.options_.disk != nullptr ? e->on_disk : e->on_remote)) return Candidate::kSkip;
        if (cache_.options_.prefix_aware && BlockIndex::HasChildrenAtOrAbove(e, t)) {
          // hbm's parents go as leaves once their children are all moving
          // down (a demotion); otherwise a parent stays behind its children
          // until they have left its tier, set aside meanwhile (issue 48:
          // the scans walked past the same parents for every victim).
          if (moves_down && ChildrenLeaving(e, t)) return Candidate::kEvict;
          return Candidate::kHeld;
        }
        return Candidate::kEvict;
      },
      &last_resort, /*marked_only=*/clean_only);
  if (last_resort) ++cache_.counters_.prefix_fallbacks;
  return victim;
}

uint8_t* RoomGate::AllocateSlot(Tier t, uint64_t bytes, Room room) {
  BlockCache::TierState* s = cache_.tier(t);
  if (!s->pool) return nullptr;
  // Blocks the tier below holds (disk, or else the cluster, however they
  // were put there) can go for nothing; an extent of another size is emptied
  // without loss only where host writes back to disk.
  const bool has_clean = t == Tier::kHost && (cache_.options_.disk != nullptr || cache_.options_.remote != nullptr);
  const bool may_empty_extents =
      room == Room::kAny || (t == Tier::kHost && cache_.options_.disk != nullptr) || (room == Room::kCleanOnly && has_clean);
  // Without a disk to write them to, an extent is emptied for kCleanOnly
  // only when every block in it is held below host.
  const bool extents_clean_only = room != Room::kAny;
  while (true) {
    if (uint8_t* slot = s->pool->Allocate(bytes); slot != nullptr) return slot;
    if (room == Room::kNothing) return nullptr;
    // Sizes share a tier by recency, not by who came first: when the
    // coldest block is of another size, the extent it lives in is emptied
    // for this size (without this, a second model's blocks would find
    // every extent taken by the first's).
    if (may_empty_extents && s->pool->sizes_in_use() > (s->pool->holds(bytes) ? 1u : 0u)) {
      const BlockEntry* coldest = PickVictim(t, 0, std::nullopt);
      if (coldest != nullptr &&
          SlotPool::StrideFor(cache_.SlotBytes(coldest)) != SlotPool::StrideFor(bytes)) {
        // Draining: refused until its blocks have left (this size's own
        // blocks are hotter than the coldest). Busy: this size's own
        // coldest may still go below.
        const ExtentReclaim r = EmptyExtent(t, bytes, coldest->slot, extents_clean_only);
        if (r == ExtentReclaim::kRoom) continue;
        if (r == ExtentReclaim::kDraining) return nullptr;
      }
    }
    // A block the tier below holds (disk, or else the cluster) costs
    // nothing to let go; a dirty one would be lost, so it goes only when no
    // clean one can.
    BlockEntry* victim =
        has_clean ? PickVictim(t, bytes, std::nullopt, /*clean_only=*/true) : nullptr;
    if (victim == nullptr && room == Room::kAny) victim = PickVictim(t, bytes, std::nullopt);
    if (victim == nullptr) {
      // No block of this size can go now (all leased or moving: a store's
      // own, blocks being coded; or all dirty): an extent of another size,
      // whatever the coldest is, before giving up.
      if (may_empty_extents && s->pool->sizes_in_use() > (s->pool->holds(bytes) ? 1u : 0u) &&
          EmptyExtent(t, bytes, nullptr, extents_clean_only) == ExtentReclaim::kRoom) {
        continue;
      }
      return nullptr;
    }
    if (cache_.BackToDisk(victim)) continue;
    if (t == Tier::kHost && cache_.options_.disk != nullptr && !victim->on_disk) ++cache_.counters_.disk_writes_missed;
    cache_.Drop(victim);
  }
}

RoomGate::ExtentReclaim RoomGate::EmptyExtent(Tier t, uint64_t bytes, const uint8_t* coldest, bool clean_only) {
  SlotPool& pool = *cache_.tier(t)->pool;
  const bool write_back = t == Tier::kHost && cache_.options_.disk != nullptr;
  const bool keep_dirty = clean_only && !write_back;
  for (const std::span<uint8_t> extent : pool.ExtentsToReclaim(bytes, coldest, kExtentCandidates)) {
    // Its blocks, found through the slots' owners: each must be settled
    // to go now (a lease, a copy in flight, a retired slot or a move's
    // destination keeps the extent this time).
    std::vector<BlockEntry*> blocks;
    bool busy = false;
    pool.ForEachSlotInUse(extent.data(), [&](uint8_t* slot, void* owner) {
      ++cache_.counters_.extent_slots_examined;
      auto* e = static_cast<BlockEntry*>(owner);
      busy = e == nullptr || e->slot != slot || e->tier != t || e->leases != 0 || e->moving ||
             e->state != EntryState::kReady || e->retired_slot != nullptr || (keep_dirty && !e->on_remote);
      if (!busy) blocks.push_back(e);
      return !busy;
    });
    // One drain at a time: one under way (listed first) is waited for while
    // its blocks leave; any other extent that cannot go now is skipped.
    const bool draining = pool.draining(extent.data());
    if (busy) {
      if (draining) return ExtentReclaim::kDraining;
      continue;
    }
    // Everything here can go: clean blocks back to disk, dirty ones written
    // back (they leave once written; one that cannot start now waits for
    // the next try) or, without a disk tier, dropped.
    for (BlockEntry* e : blocks) {
      if (!write_back) {
        cache_.Drop(e);
      } else if (!cache_.BackToDisk(e)) {
        cache_.disk_->DemoteFromHost(e, /*may_drop=*/false);
      }
    }
    if (!draining) ++cache_.counters_.extents_reclaimed;
    if (pool.CanAllocate(bytes)) return ExtentReclaim::kRoom;
    if (!draining) pool.Drain(extent.data());
    return ExtentReclaim::kDraining;
  }
  return ExtentReclaim::kBusy;
}

}  // namespace kvtier
