#include "devices/cuda_backend.h"

#include <spdlog/spdlog.h>

#include <cstring>

#include "kernels/copy_reference.h"
#include "devices/cuda_backend_internal.h"

namespace kvtier {

using cuda::CudaStatus;
using cuda::ScopedDevice;
using cuda_internal::ContextHealth;
using cuda_internal::Lane;
using cuda_internal::Pending;
using cuda_internal::PlanPieces;
using cuda_internal::RegisterMapped;
using cuda_internal::WaitingStore;

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
    // Fewer pages to pin and map; 4 KiB pages work too.
    mapping_.AdviseHugePages();
    KVTIER_RETURN_IF_ERROR(RegisterMapped(mapping_.data(), mapping_.size_bytes(),
                                          "the " + std::to_string(mapping_.size_bytes()) + "-byte host pool"));
    registered_ = true;
    return Status::Ok();
  }
  uint8_t* data() const override { return mapping_.data(); }
  uint64_t size_bytes() const override { return mapping_.size_bytes(); }

 private:
  MemoryMapping mapping_;
  bool registered_ = false;
};

}  // namespace

namespace cuda_internal {

void ContextHealth::Note(const Status& status) {
  if (lost() || !cuda::IsContextLost(status)) return;
  {
    MutexLock lock(&mu_);
    if (!status_.ok()) return;
    status_ = Status(StatusCode::kUnavailable,
                     "the GPU's CUDA context is lost (" + status.message() +
                         "): no copy can run in this process; kvtierd must be restarted",
                     ErrorSource::kCuda, status.raw_code());
  }
  lost_.store(true, std::memory_order_release);
  spdlog::critical("cuda backend: {}", status.ToString());
}

Status ContextHealth::status() const {
  if (!lost()) return Status::Ok();
  MutexLock lock(&mu_);
  return status_;
}

}  // namespace cuda_internal

namespace {

// Runs a batch whose memory is all on the host with the CPU reference (and
// the lane's codec for coded blocks).
CopyResult CopyOnCpu(const CopyBatch& c, Lane& lane) {
  CopyResult r;
  if (c.direction == CopyDirection::kSlotToSlot) {
    for (const SlotCopy& sc : c.slot_copies) {
      if (c.checksum_destination) {
        r.checksums.push_back(CopyWithChecksum(sc.dst, sc.src, sc.size_bytes));
      } else {
        CopyStreaming(sc.dst, sc.src, sc.size_bytes);
      }
    }
    return r;
  }
  const CopyPlan plan = CopyPlan::Build(*c.layout, MappedRegions{c.mapping->region_bases()});
  for (uint32_t i = 0; i < c.blocks.size(); ++i) {
    const BlockCopy& b = c.blocks[i];
    if (c.direction == CopyDirection::kSlotToEngine) {
      if (b.coded_bytes == 0) {
        ScatterBlock(plan, b.engine_block, b.slot);
        continue;
      }
      r.status = DecodeAndScatter(*lane.coder, c.codec, std::span<const uint8_t>(b.slot, b.coded_bytes), plan,
                                  b.engine_block, lane.scratch);
      if (!r.status.ok()) return r;
      continue;
    }
    uint64_t* checksum = c.checksum_destination ? &r.checksums.emplace_back() : nullptr;
    if (b.coded_bytes == 0) {
      GatherBlock(plan, b.engine_block, b.slot, checksum);
      continue;
    }
    const std::span<uint8_t> out(b.slot, b.coded_bytes);
    const std::optional<size_t> n =
        out.size() < BlockCodec::MaxEncodedBytes(c.codec, plan.block_bytes())
            ? std::nullopt
            : GatherAndEncode(*lane.coder, c.codec, plan, b.engine_block, out, lane.scratch);
    if (n != out.size()) {
      r.not_coded.push_back(i);
    } else if (checksum != nullptr) {
      *checksum = ChecksumOf(b.slot, *n);
    }
  }
  return r;
}

// The fp8 kernels' flags into a batch's result: a load's corrupt block, a
// store's blocks not coded.
void ReadCodecFlags(const Pending& p, CopyResult& result) {
  if (p.codec_flags.get() == nullptr) return;
  if (p.batch.direction == CopyDirection::kSlotToEngine) {
    if (p.codec_flags.set(0)) {
      result.status = Status(StatusCode::kCorruption, "an fp8 block of the load holds a NaN code or a bad scale");
    }
    return;
  }
  size_t coded = 0;
  for (uint32_t i = 0; i < p.batch.blocks.size(); ++i) {
    if (p.batch.blocks[i].coded_bytes != 0 && p.codec_flags.set(coded++)) result.not_coded.push_back(i);
  }
}

// Finishes a batch on a backend thread: checksums, then `done`, after letting
// go of the client's mapping (as the host backend does). `lane`: the lane's
// completion thread (the only caller whose batches may still be copied, by
// the CPU); null for a batch that failed before its lane.
void Finish(Pending p, Status status, Lane* lane, ContextHealth& health) {
  health.Note(status);
  CopyResult result{.status = std::move(status)};
  if (result.status.ok()) ReadCodecFlags(p, result);
  if (result.status.ok()) {
    if (p.on_cpu) {
      KVTIER_CHECK(lane != nullptr);
      result = CopyOnCpu(p.batch, *lane);
    } else if (p.batch.checksum_destination) {
      size_t next_not_coded = 0;
      for (size_t i = 0; i < p.checksum_of.size(); ++i) {
        const auto [dst, size] = p.checksum_of[i];
        // A block not coded: its slot holds nothing of use.
        const bool skip = next_not_coded < result.not_coded.size() && result.not_coded[next_not_coded] == i;
        next_not_coded += skip ? 1 : 0;
        result.checksums.push_back(dst != nullptr && !skip ? ChecksumOf(dst, size) : 0);
      }
    }
  }
  p.batch = CopyBatch{};
  p.fenced = OpFence::Entry();
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
    // A load by layer: each layer in place as its event completes. The
    // engine's next kernels read it after the client saw the progress.
    for (size_t l = 0; l < p.layer_events.size(); ++l) {
      if (const cudaError_t err = cudaEventSynchronize(p.layer_events[l]); err != cudaSuccess && status.ok()) {
        status = CudaStatus(err, "layer " + std::to_string(l) + " of a load by layer");
      }
      (void)cudaEventDestroy(p.layer_events[l]);
      if (status.ok()) p.batch.fence.Progress(static_cast<uint32_t>(l + 1), /*over=*/false);
    }
    p.layer_events.clear();
    if (p.event != nullptr) {
      if (const cudaError_t err = cudaEventSynchronize(p.event); err != cudaSuccess && status.ok()) {
        status = CudaStatus(err, "copy batch");
      }
      (void)cudaEventDestroy(p.event);
    }
    Finish(std::move(p), std::move(status), lane, *lane->health);
  }
}

// An engine batch's blocks split for its kernels: those as they are for the
// gather or scatter, fp8-coded ones for the encode or decode.
struct SplitBlocks {
  std::span<const BlockCopy> plain;  // the batch's own blocks when none is coded, else plain_split
  std::vector<BlockCopy> plain_split;
  std::vector<cuda::CodedBlock> coded;
  cuda::Fp8Shape shape;
};

// Errors: kInvalidArgument for coded blocks of a codec the GPU does not
// code (DecodesOnLoad, EncodesOnStore), kCorruption for a load's coded
// block not of fp8's size, kInvalidArgument for a store's.
Status Split(const CopyBatch& batch, SplitBlocks& l) {
  l.plain = batch.blocks;
  const uint64_t coded = std::ranges::count_if(batch.blocks, [](const BlockCopy& b) { return b.coded_bytes != 0; });
  if (coded == 0) return Status::Ok();
  if (batch.codec.kind != CodecKind::kFp8) {
    return InvalidArgument("the cuda backend codes " + std::string(CodecName(batch.codec.kind)) +
                           " blocks only between host memories");
  }
  l.shape = cuda::Fp8ShapeOf(batch.layout->layout().block_bytes(), batch.codec.group_elems,
                             batch.codec.dtype == DType::kBf16);
  const uint64_t want = uint64_t{l.shape.groups} * 4 + l.shape.elems;
  l.coded.reserve(coded);
  l.plain_split.reserve(batch.blocks.size() - coded);
  for (const BlockCopy& b : batch.blocks) {
    if (b.coded_bytes == 0) {
      l.plain_split.push_back(b);
    } else if (b.coded_bytes != want) {
      const std::string what = "an fp8 block of " + std::to_string(b.coded_bytes) + " bytes, where the layout's take " +
                               std::to_string(want);
      return batch.direction == CopyDirection::kSlotToEngine ? Status(StatusCode::kCorruption, what)
                                                             : InvalidArgument(what);
    } else {
      l.coded.push_back(cuda::CodedBlock{.engine_block = b.engine_block, .slot = b.slot});
    }
  }
  l.plain = l.plain_split;
  return Status::Ok();
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
    if (batch.direction != CopyDirection::kSlotToSlot && !batch.fence.Enter(p.fenced)) {
      return Status(StatusCode::kCancelled, "the client cancelled the op");
    }
    if (p.on_cpu) return Status::Ok();
    // A lost context fails every call: fail the batch before any of them.
    if (s.health.lost()) return s.health.status();
    ScopedDevice scope(device);
    KVTIER_RETURN_IF_ERROR(scope.status());
    // Errors left by earlier calls on this thread must not be taken for this
    // batch's launch error.
    (void)cudaGetLastError();
    if (batch.direction != CopyDirection::kSlotToSlot) {
      const bool store = batch.direction == CopyDirection::kEngineToSlot;
      SplitBlocks split;
      KVTIER_RETURN_IF_ERROR(Split(batch, split));
      // A load by layer copies layer after layer, each reported once in
      // place; fp8-coded blocks decode whole (their scales span layers), so
      // a load with any goes whole.
      const bool by_layer = !store && batch.by_layer && split.coded.empty() &&
                            batch.layout->layout().spec().num_layers > 1;
      KVTIER_ASSIGN_OR_RETURN(const PlanPieces plan, mapping->PlanFor(batch.layout, device, by_layer));
      if (!split.coded.empty()) {
        // A store's flag per coded block, a load's one.
        KVTIER_ASSIGN_OR_RETURN(p.codec_flags, s.codec_flags.Take(store ? split.coded.size() : 1));
      }
      queued_work = true;  // a launch that fails part way may have queued some of its kernels
      if (store) {
        KVTIER_CUDA_RETURN_IF_ERROR(cuda::LaunchGather(plan.all, split.plain, lane.stream),
                                    "launching the gather kernel");
        KVTIER_CUDA_RETURN_IF_ERROR(
            cuda::LaunchFp8Encode(plan.all, split.shape, split.coded, p.codec_flags.get(), lane.stream),
            "launching the fp8 encode kernel");
      } else if (by_layer) {
        for (uint32_t l = 0; l < plan.num_layers(); ++l) {
          KVTIER_CUDA_RETURN_IF_ERROR(cuda::LaunchScatter(plan.layer(l), split.plain, lane.stream),
                                      "launching the scatter kernel of a layer");
          cudaEvent_t layer_done = nullptr;
          KVTIER_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&layer_done, cudaEventDisableTiming),
                                      "creating a layer's event");
          p.layer_events.push_back(layer_done);  // destroyed by the completion thread
          KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(layer_done, lane.stream), "recording a layer's event");
        }
      } else {
        KVTIER_CUDA_RETURN_IF_ERROR(cuda::LaunchScatter(plan.all, split.plain, lane.stream),
                                    "launching the scatter kernel");
        KVTIER_CUDA_RETURN_IF_ERROR(
            cuda::LaunchFp8Decode(plan.all, split.shape, split.coded, p.codec_flags.get(), lane.stream),
            "launching the fp8 decode kernel");
      }
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
        Finish(std::move(w.pending), CudaStatus(q, "waiting for the engine's event"), nullptr, s.health);
      } else if (now > w.deadline) {
        Finish(std::move(w.pending),
               Status(StatusCode::kDeadlineExceeded, "the engine's event was not reached within " +
                                                         std::to_string(CudaBackend::kStoreEventTimeout.count()) + " s"),
               nullptr, s.health);
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
    Finish(std::move(w.pending), Status(StatusCode::kCancelled, "the cuda backend is shutting down"), nullptr,
           s.health);
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
      lane->health = &state->health;
      lane->device = d;
      KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&lane->stream, cudaStreamNonBlocking, priority),
                                  "cudaStreamCreateWithPriority");
      Result<std::unique_ptr<BlockCodec>> coder = BlockCodec::Create();
      if (!coder) return Err(coder.error().WithContext("cuda backend: a lane's codec"));
      lane->coder = std::move(*coder);
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
Status CudaBackend::health() const { return state_->health.status(); }

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
  if (state_->health.lost()) return Err(state_->health.status());
  auto mapping = std::make_shared<CudaClientMapping>(state_);
  if (Status st = mapping->Open(std::move(regions), std::move(events)); !st.ok()) {
    state_->health.Note(st);
    return Err(std::move(st));
  }
  return std::shared_ptr<ClientMapping>(std::move(mapping));
}

bool CudaBackend::Submit(CopyBatch batch, CopyDone done) {
  State& s = *state_;
  const bool engine = batch.direction != CopyDirection::kSlotToSlot;
  auto* mapping = engine ? dynamic_cast<CudaClientMapping*>(batch.mapping.get()) : nullptr;
  KVTIER_CHECK_MSG(!engine || mapping != nullptr, "a batch with a mapping the cuda backend did not make");
  KVTIER_CHECK_MSG(batch.wait_event < 0 || batch.signal_event < 0, "a batch with both events");
  KVTIER_CHECK_MSG(batch.gate == nullptr, "a store by layer on the cuda backend (GatesStoreLayers is false)");

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
    note(b.slot, batch.direction == CopyDirection::kEngineToSlot ? b.slot : nullptr,
         b.coded_bytes != 0 ? b.coded_bytes : block_bytes);
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
