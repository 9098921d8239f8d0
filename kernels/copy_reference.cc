#include "kernels/copy_reference.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/check.h"

namespace kvtier {
namespace {

// Copied and hashed in pieces of this size, so that each piece is hashed
// while it is still in cache: the checksum then costs no extra memory pass.
constexpr uint64_t kHashChunkBytes = 256 << 10;

// Calls copy(engine_bytes, slot_offset, size_bytes) for each contiguous run of
// engine block `block_id`, in canonical slot order. Runs that are adjacent in
// the engine too (a contiguous or page-first cache) are merged, so large
// blocks move in few large copies. Gather and scatter share this walk so they
// cannot disagree about where a byte goes.
template <typename CopyFn>
void ForEachRun(const KvCacheLayout& layout, const MappedRegions& regions, uint32_t block_id,
                CopyFn emit) {
  uint8_t* run = nullptr;
  uint64_t run_offset = 0;
  uint64_t run_bytes = 0;
  auto copy = [&](uint8_t* engine, uint64_t slot_offset, uint64_t size_bytes) {
    if (run != nullptr && engine == run + run_bytes) {
      run_bytes += size_bytes;
      return;
    }
    if (run != nullptr) emit(run, run_offset, run_bytes);
    run = engine;
    run_offset = slot_offset;
    run_bytes = size_bytes;
  };
  KVTIER_CHECK(block_id < layout.num_blocks());
  KVTIER_CHECK(regions.region_bases.size() == layout.region_sizes_bytes().size());
  const LayoutSpec& spec = layout.layout().spec();
  const std::vector<Placement>& placements = layout.placements();
  uint64_t slot_offset = 0;
  for (uint32_t piece = 0; piece < placements.size(); ++piece) {
    const Placement& p = placements[piece];
    // KvCacheLayout::Create checked that the last byte of the last block is
    // inside the region without overflow, so no address below wraps.
    uint8_t* block =
        regions.region_bases[p.region] + p.offset_bytes + uint64_t{block_id} * p.block_stride_bytes;
    if (layout.PieceIsContiguous(piece)) {
      const uint64_t size = layout.PieceBytes(piece);
      copy(block, slot_offset, size);
      slot_offset += size;
      continue;
    }
    // Only K, V and latent pieces can be strided (a scale piece is a single
    // row), so the rows are the block's tokens x heads.
    const uint64_t row_bytes = layout.RowBytes(piece);
    for (uint64_t t = 0; t < spec.block_tokens; ++t) {
      uint8_t* token = block + t * p.token_stride_bytes;
      for (uint64_t h = 0; h < spec.num_kv_heads; ++h) {
        copy(token + h * p.head_stride_bytes, slot_offset, row_bytes);
        slot_offset += row_bytes;
      }
    }
  }
  if (run != nullptr) emit(run, run_offset, run_bytes);
  KVTIER_CHECK(slot_offset == layout.layout().block_bytes());
}

}  // namespace

void GatherBlock(const KvCacheLayout& layout, const MappedRegions& regions, uint32_t block_id,
                 uint8_t* slot, uint64_t* checksum) {
  KVTIER_CHECK(slot != nullptr);
  if (checksum == nullptr) {
    ForEachRun(layout, regions, block_id,
               [slot](const uint8_t* engine, uint64_t slot_offset, uint64_t size_bytes) {
                 std::memcpy(slot + slot_offset, engine, size_bytes);
               });
    return;
  }
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  ForEachRun(layout, regions, block_id,
             [slot, &state](const uint8_t* engine, uint64_t slot_offset, uint64_t size_bytes) {
               for (uint64_t done = 0; done < size_bytes; done += kHashChunkBytes) {
                 const uint64_t n = std::min(kHashChunkBytes, size_bytes - done);
                 std::memcpy(slot + slot_offset + done, engine + done, n);
                 XXH3_64bits_update(&state, slot + slot_offset + done, n);
               }
             });
  *checksum = XXH3_64bits_digest(&state);
}

uint64_t CopyWithChecksum(uint8_t* dst, const uint8_t* src, uint64_t size_bytes) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  for (uint64_t done = 0; done < size_bytes; done += kHashChunkBytes) {
    const uint64_t n = std::min(kHashChunkBytes, size_bytes - done);
    std::memcpy(dst + done, src + done, n);
    XXH3_64bits_update(&state, dst + done, n);
  }
  return XXH3_64bits_digest(&state);
}

void ScatterBlock(const KvCacheLayout& layout, const MappedRegions& regions, uint32_t block_id,
                  const uint8_t* slot) {
  KVTIER_CHECK(slot != nullptr);
  ForEachRun(layout, regions, block_id,
             [slot](uint8_t* engine, uint64_t slot_offset, uint64_t size_bytes) {
               std::memcpy(engine, slot + slot_offset, size_bytes);
             });
}

}  // namespace kvtier
