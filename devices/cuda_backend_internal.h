// Internals of the cuda backend (devices/cuda_backend.h), shared by its two
// source files: cuda_backend.cc (arenas, copy lanes, Submit, the watcher and
// reaper threads) and cuda_client_mapping.cc (what clients register: IPC
// memory and event handles, memfds, copy plans). Nothing else includes it.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/memory_mapping.h"
#include "common/mutex.h"
#include "kernels/codec.h"
#include "kernels/copy_plan.h"
#include "kernels/cuda/codec_kernels.h"
#include "kernels/cuda/copy_kernels.h"
#include "kernels/cuda/cuda_util.h"
#include "devices/cuda_backend.h"

namespace kvtier {
namespace cuda_internal {

using IpcMemKey = std::array<uint8_t, ClientRegionHandle::kCudaIpcHandleBytes>;
using cuda::ScopedDevice;

// Flags the fp8 kernels set (codec_kernels.h): a store's, one per coded
// block (a NaN or an Inf: not coded); a load's, one per batch (a corrupt
// block). In pinned host memory mapped for every device: the kernel writes
// them, the completion thread reads them once the batch's event has
// completed. Runs of a power of two, cut from pages allocated as the batches
// in flight need them and kept for reuse (never more than twice the most
// flags in flight at once). Thread-safe.
class CodecFlags {
 public:
  static constexpr size_t kPageFlags = 1024;

  // Zeroed flags until destruction returns them.
  class Lease {
   public:
    Lease() = default;
    Lease(CodecFlags* owner, uint32_t* flags, size_t order) : owner_(owner), flags_(flags), order_(order) {}
    Lease(Lease&& o) noexcept
        : owner_(std::exchange(o.owner_, nullptr)), flags_(std::exchange(o.flags_, nullptr)), order_(o.order_) {}
    Lease& operator=(Lease&& o) noexcept {
      if (this != &o) {
        Release();
        owner_ = std::exchange(o.owner_, nullptr);
        flags_ = std::exchange(o.flags_, nullptr);
        order_ = o.order_;
      }
      return *this;
    }
    ~Lease() { Release(); }
    // Host and device address (unified addressing), or null.
    uint32_t* get() const { return flags_; }
    bool set(size_t i) const { return flags_ != nullptr && static_cast<volatile const uint32_t*>(flags_)[i] != 0; }

   private:
    void Release() {
      if (flags_ != nullptr) owner_->Return(flags_, order_);
      flags_ = nullptr;
    }
    CodecFlags* owner_ = nullptr;
    uint32_t* flags_ = nullptr;
    size_t order_ = 0;
  };

  CodecFlags() = default;
  CodecFlags(const CodecFlags&) = delete;
  CodecFlags& operator=(const CodecFlags&) = delete;
  ~CodecFlags() {
    for (void* page : pages_) (void)cudaFreeHost(page);
  }

  // `n` >= 1 flags. Errors: the CUDA error of allocating a page.
  Result<Lease> Take(size_t n) {
    size_t order = 0;
    while ((size_t{1} << order) < n) ++order;
    const size_t run = size_t{1} << order;
    MutexLock lock(&mu_);
    if (free_.size() <= order) free_.resize(order + 1);
    std::vector<uint32_t*>& runs = free_[order];
    if (runs.empty()) {
      const size_t count = std::max(run, kPageFlags);
      void* page = nullptr;
      KVTIER_CUDA_RETURN_IF_ERROR(
          cudaHostAlloc(&page, count * sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable),
          "cudaHostAlloc of codec flags");
      void* on_device = nullptr;
      if (cudaHostGetDevicePointer(&on_device, page, 0) != cudaSuccess || on_device != page) {
        (void)cudaFreeHost(page);
        (void)cudaGetLastError();
        return Err(Status(StatusCode::kFailedPrecondition, "codec flags mapped at a different device address"));
      }
      pages_.push_back(page);
      for (size_t i = 0; i < count; i += run) runs.push_back(static_cast<uint32_t*>(page) + i);
    }
    uint32_t* flags = runs.back();
    runs.pop_back();
    std::fill_n(flags, n, 0u);
    return Lease(this, flags, order);
  }

 private:
  void Return(uint32_t* flags, size_t order) {
    MutexLock lock(&mu_);
    free_[order].push_back(flags);
  }
  Mutex mu_;
  std::vector<void*> pages_ KVTIER_GUARDED_BY(mu_);
  std::vector<std::vector<uint32_t*>> free_ KVTIER_GUARDED_BY(mu_);  // by order: runs of 2^order
};

// Whether the backend's CUDA context is lost (cuda::IsContextLost): the
// first such error is kept, logged once, and fails every batch after it.
// Thread-safe: the lanes' and the watcher's threads note errors, the event
// loop reads status().
class ContextHealth {
 public:
  // Keeps `status` if it says the context is lost and none was kept yet.
  void Note(const Status& status);
  bool lost() const { return lost_.load(std::memory_order_acquire); }
  // Ok, or the kept error.
  Status status() const;

 private:
  std::atomic<bool> lost_{false};  // release by Note, after status_
  mutable Mutex mu_;
  Status status_ KVTIER_GUARDED_BY(mu_);
};

// A batch on its way through a lane.
struct Pending {
  cudaEvent_t event = nullptr;  // recorded after the batch's work; null if nothing was queued
  Status status;                // an error while queueing
  bool on_cpu = false;          // host memory on both sides: copied by the CPU reference
  CopyBatch batch;
  CopyDone done;
  // With checksum_destination: each destination, or null where it is device memory.
  std::vector<std::pair<const uint8_t*, uint64_t>> checksum_of;
  // Coded blocks on the GPU: a store's per coded block, a load's one.
  CodecFlags::Lease codec_flags;
  // A load by layer: recorded after each layer's kernels, in layer order;
  // the completion thread reports each layer in place (the fence's
  // progress) as its event completes.
  std::vector<cudaEvent_t> layer_events;
  // Engine copies: the client's fence, held from before their launch until
  // they are over (Finish).
  OpFence::Entry fenced;
};

// One stream and the thread that completes its batches, in stream order.
struct Lane {
  ContextHealth* health = nullptr;  // the backend's (State::health)
  int device = 0;
  cudaStream_t stream = nullptr;
  Mutex mu;
  CondVar cv;
  std::deque<Pending> queue KVTIER_GUARDED_BY(mu);
  bool stopping KVTIER_GUARDED_BY(mu) = false;
  std::thread thread;
  // The completion thread's own, for coded blocks of copies between host
  // memories (copied by the CPU).
  std::unique_ptr<BlockCodec> coder;
  std::vector<uint8_t> scratch;
};

// A store waiting, on the watcher thread, for the engine's record of its event.
struct WaitingStore {
  Pending pending;
  int device = 0;
  cudaEvent_t event = nullptr;
  std::chrono::steady_clock::time_point deadline;
};

// Registers `size_bytes` at `p` with CUDA (pinned, mapped for every device)
// and checks that kernels can use the host address as is (unified
// addressing); unregisters again on failure. `what` prefixes errors.
Status RegisterMapped(void* p, uint64_t size_bytes, const std::string& what);

// A copy plan's pieces in device memory, and where each layer's begin
// (a plan built by layer; otherwise one "layer" holds them all).
struct PlanPieces {
  cuda::DevicePieces all;
  std::vector<uint32_t> layer_begin;  // num_layers() + 1 entries, the last all.count

  uint32_t num_layers() const { return static_cast<uint32_t>(layer_begin.size()) - 1; }
  // REQUIRES: layer < num_layers().
  cuda::DevicePieces layer(uint32_t layer) const {
    return cuda::DevicePieces{all.pieces + layer_begin[layer], layer_begin[layer + 1] - layer_begin[layer],
                              all.max_piece_bytes};
  }
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
    for (uint32_t l = 0; l < plan.num_layers(); ++l) {
      p.layer_begin_.push_back(static_cast<uint32_t>(plan.layer_pieces(l).data() - plan.pieces().data()));
    }
    p.layer_begin_.push_back(static_cast<uint32_t>(plan.pieces().size()));
    KVTIER_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d, plan.pieces().data(), bytes, cudaMemcpyHostToDevice, stream),
                                "uploading a copy plan");
    // Kernels on other streams use it next: wait for this small copy only.
    KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "uploading a copy plan");
    return p;
  }
  StreamOrderedPlan() = default;
  StreamOrderedPlan(StreamOrderedPlan&& o) noexcept
      : pieces_(std::exchange(o.pieces_, {})),
        layer_begin_(std::move(o.layer_begin_)),
        stream_(o.stream_),
        device_(o.device_) {}
  StreamOrderedPlan& operator=(StreamOrderedPlan&&) = delete;
  ~StreamOrderedPlan() {
    if (pieces_.pieces == nullptr) return;
    // Every kernel that read it has completed: the batches hold the mapping
    // that holds this plan until their completion event.
    ScopedDevice scope(device_);
    (void)cudaFreeAsync(const_cast<CopyPiece*>(pieces_.pieces), stream_);
    (void)cudaGetLastError();
  }
  PlanPieces pieces() const { return PlanPieces{pieces_, layer_begin_}; }

 private:
  static cuda::DevicePieces DevicePieces(const CopyPiece* p, const CopyPlan& plan) {
    return cuda::DevicePieces{p, static_cast<uint32_t>(plan.pieces().size()), plan.max_piece_bytes()};
  }
  cuda::DevicePieces pieces_{};
  std::vector<uint32_t> layer_begin_;
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
};

}  // namespace cuda_internal

struct CudaBackend::State {
  std::vector<int> devices;
  std::vector<std::array<uint8_t, 16>> uuids;  // of each device, in order
  std::vector<std::vector<bool>> peer;          // [i][j]: device i's kernels reach device j's memory
  std::vector<cudaStream_t> setup_streams;      // per device: plan uploads and frees
  std::string description;
  cuda_internal::CodecFlags codec_flags;  // before lanes: their batches return flags
  std::vector<std::unique_ptr<cuda_internal::Lane>> lanes;  // devices.size() x kNumCopyPriorities
  std::atomic<uint64_t> live_mappings{0};
  cuda_internal::ContextHealth health;

  struct Range {
    uint64_t begin = 0;
    uint64_t end = 0;
    int device = 0;
  };
  // An IPC handle is opened once per process (CUDA allows no second open)
  // and shared by the registrations of the tenant that opened it, never
  // with another tenant's: knowing a handle's bytes is no right to the
  // memory.
  struct OpenedMemory {
    uint8_t* base = nullptr;
    uint64_t size_bytes = 0;
    int device = 0;
    uint32_t refs = 0;
    std::string owner;  // the tenant
  };
  struct OpenedEvent {
    cudaEvent_t event = nullptr;
    int device = 0;
    uint32_t refs = 0;
    std::string owner;
  };
  Mutex mu;
  std::vector<Range> device_arenas KVTIER_GUARDED_BY(mu);
  std::map<cuda_internal::IpcMemKey, OpenedMemory> opened_memory KVTIER_GUARDED_BY(mu);
  std::map<IpcEventHandle, OpenedEvent> opened_events KVTIER_GUARDED_BY(mu);

  // Stores waiting for their engine's event (watcher thread).
  Mutex watch_mu;
  CondVar watch_cv;
  std::deque<cuda_internal::WaitingStore> arriving KVTIER_GUARDED_BY(watch_mu);
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

  cuda_internal::Lane& LaneFor(int device, CopyPriority priority) {
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

  // The IPC memory handles and events clients registered, opened once each
  // and shared by reference count (CUDA refuses a second open of one handle
  // in a process); cuda_client_mapping.cc.
  // On `device`, for tenant `owner`. Errors: kPermissionDenied when
  // another tenant has the handle open.
  Result<OpenedMemory> OpenMemory(const cuda_internal::IpcMemKey& key, int device, const std::string& owner);
  void ReleaseMemory(const cuda_internal::IpcMemKey& key);
  Result<cudaEvent_t> OpenEvent(const IpcEventHandle& key, int device, const std::string& owner);
  void ReleaseEvent(const IpcEventHandle& key);
};

// A client's registration: its IPC allocations (or registered memfds) and
// events, and the copy plans uploaded for its layouts. Made by
// CudaBackend::MapClientMemory; used by Submit while batches hold it.
class CudaClientMapping final : public ClientMapping {
 public:
  explicit CudaClientMapping(std::shared_ptr<CudaBackend::State> state);
  // Hands the teardown (closing handles, unregistering memory, which may
  // wait for the device) to the reaper thread.
  ~CudaClientMapping() override;

  std::span<uint8_t* const> region_bases() const override { return bases_; }
  uint32_t num_events() const override { return static_cast<uint32_t>(events_.size()); }

  // Builds the mapping. Errors as CudaBackend::MapClientMemory.
  Status Open(std::vector<ClientRegionHandle> regions, std::vector<IpcEventHandle> events);

  // The engine's GPU (IPC caches); for memfd caches, the first device.
  int device() const { return device_; }
  bool on_device() const { return on_device_; }
  cudaEvent_t event(int32_t i) const {
    KVTIER_CHECK(i >= 0 && static_cast<size_t>(i) < events_.size());
    return events_[static_cast<size_t>(i)];
  }

  // The copy plan of `layout` over this mapping, in the memory of the device
  // that launches the copy, built by layer or not (uploaded on first use; a
  // registration has one layout and its kernels run on one or two devices,
  // so this is a tiny list).
  Result<cuda_internal::PlanPieces> PlanFor(const std::shared_ptr<const KvCacheLayout>& layout, int device,
                                            bool by_layer);

 private:
  Status OpenMemfd(const ClientRegionHandle& r, const std::string& what);

  std::shared_ptr<CudaBackend::State> state_;
  bool on_device_ = false;
  int device_ = -1;
  std::vector<uint8_t*> bases_;
  std::vector<cuda_internal::IpcMemKey> memory_keys_;
  std::vector<MemoryMapping> memfds_;
  std::vector<IpcEventHandle> event_keys_;
  std::vector<cudaEvent_t> events_;
  Mutex mu_;
  struct UploadedPlan {
    std::shared_ptr<const KvCacheLayout> layout;
    int device = 0;
    bool by_layer = false;
    cuda_internal::StreamOrderedPlan plan;
  };
  std::vector<UploadedPlan> plans_ KVTIER_GUARDED_BY(mu_);
};

}  // namespace kvtier
