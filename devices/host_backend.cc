#include "devices/host_backend.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sched.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stop_token>
#include <thread>

#include "common/check.h"
#include "common/memory_mapping.h"
#include "devices/reaper.h"
#include "kernels/copy_reference.h"

namespace kvtier {
namespace {

// A batch's copies go to the workers in tasks of about this many bytes at
// most (0.1 ms or so of memcpy).
constexpr uint64_t kTaskBytes = 1ull << 20;

// Engines' regions (a map each) waiting to be unmapped off the event loop,
// at most: half the headroom of maps the node budget keeps for kvtierd
// (NodeBudgets::kMapsHeadroom), which a closed session's maps still use
// until they are unmapped. Past it, they are unmapped where they are let go.
constexpr size_t kMaxMapsToUnmap = 512;

class HostArena final : public Arena {
 public:
  explicit HostArena(MemoryMapping mapping) : mapping_(std::move(mapping)) {}
  uint8_t* data() const override { return mapping_.data(); }
  uint64_t size_bytes() const override { return mapping_.size_bytes(); }

  // Faults the whole arena in on a thread of its own, a window at a time,
  // while copies may already use it (population never changes a byte). The
  // destructor stops it between windows.
  void PopulateInBackground(std::string what) {
    populate_ = std::jthread([this, what = std::move(what)](std::stop_token stop) {
      constexpr uint64_t kWindowBytes = 64ull << 20;
      const auto started = std::chrono::steady_clock::now();
      for (uint64_t offset = 0; offset < mapping_.size_bytes(); offset += kWindowBytes) {
        if (stop.stop_requested()) return;
        const Status s =
            mapping_.Populate(offset, std::min(kWindowBytes, mapping_.size_bytes() - offset));
        if (!s.ok()) {
          spdlog::warn(
              "{}: faulting its memory in stopped after {} of {} bytes ({}); the rest is faulted "
              "on first use",
              what, offset, mapping_.size_bytes(), s.ToString());
          return;
        }
      }
      spdlog::info(
          "{}: {} bytes faulted in ({:.2f} s)", what, mapping_.size_bytes(),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    });
  }

 private:
  MemoryMapping mapping_;
  std::jthread populate_;  // after mapping_: joined before the unmap
};

class HostClientMapping final : public ClientMapping {
 public:
  HostClientMapping(std::vector<MemoryMapping> mappings, std::shared_ptr<std::atomic<uint64_t>> live,
                    std::shared_ptr<Reaper> reaper)
      : mappings_(std::move(mappings)), live_(std::move(live)), reaper_(std::move(reaper)) {
    for (const MemoryMapping& m : mappings_) bases_.push_back(m.data());
    live_->fetch_add(1, std::memory_order_relaxed);  // a statistic; no ordering needed
  }
  ~HostClientMapping() override {
    live_->fetch_sub(1, std::memory_order_relaxed);
    // Unmapped on the reaper's thread: the last reference often goes on the
    // event loop (its session closed), and unmapping a populated engine
    // cache takes tens of ms per 256 MiB.
    auto mappings = std::make_shared<std::vector<MemoryMapping>>(std::move(mappings_));
    reaper_->Run([mappings] { mappings->clear(); }, mappings->size());
  }
  std::span<uint8_t* const> region_bases() const override { return bases_; }

 private:
  std::vector<MemoryMapping> mappings_;
  std::vector<uint8_t*> bases_;
  std::shared_ptr<std::atomic<uint64_t>> live_;
  std::shared_ptr<Reaper> reaper_;
};

Result<std::unique_ptr<HostArena>> AnonymousArena(uint64_t size_bytes, const char* what) {
  Result<MemoryMapping> m = MemoryMapping::Anonymous(size_bytes);
  if (!m) return Err(m.error().WithContext(std::string("allocating the ") + what + " arena"));
  // On this project's virtio disk, reads of 2 MiB records into the host
  // tier went from 1.9 to 2.7 GB/s with it (docs/benchmarks.md).
  m->AdviseHugePages();
  return std::make_unique<HostArena>(std::move(*m));
}

}  // namespace

struct HostBackend::Batch {
  CopyBatch copies;
  CopyPlan plan;  // engine copies: the layout resolved over the mapping
  CopyDone done;
  std::vector<uint64_t> checksums;      // each task writes only its own range
  std::atomic<size_t> tasks_left{0};    // acq_rel: the last task sees every write
  Mutex mu;
  Status status KVTIER_GUARDED_BY(mu);  // the first failure of a task
  // By layer: each layer's tasks not done yet, and the layers done in order.
  std::vector<uint32_t> layer_tasks_left KVTIER_GUARDED_BY(mu);
  uint32_t layers_done KVTIER_GUARDED_BY(mu) = 0;
  // A store by layer (CopyBatch::gate): its copy tasks not done yet, then
  // its checksum tasks' ranges (queued when they are); whether its gate
  // aborted (no copy runs after).
  std::atomic<size_t> copy_tasks_left{0};
  std::vector<std::pair<size_t, size_t>> checksum_ranges;
  std::atomic<bool> aborted{false};
};

struct HostBackend::Worker {
  std::unique_ptr<BlockCodec> codec;
  std::vector<uint8_t> scratch;
};

Result<std::unique_ptr<HostBackend>> HostBackend::Create(const Options& options) {
  if (options.copy_threads == 0) return Err(InvalidArgument("host backend: copy_threads must be >= 1"));
  std::vector<std::unique_ptr<Worker>> workers;
  for (uint32_t i = 0; i < options.copy_threads; ++i) {
    Result<std::unique_ptr<BlockCodec>> codec = BlockCodec::Create();
    if (!codec) return Err(codec.error().WithContext("host backend: a copy thread's codec"));
    workers.push_back(std::make_unique<Worker>(Worker{.codec = std::move(*codec), .scratch = {}}));
  }
  std::shared_ptr<Reaper> reaper =
      options.reaper != nullptr ? options.reaper : std::make_shared<Reaper>(kMaxMapsToUnmap);
  return std::unique_ptr<HostBackend>(new HostBackend(std::move(workers), options.populate_host, std::move(reaper)));
}

HostBackend::HostBackend(std::vector<std::unique_ptr<Worker>> workers, bool populate_host,
                         std::shared_ptr<Reaper> reaper)
    : num_threads_(static_cast<uint32_t>(workers.size())),
      populate_host_(populate_host),
      workers_(std::move(workers)),
      live_mappings_(std::make_shared<std::atomic<uint64_t>>(0)),
      reaper_(std::move(reaper)) {
  threads_.reserve(num_threads_);
  for (uint32_t i = 0; i < num_threads_; ++i) threads_.emplace_back([this, i] { WorkerLoop(*workers_[i]); });
}

HostBackend::~HostBackend() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  work_cv_.SignalAll();
  for (std::thread& t : threads_) t.join();
}

Result<std::unique_ptr<Arena>> HostBackend::AllocateDeviceArena(int /*device*/, uint64_t size_bytes) {
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<HostArena> arena,
                          AnonymousArena(size_bytes, "hbm (host stand-in)"));
  return std::unique_ptr<Arena>(std::move(arena));
}

Result<std::unique_ptr<Arena>> HostBackend::AllocateHostArena(uint64_t size_bytes) {
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<HostArena> arena, AnonymousArena(size_bytes, "host"));
  if (populate_host_) arena->PopulateInBackground("host tier");
  return std::unique_ptr<Arena>(std::move(arena));
}

Result<MemoryMapping> HostBackend::MapSealedMemfd(const ClientRegionHandle& r, const std::string& what) {
  if (r.kind != ClientMemoryKind::kHostMemfd || !r.memfd.valid()) {
    return Err(InvalidArgument(what + ": not a memfd region"));
  }
  if (r.size_bytes == 0) return Err(InvalidArgument(what + ": size is 0"));
  // Seals first: a size checked before the seal could shrink in between.
  const int seals = ::fcntl(r.memfd.get(), F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return Err(InvalidArgument(what + ": the memfd must be sealed with F_SEAL_SHRINK "
                                      "(kvtier::ShmKvCache does this)"));
  }
  struct stat st {};
  if (::fstat(r.memfd.get(), &st) != 0) return Err(Status::FromErrno(errno, what + ": fstat"));
  if (static_cast<uint64_t>(st.st_size) < r.size_bytes) {
    return Err(InvalidArgument(what + ": the memfd holds " + std::to_string(st.st_size) +
                               " bytes, less than the " + std::to_string(r.size_bytes) + " registered"));
  }
  Result<MemoryMapping> m = MemoryMapping::Map(MemoryMapping::Options{
      .size_bytes = r.size_bytes, .prot = PROT_READ | PROT_WRITE, .flags = MAP_SHARED, .fd = r.memfd.get()});
  if (!m) return Err(m.error().WithContext(what));
  return m;
}

std::string HostBackend::Describe() const {
  return "host: " + std::to_string(num_threads_) + " copy thread(s)";
}

Result<std::shared_ptr<ClientMapping>> HostBackend::MapClientMemory(std::vector<ClientRegionHandle> regions,
                                                                    std::vector<IpcEventHandle> events) {
  if (!events.empty()) {
    return Err(InvalidArgument("CUDA IPC events need the cuda device backend; this daemon runs host"));
  }
  std::vector<MemoryMapping> mappings;
  for (size_t i = 0; i < regions.size(); ++i) {
    const std::string what = "region " + std::to_string(i);
    if (regions[i].kind != ClientMemoryKind::kHostMemfd) {
      return Err(InvalidArgument(what + ": the host backend maps memfd regions only"));
    }
    KVTIER_ASSIGN_OR_RETURN(MemoryMapping m, MapSealedMemfd(regions[i], what));
    mappings.push_back(std::move(m));
  }
  return std::shared_ptr<ClientMapping>(new HostClientMapping(std::move(mappings), live_mappings_, reaper_));
}

uint64_t HostBackend::live_mappings() const { return live_mappings_->load(std::memory_order_relaxed); }

bool HostBackend::Submit(CopyBatch batch, CopyDone done) {
  KVTIER_CHECK_MSG(batch.wait_event < 0 && batch.signal_event < 0, "the host backend has no events");
  KVTIER_CHECK_MSG(batch.direction != CopyDirection::kEngineToSlot ||
                       std::ranges::none_of(batch.blocks, [](const BlockCopy& b) { return b.coded_bytes != 0; }),
                   "a coded store on the host backend, which codes none on the way (EncodesOnStore)");
  KVTIER_CHECK_MSG(batch.gate == nullptr || batch.direction == CopyDirection::kEngineToSlot,
                   "a layer gate on a batch that is not a store");
  // Held by the gate's opener from here on, not by the batch: the op's
  // owner lets go of the gate, which then aborts if it is not open yet.
  const std::shared_ptr<LayerGate> gate = std::move(batch.gate);
  auto b = std::make_shared<Batch>();
  const bool engine = batch.direction != CopyDirection::kSlotToSlot;
  const size_t n = engine ? batch.blocks.size() : batch.slot_copies.size();
  // Coded blocks decode whole (one pass over a block per decode).
  batch.by_layer = gate != nullptr || (batch.by_layer && batch.direction == CopyDirection::kSlotToEngine &&
                                       std::ranges::none_of(batch.blocks, [](const BlockCopy& c) {
                                         return c.coded_bytes != 0;
                                       }));
  if (batch.checksum_destination) b->checksums.assign(n, 0);
  if (engine) b->plan = CopyPlan::Build(*batch.layout, MappedRegions{batch.mapping->region_bases()}, batch.by_layer);
  b->copies = std::move(batch);
  b->done = std::move(done);
  if (n == 0) {
    b->done(CopyResult{});
    return true;
  }
  uint64_t bytes = 0;
  if (engine) {
    bytes = n * b->plan.block_bytes();
  } else {
    for (const SlotCopy& c : b->copies.slot_copies) bytes += c.size_bytes;
  }
  std::vector<Task> tasks = SplitIntoTasks(b, n, std::max<uint64_t>(1, bytes / n));
  if (gate == nullptr) {
    b->tasks_left.store(tasks.size(), std::memory_order_relaxed);
    Queue(std::move(tasks));
    return true;
  }
  // Checksums once every layer is in the slots, in tasks of about the same
  // number of blocks as the copies'.
  const size_t per_task = tasks.front().end - tasks.front().begin;
  if (b->copies.checksum_destination) {
    for (size_t begin = 0; begin < n; begin += per_task) {
      b->checksum_ranges.emplace_back(begin, std::min(n, begin + per_task));
    }
  }
  b->copy_tasks_left.store(tasks.size(), std::memory_order_relaxed);
  b->tasks_left.store(tasks.size() + b->checksum_ranges.size(), std::memory_order_relaxed);
  Hold(b, std::move(tasks), *gate);
  return true;
}

void HostBackend::Queue(std::vector<Task> tasks) {
  if (tasks.empty()) return;
  const Batch& b = *tasks.front().batch;
  const bool engine = b.copies.direction != CopyDirection::kSlotToSlot;
  const auto priority = static_cast<size_t>(b.copies.priority);
  KVTIER_CHECK(priority < kNumCopyPriorities);
  // A task's cost in its flow's share: the bytes it copies.
  auto cost = [&](const Task& t) -> uint64_t {
    if (engine) return (t.end - t.begin) * b.plan.block_bytes() / (t.layer < kChecksums ? b.plan.num_layers() : 1);
    uint64_t sum = 0;
    for (size_t i = t.begin; i < t.end; ++i) sum += b.copies.slot_copies[i].size_bytes;
    return sum;
  };
  {
    MutexLock lock(&mu_);
    for (Task& t : tasks) {
      const uint64_t c = cost(t);
      queues_[priority].Push(b.copies.flow, c, std::move(t));
    }
  }
  work_cv_.SignalAll();
}

void HostBackend::Hold(const std::shared_ptr<Batch>& b, std::vector<Task> tasks, LayerGate& gate) {
  // SplitIntoTasks: the same number of tasks for each layer, in layer order.
  const size_t per_layer = tasks.size() / b->plan.num_layers();
  auto held = std::make_shared<std::vector<Task>>(std::move(tasks));
  gate.Attach([this, b, held, per_layer, queued = size_t{0}](uint32_t open, bool aborted) mutable {
    if (aborted) {
      b->aborted.store(true, std::memory_order_release);
      MutexLock lock(&b->mu);
      if (b->status.ok()) {
        b->status = Status(StatusCode::kCancelled,
                           "the engine did not write every layer of the store (its session ended, or "
                           "limits.store_layers_timeout_ms passed, or it cancelled the store)");
      }
    }
    // Aborted: the rest go too, and copy nothing (RunTask).
    const size_t upto = aborted ? held->size() : std::min(held->size(), open * per_layer);
    if (upto <= queued) return;
    std::vector<Task> now(std::make_move_iterator(held->begin() + static_cast<std::ptrdiff_t>(queued)),
                          std::make_move_iterator(held->begin() + static_cast<std::ptrdiff_t>(upto)));
    queued = upto;
    Queue(std::move(now));
  });
}

std::vector<HostBackend::Task> HostBackend::SplitIntoTasks(const std::shared_ptr<Batch>& b, size_t n,
                                                           uint64_t copy_bytes) const {
  const uint32_t layers = b->copies.by_layer ? b->plan.num_layers() : 1;
  const uint64_t per_copy = std::max<uint64_t>(1, copy_bytes / layers);
  const size_t most_per_task = std::max<uint64_t>(1, kTaskBytes / per_copy);
  const size_t num = std::max(std::min(n, size_t{num_threads_} * 2), (n + most_per_task - 1) / most_per_task);
  const size_t per_task = (n + num - 1) / num;
  std::vector<Task> tasks;
  for (uint32_t layer = 0; layer < layers; ++layer) {
    for (size_t begin = 0; begin < n; begin += per_task) {
      tasks.push_back(Task{b, begin, std::min(n, begin + per_task), b->copies.by_layer ? layer : kAllLayers});
    }
  }
  if (b->copies.by_layer) {
    MutexLock lock(&b->mu);
    b->layer_tasks_left.assign(layers, static_cast<uint32_t>(tasks.size() / layers));
  }
  return tasks;
}

void HostBackend::LayerCopied(Batch& b, uint32_t layer) {
  uint32_t done = 0;
  {
    MutexLock lock(&b.mu);
    if (!b.status.ok()) return;  // a failed batch reports no more layers
    --b.layer_tasks_left[layer];
    const uint32_t before = b.layers_done;
    while (b.layers_done < b.layer_tasks_left.size() && b.layer_tasks_left[b.layers_done] == 0) ++b.layers_done;
    if (b.layers_done == before) return;
    done = b.layers_done;
  }
  // Raises only: reports from two workers may arrive in either order.
  b.copies.fence.Progress(done, /*over=*/false);
}

void HostBackend::RunTask(const Task& task, Worker& worker) {
  Batch& b = *task.batch;
  const CopyBatch& c = b.copies;
  if (task.layer == kChecksums) {
    // Slots only (no engine memory): after every layer's copy.
    bool ok = false;
    {
      MutexLock lock(&b.mu);
      ok = b.status.ok();
    }
    for (size_t i = task.begin; ok && i < task.end; ++i) {
      b.checksums[i] = ChecksumOf(c.blocks[i].slot, b.plan.block_bytes());
    }
  } else {
    CopyTask(task, worker);
  }
  if (b.tasks_left.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    // Let go of the client's mapping and layout before `done` runs: the
    // other tasks of the batch may still hold the Batch for a moment, and
    // whoever learns of the completion must see the mapping released
    // (live_mappings of a dead client reaches 0 with its last completion).
    CopyDone done = std::move(b.done);
    Status status;
    {
      MutexLock lock(&b.mu);
      status = std::move(b.status);
    }
    CopyResult result{.status = std::move(status), .checksums = std::move(b.checksums)};
    b.copies = CopyBatch{};
    done(std::move(result));
  }
}

void HostBackend::CopyTask(const Task& task, Worker& worker) {
  Batch& b = *task.batch;
  const CopyBatch& c = b.copies;
  // Held across this task's copies: a client that cancels the op waits for
  // them, and none starts once it has. A store whose gate aborted copies
  // nothing more.
  OpFence::Entry fenced;
  const bool go = c.direction == CopyDirection::kSlotToSlot ||
                  (!b.aborted.load(std::memory_order_acquire) && c.fence.Enter(fenced));
  if (!go) {
    MutexLock lock(&b.mu);
    if (b.status.ok()) b.status = Status(StatusCode::kCancelled, "the client cancelled the op");
  }
  for (size_t i = task.begin; go && i < task.end; ++i) {
    uint64_t* checksum = c.checksum_destination ? &b.checksums[i] : nullptr;
    switch (c.direction) {
      case CopyDirection::kEngineToSlot:
        if (task.layer != kAllLayers) {
          GatherBlockLayer(b.plan, c.blocks[i].engine_block, task.layer, c.blocks[i].slot);
        } else {
          GatherBlock(b.plan, c.blocks[i].engine_block, c.blocks[i].slot, checksum);
        }
        break;
      case CopyDirection::kSlotToEngine:
        if (task.layer != kAllLayers) {
          ScatterBlockLayer(b.plan, c.blocks[i].engine_block, task.layer, c.blocks[i].slot);
        } else if (c.blocks[i].coded_bytes == 0) {
          ScatterBlock(b.plan, c.blocks[i].engine_block, c.blocks[i].slot);
        } else if (Status st = DecodeAndScatter(*worker.codec, c.codec,
                                                std::span<const uint8_t>(c.blocks[i].slot, c.blocks[i].coded_bytes),
                                                b.plan, c.blocks[i].engine_block, worker.scratch);
                   !st.ok()) {
          MutexLock lock(&b.mu);
          if (b.status.ok()) b.status = std::move(st);
        }
        break;
      case CopyDirection::kSlotToSlot: {
        const SlotCopy& sc = c.slot_copies[i];
        if (checksum != nullptr) {
          *checksum = CopyWithChecksum(sc.dst, sc.src, sc.size_bytes);
        } else {
          CopyStreaming(sc.dst, sc.src, sc.size_bytes);
        }
        break;
      }
    }
  }
  fenced = OpFence::Entry();
  if (c.direction == CopyDirection::kSlotToEngine) {
    if (go && task.layer != kAllLayers) LayerCopied(b, task.layer);
  } else if (task.layer != kAllLayers && b.copy_tasks_left.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    // A store by layer's last copy: every layer is in the slots.
    std::vector<Task> checksums;
    for (const auto& [begin, end] : b.checksum_ranges) checksums.push_back(Task{task.batch, begin, end, kChecksums});
    Queue(std::move(checksums));
  }
}

void HostBackend::WorkerLoop(Worker& worker) {
  while (true) {
    Task task;
    {
      MutexLock lock(&mu_);
      while (true) {
        auto queue = std::ranges::find_if(queues_, [](const FairShareQueue<Task>& q) { return !q.empty(); });
        if (queue != std::end(queues_)) {
          task = *queue->Pop();
          break;
        }
        if (stopping_) return;  // only once every queue is drained
        work_cv_.Wait(&mu_);
      }
    }
    RunTask(task, worker);
    // Copies are the daemon's bulk work; the event loop (and engines'
    // threads) are waiting on them in short turns. Where the cores are all
    // busy, let whoever else is runnable on this core go first, so that
    // the loop waits for one task, not for the scheduler's slice (several
    // ms: measured by kvtier-bench abuse --sessions 64). Without a
    // runnable other, it returns at once.
    ::sched_yield();
  }
}

}  // namespace kvtier
