// The body of the fp8 codec kernels (kernels/cuda/codec_kernels.cu), as
// host-and-device code: what one thread of one CTA encodes or decodes. Like
// the copy kernels' body (copy_kernel_body.h), the .cu launches it on the GPU
// and a unit test runs the very same code for every thread of every CTA on
// the CPU, where it must give what the CPU codec (kernels/codec.h) gives,
// byte for byte: threads share nothing and never synchronise.
//
// The kernels read and write the engine's pages through the copy plan's
// pieces (the slot image is never built): encode gathers a block's groups
// from the engine and writes the codec's output into a slot (a store, D2H);
// decode reads a coded slot and writes the block into the engine's pages (a
// load, H2D). The coded layout is the CPU codec's: the groups' fp32 scales,
// little-endian, then one E4M3 code per element, in slot order.
//
// Encode: one thread per group (x = group / kCodecThreads, y = block of the
// launch). Decode: one thread per kDecodeElems elements.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>

#include "kernels/copy_plan.h"
#include "kernels/fp8_e4m3.h"
#include "kernels/host_device.h"


namespace kvtier::cuda::detail {

inline constexpr uint32_t kCodecThreads = 256;
inline constexpr uint32_t kDecodeElems = 8;

// One block of a codec launch: an engine block and its coded slot.
struct CodedBlock {
  uint32_t engine_block = 0;
  uint8_t* slot = nullptr;
};

// What a launch's blocks are: 2-byte elements (bf16 or fp16) in groups of
// group_elems, the last one possibly shorter.
struct Fp8Shape {
  uint64_t elems = 0;  // per block
  uint32_t group_elems = 0;
  uint32_t groups = 0;  // ceil(elems / group_elems)
  bool bf16 = true;
};

KVTIER_HOST_DEVICE Fp8Shape Fp8ShapeOf(uint64_t block_bytes, uint32_t group_elems, bool bf16) {
  const uint64_t elems = block_bytes / 2;
  return {elems, group_elems, static_cast<uint32_t>((elems + group_elems - 1) / group_elems), bf16};
}

// The engine address of byte `offset` of engine block `block`'s slot image.
// The pieces are in slot order (CopyPlan): the last that starts at or
// before `offset` holds it.
KVTIER_HOST_DEVICE uint8_t* EngineByte(const CopyPiece* pieces, uint32_t num_pieces, uint32_t block, uint64_t offset) {
  uint32_t lo = 0;
  uint32_t hi = num_pieces;
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (pieces[mid].slot_offset <= offset) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const CopyPiece& p = pieces[lo];
  const uint64_t d = offset - p.slot_offset;
  const uint64_t row = d / p.row_bytes;
  const uint64_t o = row / p.inner;
  const uint64_t i = row - o * p.inner;
  return reinterpret_cast<uint8_t*>(p.engine + uint64_t{block} * p.block_stride + o * p.outer_stride +
                                    i * p.inner_stride + (d - row * p.row_bytes));
}

KVTIER_HOST_DEVICE uint16_t LoadElem(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
KVTIER_HOST_DEVICE void StoreElem(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}

// Thread `thread` of CTA `cta_x` encodes its group of `b`. A NaN or an Inf
// sets *special (the block is to be stored raw; what the thread wrote then
// does not matter).
KVTIER_HOST_DEVICE void Fp8EncodeThread(const CopyPiece* pieces, uint32_t num_pieces, const Fp8Shape& shape,
                                     const CodedBlock& b, uint32_t* special, uint32_t cta_x, uint32_t thread) {
  const uint64_t g = uint64_t{cta_x} * kCodecThreads + thread;
  if (g >= shape.groups) return;
  const uint64_t begin = g * shape.group_elems;
  const uint64_t end = begin + shape.group_elems < shape.elems ? begin + shape.group_elems : shape.elems;
  const uint16_t exponent = shape.bf16 ? 0x7f80 : 0x7c00;
  // The largest magnitude as an integer maximum of the inputs' bits (finite
  // fp16 and bf16 order as their bits do), as the CPU codec takes it.
  uint16_t amax_bits = 0;
  for (uint64_t i = begin; i < end; ++i) {
    const uint16_t h = LoadElem(EngineByte(pieces, num_pieces, b.engine_block, 2 * i));
    if ((h & exponent) == exponent) {
      *special = 1;
      return;
    }
    const auto m = static_cast<uint16_t>(h & 0x7fff);
    amax_bits = m > amax_bits ? m : amax_bits;
  }
  const float amax = shape.bf16 ? fp8::Bf16ToFloat(amax_bits) : fp8::Fp16ToFloat(amax_bits);
  const float s = amax / fp8::kE4m3Max;
  const uint32_t bits = fp8::FloatBits(s);
  for (uint32_t k = 0; k < 4; ++k) b.slot[g * 4 + k] = static_cast<uint8_t>(bits >> (8 * k));
  uint8_t* q = b.slot + uint64_t{shape.groups} * 4;
  // amax below about 2^-119 (bf16 only) makes 448/amax pass the largest
  // float: the group is scaled up by 2^64 first, exactly, as the CPU codec
  // does (x·1 and x·2^64 are exact, so both give the same bytes).
  const float pre = s != 0 && !(fp8::kE4m3Max / amax <= 3.40282347e38f) ? 0x1p64f : 1.0f;
  const float inv = s == 0 ? 0.0f : fp8::kE4m3Max / (amax * pre);
  for (uint64_t i = begin; i < end; ++i) {
    const uint16_t h = LoadElem(EngineByte(pieces, num_pieces, b.engine_block, 2 * i));
    if (s == 0) {  // an all-zero group keeps its zeros' signs
      q[i] = (h & 0x8000) != 0 ? 0x80 : 0x00;
      continue;
    }
    const float x = shape.bf16 ? fp8::Bf16ToFloat(h) : fp8::Fp16ToFloat(h);
    q[i] = fp8::FloatToE4m3Rounded((x * pre) * inv);
  }
}

// Thread `thread` of CTA `cta_x` decodes its kDecodeElems elements of `b`
// into the engine's pages. A NaN code or a scale that is not a finite
// non-negative number sets *bad (the block is corrupt: not to be served).
KVTIER_HOST_DEVICE void Fp8DecodeThread(const CopyPiece* pieces, uint32_t num_pieces, const Fp8Shape& shape,
                                     const CodedBlock& b, uint32_t* bad, uint32_t cta_x, uint32_t thread) {
  const uint64_t first = (uint64_t{cta_x} * kCodecThreads + thread) * kDecodeElems;
  const uint8_t* q = b.slot + uint64_t{shape.groups} * 4;
  for (uint64_t i = first; i < first + kDecodeElems && i < shape.elems; ++i) {
    const uint64_t g = i / shape.group_elems;
    const uint32_t bits = uint32_t{b.slot[g * 4]} | (uint32_t{b.slot[g * 4 + 1]} << 8) |
                          (uint32_t{b.slot[g * 4 + 2]} << 16) | (uint32_t{b.slot[g * 4 + 3]} << 24);
    const bool bad_scale = (bits & 0x7f800000u) == 0x7f800000u || (bits > 0x80000000u);
    if (bad_scale || (q[i] & 0x7f) == 0x7f) {
      *bad = 1;
      continue;
    }
    const float x = fp8::E4m3ToFloatFinite(q[i]) * fp8::BitsFloat(bits);
    StoreElem(EngineByte(pieces, num_pieces, b.engine_block, 2 * i),
              shape.bf16 ? fp8::FiniteToBf16(x) : fp8::FloatToFp16(x));
  }
}

// CTAs per block of a launch.
KVTIER_HOST_DEVICE uint32_t Fp8EncodeCtas(const Fp8Shape& shape) {
  return (shape.groups + kCodecThreads - 1) / kCodecThreads;
}
KVTIER_HOST_DEVICE uint32_t Fp8DecodeCtas(const Fp8Shape& shape) {
  const uint64_t per_cta = uint64_t{kCodecThreads} * kDecodeElems;
  return static_cast<uint32_t>((shape.elems + per_cta - 1) / per_cta);
}

}  // namespace kvtier::cuda::detail
