#include "tests/gpu/spin_kernel.h"

namespace kvtier::gpu_testing {
namespace {

__device__ uint64_t GlobalNanos() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void Spin(uint64_t nanos) {
  const uint64_t start = GlobalNanos();
  while (GlobalNanos() - start < nanos) __nanosleep(1000);
}

__global__ void Trap() { __trap(); }

}  // namespace

cudaError_t LaunchTrap(cudaStream_t stream) {
  Trap<<<1, 1, 0, stream>>>();
  return cudaGetLastError();
}

cudaError_t LaunchSpin(cudaStream_t stream, uint64_t nanos) {
  Spin<<<1, 1, 0, stream>>>(nanos);
  return cudaGetLastError();
}

}  // namespace kvtier::gpu_testing
