// DiskOnlyIndex: the blocks that live only on disk, in 32 bytes each.
//
// A block in a memory tier, or one being read or leased, is a full
// BlockEntry (block_index.h, ~180 bytes with its LRU and prefix links); a
// block that only sits on disk needs just enough to find and account for it,
// and a node may hold millions of those. Open addressing with linear probing
// in one flat array, grown by half when 80% full, so the table costs 40 to 60
// bytes per block.
//
// Thread-compatible: owned by BlockCache's thread.
#pragma once

#include <cstdint>
#include <vector>

#include "common/key128.h"

namespace kvtier {

struct DiskOnlyBlock {
  StoredKey key;
  uint32_t offset_pages = 0;  // record offset in its device, in 4 KiB pages
  uint32_t block_bytes = 0;
  uint16_t owner = 0;
  uint16_t ns = 0;
  uint16_t hits = 0;
  uint8_t device = 0;
  uint8_t used = 0;  // kEmpty, kUsed or kTombstone
};
static_assert(sizeof(DiskOnlyBlock) == 32);

class DiskOnlyIndex {
 public:
  DiskOnlyIndex() = default;
  DiskOnlyIndex(const DiskOnlyIndex&) = delete;
  DiskOnlyIndex& operator=(const DiskOnlyIndex&) = delete;

  // Null when absent. Valid until the next Insert or Erase.
  DiskOnlyBlock* Find(const StoredKey& key);
  // REQUIRES: the key is absent.
  void Insert(const DiskOnlyBlock& block);
  // REQUIRES: `block` came from Find (and nothing was inserted since).
  void Erase(DiskOnlyBlock* block);

  size_t size() const { return size_; }
  size_t capacity() const { return slots_.size(); }

  template <typename F>
  void ForEach(F&& f) {
    for (DiskOnlyBlock& b : slots_) {
      if (b.used == kUsed) f(b);
    }
  }

 private:
  static constexpr uint8_t kEmpty = 0, kUsed = 1, kTombstone = 2;
  size_t Home(const StoredKey& key) const;
  void Grow();

  std::vector<DiskOnlyBlock> slots_;
  size_t size_ = 0;
  size_t tombstones_ = 0;
};

}  // namespace kvtier
