#include "client/cuda_export.h"

#include <cuda_runtime_api.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <optional>

#include "client/sealed_memfd.h"
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
  e->device_ = device;
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
  KVTIER_RETURN_IF_ERROR(e->CreateCompletionPage());
  return e;
}

Status CudaExport::CreateCompletionPage() {
  constexpr size_t kPageBytes = 4096;  // CompletionPage::kBytes in the daemon
  KVTIER_ASSIGN_OR_RETURN(completion_fd_, NewSealedMemfd("kvtier-completions", kPageBytes, F_SEAL_GROW));
  KVTIER_ASSIGN_OR_RETURN(completion_page_, MemoryMapping::Map(MemoryMapping::Options{
                                                .size_bytes = kPageBytes,
                                                .prot = PROT_READ | PROT_WRITE,
                                                .flags = MAP_SHARED,
                                                .fd = completion_fd_.get()}));
  // Portable: pinned for every context, not only the one current now.
  KVTIER_CUDA_RETURN_IF_ERROR(
      cudaHostRegister(completion_page_.data(), kPageBytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
      "cudaHostRegister of the completion page");
  completion_registered_ = true;
  for (size_t i = 0; i < events_.size(); ++i) {
    cudaStream_t stream = nullptr;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    completion_streams_.push_back(stream);
    cudaEvent_t ev = nullptr;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    completion_events_.push_back(ev);
  }
  completion_values_.assign(events_.size(), 0);
  return Status::Ok();
}

uint32_t CudaExport::NextCompletionValue(int32_t slot) {
  uint32_t& v = completion_values_[static_cast<size_t>(slot)];
  if (++v == 0) ++v;  // 0 is the page's initial value
  return v;
}

Result<CudaEvent> CudaExport::CompletionEvent(int32_t slot, uint32_t value) {
  cuda::ScopedDevice scope(device_);
  KVTIER_RETURN_IF_ERROR(scope.status());
  void* device_ptr = nullptr;
  uint8_t* host = completion_page_.data() + sizeof(uint32_t) * static_cast<size_t>(slot);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device_ptr, host, 0), "cudaHostGetDevicePointer");
  auto stream = static_cast<cudaStream_t>(completion_streams_[static_cast<size_t>(slot)]);
  KVTIER_RETURN_IF_ERROR(cuda::StreamWaitValue32(stream, device_ptr, value));
  auto ev = static_cast<cudaEvent_t>(completion_events_[static_cast<size_t>(slot)]);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev, stream), "cudaEventRecord of a store's completion");
  return CudaEvent{ev};
}

void CudaExport::Complete(int32_t slot, uint32_t value) {
  auto* page = reinterpret_cast<uint32_t*>(completion_page_.data());
  std::atomic_ref<uint32_t>(page[slot]).store(value, std::memory_order_release);
}

CudaExport::~CudaExport() {
  std::optional<cuda::ScopedDevice> scope;
  if (device_ >= 0) scope.emplace(device_);
  // Release every wait first (values only grow), then tear down.
  for (size_t i = 0; i < completion_values_.size(); ++i) Complete(static_cast<int32_t>(i), completion_values_[i]);
  for (CudaStream stream : completion_streams_) {
    (void)cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
    (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream));
  }
  for (CudaEvent ev : completion_events_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(ev));
  if (completion_registered_) (void)cudaHostUnregister(completion_page_.data());
  for (CudaEvent ev : events_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(ev));
}

CudaLayerWaits::CudaLayerWaits(const uint64_t* words, uint32_t count)
    : words_(words), count_(count), passed_(count, nullptr), passed_device_(count, -1) {}

Result<std::unique_ptr<CudaLayerWaits>> CudaLayerWaits::Create(const uint64_t* words, uint32_t count) {
  std::unique_ptr<CudaLayerWaits> w(new CudaLayerWaits(words, count));
  // Portable: mapped for every device's context, whichever stream waits.
  KVTIER_CUDA_RETURN_IF_ERROR(cudaHostRegister(const_cast<uint64_t*>(words), count * sizeof(uint64_t),
                                               cudaHostRegisterPortable | cudaHostRegisterMapped),
                              "cudaHostRegister of the fence page's progress words");
  return w;
}

Status CudaLayerWaits::Wait(CudaStream stream, uint32_t index, uint64_t value) {
  if (index >= count_) return InvalidArgument("progress word " + std::to_string(index) + " out of range");
  auto s = static_cast<cudaStream_t>(stream);
  int device = -1;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamGetDevice(s, &device), "cudaStreamGetDevice");
  cuda::ScopedDevice scope(device);
  KVTIER_RETURN_IF_ERROR(scope.status());
  void* device_ptr = nullptr;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device_ptr, const_cast<uint64_t*>(words_ + index), 0),
                              "cudaHostGetDevicePointer");
  KVTIER_RETURN_IF_ERROR(cuda::StreamWaitValue64(s, device_ptr, value));
  auto& passed = passed_[index];
  if (passed != nullptr && passed_device_[index] != device) {
    (void)cudaEventSynchronize(static_cast<cudaEvent_t>(passed));  // another device's stream's wait, passed first
    (void)cudaEventDestroy(static_cast<cudaEvent_t>(passed));
    passed = nullptr;
  }
  if (passed == nullptr) {
    cudaEvent_t event = nullptr;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    passed = event;
    passed_device_[index] = device;
  }
  KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(passed), s),
                              "cudaEventRecord after a layer wait");
  return Status::Ok();
}

CudaLayerWaits::~CudaLayerWaits() {
  for (uint32_t i = 0; i < count_; ++i) {
    if (passed_[i] == nullptr) continue;
    cuda::ScopedDevice scope(passed_device_[i]);
    // Every wait's word has passed its value (the owner ended the waits):
    // once the event is reached, no stream reads the words any more.
    (void)cudaEventSynchronize(static_cast<cudaEvent_t>(passed_[i]));
    (void)cudaEventDestroy(static_cast<cudaEvent_t>(passed_[i]));
  }
  (void)cudaHostUnregister(const_cast<uint64_t*>(words_));
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
  cuda::ScopedDevice scope(device_);
  KVTIER_RETURN_IF_ERROR(scope.status());
  KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(event(slot)), static_cast<cudaStream_t>(stream)),
                              "cudaEventRecord on the engine's stream");
  return Status::Ok();
}

Status CudaExport::StreamWait(CudaStream stream, int32_t slot) const {
  cuda::ScopedDevice scope(device_);
  KVTIER_RETURN_IF_ERROR(scope.status());
  KVTIER_CUDA_RETURN_IF_ERROR(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event(slot)), 0),
      "cudaStreamWaitEvent on the engine's stream");
  return Status::Ok();
}

Status CudaExport::Synchronize(CudaStream stream) const {
  cuda::ScopedDevice scope(device_);
  KVTIER_RETURN_IF_ERROR(scope.status());
  KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)),
                              "cudaStreamSynchronize of the engine's stream");
  return Status::Ok();
}

}  // namespace kvtier
