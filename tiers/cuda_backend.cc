#include "tiers/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "common/check.h"
#include "common/memory_mapping.h"
#include "common/mutex.h"
#include "kernels/copy_reference.h"
#include "kernels/cuda/copy_kernels.h"
#include "kernels/cuda/cuda_util.h"
#include "tiers/host_backend.h"

namespace kvtier {

// The wire carries CUDA's handles as opaque byte arrays of these sizes.
static_assert(sizeof(cudaIpcMemHandle_t) == ClientRegionHandle::kCudaIpcHandleBytes);
static_assert(sizeof(cudaIpcEventHandle_t) == std::tuple_size_v<IpcEventHandle>);

namespace {

using cuda::CudaStatus;
using cuda::ScopedDevice;
using IpcMemKey = std::array<uint8_t, ClientRegionHandle::kCudaIpcHandleBytes>;

// A batch on its way through a lane.
struct Pending {
  cudaEvent_t event = nullptr;  // recorded after the batch's work; null if nothing was queued
  Status status;                // an error while queueing
  bool on_cpu = false;          // host memory on both sides: copied by the CPU reference
  CopyBatch batch;
  CopyDone done;
  // With checksum_destination: each destination, or null where it is device memory.
  std::vector<std::pair<const uint8_t*, uint64_t>> checksum_of;
};

// One stream and the thread that completes its batches, in stream order.
struct Lane {
  int device = 0;
  cudaStream_t stream = nullptr;
  Mutex mu;
  CondVar cv;
  std::deque<Pending> queue KVTIER_GUARDED_BY(mu);
  bool stopping KVTIER_GUARDED_BY(mu) = false;
  std::thread thread;
};

// A store waiting, on the watcher thread, for the engine's record of its event.
struct WaitingStore {
  Pending pending;
  int device = 0;
  cudaEvent_t event = nullptr;
  std::chrono::steady_clock::time_point deadline;
};

}  // namespace

class CudaClientMapping;

struct CudaBackend::State {
  std::vector<int> devices;
  std::vector<std::array<uint8_t, 16>> uuids;  // of each device, in order
  std::vector<std::vector<bool>> peer;          // [i][j]: device i's kernels reach device j's memory
  std::vector<cudaStream_t> setup_streams;      // per device: plan uploads and frees
  std::string description;
  std::vector<std::unique_ptr<Lane>> lanes;  // devices.size() x kNumCopyPriorities
  std::atomic<uint64_t> live_mappings{0};

  struct Range {
    uint64_t begin = 0;
    uint64_t end = 0;
    int device = 0;
  };
  struct OpenedMemory {
    uint8_t* base = nullptr;
    uint64_t size_bytes = 0;
    int device = 0;
    uint32_t refs = 0;
  };
  struct OpenedEvent {
    cudaEvent_t event = nullptr;
    int device = 0;
    uint32_t refs = 0;
  };
  Mutex mu;
  std::vector<Range> device_arenas KVTIER_GUARDED_BY(mu);
  std::map<IpcMemKey, OpenedMemory> opened_memory KVTIER_GUARDED_BY(mu);
  std::map<IpcEventHandle, OpenedEvent> opened_events KVTIER_GUARDED_BY(mu);

  // Stores waiting for their engine's event (watcher thread).
  Mutex watch_mu;
  CondVar watch_cv;
  std::deque<WaitingStore> arriving KVTIER_GUARDED_BY(watch_mu);
  bool watch_stopping KVTIER_GUARDED_BY(watch_mu) = false;

  // Teardown work of released mappings (reaper thread), while the backend lives.
  Mutex reap_mu;
  CondVar reap_cv;
  std::deque<std::function<void()>> reap_queue KVTIER_GUARDED_BY(reap_mu);
  bool reaper_running KVTIER_GUARDED_BY(reap_mu) = false;

  size_t IndexOf(int device) const {
    const auto d = std::find(devices.begin(), devices.end(), device);
    KVTIER_CHECK(d != devices.end());
    return static_cast<size_t>(d - devices.begin());
  }

  Lane& LaneFor(int device, CopyPriority priority) {
    return *lanes[IndexOf(device) * kNumCopyPriorities + static_cast<size_t>(priority)];
  }

  // The device whose hbm arena holds `p`, if any (else it is host memory).
  std::optional<int> DeviceOf(const void* p) {
    const auto a = reinterpret_cast<uint64_t>(p);
    MutexLock lock(&mu);
    for (const Range& r : device_arenas) {
      if (a >= r.begin && a < r.end) return r.device;
    }
    return std::nullopt;
  }

  // Runs `work` on the reaper thread, or here once the backend is gone.
  void Reap(std::function<void()> work) {
    {
      MutexLock lock(&reap_mu);
      if (reaper_running) {
        reap_queue.push_back(std::move(work));
        reap_cv.Signal();
        return;
      }
    }
    work();
  }

  // Opens an IPC memory handle on `device`, or shares the one already open.
  Result<OpenedMemory> OpenMemory(const IpcMemKey& key, int device) {
    MutexLock lock(&mu);
    if (auto it = opened_memory.find(key); it != opened_memory.end()) {
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
    OpenedMemory opened{static_cast<uint8_t*>(base), range->size_bytes, device, 1};
    opened_memory.emplace(key, opened);
    return opened;
  }

  void ReleaseMemory(const IpcMemKey& key) {
    MutexLock lock(&mu);
    auto it = opened_memory.find(key);
    KVTIER_CHECK(it != opened_memory.end() && it->second.refs > 0);
    if (--it->second.refs > 0) return;
    ScopedDevice scope(it->second.device);
    (void)cudaIpcCloseMemHandle(it->second.base);
    (void)cudaGetLastError();
    opened_memory.erase(it);
  }

  Result<cudaEvent_t> OpenEvent(const IpcEventHandle& key, int device) {
    MutexLock lock(&mu);
    if (auto it = opened_events.find(key); it != opened_events.end()) {
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
    opened_events.emplace(key, OpenedEvent{event, device, 1});
    return event;
  }

  void ReleaseEvent(const IpcEventHandle& key) {
    MutexLock lock(&mu);
    auto it = opened_events.find(key);
    KVTIER_CHECK(it != opened_events.end() && it->second.refs > 0);
    if (--it->second.refs > 0) return;
    ScopedDevice scope(it->second.device);
    (void)cudaEventDestroy(it->second.event);
    (void)cudaGetLastError();
    opened_events.erase(it);
  }
};

namespace {

class DeviceArena final : public Arena {
 public:
  DeviceArena(cuda::DeviceBuffer buffer, std::shared_ptr<CudaBackend::State> state)
      : buffer_(std::move(buffer)), state_(std::move(state)) {}
  ~DeviceArena() override {
    MutexLock lock(&state_->mu);
    std::erase_if(state_->device_arenas, [this](const auto& r) { return r.begin == Begin(); });
  }
  uint8_t* data() const override { return buffer_.data(); }
  uint64_t size_bytes() const override { return buffer_.size_bytes(); }
  uint64_t Begin() const { return reinterpret_cast<uint64_t>(buffer_.data()); }

 private:
  cuda::DeviceBuffer buffer_;
  std::shared_ptr<CudaBackend::State> state_;
};

// Anonymous memory registered with CUDA (pinned, mapped for every device),
// not cudaHostAlloc'd: ordinary pages are what O_DIRECT and io_uring's fixed
// buffers can pin too, so the disk tier reads and writes the same slots.
class PinnedArena final : public Arena {
 public:
  explicit PinnedArena(MemoryMapping mapping) : mapping_(std::move(mapping)) {}
  ~PinnedArena() override {
    if (registered_) (void)cudaHostUnregister(mapping_.data());
  }
  Status Register() {
    // Transparent huge pages where the kernel allows: fewer pages to pin and
    // map. Only advice; 4 KiB pages work too.
    (void)::madvise(mapping_.data(), mapping_.size_bytes(), MADV_HUGEPAGE);
    KVTIER_CUDA_RETURN_IF_ERROR(cudaHostRegister(mapping_.data(), mapping_.size_bytes(),
                                                 cudaHostRegisterMapped | cudaHostRegisterPortable),
                                "cudaHostRegister of the " + std::to_string(mapping_.size_bytes()) +
                                    "-byte host pool");
    registered_ = true;
    // Kernels use the host address as is: that needs unified addressing.
    void* on_device = nullptr;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&on_device, mapping_.data(), 0),
                                "cudaHostGetDevicePointer");
    if (on_device != mapping_.data()) {
      return Status(StatusCode::kFailedPrecondition,
                    "pinned host memory is mapped at a different device address (no unified addressing)");
    }
    return Status::Ok();
  }
  uint8_t* data() const override { return mapping_.data(); }
  uint64_t size_bytes() const override { return mapping_.size_bytes(); }

 private:
  MemoryMapping mapping_;
  bool registered_ = false;
};

// A copy plan in the memory of one device, allocated and freed in stream
// order on that device's setup stream, so that releasing it never waits for
// the device.
class StreamOrderedPlan {
 public:
  static Result<StreamOrderedPlan> Upload(const CopyPlan& plan, int device, cudaStream_t stream) {
    ScopedDevice scope(device);
    KVTIER_RETURN_IF_ERROR(scope.status());
    StreamOrderedPlan p;
    p.stream_ = stream;
    p.device_ = device;
    const uint64_t bytes = plan.pieces().size() * sizeof(CopyPiece);
    void* d = nullptr;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&d, bytes, stream), "cudaMallocAsync of a copy plan");
    p.pieces_ = DevicePieces(static_cast<CopyPiece*>(d), plan);
    KVTIER_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d, plan.pieces().data(), bytes, cudaMemcpyHostToDevice, stream),
                                "uploading a copy plan");
    // Kernels on other streams use it next: wait for this small copy only.
    KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "uploading a copy plan");
    return p;
  }
  StreamOrderedPlan() = default;
  StreamOrderedPlan(StreamOrderedPlan&& o) noexcept
      : pieces_(std::exchange(o.pieces_, {})), stream_(o.stream_), device_(o.device_) {}
  StreamOrderedPlan& operator=(StreamOrderedPlan&&) = delete;
  ~StreamOrderedPlan() {
    if (pieces_.pieces == nullptr) return;
    // Every kernel that read it has completed: the batches hold the mapping
    // that holds this plan until their completion event.
    ScopedDevice scope(device_);
    (void)cudaFreeAsync(const_cast<CopyPiece*>(pieces_.pieces), stream_);
    (void)cudaGetLastError();
  }
  cuda::DevicePieces pieces() const { return pieces_; }

 private:
  static cuda::DevicePieces DevicePieces(const CopyPiece* p, const CopyPlan& plan) {
    return cuda::DevicePieces{p, static_cast<uint32_t>(plan.pieces().size()), plan.max_piece_bytes()};
  }
  cuda::DevicePieces pieces_{};
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
};

}  // namespace

// A client's registration: its IPC allocations (or registered memfds) and
// events, and the copy plans uploaded for its layouts.
class CudaClientMapping final : public ClientMapping {
 public:
  explicit CudaClientMapping(std::shared_ptr<CudaBackend::State> state) : state_(std::move(state)) {
    state_->live_mappings.fetch_add(1, std::memory_order_relaxed);  // a statistic
  }

  ~CudaClientMapping() override {
    // Closing IPC handles and unregistering memory may wait for the device:
    // not on the caller's thread (the daemon's event loop, or a lane).
    struct Held {
      std::vector<std::tuple<std::shared_ptr<const KvCacheLayout>, int, StreamOrderedPlan>> plans;
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

  std::span<uint8_t* const> region_bases() const override { return bases_; }
  uint32_t num_events() const override { return static_cast<uint32_t>(events_.size()); }

  // Builds the mapping. Errors as CudaBackend::MapClientMemory.
  Status Open(std::vector<ClientRegionHandle> regions, std::vector<IpcEventHandle> events) {
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
                              state_->OpenMemory(r.cuda_ipc_handle, r.device));
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
      KVTIER_ASSIGN_OR_RETURN(cudaEvent_t event, state_->OpenEvent(e, device_));
      event_keys_.push_back(e);
      events_.push_back(event);
    }
    return Status::Ok();
  }

  // The engine's GPU (IPC caches); for memfd caches, the first device.
  int device() const { return device_; }
  bool on_device() const { return on_device_; }
  cudaEvent_t event(int32_t i) const {
    KVTIER_CHECK(i >= 0 && static_cast<size_t>(i) < events_.size());
    return events_[static_cast<size_t>(i)];
  }

  // The copy plan of `layout` over this mapping, in the memory of the device
  // that launches the copy (uploaded on first use; a registration has one
  // layout and its kernels run on one or two devices, so this is a tiny list).
  Result<cuda::DevicePieces> PlanFor(const std::shared_ptr<const KvCacheLayout>& layout, int device) {
    MutexLock lock(&mu_);
    for (const auto& [l, d, plan] : plans_) {
      if (l == layout && d == device) return plan.pieces();
    }
    KVTIER_ASSIGN_OR_RETURN(StreamOrderedPlan plan,
                            StreamOrderedPlan::Upload(CopyPlan::Build(*layout, MappedRegions{bases_}), device,
                                                      state_->setup_streams[state_->IndexOf(device)]));
    plans_.emplace_back(layout, device, std::move(plan));
    return std::get<2>(plans_.back()).pieces();
  }

 private:
  Status OpenMemfd(const ClientRegionHandle& r, const std::string& what) {
    KVTIER_ASSIGN_OR_RETURN(MemoryMapping m, HostBackend::MapSealedMemfd(r, what));
    // Registered (mapped, every device) so that a kernel can copy between
    // the CPU engine's memory and the hbm tier.
    ScopedDevice scope(state_->devices.front());
    KVTIER_RETURN_IF_ERROR(scope.status());
    KVTIER_CUDA_RETURN_IF_ERROR(
        cudaHostRegister(m.data(), m.size_bytes(), cudaHostRegisterMapped | cudaHostRegisterPortable),
        what + ": cudaHostRegister");
    void* on_device = nullptr;
    const cudaError_t err = cudaHostGetDevicePointer(&on_device, m.data(), 0);
    if (err != cudaSuccess || on_device != m.data()) {
      (void)cudaHostUnregister(m.data());
      (void)cudaGetLastError();
      return err != cudaSuccess ? CudaStatus(err, what + ": cudaHostGetDevicePointer")
                                : Status(StatusCode::kFailedPrecondition,
                                         what + ": registered memory has another device address");
    }
    bases_.push_back(m.data());
    memfds_.push_back(std::move(m));
    return Status::Ok();
  }

  std::shared_ptr<CudaBackend::State> state_;
  bool on_device_ = false;
  int device_ = -1;
  std::vector<uint8_t*> bases_;
  std::vector<IpcMemKey> memory_keys_;
  std::vector<MemoryMapping> memfds_;
  std::vector<IpcEventHandle> event_keys_;
  std::vector<cudaEvent_t> events_;
  Mutex mu_;
  std::vector<std::tuple<std::shared_ptr<const KvCacheLayout>, int, StreamOrderedPlan>> plans_
      KVTIER_GUARDED_BY(mu_);
};

namespace {

// Runs a batch whose memory is all on the host with the CPU reference.
CopyResult CopyOnCpu(const CopyBatch& c) {
  CopyResult r;
  const bool engine = c.direction != CopyDirection::kSlotToSlot;
  if (engine) {
    const CopyPlan plan = CopyPlan::Build(*c.layout, MappedRegions{c.mapping->region_bases()});
    for (const BlockCopy& b : c.blocks) {
      if (c.direction == CopyDirection::kSlotToEngine) {
        ScatterBlock(plan, b.engine_block, b.slot);
      } else if (c.checksum_destination) {
        GatherBlock(plan, b.engine_block, b.slot, &r.checksums.emplace_back());
      } else {
        GatherBlock(plan, b.engine_block, b.slot);
      }
    }
    return r;
  }
  for (const SlotCopy& sc : c.slot_copies) {
    if (c.checksum_destination) {
      r.checksums.push_back(CopyWithChecksum(sc.dst, sc.src, sc.size_bytes));
    } else {
      std::memcpy(sc.dst, sc.src, sc.size_bytes);
    }
  }
  return r;
}

// Finishes a batch on a backend thread: checksums, then `done`, after letting
// go of the client's mapping (as the host backend does).
void Finish(Pending p, Status status) {
  CopyResult result{.status = std::move(status)};
  if (result.status.ok()) {
    if (p.on_cpu) {
      result = CopyOnCpu(p.batch);
    } else if (p.batch.checksum_destination) {
      for (const auto& [dst, size] : p.checksum_of) result.checksums.push_back(dst ? ChecksumOf(dst, size) : 0);
    }
  }
  p.batch = CopyBatch{};
  p.done(std::move(result));
}

void CompleteLoop(Lane* lane) {
  while (true) {
    Pending p;
    {
      MutexLock lock(&lane->mu);
      while (lane->queue.empty() && !lane->stopping) lane->cv.Wait(&lane->mu);
      if (lane->queue.empty()) return;  // stopping, and drained
      p = std::move(lane->queue.front());
      lane->queue.pop_front();
    }
    Status status = p.status;
    if (p.event != nullptr) {
      if (const cudaError_t err = cudaEventSynchronize(p.event); err != cudaSuccess && status.ok()) {
        status = CudaStatus(err, "copy batch");
      }
      (void)cudaEventDestroy(p.event);
    }
    Finish(std::move(p), std::move(status));
  }
}

// Queues a batch's copies on its lane (or, for a CPU batch, just its
// place in the lane's order). Returns whether everything was queued.
bool Enqueue(CudaBackend::State& s, Pending p, int device) {
  CopyBatch& batch = p.batch;
  auto* mapping = dynamic_cast<CudaClientMapping*>(batch.mapping.get());
  Lane& lane = s.LaneFor(device, batch.priority);
  MutexLock lock(&lane.mu);  // queue order must be stream order
  bool queued_work = false;
  auto enqueue = [&]() -> Status {
    if (p.on_cpu) return Status::Ok();
    ScopedDevice scope(device);
    KVTIER_RETURN_IF_ERROR(scope.status());
    // Errors left by earlier calls on this thread must not be taken for this
    // batch's launch error.
    (void)cudaGetLastError();
    if (batch.direction != CopyDirection::kSlotToSlot) {
      KVTIER_ASSIGN_OR_RETURN(const cuda::DevicePieces plan, mapping->PlanFor(batch.layout, device));
      queued_work = true;  // a launch that fails part way may have queued some of its kernels
      const cudaError_t err = batch.direction == CopyDirection::kEngineToSlot
                                  ? cuda::LaunchGather(plan, batch.blocks, lane.stream)
                                  : cuda::LaunchScatter(plan, batch.blocks, lane.stream);
      KVTIER_CUDA_RETURN_IF_ERROR(err, "launching the gather/scatter kernel");
    }
    for (const SlotCopy& c : batch.slot_copies) {
      queued_work = true;
      KVTIER_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(c.dst, c.src, c.size_bytes, cudaMemcpyDefault, lane.stream),
                                  "cudaMemcpyAsync between tiers");
    }
    if (batch.signal_event >= 0) {
      KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(mapping->event(batch.signal_event), lane.stream),
                                  "cudaEventRecord of the client's event");
    }
    return Status::Ok();
  };
  p.status = enqueue();
  // Completion waits for whatever was queued, even after an error, so that
  // no slot is reused while a kernel still writes it.
  if (!p.on_cpu && (p.status.ok() || queued_work)) {
    ScopedDevice scope(device);
    cudaError_t err = cudaEventCreateWithFlags(&p.event, cudaEventDisableTiming | cudaEventBlockingSync);
    if (err == cudaSuccess) err = cudaEventRecord(p.event, lane.stream);
    if (err != cudaSuccess) {
      if (p.event != nullptr) (void)cudaEventDestroy(p.event);
      p.event = nullptr;
      (void)cudaStreamSynchronize(lane.stream);
      if (p.status.ok()) p.status = CudaStatus(err, "recording a copy batch's completion");
    }
  }
  const bool ok = p.status.ok();
  lane.queue.push_back(std::move(p));
  lane.cv.Signal();
  return ok;
}

// Starts stores once their engine's event has completed.
void WatchLoop(CudaBackend::State& s) {
  std::vector<WaitingStore> watching;
  while (true) {
    {
      MutexLock lock(&s.watch_mu);
      while (watching.empty() && s.arriving.empty() && !s.watch_stopping) s.watch_cv.Wait(&s.watch_mu);
      for (WaitingStore& w : s.arriving) watching.push_back(std::move(w));
      s.arriving.clear();
      if (s.watch_stopping) break;
    }
    const auto now = std::chrono::steady_clock::now();
    std::vector<WaitingStore> still;
    for (WaitingStore& w : watching) {
      const cudaError_t q = cudaEventQuery(w.event);
      if (q == cudaSuccess) {
        Enqueue(s, std::move(w.pending), w.device);
      } else if (q != cudaErrorNotReady) {
        (void)cudaGetLastError();
        Finish(std::move(w.pending), CudaStatus(q, "waiting for the engine's event"));
      } else if (now > w.deadline) {
        Finish(std::move(w.pending),
               Status(StatusCode::kDeadlineExceeded, "the engine's event was not reached within " +
                                                         std::to_string(CudaBackend::kStoreEventTimeout.count()) + " s"));
      } else {
        still.push_back(std::move(w));
      }
    }
    watching = std::move(still);
    // Engine streams finish their writes within microseconds to milliseconds
    // of a store; a short sleep keeps the watcher off the CPU meanwhile.
    if (!watching.empty()) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  for (WaitingStore& w : watching) {
    Finish(std::move(w.pending), Status(StatusCode::kCancelled, "the cuda backend is shutting down"));
  }
}

void ReapLoop(CudaBackend::State* s) {
  while (true) {
    std::function<void()> work;
    {
      MutexLock lock(&s->reap_mu);
      while (s->reap_queue.empty() && s->reaper_running) s->reap_cv.Wait(&s->reap_mu);
      if (s->reap_queue.empty()) return;  // stopped, and drained
      work = std::move(s->reap_queue.front());
      s->reap_queue.pop_front();
    }
    work();
  }
}
}  // namespace

Result<std::unique_ptr<CudaBackend>> CudaBackend::Create(const Options& options) {
  KVTIER_ASSIGN_OR_RETURN(const int count, cuda::DeviceCount());
  auto state = std::make_shared<State>();
  state->devices = options.devices;
  if (state->devices.empty()) {
    for (int d = 0; d < count; ++d) state->devices.push_back(d);
  }
  state->description = "cuda:";
  for (int d : state->devices) {
    if (d < 0 || d >= count) {
      return Err(InvalidArgument("device " + std::to_string(d) + " does not exist (" + std::to_string(count) +
                                 " visible)"));
    }
    cudaDeviceProp prop{};
    KVTIER_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, d), "cudaGetDeviceProperties");
    int mode = cudaComputeModeDefault;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, d), "cudaDeviceGetAttribute");
    if (mode == cudaComputeModeExclusiveProcess || mode == cudaComputeModeProhibited) {
      return Err(Status(StatusCode::kFailedPrecondition,
                        "GPU " + std::to_string(d) + " is in an exclusive or prohibited compute mode: engines and "
                        "kvtierd must share it (nvidia-smi -c DEFAULT)"));
    }
    std::memcpy(state->uuids.emplace_back().data(), prop.uuid.bytes, 16);
    KVTIER_ASSIGN_OR_RETURN(const std::string about, cuda::DescribeDevice(d));
    state->description += " [" + std::to_string(d) + "] " + about + ";";
  }
  state->description += " driver " + cuda::DriverVersion();
  // Peer access between every pair that allows it, so that an engine on one
  // GPU can copy to and from the hbm tier on another.
  const size_t n = state->devices.size();
  state->peer.assign(n, std::vector<bool>(n, false));
  for (size_t i = 0; i < n; ++i) {
    state->peer[i][i] = true;
    ScopedDevice scope(state->devices[i]);
    KVTIER_RETURN_IF_ERROR(scope.status());
    for (size_t j = 0; j < n; ++j) {
      if (i == j) continue;
      int can = 0;
      KVTIER_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, state->devices[i], state->devices[j]),
                                  "cudaDeviceCanAccessPeer");
      if (can == 0) continue;
      const cudaError_t err = cudaDeviceEnablePeerAccess(state->devices[j], 0);
      if (err != cudaSuccess && err != cudaErrorPeerAccessAlreadyEnabled) {
        return Err(CudaStatus(err, "cudaDeviceEnablePeerAccess"));
      }
      (void)cudaGetLastError();  // clears cudaErrorPeerAccessAlreadyEnabled
      state->peer[i][j] = true;
    }
  }
  auto backend = std::unique_ptr<CudaBackend>(new CudaBackend(state));
  for (int d : state->devices) {
    ScopedDevice scope(d);
    KVTIER_RETURN_IF_ERROR(scope.status());
    int least = 0;
    int greatest = 0;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                                "cudaDeviceGetStreamPriorityRange");
    cudaStream_t setup = nullptr;
    KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&setup, cudaStreamNonBlocking), "cudaStreamCreate");
    state->setup_streams.push_back(setup);
    for (size_t p = 0; p < kNumCopyPriorities; ++p) {
      // Loads get the greatest priority, background moves the least.
      const int priority = p == 0 ? greatest : p == kNumCopyPriorities - 1 ? least : (least + greatest) / 2;
      auto lane = std::make_unique<Lane>();
      lane->device = d;
      KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&lane->stream, cudaStreamNonBlocking, priority),
                                  "cudaStreamCreateWithPriority");
      lane->thread = std::thread(CompleteLoop, lane.get());
      state->lanes.push_back(std::move(lane));
    }
  }
  {
    MutexLock lock(&state->reap_mu);
    state->reaper_running = true;
  }
  backend->reaper_ = std::thread([s = state.get()] { ReapLoop(s); });
  backend->watcher_ = std::thread([s = state.get()] { WatchLoop(*s); });
  return backend;
}

CudaBackend::CudaBackend(std::shared_ptr<State> state) : state_(std::move(state)) {}

CudaBackend::~CudaBackend() {
  State& s = *state_;
  if (watcher_.joinable()) {
    {
      MutexLock lock(&s.watch_mu);
      s.watch_stopping = true;
    }
    s.watch_cv.SignalAll();
    watcher_.join();
  }
  for (const std::unique_ptr<Lane>& lane : s.lanes) {
    {
      MutexLock lock(&lane->mu);
      lane->stopping = true;
    }
    lane->cv.SignalAll();
  }
  for (const std::unique_ptr<Lane>& lane : s.lanes) {
    if (lane->thread.joinable()) lane->thread.join();
  }
  // Teardown of mappings released so far; later ones run on their releaser.
  if (reaper_.joinable()) {
    {
      MutexLock lock(&s.reap_mu);
      s.reaper_running = false;
    }
    s.reap_cv.SignalAll();
    reaper_.join();
  }
  for (const std::unique_ptr<Lane>& lane : s.lanes) {
    if (lane->stream != nullptr) (void)cudaStreamDestroy(lane->stream);
  }
  s.lanes.clear();
  // Setup streams stay: plans of mappings that outlive the backend are freed
  // on them (cudaFreeAsync), and the process exits soon after in practice.
}


std::string CudaBackend::Describe() const { return state_->description; }
const std::vector<int>& CudaBackend::devices() const { return state_->devices; }
uint64_t CudaBackend::live_mappings() const { return state_->live_mappings.load(std::memory_order_relaxed); }

Result<std::unique_ptr<Arena>> CudaBackend::AllocateDeviceArena(int device, uint64_t size_bytes) {
  if (std::find(state_->devices.begin(), state_->devices.end(), device) == state_->devices.end()) {
    return Err(InvalidArgument("hbm on device " + std::to_string(device) + ", which this daemon does not use"));
  }
  KVTIER_ASSIGN_OR_RETURN(cuda::DeviceBuffer buffer, cuda::DeviceBuffer::Allocate(device, size_bytes));
  auto arena = std::make_unique<DeviceArena>(std::move(buffer), state_);
  MutexLock lock(&state_->mu);
  state_->device_arenas.push_back(State::Range{arena->Begin(), arena->Begin() + size_bytes, device});
  return std::unique_ptr<Arena>(std::move(arena));
}

Result<std::unique_ptr<Arena>> CudaBackend::AllocateHostArena(uint64_t size_bytes) {
  ScopedDevice scope(state_->devices.front());
  KVTIER_RETURN_IF_ERROR(scope.status());
  Result<MemoryMapping> m = MemoryMapping::Anonymous(size_bytes);
  if (!m) return Err(m.error().WithContext("allocating the host pool"));
  auto arena = std::make_unique<PinnedArena>(std::move(*m));
  KVTIER_RETURN_IF_ERROR(arena->Register());
  return std::unique_ptr<Arena>(std::move(arena));
}

Result<std::shared_ptr<ClientMapping>> CudaBackend::MapClientMemory(std::vector<ClientRegionHandle> regions,
                                                                    std::vector<IpcEventHandle> events) {
  auto mapping = std::make_shared<CudaClientMapping>(state_);
  KVTIER_RETURN_IF_ERROR(mapping->Open(std::move(regions), std::move(events)));
  return std::shared_ptr<ClientMapping>(std::move(mapping));
}

bool CudaBackend::Submit(CopyBatch batch, CopyDone done) {
  State& s = *state_;
  const bool engine = batch.direction != CopyDirection::kSlotToSlot;
  auto* mapping = engine ? dynamic_cast<CudaClientMapping*>(batch.mapping.get()) : nullptr;
  KVTIER_CHECK_MSG(!engine || mapping != nullptr, "a batch with a mapping the cuda backend did not make");
  KVTIER_CHECK_MSG(batch.wait_event < 0 || batch.signal_event < 0, "a batch with both events");

  Pending p;
  p.done = std::move(done);
  // Where the work runs: the engine's GPU; for a CPU engine's memfd cache or
  // a move between tiers, the GPU of the hbm slot involved. Memory all on
  // the host is copied by the CPU.
  const bool engine_on_device = engine && mapping->on_device();
  int device = engine_on_device ? mapping->device() : s.devices.front();
  std::optional<int> hbm;  // the device of an hbm slot the batch touches
  auto note = [&](const void* ptr, const uint8_t* dst, uint64_t size) {
    const std::optional<int> d = s.DeviceOf(ptr);
    if (d) hbm = d;
    if (batch.checksum_destination && dst != nullptr) p.checksum_of.emplace_back(d ? nullptr : dst, size);
  };
  const uint64_t block_bytes = engine ? batch.layout->layout().block_bytes() : 0;
  for (const BlockCopy& b : batch.blocks) {
    note(b.slot, batch.direction == CopyDirection::kEngineToSlot ? b.slot : nullptr, block_bytes);
  }
  for (const SlotCopy& c : batch.slot_copies) {
    if (const std::optional<int> d = s.DeviceOf(c.src)) hbm = d;
    note(c.dst, c.dst, c.size_bytes);
  }
  if (!engine_on_device && hbm) device = *hbm;
  p.on_cpu = !engine_on_device && !hbm;
  KVTIER_CHECK_MSG(!p.on_cpu || (batch.wait_event < 0 && batch.signal_event < 0),
                   "events on a batch in host memory");
  if (hbm && !s.peer[s.IndexOf(device)][s.IndexOf(*hbm)]) {
    // Failed in its lane's order, on the lane's thread, like any batch.
    p.status = Status(StatusCode::kFailedPrecondition,
                      "GPU " + std::to_string(device) + " cannot reach the hbm tier on GPU " + std::to_string(*hbm) +
                          " (no peer access); set tiers.hbm.devices to the engines' GPU or disable the hbm tier");
    p.batch = std::move(batch);
    Lane& lane = s.LaneFor(device, p.batch.priority);
    MutexLock lock(&lane.mu);
    lane.queue.push_back(std::move(p));
    lane.cv.Signal();
    return false;
  }
  if (batch.wait_event >= 0) {
    // A store: its copies start once the engine's record has completed,
    // which the watcher sees from the host.
    WaitingStore w{.pending = {},
                   .device = device,
                   .event = mapping->event(batch.wait_event),
                   .deadline = std::chrono::steady_clock::now() + kStoreEventTimeout};
    p.batch = std::move(batch);
    w.pending = std::move(p);
    MutexLock lock(&s.watch_mu);
    s.arriving.push_back(std::move(w));
    s.watch_cv.Signal();
    return true;
  }
  p.batch = std::move(batch);
  return Enqueue(s, std::move(p), device);
}



}  // namespace kvtier
