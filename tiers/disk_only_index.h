// DiskOnlyIndex: the blocks that live only on disk, in 40 bytes each.
//
// A block in a memory tier, or one being read or leased, is a full
// BlockEntry (block_index.h, ~170 bytes with its LRU and prefix links); a
// block that only sits on disk needs just enough to find and account for it,
// and a node may hold millions of those. Open addressing with linear probing
// in one flat array (tiers/open_table.h), grown by half when 80% full, so the
// table costs 50 to 75 bytes per block. A growth moves the blocks over a few
// at a time, in the Inserts and Erases that follow it, so no call stalls the
// event loop for a rebuild; while it runs the old table is given back as it
// empties, so the peak is about 125 bytes per block and falls from there.
//
// Thread-compatible: owned by BlockCache's thread.
#pragma once

#include <cstdint>

#include "common/disk_limits.h"
#include "common/key128.h"
#include "tiers/disk/record.h"
#include "tiers/open_table.h"

namespace kvtier {

struct DiskOnlyBlock {
  // Record offsets below this fit: 39 bits of 4 KiB pages (2 PiB), as many
  // as a disk path may have.
  static constexpr uint64_t kOffsetLimitBytes = (uint64_t{1} << 39) * kRecordAlignBytes;

  static constexpr uint16_t kMaxHits = (1u << 9) - 1;

  StoredKey key;
  // Its record's payload's XXH3-64, which a read must find (a bare record
  // holds nothing else to check it by).
  uint64_t checksum = 0;
  // Its record's payload: the block's bytes, or what a codec wrote when
  // `packed` (the block's own size is its namespace's, NamespaceFormat);
  // at most Layout::kMaxBlockBytes (2^30).
  uint32_t block_bytes : 31 = 0;
  // Its record is bare (record.h); else of an older release, and `packed`
  // says which.
  uint32_t bare : 1 = 1;
  uint16_t owner = 0;
  uint16_t ns = 0;
  uint16_t hits : 9 = 0;  // saturating at kMaxHits
  uint16_t packed : 1 = 0;
  uint16_t disk_gate : 6 = 0;  // BlockEntry::disk_gate
  uint8_t device = 0;
  uint8_t used : 1 = 0;  // set by the index: 0 marks an empty slot

  // The record's offset in its device.
  uint64_t offset_bytes() const {
    return ((uint64_t{offset_pages_high_} << 32) | offset_pages_low_) * kRecordAlignBytes;
  }
  // REQUIRES (checked): `offset` is a multiple of 4 KiB below kOffsetLimitBytes.
  void set_offset_bytes(uint64_t offset);

 private:
  // The offset in 4 KiB pages, split so that the block stays 40 bytes.
  uint8_t offset_pages_high_ : 7 = 0;
  uint32_t offset_pages_low_ = 0;
};
static_assert(sizeof(DiskOnlyBlock) == 40);
static_assert(DiskOnlyBlock::kOffsetLimitBytes >= kMaxDiskPathBytes,
              "every record offset of a disk path must fit a DiskOnlyBlock");

class DiskOnlyIndex {
 public:
  // The most slots of an old table that one Insert or Erase moves while the
  // table grows.
  static constexpr size_t kMigrateSlotsPerCall = kOpenTableMigrateSlotsPerCall;

  DiskOnlyIndex() = default;
  DiskOnlyIndex(const DiskOnlyIndex&) = delete;
  DiskOnlyIndex& operator=(const DiskOnlyIndex&) = delete;

  // Null when absent. Valid until the next Insert or Erase: both may move
  // blocks (a growth step, or the shift that closes an erased slot).
  DiskOnlyBlock* Find(const StoredKey& key) { return table_.Find(key); }
  // REQUIRES: the key is absent (checked).
  void Insert(const DiskOnlyBlock& block);
  // REQUIRES: `block` came from Find, with no Insert or Erase since.
  void Erase(DiskOnlyBlock* block);

  size_t size() const { return table_.size(); }
  // Slots of the table Inserts go to (while growing, the old one is extra:
  // table_stats().bytes has both).
  size_t capacity() const { return table_.stats().capacity; }
  OpenTableStats table_stats() const { return table_.stats(); }

  // f(DiskOnlyBlock&) once for every block, in no particular order. f must
  // not Insert or Erase.
  template <typename F>
  void ForEach(F&& f) {
    table_.ForEach(f);
  }

 private:
  struct Traits {
    static constexpr bool IsEmpty(const DiskOnlyBlock& b) { return b.used == 0; }
    static const StoredKey& KeyOf(const DiskOnlyBlock& b) { return b.key; }
    // Stored keys are uniform hashes: their low 64 bits serve directly.
    static uint64_t Hash(const StoredKey& key) { return key.Low64(); }
    static constexpr size_t kMaxLoadPercent = 80;
    static constexpr size_t kGrowPercent = 150;
    static constexpr size_t kMinCapacity = 64;
  };
  using Table = OpenTable<DiskOnlyBlock, Traits>;

  Table table_;
};

}  // namespace kvtier
