// Kernels for the gpu tests. Spin keeps a stream busy for a while: the tests
// queue it before an engine's writes or reads, so that a copy that is not
// ordered against the engine's stream would visibly race with them. Trap
// faults the context.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvtier::gpu_testing {

// Occupies `stream` for about `nanos` nanoseconds (one thread, sleeping).
cudaError_t LaunchSpin(cudaStream_t stream, uint64_t nanos);

// Queues a kernel that traps: a sticky error (cudaErrorLaunchFailure) that
// loses the process's CUDA context for good, as a fault in a copy would.
cudaError_t LaunchTrap(cudaStream_t stream);

}  // namespace kvtier::gpu_testing
