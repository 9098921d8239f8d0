#include "tiers/slot_pool.h"

#include <algorithm>
#include <cstdint>

#include "common/check.h"

namespace kvtier {

SlotPool::SlotPool(uint8_t* base, uint64_t size_bytes, uint64_t extent_bytes)
    : base_(base), size_bytes_(size_bytes), extent_bytes_(extent_bytes) {
  KVTIER_CHECK(reinterpret_cast<uintptr_t>(base) % kSlotAlignBytes == 0);
  KVTIER_CHECK(extent_bytes_ > 0);
}

bool SlotPool::Grow(SizeClass& c, uint64_t stride) {
  const uint64_t left = size_bytes_ - carved_bytes_;
  const uint64_t slots = std::min(std::max<uint64_t>(1, extent_bytes_ / stride), left / stride);
  if (slots == 0) return false;
  uint8_t* extent = base_ + carved_bytes_;
  carved_bytes_ += slots * stride;
  // Hand out low addresses first (LIFO free list, so push in reverse).
  for (uint64_t i = slots; i-- > 0;) c.free.push_back(extent + i * stride);
  return true;
}

uint8_t* SlotPool::Allocate(uint64_t block_bytes) {
  const uint64_t stride = StrideFor(block_bytes);
  SizeClass& c = classes_[stride];
  if (c.free.empty() && !Grow(c, stride)) return nullptr;
  uint8_t* slot = c.free.back();
  c.free.pop_back();
  used_bytes_ += stride;
  return slot;
}

void SlotPool::Free(uint8_t* slot, uint64_t block_bytes) {
  const uint64_t stride = StrideFor(block_bytes);
  KVTIER_CHECK(slot >= base_ && slot + stride <= base_ + carved_bytes_);
  KVTIER_CHECK(used_bytes_ >= stride);
  classes_[stride].free.push_back(slot);
  used_bytes_ -= stride;
}

bool SlotPool::CanAllocate(uint64_t block_bytes) const {
  const uint64_t stride = StrideFor(block_bytes);
  auto it = classes_.find(stride);
  if (it != classes_.end() && !it->second.free.empty()) return true;
  return size_bytes_ - carved_bytes_ >= stride;
}

}  // namespace kvtier
