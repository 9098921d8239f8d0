// The cuda device backend on a real GPU, in one process: arenas, moves
// between the hbm and host tiers with host checksums, and a CPU engine's
// memfd cache copied to and from both tiers (a kernel for hbm, the CPU
// reference for host), with mappings counted up and down.
#include "devices/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/memory_mapping.h"
#include "common/op_fence.h"
#include "kernels/codec.h"
#include "kernels/copy_reference.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/spin_kernel.h"
#include "tests/tiers/coded_blocks.h"
#include "tests/tiers/tiers_test_util.h"

namespace kvtier {
namespace {

using tiers_test::EngineMemory;

CopyResult RunBatch(DeviceBackend& backend, CopyBatch batch) {
  std::promise<CopyResult> done;
  std::future<CopyResult> result = done.get_future();
  backend.Submit(std::move(batch), [&done](CopyResult r) { done.set_value(std::move(r)); });
  return result.get();
}

// A mapping is torn down on the backend's reaper thread once its last
// reference is gone (closing handles may wait for the device): the count
// reaches zero soon after, not at once. Whether it does within 10 s.
bool MappingsReachZero(const DeviceBackend& backend) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (backend.live_mappings() != 0) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

class CudaBackendGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVTIER_SKIP_WITHOUT_GPU();
    Result<std::unique_ptr<CudaBackend>> b = CudaBackend::Create({});
    ASSERT_TRUE(b.has_value()) << b.error();
    backend_ = std::move(*b);
    Result<std::unique_ptr<Arena>> hbm = backend_->AllocateDeviceArena(backend_->devices().front(), 16 << 20);
    ASSERT_TRUE(hbm.has_value()) << hbm.error();
    hbm_ = std::move(*hbm);
    Result<std::unique_ptr<Arena>> host = backend_->AllocateHostArena(16 << 20);
    ASSERT_TRUE(host.has_value()) << host.error();
    host_ = std::move(*host);
  }

  std::unique_ptr<CudaBackend> backend_;
  std::unique_ptr<Arena> hbm_;
  std::unique_ptr<Arena> host_;
};

TEST_F(CudaBackendGpuTest, DescribesItsDevicesAndDriver) {
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, backend_->devices().front()), cudaSuccess);
  EXPECT_THAT(backend_->Describe(), ::testing::HasSubstr(prop.name));
  EXPECT_THAT(backend_->Describe(), ::testing::HasSubstr("driver"));
  EXPECT_EQ(backend_->name(), "cuda");
}

TEST_F(CudaBackendGpuTest, MovesBetweenTiersAndChecksumsHostDestinations) {
  constexpr uint64_t kBytes = 3 << 20;
  uint8_t* a = host_->data();
  uint8_t* b = host_->data() + (4 << 20);
  uint8_t* dev = hbm_->data();
  for (uint64_t i = 0; i < kBytes; ++i) a[i] = static_cast<uint8_t>(i * 7 + 3);
  std::memset(b, 0, kBytes);

  CopyResult up = RunBatch(*backend_, CopyBatch{.direction = CopyDirection::kSlotToSlot,
                                           .slot_copies = {SlotCopy{a, dev, kBytes}},
                                           .checksum_destination = true});
  ASSERT_TRUE(up.status.ok()) << up.status;
  ASSERT_EQ(up.checksums.size(), 1u);
  EXPECT_EQ(up.checksums[0], 0u) << "a destination in hbm is not checksummed";

  CopyResult down = RunBatch(*backend_, CopyBatch{.direction = CopyDirection::kSlotToSlot,
                                             .slot_copies = {SlotCopy{dev, b, kBytes}},
                                             .checksum_destination = true});
  ASSERT_TRUE(down.status.ok()) << down.status;
  EXPECT_EQ(std::memcmp(a, b, kBytes), 0);
  ASSERT_EQ(down.checksums.size(), 1u);
  EXPECT_EQ(down.checksums[0], ChecksumOf(b, kBytes));
}

TEST_F(CudaBackendGpuTest, CpuEngineCacheCopiesThroughHbmAndHost) {
  Result<std::unique_ptr<EngineMemory>> engine =
      EngineMemory::Create(*backend_, tiers_test::SmallSpec(3), 8, {});
  ASSERT_TRUE(engine.has_value()) << engine.error();
  EXPECT_EQ(backend_->live_mappings(), 1u);
  EngineMemory& e = **engine;
  e.ZeroAll();
  const StoredKey k1 = StoredKey::FromHex("0102030405060708090a0b0c0d0e0f10").value();
  const StoredKey k2 = StoredKey::FromHex("f102030405060708090a0b0c0d0e0f1f").value();
  e.Fill(1, k1);
  e.Fill(2, k2);
  uint8_t* hbm_slot = hbm_->data() + (1 << 20);
  uint8_t* host_slot = host_->data() + (8 << 20);

  // Gather: block 1 into hbm (a kernel over registered host memory), block 2
  // into host (the CPU reference, with its checksum).
  CopyResult g1 = RunBatch(*backend_, CopyBatch{.direction = CopyDirection::kEngineToSlot,
                                           .priority = CopyPriority::kStore,
                                           .layout = e.layout(),
                                           .mapping = e.mapping(),
                                           .blocks = {BlockCopy{1, hbm_slot}}});
  ASSERT_TRUE(g1.status.ok()) << g1.status;
  CopyResult g2 = RunBatch(*backend_, CopyBatch{.direction = CopyDirection::kEngineToSlot,
                                           .priority = CopyPriority::kStore,
                                           .layout = e.layout(),
                                           .mapping = e.mapping(),
                                           .blocks = {BlockCopy{2, host_slot}},
                                           .checksum_destination = true});
  ASSERT_TRUE(g2.status.ok()) << g2.status;
  ASSERT_EQ(g2.checksums.size(), 1u);
  EXPECT_EQ(g2.checksums[0], ChecksumOf(host_slot, e.block_bytes()));

  // Scatter both into other engine blocks and check every byte.
  CopyResult s = RunBatch(*backend_, CopyBatch{.direction = CopyDirection::kSlotToEngine,
                                          .priority = CopyPriority::kLoad,
                                          .layout = e.layout(),
                                          .mapping = e.mapping(),
                                          .blocks = {BlockCopy{5, hbm_slot}}});
  ASSERT_TRUE(s.status.ok()) << s.status;
  s = RunBatch(*backend_, CopyBatch{.direction = CopyDirection::kSlotToEngine,
                               .priority = CopyPriority::kLoad,
                               .layout = e.layout(),
                               .mapping = e.mapping(),
                               .blocks = {BlockCopy{6, host_slot}}});
  ASSERT_TRUE(s.status.ok()) << s.status;
  EXPECT_TRUE(e.Holds(5, k1));
  EXPECT_TRUE(e.Holds(6, k2));
  EXPECT_TRUE(e.IsZero(7));

  e.DropMapping();
  EXPECT_TRUE(MappingsReachZero(*backend_)) << backend_->live_mappings() << " live";
}

// fp8 blocks of a CPU engine's cache (both sides in host memory: the lane's
// CPU codec) coded on a store's way into slots of their coded size and back
// on a load's; a block with a NaN is reported, a corrupt one fails its load.
TEST_F(CudaBackendGpuTest, CpuEngineFp8BlocksAreCodedOnTheWayAndBack) {
  Result<std::unique_ptr<EngineMemory>> engine =
      EngineMemory::Create(*backend_, tiers_test::Bf16KvSpec("test/gpu-fp8", 2), 8, {});
  ASSERT_TRUE(engine.has_value()) << engine.error();
  EngineMemory& e = **engine;
  std::mt19937_64 rng(9);
  for (uint32_t b = 0; b < 2; ++b) tiers_test::FillKvLike(rng, e.block(b));
  const uint16_t nan = 0x7fc0;
  std::memcpy(e.block(1).data() + 100, &nan, 2);
  const CodecParams fp8 = tiers_test::Bf16Codec(CodecKind::kFp8);
  const auto coded = static_cast<uint32_t>(BlockCodec::MaxEncodedBytes(fp8, e.block_bytes()));
  uint8_t* a = host_->data();
  uint8_t* b = host_->data() + (1 << 20);

  CopyResult store = RunBatch(*backend_, CopyBatch{.direction = CopyDirection::kEngineToSlot,
                                                  .priority = CopyPriority::kStore,
                                                  .layout = e.layout(),
                                                  .mapping = e.mapping(),
                                                  .blocks = {BlockCopy{0, a, coded}, BlockCopy{1, b, coded}},
                                                  .checksum_destination = true,
                                                  .codec = fp8});
  ASSERT_TRUE(store.status.ok()) << store.status;
  EXPECT_EQ(store.not_coded, std::vector<uint32_t>{1});
  std::unique_ptr<BlockCodec> coder = BlockCodec::Create().value();
  std::vector<uint8_t> want(coded);
  ASSERT_EQ(coder->Encode(fp8, e.block(0), want), coded);
  EXPECT_EQ(std::memcmp(a, want.data(), coded), 0);
  ASSERT_EQ(store.checksums.size(), 2u);
  EXPECT_EQ(store.checksums[0], ChecksumOf(a, coded));

  CopyResult load = RunBatch(*backend_, CopyBatch{.direction = CopyDirection::kSlotToEngine,
                                                 .priority = CopyPriority::kLoad,
                                                 .layout = e.layout(),
                                                 .mapping = e.mapping(),
                                                 .blocks = {BlockCopy{5, a, coded}},
                                                 .codec = fp8});
  ASSERT_TRUE(load.status.ok()) << load.status;
  std::vector<uint8_t> decoded(e.block_bytes());
  ASSERT_TRUE(coder->Decode(fp8, std::span(a, coded), decoded).ok());
  EXPECT_TRUE(std::ranges::equal(e.block(5), decoded));

  a[coded - 1] = 0x7f;  // a NaN code
  load = RunBatch(*backend_, CopyBatch{.direction = CopyDirection::kSlotToEngine,
                                      .priority = CopyPriority::kLoad,
                                      .layout = e.layout(),
                                      .mapping = e.mapping(),
                                      .blocks = {BlockCopy{6, a, coded}},
                                      .codec = fp8});
  EXPECT_EQ(load.status.code(), StatusCode::kCorruption) << load.status;
}

// A load by layer from hbm slots (a kernel per layer): each layer is
// reported through the fence only once it is in place in every block, the
// count only grows, and every layer arrives (issue 47: the copies go layer
// by layer on cuda too). A contiguous layout keeps a block's layers in
// order in the engine, so its first p layers are its first p * layer_bytes.
TEST_F(CudaBackendGpuTest, ALoadByLayerReportsEachLayerOnceEveryBlockHasIt) {
  constexpr uint32_t kLayers = 16, kBlocks = 64;
  Result<std::unique_ptr<EngineMemory>> engine =
      EngineMemory::Create(*backend_, tiers_test::SmallSpec(kLayers), kBlocks, {});
  ASSERT_TRUE(engine.has_value()) << engine.error();
  EngineMemory& e = **engine;
  e.ZeroAll();
  const uint64_t bytes = e.block_bytes();
  ASSERT_LE(kBlocks * bytes, uint64_t{16} << 20);
  std::vector<uint8_t> slots(kBlocks * bytes);
  for (uint32_t b = 0; b < kBlocks; ++b) {
    StoredKey key;
    std::memcpy(key.bytes.data(), &b, sizeof(b));
    tiers_test::PatternFor(key, std::span<uint8_t>(slots.data() + b * bytes, bytes));
  }
  ASSERT_EQ(cudaMemcpy(hbm_->data(), slots.data(), slots.size(), cudaMemcpyHostToDevice), cudaSuccess);
  auto page = std::make_shared<FencePage>(MemoryMapping::Anonymous(FencePage::kBytes).value());
  page->Open(3, 41);
  CopyBatch load{.direction = CopyDirection::kSlotToEngine,
                 .priority = CopyPriority::kLoad,
                 .layout = e.layout(),
                 .mapping = e.mapping(),
                 .fence = OpFence(page, 3, 41),
                 .by_layer = true};
  // Reversed: engine block kBlocks - 1 - b gets slot b.
  for (uint32_t b = 0; b < kBlocks; ++b) load.blocks.push_back(BlockCopy{kBlocks - 1 - b, hbm_->data() + b * bytes});
  std::vector<const uint8_t*> want;
  for (uint32_t b = 0; b < kBlocks; ++b) want.push_back(slots.data() + (kBlocks - 1 - b) * bytes);
  tiers_test::LayerProgressWatcher watcher(page, 3, 41, e, std::move(want));
  CopyResult result = RunBatch(*backend_, std::move(load));
  watcher.Finish();
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_EQ(watcher.wrong(), "");
  ASSERT_FALSE(watcher.seen().empty()) << "no layer was reported";
  EXPECT_EQ(watcher.seen().back(), kLayers);
  EXPECT_TRUE(std::is_sorted(watcher.seen().begin(), watcher.seen().end()));
  EXPECT_EQ(page->ProgressOf(3, 41).value() & FencePage::kOver, 0u) << "the daemon, not the backend, says over";
  for (uint32_t b = 0; b < kBlocks; ++b) {
    ASSERT_EQ(std::memcmp(e.block(kBlocks - 1 - b).data(), slots.data() + b * bytes, bytes), 0) << b;
  }
}

TEST_F(CudaBackendGpuTest, RefusesEventsForHostMemoryAndUnknownDevices) {
  Result<UniqueFd> fd = tiers_test::MakeMemfd(4096, true, true);
  ASSERT_TRUE(fd.has_value()) << fd.error();
  std::vector<ClientRegionHandle> regions;
  regions.push_back(tiers_test::MemfdHandle(std::move(*fd), 4096));
  Result<std::shared_ptr<ClientMapping>> m = backend_->MapClientMemory(std::move(regions), {IpcEventHandle{}});
  ASSERT_FALSE(m.has_value());
  EXPECT_EQ(m.error().code(), StatusCode::kInvalidArgument) << m.error();

  ClientRegionHandle ipc;
  ipc.kind = ClientMemoryKind::kCudaIpc;
  ipc.size_bytes = 4096;
  ipc.device = 1000;
  std::vector<ClientRegionHandle> bad;
  bad.push_back(std::move(ipc));
  m = backend_->MapClientMemory(std::move(bad), {});
  ASSERT_FALSE(m.has_value());
  EXPECT_EQ(m.error().code(), StatusCode::kInvalidArgument) << m.error();
  EXPECT_TRUE(MappingsReachZero(*backend_)) << backend_->live_mappings() << " live";
}

// What the death test's child checks once a kernel of its own process has
// trapped: the backend reports the lost context and fails batches with it.
// Exits 0 with "context lost and reported" on stderr, else 1 saying why.
[[noreturn]] void LoseTheContextAndCheck() {
  const auto fail = [](const std::string& why) {
    std::fprintf(stderr, "FAILED: %s\n", why.c_str());
    std::_Exit(1);
  };
  Result<std::unique_ptr<CudaBackend>> b = CudaBackend::Create({});
  if (!b) fail("CudaBackend::Create: " + b.error().ToString());
  CudaBackend& backend = **b;
  Result<std::unique_ptr<Arena>> hbm = backend.AllocateDeviceArena(backend.devices().front(), 1 << 20);
  Result<std::unique_ptr<Arena>> host = backend.AllocateHostArena(1 << 20);
  if (!hbm || !host) fail("allocating the arenas");
  const auto move = [&] {
    return RunBatch(backend, CopyBatch{.direction = CopyDirection::kSlotToSlot,
                                       .slot_copies = {SlotCopy{(*host)->data(), (*hbm)->data(), 4096}}});
  };
  if (CopyResult r = move(); !r.status.ok()) fail("a move before the fault: " + r.status.ToString());
  if (!backend.health().ok()) fail("unhealthy before the fault");

  if (gpu_testing::LaunchTrap(nullptr) != cudaSuccess) fail("launching the trap kernel");
  const cudaError_t sync = cudaDeviceSynchronize();
  if (!cuda::IsContextLost(sync)) fail(std::string("the trap gave ") + cudaGetErrorName(sync));

  // The first batch meets the sticky error, and the backend keeps it.
  const CopyResult first = move();
  if (first.status.ok() || !cuda::IsContextLost(first.status)) fail("the first batch: " + first.status.ToString());
  const Status health = backend.health();
  if (health.ok() || health.code() != StatusCode::kUnavailable || !cuda::IsContextLost(health)) {
    fail("health after the fault: " + health.ToString());
  }
  // Later batches and mappings fail with it, without touching the device.
  const CopyResult second = move();
  if (second.status.code() != StatusCode::kUnavailable || second.status.message() != health.message()) {
    fail("the second batch: " + second.status.ToString());
  }
  Result<UniqueFd> fd = tiers_test::MakeMemfd(4096, true, true);
  if (!fd) fail("memfd");
  std::vector<ClientRegionHandle> regions;
  regions.push_back(tiers_test::MemfdHandle(std::move(*fd), 4096));
  Result<std::shared_ptr<ClientMapping>> m = backend.MapClientMemory(std::move(regions), {});
  if (m || m.error().code() != StatusCode::kUnavailable) fail("a mapping after the fault");
  std::fprintf(stderr, "context lost and reported: %s\n", health.ToString().c_str());
  std::_Exit(0);  // the lost context's teardown is the process's exit
}

// A sticky error (a kernel fault, such as an engine's memory unmapped under
// a copy) loses the process's CUDA context for good: every later call fails.
// The backend must say so (health(), which makes kvtierd stop and exit for
// its supervisor) and fail batches at once, not look healthy while every
// copy fails. In a child process: the context cannot be had back.
TEST(CudaBackendContextLostGpuTest, AStickyErrorIsReportedAndFailsEveryLaterBatch) {
  KVTIER_SKIP_WITHOUT_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(LoseTheContextAndCheck(), ::testing::ExitedWithCode(0), "context lost and reported");
}

}  // namespace
}  // namespace kvtier
