#include "kernels/copy_reference.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace kvtier {
namespace {

enum class Part { kK, kV, kScale };  // kK is also the latent of an MLA layout

struct Loc {
  uint32_t region = 0;
  uint64_t offset = 0;
};

// One engine cache, described twice: as placements (what the code under test
// reads) and as `locate`, the engine tensor's own index formula, from which
// the expected bytes are computed without going through KvCacheLayout.
struct CopyCase {
  LayoutSpec spec;
  uint32_t num_blocks = 0;
  std::function<std::vector<Placement>(const Layout&, uint32_t num_blocks)> placements;
  std::vector<uint64_t> region_sizes;
  // Start of row (t, h) of `part` of `layer` of engine block `block`; for
  // Part::kScale, the start of the scale bytes (t = h = 0).
  std::function<Loc(uint32_t layer, Part part, uint32_t block, uint32_t t, uint32_t h)> locate;
  // At least one piece is strided, so the row-by-row path runs.
  bool has_strided_piece = false;
};

LayoutSpec KvSpec(DType dtype, uint32_t scale_bytes = 0) {
  return LayoutSpec{.model_id = "test/kv",
                    .num_layers = 3,
                    .kv_kind = KvKind::kSeparateKv,
                    .num_kv_heads = 2,
                    .head_dim = 8,
                    .dtype = dtype,
                    .block_tokens = 4,
                    .scale_bytes_per_layer = scale_bytes};
}

LayoutSpec LatentSpec(DType dtype, uint32_t scale_bytes = 0) {
  return LayoutSpec{.model_id = "test/mla",
                    .num_layers = 2,
                    .kv_kind = KvKind::kLatent,
                    .num_kv_heads = 1,
                    .head_dim = 576,
                    .dtype = dtype,
                    .block_tokens = 4,
                    .scale_bytes_per_layer = scale_bytes};
}

// Index of K or V in a [2, ...] tensor.
uint64_t KvIndex(Part part) { return part == Part::kV ? 1 : 0; }

// vLLM's default: per layer [2, num_blocks, tokens, heads, head_dim].
CopyCase VllmNhdCase() {
  CopyCase c;
  c.spec = KvSpec(DType::kFp16);
  c.num_blocks = 5;
  constexpr uint64_t N = 5, T = 4, H = 2, D = 8, E = 2;
  c.placements = KvCacheLayout::VllmNhd;
  c.region_sizes = std::vector<uint64_t>(3, 2 * N * T * H * D * E);
  c.locate = [](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
    return Loc{layer, (((KvIndex(part) * N + b) * T + t) * H + h) * D * E};
  };
  return c;
}

// vLLM's HND: per layer [2, num_blocks, heads, tokens, head_dim], with a few
// bytes of padding after each tensor.
CopyCase VllmHndCase() {
  CopyCase c;
  c.spec = KvSpec(DType::kBf16);
  c.num_blocks = 5;
  constexpr uint64_t N = 5, T = 4, H = 2, D = 8, E = 2, kPad = 24;
  c.placements = [](const Layout& layout, uint32_t) {
    std::vector<Placement> p;
    for (uint32_t layer = 0; layer < layout.spec().num_layers; ++layer) {
      for (uint64_t part = 0; part < 2; ++part) {
        p.push_back(Placement{layer, part * N * H * T * D * E, H * T * D * E, D * E, T * D * E});
      }
    }
    return p;
  };
  c.region_sizes = std::vector<uint64_t>(3, 2 * N * T * H * D * E + kPad);
  c.locate = [](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
    return Loc{layer, (((KvIndex(part) * N + b) * H + h) * T + t) * D * E};
  };
  c.has_strided_piece = true;
  return c;
}

// MLA through vLLM: per layer [num_blocks, tokens, head_dim].
CopyCase LatentCase() {
  CopyCase c;
  c.spec = LatentSpec(DType::kBf16);
  c.num_blocks = 3;
  constexpr uint64_t N = 3, T = 4, D = 576, E = 2;
  c.placements = KvCacheLayout::VllmNhd;
  c.region_sizes = std::vector<uint64_t>(2, N * T * D * E);
  c.locate = [](uint32_t layer, Part, uint32_t b, uint32_t t, uint32_t) {
    return Loc{layer, (b * T + t) * D * E};
  };
  return c;
}

// fp8 K and V in vLLM NHD tensors, and all layers' scales in a region of their
// own: [layers][num_blocks][16-byte pitch], 12 bytes used.
CopyCase Fp8WithScaleCase() {
  CopyCase c;
  c.spec = KvSpec(DType::kFp8E4M3, /*scale_bytes=*/12);
  c.num_blocks = 5;
  constexpr uint64_t N = 5, T = 4, H = 2, D = 8, L = 3, kPitch = 16;
  c.placements = [](const Layout& layout, uint32_t) {
    std::vector<Placement> p;
    for (uint32_t layer = 0; layer < layout.spec().num_layers; ++layer) {
      p.push_back(Placement{layer, 0, T * H * D, H * D, D});
      p.push_back(Placement{layer, N * T * H * D, T * H * D, H * D, D});
      p.push_back(Placement{3, layer * N * kPitch, kPitch, 0, 0});
    }
    return p;
  };
  c.region_sizes = {2 * N * T * H * D, 2 * N * T * H * D, 2 * N * T * H * D, L * N * kPitch};
  c.locate = [](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
    if (part == Part::kScale) return Loc{3, (layer * N + b) * kPitch};
    return Loc{layer, (((KvIndex(part) * N + b) * T + t) * H + h) * D};
  };
  return c;
}

// SGLang-like layer-first pool: one region per layer, a reserved 64-byte
// page, then K of all blocks, a gap, then V of all blocks; blocks padded to a
// pitch larger than the tensor.
CopyCase LayerFirstCase() {
  CopyCase c;
  c.spec = KvSpec(DType::kFp16);
  c.num_blocks = 4;
  constexpr uint64_t N = 4, T = 4, H = 2, D = 8, E = 2;
  constexpr uint64_t kPitch = T * H * D * E + 32, kHead = 64, kGap = 16, kTail = 8;
  constexpr uint64_t kVStart = kHead + N * kPitch + kGap;
  c.placements = [](const Layout& layout, uint32_t) {
    std::vector<Placement> p;
    for (uint32_t layer = 0; layer < layout.spec().num_layers; ++layer) {
      p.push_back(Placement{layer, kHead, kPitch, H * D * E, D * E});
      p.push_back(Placement{layer, kVStart, kPitch, H * D * E, D * E});
    }
    return p;
  };
  c.region_sizes = std::vector<uint64_t>(3, kVStart + N * kPitch + kTail);
  c.locate = [](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
    return Loc{layer, (part == Part::kV ? kVStart : kHead) + b * kPitch + (t * H + h) * D * E};
  };
  return c;
}

// Page-first pool: one region; block b holds all layers, each layer padded,
// and inside a layer each token's K and V rows are adjacent, so K and V are
// both strided.
CopyCase PageFirstCase() {
  CopyCase c;
  c.spec = KvSpec(DType::kBf16);
  c.num_blocks = 4;
  constexpr uint64_t N = 4, T = 4, H = 2, D = 8, E = 2, L = 3;
  constexpr uint64_t kTokenPitch = 2 * H * D * E;
  constexpr uint64_t kLayerPitch = T * kTokenPitch + 16;
  constexpr uint64_t kBlockPitch = L * kLayerPitch + 40;
  c.placements = [](const Layout& layout, uint32_t) {
    std::vector<Placement> p;
    for (uint64_t layer = 0; layer < layout.spec().num_layers; ++layer) {
      for (uint64_t part = 0; part < 2; ++part) {
        p.push_back(
            Placement{0, layer * kLayerPitch + part * H * D * E, kBlockPitch, kTokenPitch, D * E});
      }
    }
    return p;
  };
  c.region_sizes = {N * kBlockPitch};
  c.locate = [](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
    return Loc{0, b * kBlockPitch + layer * kLayerPitch + t * kTokenPitch +
                      (KvIndex(part) * H + h) * D * E};
  };
  c.has_strided_piece = true;
  return c;
}

// SGLang's token-major host layout [2, num_blocks * tokens, layers, heads,
// head_dim]: the layers of one token are adjacent, so every piece is strided.
CopyCase TokenMajorCase() {
  CopyCase c;
  c.spec = KvSpec(DType::kFp32);
  c.num_blocks = 3;
  constexpr uint64_t N = 3, T = 4, H = 2, D = 8, E = 4, L = 3;
  c.placements = [](const Layout& layout, uint32_t) {
    std::vector<Placement> p;
    for (uint64_t layer = 0; layer < layout.spec().num_layers; ++layer) {
      for (uint64_t part = 0; part < 2; ++part) {
        p.push_back(Placement{0, (part * N * T * L + layer) * H * D * E, T * L * H * D * E,
                              L * H * D * E, D * E});
      }
    }
    return p;
  };
  c.region_sizes = {2 * N * T * L * H * D * E};
  c.locate = [](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
    return Loc{0, ((((KvIndex(part) * N + b) * T + t) * L + layer) * H + h) * D * E};
  };
  c.has_strided_piece = true;
  return c;
}

// KvCacheLayout::Contiguous for a DeepSeek-like fp8 latent with a scale.
CopyCase ContiguousLatentCase() {
  CopyCase c;
  c.spec = LatentSpec(DType::kFp8E4M3, /*scale_bytes=*/16);
  c.num_blocks = 4;
  constexpr uint64_t N = 4, T = 4, D = 576, S = 16, L = 2;
  constexpr uint64_t kLayer = T * D + S;
  c.placements = [](const Layout& layout, uint32_t) { return KvCacheLayout::Contiguous(layout); };
  c.region_sizes = {N * L * kLayer};
  c.locate = [](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t) {
    const uint64_t base = b * L * kLayer + layer * kLayer;
    return Loc{0, part == Part::kScale ? base + T * D : base + t * D};
  };
  return c;
}

// KvCacheLayout::Contiguous for separate K and V.
CopyCase ContiguousKvCase() {
  CopyCase c;
  c.spec = KvSpec(DType::kFp16);
  c.num_blocks = 3;
  constexpr uint64_t N = 3, T = 4, H = 2, D = 8, E = 2, L = 3;
  constexpr uint64_t kTensor = T * H * D * E;
  c.placements = [](const Layout& layout, uint32_t) { return KvCacheLayout::Contiguous(layout); };
  c.region_sizes = {N * L * 2 * kTensor};
  c.locate = [](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
    return Loc{0, ((b * L + layer) * 2 + KvIndex(part)) * kTensor + (t * H + h) * D * E};
  };
  return c;
}

struct Param {
  std::string name;
  CopyCase (*make)();
};

void PrintTo(const Param& param, std::ostream* os) { *os << param.name; }

// The engine byte each slot byte of `block` comes from, in canonical order,
// by plain nested loops over the case's index formula.
std::vector<Loc> SlotByteSources(const CopyCase& c, uint32_t block) {
  const LayoutSpec& s = c.spec;
  const uint64_t row_bytes = uint64_t{s.head_dim} * DTypeSizeBytes(s.dtype);
  std::vector<Part> parts = {Part::kK};
  if (s.kv_kind == KvKind::kSeparateKv) parts.push_back(Part::kV);
  std::vector<Loc> sources;
  for (uint32_t layer = 0; layer < s.num_layers; ++layer) {
    for (Part part : parts) {
      for (uint32_t t = 0; t < s.block_tokens; ++t) {
        for (uint32_t h = 0; h < s.num_kv_heads; ++h) {
          const Loc row = c.locate(layer, part, block, t, h);
          for (uint64_t i = 0; i < row_bytes; ++i) sources.push_back({row.region, row.offset + i});
        }
      }
    }
    if (s.scale_bytes_per_layer > 0) {
      const Loc scale = c.locate(layer, Part::kScale, block, 0, 0);
      for (uint64_t i = 0; i < s.scale_bytes_per_layer; ++i) {
        sources.push_back({scale.region, scale.offset + i});
      }
    }
  }
  return sources;
}

// The engine's registered memory, owned by the test.
struct Cache {
  std::vector<std::vector<uint8_t>> regions;
  std::vector<uint8_t*> bases;

  explicit Cache(const std::vector<uint64_t>& sizes) {
    for (uint64_t size : sizes) regions.emplace_back(size, 0);
    for (std::vector<uint8_t>& r : regions) bases.push_back(r.data());
  }
  MappedRegions Mapped() const { return MappedRegions{bases}; }
  uint8_t& At(const Loc& loc) { return regions[loc.region][loc.offset]; }
};

// splitmix64: a fixed pseudo-random stream, so failures reproduce.
void FillPattern(std::vector<uint8_t>& bytes, uint64_t seed) {
  uint64_t state = seed;
  for (uint8_t& byte : bytes) {
    state += 0x9e3779b97f4a7c15;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9;
    z = (z ^ (z >> 27)) * 0x94d049bb133111eb;
    byte = static_cast<uint8_t>(z ^ (z >> 31));
  }
}

// Index of the first differing byte, or nullopt; keeps failure output short.
std::optional<size_t> FirstDifference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b,
                                      size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return i;
  }
  return std::nullopt;
}

constexpr size_t kGuardBytes = 64;
constexpr uint8_t kGuard = 0xA5;

class CopyReferenceTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    c_ = GetParam().make();
    Result<Layout> layout = Layout::Create(c_.spec);
    ASSERT_TRUE(layout.has_value()) << layout.error();
    Result<KvCacheLayout> kv = KvCacheLayout::Create(
        *layout, c_.num_blocks, c_.placements(*layout, c_.num_blocks), c_.region_sizes);
    ASSERT_TRUE(kv.has_value()) << kv.error();
    kv_.emplace(std::move(*kv));
    block_bytes_ = kv_->layout().block_bytes();

    bool strided = false;
    for (uint32_t i = 0; i < kv_->placements().size(); ++i) {
      strided = strided || !kv_->PieceIsContiguous(i);
    }
    EXPECT_EQ(strided, c_.has_strided_piece);

    source_.emplace(c_.region_sizes);
    for (size_t r = 0; r < source_->regions.size(); ++r) FillPattern(source_->regions[r], r + 1);
  }

  std::vector<uint8_t> NewSlot() const {
    return std::vector<uint8_t>(block_bytes_ + kGuardBytes, kGuard);
  }

  void ExpectGuardIntact(const std::vector<uint8_t>& slot) const {
    for (size_t i = block_bytes_; i < slot.size(); ++i) {
      ASSERT_EQ(slot[i], kGuard) << "wrote past the slot at byte " << i;
    }
  }

  CopyCase c_;
  std::optional<KvCacheLayout> kv_;
  uint64_t block_bytes_ = 0;
  std::optional<Cache> source_;
};

TEST_P(CopyReferenceTest, GatherMatchesIndependentWalk) {
  const std::vector<std::vector<uint8_t>> before = source_->regions;
  for (uint32_t b = 0; b < c_.num_blocks; ++b) {
    SCOPED_TRACE("block " + std::to_string(b));
    const std::vector<Loc> sources = SlotByteSources(c_, b);
    ASSERT_EQ(sources.size(), block_bytes_);
    std::vector<uint8_t> expected(block_bytes_);
    for (size_t i = 0; i < sources.size(); ++i) expected[i] = source_->At(sources[i]);

    std::vector<uint8_t> slot = NewSlot();
    GatherBlock(*kv_, source_->Mapped(), b, slot.data());
    const std::optional<size_t> diff = FirstDifference(slot, expected, block_bytes_);
    ASSERT_FALSE(diff.has_value()) << "slot byte " << *diff << " differs: got " << int{slot[*diff]}
                                   << ", expected " << int{expected[*diff]};
    ExpectGuardIntact(slot);
  }
  EXPECT_TRUE(source_->regions == before) << "gather wrote to the engine cache";
}

TEST_P(CopyReferenceTest, ScatterOfARandomSlotWritesIndependentWalk) {
  for (uint32_t b = 0; b < c_.num_blocks; ++b) {
    SCOPED_TRACE("block " + std::to_string(b));
    std::vector<uint8_t> slot(block_bytes_);
    FillPattern(slot, 1000 + b);
    Cache cache(c_.region_sizes);
    ScatterBlock(*kv_, cache.Mapped(), b, slot.data());

    Cache expected(c_.region_sizes);
    const std::vector<Loc> sources = SlotByteSources(c_, b);
    for (size_t i = 0; i < sources.size(); ++i) expected.At(sources[i]) = slot[i];
    for (size_t r = 0; r < cache.regions.size(); ++r) {
      const std::optional<size_t> diff =
          FirstDifference(cache.regions[r], expected.regions[r], cache.regions[r].size());
      ASSERT_FALSE(diff.has_value()) << "region " << r << " byte " << *diff << " differs";
    }

    std::vector<uint8_t> back = NewSlot();
    GatherBlock(*kv_, cache.Mapped(), b, back.data());
    EXPECT_FALSE(FirstDifference(back, slot, block_bytes_).has_value());
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
    std::vector<uint8_t> slot = NewSlot();
    GatherBlock(*kv_, source_->Mapped(), b, slot.data());
    ExpectGuardIntact(slot);
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

INSTANTIATE_TEST_SUITE_P(
    Layouts, CopyReferenceTest,
    ::testing::Values(Param{"VllmNhd", VllmNhdCase}, Param{"VllmHnd", VllmHndCase},
                      Param{"Latent", LatentCase}, Param{"Fp8WithScale", Fp8WithScaleCase},
                      Param{"LayerFirst", LayerFirstCase}, Param{"PageFirst", PageFirstCase},
                      Param{"TokenMajor", TokenMajorCase},
                      Param{"ContiguousLatent", ContiguousLatentCase},
                      Param{"ContiguousKv", ContiguousKvCase}),
    [](const ::testing::TestParamInfo<Param>& param_info) { return param_info.param.name; });

class CopyReferenceDeathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    c_ = VllmNhdCase();
    Result<Layout> layout = Layout::Create(c_.spec);
    ASSERT_TRUE(layout.has_value()) << layout.error();
    Result<KvCacheLayout> kv = KvCacheLayout::Create(
        *layout, c_.num_blocks, c_.placements(*layout, c_.num_blocks), c_.region_sizes);
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
               "CHECK failed: block_id < layout.num_blocks\\(\\)");
  EXPECT_DEATH(ScatterBlock(*kv_, cache.Mapped(), c_.num_blocks, slot_.data()),
               "CHECK failed: block_id < layout.num_blocks\\(\\)");
  EXPECT_DEATH(GatherBlock(*kv_, cache.Mapped(), UINT32_MAX, slot_.data()), "block_id");
}

TEST_F(CopyReferenceDeathTest, MissingRegionAborts) {
  Cache cache(c_.region_sizes);
  MappedRegions short_regions{std::span<uint8_t* const>(cache.bases).first(2)};
  EXPECT_DEATH(GatherBlock(*kv_, short_regions, 0, slot_.data()), "region_bases.size\\(\\)");
}

}  // namespace
}  // namespace kvtier
