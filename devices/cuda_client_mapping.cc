// The cuda backend's client side: the IPC memory and event handles clients
// register (opened once, reference counted), their memfds, and the copy
// plans uploaded for their layouts. See cuda_backend_internal.h.
#include <cstring>

#include "devices/cuda_backend_internal.h"
#include "devices/host_backend.h"

namespace kvtier {

// The wire carries CUDA's handles as opaque byte arrays of these sizes.
static_assert(sizeof(cudaIpcMemHandle_t) == ClientRegionHandle::kCudaIpcHandleBytes);
static_assert(sizeof(cudaIpcEventHandle_t) == std::tuple_size_v<IpcEventHandle>);

using cuda::CudaStatus;
using cuda::ScopedDevice;
using cuda_internal::IpcMemKey;
using cuda_internal::RegisterMapped;
using cuda_internal::PlanPieces;
using cuda_internal::StreamOrderedPlan;

Status cuda_internal::RegisterMapped(void* p, uint64_t size_bytes, const std::string& what) {
  KVTIER_CUDA_RETURN_IF_ERROR(cudaHostRegister(p, size_bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
                              what + ": cudaHostRegister");
  void* on_device = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&on_device, p, 0);
  if (err != cudaSuccess || on_device != p) {
    (void)cudaHostUnregister(p);
    (void)cudaGetLastError();
    return err != cudaSuccess ? CudaStatus(err, what + ": cudaHostGetDevicePointer")
                              : Status(StatusCode::kFailedPrecondition,
                                       what + ": mapped at a different device address (no unified addressing)");
  }
  return Status::Ok();
}

namespace {

Status OwnedByAnother(const char* what) {
  return Status(StatusCode::kPermissionDenied,
                std::string(what) + " is registered by another tenant: a tenant registers only its own memory");
}

}  // namespace

Result<CudaBackend::State::OpenedMemory> CudaBackend::State::OpenMemory(const IpcMemKey& key, int device,
                                                                        const std::string& owner) {
  MutexLock lock(&mu);
  if (auto it = opened_memory.find(key); it != opened_memory.end()) {
    if (it->second.owner != owner) return Err(OwnedByAnother("this CUDA allocation"));
    if (it->second.device != device) {
      return Err(InvalidArgument("this allocation is already registered on device " +
                                 std::to_string(it->second.device)));
    }
    ++it->second.refs;
    return it->second;
  }
  ScopedDevice scope(device);
  KVTIER_RETURN_IF_ERROR(scope.status());
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, key.data(), sizeof(handle));
  void* base = nullptr;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess),
                              "cudaIpcOpenMemHandle");
  auto fail = [&](Status st) {
    (void)cudaIpcCloseMemHandle(base);
    (void)cudaGetLastError();  // leave no stale error for the next launch on this thread
    return Err(std::move(st));
  };
  // The allocation must be on the device the client named: kernels for
  // this cache run there.
  cudaPointerAttributes attrs{};
  if (const cudaError_t err = cudaPointerGetAttributes(&attrs, base); err != cudaSuccess) {
    return fail(CudaStatus(err, "cudaPointerGetAttributes of an opened IPC allocation"));
  }
  if (attrs.device != device) {
    return fail(InvalidArgument("the allocation is on device " + std::to_string(attrs.device) +
                                ", not the device " + std::to_string(device) + " the client named"));
  }
  Result<cuda::AllocationRange> range = cuda::AllocationOf(base);
  if (!range) return fail(range.error().WithContext("sizing an opened IPC allocation"));
  if (range->base != reinterpret_cast<uint64_t>(base)) {
    return fail(Internal("an opened IPC allocation does not start at its mapping"));
  }
  OpenedMemory opened{static_cast<uint8_t*>(base), range->size_bytes, device, 1, owner};
  opened_memory.emplace(key, opened);
  return opened;
}

namespace {

// Drops one reference to an opened IPC handle; the last one closes it on its
// device with `close`. REQUIRES: the map's mutex is held.
template <typename Map, typename Close>
void ReleaseOpened(Map& opened, const typename Map::key_type& key, Close close) {
  auto it = opened.find(key);
  KVTIER_CHECK(it != opened.end() && it->second.refs > 0);
  if (--it->second.refs > 0) return;
  ScopedDevice scope(it->second.device);
  close(it->second);
  (void)cudaGetLastError();
  opened.erase(it);
}

}  // namespace

void CudaBackend::State::ReleaseMemory(const IpcMemKey& key) {
  MutexLock lock(&mu);
  ReleaseOpened(opened_memory, key, [](const OpenedMemory& m) { (void)cudaIpcCloseMemHandle(m.base); });
}

Result<cudaEvent_t> CudaBackend::State::OpenEvent(const IpcEventHandle& key, int device, const std::string& owner) {
  MutexLock lock(&mu);
  if (auto it = opened_events.find(key); it != opened_events.end()) {
    if (it->second.owner != owner) return Err(OwnedByAnother("this CUDA event"));
    if (it->second.device != device) return Err(InvalidArgument("an event registered on another device"));
    ++it->second.refs;
    return it->second.event;
  }
  ScopedDevice scope(device);
  KVTIER_RETURN_IF_ERROR(scope.status());
  cudaIpcEventHandle_t handle;
  std::memcpy(&handle, key.data(), sizeof(handle));
  cudaEvent_t event = nullptr;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaIpcOpenEventHandle(&event, handle), "cudaIpcOpenEventHandle");
  opened_events.emplace(key, OpenedEvent{event, device, 1, owner});
  return event;
}

void CudaBackend::State::ReleaseEvent(const IpcEventHandle& key) {
  MutexLock lock(&mu);
  ReleaseOpened(opened_events, key, [](const OpenedEvent& e) { (void)cudaEventDestroy(e.event); });
}

CudaClientMapping::CudaClientMapping(std::shared_ptr<CudaBackend::State> state) : state_(std::move(state)) {
  state_->live_mappings.fetch_add(1, std::memory_order_relaxed);  // a statistic
}

CudaClientMapping::~CudaClientMapping() {
  // Closing IPC handles and unregistering memory may wait for the device:
  // not on the caller's thread (the daemon's event loop, or a lane).
  struct Held {
    std::vector<UploadedPlan> plans;
    std::vector<IpcEventHandle> events;
    std::vector<IpcMemKey> memory;
    std::vector<MemoryMapping> memfds;
  };
  std::shared_ptr<Held> held;
  {
    MutexLock lock(&mu_);
    held = std::make_shared<Held>(Held{std::move(plans_), std::move(event_keys_), std::move(memory_keys_),
                                       std::move(memfds_)});
  }
  state_->Reap([state = state_, held = std::move(held)] {
    held->plans.clear();
    for (const IpcEventHandle& e : held->events) state->ReleaseEvent(e);
    for (const IpcMemKey& k : held->memory) state->ReleaseMemory(k);
    for (const MemoryMapping& m : held->memfds) (void)cudaHostUnregister(m.data());
    (void)cudaGetLastError();
    held->memfds.clear();
    state->live_mappings.fetch_sub(1, std::memory_order_relaxed);
  });
}

Status CudaClientMapping::Open(std::vector<ClientRegionHandle> regions, std::vector<IpcEventHandle> events) {
  const CudaBackend::State& s = *state_;
  for (size_t i = 0; i < regions.size(); ++i) {
    ClientRegionHandle& r = regions[i];
    const std::string what = "region " + std::to_string(i);
    if (r.size_bytes == 0) return InvalidArgument(what + ": size is 0");
    if (i > 0 && (r.kind == ClientMemoryKind::kCudaIpc) != on_device_) {
      return InvalidArgument(what + ": one cache's regions must be all device memory or all memfds");
    }
    if (r.kind == ClientMemoryKind::kHostMemfd) {
      KVTIER_RETURN_IF_ERROR(OpenMemfd(r, what));
      continue;
    }
    if (r.kind != ClientMemoryKind::kCudaIpc) return InvalidArgument(what + ": unknown memory kind");
    if (r.has_device_uuid) {
      // The client's ordinal depends on its CUDA_VISIBLE_DEVICES; the UUID does not.
      const auto u = std::find(s.uuids.begin(), s.uuids.end(), r.device_uuid);
      if (u == s.uuids.end()) return InvalidArgument(what + ": its GPU (by UUID) is not one this daemon uses");
      r.device = s.devices[static_cast<size_t>(u - s.uuids.begin())];
    }
    if (std::find(s.devices.begin(), s.devices.end(), r.device) == s.devices.end()) {
      return InvalidArgument(what + ": device " + std::to_string(r.device) + " is not one this daemon uses");
    }
    if (on_device_ && r.device != device_) {
      return InvalidArgument(what + ": all regions of one cache must be on one device");
    }
    on_device_ = true;
    device_ = r.device;
    KVTIER_ASSIGN_OR_RETURN(const CudaBackend::State::OpenedMemory opened,
                            state_->OpenMemory(r.cuda_ipc_handle, r.device, r.owner));
    memory_keys_.push_back(r.cuda_ipc_handle);
    uint64_t end = 0;
    if (__builtin_add_overflow(r.cuda_offset, r.size_bytes, &end) || end > opened.size_bytes) {
      return InvalidArgument(what + ": offset " + std::to_string(r.cuda_offset) + " + size " +
                             std::to_string(r.size_bytes) + " is beyond the exported allocation's " +
                             std::to_string(opened.size_bytes) + " bytes");
    }
    bases_.push_back(opened.base + r.cuda_offset);
  }
  if (!on_device_) device_ = s.devices.front();
  if (!events.empty() && !on_device_) {
    return InvalidArgument("CUDA IPC events need a cache in device memory, not memfds");
  }
  for (const IpcEventHandle& e : events) {
    KVTIER_ASSIGN_OR_RETURN(cudaEvent_t event, state_->OpenEvent(e, device_, regions.front().owner));
    event_keys_.push_back(e);
    events_.push_back(event);
  }
  return Status::Ok();
}

Result<PlanPieces> CudaClientMapping::PlanFor(const std::shared_ptr<const KvCacheLayout>& layout, int device,
                                              bool by_layer) {
  MutexLock lock(&mu_);
  for (const UploadedPlan& p : plans_) {
    if (p.layout == layout && p.device == device && p.by_layer == by_layer) return p.plan.pieces();
  }
  KVTIER_ASSIGN_OR_RETURN(StreamOrderedPlan plan,
                          StreamOrderedPlan::Upload(CopyPlan::Build(*layout, MappedRegions{bases_}, by_layer),
                                                    device, state_->setup_streams[state_->IndexOf(device)]));
  plans_.push_back(UploadedPlan{layout, device, by_layer, std::move(plan)});
  return plans_.back().plan.pieces();
}

Status CudaClientMapping::OpenMemfd(const ClientRegionHandle& r, const std::string& what) {
  KVTIER_ASSIGN_OR_RETURN(MemoryMapping m, HostBackend::MapSealedMemfd(r, what));
  // Registered (mapped, every device) so that a kernel can copy between
  // the CPU engine's memory and the hbm tier.
  ScopedDevice scope(state_->devices.front());
  KVTIER_RETURN_IF_ERROR(scope.status());
  KVTIER_RETURN_IF_ERROR(RegisterMapped(m.data(), m.size_bytes(), what));
  bases_.push_back(m.data());
  memfds_.push_back(std::move(m));
  return Status::Ok();
}

}  // namespace kvtier
