#include "tiers/slot_pool.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <tuple>

#include "common/check.h"

namespace kvtier {

SlotPool::SlotPool(uint8_t* base, uint64_t size_bytes, uint64_t extent_bytes)
    : base_(base), size_bytes_(size_bytes), extent_bytes_(extent_bytes) {
  KVTIER_CHECK(reinterpret_cast<uintptr_t>(base) % kSlotAlignBytes == 0);
  KVTIER_CHECK(extent_bytes_ > 0);
  if (size_bytes_ > 0) free_ranges_.emplace(base_, size_bytes_);
}

void SlotPool::AddRange(std::map<uint8_t*, uint64_t>& ranges, uint8_t* begin, uint64_t bytes) {
  auto it = ranges.emplace(begin, bytes).first;
  if (auto next = std::next(it); next != ranges.end() && begin + it->second == next->first) {
    it->second += next->second;
    ranges.erase(next);
  }
  if (it != ranges.begin()) {
    if (auto prev = std::prev(it); prev->first + prev->second == begin) {
      prev->second += it->second;
      ranges.erase(it);
    }
  }
}

bool SlotPool::Carve(uint64_t stride) {
  // First fit, lowest address first, so that low extents fill and high ones
  // empty out.
  auto range = std::find_if(free_ranges_.begin(), free_ranges_.end(),
                            [&](const auto& r) { return r.second >= stride; });
  if (range == free_ranges_.end()) return false;
  const uint64_t slots =
      std::min(std::max<uint64_t>(1, extent_bytes_ / stride), range->second / stride);
  uint8_t* const begin = range->first;
  const uint64_t bytes = slots * stride;
  const uint64_t rest = range->second - bytes;
  free_ranges_.erase(range);
  if (rest > 0) free_ranges_.emplace(begin + bytes, rest);
  Extent& e = extents_[begin];
  e = Extent{.bytes = bytes, .stride = stride, .used = 0, .free = {}, .owners = {}};
  e.free.reserve(slots);
  e.owners.assign(slots, nullptr);
  // Hand out low addresses first (LIFO free list, so push in reverse).
  for (uint64_t i = slots; i-- > 0;) e.free.push_back(begin + i * stride);
  SizeClass& c = classes_[stride];
  c.with_free.insert(begin);
  ++c.extents;
  empty_.insert(begin);
  return true;
}

void SlotPool::Release(std::map<uint8_t*, Extent>::iterator it) {
  KVTIER_CHECK(it->second.used == 0);
  SizeClass& c = classes_[it->second.stride];
  c.with_free.erase(it->first);
  --c.extents;
  empty_.erase(it->first);
  draining_.erase(it->first);
  AddRange(free_ranges_, it->first, it->second.bytes);
  extents_.erase(it);
}

uint8_t* SlotPool::Allocate(uint64_t block_bytes) {
  const uint64_t stride = StrideFor(block_bytes);
  if (classes_[stride].with_free.empty() && !Carve(stride)) {
    // Other sizes' empty extents go back to the arena (this size has none:
    // they would have a free slot), and the room is carved again.
    while (!empty_.empty()) Release(extents_.find(*empty_.begin()));
    if (!Carve(stride)) return nullptr;
  }
  SizeClass& c = classes_[stride];
  uint8_t* const begin = *c.with_free.begin();
  Extent& e = extents_.at(begin);
  uint8_t* slot = e.free.back();
  e.free.pop_back();
  e.owners[static_cast<uint64_t>(slot - begin) / e.stride] = kInUse;
  if (e.used++ == 0) empty_.erase(begin);
  if (e.free.empty()) c.with_free.erase(begin);
  used_bytes_ += stride;
  return slot;
}

SlotPool::Extent& SlotPool::ExtentOf(const uint8_t* slot,
                                     std::map<uint8_t*, Extent>::iterator* found) {
  auto it = extents_.upper_bound(const_cast<uint8_t*>(slot));
  KVTIER_CHECK(it != extents_.begin());
  --it;
  Extent& e = it->second;
  KVTIER_CHECK(slot + e.stride <= it->first + e.bytes &&
               static_cast<uint64_t>(slot - it->first) % e.stride == 0);
  if (found != nullptr) *found = it;
  return e;
}

void SlotPool::SetOwner(const uint8_t* slot, void* owner) {
  std::map<uint8_t*, Extent>::iterator it;
  Extent& e = ExtentOf(slot, &it);
  void*& tag = e.owners[static_cast<uint64_t>(slot - it->first) / e.stride];
  KVTIER_CHECK(tag != nullptr);  // in use
  tag = owner == nullptr ? kInUse : owner;
}

void SlotPool::Drain(const uint8_t* extent) {
  auto it = extents_.find(const_cast<uint8_t*>(extent));
  KVTIER_CHECK(it != extents_.end());
  draining_.insert(it->first);
  classes_[it->second.stride].with_free.erase(it->first);
}

void SlotPool::Free(uint8_t* slot, uint64_t block_bytes) {
  const uint64_t stride = StrideFor(block_bytes);
  std::map<uint8_t*, Extent>::iterator it;
  Extent& e = ExtentOf(slot, &it);
  KVTIER_CHECK(e.stride == stride);
  KVTIER_CHECK(e.used > 0 && used_bytes_ >= stride);
  e.free.push_back(slot);
  e.owners[static_cast<uint64_t>(slot - it->first) / stride] = nullptr;
  // A draining extent's slots are not handed out again.
  if (e.free.size() == 1 && draining_.count(it->first) == 0)
    classes_[stride].with_free.insert(it->first);
  if (--e.used == 0) empty_.insert(it->first);
  used_bytes_ -= stride;
}

std::map<uint8_t*, uint64_t> SlotPool::RangesWithEmptiesReleased() const {
  std::map<uint8_t*, uint64_t> ranges = free_ranges_;
  for (uint8_t* begin : empty_) AddRange(ranges, begin, extents_.at(begin).bytes);
  return ranges;
}

uint64_t SlotPool::SlotsInUse(const uint8_t* extent) const {
  auto it = extents_.find(const_cast<uint8_t*>(extent));
  return it == extents_.end() ? 0 : it->second.used;
}

bool SlotPool::CanAllocate(uint64_t block_bytes) const {
  const uint64_t stride = StrideFor(block_bytes);
  if (auto c = classes_.find(stride); c != classes_.end() && !c->second.with_free.empty())
    return true;
  const std::map<uint8_t*, uint64_t> ranges = RangesWithEmptiesReleased();
  return std::any_of(ranges.begin(), ranges.end(),
                     [&](const auto& r) { return r.second >= stride; });
}

size_t SlotPool::sizes_in_use() const {
  return static_cast<size_t>(std::count_if(classes_.begin(), classes_.end(),
                                           [](const auto& c) { return c.second.extents > 0; }));
}

bool SlotPool::holds(uint64_t block_bytes) const {
  auto c = classes_.find(StrideFor(block_bytes));
  return c != classes_.end() && c->second.extents > 0;
}

std::optional<std::span<uint8_t>> SlotPool::ExtentToReclaim(uint64_t block_bytes,
                                                            const uint8_t* prefer) const {
  std::vector<std::span<uint8_t>> best = ExtentsToReclaim(block_bytes, prefer, 1);
  if (best.empty()) return std::nullopt;
  return best.front();
}

std::vector<std::span<uint8_t>> SlotPool::ExtentsToReclaim(uint64_t block_bytes,
                                                           const uint8_t* prefer,
                                                           size_t max) const {
  const uint64_t stride = StrideFor(block_bytes);
  const std::map<uint8_t*, uint64_t> ranges = RangesWithEmptiesReleased();
  // The free bytes right before and right after [begin, end).
  auto around = [&](uint8_t* begin, uint8_t* end) {
    uint64_t bytes = 0;
    if (auto next = ranges.find(end); next != ranges.end()) bytes += next->second;
    if (auto after = ranges.lower_bound(begin); after != ranges.begin()) {
      if (auto prev = std::prev(after); prev->first + prev->second == begin) bytes += prev->second;
    }
    return bytes;
  };
  // Ranked: draining first, then the preferred one, then fewest in use
  // (address order among equals).
  struct Candidate {
    int rank = 0;
    uint64_t used = 0;
    uint8_t* begin = nullptr;
    uint64_t bytes = 0;
  };
  std::vector<Candidate> all;
  for (const auto& x : extents_) {
    const Extent& e = x.second;
    if (e.stride == stride || e.used == 0) continue;
    if (e.bytes + around(x.first, x.first + e.bytes) < stride) continue;
    const bool preferred = prefer != nullptr && prefer >= x.first && prefer < x.first + e.bytes;
    const int rank = draining_.count(x.first) > 0 ? 0 : preferred ? 1 : 2;
    all.push_back(Candidate{rank, e.used, x.first, e.bytes});
  }
  const size_t n = std::min(max, all.size());
  std::partial_sort(all.begin(), all.begin() + static_cast<ptrdiff_t>(n), all.end(),
                    [](const Candidate& a, const Candidate& b) {
                      return std::tie(a.rank, a.used, a.begin) < std::tie(b.rank, b.used, b.begin);
                    });
  std::vector<std::span<uint8_t>> out;
  for (size_t i = 0; i < n; ++i) out.emplace_back(all[i].begin, all[i].bytes);
  return out;
}

}  // namespace kvtier
