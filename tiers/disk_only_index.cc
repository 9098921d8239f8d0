#include "tiers/disk_only_index.h"

#include "common/check.h"

namespace kvtier {

void DiskOnlyIndex::Insert(const DiskOnlyBlock& block) {
  DiskOnlyBlock b = block;
  b.used = 1;
  table_.Insert(b);
}

void DiskOnlyIndex::Erase(DiskOnlyBlock* block) {
  KVTIER_CHECK(block != nullptr);
  table_.Erase(block);
}

}  // namespace kvtier
