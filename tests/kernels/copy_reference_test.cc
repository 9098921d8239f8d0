#include "kernels/copy_reference.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/kernels/layout_cases.h"

namespace kvtier {
namespace {

using layout_cases::Cache;
using layout_cases::CopyCase;
using layout_cases::FillPattern;
using layout_cases::FirstDifference;
using layout_cases::Loc;
using layout_cases::MakeKvCacheLayout;
using layout_cases::NamedCase;
using layout_cases::RandomCase;
using layout_cases::Rng;
using layout_cases::SlotByteSources;

constexpr size_t kGuardBytes = 64;
constexpr uint8_t kGuard = 0xA5;

// A slot of block_bytes followed by guard bytes that no copy may touch.
std::vector<uint8_t> NewSlot(uint64_t block_bytes) {
  return std::vector<uint8_t>(block_bytes + kGuardBytes, kGuard);
}

void ExpectGuardIntact(const std::vector<uint8_t>& slot, uint64_t block_bytes) {
  for (size_t i = block_bytes; i < slot.size(); ++i) {
    ASSERT_EQ(slot[i], kGuard) << "wrote past the slot at byte " << i;
  }
}

bool HasStridedPiece(const KvCacheLayout& kv) {
  for (uint32_t i = 0; i < kv.placements().size(); ++i) {
    if (!kv.PieceIsContiguous(i)) return true;
  }
  return false;
}

// Gathers `block` of `source` and expects, in the slot, exactly the bytes the
// case's index formula names, and no write to the engine cache or past the
// slot.
void ExpectGatherMatchesWalk(const CopyCase& c, const KvCacheLayout& kv, Cache& source,
                             uint32_t block) {
  SCOPED_TRACE("gather of block " + std::to_string(block));
  const uint64_t block_bytes = kv.layout().block_bytes();
  const std::vector<std::vector<uint8_t>> before = source.regions;
  const std::vector<Loc> sources = SlotByteSources(c, block);
  ASSERT_EQ(sources.size(), block_bytes);
  std::vector<uint8_t> expected(block_bytes);
  for (size_t i = 0; i < sources.size(); ++i) expected[i] = source.At(sources[i]);

  std::vector<uint8_t> slot = NewSlot(block_bytes);
  GatherBlock(kv, source.Mapped(), block, slot.data());
  const std::optional<size_t> diff = FirstDifference(slot, expected, block_bytes);
  ASSERT_FALSE(diff.has_value()) << "slot byte " << *diff << " differs: got " << int{slot[*diff]}
                                 << ", expected " << int{expected[*diff]};
  ExpectGuardIntact(slot, block_bytes);
  for (size_t r = 0; r < before.size(); ++r) {
    const std::optional<size_t> wrote =
        FirstDifference(source.regions[r], before[r], before[r].size());
    EXPECT_FALSE(wrote.has_value()) << "gather wrote to byte " << *wrote << " of region " << r;
  }
}

// Scatters a random slot (from `seed`) into `block` of a cache full of a
// pattern, and expects exactly the bytes the case's index formula names to
// change, to the slot's bytes; gathering the block back returns the slot.
void ExpectScatterWritesWalk(const CopyCase& c, const KvCacheLayout& kv, uint32_t block,
                             uint64_t seed) {
  SCOPED_TRACE("scatter of block " + std::to_string(block));
  const uint64_t block_bytes = kv.layout().block_bytes();
  std::vector<uint8_t> slot(block_bytes);
  FillPattern(slot, seed);
  // A background other than zero, so a byte that should not be written but
  // is, or should be but is not, shows up even where the slot holds a zero.
  Cache cache(c.region_sizes);
  cache.Fill(seed + 1);
  ScatterBlock(kv, cache.Mapped(), block, slot.data());

  Cache expected(c.region_sizes);
  expected.Fill(seed + 1);
  const std::vector<Loc> sources = SlotByteSources(c, block);
  for (size_t i = 0; i < sources.size(); ++i) expected.At(sources[i]) = slot[i];
  for (size_t r = 0; r < cache.regions.size(); ++r) {
    const std::optional<size_t> diff =
        FirstDifference(cache.regions[r], expected.regions[r], cache.regions[r].size());
    ASSERT_FALSE(diff.has_value())
        << "region " << r << " byte " << *diff << " differs: got " << int{cache.regions[r][*diff]}
        << ", expected " << int{expected.regions[r][*diff]};
  }

  std::vector<uint8_t> back = NewSlot(block_bytes);
  GatherBlock(kv, cache.Mapped(), block, back.data());
  EXPECT_FALSE(FirstDifference(back, slot, block_bytes).has_value());
  ExpectGuardIntact(back, block_bytes);
}

class CopyReferenceTest : public ::testing::TestWithParam<NamedCase> {
 protected:
  void SetUp() override {
    c_ = GetParam().make();
    Result<KvCacheLayout> kv = MakeKvCacheLayout(c_);
    ASSERT_TRUE(kv.has_value()) << kv.error();
    kv_.emplace(std::move(*kv));
    block_bytes_ = kv_->layout().block_bytes();
    EXPECT_EQ(HasStridedPiece(*kv_), c_.has_strided_piece);

    source_.emplace(c_.region_sizes);
    source_->Fill(1);
  }

  CopyCase c_;
  std::optional<KvCacheLayout> kv_;
  uint64_t block_bytes_ = 0;
  std::optional<Cache> source_;
};

TEST_P(CopyReferenceTest, GatherMatchesIndependentWalk) {
  for (uint32_t b = 0; b < c_.num_blocks; ++b) {
    ASSERT_NO_FATAL_FAILURE(ExpectGatherMatchesWalk(c_, *kv_, *source_, b));
  }
}

TEST_P(CopyReferenceTest, ScatterOfARandomSlotWritesIndependentWalk) {
  for (uint32_t b = 0; b < c_.num_blocks; ++b) {
    ASSERT_NO_FATAL_FAILURE(ExpectScatterWritesWalk(c_, *kv_, b, 1000 + b));
  }
}

TEST_P(CopyReferenceTest, RoundTripRestoresOnlyTheCopiedBlocks) {
  // The last block and one in the middle; block 0 and the rest stay zero.
  const std::vector<uint32_t> blocks = {c_.num_blocks - 1, 1};
  ASSERT_GE(c_.num_blocks, 3u);
  Cache cache(c_.region_sizes);
  Cache expected(c_.region_sizes);
  std::vector<std::vector<bool>> written;
  for (const std::vector<uint8_t>& r : cache.regions) written.emplace_back(r.size(), false);
  for (uint32_t b : blocks) {
    std::vector<uint8_t> slot = NewSlot(block_bytes_);
    GatherBlock(*kv_, source_->Mapped(), b, slot.data());
    ExpectGuardIntact(slot, block_bytes_);
    ScatterBlock(*kv_, cache.Mapped(), b, slot.data());
    for (const Loc& loc : SlotByteSources(c_, b)) {
      expected.At(loc) = source_->At(loc);
      ASSERT_FALSE(written[loc.region][loc.offset]) << "the test's layout overlaps itself";
      written[loc.region][loc.offset] = true;
    }
  }
  for (size_t r = 0; r < cache.regions.size(); ++r) {
    const std::optional<size_t> diff =
        FirstDifference(cache.regions[r], expected.regions[r], cache.regions[r].size());
    ASSERT_FALSE(diff.has_value())
        << "region " << r << " byte " << *diff << ": got " << int{cache.regions[r][*diff]}
        << ", expected " << int{expected.regions[r][*diff]}
        << (written[r][*diff] ? "" : " (a byte no copied block owns)");
  }
}

// A plan by layer (layer-by-layer loads): scattering layer after layer
// writes, after layer l, exactly the bytes of layers 0..l that ScatterBlock
// writes, and nothing else; the plan's layers cover the whole block.
void ExpectLayerByLayerScatter(const CopyCase& c, const KvCacheLayout& kv, uint32_t block, uint64_t seed) {
  SCOPED_TRACE("layer-by-layer scatter of block " + std::to_string(block));
  const uint64_t block_bytes = kv.layout().block_bytes();
  const uint64_t layer_bytes = kv.layout().layer_bytes();
  const uint32_t layers = kv.layout().spec().num_layers;
  std::vector<uint8_t> slot(block_bytes);
  FillPattern(slot, seed);
  Cache cache(c.region_sizes);
  cache.Fill(seed + 1);
  Cache expected(c.region_sizes);
  expected.Fill(seed + 1);
  const CopyPlan plan = CopyPlan::Build(kv, cache.Mapped(), /*by_layer=*/true);
  ASSERT_EQ(plan.num_layers(), layers);
  uint64_t covered = 0;
  for (uint32_t l = 0; l < layers; ++l) {
    for (const CopyPiece& piece : plan.layer_pieces(l)) {
      EXPECT_GE(piece.slot_offset, l * layer_bytes) << "layer " << l;
      EXPECT_LE(piece.slot_offset + piece.bytes(), (l + 1) * layer_bytes) << "layer " << l;
      covered += piece.bytes();
    }
  }
  EXPECT_EQ(covered, block_bytes);
  const std::vector<Loc> sources = SlotByteSources(c, block);
  for (uint32_t l = 0; l < layers; ++l) {
    ScatterBlockLayer(plan, block, l, slot.data());
    for (uint64_t i = l * layer_bytes; i < (l + 1) * layer_bytes; ++i) expected.At(sources[i]) = slot[i];
    for (size_t r = 0; r < cache.regions.size(); ++r) {
      const std::optional<size_t> diff =
          FirstDifference(cache.regions[r], expected.regions[r], cache.regions[r].size());
      ASSERT_FALSE(diff.has_value()) << "after layer " << l << ": region " << r << " byte " << *diff;
    }
  }
}

// A store by layer (HostBackend, LayerGate): each layer gathered into its
// own bytes of the slot, and once every layer is in, the slot is what a
// whole gather writes, with the same checksum.
void ExpectLayerByLayerGather(const KvCacheLayout& kv, const CopyCase& c, uint32_t block, uint64_t seed) {
  SCOPED_TRACE("layer-by-layer gather of block " + std::to_string(block));
  const uint64_t block_bytes = kv.layout().block_bytes();
  const uint64_t layer_bytes = kv.layout().layer_bytes();
  Cache cache(c.region_sizes);
  cache.Fill(seed);
  std::vector<uint8_t> whole(block_bytes);
  uint64_t checksum = 0;
  GatherBlock(CopyPlan::Build(kv, cache.Mapped()), block, whole.data(), &checksum);
  const CopyPlan plan = CopyPlan::Build(kv, cache.Mapped(), /*by_layer=*/true);
  std::vector<uint8_t> slot(block_bytes, 0xee);
  for (uint32_t l = 0; l < kv.layout().spec().num_layers; ++l) {
    GatherBlockLayer(plan, block, l, slot.data());
    ASSERT_EQ(std::memcmp(slot.data(), whole.data(), (l + 1) * layer_bytes), 0) << "after layer " << l;
    ASSERT_TRUE(std::all_of(slot.begin() + static_cast<std::ptrdiff_t>((l + 1) * layer_bytes), slot.end(),
                            [](uint8_t x) { return x == 0xee; }))
        << "layer " << l << " wrote past its bytes";
  }
  EXPECT_EQ(ChecksumOf(slot.data(), block_bytes), checksum);
}

TEST_P(CopyReferenceTest, LayerByLayerGatherFillsEachLayerAndSumsAsAWholeGather) {
  for (uint32_t b : {0u, c_.num_blocks - 1}) {
    ASSERT_NO_FATAL_FAILURE(ExpectLayerByLayerGather(*kv_, c_, b, 3000 + b));
  }
}

TEST(CopyReferenceRandomLayouts, LayerByLayerGatherFillsEachLayerAndSumsAsAWholeGather) {
  for (uint64_t seed = 1; seed <= 100; ++seed) {
    const CopyCase c = RandomCase(seed);
    SCOPED_TRACE("RandomCase(" + std::to_string(seed) + "): " + c.description);
    Result<KvCacheLayout> kv = MakeKvCacheLayout(c);
    ASSERT_TRUE(kv.has_value()) << kv.error();
    ASSERT_NO_FATAL_FAILURE(ExpectLayerByLayerGather(*kv, c, c.num_blocks - 1, seed << 9));
  }
}

TEST_P(CopyReferenceTest, LayerByLayerScatterWritesEachLayerAndNothingElse) {
  for (uint32_t b : {0u, c_.num_blocks - 1}) {
    ASSERT_NO_FATAL_FAILURE(ExpectLayerByLayerScatter(c_, *kv_, b, 2000 + b));
  }
}

TEST(CopyReferenceRandomLayouts, LayerByLayerScatterWritesEachLayerAndNothingElse) {
  for (uint64_t seed = 1; seed <= 100; ++seed) {
    const CopyCase c = RandomCase(seed);
    SCOPED_TRACE("RandomCase(" + std::to_string(seed) + "): " + c.description);
    Result<KvCacheLayout> kv = MakeKvCacheLayout(c);
    ASSERT_TRUE(kv.has_value()) << kv.error();
    ASSERT_NO_FATAL_FAILURE(ExpectLayerByLayerScatter(c, *kv, c.num_blocks - 1, seed << 8));
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, CopyReferenceTest,
                         ::testing::ValuesIn(layout_cases::NamedCases()),
                         [](const ::testing::TestParamInfo<NamedCase>& param_info) {
                           return param_info.param.name;
                         });

// Hundreds of random engine layouts (layout_cases::RandomCase), a few blocks
// of each: the last one, whose bytes end a region, and two at random.
TEST(CopyReferenceRandomLayouts, GatherAndScatterMatchIndependentWalk) {
  constexpr uint64_t kSeeds = 300;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    const CopyCase c = RandomCase(seed);
    SCOPED_TRACE("RandomCase(" + std::to_string(seed) + "): " + c.description);
    Result<KvCacheLayout> kv = MakeKvCacheLayout(c);
    ASSERT_TRUE(kv.has_value()) << kv.error();
    EXPECT_EQ(HasStridedPiece(*kv), c.has_strided_piece);
    Cache source(c.region_sizes);
    source.Fill(seed << 8);

    Rng rng(~seed);  // not RandomCase's own stream
    std::vector<uint32_t> blocks = {c.num_blocks - 1,
                                    static_cast<uint32_t>(rng.Between(0, c.num_blocks - 1)),
                                    static_cast<uint32_t>(rng.Between(0, c.num_blocks - 1))};
    std::sort(blocks.begin(), blocks.end());
    blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
    // The case's own formula must not send two bytes of these blocks to one
    // engine byte, or a copy that mixes them up would go unnoticed.
    std::vector<std::vector<uint8_t>> owned;  // not vector<bool>: slow in debug builds
    for (uint64_t size : c.region_sizes) owned.emplace_back(size, 0);
    for (uint32_t b : blocks) {
      for (const Loc& loc : SlotByteSources(c, b)) {
        // Plain ifs: an assertion per byte is slow in debug builds.
        if (loc.region >= owned.size() || loc.offset >= owned[loc.region].size()) {
          FAIL() << "the case's formula leaves its regions: block " << b << " region " << loc.region
                 << " byte " << loc.offset;
        }
        if (owned[loc.region][loc.offset]) {
          FAIL() << "the case's layout overlaps itself: block " << b << " region " << loc.region
                 << " byte " << loc.offset;
        }
        owned[loc.region][loc.offset] = 1;
      }
    }

    for (uint32_t b : blocks) {
      ASSERT_NO_FATAL_FAILURE(ExpectGatherMatchesWalk(c, *kv, source, b));
      ASSERT_NO_FATAL_FAILURE(ExpectScatterWritesWalk(c, *kv, b, (seed << 8) + b + 1));
    }
  }
}

// The streaming copy around its edges: rows shorter than its threshold, a
// destination that starts anywhere within a cache line, a source that does
// not, and a tail shorter than a line. The bytes around the destination stay
// untouched, and the checksum is the slot's.
TEST(StreamingCopy, CopiesEveryByteAndNothingElseAtAnyAlignment) {
  Rng rng(7);
  std::vector<uint8_t> src(64 << 10);
  for (uint8_t& b : src) b = static_cast<uint8_t>(rng.Next());
  for (uint64_t size : {0ul, 1ul, 63ul, 64ul, 1023ul, 1024ul, 1025ul, 4095ul, 4096ul, 4097ul, 9000ul, 40000ul}) {
    for (uint64_t dst_offset : {0ul, 1ul, 15ul, 16ul, 33ul, 63ul}) {
      for (uint64_t src_offset : {0ul, 5ul, 64ul}) {
        // dst_offset from a cache line's start (a vector promises only 16).
        std::vector<uint8_t> dst(size + dst_offset + 2 * kGuardBytes + 128, kGuard);
        const uintptr_t line = (reinterpret_cast<uintptr_t>(dst.data()) + kGuardBytes + 63) & ~uintptr_t{63};
        uint8_t* const d = reinterpret_cast<uint8_t*>(line) + dst_offset;
        CopyStreaming(d, src.data() + src_offset, size);
        ASSERT_TRUE(std::equal(d, d + size, src.data() + src_offset))
            << size << " bytes, dst +" << dst_offset << ", src +" << src_offset;
        EXPECT_TRUE(std::all_of(dst.data(), d, [](uint8_t b) { return b == kGuard; }));
        EXPECT_TRUE(std::all_of(d + size, dst.data() + dst.size(), [](uint8_t b) { return b == kGuard; }));

        std::fill(dst.begin(), dst.end(), kGuard);
        EXPECT_EQ(CopyWithChecksum(d, src.data() + src_offset, size), ChecksumOf(src.data() + src_offset, size));
        ASSERT_TRUE(std::equal(d, d + size, src.data() + src_offset));
        EXPECT_TRUE(std::all_of(d + size, dst.data() + dst.size(), [](uint8_t b) { return b == kGuard; }));
      }
    }
  }
}

// A gather with cached stores (a codec's scratch) writes what a streaming one
// does, with the same checksum.
TEST_P(CopyReferenceTest, CachedAndStreamingGathersAgree) {
  const CopyPlan plan = CopyPlan::Build(*kv_, source_->Mapped());
  for (uint32_t b = 0; b < c_.num_blocks; ++b) {
    std::vector<uint8_t> streamed(block_bytes_), cached(block_bytes_);
    uint64_t streamed_sum = 0, cached_sum = 0;
    GatherBlock(plan, b, streamed.data(), &streamed_sum);
    GatherBlock(plan, b, cached.data(), &cached_sum, CopyStores::kCached);
    EXPECT_EQ(streamed, cached) << "block " << b;
    EXPECT_EQ(streamed_sum, cached_sum);
    EXPECT_EQ(streamed_sum, ChecksumOf(streamed.data(), block_bytes_));
  }
}

class CopyReferenceDeathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    c_ = layout_cases::VllmNhdCase();
    Result<KvCacheLayout> kv = MakeKvCacheLayout(c_);
    ASSERT_TRUE(kv.has_value()) << kv.error();
    kv_.emplace(std::move(*kv));
    slot_.resize(kv_->layout().block_bytes());
  }

  CopyCase c_;
  std::optional<KvCacheLayout> kv_;
  std::vector<uint8_t> slot_;
};

TEST_F(CopyReferenceDeathTest, OutOfRangeBlockAborts) {
  Cache cache(c_.region_sizes);
  EXPECT_DEATH(GatherBlock(*kv_, cache.Mapped(), c_.num_blocks, slot_.data()),
               "CHECK failed: block_id < ");
  EXPECT_DEATH(ScatterBlock(*kv_, cache.Mapped(), c_.num_blocks, slot_.data()),
               "CHECK failed: block_id < ");
  EXPECT_DEATH(GatherBlock(*kv_, cache.Mapped(), UINT32_MAX, slot_.data()), "block_id");
}

TEST_F(CopyReferenceDeathTest, MissingRegionAborts) {
  Cache cache(c_.region_sizes);
  MappedRegions short_regions{std::span<uint8_t* const>(cache.bases).first(2)};
  EXPECT_DEATH(GatherBlock(*kv_, short_regions, 0, slot_.data()), "region_bases.size\\(\\)");
}

}  // namespace
}  // namespace kvtier
