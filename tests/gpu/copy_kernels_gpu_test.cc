// The CUDA gather/scatter kernels against the CPU reference, byte for byte,
// on every named engine layout and on random ones; slots in device memory
// (the hbm tier) and in pinned host memory (the host tier, H2D/D2H without
// staging), including a slot base that is not 16-byte aligned.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/copy_plan.h"
#include "kernels/copy_reference.h"
#include "kernels/cuda/copy_kernels.h"
#include "kernels/cuda/cuda_util.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/kernels/layout_cases.h"

namespace kvtier {
namespace {

using gpu_testing::DeviceBytes;
using gpu_testing::PinnedBytes;
using layout_cases::Cache;
using layout_cases::CopyCase;
using layout_cases::FirstDifference;
using layout_cases::FillPattern;

enum class SlotMemory { kDevice, kPinned };

// One case on the GPU: its regions in device memory with a copy of the host
// pattern, and the two plans (device addresses for the kernels, host
// addresses for the reference).
class GpuCase {
 public:
  static std::unique_ptr<GpuCase> Make(const CopyCase& c, uint64_t seed) {
    Result<KvCacheLayout> kv = layout_cases::MakeKvCacheLayout(c);
    KVTIER_CHECK_MSG(kv.has_value(), "a test case with an invalid layout");
    auto g = std::unique_ptr<GpuCase>(new GpuCase(std::move(*kv), c.region_sizes));
    g->host_.Fill(seed);
    for (size_t r = 0; r < c.region_sizes.size(); ++r) {
      g->device_.push_back(std::make_unique<DeviceBytes>(c.region_sizes[r]));
      g->device_bases_.push_back(g->device_.back()->data());
    }
    return g;
  }

  ::testing::AssertionResult Upload() {
    for (size_t r = 0; r < device_.size(); ++r) {
      if (device_[r]->data() == nullptr) return ::testing::AssertionFailure() << "cudaMalloc failed";
      if (cudaMemcpy(device_[r]->data(), host_.regions[r].data(), host_.regions[r].size(),
                     cudaMemcpyHostToDevice) != cudaSuccess) {
        return ::testing::AssertionFailure() << "upload failed";
      }
    }
    Result<cuda::DevicePlan> plan =
        cuda::DevicePlan::Upload(CopyPlan::Build(kv_, MappedRegions{device_bases_}), 0);
    if (!plan) return ::testing::AssertionFailure() << plan.error();
    plan_.emplace(std::move(*plan));
    return ::testing::AssertionSuccess();
  }

  // The device regions, read back.
  std::vector<std::vector<uint8_t>> Download() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto& d : device_) {
      out.emplace_back(d->size());
      if (cudaMemcpy(out.back().data(), d->data(), d->size(), cudaMemcpyDeviceToHost) != cudaSuccess) out.clear();
    }
    return out;
  }

  const KvCacheLayout& kv() const { return kv_; }
  Cache& host() { return host_; }
  cuda::DevicePieces pieces() const { return plan_->pieces(); }
  CopyPlan HostPlan() const { return CopyPlan::Build(kv_, host_.Mapped()); }

 private:
  GpuCase(KvCacheLayout kv, const std::vector<uint64_t>& sizes) : kv_(std::move(kv)), host_(sizes) {}

  KvCacheLayout kv_;
  Cache host_;
  std::vector<std::unique_ptr<DeviceBytes>> device_;
  std::vector<uint8_t*> device_bases_;
  std::optional<cuda::DevicePlan> plan_;
};

// Slot memory for n blocks (plus `misalign` bytes in front), device or pinned.
struct Slots {
  Slots(SlotMemory memory, uint64_t bytes, uint64_t offset) : misalign(offset) {
    if (memory == SlotMemory::kDevice) {
      device = std::make_unique<DeviceBytes>(bytes + misalign);
    } else {
      pinned = std::make_unique<PinnedBytes>(bytes + misalign);
    }
  }
  uint8_t* data() const { return (device ? device->data() : pinned->data()) + misalign; }
  bool ok() const { return (device ? device->data() : pinned->data()) != nullptr; }
  std::vector<uint8_t> Read(uint64_t bytes) const {
    std::vector<uint8_t> out(bytes);
    if (cudaMemcpy(out.data(), data(), bytes, cudaMemcpyDefault) != cudaSuccess) out.clear();
    return out;
  }

  uint64_t misalign;
  std::unique_ptr<DeviceBytes> device;
  std::unique_ptr<PinnedBytes> pinned;
};

// Gathers `blocks` with the kernel and with the reference, and scatters
// random slots back both ways; every byte must agree.
void CheckCase(const CopyCase& c, uint64_t seed, SlotMemory memory, uint64_t misalign) {
  SCOPED_TRACE(c.description + ", seed " + std::to_string(seed) +
               (memory == SlotMemory::kDevice ? ", device slots" : ", pinned slots") + ", misalign " +
               std::to_string(misalign));
  std::unique_ptr<GpuCase> g = GpuCase::Make(c, seed);
  ASSERT_TRUE(g->Upload());
  const uint64_t block_bytes = g->kv().layout().block_bytes();
  // Every block, in reverse, so that slot i is not engine block i.
  std::vector<uint32_t> ids(g->kv().num_blocks());
  std::iota(ids.rbegin(), ids.rend(), 0u);
  const uint64_t total = block_bytes * ids.size();
  Slots slots(memory, total, misalign);
  ASSERT_TRUE(slots.ok());
  std::vector<BlockCopy> copies;
  for (size_t i = 0; i < ids.size(); ++i) copies.push_back(BlockCopy{ids[i], slots.data() + i * block_bytes});

  // Gather.
  KVTIER_ASSERT_CUDA(cuda::LaunchGather(g->pieces(), copies, nullptr));
  KVTIER_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = slots.Read(total);
  ASSERT_EQ(got.size(), total);
  const CopyPlan host_plan = g->HostPlan();
  std::vector<uint8_t> expected(total);
  for (size_t i = 0; i < ids.size(); ++i) GatherBlock(host_plan, ids[i], expected.data() + i * block_bytes);
  if (const std::optional<size_t> d = FirstDifference(got, expected, total)) {
    FAIL() << "gather: slot byte " << *d % block_bytes << " of block " << ids[*d / block_bytes] << " differs";
  }

  // Scatter random slot contents over the engine cache.
  std::vector<uint8_t> fresh(total);
  FillPattern(fresh, seed ^ 0x5ca77e5);
  KVTIER_ASSERT_CUDA(cudaMemcpy(slots.data(), fresh.data(), total, cudaMemcpyDefault));
  KVTIER_ASSERT_CUDA(cuda::LaunchScatter(g->pieces(), copies, nullptr));
  KVTIER_ASSERT_CUDA(cudaDeviceSynchronize());
  for (size_t i = 0; i < ids.size(); ++i) ScatterBlock(host_plan, ids[i], fresh.data() + i * block_bytes);
  const std::vector<std::vector<uint8_t>> regions = g->Download();
  ASSERT_EQ(regions.size(), g->host().regions.size());
  for (size_t r = 0; r < regions.size(); ++r) {
    if (const std::optional<size_t> d = FirstDifference(regions[r], g->host().regions[r], regions[r].size())) {
      FAIL() << "scatter: region " << r << " byte " << *d << " differs";
    }
  }
}

class CopyKernelsGpuTest : public ::testing::TestWithParam<layout_cases::NamedCase> {
 protected:
  void SetUp() override { KVTIER_SKIP_WITHOUT_GPU(); }
};

TEST_P(CopyKernelsGpuTest, MatchesTheCpuReference) {
  const CopyCase c = GetParam().make();
  for (SlotMemory memory : {SlotMemory::kDevice, SlotMemory::kPinned}) {
    for (uint64_t misalign : {0, 4, 1}) {
      CheckCase(c, 7, memory, misalign);
      if (HasFatalFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, CopyKernelsGpuTest, ::testing::ValuesIn(layout_cases::NamedCases()),
                         [](const auto& param_info) { return param_info.param.name; });

TEST(CopyKernelsGpuRandomTest, MatchesTheCpuReferenceOnRandomLayouts) {
  KVTIER_SKIP_WITHOUT_GPU();
  for (uint64_t seed = 1; seed <= 150; ++seed) {
    const CopyCase c = layout_cases::RandomCase(seed);
    CheckCase(c, seed, seed % 2 == 0 ? SlotMemory::kDevice : SlotMemory::kPinned, seed % 5 == 0 ? 2 : 0);
    if (HasFatalFailure()) return;
  }
}

// More blocks than one launch takes (kBlocksPerLaunch), and large 2 MiB
// blocks split over many CTAs.
TEST(CopyKernelsGpuRandomTest, ManyLargeBlocksInOneCall) {
  KVTIER_SKIP_WITHOUT_GPU();
  CopyCase c = layout_cases::VllmNhdCase();
  c.spec.num_layers = 32;
  c.spec.num_kv_heads = 8;
  c.spec.head_dim = 128;
  c.spec.block_tokens = 16;
  c.num_blocks = cuda::kBlocksPerLaunch + 37;
  const uint64_t tensor = uint64_t{c.num_blocks} * 16 * 8 * 128 * 2;
  c.region_sizes.assign(32, 2 * tensor);
  c.placements = KvCacheLayout::VllmNhd;
  c.description = "vLLM NHD, 2 MiB blocks";
  CheckCase(c, 99, SlotMemory::kPinned, 0);
}

}  // namespace
}  // namespace kvtier
