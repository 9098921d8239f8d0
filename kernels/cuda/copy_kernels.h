// Batched gather/scatter kernels: copy many blocks between an engine's paged
// KV cache and kvtier's contiguous slots in one launch, every piece (each
// layer's K and V, or the MLA latent, and fp8 scales) of every block.
//
// The kernels walk the descriptors of a CopyPlan (kernels/copy_plan.h), the
// same ones the CPU reference walks, and produce byte-identical results
// (tests/gpu/ compares them on every layout). Engine and slot memory may be
// device memory or mapped pinned host memory (H2D and D2H without staging):
// any address the device can dereference. Rows move in 16-byte vectors where
// the piece and slot alignment allow, else in the widest access that does.
//
// Launchers are called from host code; they queue work on `stream` and
// return the launch error (cudaSuccess when queued). Thread-safe.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "common/device_backend.h"
#include "kernels/copy_plan.h"

namespace kvtier::cuda {

// A plan's pieces in memory the device can read (DevicePlan owns one).
struct DevicePieces {
  const CopyPiece* pieces = nullptr;
  uint32_t count = 0;
  uint64_t max_piece_bytes = 0;
};

// Copies engine blocks into slots (gather) or slots into engine blocks
// (scatter). Any number of blocks; launches ceil(n / kBlocksPerLaunch)
// kernels. REQUIRES: every engine_block < the plan's num_blocks.
inline constexpr uint32_t kBlocksPerLaunch = 128;
cudaError_t LaunchGather(const DevicePieces& plan, std::span<const BlockCopy> blocks, cudaStream_t stream);
cudaError_t LaunchScatter(const DevicePieces& plan, std::span<const BlockCopy> blocks, cudaStream_t stream);

}  // namespace kvtier::cuda
