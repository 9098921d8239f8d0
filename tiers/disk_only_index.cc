#include "tiers/disk_only_index.h"

#include "common/check.h"

namespace kvtier {

void DiskOnlyBlock::set_offset_bytes(uint64_t offset) {
  KVTIER_CHECK_MSG(offset % kRecordAlignBytes == 0 && offset < kOffsetLimitBytes,
                   "a disk record offset must be 4 KiB aligned and below 2 PiB");
  const uint64_t pages = offset / kRecordAlignBytes;
  offset_pages_high_ = static_cast<uint8_t>((pages >> 32) & 0x7f);
  offset_pages_low_ = static_cast<uint32_t>(pages);
}

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
