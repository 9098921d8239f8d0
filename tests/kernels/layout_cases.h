// Test cases for code that copies blocks between an engine's paged KV cache
// and kvtier's canonical slots (the CPU reference in kernels/copy_reference.h,
// the CUDA kernels): named engine layouts and a seeded random generator.
//
// Each CopyCase describes one engine cache twice: as placements (what the code
// under test reads) and as `locate`, the engine tensor's own index formula,
// from which SlotByteSources computes the expected bytes without going
// through KvCacheLayout. The two are written independently, so a wrong helper
// or a wrong copy shows up as a mismatch.
//
// Test-only, header-only (inline functions); thread-compatible.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/kv_cache_layout.h"
#include "common/layout.h"
#include "kernels/copy_reference.h"

namespace kvtier::layout_cases {

enum class Part { kK, kV, kScale };  // kK is also the latent of an MLA layout

// A byte (or the start of a row) of the engine cache.
struct Loc {
  uint32_t region = 0;
  uint64_t offset = 0;
};

struct CopyCase {
  std::string description;  // for failure messages
  LayoutSpec spec;
  uint32_t num_blocks = 0;
  std::function<std::vector<Placement>(const Layout&, uint32_t num_blocks)> placements;
  std::vector<uint64_t> region_sizes;
  // Start of row (t, h) of `part` of `layer` of engine block `block`; for
  // Part::kScale, the start of the scale bytes (t = h = 0).
  std::function<Loc(uint32_t layer, Part part, uint32_t block, uint32_t t, uint32_t h)> locate;
  // At least one piece is strided (KvCacheLayout::PieceIsContiguous is false),
  // so the row-by-row path runs.
  bool has_strided_piece = false;
};

// The case's layout validated by KvCacheLayout::Create; an error means the
// case itself is wrong.
inline Result<KvCacheLayout> MakeKvCacheLayout(const CopyCase& c) {
  Result<Layout> layout = Layout::Create(c.spec);
  if (!layout.has_value()) return Err(layout.error());
  return KvCacheLayout::Create(*layout, c.num_blocks, c.placements(*layout, c.num_blocks),
                               c.region_sizes);
}

// splitmix64: a fixed pseudo-random stream, so failures reproduce from the
// seed alone, on any machine.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}

  uint64_t Next() {
    state_ += 0x9e3779b97f4a7c15;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9;
    z = (z ^ (z >> 27)) * 0x94d049bb133111eb;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi] (the modulo bias is irrelevant for tests).
  uint64_t Between(uint64_t lo, uint64_t hi) { return lo + Next() % (hi - lo + 1); }
  bool OneIn(uint64_t n) { return Next() % n == 0; }
  template <typename T>
  T Pick(const std::vector<T>& values) {
    return values[Next() % values.size()];
  }

 private:
  uint64_t state_;
};

// Pseudo-random bytes from `seed`, eight per number: tests fill megabytes of
// them in debug builds.
inline void FillPattern(std::vector<uint8_t>& bytes, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = 0; i < bytes.size(); i += 8) {
    const uint64_t word = rng.Next();
    std::memcpy(bytes.data() + i, &word, std::min<size_t>(8, bytes.size() - i));
  }
}

// Index of the first differing byte of the first n, or nullopt; keeps failure
// output short. memcmp first, since nearly every call finds no difference.
inline std::optional<size_t> FirstDifference(const std::vector<uint8_t>& a,
                                             const std::vector<uint8_t>& b, size_t n) {
  if (n == 0 || std::memcmp(a.data(), b.data(), n) == 0) return std::nullopt;
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return i;
  }
  return std::nullopt;
}

// The engine byte each slot byte of `block` comes from, in canonical order,
// by plain nested loops over the case's index formula.
inline std::vector<Loc> SlotByteSources(const CopyCase& c, uint32_t block) {
  const LayoutSpec& s = c.spec;
  const uint64_t row_bytes = uint64_t{s.head_dim} * DTypeSizeBytes(s.dtype);
  std::vector<Part> parts = {Part::kK};
  if (s.kv_kind == KvKind::kSeparateKv) parts.push_back(Part::kV);
  std::vector<Loc> sources;
  sources.reserve(s.num_layers * (parts.size() * s.block_tokens * s.num_kv_heads * row_bytes +
                                  s.scale_bytes_per_layer));
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

// The engine's registered memory, owned by the test. Not movable: `bases`
// points into `regions`.
struct Cache {
  std::vector<std::vector<uint8_t>> regions;
  std::vector<uint8_t*> bases;

  explicit Cache(const std::vector<uint64_t>& sizes) {
    for (uint64_t size : sizes) regions.emplace_back(size, 0);
    for (std::vector<uint8_t>& r : regions) bases.push_back(r.data());
  }
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;

  MappedRegions Mapped() const { return MappedRegions{bases}; }
  uint8_t& At(const Loc& loc) { return regions[loc.region][loc.offset]; }
  // Region r gets FillPattern(seed + r), so regions differ from each other.
  void Fill(uint64_t seed) {
    for (size_t r = 0; r < regions.size(); ++r) FillPattern(regions[r], seed + r);
  }
};

// ---------------------------------------------------------------------------
// Named cases: one per engine layout, with fixed small shapes.

inline LayoutSpec KvSpec(DType dtype, uint32_t scale_bytes = 0) {
  return LayoutSpec{.model_id = "test/kv",
                    .num_layers = 3,
                    .kv_kind = KvKind::kSeparateKv,
                    .num_kv_heads = 2,
                    .head_dim = 8,
                    .dtype = dtype,
                    .block_tokens = 4,
                    .scale_bytes_per_layer = scale_bytes};
}

inline LayoutSpec LatentSpec(DType dtype, uint32_t scale_bytes = 0) {
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
inline uint64_t KvIndex(Part part) { return part == Part::kV ? 1 : 0; }

// vLLM's default: per layer [2, num_blocks, tokens, heads, head_dim].
inline CopyCase VllmNhdCase() {
  CopyCase c;
  c.description = "vLLM NHD";
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

// vLLM's HND: per layer [2, num_blocks, heads, tokens, head_dim], registered
// with a few bytes past each tensor.
inline CopyCase VllmHndCase() {
  CopyCase c;
  c.description = "vLLM HND";
  c.spec = KvSpec(DType::kBf16);
  c.num_blocks = 5;
  constexpr uint64_t N = 5, T = 4, H = 2, D = 8, E = 2, kPad = 24;
  c.placements = KvCacheLayout::VllmHnd;
  c.region_sizes = std::vector<uint64_t>(3, 2 * N * T * H * D * E + kPad);
  c.locate = [](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
    return Loc{layer, (((KvIndex(part) * N + b) * H + h) * T + t) * D * E};
  };
  c.has_strided_piece = true;
  return c;
}

// MLA through vLLM: per layer [num_blocks, tokens, head_dim].
inline CopyCase LatentCase() {
  CopyCase c;
  c.description = "vLLM latent";
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
inline CopyCase Fp8WithScaleCase() {
  CopyCase c;
  c.description = "fp8 vLLM NHD with a scale region";
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

// A hand-made layer-first pool that no helper produces: one region per layer,
// a reserved 64-byte page, then K of all blocks, a gap, then V of all blocks;
// blocks padded to a pitch larger than the tensor.
inline CopyCase LayerFirstCase() {
  CopyCase c;
  c.description = "padded layer-first";
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

// SGLang's device pool: K and V of each layer in tensors of their own,
// [num_blocks * tokens, heads, head_dim]; K of layer i in region 2i.
inline CopyCase SglangLayerFirstCase() {
  CopyCase c;
  c.description = "SGLang layer-first";
  c.spec = KvSpec(DType::kFp16);
  c.num_blocks = 4;
  constexpr uint64_t N = 4, T = 4, H = 2, D = 8, E = 2;
  c.placements = KvCacheLayout::SglangLayerFirst;
  c.region_sizes = std::vector<uint64_t>(6, N * T * H * D * E);
  c.locate = [](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
    const uint64_t token = b * T + t;
    return Loc{static_cast<uint32_t>(2 * layer + KvIndex(part)), (token * H + h) * D * E};
  };
  return c;
}

// A hand-made page-first pool: one region; block b holds all layers, each
// layer padded, and inside a layer each token's K and V rows are adjacent, so
// K and V are both strided.
inline CopyCase PageFirstCase() {
  CopyCase c;
  c.description = "padded page-first, K and V interleaved";
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

// SGLang HiCache's token-major host layout ("page_first") [2, num_blocks *
// tokens, layers, heads, head_dim]: the layers of one token are adjacent, so
// every piece is strided.
inline CopyCase TokenMajorCase() {
  CopyCase c;
  c.description = "SGLang page-first (token-major)";
  c.spec = KvSpec(DType::kFp32);
  c.num_blocks = 3;
  constexpr uint64_t N = 3, T = 4, H = 2, D = 8, E = 4, L = 3;
  c.placements = KvCacheLayout::SglangPageFirst;
  c.region_sizes = {2 * N * T * L * H * D * E};
  c.locate = [](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
    return Loc{0, ((((KvIndex(part) * N + b) * T + t) * L + layer) * H + h) * D * E};
  };
  c.has_strided_piece = true;
  return c;
}

// The same for MLA: [num_blocks * tokens, layers, 1, head_dim], fp8 without
// scales.
inline CopyCase TokenMajorLatentCase() {
  CopyCase c;
  c.description = "SGLang page-first latent";
  c.spec = LatentSpec(DType::kFp8E5M2);
  c.num_blocks = 3;
  constexpr uint64_t N = 3, T = 4, D = 576, L = 2;
  c.placements = KvCacheLayout::SglangPageFirst;
  c.region_sizes = {N * T * L * D};
  c.locate = [](uint32_t layer, Part, uint32_t b, uint32_t t, uint32_t) {
    return Loc{0, ((b * T + t) * L + layer) * D};
  };
  c.has_strided_piece = true;
  return c;
}

// KvCacheLayout::Contiguous for a DeepSeek-like fp8 latent with a scale.
inline CopyCase ContiguousLatentCase() {
  CopyCase c;
  c.description = "contiguous fp8 latent with scales";
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
inline CopyCase ContiguousKvCase() {
  CopyCase c;
  c.description = "contiguous K and V";
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

struct NamedCase {
  std::string name;  // a valid gtest parameter name
  CopyCase (*make)();
};

inline void PrintTo(const NamedCase& named, std::ostream* os) { *os << named.name; }

// Every named case, for INSTANTIATE_TEST_SUITE_P(..., ValuesIn(NamedCases())).
inline std::vector<NamedCase> NamedCases() {
  return {{"VllmNhd", VllmNhdCase},
          {"VllmHnd", VllmHndCase},
          {"Latent", LatentCase},
          {"Fp8WithScale", Fp8WithScaleCase},
          {"LayerFirst", LayerFirstCase},
          {"SglangLayerFirst", SglangLayerFirstCase},
          {"PageFirst", PageFirstCase},
          {"TokenMajor", TokenMajorCase},
          {"TokenMajorLatent", TokenMajorLatentCase},
          {"ContiguousLatent", ContiguousLatentCase},
          {"ContiguousKv", ContiguousKvCase}};
}

// ---------------------------------------------------------------------------
// Random cases.

namespace internal {

// The case's dimensions, named like the tensor dimensions they are: blocks,
// K/V parts (2, or 1 for a latent), layers, tokens, heads, head_dim, dtype
// bytes, scale bytes per layer.
struct Dims {
  uint64_t N, P, L, T, H, D, E, S;
};

// Where the scales of the non-contiguous layouts live: region `region`,
// from byte `base`, one `pitch` (>= S) per (layer, block), ordered
// [layer][block] or, block_major, [block][layer].
struct ScaleRegion {
  uint32_t region = 0;
  uint64_t base = 0;
  uint64_t pitch = 0;
  bool block_major = false;

  uint64_t Offset(const Dims& x, uint64_t layer, uint64_t b) const {
    return base + (block_major ? b * x.L + layer : layer * x.N + b) * pitch;
  }
  Placement PlacementOf(const Dims& x, uint64_t layer) const {
    return block_major ? Placement{region, base + layer * pitch, x.L * pitch, 0, 0}
                       : Placement{region, base + layer * x.N * pitch, pitch, 0, 0};
  }
  uint64_t Bytes(const Dims& x) const { return base + x.L * x.N * pitch; }
  std::string ToString() const {
    return "scales in region " + std::to_string(region) + " from " + std::to_string(base) +
           ", pitch " + std::to_string(pitch) +
           (block_major ? ", [block][layer]" : ", [layer][block]");
  }
};

inline ScaleRegion RandomScaleRegion(Rng& rng, const Dims& x, uint32_t region) {
  return ScaleRegion{.region = region,
                     .base = rng.OneIn(2) ? 0 : rng.Between(1, 64),
                     .pitch = x.S + (rng.OneIn(2) ? 0 : rng.Between(1, 24)),
                     .block_major = rng.OneIn(2)};
}

// An engine helper's K/V placements with each layer's scale piece from
// `scale` inserted after it (the helpers themselves refuse scales).
inline std::vector<Placement> WithScales(const Layout& layout, uint32_t num_blocks,
                                         std::vector<Placement> (*helper)(const Layout&, uint32_t),
                                         const Dims& x, const ScaleRegion& scale) {
  LayoutSpec kv_only = layout.spec();
  kv_only.scale_bytes_per_layer = 0;
  const Result<Layout> kv_layout = Layout::Create(kv_only);
  KVTIER_CHECK(kv_layout.has_value());
  const std::vector<Placement> kv = helper(*kv_layout, num_blocks);
  std::vector<Placement> placements;
  for (uint64_t layer = 0; layer < x.L; ++layer) {
    for (uint64_t part = 0; part < x.P; ++part) placements.push_back(kv[layer * x.P + part]);
    placements.push_back(scale.PlacementOf(x, layer));
  }
  return placements;
}

enum class Engine { kVllmNhd, kVllmHnd, kSglangLayerFirst, kSglangPageFirst, kContiguous, kPadded };

// How the padded layout spreads its tensors over regions.
enum class Arrangement {
  kRegionPerTensor,  // (layer, part) in region layer * P + part
  kRegionPerLayer,   // K of all blocks, a gap, V of all blocks
  kOneRegion,        // block b holds every (layer, part) tensor, each padded
};

// An engine layout from the KvCacheLayout helpers, with `locate` written from
// the engine tensor's shape.
inline void SetEngineLayout(Rng& rng, Engine engine, const Dims& x, CopyCase& c) {
  static constexpr std::vector<Placement> (*kHelpers[])(const Layout&, uint32_t) = {
      KvCacheLayout::VllmNhd, KvCacheLayout::VllmHnd, KvCacheLayout::SglangLayerFirst,
      KvCacheLayout::SglangPageFirst};
  static constexpr const char* kNames[] = {"vLLM NHD", "vLLM HND", "SGLang layer-first",
                                           "SGLang page-first"};
  const auto helper = kHelpers[static_cast<int>(engine)];
  c.description = kNames[static_cast<int>(engine)];

  const uint64_t tensor_bytes = x.N * x.T * x.H * x.D * x.E;  // one part of one layer
  std::function<Loc(uint32_t, Part, uint32_t, uint32_t, uint32_t)> kv_locate;
  switch (engine) {
    case Engine::kVllmNhd:
      c.region_sizes.assign(x.L, x.P * tensor_bytes);
      kv_locate = [x](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
        return Loc{layer, ((((KvIndex(part) * x.N + b) * x.T + t) * x.H + h) * x.D) * x.E};
      };
      break;
    case Engine::kVllmHnd:
      c.region_sizes.assign(x.L, x.P * tensor_bytes);
      kv_locate = [x](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
        return Loc{layer, ((((KvIndex(part) * x.N + b) * x.H + h) * x.T + t) * x.D) * x.E};
      };
      c.has_strided_piece = x.H > 1 && x.T > 1;
      break;
    case Engine::kSglangLayerFirst:
      c.region_sizes.assign(x.L * x.P, tensor_bytes);
      kv_locate = [x](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
        const uint64_t token = b * x.T + t;
        return Loc{static_cast<uint32_t>(layer * x.P + KvIndex(part)),
                   ((token * x.H + h) * x.D) * x.E};
      };
      break;
    default:  // Engine::kSglangPageFirst
      c.region_sizes.assign(1, x.P * x.L * tensor_bytes);
      kv_locate = [x](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
        const uint64_t token = b * x.T + t;
        return Loc{0,
                   ((((KvIndex(part) * x.N * x.T + token) * x.L + layer) * x.H + h) * x.D) * x.E};
      };
      c.has_strided_piece = x.L > 1 && x.T > 1;
      break;
  }
  // Engines often register more than the tensor (an allocator's rounding).
  for (uint64_t& size : c.region_sizes) size += rng.OneIn(2) ? 0 : rng.Between(1, 64);

  if (x.S == 0) {
    c.placements = helper;
    c.locate = kv_locate;
    return;
  }
  const ScaleRegion scale = RandomScaleRegion(rng, x, static_cast<uint32_t>(c.region_sizes.size()));
  c.region_sizes.push_back(scale.Bytes(x) + rng.Between(0, 16));
  c.description += ", " + scale.ToString();
  c.placements = [helper, x, scale](const Layout& layout, uint32_t num_blocks) {
    return WithScales(layout, num_blocks, helper, x, scale);
  };
  c.locate = [x, scale, kv_locate](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
    if (part == Part::kScale) return Loc{scale.region, scale.Offset(x, layer, b)};
    return kv_locate(layer, part, b, t, h);
  };
}

// KvCacheLayout::Contiguous: [block][layer]{K, V, scale}.
inline void SetContiguousLayout(const Dims& x, CopyCase& c) {
  c.description = "contiguous";
  const uint64_t tensor = x.T * x.H * x.D * x.E;
  const uint64_t layer_bytes = x.P * tensor + x.S;
  c.placements = [](const Layout& layout, uint32_t) { return KvCacheLayout::Contiguous(layout); };
  c.region_sizes = {x.N * x.L * layer_bytes};
  c.locate = [x, tensor, layer_bytes](uint32_t layer, Part part, uint32_t b, uint32_t t,
                                      uint32_t h) {
    const uint64_t base = (b * x.L + layer) * layer_bytes;
    if (part == Part::kScale) return Loc{0, base + x.P * tensor};
    return Loc{0, base + KvIndex(part) * tensor + (t * x.H + h) * x.D * x.E};
  };
}

// Every tensor is a view of a padded one: rows of Dp >= D elements, Hp >= H
// heads and Tp >= T tokens, in NHD or HND order, blocks padded further, at
// random byte offsets in regions spread by `Arrangement`. What an engine gets
// by slicing a bigger tensor (a TP shard of the heads, a head_dim padded for
// alignment). `locate` is the padded tensor's index formula; the placements
// are its byte strides.
inline void SetPaddedLayout(Rng& rng, const Dims& x, CopyCase& c) {
  const bool hnd = rng.OneIn(2);
  const uint64_t Tp = x.T + (rng.OneIn(2) ? 0 : rng.Between(1, 3));
  const uint64_t Hp = x.H + (rng.OneIn(2) ? 0 : rng.Between(1, 3));
  const uint64_t Dp = x.D + (rng.OneIn(2) ? 0 : rng.Between(1, 9));
  const uint64_t tensor = Tp * Hp * Dp;  // elements of one block's padded tensor
  const uint64_t tensor_pitch = tensor + (rng.OneIn(2) ? 0 : rng.Between(1, 40));
  const Arrangement arrangement = rng.Pick(std::vector<Arrangement>{
      Arrangement::kRegionPerTensor, Arrangement::kRegionPerLayer, Arrangement::kOneRegion});
  // Byte offsets: unaligned, element-aligned or 16-byte aligned, so copies of
  // every alignment run.
  const uint64_t granule = rng.Pick(std::vector<uint64_t>{1, x.E, 16});
  const uint64_t gap = rng.OneIn(2) ? 0 : rng.Between(1, 20);  // elements, kRegionPerLayer
  uint64_t block_pitch = tensor_pitch;                         // elements
  uint32_t kv_regions = 0;
  switch (arrangement) {
    case Arrangement::kRegionPerTensor:
      kv_regions = static_cast<uint32_t>(x.L * x.P);
      break;
    case Arrangement::kRegionPerLayer:
      kv_regions = static_cast<uint32_t>(x.L);
      break;
    case Arrangement::kOneRegion:
      kv_regions = 1;
      block_pitch = x.L * x.P * tensor_pitch + (rng.OneIn(2) ? 0 : rng.Between(1, 40));
      break;
  }
  std::vector<uint64_t> starts;  // byte offset of each KV region's first tensor
  for (uint32_t r = 0; r < kv_regions; ++r) starts.push_back(granule * rng.Between(0, 8));

  // Start of the (layer, part) tensor of block 0, in elements past its
  // region's start, and its region.
  auto tensor_origin = [=](uint64_t layer, uint64_t part) -> std::pair<uint32_t, uint64_t> {
    switch (arrangement) {
      case Arrangement::kRegionPerTensor:
        return {static_cast<uint32_t>(layer * x.P + part), 0};
      case Arrangement::kRegionPerLayer:
        return {static_cast<uint32_t>(layer), part * (x.N * block_pitch + gap)};
      case Arrangement::kOneRegion:
        break;
    }
    return {0, (layer * x.P + part) * tensor_pitch};
  };
  for (uint32_t r = 0; r < kv_regions; ++r) {
    // Every region's last tensor ends within N * block_pitch elements of its
    // origin, and kRegionPerLayer adds V after K and the gap.
    const uint64_t parts = arrangement == Arrangement::kRegionPerLayer ? x.P : 1;
    const uint64_t elements = parts * x.N * block_pitch + (parts - 1) * gap;
    c.region_sizes.push_back(starts[r] + elements * x.E + rng.Between(0, 16));
  }

  c.description =
      std::string("padded ") + (hnd ? "HND" : "NHD") +
      (arrangement == Arrangement::kRegionPerTensor  ? ", a region per tensor"
       : arrangement == Arrangement::kRegionPerLayer ? ", a region per layer"
                                                     : ", one region") +
      ", T+" + std::to_string(Tp - x.T) + " H+" + std::to_string(Hp - x.H) + " D+" +
      std::to_string(Dp - x.D) + ", pitches (elements) tensor " + std::to_string(tensor_pitch) +
      " block " + std::to_string(block_pitch) +
      (arrangement == Arrangement::kRegionPerLayer ? " gap " + std::to_string(gap) : "") +
      ", offsets in " + std::to_string(granule) + "-byte steps";

  // A piece is contiguous when its head stride is one row (or there is one
  // head) and its token stride H rows (or there is one token).
  const uint64_t head_stride = hnd ? Tp * Dp : Dp;  // elements
  const uint64_t token_stride = hnd ? Dp : Hp * Dp;
  c.has_strided_piece = (x.H > 1 && head_stride != x.D) || (x.T > 1 && token_stride != x.H * x.D);

  std::optional<ScaleRegion> scale;
  if (x.S > 0) {
    scale = RandomScaleRegion(rng, x, kv_regions);
    c.region_sizes.push_back(scale->Bytes(x) + rng.Between(0, 16));
    c.description += ", " + scale->ToString();
  }

  c.placements = [=](const Layout&, uint32_t) {
    std::vector<Placement> placements;
    for (uint64_t layer = 0; layer < x.L; ++layer) {
      for (uint64_t part = 0; part < x.P; ++part) {
        const auto [region, origin] = tensor_origin(layer, part);
        placements.push_back(Placement{.region = region,
                                       .offset_bytes = starts[region] + origin * x.E,
                                       .block_stride_bytes = block_pitch * x.E,
                                       .token_stride_bytes = token_stride * x.E,
                                       .head_stride_bytes = head_stride * x.E});
      }
      if (scale.has_value()) placements.push_back(scale->PlacementOf(x, layer));
    }
    return placements;
  };
  c.locate = [=](uint32_t layer, Part part, uint32_t b, uint32_t t, uint32_t h) {
    if (part == Part::kScale) return Loc{scale->region, scale->Offset(x, layer, b)};
    const auto [region, origin] = tensor_origin(layer, KvIndex(part));
    const uint64_t row = hnd ? h * Tp + t : t * Hp + h;
    return Loc{region, starts[region] + (origin + b * block_pitch + row * Dp) * x.E};
  };
}

}  // namespace internal

// Bounds on a random case, so that hundreds of them run in seconds.
inline constexpr uint64_t kMaxRandomBlockBytes = 256 << 10;
inline constexpr uint64_t kMaxRandomCaseBytes = 4 << 20;  // all regions together

// A random engine cache, the same for the same seed: separate K and V or a
// latent; any dtype, with a scale region (1..40 bytes per layer) half of the
// time for fp8; 1..6 layers, 1..8 heads, head_dim from {8, 16, 24, 64, 72,
// 128} (or 576 for a latent), 1..32 tokens, with one head, one token and one
// block each more likely than uniform; laid out as vLLM NHD or HND, SGLang
// layer-first or page-first (scales, if any, in a random region of their
// own), contiguous, or padded (see SetPaddedLayout). Draws again until the
// case fits kMaxRandomBlockBytes and kMaxRandomCaseBytes.
inline CopyCase RandomCase(uint64_t seed) {
  using internal::Engine;
  Rng rng(seed);
  for (;;) {
    CopyCase c;
    LayoutSpec& s = c.spec;
    s.model_id = "test/random";
    s.kv_kind = rng.OneIn(3) ? KvKind::kLatent : KvKind::kSeparateKv;
    const bool latent = s.kv_kind == KvKind::kLatent;
    s.dtype = rng.Pick(std::vector<DType>{DType::kFp16, DType::kBf16, DType::kFp32, DType::kFp8E4M3,
                                          DType::kFp8E5M2});
    s.num_layers = static_cast<uint32_t>(rng.Between(1, 6));
    s.num_kv_heads = latent || rng.OneIn(6) ? 1 : static_cast<uint32_t>(rng.Between(1, 8));
    std::vector<uint32_t> head_dims = {8, 16, 24, 64, 72, 128};
    if (latent) head_dims.push_back(576);
    s.head_dim = rng.Pick(head_dims);
    s.block_tokens = rng.OneIn(6) ? 1 : static_cast<uint32_t>(rng.Between(1, 32));
    const bool fp8 = s.dtype == DType::kFp8E4M3 || s.dtype == DType::kFp8E5M2;
    s.scale_bytes_per_layer = fp8 && rng.OneIn(2) ? static_cast<uint32_t>(rng.Between(1, 40)) : 0;
    c.num_blocks = rng.OneIn(8) ? 1 : static_cast<uint32_t>(rng.Between(2, 8));

    const internal::Dims x{.N = c.num_blocks,
                           .P = latent ? 1u : 2u,
                           .L = s.num_layers,
                           .T = s.block_tokens,
                           .H = s.num_kv_heads,
                           .D = s.head_dim,
                           .E = DTypeSizeBytes(s.dtype),
                           .S = s.scale_bytes_per_layer};
    const uint64_t block_bytes = x.L * (x.P * x.T * x.H * x.D * x.E + x.S);
    if (block_bytes > kMaxRandomBlockBytes) continue;

    const auto engine = static_cast<Engine>(rng.Between(0, 5));
    if (engine == Engine::kContiguous) {
      internal::SetContiguousLayout(x, c);
    } else if (engine == Engine::kPadded) {
      internal::SetPaddedLayout(rng, x, c);
    } else {
      internal::SetEngineLayout(rng, engine, x, c);
    }
    uint64_t total = 0;
    for (uint64_t size : c.region_sizes) total += size;
    if (total > kMaxRandomCaseBytes) continue;

    c.description += "; " + std::string(KvKindName(s.kv_kind)) + " " +
                     std::string(DTypeName(s.dtype)) + " layers=" + std::to_string(x.L) +
                     " heads=" + std::to_string(x.H) + " head_dim=" + std::to_string(x.D) +
                     " block_tokens=" + std::to_string(x.T) +
                     " scale_bytes=" + std::to_string(x.S) + " blocks=" + std::to_string(x.N);
    return c;
  }
}

}  // namespace kvtier::layout_cases
