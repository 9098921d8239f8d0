#include "common/kv_cache_layout.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace kvtier {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

// 2 layers, 2 heads of 4 fp16 elements (8-byte rows), 3 tokens per block.
LayoutSpec SmallSpec() {
  return LayoutSpec{.model_id = "test/small",
                    .num_layers = 2,
                    .kv_kind = KvKind::kSeparateKv,
                    .num_kv_heads = 2,
                    .head_dim = 4,
                    .dtype = DType::kFp16,
                    .block_tokens = 3};
}

// DeepSeek-V3-like MLA: one 576-wide latent per token per layer.
LayoutSpec LatentSpec() {
  return LayoutSpec{.model_id = "deepseek-ai/DeepSeek-V3",
                    .num_layers = 61,
                    .kv_kind = KvKind::kLatent,
                    .num_kv_heads = 1,
                    .head_dim = 576,
                    .dtype = DType::kBf16,
                    .block_tokens = 64};
}

LayoutSpec LatentFp8WithScaleSpec() {
  LayoutSpec s = LatentSpec();
  s.dtype = DType::kFp8E4M3;
  s.scale_bytes_per_layer = 256;
  return s;
}

Layout MakeLayout(const LayoutSpec& spec) {
  Result<Layout> layout = Layout::Create(spec);
  EXPECT_TRUE(layout.has_value()) << layout.error();
  return layout.value();
}

// Region sizes of vLLM's per-layer tensors, written from the tensor shape.
std::vector<uint64_t> VllmRegionSizes(const LayoutSpec& s, uint32_t num_blocks) {
  const uint64_t parts = s.kv_kind == KvKind::kSeparateKv ? 2 : 1;
  const uint64_t bytes =
      parts * num_blocks * s.block_tokens * s.num_kv_heads * s.head_dim * DTypeSizeBytes(s.dtype);
  return std::vector<uint64_t>(s.num_layers, bytes);
}

void ExpectInvalid(const Result<KvCacheLayout>& result, const std::string& needle) {
  ASSERT_FALSE(result.has_value()) << "expected an error containing '" << needle << "'";
  EXPECT_EQ(result.error().code(), StatusCode::kInvalidArgument) << result.error();
  EXPECT_NE(result.error().message().find(needle), std::string::npos) << result.error();
}

TEST(KvCacheLayoutTest, PiecesPerLayer) {
  EXPECT_EQ(KvCacheLayout::PiecesPerLayer(MakeLayout(SmallSpec())), 2u);
  EXPECT_EQ(KvCacheLayout::PiecesPerLayer(MakeLayout(LatentSpec())), 1u);
  EXPECT_EQ(KvCacheLayout::PiecesPerLayer(MakeLayout(LatentFp8WithScaleSpec())), 2u);
  LayoutSpec kv_fp8 = SmallSpec();
  kv_fp8.dtype = DType::kFp8E5M2;
  kv_fp8.scale_bytes_per_layer = 4;
  EXPECT_EQ(KvCacheLayout::PiecesPerLayer(MakeLayout(kv_fp8)), 3u);
}

TEST(KvCacheLayoutTest, VllmNhdOfSeparateKvValidates) {
  const LayoutSpec s = SmallSpec();
  const Layout layout = MakeLayout(s);
  constexpr uint32_t kBlocks = 5;
  const std::vector<Placement> placements = KvCacheLayout::VllmNhd(layout, kBlocks);
  ASSERT_EQ(placements.size(), 4u);
  for (uint32_t i = 0; i < placements.size(); ++i) {
    const Placement& p = placements[i];
    EXPECT_EQ(p.region, i / 2) << i;
    EXPECT_EQ(p.offset_bytes, i % 2 == 0 ? 0u : kBlocks * 3u * 2 * 8) << i;
    EXPECT_EQ(p.block_stride_bytes, 3u * 2 * 8) << i;
    EXPECT_EQ(p.token_stride_bytes, 2u * 8) << i;
    EXPECT_EQ(p.head_stride_bytes, 8u) << i;
  }

  Result<KvCacheLayout> kv =
      KvCacheLayout::Create(layout, kBlocks, placements, VllmRegionSizes(s, kBlocks));
  ASSERT_TRUE(kv.has_value()) << kv.error();
  EXPECT_EQ(kv->num_blocks(), kBlocks);
  EXPECT_EQ(kv->placements().size(), 4u);
  EXPECT_EQ(kv->region_sizes_bytes().size(), 2u);
  uint64_t total = 0;
  for (uint32_t i = 0; i < 4; ++i) {
    EXPECT_EQ(kv->RowBytes(i), 8u);
    EXPECT_EQ(kv->RowsPerPiece(i), 6u);
    EXPECT_EQ(kv->PieceBytes(i), 48u);
    EXPECT_TRUE(kv->PieceIsContiguous(i));
    total += kv->PieceBytes(i);
  }
  EXPECT_EQ(total, layout.block_bytes());
}

TEST(KvCacheLayoutTest, VllmNhdOfLatentValidates) {
  const LayoutSpec s = LatentSpec();
  const Layout layout = MakeLayout(s);
  constexpr uint32_t kBlocks = 1000;
  const std::vector<Placement> placements = KvCacheLayout::VllmNhd(layout, kBlocks);
  ASSERT_EQ(placements.size(), 61u);
  EXPECT_EQ(placements[7].region, 7u);
  EXPECT_EQ(placements[7].offset_bytes, 0u);
  EXPECT_EQ(placements[7].block_stride_bytes, 64u * 576 * 2);
  EXPECT_EQ(placements[7].token_stride_bytes, 576u * 2);

  Result<KvCacheLayout> kv =
      KvCacheLayout::Create(layout, kBlocks, placements, VllmRegionSizes(s, kBlocks));
  ASSERT_TRUE(kv.has_value()) << kv.error();
  EXPECT_EQ(kv->RowBytes(60), 576u * 2);
  EXPECT_EQ(kv->RowsPerPiece(60), 64u);
  EXPECT_TRUE(kv->PieceIsContiguous(60));
}

TEST(KvCacheLayoutTest, ContiguousValidates) {
  for (const LayoutSpec& s : {SmallSpec(), LatentSpec(), LatentFp8WithScaleSpec()}) {
    SCOPED_TRACE(s.model_id + " " + DTypeName(s.dtype).data());
    const Layout layout = MakeLayout(s);
    constexpr uint32_t kBlocks = 7;
    const std::vector<Placement> placements = KvCacheLayout::Contiguous(layout);
    ASSERT_EQ(placements.size(), s.num_layers * KvCacheLayout::PiecesPerLayer(layout));
    Result<KvCacheLayout> kv =
        KvCacheLayout::Create(layout, kBlocks, placements, {kBlocks * layout.block_bytes()});
    ASSERT_TRUE(kv.has_value()) << kv.error();
    // The pieces tile one block in canonical order.
    uint64_t offset = 0;
    for (uint32_t i = 0; i < placements.size(); ++i) {
      EXPECT_EQ(placements[i].region, 0u);
      EXPECT_EQ(placements[i].offset_bytes, offset) << i;
      EXPECT_EQ(placements[i].block_stride_bytes, layout.block_bytes()) << i;
      EXPECT_TRUE(kv->PieceIsContiguous(i)) << i;
      offset += kv->PieceBytes(i);
    }
    EXPECT_EQ(offset, layout.block_bytes());
    // One byte short of num_blocks whole blocks is rejected.
    ExpectInvalid(
        KvCacheLayout::Create(layout, kBlocks, placements, {kBlocks * layout.block_bytes() - 1}),
        "past the end of region 0");
  }
}

TEST(KvCacheLayoutTest, ScalePieceIsOneRow) {
  const Layout layout = MakeLayout(LatentFp8WithScaleSpec());
  Result<KvCacheLayout> kv = KvCacheLayout::Create(layout, 2, KvCacheLayout::Contiguous(layout),
                                                   {2 * layout.block_bytes()});
  ASSERT_TRUE(kv.has_value()) << kv.error();
  EXPECT_EQ(kv->RowBytes(0), 576u);
  EXPECT_EQ(kv->RowsPerPiece(0), 64u);
  EXPECT_EQ(kv->RowBytes(1), 256u);
  EXPECT_EQ(kv->RowsPerPiece(1), 1u);
  EXPECT_EQ(kv->PieceBytes(1), 256u);
  EXPECT_TRUE(kv->PieceIsContiguous(1));
}

TEST(KvCacheLayoutTest, ScalePieceIgnoresTokenAndHeadStrides) {
  const Layout layout = MakeLayout(LatentFp8WithScaleSpec());
  std::vector<Placement> placements = KvCacheLayout::Contiguous(layout);
  placements[1].token_stride_bytes = kMax;
  placements[1].head_stride_bytes = kMax;
  Result<KvCacheLayout> kv =
      KvCacheLayout::Create(layout, 2, placements, {2 * layout.block_bytes()});
  ASSERT_TRUE(kv.has_value()) << kv.error();
  EXPECT_TRUE(kv->PieceIsContiguous(1));
}

TEST(KvCacheLayoutTest, HndAndPaddedRowsAreNotContiguous) {
  const LayoutSpec s = SmallSpec();
  const Layout layout = MakeLayout(s);
  Result<KvCacheLayout> kv =
      KvCacheLayout::Create(layout, 4, KvCacheLayout::VllmHnd(layout, 4), VllmRegionSizes(s, 4));
  ASSERT_TRUE(kv.has_value()) << kv.error();
  for (uint32_t i = 0; i < 4; ++i) EXPECT_FALSE(kv->PieceIsContiguous(i)) << i;

  // Padding between rows or between tokens breaks contiguity too.
  std::vector<Placement> padded = KvCacheLayout::VllmNhd(layout, 1);
  padded[0].token_stride_bytes = 20;
  padded[1].head_stride_bytes = 9;
  padded[1].token_stride_bytes = 18;
  Result<KvCacheLayout> p = KvCacheLayout::Create(layout, 1, padded, {1000, 1000});
  ASSERT_TRUE(p.has_value()) << p.error();
  EXPECT_FALSE(p->PieceIsContiguous(0));
  EXPECT_FALSE(p->PieceIsContiguous(1));
  EXPECT_TRUE(p->PieceIsContiguous(2));

  // With one head, HND and NHD are the same bytes.
  LayoutSpec one_head = s;
  one_head.num_kv_heads = 1;
  const Layout one_head_layout = MakeLayout(one_head);
  Result<KvCacheLayout> one = KvCacheLayout::Create(
      one_head_layout, 4, KvCacheLayout::VllmHnd(one_head_layout, 4), VllmRegionSizes(one_head, 4));
  ASSERT_TRUE(one.has_value()) << one.error();
  EXPECT_TRUE(one->PieceIsContiguous(0));
}

TEST(KvCacheLayoutTest, RejectsZeroBlocks) {
  const Layout layout = MakeLayout(SmallSpec());
  ExpectInvalid(KvCacheLayout::Create(layout, 0, KvCacheLayout::VllmNhd(layout, 0),
                                      VllmRegionSizes(SmallSpec(), 0)),
                "num_blocks");
}

TEST(KvCacheLayoutTest, RejectsWrongPlacementCount) {
  const Layout layout = MakeLayout(SmallSpec());
  const std::vector<uint64_t> sizes = VllmRegionSizes(SmallSpec(), 4);
  std::vector<Placement> placements = KvCacheLayout::VllmNhd(layout, 4);
  placements.pop_back();
  ExpectInvalid(KvCacheLayout::Create(layout, 4, placements, sizes), "expected 4 placements");
  placements.push_back(placements.back());
  placements.push_back(placements.back());
  ExpectInvalid(KvCacheLayout::Create(layout, 4, placements, sizes), "got 5");
  ExpectInvalid(KvCacheLayout::Create(layout, 4, {}, sizes), "got 0");
}

TEST(KvCacheLayoutTest, RejectsRegionOutOfRange) {
  const Layout layout = MakeLayout(SmallSpec());
  std::vector<Placement> placements = KvCacheLayout::VllmNhd(layout, 4);
  placements[3].region = 2;
  ExpectInvalid(KvCacheLayout::Create(layout, 4, placements, VllmRegionSizes(SmallSpec(), 4)),
                "placement 3 (layer 1 V): region 2 out of range");
  placements[3].region = std::numeric_limits<uint32_t>::max();
  ExpectInvalid(KvCacheLayout::Create(layout, 4, placements, VllmRegionSizes(SmallSpec(), 4)),
                "placement 3");
  ExpectInvalid(KvCacheLayout::Create(layout, 4, KvCacheLayout::VllmNhd(layout, 4), {}),
                "placement 0 (layer 0 K): region 0 out of range");
}

TEST(KvCacheLayoutTest, RangeExactlyAtRegionEndIsAcceptedOneBytePastIsNot) {
  const LayoutSpec s = SmallSpec();
  const Layout layout = MakeLayout(s);
  std::vector<uint64_t> sizes = VllmRegionSizes(s, 4);
  ASSERT_TRUE(KvCacheLayout::Create(layout, 4, KvCacheLayout::VllmNhd(layout, 4), sizes));

  // The V half of layer 1 ends exactly at its region's end.
  sizes[1] -= 1;
  ExpectInvalid(
      KvCacheLayout::Create(layout, 4, KvCacheLayout::VllmNhd(layout, 4), sizes),
      "placement 3 (layer 1 V): block 3 ends at byte 384, past the end of region 1 (383 bytes)");

  // Layer 0's V also ends exactly at its region's end, so one more byte of
  // offset or of any stride is rejected (a wider head stride as overlapping
  // rows, since NHD leaves no room between heads).
  sizes = VllmRegionSizes(s, 4);
  for (int field = 0; field < 4; ++field) {
    SCOPED_TRACE(field);
    std::vector<Placement> placements = KvCacheLayout::VllmNhd(layout, 4);
    Placement& v = placements[1];
    if (field == 0) v.offset_bytes += 1;
    if (field == 1) v.block_stride_bytes += 1;
    if (field == 2) v.token_stride_bytes += 1;
    if (field == 3) v.head_stride_bytes += 1;
    ExpectInvalid(KvCacheLayout::Create(layout, 4, placements, sizes), "placement 1 (layer 0 V)");
  }

  // A scale piece in its own region of exactly num_blocks rows.
  const Layout fp8 = MakeLayout(LatentFp8WithScaleSpec());
  std::vector<Placement> placements = KvCacheLayout::Contiguous(fp8);
  const uint64_t block = fp8.block_bytes();
  placements[3] = Placement{.region = 1, .offset_bytes = 10, .block_stride_bytes = 256};
  EXPECT_TRUE(KvCacheLayout::Create(fp8, 3, placements, {3 * block, 10 + 3 * 256}));
  ExpectInvalid(KvCacheLayout::Create(fp8, 3, placements, {3 * block, 10 + 3 * 256 - 1}),
                "placement 3 (layer 1 scale)");
}

TEST(KvCacheLayoutTest, RejectsOverflow) {
  const Layout layout = MakeLayout(SmallSpec());
  // Huge regions, so only the overflow checks can catch a wrapped range.
  const std::vector<uint64_t> sizes = {kMax, kMax};
  struct Case {
    const char* name;
    Placement placement;
    uint32_t num_blocks;
  };
  const Case cases[] = {
      {"offset near the end", {0, kMax - 10, 48, 16, 8}, 1},
      {"offset plus blocks", {0, kMax - 100, 48, 16, 8}, 4},
      {"block stride", {0, 0, kMax / 2, 16, 8}, 4},
      {"block stride times blocks", {0, 0, uint64_t{1} << 62, 16, 8}, 5},
      {"token stride", {0, 0, kMax, kMax / 2 + 1, 8}, 1},
      {"head stride", {0, 0, kMax, 16, kMax - 7}, 1},
      {"both strides", {0, 0, kMax, uint64_t{1} << 62, (uint64_t{1} << 63) + 8}, 1},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<Placement> placements = KvCacheLayout::VllmNhd(layout, c.num_blocks);
    placements[2] = c.placement;
    ExpectInvalid(KvCacheLayout::Create(layout, c.num_blocks, placements, sizes),
                  "placement 2 (layer 1 K)");
  }
  // Right at the limit, a range ending exactly at UINT64_MAX is fine.
  std::vector<Placement> placements = KvCacheLayout::VllmNhd(layout, 1);
  placements[2] = Placement{0, kMax - 48, 48, 16, 8};
  EXPECT_TRUE(KvCacheLayout::Create(layout, 1, placements, sizes));
}

TEST(KvCacheLayoutTest, RejectsOverlappingRows) {
  const LayoutSpec s = SmallSpec();  // 3 tokens, 2 heads, 8-byte rows
  const Layout layout = MakeLayout(s);
  struct Case {
    const char* name;
    uint64_t token_stride;
    uint64_t head_stride;
    const char* error;  // nullptr: valid
  };
  const Case cases[] = {
      {"NHD", 16, 8, nullptr},
      {"HND", 8, 24, nullptr},
      {"padded NHD", 20, 9, nullptr},
      {"head stride under a row", 16, 7, "head_stride_bytes 7"},
      {"token stride under a row", 7, 24, "token_stride_bytes 7"},
      {"token stride under the heads", 15, 8, "token_stride_bytes 15"},
      {"head stride under the tokens", 8, 23, "head_stride_bytes 23"},
      {"equal strides", 8, 8, "rows would overlap"},
      {"zero strides", 0, 0, "rows would overlap"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<Placement> placements = KvCacheLayout::VllmNhd(layout, 1);
    placements[1] = Placement{0, 48, 48, c.token_stride, c.head_stride};
    Result<KvCacheLayout> kv = KvCacheLayout::Create(layout, 1, placements, {1000, 1000});
    if (c.error == nullptr) {
      EXPECT_TRUE(kv.has_value()) << kv.error();
    } else {
      ExpectInvalid(kv, "placement 1 (layer 0 V): ");
      ExpectInvalid(kv, c.error);
    }
  }
}

TEST(KvCacheLayoutTest, StrideOfASingleTokenOrHeadIsIgnored) {
  LayoutSpec s = SmallSpec();
  s.block_tokens = 1;
  const Layout one_token = MakeLayout(s);
  std::vector<Placement> placements = KvCacheLayout::VllmNhd(one_token, 2);
  for (Placement& p : placements) p.token_stride_bytes = 0;
  EXPECT_TRUE(KvCacheLayout::Create(one_token, 2, placements, VllmRegionSizes(s, 2)));
  placements[0].head_stride_bytes = 0;
  ExpectInvalid(KvCacheLayout::Create(one_token, 2, placements, VllmRegionSizes(s, 2)),
                "head_stride_bytes 0");

  const LayoutSpec latent = LatentSpec();
  const Layout one_head = MakeLayout(latent);
  placements = KvCacheLayout::VllmNhd(one_head, 2);
  for (Placement& p : placements) p.head_stride_bytes = 0;
  EXPECT_TRUE(KvCacheLayout::Create(one_head, 2, placements, VllmRegionSizes(latent, 2)));
  placements[5].token_stride_bytes = 576 * 2 - 1;
  ExpectInvalid(KvCacheLayout::Create(one_head, 2, placements, VllmRegionSizes(latent, 2)),
                "placement 5 (layer 5 latent): token_stride_bytes 1151");
}

TEST(KvCacheLayoutTest, RejectsOverlappingBlocks) {
  const LayoutSpec s = SmallSpec();
  const Layout layout = MakeLayout(s);
  const std::vector<uint64_t> sizes = {10000, 10000};
  std::vector<Placement> placements = KvCacheLayout::VllmNhd(layout, 4);
  // One block's piece spans 48 bytes in NHD.
  placements[2].block_stride_bytes = 47;
  ExpectInvalid(KvCacheLayout::Create(layout, 4, placements, sizes),
                "placement 2 (layer 1 K): block_stride_bytes 47");
  placements[2].block_stride_bytes = 48;
  EXPECT_TRUE(KvCacheLayout::Create(layout, 4, placements, sizes));
  placements[2].block_stride_bytes = 0;
  ExpectInvalid(KvCacheLayout::Create(layout, 4, placements, sizes), "blocks would overlap");
  // A single block has no other block to overlap.
  EXPECT_TRUE(KvCacheLayout::Create(layout, 1, placements, sizes));

  // Blocks nested inside heads (vLLM's LHBNC: [heads][blocks][tokens]): one
  // head of all 4 blocks spans 4 * 24 bytes, so the head stride must step over it.
  placements[2] = Placement{0, 0, 24, 8, 96};
  EXPECT_TRUE(KvCacheLayout::Create(layout, 4, placements, sizes));
  placements[2].head_stride_bytes = 95;
  ExpectInvalid(KvCacheLayout::Create(layout, 4, placements, sizes), "head_stride_bytes 95 is less than the 96");
  placements[2].head_stride_bytes = 96;
  placements[2].block_stride_bytes = 23;
  ExpectInvalid(KvCacheLayout::Create(layout, 4, placements, sizes), "block_stride_bytes 23 is less than the 24");

  // HND with padded rows: one block spans (2 - 1) * 30 + (3 - 1) * 10 + 8 = 58 bytes.
  placements = KvCacheLayout::VllmNhd(layout, 4);
  placements[0] = Placement{0, 0, 57, 10, 30};
  ExpectInvalid(KvCacheLayout::Create(layout, 4, placements, sizes), "57 is less than the 58");
  placements[0].block_stride_bytes = 58;
  EXPECT_TRUE(KvCacheLayout::Create(layout, 4, placements, sizes));
}

// Where the engine tensor's own index formula puts element 0 of row (t, h) of
// `part` (0: K or the latent, 1: V) of `layer` of engine block b, written from
// the tensor's shape and not from any placement.
struct Loc {
  uint32_t region = 0;
  uint64_t offset = 0;
};

struct EngineShape {
  // Named like the tensor dimensions they are: blocks, K/V parts (2, or 1 for
  // a latent), layers, tokens, heads, head_dim, dtype bytes.
  uint64_t N, P, L, T, H, D, E;

  EngineShape(const LayoutSpec& s, uint32_t num_blocks)
      : N(num_blocks),
        P(s.kv_kind == KvKind::kSeparateKv ? 2 : 1),
        L(s.num_layers),
        T(s.block_tokens),
        H(s.num_kv_heads),
        D(s.head_dim),
        E(DTypeSizeBytes(s.dtype)) {}
};

struct EngineLayout {
  const char* name;
  std::vector<Placement> (*placements)(const Layout&, uint32_t num_blocks);
  Loc (*locate)(const EngineShape&, uint64_t layer, uint64_t part, uint64_t b, uint64_t t,
                uint64_t h);
  // The byte size of each engine tensor, one per region.
  std::vector<uint64_t> (*tensor_sizes)(const EngineShape&);
};

const EngineLayout kEngineLayouts[] = {
    {"vLLM NHD [2, N, T, H, D] per layer", KvCacheLayout::VllmNhd,
     [](const EngineShape& x, uint64_t layer, uint64_t part, uint64_t b, uint64_t t, uint64_t h) {
       return Loc{uint32_t(layer), ((((part * x.N + b) * x.T + t) * x.H + h) * x.D) * x.E};
     },
     [](const EngineShape& x) {
       return std::vector<uint64_t>(x.L, x.P * x.N * x.T * x.H * x.D * x.E);
     }},
    {"vLLM HND [2, N, H, T, D] per layer", KvCacheLayout::VllmHnd,
     [](const EngineShape& x, uint64_t layer, uint64_t part, uint64_t b, uint64_t t, uint64_t h) {
       return Loc{uint32_t(layer), ((((part * x.N + b) * x.H + h) * x.T + t) * x.D) * x.E};
     },
     [](const EngineShape& x) {
       return std::vector<uint64_t>(x.L, x.P * x.N * x.T * x.H * x.D * x.E);
     }},
    {"SGLang layer-first [N * T, H, D] per layer and part", KvCacheLayout::SglangLayerFirst,
     [](const EngineShape& x, uint64_t layer, uint64_t part, uint64_t b, uint64_t t, uint64_t h) {
       const uint64_t token = b * x.T + t;
       return Loc{uint32_t(layer * x.P + part), ((token * x.H + h) * x.D) * x.E};
     },
     [](const EngineShape& x) {
       return std::vector<uint64_t>(x.L * x.P, x.N * x.T * x.H * x.D * x.E);
     }},
    {"SGLang page-first [2, N * T, L, H, D]", KvCacheLayout::SglangPageFirst,
     [](const EngineShape& x, uint64_t layer, uint64_t part, uint64_t b, uint64_t t, uint64_t h) {
       const uint64_t token = b * x.T + t;
       return Loc{0, ((((part * x.N * x.T + token) * x.L + layer) * x.H + h) * x.D) * x.E};
     },
     [](const EngineShape& x) {
       return std::vector<uint64_t>{x.P * x.N * x.T * x.L * x.H * x.D * x.E};
     }},
};

// Small enough to visit every row of every block; odd sizes so that swapped
// dimensions land on different bytes.
std::vector<LayoutSpec> EngineSpecs() {
  LayoutSpec fp32 = SmallSpec();
  fp32.num_layers = 3;
  fp32.num_kv_heads = 3;
  fp32.head_dim = 5;
  fp32.dtype = DType::kFp32;
  fp32.block_tokens = 2;
  LayoutSpec one_token = SmallSpec();
  one_token.block_tokens = 1;
  LayoutSpec latent = LatentSpec();
  latent.num_layers = 3;
  latent.head_dim = 8;
  latent.block_tokens = 5;
  return {SmallSpec(), fp32, one_token, latent};
}

TEST(KvCacheLayoutTest, EngineHelpersPlaceRowsWhereTheEngineTensorsHaveThem) {
  for (const EngineLayout& engine : kEngineLayouts) {
    for (const LayoutSpec& s : EngineSpecs()) {
      for (uint32_t num_blocks : {1u, 4u}) {
        SCOPED_TRACE(std::string(engine.name) + ", " + MakeLayout(s).ToString() + ", " +
                     std::to_string(num_blocks) + " blocks");
        const Layout layout = MakeLayout(s);
        const EngineShape x(s, num_blocks);
        const std::vector<Placement> placements = engine.placements(layout, num_blocks);
        ASSERT_EQ(placements.size(), x.L * x.P);

        // Dense tensors: the smallest regions are the tensors themselves.
        const std::vector<uint64_t> sizes = engine.tensor_sizes(x);
        EXPECT_EQ(KvCacheLayout::MinRegionSizes(layout, num_blocks, placements), sizes);
        Result<KvCacheLayout> kv = KvCacheLayout::Create(layout, num_blocks, placements, sizes);
        ASSERT_TRUE(kv.has_value()) << kv.error();
        for (size_t r = 0; r < sizes.size(); ++r) {
          std::vector<uint64_t> short_sizes = sizes;
          short_sizes[r] -= 1;
          ExpectInvalid(KvCacheLayout::Create(layout, num_blocks, placements, short_sizes),
                        "past the end of region " + std::to_string(r));
        }

        for (uint64_t layer = 0; layer < x.L; ++layer) {
          for (uint64_t part = 0; part < x.P; ++part) {
            const Placement& p = placements[layer * x.P + part];
            for (uint64_t b = 0; b < x.N; ++b) {
              for (uint64_t t = 0; t < x.T; ++t) {
                for (uint64_t h = 0; h < x.H; ++h) {
                  const Loc want = engine.locate(x, layer, part, b, t, h);
                  const uint64_t got = p.offset_bytes + b * p.block_stride_bytes +
                                       t * p.token_stride_bytes + h * p.head_stride_bytes;
                  ASSERT_EQ(p.region, want.region) << layer << " " << part;
                  ASSERT_EQ(got, want.offset) << "layer " << layer << " part " << part << " block "
                                              << b << " token " << t << " head " << h;
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST(KvCacheLayoutTest, EngineHelpersOfALatentLayoutAreOneHeadTensors) {
  const Layout layout = MakeLayout(LatentSpec());
  // vLLM's HND and NHD are the same bytes with one head; the head stride is
  // never used.
  const std::vector<Placement> nhd = KvCacheLayout::VllmNhd(layout, 10);
  const std::vector<Placement> hnd = KvCacheLayout::VllmHnd(layout, 10);
  ASSERT_EQ(hnd.size(), nhd.size());
  for (size_t i = 0; i < nhd.size(); ++i) {
    EXPECT_EQ(hnd[i].region, nhd[i].region);
    EXPECT_EQ(hnd[i].offset_bytes, nhd[i].offset_bytes);
    EXPECT_EQ(hnd[i].block_stride_bytes, nhd[i].block_stride_bytes);
    EXPECT_EQ(hnd[i].token_stride_bytes, nhd[i].token_stride_bytes);
  }
  Result<KvCacheLayout> kv =
      KvCacheLayout::Create(layout, 10, hnd, VllmRegionSizes(LatentSpec(), 10));
  ASSERT_TRUE(kv.has_value()) << kv.error();
  EXPECT_TRUE(kv->PieceIsContiguous(0));

  // SGLang's latent pool is one region per layer; its page-first host pool
  // one region in which a token's 61 layers are adjacent.
  EXPECT_EQ(KvCacheLayout::SglangLayerFirst(layout, 10).back().region, 60u);
  const std::vector<Placement> page_first = KvCacheLayout::SglangPageFirst(layout, 10);
  EXPECT_EQ(page_first.back().region, 0u);
  EXPECT_EQ(page_first.back().offset_bytes, 60u * 576 * 2);
  EXPECT_EQ(page_first.back().token_stride_bytes, 61u * 576 * 2);
}

TEST(KvCacheLayoutTest, MinRegionSizes) {
  const Layout layout = MakeLayout(SmallSpec());  // 3 tokens, 2 heads, 8-byte rows
  // HND with padded rows: one block spans (2 - 1) * 30 + (3 - 1) * 10 + 8 = 58
  // bytes. Region 1 is unused, region 3 holds two pieces, the later one ending
  // first.
  const std::vector<Placement> placements = {
      Placement{0, 5, 60, 10, 30},
      Placement{2, 0, 48, 16, 8},
      Placement{3, 1000, 48, 16, 8},
      Placement{3, 0, 48, 16, 8},
  };
  EXPECT_EQ(KvCacheLayout::MinRegionSizes(layout, 4, placements),
            (std::vector<uint64_t>{5 + 3 * 60 + 58, 0, 3 * 48 + 48, 1000 + 3 * 48 + 48}));
  // One block: its block stride does not matter.
  EXPECT_EQ(KvCacheLayout::MinRegionSizes(layout, 1, placements),
            (std::vector<uint64_t>{5 + 58, 0, 48, 1000 + 48}));

  // Strides of a single token or head do not count, as in Create; a scale
  // piece is one row.
  LayoutSpec one = SmallSpec();
  one.block_tokens = 1;
  one.num_kv_heads = 1;
  one.dtype = DType::kFp8E4M3;
  one.scale_bytes_per_layer = 3;
  const Layout one_row = MakeLayout(one);
  std::vector<Placement> rows(6, Placement{0, 0, 100, kMax / 4, kMax / 4});
  rows[5] = Placement{1, 7, 11, kMax, kMax};
  EXPECT_EQ(KvCacheLayout::MinRegionSizes(one_row, 2, rows),
            (std::vector<uint64_t>{100 + 4, 7 + 11 + 3}));
  EXPECT_TRUE(
      KvCacheLayout::Create(one_row, 2, rows, KvCacheLayout::MinRegionSizes(one_row, 2, rows)));
}

TEST(KvCacheLayoutDeathTest, EngineHelpersRejectAScaleRegion) {
  const Layout fp8 = MakeLayout(LatentFp8WithScaleSpec());
  EXPECT_DEATH(KvCacheLayout::VllmNhd(fp8, 1), "vLLM's KV tensors hold no fp8 scale region");
  EXPECT_DEATH(KvCacheLayout::VllmHnd(fp8, 1), "vLLM's KV tensors hold no fp8 scale region");
  EXPECT_DEATH(KvCacheLayout::SglangLayerFirst(fp8, 1), "SGLang's KV tensors hold no fp8");
  EXPECT_DEATH(KvCacheLayout::SglangPageFirst(fp8, 1), "SGLang's KV tensors hold no fp8");
}

TEST(KvCacheLayoutDeathTest, MinRegionSizesChecksItsArguments) {
  const Layout layout = MakeLayout(SmallSpec());
  std::vector<Placement> placements = KvCacheLayout::VllmNhd(layout, 4);
  EXPECT_DEATH(KvCacheLayout::MinRegionSizes(layout, 0, placements), "num_blocks > 0");
  placements[2].block_stride_bytes = kMax / 2;
  EXPECT_DEATH(KvCacheLayout::MinRegionSizes(layout, 4, placements),
               "placement 2 \\(layer 1 K\\): byte range overflows");
  placements.pop_back();
  EXPECT_DEATH(KvCacheLayout::MinRegionSizes(layout, 4, placements), "placements.size\\(\\)");
}

}  // namespace
}  // namespace kvtier
