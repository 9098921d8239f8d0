// The CUDA fp8 codec kernels' per-thread code (kernels/cuda/
// codec_kernel_body.h), run on the CPU for every thread of every CTA of the
// launch the GPU would run, against the CPU codec (kernels/codec.h) on the
// gathered block: encode must write the codec's bytes exactly, and decode
// must leave the engine's pages as the codec's decode scattered by the CPU
// reference would. On every named engine layout of 2-byte elements and on
// random ones, with groups of a head, of 7 (groups that straddle rows and
// pieces) and of 1. tests/gpu/ runs the kernels themselves on a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/copy_plan.h"
#include "kernels/copy_reference.h"
#include "kernels/cuda/codec_kernel_body.h"
#include "kernels/fp8_e4m3.h"
#include "tests/kernels/codec_cases.h"
#include "tests/kernels/layout_cases.h"

namespace kvtier {
namespace {

using cuda::detail::CodedBlock;
using cuda::detail::Fp8Shape;
using layout_cases::Cache;
using layout_cases::CopyCase;
using layout_cases::FirstDifference;

void EmulateEncode(const CopyPlan& plan, const Fp8Shape& shape, const std::vector<CodedBlock>& blocks,
                   std::vector<uint32_t>& flags) {
  const auto n = static_cast<uint32_t>(plan.pieces().size());
  for (size_t b = 0; b < blocks.size(); ++b) {
    for (uint32_t cta = 0; cta < cuda::detail::Fp8EncodeCtas(shape); ++cta) {
      // The CTA's shared words, zeroed; phase 2 starts once every thread
      // did phase 1 (the kernel's barrier).
      std::vector<uint32_t> amax(cuda::detail::Fp8TileGroups(shape), 0);
      for (uint32_t t = 0; t < cuda::detail::kCodecThreads; ++t) {
        cuda::detail::Fp8EncodeAmax(plan.pieces().data(), n, shape, blocks[b], &flags[b], amax.data(), cta, t);
      }
      for (uint32_t t = 0; t < cuda::detail::kCodecThreads; ++t) {
        cuda::detail::Fp8EncodeWrite(plan.pieces().data(), n, shape, blocks[b], amax.data(), cta, t);
      }
    }
  }
}

void EmulateDecode(const CopyPlan& plan, const Fp8Shape& shape, const std::vector<CodedBlock>& blocks,
                   std::vector<uint32_t>& flags) {
  const auto n = static_cast<uint32_t>(plan.pieces().size());
  for (size_t b = 0; b < blocks.size(); ++b) {
    for (uint32_t cta = 0; cta < cuda::detail::Fp8DecodeCtas(shape); ++cta) {
      for (uint32_t t = 0; t < cuda::detail::kCodecThreads; ++t) {
        cuda::detail::Fp8DecodeThread(plan.pieces().data(), n, shape, blocks[b], &flags[b], cta, t);
      }
    }
  }
}

// `tiny`: every bf16 value's magnitude bits shifted down by 8, making
// subnormals (and zeros): groups whose 448/amax is past the largest float.
void CheckCase(const CopyCase& c, uint64_t seed, uint32_t group, bool tiny = false) {
  SCOPED_TRACE(c.description + ", seed " + std::to_string(seed) + ", groups of " + std::to_string(group) +
               (tiny ? ", tiny values" : ""));
  Result<KvCacheLayout> kv = layout_cases::MakeKvCacheLayout(c);
  ASSERT_TRUE(kv.has_value()) << kv.error();
  const DType dtype = kv->layout().spec().dtype;
  const CodecParams codec{.kind = CodecKind::kFp8, .dtype = dtype, .group_elems = group};
  Cache engine(c.region_sizes);
  codec_cases::FillFinite(engine, *kv, seed);
  if (tiny) {
    ASSERT_EQ(dtype, DType::kBf16);
    codec_cases::MakeTiny(engine);
  }
  const CopyPlan plan = CopyPlan::Build(*kv, engine.Mapped());
  const uint64_t block_bytes = kv->layout().block_bytes();
  std::vector<uint8_t> raw(block_bytes);
  for (size_t i = 1; i < plan.pieces().size(); ++i) {
    ASSERT_LT(plan.pieces()[i - 1].slot_offset, plan.pieces()[i].slot_offset) << "pieces in slot order";
  }
  const Fp8Shape shape = cuda::detail::Fp8ShapeOf(block_bytes, group, dtype == DType::kBf16);
  const size_t coded_bytes = BlockCodec::MaxEncodedBytes(codec, block_bytes);
  ASSERT_EQ(coded_bytes, uint64_t{shape.groups} * 4 + shape.elems);
  std::unique_ptr<BlockCodec> coder = BlockCodec::Create().value();

  // Encode: every block, in reverse (slot i is not engine block i).
  const uint32_t n = kv->num_blocks();
  std::vector<uint8_t> slots(coded_bytes * n, 0xee);
  std::vector<CodedBlock> blocks;
  for (uint32_t i = 0; i < n; ++i) blocks.push_back({n - 1 - i, slots.data() + i * coded_bytes});
  std::vector<uint32_t> flags(n, 0);
  EmulateEncode(plan, shape, blocks, flags);
  std::vector<uint8_t> want(coded_bytes);
  for (uint32_t i = 0; i < n; ++i) {
    ASSERT_EQ(flags[i], 0u) << "block " << i << ": no NaN or Inf was put in";
    GatherBlock(plan, blocks[i].engine_block, raw.data());
    ASSERT_EQ(coder->Encode(codec, raw, want), coded_bytes);
    if (const std::optional<size_t> d = FirstDifference(std::vector<uint8_t>(blocks[i].slot, blocks[i].slot + coded_bytes),
                                                        want, coded_bytes)) {
      FAIL() << "encode: byte " << *d << " of block " << i << " differs from the CPU codec's";
    }
  }

  // Decode the codec's output into a copy of the engine; the reference
  // decodes on the CPU and scatters.
  Cache kernel_side(c.region_sizes);
  Cache reference(c.region_sizes);
  for (size_t r = 0; r < engine.regions.size(); ++r) {
    kernel_side.regions[r] = engine.regions[r];
    reference.regions[r] = engine.regions[r];
  }
  const CopyPlan kernel_plan = CopyPlan::Build(*kv, kernel_side.Mapped());
  const CopyPlan reference_plan = CopyPlan::Build(*kv, reference.Mapped());
  // Slot i decodes into engine block i this time.
  std::vector<CodedBlock> loads;
  for (uint32_t i = 0; i < n; ++i) loads.push_back({i, slots.data() + i * coded_bytes});
  std::fill(flags.begin(), flags.end(), 0u);
  EmulateDecode(kernel_plan, shape, loads, flags);
  for (uint32_t i = 0; i < n; ++i) {
    ASSERT_EQ(flags[i], 0u);
    ASSERT_TRUE(coder->Decode(codec, std::span(loads[i].slot, coded_bytes), raw).ok());
    ScatterBlock(reference_plan, i, raw.data());
  }
  for (size_t r = 0; r < engine.regions.size(); ++r) {
    if (const std::optional<size_t> d =
            FirstDifference(kernel_side.regions[r], reference.regions[r], reference.regions[r].size())) {
      FAIL() << "decode: region " << r << " byte " << *d << " differs";
    }
  }

  // A NaN in engine block 0 flags it (and only it); a NaN code in slot 0
  // flags its decode.
  GatherBlock(plan, 0, raw.data());
  const uint16_t nan = dtype == DType::kBf16 ? 0x7fc0 : 0x7e00;
  std::memcpy(raw.data() + 2 * (shape.elems / 2), &nan, 2);
  ScatterBlock(plan, 0, raw.data());
  std::fill(flags.begin(), flags.end(), 0u);
  EmulateEncode(plan, shape, blocks, flags);
  for (uint32_t i = 0; i < n; ++i) EXPECT_EQ(flags[i], blocks[i].engine_block == 0 ? 1u : 0u) << "block " << i;
  slots[uint64_t{shape.groups} * 4 + 3] = 0x7f;
  std::fill(flags.begin(), flags.end(), 0u);
  EmulateDecode(kernel_plan, shape, loads, flags);
  EXPECT_EQ(flags[0], 1u);
  EXPECT_FALSE(coder->Decode(codec, std::span(loads[0].slot, coded_bytes), raw).ok()) << "the CPU codec agrees";
}

class CodecKernelEmulationTest : public ::testing::TestWithParam<layout_cases::NamedCase> {};

TEST_P(CodecKernelEmulationTest, MatchesTheCpuCodec) {
  const CopyCase c = GetParam().make();
  for (uint32_t group : {c.spec.head_dim, 7u, 1u}) {
    CheckCase(c, 5, group);
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, CodecKernelEmulationTest, ::testing::ValuesIn(codec_cases::Fp8Cases()),
                         [](const auto& param_info) { return param_info.param.name; });

TEST(CodecKernelEmulationRandomTest, MatchesTheCpuCodecOnRandomLayouts) {
  int checked = 0;
  int tiny_checked = 0;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    CopyCase c = layout_cases::RandomCase(seed);
    if (!codec_cases::TwoByteFloats(c.spec.dtype)) continue;
    CheckCase(c, seed, seed % 2 == 0 ? c.spec.head_dim : 3);
    if (HasFatalFailure()) return;
    if (c.spec.dtype == DType::kBf16) {
      CheckCase(c, seed, c.spec.head_dim, /*tiny=*/true);
      if (HasFatalFailure()) return;
      ++tiny_checked;
    }
    ++checked;
  }
  EXPECT_GT(checked, 10);
  EXPECT_GT(tiny_checked, 2);
}

}  // namespace
}  // namespace kvtier
