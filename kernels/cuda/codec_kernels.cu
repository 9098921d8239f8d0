#include "kernels/cuda/codec_kernels.h"

#include <algorithm>

namespace kvtier::cuda {
namespace {

using detail::kCodecThreads;

struct CodedList {
  uint32_t count;
  CodedBlock blocks[kBlocksPerLaunch];
};

__global__ void __launch_bounds__(kCodecThreads)
    Fp8EncodeKernel(const CopyPiece* __restrict__ pieces, uint32_t num_pieces, const Fp8Shape shape,
                    const __grid_constant__ CodedList list, uint32_t* special) {
  __shared__ uint32_t amax[detail::kEncodeMaxTileGroups];
  const CodedBlock& b = list.blocks[blockIdx.y];
  const uint32_t groups = detail::Fp8TileGroups(shape);
  for (uint32_t i = threadIdx.x; i < groups; i += kCodecThreads) amax[i] = 0;
  __syncthreads();
  detail::Fp8EncodeAmax(pieces, num_pieces, shape, b, special + blockIdx.y, amax, blockIdx.x, threadIdx.x);
  __syncthreads();
  detail::Fp8EncodeWrite(pieces, num_pieces, shape, b, amax, blockIdx.x, threadIdx.x);
}

__global__ void __launch_bounds__(kCodecThreads)
    Fp8DecodeKernel(const CopyPiece* __restrict__ pieces, uint32_t num_pieces, const Fp8Shape shape,
                    const __grid_constant__ CodedList list, uint32_t* bad) {
  detail::Fp8DecodeThread(pieces, num_pieces, shape, list.blocks[blockIdx.y], bad, blockIdx.x, threadIdx.x);
}

template <bool kEncode>
cudaError_t Launch(const DevicePieces& plan, const Fp8Shape& shape, std::span<const CodedBlock> blocks,
                   uint32_t* flags, cudaStream_t stream) {
  if (blocks.empty() || plan.count == 0 || shape.elems == 0) return cudaSuccess;
  const uint32_t ctas = kEncode ? detail::Fp8EncodeCtas(shape) : detail::Fp8DecodeCtas(shape);
  for (size_t first = 0; first < blocks.size(); first += kBlocksPerLaunch) {
    CodedList list{};
    list.count = static_cast<uint32_t>(std::min<size_t>(kBlocksPerLaunch, blocks.size() - first));
    std::copy_n(blocks.begin() + static_cast<ptrdiff_t>(first), list.count, list.blocks);
    const dim3 grid(ctas, list.count);
    // Encode: a flag per block; decode: one for the launch.
    uint32_t* launch_flags = kEncode ? flags + first : flags;
    if constexpr (kEncode) {
      Fp8EncodeKernel<<<grid, kCodecThreads, 0, stream>>>(plan.pieces, plan.count, shape, list, launch_flags);
    } else {
      Fp8DecodeKernel<<<grid, kCodecThreads, 0, stream>>>(plan.pieces, plan.count, shape, list, launch_flags);
    }
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchFp8Encode(const DevicePieces& plan, const Fp8Shape& shape, std::span<const CodedBlock> blocks,
                            uint32_t* special, cudaStream_t stream) {
  return Launch<true>(plan, shape, blocks, special, stream);
}

cudaError_t LaunchFp8Decode(const DevicePieces& plan, const Fp8Shape& shape, std::span<const CodedBlock> blocks,
                            uint32_t* bad, cudaStream_t stream) {
  return Launch<false>(plan, shape, blocks, bad, stream);
}

}  // namespace kvtier::cuda
