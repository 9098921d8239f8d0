// Limits of the disk tier's addressing, shared by the config (which refuses
// larger sizes at load, naming the key) and the tiers (which rely on them),
// so neither depends on the other. Constants only.
#pragma once

#include <cstdint>

namespace kvtier {

// The most bytes one disk path (device) may have: a block that lives only
// on disk keeps its record's offset in 39 bits of 4 KiB pages
// (tiers/disk_only_index.h), so that a node can hold millions of them in 32
// bytes each. 2 PiB is far above any NVMe drive sold today.
inline constexpr uint64_t kMaxDiskPathBytes = uint64_t{1} << 51;

// The most bytes one region may have: the tier lists a region's records by
// their 32-bit page number inside it (tiers/disk/disk_tier.h).
inline constexpr uint64_t kMaxDiskRegionBytes = (uint64_t{1} << 44) - 4096;

}  // namespace kvtier
