#include "tiers/disk_only_index.h"

#include "common/check.h"

namespace kvtier {

size_t DiskOnlyIndex::Home(const StoredKey& key) const {
  // Stored keys are uniform hashes: their low 64 bits index directly (by
  // multiply-shift, so the capacity need not be a power of two).
  __extension__ using U128 = unsigned __int128;  // g++ and clang; -Wpedantic asks for the marker
  return static_cast<size_t>((static_cast<U128>(key.Low64()) * slots_.size()) >> 64);
}

DiskOnlyBlock* DiskOnlyIndex::Find(const StoredKey& key) {
  if (slots_.empty()) return nullptr;
  for (size_t i = Home(key), n = 0; n < slots_.size(); ++n, i = (i + 1 == slots_.size() ? 0 : i + 1)) {
    DiskOnlyBlock& b = slots_[i];
    if (b.used == kEmpty) return nullptr;
    if (b.used == kUsed && b.key == key) return &b;
  }
  return nullptr;
}

void DiskOnlyIndex::Insert(const DiskOnlyBlock& block) {
  if ((size_ + tombstones_ + 1) * 5 > slots_.size() * 4) Grow();
  for (size_t i = Home(block.key);; i = (i + 1 == slots_.size() ? 0 : i + 1)) {
    DiskOnlyBlock& b = slots_[i];
    KVTIER_CHECK(!(b.used == kUsed && b.key == block.key));
    if (b.used != kUsed) {
      if (b.used == kTombstone) --tombstones_;
      b = block;
      b.used = kUsed;
      ++size_;
      return;
    }
  }
}

void DiskOnlyIndex::Erase(DiskOnlyBlock* block) {
  KVTIER_CHECK(block != nullptr && block->used == kUsed);
  block->used = kTombstone;
  --size_;
  ++tombstones_;
}

void DiskOnlyIndex::Grow() {
  std::vector<DiskOnlyBlock> old = std::move(slots_);
  // Half again as large as the live blocks need at 80%: tombstones go.
  const size_t want = std::max<size_t>(64, (size_ + 1) * 5 / 4 * 3 / 2);
  slots_.assign(want, DiskOnlyBlock{});
  size_ = 0;
  tombstones_ = 0;
  for (const DiskOnlyBlock& b : old) {
    if (b.used == kUsed) Insert(b);
  }
}

}  // namespace kvtier
