#include "kernels/cuda/cuda_util.h"

#include <cuda.h>

#include <cstdio>
#include <utility>

#include "common/check.h"

namespace kvtier::cuda {

bool IsContextLost(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContained:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
      return true;
    default:
      return false;
  }
}

bool IsContextLost(const Status& status) {
  return status.source() == ErrorSource::kCuda && IsContextLost(static_cast<cudaError_t>(status.raw_code()));
}

Status CudaStatus(cudaError_t err, std::string_view what) {
  StatusCode code = IsContextLost(err) ? StatusCode::kUnavailable : StatusCode::kInternal;
  switch (err) {
    case cudaErrorMemoryAllocation:
      code = StatusCode::kResourceExhausted;
      break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorInitializationError:
      code = StatusCode::kUnavailable;
      break;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorMapBufferObjectFailed:
      code = StatusCode::kInvalidArgument;
      break;
    default:
      break;
  }
  std::string message(what);
  message += ": ";
  message += cudaGetErrorName(err);
  message += " (";
  message += cudaGetErrorString(err);
  message += ')';
  return Status(code, std::move(message), ErrorSource::kCuda, static_cast<int>(err));
}

Result<int> DeviceCount() {
  int count = 0;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (count == 0) return Err(Status(StatusCode::kUnavailable, "no CUDA device is visible"));
  return count;
}

ScopedDevice::ScopedDevice(int device) {
  if (cudaError_t err = cudaGetDevice(&previous_); err != cudaSuccess) {
    status_ = CudaStatus(err, "cudaGetDevice");
    previous_ = -1;
    return;
  }
  if (device == previous_) return;
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    status_ = CudaStatus(err, "cudaSetDevice(" + std::to_string(device) + ")");
  }
}

ScopedDevice::~ScopedDevice() {
  if (previous_ >= 0) (void)cudaSetDevice(previous_);
}

Result<DeviceBuffer> DeviceBuffer::Allocate(int device, uint64_t size_bytes) {
  ScopedDevice scope(device);
  KVTIER_RETURN_IF_ERROR(scope.status());
  DeviceBuffer b;
  void* p = nullptr;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, size_bytes),
                              "cudaMalloc of " + std::to_string(size_bytes) + " bytes on device " +
                                  std::to_string(device));
  b.data_ = static_cast<uint8_t*>(p);
  b.size_bytes_ = size_bytes;
  b.device_ = device;
  return b;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)),
      device_(std::exchange(other.device_, -1)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    device_ = std::exchange(other.device_, -1);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() { Reset(); }

void DeviceBuffer::Reset() {
  if (data_ == nullptr) return;
  ScopedDevice scope(device_);
  // cudaFree synchronises with the device; a failure here (a context already
  // torn down at exit) leaves nothing to clean up.
  (void)cudaFree(data_);
  data_ = nullptr;
}

Result<DevicePlan> DevicePlan::Upload(const CopyPlan& plan, int device) {
  const uint64_t bytes = plan.pieces().size() * sizeof(CopyPiece);
  DevicePlan d;
  KVTIER_ASSIGN_OR_RETURN(d.buffer_, DeviceBuffer::Allocate(device, bytes));
  KVTIER_CUDA_RETURN_IF_ERROR(cudaMemcpy(d.buffer_.data(), plan.pieces().data(), bytes, cudaMemcpyHostToDevice),
                              "uploading a copy plan");
  d.count_ = static_cast<uint32_t>(plan.pieces().size());
  d.max_piece_bytes_ = plan.max_piece_bytes();
  return d;
}

namespace {
// A driver entry point by name, at the ABI of CUDA 12.0; null if absent.
void* DriverEntryPoint(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return fn;
}
}  // namespace

Result<AllocationRange> AllocationOf(const void* ptr) {
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const auto get_range = reinterpret_cast<GetAddressRange>(DriverEntryPoint("cuMemGetAddressRange"));
  if (get_range == nullptr) {
    return Err(Status(StatusCode::kUnavailable, "the CUDA driver has no cuMemGetAddressRange"));
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  if (const CUresult r = get_range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)); r != CUDA_SUCCESS) {
    return Err(Status(StatusCode::kInvalidArgument,
                      "cuMemGetAddressRange: the pointer is not in device memory (CUresult " +
                          std::to_string(static_cast<int>(r)) + ")",
                      ErrorSource::kCuda, static_cast<int>(r)));
  }
  return AllocationRange{static_cast<uint64_t>(base), static_cast<uint64_t>(size)};
}


Status StreamWaitValue32(cudaStream_t stream, const void* device_addr, uint32_t value) {
  using WaitValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  static const auto wait = reinterpret_cast<WaitValue32>(DriverEntryPoint("cuStreamWaitValue32"));
  if (wait == nullptr) return Status(StatusCode::kUnavailable, "the CUDA driver has no cuStreamWaitValue32");
  if (const CUresult r = wait(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(device_addr), value,
                              CU_STREAM_WAIT_VALUE_GEQ);
      r != CUDA_SUCCESS) {
    return Status(StatusCode::kInternal, "cuStreamWaitValue32 (CUresult " + std::to_string(static_cast<int>(r)) + ")",
                  ErrorSource::kCuda, static_cast<int>(r));
  }
  return Status::Ok();
}

Status StreamWaitValue64(cudaStream_t stream, const void* device_addr, uint64_t value) {
  using WaitValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  static const auto wait = reinterpret_cast<WaitValue64>(DriverEntryPoint("cuStreamWaitValue64"));
  if (wait == nullptr) return Status(StatusCode::kUnavailable, "the CUDA driver has no cuStreamWaitValue64");
  if (const CUresult r = wait(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(device_addr), value,
                              CU_STREAM_WAIT_VALUE_GEQ);
      r != CUDA_SUCCESS) {
    // CUDA_ERROR_NOT_SUPPORTED: a device without 64-bit stream memory
    // operations (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS).
    return Status(r == CUDA_ERROR_NOT_SUPPORTED ? StatusCode::kUnavailable : StatusCode::kInternal,
                  "cuStreamWaitValue64 (CUresult " + std::to_string(static_cast<int>(r)) + ")", ErrorSource::kCuda,
                  static_cast<int>(r));
  }
  return Status::Ok();
}

Result<std::string> DescribeDevice(int device) {
  cudaDeviceProp prop{};
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device),
                              "cudaGetDeviceProperties(" + std::to_string(device) + ")");
  char buf[384];
  std::snprintf(buf, sizeof(buf), "%s (sm_%d%d, %.1f GiB)", prop.name, prop.major, prop.minor,
                static_cast<double>(prop.totalGlobalMem) / (1ull << 30));
  return std::string(buf);
}

std::string DriverVersion() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess || v == 0) return "none";
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

}  // namespace kvtier::cuda
