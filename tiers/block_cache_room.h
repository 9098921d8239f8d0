// RoomGate: the one way any part of BlockCache gets a slot in a memory tier
// (issue 34). Each caller asks by what the slot is for; what may be let go
// of to make it is decided here, and nowhere else:
//
//   - ForStore: a store's block. hbm from free room only; host letting go
//     blocks the tier below holds, then (none) the coldest block: a store
//     may cost the cache a block.
//   - ForRead: a host slot for a block read up from disk or fetched from
//     the cluster. Free room, or a block the tier below holds (its disk
//     record, or without a disk tier its remote copy): a read never drops a
//     block that exists nowhere else. That holds for the room a tenant's
//     host quota asks of its own blocks too: held below host, or with a
//     disk tier written back (never dropped). A load's read that its
//     owner's quota has no room for (its host blocks all leased or on
//     their way down) takes free room only, and does not stay: the block
//     goes back below host when the load is over (BlockCache::CopyToEngine). (A block going back to disk
//     may make its owner's disk quota forget the owner's oldest disk
//     records: CachePolicy's rule after every disk write.)
//   - ForDemotion: a host slot for a block hbm demotes. Free room only where
//     a disk tier is (host's blocks are on their way there); else as a store.
//   - ForPromotion: an hbm slot for a host block moving up: free room only.
//   - ForCompaction: a host slot of a block's coded size. Free room only
//     where a tier below takes host's write-back (making room would drop
//     blocks not written yet); else as a store.
//
// A tenant at its host quota makes room from its own coldest host blocks:
// for a store (HostQuotaRoom) they go on their way down as the tier's own
// would (CacheDisk::DemoteFromHost; dropped without a disk tier), and so
// for an hbm block demoted where a disk tier is (without one, that block
// itself goes); for a read (ForRead with a tenant) only as said above.
//
// Sizes share a tier by recency: when the coldest block is of another
// size, an extent of that size is emptied for this one (EmptyExtent; dirty
// host blocks are written to disk first, where a disk tier is).
//
// Who may call: BlockCache's core and sides, on the owner thread.
#pragma once

#include <cstdint>
#include <optional>

#include "tiers/block_cache.h"

namespace kvtier {

class RoomGate {
 public:
  explicit RoomGate(BlockCache& cache) : cache_(cache) {}
  RoomGate(const RoomGate&) = delete;
  RoomGate& operator=(const RoomGate&) = delete;

  // A slot of `bytes` in tier `t` (hbm or host), or nullptr: see above.
  uint8_t* ForStore(Tier t, uint64_t bytes);
  // `quota_of`: the tenant whose host quota the block counts against (its
  // owner: a disk read or a remote fetch is held to it as a store is).
  // `for_load`: a load waits for the block (not a prefetch): past the
  // quota, it may take free room for the load's time.
  uint8_t* ForRead(uint64_t bytes, TenantId quota_of, bool for_load);
  uint8_t* ForDemotion(uint64_t bytes);
  uint8_t* ForPromotion(uint64_t bytes);
  uint8_t* ForCompaction(uint64_t bytes);

  // Host-quota room for `bytes` of `tenant`, for a store or a demotion
  // into host: its own coldest host blocks go on their way down. False
  // when its quota is still full (of leased, moving or filling blocks).
  bool HostQuotaRoom(TenantId tenant, uint64_t bytes) { return QuotaRoom(tenant, bytes, /*clean_only=*/false); }

  // The eviction victim in tier `t` with the given block size (0 = any),
  // of `owner` when given, or nullptr. With clean_only, only blocks the
  // tier below host holds: their disk record, or without a disk tier,
  // their remote copy. `moves_down`: the victim is demoted from hbm to
  // host, not dropped, so a parent whose children in hbm are all moving
  // down already goes as a leaf would (ChildrenLeaving): nothing is
  // orphaned, and the scan need not walk past the parents of the blocks
  // being demoted (issue 32: those scans held the event loop for
  // milliseconds a turn). Host's write-back keeps strict prefix order:
  // written back early, a parent's record is reclaimed before its
  // children's, and the replay hit 2 points less. Parents are set aside
  // by the order until their children have left the tier
  // (Candidate::kHeld), and host's clean blocks are marked
  // (BlockCache::MarkClean), so that no scan walks past the same blocks
  // again for each victim (issue 48). Picks; lets nothing go.
  BlockEntry* PickVictim(Tier t, uint64_t block_bytes, std::optional<TenantId> owner, bool clean_only = false,
                         bool moves_down = false);

 private:
  // What AllocateSlot may let go of to make room.
  enum class Room : uint8_t {
    kNothing,    // free room only
    kCleanOnly,  // also host blocks the tier below holds (a disk record or remote copy)
    kAny,        // also, when no clean one can go, the coldest block: lost
  };
  // A slot in tier `t` for a block of `bytes`, letting unleased blocks of
  // that tier go (prefix-aware LRU) as `room` allows; nullptr when
  // impossible. When the coldest block is of another size, an extent of that
  // size is emptied instead (EmptyExtent: dirty host blocks are written, not
  // dropped, where a disk tier is); nullptr while one drains to disk.
  uint8_t* AllocateSlot(Tier t, uint64_t bytes, Room room);
  // Empties an extent of another size for `bytes`. Candidates (at most
  // kExtentCandidates, from SlotPool::ExtentsToReclaim): an extent already
  // draining, the one holding the `coldest` block's slot, then those with
  // the fewest slots in use; their blocks are found through the pool's slot
  // owners (no LRU walk: bounded by the candidates' slots). An extent with
  // a block that cannot go now (leased, filling, moving, a retired slot or a
  // move's destination) is skipped. The chosen one's blocks go: clean ones
  // back to disk; dirty ones, with a disk tier, written back (the extent
  // drains: SlotPool::Drain) — without one, dropped.
  enum class ExtentReclaim : uint8_t {
    kRoom,      // `bytes` fits now
    kDraining,  // an extent is being emptied for it: try again shortly
    kBusy,      // no candidate could go now
  };
  // `clean_only` (without a disk tier): an extent holding a block the
  // cluster does not is not emptied.
  ExtentReclaim EmptyExtent(Tier t, uint64_t bytes, const uint8_t* coldest, bool clean_only = false);
  // HostQuotaRoom; with `clean_only`, for a read: only the tenant's blocks
  // the tier below holds go (back to disk, or dropped where the cluster
  // holds them), then dirty ones written back (CacheDisk::WriteBack).
  bool QuotaRoom(TenantId tenant, uint64_t bytes, bool clean_only);

  BlockCache& cache_;
};

}  // namespace kvtier
