// KVTIER_HOST_DEVICE: a function the CUDA kernels and the CPU share (their
// per-thread bodies, the element conversions): host-and-device code, inlined,
// under nvcc; a plain inline function elsewhere.
#pragma once

#if defined(__CUDACC__)
#define KVTIER_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVTIER_HOST_DEVICE inline
#endif
