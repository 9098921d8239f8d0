#include "common/kv_cache_layout.h"

#include <algorithm>
#include <array>
#include <string>
#include <string_view>
#include <utility>

#include "common/check.h"

namespace kvtier {
namespace {

enum class PieceKind : uint8_t { kK, kV, kLatent, kScale };

std::string_view PieceKindName(PieceKind kind) {
  switch (kind) {
    case PieceKind::kK:
      return "K";
    case PieceKind::kV:
      return "V";
    case PieceKind::kLatent:
      return "latent";
    case PieceKind::kScale:
      return "scale";
  }
  return "invalid";
}

PieceKind KindOf(const Layout& layout, uint32_t piece) {
  const uint32_t part = piece % KvCacheLayout::PiecesPerLayer(layout);
  if (layout.spec().kv_kind == KvKind::kLatent) {
    return part == 0 ? PieceKind::kLatent : PieceKind::kScale;
  }
  if (part == 0) return PieceKind::kK;
  return part == 1 ? PieceKind::kV : PieceKind::kScale;
}

// One block's piece is tokens x heads rows of row_bytes each. A scale piece is a
// single row, which is why its token and head strides never matter.
struct PieceShape {
  uint64_t row_bytes = 0;
  uint64_t tokens = 0;
  uint64_t heads = 0;
};

// Cannot overflow: Layout::Create bounded every product here by kMaxBlockBytes.
PieceShape ShapeOf(const Layout& layout, uint32_t piece) {
  const LayoutSpec& s = layout.spec();
  if (KindOf(layout, piece) == PieceKind::kScale) {
    return PieceShape{.row_bytes = s.scale_bytes_per_layer, .tokens = 1, .heads = 1};
  }
  return PieceShape{.row_bytes = uint64_t{s.head_dim} * DTypeSizeBytes(s.dtype),
                    .tokens = s.block_tokens,
                    .heads = s.num_kv_heads};
}

// "placement 5 (layer 2 V)", the prefix of every error about one piece.
std::string PieceName(const Layout& layout, uint32_t piece) {
  const uint32_t layer = piece / KvCacheLayout::PiecesPerLayer(layout);
  std::string name = "placement " + std::to_string(piece) + " (layer " + std::to_string(layer);
  name += ' ';
  name += PieceKindName(KindOf(layout, piece));
  name += ')';
  return name;
}

// Bytes from the first row's start to the last row's end of one block's
// piece; false on overflow. A dimension of one element contributes nothing,
// whatever its stride, as in ValidatePiece.
bool PieceExtent(const PieceShape& shape, const Placement& p, uint64_t* extent) {
  uint64_t token_span = 0;
  uint64_t head_span = 0;
  return !(__builtin_mul_overflow(shape.tokens - 1, p.token_stride_bytes, &token_span) ||
           __builtin_mul_overflow(shape.heads - 1, p.head_stride_bytes, &head_span) ||
           __builtin_add_overflow(shape.row_bytes, token_span, extent) ||
           __builtin_add_overflow(*extent, head_span, extent));
}

// One past the last byte of the piece of block num_blocks - 1, given the
// extent of one block's piece; false on overflow. REQUIRES: num_blocks > 0.
bool LastBlockEnd(const Placement& p, uint32_t num_blocks, uint64_t extent, uint64_t* end) {
  return !(__builtin_mul_overflow(uint64_t{num_blocks} - 1, p.block_stride_bytes, end) ||
           __builtin_add_overflow(*end, p.offset_bytes, end) ||
           __builtin_add_overflow(*end, extent, end));
}

// The K and V (or latent) placements of every layer, in piece order, from
// place(layer, part) with part 0 for K or the latent and 1 for V. Shared by
// the engine helpers, none of which has a scale region.
template <typename PlaceFn>
std::vector<Placement> KvPlacements(const Layout& layout, std::string_view engine, PlaceFn place) {
  const LayoutSpec& s = layout.spec();
  KVTIER_CHECK_MSG(s.scale_bytes_per_layer == 0,
                   std::string(engine) + "'s KV tensors hold no fp8 scale region");
  const uint32_t parts = s.kv_kind == KvKind::kSeparateKv ? 2 : 1;
  std::vector<Placement> placements;
  placements.reserve(uint64_t{s.num_layers} * parts);
  for (uint32_t layer = 0; layer < s.num_layers; ++layer) {
    for (uint32_t part = 0; part < parts; ++part) placements.push_back(place(layer, part));
  }
  return placements;
}

// Checks one piece against its region; returns the error without the piece
// name, which the caller adds. Every quantity comes from the client, so every
// sum and product is overflow-checked.
Status ValidatePiece(const PieceShape& shape, const Placement& p, uint32_t num_blocks,
                     const std::vector<uint64_t>& region_sizes_bytes) {
  if (p.region >= region_sizes_bytes.size()) {
    return InvalidArgument("region " + std::to_string(p.region) + " out of range (" +
                           std::to_string(region_sizes_bytes.size()) + " regions registered)");
  }

  // Rows are disjoint, within a block and across blocks, if, taking the
  // dimensions from the smallest stride to the largest, each stride steps
  // over everything nested inside it. This is sufficient, not necessary, but
  // every engine layout we know nests its dimensions (NHD, HND, token-major
  // pools, and vLLM's head-outer LHBNC, where blocks nest inside heads). A
  // dimension of one element places a single row, so its stride is
  // irrelevant (it may well be 0).
  struct Dim {
    std::string_view name;
    uint64_t count;
    uint64_t stride;
  };
  std::array<Dim, 3> dims{};
  size_t num_dims = 0;
  if (shape.tokens > 1) dims[num_dims++] = Dim{"token", shape.tokens, p.token_stride_bytes};
  if (shape.heads > 1) dims[num_dims++] = Dim{"head", shape.heads, p.head_stride_bytes};
  if (num_blocks > 1) dims[num_dims++] = Dim{"block", num_blocks, p.block_stride_bytes};
  // Three elements at most: compare-and-swap, not std::sort (whose inlined
  // code g++ 12 at -O2 misreads as out of bounds, -Warray-bounds).
  auto order = [&](size_t a, size_t b) {
    if (b < num_dims && dims[b].stride < dims[a].stride) std::swap(dims[a], dims[b]);
  };
  order(0, 1);
  order(1, 2);
  order(0, 1);
  // Bytes from the first row's start to the last row's end, over the
  // dimensions processed so far.
  uint64_t extent = shape.row_bytes;
  for (size_t i = 0; i < num_dims; ++i) {
    const Dim& d = dims[i];
    if (d.stride < extent) {
      return InvalidArgument(std::string(d.name) + "_stride_bytes " + std::to_string(d.stride) +
                             " is less than the " + std::to_string(extent) +
                             " bytes it has to step over; " +
                             (d.name == "block" ? "blocks" : "rows") + " would overlap");
    }
    uint64_t span = 0;
    if (__builtin_mul_overflow(d.count - 1, d.stride, &span) ||
        __builtin_add_overflow(extent, span, &extent)) {
      return InvalidArgument(std::string(d.name) + "_stride_bytes " + std::to_string(d.stride) +
                             " overflows the byte range of the blocks");
    }
  }
  // One block's piece: from its first row's start to its last row's end (no
  // overflow: a part of the sum checked above).
  const uint64_t piece_extent = shape.row_bytes +
                                (shape.tokens > 1 ? (shape.tokens - 1) * p.token_stride_bytes : 0) +
                                (shape.heads > 1 ? (shape.heads - 1) * p.head_stride_bytes : 0);

  uint64_t end = 0;
  if (!LastBlockEnd(p, num_blocks, piece_extent, &end)) {
    return InvalidArgument("byte range of block " + std::to_string(num_blocks - 1) +
                           " overflows (offset_bytes " + std::to_string(p.offset_bytes) +
                           ", block_stride_bytes " + std::to_string(p.block_stride_bytes) + ")");
  }
  const uint64_t region_size = region_sizes_bytes[p.region];
  if (end > region_size) {
    return InvalidArgument("block " + std::to_string(num_blocks - 1) + " ends at byte " +
                           std::to_string(end) + ", past the end of region " +
                           std::to_string(p.region) + " (" + std::to_string(region_size) +
                           " bytes)");
  }
  return Status::Ok();
}

}  // namespace

Result<KvCacheLayout> KvCacheLayout::Create(const Layout& layout, uint32_t num_blocks,
                                            std::vector<Placement> placements,
                                            std::vector<uint64_t> region_sizes_bytes) {
  if (num_blocks == 0) return Err(InvalidArgument("num_blocks must be > 0"));
  // Cannot overflow: Layout::Create bounds num_layers by kMaxBlockBytes.
  const uint64_t expected = uint64_t{layout.spec().num_layers} * PiecesPerLayer(layout);
  if (placements.size() != expected) {
    return Err(InvalidArgument("expected " + std::to_string(expected) + " placements (" +
                               std::to_string(layout.spec().num_layers) + " layers x " +
                               std::to_string(PiecesPerLayer(layout)) + " pieces), got " +
                               std::to_string(placements.size())));
  }
  // Overlap between different pieces (K of one layer over V of another) is
  // not checked: no engine lays its cache out that way, and checking it is
  // quadratic in the number of pieces. It would only corrupt the client's own
  // cache, never another tenant's memory, since every range is in its region.
  for (uint32_t piece = 0; piece < placements.size(); ++piece) {
    const Status status =
        ValidatePiece(ShapeOf(layout, piece), placements[piece], num_blocks, region_sizes_bytes);
    if (!status.ok()) return Err(status.WithContext(PieceName(layout, piece)));
  }

  KvCacheLayout result(layout);
  result.num_blocks_ = num_blocks;
  result.placements_ = std::move(placements);
  result.region_sizes_bytes_ = std::move(region_sizes_bytes);
  return result;
}

// Offsets below cannot overflow: Layout::Create bounded tensor_bytes (and
// num_layers * tensor_bytes) by kMaxBlockBytes = 2^30, and num_blocks < 2^32.

std::vector<Placement> KvCacheLayout::VllmNhd(const Layout& layout, uint32_t num_blocks) {
  const LayoutSpec& s = layout.spec();
  const uint64_t row_bytes = uint64_t{s.head_dim} * DTypeSizeBytes(s.dtype);
  const uint64_t block_stride = layout.tensor_bytes();
  return KvPlacements(layout, "vLLM", [&](uint32_t layer, uint32_t part) {
    // V is the second half of the [2, num_blocks, ...] tensor.
    return Placement{.region = layer,
                     .offset_bytes = part * uint64_t{num_blocks} * block_stride,
                     .block_stride_bytes = block_stride,
                     .token_stride_bytes = row_bytes * s.num_kv_heads,
                     .head_stride_bytes = row_bytes};
  });
}

std::vector<Placement> KvCacheLayout::VllmHnd(const Layout& layout, uint32_t num_blocks) {
  const LayoutSpec& s = layout.spec();
  const uint64_t row_bytes = uint64_t{s.head_dim} * DTypeSizeBytes(s.dtype);
  const uint64_t block_stride = layout.tensor_bytes();
  return KvPlacements(layout, "vLLM", [&](uint32_t layer, uint32_t part) {
    return Placement{.region = layer,
                     .offset_bytes = part * uint64_t{num_blocks} * block_stride,
                     .block_stride_bytes = block_stride,
                     .token_stride_bytes = row_bytes,
                     .head_stride_bytes = row_bytes * s.block_tokens};
  });
}

// Every tensor starts at its region's start, whatever the number of blocks.
std::vector<Placement> KvCacheLayout::SglangLayerFirst(const Layout& layout,
                                                       uint32_t /*num_blocks*/) {
  const LayoutSpec& s = layout.spec();
  const uint64_t row_bytes = uint64_t{s.head_dim} * DTypeSizeBytes(s.dtype);
  const uint32_t parts = s.kv_kind == KvKind::kSeparateKv ? 2 : 1;
  return KvPlacements(layout, "SGLang", [&](uint32_t layer, uint32_t part) {
    // Cannot overflow: num_layers <= 2^30 (each layer has at least a byte).
    return Placement{.region = layer * parts + part,
                     .offset_bytes = 0,
                     .block_stride_bytes = layout.tensor_bytes(),
                     .token_stride_bytes = row_bytes * s.num_kv_heads,
                     .head_stride_bytes = row_bytes};
  });
}

std::vector<Placement> KvCacheLayout::SglangPageFirst(const Layout& layout, uint32_t num_blocks) {
  const LayoutSpec& s = layout.spec();
  const uint64_t row_bytes = uint64_t{s.head_dim} * DTypeSizeBytes(s.dtype);
  const uint64_t layer_stride = row_bytes * s.num_kv_heads;
  const uint64_t token_stride = layer_stride * s.num_layers;
  const uint64_t block_stride = token_stride * s.block_tokens;
  return KvPlacements(layout, "SGLang", [&](uint32_t layer, uint32_t part) {
    // V is the second half of the [2, num_tokens, ...] tensor.
    return Placement{
        .region = 0,
        .offset_bytes = part * uint64_t{num_blocks} * block_stride + layer * layer_stride,
        .block_stride_bytes = block_stride,
        .token_stride_bytes = token_stride,
        .head_stride_bytes = row_bytes};
  });
}

std::vector<Placement> KvCacheLayout::Contiguous(const Layout& layout) {
  const LayoutSpec& s = layout.spec();
  const uint64_t row_bytes = uint64_t{s.head_dim} * DTypeSizeBytes(s.dtype);
  const uint64_t token_stride = row_bytes * s.num_kv_heads;
  const uint32_t tensors_per_layer = s.kv_kind == KvKind::kSeparateKv ? 2 : 1;
  std::vector<Placement> placements;
  placements.reserve(uint64_t{s.num_layers} * PiecesPerLayer(layout));
  // No overflow: every offset is below block_bytes <= kMaxBlockBytes.
  for (uint32_t layer = 0; layer < s.num_layers; ++layer) {
    uint64_t offset = uint64_t{layer} * layout.layer_bytes();
    for (uint32_t t = 0; t < tensors_per_layer; ++t) {
      placements.push_back(Placement{.region = 0,
                                     .offset_bytes = offset,
                                     .block_stride_bytes = layout.block_bytes(),
                                     .token_stride_bytes = token_stride,
                                     .head_stride_bytes = row_bytes});
      offset += layout.tensor_bytes();
    }
    if (s.scale_bytes_per_layer > 0) {
      placements.push_back(Placement{.region = 0,
                                     .offset_bytes = offset,
                                     .block_stride_bytes = layout.block_bytes(),
                                     .token_stride_bytes = 0,
                                     .head_stride_bytes = 0});
    }
  }
  return placements;
}

std::vector<uint64_t> KvCacheLayout::MinRegionSizes(const Layout& layout, uint32_t num_blocks,
                                                    const std::vector<Placement>& placements) {
  KVTIER_CHECK(num_blocks > 0);
  KVTIER_CHECK(placements.size() == uint64_t{layout.spec().num_layers} * PiecesPerLayer(layout));
  std::vector<uint64_t> sizes;
  for (uint32_t piece = 0; piece < placements.size(); ++piece) {
    const Placement& p = placements[piece];
    uint64_t extent = 0;
    uint64_t end = 0;
    KVTIER_CHECK_MSG(PieceExtent(ShapeOf(layout, piece), p, &extent) &&
                         LastBlockEnd(p, num_blocks, extent, &end),
                     PieceName(layout, piece) + ": byte range overflows");
    if (p.region >= sizes.size()) sizes.resize(uint64_t{p.region} + 1, 0);
    sizes[p.region] = std::max(sizes[p.region], end);
  }
  return sizes;
}

uint32_t KvCacheLayout::PiecesPerLayer(const Layout& layout) {
  const LayoutSpec& s = layout.spec();
  return (s.kv_kind == KvKind::kLatent ? 1 : 2) + (s.scale_bytes_per_layer > 0 ? 1 : 0);
}

uint64_t KvCacheLayout::RowBytes(uint32_t piece) const {
  KVTIER_CHECK(piece < placements_.size());
  return ShapeOf(layout_, piece).row_bytes;
}

uint64_t KvCacheLayout::RowsPerPiece(uint32_t piece) const {
  KVTIER_CHECK(piece < placements_.size());
  const PieceShape shape = ShapeOf(layout_, piece);
  return shape.tokens * shape.heads;
}

bool KvCacheLayout::PieceIsContiguous(uint32_t piece) const {
  KVTIER_CHECK(piece < placements_.size());
  const PieceShape shape = ShapeOf(layout_, piece);
  const Placement& p = placements_[piece];
  // A scale piece has one token and one head, so it is always contiguous.
  return (shape.heads == 1 || p.head_stride_bytes == shape.row_bytes) &&
         (shape.tokens == 1 || p.token_stride_bytes == shape.heads * shape.row_bytes);
}

}  // namespace kvtier
