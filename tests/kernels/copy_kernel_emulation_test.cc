// The CUDA kernels' per-thread code (kernels/cuda/copy_kernel_body.h), run on
// the CPU for every thread of every CTA of the launch the GPU would run, and
// compared byte for byte with the CPU reference on every named layout and on
// random ones, with slot bases of every alignment. Threads share nothing and
// never synchronise, so running them one after another is exact: this is
// the kernels' index arithmetic, splitting and vector-width choice, checked
// where no GPU is (tests/gpu/ runs them on one).
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "kernels/copy_plan.h"
#include "kernels/copy_reference.h"
#include "kernels/cuda/copy_kernel_body.h"
#include "tests/kernels/layout_cases.h"

namespace kvtier {
namespace {

using layout_cases::Cache;
using layout_cases::CopyCase;
using layout_cases::FillPattern;
using layout_cases::FirstDifference;

// Runs the launch LaunchGather/LaunchScatter would make, thread by thread.
template <bool kGather>
void Emulate(const CopyPlan& plan, const std::vector<BlockCopy>& blocks) {
  const uint32_t splits = cuda::detail::SplitsFor(plan.max_piece_bytes());
  const auto ctas = static_cast<uint32_t>(plan.pieces().size()) * splits;
  for (const BlockCopy& b : blocks) {
    for (uint32_t cta = 0; cta < ctas; ++cta) {
      for (uint32_t t = 0; t < cuda::detail::kThreads; ++t) {
        cuda::detail::CopyThread<kGather>(plan.pieces().data(), splits, b, cta, t);
      }
    }
  }
}

void CheckCase(const CopyCase& c, uint64_t seed, uint64_t misalign) {
  SCOPED_TRACE(c.description + ", seed " + std::to_string(seed) + ", slot misaligned by " +
               std::to_string(misalign));
  Result<KvCacheLayout> kv = layout_cases::MakeKvCacheLayout(c);
  ASSERT_TRUE(kv.has_value()) << kv.error();
  Cache engine(c.region_sizes);
  engine.Fill(seed);
  const CopyPlan plan = CopyPlan::Build(*kv, engine.Mapped());
  const uint64_t block_bytes = kv->layout().block_bytes();
  std::vector<uint32_t> ids(kv->num_blocks());
  std::iota(ids.rbegin(), ids.rend(), 0u);
  const uint64_t total = block_bytes * ids.size();
  // 16-byte aligned storage, then the requested misalignment.
  std::vector<uint64_t> storage((total + misalign + 15) / 8 + 2);
  uint8_t* slots = reinterpret_cast<uint8_t*>(storage.data()) + misalign;
  std::vector<BlockCopy> copies;
  for (size_t i = 0; i < ids.size(); ++i) copies.push_back(BlockCopy{ids[i], slots + i * block_bytes});

  Emulate<true>(plan, copies);
  std::vector<uint8_t> got(slots, slots + total);
  std::vector<uint8_t> expected(total);
  for (size_t i = 0; i < ids.size(); ++i) GatherBlock(plan, ids[i], expected.data() + i * block_bytes);
  if (const std::optional<size_t> d = FirstDifference(got, expected, total)) {
    FAIL() << "gather: slot byte " << *d % block_bytes << " of block " << ids[*d / block_bytes] << " differs";
  }

  std::vector<uint8_t> fresh(total);
  FillPattern(fresh, seed ^ 0xf00d);
  std::copy(fresh.begin(), fresh.end(), slots);
  Cache reference(c.region_sizes);
  for (size_t r = 0; r < engine.regions.size(); ++r) reference.regions[r] = engine.regions[r];
  Emulate<false>(plan, copies);
  const CopyPlan reference_plan = CopyPlan::Build(*kv, reference.Mapped());
  for (size_t i = 0; i < ids.size(); ++i) ScatterBlock(reference_plan, ids[i], fresh.data() + i * block_bytes);
  for (size_t r = 0; r < engine.regions.size(); ++r) {
    if (const std::optional<size_t> d =
            FirstDifference(engine.regions[r], reference.regions[r], engine.regions[r].size())) {
      FAIL() << "scatter: region " << r << " byte " << *d << " differs";
    }
  }
}

class CopyKernelEmulationTest : public ::testing::TestWithParam<layout_cases::NamedCase> {};

TEST_P(CopyKernelEmulationTest, MatchesTheCpuReferenceAtEverySlotAlignment) {
  const CopyCase c = GetParam().make();
  for (uint64_t misalign : {0, 1, 2, 4, 8}) {
    CheckCase(c, 3, misalign);
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, CopyKernelEmulationTest, ::testing::ValuesIn(layout_cases::NamedCases()),
                         [](const auto& param_info) { return param_info.param.name; });

TEST(CopyKernelEmulationRandomTest, MatchesTheCpuReferenceOnRandomLayouts) {
  for (uint64_t seed = 1; seed <= 120; ++seed) {
    CheckCase(layout_cases::RandomCase(seed), seed, seed % 3 == 0 ? seed % 16 : 0);
    if (HasFatalFailure()) return;
  }
}

// A 2 MiB contiguous block: one piece split over 64 CTAs.
TEST(CopyKernelEmulationRandomTest, LargePiecesSplitOverManyCtas) {
  CopyCase c = layout_cases::ContiguousKvCase();
  c.spec.num_layers = 32;
  c.spec.num_kv_heads = 8;
  c.spec.head_dim = 128;
  c.spec.block_tokens = 16;
  c.spec.dtype = DType::kBf16;
  c.num_blocks = 3;
  c.region_sizes = {3ull * (2 << 20)};
  c.description = "contiguous, 2 MiB blocks";
  Result<KvCacheLayout> kv = layout_cases::MakeKvCacheLayout(c);
  ASSERT_TRUE(kv.has_value()) << kv.error();
  ASSERT_EQ(kv->layout().block_bytes(), 2u << 20);
  Cache engine(c.region_sizes);
  const CopyPlan plan = CopyPlan::Build(*kv, engine.Mapped());
  ASSERT_EQ(plan.pieces().size(), 1u) << "a contiguous block is one piece";
  EXPECT_EQ(cuda::detail::SplitsFor(plan.max_piece_bytes()), 64u);
  CheckCase(c, 11, 0);
}

}  // namespace
}  // namespace kvtier
