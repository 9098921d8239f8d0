// Small CUDA runtime helpers shared by the cuda backend, the client library,
// the GPU tests and kvtier-bench: errors as Status (keeping the cudaError_t),
// the current device for a scope, owned device memory, a CopyPlan uploaded to
// one device, and the driver's allocation range of a pointer.
//
// Built only with the CUDA toolkit (KVTIER_HAVE_CUDA). Thread-safe where the
// CUDA runtime is; each object is owned by one caller.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "kernels/copy_plan.h"
#include "kernels/cuda/copy_kernels.h"

namespace kvtier::cuda {

// "what: cudaErrorMemoryAllocation (out of memory)", source kCuda, raw code
// the cudaError_t. Codes: kResourceExhausted for allocation failures,
// kUnavailable for no device or driver and for a lost context
// (IsContextLost), kInvalidArgument for invalid values and handles,
// kInternal otherwise.
Status CudaStatus(cudaError_t err, std::string_view what);

// Whether `err` is sticky: a fault on the device (an illegal address, a
// kernel's trap or assert, an uncorrectable ECC error, ...) that leaves the
// process's CUDA context unusable, so that every later call of the process
// on that device fails with it. cudaGetLastError does not clear it; only a
// new process gets a working context. (The CUDA runtime API's reference
// says so of each of these codes.)
bool IsContextLost(cudaError_t err);
// The same for a Status made by CudaStatus (false for any other).
bool IsContextLost(const Status& status);

#define KVTIER_CUDA_RETURN_IF_ERROR(expr, what)                              \
  do {                                                                       \
    if (const cudaError_t kvtier_cuda_err_ = (expr); kvtier_cuda_err_ != cudaSuccess) \
      return ::tl::unexpected<::kvtier::Status>(::kvtier::cuda::CudaStatus(kvtier_cuda_err_, what)); \
  } while (0)

// Number of usable devices; an error says why there are none (no driver, no
// device), for tests that skip and daemons that refuse the cuda backend.
Result<int> DeviceCount();

// Makes `device` current for this thread until destruction, then restores
// the previous one.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  Status status() const { return status_; }

 private:
  int previous_ = -1;
  Status status_;
};

// cudaMalloc'd bytes on one device, freed on destruction.
class DeviceBuffer {
 public:
  static Result<DeviceBuffer> Allocate(int device, uint64_t size_bytes);
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  ~DeviceBuffer();

  uint8_t* data() const { return data_; }
  uint64_t size_bytes() const { return size_bytes_; }
  int device() const { return device_; }

 private:
  void Reset();
  uint8_t* data_ = nullptr;
  uint64_t size_bytes_ = 0;
  int device_ = -1;
};

// A CopyPlan's pieces in device memory, ready for LaunchGather/LaunchScatter.
class DevicePlan {
 public:
  static Result<DevicePlan> Upload(const CopyPlan& plan, int device);
  DevicePieces pieces() const {
    return DevicePieces{reinterpret_cast<const CopyPiece*>(buffer_.data()), count_, max_piece_bytes_};
  }

 private:
  DeviceBuffer buffer_;
  uint32_t count_ = 0;
  uint64_t max_piece_bytes_ = 0;
};

// The allocation that contains `ptr` (cuMemGetAddressRange through the
// runtime's driver entry point, so nothing links libcuda): its base and size.
// PyTorch sub-allocates, so an engine tensor is an offset into a larger
// allocation, and that allocation is what a CUDA IPC handle names.
struct AllocationRange {
  uint64_t base = 0;
  uint64_t size_bytes = 0;
};
Result<AllocationRange> AllocationOf(const void* ptr);

// cuStreamWaitValue32(stream, device_addr, value, CU_STREAM_WAIT_VALUE_GEQ)
// through the runtime's driver entry point: `stream` waits until the u32 at
// `device_addr` (mapped host memory) reaches `value` (wrapping compare).
Status StreamWaitValue32(cudaStream_t stream, const void* device_addr, uint32_t value);
// The same for a u64 (cuStreamWaitValue64); kUnavailable where the device
// has no 64-bit stream memory operations.
Status StreamWaitValue64(cudaStream_t stream, const void* device_addr, uint64_t value);

// "NVIDIA H200 (sm_90, 139.8 GiB)" for a device, and the driver's version.
Result<std::string> DescribeDevice(int device);
std::string DriverVersion();

}  // namespace kvtier::cuda
