// BlockEntry: what BlockCache knows of one block, in BlockIndex's pool
// (tiers/block_index.h), linked into its tier's eviction order
// (tiers/eviction_order.h).
//
// Thread-compatible: owned by BlockCache's thread.
#pragma once

#include <cstdint>

#include "common/key128.h"
#include "tiers/disk/disk_tier.h"

namespace kvtier {

enum class Tier : uint8_t { kHbm = 0, kHost = 1, kDisk = 2 };
inline constexpr size_t kNumTiers = 3;
const char* TierName(Tier tier);

using TenantId = uint16_t;

enum class EntryState : uint8_t {
  kFilling,  // copy from the engine in flight; invisible to lookups
  kReady,
};

enum class RemotePut : uint8_t { kNone, kPutting, kRefused };

struct BlockEntry {
  StoredKey key;
  uint8_t* slot = nullptr;
  uint64_t checksum = 0;     // XXH3-64 of the block as copied to host memory (of the engine's bytes as read)
  uint32_t block_bytes = 0;
  uint32_t leases = 0;
  uint32_t ns = 0;           // BlockCache namespace id
  TenantId owner = 0;
  Tier tier = Tier::kHost;
  EntryState state = EntryState::kFilling;
  bool moving = false;       // a copy to another tier is in flight
  // Its move is down, out of its tier (hbm to host, host to disk): once it
  // lands it no longer makes its parent a parent in this tier.
  bool leaving = false;
  // Out of its tier's eviction order (BlockIndex::Park), while it moves: eviction
  // never looks at a block that cannot go anyway.
  bool parked = false;
  // Parked while it changed tier: Unpark puts it into the new tier's order
  // as an arrival.
  bool arrives = false;
  uint8_t disk_write_failures = 0;  // failed writes to disk in a row
  bool has_checksum = false;
  // The learned NVMe gate's tag (tiers/disk_gate.h: its request's class,
  // and whether it is a sample), set at its store when the gate is on.
  uint8_t disk_gate = 0;
  // Its place in its tier's eviction order, continued (owned by
  // EvictionOrder; in holes the fields around leave): whether it is set
  // aside as held by its children, and marked (the caller's mark: the
  // blocks the tier below holds, in a list of their own)...
  uint8_t order_flags = 0;
  // Lookups and loads that found it (saturating) since it was last written
  // to disk: disk admission asks for some, and a reclaim carries forward a
  // block that has any.
  uint16_t hits = 0;
  // ... and the position it was linked at (48 bits, rising towards hot):
  // a queue's two lists merge by it.
  uint16_t order_seq_high = 0;
  uint32_t order_seq_low = 0;
  // Its disk record, while on_disk. A block read up from disk keeps its record
  // (until the region is reclaimed), so leaving host again costs no write.
  DiskLocation disk;
  bool on_disk = false;
  // Its disk writes store it coded (issue 18) by its namespace's codec
  // (NamespaceFormat): its store asked for lossless or fp8.
  bool compress = false;
  // Its place in its chain as its store knew it: 1 for a root, its parent's
  // plus one when the parent was in the index (saturating); 0 unknown.
  uint16_t depth = 0;
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
  // The remote tier holds it: a put of it landed, or it was fetched from
  // there. Put once at most.
  bool on_remote = false;
  // The cluster holds it as far as this node knows (TierListener's kRemote).
  bool remote_present = false;

  // Cached children (blocks whose parent is this one), counted by the tier
  // they live in. A block with children in its own tier or above is evicted
  // after them.
  uint32_t children_in_tier[kNumTiers] = {};
  // Its place in its tier's eviction order (owned by EvictionOrder): the
  // links of its queue (pool ids, ChunkedPool::IdOf; 0: none), the time an
  // engine's hint keeps it until (the order's milliseconds), the policy's
  // few bits (s3fifo: queue, hits) and the hint's (EvictionOrder::Hint:
  // level, kept and its class). Placed where the fields around leave room.
  uint32_t lru_prev = 0;  // towards colder
  uint32_t lru_next = 0;  // towards hotter
  uint32_t keep_until_ms = 0;
  uint8_t policy_bits = 0;
  uint8_t hint_bits = 0;
  // Its put to the remote tier (while not on_remote): none yet, queued or in
  // flight, or refused by the cluster (too large, out of memory, no
  // permission: never put again).
  RemotePut remote_put = RemotePut::kNone;
  // The slot this block lived in before its last move, freed when the last
  // lease taken before the move is released (loads read the old slot).
  Tier retired_tier = Tier::kHost;
  uint32_t retired_bytes = 0;  // what the retired slot was allocated for
  uint8_t* retired_slot = nullptr;
  // Tree links (owned by BlockIndex).
  BlockEntry* parent = nullptr;
  BlockEntry* first_child = nullptr;
  BlockEntry* prev_sibling = nullptr;
  BlockEntry* next_sibling = nullptr;
};

}  // namespace kvtier
