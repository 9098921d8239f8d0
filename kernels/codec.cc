#include "kernels/codec.h"

#include <xxhash.h>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "common/check.h"
#include "kernels/copy_reference.h"
#include "kernels/fp8_e4m3.h"

namespace kvtier {
namespace {

constexpr int kZstdLevel = 1;

// Bytes an encoding must save to be kept: 1/64 of the block.
bool WorthIt(size_t raw, size_t encoded) { return encoded <= raw - raw / 64; }

size_t Groups(size_t elems, uint32_t group) { return (elems + group - 1) / group; }

// Byte planes: element i's byte b goes to planes[b * n + i].
void Split(std::span<const uint8_t> raw, size_t width, uint8_t* planes) {
  const size_t n = raw.size() / width;
  if (width == 2) {  // fp16 and bf16: a loop the compiler vectorizes
    const uint8_t* in = raw.data();
    for (size_t i = 0; i < n; ++i) {
      planes[i] = in[2 * i];
      planes[n + i] = in[2 * i + 1];
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    for (size_t b = 0; b < width; ++b) planes[b * n + i] = raw[i * width + b];
  }
}
void Join(const uint8_t* planes, size_t width, std::span<uint8_t> dst) {
  const size_t n = dst.size() / width;
  if (width == 2) {
    uint8_t* out = dst.data();
    for (size_t i = 0; i < n; ++i) {
      out[2 * i] = planes[i];
      out[2 * i + 1] = planes[n + i];
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    for (size_t b = 0; b < width; ++b) dst[i * width + b] = planes[b * n + i];
  }
}

}  // namespace

struct BlockCodec::Zstd {
  ZSTD_CCtx* c = nullptr;
  ZSTD_DCtx* d = nullptr;
  ~Zstd() {
    ZSTD_freeCCtx(c);
    ZSTD_freeDCtx(d);
  }
};

LayoutFingerprint CodedFingerprint(const LayoutFingerprint& layout, const CodecParams& p) {
  if (p.kind != CodecKind::kFp8) return layout;
  std::string in = "KVTCODC1";
  in.append(reinterpret_cast<const char*>(layout.bytes.data()), layout.bytes.size());
  in.push_back(static_cast<char>(p.kind));
  for (int i = 0; i < 4; ++i) in.push_back(static_cast<char>(p.group_elems >> (8 * i)));
  const XXH128_hash_t h = XXH3_128bits(in.data(), in.size());
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, h);
  LayoutFingerprint out;
  std::memcpy(out.bytes.data(), canonical.digest, out.bytes.size());
  return out;
}

bool WithinFp8Bound(const CodecParams& p, std::span<const uint8_t> raw, std::span<const uint8_t> decoded) {
  KVTIER_CHECK(p.kind == CodecKind::kFp8 && p.group_elems > 0 && raw.size() == decoded.size() && raw.size() % 2 == 0);
  auto value = [&](std::span<const uint8_t> v, size_t i) {
    uint16_t b = 0;
    std::memcpy(&b, &v[2 * i], 2);
    return p.dtype == DType::kBf16 ? fp8::Bf16ToFloat(b) : fp8::Fp16ToFloat(b);
  };
  const size_t elems = raw.size() / 2;
  for (size_t g = 0; g < elems; g += p.group_elems) {
    const size_t end = std::min(elems, g + p.group_elems);
    float amax = 0;
    for (size_t i = g; i < end; ++i) amax = std::max(amax, std::fabs(value(raw, i)));
    const float slack = std::ldexp(amax / fp8::kE4m3Max, -10);
    for (size_t i = g; i < end; ++i) {
      const float x = value(raw, i);
      if (!(std::fabs(value(decoded, i) - x) <= 0.0665f * std::fabs(x) + slack)) return false;
    }
  }
  return true;
}

Status CheckCodec(const CodecParams& p) {
  const size_t width = DTypeSizeBytes(p.dtype);
  switch (p.kind) {
    case CodecKind::kNone: return Status::Ok();
    case CodecKind::kLossless:
      if (width == 0) return InvalidArgument("lossless: unknown dtype");
      return Status::Ok();
    case CodecKind::kFp8:
      if (p.dtype != DType::kFp16 && p.dtype != DType::kBf16) {
        return InvalidArgument("fp8 needs fp16 or bf16 KV, not " + std::string(DTypeName(p.dtype)) +
                               " (use none or lossless)");
      }
      if (p.group_elems == 0) return InvalidArgument("fp8: group_elems must be at least 1");
      return Status::Ok();
  }
  return InvalidArgument("unknown codec " + std::to_string(static_cast<int>(p.kind)));
}

Result<std::unique_ptr<BlockCodec>> BlockCodec::Create() {
  auto z = std::make_unique<Zstd>();
  z->c = ZSTD_createCCtx();
  z->d = ZSTD_createDCtx();
  if (z->c == nullptr || z->d == nullptr) return Err(Status(StatusCode::kResourceExhausted, "zstd: no memory"));
  return std::unique_ptr<BlockCodec>(new BlockCodec(std::move(z)));
}

BlockCodec::BlockCodec(std::unique_ptr<Zstd> zstd) : zstd_(std::move(zstd)) {}
BlockCodec::~BlockCodec() = default;

size_t BlockCodec::MaxEncodedBytes(const CodecParams& p, size_t raw_bytes) {
  switch (p.kind) {
    case CodecKind::kNone: return 0;
    case CodecKind::kLossless: return ZSTD_compressBound(raw_bytes);
    case CodecKind::kFp8: {
      const size_t elems = raw_bytes / 2;
      return Groups(elems, std::max<uint32_t>(p.group_elems, 1)) * sizeof(float) + elems;
    }
  }
  return 0;
}

std::optional<size_t> BlockCodec::Encode(const CodecParams& p, std::span<const uint8_t> raw, std::span<uint8_t> out) {
  KVTIER_CHECK(CheckCodec(p).ok());
  KVTIER_CHECK(out.size() >= MaxEncodedBytes(p, raw.size()));
  if (p.kind == CodecKind::kLossless) {
    const size_t width = DTypeSizeBytes(p.dtype);
    KVTIER_CHECK(raw.size() % width == 0);
    planes_.resize(raw.size());
    Split(raw, width, planes_.data());
    const size_t n = ZSTD_compressCCtx(zstd_->c, out.data(), out.size(), planes_.data(), planes_.size(), kZstdLevel);
    if (ZSTD_isError(n) || !WorthIt(raw.size(), n)) return std::nullopt;
    return n;
  }
  if (p.kind == CodecKind::kFp8) {
    KVTIER_CHECK(raw.size() % 2 == 0);
    const size_t elems = raw.size() / 2;
    const size_t groups = Groups(elems, p.group_elems);
    uint8_t* scales = out.data();
    uint8_t* q = out.data() + groups * sizeof(float);
    // One pass to fp32 (the dtype's branch out of the loop), finiteness as
    // an OR over exponent bits: loops the compiler vectorizes.
    floats_.resize(elems);
    const uint16_t* in = reinterpret_cast<const uint16_t*>(raw.data());  // little-endian host
    const bool bf16 = p.dtype == DType::kBf16;
    const uint16_t exponent = bf16 ? 0x7f80 : 0x7c00;
    uint32_t special = 0;
    for (size_t i = 0; i < elems; ++i) special |= static_cast<uint32_t>((in[i] & exponent) == exponent);
    if (special != 0) return std::nullopt;  // NaN or Inf: raw
    if (bf16) {
      for (size_t i = 0; i < elems; ++i) floats_[i] = fp8::Bf16ToFloat(in[i]);
    } else {
      for (size_t i = 0; i < elems; ++i) floats_[i] = fp8::Fp16ToFloat(in[i]);
    }
    const float* f = floats_.data();  // q's byte stores may alias floats_ itself
    for (size_t g = 0; g < groups; ++g) {
      const size_t begin = g * p.group_elems;
      const size_t end = std::min(elems, begin + p.group_elems);
      // The largest magnitude as an integer maximum of the inputs' bits
      // (sign cleared: finite fp16 and bf16 order as their bits do).
      uint16_t amax_bits = 0;
      for (size_t i = begin; i < end; ++i) {
        const auto m = static_cast<uint16_t>(in[i] & 0x7fff);
        amax_bits = m > amax_bits ? m : amax_bits;
      }
      const float amax = bf16 ? fp8::Bf16ToFloat(amax_bits) : fp8::Fp16ToFloat(amax_bits);
      const float s = amax / fp8::kE4m3Max;
      const uint32_t bits = fp8::FloatBits(s);
      for (int b = 0; b < 4; ++b) scales[g * 4 + static_cast<size_t>(b)] = static_cast<uint8_t>(bits >> (8 * b));
      if (s == 0) {
        // An all-zero group keeps its zeros' signs (code 0x80 is -0).
        for (size_t i = begin; i < end; ++i) q[i] = std::signbit(f[i]) ? 0x80 : 0x00;
        continue;
      }
      const float inv = fp8::kE4m3Max / amax;  // x·inv: x/s within fp32 rounding
      if (std::isfinite(inv)) {
        for (size_t i = begin; i < end; ++i) q[i] = fp8::FloatToE4m3Rounded(f[i] * inv);
        continue;
      }
      // amax below about 2^-119 (bf16 only): 448/amax is past the largest
      // float. Scaled up by 2^64 first, exactly (a power of two, and |x|
      // is tiny), the same quotient is finite.
      const float pre = 0x1p64f;
      const float scaled_inv = fp8::kE4m3Max / (amax * pre);
      for (size_t i = begin; i < end; ++i) q[i] = fp8::FloatToE4m3Rounded((f[i] * pre) * scaled_inv);
    }
    return groups * sizeof(float) + elems;
  }
  return std::nullopt;
}

Status BlockCodec::Decode(const CodecParams& p, std::span<const uint8_t> stored, std::span<uint8_t> dst) {
  auto corrupt = [&](const std::string& what) {
    return Status(StatusCode::kCorruption, std::string(CodecName(p.kind)) + " block: " + what);
  };
  if (p.kind == CodecKind::kLossless) {
    const size_t width = DTypeSizeBytes(p.dtype);
    if (width == 0 || dst.size() % width != 0) return corrupt("the raw size is not a whole number of elements");
    planes_.resize(dst.size());
    const size_t n = ZSTD_decompressDCtx(zstd_->d, planes_.data(), planes_.size(), stored.data(), stored.size());
    if (ZSTD_isError(n)) return corrupt(std::string("zstd: ") + ZSTD_getErrorName(n));
    if (n != dst.size()) return corrupt(std::to_string(n) + " bytes, not " + std::to_string(dst.size()));
    Join(planes_.data(), width, dst);
    return Status::Ok();
  }
  if (p.kind == CodecKind::kFp8) {
    if (dst.size() % 2 != 0 || p.group_elems == 0) return corrupt("bad raw size or group");
    const size_t elems = dst.size() / 2;
    const size_t groups = Groups(elems, p.group_elems);
    if (stored.size() != groups * sizeof(float) + elems) {
      return corrupt(std::to_string(stored.size()) + " bytes stored, expected " +
                     std::to_string(groups * sizeof(float) + elems));
    }
    const uint8_t* q = stored.data() + groups * sizeof(float);
    // Checked first, in loops of their own, so that the conversion below
    // has no branch and vectorizes.
    uint32_t nan_codes = 0;
    for (size_t i = 0; i < elems; ++i) nan_codes |= static_cast<uint32_t>((q[i] & 0x7f) == 0x7f);
    if (nan_codes != 0) return corrupt("a NaN code");
    uint16_t* out = reinterpret_cast<uint16_t*>(dst.data());  // little-endian host, as Encode
    for (size_t g = 0; g < groups; ++g) {
      uint32_t bits = 0;
      for (int b = 0; b < 4; ++b) bits |= uint32_t{stored[g * 4 + static_cast<size_t>(b)]} << (8 * b);
      const float s = fp8::BitsFloat(bits);
      if (!std::isfinite(s) || s < 0) return corrupt("a bad scale");
      const size_t begin = g * p.group_elems;
      const size_t end = std::min(elems, begin + p.group_elems);
      if (p.dtype == DType::kBf16) {
        // |q·s| <= 448·s is at most the group's amax: finite.
        for (size_t i = begin; i < end; ++i) out[i] = fp8::FiniteToBf16(fp8::E4m3ToFloatFinite(q[i]) * s);
      } else {
        for (size_t i = begin; i < end; ++i) out[i] = fp8::FloatToFp16(fp8::E4m3ToFloatFinite(q[i]) * s);
      }
    }
    return Status::Ok();
  }
  return corrupt("nothing to decode");
}

Status DecodeAndScatter(BlockCodec& coder, const CodecParams& p, std::span<const uint8_t> stored,
                        const CopyPlan& plan, uint32_t engine_block, std::vector<uint8_t>& scratch) {
  scratch.resize(plan.block_bytes());
  KVTIER_RETURN_IF_ERROR(coder.Decode(p, stored, scratch));
  ScatterBlock(plan, engine_block, scratch.data());
  return Status::Ok();
}

std::optional<size_t> GatherAndEncode(BlockCodec& coder, const CodecParams& p, const CopyPlan& plan,
                                      uint32_t engine_block, std::span<uint8_t> out, std::vector<uint8_t>& scratch) {
  scratch.resize(plan.block_bytes());
  GatherBlock(plan, engine_block, scratch.data(), nullptr, CopyStores::kCached);  // encoded right away
  return coder.Encode(p, scratch, out);
}

}  // namespace kvtier
