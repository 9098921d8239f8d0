// BlockIndex: stored key -> BlockEntry, with per-tier eviction orders
// (tiers/eviction_order.h: lru, s3fifo or classes) and parent/child links for
// prefix-aware eviction. About 215 to 250 bytes per
// block, fixed: the entry (184 bytes today) in a chunked pool and a 24-byte
// slot in the lookup table (at 3/8 to 3/4 load); no allocation per entry.
//
// Entries live in a ChunkedPool (tiers/chunked_pool.h) and never move, so the
// raw pointers between entries (LRU neighbours, parent, children) stay valid
// until an entry is erased; Erase unlinks it from everything first. Neither
// the pool nor the lookup table (tiers/open_table.h) ever rebuilds in one
// pass: the pool grows a chunk at a time and the table migrates a few slots
// per Insert or Erase, so no call stalls the event loop however many blocks
// the node holds.
//
// Thread-compatible: owned by BlockCache's thread.
#pragma once

#include <cstdint>
#include <span>

#include "common/key128.h"
#include "tiers/block_entry.h"
#include "tiers/chunked_pool.h"
#include "tiers/eviction_order.h"
#include "tiers/open_table.h"

namespace kvtier {

class BlockIndex {
 public:
  // Each tier's blocks in an eviction order of policy `policy`.
  explicit BlockIndex(PolicyKind policy = PolicyKind::kLru)
      : orders_{EvictionOrder(policy, &entries_), EvictionOrder(policy, &entries_), EvictionOrder(policy, &entries_)} {}
  BlockIndex(const BlockIndex&) = delete;
  BlockIndex& operator=(const BlockIndex&) = delete;

  BlockEntry* Find(const StoredKey& key);
  // Starts loading the lookup-table lines of `keys` into the CPU cache, so
  // that Finds of a whole prompt's keys overlap their memory misses instead
  // of taking them one after the other.
  void Prefetch(std::span<const StoredKey> keys) const;
  // Inserts a new entry (REQUIRES: absent) in `tier`, hottest, linked under
  // `parent` if that is present.
  BlockEntry* Insert(const StoredKey& key, Tier tier, const StoredKey* parent);
  // Unlinks and erases.
  void Erase(BlockEntry* e);

  // A hit on `e`, for its tier's order (a parked entry stays out).
  void Touch(BlockEntry* e);
  // A load into an engine that keeps `e` (EvictionOrder::TouchHeld).
  bool TouchHeld(BlockEntry* e) { return order(e->tier).TouchHeld(e, !e->parked); }
  // The engine's retention hint for `e`, in its tier's order
  // (EvictionOrder::Hint; a parked entry takes it when it comes back).
  bool Hint(BlockEntry* e, const RetentionHint& hint, uint32_t now_ms, EvictionOrder::KeepLimits limits = {}) {
    return order(e->tier).Hint(e, hint, now_ms, !e->parked, limits);
  }
  // Moves `e` into another tier's order (an arrival there), keeping parent
  // counts right. A parked entry changes tier and stays out of the orders
  // (Unpark puts it into the new tier's, as an arrival).
  void ChangeTier(BlockEntry* e, Tier to);
  // Takes `e` out of its tier's order while it moves; Unpark puts it back,
  // at the hot or the cold end of its place there.
  void Park(BlockEntry* e);
  // Marks `e` in its tier's order, or clears its mark (EvictionOrder::Mark).
  void Mark(BlockEntry* e, bool marked) { order(e->tier).Mark(e, marked, !e->parked); }
  void Unpark(BlockEntry* e, bool hot);

  // A tier's eviction order (its victim scan: EvictionOrder::PickVictim).
  EvictionOrder& order(Tier t) { return orders_[static_cast<size_t>(t)]; }
  const EvictionOrder& order(Tier t) const { return orders_[static_cast<size_t>(t)]; }

  void AddLease(BlockEntry* e) { ++e->leases; ++total_leases_; }
  void ReleaseLease(BlockEntry* e);
  uint64_t total_leases() const { return total_leases_; }
  size_t size() const { return entries_.size(); }
  // The lookup table's capacity, and whether a growth is still migrating and
  // how far (at most kMigrateSlotsPerCall slots per Insert or Erase).
  static constexpr size_t kMigrateSlotsPerCall = kOpenTableMigrateSlotsPerCall;
  OpenTableStats table_stats() const { return table_.stats(); }

  // True when `e` has cached children in tier `t` or any tier above it.
  // A block its order set aside as held by its children (Candidate::kHeld)
  // is released when this turns false for its own tier.
  static bool HasChildrenAtOrAbove(const BlockEntry* e, Tier t);

  // f(BlockEntry*) once for every entry, in no particular order. f must not
  // Insert or Erase.
  template <typename F>
  void ForEach(F&& f) {
    entries_.ForEach(f);
  }
  // The same a chunk of entries (a few thousand) at a time: chunk i <
  // chunks(). Entries never move, so a walk over the chunks sees every entry
  // that lives throughout it.
  size_t chunks() const { return entries_.chunks(); }
  template <typename F>
  void ForEachInChunk(size_t i, F&& f) {
    entries_.ForEachIn(i, f);
  }

 private:
  void MaybeRelease(BlockEntry* parent);

  // Entries live in entries_ (stable addresses, iteration); lookups go
  // through table_, a compact open-addressed key -> entry table (24-byte
  // slots, linear probing, indexed by the key's own low bits: stored keys
  // are uniform hashes), which costs one cache miss where a node-based map
  // costs two or three.
  struct Slot {
    StoredKey key;
    BlockEntry* entry = nullptr;  // nullptr: empty
  };
  struct SlotTraits {
    static constexpr bool IsEmpty(const Slot& s) { return s.entry == nullptr; }
    static const StoredKey& KeyOf(const Slot& s) { return s.key; }
    // A Fibonacci multiply spreads keys that are not uniform (tests'
    // counters) too.
    static uint64_t Hash(const StoredKey& key) { return key.Low64() * 0x9e3779b97f4a7c15ull; }
    static constexpr size_t kMaxLoadPercent = 75;
    static constexpr size_t kGrowPercent = 200;
    static constexpr size_t kMinCapacity = 64;
  };
  using Table = OpenTable<Slot, SlotTraits>;
  // A new entry for `key` in entries_ and table_ (REQUIRES: absent), and
  // its removal from both.
  BlockEntry* NewEntry(const StoredKey& key);
  void DeleteEntry(BlockEntry* e);
  Table table_;
  ChunkedPool<BlockEntry> entries_;

  EvictionOrder orders_[kNumTiers];
  uint64_t total_leases_ = 0;
};

}  // namespace kvtier
