#include "kernels/cuda/copy_kernels.h"

#include <algorithm>

namespace kvtier::cuda {
namespace {

constexpr uint32_t kThreads = 256;
// Units (vectors) each thread has in flight per iteration: loads first, then
// stores, so a thread reading host memory over PCIe waits once per batch.
constexpr uint32_t kUnroll = 4;
// Bytes of one piece that one CTA copies, at most: a large contiguous piece
// (a whole block of a contiguous cache) is split over many CTAs.
constexpr uint64_t kBytesPerCta = 32 << 10;

struct BlockList {
  uint32_t count;
  BlockCopy blocks[kBlocksPerLaunch];
};

// Byte offset of vector unit `u` of a piece on the engine side. The slot
// side is always u * sizeof(T): the slot holds the rows back to back.
__device__ __forceinline__ uint64_t EngineOffset(const CopyPiece& p, uint64_t units_per_row, uint64_t u,
                                                 uint32_t unit_bytes) {
  if (p.outer == 1 && p.inner == 1) return u * unit_bytes;
  const uint64_t row = u / units_per_row;
  const uint64_t col = u - row * units_per_row;
  const uint64_t o = row / p.inner;
  const uint64_t i = row - o * p.inner;
  return o * p.outer_stride + i * p.inner_stride + col * unit_bytes;
}

template <typename T, bool kGather>
__device__ void CopyUnits(const CopyPiece& p, uint8_t* engine, uint8_t* slot, uint32_t split, uint32_t splits) {
  constexpr uint32_t kBytes = sizeof(T);
  const uint64_t units_per_row = p.row_bytes / kBytes;
  const uint64_t total = units_per_row * p.outer * p.inner;
  const uint64_t begin = total * split / splits;
  const uint64_t end = total * (split + 1) / splits;
  for (uint64_t base = begin + threadIdx.x; base < end; base += uint64_t{kThreads} * kUnroll) {
    T v[kUnroll];
#pragma unroll
    for (uint32_t k = 0; k < kUnroll; ++k) {
      const uint64_t u = base + uint64_t{k} * kThreads;
      if (u >= end) break;
      const uint8_t* src = kGather ? engine + EngineOffset(p, units_per_row, u, kBytes) : slot + u * kBytes;
      v[k] = *reinterpret_cast<const T*>(src);
    }
#pragma unroll
    for (uint32_t k = 0; k < kUnroll; ++k) {
      const uint64_t u = base + uint64_t{k} * kThreads;
      if (u >= end) break;
      uint8_t* dst = kGather ? slot + u * kBytes : engine + EngineOffset(p, units_per_row, u, kBytes);
      *reinterpret_cast<T*>(dst) = v[k];
    }
  }
}

// Grid: x = piece * splits + split, y = block of the list.
template <bool kGather>
__global__ void __launch_bounds__(kThreads)
    BlockCopyKernel(const CopyPiece* __restrict__ pieces, uint32_t splits, const __grid_constant__ BlockList list) {
  const CopyPiece p = pieces[blockIdx.x / splits];
  const uint32_t split = blockIdx.x % splits;
  const BlockCopy& b = list.blocks[blockIdx.y];
  uint8_t* engine = reinterpret_cast<uint8_t*>(p.engine + uint64_t{b.engine_block} * p.block_stride);
  uint8_t* slot = b.slot + p.slot_offset;
  // The plan's alignment covers the engine side and the slot offset; the
  // slot's own base may be less aligned (it never is in kvtier's pools).
  const uint64_t slot_bits = reinterpret_cast<uint64_t>(b.slot) | p.align;
  const uint32_t align = static_cast<uint32_t>(slot_bits & (~slot_bits + 1));
  switch (align) {
    case 16: CopyUnits<uint4, kGather>(p, engine, slot, split, splits); break;
    case 8: CopyUnits<uint2, kGather>(p, engine, slot, split, splits); break;
    case 4: CopyUnits<uint32_t, kGather>(p, engine, slot, split, splits); break;
    case 2: CopyUnits<uint16_t, kGather>(p, engine, slot, split, splits); break;
    default: CopyUnits<uint8_t, kGather>(p, engine, slot, split, splits); break;
  }
}

template <bool kGather>
cudaError_t Launch(const DevicePieces& plan, std::span<const BlockCopy> blocks, cudaStream_t stream) {
  if (blocks.empty() || plan.count == 0) return cudaSuccess;
  const uint64_t splits64 = std::max<uint64_t>(1, (plan.max_piece_bytes + kBytesPerCta - 1) / kBytesPerCta);
  const auto splits = static_cast<uint32_t>(splits64);  // <= 2^30 / 2^15
  for (size_t first = 0; first < blocks.size(); first += kBlocksPerLaunch) {
    BlockList list{};
    list.count = static_cast<uint32_t>(std::min<size_t>(kBlocksPerLaunch, blocks.size() - first));
    std::copy_n(blocks.begin() + static_cast<ptrdiff_t>(first), list.count, list.blocks);
    const dim3 grid(plan.count * splits, list.count);
    BlockCopyKernel<kGather><<<grid, kThreads, 0, stream>>>(plan.pieces, splits, list);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchGather(const DevicePieces& plan, std::span<const BlockCopy> blocks, cudaStream_t stream) {
  return Launch<true>(plan, blocks, stream);
}

cudaError_t LaunchScatter(const DevicePieces& plan, std::span<const BlockCopy> blocks, cudaStream_t stream) {
  return Launch<false>(plan, blocks, stream);
}

}  // namespace kvtier::cuda
