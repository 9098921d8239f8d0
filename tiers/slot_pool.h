// SlotPool: fixed-size slots carved out of one arena, never an allocation per
// block. Each slot size (one per block size in use) has its own free list and
// takes extents of the arena on demand; freed slots go back to their size's
// free list. Slots are 4 KiB aligned (O_DIRECT-ready) and their stride is the
// block size rounded up to 4 KiB.
//
// Thread-compatible: owned by the event-loop thread (BlockCache).
#pragma once

#include <cstdint>
#include <map>
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
  // free slot and the arena has no room for another extent.
  uint8_t* Allocate(uint64_t block_bytes);
  // REQUIRES: `slot` came from Allocate(block_bytes) and is not free.
  void Free(uint8_t* slot, uint64_t block_bytes);

  uint64_t capacity_bytes() const { return size_bytes_; }
  // Bytes of slots handed out (strides).
  uint64_t used_bytes() const { return used_bytes_; }
  // True when Allocate(block_bytes) would succeed.
  bool CanAllocate(uint64_t block_bytes) const;

 private:
  struct SizeClass {
    std::vector<uint8_t*> free;
  };
  // Carves a new extent of `stride` slots into `c`; false when the arena is full.
  bool Grow(SizeClass& c, uint64_t stride);

  uint8_t* const base_;
  const uint64_t size_bytes_;
  const uint64_t extent_bytes_;
  uint64_t carved_bytes_ = 0;
  uint64_t used_bytes_ = 0;
  std::map<uint64_t, SizeClass> classes_;  // by stride
};

}  // namespace kvtier
