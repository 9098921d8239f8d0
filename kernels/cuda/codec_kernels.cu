#include "kernels/cuda/codec_kernels.h"

#include <algorithm>

namespace kvtier::cuda {
namespace {

using detail::kCodecThreads;

struct CodedList {
  uint32_t count;
  CodedBlock blocks[kBlocksPerLaunch];
};

template <bool kEncode>
__global__ void __launch_bounds__(kCodecThreads)
    Fp8Kernel(const CopyPiece* __restrict__ pieces, uint32_t num_pieces, const Fp8Shape shape,
              const __grid_constant__ CodedList list, uint32_t* flags) {
  const CodedBlock& b = list.blocks[blockIdx.y];
  if constexpr (kEncode) {
    detail::Fp8EncodeThread(pieces, num_pieces, shape, b, flags + blockIdx.y, blockIdx.x, threadIdx.x);
  } else {
    detail::Fp8DecodeThread(pieces, num_pieces, shape, b, flags, blockIdx.x, threadIdx.x);
  }
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
    Fp8Kernel<kEncode><<<grid, kCodecThreads, 0, stream>>>(plan.pieces, plan.count, shape, list, launch_flags);
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
