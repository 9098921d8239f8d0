#include "kernels/copy_reference.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>
#if defined(__x86_64__)
// XXH3 through libxxhash's dispatcher: AVX2 (or AVX-512) where the CPU has
// it, picked at run time; 1.2-1.3x the baseline SSE2 build's checksums
// (issue 48: the store path's copy-and-checksum ran at 0.71x a memcpy).
#include <xxh_x86dispatch.h>
#endif

#include <algorithm>
#include <cstring>

#include "common/check.h"

namespace kvtier {
namespace {

// Copied and hashed in pieces of this size, so that each piece is hashed
// while it is still in cache: the checksum then costs no extra memory pass.
constexpr uint64_t kHashChunkBytes = 256 << 10;

// Calls emit(engine_bytes, slot_offset, size_bytes) for each row of
// `pieces` of engine block `block_id`, in canonical slot order. Gather and
// scatter share this walk so they cannot disagree about where a byte goes.
template <typename EmitFn>
void ForEachRow(const CopyPlan& plan, std::span<const CopyPiece> pieces, uint32_t block_id, EmitFn emit) {
  KVTIER_CHECK(block_id < plan.num_blocks());
  for (const CopyPiece& p : pieces) {
    // KvCacheLayout::Create checked that the last byte of the last block is
    // inside its region without overflow, so no address below wraps.
    const uint64_t block = p.engine + uint64_t{block_id} * p.block_stride;
    uint64_t slot_offset = p.slot_offset;
    for (uint64_t o = 0; o < p.outer; ++o) {
      for (uint64_t i = 0; i < p.inner; ++i) {
        emit(reinterpret_cast<uint8_t*>(block + o * p.outer_stride + i * p.inner_stride), slot_offset,
             p.row_bytes);
        slot_offset += p.row_bytes;
      }
    }
  }
}

}  // namespace

void GatherBlock(const CopyPlan& plan, uint32_t block_id, uint8_t* slot, uint64_t* checksum) {
  KVTIER_CHECK(slot != nullptr);
  if (checksum == nullptr) {
    ForEachRow(plan, plan.pieces(), block_id, [slot](const uint8_t* engine, uint64_t slot_offset, uint64_t size_bytes) {
      std::memcpy(slot + slot_offset, engine, size_bytes);
    });
    return;
  }
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  ForEachRow(plan, plan.pieces(), block_id, [slot, &state](const uint8_t* engine, uint64_t slot_offset, uint64_t size_bytes) {
    for (uint64_t done = 0; done < size_bytes; done += kHashChunkBytes) {
      const uint64_t n = std::min(kHashChunkBytes, size_bytes - done);
      std::memcpy(slot + slot_offset + done, engine + done, n);
      XXH3_64bits_update(&state, slot + slot_offset + done, n);
    }
  });
  *checksum = XXH3_64bits_digest(&state);
}

void GatherBlockLayer(const CopyPlan& plan, uint32_t block_id, uint32_t layer, uint8_t* slot) {
  KVTIER_CHECK(slot != nullptr && layer < plan.num_layers());
  ForEachRow(plan, plan.layer_pieces(layer), block_id,
             [slot](const uint8_t* engine, uint64_t slot_offset, uint64_t size_bytes) {
               std::memcpy(slot + slot_offset, engine, size_bytes);
             });
}

void ScatterBlock(const CopyPlan& plan, uint32_t block_id, const uint8_t* slot) {
  KVTIER_CHECK(slot != nullptr);
  ForEachRow(plan, plan.pieces(), block_id, [slot](uint8_t* engine, uint64_t slot_offset, uint64_t size_bytes) {
    std::memcpy(engine, slot + slot_offset, size_bytes);
  });
}

void ScatterBlockLayer(const CopyPlan& plan, uint32_t block_id, uint32_t layer, const uint8_t* slot) {
  KVTIER_CHECK(slot != nullptr && layer < plan.num_layers());
  ForEachRow(plan, plan.layer_pieces(layer), block_id,
             [slot](uint8_t* engine, uint64_t slot_offset, uint64_t size_bytes) {
               std::memcpy(engine, slot + slot_offset, size_bytes);
             });
}

void GatherBlock(const KvCacheLayout& layout, const MappedRegions& regions, uint32_t block_id,
                 uint8_t* slot, uint64_t* checksum) {
  GatherBlock(CopyPlan::Build(layout, regions), block_id, slot, checksum);
}

void ScatterBlock(const KvCacheLayout& layout, const MappedRegions& regions, uint32_t block_id,
                  const uint8_t* slot) {
  ScatterBlock(CopyPlan::Build(layout, regions), block_id, slot);
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

uint64_t ChecksumOf(const uint8_t* data, uint64_t size_bytes) { return XXH3_64bits(data, size_bytes); }

}  // namespace kvtier
