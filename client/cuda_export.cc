#include "client/cuda_export.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "kernels/cuda/cuda_util.h"

namespace kvtier {

static_assert(sizeof(cudaIpcMemHandle_t) == ClientRegionHandle::kCudaIpcHandleBytes);
static_assert(sizeof(cudaIpcEventHandle_t) == std::tuple_size_v<IpcEventHandle>);

Result<std::unique_ptr<CudaExport>> CudaExport::Create(std::span<const CudaKvRegion> regions, uint32_t num_events) {
  std::unique_ptr<CudaExport> e(new CudaExport());
  int device = -1;
  for (size_t i = 0; i < regions.size(); ++i) {
    const CudaKvRegion& r = regions[i];
    const std::string what = "region " + std::to_string(i);
    cudaPointerAttributes attrs{};
    KVTIER_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attrs, r.device_ptr), what + ": cudaPointerGetAttributes");
    if (attrs.type != cudaMemoryTypeDevice) return Err(InvalidArgument(what + ": not device memory"));
    if (device >= 0 && attrs.device != device) {
      return Err(InvalidArgument(what + ": all regions of one cache must be on one device"));
    }
    device = attrs.device;
    KVTIER_ASSIGN_OR_RETURN(const cuda::AllocationRange range, cuda::AllocationOf(r.device_ptr));
    const auto ptr = reinterpret_cast<uint64_t>(r.device_ptr);
    if (r.size_bytes == 0 || ptr - range.base + r.size_bytes > range.size_bytes) {
      return Err(InvalidArgument(what + ": " + std::to_string(r.size_bytes) +
                                 " bytes do not fit in the allocation that holds the pointer"));
    }
    Region out;
    cudaIpcMemHandle_t handle;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(range.base)),
                                what + ": cudaIpcGetMemHandle");
    std::memcpy(out.handle.data(), &handle, sizeof(handle));
    out.offset = ptr - range.base;
    out.size_bytes = r.size_bytes;
    out.device = device;
    cudaDeviceProp prop{};
    KVTIER_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    std::memcpy(out.device_uuid.data(), prop.uuid.bytes, out.device_uuid.size());
    e->regions_.push_back(out);
  }
  if (device < 0) return Err(InvalidArgument("no regions"));
  cuda::ScopedDevice scope(device);
  KVTIER_RETURN_IF_ERROR(scope.status());
  for (uint32_t i = 0; i < num_events; ++i) {
    cudaEvent_t event = nullptr;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventInterprocess | cudaEventDisableTiming),
                                "cudaEventCreate (interprocess)");
    e->events_.push_back(event);
    cudaIpcEventHandle_t handle;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaIpcGetEventHandle(&handle, event), "cudaIpcGetEventHandle");
    std::memcpy(e->event_handles_.emplace_back().data(), &handle, sizeof(handle));
  }
  e->busy_.assign(num_events, false);
  return e;
}

CudaExport::~CudaExport() {
  for (CudaEvent ev : events_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(ev));
}

std::optional<int32_t> CudaExport::AcquireEvent() {
  for (size_t i = 0; i < busy_.size(); ++i) {
    if (!busy_[i]) {
      busy_[i] = true;
      return static_cast<int32_t>(i);
    }
  }
  return std::nullopt;
}

void CudaExport::ReleaseEvent(int32_t slot) { busy_[static_cast<size_t>(slot)] = false; }

Status CudaExport::Record(int32_t slot, CudaStream stream) const {
  KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(event(slot)), static_cast<cudaStream_t>(stream)),
                              "cudaEventRecord on the engine's stream");
  return Status::Ok();
}

Status CudaExport::StreamWait(CudaStream stream, int32_t slot) const {
  KVTIER_CUDA_RETURN_IF_ERROR(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event(slot)), 0),
      "cudaStreamWaitEvent on the engine's stream");
  return Status::Ok();
}

Status CudaExport::Synchronize(CudaStream stream) const {
  KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)),
                              "cudaStreamSynchronize of the engine's stream");
  return Status::Ok();
}

}  // namespace kvtier
