// Helpers for tests with the `gpu` label: they skip, with the reason, where
// no CUDA device is usable (CI has the toolkit but no GPU), and run for real
// on a GPU machine (tools/gpu-check.sh).
//
// Test-only; thread-compatible.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_util.h"

// Skips the current test when there is no usable CUDA device, or fails it
// when KVTIER_REQUIRE_GPU=1 (tools/gpu-check.sh sets it: on a GPU machine, a
// driver too old for the toolkit must not pass as a skip).
#define KVTIER_SKIP_WITHOUT_GPU()                                                              \
  do {                                                                                         \
    if (::kvtier::Result<int> kvtier_gpus_ = ::kvtier::cuda::DeviceCount(); !kvtier_gpus_) {   \
      const char* kvtier_require_ = std::getenv("KVTIER_REQUIRE_GPU");                         \
      if (kvtier_require_ != nullptr && std::string(kvtier_require_) == "1") {                 \
        FAIL() << "KVTIER_REQUIRE_GPU=1, but no GPU is usable: " << kvtier_gpus_.error();     \
      }                                                                                        \
      GTEST_SKIP() << "needs a CUDA GPU, and none is usable here: " << kvtier_gpus_.error();   \
    }                                                                                          \
  } while (0)

// Fails the current test (fatally) on a CUDA error.
#define KVTIER_ASSERT_CUDA(expr) \
  ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

namespace kvtier::gpu_testing {

// Device memory for one test, freed at scope exit.
class DeviceBytes {
 public:
  explicit DeviceBytes(uint64_t size) : size_(size) {
    if (cudaMalloc(&data_, size) != cudaSuccess) data_ = nullptr;
  }
  ~DeviceBytes() {
    if (data_ != nullptr) (void)cudaFree(data_);
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(data_); }
  uint64_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  uint64_t size_;
};

// Pinned, mapped host memory (what kvtier's host pool is), freed at scope exit.
class PinnedBytes {
 public:
  explicit PinnedBytes(uint64_t size) : size_(size) {
    if (cudaHostAlloc(&data_, size, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) data_ = nullptr;
  }
  ~PinnedBytes() {
    if (data_ != nullptr) (void)cudaFreeHost(data_);
  }
  PinnedBytes(const PinnedBytes&) = delete;
  PinnedBytes& operator=(const PinnedBytes&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(data_); }
  uint64_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  uint64_t size_;
};

}  // namespace kvtier::gpu_testing
