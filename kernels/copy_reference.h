// CPU reference gather/scatter between an engine's paged KV cache (described
// by a KvCacheLayout over mapped regions) and kvtier's contiguous block slots.
// The host device backend runs it on worker threads; the CUDA kernels (later)
// must produce byte-identical results for the same descriptors.
//
// Pure functions over caller-owned memory; thread-safe as long as concurrent
// calls touch disjoint destination bytes.
#pragma once

#include <cstdint>
#include <span>

#include "common/kv_cache_layout.h"

namespace kvtier {

// Where the registered regions of one engine are mapped in this process.
// region_bases[i] must be the start of region i, valid for
// layout.region_sizes_bytes()[i] bytes, for the duration of the call.
struct MappedRegions {
  std::span<uint8_t* const> region_bases;
};

// Copies engine block `block_id` into `slot` (layout.layout().block_bytes()
// bytes, canonical order). With `checksum`, also stores the XXH3-64 of the
// slot's bytes there, hashed piece by piece while they are in cache.
// REQUIRES: block_id < num_blocks, region_bases has one entry per region
// (checked by KVTIER_CHECK: a violation is a bug).
void GatherBlock(const KvCacheLayout& layout, const MappedRegions& regions, uint32_t block_id,
                 uint8_t* slot, uint64_t* checksum = nullptr);

// Copies `slot` (canonical order) into engine block `block_id`.
void ScatterBlock(const KvCacheLayout& layout, const MappedRegions& regions, uint32_t block_id,
                  const uint8_t* slot);

// memcpy that returns the XXH3-64 of the copied bytes, hashing each piece
// right after copying it.
uint64_t CopyWithChecksum(uint8_t* dst, const uint8_t* src, uint64_t size_bytes);

}  // namespace kvtier
