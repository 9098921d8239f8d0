// KvCacheLayout: where the blocks of one engine's paged KV cache live in the
// memory the engine registered, described by strides so that vLLM's NHD and
// HND per-layer tensors, SGLang's layer-first and page-first pools and fully
// contiguous caches are all the same thing.
//
// kvtier stores a block in its own slots in canonical order (common/layout.h):
// for each layer, K then V (or the single latent), each
// [block_tokens][num_kv_heads][head_dim], then the layer's scale bytes. A
// Placement says where one such (layer, part) piece of engine block b lives:
//
//   row (token t, head h) of engine block b starts at
//     regions[region] + offset_bytes + b * block_stride_bytes
//                     + t * token_stride_bytes + h * head_stride_bytes
//   and is head_dim * dtype_size contiguous bytes.
//
// A scale piece (fp8 layouts with scale_bytes_per_layer > 0) is one row of
// scale_bytes_per_layer bytes at offset_bytes + b * block_stride_bytes; its
// token and head strides are ignored.
//
// Pieces are listed layer by layer: K, V (absent for latent), scale (only when
// scale_bytes_per_layer > 0). So there are num_layers * PiecesPerLayer().
//
// Value type, validated by Create; thread-compatible.
#pragma once

#include <cstdint>
#include <vector>

#include "common/layout.h"
#include "common/status.h"

namespace kvtier {

struct Placement {
  uint32_t region = 0;
  uint64_t offset_bytes = 0;
  uint64_t block_stride_bytes = 0;
  uint64_t token_stride_bytes = 0;
  uint64_t head_stride_bytes = 0;
};

class KvCacheLayout {
 public:
  // Validates the placements against the layout and the sizes of the
  // registered regions. Errors (kInvalidArgument, naming the piece index):
  // wrong number of placements, a region index out of range, zero num_blocks,
  // a byte range of any block that overflows or ends beyond its region, rows
  // of one piece that overlap each other (a token or head stride smaller than
  // the row, when there is more than one token or head).
  static Result<KvCacheLayout> Create(const Layout& layout, uint32_t num_blocks,
                                      std::vector<Placement> placements,
                                      std::vector<uint64_t> region_sizes_bytes);

  // The placements of the engine layouts below are what Create expects for
  // that engine's tensors; pass them with the tensors' byte sizes (or
  // MinRegionSizes) as region_sizes_bytes. None of these engines keeps fp8
  // scales next to its KV tensors, so each REQUIRES: scale_bytes_per_layer ==
  // 0 (a KVTIER_CHECK: asking for one is a bug in the caller). They cannot
  // fail otherwise: Layout::Create bounded the block size, so no offset
  // overflows for any num_blocks < 2^32. E is the dtype's size in bytes.

  // vLLM's default per-layer tensors [2, num_blocks, block_tokens, heads,
  // head_dim] (NHD); for kLatent [num_blocks, block_tokens, head_dim].
  // num_layers regions, layer i in region i, each num_blocks *
  // layout.tensor_bytes() bytes (times 2 for K and V).
  static std::vector<Placement> VllmNhd(const Layout& layout, uint32_t num_blocks);
  // vLLM's HND per-layer tensors [2, num_blocks, heads, block_tokens,
  // head_dim], chosen by backends that want a head's tokens adjacent; for
  // kLatent (one head) the same bytes as VllmNhd. Regions as VllmNhd. Rows of
  // one block are strided when there is more than one head and token.
  static std::vector<Placement> VllmHnd(const Layout& layout, uint32_t num_blocks);
  // SGLang's device pool: a K and a V tensor per layer, each
  // [num_blocks * block_tokens, heads, head_dim], token-major, engine block b
  // being page b (tokens b * block_tokens ...). 2 * num_layers regions: K of
  // layer i is region 2i, V region 2i+1; kLatent: num_layers regions of
  // [num_tokens, 1, head_dim], layer i in region i. Each region is num_blocks
  // * layout.tensor_bytes() bytes. SGLang's reserved padding page is simply
  // one of the num_blocks pages.
  static std::vector<Placement> SglangLayerFirst(const Layout& layout, uint32_t num_blocks);
  // SGLang HiCache's host pool in its "page_first" layout: one region
  // [2, num_blocks * block_tokens, num_layers, heads, head_dim] (kLatent:
  // [num_tokens, num_layers, 1, head_dim]) of num_blocks * (2 or 1) *
  // num_layers * layout.tensor_bytes() bytes. A token's layers are adjacent,
  // so every piece is strided when there is more than one layer and token.
  static std::vector<Placement> SglangPageFirst(const Layout& layout, uint32_t num_blocks);
  // One contiguous region holding num_blocks blocks back to back, each in
  // canonical order (what the shared-memory helper for CPU engines allocates):
  // num_blocks * layout.block_bytes() bytes. Any scale_bytes_per_layer.
  static std::vector<Placement> Contiguous(const Layout& layout);

  // The smallest region sizes that hold every byte `placements` address for
  // blocks 0 .. num_blocks - 1: for region r (0 .. the largest index used),
  // the largest end (offset + (num_blocks - 1) * block stride + the extent of
  // one block's piece) of a piece in r, or 0 for an index no piece uses. A
  // stride is ignored where Create ignores it (a dimension of one element).
  // Does not check for overlap; Create does.
  // REQUIRES (KVTIER_CHECK): num_blocks > 0, placements.size() == num_layers
  // * PiecesPerLayer(layout), and no end overflows uint64_t (only hand-made
  // placements can, never the engine helpers above).
  static std::vector<uint64_t> MinRegionSizes(const Layout& layout, uint32_t num_blocks,
                                              const std::vector<Placement>& placements);

  static uint32_t PiecesPerLayer(const Layout& layout);

  const Layout& layout() const { return layout_; }
  uint32_t num_blocks() const { return num_blocks_; }
  const std::vector<Placement>& placements() const { return placements_; }
  const std::vector<uint64_t>& region_sizes_bytes() const { return region_sizes_bytes_; }

  // Byte size of one row of piece `piece` (head_dim * dtype size, or the
  // scale bytes), and the number of rows (block_tokens * heads, or 1).
  uint64_t RowBytes(uint32_t piece) const;
  uint64_t RowsPerPiece(uint32_t piece) const;
  // True when every row of the piece is back to back in canonical order, so
  // the piece of one block is a single contiguous range of PieceBytes().
  bool PieceIsContiguous(uint32_t piece) const;
  uint64_t PieceBytes(uint32_t piece) const { return RowBytes(piece) * RowsPerPiece(piece); }

 private:
  KvCacheLayout(Layout layout) : layout_(std::move(layout)) {}

  Layout layout_;
  uint32_t num_blocks_ = 0;
  std::vector<Placement> placements_;
  std::vector<uint64_t> region_sizes_bytes_;
};

}  // namespace kvtier
