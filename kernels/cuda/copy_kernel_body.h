// The body of the gather/scatter kernels (kernels/cuda/copy_kernels.cu), as
// host-and-device code: what one thread of one CTA copies. The .cu launches
// it on the GPU; a unit test runs the very same code for every thread of
// every CTA on the CPU (there is no shared memory and no synchronisation
// between threads, so a sequential walk is exact), which is how CI checks
// the kernels' index arithmetic and alignment choices without a GPU.
//
// Grid: x = piece * splits + split, y = block of the launch; kThreads threads.
// Each CTA copies one split of one piece of one block; a thread moves vector
// units (16, 8, 4, 2 or 1 bytes, the widest the alignment allows), kUnroll at
// a time: loads first, then stores, so a thread reading host memory over
// PCIe waits once per batch of loads.
//
// Pure functions; thread-safe.
#pragma once

#include <vector_types.h>  // uint2, uint4: host-includable CUDA vector types

#include <cstdint>

#include "common/device_backend.h"
#include "kernels/copy_plan.h"
#include "kernels/host_device.h"


namespace kvtier::cuda::detail {

inline constexpr uint32_t kThreads = 256;
inline constexpr uint32_t kUnroll = 4;
// Bytes of one piece that one CTA copies, at most: a large contiguous piece
// (a whole block of a contiguous cache) is split over many CTAs.
inline constexpr uint64_t kBytesPerCta = 32 << 10;

// CTAs per piece (the same for every piece of a launch).
KVTIER_HOST_DEVICE uint32_t SplitsFor(uint64_t max_piece_bytes) {
  const uint64_t splits = (max_piece_bytes + kBytesPerCta - 1) / kBytesPerCta;
  return static_cast<uint32_t>(splits == 0 ? 1 : splits);  // <= 2^30 / 2^15
}

// Byte offset of vector unit `u` of a piece on the engine side. The slot
// side is always u * unit_bytes: the slot holds the rows back to back.
KVTIER_HOST_DEVICE uint64_t EngineOffset(const CopyPiece& p, uint64_t units_per_row, uint64_t u,
                                         uint32_t unit_bytes) {
  if (p.outer == 1 && p.inner == 1) return u * unit_bytes;
  const uint64_t row = u / units_per_row;
  const uint64_t col = u - row * units_per_row;
  const uint64_t o = row / p.inner;
  const uint64_t i = row - o * p.inner;
  return o * p.outer_stride + i * p.inner_stride + col * unit_bytes;
}

template <typename T, bool kGather>
KVTIER_HOST_DEVICE void CopyUnits(const CopyPiece& p, uint8_t* engine, uint8_t* slot, uint32_t split,
                                  uint32_t splits, uint32_t thread) {
  constexpr uint32_t kBytes = sizeof(T);
  const uint64_t units_per_row = p.row_bytes / kBytes;
  const uint64_t total = units_per_row * p.outer * p.inner;
  const uint64_t begin = total * split / splits;
  const uint64_t end = total * (split + 1) / splits;
  for (uint64_t base = begin + thread; base < end; base += uint64_t{kThreads} * kUnroll) {
    // (Zeroed: g++ -O2 cannot tell that the second loop reads only what
    // the first wrote, and warns.)
    T v[kUnroll] = {};
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (uint32_t k = 0; k < kUnroll; ++k) {
      const uint64_t u = base + uint64_t{k} * kThreads;
      if (u >= end) break;
      const uint8_t* src = kGather ? engine + EngineOffset(p, units_per_row, u, kBytes) : slot + u * kBytes;
      v[k] = *reinterpret_cast<const T*>(src);
    }
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (uint32_t k = 0; k < kUnroll; ++k) {
      const uint64_t u = base + uint64_t{k} * kThreads;
      if (u >= end) break;
      uint8_t* dst = kGather ? slot + u * kBytes : engine + EngineOffset(p, units_per_row, u, kBytes);
      *reinterpret_cast<T*>(dst) = v[k];
    }
  }
}

// What thread `thread` of CTA (cta_x, block b) copies.
template <bool kGather>
KVTIER_HOST_DEVICE void CopyThread(const CopyPiece* pieces, uint32_t splits, const BlockCopy& b, uint32_t cta_x,
                                   uint32_t thread) {
  const CopyPiece p = pieces[cta_x / splits];
  const uint32_t split = cta_x % splits;
  uint8_t* engine = reinterpret_cast<uint8_t*>(p.engine + uint64_t{b.engine_block} * p.block_stride);
  uint8_t* slot = b.slot + p.slot_offset;
  // The plan's alignment covers the engine side and the slot offset; the
  // slot's own base may be less aligned (it never is in kvtier's pools). The
  // lowest set bit of (base | align) is the alignment of both.
  const uint64_t bits = reinterpret_cast<uint64_t>(b.slot) | p.align;
  switch (static_cast<uint32_t>(bits & (~bits + 1))) {
    case 16: CopyUnits<uint4, kGather>(p, engine, slot, split, splits, thread); break;
    case 8: CopyUnits<uint2, kGather>(p, engine, slot, split, splits, thread); break;
    case 4: CopyUnits<uint32_t, kGather>(p, engine, slot, split, splits, thread); break;
    case 2: CopyUnits<uint16_t, kGather>(p, engine, slot, split, splits, thread); break;
    default: CopyUnits<uint8_t, kGather>(p, engine, slot, split, splits, thread); break;
  }
}

}  // namespace kvtier::cuda::detail
