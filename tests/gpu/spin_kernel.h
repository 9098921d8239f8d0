// A kernel that keeps a stream busy for a while: the gpu tests queue it
// before an engine's writes or reads, so that a copy that is not ordered
// against the engine's stream would visibly race with them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvtier::gpu_testing {

// Occupies `stream` for about `nanos` nanoseconds (one thread, sleeping).
cudaError_t LaunchSpin(cudaStream_t stream, uint64_t nanos);

}  // namespace kvtier::gpu_testing
