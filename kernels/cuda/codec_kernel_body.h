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
// Grid: x = tile (encode) or run of kCodecThreads * kCodecElems elements
// (decode), y = block of the launch; kCodecThreads threads.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>

#include "kernels/copy_plan.h"
#include "kernels/fp8_e4m3.h"
#include "kernels/host_device.h"

#if defined(__CUDACC__)
#include <vector_types.h>  // uint2, uint4: the GPU's vector accesses (device code only)
#endif


namespace kvtier::cuda::detail {

inline constexpr uint32_t kCodecThreads = 256;

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

// The engine address of byte `offset` of engine block `block`'s slot image,
// and in *row_left how many bytes from there on are contiguous in the
// engine (the rest of its row). The pieces are in slot order (CopyPlan):
// the last that starts at or before `offset` holds it.
KVTIER_HOST_DEVICE uint8_t* EngineSpan(const CopyPiece* pieces, uint32_t num_pieces, uint32_t block, uint64_t offset,
                                       uint64_t* row_left) {
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
  const uint64_t col = d - row * p.row_bytes;
  *row_left = p.row_bytes - col;
  return reinterpret_cast<uint8_t*>(p.engine + uint64_t{block} * p.block_stride + o * p.outer_stride +
                                    i * p.inner_stride + col);
}

KVTIER_HOST_DEVICE uint16_t LoadElem(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
KVTIER_HOST_DEVICE void StoreElem(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}

// A run of at most kCodecElems consecutive elements of a block, as one
// thread reads or writes them: one lookup in the plan for the run when it
// lies in one row of the engine (it nearly always does), one 16-byte access
// when it is also whole and aligned.
inline constexpr uint32_t kCodecElems = 8;

KVTIER_HOST_DEVICE void LoadRun(const CopyPiece* pieces, uint32_t num_pieces, uint32_t block, uint64_t first,
                                uint32_t n, uint16_t* out) {
  uint64_t left = 0;
  const uint8_t* p = EngineSpan(pieces, num_pieces, block, 2 * first, &left);
  if (left >= 2 * uint64_t{n}) {
#if defined(__CUDA_ARCH__)
    if (n == kCodecElems && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
      const uint4 v = *reinterpret_cast<const uint4*>(p);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (uint32_t k = 0; k < 4; ++k) {
        out[2 * k] = static_cast<uint16_t>(w[k]);
        out[2 * k + 1] = static_cast<uint16_t>(w[k] >> 16);
      }
      return;
    }
#endif
    for (uint32_t k = 0; k < n; ++k) out[k] = LoadElem(p + 2 * k);
    return;
  }
  for (uint32_t k = 0; k < n; ++k) out[k] = LoadElem(EngineSpan(pieces, num_pieces, block, 2 * (first + k), &left));
}

KVTIER_HOST_DEVICE void StoreRun(const CopyPiece* pieces, uint32_t num_pieces, uint32_t block, uint64_t first,
                                 uint32_t n, const uint16_t* in) {
  uint64_t left = 0;
  uint8_t* p = EngineSpan(pieces, num_pieces, block, 2 * first, &left);
  if (left >= 2 * uint64_t{n}) {
#if defined(__CUDA_ARCH__)
    if (n == kCodecElems && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
      uint4 v;
      v.x = in[0] | (uint32_t{in[1]} << 16);
      v.y = in[2] | (uint32_t{in[3]} << 16);
      v.z = in[4] | (uint32_t{in[5]} << 16);
      v.w = in[6] | (uint32_t{in[7]} << 16);
      *reinterpret_cast<uint4*>(p) = v;
      return;
    }
#endif
    for (uint32_t k = 0; k < n; ++k) StoreElem(p + 2 * k, in[k]);
    return;
  }
  for (uint32_t k = 0; k < n; ++k) StoreElem(EngineSpan(pieces, num_pieces, block, 2 * (first + k), &left), in[k]);
}

// Writes n bytes at `dst` (host-mapped memory, most likely): one 8-byte
// store when whole and aligned, so that a warp writes whole lines.
KVTIER_HOST_DEVICE void StoreBytes(uint8_t* dst, const uint8_t* src, uint32_t n) {
#if defined(__CUDA_ARCH__)
  if (n == kCodecElems && (reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
    uint2 v;
    v.x = src[0] | (uint32_t{src[1]} << 8) | (uint32_t{src[2]} << 16) | (uint32_t{src[3]} << 24);
    v.y = src[4] | (uint32_t{src[5]} << 8) | (uint32_t{src[6]} << 16) | (uint32_t{src[7]} << 24);
    *reinterpret_cast<uint2*>(dst) = v;
    return;
  }
#endif
  for (uint32_t k = 0; k < n; ++k) dst[k] = src[k];
}

// The largest of *p and v, in a CTA's shared memory (an atomic on the GPU;
// the CPU emulation runs one thread at a time).
KVTIER_HOST_DEVICE void SharedMax(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
  atomicMax(p, v);
#else
  *p = *p > v ? *p : v;
#endif
}

// Encode: a CTA codes a tile of whole groups of one block, in two phases
// separated by a barrier. Phase 1: each thread reads runs of kCodecElems
// elements, kCodecThreads runs apart (a warp reads contiguous bytes), flags
// a NaN or an Inf, and folds each group's largest magnitude into the tile's
// shared `amax` (one word per group). Phase 2: the groups' scales, then each
// thread reads its runs again (from L2) and writes their codes, so that a
// warp writes 256 contiguous bytes of the slot: host memory is written in
// whole lines, not one byte per thread per group.
inline constexpr uint32_t kEncodeTileElems = kCodecThreads * kCodecElems;

// Groups per tile (at least one; a group longer than a tile is a tile).
KVTIER_HOST_DEVICE uint32_t Fp8TileGroups(const Fp8Shape& shape) {
  const uint32_t g = kEncodeTileElems / shape.group_elems;
  return g == 0 ? 1 : g;
}
// The shared words a tile needs: one per group, at most this many.
inline constexpr uint32_t kEncodeMaxTileGroups = kEncodeTileElems;

// Tile `cta_x`'s groups [g0, g1) and elements [e0, e1).
struct Fp8Tile {
  uint64_t g0, g1, e0, e1;
};
KVTIER_HOST_DEVICE Fp8Tile TileOf(const Fp8Shape& shape, uint32_t cta_x) {
  const uint64_t per = Fp8TileGroups(shape);
  const uint64_t g0 = uint64_t{cta_x} * per;
  const uint64_t g1 = g0 + per < shape.groups ? g0 + per : shape.groups;
  const uint64_t e1 = g1 * shape.group_elems;
  return {g0, g1, g0 * shape.group_elems, e1 < shape.elems ? e1 : shape.elems};
}

// Calls fn(first, n, elements) for each of thread `thread`'s runs of tile
// `t`: kCodecElems elements each (fewer at the tile's end), kCodecThreads
// runs apart, so that a warp reads and writes contiguous bytes.
template <typename Fn>
KVTIER_HOST_DEVICE void ForEachRun(const CopyPiece* pieces, uint32_t num_pieces, const CodedBlock& b,
                                   const Fp8Tile& t, uint32_t thread, Fn&& fn) {
  for (uint64_t first = t.e0 + uint64_t{thread} * kCodecElems; first < t.e1;
       first += uint64_t{kCodecThreads} * kCodecElems) {
    const auto n = static_cast<uint32_t>(t.e1 - first < kCodecElems ? t.e1 - first : kCodecElems);
    uint16_t h[kCodecElems];
    LoadRun(pieces, num_pieces, b.engine_block, first, n, h);
    fn(first, n, static_cast<const uint16_t*>(h));
  }
}

// Phase 1 of thread `thread`. `amax`: the tile's shared words, zeroed.
KVTIER_HOST_DEVICE void Fp8EncodeAmax(const CopyPiece* pieces, uint32_t num_pieces, const Fp8Shape& shape,
                                      const CodedBlock& b, uint32_t* special, uint32_t* amax, uint32_t cta_x,
                                      uint32_t thread) {
  const Fp8Tile t = TileOf(shape, cta_x);
  const uint16_t exponent = shape.bf16 ? 0x7f80 : 0x7c00;
  ForEachRun(pieces, num_pieces, b, t, thread, [&](uint64_t first, uint32_t n, const uint16_t* h) {
    // The largest magnitude as an integer maximum of the inputs' bits (finite
    // fp16 and bf16 order as their bits do), as the CPU codec takes it; one
    // shared update per group the run touches.
    uint64_t g = first / shape.group_elems;
    uint64_t next = (g + 1) * shape.group_elems;
    uint32_t m = 0;
    for (uint32_t k = 0; k < n; ++k) {
      if (first + k == next) {
        SharedMax(&amax[g - t.g0], m);
        m = 0;
        ++g;
        next += shape.group_elems;
      }
      if ((h[k] & exponent) == exponent) *special = 1;
      const uint32_t v = h[k] & 0x7fffu;
      m = v > m ? v : m;
    }
    SharedMax(&amax[g - t.g0], m);
  });
}

// A group's coding, as the CPU codec does it: s = amax/448, and the factors
// x is multiplied by. amax below about 2^-119 (bf16 only) makes 448/amax
// pass the largest float: the group is scaled up by 2^64 first, exactly
// (x·1 and x·2^64 are exact, so both give the same bytes).
struct Fp8Group {
  float s, pre, inv;
};
KVTIER_HOST_DEVICE Fp8Group GroupOf(const Fp8Shape& shape, uint32_t amax_bits) {
  const float amax = shape.bf16 ? fp8::Bf16ToFloat(static_cast<uint16_t>(amax_bits))
                                : fp8::Fp16ToFloat(static_cast<uint16_t>(amax_bits));
  const float s = amax / fp8::kE4m3Max;
  const float pre = s != 0 && !(fp8::kE4m3Max / amax <= 3.40282347e38f) ? 0x1p64f : 1.0f;
  return {s, pre, s == 0 ? 0.0f : fp8::kE4m3Max / (amax * pre)};
}

// Phase 2 of thread `thread`, once every thread of the CTA did phase 1.
KVTIER_HOST_DEVICE void Fp8EncodeWrite(const CopyPiece* pieces, uint32_t num_pieces, const Fp8Shape& shape,
                                       const CodedBlock& b, const uint32_t* amax, uint32_t cta_x, uint32_t thread) {
  const Fp8Tile t = TileOf(shape, cta_x);
  for (uint64_t g = t.g0 + thread; g < t.g1; g += kCodecThreads) {
    const uint32_t bits = fp8::FloatBits(GroupOf(shape, amax[g - t.g0]).s);
    uint8_t* dst = b.slot + g * 4;
    for (uint32_t k = 0; k < 4; ++k) dst[k] = static_cast<uint8_t>(bits >> (8 * k));
  }
  uint8_t* q = b.slot + uint64_t{shape.groups} * 4;
  ForEachRun(pieces, num_pieces, b, t, thread, [&](uint64_t first, uint32_t n, const uint16_t* h) {
    uint64_t g = first / shape.group_elems;
    uint64_t next = (g + 1) * shape.group_elems;
    Fp8Group c = GroupOf(shape, amax[g - t.g0]);
    uint8_t codes[kCodecElems];
    for (uint32_t k = 0; k < n; ++k) {
      if (first + k == next) {
        ++g;
        next += shape.group_elems;
        c = GroupOf(shape, amax[g - t.g0]);
      }
      if (c.s == 0) {  // an all-zero group keeps its zeros' signs
        codes[k] = (h[k] & 0x8000) != 0 ? 0x80 : 0x00;
        continue;
      }
      const float x = shape.bf16 ? fp8::Bf16ToFloat(h[k]) : fp8::Fp16ToFloat(h[k]);
      codes[k] = fp8::FloatToE4m3Rounded((x * c.pre) * c.inv);
    }
    StoreBytes(q + first, codes, n);
  });
}

// Group `g`'s scale in a coded slot; *ok: whether it is a finite,
// non-negative number (a coded block's scales are).
KVTIER_HOST_DEVICE float ScaleOf(const uint8_t* slot, uint64_t g, bool* ok) {
  const uint8_t* p = slot + g * 4;
  const uint32_t bits = uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
  *ok = (bits & 0x7f800000u) != 0x7f800000u && bits <= 0x80000000u;
  return fp8::BitsFloat(bits);
}

// Decode: thread `thread` of CTA `cta_x` decodes one run of kCodecElems
// elements of `b` into the engine's pages. A NaN code or a scale that is not
// a finite non-negative number sets *bad (the block is corrupt: not to be
// served; the runs of other threads may have been written).
KVTIER_HOST_DEVICE void Fp8DecodeThread(const CopyPiece* pieces, uint32_t num_pieces, const Fp8Shape& shape,
                                        const CodedBlock& b, uint32_t* bad, uint32_t cta_x, uint32_t thread) {
  const uint64_t first = (uint64_t{cta_x} * kCodecThreads + thread) * kCodecElems;
  if (first >= shape.elems) return;
  const auto n = static_cast<uint32_t>(shape.elems - first < kCodecElems ? shape.elems - first : kCodecElems);
  const uint8_t* q = b.slot + uint64_t{shape.groups} * 4 + first;
  uint8_t codes[kCodecElems];
#if defined(__CUDA_ARCH__)
  if (n == kCodecElems && (reinterpret_cast<uintptr_t>(q) & 7) == 0) {
    const uint2 v = *reinterpret_cast<const uint2*>(q);
#pragma unroll
    for (uint32_t k = 0; k < 4; ++k) {
      codes[k] = static_cast<uint8_t>(v.x >> (8 * k));
      codes[4 + k] = static_cast<uint8_t>(v.y >> (8 * k));
    }
  } else
#endif
  {
    for (uint32_t k = 0; k < n; ++k) codes[k] = q[k];
  }
  uint64_t g = first / shape.group_elems;
  uint64_t next = (g + 1) * shape.group_elems;
  bool ok = true;
  float s = ScaleOf(b.slot, g, &ok);
  bool all_ok = ok;
  uint16_t out[kCodecElems];
  for (uint32_t k = 0; k < n; ++k) {
    if (first + k == next) {
      ++g;
      next += shape.group_elems;
      s = ScaleOf(b.slot, g, &ok);
      all_ok = all_ok && ok;
    }
    all_ok = all_ok && (codes[k] & 0x7f) != 0x7f;
    const float x = fp8::E4m3ToFloatFinite(codes[k]) * s;
    out[k] = shape.bf16 ? fp8::FiniteToBf16(x) : fp8::FloatToFp16(x);
  }
  if (!all_ok) {
    *bad = 1;
    return;
  }
  StoreRun(pieces, num_pieces, b.engine_block, first, n, out);
}

// CTAs per block of a launch.
KVTIER_HOST_DEVICE uint32_t Fp8EncodeCtas(const Fp8Shape& shape) {
  const uint32_t per = Fp8TileGroups(shape);
  return (shape.groups + per - 1) / per;
}
KVTIER_HOST_DEVICE uint32_t Fp8DecodeCtas(const Fp8Shape& shape) {
  const uint64_t per_cta = uint64_t{kCodecThreads} * kCodecElems;
  return static_cast<uint32_t>((shape.elems + per_cta - 1) / per_cta);
}

}  // namespace kvtier::cuda::detail
