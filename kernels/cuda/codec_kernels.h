// The fp8 codec on the GPU (issue 18): kernels that quantize engine blocks
// straight into coded slots (a store: gather, quantize and D2H in one pass)
// and dequantize coded slots straight into the engine's pages (a load: H2D,
// dequantize and scatter in one pass), so no CPU pass touches the block.
// Their output is the CPU codec's (kernels/codec.h), byte for byte: the same
// conversions (kernels/fp8_e4m3.h), compiled without fused multiply-adds.
// Per-thread code: kernels/cuda/codec_kernel_body.h.
//
// Slots and flags may be device memory or mapped pinned host memory. Flags
// are uint32, zeroed by the caller, that a kernel sets to 1: encode, one per
// block, for a NaN or an Inf (store that block raw); decode, one for the
// whole launch, for a NaN code or a bad scale in any block (the load is
// corrupt: do not serve it). A decode that sets it has still written the
// runs of 8 elements that decoded (a failed load's blocks are undefined:
// the engine recomputes them, kvtier/client.h); checking every block first
// would read the coded bytes over PCIe twice.
//
// Launchers are called from host code; they queue work on `stream` and
// return the launch error (cudaSuccess when queued). Thread-safe.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "kernels/cuda/codec_kernel_body.h"
#include "kernels/cuda/copy_kernels.h"

namespace kvtier::cuda {

using detail::CodedBlock;
using detail::Fp8Shape;
using detail::Fp8ShapeOf;

// REQUIRES: every engine_block < the plan's num_blocks; a slot holds
// groups * 4 + elems bytes; `special` holds blocks.size() entries.
cudaError_t LaunchFp8Encode(const DevicePieces& plan, const Fp8Shape& shape, std::span<const CodedBlock> blocks,
                            uint32_t* special, cudaStream_t stream);
// REQUIRES: as encode; `bad` is one flag for every block.
cudaError_t LaunchFp8Decode(const DevicePieces& plan, const Fp8Shape& shape, std::span<const CodedBlock> blocks,
                            uint32_t* bad, cudaStream_t stream);

}  // namespace kvtier::cuda
