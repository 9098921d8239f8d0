// The CUDA fp8 codec kernels on a GPU against the CPU codec (kernels/
// codec.h), byte for byte: encode gathers the engine's blocks from device
// memory into coded slots (pinned host memory, as the host tier is, and
// device memory), decode writes coded slots back into the engine's pages. On
// every named layout of 2-byte elements and on random ones; a NaN flags its
// block. Skipped without a GPU; tools/gpu-check.sh runs it on one.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/copy_plan.h"
#include "kernels/copy_reference.h"
#include "kernels/cuda/codec_kernels.h"
#include "kernels/cuda/cuda_util.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/kernels/codec_cases.h"
#include "tests/kernels/layout_cases.h"

namespace kvtier {
namespace {

using gpu_testing::DeviceBytes;
using gpu_testing::PinnedBytes;
using layout_cases::Cache;
using layout_cases::CopyCase;
using layout_cases::FirstDifference;

enum class SlotMemory { kDevice, kPinned };

// `tiny`: bf16 values shifted down to subnormals (codec_cases::MakeTiny).
void CheckCase(const CopyCase& c, uint64_t seed, uint32_t group, SlotMemory memory, bool tiny = false) {
  SCOPED_TRACE(c.description + ", seed " + std::to_string(seed) + ", groups of " + std::to_string(group) +
               (memory == SlotMemory::kDevice ? ", device slots" : ", pinned slots") + (tiny ? ", tiny values" : ""));
  Result<KvCacheLayout> kv = layout_cases::MakeKvCacheLayout(c);
  ASSERT_TRUE(kv.has_value()) << kv.error();
  const DType dtype = kv->layout().spec().dtype;
  const CodecParams codec{.kind = CodecKind::kFp8, .dtype = dtype, .group_elems = group};
  Cache host(c.region_sizes);
  codec_cases::FillFinite(host, *kv, seed);
  if (tiny) {
    ASSERT_EQ(dtype, DType::kBf16);
    codec_cases::MakeTiny(host);
  }
  // The engine's regions on the device.
  std::vector<std::unique_ptr<DeviceBytes>> regions;
  std::vector<uint8_t*> bases;
  for (size_t r = 0; r < c.region_sizes.size(); ++r) {
    regions.push_back(std::make_unique<DeviceBytes>(c.region_sizes[r]));
    ASSERT_NE(regions.back()->data(), nullptr);
    bases.push_back(regions.back()->data());
    KVTIER_ASSERT_CUDA(
        cudaMemcpy(bases.back(), host.regions[r].data(), c.region_sizes[r], cudaMemcpyHostToDevice));
  }
  Result<cuda::DevicePlan> plan = cuda::DevicePlan::Upload(CopyPlan::Build(*kv, MappedRegions{bases}), 0);
  ASSERT_TRUE(plan.has_value()) << plan.error();
  const CopyPlan host_plan = CopyPlan::Build(*kv, host.Mapped());

  const uint64_t block_bytes = kv->layout().block_bytes();
  const cuda::Fp8Shape shape = cuda::detail::Fp8ShapeOf(block_bytes, group, dtype == DType::kBf16);
  const size_t coded = BlockCodec::MaxEncodedBytes(codec, block_bytes);
  const uint32_t n = kv->num_blocks();
  std::unique_ptr<DeviceBytes> device_slots;
  std::unique_ptr<PinnedBytes> pinned_slots;
  uint8_t* slots = nullptr;
  if (memory == SlotMemory::kDevice) {
    device_slots = std::make_unique<DeviceBytes>(coded * n);
    slots = device_slots->data();
  } else {
    pinned_slots = std::make_unique<PinnedBytes>(coded * n);
    slots = pinned_slots->data();
  }
  ASSERT_NE(slots, nullptr);
  DeviceBytes flags(sizeof(uint32_t) * n);
  ASSERT_NE(flags.data(), nullptr);
  auto read_flags = [&] {
    std::vector<uint32_t> out(n);
    if (cudaMemcpy(out.data(), flags.data(), out.size() * 4, cudaMemcpyDeviceToHost) != cudaSuccess) out.clear();
    return out;
  };
  std::unique_ptr<BlockCodec> coder = BlockCodec::Create().value();

  // Encode every block, in reverse (slot i is not engine block i).
  std::vector<cuda::CodedBlock> stores;
  for (uint32_t i = 0; i < n; ++i) stores.push_back({n - 1 - i, slots + i * coded});
  KVTIER_ASSERT_CUDA(cudaMemset(flags.data(), 0, flags.size()));
  KVTIER_ASSERT_CUDA(cuda::LaunchFp8Encode(plan->pieces(), shape, stores, reinterpret_cast<uint32_t*>(flags.data()),
                                           nullptr));
  KVTIER_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> got(coded * n);
  KVTIER_ASSERT_CUDA(cudaMemcpy(got.data(), slots, got.size(), cudaMemcpyDefault));
  std::vector<uint8_t> raw(block_bytes);
  std::vector<uint8_t> want(coded);
  for (uint32_t i = 0; i < n; ++i) {
    GatherBlock(host_plan, stores[i].engine_block, raw.data());
    ASSERT_EQ(coder->Encode(codec, raw, want), coded);
    const std::vector<uint8_t> slot(got.begin() + i * coded, got.begin() + (i + 1) * coded);
    if (const std::optional<size_t> d = FirstDifference(slot, want, coded)) {
      FAIL() << "encode: byte " << *d << " of block " << i << " differs from the CPU codec's";
    }
  }
  for (uint32_t f : read_flags()) ASSERT_EQ(f, 0u);

  // Decode slot i into engine block i; the reference decodes on the CPU.
  std::vector<cuda::CodedBlock> loads;
  for (uint32_t i = 0; i < n; ++i) loads.push_back({i, slots + i * coded});
  KVTIER_ASSERT_CUDA(cudaMemset(flags.data(), 0, flags.size()));
  KVTIER_ASSERT_CUDA(cuda::LaunchFp8Decode(plan->pieces(), shape, loads, reinterpret_cast<uint32_t*>(flags.data()),
                                           nullptr));
  KVTIER_ASSERT_CUDA(cudaDeviceSynchronize());
  for (uint32_t i = 0; i < n; ++i) {
    ASSERT_TRUE(coder->Decode(codec, std::span(got.data() + i * coded, coded), raw).ok());
    ScatterBlock(host_plan, i, raw.data());
  }
  for (size_t r = 0; r < regions.size(); ++r) {
    std::vector<uint8_t> device(c.region_sizes[r]);
    KVTIER_ASSERT_CUDA(cudaMemcpy(device.data(), bases[r], device.size(), cudaMemcpyDeviceToHost));
    if (const std::optional<size_t> d = FirstDifference(device, host.regions[r], device.size())) {
      FAIL() << "decode: region " << r << " byte " << *d << " differs";
    }
  }
  for (uint32_t f : read_flags()) ASSERT_EQ(f, 0u);

  // A NaN code in one slot flags the decode (one flag for the launch).
  const uint8_t nan_code = 0x7f;
  KVTIER_ASSERT_CUDA(cudaMemcpy(slots + (n - 1) * coded + shape.groups * 4 + shape.elems / 3, &nan_code, 1,
                                cudaMemcpyDefault));
  KVTIER_ASSERT_CUDA(cudaMemset(flags.data(), 0, flags.size()));
  KVTIER_ASSERT_CUDA(cuda::LaunchFp8Decode(plan->pieces(), shape, loads, reinterpret_cast<uint32_t*>(flags.data()),
                                           nullptr));
  KVTIER_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(read_flags().at(0), 1u) << "a NaN code in the last slot was decoded without a flag";

  // A NaN in engine block 0 flags its encode, and only its.
  GatherBlock(host_plan, 0, raw.data());
  const uint16_t nan = dtype == DType::kBf16 ? 0x7fc0 : 0x7e00;
  std::memcpy(raw.data() + 2 * (shape.elems / 2), &nan, 2);
  ScatterBlock(host_plan, 0, raw.data());
  for (size_t r = 0; r < regions.size(); ++r) {
    KVTIER_ASSERT_CUDA(cudaMemcpy(bases[r], host.regions[r].data(), c.region_sizes[r], cudaMemcpyHostToDevice));
  }
  KVTIER_ASSERT_CUDA(cudaMemset(flags.data(), 0, flags.size()));
  KVTIER_ASSERT_CUDA(cuda::LaunchFp8Encode(plan->pieces(), shape, stores, reinterpret_cast<uint32_t*>(flags.data()),
                                           nullptr));
  KVTIER_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<uint32_t> flagged = read_flags();
  ASSERT_EQ(flagged.size(), n);
  for (uint32_t i = 0; i < n; ++i) EXPECT_EQ(flagged[i], stores[i].engine_block == 0 ? 1u : 0u) << "block " << i;
}

class CodecKernelsGpuTest : public ::testing::TestWithParam<layout_cases::NamedCase> {
 protected:
  void SetUp() override { KVTIER_SKIP_WITHOUT_GPU(); }
};

TEST_P(CodecKernelsGpuTest, MatchesTheCpuCodec) {
  const CopyCase c = GetParam().make();
  for (SlotMemory memory : {SlotMemory::kPinned, SlotMemory::kDevice}) {
    for (uint32_t group : {c.spec.head_dim, 7u}) {
      CheckCase(c, 9, group, memory);
      if (HasFatalFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, CodecKernelsGpuTest, ::testing::ValuesIn(codec_cases::Fp8Cases()),
                         [](const auto& param_info) { return param_info.param.name; });

TEST(CodecKernelsGpuRandomTest, MatchesTheCpuCodecOnRandomLayoutsAndManyLargeBlocks) {
  KVTIER_SKIP_WITHOUT_GPU();
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    const CopyCase c = layout_cases::RandomCase(seed);
    if (!codec_cases::TwoByteFloats(c.spec.dtype)) continue;
    CheckCase(c, seed, seed % 2 == 0 ? c.spec.head_dim : 3, seed % 3 == 0 ? SlotMemory::kDevice : SlotMemory::kPinned);
    if (HasFatalFailure()) return;
    // Groups so small that 448/amax passes the largest float: the GPU's
    // arithmetic (no fused multiply-adds, subnormals kept) must give the
    // CPU codec's bytes there too.
    if (c.spec.dtype == DType::kBf16) {
      CheckCase(c, seed, c.spec.head_dim, SlotMemory::kPinned, /*tiny=*/true);
      if (HasFatalFailure()) return;
    }
  }
  // More blocks than one launch takes, of 2 MiB (vLLM's NHD, Llama-8B-like).
  CopyCase c = layout_cases::VllmNhdCase();
  c.spec.num_layers = 32;
  c.spec.num_kv_heads = 8;
  c.spec.head_dim = 128;
  c.spec.block_tokens = 16;
  c.spec.dtype = DType::kBf16;
  c.num_blocks = cuda::kBlocksPerLaunch + 9;
  const uint64_t tensor = uint64_t{c.num_blocks} * 16 * 8 * 128 * 2;
  c.region_sizes.assign(32, 2 * tensor);
  c.placements = KvCacheLayout::VllmNhd;
  c.description = "vLLM NHD, 2 MiB blocks";
  CheckCase(c, 77, 128, SlotMemory::kPinned);
}

}  // namespace
}  // namespace kvtier
