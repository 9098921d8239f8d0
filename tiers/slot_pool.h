// SlotPool: fixed-size slots carved out of one arena, never an allocation per
// block. Each slot size (one per block size in use) takes the arena an extent
// at a time; freed slots go back to their extent. An extent whose slots are
// all free stays with its size until another size needs the room, and then
// goes back to the arena (so a second block size is never starved by a
// first one's empty extents); to empty an extent of another size that still
// holds blocks, the owner asks ExtentsToReclaim, finds what lives there
// through the slots' owners (SetOwner, ForEachSlotInUse: 8 bytes per slot)
// and evicts it, or Drains the extent while its blocks leave. Slots are
// 4 KiB aligned (O_DIRECT-ready) and their stride is the block size rounded
// up to 4 KiB.
//
// Thread-compatible: owned by the event-loop thread (BlockCache).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <vector>

namespace kvtier {

class SlotPool {
 public:
  static constexpr uint64_t kSlotAlignBytes = 4096;
  static constexpr uint64_t kDefaultExtentBytes = 64ull << 20;

  // `base` must be kSlotAlignBytes-aligned and outlive the pool.
  SlotPool(uint8_t* base, uint64_t size_bytes, uint64_t extent_bytes = kDefaultExtentBytes);
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;

  static uint64_t StrideFor(uint64_t block_bytes) {
    return (block_bytes + kSlotAlignBytes - 1) / kSlotAlignBytes * kSlotAlignBytes;
  }

  // A slot for a block of `block_bytes`, or nullptr when this size has no
  // free slot and no room for another extent is left, even after every
  // empty extent of other sizes went back to the arena.
  uint8_t* Allocate(uint64_t block_bytes);
  // REQUIRES: `slot` came from Allocate(block_bytes) and is not free.
  void Free(uint8_t* slot, uint64_t block_bytes);

  uint64_t capacity_bytes() const { return size_bytes_; }
  // Bytes of slots handed out (strides).
  uint64_t used_bytes() const { return used_bytes_; }
  // True when Allocate(block_bytes) would succeed.
  bool CanAllocate(uint64_t block_bytes) const;

  // When Allocate(block_bytes) fails: an extent of another size whose
  // release would make room, as the bytes it spans: the one holding
  // `prefer` (e.g. the coldest block's slot) if it qualifies, else the one
  // with the fewest slots in use; nullopt when none qualifies. Once every
  // slot in it is freed, Allocate(block_bytes) can use its room.
  std::optional<std::span<uint8_t>> ExtentToReclaim(uint64_t block_bytes,
                                                    const uint8_t* prefer = nullptr) const;
  // Up to `max` such extents, best first: those being drained (Drain), then
  // the one holding `prefer`, then by fewest slots in use. O(extents).
  std::vector<std::span<uint8_t>> ExtentsToReclaim(uint64_t block_bytes, const uint8_t* prefer,
                                                   size_t max) const;
  // The extent that starts at `extent` hands out no more slots: its slots
  // go back to it as they are freed, and once all are, it goes back to the
  // arena like any empty extent. REQUIRES: `extent` starts an extent.
  void Drain(const uint8_t* extent);
  bool draining() const { return !draining_.empty(); }
  bool draining(const uint8_t* extent) const {
    return draining_.count(const_cast<uint8_t*>(extent)) > 0;
  }

  // The owner's tag of a slot in use (e.g. the block that lives there), kept
  // until the slot is freed; nullptr until set. REQUIRES: `slot` is in use.
  void SetOwner(const uint8_t* slot, void* owner);
  // f(uint8_t* slot, void* owner) for each slot in use in the extent that
  // starts at `extent`, in address order, while f returns true. O(slots of
  // the extent).
  template <typename F>
  void ForEachSlotInUse(const uint8_t* extent, F&& f) const {
    auto it = extents_.find(const_cast<uint8_t*>(extent));
    if (it == extents_.end()) return;
    const Extent& e = it->second;
    for (size_t i = 0; i < e.owners.size(); ++i) {
      void* owner = e.owners[i];
      if (owner == nullptr) continue;  // free
      if (!f(it->first + i * e.stride, owner == kInUse ? nullptr : owner)) return;
    }
  }
  // Slots handed out from the extent that starts at `extent` (as
  // ExtentToReclaim returned it); 0 for an address that starts none.
  uint64_t SlotsInUse(const uint8_t* extent) const;
  // How many slot sizes hold extents now; whether `block_bytes`'s does.
  size_t sizes_in_use() const;
  bool holds(uint64_t block_bytes) const;

 private:
  struct Extent {
    uint64_t bytes = 0;
    uint64_t stride = 0;
    uint64_t used = 0;           // slots handed out
    std::vector<uint8_t*> free;  // LIFO, low addresses on top at first
    // Per slot: nullptr when free, kInUse when handed out with no owner
    // set, else the owner's tag.
    std::vector<void*> owners;
  };
  // The tag of a slot handed out whose owner is not set.
  static inline char in_use_tag_ = 0;
  static inline void* const kInUse = &in_use_tag_;
  Extent& ExtentOf(const uint8_t* slot, std::map<uint8_t*, Extent>::iterator* it = nullptr);
  struct SizeClass {
    std::set<uint8_t*> with_free;  // its extents with a free slot, by address
    uint64_t extents = 0;
  };

  // Carves an extent of `stride` slots out of a free range; false when no
  // range holds even one slot.
  bool Carve(uint64_t stride);
  // Returns an extent whose slots are all free to the free ranges.
  void Release(std::map<uint8_t*, Extent>::iterator it);
  // The free ranges as they would be with every empty extent released.
  std::map<uint8_t*, uint64_t> RangesWithEmptiesReleased() const;
  static void AddRange(std::map<uint8_t*, uint64_t>& ranges, uint8_t* begin, uint64_t bytes);

  uint8_t* const base_;
  const uint64_t size_bytes_;
  const uint64_t extent_bytes_;
  uint64_t used_bytes_ = 0;
  std::map<uint8_t*, Extent> extents_;        // carved, by address
  std::map<uint8_t*, uint64_t> free_ranges_;  // not carved: start -> bytes, coalesced
  std::set<uint8_t*> empty_;                  // extents with no slot in use
  std::set<uint8_t*> draining_;               // extents that hand out no slots (Drain)
  std::map<uint64_t, SizeClass> classes_;  // by stride
};

}  // namespace kvtier
