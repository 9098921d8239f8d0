// Block codecs for the lower tiers (issue 18; ../shared/notes/compression.md):
// what a block's bytes become in host, disk and remote tiers that hold more
// blocks per byte, and back.
//
//   lossless  2-byte (or 4-byte) elements split into byte planes, then zstd
//             level 1. Bit-exact. Not used (stored raw) when it saves less
//             than 1/64.
//   fp8       LOSSY: E4M3 with one fp32 scale per group of `group_elems`
//             elements (a head's head_dim values of one token, by default),
//             for fp16 and bf16. Per group s = amax/448, q = E4M3(x·448/amax)
//             (round to nearest even, saturating), decoded as q*s rounded to
//             the block's dtype. Each element is within
//             0.0665·|x| + 2^-10·s of its input; zeros and signs are kept and
//             a group's largest element comes back exactly. A block with a
//             NaN or an Inf is not encoded (stored raw).
//
// Encoded layouts: lossless is a zstd frame of the planes; fp8 is the
// groups' scales (fp32, little-endian) followed by one byte per element.
//
// BlockCodec: one thread's codec (its zstd contexts and scratch);
// thread-compatible: a codec pool keeps one per thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "common/key128.h"
#include "common/layout.h"
#include "common/status.h"

namespace kvtier {

// CodecKind, CodecParams, CodecName and ParseCodec: common/layout.h.

// The namespace a layout's blocks belong to under codec `p`: the layout's
// own for none and lossless (bit-exact, so the blocks are the same), and one
// of their own for fp8 (per group size), so that a lossy block is never
// served to an engine that did not opt in. XXH3-128 of "KVTCODC1" ‖
// layout fingerprint ‖ u8 codec ‖ u32 group_elems (docs/hashing.md).
LayoutFingerprint CodedFingerprint(const LayoutFingerprint& layout, const CodecParams& p);

// Whether `p` can encode blocks of its dtype: lossless any dtype of 1, 2 or 4
// bytes; fp8 only fp16 and bf16 with group_elems >= 1. Errors:
// kInvalidArgument saying why (e.g. "fp8 needs fp16 or bf16 KV").
Status CheckCodec(const CodecParams& p);

// Whether every element of `decoded` is within fp8's bound of `raw`'s:
// |x̂ − x| ≤ 0.0665·|x| + 2^-10·s, s its group's amax / 448; for checks of
// what a lossy path served (tests, kvtier-bench). REQUIRES: p.kind is kFp8,
// equal sizes, a whole number of elements.
bool WithinFp8Bound(const CodecParams& p, std::span<const uint8_t> raw, std::span<const uint8_t> decoded);

class BlockCodec;
class CopyPlan;

// Decodes `stored` (what Encode wrote for `p`) into `scratch` (resized to the
// plan's block bytes) and scatters it into engine block `engine_block`: a
// load of a coded block by the CPU (the host backend's copy threads, the
// cuda backend's copies between host memories). Errors as Decode; nothing
// is written into the engine then. REQUIRES: engine_block < the plan's
// num_blocks.
Status DecodeAndScatter(BlockCodec& coder, const CodecParams& p, std::span<const uint8_t> stored,
                        const CopyPlan& plan, uint32_t engine_block, std::vector<uint8_t>& scratch);

// Gathers engine block `engine_block` into `scratch` (resized to the plan's
// block bytes) and encodes it into `out` (at least MaxEncodedBytes): a store
// coded on its way. Returns what Encode returns.
std::optional<size_t> GatherAndEncode(BlockCodec& coder, const CodecParams& p, const CopyPlan& plan,
                                      uint32_t engine_block, std::span<uint8_t> out, std::vector<uint8_t>& scratch);

class BlockCodec {
 public:
  static Result<std::unique_ptr<BlockCodec>> Create();
  ~BlockCodec();
  BlockCodec(const BlockCodec&) = delete;
  BlockCodec& operator=(const BlockCodec&) = delete;

  // The most bytes Encode may write for a block of `raw_bytes`.
  static size_t MaxEncodedBytes(const CodecParams& p, size_t raw_bytes);

  // Encodes `raw` into `out` (at least MaxEncodedBytes) and returns the
  // bytes written, or nullopt when the block is to be stored raw: kNone, a
  // saving under 1/64 (lossless), a NaN or Inf (fp8). REQUIRES:
  // CheckCodec(p) is ok and raw.size() is a whole number of elements.
  std::optional<size_t> Encode(const CodecParams& p, std::span<const uint8_t> raw, std::span<uint8_t> out);

  // Decodes what Encode wrote into `dst` (the raw size). Errors:
  // kCorruption when `stored` does not decode to exactly dst.size() bytes;
  // dst is then not to be served.
  Status Decode(const CodecParams& p, std::span<const uint8_t> stored, std::span<uint8_t> dst);

 private:
  struct Zstd;
  explicit BlockCodec(std::unique_ptr<Zstd> zstd);

  std::unique_ptr<Zstd> zstd_;
  std::vector<uint8_t> planes_;  // scratch: the byte planes
  std::vector<float> floats_;    // scratch: a block in fp32 (fp8)
};

}  // namespace kvtier
