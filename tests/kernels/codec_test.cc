// The block codecs (kernels/codec.h) against the bounds the issue sets
// (../shared/notes/compression.md, section 7): lossless is bit-exact on any
// input and stores raw what does not compress; fp8 keeps every element within
// 0.0665·|x| + 2^-10·s, keeps zeros and signs, returns each group's largest
// element exactly, and its relative RMSE is at most 0.03 on N(0,1) and on
// the ordinary channels of outlier-heavy K. The element conversions are
// checked exhaustively against their definitions.
#include "kernels/codec.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/fp8_e4m3.h"

namespace kvtier {
namespace {

using fp8::Bf16ToFloat;
using fp8::E4m3ToFloat;
using fp8::FloatToBf16;
using fp8::FloatToE4m3;
using fp8::FloatToFp16;
using fp8::Fp16ToFloat;

std::unique_ptr<BlockCodec> Codec() { return BlockCodec::Create().value(); }

std::vector<uint8_t> Bytes16(const std::vector<uint16_t>& v) {
  std::vector<uint8_t> out(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    out[2 * i] = static_cast<uint8_t>(v[i]);
    out[2 * i + 1] = static_cast<uint8_t>(v[i] >> 8);
  }
  return out;
}
std::vector<uint16_t> Elems16(const std::vector<uint8_t>& b) {
  std::vector<uint16_t> out(b.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint16_t>(b[2 * i] | (b[2 * i + 1] << 8));
  return out;
}

// Encodes and decodes; nullopt when the codec stored it raw.
std::optional<std::vector<uint8_t>> RoundTrip(BlockCodec& c, const CodecParams& p, const std::vector<uint8_t>& raw,
                                              size_t* stored_bytes = nullptr) {
  std::vector<uint8_t> stored(BlockCodec::MaxEncodedBytes(p, raw.size()));
  const std::optional<size_t> n = c.Encode(p, raw, stored);
  if (!n) return std::nullopt;
  stored.resize(*n);
  if (stored_bytes != nullptr) *stored_bytes = *n;
  std::vector<uint8_t> back(raw.size());
  const Status st = c.Decode(p, stored, back);
  EXPECT_TRUE(st.ok()) << st;
  return back;
}

std::vector<uint16_t> Normal(DType d, size_t n, uint64_t seed, float sigma = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = d == DType::kBf16 ? FloatToBf16(dist(rng)) : FloatToFp16(dist(rng));
  return v;
}

TEST(Fp8ConversionTest, EveryE4m3CodeRoundTripsAndRoundingIsToNearestEven) {
  for (int q = 0; q < 256; ++q) {
    const float v = E4m3ToFloat(static_cast<uint8_t>(q));
    if ((q & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << q;
      continue;
    }
    // -0 and +0 are distinct codes; every other value maps to its own code.
    EXPECT_EQ(FloatToE4m3(v), q) << q << " = " << v;
  }
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4m3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(FloatToE4m3(1e9f), 0x7e) << "saturates, never NaN";
  EXPECT_EQ(FloatToE4m3(-1e9f), 0xfe);
  EXPECT_EQ(FloatToE4m3(464.0f), 0x7e);
  // Halfway between 1 and 1.125: to the even mantissa (1); between 1.125
  // and 1.25: to 1.25.
  EXPECT_EQ(E4m3ToFloat(FloatToE4m3(1.0625f)), 1.0f);
  EXPECT_EQ(E4m3ToFloat(FloatToE4m3(1.1875f)), 1.25f);
  // Subnormals: half the smallest step rounds to even (0); a little more, up.
  EXPECT_EQ(FloatToE4m3(std::ldexp(1.0f, -10)), 0);
  EXPECT_EQ(FloatToE4m3(std::ldexp(1.5f, -10)), 1);
  EXPECT_EQ(FloatToE4m3(-0.0f), 0x80);
  // Against the nearest representable value, over a sweep.
  std::vector<float> grid;
  for (int q = 0; q < 0x7f; ++q) grid.push_back(E4m3ToFloat(static_cast<uint8_t>(q)));
  for (float x = 0; x < 460; x = x * 1.0007f + 1e-5f) {
    const float got = E4m3ToFloat(FloatToE4m3(x));
    float best = grid[0];
    for (float g : grid) {
      if (std::fabs(g - x) < std::fabs(best - x)) best = g;
    }
    ASSERT_EQ(std::fabs(got - x), std::fabs(best - x)) << x;
  }
}

// The codec's loops use branch-free forms of the conversions: the same
// results as the reference forms above over everything they may meet.
TEST(Fp8ConversionTest, TheCodecsVectorizableConversionsAgreeWithTheReferenceOnes) {
  // Every E4M3 code but NaN.
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    const auto q = static_cast<uint8_t>(c);
    EXPECT_EQ(fp8::FloatBits(fp8::E4m3ToFloatFinite(q)), fp8::FloatBits(fp8::E4m3ToFloat(q))) << c;
  }
  // Every E4M3 value, the midpoints between neighbours (ties) and a hair
  // either side of them, and every bf16 value up to 448 in magnitude.
  std::vector<float> xs;
  for (int c = 0; c < 0x7e; ++c) {
    const float a = fp8::E4m3ToFloat(static_cast<uint8_t>(c));
    const float b = fp8::E4m3ToFloat(static_cast<uint8_t>(c + 1));
    const float mid = (a + b) / 2;
    xs.insert(xs.end(), {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f)});
  }
  xs.insert(xs.end(), {448.0f, std::nextafter(448.0f, 1000.0f), 448.0f * (1 + 0x1p-21f), 0.0f, 1e-30f, 1e-45f});
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = fp8::Bf16ToFloat(static_cast<uint16_t>(h));
    if (std::isfinite(f) && std::fabs(f) <= 448.0f) xs.push_back(f);
  }
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> any(-448.0f, 448.0f);
  for (int i = 0; i < 200000; ++i) xs.push_back(any(rng) * (i % 3 == 0 ? 1e-3f : 1.0f));
  for (float x : xs) {
    for (float v : {x, -x}) {
      ASSERT_EQ(fp8::FloatToE4m3Rounded(v), fp8::FloatToE4m3(v)) << v;
    }
  }
  // bf16 rounding of finite values: random bits of every exponent.
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng());
    const float f = fp8::BitsFloat(bits);
    if (!std::isfinite(f)) continue;
    ASSERT_EQ(fp8::FiniteToBf16(f), fp8::FloatToBf16(f)) << bits;
  }
}

TEST(Fp8ConversionTest, Fp16AndBf16RoundTripEveryValueAndRoundToNearestEven) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f16 = Fp16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f16)) {
      EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(f16))));
    } else {
      EXPECT_EQ(FloatToFp16(f16), h) << h;
    }
    const float bf = Bf16ToFloat(static_cast<uint16_t>(h));
    if (!std::isnan(bf)) {
      EXPECT_EQ(FloatToBf16(bf), h) << h;
    }
  }
  EXPECT_EQ(Fp16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00) << "past 65504 it is Inf";
  EXPECT_EQ(FloatToFp16(65519.0f), 0x7bff);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: to even (1).
  EXPECT_EQ(FloatToFp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(FloatToFp16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
}

TEST(LosslessCodecTest, BitExactOnEveryKindOfInput) {
  auto c = Codec();
  std::mt19937_64 rng(1);
  const size_t n = 16384;  // a 32 KiB block of 2-byte elements
  std::vector<std::pair<const char*, std::vector<uint16_t>>> inputs;
  inputs.emplace_back("N(0,1) bf16", Normal(DType::kBf16, n, 2));
  inputs.emplace_back("zeros", std::vector<uint16_t>(n, 0));
  std::vector<uint16_t> nan(n), inf(n), random(n);
  for (size_t i = 0; i < n; ++i) {
    nan[i] = i % 3 == 0 ? 0x7fc1 : (i % 3 == 1 ? 0xffff : FloatToBf16(static_cast<float>(i)));
    inf[i] = i % 2 == 0 ? 0x7f80 : 0xff80;
    random[i] = static_cast<uint16_t>(rng());
  }
  inputs.emplace_back("NaN patterns", nan);
  inputs.emplace_back("±Inf", inf);
  inputs.emplace_back("uniform random", random);
  for (const auto& [name, elems] : inputs) {
    const std::vector<uint8_t> raw = Bytes16(elems);
    size_t stored = 0;
    const std::optional<std::vector<uint8_t>> back =
        RoundTrip(*c, {.kind = CodecKind::kLossless, .dtype = DType::kBf16}, raw, &stored);
    if (std::string(name) == "uniform random") {
      EXPECT_FALSE(back.has_value()) << "incompressible bytes are stored raw";
      continue;
    }
    ASSERT_TRUE(back.has_value()) << name;
    EXPECT_EQ(*back, raw) << name;
    EXPECT_LT(stored, raw.size()) << name;
  }
  // Other widths: fp32 (4 planes) and fp8 caches (1: zstd alone).
  for (DType d : {DType::kFp32, DType::kFp8E4M3}) {
    std::vector<uint8_t> raw(65536);
    for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<uint8_t>((i % 7) * (i % 4 == 3 ? 1 : 0) + (i % 64));
    const std::optional<std::vector<uint8_t>> back = RoundTrip(*c, {.kind = CodecKind::kLossless, .dtype = d}, raw);
    ASSERT_TRUE(back.has_value()) << DTypeName(d);
    EXPECT_EQ(*back, raw) << DTypeName(d);
  }
  // Byte planes are worth it on bf16 KV: at least 1.3x on N(0,1).
  size_t stored = 0;
  const std::vector<uint8_t> raw = Bytes16(Normal(DType::kBf16, 1 << 20, 3));  // 2 MiB
  ASSERT_TRUE(RoundTrip(*c, {.kind = CodecKind::kLossless, .dtype = DType::kBf16}, raw, &stored).has_value());
  EXPECT_GE(static_cast<double>(raw.size()) / static_cast<double>(stored), 1.3);
}

TEST(LosslessCodecTest, DamagedBytesAreCorruptionNeverServed) {
  auto c = Codec();
  const CodecParams p{.kind = CodecKind::kLossless, .dtype = DType::kFp16};
  const std::vector<uint8_t> raw = Bytes16(Normal(DType::kFp16, 4096, 4));
  std::vector<uint8_t> stored(BlockCodec::MaxEncodedBytes(p, raw.size()));
  const size_t n = c->Encode(p, raw, stored).value();
  stored.resize(n);
  std::vector<uint8_t> back(raw.size());
  EXPECT_EQ(c->Decode(p, std::span(stored).first(n / 2), back).code(), StatusCode::kCorruption);
  std::vector<uint8_t> small(raw.size() - 2);
  EXPECT_EQ(c->Decode(p, stored, small).code(), StatusCode::kCorruption) << "the raw size must match";
}

// Relative RMSE of `back` against `in` over the elements `use` selects.
template <typename Use>
double RelativeRmse(DType d, const std::vector<uint16_t>& in, const std::vector<uint16_t>& back, Use use) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    if (!use(i)) continue;
    const double x = d == DType::kBf16 ? Bf16ToFloat(in[i]) : Fp16ToFloat(in[i]);
    const double y = d == DType::kBf16 ? Bf16ToFloat(back[i]) : Fp16ToFloat(back[i]);
    err += (y - x) * (y - x);
    ref += x * x;
  }
  return std::sqrt(err / ref);
}

// Checks the element bound, zeros, signs and the groups' exact maxima.
void ExpectWithinBound(DType d, uint32_t group, const std::vector<uint16_t>& in, const std::vector<uint16_t>& back) {
  auto f = [&](uint16_t v) { return d == DType::kBf16 ? Bf16ToFloat(v) : Fp16ToFloat(v); };
  for (size_t g = 0; g * group < in.size(); ++g) {
    const size_t begin = g * group, end = std::min(in.size(), begin + group);
    float amax = 0;
    size_t at = begin;
    for (size_t i = begin; i < end; ++i) {
      if (std::fabs(f(in[i])) > amax) {
        amax = std::fabs(f(in[i]));
        at = i;
      }
    }
    const double s = amax / 448.0;
    for (size_t i = begin; i < end; ++i) {
      const double x = f(in[i]), y = f(back[i]);
      ASSERT_TRUE(std::isfinite(y)) << i;
      ASSERT_LE(std::fabs(y - x), 0.0665 * std::fabs(x) + std::ldexp(s, -10)) << "element " << i << ": " << x << " -> "
                                                                              << y;
      if (x == 0) {
        ASSERT_EQ(back[i], in[i]) << "zero (and its sign) kept at " << i;
      }
      if (x != 0 && y != 0) {
        ASSERT_EQ(std::signbit(x), std::signbit(y)) << i;
      }
    }
    ASSERT_EQ(back[at], in[at]) << "the group's largest element comes back exactly (group " << g << ")";
  }
}

TEST(Fp8CodecTest, WithinTheBoundOnNormalDataBothDtypesAndGroupSizes) {
  auto c = Codec();
  for (DType d : {DType::kBf16, DType::kFp16}) {
    for (uint32_t group : {128u, 64u, 100u}) {  // 100: a last group shorter than the rest
      const std::vector<uint16_t> in = Normal(d, 192 * 1024, 5 + group);
      const CodecParams p{.kind = CodecKind::kFp8, .dtype = d, .group_elems = group};
      size_t stored = 0;
      const std::vector<uint8_t> raw = Bytes16(in);
      const std::optional<std::vector<uint8_t>> back = RoundTrip(*c, p, raw, &stored);
      ASSERT_TRUE(back.has_value());
      const std::vector<uint16_t> out = Elems16(*back);
      ExpectWithinBound(d, group, in, out);
      EXPECT_LE(RelativeRmse(d, in, out, [](size_t) { return true; }), 0.03) << DTypeName(d) << " group " << group;
      if (group == 128) {
        EXPECT_NEAR(static_cast<double>(raw.size()) / static_cast<double>(stored), 1.94, 0.01);
      }
    }
  }
}

TEST(Fp8CodecTest, OutlierHeavyKeysKeepTheirOrdinaryChannels) {
  // 4 of 128 channels x50, values Student-t(3) (K's fixed outlier channels).
  auto c = Codec();
  std::mt19937_64 rng(7);
  std::student_t_distribution<float> t3(3.0f);
  const uint32_t dim = 128;
  std::vector<uint16_t> in(dim * 1536);
  auto outlier = [&](size_t i) { const size_t ch = i % dim; return ch == 3 || ch == 40 || ch == 77 || ch == 120; };
  for (size_t i = 0; i < in.size(); ++i) in[i] = FloatToBf16(t3(rng) * (outlier(i) ? 50.0f : 1.0f));
  const CodecParams p{.kind = CodecKind::kFp8, .dtype = DType::kBf16, .group_elems = dim};
  const std::vector<uint16_t> out = Elems16(RoundTrip(*c, p, Bytes16(in)).value());
  ExpectWithinBound(DType::kBf16, dim, in, out);
  EXPECT_LE(RelativeRmse(DType::kBf16, in, out, [&](size_t i) { return !outlier(i); }), 0.03);
}

TEST(Fp8CodecTest, ZerosNansInfsAndExtremes) {
  auto c = Codec();
  const CodecParams p{.kind = CodecKind::kFp8, .dtype = DType::kBf16, .group_elems = 8};
  // All-zero groups (both signs) stay zero, with their signs.
  std::vector<uint16_t> zeros = {0, 0x8000, 0, 0, 0x8000, 0, 0, 0};
  EXPECT_EQ(Elems16(RoundTrip(*c, p, Bytes16(zeros)).value()), zeros);
  // A NaN or an Inf anywhere: the block is stored raw.
  for (uint16_t bad : {uint16_t{0x7fc0}, uint16_t{0x7f80}, uint16_t{0xff80}}) {
    std::vector<uint16_t> v(64, FloatToBf16(1.5f));
    v[37] = bad;
    EXPECT_FALSE(RoundTrip(*c, p, Bytes16(v)).has_value()) << bad;
  }
  // The largest bf16 values and the smallest subnormals, side by side.
  std::vector<uint16_t> extremes = {0x7f7f, 0xff7f, 0x0001, 0x8001, 0x3f80, 0x0080, 0x7f00, 0x0000};
  ExpectWithinBound(DType::kBf16, 8, extremes, Elems16(RoundTrip(*c, p, Bytes16(extremes)).value()));
  const CodecParams h{.kind = CodecKind::kFp8, .dtype = DType::kFp16, .group_elems = 8};
  std::vector<uint16_t> fp16_extremes = {0x7bff, 0xfbff, 0x0001, 0x8001, 0x3c00, 0x0400, 0x7000, 0x0000};
  ExpectWithinBound(DType::kFp16, 8, fp16_extremes, Elems16(RoundTrip(*c, h, Bytes16(fp16_extremes)).value()));
}

// A bf16 group whose largest magnitude is below about 2^-119: 448/amax is
// past the largest float. Before, the encoder's inverse scale was inf, and
// zeros came back as -amax.
TEST(Fp8CodecTest, GroupsOfTinyBf16ValuesKeepTheBound) {
  auto c = Codec();
  const CodecParams p{.kind = CodecKind::kFp8, .dtype = DType::kBf16, .group_elems = 8};
  for (const int e : {-120, -126, -128, -130, -133}) {
    const float a = std::ldexp(1.0f, e);
    std::vector<uint16_t> tiny = {FloatToBf16(a),         0, 0x8000, FloatToBf16(-a / 2), FloatToBf16(a / 4),
                                  FloatToBf16(a * 0.75f), 0, FloatToBf16(-a)};
    ExpectWithinBound(DType::kBf16, 8, tiny, Elems16(RoundTrip(*c, p, Bytes16(tiny)).value()));
    // The smallest subnormal alone, and beside zeros.
    std::vector<uint16_t> least = {0x0001, 0, 0, 0, 0x8000, 0, 0, 0x8001};
    ExpectWithinBound(DType::kBf16, 8, least, Elems16(RoundTrip(*c, p, Bytes16(least)).value()));
  }
}

TEST(Fp8CodecTest, DamagedBytesAreCorruption) {
  auto c = Codec();
  const CodecParams p{.kind = CodecKind::kFp8, .dtype = DType::kBf16, .group_elems = 16};
  const std::vector<uint8_t> raw = Bytes16(Normal(DType::kBf16, 256, 8));
  std::vector<uint8_t> stored(BlockCodec::MaxEncodedBytes(p, raw.size()));
  stored.resize(c->Encode(p, raw, stored).value());
  std::vector<uint8_t> back(raw.size());
  EXPECT_EQ(c->Decode(p, std::span(stored).first(stored.size() - 1), back).code(), StatusCode::kCorruption);
  std::vector<uint8_t> nan_scale = stored;
  nan_scale[3] = 0x7f;
  nan_scale[2] = 0xc0;  // the first scale: a NaN
  EXPECT_EQ(c->Decode(p, nan_scale, back).code(), StatusCode::kCorruption);
  std::vector<uint8_t> nan_code = stored;
  nan_code[(256 / 16) * 4 + 5] = 0x7f;
  EXPECT_EQ(c->Decode(p, nan_code, back).code(), StatusCode::kCorruption);
}

TEST(CodecTest, WhatEachCodecAcceptsIsChecked) {
  EXPECT_TRUE(CheckCodec({.kind = CodecKind::kFp8, .dtype = DType::kFp16}).ok());
  EXPECT_EQ(CheckCodec({.kind = CodecKind::kFp8, .dtype = DType::kFp8E4M3}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckCodec({.kind = CodecKind::kFp8, .dtype = DType::kFp32}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckCodec({.kind = CodecKind::kFp8, .dtype = DType::kBf16, .group_elems = 0}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckCodec({.kind = CodecKind::kLossless, .dtype = DType::kFp8E4M3}).ok());
  EXPECT_TRUE(CheckCodec({.kind = CodecKind::kLossless, .dtype = DType::kFp32}).ok());
  EXPECT_EQ(ParseCodec("fp8").value(), CodecKind::kFp8);
  EXPECT_FALSE(ParseCodec("zstd").has_value());
}

TEST(CodecTest, Fp8BlocksHaveANamespaceOfTheirOwnPerGroupSize) {
  LayoutFingerprint layout;
  for (size_t i = 0; i < layout.bytes.size(); ++i) layout.bytes[i] = static_cast<uint8_t>(i * 7 + 1);
  EXPECT_EQ(CodedFingerprint(layout, {.kind = CodecKind::kNone, .dtype = DType::kBf16, .group_elems = 0}), layout);
  EXPECT_EQ(CodedFingerprint(layout, {.kind = CodecKind::kLossless, .dtype = DType::kBf16, .group_elems = 0}),
            layout);
  const LayoutFingerprint fp8 =
      CodedFingerprint(layout, {.kind = CodecKind::kFp8, .dtype = DType::kBf16, .group_elems = 128});
  EXPECT_NE(fp8, layout);
  EXPECT_NE(CodedFingerprint(layout, {.kind = CodecKind::kFp8, .dtype = DType::kBf16, .group_elems = 64}), fp8);
  // As docs/hashing.md states it: XXH3-128 of "KVTCODC1" ‖ layout ‖ u8 2 ‖
  // u32 group, in canonical byte order.
  std::vector<uint8_t> in = {'K', 'V', 'T', 'C', 'O', 'D', 'C', '1'};
  in.insert(in.end(), layout.bytes.begin(), layout.bytes.end());
  in.insert(in.end(), {2, 128, 0, 0, 0});
  XXH128_canonical_t want;
  XXH128_canonicalFromHash(&want, XXH3_128bits(in.data(), in.size()));
  EXPECT_TRUE(std::equal(fp8.bytes.begin(), fp8.bytes.end(), want.digest));
}

}  // namespace
}  // namespace kvtier
