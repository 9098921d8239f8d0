// CudaBackend: the `cuda` DeviceBackend (DESIGN.md, "Device backends").
//
//   - hbm: one cudaMalloc arena per device, cut into slots above this layer.
//   - host: one arena per node, shared by every client: anonymous memory
//     registered with cudaHostRegister (pinned, mapped, portable), so that
//     kernels read and write it directly and O_DIRECT and io_uring's fixed
//     buffers can use the same pages (the driver's own cudaHostAlloc
//     mappings need not allow that).
//   - client memory: engine KV caches arrive as CUDA IPC memory handles
//     (allocation + offset, since PyTorch sub-allocates) and are opened once
//     per allocation, reference counted across registrations (CUDA refuses a
//     second open of one handle in a process); CPU engines' memfd regions are
//     mapped and cudaHostRegister'ed. Every opened range is checked against
//     the allocation's real size, so a client cannot make the daemon touch
//     memory outside what it exported.
//   - events: a client's CUDA IPC events, opened with its registration. A
//     load records one after its copies (the engine's stream waits for it on
//     the GPU, not on a socket round trip). A store waits for the engine's
//     record of one (what the engine's stream wrote) on a watcher thread
//     that polls it from the host, never in a shared copy stream, so that a
//     slow or dead engine cannot hold up other engines' copies; a record that
//     does not complete within kStoreEventTimeout fails that store.
//   - copies: three streams per device (loads, stores, background moves; CUDA
//     stream priorities in that order), batched gather/scatter kernels
//     (kernels/cuda/copy_kernels.h) for engine copies, cudaMemcpyAsync (the
//     copy engines, leaving SMs to the engine) for moves between tiers.
//     Submit queues the work before it returns; one completion thread per
//     stream waits for each batch's event in order, computes the checksums of
//     destinations in host memory and runs `done`.
//   - coded blocks (issue 18): a store's fp8 blocks are quantized by a
//     kernel straight from the engine's pages into host slots of their coded
//     size (a block with a NaN or an Inf is reported, not coded), and a
//     load's dequantized straight into the engine's pages; no raw copy in
//     host memory and no CPU pass. A corrupt block fails its load with
//     kCorruption. Pinned, mapped flags (CodecFlags) carry what the kernels
//     found to the completion thread.
//   - several GPUs: kernels run on the engine's GPU; peer access is enabled
//     between every pair of devices that allows it at start-up, and a copy
//     between an engine and the hbm tier of a GPU it cannot reach fails
//     cleanly (kFailedPrecondition) rather than faulting the context.
//
// Mappings hold their IPC handles open until the last copy using them has
// completed and the mapping is released (a dead client's GPU memory is not
// kept mapped). Their teardown (closing handles, unregistering memory), which
// may wait for the device, runs on a reaper thread, never on the caller's.
// Errors keep the cudaError_t (Status::raw_code, source kCuda). A sticky
// error (a fault on the device: cuda::IsContextLost) leaves the process's
// context unusable for good: the first is logged and kept, health() reports
// it, and every later batch fails with it at once (the daemon then stops
// and exits for its supervisor to start a new process).
//
// Thread-safe. Destruction waits for every queued batch.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/device_backend.h"

namespace kvtier {

class CudaBackend final : public DeviceBackend {
 public:
  struct Options {
    // CUDA device ordinals to use; empty: every visible device.
    std::vector<int> devices;
  };

  // Errors: kUnavailable when there is no driver or no device (the message
  // says which), kInvalidArgument for a device that does not exist.
  static Result<std::unique_ptr<CudaBackend>> Create(const Options& options);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string_view name() const override { return "cuda"; }
  std::string Describe() const override;
  Result<std::unique_ptr<Arena>> AllocateDeviceArena(int device, uint64_t size_bytes) override;
  Result<std::unique_ptr<Arena>> AllocateHostArena(uint64_t size_bytes) override;
  Result<std::shared_ptr<ClientMapping>> MapClientMemory(std::vector<ClientRegionHandle> regions,
                                                         std::vector<IpcEventHandle> events) override;
  bool Submit(CopyBatch batch, CopyDone done) override;
  // fp8 blocks are coded by kernels (kernels/cuda/codec_kernels.h) on the
  // GPU between the engine's pages and host slots of their coded size, and
  // by the lane's CPU codec for a CPU engine's.
  bool DecodesOnLoad(CodecKind kind) const override { return kind == CodecKind::kNone || kind == CodecKind::kFp8; }
  bool EncodesOnStore(CodecKind kind) const override { return kind == CodecKind::kFp8; }
  uint64_t live_mappings() const override;
  // Not ok once an error lost the CUDA context (cuda::IsContextLost):
  // batches and mappings fail with that error from then on.
  Status health() const override;

  const std::vector<int>& devices() const;

  // How long a store waits for the engine's record of its event.
  static constexpr std::chrono::seconds kStoreEventTimeout{60};

  // Shared by the backend, its arenas and its mappings (which may outlive
  // it); defined in cuda_backend.cc.
  struct State;

 private:
  explicit CudaBackend(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;  // shared with arenas and mappings that outlive the backend
  std::thread watcher_;           // starts stores once their engine's event completed
  std::thread reaper_;            // tears down released mappings
};

}  // namespace kvtier
