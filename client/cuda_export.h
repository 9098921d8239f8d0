// CudaExport: the client's side of a KV cache in GPU memory. It exports each
// region as a CUDA IPC memory handle of the allocation that holds it (plus the
// offset: PyTorch's caching allocator sub-allocates tensors), names the
// device by UUID (ordinals differ between processes with different
// CUDA_VISIBLE_DEVICES), and owns a pool of interprocess events: the daemon
// records one after a load's copies (an engine stream waits for it on the
// GPU), and watches one that the engine recorded after writing the blocks of
// a store. Store completion comes back through a completion page, a memfd
// page shared with the daemon and registered with CUDA: the daemon writes a
// slot's value when the store is over, and a private stream that waits for
// that value (cuStreamWaitValue32) records an ordinary event the engine can
// wait on. If the daemon goes away, the client writes the values itself, so
// no engine stream waits forever.
//
// Built with the real CUDA runtime when libkvtier has CUDA (cuda_export.cc),
// else every call reports kUnimplemented (cuda_export_stub.cc).
//
// Owned by Client::Impl, used under its mutex; thread-compatible. Any thread
// may call: each call makes the cache's device current for its duration.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "common/device_backend.h"
#include "common/memory_mapping.h"
#include "common/unique_fd.h"
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

  // The completion page's memfd, sent with every registration.
  int completion_fd() const { return completion_fd_.get(); }
  // The next value slot `slot`'s store will complete with (never 0).
  uint32_t NextCompletionValue(int32_t slot);
  // An event that completes once the daemon has written `value` into `slot`.
  Result<CudaEvent> CompletionEvent(int32_t slot, uint32_t value);
  // Writes `value` into `slot` as the daemon would (the daemon is gone).
  void Complete(int32_t slot, uint32_t value);

 private:
  CudaExport() = default;
  Status CreateCompletionPage();

  std::vector<Region> regions_;
  // The cache's device: every CUDA call here runs with it current, whatever
  // device the calling thread has (a store from a helper thread must not
  // create a context on device 0 nor record on another device's stream).
  int device_ = -1;
  std::vector<CudaEvent> events_;  // cudaEvent_t, interprocess
  std::vector<IpcEventHandle> event_handles_;
  std::vector<bool> busy_;
  UniqueFd completion_fd_;
  MemoryMapping completion_page_;
  bool completion_registered_ = false;
  // Per slot: a stream that waits for the slot's value and then records the
  // slot's completion event (one stream each, so that stores complete
  // independently of each other).
  std::vector<CudaStream> completion_streams_;
  std::vector<CudaEvent> completion_events_;
  std::vector<uint32_t> completion_values_;  // last value handed out per slot
};

// CudaLayerWaits: GPU streams that wait for loads' layers on the GPU
// (Client::StreamWaitLayers). The client's fence page's progress words are
// registered with CUDA (portable, mapped) once, and a stream waits for a
// word to reach a value (cuStreamWaitValue64) with no host thread waiting.
// After each wait the word's event is recorded on the stream, so that
// teardown waits until every stream has passed its waits (the caller ends
// them first: OpFences::EndLayerWaits) before it unregisters the words.
//
// Built with CUDA in cuda_export.cc; without, Create reports kUnimplemented.
// Owned by Client::Impl, used under its mutex; thread-compatible.
class CudaLayerWaits {
 public:
  // `words`: `count` u64 words, page-aligned, that outlive this object.
  static Result<std::unique_ptr<CudaLayerWaits>> Create(const uint64_t* words, uint32_t count);
  ~CudaLayerWaits();
  CudaLayerWaits(const CudaLayerWaits&) = delete;
  CudaLayerWaits& operator=(const CudaLayerWaits&) = delete;

  // `stream` waits until words[index] reaches `value` (GEQ, wrapping).
  // Errors: kUnavailable where the device has no 64-bit stream memory
  // operations (wait on the host: Client::WaitLayers); CUDA's errors.
  Status Wait(CudaStream stream, uint32_t index, uint64_t value);

 private:
  CudaLayerWaits(const uint64_t* words, uint32_t count);

  const uint64_t* words_;
  uint32_t count_;
  // Per word: the event recorded after its last wait (null before any) and
  // the device it belongs to.
  std::vector<CudaEvent> passed_;
  std::vector<int> passed_device_;
};

}  // namespace kvtier
