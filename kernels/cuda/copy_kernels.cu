#include "kernels/cuda/copy_kernels.h"

#include <algorithm>

#include "kernels/cuda/copy_kernel_body.h"

namespace kvtier::cuda {
namespace {

using detail::kThreads;

struct BlockList {
  uint32_t count;
  BlockCopy blocks[kBlocksPerLaunch];
};

template <bool kGather>
__global__ void __launch_bounds__(kThreads)
    BlockCopyKernel(const CopyPiece* __restrict__ pieces, uint32_t splits, const __grid_constant__ BlockList list) {
  detail::CopyThread<kGather>(pieces, splits, list.blocks[blockIdx.y], blockIdx.x, threadIdx.x);
}

template <bool kGather>
cudaError_t Launch(const DevicePieces& plan, std::span<const BlockCopy> blocks, cudaStream_t stream) {
  if (blocks.empty() || plan.count == 0) return cudaSuccess;
  const uint32_t splits = detail::SplitsFor(plan.max_piece_bytes);
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
