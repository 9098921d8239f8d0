#include "common/layout.h"

#include <functional>
#include <set>

#include <gtest/gtest.h>

namespace kvtier {
namespace {

LayoutSpec Llama8B() {
  return LayoutSpec{.model_id = "meta-llama/Llama-3.1-8B",
                    .num_layers = 32,
                    .kv_kind = KvKind::kSeparateKv,
                    .num_kv_heads = 8,
                    .head_dim = 128,
                    .dtype = DType::kBf16,
                    .block_tokens = 16,
                    .tp_rank = 0,
                    .tp_size = 1,
                    .scale_bytes_per_layer = 0};
}

TEST(LayoutTest, BlockSizeOfSeparateKv) {
  Result<Layout> l = Layout::Create(Llama8B());
  ASSERT_TRUE(l.has_value()) << l.error();
  EXPECT_EQ(l->tensor_bytes(), 16u * 8 * 128 * 2);
  EXPECT_EQ(l->layer_bytes(), 2u * 16 * 8 * 128 * 2);
  EXPECT_EQ(l->block_bytes(), 32u * 2 * 16 * 8 * 128 * 2);  // 2 MiB
  EXPECT_EQ(l->block_bytes(), 2u << 20);
}

TEST(LayoutTest, BlockSizeOfLatentWithScale) {
  // DeepSeek-V3 style MLA: one 576-wide latent per token per layer, fp8 with a
  // per-layer scale region.
  LayoutSpec s{.model_id = "deepseek-ai/DeepSeek-V3", .num_layers = 61, .kv_kind = KvKind::kLatent,
               .num_kv_heads = 1, .head_dim = 576, .dtype = DType::kFp8E4M3, .block_tokens = 64,
               .tp_rank = 0, .tp_size = 1, .scale_bytes_per_layer = 256};
  Result<Layout> l = Layout::Create(s);
  ASSERT_TRUE(l.has_value()) << l.error();
  EXPECT_EQ(l->tensor_bytes(), 64u * 576);
  EXPECT_EQ(l->layer_bytes(), 64u * 576 + 256);
  EXPECT_EQ(l->block_bytes(), 61u * (64 * 576 + 256));
}

TEST(LayoutTest, DTypeSizes) {
  EXPECT_EQ(DTypeSizeBytes(DType::kFp16), 2u);
  EXPECT_EQ(DTypeSizeBytes(DType::kBf16), 2u);
  EXPECT_EQ(DTypeSizeBytes(DType::kFp32), 4u);
  EXPECT_EQ(DTypeSizeBytes(DType::kFp8E4M3), 1u);
  EXPECT_EQ(DTypeSizeBytes(DType::kFp8E5M2), 1u);
  for (DType d : {DType::kFp16, DType::kBf16, DType::kFp32, DType::kFp8E4M3, DType::kFp8E5M2}) {
    EXPECT_EQ(ParseDType(DTypeName(d)).value(), d);
  }
  EXPECT_FALSE(ParseDType("int4").has_value());
  EXPECT_EQ(ParseKvKind("latent").value(), KvKind::kLatent);
  EXPECT_FALSE(ParseKvKind("kvv").has_value());
}

TEST(LayoutTest, FingerprintIsStableAndChangesWithEveryField) {
  const LayoutFingerprint base = Layout::Create(Llama8B()).value().fingerprint();
  EXPECT_EQ(Layout::Create(Llama8B()).value().fingerprint(), base);

  const std::vector<std::function<void(LayoutSpec&)>> changes = {
      [](LayoutSpec& s) { s.model_id += "-Instruct"; },
      [](LayoutSpec& s) { s.num_layers = 33; },
      [](LayoutSpec& s) { s.kv_kind = KvKind::kLatent; s.num_kv_heads = 1; },
      [](LayoutSpec& s) { s.num_kv_heads = 4; },
      [](LayoutSpec& s) { s.head_dim = 64; },
      [](LayoutSpec& s) { s.dtype = DType::kFp16; },  // same size, different bytes
      [](LayoutSpec& s) { s.block_tokens = 32; },
      [](LayoutSpec& s) { s.tp_size = 2; },
      [](LayoutSpec& s) { s.tp_size = 2; s.tp_rank = 1; },
      [](LayoutSpec& s) { s.dtype = DType::kFp8E4M3; s.scale_bytes_per_layer = 4; },
  };
  std::set<std::string> seen = {base.ToHex()};
  for (size_t i = 0; i < changes.size(); ++i) {
    LayoutSpec s = Llama8B();
    changes[i](s);
    Result<Layout> l = Layout::Create(s);
    ASSERT_TRUE(l.has_value()) << i << ": " << l.error();
    EXPECT_TRUE(seen.insert(l->fingerprint().ToHex()).second) << "change " << i << " collided";
  }
}

TEST(LayoutTest, InvalidLayoutsNameTheField) {
  struct Case {
    std::function<void(LayoutSpec&)> change;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](LayoutSpec& s) { s.model_id.clear(); }, "model_id"},
      {[](LayoutSpec& s) { s.model_id.assign(300, 'm'); }, "model_id"},
      {[](LayoutSpec& s) { s.num_layers = 0; }, "num_layers"},
      {[](LayoutSpec& s) { s.num_kv_heads = 0; }, "num_kv_heads"},
      {[](LayoutSpec& s) { s.head_dim = 0; }, "head_dim"},
      {[](LayoutSpec& s) { s.block_tokens = 0; }, "block_tokens"},
      {[](LayoutSpec& s) { s.tp_size = 0; }, "tp_size"},
      {[](LayoutSpec& s) { s.tp_rank = 1; }, "tp_rank"},
      {[](LayoutSpec& s) { s.kv_kind = KvKind::kLatent; }, "num_kv_heads"},
      {[](LayoutSpec& s) { s.kv_kind = static_cast<KvKind>(9); }, "kv_kind"},
      {[](LayoutSpec& s) { s.dtype = static_cast<DType>(42); }, "dtype"},
      {[](LayoutSpec& s) { s.scale_bytes_per_layer = 16; }, "scale_bytes_per_layer"},
      // Overflow of 64 bits, and merely too large.
      {[](LayoutSpec& s) { s.num_layers = s.head_dim = s.block_tokens = s.num_kv_heads = 0xffffffffu; },
       "block_tokens"},
      {[](LayoutSpec& s) { s.block_tokens = 1u << 20; }, "block_tokens"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    LayoutSpec s = Llama8B();
    cases[i].change(s);
    Result<Layout> l = Layout::Create(s);
    ASSERT_FALSE(l.has_value()) << "case " << i;
    EXPECT_EQ(l.error().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(l.error().message().find("layout." + cases[i].field), std::string::npos)
        << "case " << i << ": " << l.error().message();
  }
}

}  // namespace
}  // namespace kvtier
