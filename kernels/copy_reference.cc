#include "kernels/copy_reference.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>
#if defined(__x86_64__)
// XXH3 through libxxhash's dispatcher: AVX2 (or AVX-512) where the CPU has
// it, picked at run time; 1.2-1.3x the baseline SSE2 build's checksums
// (issue 48: the store path's copy-and-checksum ran at 0.71x a memcpy).
#include <xxh_x86dispatch.h>
#endif

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstring>

#include "common/check.h"

namespace kvtier {
namespace {

// Hashed and then copied in pieces of this size: the hash brings a piece
// into L1, and the copy reads it from there, so the checksum costs no extra
// memory pass. On this VM's EPYC, 2 threads hashing and copying 2 MiB blocks
// ran at 0.9-0.97x a streaming copy in 2 KiB pieces, 0.8-0.9x in 4 KiB and
// 0.65-0.75x in 16 KiB to 1 MiB.
constexpr uint64_t kHashChunkBytes = 2 << 10;

// Copies with streaming (non-temporal) stores where the CPU has them, SSE2
// on every x86-64: each destination line is written without being read into
// the cache first, so a copy moves two bytes of memory per byte, not three:
// 1.6-1.8x glibc's memcpy of 2 MiB here, on 1 and 2 threads. The bytes are
// not ordered for other threads until StreamFence().
void StreamCopy(uint8_t* dst, const uint8_t* src, uint64_t n) {
#if defined(__SSE2__)
  // Rows shorter than this are copied with memcpy: a streaming store wants
  // whole cache lines, and a short row is mostly head and tail.
  constexpr uint64_t kStreamMinBytes = 1 << 10;
  if (n >= kStreamMinBytes) {
    // Cached stores up to the first whole line, so that no line takes both
    // kinds of store.
    const uint64_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const uint64_t body = n & ~uint64_t{63};
    for (uint64_t i = 0; i < body; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    dst += body;
    src += body;
    n -= body;
  }
#endif
  std::memcpy(dst, src, n);
}

// Orders the streaming stores before whatever this thread writes next (the
// op's completion): they are weakly ordered, and AMD does not promise that a
// locked instruction orders them.
void StreamFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

void Copy(uint8_t* dst, const uint8_t* src, uint64_t n, CopyStores stores) {
  if (stores == CopyStores::kStreaming) {
    StreamCopy(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

// Hashes each piece of `src` and then copies it. The checksum is of the
// engine's bytes as they were read: an engine that writes a block while it
// is being stored may leave a slot that fails it where it is checked (disk,
// cluster), where hashing the slot made the torn bytes pass.
template <typename CopyFn>
void CopyAndHash(uint8_t* dst, const uint8_t* src, uint64_t n, XXH3_state_t& state, CopyFn copy) {
  for (uint64_t done = 0; done < n; done += kHashChunkBytes) {
    const uint64_t piece = std::min(kHashChunkBytes, n - done);
    XXH3_64bits_update(&state, src + done, piece);
    copy(dst + done, src + done, piece);
  }
}

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

// Streams `pieces` of engine block `block_id` into `slot`, or out of it,
// and fences.
void GatherRows(const CopyPlan& plan, std::span<const CopyPiece> pieces, uint32_t block_id, uint8_t* slot) {
  ForEachRow(plan, pieces, block_id, [slot](const uint8_t* engine, uint64_t slot_offset, uint64_t size_bytes) {
    StreamCopy(slot + slot_offset, engine, size_bytes);
  });
  StreamFence();
}

void ScatterRows(const CopyPlan& plan, std::span<const CopyPiece> pieces, uint32_t block_id, const uint8_t* slot) {
  ForEachRow(plan, pieces, block_id, [slot](uint8_t* engine, uint64_t slot_offset, uint64_t size_bytes) {
    StreamCopy(engine, slot + slot_offset, size_bytes);
  });
  StreamFence();
}

}  // namespace

void GatherBlock(const CopyPlan& plan, uint32_t block_id, uint8_t* slot, uint64_t* checksum, CopyStores stores) {
  KVTIER_CHECK(slot != nullptr);
  if (checksum == nullptr) {
    ForEachRow(plan, plan.pieces(), block_id,
               [slot, stores](const uint8_t* engine, uint64_t slot_offset, uint64_t size_bytes) {
                 Copy(slot + slot_offset, engine, size_bytes, stores);
               });
  } else {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    ForEachRow(plan, plan.pieces(), block_id,
               [slot, stores, &state](const uint8_t* engine, uint64_t slot_offset, uint64_t size_bytes) {
                 CopyAndHash(slot + slot_offset, engine, size_bytes, state,
                             [stores](uint8_t* d, const uint8_t* s, uint64_t n) { Copy(d, s, n, stores); });
               });
    *checksum = XXH3_64bits_digest(&state);
  }
  StreamFence();
}

void GatherBlockLayer(const CopyPlan& plan, uint32_t block_id, uint32_t layer, uint8_t* slot) {
  KVTIER_CHECK(slot != nullptr && layer < plan.num_layers());
  GatherRows(plan, plan.layer_pieces(layer), block_id, slot);
}

void ScatterBlock(const CopyPlan& plan, uint32_t block_id, const uint8_t* slot) {
  KVTIER_CHECK(slot != nullptr);
  ScatterRows(plan, plan.pieces(), block_id, slot);
}

void ScatterBlockLayer(const CopyPlan& plan, uint32_t block_id, uint32_t layer, const uint8_t* slot) {
  KVTIER_CHECK(slot != nullptr && layer < plan.num_layers());
  ScatterRows(plan, plan.layer_pieces(layer), block_id, slot);
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
  CopyAndHash(dst, src, size_bytes, state, StreamCopy);
  StreamFence();
  return XXH3_64bits_digest(&state);
}

void CopyStreaming(uint8_t* dst, const uint8_t* src, uint64_t size_bytes) {
  StreamCopy(dst, src, size_bytes);
  StreamFence();
}

uint64_t ChecksumOf(const uint8_t* data, uint64_t size_bytes) { return XXH3_64bits(data, size_bytes); }

}  // namespace kvtier
