// CudaExport: the client's side of a KV cache in GPU memory. It exports each
// region as a CUDA IPC memory handle of the allocation that holds it (plus the
// offset: PyTorch's caching allocator sub-allocates tensors), names the
// device by UUID (ordinals differ between processes with different
// CUDA_VISIBLE_DEVICES), and owns a pool of interprocess events that the
// daemon records after a load's copies, so that an engine stream waits for
// them on the GPU.
//
// Built with the real CUDA runtime when libkvtier has CUDA (cuda_export.cc),
// else every call reports kUnimplemented (cuda_export_stub.cc).
//
// Owned by Client::Impl, used under its mutex; thread-compatible.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "common/device_backend.h"
#include "common/status.h"
#include "kvtier/client.h"

namespace kvtier {

class CudaExport {
 public:
  // One region as the wire carries it.
  struct Region {
    std::array<uint8_t, ClientRegionHandle::kCudaIpcHandleBytes> handle{};
    uint64_t offset = 0;
    uint64_t size_bytes = 0;
    int device = 0;
    std::array<uint8_t, 16> device_uuid{};
  };

  // Errors: kInvalidArgument for a pointer that is not device memory or
  // regions on different devices; kUnimplemented without CUDA.
  static Result<std::unique_ptr<CudaExport>> Create(std::span<const CudaKvRegion> regions, uint32_t num_events);
  ~CudaExport();
  CudaExport(const CudaExport&) = delete;
  CudaExport& operator=(const CudaExport&) = delete;

  const std::vector<Region>& regions() const { return regions_; }
  const std::vector<IpcEventHandle>& event_handles() const { return event_handles_; }

  // A free event slot, or nullopt when all are held by ops not yet waited for.
  std::optional<int32_t> AcquireEvent();
  void ReleaseEvent(int32_t slot);
  CudaEvent event(int32_t slot) const { return events_[static_cast<size_t>(slot)]; }
  // cudaEventRecord(event(slot), stream) / cudaStreamWaitEvent(stream, event(slot)).
  Status Record(int32_t slot, CudaStream stream) const;
  Status StreamWait(CudaStream stream, int32_t slot) const;
  // cudaStreamSynchronize(stream): orders a store when every event is busy.
  Status Synchronize(CudaStream stream) const;

 private:
  CudaExport() = default;
  std::vector<Region> regions_;
  std::vector<CudaEvent> events_;  // cudaEvent_t
  std::vector<IpcEventHandle> event_handles_;
  std::vector<bool> busy_;
};

}  // namespace kvtier
