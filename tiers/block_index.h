// BlockIndex: stored key -> BlockEntry, with per-tier intrusive LRU lists and
// parent/child links for prefix-aware eviction. About 200 to 230 bytes per
// block, fixed: the entry (168 bytes today) in a chunked pool and a 24-byte
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
#include "tiers/chunked_pool.h"
#include "tiers/disk/disk_tier.h"
#include "tiers/open_table.h"

namespace kvtier {

enum class Tier : uint8_t { kHbm = 0, kHost = 1, kDisk = 2 };
inline constexpr size_t kNumTiers = 3;
const char* TierName(Tier tier);

using TenantId = uint16_t;

enum class EntryState : uint8_t {
  kFilling,  // copy from the engine in flight; invisible to lookups
  kReady,
};

struct BlockEntry {
  StoredKey key;
  uint8_t* slot = nullptr;
  uint64_t checksum = 0;     // XXH3-64 of the block, once it reached host memory
  uint32_t block_bytes = 0;
  uint32_t leases = 0;
  uint32_t ns = 0;           // BlockCache namespace id
  TenantId owner = 0;
  Tier tier = Tier::kHost;
  EntryState state = EntryState::kFilling;
  bool moving = false;       // a copy to another tier is in flight
  // Out of its tier's LRU list (BlockIndex::Park), while it moves: eviction
  // never looks at a block that cannot go anyway.
  bool parked = false;
  uint8_t disk_write_failures = 0;  // failed writes to disk in a row
  bool has_checksum = false;
  // Lookups and loads that found it (saturating) since it was last written
  // to disk: disk admission asks for some, and a reclaim carries forward a
  // block that has any.
  uint16_t hits = 0;
  // Its disk record, while on_disk. A block read up from disk keeps its record
  // (until the region is reclaimed), so leaving host again costs no write.
  DiskLocation disk;
  bool on_disk = false;
  // Its disk writes store it coded (issue 18) by its namespace's codec
  // (NamespaceFormat): its store asked for lossless or fp8.
  bool compress = false;
  // The payload bytes of its record (disk.packed: what the codec wrote;
  // else block_bytes), while on_disk. What the disk tier is charged.
  uint32_t disk_payload_bytes = 0;
  // Its host slot holds its namespace codec's output, of this many bytes
  // (0: the block itself). The slot is of that size, and so is its charge.
  uint32_t coded_bytes = 0;
  // Being encoded for a host slot of its coded size (also moving); a disk
  // write asked for meanwhile waits for the end: 1 write-back or flush, 2
  // write-through.
  bool compacting = false;
  uint8_t deferred_write = 0;
  // The remote tier holds it (or a put of it was tried): put once at most.
  bool on_remote = false;
  // The cluster holds it as far as this node knows (TierListener's kRemote).
  bool remote_present = false;
  // Cached children (blocks whose parent is this one), counted by the tier
  // they live in. A block with children in its own tier or above is evicted
  // after them.
  uint32_t children_in_tier[kNumTiers] = {};
  // The slot this block lived in before its last move, freed when the last
  // lease taken before the move is released (loads read the old slot).
  uint8_t* retired_slot = nullptr;
  Tier retired_tier = Tier::kHost;
  uint32_t retired_bytes = 0;  // what the retired slot was allocated for

  // Intrusive links (owned by BlockIndex).
  BlockEntry* lru_prev = nullptr;  // towards colder
  BlockEntry* lru_next = nullptr;  // towards hotter
  BlockEntry* parent = nullptr;
  BlockEntry* first_child = nullptr;
  BlockEntry* prev_sibling = nullptr;
  BlockEntry* next_sibling = nullptr;
};

class BlockIndex {
 public:
  BlockIndex() = default;
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

  // Moves `e` to the hot end of its tier's list (a parked entry stays out).
  void Touch(BlockEntry* e);
  // Moves `e` to another tier's list (hot end), keeping parent counts right.
  // A parked entry changes tier and stays out of the lists.
  void ChangeTier(BlockEntry* e, Tier to);
  // Takes `e` out of its tier's list while it moves; Unpark puts it back,
  // at the hot or the cold end.
  void Park(BlockEntry* e);
  void Unpark(BlockEntry* e, bool hot);

  // Coldest entry of a tier, and the next hotter one.
  BlockEntry* Coldest(Tier t) const { return lru_[static_cast<size_t>(t)].coldest; }
  static BlockEntry* Hotter(const BlockEntry* e) { return e->lru_next; }

  void AddLease(BlockEntry* e) { ++e->leases; ++total_leases_; }
  void ReleaseLease(BlockEntry* e);
  uint64_t total_leases() const { return total_leases_; }
  size_t size() const { return entries_.size(); }
  // The lookup table's capacity, and whether a growth is still migrating and
  // how far (at most kMigrateSlotsPerCall slots per Insert or Erase).
  static constexpr size_t kMigrateSlotsPerCall = kOpenTableMigrateSlotsPerCall;
  OpenTableStats table_stats() const { return table_.stats(); }

  // True when `e` has cached children in tier `t` or any tier above it.
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
  struct List {
    BlockEntry* coldest = nullptr;
    BlockEntry* hottest = nullptr;
  };
  // Links `e` into its tier's list at the hot or the cold end.
  void Link(BlockEntry* e, bool hot);
  void Unlink(BlockEntry* e);

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

  List lru_[kNumTiers];
  uint64_t total_leases_ = 0;
};

}  // namespace kvtier
