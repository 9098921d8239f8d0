// CPU reference gather/scatter between an engine's paged KV cache and
// kvtier's contiguous block slots, walking a CopyPlan (kernels/copy_plan.h).
// The host backend runs it on worker threads; the CUDA kernels
// (kernels/copy_kernels.h) walk the same descriptors and must produce
// byte-identical results.
//
// Pure functions over caller-owned memory; thread-safe as long as concurrent
// calls touch disjoint destination bytes.
#pragma once

#include <cstdint>

#include "common/kv_cache_layout.h"
#include "kernels/copy_plan.h"

namespace kvtier {

// How a copy writes its destination. Streaming (non-temporal stores, x86-64)
// suits a destination read much later or by another agent: a slot, the
// engine's pages. It writes each line without first reading it into the
// cache (copy_reference.cc has the figures). Cached suits a destination read
// right away (a codec's scratch).
// Every copy below streams unless it takes a CopyStores; each returns with
// its stores ordered before the caller's next write.
enum class CopyStores { kStreaming, kCached };

// Copies engine block `block_id` into `slot` (plan.block_bytes() bytes,
// canonical order). With `checksum`, also stores the XXH3-64 of the bytes
// copied there, each piece hashed just before it is copied, from the cache.
// REQUIRES: block_id < plan.num_blocks() (KVTIER_CHECK: a violation is a bug).
void GatherBlock(const CopyPlan& plan, uint32_t block_id, uint8_t* slot, uint64_t* checksum = nullptr,
                 CopyStores stores = CopyStores::kStreaming);

// Only layer `layer` of it (a plan built by layer), with no checksum: a
// block gathered layer by layer is checksummed once every layer is in its
// slot (ChecksumOf the slot, the same value). REQUIRES: layer <
// plan.num_layers().
void GatherBlockLayer(const CopyPlan& plan, uint32_t block_id, uint32_t layer, uint8_t* slot);

// Copies `slot` (canonical order) into engine block `block_id`.
void ScatterBlock(const CopyPlan& plan, uint32_t block_id, const uint8_t* slot);
// Only layer `layer` of it (a plan built by layer). REQUIRES: layer <
// plan.num_layers().
void ScatterBlockLayer(const CopyPlan& plan, uint32_t block_id, uint32_t layer, const uint8_t* slot);

// The same for one block, building the plan on the way (tests, one-offs).
void GatherBlock(const KvCacheLayout& layout, const MappedRegions& regions, uint32_t block_id,
                 uint8_t* slot, uint64_t* checksum = nullptr);
void ScatterBlock(const KvCacheLayout& layout, const MappedRegions& regions, uint32_t block_id,
                  const uint8_t* slot);

// A streaming copy that returns the XXH3-64 of the copied bytes, hashing
// each piece just before copying it.
uint64_t CopyWithChecksum(uint8_t* dst, const uint8_t* src, uint64_t size_bytes);

// A streaming copy of `size_bytes` (slot to slot).
void CopyStreaming(uint8_t* dst, const uint8_t* src, uint64_t size_bytes);

// XXH3-64 of `size_bytes` at `data` (the checksum a slot carries).
uint64_t ChecksumOf(const uint8_t* data, uint64_t size_bytes);

}  // namespace kvtier
