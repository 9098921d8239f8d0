#include "devices/host_backend.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <latch>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/memory_mapping.h"
#include "common/mutex.h"
#include "devices/reaper.h"
#include "kernels/codec.h"
#include "tests/tiers/tiers_test_util.h"

namespace kvtier {
namespace {

using tiers_test::EngineMemory;
using tiers_test::MakeMemfd;
using tiers_test::MemfdHandle;
using tiers_test::PatternFor;
using tiers_test::SmallSpec;
using tiers_test::WorkerGate;

std::unique_ptr<HostBackend> MakeBackend(uint32_t threads) {
  Result<std::unique_ptr<HostBackend>> b =
      HostBackend::Create(HostBackend::Options{.copy_threads = threads});
  EXPECT_TRUE(b.has_value()) << b.error();
  return std::move(*b);
}

StoredKey KeyN(uint32_t n) {
  StoredKey key;
  std::memcpy(key.bytes.data(), &n, sizeof(n));
  key.bytes[15] = 0xa7;
  return key;
}

// Waits for `n` completions and keeps what they returned. Everything a
// completion does happens under the mutex, so once Wait() returns no worker
// touches this object again.
class Completions {
 public:
  explicit Completions(size_t n) : left_(n) {}
  CopyDone Done(int id) {
    return [this, id](CopyResult r) {
      MutexLock lock(&mu_);
      order_.push_back(id);
      results_.push_back(std::move(r));
      ++calls_[id];
      if (--left_ == 0) cv_.SignalAll();
    };
  }
  void Wait() {
    MutexLock lock(&mu_);
    while (left_ != 0) cv_.Wait(&mu_);
  }
  std::vector<int> order() {
    MutexLock lock(&mu_);
    return order_;
  }
  std::vector<CopyResult> results() {
    MutexLock lock(&mu_);
    return results_;
  }
  std::map<int, int> calls() {
    MutexLock lock(&mu_);
    return calls_;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  size_t left_ KVTIER_GUARDED_BY(mu_);
  std::vector<int> order_ KVTIER_GUARDED_BY(mu_);
  std::vector<CopyResult> results_ KVTIER_GUARDED_BY(mu_);
  std::map<int, int> calls_ KVTIER_GUARDED_BY(mu_);
};

TEST(HostBackendTest, RejectsZeroThreads) {
  Result<std::unique_ptr<HostBackend>> b =
      HostBackend::Create(HostBackend::Options{.copy_threads = 0});
  ASSERT_FALSE(b.has_value());
  EXPECT_EQ(b.error().code(), StatusCode::kInvalidArgument);
}

TEST(HostBackendTest, ArenasArePageAlignedAndWritable) {
  auto backend = MakeBackend(1);
  EXPECT_EQ(backend->name(), "host");
  for (bool device : {false, true}) {
    Result<std::unique_ptr<Arena>> a =
        device ? backend->AllocateDeviceArena(0, 1 << 20) : backend->AllocateHostArena(1 << 20);
    ASSERT_TRUE(a.has_value()) << a.error();
    EXPECT_EQ((*a)->size_bytes(), uint64_t{1} << 20);
    EXPECT_EQ(reinterpret_cast<uintptr_t>((*a)->data()) % 4096, 0u);
    std::memset((*a)->data(), 0xab, (*a)->size_bytes());
    EXPECT_EQ((*a)->data()[(1 << 20) - 1], 0xab);
  }
}

// The VmFlags line of /proc/self/smaps for the mapping holding `p`.
std::string VmFlagsOf(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find('-')) {
      inside = lo <= at && at < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

TEST(HostBackendTest, ArenasAskForHugePages) {
  // 2 MiB pages: a 2 MiB block is then one segment for the disk's DMA (a
  // virtio disk read 1.4x faster so) and one TLB entry for a copy. Only
  // advice: the kernel may still back it with 4 KiB pages.
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled")) {
    GTEST_SKIP() << "this kernel has no transparent huge pages (MADV_HUGEPAGE is refused)";
  }
  auto backend = MakeBackend(1);
  for (bool device : {false, true}) {
    Result<std::unique_ptr<Arena>> a =
        device ? backend->AllocateDeviceArena(0, 8 << 20) : backend->AllocateHostArena(8 << 20);
    ASSERT_TRUE(a.has_value()) << a.error();
    const std::string flags = VmFlagsOf((*a)->data());
    ASSERT_FALSE(flags.empty()) << "no smaps entry for the arena";
    EXPECT_THAT(flags, testing::HasSubstr(" hg")) << (device ? "device" : "host") << " arena: " << flags;
  }
}

TEST(HostBackendTest, DoneRunsExactlyOncePerBatch) {
  auto backend = MakeBackend(2);
  constexpr int kBatches = 40;
  std::vector<std::vector<uint8_t>> src(kBatches), dst(kBatches);
  Completions c(kBatches);
  std::mt19937 rng(3);
  for (int i = 0; i < kBatches; ++i) {
    // From 0 to 99 copies per batch, so batches split into 1..4 tasks.
    const size_t copies = static_cast<size_t>(i == 0 ? 0 : rng() % 100);
    src[i].resize(copies * 100);
    dst[i].assign(copies * 100, 0);
    for (auto& b : src[i]) b = static_cast<uint8_t>(rng());
    CopyBatch batch{.direction = CopyDirection::kSlotToSlot,
                    .priority = static_cast<CopyPriority>(i % kNumCopyPriorities)};
    for (size_t j = 0; j < copies; ++j) {
      batch.slot_copies.push_back(SlotCopy{src[i].data() + j * 100, dst[i].data() + j * 100, 100});
    }
    backend->Submit(std::move(batch), c.Done(i));
  }
  c.Wait();
  for (const auto& [id, calls] : c.calls()) EXPECT_EQ(calls, 1) << "batch " << id;
  EXPECT_EQ(c.calls().size(), size_t{kBatches});
  for (int i = 0; i < kBatches; ++i) EXPECT_EQ(src[i], dst[i]) << "batch " << i;
  for (const CopyResult& r : c.results()) {
    EXPECT_TRUE(r.status.ok());
    EXPECT_TRUE(r.checksums.empty()) << "no checksums unless asked";
  }
}

TEST(HostBackendTest, DestructionFinishesQueuedCopies) {
  std::vector<uint8_t> src(1 << 16, 0x5c), dst(1 << 16, 0);
  std::atomic<int> done{0};  // relaxed is enough: the join orders it
  {
    auto backend = MakeBackend(1);
    WorkerGate gate(*backend);
    for (int i = 0; i < 16; ++i) {
      CopyBatch batch{
          .direction = CopyDirection::kSlotToSlot,
          .priority = CopyPriority::kBackground,
          .slot_copies = {SlotCopy{src.data() + i * 4096, dst.data() + i * 4096, 4096}}};
      backend->Submit(std::move(batch),
                      [&done](CopyResult) { done.fetch_add(1, std::memory_order_relaxed); });
    }
    gate.Release();
  }  // ~HostBackend: the queue is drained first
  EXPECT_EQ(done.load(std::memory_order_relaxed), 16);
  EXPECT_EQ(src, dst);
}

TEST(HostBackendTest, LoadsRunBeforeStoresBeforeBackground) {
  auto backend = MakeBackend(1);
  uint8_t src[64] = {}, dst[64] = {};
  auto batch = [&](CopyPriority p) {
    return CopyBatch{.direction = CopyDirection::kSlotToSlot,
                     .priority = p,
                     .slot_copies = {SlotCopy{src, dst, sizeof(src)}}};
  };
  Completions c(41);
  {
    WorkerGate gate(*backend);  // the only worker is busy from here on
    for (int i = 0; i < 30; ++i) backend->Submit(batch(CopyPriority::kBackground), c.Done(100 + i));
    for (int i = 0; i < 10; ++i) backend->Submit(batch(CopyPriority::kStore), c.Done(200 + i));
    backend->Submit(batch(CopyPriority::kLoad), c.Done(1));
  }  // the gate opens
  c.Wait();
  std::vector<int> want = {1};
  for (int i = 0; i < 10; ++i) want.push_back(200 + i);
  for (int i = 0; i < 30; ++i) want.push_back(100 + i);
  EXPECT_EQ(c.order(), want) << "by priority, FIFO within one";
}

// A tenant's burst does not hold up another tenant's copy of the same
// priority: flows are served in turn, each in order.
TEST(HostBackendTest, FlowsOfOnePriorityTakeTurns) {
  auto backend = MakeBackend(1);
  uint8_t src[64] = {}, dst[64] = {};
  auto batch = [&](uint32_t flow) {
    return CopyBatch{.direction = CopyDirection::kSlotToSlot,
                     .priority = CopyPriority::kLoad,
                     .flow = flow,
                     .slot_copies = {SlotCopy{src, dst, sizeof(src)}}};
  };
  Completions c(33);
  {
    WorkerGate gate(*backend);
    for (int i = 0; i < 30; ++i) backend->Submit(batch(1), c.Done(100 + i));  // a burst of tenant 1
    backend->Submit(batch(2), c.Done(200));  // then tenant 2's load
    backend->Submit(batch(7), c.Done(700));
    backend->Submit(batch(2), c.Done(201));
  }
  c.Wait();
  const std::vector<int> order = c.order();
  ASSERT_EQ(order.size(), 33u);
  // Turns: 1, 2, 7, 1, 2, then the rest of 1's burst.
  const std::vector<int> head(order.begin(), order.begin() + 5);
  EXPECT_EQ(head, (std::vector<int>{100, 200, 700, 101, 201}));
  for (int i = 2; i < 30; ++i)
    EXPECT_EQ(order[static_cast<size_t>(i) + 3], 100 + i) << "one flow's copies stay in order";
}

// Flows share the workers by bytes, not by copies (issue 46): a tenant of
// 256 KiB blocks gets no more than a tenant of 4 KiB blocks.
TEST(HostBackendTest, FlowsShareTheWorkersByBytes) {
  auto backend = MakeBackend(1);
  std::vector<uint8_t> big_src(256 * 1024), big_dst(256 * 1024), small_src(4096), small_dst(4096);
  auto batch = [&](uint32_t flow, std::vector<uint8_t>& src, std::vector<uint8_t>& dst) {
    return CopyBatch{.direction = CopyDirection::kSlotToSlot,
                     .priority = CopyPriority::kLoad,
                     .flow = flow,
                     .slot_copies = {SlotCopy{src.data(), dst.data(), src.size()}}};
  };
  Completions c(8 + 256);
  {
    WorkerGate gate(*backend);
    for (int i = 0; i < 8; ++i) backend->Submit(batch(1, big_src, big_dst), c.Done(100 + i));
    for (int i = 0; i < 256; ++i) backend->Submit(batch(2, small_src, small_dst), c.Done(1000 + i));
  }
  c.Wait();
  // Tenant 2's 4 KiB copies between tenant 1's second and third: 64 of them
  // (256 KiB), give or take the one whose turn it was.
  const std::vector<int> order = c.order();
  const auto second = std::find(order.begin(), order.end(), 101);
  const auto third = std::find(order.begin(), order.end(), 102);
  ASSERT_LT(second, third);
  EXPECT_NEAR(third - second - 1, 64, 1) << "tenant 2's copies between two of tenant 1's";
}

// A batch is cut into tasks of at most about 1 MiB: a tenant's 16 MiB load
// holds the only worker for one task, not half the batch, before another
// tenant's load runs.
TEST(HostBackendTest, ALargeBatchHoldsAWorkerForOneTaskOfAtMostAMebibyte) {
  auto backend = MakeBackend(1);
  constexpr size_t kCopies = 64, kCopyBytes = 256 * 1024;
  std::vector<uint8_t> src(kCopies * kCopyBytes, 0xab), dst(kCopies * kCopyBytes, 0);
  std::vector<SlotCopy> copies;
  for (size_t i = 0; i < kCopies; ++i) copies.push_back({&src[i * kCopyBytes], &dst[i * kCopyBytes], kCopyBytes});
  uint8_t small_src[64] = {}, small_dst[64] = {};
  std::atomic<size_t> copied_before{SIZE_MAX};
  Completions c(2);
  {
    WorkerGate gate(*backend);
    backend->Submit(CopyBatch{.direction = CopyDirection::kSlotToSlot,
                              .priority = CopyPriority::kLoad,
                              .flow = 1,
                              .slot_copies = copies},
                    c.Done(1));
    CopyDone done = c.Done(2);
    backend->Submit(CopyBatch{.direction = CopyDirection::kSlotToSlot,
                              .priority = CopyPriority::kLoad,
                              .flow = 2,
                              .slot_copies = {SlotCopy{small_src, small_dst, sizeof(small_src)}}},
                    [&, done](CopyResult r) {
                      // On the only worker: tenant 1's tasks are not running.
                      copied_before = static_cast<size_t>(std::count(dst.begin(), dst.end(), 0xab));
                      done(std::move(r));
                    });
  }
  c.Wait();
  EXPECT_EQ(c.order(), (std::vector<int>{2, 1}));
  EXPECT_LE(copied_before.load(), size_t{1} << 20) << "bytes of tenant 1's load copied before tenant 2's ran";
  EXPECT_EQ(dst, src);
}

TEST(HostBackendTest, SlotCopyChecksumsAreXxh3OfTheDestination) {
  auto backend = MakeBackend(2);
  constexpr size_t kCopies = 9;
  std::vector<std::vector<uint8_t>> src(kCopies), dst(kCopies);
  std::mt19937 rng(11);
  CopyBatch batch{.direction = CopyDirection::kSlotToSlot,
                  .priority = CopyPriority::kBackground,
                  .checksum_destination = true};
  for (size_t i = 0; i < kCopies; ++i) {
    // The last one spans several of the copy's 256 KiB hashing chunks.
    src[i].resize(i + 1 < kCopies ? 1000 + i * 777 : (600 << 10) + 13);
    for (auto& b : src[i]) b = static_cast<uint8_t>(rng());
    dst[i].assign(src[i].size(), 0);
    batch.slot_copies.push_back(SlotCopy{src[i].data(), dst[i].data(), src[i].size()});
  }
  Completions c(1);
  backend->Submit(std::move(batch), c.Done(0));
  c.Wait();
  const std::vector<CopyResult> results = c.results();
  ASSERT_EQ(results.size(), 1u);
  ASSERT_TRUE(results[0].status.ok());
  ASSERT_EQ(results[0].checksums.size(), kCopies);
  for (size_t i = 0; i < kCopies; ++i) {
    EXPECT_EQ(dst[i], src[i]);
    EXPECT_EQ(results[0].checksums[i], XXH3_64bits(dst[i].data(), dst[i].size())) << i;
  }
}

TEST(HostBackendTest, GatherAndScatterThroughAClientMapping) {
  auto backend = MakeBackend(2);
  Result<std::unique_ptr<EngineMemory>> engine_or = EngineMemory::Create(*backend, SmallSpec(), 16);
  ASSERT_TRUE(engine_or.has_value()) << engine_or.error();
  EngineMemory& engine = **engine_or;
  const uint64_t bytes = engine.block_bytes();
  for (uint32_t b = 0; b < 8; ++b) engine.Fill(b, KeyN(b));
  std::vector<uint8_t> slots(8 * bytes, 0);

  CopyBatch gather{.direction = CopyDirection::kEngineToSlot,
                   .priority = CopyPriority::kStore,
                   .layout = engine.layout(),
                   .mapping = engine.mapping(),
                   .checksum_destination = true};
  for (uint32_t b = 0; b < 8; ++b) gather.blocks.push_back(BlockCopy{b, slots.data() + b * bytes});
  Completions g(1);
  backend->Submit(std::move(gather), g.Done(0));
  g.Wait();
  const std::vector<CopyResult> gathered = g.results();
  ASSERT_TRUE(gathered[0].status.ok());
  ASSERT_EQ(gathered[0].checksums.size(), 8u);
  for (uint32_t b = 0; b < 8; ++b) {
    // Contiguous layout: a slot is byte for byte the engine block.
    EXPECT_EQ(std::memcmp(slots.data() + b * bytes, engine.block(b).data(), bytes), 0) << b;
    EXPECT_EQ(gathered[0].checksums[b], XXH3_64bits(slots.data() + b * bytes, bytes)) << b;
  }

  engine.ZeroAll();
  CopyBatch scatter{.direction = CopyDirection::kSlotToEngine,
                    .priority = CopyPriority::kLoad,
                    .layout = engine.layout(),
                    .mapping = engine.mapping()};
  for (uint32_t b = 0; b < 8; ++b)
    scatter.blocks.push_back(BlockCopy{15 - b, slots.data() + b * bytes});
  Completions s(1);
  backend->Submit(std::move(scatter), s.Done(0));
  s.Wait();
  ASSERT_TRUE(s.results()[0].status.ok());
  for (uint32_t b = 0; b < 8; ++b) {
    EXPECT_TRUE(engine.Holds(15 - b, KeyN(b)));
    EXPECT_TRUE(engine.IsZero(b));
  }
}

// A load by layer (CopyBatch::by_layer): layers reach the engine in order,
// and each is reported through the fence once it is in place in every
// block, while later layers are still being copied. A contiguous layout
// keeps a block's layers in order in the engine too, so the first p layers
// of each block are its first p * layer_bytes bytes.
TEST(HostBackendTest, ALoadByLayerReportsEachLayerOnceEveryBlockHasIt) {
  auto backend = MakeBackend(2);
  constexpr uint32_t kLayers = 16, kBlocks = 256;
  Result<std::unique_ptr<EngineMemory>> engine_or = EngineMemory::Create(*backend, SmallSpec(kLayers), kBlocks);
  ASSERT_TRUE(engine_or.has_value()) << engine_or.error();
  EngineMemory& engine = **engine_or;
  const uint64_t bytes = engine.block_bytes();
  std::vector<uint8_t> slots(kBlocks * bytes);
  for (uint32_t b = 0; b < kBlocks; ++b) {
    PatternFor(KeyN(b), std::span<uint8_t>(slots.data() + b * bytes, bytes));
  }
  auto page = std::make_shared<FencePage>(MemoryMapping::Anonymous(FencePage::kBytes).value());
  page->Open(5, 77);
  CopyBatch load{.direction = CopyDirection::kSlotToEngine,
                 .priority = CopyPriority::kLoad,
                 .layout = engine.layout(),
                 .mapping = engine.mapping(),
                 .fence = OpFence(page, 5, 77),
                 .by_layer = true};
  // Reversed, so that engine block e gets slot kBlocks - 1 - e.
  for (uint32_t b = 0; b < kBlocks; ++b) load.blocks.push_back(BlockCopy{kBlocks - 1 - b, slots.data() + b * bytes});
  // Layers below each count reported are in place in every block.
  std::vector<const uint8_t*> want;
  for (uint32_t b = 0; b < kBlocks; ++b) want.push_back(slots.data() + (kBlocks - 1 - b) * bytes);
  tiers_test::LayerProgressWatcher watcher(page, 5, 77, engine, std::move(want));
  Completions c(1);
  backend->Submit(std::move(load), c.Done(0));
  c.Wait();
  watcher.Finish();
  ASSERT_TRUE(c.results()[0].status.ok()) << c.results()[0].status;
  EXPECT_EQ(watcher.wrong(), "");
  ASSERT_FALSE(watcher.seen().empty());
  EXPECT_EQ(watcher.seen().back(), kLayers);
  EXPECT_TRUE(std::is_sorted(watcher.seen().begin(), watcher.seen().end()));
  EXPECT_EQ(page->ProgressOf(5, 77).value() & FencePage::kOver, 0u) << "the daemon, not the backend, says over";
  for (uint32_t b = 0; b < kBlocks; ++b) ASSERT_TRUE(engine.Holds(kBlocks - 1 - b, KeyN(b)));
}

// Cancelled before its copies ran: no layer is reported and none written.
TEST(HostBackendTest, ALoadByLayerCancelledReportsNoLayer) {
  auto backend = MakeBackend(1);
  Result<std::unique_ptr<EngineMemory>> engine_or = EngineMemory::Create(*backend, SmallSpec(8), 8);
  ASSERT_TRUE(engine_or.has_value()) << engine_or.error();
  EngineMemory& engine = **engine_or;
  engine.ZeroAll();
  std::vector<uint8_t> slots(8 * engine.block_bytes(), 0x5a);
  auto page = std::make_shared<FencePage>(MemoryMapping::Anonymous(FencePage::kBytes).value());
  page->Open(0, 1);
  CopyBatch load{.direction = CopyDirection::kSlotToEngine,
                 .priority = CopyPriority::kLoad,
                 .layout = engine.layout(),
                 .mapping = engine.mapping(),
                 .fence = OpFence(page, 0, 1),
                 .by_layer = true};
  for (uint32_t b = 0; b < 8; ++b) load.blocks.push_back(BlockCopy{b, slots.data() + b * engine.block_bytes()});
  Completions c(1);
  {
    WorkerGate gate(*backend);
    backend->Submit(std::move(load), c.Done(0));
    ASSERT_TRUE(page->Cancel(0, 1));
  }
  c.Wait();
  EXPECT_EQ(c.results()[0].status.code(), StatusCode::kCancelled);
  EXPECT_EQ(page->ProgressOf(0, 1).value() & FencePage::kLayersMask, 0u);
  for (uint32_t b = 0; b < 8; ++b) EXPECT_TRUE(engine.IsZero(b));
}

// A store by layer of every block of `engine` into `slots`, block b into
// bytes [b * block_bytes, (b + 1) * block_bytes), held by `gate`.
CopyBatch StoreByLayer(EngineMemory& engine, std::vector<uint8_t>& slots, std::shared_ptr<LayerGate> gate) {
  CopyBatch store{.direction = CopyDirection::kEngineToSlot,
                  .priority = CopyPriority::kStore,
                  .layout = engine.layout(),
                  .mapping = engine.mapping(),
                  .checksum_destination = true,
                  .gate = std::move(gate)};
  for (uint32_t b = 0; b < engine.num_blocks(); ++b) {
    store.blocks.push_back(BlockCopy{b, slots.data() + uint64_t{b} * engine.block_bytes()});
  }
  return store;
}

// A store by layer (CopyBatch::gate): the engine writes layer l of every
// block and then opens it. Each layer's copies wait for it: every engine
// block holds nonsense until its layers are written, so a copy run early
// would store nonsense. The store is over only once every layer is in, with
// each slot's checksum that of its whole block.
TEST(HostBackendTest, AStoreByLayerCopiesEachLayerOnlyOnceItsGateOpensIt) {
  auto backend = MakeBackend(2);
  constexpr uint32_t kLayers = 8, kBlocks = 64;
  Result<std::unique_ptr<EngineMemory>> engine_or = EngineMemory::Create(*backend, SmallSpec(kLayers), kBlocks);
  ASSERT_TRUE(engine_or.has_value()) << engine_or.error();
  EngineMemory& engine = **engine_or;
  const uint64_t bytes = engine.block_bytes();
  const uint64_t layer_bytes = engine.layout()->layout().layer_bytes();
  std::vector<uint8_t> want(kBlocks * bytes);
  for (uint32_t b = 0; b < kBlocks; ++b) {
    PatternFor(KeyN(b), std::span<uint8_t>(want.data() + b * bytes, bytes));
    std::memset(engine.block(b).data(), 0x5a, bytes);
  }
  std::vector<uint8_t> slots(kBlocks * bytes, 0);
  auto gate = std::make_shared<LayerGate>(kLayers);
  Completions c(1);
  ASSERT_TRUE(backend->Submit(StoreByLayer(engine, slots, gate), c.Done(0)));
  for (uint32_t l = 0; l < kLayers; ++l) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // time for any copy run too early
    EXPECT_TRUE(c.order().empty()) << "over before layer " << l << " was written";
    for (uint32_t b = 0; b < kBlocks; ++b) {
      std::memcpy(engine.block(b).data() + l * layer_bytes, want.data() + b * bytes + l * layer_bytes, layer_bytes);
    }
    gate->Open(l + 1);
  }
  c.Wait();
  ASSERT_TRUE(c.results()[0].status.ok()) << c.results()[0].status;
  ASSERT_EQ(c.results()[0].checksums.size(), kBlocks);
  for (uint32_t b = 0; b < kBlocks; ++b) {
    ASSERT_EQ(std::memcmp(slots.data() + b * bytes, want.data() + b * bytes, bytes), 0) << "block " << b;
    EXPECT_EQ(c.results()[0].checksums[b], XXH3_64bits(want.data() + b * bytes, bytes)) << "block " << b;
  }
}

// Its gate let go of (the session ended) with 2 of 8 layers written: the
// store fails kCancelled and no layer past those is copied.
TEST(HostBackendTest, AStoreByLayerWhoseGateAbortsCopiesNoLayerPastThoseWritten) {
  auto backend = MakeBackend(2);
  constexpr uint32_t kLayers = 8, kBlocks = 16;
  Result<std::unique_ptr<EngineMemory>> engine_or = EngineMemory::Create(*backend, SmallSpec(kLayers), kBlocks);
  ASSERT_TRUE(engine_or.has_value()) << engine_or.error();
  EngineMemory& engine = **engine_or;
  const uint64_t bytes = engine.block_bytes();
  const uint64_t layer_bytes = engine.layout()->layout().layer_bytes();
  for (uint32_t b = 0; b < kBlocks; ++b) std::memset(engine.block(b).data(), 0x5a, bytes);
  std::vector<uint8_t> slots(kBlocks * bytes, 0);
  auto gate = std::make_shared<LayerGate>(kLayers);
  Completions c(1);
  ASSERT_TRUE(backend->Submit(StoreByLayer(engine, slots, gate), c.Done(0)));
  gate->Open(2);
  gate.reset();
  c.Wait();
  EXPECT_EQ(c.results()[0].status.code(), StatusCode::kCancelled) << c.results()[0].status;
  for (uint32_t b = 0; b < kBlocks; ++b) {
    const uint8_t* past = slots.data() + b * bytes + 2 * layer_bytes;
    const uint8_t* end = slots.data() + (b + 1) * bytes;
    EXPECT_TRUE(std::all_of(past, end, [](uint8_t x) { return x == 0; })) << "block " << b;
  }
}

// A load of coded blocks (issue 18): each copy thread decodes them straight
// into the engine's pages, next to raw ones; a corrupt one fails the load and
// writes nothing of itself into the engine.
TEST(HostBackendTest, LoadsDecodeCodedBlocksAndRefuseACorruptOne) {
  auto backend = MakeBackend(2);
  Result<std::unique_ptr<EngineMemory>> engine_or = EngineMemory::Create(*backend, SmallSpec(), 8);
  ASSERT_TRUE(engine_or.has_value()) << engine_or.error();
  EngineMemory& engine = **engine_or;
  const uint64_t bytes = engine.block_bytes();
  const CodecParams fp8{.kind = CodecKind::kFp8, .dtype = DType::kFp16, .group_elems = 64};
  std::unique_ptr<BlockCodec> coder = BlockCodec::Create().value();
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<uint16_t> finite(0, 0x7bff);  // fp16 below Inf, either sign
  std::vector<uint8_t> raw(bytes);
  for (size_t i = 0; i + 1 < bytes; i += 2) {
    const uint16_t h = static_cast<uint16_t>(finite(rng) | ((i & 2) != 0 ? 0x8000 : 0));
    std::memcpy(&raw[i], &h, 2);
  }
  std::vector<uint8_t> coded(BlockCodec::MaxEncodedBytes(fp8, bytes));
  const std::optional<size_t> n = coder->Encode(fp8, raw, coded);
  ASSERT_TRUE(n.has_value());
  std::vector<uint8_t> want(bytes);
  ASSERT_TRUE(coder->Decode(fp8, std::span(coded.data(), *n), want).ok());

  auto load = [&](std::vector<BlockCopy> blocks) {
    CopyBatch batch{.direction = CopyDirection::kSlotToEngine,
                    .priority = CopyPriority::kLoad,
                    .layout = engine.layout(),
                    .mapping = engine.mapping(),
                    .blocks = std::move(blocks),
                    .codec = fp8};
    Completions c(1);
    backend->Submit(std::move(batch), c.Done(0));
    c.Wait();
    return c.results()[0].status;
  };
  engine.ZeroAll();
  const uint32_t coded_bytes = static_cast<uint32_t>(*n);
  ASSERT_TRUE(load({BlockCopy{1, coded.data(), coded_bytes}, BlockCopy{2, raw.data()}}).ok());
  EXPECT_TRUE(std::ranges::equal(engine.block(1), want));
  EXPECT_TRUE(std::ranges::equal(engine.block(2), raw));

  coded[(bytes / 2 / 64) * 4 + 9] = 0x7f;  // a NaN code
  const Status corrupt = load({BlockCopy{3, coded.data(), coded_bytes}});
  EXPECT_EQ(corrupt.code(), StatusCode::kCorruption) << corrupt;
  EXPECT_TRUE(engine.IsZero(3));
}

// Engine blocks whose rows are strided (head-major inside each block, so
// every 128-byte row is its own copy) and 1 MiB blocks (one run, hashed in
// 256 KiB chunks): the gather's checksum is the XXH3-64 of the slot it wrote,
// and a scatter of those slots gives the engine its bytes back.
TEST(HostBackendTest, GatherChecksumsHoldForStridedAndLargeBlocks) {
  auto backend = MakeBackend(2);
  auto head_major = [](const LayoutSpec& spec) {
    Result<Layout> layout = Layout::Create(spec);
    EXPECT_TRUE(layout.has_value());
    const uint64_t row = uint64_t{spec.head_dim} * 2;  // fp16
    std::vector<Placement> placements;
    for (uint32_t piece = 0; piece < 2 * spec.num_layers; ++piece) {
      placements.push_back(Placement{.region = 0,
                                     .offset_bytes = piece * layout->tensor_bytes(),
                                     .block_stride_bytes = layout->block_bytes(),
                                     .token_stride_bytes = row,
                                     .head_stride_bytes = row * spec.block_tokens});
    }
    return placements;
  };
  LayoutSpec large = SmallSpec(4);
  large.num_kv_heads = 8;
  large.head_dim = 128;
  large.block_tokens = 64;
  struct Case {
    std::string name;
    LayoutSpec spec;
    std::vector<Placement> placements;
  };
  const std::vector<Case> cases = {{"head-major", SmallSpec(), head_major(SmallSpec())},
                                   {"1 MiB contiguous", large, {}}};
  for (const Case& tc : cases) {
    SCOPED_TRACE(tc.name);
    Result<std::unique_ptr<EngineMemory>> engine_or =
        EngineMemory::Create(*backend, tc.spec, 4, tc.placements);
    ASSERT_TRUE(engine_or.has_value()) << engine_or.error();
    EngineMemory& engine = **engine_or;
    const uint64_t bytes = engine.block_bytes();
    for (uint32_t b = 0; b < 4; ++b) engine.Fill(b, KeyN(100 + b));
    std::vector<uint8_t> slots(4 * bytes, 0);
    CopyBatch gather{.direction = CopyDirection::kEngineToSlot,
                     .priority = CopyPriority::kStore,
                     .layout = engine.layout(),
                     .mapping = engine.mapping(),
                     .checksum_destination = true};
    for (uint32_t b = 0; b < 4; ++b)
      gather.blocks.push_back(BlockCopy{b, slots.data() + b * bytes});
    Completions g(1);
    backend->Submit(std::move(gather), g.Done(0));
    g.Wait();
    const std::vector<CopyResult> gathered = g.results();
    ASSERT_TRUE(gathered[0].status.ok());
    ASSERT_EQ(gathered[0].checksums.size(), 4u);
    for (uint32_t b = 0; b < 4; ++b) {
      EXPECT_EQ(gathered[0].checksums[b], XXH3_64bits(slots.data() + b * bytes, bytes)) << b;
    }
    if (!tc.placements.empty()) {
      EXPECT_NE(std::memcmp(slots.data(), engine.block(0).data(), bytes), 0)
          << "head-major rows are reordered into canonical order";
    }
    engine.ZeroAll();
    CopyBatch scatter{.direction = CopyDirection::kSlotToEngine,
                      .priority = CopyPriority::kLoad,
                      .layout = engine.layout(),
                      .mapping = engine.mapping()};
    for (uint32_t b = 0; b < 4; ++b)
      scatter.blocks.push_back(BlockCopy{b, slots.data() + b * bytes});
    Completions s(1);
    backend->Submit(std::move(scatter), s.Done(0));
    s.Wait();
    for (uint32_t b = 0; b < 4; ++b) EXPECT_TRUE(engine.Holds(b, KeyN(100 + b)));
  }
}

// The batch holds the mapping until the copy is done, and lets go of it
// before `done` runs, so that whoever learns of the completion also sees
// the mapping gone.
TEST(HostBackendTest, BatchHoldsTheMappingUntilDone) {
  auto backend = MakeBackend(1);
  Result<std::unique_ptr<EngineMemory>> engine_or = EngineMemory::Create(*backend, SmallSpec(), 4);
  ASSERT_TRUE(engine_or.has_value()) << engine_or.error();
  EngineMemory& engine = **engine_or;
  engine.Fill(1, KeyN(1));
  std::vector<uint8_t> slot(engine.block_bytes(), 0);
  EXPECT_EQ(backend->live_mappings(), 1u);

  std::atomic<uint64_t> live_in_done{99};  // read after Wait(): the latch orders it
  Completions c(1);
  {
    WorkerGate gate(*backend);
    CopyBatch batch{.direction = CopyDirection::kEngineToSlot,
                    .priority = CopyPriority::kStore,
                    .layout = engine.layout(),
                    .mapping = engine.mapping(),
                    .blocks = {BlockCopy{1, slot.data()}}};
    CopyDone done = c.Done(0);
    backend->Submit(std::move(batch), [&, done](CopyResult r) {
      live_in_done.store(backend->live_mappings(), std::memory_order_relaxed);
      done(std::move(r));
    });
    engine.DropMapping();
    EXPECT_EQ(backend->live_mappings(), 1u) << "the queued batch holds the mapping";
  }
  c.Wait();
  EXPECT_EQ(live_in_done.load(std::memory_order_relaxed), 0u);
  EXPECT_EQ(backend->live_mappings(), 0u);
  EXPECT_EQ(std::memcmp(slot.data(), engine.block(1).data(), slot.size()), 0);
}

TEST(HostBackendTest, MapClientMemoryMapsASealedMemfd) {
  auto backend = MakeBackend(1);
  Result<UniqueFd> fd = MakeMemfd(3 * 4096, true, true);
  ASSERT_TRUE(fd.has_value()) << fd.error();
  Result<MemoryMapping> own =
      MemoryMapping::Map(MemoryMapping::Options{.size_bytes = 3 * 4096,
                                                .prot = PROT_READ | PROT_WRITE,
                                                .flags = MAP_SHARED,
                                                .fd = fd->get()});
  ASSERT_TRUE(own.has_value()) << own.error();
  std::vector<ClientRegionHandle> regions;
  regions.push_back(MemfdHandle(std::move(*fd), 2 * 4096));  // a memfd larger than claimed is fine
  Result<std::shared_ptr<ClientMapping>> m = backend->MapClientMemory(std::move(regions), {});
  ASSERT_TRUE(m.has_value()) << m.error();
  ASSERT_EQ((*m)->region_bases().size(), 1u);
  // Shared memory: what the engine writes, the daemon sees, and back.
  own->data()[100] = 0x42;
  EXPECT_EQ((*m)->region_bases()[0][100], 0x42);
  (*m)->region_bases()[0][8191] = 0x24;
  EXPECT_EQ(own->data()[8191], 0x24);
}

// Whether an address of this process is mapped (/proc/self/maps).
bool Mapped(const void* p) {
  std::ifstream maps("/proc/self/maps");
  const auto at = reinterpret_cast<uintptr_t>(p);
  for (std::string line; std::getline(maps, line);) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && lo <= at && at < hi) return true;
  }
  return false;
}

// A released client mapping is unmapped by the backend's reaper, not by
// whoever dropped it (the event loop, when a session closes: 65 ms for a
// 256 MiB engine cache): the address goes, soon after, on its own.
TEST(HostBackendTest, AReleasedClientMappingIsUnmappedByTheReaperNotTheCaller) {
  auto reaper = std::make_shared<Reaper>(8);
  Result<std::unique_ptr<HostBackend>> backend =
      HostBackend::Create(HostBackend::Options{.copy_threads = 1, .populate_host = false, .reaper = reaper});
  ASSERT_TRUE(backend.has_value()) << backend.error();
  Result<UniqueFd> fd = MakeMemfd(4 * 4096, true, true);
  ASSERT_TRUE(fd.has_value()) << fd.error();
  std::vector<ClientRegionHandle> regions;
  regions.push_back(MemfdHandle(std::move(*fd), 4 * 4096));
  Result<std::shared_ptr<ClientMapping>> m = (*backend)->MapClientMemory(std::move(regions), {});
  ASSERT_TRUE(m.has_value()) << m.error();
  const uint8_t* base = (*m)->region_bases()[0];
  ASSERT_TRUE(Mapped(base));

  std::latch busy(1), release(1);
  reaper->Run([&] {
    busy.count_down();
    release.wait();
  });
  busy.wait();
  m->reset();  // released here, with the reaper held
  EXPECT_EQ((*backend)->live_mappings(), 0u);
  EXPECT_TRUE(Mapped(base)) << "unmapped by the thread that released it";
  release.count_down();
  reaper->Drain();
  EXPECT_FALSE(Mapped(base)) << "the reaper did not unmap it";
}

// The reaper runs work on its thread, in order; past its backlog (by
// weight), on the caller; and what is still queued when it goes, then.
TEST(ReaperTest, WorkRunsOnItsThreadInOrderAndPastTheBacklogOnTheCaller) {
  std::latch release(1);
  Mutex mu;
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  auto note = [&](int i) {
    MutexLock lock(&mu);
    order.push_back(i);
    threads.push_back(std::this_thread::get_id());
  };
  {
    Reaper reaper(3);
    std::latch started(1);
    reaper.Run([&] {
      started.count_down();
      release.wait();  // holds the reaper's thread
      note(0);
    });
    started.wait();
    reaper.Run([&] { note(1); });
    reaper.Run([&] { note(2); }, 2);
    reaper.Run([&] { note(3); });  // 1 + 2 of 3 wait: runs here, now
    {
      MutexLock lock(&mu);
      ASSERT_EQ(order, std::vector<int>({3}));
      EXPECT_EQ(threads[0], std::this_thread::get_id());
    }
    release.count_down();
    reaper.Drain();
    MutexLock lock(&mu);
    EXPECT_EQ(order, std::vector<int>({3, 0, 1, 2}));
    EXPECT_NE(threads[1], std::this_thread::get_id());
    EXPECT_EQ(threads[1], threads[2]);
    EXPECT_EQ(threads[2], threads[3]);
  }
  // Queued and then destroyed at once: everything still runs.
  std::atomic<int> ran = 0;
  {
    Reaper reaper(64);
    for (int i = 0; i < 50; ++i) reaper.Run([&] { ran.fetch_add(1); });
  }
  EXPECT_EQ(ran.load(), 50);
}

TEST(HostBackendTest, MapClientMemoryRejectsBadRegions) {
  auto backend = MakeBackend(1);
  auto expect_rejected = [&](ClientRegionHandle h, const std::string& what) {
    std::vector<ClientRegionHandle> regions;
    regions.push_back(std::move(h));
    Result<std::shared_ptr<ClientMapping>> m = backend->MapClientMemory(std::move(regions), {});
    ASSERT_FALSE(m.has_value()) << what;
    EXPECT_EQ(m.error().code(), StatusCode::kInvalidArgument) << what << ": " << m.error();
  };
  {
    Result<UniqueFd> fd = MakeMemfd(4096, /*allow_sealing=*/true, /*seal_shrink=*/false);
    ASSERT_TRUE(fd.has_value()) << fd.error();
    expect_rejected(MemfdHandle(std::move(*fd), 4096), "sealable but unsealed");
  }
  {
    Result<UniqueFd> fd = MakeMemfd(4096, /*allow_sealing=*/false, /*seal_shrink=*/false);
    ASSERT_TRUE(fd.has_value()) << fd.error();
    expect_rejected(MemfdHandle(std::move(*fd), 4096), "not sealable");
  }
  {
    // Only F_SEAL_GROW: growing is harmless, shrinking is what hurts.
    Result<UniqueFd> fd = MakeMemfd(4096, true, false);
    ASSERT_TRUE(fd.has_value()) << fd.error();
    ASSERT_EQ(::fcntl(fd->get(), F_ADD_SEALS, F_SEAL_GROW), 0);
    expect_rejected(MemfdHandle(std::move(*fd), 4096), "sealed against growing only");
  }
  {
    Result<UniqueFd> fd = MakeMemfd(4096, true, true);
    ASSERT_TRUE(fd.has_value()) << fd.error();
    expect_rejected(MemfdHandle(std::move(*fd), 8192), "smaller than claimed");
  }
  {
    Result<UniqueFd> fd = MakeMemfd(4096, true, true);
    ASSERT_TRUE(fd.has_value()) << fd.error();
    expect_rejected(MemfdHandle(std::move(*fd), 0), "zero size");
  }
  {
    Result<UniqueFd> fd = MakeMemfd(4096, true, true);
    ASSERT_TRUE(fd.has_value()) << fd.error();
    ClientRegionHandle h = MemfdHandle(std::move(*fd), 4096);
    h.kind = ClientMemoryKind::kCudaIpc;
    expect_rejected(std::move(h), "CUDA IPC handle on the host backend");
  }
  expect_rejected(MemfdHandle(UniqueFd(), 4096), "no fd");
  EXPECT_EQ(backend->live_mappings(), 0u);
}

TEST(HostBackendTest, CudaEventsAreRefused) {
  auto backend = MakeBackend(1);
  Result<UniqueFd> fd = MakeMemfd(4096, true, true);
  ASSERT_TRUE(fd.has_value()) << fd.error();
  std::vector<ClientRegionHandle> regions;
  regions.push_back(MemfdHandle(std::move(*fd), 4096));
  Result<std::shared_ptr<ClientMapping>> m = backend->MapClientMemory(std::move(regions), {IpcEventHandle{}});
  ASSERT_FALSE(m.has_value());
  EXPECT_EQ(m.error().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(m.error().message(), ::testing::HasSubstr("cuda device backend"));
  EXPECT_EQ(backend->live_mappings(), 0u);
}

TEST(HostBackendTest, OneBadRegionRejectsTheWholeRegistration) {
  auto backend = MakeBackend(1);
  Result<UniqueFd> good = MakeMemfd(4096, true, true);
  Result<UniqueFd> bad = MakeMemfd(4096, true, false);
  ASSERT_TRUE(good.has_value() && bad.has_value());
  std::vector<ClientRegionHandle> regions;
  regions.push_back(MemfdHandle(std::move(*good), 4096));
  regions.push_back(MemfdHandle(std::move(*bad), 4096));
  Result<std::shared_ptr<ClientMapping>> m = backend->MapClientMemory(std::move(regions), {});
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().message().find("region 1"), std::string::npos) << m.error();
  EXPECT_EQ(backend->live_mappings(), 0u);
}

TEST(HostBackendTest, LiveMappingsCountsMappings) {
  auto backend = MakeBackend(1);
  auto map = [&](uint32_t regions) {
    std::vector<ClientRegionHandle> handles;
    for (uint32_t i = 0; i < regions; ++i) {
      Result<UniqueFd> fd = MakeMemfd(4096, true, true);
      EXPECT_TRUE(fd.has_value());
      handles.push_back(MemfdHandle(std::move(*fd), 4096));
    }
    Result<std::shared_ptr<ClientMapping>> m = backend->MapClientMemory(std::move(handles), {});
    EXPECT_TRUE(m.has_value());
    return std::move(*m);
  };
  EXPECT_EQ(backend->live_mappings(), 0u);
  std::shared_ptr<ClientMapping> a = map(1);
  std::shared_ptr<ClientMapping> b = map(3);
  EXPECT_EQ(b->region_bases().size(), 3u);
  EXPECT_EQ(backend->live_mappings(), 2u) << "one per registration, not per region";
  std::shared_ptr<ClientMapping> a2 = a;
  a.reset();
  EXPECT_EQ(backend->live_mappings(), 2u);
  a2.reset();
  EXPECT_EQ(backend->live_mappings(), 1u);
  b.reset();
  EXPECT_EQ(backend->live_mappings(), 0u);
  // A mapping may outlive the backend.
  std::shared_ptr<ClientMapping> late = map(1);
  backend.reset();
  late.reset();
}

}  // namespace
}  // namespace kvtier
