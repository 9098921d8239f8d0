// HostBackend: the `host` DeviceBackend. Arenas are anonymous process memory,
// engine KV caches are memfd shared memory passed with SCM_RIGHTS and mapped
// here, and copies run on a pool of worker threads using the CPU reference
// gather/scatter (kernels/copy_reference.h). It is what CI and every machine
// without a GPU run, and a real mode for CPU inference engines.
//
// Blocks a load finds coded (BlockCopy::coded_bytes) are decoded by the
// copy thread, with a codec of its own, into a scratch block of its own (in
// its cache) and scattered from there into the engine's pages: no host slot
// ever holds them raw. Every codec decodes on load (DecodesOnLoad).
//
// Workers take tasks (slices of a batch) by priority: loads, then stores,
// then background moves; within a priority, flows (tenants, CopyBatch::flow)
// by the bytes copied for them (FairShareQueue), each flow's in order. A
// by_layer load's tasks each copy one layer of some blocks, queued layer
// after layer; a layer is reported (OpFence::Progress) once its last task is
// done. A load with coded blocks is copied whole. A store by layer
// (CopyBatch::gate) is split the same way, and a layer's tasks are queued
// only once the gate opens it; once every layer is copied, its blocks are
// checksummed (in tasks of their own). A gate given to Submit must not
// outlive the backend.
//
// A batch releases its client mapping and layout before its `done` runs, so
// a completion observer already sees the mapping's share of live_mappings()
// gone.
//
// Thread-safe. Destruction waits for queued copies to finish (each `done`
// still runs exactly once) and then joins the workers.
#pragma once

#include <memory>
#include <thread>
#include <vector>

#include "common/device_backend.h"
#include "common/fair_share_queue.h"
#include "common/memory_mapping.h"
#include "common/mutex.h"
#include "devices/reaper.h"
#include "kernels/codec.h"

namespace kvtier {

class HostBackend final : public DeviceBackend {
 public:
  struct Options {
    uint32_t copy_threads = 2;  // >= 1
    // Fault the host arena in at allocation, on a thread of its own
    // (config tiers.host.prefault): the memory is the daemon's from the
    // start, as pinned memory is on the cuda backend, and the first stores
    // into it run at memory speed rather than at page-fault speed.
    bool populate_host = false;
    // Where released engine mappings are unmapped; null: a reaper of the
    // backend's own (tests pass one to hold it).
    std::shared_ptr<Reaper> reaper = nullptr;
  };

  static Result<std::unique_ptr<HostBackend>> Create(const Options& options);
  ~HostBackend() override;

  // Maps one kHostMemfd region after checking its seal and size (see
  // DeviceBackend::MapClientMemory); the cuda backend maps CPU engines'
  // regions the same way. `what` prefixes errors ("region 2").
  static Result<MemoryMapping> MapSealedMemfd(const ClientRegionHandle& region, const std::string& what);

  std::string_view name() const override { return "host"; }
  std::string Describe() const override;
  Result<std::unique_ptr<Arena>> AllocateDeviceArena(int device, uint64_t size_bytes) override;
  Result<std::unique_ptr<Arena>> AllocateHostArena(uint64_t size_bytes) override;
  Result<std::shared_ptr<ClientMapping>> MapClientMemory(std::vector<ClientRegionHandle> regions,
                                                         std::vector<IpcEventHandle> events) override;
  bool Submit(CopyBatch batch, CopyDone done) override;
  bool DecodesOnLoad(CodecKind /*kind*/) const override { return true; }
  bool GatesStoreLayers() const override { return true; }
  uint64_t live_mappings() const override;

 private:
  struct Batch;
  static constexpr uint32_t kAllLayers = UINT32_MAX;
  static constexpr uint32_t kChecksums = UINT32_MAX - 1;
  struct Task {
    std::shared_ptr<Batch> batch;
    size_t begin = 0;  // range of copies (blocks or slot copies) in the batch
    size_t end = 0;
    // A by_layer batch's: the one layer it copies; kChecksums: a store by
    // layer's checksums of its slots, once every layer is in them.
    uint32_t layer = kAllLayers;
  };

  // A worker's own: its codec (zstd contexts) and a block of scratch.
  struct Worker;

  HostBackend(std::vector<std::unique_ptr<Worker>> workers, bool populate_host, std::shared_ptr<Reaper> reaper);
  // The tasks of a batch of `n` copies, in order: about two per worker so
  // both cores work on one large request, and at most about kTaskBytes each,
  // so that a worker turns to another tenant's copies within one task's time
  // (FairShareQueue). A by_layer batch's, layer after layer.
  std::vector<Task> SplitIntoTasks(const std::shared_ptr<Batch>& b, size_t n, uint64_t copy_bytes) const;
  // Queues the tasks (one batch's) by the batch's priority and flow.
  void Queue(std::vector<Task> tasks);
  // A store by layer: its tasks, queued layer by layer as `gate` opens.
  void Hold(const std::shared_ptr<Batch>& b, std::vector<Task> tasks, LayerGate& gate);
  void WorkerLoop(Worker& worker);
  void RunTask(const Task& task, Worker& worker);
  // A task's copies (RunTask, for any task but kChecksums).
  void CopyTask(const Task& task, Worker& worker);
  // A by_layer batch's task of `layer` is over, its copies done: reports the
  // layers now in place in every block.
  static void LayerCopied(Batch& b, uint32_t layer);

  Mutex mu_;
  CondVar work_cv_;
  // Each priority's tasks: flows (tenants) by the bytes copied for them,
  // each flow's in order.
  FairShareQueue<Task> queues_[kNumCopyPriorities] KVTIER_GUARDED_BY(mu_);
  bool stopping_ KVTIER_GUARDED_BY(mu_) = false;
  const uint32_t num_threads_;
  const bool populate_host_;
  std::vector<std::unique_ptr<Worker>> workers_;  // one per thread
  std::vector<std::thread> threads_;
  // Shared with mappings so they can count down after the backend is gone.
  std::shared_ptr<std::atomic<uint64_t>> live_mappings_;
  // Unmaps engines' memory once their mappings are released (devices/reaper.h).
  std::shared_ptr<Reaper> reaper_;
};

}  // namespace kvtier
